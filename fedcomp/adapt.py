"""Closed-loop compression: a per-client byte budget driven by the training signal, and link
estimates measured from transfers instead of declared.

Both produce *byte budgets*, the input of :func:`fedcomp.budget.fit_budget`/``fit_update``, which
move the codec's free parameter (top-k ratio, bits, rank, sketch columns: the stage's declared
``budget_knobs``) to fit; so every budgetable codec works, and nothing here names a codec.

Written in a spec as ``topk(ratio=auto)+qsgd(bits=4)`` (:class:`AutoStrength`): the server turns
each round's budget into a concrete spec (``topk(ratio=0.0011,...)+qsgd(bits=4,...)``), which the
clients receive as their upload spec (:mod:`fedcomp.strategies.adaptive` for Flower,
:mod:`fedcomp.simulations.sweep` in-process). Bounds and start are the same rule for every task
(:class:`AdaptSettings`): the highest budget is the dense payload / 30; the lowest, where the first
round starts, the dense payload / 5000, raised after the first round to 0.6x the bytes the upload
message carries besides its payload (framing, the app's metrics, statistics sent exact), as seen
in the replies (:meth:`AutoStrength.observe_message`).

Why that floor: with error feedback a stronger compression delays information rather than losing
it, but a halving of the payload ``p`` saves only ``p / 2 / (p + F)`` of a message with fixed bytes
``F``; below ``p = 0.6 F`` that share shrinks while training slows as much as anywhere. Between the
floor and a stall the controller holds, so ``auto`` costs about what the fixed ratio at its floor
costs plus its trials (see the docs' How-to: closed loop, which has the figures).

Accuracy-driven (:class:`StrengthController`): the signal is the server-side evaluation after
each round (accuracy, or minus the loss). It is averaged over windows of `window` rounds (a
single round's test accuracy is too noisy to act on); at the end of each window, with ``gain`` =
this window's mean minus the previous window's::

    gain > tolerance        on track: budget *= tighten (not within `cooldown` windows of a relax)
    0 < gain <= tolerance   slow progress: hold
    gain < -tolerance       degrading: budget *= relax
    otherwise               stalled (no gain): budget *= relax -- a probe: does less compression help?
      the window after a probe, still no gain: revert to the budget before the probe, and wait
      twice as many stalled windows before the next probe (1, 2, 4, ...; reset by progress)
    budget clamped to [lowest, highest]

So compression tightens while training progresses, and is bought back only when progress stops;
a plateau that less compression does not lift (training has converged) costs one probe window
at exponentially growing intervals. The budget changes at most once per window, and tightening
waits after every relax (hysteresis), so noise makes the budget hold rather than oscillate.

Measured links (:class:`LinkEstimator`): per node and direction, the last `window` transfers
(bytes, seconds) are fitted to ``seconds = latency + bytes * 8 / (kbps * 1000)``: the latency by
least squares whenever their sizes differ enough to tell it from bandwidth (kept until the next
such fit), the bandwidth from the kept transfers' total bytes over their total time after
latency. :class:`MeasuredBudgets` turns the estimates into upload byte budgets (:meth:`MeasuredBudgets.budget`)
or into the link a client budgets from itself (:meth:`MeasuredBudgets.link`, what
:mod:`fedcomp.strategies.measured` sends each node in Flower).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from fedcomp.errors import FedcompError


class AdaptError(FedcompError, ValueError):
    """An adaptive-compression setting or observation is invalid."""


def _positive(name: str, value: float, *, below_one: bool = False, above_one: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise AdaptError(f"{name}={value!r} is invalid: {name} must be a finite number > 0")
    if below_one and not value < 1:
        raise AdaptError(f"{name}={value!r} is invalid: {name} must be in (0, 1)")
    if above_one and not value > 1:
        raise AdaptError(f"{name}={value!r} is invalid: {name} must be > 1")
    return float(value)


@dataclass
class StrengthController:
    """A per-client upload byte budget moved by the training signal (see the module docstring)."""

    lowest: int  # smallest budget, bytes (the strongest compression allowed)
    highest: int  # largest budget, bytes (the weakest compression allowed)
    start: int  # first round's budget, bytes
    tighten: float = 0.7  # budget factor when a window made progress (< 1)
    relax: float = 1.6  # budget factor when a window stalled or dropped (> 1)
    tolerance: float = 0.005  # change of the window mean that counts (accuracy: half a point)
    window: int = 5  # rounds per decision; the signal is averaged over a window (test-set noise)
    cooldown: int = 1  # windows after a relax in which the budget is not tightened
    revert: bool = True  # undo a stall relax that bought nothing (False: keep it; probes still back off)
    budget: float = field(init=False)
    history: list[dict] = field(init=False, default_factory=list)  # per round: signal, decision, budget
    _signals: list[float] = field(init=False, default_factory=list)  # this window's
    _last_mean: float | None = field(init=False, default=None)  # the previous window's mean
    _probe_from: float | None = field(init=False, default=None)  # budget before a stall relax (to revert to)
    _backoff: int = field(init=False, default=1)  # stalled windows before the next stall relax
    _waited: int = field(init=False, default=0)
    _quiet: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        for name in ("lowest", "highest", "start"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AdaptError(f"{name}={v!r} is invalid: {name} must be a positive integer (bytes)")
        if not self.lowest <= self.start <= self.highest:
            raise AdaptError(f"start={self.start} is invalid: it must lie in [lowest={self.lowest}, highest={self.highest}]")
        _positive("tighten", self.tighten, below_one=True)
        _positive("relax", self.relax, above_one=True)
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) or not 0 <= self.tolerance < math.inf:
            raise AdaptError(f"tolerance={self.tolerance!r} is invalid: tolerance must be a finite number >= 0")
        for name, least in (("window", 1), ("cooldown", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise AdaptError(f"{name}={v!r} is invalid: {name} must be an integer >= {least}")
        self.budget = float(self.start)

    def current(self) -> int:
        """The budget for the next round, bytes."""
        return int(self.budget)

    def update(self, round: int, signal: float) -> int:
        """Take round ``round``'s signal (higher is better) and return the next round's budget."""
        if isinstance(signal, bool) or not isinstance(signal, (int, float)) or not math.isfinite(signal):
            raise AdaptError(f"signal={signal!r} for round {round} is invalid: it must be a finite number")
        self._signals.append(float(signal))
        decision = "hold"
        if len(self._signals) >= self.window:
            decision = self._decide(sum(self._signals) / len(self._signals))
            self._signals.clear()
        self.history.append({"round": round, "signal": float(signal), "decision": decision, "budget": self.current()})
        return self.current()

    def _decide(self, mean: float) -> str:
        last, self._last_mean = self._last_mean, mean
        if last is None:
            return "hold"  # the first window is the reference
        gain = mean - last
        probing, self._probe_from = self._probe_from, None
        quiet, self._quiet = self._quiet, max(0, self._quiet - 1)
        if gain > self.tolerance:  # on track
            if quiet:
                return "hold"
            self._backoff, self._waited = 1, 0
            return self._move("tighten", max(float(self.lowest), self.budget * self.tighten))
        if probing is not None and gain >= -self.tolerance:
            # a relax on a stall that bought nothing: back to the budget before it, probe half as often
            self._backoff, self._waited = 2 * self._backoff, 0
            return self._move("revert", probing) if self.revert else "hold"
        if gain > 0:
            return "hold"  # slow progress: training still moves at this strength, a probe would only cost bytes
        self._waited += 1
        if gain >= -self.tolerance and self._waited < self._backoff:
            return "hold"  # stalled, but the last probe on a stall did not help: wait longer
        self._waited = 0
        before = self.budget
        decision = self._move("relax", min(float(self.highest), self.budget * self.relax))
        if decision == "relax":
            self._quiet = self.cooldown
            if gain >= -self.tolerance:
                self._probe_from = before
        return decision

    def _move(self, decision: str, budget: float) -> str:
        if int(budget) == self.current():
            return "hold"  # at a bound
        self.budget = budget
        return decision


def rising_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """(intercept >= 0, slope) of the least-squares line of ``ys`` on ``xs``; None unless the slope
    is positive (the time of a transfer or an encode on its bytes)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if slope <= 0:
        return None
    return max(0.0, my - slope * mx), slope


@dataclass
class LinkEstimator:
    """Per node and direction ('up' or 'down'): kbps and latency fitted to observed transfers.

    A transfer may also come with ``wire_s``: the seconds its bytes took on the link itself (a
    SuperNode's interface counters, :mod:`fedcomp.clients.supernode`), which leave out what the
    ends do before the first byte and after the last. Where the kept transfers have it, the
    bandwidth is their bytes over their wire seconds, and the latency (everything of a transfer
    besides its bytes at that rate) is the kept transfers' mean remainder: no fit of sizes needed."""

    window: int = 16  # transfers kept per node and direction (longer: less noise, slower to follow a change)
    spread: float = 1.5  # largest/smallest size ratio above which latency is fitted, not assumed
    _seen: dict[tuple[int, str], deque] = field(init=False, default_factory=dict)
    _latency: dict[tuple[int, str], float] = field(init=False, default_factory=dict)  # the last fitted latency

    def observe(self, node: int, direction: str, nbytes: int, seconds: float, wire_s: float | None = None) -> None:
        """Record one transfer of ``nbytes`` that took ``seconds`` (its bytes ``wire_s`` of them on the
        link, where that was timed)."""
        if direction not in ("up", "down"):
            raise AdaptError(f"direction={direction!r} is invalid: it must be 'up' or 'down'")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise AdaptError(f"nbytes={nbytes!r} is invalid: it must be a positive integer")
        _positive("seconds", seconds)
        if wire_s is not None:
            _positive("wire_s", wire_s)
        key = (int(node), direction)
        self._seen.setdefault(key, deque(maxlen=self.window)).append(
            (nbytes, float(seconds), None if wire_s is None else float(wire_s)))
        fitted = self._fit(self._seen[key])
        if fitted is not None:
            self._latency[key] = fitted

    def fitted(self, node: int, direction: str) -> bool:
        """Whether the latency is known, not assumed 0: fitted to sizes that differ, or any kept transfer
        was timed on the wire."""
        key = (int(node), direction)
        return key in self._latency or any(w is not None for _, _, w in self._seen.get(key, ()))

    def _fit(self, seen) -> float | None:
        """Least-squares latency (intercept) of seconds on bytes, when the sizes differ enough."""
        sizes = [b for b, _, _ in seen]
        if len(seen) < 3 or max(sizes) < self.spread * min(sizes):
            return None
        line = rising_line(sizes, [s for _, s, _ in seen])
        return None if line is None else line[0]

    def uncertainty(self, node: int, direction: str) -> float | None:
        """Relative standard error of a time predicted from the estimate: the standard deviation of
        the kept transfers' relative residuals over sqrt(their count) (None below 3 transfers)."""
        key = (int(node), direction)
        seen = self._seen.get(key)
        est = self.estimate(node, direction)
        if est is None or len(seen) < 3:
            return None
        kbps, latency = est
        rel = [s / (latency + b * 8 / (kbps * 1000)) - 1 for b, s, _ in seen]
        mean = sum(rel) / len(rel)
        sd = math.sqrt(sum((r - mean) ** 2 for r in rel) / (len(rel) - 1))
        return sd / math.sqrt(len(rel))

    def estimate(self, node: int, direction: str) -> tuple[float, float] | None:
        """(kbps, latency seconds), or None before any transfer was seen. Where kept transfers were
        timed on the wire: their bytes over their wire seconds, and the mean of what every kept
        transfer took besides its bytes at that rate (the ends' work grows with the bytes, so a small
        transfer's time is over-predicted: budgets err short). Otherwise latency: the last fit (0
        before one: the bandwidth is then a lower bound, so a budget from it errs short)."""
        key = (int(node), direction)
        seen = self._seen.get(key)
        if not seen:
            return None
        wired = [(b, w) for b, _, w in seen if w is not None]
        if wired:  # the rate on the link itself; the latency: what the transfers took besides their bytes
            kbps = sum(b for b, _ in wired) * 8 / sum(w for _, w in wired) / 1000
            return kbps, max(0.0, sum(s - b * 8 / (kbps * 1000) for b, s, _ in seen) / len(seen))
        latency = min(self._latency.get(key, 0.0), min(s for _, s, _ in seen))
        # bandwidth from the time left after latency, over all kept transfers (a sum, not a mean of ratios)
        busy = sum(max(s - latency, 1e-9) for _, s, _ in seen)
        return sum(b for b, _, _ in seen) * 8 / busy / 1000, latency


# -- `auto` strength in an upload spec -------------------------------------------------------------
AUTO = "auto"  # the value that marks a codec parameter as set each round by the controller


def is_auto(spec: str) -> bool:
    """True when ``spec`` (a plain codec spec) has a parameter written as ``auto``."""
    from fedcomp.policy import is_policy
    from fedcomp.spec import parse_spec

    if is_policy(spec):
        return False
    return any(v == AUTO for st in parse_spec(spec) for _, v in st.args)


def without_auto(spec: str) -> str:
    """``spec`` with its ``auto`` parameter dropped (the stage's default stands in): a valid spec of
    the same family, e.g. for a strategy that must be built before the first round's strength is known."""
    from fedcomp import budget
    from fedcomp.spec import Stage, parse_spec

    stages = [Stage(st.name, tuple((k, v) for k, v in st.args if v != AUTO)) for st in parse_spec(spec)]
    return budget._spec(stages, {})


def signal_of(metrics) -> float | None:
    """The controller's signal from an evaluation's metrics: ``accuracy`` (or ``acc``), else minus ``loss``;
    None when it has neither."""
    for key in ("accuracy", "acc"):
        if key in metrics:
            return float(metrics[key])
    if "loss" in metrics:
        return -float(metrics["loss"])
    return None


@dataclass(frozen=True)
class AdaptSettings:
    """The controller's bounds as reductions against the dense payload, and its policy factors.

    One set of defaults for every task and codec (no per-task tuning): bytes are relative to the
    model's dense payload, so the same reductions mean the same thing on a 200k- and a 2M-parameter
    model; the codec's own range clamps them.
    """

    min_reduction: float = 30.0  # highest budget = dense / this (the weakest compression allowed)
    max_reduction: float = 5000.0  # lowest budget = dense / this (the strongest compression allowed)
    start_reduction: float = 5000.0  # the first round's budget = dense / this: the strongest compression
    # allowed (with error feedback early rounds progress under any compression; the controller relaxes
    # when progress stops, so a start too strong costs a few windows, one too weak costs bytes every round)
    fixed_share: float = 0.6  # lowest budget >= this x the upload message's fixed bytes, once measured
    # (AutoStrength.observe_message: framing, metrics, statistics sent exact): below that, halving the
    # payload saves under a fifth of the message while slowing training as much as anywhere (0: off)
    tighten: float = 0.7  # StrengthController.tighten
    relax: float = 1.6  # StrengthController.relax
    tolerance: float = 0.005  # StrengthController.tolerance (accuracy: half a point)
    window: int = 5  # StrengthController.window
    cooldown: int = 1  # StrengthController.cooldown
    revert: bool = True  # StrengthController.revert

    def __post_init__(self) -> None:
        if isinstance(self.fixed_share, bool) or not isinstance(self.fixed_share, (int, float)) or not 0 <= self.fixed_share < math.inf:
            raise AdaptError(f"fixed_share={self.fixed_share!r} is invalid: a finite number >= 0")
        for name in ("min_reduction", "max_reduction", "start_reduction"):
            _positive(name, getattr(self, name))
            if getattr(self, name) < 1:
                raise AdaptError(f"{name}={getattr(self, name)!r} is invalid: a reduction must be >= 1")
        if not self.min_reduction <= self.start_reduction <= self.max_reduction:
            raise AdaptError(f"start_reduction={self.start_reduction} is invalid: it must lie in "
                             f"[min_reduction={self.min_reduction}, max_reduction={self.max_reduction}]")


class AutoStrength:
    """An upload spec with one ``param=auto``, resolved each round to a concrete spec.

    The :class:`StrengthController` keeps a per-client payload budget; :func:`fedcomp.budget.fit_budget`
    turns it into the codec's free parameter (the same knobs and search a link budget uses), so
    ``topk(ratio=auto)+qsgd(bits=4)``, ``kbit(bits=auto)``, ``powersgd(rank=auto)`` and
    ``sketch(cols=auto)`` all work. Sizes that depend on the data (Rice-coded indices) are
    measured on a seeded Gaussian update of the model's layout: the real messages differ by a few
    percent, and what clients send is counted from the real replies anyway.

    Each round: :meth:`spec` gives the codec for the round; after the server evaluates the new
    model, :meth:`observe` feeds its accuracy (or minus its loss) to the controller. ``history``
    holds per round the spec, the knob's value, the budget, the signal and the decision.
    """

    def __init__(self, spec: str, layout, settings: AdaptSettings | None = None, *, seed: int = 0) -> None:
        from fedcomp import budget
        from fedcomp.codec import Codec
        from fedcomp.spec import Stage, parse_spec

        self.settings = settings = settings or AdaptSettings()
        stages = parse_spec(spec)
        autos = [(i, k) for i, st in enumerate(stages) for k, v in st.args if v == AUTO]
        if len(autos) != 1:
            raise AdaptError(f"upload {spec!r} is invalid for adaptive strength: exactly one parameter must be "
                             f"'{AUTO}' (e.g. 'topk(ratio=auto)+qsgd(bits=4)'), found {len(autos)}")
        (at, param), = autos
        stages[at] = Stage(stages[at].name, tuple((k, v) for k, v in stages[at].args if k != param))
        self.template = budget._spec(stages, {})  # the spec without the auto parameter (its default stands in)
        self.param, self.stage = param, at
        plan = budget._plan(budget._stages(self.template), layout)
        moved = {(plan.fine_stage, plan.fine_key)} | {(i, p) for g in plan.coarse for c in g for i, o in c.items() for p in o}
        if (at, param) not in moved:
            names = sorted(f"{stages[i].name}.{p}" for i, p in moved if p is not None)
            raise AdaptError(f"{stages[at].name}({param}={AUTO}) is invalid: the controller moves "
                             f"{', '.join(names) or 'nothing'} of {self.template!r}; write '{AUTO}' there")
        self.layout = layout
        self._probe = _probe_update(layout, seed)
        dense = Codec("none()").size_bytes(layout)
        lo, hi = budget.limits(self.template, layout, measure=self._measure)
        clamp = lambda b: int(min(max(b, lo), hi))  # noqa: E731
        self._clamp = clamp
        self.dense_bytes = dense
        self.fixed_bytes: int | None = None  # the upload message's bytes besides the payload (observe_message)
        self.controller = StrengthController(
            lowest=clamp(dense / settings.max_reduction), highest=clamp(dense / settings.min_reduction),
            start=clamp(dense / settings.start_reduction), tighten=settings.tighten, relax=settings.relax,
            tolerance=settings.tolerance, window=settings.window, cooldown=settings.cooldown,
            revert=settings.revert)
        self._fits: dict[int, budget.Fit] = {}
        self.history: list[dict] = []

    def _measure(self, codec) -> int:
        from fedcomp.feedback import compress

        enc, _ = compress(codec, self._probe, None, nonce=1, error_feedback=False, round=1, state={})
        return len(enc.payload)

    def spec(self, round: int) -> str:
        """The concrete spec for round ``round`` (recorded in ``history``)."""
        from fedcomp import budget

        b = self.controller.current()
        if b not in self._fits:
            self._fits[b] = budget.fit_budget(self.template, self.layout, b, measure=self._measure)
        spec = self._fits[b].spec
        if not self.history or self.history[-1]["round"] != round:
            from fedcomp.spec import parse_spec

            value = dict(parse_spec(spec)[self.stage].args).get(self.param)
            self.history.append({"round": round, "spec": spec, self.param: value, "budget": b})
        return spec

    def observe_message(self, round: int, message_bytes: float) -> None:
        """The mean size of round ``round``'s upload messages (Flower message bytes per client, as
        received). What they carry besides the payload the round's spec was fitted to (framing,
        metrics, statistics sent exact) is the fixed part (``fixed_bytes``: the smallest seen); the
        controller's lowest budget becomes the larger of ``dense / max_reduction`` and
        ``fixed_share`` x that (see :class:`AdaptSettings`)."""
        _positive("message_bytes", message_bytes)
        entry = next((h for h in reversed(self.history) if h["round"] == round), None)
        if entry is None:
            raise AdaptError(f"round {round} has no spec yet: call spec({round}) before observe_message({round}, ...)")
        fixed = max(0, int(message_bytes) - self._fits[entry["budget"]].message_bytes)
        entry["fixed_bytes"] = fixed
        # the smallest seen: a real payload larger than the seeded update it was fitted on reads as fixed
        # bytes, and a floor that followed each round's would move the budget by noise
        self.fixed_bytes = fixed if self.fixed_bytes is None else min(self.fixed_bytes, fixed)
        c = self.controller
        c.lowest = min(self._clamp(max(self.dense_bytes / self.settings.max_reduction,
                                       self.settings.fixed_share * self.fixed_bytes)), c.highest)
        if c.budget < c.lowest:
            c.budget = float(c.lowest)

    def observe(self, round: int, metrics) -> None:
        """Round ``round``'s evaluation metrics (``accuracy``, else ``loss``); moves the next round's budget."""
        signal = signal_of(metrics) if not isinstance(metrics, (int, float)) else float(metrics)
        if signal is None:
            raise AdaptError(f"round {round}: the evaluation reported {sorted(metrics)}, but adaptive strength "
                             f"needs 'accuracy' or 'loss'")
        self.controller.update(round, signal)
        entry = next((h for h in reversed(self.history) if h["round"] == round), None)
        if entry is not None:
            entry.update(signal=float(signal), decision=self.controller.history[-1]["decision"])


def _probe_update(layout, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {t.name: (torch.randn(t.shape, generator=g) * 1e-2).to(t.torch_dtype) if t.is_float else torch.zeros(t.shape, dtype=t.torch_dtype)
            for t in layout.tensors}


# -- budgets from measured links ------------------------------------------------------------------------
FAST_KBPS = 1e9  # a bandwidth that limits nothing (first contact: the byte cap does)


def _sig(x: float, up: bool, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits, rounded up or down (short on the wire, margin kept)."""
    if x <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(x)) - digits + 1)
    return float((math.ceil if up else math.floor)(x / scale) * scale) if scale >= 1 else \
        (math.ceil if up else math.floor)(x / scale) / round(1 / scale)


@dataclass
class MeasuredBudgets:
    """Per-node upload byte budgets from links measured by a :class:`LinkEstimator`, not declared.

    The budget is :func:`fedcomp.links.upload_budget`'s (what the uplink carries in the time the
    deadline leaves after download, compute and latency) on the *estimated* link, with both
    predicted transfer times lengthened by ``z`` standard errors of the estimate
    (:meth:`LinkEstimator.uncertainty`; ``prior`` until three transfers are seen): measurement
    noise must not push an upload past the deadline, and a precise estimate costs little margin. A
    node's uploads grow by slow start (as TCP's): the first is ``first`` bytes, each next at most
    ``growth`` times the largest that reached the server within the deadline (timed, or only seen
    arriving in time: :meth:`observe_arrival`; a SuperNode's push is timed a round later, and slow
    start need not wait for it). Until a node has a latency fit, the sizes that differ
    let the estimator tell latency from bandwidth (before that, latency counts as 0 and the
    bandwidth estimate is a lower bound: budgets err short, never past the deadline), and a node
    whose estimate leaves no time for an upload at all keeps probing (a budget of 0 would never
    spread the sizes a fit needs). After the fit the growth cap stays: a budget that jumped from a
    probe to most of the model at once would be encoded at a size whose compute time was never
    measured (the budget counts the last round's), and would send several rounds of error-feedback
    residual in one reply.

    Where the transfers are timed on the link itself (a deployment's SuperNode,
    :mod:`fedcomp.clients.supernode`), what else a round holds besides compute (the engine's polls
    and process starts) is observed as the node's overhead (:meth:`observe_overhead`) and kept free
    by every budget.

    ``history`` holds per node and round: the estimate (kbps, latency), the budget, and -- where the
    caller passes the budget a declared link would give -- its relative error.
    """

    deadline_s: float  # the round deadline the budgets must meet
    z: float = 1.0  # standard errors of the predicted times kept free
    prior: float = 0.1  # relative uncertainty of a time predicted from fewer than 3 transfers
    growth: float = 4.0  # slow start: next upload <= growth x the largest seen
    first: int = 4096  # bytes of a node's first upload (nothing measured yet)
    estimator: LinkEstimator = field(default_factory=LinkEstimator)
    history: list[dict] = field(init=False, default_factory=list)
    _largest: dict[int, int] = field(init=False, default_factory=dict)
    _overhead: dict[int, deque] = field(init=False, default_factory=dict)  # node -> recent overhead seconds

    def __post_init__(self) -> None:
        _positive("deadline_s", self.deadline_s)
        for name in ("z", "prior"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise AdaptError(f"{name}={v!r} is invalid: a finite number >= 0")
        _positive("growth", self.growth, above_one=True)
        if isinstance(self.first, bool) or not isinstance(self.first, int) or self.first < 1:
            raise AdaptError(f"first={self.first!r} is invalid: a positive number of bytes")

    def observe(self, node: int, *, up_bytes: int | None = None, up_s: float | None = None,
                down_bytes: int | None = None, down_s: float | None = None,
                up_wire_s: float | None = None, down_wire_s: float | None = None) -> None:
        """One round's transfers of ``node`` as the server saw them (bytes and seconds each way;
        a direction left None was not timed this round; ``*_wire_s``: the seconds its bytes took on
        the link itself, where the node's SuperNode timed that: :class:`LinkEstimator`)."""
        if up_bytes is not None and up_s is not None:
            self.estimator.observe(node, "up", up_bytes, up_s, up_wire_s)
            self.observe_arrival(node, up_bytes)
        if down_bytes is not None and down_s is not None:
            self.estimator.observe(node, "down", down_bytes, down_s, down_wire_s)

    def observe_arrival(self, node: int, nbytes: int) -> None:
        """A reply of ``nbytes`` from ``node`` arrived within the deadline (its transfer may be timed
        later): slow start grows from it."""
        self._largest[int(node)] = max(self._largest.get(int(node), 0), int(nbytes))

    def observe_overhead(self, node: int, seconds: float) -> None:
        """Seconds of one of ``node``'s rounds that were neither its link's transfers nor its compute:
        where the transfers are timed on the link itself (a SuperNode's own timings), the polls,
        process starts and local copies of the engine around them, which a deadline sees too."""
        if not math.isfinite(seconds):
            raise AdaptError(f"seconds={seconds!r} is invalid: a finite number")
        self._overhead.setdefault(int(node), deque(maxlen=self.estimator.window)).append(max(0.0, float(seconds)))

    def overhead_s(self, node: int) -> float:
        """The overhead a budget keeps free for ``node``: the mean of its recent rounds' overheads plus
        ``z`` standard deviations (one sample: its own size stands in for the deviation; 0 where none
        was measured: the transfers were timed end to end)."""
        seen = self._overhead.get(int(node))
        if not seen:
            return 0.0
        mean = sum(seen) / len(seen)
        sd = math.sqrt(sum((s - mean) ** 2 for s in seen) / (len(seen) - 1)) if len(seen) > 1 else mean
        return mean + self.z * sd

    def _growth_cap(self, node: int) -> int:
        """Slow start's byte cap: ``growth`` x the node's largest upload in time, never below ``first``."""
        return max(self.first, math.floor(self.growth * self._largest.get(node, 0)))

    def _slack(self, node: int, direction: str) -> float:
        u = self.estimator.uncertainty(node, direction)
        return 1 + self.z * (self.prior if u is None else u)

    def _left(self, node: int, download_bytes: int, compute_s: float) -> float:
        """Seconds the deadline leaves for the upload's transfer on the estimate (margins applied)."""
        up = self.estimator.estimate(node, "up")
        down = self.estimator.estimate(node, "down")
        down_s = 0.0
        if down is not None:
            down_s = (download_bytes * 8 / (down[0] * 1000) + down[1]) * self._slack(node, "down")
        return self.deadline_s - down_s - compute_s - up[1] * self._slack(node, "up") - self.overhead_s(node)

    def down_estimate(self, node: int) -> tuple[float, float] | None:
        """(kbps, latency seconds) of ``node``'s downlink. Broadcasts are about one size, so their
        latency is rarely fitted: until it is (or their bytes are timed on the wire), the upload's
        fitted latency stands in (one latency
        per link, as the link model has), or the small ones would read as a slow link; at most half
        of each transfer counts as latency: a latency-bound broadcast says little about bandwidth,
        and an over-estimate would move the node to a larger download tier."""
        est = self.estimator
        down = est.estimate(node, "down")
        up = est.estimate(node, "up")
        if down is not None and up is not None and not est.fitted(node, "down") and est.fitted(node, "up"):
            seen = est._seen[(node, "down")]
            down = (sum(b for b, _, _ in seen) * 8 / sum(max(s - up[1], s / 2) for _, s, _ in seen) / 1000, up[1])
        return down

    def link(self, node: int, *, download_bytes: int | None = None, compute_s: float = 0.0):
        """The link to send ``node`` for its next upload (:data:`fedcomp.links.ESTIMATE`): the
        estimate with the margins of :meth:`budget` folded in, so that the client's own
        :func:`fedcomp.links.upload_budget` (with the compute it measures) gives what
        :meth:`budget` would: uplink kbps / slack, the upload's latency x slack, downlink kbps /
        slack; a byte cap of ``growth`` x the largest upload in time (slow start). Before any upload
        was timed: :data:`FAST_KBPS` both ways, no latency, slow start's cap (``first`` bytes at
        first contact): a small probe whatever the link. A :class:`fedcomp.links.Link` has one latency for both directions (the
        upload's here); an unfitted download latency sits in its lower-bound bandwidth instead.

        ``download_bytes``/``compute_s`` (the coming broadcast, the node's last compute): in slow
        start, when the estimate leaves the upload no time (download and compute alone reach the
        deadline), the link goes without a deadline, so the cap alone budgets: the probe goes on
        (the node is late on this estimate whatever it sends; a budget of 0 would keep the upload
        sizes equal, and its latency, hence its bandwidth, would never be fitted)."""
        from fedcomp.links import Link

        est = self.estimator
        up = est.estimate(node, "up")
        if up is None:
            return Link(FAST_KBPS, FAST_KBPS, 0.0, byte_cap=self._growth_cap(node), deadline_s=self.deadline_s)
        s_up = self._slack(node, "up")
        cap = self._growth_cap(node)
        fitted = est.fitted(node, "up")
        down = self.down_estimate(node)
        downlink = FAST_KBPS if down is None else _sig(down[0] / self._slack(node, "down"), up=False)
        deadline = self.deadline_s
        if not fitted and download_bytes is not None and self._left(node, download_bytes, compute_s) <= 0:
            deadline = None  # slow start past the deadline: keep probing (see above)
        # the client counts a link's latency twice (download, upload): half the overhead in each
        latency_ms = (up[1] * s_up + self.overhead_s(node) / 2) * 1000
        return Link(_sig(up[0] / s_up, up=False), downlink, _sig(latency_ms, up=True), byte_cap=cap,
                    deadline_s=deadline)

    def budget(self, node: int, round: int, *, download_bytes: int, compute_s: float,
               declared: int | None = None) -> int:
        """Bytes ``node`` may upload in round ``round`` (recorded in ``history``)."""
        up = self.estimator.estimate(node, "up")
        entry = {"node": int(node), "round": int(round), "up_kbps": None, "up_latency_s": None}
        if up is None:
            budget = self._growth_cap(node)
        else:
            kbps, latency = up
            left = self._left(node, download_bytes, compute_s)
            budget = max(1, math.floor(left / self._slack(node, "up") * kbps * 1000 / 8))
            cap = self._growth_cap(node)
            if not self.estimator.fitted(node, "up") and left <= 0:
                budget = cap  # no latency fit yet and past the deadline on this estimate: probe anyway (see link())
            budget = min(budget, cap)
            entry.update(up_kbps=kbps, up_latency_s=latency)
        entry["budget"] = budget
        if declared is not None:
            entry["declared"] = declared
            entry["error"] = budget / declared - 1 if declared else None
        self.history.append(entry)
        return budget
