"""Selectors (sparsifiers): which elements of a segment travel, and how their positions are coded.

Top-k without a sort: :func:`sampled_topk` estimates the k-th largest |x| on a random sample
and selects against it (DGC's selection, and the adaptive threshold's); :func:`exact_topk_sampled`
(``topk``) cuts below a sampled estimate and selects exactly the top k among the few candidates
above the cut; :func:`exact_topk` is the partial-selection fallback.

Index coding (``index=``): ``rice`` codes the gaps between sorted positions (Golomb-Rice, within
about 1% of log2 C(n, k) for top-k), ``fixed`` spends ceil(log2 n) bits per position and has a
size that depends on k only. Random-k sends no positions: the decoder regenerates them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp import kernels, uniforms
from fedcomp.base import Quantizer, Segment, Selector, StageContext, register
from fedcomp.bitpack import (
    choose_rice_parameter,
    fixed_index_bits,
    pack_bits,
    packed_bytes,
    rice_decode,
    rice_encode,
    unpack_bits,
)
from fedcomp.errors import DecodeError
from fedcomp.pieces import Pieces
from fedcomp.codecs.sign import FixedSign, Sign
from fedcomp.wire import Reader, Writer

SCOPES = ("global", "tensor")
INDEX_CODINGS = ("rice", "fixed")
THRESHOLD_MODES = ("abs", "signed")

# sampled top-k (Lin et al. 2018, DGC; the reference code uses the same constants)
SAMPLE_MIN = 1024  # at least this many |x| samples (LBANN's count); smaller segments use exact top-k
SLACK_LOW, SLACK_HIGH = 0.8, 1.3  # accept a threshold that passes between 0.8k and 1.3k elements
LOWER = 0.8  # factor applied to a threshold that passes fewer than 0.8k
TRIES = 10  # thresholds tried before falling back to exact top-k
_SAMPLE_STREAM = 1 << 32  # offset of the sampling generators' seeds from the quantizers' (ctx.generator)


def _kept(ratio: float, n: int) -> int:
    """ceil(ratio * n), at least 1; the product is rounded first so 0.07 * 100 keeps 7, not 8."""
    return min(n, max(1, math.ceil(round(ratio * n, 6)))) if n else 0


def exact_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted positions of the k largest entries of ``mag`` (partial selection, no full sort)."""
    return torch.topk(mag, k, sorted=False).indices.sort().values


# exact top-k through a sampled threshold (TopK.select)
_TOPK_RANK = 64  # the sample is sized so that the k-th largest |x| sits about this far down it
_TOPK_MARGIN = 5.0  # the cut is taken that many standard deviations further down (P(miss) ~ 3e-7)
_SAMPLE_RUN = 16  # sampled positions come in aligned runs of 16 (one 64-byte cache line of fp32)
_CHUNK = 1 << 18  # elements scanned per step (1 MB): the chunk's temporaries stay in cache
_CAND_CAP = 1 << 20  # candidates the fused scan collects before it leaves a part to numpy
_TIED = 64  # more than this many times k candidates: the cut sits on a tie (or a badly off sample)


def _flat_parts(x: torch.Tensor | Pieces) -> list[tuple[int, torch.Tensor]]:
    return [(0, x)] if isinstance(x, torch.Tensor) else list(zip(x.starts, x.parts))


def _candidates(x: torch.Tensor | Pieces, thr: float, strict: bool = False) -> torch.Tensor:
    """Sorted positions with |x| >= thr (|x| > thr if ``strict``) in one read pass over x.

    On the CPU the scan runs in numpy over cache-sized chunks with reused buffers: torch's
    per-op overhead and ``nonzero`` cost 5-10 read passes there, and a full-size ``x.abs()``
    pays a page fault per 4 kB of fresh memory. Elsewhere (GPU) it is one fused-enough torch pass.
    """
    out = []
    cmp = np.greater if strict else np.greater_equal
    t = np.float32(thr)
    buf = mask = None
    k = kernels.for_encode()
    hosts = getattr(x, "_host", None) or [None] * len(_flat_parts(x))  # Pieces' numpy views, made once
    for (start, part), host in zip(_flat_parts(x), hosts):
        n = part.numel()
        if k is not None and part.device.type == "cpu" and part.dtype == torch.float32 and part.is_contiguous():
            hits = kernels.scratch(min(n, _CAND_CAP), np.int64)  # one pass, blocks below t skipped
            c = k.candidates(_host(part) if host is None else host, t, strict, hits)
            if c >= 0:
                if c:
                    out.append(hits[:c] + start)  # numpy until the end: one tensor made, not one a piece
                continue
        if part.device.type != "cpu":
            mag = part.abs()
            hit = torch.nonzero(mag > thr if strict else mag >= thr).reshape(-1)
            out.append(hit + start if start else hit)
            continue
        if buf is None:
            size = min(_CHUNK, max(p.numel() for _, p in _flat_parts(x)))
            buf, mask = np.empty(size, np.float32), np.empty(size, bool)
        xn = _host(part) if host is None else host
        for lo in range(0, n, _CHUNK):
            chunk = xn[lo:lo + _CHUNK]
            b, mk = buf[:chunk.size], mask[:chunk.size]
            np.abs(chunk, out=b)
            cmp(b, t, out=mk)
            hit = np.flatnonzero(mk)
            if hit.size:
                out.append(hit + (start + lo))
    if not out:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if all(isinstance(o, np.ndarray) for o in out):
        return torch.from_numpy(np.concatenate(out) if len(out) > 1 else out[0])
    out = [torch.from_numpy(o) if isinstance(o, np.ndarray) else o for o in out]
    return torch.cat(out) if len(out) > 1 else out[0]


def _host(part: torch.Tensor) -> np.ndarray:
    """A flat CPU tensor's values as numpy (no torch op where it is flat, contiguous and detached)."""
    if part.requires_grad or part.dim() != 1 or not part.is_contiguous():
        part = part.detach().reshape(-1)
    return part.numpy()


def _first_zeros(x: torch.Tensor | Pieces, nonzero: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` lowest positions where |x| is not > 0, given the sorted positions ``nonzero``
    of the others: all lie below count + len(nonzero)."""
    span = torch.arange(count + nonzero.numel(), device=nonzero.device)
    free = torch.ones(span.numel(), dtype=torch.bool, device=nonzero.device)
    free[nonzero[nonzero < span.numel()]] = False
    return span[free][:count]


def _gather(x: torch.Tensor | Pieces, idx: torch.Tensor) -> torch.Tensor:
    # index_select: ~6x faster than x[idx] on the CPU (25M elements, 39k positions: 0.33 ms / 2.1 ms)
    return torch.index_select(x, 0, idx) if isinstance(x, torch.Tensor) else x.gather_sorted(idx)


def _full(x: torch.Tensor | Pieces) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x.cat()


def exact_topk_sampled(x: torch.Tensor | Pieces, k: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted positions of the k largest |x|: the same set as :func:`exact_topk` (up to ties),
    found without a partial selection over all of x. ``x``: a flat tensor, or :class:`Pieces`
    (several tensors seen as one, scanned in place).

    1. Sample m = ceil(64 n / k) positions in aligned runs of 16 (at least SAMPLE_MIN = 1,024; if
       m >= n / 4 the sample would not pay: exact top-k).
    2. Cut at the r-th largest sampled |x|, r = 64 + 5 sqrt(64) + 1 = 105: about 1.6k elements
       lie above it, fewer than k with probability ~3e-7 for i.i.d. positions.
    3. Candidates: every position with |x| >= cut, in one chunked pass over x.
    4. At least k candidates: the top k among them (exactly the top k of x, since every other
       element is below the cut). Fewer: exact top-k of the whole vector.

    Ties stay fast: a cut of 0 (an update that is mostly zeros) takes the nonzero elements as
    candidates; a cut on a tie (more than 64k candidates) keeps every candidate above it. Where
    fewer than k elements are strictly larger than the tied value, the tie is broken towards the
    lowest positions (zeros included), the same on every device.
    """
    n = x.numel()
    m = max(SAMPLE_MIN, math.ceil(_TOPK_RANK * n / max(k, 1)))
    if k <= 0 or 4 * m >= n:
        return exact_topk(_full(x).abs(), k)
    runs = m // _SAMPLE_RUN
    # runs drawn with replacement, in ascending order: two equal starts repeat a run, and the
    # positions are ascending (what Pieces.gather_sorted needs) only once sorted; the cut does not
    # depend on the sample's order, so sorting changes nothing else
    starts = (torch.randint(n // _SAMPLE_RUN, (runs,), generator=gen) * _SAMPLE_RUN).sort().values
    pos = (starts[:, None] + torch.arange(_SAMPLE_RUN)).reshape(-1)
    if runs > 1 and bool((starts[1:] == starts[:-1]).any()):
        pos = pos.sort().values
    pos = pos.to(x.device)
    sample = (torch.index_select(x, 0, pos) if isinstance(x, torch.Tensor) else x.gather_sorted(pos)).abs()
    r = min(sample.numel(), math.ceil(k * sample.numel() / n + _TOPK_MARGIN * math.sqrt(_TOPK_RANK)) + 1)
    thr = float(torch.topk(sample, r, sorted=False).values.min())
    if thr == 0:  # most of x is zero: the nonzero elements, then the lowest zero positions
        idx = _candidates(x, 0.0, strict=True)
        if idx.numel() < k:
            return torch.cat([idx, _first_zeros(x, idx, k - idx.numel())]).sort().values
    else:
        idx = _candidates(x, thr)
        if idx.numel() < k:
            return exact_topk(_full(x).abs(), k)
    if idx.numel() == k:
        return idx
    mag = _gather(x, idx).abs()
    if idx.numel() > _TIED * k and thr > 0:  # the cut sits on a tie: what is above it, then the tie
        above = mag > thr
        a = int(above.sum())
        if a < k:
            tied = idx[~above][: k - a]
            return torch.cat([idx[above], tied]).sort().values
    return idx[torch.topk(mag, k, sorted=False).indices].sort().values


def nonzero_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k of the nonzero entries of ``mag`` (>= 0): all of them where at most k are nonzero."""
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=mag.device)
    if int(torch.count_nonzero(mag)) <= k:
        return torch.nonzero(mag).reshape(-1)
    return exact_topk(mag, k)


def sampled_threshold(mag: torch.Tensor, k: int, gen: torch.Generator, sample: float) -> torch.Tensor | None:
    """Estimate of the k-th largest entry of ``mag`` from a random sample of it.

    The sample holds m = max(SAMPLE_MIN, ceil(sample * n)) positions drawn with replacement from
    ``gen`` (a CPU generator: the same positions on every device); the estimate is the
    ceil(k * m / n)-th largest sampled value. None when m >= n (use the exact top-k).
    """
    n = mag.numel()
    m = max(SAMPLE_MIN, math.ceil(sample * n))
    if m >= n:
        return None
    pos = torch.randint(n, (m,), generator=gen).to(mag.device)
    return torch.topk(mag[pos], max(1, math.ceil(k * m / n)), sorted=False).values.min()


def topk_from_threshold(mag: torch.Tensor, k: int, thr: torch.Tensor | float) -> torch.Tensor:
    """Sorted positions of about the k largest entries of ``mag`` (>= 0, e.g. |x|), by DGC's
    threshold rule, starting from the estimate ``thr``:

    1. c = #{j : mag_j >= thr and mag_j > 0}.
    2. c > 1.3k: the exact top-k among those c (exactly k positions).
    3. 0.8k <= c <= 1.3k: those c positions.
    4. c < 0.8k: thr <- 0.8 thr and back to 1, at most TRIES (10) thresholds in all; then the
       exact top-k of the whole vector (exactly k positions).

    Zero entries are never kept (they would decode to zero, or to a sign quantizer's +scale):
    where at most k entries are nonzero the result is all of them. Otherwise the result is a top
    set (no unselected entry is larger than a selected one) of exactly k positions (paths 2, 4)
    or of c in [ceil(0.8k), floor(1.3k)] (path 3). Only candidates are partially selected, and
    only the kept positions are sorted, never the whole vector.
    """
    if k <= 0 or int(torch.count_nonzero(mag)) <= k:
        return nonzero_topk(mag, k)
    positive = mag > 0
    for _ in range(TRIES):
        idx = torch.nonzero((mag >= thr) & positive).reshape(-1)
        c = idx.numel()
        if c > SLACK_HIGH * k:
            return idx[torch.topk(mag[idx], k, sorted=False).indices].sort().values
        if c >= SLACK_LOW * k:
            return idx
        thr = thr * LOWER
    return exact_topk(mag, k)


def sampled_topk(mag: torch.Tensor, k: int, gen: torch.Generator, sample: float = 0.01) -> torch.Tensor:
    """About the k largest entries of ``mag`` (>= 0, e.g. |x|), without sorting it.

    The threshold is estimated on a random sample (:func:`sampled_threshold`) and refined by
    :func:`topk_from_threshold`: the result is the exact top-k (k positions), or every nonzero
    entry at or above an accepted threshold (between 0.8k and 1.3k positions). Segments no larger
    than the sample (at most SAMPLE_MIN = 1,024 elements) take the exact top-k. Zero entries are
    never kept. ``gen`` is the caller's private generator; the global RNG is never used.
    Positions come sorted ascending.
    """
    thr = sampled_threshold(mag, k, gen, sample) if 0 < k < mag.numel() else None
    return nonzero_topk(mag, k) if thr is None else topk_from_threshold(mag, k, thr)


def sample_generator(ctx: StageContext, seg: Segment) -> torch.Generator:
    """A private CPU generator for sampling thresholds, independent of the quantizer's stream."""
    return ctx.generator(_SAMPLE_STREAM + seg.index, "cpu")


def write_rice(idx: torch.Tensor, n: int, out: Writer) -> int:
    """Sorted positions in [0, n) as a Golomb-Rice gap stream (parameter, unary part, remainders);
    its bytes. The count goes before it, written by the caller."""
    r = choose_rice_parameter(idx, n)
    unary, rem = rice_encode(idx, r)
    out.u8(r)
    out.u32(unary.numel())
    out.tensor(unary)
    out.tensor(rem)
    return 5 + unary.numel() + rem.numel()


def read_rice(src: Reader, k: int, n: int, device: torch.device) -> torch.Tensor:
    """The ``k`` positions :func:`write_rice` wrote (checked: in range, strictly increasing)."""
    r = src.u8()
    if r > 40:
        raise DecodeError(f"Rice parameter {r} out of range (0..40)")
    unary = src.take(src.u32())
    rem = src.take(packed_bytes(k, r))
    return rice_decode(unary, rem, k, r, n).to(device)


class _CodedIndices(Selector):
    """Selectors that send their positions: u32 k, then the index stream."""

    def validate(self) -> None:
        if self.config.scope not in SCOPES:
            self.fail("scope", f"one of {SCOPES}")
        if self.config.index not in INDEX_CODINGS:
            self.fail("index", f"one of {INDEX_CODINGS}")

    @property
    def scope(self) -> str:  # type: ignore[override]
        return self.config.scope

    def write_indices(self, idx: torch.Tensor, n: int, out: Writer) -> int:
        k = idx.numel()
        out.u32(k)
        if self.config.index == "fixed":
            out.tensor(pack_bits(idx, fixed_index_bits(n)))
            return 4 + packed_bytes(k, fixed_index_bits(n))
        return 4 + write_rice(idx, n, out)

    def read_indices(self, src: Reader, seg: Segment, ctx: StageContext, device: torch.device) -> torch.Tensor:
        n = seg.numel
        k = src.u32()
        if k > n:
            raise DecodeError(f"payload claims {k} kept elements in a segment of {n}")
        if self.config.index == "fixed":
            width = fixed_index_bits(n)
            idx = unpack_bits(src.take(packed_bytes(k, width)), k, width)
            if k and (bool((idx >= n).any()) or bool((torch.diff(idx) <= 0).any())):
                raise DecodeError(f"indices out of range for {n} positions or not strictly increasing")
            return idx.to(device)
        return read_rice(src, k, n, device)

    def side_nbytes(self, seg: Segment, count: int) -> int | None:
        return 4 + packed_bytes(count, fixed_index_bits(seg.numel)) if self.config.index == "fixed" else None


@register
class TopK(_CodedIndices):
    """Keep the k = ceil(ratio * n) largest |x| of each segment."""

    name = "topk"
    accepts_pieces = True  # a global segment over several tensors is scanned in place (no concatenation)
    # for clients that take part now and then (see the docs' Spec grammar: cross-device defaults)
    cross_device = {"ratio": 0.1}

    @dataclass(frozen=True)
    class Config:
        ratio: float = 0.01  # fraction of the segment's elements kept, in (0, 1]
        scope: str = "global"  # "global": top-k over all float tensors at once; "tensor": per tensor
        index: str = "rice"  # index coding: "rice" (gap coded) or "fixed" (ceil(log2 n) bits each)

    def validate(self) -> None:
        super().validate()
        if not 0 < self.config.ratio <= 1:
            self.fail("ratio", "a fraction in (0, 1]")

    def count(self, seg: Segment) -> int | None:
        return _kept(self.config.ratio, seg.numel)

    def select(self, x: torch.Tensor | Pieces, ctx: StageContext, seg: Segment) -> torch.Tensor:
        return exact_topk_sampled(x, _kept(self.config.ratio, x.numel()), sample_generator(ctx, seg))

    def reduce(self, x, seg, out, ctx):
        idx = self.select(x, ctx, seg)
        return _gather(x, idx), idx, self.write_indices(idx, seg.numel, out)


@register
class Threshold(_CodedIndices):
    """Send the elements at or above a magnitude threshold: static (Strom) or chosen per round.

    * ``ratio == 0`` (default): Strom's static threshold. Every |x| >= ``tau`` is sent; alone,
      values travel as signs that decode to +-tau (the residual keeps x -+ tau).
    * ``ratio > 0``: adaptive. Each encode picks the threshold that keeps about ``ratio`` of the
      segment's elements, estimated on a random sample of ``sample`` of them (at least 1,024;
      :func:`sampled_topk`), and ``tau`` is unused. ``mode="abs"``: one threshold on |x| (Aji &
      Heafield 2017). ``mode="signed"``: separate thresholds for the positive and the negative
      elements, keeping about ``ratio`` of each (Dryden et al. 2016). The kept count is between
      0.8 and 1.3 times ceil(ratio * n) per selection (exactly that where the exact top-k path
      is taken); it is written in the payload. Alone, adaptive mode sends sign bits that decode
      to +- the mean |kept| of the segment (one fp32 scale: ``sign(block=0)``); append a
      quantizer (``+none``, ``+fp16``...) to send values instead.

    Either way the kept count depends on the data: pass ``Encoded.kept`` and
    ``Encoded.index_bytes`` to ``Codec.size_bytes``.
    """

    name = "threshold"
    budget_args = {"sample": 1.0}  # budgeted: exact top-k (sampled counts move in steps too coarse to fill 98%)

    @dataclass(frozen=True)
    class Config:
        tau: float = 1e-3  # static mode: magnitude at or above which an element is sent
        ratio: float = 0.0  # 0: static tau; in (0, 1]: adaptive, keep about this fraction per encode
        mode: str = "abs"  # adaptive: "abs" (one |x| threshold, Aji) or "signed" (+/- thresholds, Dryden)
        sample: float = 0.01  # adaptive: fraction of the elements sampled to set the threshold (min 1,024)
        scope: str = "global"  # "global" or "tensor" (selection is elementwise; only the coding differs)
        index: str = "rice"  # "rice" or "fixed"

    def validate(self) -> None:
        super().validate()
        if not self.config.tau > 0:
            self.fail("tau", "a positive float")
        if not 0 <= self.config.ratio <= 1:
            self.fail("ratio", "0 (static tau) or a fraction in (0, 1] (adaptive)")
        if self.config.mode not in THRESHOLD_MODES:
            self.fail("mode", f"one of {THRESHOLD_MODES}")
        if not 0 < self.config.sample <= 1:
            self.fail("sample", "a fraction in (0, 1]")

    @property
    def adaptive(self) -> bool:
        return self.config.ratio > 0

    def default_quantizer(self) -> Quantizer:
        if self.adaptive:
            return Sign(Sign.Config(block=0))
        return FixedSign(FixedSign.Config(tau=self.config.tau))

    def select(self, x: torch.Tensor, ctx: StageContext, seg: Segment) -> torch.Tensor:
        if not self.adaptive:
            return torch.nonzero(x.abs() >= self.config.tau).reshape(-1)
        gen = sample_generator(ctx, seg)
        ratio, sample = self.config.ratio, self.config.sample
        if self.config.mode == "abs":
            return sampled_topk(x.abs(), _kept(ratio, x.numel()), gen, sample)
        # signed: the positive and the negative elements each keep about `ratio` of their own count
        parts = []
        for pos in (torch.nonzero(x > 0).reshape(-1), torch.nonzero(x < 0).reshape(-1)):
            mag = x[pos].abs()
            parts.append(pos[sampled_topk(mag, _kept(ratio, mag.numel()), gen, sample)])
        return torch.cat(parts).sort().values


@register
class RandomK(Selector):
    """Keep k = ceil(ratio * n) positions drawn from a seeded generator; no positions travel.

    Positions: one uniformly in each of k equal strata of the segment (:func:`uniforms.strata`).
    With ``rescale`` (the default) a kept value is multiplied by its stratum's size (n / k where
    k divides n; each element is kept with one over it), which makes the codec unbiased, and
    error feedback is off for it (``feedback``): its residual x - (n/k) x_kept would hold
    (n/k - 1) ||x||^2 in expectation and grow every round. Unscaled is the choice with error
    feedback, and what a byte budget moves (``budget_args``: the variance of a rescaled draw grows
    as the budget shrinks the ratio). The default keeps a tenth, rescaled; for clients that take
    part now and then a quarter (see the docs' Spec grammar: cross-device defaults).
    """

    name = "randomk"
    wire_version = 3  # the positions' draw (see _draw); format-1 and -2 payloads decode with theirs
    budget_args = {"rescale": False}  # budgeted: unscaled, with error feedback (see above)
    accepts_pieces = True  # a global segment over several tensors is gathered in place (no concatenation)
    cross_device = {"ratio": 0.25}  # rescaled (the default): fewer clients average out the n/k variance

    @dataclass(frozen=True)
    class Config:
        ratio: float = 0.1  # fraction of the segment's elements kept, in (0, 1]
        scope: str = "global"  # "global" or "tensor"
        rescale: bool = True  # multiply kept values by their stratum's size, ~n / k (unbiased; no error feedback)

    def validate(self) -> None:
        if not 0 < self.config.ratio <= 1:
            self.fail("ratio", "a fraction in (0, 1]")
        if self.config.scope not in SCOPES:
            self.fail("scope", f"one of {SCOPES}")

    @property
    def scope(self) -> str:  # type: ignore[override]
        return self.config.scope

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.config.rescale

    @property
    def feedback(self) -> bool:  # type: ignore[override]
        return not self.config.rescale

    def count(self, seg: Segment) -> int | None:
        return _kept(self.config.ratio, seg.numel)

    def select(self, x: torch.Tensor, ctx: StageContext, seg: Segment) -> torch.Tensor:
        return self._draw(x.numel(), ctx, seg, self.wire_version, load=False).to(x.device)

    def _draw(self, n: int, ctx: StageContext, seg: Segment, version: int, load: bool = True) -> torch.Tensor:
        """The kept positions, ascending (CPU: the same whatever the device). Format 3: one in
        each of k equal strata (:func:`fedcomp.uniforms.strata`, a hash per kept element); format
        2: the k positions of the smallest hashes of the whole segment
        (`fedcomp.uniforms.smallest`); format 1: ``randperm(n)[:k]``. Every format still decodes.
        ``load``: whether to load the compiled loops for it (not for a client's encode)."""
        gen = ctx.generator(seg.index, "cpu")
        k = _kept(self.config.ratio, n)
        if version == 1:
            return torch.randperm(n, generator=gen)[:k].sort().values
        key = uniforms.draw_key(gen, torch.device("cpu"))
        if version == 2:
            return uniforms.smallest(key, n, k, load=load)
        return uniforms.strata(key, n, k, load=load)

    def reduce(self, x, seg, out, ctx):
        idx = self.select(x, ctx, seg)
        vals = x.gather_sorted(idx) if isinstance(x, Pieces) else torch.index_select(x, 0, idx)
        if self.config.rescale and idx.numel():  # by the stratum's size: each kept with 1 / size
            vals = vals * uniforms.stratum_sizes(seg.numel, idx.numel()).to(vals.device)
        return vals, idx, 0

    def write_indices(self, idx: torch.Tensor, n: int, out: Writer) -> int:
        return 0

    def read_indices(self, src: Reader, seg: Segment, ctx: StageContext, device: torch.device) -> torch.Tensor:
        return self._draw(seg.numel, ctx, seg, src.version).to(device)

    def side_nbytes(self, seg: Segment, count: int) -> int | None:
        return 0


_ASCENDING_READERS = (_CodedIndices.read_indices, RandomK.read_indices)


def reads_ascending(selector: Selector) -> bool:
    """Whether ``selector`` reads its positions with one of the built-in readers, which return
    them strictly ascending and below the segment's size (both index codings check it, or raise a
    DecodeError; random-k draws them so): the server then adds them as read. A selector that reads
    its own way (a subclass overriding ``read_indices`` too) has its positions ordered first
    (:func:`fedcomp.aggregate._ascending`): the compiled add walks them in order."""
    return type(selector).read_indices in _ASCENDING_READERS
