"""Byte budgets: pick a codec's free parameter so that one client's message fits its budget.

Budget in, concrete codec out, per client per round. The budget counts the whole message:
the payload plus a fixed ``overhead`` the caller passes in (record framing, its own header).
The result is the codec whose message is at most the budget and, when the budget lies inside
the codec's range, at least 98% of it (:data:`FILL`).

Which parameters move: those a stage class declares in ``budget_knobs`` (:class:`fedcomp.base.Knob`);
every other argument stays as written. The first stage's knobs move; a quantizer's after a
reducer only when the reducer has no fine knob. Declared today::

    topk, randomk, threshold, dgc   ratio ("fraction": k = 1..n kept elements, one element per step)
    sketch                          cols ("count": 1.., rows cells per step)
    kbit, qsgd                      bits ("levels", coarse), then block / bucket ("block") down to BLOCK_MIN
    powersgd                        rank ("levels"); with a kbit/qsgd quantizer also its bits, from
                                    the written bits up to 8 (coarse), then its block (fine)

A new codec joins by declaring its knobs (and ``budget_args``, arguments forced when budgeted);
nothing here names a codec.

Search: coarse settings are tried in order of preference (highest rank, then highest bits);
for each, a bisection on the fine parameter finds the largest message that fits. The first
setting that fills at least 98% of the budget wins; when none does, the largest message that
fits wins (the budget is above the codec's range: ``Fit.saturated``). When even the smallest
message is too big, :class:`BudgetTooSmall` says by how much.

Sizes: data-independent sizes come from ``Codec.size_bytes`` (pure arithmetic). Rice-coded
indices (``index='rice'``, topk's default) and the kept counts of ``threshold`` and ``dgc``
depend on the data: for those the caller passes ``measure`` (codec -> payload bytes, usually a
real encode of the update, see :func:`fit_update`), and the search runs on the real encoder
(interpolation alternating with bisection, about 6-10 encodes).
Only sizes that were computed exactly are ever returned, so a fit never exceeds its budget.

Notes: a budgeted ``threshold`` is adaptive (``ratio`` > 0; a static ``tau`` has no byte
control), and budgeted ``threshold`` and ``dgc`` select exactly (``sample=1``: exact top-k of k
elements): the sampled threshold accepts 0.8k..1.3k elements, and measured on the mlp its
counts move in steps of up to 22% as k grows (one step per sampled order statistic), too
coarse to fill 98% of a budget. A budgeted ``dgc`` in its warm-up rounds keeps the warm-up's larger fraction (the
measured size includes it), so early rounds may not fit: use ``warmup=0`` with budgets.
Different clients get different parameters, so a server must decode each client with the spec
it reports (sketches with different ``cols`` cannot be summed in sketch space).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from fedcomp.base import REGISTRY
from fedcomp.base import Stage as BaseStage
from fedcomp.codec import Codec, Encoded
from fedcomp.errors import FedcompError, SpecError
from fedcomp.feedback import compress
from fedcomp.layout import Layout
from fedcomp.policy import is_policy
from fedcomp.spec import Stage, parse_spec

FILL = 0.98  # a fit inside the codec's range fills at least this fraction of the budget
BLOCK_MIN = 32  # smallest kbit block / qsgd bucket the controller uses (their Knob's lo; 2 resp. 1 extra bit per value)


class BudgetTooSmall(FedcompError):
    """Even the coarsest setting of the codec does not fit the budget.

    Attributes: ``spec`` (the codec as configured), ``budget`` and ``minimum`` (whole-message
    bytes of the coarsest setting), ``coarsest`` (that setting's spec).
    """

    def __init__(self, spec: str, budget: int, minimum: int, coarsest: str) -> None:
        self.spec, self.budget, self.minimum, self.coarsest = spec, budget, minimum, coarsest
        super().__init__(
            f"byte budget {budget} B is below the smallest message of {spec!r}: {coarsest} needs "
            f"{minimum} B (message overhead included); raise the budget (a longer deadline, a larger "
            f"byte cap) or choose a smaller codec"
        )


@dataclass(frozen=True)
class Fit:
    """The controller's answer for one client and round."""

    spec: str  # canonical spec of the chosen codec (what the client sends and the server decodes with)
    codec: Codec
    message_bytes: int  # payload + overhead, exact (<= budget)
    budget: int  # the whole-message budget asked for
    overhead: int  # bytes of the message outside the payload
    saturated: bool  # the budget is above the codec's range: the largest setting is used
    measured: bool  # the size came from a real encode (data-dependent size)
    encoded: Encoded | None = None  # that encode, when fit_update measured it (reuse it, do not re-encode)
    residual: dict[str, torch.Tensor] | None = None  # fit_update: the new error-feedback residual
    state: dict[str, torch.Tensor] | None = None  # fit_update: the codec state after that encode

    @property
    def payload_bytes(self) -> int:
        return self.message_bytes - self.overhead

    @property
    def fill(self) -> float:
        return self.message_bytes / self.budget if self.budget else 0.0


# -- spec editing --------------------------------------------------------------------------------
def _fmt(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    return repr(value)


def _spec(stages: list[Stage], overrides: dict[int, dict]) -> str:
    parts = []
    for i, st in enumerate(stages):
        args = dict(st.args)
        args.update(overrides.get(i, {}))
        parts.append(f"{st.name}(" + ",".join(f"{k}={_fmt(v)}" for k, v in args.items()) + ")")
    return "+".join(parts)


@dataclass(frozen=True)
class _Plan:
    """The search space of one spec: coarse settings in preference order, and one fine parameter."""

    coarse: list[list[dict[int, dict]]]  # groups of overrides per stage index, most preferred first;
    # within a group the last is the smallest (when it does not fit, the whole group is skipped)
    fine_stage: int | None  # stage whose parameter the bisection moves (None: no fine parameter)
    fine_key: str | None
    lo: int  # fine index range; the size is non-decreasing in the index
    hi: int
    value: Callable[[int], object]  # fine index -> parameter value


def _built(stages: list[Stage]) -> list[BaseStage]:
    """The registered stage objects of a parsed spec (unknown names and bad values: SpecError)."""
    out = []
    for st in stages:
        cls = REGISTRY.get(st.name)
        if cls is None:
            raise SpecError(f"unknown codec {st.name!r}; available: {', '.join(sorted(REGISTRY))}")
        out.append(cls.from_args(dict(st.args)))
    return out


def _plan(stages: list[Stage], layout: Layout) -> _Plan:
    """The search space of a spec, from the knobs its stage classes declare (``budget_knobs``).

    The first stage's knobs move; the second stage's (a quantizer after a reducer) only when the
    first has no fine knob. "levels" knobs are the coarse settings (the first one's values form
    the groups, the rest vary inside a group), the first fine knob is bisected.
    """
    built = _built(stages)
    floats = [t for t in layout.tensors if t.is_float]
    if not floats or sum(t.numel for t in floats) == 0:
        raise SpecError("the layout has no float tensors: there is nothing to budget")
    knobs = [(0, k) for k in built[0].budget_knobs]
    if len(built) > 1 and not any(k.fine for _, k in knobs):
        knobs += [(1, k) for k in built[1].budget_knobs]
    if not knobs:
        movable = sorted(name for name, cls in REGISTRY.items() if cls.budget_knobs)
        raise SpecError(
            f"codec {'+'.join(s.name for s in stages)!r} has no parameter a byte budget can set; budgets work "
            f"with codecs that declare budget_knobs: {', '.join(movable)} (a quantizer after a reducer "
            f"moves only where the reducer has no fine knob, e.g. powersgd+kbit)"
        )
    levels = []  # (stage index, param, values highest first)
    for i, k in knobs:
        if k.fine:
            continue
        lo = k.lo if i == 0 else max(k.lo, int(getattr(built[i].config, k.param)))  # after a reducer: a floor
        levels.append((i, k.param, range(built[i].knob_limit(k, floats), lo - 1, -1)))
    groups: list[list[dict[int, dict]]] = [[{}]]
    if levels:
        (i0, p0, outer), inner = levels[0], levels[1:]
        groups = []
        for v in outer:
            group = [{i0: {p0: v}}]
            for i, param, values in inner:
                group = [{**g, i: {**g.get(i, {}), param: w}} for g in group for w in values]
            groups.append(group)
    fine = next(((i, k) for i, k in knobs if k.fine), None)
    if fine is None:
        return _Plan(groups, None, None, 0, 0, lambda i: None)
    i, k = fine
    stage = built[i]
    if k.scale == "fraction":  # elements of the selector's largest segment
        n = stage.max_values(floats) if stage.kind == "reducer" else max(t.numel for t in floats)
        return _Plan(groups, i, k.param, 1, n, lambda j, n=n: j / n)
    if k.scale == "count":
        return _Plan(groups, i, k.param, k.lo, stage.knob_limit(k, floats), lambda j: j)
    # "block": one block per segment (index 0, the coarsest) down to k.lo elements per block
    largest = built[0].max_values(floats) if i > 0 else max(t.numel for t in floats)
    if largest <= k.lo:  # one block already is as fine as the controller goes
        return _Plan(groups, None, None, 0, 0, lambda j: None)
    return _Plan(groups, i, k.param, 0, largest - k.lo, lambda j, top=largest: top - j)


def _stages(spec: str) -> list[Stage]:
    """The spec's stages as budgeted: each stage's ``budget_args`` applied (e.g. exact selection)."""
    stages = parse_spec(spec)
    for i, st in enumerate(stages):
        forced = getattr(REGISTRY.get(st.name), "budget_args", {})
        if forced:
            stages[i] = Stage(st.name, tuple({**dict(st.args), **forced}.items()))
    return stages


# -- search --------------------------------------------------------------------------------------
def fit_budget(
    spec: str,
    layout: Layout,
    budget: int,
    *,
    overhead: int = 0,
    measure: Callable[[Codec], int] | None = None,
) -> Fit:
    """The codec (from ``spec``, free parameter chosen) whose message best fills ``budget`` bytes.

    Parameters
    ----------
    spec : str
        A plain codec spec (not a policy); the free parameter's written value is ignored.
    layout : Layout
        The model the message carries.
    budget : int
        Bytes allowed for the whole message: payload + ``overhead``.
    overhead : int
        Bytes of the message outside the fedcomp payload (default: 0).
    measure : callable, optional
        Codec -> payload bytes by a real encode; needed where the size depends on the data
        (Rice-coded indices, threshold and dgc counts). :func:`fit_update` builds one.

    Raises
    ------
    BudgetTooSmall
        When the coarsest setting's message exceeds the budget.
    SpecError
        For a spec without a budgetable parameter, or a data-dependent one without ``measure``.
    """
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise SpecError(f"byte budget must be a positive integer, got {budget!r}")
    if overhead < 0:
        raise SpecError(f"message overhead must be >= 0 bytes, got {overhead!r}")
    stages = _stages(spec)
    plan = _plan(stages, layout)
    cache: dict[str, tuple[Codec, int, bool]] = {}

    def size(overrides: dict[int, dict]) -> tuple[Codec, int, bool]:
        text = _spec(stages, overrides)
        if text not in cache:
            codec = Codec(text)
            try:
                cache[text] = (codec, codec.size_bytes(layout) + overhead, False)
            except ValueError:
                if measure is None:
                    raise SpecError(
                        f"the size of {codec.spec} depends on the data: pass measure= (see fit_update), "
                        f"or use index='fixed'"
                    ) from None
                cache[text] = (codec, int(measure(codec)) + overhead, True)
        return cache[text]

    def at(coarse: dict[int, dict], i: int) -> dict[int, dict]:
        if plan.fine_stage is None:
            return coarse
        merged = {k: dict(v) for k, v in coarse.items()}
        merged.setdefault(plan.fine_stage, {})[plan.fine_key] = plan.value(i)
        return merged

    best: tuple[Codec, int, bool] | None = None
    smallest: tuple[Codec, int, bool] | None = None
    for group in plan.coarse:
        least = size(at(group[-1], plan.lo))
        if smallest is None or least[1] < smallest[1]:
            smallest = least
        if least[1] > budget:
            continue
        for coarse in group:
            low = size(at(coarse, plan.lo))
            if low[1] > budget:
                continue
            found = _fill(lambda i, c=coarse: size(at(c, i)), plan.lo, plan.hi, budget, low) if plan.fine_stage is not None else low
            if best is None or found[1] > best[1]:
                best = found
            if found[1] >= FILL * budget:
                break
        if best is not None and best[1] >= FILL * budget:
            break
    if best is None:
        assert smallest is not None
        raise BudgetTooSmall(spec, budget, smallest[1], smallest[0].spec)
    codec, total, measured = best
    return Fit(codec.spec, codec, total, budget, overhead, total < FILL * budget, measured)


def _fill(size: Callable[[int], tuple[Codec, int, bool]], lo: int, hi: int, budget: int, low):
    """The largest size <= budget over fine indices lo..hi (sizes non-decreasing in the index).

    The bracket keeps an index that fits (``good``) and one that does not (``bad``). Computed
    sizes are cheap: plain bisection to a bracket of one step (the best fill there is). Measured
    sizes cost an encode each: steps alternate between linear interpolation aimed at 99% of the
    budget and bisection (so never more than twice bisection's count), and stop once the fill
    reaches 99%.
    """
    aim = (1 + FILL) / 2 * budget
    measured, step = low[2], 0
    good, s_good, best = lo, low[1], low
    if measured:
        # bracket by extrapolating upward (the largest setting is the costliest encode of all)
        i = min(hi, lo + max(1, (hi - lo) // 4096))
        while True:
            s = size(i)
            if s[1] > budget:
                bad, s_bad = i, s[1]
                break
            if s[1] > best[1]:
                best = s
            if i == hi or best[1] >= aim:
                return best
            slope = (s[1] - s_good) / (i - good) if s[1] > s_good else 0.0
            good, s_good = i, s[1]
            nxt = good + int((aim - s_good) / slope) + 1 if slope > 0 else 2 * good
            i = min(hi, max(good + 1, nxt, good + (good - lo) // 8))
    else:
        top = size(hi)
        if top[1] <= budget:
            return top
        bad, s_bad = hi, top[1]
    while bad - good > 1:
        if measured and step % 2 == 0 and s_bad > s_good:
            mid = good + int((aim - s_good) * (bad - good) / (s_bad - s_good))
            mid = min(max(mid, good + 1), bad - 1)
        else:
            mid = (good + bad) // 2
        step += 1
        s = size(mid)
        if s[1] <= budget:
            good, s_good = mid, s[1]
            if s[1] > best[1]:
                best = s
            if measured and best[1] >= aim:
                break
        else:
            bad, s_bad = mid, s[1]
    return best


def fit_update(
    spec: str,
    update: Mapping[str, torch.Tensor],
    budget: int,
    residual: Mapping[str, torch.Tensor] | None = None,
    *,
    overhead: int = 0,
    nonce: int = 0,
    round: int = 0,
    state: dict[str, torch.Tensor] | None = None,
    error_feedback: bool = True,
) -> Fit:
    """:func:`fit_budget` for one client's update, measuring data-dependent sizes by real encodes.

    Each measurement runs :func:`fedcomp.compress` (error feedback and codec hooks included) on
    a copy of ``state``, so the measured payload is exactly the one the client sends. The
    returned ``Fit`` carries that encode (``encoded``, ``residual``, ``state``: use them instead
    of encoding again); for data-independent sizes it encodes once after the search. ``state``
    itself is never modified.
    """
    layout = Layout.of(update)
    runs: dict[str, tuple[Encoded, dict, dict | None]] = {}

    def run(codec: Codec) -> tuple[Encoded, dict, dict | None]:
        if codec.spec not in runs:
            st = copy.deepcopy(state) if state is not None else None
            enc, res = compress(codec, update, residual, nonce=nonce, error_feedback=error_feedback, round=round, state=st)
            runs.clear()  # keep one encode alive: the latest (the chosen one is re-run at most once)
            runs[codec.spec] = (enc, res, st)
        return runs[codec.spec]

    fit = fit_budget(spec, layout, budget, overhead=overhead, measure=lambda c: len(run(c)[0].payload))
    enc, res, st = run(fit.codec)
    total = len(enc.payload) + overhead
    if total != fit.message_bytes:  # an encode is deterministic given (update, nonce, round, state)
        raise FedcompError(f"{fit.spec}: encoded {total} B where the search measured {fit.message_bytes} B")
    return Fit(fit.spec, fit.codec, total, budget, overhead, fit.saturated, fit.measured, enc, res, st)


def limits(spec: str, layout: Layout, *, overhead: int = 0, measure: Callable[[Codec], int] | None = None) -> tuple[int, int]:
    """(smallest, largest) whole-message bytes the controller can reach for ``spec`` on ``layout``."""
    stages = _stages(spec)
    plan = _plan(stages, layout)
    sizes = []
    for coarse in (c for group in plan.coarse for c in group):
        for i in ((plan.lo, plan.hi) if plan.fine_stage is not None else (None,)):
            over = coarse if i is None else {**{k: dict(v) for k, v in coarse.items()},
                                             plan.fine_stage: {**coarse.get(plan.fine_stage, {}), plan.fine_key: plan.value(i)}}
            codec = Codec(_spec(stages, over))
            try:
                sizes.append(codec.size_bytes(layout) + overhead)
            except ValueError:
                if measure is None:
                    raise SpecError(f"the size of {codec.spec} depends on the data: pass measure=") from None
                sizes.append(int(measure(codec)) + overhead)
    return min(sizes), max(sizes)


FALLBACKS = ("skip", "coarsest")  # what a client does when even the coarsest setting is over budget


def check_budgetable(spec: str) -> None:
    """Raise SpecError unless a byte budget can set a free parameter of ``spec`` (a plain codec
    spec whose stage declares ``budget_knobs``; not a policy)."""
    if is_policy(spec):
        raise SpecError(f"upload {spec!r} is a policy; byte budgets need a plain codec spec such as "
                        f"'topk(ratio=0.01,index=\'fixed\')+qsgd(bits=4)'")
    _plan(_stages(spec), Layout.of({"w": torch.zeros(8, 8)}))


def same_family(configured: str, reported: str) -> bool:
    """True when ``reported`` has the stages of ``configured`` (names in order): what a server
    accepts from a budgeted client, which may differ in the free parameters only."""
    return [s.name for s in parse_spec(configured)] == [s.name for s in parse_spec(reported)]


__all__ = ["BLOCK_MIN", "FALLBACKS", "FILL", "BudgetTooSmall", "Fit", "check_budgetable", "fit_budget", "fit_update",
           "limits", "same_family"]
