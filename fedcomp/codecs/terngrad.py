"""`terngrad`: TernGrad (Wen et al., 2017): stochastic ternary codes scaled by max |x|, unbiased.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp import kernels, uniforms
from fedcomp.base import Quantizer, register
from fedcomp.bitpack import packed_bytes, unpack_codes
from fedcomp.codecs import blockwise
from fedcomp.codecs.blockwise import _STD_QBITS, _encode_kernels, _key32, _pack_into, _qstats_torch, _shifted_sum
from fedcomp.codecs.fastpath import _TernaryRuns, _block_params, _stream_keys
from fedcomp.codecs.values import Values, _ternary, _ternary_kernels
from fedcomp.errors import DecodeError
from fedcomp.wire import Reader, Writer


def _tern_std(n: int, ks, s1, s2) -> float:
    """TernGrad's std(x) (n - 1 normalization) from exact per-block integer sums: block b holds
    s1 = sum q, s2 = sum q^2 of q = rint(x * 2**ks[b]) (|q| <= 2**20: x to 20 bits of its block's
    max |x|). Combined exactly (Python integers), divided once (correctly rounded), so the result
    depends on neither the order of the sums nor the path (fused loop or torch ops).

    Why not ``torch.std``: it costs ~7 read passes on one thread (more than the rest of the
    encode), and a float sum's last bits depend on its order, so a fused loop could not give
    torch's bits. The rounding (each value moves by at most 2**-20 of its block's max |x|) moves
    the std by at most 2**-20 * max|x| (the centred vector moves by at most that per element);
    rounding errors of continuous data average out, so on Gaussian updates it agrees with
    ``torch.std`` to ~1e-8 relative (``tests/test_uniforms.py`` checks 1e-6)."""
    if len(ks) == 1:  # one block (most of a ResNet's tensors): nothing to shift
        top, a, b = int(ks[0]), int(s1[0]), int(s2[0])
    else:
        top = int(max(ks))
        a = _shifted_sum(s1, ks, top, 1)
        b = _shifted_sum(s2, ks, top, 2)
    var = (n * b - a * a) / (n * (n - 1))
    return math.ldexp(math.sqrt(var), -top)


def _tern_stats_kernel(x: torch.Tensor, clip: bool, k):
    """(max |x|, std or None) through the fused loop; None where a value is not finite."""
    m = x.numel()
    nb = -(-m // blockwise._STD_BLOCK)
    amax = np.empty(nb, dtype=np.float32)
    s1, s2, ks = np.empty(nb, dtype=np.int64), np.empty(nb, dtype=np.int64), np.empty(nb, dtype=np.int64)
    if not k.tern_stats(x.numpy(), blockwise._STD_BLOCK, _STD_QBITS, clip, amax, s1, s2, ks, k.NO_GUESS):
        return None
    return amax.max(), (_tern_std(m, ks, s1, s2) if clip else None)


def _tern_stats_torch(x: torch.Tensor, clip: bool):
    """:func:`_tern_stats_kernel` in torch ops (any device), blocks of blockwise._STD_BLOCK (zero padding
    changes neither max |x| nor the sums); std NaN where a value is not finite."""
    amax, ks, s1, s2 = _qstats_torch(x, blockwise._STD_BLOCK, _STD_QBITS, clip)
    a = np.float32(amax.max())
    if not clip:
        return a, None
    return a, (_tern_std(x.numel(), ks, s1, s2) if bool(np.isfinite(amax).all()) else float("nan"))


@register
class TernGrad(_TernaryRuns, Quantizer):
    """TernGrad (Wen et al. 2017): s * sign(g) * b, b ~ Bernoulli(|g| / s), s = max|g| per segment.

    With ``clip`` > 0, g is first clipped to +-clip * std(g) (biased; error feedback keeps the
    clipped part). Unbiased with clip = 0, to the draws' resolution: P(sent) is |g| / s rounded to
    the nearest multiple of 2**-16, a bias of at most min(|g|, s * 2**-17) per element, either
    way. Elementwise |error| <= s.

    std(g) is computed from exact integer sums (:func:`_tern_std`; within ~1e-6 of ``torch.std``,
    which costs ~7 read passes), so the fused CPU loop and the torch path (CUDA, no numba) give
    the same bytes; the Bernoulli draws use the segment's half-width counter-based uniforms
    (16 bits, two from one hash: :func:`fedcomp.uniforms.fill16`).
    """

    name = "terngrad"

    @dataclass(frozen=True)
    class Config:
        clip: float = 2.5  # clip at clip * std before scaling; 0 disables clipping

    def validate(self) -> None:
        if self.config.clip < 0:
            self.fail("clip", "0 (no clipping) or a positive multiple of the standard deviation")

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.config.clip == 0

    def nbytes(self, count: int) -> int:
        return (4 if count else 0) + packed_bytes(count, 2)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        if x.numel() == 0:
            return x
        s, packed = self._write(x, out, gen)
        return self._values(s, unpack_codes(packed, x.numel(), 2))

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes without the reconstruction."""
        if x.numel():
            self._write(x, out, gen)

    def _write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [s, 2-bit codes]; returns (s as a 1-element fp32 tensor, the packed codes).

        1. The clip bound ``clip * std(x)`` (:func:`_tern_std`; skipped for clip = 0 or one value).
        2. s = max |clipped x| = min(max |x|, bound), in fp32.
        3. Per element: a = min(|x|, bound); code 1 (+s) or 2 (-s, x < 0) where u_i * s < a (so
           P(sent) = a / s rounded to the nearest multiple of 2**-16), else 0; u_i the segment's
           half-width counter-based uniform (:func:`fedcomp.uniforms.fill16`), so the chunking
           and the path (fused CPU loop or torch ops) do not change the bytes. A non-finite x
           gives s = NaN (or inf without clipping) and every code 0, as before the rework."""
        m = x.numel()
        key = uniforms.draw_key(gen, x.device)
        clip = self.config.clip > 0 and m > 1
        k = _encode_kernels(x)
        stats = _tern_stats_kernel(x, clip, k) if k is not None else None
        if stats is None:  # no kernels, or a value is not finite
            k = None
            stats = _tern_stats_torch(x, clip)
        s32, bound32 = self._scale(*stats, clip)
        s_out = out.empty(1, torch.float32, x.device)  # the writer's places go in the order they are written
        packed = out.empty(packed_bytes(m, 2), torch.uint8, x.device)
        step = min(m, max(4, blockwise._ENCODE_CHUNK // 4 * 4))  # a multiple of 4 codes: chunks end on a byte
        s_t = torch.from_numpy(np.array([s32], dtype=np.float32)).to(x.device)
        if k is not None:
            k0, k1 = _key32(key)
            codes = kernels.scratch(max(step, 16), np.uint8)
            for lo in range(0, m, step):
                xc = x[lo:lo + step].numpy()
                n = xc.shape[0]
                dst = packed[lo // 4:lo // 4 + packed_bytes(n, 2)].numpy()
                k.tern_packed(xc, s32, bound32, clip, k0, k1, lo, dst, codes)
        else:
            u = torch.empty(step, dtype=torch.float32, device=x.device)
            work = torch.empty(2 * step, dtype=torch.int32, device=x.device)
            mag = torch.empty(step, dtype=torch.float32, device=x.device)
            code = torch.empty(step, dtype=torch.uint8, device=x.device)
            keep = torch.empty(step, dtype=torch.bool, device=x.device)
            b_t = torch.tensor(bound32, dtype=torch.float32, device=x.device)
            for lo in range(0, m, step):
                xc = x[lo:lo + step]
                n = xc.numel()
                a = torch.abs(xc, out=mag[:n])
                if clip:
                    torch.minimum(a, b_t, out=a)
                uc = uniforms.fill16(key, lo, u[:n], work).mul_(s_t)
                torch.lt(uc, a, out=keep[:n])
                c = torch.lt(xc, 0, out=code[:n].view(torch.bool)).view(torch.uint8).add_(1)
                c.mul_(keep[:n].view(torch.uint8))
                _pack_into(c, 2, packed[lo // 4:lo // 4 + packed_bytes(n, 2)])
        out.tensor(s_out.copy_(s_t))
        out.tensor(packed)
        return s_t, packed

    def flat(self) -> bool:
        return True

    def write_flat(self, fl, segs: list[int], out: Writer, ctx) -> None:
        """Every segment of the flat buffer ``fl`` (:class:`fedcomp.codecs.flat.Flat`) in a
        constant number of torch ops: :meth:`_write`'s bytes. The parts' exact sums come to the
        host in one copy (the one sync); s and the clip bound per segment are computed there as
        :meth:`write_segments` computes them, and go back in one copy."""
        from fedcomp.codecs import flat as _flat

        rows = fl.rows(0, blockwise._STD_BLOCK)
        amax, ks, s1, s2 = _flat.qstats(rows, _STD_QBITS, False)
        keep = rows.real_index()
        amax, ks, s1, s2 = amax[keep], ks[keep], s1[keep], s2[keep]
        ns = fl.ns
        b0 = rows.seg_rows
        s32 = np.maximum.reduceat(amax, b0[:-1])  # every segment here has a part
        bound32 = np.full(ns.shape[0], np.inf, dtype=np.float32)
        clips = (ns > 1) if self.config.clip > 0 else np.zeros(ns.shape[0], dtype=np.bool_)
        use = np.flatnonzero(clips)
        if use.shape[0]:
            nl, kl, s1l, s2l, bl = ns.tolist(), ks.tolist(), s1.tolist(), s2.tolist(), b0.tolist()
            finite = np.isfinite(amax)
            std = np.array([_tern_std(nl[i], kl[bl[i]:bl[i + 1]], s1l[bl[i]:bl[i + 1]], s2l[bl[i]:bl[i + 1]])
                            if finite[bl[i]:bl[i + 1]].all() else float("nan") for i in use.tolist()], dtype=np.float64)
            s32[use], bound32[use] = self._scale(s32[use], std, True)
        table = torch.from_numpy(np.stack([s32, bound32])).to(fl.device)  # rows s, bound
        x = fl.x
        per = fl.per_element(table.T)
        a = x.abs()
        if use.shape[0]:
            torch.minimum(a, per[:, 1], out=a)
        sent = torch.lt(fl.uniforms16(_flat.stream_keys(ctx, segs)).mul_(per[:, 0]), a)
        code = torch.lt(x, 0).view(torch.uint8).add(1).mul_(sent.view(torch.uint8))
        fl.assemble(out, table[0], np.ones(ns.shape[0], dtype=np.int64), fl.pack(code, 2), 2)

    _bad = (3, "terngrad payload holds the unused code 11")

    def _tables(self, body: np.ndarray, ns: np.ndarray, offs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        nb = (ns > 0).astype(np.int64)  # one s per non-empty segment
        s, p0 = _block_params(body, offs, nb, 1)
        per = np.zeros(ns.shape[0], dtype=np.float32)
        per[nb > 0] = s
        return offs + 4 * nb, np.stack([np.zeros_like(per), per, -per, np.zeros_like(per)], axis=1)

    def _scale(self, amax, bound, clip: bool) -> tuple[np.float32, np.float32]:
        """(s, the clip bound) in fp32 from max |x| and std (``bound``): scalars, or arrays of
        segments (elementwise, the same fp32 operations)."""
        s32, bound32 = amax, np.float32(np.inf)
        if clip:
            with np.errstate(invalid="ignore", over="ignore"):  # std past fp32's range: inf
                bound32 = np.float32(np.float32(self.config.clip) * np.float32(bound))
                s32 = np.minimum(amax, bound32)
        return s32, bound32

    crc_on_write = True

    def write_segments(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int = 0, crc: int = 0) -> int:
        """:func:`write_run`'s compiled calls: every segment's block statistics in one
        (:func:`fedcomp._kernels.tern_stats_run`), s and the clip bound per segment here as
        :meth:`_write` computes them (the exact std in Python integers; the fp32 scale for all
        segments at once), the codes in one (:func:`fedcomp._kernels.tern_run`). A segment
        with a value not finite is left to :meth:`_write` (ok False). ``fn`` nonzero: the codes'
        call continues the payload's CRC32 ``crc`` as it packs them; returns the CRC.

        Why: per segment, the statistics' call, arrays and scalar arithmetic cost tens of
        microseconds, which adds up on models with many tensors."""
        count = len(xs)
        clips = (ns > 1) if self.config.clip > 0 else np.zeros(count, dtype=np.bool_)
        b0 = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(-(-ns // blockwise._STD_BLOCK), out=b0[1:])
        total = int(b0[-1])
        amax = np.empty(total, dtype=np.float32)
        s1, s2, ks = (np.empty(total, dtype=np.int64) for _ in range(3))
        k.tern_stats_run(ptrs, ns, blockwise._STD_BLOCK, _STD_QBITS, clips, b0, amax, s1, s2, ks, ok)
        s32 = np.maximum.reduceat(amax, b0[:-1])  # max |x| per segment (every segment has a block)
        bound32 = np.full(count, np.inf, dtype=np.float32)
        use = np.flatnonzero(clips & ok)
        if use.shape[0]:  # the scale of _write, for every clipped segment at once
            nl, kl, s1l, s2l, bl = ns.tolist(), ks.tolist(), s1.tolist(), s2.tolist(), b0.tolist()  # Python ints:
            # numpy scalars cost ~2 ms a ResNet-50 layout in _tern_std's loops
            std = np.array([_tern_std(nl[i], kl[bl[i]:bl[i + 1]], s1l[bl[i]:bl[i + 1]], s2l[bl[i]:bl[i + 1]])
                            for i in use.tolist()], dtype=np.float64)
            s32[use], bound32[use] = self._scale(s32[use], std, True)
        k0s, k1s = _stream_keys(k, gen, xs)
        step = max(4, blockwise._ENCODE_CHUNK // 4 * 4)
        codes = kernels.scratch(max(step, 16), np.uint8)
        return int(k.tern_run(ptrs, ns, s32, bound32, clips, k0s, k1s, offs, region, step, codes, ok, fn, np.uint32(crc)))

    def _values(self, s: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        s = s.reshape(())
        return torch.where(codes == 1, s, torch.where(codes == 2, -s, torch.zeros_like(s))).float()

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        if count == 0 or _ternary_kernels(device) is None:
            return Values.of(self.decode(src, count, device))
        s = float(src.tensor(1, torch.float32)[0])
        return _ternary(src, count, device, 3, "terngrad payload holds the unused code 11", [0.0, s, -s, 0.0])

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, device=device)
        if _ternary_kernels(device, load=False) is not None:  # the compiled table loop (torch ops: ~65 read passes)
            return self.read_values(src, count, device).dense()
        s = src.tensor(1, torch.float32).to(device)[0]
        codes = unpack_codes(src.take(packed_bytes(count, 2)).to(device), count, 2)
        if bool((codes == 3).any()):
            raise DecodeError("terngrad payload holds the unused code 11")
        return self._values(s, codes)
