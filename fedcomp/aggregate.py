"""Server-side aggregation: replies streamed into one weighted float64 sum, checked before they count.

`Accumulator.add` reads and checks a whole payload (checksum, every count and index, finite
values; `check_weight` and `NormGuard` for the weight and the norm) before anything is added, so
a bad reply raises `AggregationError` / `DecodeError` and leaves the sum unchanged. Sparse replies
stay sparse and dense ones compact (packed codes, low-rank factors): their values are built
``CHUNK`` elements at a time as they are added, and dense replies wait in small batches that are
added in one pass over the sum. Float tensors sum in float64, where ``weight x value`` is exact for
fp32/fp16/bf16 values and integer weights below 2**29, so the sum does not depend on the order
replies arrive in. `Accumulator.apply_mean` returns ``reference + sum / total weight`` in the
reference's dtypes through `fedcomp.steps.apply_step`.

Where the quantizer implements `fedcomp.codecs.fastpath.RunCodec` (CPU, numba), a reply is read,
checked and added in one compiled call each, with the same sums. Working memory: the float64 sum
plus chunk-sized temporaries, whatever the number of replies.
"""

from __future__ import annotations

import bisect
import math
import numbers
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fedcomp import kernels
from fedcomp.base import Selector
from fedcomp.codec import Codec
from fedcomp.errors import DecodeError, FedcompError
from fedcomp.codecs.sparsify import reads_ascending
from fedcomp.steps import APPLY_CHUNK, _apply_one, apply_step, model_step  # noqa: F401  (re-exported)
from fedcomp.wire import host_zeros

CHUNK = 1 << 20  # elements per step of chunked loops: temporaries of 8 MB at most
BATCH = 8  # replies whose fused adds share one pass over the float64 sum (Accumulator(batch=...))
# payload bytes that may wait for that pass, in float64 sums' worth (each pass over the sums reads
# and writes 16 bytes an element, so fewer passes win; see the docs' Results: performance). A server
# holds a round's replies anyway; this bounds what an Accumulator keeps alive for a caller that
# drops each payload after add().
PENDING_SUMS = 4
SUM_CHUNK = 1 << 18  # elements of the sum per step of that pass (2 MB of float64: in the cache)
# a quantizer's run replies (codes or values streamed from memory) add into 512 kB of the sum at a
# time, in L2; sparse replies were slower so and keep SUM_CHUNK (see the docs' Results: performance)
RUN_SUM_CHUNK = 1 << 16
MAX_WEIGHT = float(2**53)  # largest weight accepted at all: beyond it counts are not exact in float64


class AggregationError(FedcompError):
    """An update or weight cannot be aggregated; the sum is unchanged."""


class WeightError(AggregationError, ValueError):
    """A reply's weight (its example count) is not a finite positive number within the cap."""


class UpdateRejected(AggregationError):
    """An update failed a check (non-finite values, norm guard); the reply is dropped."""


class AggregateOverflow(AggregationError):
    """The aggregate does not fit the model's dtype (it would be inf): refused, never returned."""


def _chunks(t: torch.Tensor):
    flat = t.reshape(-1)
    for i in range(0, flat.numel(), CHUNK):
        yield flat[i:i + CHUNK]


def _finite(t: torch.Tensor) -> bool:
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) and kernels.get() is not None:
        return math.isfinite(_sq_norm(t))  # one fused pass: a sum of squares is finite iff every value is
    return all(bool(torch.isfinite(c).all()) for c in _chunks(t))


def _ascending(pos: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, values) ordered by position (as they are, where they already are)."""
    if pos.numel() < 2:
        return pos, vals
    k = kernels.get() if pos.device.type == "cpu" and pos.dtype == torch.int64 and pos.is_contiguous() else None
    if bool(k.ascending(pos.numpy())) if k is not None else bool((pos[1:] >= pos[:-1]).all()):
        return pos, vals
    order = torch.argsort(pos, stable=True)
    return pos[order], vals[order]


def _chunk_sq(c: torch.Tensor) -> float:
    """Sum of squares of one chunk in float64: a fused loop for CPU fp32/fp64 tensors
    (:mod:`fedcomp.kernels`; about 5x faster than ``vector_norm(dtype=float64)``, which first
    converts the chunk), torch otherwise. Either is inf or NaN exactly when a value is."""
    if c.device.type == "cpu" and (k := kernels.get()) is not None:
        if c.dtype in (torch.float32, torch.float64):
            return float(k.sumsq(c.detach().reshape(-1).numpy()))
        if c.dtype in _HALVES:  # a model's fp16 / bf16 tensor: the values as its dtype holds them
            return float(k.half_sq(_bits16(c), c.dtype == torch.bfloat16))
    return float(torch.linalg.vector_norm(c, dtype=torch.float64) ** 2)


_HALVES = (torch.float16, torch.bfloat16)


def _bits16(c: torch.Tensor) -> np.ndarray:
    """The uint16 bit patterns of an fp16 / bf16 CPU tensor (flat, as numpy)."""
    return c.detach().contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16)


def _sq_norm(t: torch.Tensor) -> float:
    """Sum of squares in float64, in chunks."""
    return sum(_chunk_sq(c) for c in _chunks(t))


# -- weights and norms ---------------------------------------------------------------------------
def check_weight(weight, max_weight: float = 0.0) -> float:
    """``weight`` as a float if it is a finite number > 0 and at most ``max_weight`` (0: only the
    hard limit 2**53); :class:`WeightError` naming the value otherwise."""
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise WeightError(f"weight must be a number, got {weight!r}")
    try:
        w = float(weight)
    except OverflowError:
        raise WeightError(f"weight {str(weight)[:40]} is too large to be a float") from None
    except (TypeError, ValueError):
        raise WeightError(f"weight must be a number, got {weight!r}") from None
    if not math.isfinite(w) or w <= 0:
        raise WeightError(f"weight must be a finite number > 0, got {w:g}")
    cap = min(max_weight, MAX_WEIGHT) if max_weight > 0 else MAX_WEIGHT
    if w > cap:
        which = f"max_weight={max_weight:g}" if max_weight > 0 and max_weight < MAX_WEIGHT else "the limit 2**53"
        raise WeightError(f"weight {w:g} exceeds {which}")
    return w


@dataclass
class NormGuard:
    """Per-round bound on update norms: absolute, and relative to the round's median norm.

    A reply is rejected when its update's L2 norm exceeds ``max_norm`` (0: no absolute bound)
    or ``factor`` times the lower median of the norms of the round's valid updates seen so far
    (this one included; 0: no relative bound). Until ``warmup`` norms are known the relative
    decision is deferred (:meth:`offer` returns None; :meth:`settle` decides the deferred ones
    once there are ``warmup`` norms or at the end of the round). A round with one reply is
    checked against ``max_norm`` only; with two, the smaller norm is the reference. A median of
    0 (every update zero) bounds nothing. A majority of hostile replies defeats any median.
    """

    factor: float = 10.0
    warmup: int = 3
    max_norm: float = 0.0
    norms: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("factor", "max_norm"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise FedcompError(f"{name}={v!r} is invalid: a finite number >= 0 (0 turns it off)")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 1:
            raise FedcompError(f"warmup={self.warmup!r} is invalid: a positive integer")

    def reset(self) -> None:
        self.norms = []

    def bound(self) -> float:
        """The relative bound now (inf: none yet or off)."""
        if not self.factor or not self.norms:
            return math.inf
        median = statistics.median_low(self.norms)
        return self.factor * median if median > 0 else math.inf

    def offer(self, norm: float) -> bool | None:
        """Record a valid update's norm: True (accept), False (reject) or None (decide later)."""
        if not math.isfinite(norm):
            raise UpdateRejected(f"update norm is {norm}")
        if self.max_norm and norm > self.max_norm:
            return False
        self.norms.append(norm)
        if self.factor and len(self.norms) < self.warmup:
            return None
        return norm <= self.bound()

    def ready(self) -> bool:
        """Whether deferred replies can be decided (warm-up reached)."""
        return not self.factor or len(self.norms) >= self.warmup

    def settle(self, norm: float) -> bool:
        """Decide a deferred reply with the bound as it stands."""
        return norm <= self.bound()

    def reason(self, norm: float) -> str:
        if self.max_norm and norm > self.max_norm:
            return (f"update norm {norm:.4g} exceeds max_update_norm={self.max_norm:g} (raise max-update-norm "
                    f"if such updates are legitimate)")
        return (f"update norm {norm:.4g} exceeds {self.factor:g} x the round's median norm "
                f"{self.bound() / self.factor:.4g} (norm_factor; 0 turns this guard off)")


# -- the streaming sum ---------------------------------------------------------------------------
class _Expanded:
    """A reducer's dense segment (PowerSGD's P_hat Q^T...), built range by range where the reducer
    can (its ``expand_range``), else expanded whole once per pass over the update."""

    def __init__(self, reducer, values: torch.Tensor, aux, seg) -> None:
        self.reducer, self.values, self.aux, self.seg = reducer, values, aux, seg
        self._range = getattr(reducer, "expand_range", None)
        self._y: torch.Tensor | None = None

    def chunk(self, lo: int, hi: int) -> torch.Tensor:
        if self._range is not None:
            return self._range(self.values, self.aux, self.seg, lo, hi)
        if self._y is None:
            self._y = self.reducer.expand(self.values, self.aux, self.seg)
        return self._y[lo:hi]

    def add_to(self, lo: int, hi: int, target: torch.Tensor, weight: float) -> bool:
        """``target += weight * chunk(lo, hi)`` in one fused loop where the reducer has one
        (``add_range``: PowerSGD's rows of P Q^T); False (nothing done) otherwise."""
        add = getattr(self.reducer, "add_range", None)
        return add is not None and add(self.values, self.aux, self.seg, lo, hi, target, weight)

    def adder(self):
        """``f(lo, hi, s, w)``: ``s += w * chunk(lo, hi)`` for a float64 numpy ``s`` in one fused
        loop, or None (see :meth:`fedcomp.codecs.values.Values.adder`)."""
        make = getattr(self.reducer, "range_adder", None)
        return None if make is None else make(self.values, self.aux, self.seg)

    def sq(self, lo: int, hi: int) -> float | None:
        """Sum of squares of ``chunk(lo, hi)`` without fresh memory where the reducer can
        (``sq_range``); None otherwise."""
        sq = getattr(self.reducer, "sq_range", None)
        return None if sq is None else sq(self.values, self.aux, self.seg, lo, hi)

    def sq_whole(self, lo: int, hi: int) -> float | None:
        """Sum of squares of ``chunk(lo, hi)`` computed at once where the reducer can
        (``sq_all``); None otherwise."""
        sq = getattr(self.reducer, "sq_all", None)
        return None if sq is None else sq(self.values, self.aux, self.seg, lo, hi)

    def release(self) -> None:
        self._y = None


def _tensor_chunks(source, start: int, offset: int, numel: int, dtype: torch.dtype):
    """(flat position, values in the tensor's dtype) of one tensor of a lazy segment, CHUNK by
    CHUNK from the tensor's start (the chunks :func:`_sq_norm` and the dense path use)."""
    for i in range(0, numel, CHUNK):
        yield start + offset + i, source.chunk(offset + i, offset + min(numel, i + CHUNK)).to(dtype)


def _fused_chunks(source, start: int, offset: int, numel: int, dtype: torch.dtype, target: torch.Tensor, w: float):
    """:func:`_tensor_chunks`, except that chunks ``source.add_to`` adds into ``target`` (this
    tensor's float64 sum) are added there and not yielded (fp32 values to an fp32 or fp64
    tensor: the cast :func:`_tensor_chunks` does is exact, so the sum has the same bits)."""
    for i in range(0, numel, CHUNK):
        lo, hi = offset + i, offset + min(numel, i + CHUNK)
        if not source.add_to(lo, hi, target[i:i + hi - lo], w):
            yield start + lo, source.chunk(lo, hi).to(dtype)


def _square_chunks(source, start: int, offset: int, numel: int, dtype: torch.dtype):
    """:func:`_tensor_chunks` with each chunk's sum of squares (float) in place of its values
    where ``source.sq`` computes it; one float for the whole tensor where ``source.sq_whole``
    does (PowerSGD: from its factors, without building a value)."""
    whole = getattr(source, "sq_whole", None)
    total = whole(offset, offset + numel) if whole is not None else None
    if total is not None:
        yield start + offset, total
        return
    for i in range(0, numel, CHUNK):
        lo, hi = offset + i, offset + min(numel, i + CHUNK)
        sq = source.sq(lo, hi)
        yield start + lo, (sq if sq is not None else source.chunk(lo, hi).to(dtype))


@dataclass
class Update:
    """One decoded, checked reply, in its compact form.

    ``parts``: (offset in the flat float buffer, positions or None for dense, values) per piece;
    ``ints``: integer tensors by name (raw). :meth:`norm` is the L2 norm of the float values.
    ``lazy``: segments whose dense values are built on demand, chunk by chunk (a dense codec's
    values still coded, PowerSGD's factors): (offset, source, [(name, numel, dtype)]) with
    ``source.chunk(lo, hi)`` the fp32 values of the segment's elements [lo, hi). They are built
    once to check and measure (:meth:`norm`) and once more to add, never whole.
    """

    parts: list[tuple[int, torch.Tensor | None, torch.Tensor]]
    ints: dict[str, torch.Tensor]
    _norm: float | None = None
    lazy: list[tuple[int, object, list]] = field(default_factory=list)
    nbytes: int = 0  # the payload it was read from (kept alive while the update waits in a batch)
    run: object | None = None  # every dense segment at once (fastpath.RunReply), for compiled checks and adds
    names: list[str] = field(default_factory=list)  # the run's segments' tensors, in order
    held: tuple[torch.Tensor, torch.Tensor] | None = None  # waiting sparse reply: (ascending flat positions, fp32 values)
    ascending: bool = False  # the parts' positions are ascending, parts in order of offset (reads_ascending)

    def _read_lazy(self) -> None:
        """A run read the per-segment way (:attr:`lazy`), for callers that take pieces."""
        if self.run is not None and not self.lazy:
            codec, payload, layout, device = self.run.read
            read, _ = codec.decode_parts(payload, layout, device, lazy=True)
            self.lazy = _lazy_segments(codec, read, layout, Accumulator.offsets(layout))

    def _lazy_tensors(self, fused=None, squares: bool = False):
        """(name, chunks) per tensor of the lazy segments; chunks as :func:`_tensor_chunks`.

        ``fused``: (per-tensor float64 sums, weight): a chunk whose source adds it into the sum
        in one loop (``source.add_to``: fp32/fp64 tensors, CPU kernels) is added here and not
        yielded. ``squares``: a chunk's sum of squares (a float) instead of its values where the
        source computes it in place (``source.sq``: fp32/fp64 tensors, CPU kernels)."""
        self._read_lazy()
        for start, source, tensors in self.lazy:
            offset = 0
            for name, numel, dtype in tensors:  # each tensor in its dtype, as Codec.decode returns it
                if squares and dtype in (torch.float32, torch.float64) and hasattr(source, "sq"):
                    yield name, _square_chunks(source, start, offset, numel, dtype)
                elif fused is not None and dtype in (torch.float32, torch.float64) and hasattr(source, "add_to"):
                    yield name, _fused_chunks(source, start, offset, numel, dtype, fused[0][name], fused[1])
                else:
                    yield name, _tensor_chunks(source, start, offset, numel, dtype)
                offset += numel
            release = getattr(source, "release", None)
            if release is not None:
                release()

    def pieces(self):
        """(offset, positions or None, values) of every part; lazy segments in chunks of at most
        ``CHUNK`` elements, built one at a time (a piece never spans two tensors)."""
        yield from self.parts
        for _, chunks in self._lazy_tensors():
            for start, v in chunks:
                yield start, None, v

    def norm(self) -> float:
        """L2 norm of the float values; :class:`UpdateRejected` for a lazily built NaN or Inf."""
        if self._norm is None:
            total = 0.0
            for _, _, v in self.parts:
                total += _sq_norm(v)
            if self.run is not None and not self.lazy:  # per tensor, as below, in one compiled call
                for name, sq in zip(self.names, self.run.sq(CHUNK).tolist()):
                    if not math.isfinite(sq):
                        raise UpdateRejected(f"update of {name!r} has NaN or Inf values")
                    total += sq
                self._norm = math.sqrt(total)
                return self._norm
            for name, chunks in self._lazy_tensors(squares=True):
                sq = 0.0  # per tensor, chunk by chunk: the sum _sq_norm forms for a dense tensor
                for _, v in chunks:
                    # squares of decoded (fp32-range) values cannot overflow in float64: the
                    # chunk's norm is finite exactly when all its values are
                    part = v if isinstance(v, float) else _chunk_sq(v)
                    if not math.isfinite(part):
                        raise UpdateRejected(f"update of {name!r} has NaN or Inf values")
                    sq += part
                total += sq
            self._norm = math.sqrt(total)
        return self._norm

    def dense(self, layout_offsets: Mapping[str, tuple[int, int]], shapes: Mapping[str, tuple]) -> dict:
        """Named dense tensors (fp32 values) of this update (for strategies that need models)."""
        total = sum(n for _, n in layout_offsets.values())
        flat = torch.zeros(total, dtype=torch.float32, device=self.parts[0][2].device if self.parts else "cpu")
        for start, idx, vals in self.pieces():
            if idx is None:
                flat[start:start + vals.numel()] = vals.reshape(-1)
            else:
                flat.index_add_(0, idx + start, vals.float())
        out = {name: flat[a:a + n].view(shapes[name]) for name, (a, n) in layout_offsets.items()}
        out.update({name: t.view(shapes[name]) for name, t in self.ints.items()})
        return out


def _lazy_segments(codec, read, layout, offsets: Mapping[str, tuple[int, int]]) -> list:
    """:attr:`Update.lazy` of what ``codec.decode_parts(..., lazy=True)`` read."""
    lazy = []
    for seg, group, aux, vals in read:
        tensors = [(layout.tensors[i].name, layout.tensors[i].numel, layout.tensors[i].torch_dtype) for i in group]
        source = vals if codec.reducer is None else _Expanded(codec.reducer, vals, aux, seg)
        lazy.append((offsets[tensors[0][0]][0], source, tensors))
    return lazy


class Accumulator:
    """Weighted running sum of decoded updates, one reply at a time.

    Parameters
    ----------
    codec : Codec or PolicyCodec
        The upload codec the replies were encoded with (``fedcomp.build_codec(spec)``).
    layout : Layout
        The model's layout; every reply must match it.
    device : torch.device or str (default: ``"cpu"``)
        Where the running sum lives and replies are decoded.
    batch : int (default: 8)
        Dense replies (quantizer codes, PowerSGD factors) whose fused adds share one pass over
        the float64 sum. A checked reply waits, compact (its codes are views of its payload),
        until ``batch`` of them are there, their payloads reach four times the sum's size (32
        bytes per element: fp32 replies go eight at a time), or the sum is read (:meth:`flush`); then
        each chunk of the sum (512 kB for a quantizer's replies, 2 MB for sparse ones: in the cache)
        takes every waiting reply in arrival order. The sum
        has the bits of adding them one at a time (the same additions per element, in the same
        order); the sum's memory traffic (16 bytes per element and pass, more than a 4-bit
        reply's 0.5) is paid once per batch. 1: each reply is added when it arrives.
    """

    def __init__(self, codec, layout, device: torch.device | str = "cpu", batch: int = BATCH) -> None:
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
            raise AggregationError(f"batch={batch!r}: replies added per pass over the sum must be an integer >= 1")
        self.batch = int(batch)
        self.codec = codec
        self.layout = layout
        self.device = torch.device(device)
        self._offsets = self.offsets(layout)
        offset = sum(n for _, n in self._offsets.values())
        self._numel = offset
        # replies read at once (Codec.read_run): fp16 / bf16 tensors' values rounded in the loops
        self._runs = all(t.torch_dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
                         for t in layout.tensors if t.is_float)
        self._shapes = {t.name: t.shape for t in layout.tensors}
        self._start_list = [start for start, _ in self._offsets.values()]  # ascending: layout order
        self._names = list(self._offsets)
        self._starts = torch.tensor([start for start, _ in self._offsets.values()] + [offset], dtype=torch.int64)
        # one float64 sum per tensor (freed tensor by tensor when the mean is applied)
        self._sums: dict[str, torch.Tensor] | None = None
        self._ints: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[Update, float]] = []  # checked dense replies not yet in the sum
        self._pending_bytes = 0  # their payloads: at most four float64 sums' worth wait (PENDING_SUMS)
        self._spent = False
        reducer = getattr(codec, "reducer", None)
        # scatter-add path: a selector whose dense form is "values at positions, zero elsewhere"
        self.sparse = (
            isinstance(codec, Codec) and isinstance(reducer, Selector) and type(reducer).expand is Selector.expand
        )
        self.reset()

    @staticmethod
    def offsets(layout) -> dict[str, tuple[int, int]]:
        """(offset in the flat float buffer, numel) of each float tensor, in layout order."""
        out, offset = {}, 0
        for t in layout.tensors:
            if t.is_float:
                out[t.name] = (offset, t.numel)
                offset += t.numel
        return out

    # -- decoding ------------------------------------------------------------------------------
    def decode(self, payload: bytes, *, round: int = 0, codec=None) -> Update:
        """Read and check one reply (``codec``: a budgeted client's own codec of the same family).

        Raises :class:`fedcomp.DecodeError` for a malformed payload and :class:`UpdateRejected`
        for non-finite values.
        """
        codec = self.codec if codec is None else codec
        sparse = self.sparse if codec is self.codec else self._is_sparse(codec)
        if sparse:
            read, raw = codec.decode_parts(payload, self.layout, self.device, round=round)
            parts = []
            for seg, group, idx, vals in read:
                if vals.numel() != idx.numel():
                    raise DecodeError(f"{vals.numel()} values for {idx.numel()} positions")
                parts.append((self._offsets[self.layout.tensors[group[0]].name][0], idx, vals))
            ints = {self.layout.tensors[i].name: t for i, t in raw.items()}
            ascending = reads_ascending(codec.reducer) and all(a[0] < b[0] for a, b in zip(parts, parts[1:]))
        elif isinstance(codec, Codec):
            got = codec.read_run(payload, self.layout, self.device, sq_chunk=CHUNK) if self._runs else None
            if got is not None:  # every segment at once: compiled check and add
                run, raw = got
                update = Update([], {self.layout.tensors[i].name: t for i, t in raw.items()}, nbytes=len(payload),
                                run=run, names=self._names)
                update.norm()
                return update
            # dense values stay coded (quantizers: Values) or factored (reducers), built chunk by chunk
            read, raw = codec.decode_parts(payload, self.layout, self.device, round=round, lazy=codec.reducer is None)
            lazy = _lazy_segments(codec, read, self.layout, self._offsets)
            update = Update([], {self.layout.tensors[i].name: t for i, t in raw.items()}, lazy=lazy, nbytes=len(payload))
            update.norm()  # the check: non-finite values raise here, before anything is added
            return update
        else:
            decoded = codec.decode(payload, self.layout, self.device, round=round)
            return self.dense_update(decoded)
        for _, _, vals in parts:
            if not _finite(vals):
                raise UpdateRejected("update has NaN or Inf values")
        return Update(parts, ints, ascending=ascending)

    def dense_update(self, tensors: Mapping[str, torch.Tensor]) -> Update:
        """An :class:`Update` of named dense tensors matching the layout (checked like payloads)."""
        missing = [n for n in self.layout.names if n not in tensors]
        if missing:
            raise AggregationError(f"update lacks tensors {missing[:3]} of the layout")
        parts = []
        for name, (start, numel) in self._offsets.items():
            t = tensors[name]
            if t.numel() != numel:
                raise AggregationError(f"update of {name!r} has {t.numel()} elements, the layout says {numel}")
            if not _finite(t):
                raise UpdateRejected(f"update of {name!r} has NaN or Inf values")
            parts.append((start, None, t))
        ints = {}
        for spec in self.layout.tensors:
            if spec.is_float:
                continue
            t = tensors[spec.name]
            if t.numel() != spec.numel:
                raise AggregationError(f"update of {spec.name!r} has {t.numel()} elements, the layout says {spec.numel}")
            ints[spec.name] = t
        return Update(parts, ints)

    def _is_sparse(self, codec) -> bool:
        reducer = getattr(codec, "reducer", None)
        return isinstance(codec, Codec) and isinstance(reducer, Selector) and type(reducer).expand is Selector.expand

    # -- adding --------------------------------------------------------------------------------
    def add_update(self, update: Update, weight: float) -> None:
        """Add ``weight * update`` (weight checked by :func:`check_weight`)."""
        w = check_weight(weight)
        if self._spent:
            raise AggregationError("the accumulator's mean was taken; reset() it before adding")
        if not math.isfinite(self.total_weight + w):
            raise AggregateOverflow(f"total weight {self.total_weight:g} + {w:g} overflows")
        if self._sums is None:  # allocated at the first reply of a round, freed by apply_mean
            # CPU sums from calloc where large (wire.host_zeros): torch.zeros would write every
            # fresh 4 kB page of them
            self._sums = {name: host_zeros(numel, torch.float64) if self.device.type == "cpu"
                          else torch.zeros(numel, dtype=torch.float64, device=self.device)
                          for name, (_, numel) in self._offsets.items()}
            self._ints = {t.name: torch.zeros(t.shape, dtype=torch.float64, device=self.device)
                          for t in self.layout.tensors if not t.is_float}
        for name, t in update.ints.items():
            self._ints[name].add_(t.to(self.device, torch.float64).view(self._ints[name].shape), alpha=w)
        self.total_weight += w
        self.count += 1
        update.held = self._held(update) if update.parts else None
        if update.held is not None or self._batchable(update):
            self._pending.append((update, w))
            # what waits: payloads up to PENDING_SUMS float64 sums' worth; decoded sparse replies
            # (fresh memory, unlike payloads) up to a quarter of that (smaller batches were faster)
            held = 0 if update.held is None else sum(t.nbytes for t in update.held)
            self._pending_bytes += 2 * PENDING_SUMS * held or update.nbytes
            if len(self._pending) >= self.batch or self._pending_bytes >= 8 * PENDING_SUMS * self._numel:
                self.flush()
            return
        self.flush()  # what waits goes first: every element's additions stay in arrival order
        for start, idx, vals in update.parts:
            if idx is not None:
                self._scatter(idx.to(self.device) + start if start else idx.to(self.device), vals, w)
                continue
            j = bisect.bisect_right(self._start_list, start) - 1  # the tensor holding this piece
            self._add_dense(self._sums[self._names[j]], start - self._start_list[j], vals.reshape(-1), w)
        for name, chunks in update._lazy_tensors(fused=(self._sums, w)):
            for start, v in chunks:  # what a fused loop did not add already
                self._add_dense(self._sums[name], start - self._offsets[name][0], v.reshape(-1), w)

    def _batchable(self, update: Update) -> bool:
        """Whether ``update`` can wait for a batched pass: CPU sums, only lazy segments (no
        positions or decoded values to hold), and a batch of more than one."""
        if self.device.type != "cpu" or update.parts:
            return False
        return update.run is not None if not update.lazy else self.batch > 1

    def _held(self, update: Update) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A sparse reply as it waits in a batch (ascending flat positions, fp32 values), or None
        where it is added at once (not CPU, no compiled loops, batch 1, other dtypes)."""
        if self.device.type != "cpu" or self.batch <= 1 or update.lazy or update.run is not None \
                or kernels.get() is None:
            return None
        pos, vals = [], []
        for start, idx, v in update.parts:
            if idx is None or idx.dtype != torch.int64 or v.dtype != torch.float32 \
                    or idx.device.type != "cpu" or v.device.type != "cpu":
                return None
            pos.append(idx + start if start else idx)
            vals.append(v.detach().reshape(-1))
        pos, vals = (pos[0], vals[0]) if len(pos) == 1 else (torch.cat(pos), torch.cat(vals))
        if update.ascending:  # a selector's positions, in order already (an ordering pass of 20 MB at a tenth of 25M)
            return pos.contiguous(), vals.contiguous()
        return _ascending(pos.contiguous(), vals.contiguous())

    def flush(self) -> None:
        """Add the waiting replies (see ``batch``): per tensor, per chunk of its sum, every reply
        in arrival order, each through its fused loop where it has one."""
        pending, self._pending, self._pending_bytes = self._pending, [], 0

        def kind(u: Update):
            if u.held is not None:
                return "sparse"
            if u.run is not None and not u.lazy:
                return "run", type(u.run.quantizer), u.run.quantizer.config
            return "lazy"
        i = 0
        while i < len(pending):  # groups in arrival order: runs of one codec together, the rest alike
            j, first = i + 1, kind(pending[i][0])
            while j < len(pending) and kind(pending[j][0]) == first:
                j += 1
            if first == "sparse":
                self._add_sparse(pending[i:j])
            elif first == "lazy":
                self._flush_lazy(pending[i:j])
            else:
                self._add_runs(pending[i:j])
            i = j

    def _add_sparse(self, pending: list[tuple[Update, float]]) -> None:
        """Sparse replies (:attr:`Update.held`) into the sums in one compiled call, chunk by chunk
        of the sums (at a tenth kept, every cache line of the sum is touched by every reply)."""
        starts = self._starts.numpy()
        cuts = np.stack([np.searchsorted(u.held[0].numpy(), starts) for u, _ in pending])
        pos_at, val_at = (np.array([u.held[i].data_ptr() for u, _ in pending], dtype=np.int64) for i in (0, 1))
        kernels.get().add_at_runs(self._sum_addresses(), starts[:-1], np.diff(starts), pos_at, val_at, cuts,
                                  np.array([w for _, w in pending], dtype=np.float64), SUM_CHUNK)
        for u, _ in pending:
            u.held = None

    def _sum_addresses(self) -> np.ndarray:
        """The data addresses of the per-tensor float64 sums, in layout order (for compiled adds)."""
        return np.fromiter((self._sums[name].data_ptr() for name in self._names), dtype=np.int64,
                           count=len(self._names))

    def _add_runs(self, pending: list[tuple[Update, float]]) -> None:
        """Replies read at once (:attr:`Update.run`) into the sums in one compiled call."""
        q = pending[0][0].run.quantizer
        q.add_runs(kernels.get(), [u.run for u, _ in pending], np.array([w for _, w in pending], dtype=np.float64),
                    self._sum_addresses(), RUN_SUM_CHUNK)

    def _flush_lazy(self, pending: list[tuple[Update, float]]) -> None:
        plans = []  # per reply: tensor name -> (adder or None, source, offset in the segment, dtype)
        for update, w in pending:
            plan = {}
            for _, source, tensors in update.lazy:
                offset = 0
                for name, numel, dtype in tensors:
                    fused = dtype in (torch.float32, torch.float64) and hasattr(source, "adder")
                    plan[name] = (source.adder() if fused else None, source, offset, dtype)
                    offset += numel
            plans.append((plan, w))
        for name, (_, numel) in self._offsets.items():
            target = self._sums[name]
            host = target.numpy()
            for i in range(0, numel, SUM_CHUNK):
                j = min(numel, i + SUM_CHUNK)
                for plan, w in plans:
                    add, source, offset, dtype = plan[name]
                    if add is not None:
                        add(offset + i, offset + j, host[i:j], w)
                    else:
                        self._add_dense(target, i, source.chunk(offset + i, offset + j).to(dtype).reshape(-1), w)
        for update, _ in pending:
            for _, source, _ in update.lazy:
                release = getattr(source, "release", None)
                if release is not None:
                    release()

    def _add_dense(self, target: torch.Tensor, local: int, flat: torch.Tensor, w: float) -> None:
        k = kernels.get() if flat.dtype in _HALVES and flat.device.type == "cpu" and target.device.type == "cpu" \
            and target.dtype == torch.float64 else None
        if k is not None:  # fp16 / bf16 values (a model's tensor of that dtype) in one loop: add_'s bits
            k.add_half(_bits16(flat), flat.dtype == torch.bfloat16, target[local:local + flat.numel()].numpy(), float(w))
            return
        for i in range(0, flat.numel(), CHUNK):  # the float64 temporaries stay chunk-sized
            piece = flat[i:i + CHUNK]
            target[local + i:local + i + piece.numel()].add_(piece.to(self.device), alpha=w)

    def _scatter(self, pos: torch.Tensor, vals: torch.Tensor, w: float) -> None:
        """Scatter-add values at flat positions (over all float tensors) into the per-tensor sums."""
        pos, vals = _ascending(pos, vals)
        cuts = torch.searchsorted(pos, self._starts.to(pos.device)).tolist()
        k = kernels.get() if self.device.type == "cpu" and pos.device.type == "cpu" and vals.device.type == "cpu" \
            and pos.dtype == torch.int64 and vals.dtype in (torch.float32, torch.float64) else None
        if k is not None:  # one loop per tensor: the bits of index_add_
            pos_np, vals_np = pos.contiguous().numpy(), vals.detach().contiguous().numpy()
        for (name, (start, _)), a, b in zip(self._offsets.items(), cuts[:-1], cuts[1:]):
            if b <= a:
                continue
            if k is not None:
                k.add_at(self._sums[name].numpy(), pos_np[a:b], start, vals_np[a:b], float(w))
            else:
                self._sums[name].index_add_(0, pos[a:b] - start, vals[a:b].to(self.device, torch.float64), alpha=w)

    def add(self, payload: bytes, weight: float, *, round: int = 0) -> None:
        """Decode one reply and add ``weight`` times its update; on any error the sum is unchanged."""
        check_weight(weight)
        self.add_update(self.decode(payload, round=round), weight)

    def add_dense(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        """Add ``weight`` times a dense update (named tensors matching the layout)."""
        check_weight(weight)
        self.add_update(self.dense_update(tensors), weight)

    # -- results -------------------------------------------------------------------------------
    def _need(self) -> None:
        self.flush()
        if self._spent:
            raise AggregationError("the accumulator's mean was taken already; reset() it for the next round")
        if not self.total_weight > 0 or self._sums is None:
            raise AggregationError(f"no weight to average over (total weight {self.total_weight}, {self.count} replies)")

    def sum(self) -> dict[str, torch.Tensor]:
        """The weighted sum so far, per tensor (float64)."""
        if self._spent:
            raise AggregationError("the accumulator's mean was taken already; reset() it for the next round")
        self.flush()
        if self._sums is None:
            return {t.name: torch.zeros(t.shape, dtype=torch.float64, device=self.device) for t in self.layout.tensors}
        return {t.name: (self._sums[t.name] if t.is_float else self._ints[t.name]).view(t.shape).clone()
                for t in self.layout.tensors}

    def mean(self, *, release: bool = False) -> dict[str, torch.Tensor]:
        """Weighted mean of the updates added, in the layout's dtypes (integer tensors rounded);
        :class:`AggregateOverflow` where a value does not fit its dtype.

        The sums stay (more replies may follow), so this holds them and the result at once: three
        dense copies for fp32 tensors (float64 sums, fp32 result). An fp32 CPU tensor's mean is
        divided straight into its output (numpy's ``divide(..., out=)``, whose buffered loop casts a
        few thousand quotients at a time: the bits of ``(sum / total).to(float32)``, without that
        expression's float64 temporary of the tensor's size, which ``torch.div(..., out=)`` makes
        too). ``release=True``: the round ends here, as with :meth:`apply_mean`: tensor by tensor,
        smallest first, each sum is freed once its mean is formed (the peak is the sums plus the
        smallest results); call :meth:`reset` before the next round."""
        self._need()
        sums, ints, total = self._sums, self._ints, self.total_weight
        if release:
            self._sums, self._ints, self._spent = None, {}, True
        out = {}
        for t in (sorted(self.layout.tensors, key=lambda t: t.numel) if release else self.layout.tensors):
            if t.is_float and t.torch_dtype == torch.float32 and self.device.type == "cpu":
                mean = torch.empty(t.shape, dtype=t.torch_dtype)
                with np.errstate(over="ignore", invalid="ignore"):  # inf is refused below
                    np.divide(sums[t.name].numpy(), total, out=mean.view(-1).numpy(), casting="same_kind")
                out[t.name] = mean
            elif t.is_float:
                out[t.name] = (sums[t.name] / total).view(t.shape).to(t.torch_dtype)
            else:
                out[t.name] = torch.round(ints[t.name] / total).to(t.torch_dtype)
            if release:
                (sums if t.is_float else ints).pop(t.name)
        out = {name: out[name] for name in self.layout.names}
        self._check_finite(out)
        return out

    def apply_mean(self, reference: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``reference + weighted mean`` in the reference's dtypes (:func:`apply_step`).

        Tensor by tensor, smallest first, the mean is formed in place in its float64 sum, applied,
        and the sum freed: each output tensor (4 bytes an element) replaces a larger sum (8), so
        the peak is the sums plus the smallest tensors. Call :meth:`reset` before the next round.
        """
        self._need()
        sums, ints, total = self._sums, self._ints, self.total_weight
        self._sums, self._ints, self._spent = None, {}, True
        out = {}
        for t in sorted(self.layout.tensors, key=lambda t: t.numel):
            if t.is_float:
                mean = sums.pop(t.name).div_(total).view(t.shape)
            else:
                mean = ints.pop(t.name) / total
            out[t.name] = _apply_one(reference[t.name], mean)
            del mean
        out = {name: out[name] for name in self.layout.names}
        self._check_finite(out)
        return out

    @staticmethod
    def _check_finite(out: Mapping[str, torch.Tensor]) -> None:
        for name, t in out.items():
            if t.is_floating_point() and not _finite(t):
                raise AggregateOverflow(f"the aggregate of {name!r} does not fit {t.dtype} (it would be inf)")

    def reset(self) -> None:
        """An empty sum for the next round (buffers are allocated at the first reply)."""
        self._pending, self._pending_bytes = [], 0
        if self._sums is not None:
            for v in (*self._sums.values(), *self._ints.values()):
                v.zero_()
        self._spent = False
        self.total_weight = 0.0
        self.count = 0

    def to_dense(self, update: Update) -> dict[str, torch.Tensor]:
        """Named dense fp32 tensors of an update (integer tensors raw)."""
        return update.dense(self._offsets, self._shapes)
