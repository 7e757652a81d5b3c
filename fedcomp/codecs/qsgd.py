"""`qsgd`: QSGD (Alistarh et al., 2017): stochastic levels of |x| / ||x|| per bucket, unbiased.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedcomp import kernels, uniforms
from fedcomp.base import Knob, Quantizer, block_size, blocks, register
from fedcomp.bitpack import pack_bits, packed_bytes
from fedcomp.codecs import blockwise
from fedcomp.codecs.blockwise import (
    CODINGS,
    _BlockWriter,
    _EntropyCoded,
    _block_unit,
    _blocked,
    _chunk_step,
    _chunked_encode,
    _encode_kernels,
    _key32,
    _padded_rows,
    _per_block_,
    _uniform,
)
from fedcomp.codecs.fastpath import _BlockRuns, _stream_keys
from fedcomp.codecs.values import Values, _fused
from fedcomp.wire import Reader, Writer


@register
class QSGD(_BlockRuns, _EntropyCoded, Quantizer):
    """QSGD (Alistarh et al. 2017): per bucket, ||v|| * sign(v_j) * xi_j with xi_j stochastic over s levels.

    ``bits`` counts the sign: s = 2^(bits-1) - 1 levels above zero. Unbiased; elementwise
    |error| <= scale / s, where scale is the bucket's norm.

    ``norm="l2"`` is the paper's scaling: E||Q(v) - v||^2 <= min(d / s^2, sqrt(d) / s) ||v||^2,
    which exceeds ||v||^2 for buckets larger than s^2 elements. Such a compressor is not
    contractive, and error feedback on top of it diverges (top-k 1% + 4-bit l2 QSGD with error
    feedback fell to chance accuracy on digits). ``norm="max"`` (the default) scales
    by the bucket's max |v|, so levels are spread over the values' actual range; still
    unbiased, with E(Q(v_j) - v_j)^2 <= max|v|^2 / (4 s^2).
    """

    name = "qsgd"
    unbiased = True
    budget_knobs = (Knob("bits", "levels", 2, 8), Knob("bucket", "block", 32))

    @dataclass(frozen=True)
    class Config:
        bits: int = 4  # bits per value including the sign bit (2..8)
        bucket: int = 512  # elements per norm; 0 = one norm per segment
        norm: str = "max"  # bucket scale: "max" (max |v|, contractive) or "l2" (the paper's ||v||_2)
        coding: str = "packed"  # codes: "packed" (bits each) or "ans" (entropy coded: size depends on data)

    def validate(self) -> None:
        if self.config.norm not in ("max", "l2"):
            self.fail("norm", "'max' or 'l2'")
        if self.config.coding not in CODINGS:
            self.fail("coding", f"one of {CODINGS}")
        if not 2 <= self.config.bits <= 8:
            self.fail("bits", "an integer from 2 to 8 (sign bit included)")
        if self.config.bucket < 0:
            self.fail("bucket", "0 (one bucket per segment) or a positive bucket size")

    @property
    def levels(self) -> int:
        return (1 << (self.config.bits - 1)) - 1

    def _packed_nbytes(self, count: int) -> int:
        return 4 * blocks(count, self.config.bucket) + packed_bytes(count, self.config.bits)

    def _chunked(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        key = uniforms.draw_key(gen, x.device) if x.numel() else None
        return _chunked_encode(self._encode_one, x, out, key, self.config.bucket)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        if self.config.coding == "ans":
            return self._ans(self._chunked, x, out, gen)
        return self._chunked(x, out, gen)

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes without the reconstruction, through reused chunk buffers."""
        if self.config.coding == "ans":
            self._ans(self._chunked, x, out, gen)
            return
        m, s, bits = x.numel(), self.levels, self.config.bits
        if m == 0:
            return
        w = _BlockWriter(m, self.config.bucket, 1, bits, out, x.device)
        k = _encode_kernels(x)
        use_max = self.config.norm == "max"
        key = uniforms.draw_key(gen, x.device)
        k0, k1 = _key32(key)
        for start, stop, b0, b1 in w.chunks():
            xc = x[start:stop]
            if k is not None:
                norms = w.params[b0:b1, 0]
                if not use_max:  # torch's reduction, as the torch path computes it
                    norms.copy_(torch.linalg.vector_norm(_padded_rows(xc, w.size, fill_first=False), dim=1))
                codes = kernels.scratch(stop - start, np.uint8)
                if k.qsgd_codes(xc.numpy(), w.size, s, bits - 1, use_max, norms.numpy(), k0, k1, start, codes):
                    w.put_host_codes(start, codes, k)
                    continue
            rows = _padded_rows(xc, w.size, fill_first=False)
            mag = torch.abs(rows, out=w.f32[:rows.numel()].view(rows.shape))
            if self.config.norm == "max":
                norm = torch.amax(mag, dim=1)
            else:
                norm = torch.linalg.vector_norm(rows, dim=1)
            w.params[b0:b1, 0] = norm
            ratio = self._ratio_(mag, norm).view(-1)[:stop - start]
            ratio.add_(w.uniform(key, start, stop - start)).floor_().clamp_(0, s)
            code = w.u8[:stop - start]
            code.copy_(ratio)
            code.bitwise_or_(torch.lt(xc, 0).view(torch.uint8) << (bits - 1))
            w.put_codes(start, code)
        w.write(out)

    def runs(self) -> bool:
        return self.config.coding == "packed" and self.config.norm == "max"  # l2 norms are torch's

    _run_kind, _run_per, _run_block_field = "BLOCK_QSGD", 1, "bucket"  # runs (_BlockRuns): norm / levels per bucket

    def flat(self) -> bool:
        """Whether :meth:`write_flat` writes this codec's segments (packed codes, max norm: an l2
        norm is torch's float sum over the padded bucket, whose bits a segment sum need not give)."""
        return self.config.coding == "packed" and self.config.norm == "max"

    def write_flat(self, fl, segs: list[int], out: Writer, ctx) -> None:
        """Every segment of the flat buffer ``fl`` (:class:`fedcomp.codecs.flat.Flat`) in a
        constant number of torch ops: :meth:`write`'s bytes. One host sync: whether a bucket's
        norm is NaN (its bits: the padded bucket's amax, taken again) or its levels / norm
        overflows (:meth:`_ratio_`'s other arithmetic)."""
        from fedcomp.codecs import flat as _flat

        s, bits = self.levels, self.config.bits
        rows = fl.rows(self.config.bucket)
        x = fl.x
        mag = x.abs()
        norm = rows.reduce(mag, "max")
        safe = torch.where(norm > 0, norm, torch.ones_like(norm))
        r = torch.full_like(safe, float(s)).div_(safe)
        big = torch.isinf(r)
        nan, anybig = torch.stack([torch.isnan(norm).logical_and_(rows.real_mask()).any(), big.any()]).tolist()
        if nan:
            bad = torch.nonzero(torch.isnan(norm) & rows.real_mask()).reshape(-1).cpu().numpy()
            for these, got in _flat.redo_rows(rows, bad, False, lambda p: p.abs().amax(dim=1)):
                norm[torch.from_numpy(these).to(x.device)] = got
        if anybig:
            big_e = rows.expand(big)
            mag = torch.where(big_e, mag.mul(s).div_(rows.expand(safe)), mag)
            r[big] = 1.0
        ratio = mag.mul_(rows.expand(r))
        ratio.add_(fl.uniforms(_flat.stream_keys(ctx, segs))).floor_().clamp_(0, s)
        code = ratio.to(torch.uint8)
        code.bitwise_or_(torch.lt(x, 0).view(torch.uint8) << (bits - 1))
        fl.assemble(out, rows.real(norm), rows.nrows, fl.pack(code, bits), bits)

    def _run_rows(self, rows: np.ndarray) -> np.ndarray:
        """norm / levels per bucket (fp32, as :meth:`read_values` divides)."""
        with np.errstate(all="ignore"):  # a NaN or inf norm (fuzzed payloads) is refused by the check
            return rows / np.float32(self.levels)

    crc_on_write = True

    def write_segments(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int = 0, crc: int = 0) -> int:
        """One compiled call, continuing the payload's CRC32 as the codes are packed (``fn`` 0: none)."""
        k0s, k1s = _stream_keys(k, gen, xs)
        step = max(_chunk_step(int(n), self.config.bucket) for n in ns.tolist())
        return int(k.block_run(k.BLOCK_QSGD, ptrs, ns, self.config.bucket, self.levels, self.config.bits, True, k0s, k1s,
                               offs, region, blockwise._ENCODE_CHUNK, np.empty((blocks(step, self.config.bucket), 1), dtype=np.float32),
                               kernels.scratch(step, np.uint8), ok, fn, np.uint32(crc)))

    def _ratio_(self, mag: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """In place: mag (|x| as rows of buckets) times r = fp32(levels / norm) per bucket (norm 0:
        r = levels), one fp32 multiply per element, the kernel's arithmetic; where r overflows (a
        norm below levels / fp32's max, where 0 * r would be NaN) |x| * levels / norm instead."""
        safe = torch.where(norm > 0, norm, torch.ones_like(norm))
        r = torch.full_like(safe, float(self.levels)).div_(safe)
        big = torch.isinf(r)
        if bool(big.any()):
            mag[big] = mag[big].mul(self.levels).div_(safe[big][:, None])
            r[big] = 1.0
        return mag.mul_(r[:, None])

    def _encode_one(self, x: torch.Tensor, out: Writer, key: tuple[int, int] | None, start: int) -> torch.Tensor:
        m, s = x.numel(), self.levels
        if m == 0:
            return x
        rows = _blocked(x, self.config.bucket)
        norm = rows.abs().amax(dim=1) if self.config.norm == "max" else torch.linalg.vector_norm(rows, dim=1)
        ratio = self._ratio_(rows.abs(), norm).reshape(-1)[:m]
        ratio.add_(_uniform(key, start, m, x.device)).floor_().clamp_(0, s)
        level = ratio.to(torch.uint8)
        negative = (x < 0).to(torch.uint8)
        out.tensor(norm)
        out.tensor(pack_bits((negative << (self.config.bits - 1)) | level, self.config.bits))
        return self._values(norm, level, negative, m)

    def _values(self, norm: torch.Tensor, level: torch.Tensor, negative: torch.Tensor, m: int) -> torch.Tensor:
        """norm * (+-level) / s per bucket (level, negative: uint8; a new fp32 tensor)."""
        signed = level.to(torch.int8) * (1 - 2 * negative.to(torch.int8))  # int8: |level| <= 127
        # Divided by a tensor, not the Python int: CUDA divides by a scalar as a multiply by its
        # reciprocal, which is not correctly rounded, so norm / levels would differ from the CPU's
        # (kernels and numpy) by an ulp and a GPU's decode from every other decode of the payload.
        per_level = norm / torch.full_like(norm, float(self.levels))
        return _per_block_(signed.to(torch.float32), self.config.bucket, per_level)

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        return self.read_values(src, count, device).dense()

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        bucket = self.config.bucket
        if count == 0:
            return Values.of(torch.empty(0, device=device))
        top = self.config.bits - 1
        size, unit = block_size(count, bucket), _block_unit(count, bucket)
        if device.type == "cpu" and (k := kernels.get()) is not None:
            # numpy, no torch op (one segment per tensor); the fp32 division _values does
            with np.errstate(all="ignore"):  # a NaN or inf norm (fuzzed payloads) is refused by the check
                per_level = src.take(4 * blocks(count, bucket)).numpy().view(np.float32) / np.float32(self.levels)
            codes = self._read_codes(src, count, device)

            def run(a, b, i0, i1, out, s, w, add):
                k.qsgd(codes.host(a, b, k), per_level[a // size:], top, size, i0, i1, out, s, w, add, 0)

            def sq(a, b, i0, i1):
                return k.qsgd_sq(codes.host(a, b, k), per_level[a // size:], top, size, i0, i1)
            return _fused(count, unit, device, run, sq)
        norm = src.tensor(blocks(count, bucket), torch.float32).to(device)
        codes = self._read_codes(src, count, device)

        def build(lo: int, hi: int) -> torch.Tensor:
            c = codes(lo, hi)
            return self._values(norm[lo // size:], c & ((1 << top) - 1), c >> top, hi - lo)
        return Values(count, unit, build, device)
