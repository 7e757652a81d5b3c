"""Server-side error feedback for rarely participating clients (FetchSGD's idea, any linear codec).

In cross-device federated learning a client takes part in a round now and then (100 clients, 10%
per round: about 6 times in 60 rounds), so a residual kept on the client is stale when it is
finally sent, and most of it never is. FetchSGD (Rothchild et al. 2020) moves error accumulation
to the server, which sees every round: clients are stateless and upload a *linear* compression of
their update (a count sketch), the server sums the tables, and per segment::

    S   = sum_i w_i D_q(c_i) / sum_i w_i  (tables, dequantized: summing commutes with the sketch)
    S_u <- rho * S_u + S                 (momentum, in sketch space)
    S_e <- S_e + S_u                     (error accumulation, in sketch space)
    delta = top-k(unsketch(S_e))         (heavy hitters: the coordinates applied this round)
    S_u[cells of delta] = 0; S_e[cells of delta] = 0

and applies ``delta``. What a round's top-k leaves out stays in ``S_e`` and is applied when it has
grown large enough, whoever sent it. :class:`ServerFeedback` does this for a codec whose reducer is
linear (``sketch(...)``), with or without a quantizer after it: the server dequantizes each table
before summing, so ``sketch(rows=1, cols=16000)+qsgd(bits=4)`` is as summable as the raw sketch and
costs a quarter of it. Stochastic (unbiased) quantizers keep the sum unbiased.

:meth:`ServerFeedback.step_broadcast` couples the download to it: the heavy hitters are encoded
once with the download codec (unbiased rounding), the server applies exactly what that payload
decodes to, and what the download codec dropped is sketched back into the error table; the payloads
are then the model's whole history. :func:`plan_download` is the download side: every client can
rebuild the round-0 model from the run's seed, so a client on first contact gets the chain of
compressed steps from round 0 instead of the dense model, and the server keeps the step payloads
(per tier, not per client; never more than one model's bytes are worth keeping).

Measured in ``fedcomp.simulations.xdev_study`` (100 clients, 10% per round, digits):
``sketch(rows=1, cols=16000, ratio=0.01)+qsgd(bits=4)`` + ``topk(ratio=0.01)+kbit(bits=4,
stochastic=true)`` coupled: 114x fewer upload and 30x fewer download bytes than dense FedAvg at
+0.42 points (4 seeds); unchanged accuracy with 10 clients all participating.

Warm-up (``warmup=Warmup(...)``, off by default). Early in a cross-device run the clients'
updates are spread over many coordinates: a step of the codec's ``ratio`` heavy hitters, each the
estimate of a one-row sketch shared by every element of its cell, moves the model far less than
the dense mean, and accuracy lags dense for the first rounds (issue 36). :class:`Warmup` has two
knobs, each falling geometrically to its resting value over its rounds (DGC's sparsity warm-up
schedule, :func:`fedcomp.codecs.dgc.warmup_fraction`):

* ``scale``: the round's mean table is multiplied by a factor falling from ``scale`` to 1 (a
  server step size: the same heavy hitters, larger steps). It costs no byte: the step keeps the
  codec's count, so the coupled ``topk`` download is unchanged. As the factor falls, the momentum
  and error tables are multiplied by its fall too (``rescale``, the default): what waits in them
  is applied at the current step size, not at the one it arrived with (without it, the early
  rounds' scaled mass kept arriving for tens of rounds and cost a model with BatchNorm points at
  the end). Scaling the applied heavy hitters instead (the error table at scale 1) diverged.
* ``share``: the heavy hitters' share of the step falls from ``share`` to the codec's ``ratio``.
  The coupled download must carry the larger steps: ``dgc(ratio=<the sketch's>, momentum=0,
  warmup=<rounds>, start=<share>, sample=1)+kbit(bits=4, stochastic=true)`` keeps exactly the same
  count for the same ``round`` (a ``topk(ratio=...)`` download would drop the extra coordinates
  back into the error table). Every node's first contact downloads the chain of steps since round
  0, so these bytes are paid by nearly every node.

The round is the one the step is for, as the coupled download's codec sees it (the wrapper passes
the server round + 1); 0 (unknown) is no warm-up. Measured: the docs' results page "Slow start".

Memory: two tables per segment (momentum and error), ``8 * rows * cols`` bytes, and with one row the
cached element count per cell (``4 * cols``); nothing per client.
"""

from __future__ import annotations

import math
import numbers
from builtins import round as round_
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedcomp.codec import Codec
from fedcomp.codecs.dgc import warmup_fraction
from fedcomp.aggregate import check_weight
from fedcomp.errors import DecodeError, FedcompError, SpecError
from fedcomp.fetchsgd import sketch_step
from fedcomp.layout import Layout
from fedcomp.wire import HEADER, open_payload


class BroadcastFailed(FedcompError):
    """:meth:`ServerFeedback.step_broadcast` could not encode the step for the download (a codec
    bug); ``step`` is the update it computed (the server state has moved by it already), to be
    applied uncompressed."""

    def __init__(self, message: str, step: dict[str, torch.Tensor]) -> None:
        super().__init__(message)
        self.step = step


class ServerFeedback:
    """Sum clients' linear (sketched) uploads and apply heavy hitters of the server-side error.

    Entries that must not enter the sketch travel beside it and are averaged exactly: with a
    policy upload such as ``name~*running_mean: none(); name~*running_var: none(); sketch()``
    (what :func:`fedcomp.tensor_kinds.exact_state_policy` writes, and ``CompressedStrategy``
    uses for a model with BatchNorm), the rule with the linear reducer is sketched and the other
    rules' tensors are decoded and averaged (weighted mean of the clients' deltas, no momentum, no
    error table), so a running variance stays the mean of the clients' non-negative ones. Integer
    tensors (``num_batches_tracked``) travel raw in every codec and advance by the rounded mean
    of the clients' deltas.

    Parameters
    ----------
    codec : Codec or PolicyCodec
        The upload codec: a linear reducer (``sketch(...)``), any quantizer may follow; or a
        policy without ``round`` conditions whose rules hold exactly one such codec.
    layout : Layout
        The model's layout.
    momentum : float (default: 0.0)
        FetchSGD's rho, momentum in sketch space, in [0, 1).
    warmup : Warmup or None (default: None)
        The first rounds' step size and heavy hitters' share (:class:`Warmup`; module
        docstring); None: the codec's ``ratio`` and the round's mean every round. Settable later
        (``feedback.warmup = ...``), checked the same way.
    """

    def __init__(self, codec: Codec, layout: Layout, momentum: float = 0.0, *,
                 warmup: Warmup | None = None) -> None:
        if not 0 <= momentum < 1:
            raise SpecError(f"momentum={momentum!r} is invalid: it must be in [0, 1)")
        self.codec = codec
        self.layout = layout
        self.momentum = float(momentum)
        self.warmup = warmup
        self._table_scale = 1.0  # the warm-up's scale the momentum and error tables are in
        self._rule, self._sketch_codec, self._sketch_layout, self._others = _split(codec, layout)
        self._segments = self._sketch_codec.segments(self._sketch_layout)
        # entries averaged exactly, in layout order: every tensor outside the sketched segments
        sketched = {self._sketch_layout.tensors[i].name for _, group in self._segments for i in group}
        self._exact = [t for t in layout.tensors if t.name not in sketched]
        self._sum: list[torch.Tensor] | None = None  # per sketched segment, then the exact entries (flat)
        self._velocity: list[torch.Tensor] | None = None  # S_u
        self._error: list[torch.Tensor] | None = None  # S_e
        self.count = 0  # uploads added this round
        self.weight = 0.0  # their total weight

    @property
    def reducer(self):
        return self._sketch_codec.reducer

    @property
    def warmup(self) -> Warmup | None:
        """The first rounds' step size and share (:class:`Warmup`), or None (off)."""
        return self._warmup

    @warmup.setter
    def warmup(self, value: Warmup | None) -> None:
        if value is not None and not isinstance(value, Warmup):
            raise SpecError(f"warmup={value!r} is invalid: None (off) or a Warmup(share=..., scale=..., rounds=...)")
        self._warmup = value

    def share(self, round: int) -> float:
        """The heavy hitters' share of the step for ``round`` (1: the first; 0: unknown, no
        warm-up): the codec's ``ratio``, or the warm-up's (:meth:`Warmup.share_at`)."""
        ratio = self.reducer.ratio
        return ratio if self._warmup is None else self._warmup.share_at(ratio, round)

    def scale(self, round: int) -> float:
        """The factor on the round's mean table for ``round``: 1, or the warm-up's
        (:meth:`Warmup.scale_at`)."""
        return 1.0 if self._warmup is None else self._warmup.scale_at(round)

    def kept(self, round: int, numel: int) -> int | None:
        """Heavy hitters applied in a segment of ``numel`` elements for ``round``: None where the
        codec's ratio holds (the reducer's own count), else ceil(share * numel), in [1, numel]."""
        share = self.share(round)
        if share == self.reducer.ratio:
            return None
        return min(numel, max(1, math.ceil(round_(share * numel, 6)))) if numel else 0

    @property
    def nbytes(self) -> int:
        """Server memory between rounds: momentum and error tables, and what the reducer caches (a
        one-row sketch's element count per cell, once a step has run with the compiled loops)."""
        return sum(2 * 4 * self.reducer.count(seg) for seg, _ in self._segments) + getattr(self.reducer, "cache_nbytes", 0)

    @property
    def exact_specs(self) -> list:
        """The layout entries that travel exact beside the sketch (statistics, integer buffers), in the
        order of :meth:`decode`'s last value."""
        return list(self._exact)

    def decode(self, payload: bytes) -> list[torch.Tensor]:
        """One upload's dequantized table values per sketched segment, then its exact entries
        (one flat float64 vector, empty when there are none), checked: DecodeError for a
        malformed payload or NaN/Inf values (nothing is added)."""
        parts: dict[str, torch.Tensor] = {}
        if self._rule is None:
            tables = self._sketch_values(payload, parts)
        else:
            src, _ = open_payload(payload, self.layout.fingerprint(), self.codec.fingerprint)
            tables = []
            for i, sub, rule_codec in self._others:
                rule = src.u8()
                if rule != i:
                    raise DecodeError(f"policy payload holds rule {rule} where rule {i} is expected")
                body = src.take(src.u32()).numpy().tobytes()
                if i == self._rule:
                    tables = self._sketch_values(body, parts)
                else:
                    parts.update(rule_codec.decode(body, sub))
            src.finish()
        exact = (torch.cat([parts[t.name].reshape(-1).to(torch.float64) for t in self._exact])
                 if self._exact else torch.zeros(0, dtype=torch.float64))
        values = [*tables, exact]
        if not all(bool(torch.isfinite(v).all()) for v in values):
            raise DecodeError("upload has NaN or Inf values")
        return values

    def _sketch_values(self, payload: bytes, parts: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        read, raw = self._sketch_codec.decode_parts(payload, self._sketch_layout)
        version = HEADER.unpack_from(payload)[1]  # decode_parts checked the header
        if version < self.reducer.wire_version:
            raise DecodeError(f"sketch payload of format version {version}: its hashes are not this server's "
                              f"(format {self.reducer.wire_version}), so its table cannot be summed with the others; "
                              f"update fedcomp on the client")
        for i, t in raw.items():
            parts[self._sketch_layout.tensors[i].name] = t
        return [vals for _, _, _, vals in read]

    def norm(self, values: list[torch.Tensor]) -> float:
        """Estimate of the sketched update's L2 norm from its tables: each row of a count sketch
        preserves the norm in expectation, so ``sqrt(sum of squares / rows)``. The exact entries
        (statistics, counters) are not gradients and do not count."""
        rows = getattr(self.reducer, "rows", 1)
        return math.sqrt(sum(float(torch.linalg.vector_norm(v, dtype=torch.float64) ** 2)
                             for v in values[:-1]) / rows)

    def add(self, payload: bytes, weight: float = 1.0) -> None:
        """Add one client's upload with its weight (e.g. its number of examples), as it arrives.

        Raises DecodeError for a malformed payload and FedcompError for non-finite values or a
        non-finite or negative weight; nothing is added then.
        """
        self._check_weight(weight)
        self.add_values(self.decode(payload), weight)

    @staticmethod
    def _check_weight(weight) -> float:
        """0 (counts for nothing) or what :func:`fedcomp.aggregate.check_weight` accepts (finite, > 0,
        at most 2**53); a WeightError naming the value otherwise."""
        if isinstance(weight, numbers.Real) and not isinstance(weight, bool) and weight == 0:
            return 0.0
        return check_weight(weight)

    def add_values(self, values: list[torch.Tensor], weight: float = 1.0) -> None:
        """Add one upload already decoded by :meth:`decode` (the wrapper decodes first to check
        its norm). Sums are float64, so the order replies arrive in changes no bit that matters."""
        weight = self._check_weight(weight)
        if self._sum is not None and (len(values) != len(self._sum)
                                      or any(v.numel() != s.numel() for v, s in zip(values, self._sum))):
            raise DecodeError("upload's table shapes differ from the round's other uploads")
        if self._sum is None:
            self._sum = [torch.zeros(v.numel(), dtype=torch.float64) for v in values]
        for acc, v in zip(self._sum, values):
            acc.add_(v.reshape(-1).to(torch.float64), alpha=float(weight))
        self.count += 1
        self.weight += float(weight)

    def discard_round(self) -> None:
        """Forget the round's uploads (a round without usable replies); the tables stay."""
        self._sum = None
        self.count, self.weight = 0, 0.0

    def step(self, *, round: int = 0) -> dict[str, torch.Tensor]:
        """The update to apply this round (dense tensors, zero where nothing is applied) from the
        weighted mean of the round's tables; exact entries get the weighted mean of the clients'
        deltas (integers rounded). Resets the round's sum. ``round``: the round the step is for
        (the warm-up's; 0: unknown, the codec's ratio)."""
        return self._step(None, 0, round)[0]

    def _broadcast(self, broadcast, out: dict, nonce: int, round: int) -> tuple[dict, bytes]:
        """The step ``out`` as ``broadcast`` encodes it, and its payload (:class:`BroadcastFailed`,
        carrying ``out``, when the codec cannot encode it: the state has moved already)."""
        try:
            encoded = broadcast.encode(out, nonce=nonce, round=round)
            return broadcast.decode(encoded.payload, self.layout, round=round), encoded.payload
        except Exception as exc:  # noqa: BLE001 - the step is computed (and the state moved): hand it on
            raise BroadcastFailed(
                f"the download codec {broadcast.spec!r} could not encode the server's step "
                f"({type(exc).__name__}: {exc})", out) from exc

    def step_broadcast(
        self, broadcast: Codec, *, nonce: int = 0, round: int = 0
    ) -> tuple[dict[str, torch.Tensor], bytes]:
        """The update to apply, already compressed for the download, and its payload.

        The heavy hitters are encoded with ``broadcast`` (e.g. ``topk(ratio=...)+kbit(bits=4)``
        with the same ratio as the sketch's), the server applies exactly what the payload decodes
        to, and what the broadcast codec dropped goes back into the error table (sketches are
        linear). The global model then moves only by broadcast payloads: clients that replay
        them from the seeded round-0 model hold the server's model itself, with no download
        error-feedback loop lagging behind it.

        Use an unbiased (stochastic) quantizer in ``broadcast``: with nearest rounding
        (``kbit(bits=4)``) the study (``fedcomp.simulations.xdev_study``, scheme
        ``fetchsgd-c16000-q4+coupled``) collapsed to chance late in 2 of 5 runs; with
        ``kbit(bits=4, stochastic=true)`` it did not (``fetchsgd-c16000-q4+coupled-stoch``).
        Exact entries (statistics) should travel exact in ``broadcast`` too (a policy with
        ``none()`` for them, as ``CompressedStrategy`` builds).
        """
        out, payload = self._step(broadcast, nonce, round)
        assert payload is not None
        return out, payload

    def cells_of(self, broadcast: Codec):
        """The ``cells`` reducer of ``broadcast`` that sends this sketch's cells (one row, the same
        cols and seed, over the same tensors), or None: then what the broadcast drops is sketched
        back coordinate by coordinate."""
        from fedcomp.codecs.sketch import SketchCells

        rules = getattr(broadcast, "rules", None)
        if rules is None:
            pairs = [(broadcast, self.layout)]
        else:
            pairs = [(rules[i][1], sub) for i, sub in broadcast.groups(self.layout, 0)]
        sketched = [self._sketch_layout.tensors[i].name for _, group in self._segments for i in group]
        for codec, sub in pairs:
            r = getattr(codec, "reducer", None)
            if (isinstance(r, SketchCells) and r.matches(self.reducer)
                    and [t.name for t in sub.tensors if t.is_float] == sketched):
                return r
        return None

    def flat_sent(self, sent: dict[str, torch.Tensor], group) -> torch.Tensor:
        """A segment's tensors of ``sent``, flat, fp32."""
        return torch.cat([sent[self._sketch_layout.tensors[i].name].reshape(-1).float() for i in group])

    def _step(self, broadcast: Codec | None, nonce: int, round: int) -> tuple[dict[str, torch.Tensor], bytes | None]:
        reducer = self.reducer
        if self._error is None:
            if self._sum is None:  # no upload ever: nothing to apply
                out = {t.name: torch.zeros(t.shape, dtype=t.torch_dtype) for t in self.layout.tensors}
                return out, (broadcast.encode(out, nonce=nonce, round=round).payload if broadcast else None)
            self._velocity = [torch.zeros(s.numel()) for s in self._sum[:-1]]
            self._error = [torch.zeros(s.numel()) for s in self._sum[:-1]]
        # a round without uploads still applies what the error and momentum hold
        if self._sum is not None and self.weight > 0:
            sums = [s.div_(self.weight) for s in self._sum]  # in place: the round's sums end here
        else:
            sums = [torch.zeros(e.numel(), dtype=torch.float64) for e in self._error]
            sums.append(torch.zeros(sum(t.numel for t in self._exact), dtype=torch.float64))
        factor = self.scale(round)
        if factor != 1:  # the warm-up's step size: the sketched tables, not the exact entries
            for s in sums[:-1]:
                s.mul_(factor)
        if factor != self._table_scale and self._warmup is not None and self._warmup.rescale:
            for t in (*self._velocity, *self._error):  # what waits in them: at this round's scale
                t.mul_(factor / self._table_scale)
        self._table_scale = factor
        deltas, out = [], {}  # every tensor is set below: the sketched from their segment's delta (a
        # view where the dtype is fp32), the others from the exact mean (no dense zeros made first)
        for j, ((seg, group), s_j) in enumerate(zip(self._segments, sums)):
            delta = sketch_step(reducer, self._velocity[j], self._error[j], s_j.float(), self.momentum, seg.numel,
                                self.kept(round, seg.numel))
            deltas.append(delta)
            offset = 0
            for i in group:
                spec = self._sketch_layout.tensors[i]
                out[spec.name] = _to_dtype(delta[offset:offset + spec.numel].view(spec.shape), spec.torch_dtype)
                offset += spec.numel
        offset, mean = 0, sums[-1]
        for spec in self._exact:  # the plain weighted mean of the clients' deltas
            v = mean[offset:offset + spec.numel].view(spec.shape)
            out[spec.name] = v.to(spec.torch_dtype) if spec.is_float else torch.round(v).to(spec.torch_dtype)
            offset += spec.numel
        out = {t.name: out[t.name] for t in self.layout.tensors}  # layout order
        self._sum = None
        self.count, self.weight = 0, 0.0
        if broadcast is None:
            return out, None
        sent, payload = self._broadcast(broadcast, out, nonce, round)
        cells = self.cells_of(broadcast)
        for j, (seg, group) in enumerate(self._segments):  # the broadcast's loss stays in the error,
            if cells is not None:  # in the cells' units: each cell's coordinates moved by its value
                flat = self.flat_sent(sent, group)
                self._error[j].add_(cells.cell_mean(deltas[j] - flat, deltas[j] != 0))
                continue
            # and so does what the model's dtype could not hold (fp16 rounding, values past its range):
            # sketched from where it is nonzero (the kept coordinates, mostly), tensor by tensor,
            # the bits of sketching the dense difference (zeros add nothing)
            positions, values, offset = [], [], 0
            for i in group:
                spec = self._sketch_layout.tensors[i]
                diff = deltas[j][offset:offset + spec.numel] - sent[spec.name].reshape(-1).float()
                nz = torch.nonzero(diff).squeeze(1)
                positions.append(nz + offset)
                values.append(diff[nz])
                offset += spec.numel
                del diff
            self._error[j].add_(reducer.sketch_entries(torch.cat(positions), torch.cat(values), seg.numel))
        return sent, payload


@dataclass(frozen=True)
class Warmup:
    """The first rounds of :class:`ServerFeedback` (module docstring): larger steps and/or more
    heavy hitters, each falling geometrically to its resting value (DGC's schedule,
    :func:`fedcomp.codecs.dgc.warmup_fraction`) over its rounds; SpecError naming a bad value.

    ``scale``: factor on the round's mean table in round 1, falling to 1 over ``scale_rounds``
    rounds (default ``rounds``); >= 1 (1: off). ``share``: heavy hitters' share of the step in
    round 1, falling to the codec's ``ratio`` over ``rounds`` rounds; None: off (a share at or
    below the ratio is the ratio). ``rounds``: an int >= 0. ``rescale``: as the factor falls, the
    momentum and error tables fall with it (module docstring); False: they keep the scale their
    contents arrived with.
    """

    share: float | None = None
    scale: float = 1.0
    rounds: int = 0
    scale_rounds: int | None = None
    rescale: bool = True

    def __post_init__(self) -> None:
        if self.share is not None and not (_real(self.share) and 0 < self.share <= 1):
            raise SpecError(f"warmup share={self.share!r} is invalid: None (off) or a share in (0, 1]")
        if not (_real(self.scale) and 1 <= self.scale <= MAX_WARMUP_SCALE):
            raise SpecError(f"warmup scale={self.scale!r} is invalid: a factor in [1, {MAX_WARMUP_SCALE:g}] "
                            f"(1: off)")
        if not isinstance(self.rescale, bool):
            raise SpecError(f"warmup rescale={self.rescale!r} is invalid: True or False")
        for name in ("rounds", "scale_rounds"):
            value = getattr(self, name)
            if (value is not None or name == "rounds") and not (
                    isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0):
                raise SpecError(f"warmup {name}={value!r} is invalid: a number of rounds, an int >= 0"
                                + (" (None: rounds)" if name == "scale_rounds" else ""))

    def share_at(self, ratio: float, round: int) -> float:
        """The heavy hitters' share of the step for ``round``: ``share * (ratio / share) **
        ((round - 1) / rounds)`` for rounds 1..``rounds``, floored at ``ratio``; ``ratio`` after
        them, for round 0 (unknown) and without a share. DGC's schedule, so a ``dgc(ratio=ratio,
        warmup=rounds, start=share)`` download keeps the same count for the same round."""
        return ratio if self.share is None else warmup_fraction(ratio, self.rounds, round, self.share)

    def scale_at(self, round: int) -> float:
        """The factor on the round's mean table for ``round``: ``scale`` in round 1, falling
        geometrically to 1 in round ``scale_rounds + 1``; 1 after them and for round 0."""
        rounds = self.rounds if self.scale_rounds is None else self.scale_rounds
        return warmup_fraction(1.0, rounds, round, float(self.scale))


MAX_WARMUP_SCALE = 100.0  # a larger first step than this is a typo, not a warm-up


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (fp32) in ``dtype``, saturated at its largest finite values (an fp16 tensor's step
    past 65,504 would be inf, and its broadcast NaN); the caller keeps the difference."""
    if dtype == x.dtype:
        return x
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype) if big < torch.finfo(x.dtype).max else x.to(dtype)


def _split(codec, layout: Layout):
    """(policy rule sketched or None, the sketch's codec, its sub-layout, [(rule, sub-layout,
    codec)] of a policy's groups in payload order) for :class:`ServerFeedback`."""
    rules = getattr(codec, "rules", None)
    if rules is None:
        reducer = getattr(codec, "reducer", None)
        if reducer is None or not reducer.linear:
            raise SpecError(
                f"server-side error feedback needs a linear upload codec such as "
                f"'sketch(rows=1, cols=16000)+qsgd(bits=4)', got {getattr(codec, 'spec', codec)!r}")
        return None, codec, layout, []
    if any(c.field == "round" for conds, _ in rules for c in conds):
        raise SpecError(f"server-side error feedback needs a policy without round conditions (one grouping for "
                        f"every round), got {codec.spec!r}")
    groups = [(i, sub, rules[i][1]) for i, sub in codec.groups(layout, 0)]
    linear = [g for g in groups if g[2].reducer is not None and g[2].reducer.linear]
    if len(linear) != 1:
        raise SpecError(
            f"server-side error feedback needs exactly one policy rule with a linear reducer (sketch) holding "
            f"tensors of this model, the others sent beside it (e.g. 'name~*running_var: none(); sketch()'), "
            f"got {codec.spec!r} ({len(linear)} such rules in use)")
    rule, sub, sketch_codec = linear[0]
    return rule, sketch_codec, sub, groups


@dataclass(frozen=True)
class DownloadPlan:
    """What a client is sent: ``"chain"`` (steps ``first..last``) or ``"full"``, and its bytes."""

    mode: str
    first: int  # first step sent (chain), or the round of the full model
    last: int
    nbytes: int


def plan_download(
    held: int | None, step_bytes: Sequence[int], now: int, full_bytes: int, *, overhead: int = 0,
    max_stale: int | None = None,
) -> DownloadPlan:
    """The cheaper of the chain of steps since the version a client holds and the full model.

    ``step_bytes[t]`` is the size of the step that moved the tier's reference to round ``t``
    (index 0 unused: the seeded round-0 model every node builds itself). ``held`` is the round of
    the reference the client holds: 0 for a client on first contact whose round-0 model is the
    seeded initialisation, None when it holds nothing usable. ``max_stale`` bounds the chain's
    length (None: any length, as long as it is cheaper than ``full_bytes``).
    """
    if not 0 <= now < len(step_bytes):
        raise FedcompError(f"now={now!r} is outside the {len(step_bytes) - 1} steps kept")
    if held is not None and not 0 <= held <= now:
        raise FedcompError(f"held={held!r} is invalid: a client holds a round in [0, {now}]")
    full = DownloadPlan("full", now, now, full_bytes + overhead)
    if held is None or (max_stale is not None and now - held > max_stale):
        return full
    chain = DownloadPlan("chain", held + 1, now, sum(step_bytes[held + 1:now + 1]) + overhead)
    return chain if chain.nbytes < full.nbytes else full

