"""Sign codecs: `sign` (1 bit and a scale per block), the selector-coupled fixed sign, and `twobit`
(signs with a zero code).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp import kernels
from fedcomp.base import Quantizer, block_size, blocks, register
from fedcomp.bitpack import pack_bits, packed_bytes, unpack_bits, unpack_codes, unpack_flags
from fedcomp.codecs import blockwise
from fedcomp.codecs.blockwise import (
    _SIGN_QBITS,
    _STD_QBITS,
    _Codes,
    _block_unit,
    _encode_kernels,
    _pack_into,
    _per_block_,
    _qstats_torch,
    _shifted_sum,
)
from fedcomp.codecs.fastpath import _BlockRuns, RunReply, _TernaryRuns, _round_by
from fedcomp.codecs.values import Values, _fused, _ternary, _ternary_kernels
from fedcomp.errors import DecodeError
from fedcomp.wire import Reader, Writer


def _sign_scales(amax, ks, s, m: int, size: int, sub: int, rms: bool) -> np.ndarray:
    """Sign's fp32 scale per block of ``size`` (m elements) from its parts' exact sums (parts of
    ``sub``, :meth:`Sign._write`): mean |x| = sum |q| / count or rms = sqrt(sum q^2 / count), times
    2**-k; inf or NaN where a part's max |x| is. One part per block: in numpy (each sum below
    2**53 for ``mean``, float64 for ``rms``); several: combined in Python integers, divided once."""
    per, nb = -(-size // sub), -(-m // size)
    finite = np.isfinite(amax)
    if per == 1:
        counts = np.full(nb, float(size))
        if m % size:
            counts[-1] = m % size
        v = s.astype(np.float64) / counts
        if rms:
            v = np.sqrt(v)
        v *= np.ldexp(1.0, -ks.astype(np.int32))  # exact powers of 2: one rounding, as the fused loop's
        return np.where(finite, v, amax).astype(np.float32)
    scale = np.empty(nb, dtype=np.float32)
    for b in range(nb):
        lo, hi = b * per, min(b * per + per, amax.shape[0])
        if not finite[lo:hi].all():
            scale[b] = amax[lo:hi].max()  # NaN where a value is NaN, else inf
            continue
        top = int(ks[lo:hi].max())
        v = _shifted_sum(s[lo:hi], ks[lo:hi], top, 2 if rms else 1) / min(size, m - b * size)
        scale[b] = math.ldexp(math.sqrt(v) if rms else v, -top)
    return scale


@register
class Sign(_BlockRuns, Quantizer):
    """1-bit sign with one scale per block.

    ``scale="mean"``: the block's mean |x| (EF-signSGD's ||x||_1 / d), the least-squares scale:
    ||x - scale * sign(x)||^2 = ||x||^2 - ||x||_1^2 / d <= ||x||^2. The decoded block is shorter
    than x by the factor ||x||_1 / (sqrt(d) ||x||_2) (0.8 for Gaussian values, less for heavy tails).
    ``scale="rms"``: ||x||_2 / sqrt(d), the decoded block has x's length. Where a client's update
    reaches the model at once rather than through many rounds of error feedback (a client that
    takes part now and then), the shorter step is what was lost: mnist cnn-bn, 100 clients at 10%,
    30 rounds, 5 seeds: ``mean`` -3.7 points against dense (-2.9 without error feedback), ``rms``
    +0.8 (its cross-device default). Only the encoder differs: both decode alike.
    """

    name = "sign"
    cross_device = {"scale": "rms"}

    @dataclass(frozen=True)
    class Config:
        block: int = 0  # elements per scale; 0 = one scale per segment (a tensor, or the kept values)
        scale: str = "mean"  # "mean": mean |x| per block (least squares); "rms": ||x||_2 / sqrt(d) (keeps the length)

    def validate(self) -> None:
        if self.config.block < 0:
            self.fail("block", "0 (one scale per segment) or a positive block size")
        if self.config.scale not in ("mean", "rms"):
            self.fail("scale", "'mean' (mean |x| per block) or 'rms' (the block's root mean square)")

    def canonical(self) -> str:
        # the default scale is left out: specs (hence fingerprints) from before the option stay the same
        return super().canonical().replace(",scale='mean'", "")

    def nbytes(self, count: int) -> int:
        return 4 * blocks(count, self.config.block) + packed_bytes(count, 1)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        m = x.numel()
        if m == 0:
            return x
        return self._expand(self._write(x, out), x < 0, m)

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes without the reconstruction."""
        if x.numel():
            self._write(x, out)

    def _write(self, x: torch.Tensor, out: Writer) -> torch.Tensor:
        """Write [scale per block (fp32), sign bits]; returns the scales (on x's device).

        A block's scale comes from exact integer sums (the way TernGrad's std does,
        :func:`_tern_std`): the block is cut into parts of at most blockwise._STD_BLOCK elements, each part's
        values are put on a grid of 2**-qbits of its max |x| (q = rint(x * 2**k)), sum |q|
        (``mean``, qbits 30) or sum q^2 (``rms``, qbits 20; q^2 sums must stay exact) per part are
        combined exactly in Python integers and divided once. So the fused CPU loop (one pass:
        sums and sign bits of each part while it is in cache, no fresh dense memory) and the torch
        path (CUDA, no numba) give the same bytes, whatever the order of their sums. Accuracy: each
        value moves by at most 2**-(qbits+1) of its part's max |x|; on Gaussian and heavy-tailed
        updates the scale is within ~1e-7 of the float64 mean |x| / rms (a float32 sum, what torch
        did before, is off by about as much). A value not finite makes its block's scale NaN
        (a NaN) or inf, as the float sums did; finite values never overflow (no x*x in fp32)."""
        m = x.numel()
        size = block_size(m, self.config.block)
        sub = min(size, blockwise._STD_BLOCK)
        rms = self.config.scale == "rms"
        qbits = _STD_QBITS if rms else _SIGN_QBITS
        scale_out = out.empty(blocks(m, self.config.block), torch.float32, x.device)  # in the order they are written
        codes = out.empty(packed_bytes(m, 1), torch.uint8, x.device)
        k = _encode_kernels(x)
        if k is not None:
            n = (m // size) * -(-size // sub) + -(-(m % size) // sub)
            amax, s, ks = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
            scale = scale_out.numpy() if size == sub else np.empty(0, dtype=np.float32)
            k.sign_stats(x.numpy(), size, sub, qbits, not rms, amax, s, ks, scale,
                         kernels.scratch(sub + k.SIGN_TILE + 8, np.uint8), codes.numpy(), k.NO_GUESS)
        else:
            starts = range(0, m, size) if size > sub else [0]
            stats = [_qstats_torch(x[a:a + size] if size > sub else x, sub, qbits, True, not rms) for a in starts]
            amax, ks, s1, s2 = (np.concatenate(v) for v in zip(*stats))
            s = s2 if rms else s1
            step = max(8, blockwise._ENCODE_CHUNK // 8 * 8)
            for lo in range(0, m, step):
                _pack_into(torch.lt(x[lo:lo + step], 0), 1, codes[lo // 8:lo // 8 + packed_bytes(min(step, m - lo), 1)])
        if k is None or size > sub:
            scale_out.copy_(torch.from_numpy(_sign_scales(amax, ks, s, m, size, sub, rms)))
        out.tensor(scale_out)
        out.tensor(codes)
        return scale_out

    _run_kind, _run_per, _run_bits = "BLOCK_SIGN", 1, 1  # runs (_BlockRuns): a scale per block, sign bits

    def flat(self) -> bool:
        return True

    def write_flat(self, fl, segs: list[int], out: Writer, ctx) -> None:
        """Every segment of the flat buffer ``fl`` (:class:`fedcomp.codecs.flat.Flat`) in a
        constant number of torch ops: :meth:`_write`'s bytes. The parts' exact sums of all segments
        come to the host in one copy (the one sync); the scales are :func:`_sign_scales`', for the
        blocks of one part (most) in one numpy pass over all segments."""
        from fedcomp.codecs import flat as _flat

        block, rms = self.config.block, self.config.scale == "rms"
        sub = blockwise._STD_BLOCK
        rows = fl.rows(block, sub)
        amax, ks, s1, s2 = _flat.qstats(rows, _STD_QBITS if rms else _SIGN_QBITS, not rms)
        keep = rows.real_index()
        amax, ks, s = amax[keep], ks[keep], (s2 if rms else s1)[keep]
        counts = rows.lengths_np[keep].astype(np.float64)
        ns = fl.ns.tolist()
        sizes = np.array([block_size(n, block) for n in ns], dtype=np.int64)
        one = np.repeat(sizes <= sub, rows.nrows)  # parts that are whole blocks
        with np.errstate(all="ignore"):
            v = s.astype(np.float64) / counts
            if rms:
                v = np.sqrt(v)
            v *= np.ldexp(1.0, -ks.astype(np.int32))
            scales = np.where(np.isfinite(amax), v, amax).astype(np.float32)
        if not one.all():  # blocks of several parts: combined in Python integers, segment by segment
            pieces = []
            for i, n in enumerate(ns):
                p0, p1 = rows.seg_rows[i], rows.seg_rows[i + 1]
                if sizes[i] <= sub:
                    pieces.append(scales[p0:p1])
                else:
                    pieces.append(_sign_scales(amax[p0:p1], ks[p0:p1], s[p0:p1], n, int(sizes[i]), sub, rms))
            scales = np.concatenate(pieces)
        nb = np.array([blocks(n, block) for n in ns], dtype=np.int64)
        codes = fl.pack(torch.lt(fl.x, 0).view(torch.uint8), 1)
        fl.assemble(out, torch.from_numpy(scales).to(fl.device), nb, codes, 1)

    def run_sq(self, k, run: RunReply, chunk: int) -> np.ndarray:
        """Every value is +-scale: elements per block x scale**2, from the scales alone."""
        out = np.empty(run.ns.shape[0], dtype=np.float64)
        k.sign_sq_run(run.ns, run.p0, run.params[0], self.config.block, chunk, out)
        return out

    def round_tables(self, run: RunReply, halves: np.ndarray) -> None:
        """Every value is +-scale: a half segment's scales rounded once (the check's squares; the
        add rounds each value again, to the same value)."""
        _round_by(run.params[0], np.repeat(halves, np.diff(run.p0)))

    def write_segments(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int = 0, crc: int = 0) -> int:
        """One compiled call (`sign_run`); the scales of blocks of several parts are combined
        here, as `_write` does. No CRC on the way (``crc_on_write`` False)."""
        block, rms = self.config.block, self.config.scale == "rms"
        sizes = [block_size(n, block) for n in ns.tolist()]
        subs = [min(size, blockwise._STD_BLOCK) for size in sizes]
        part0 = np.zeros(len(xs) + 1, dtype=np.int64)
        part0[1:] = np.cumsum([(n // size) * -(-size // sub) + -(-(n % size) // sub)
                               for n, size, sub in zip(ns.tolist(), sizes, subs)])
        total = int(part0[-1])
        amax, s, ks = np.empty(total, dtype=np.float32), np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
        scale = np.empty(max(blocks(n, block) for n in ns.tolist()), dtype=np.float32)
        k.sign_run(ptrs, ns, block, blockwise._STD_BLOCK, _STD_QBITS if rms else _SIGN_QBITS, not rms, offs, region, part0, amax, s, ks,
                   scale, kernels.scratch(blockwise._STD_BLOCK + k.SIGN_TILE + 8, np.uint8), ok)
        for i in np.flatnonzero(~ok).tolist():
            n, p0, p1 = int(ns[i]), part0[i], part0[i + 1]
            sc = _sign_scales(amax[p0:p1], ks[p0:p1], s[p0:p1], n, sizes[i], subs[i], rms)
            region[offs[i]:offs[i] + 4 * sc.shape[0]] = sc.view(np.uint8)
            ok[i] = True
        return 0

    def _expand(self, scale: torch.Tensor, negative: torch.Tensor, m: int) -> torch.Tensor:
        per = scale.repeat_interleave(block_size(m, self.config.block))[:m]
        return torch.where(negative, -per, per)

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        return self.read_values(src, count, device).dense()

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        block = self.config.block
        if count == 0:
            return Values.of(torch.empty(0, device=device))
        scale = src.tensor(blocks(count, block), torch.float32).to(device)
        data = src.take(packed_bytes(count, 1))
        size = block_size(count, block)

        def build(lo: int, hi: int) -> torch.Tensor:
            negative = unpack_flags(data[lo // 8:lo // 8 + packed_bytes(hi - lo, 1)].to(device), hi - lo)
            # +-scale per block: (1 - 2 negative) * scale is exactly _expand's where(negative, -s, s)
            y = negative.to(torch.float32).mul_(-2).add_(1)
            return _per_block_(y, block, scale[lo // size:])
        unit = _block_unit(count, block)
        if device.type == "cpu" and (k := kernels.get()) is not None:
            flags, sc = _Codes(data, count, 1), scale.numpy()

            def run(a, b, i0, i1, out, s, w, add):  # a: a multiple of 8 elements and of the block
                k.sign(flags.host(a, b, k), sc[a // size:], size, i0, i1, out, s, w, add)

            def sq(a, b, i0, i1):  # every value is +-scale: elements per block x scale**2
                lo, hi = a + i0, a + i1
                first = lo // size
                edges = np.arange(first, (hi - 1) // size + 2, dtype=np.int64) * size
                edges[0], edges[-1] = lo, hi
                scales = sc[first:first + edges.size - 1].astype(np.float64)
                return float(np.dot(np.diff(edges).astype(np.float64), scales * scales))
            return _fused(count, unit, device, run, sq)
        return Values(count, unit, build, device)


class FixedSign(Quantizer):
    """Sign bits decoding to +-tau: the value coding of Strom's threshold sparsifier (not a spec name)."""

    name = "fixed-sign"

    @dataclass(frozen=True)
    class Config:
        tau: float = 1e-3

    def nbytes(self, count: int) -> int:
        return packed_bytes(count, 1)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        negative = x < 0
        out.tensor(pack_bits(negative, 1))
        return self._expand(negative)

    def _expand(self, negative: torch.Tensor) -> torch.Tensor:
        tau = self.config.tau
        return torch.where(negative, -tau, tau).float()

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        negative = unpack_bits(src.take(packed_bytes(count, 1)).to(device), count, 1).bool()
        return self._expand(negative)


@register
class TwoBit(_TernaryRuns, Quantizer):
    """MXNet's 2-bit codec: x >= t -> +t (11), x <= -t -> -t (10), else 0 (00).

    Elementwise |error| <= |x|: the remainder stays in the residual (error feedback). ``t`` is an
    absolute value and must be on the scale of what is sent: MXNet's 0.5 is for gradients, while a
    federated round's update is about 1e-3 per weight (digits mlp, mnist cnn-bn), where 0.5 sends
    nothing until a residual reaches it and then a step of 0.5. The default 0.001 suits such
    updates (see the docs' Results: codec families).
    """

    name = "twobit"

    @dataclass(frozen=True)
    class Config:
        threshold: float = 0.001  # t: the magnitude every sent value carries (the updates' scale)

    def validate(self) -> None:
        if not self.config.threshold > 0:
            self.fail("threshold", "a positive float")

    def nbytes(self, count: int) -> int:
        return packed_bytes(count, 2)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        t = self.config.threshold
        codes = torch.where(x >= t, 3, torch.where(x <= -t, 2, 0)).to(torch.uint8)
        out.tensor(pack_bits(codes, 2))
        return self._values(codes)

    _bad = (1, "twobit payload holds the unused code 01")

    def _tables(self, body: np.ndarray, ns: np.ndarray, offs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = self.config.threshold
        return offs, np.tile(np.array([0.0, 0.0, -t, t], dtype=np.float32), (ns.shape[0], 1))

    crc_on_write = True

    def write_segments(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int = 0, crc: int = 0) -> int:
        """One compiled call, continuing the payload's CRC32 as each chunk is packed (``fn`` 0: none)."""
        step = max(4, blockwise._ENCODE_CHUNK // 16 * 4)
        crc = k.twobit_run(ptrs, ns, np.float32(self.config.threshold), offs, region, step,
                           kernels.scratch(step, np.uint8), fn, np.uint32(crc))
        ok[:] = True
        return int(crc)

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes: code = 2 sent + positive, chunk by chunk into one output."""
        m, t = x.numel(), self.config.threshold
        if m == 0:
            return
        packed = out.empty(packed_bytes(m, 2), torch.uint8, x.device)
        step = max(4, blockwise._ENCODE_CHUNK // 16 * 4)  # a multiple of 4 codes: every chunk but the last ends on a byte
        code = torch.empty(min(m, step), dtype=torch.uint8, device=x.device)
        pos = torch.empty(min(m, step), dtype=torch.bool, device=x.device)
        k = _encode_kernels(x)
        t32 = np.float32(t)
        for lo in range(0, m, step):
            xc = x[lo:lo + step]
            if k is not None:  # the same codes in one loop, packed by another
                c = code[:xc.numel()].numpy()
                k.twobit_codes(xc.numpy(), t32, c)
                k.pack(c, xc.numel(), 2, packed[lo // 4:lo // 4 + packed_bytes(xc.numel(), 2)].numpy())
                continue
            c, p = code[:xc.numel()], pos[:xc.numel()]
            torch.ge(xc, t, out=p)
            torch.le(xc, -t, out=c.view(torch.bool)).logical_or_(p)  # sent
            c.bitwise_left_shift_(1).bitwise_or_(p.view(torch.uint8))
            _pack_into(c, 2, packed[lo // 4:lo // 4 + packed_bytes(xc.numel(), 2)])
        out.tensor(packed)

    def flat(self) -> bool:
        return True

    def write_flat(self, fl, segs: list[int], out: Writer, ctx) -> None:
        """Every segment of the flat buffer ``fl`` (:class:`fedcomp.codecs.flat.Flat`) at once:
        :meth:`write`'s codes (padding: 0, as packing pads)."""
        t = self.config.threshold
        x = fl.x
        p = torch.ge(x, t)
        c = torch.le(x, -t).logical_or_(p).view(torch.uint8)
        c = c.bitwise_left_shift(1).bitwise_or_(p.view(torch.uint8))
        fl.assemble(out, None, np.zeros(fl.ns.shape[0], dtype=np.int64), fl.pack(c, 2), 2)

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        t = self.config.threshold
        return torch.where(codes == 3, t, torch.where(codes == 2, -t, 0.0)).float()

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        if count and _ternary_kernels(device, load=False) is not None:  # the compiled table loop (torch: ~65 read passes)
            return self.read_values(src, count, device).dense()
        codes = unpack_codes(src.take(packed_bytes(count, 2)).to(device), count, 2)
        if bool((codes == 1).any()):
            raise DecodeError("twobit payload holds the unused code 01")
        return self._values(codes)

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        if count == 0 or _ternary_kernels(device) is None:
            return Values.of(self.decode(src, count, device))
        t = self.config.threshold  # fp32 values as _values gives them: +t, -t (rounded), 0
        return _ternary(src, count, device, 1, "twobit payload holds the unused code 01", [0.0, 0.0, -t, t])
