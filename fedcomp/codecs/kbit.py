"""`kbit`: k-bit min/max quantization per block, deterministic or stochastic rounding.
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
    _row_range,
    _uniform,
)
from fedcomp.codecs.fastpath import _BlockRuns, _run_keys, _stream_keys
from fedcomp.codecs.values import Values, _fused
from fedcomp.wire import Reader, Writer


@register
class KBit(_BlockRuns, _EntropyCoded, Quantizer):
    """Linear k-bit quantization per block: q = round((x - min) / scale), scale = (max - min) / (2^b - 1).

    |error| <= scale / 2 with nearest rounding; < scale and unbiased with stochastic rounding.
    """

    name = "kbit"
    budget_knobs = (Knob("bits", "levels", 1, 8), Knob("block", "block", 32))

    @dataclass(frozen=True)
    class Config:
        bits: int = 4  # 1..8 bits per value
        block: int = 256  # elements per (min, scale) pair; 0 = one pair per segment
        stochastic: bool = False  # stochastic rounding: unbiased, twice the worst-case error
        coding: str = "packed"  # codes: "packed" (bits each) or "ans" (entropy coded: size depends on data)

    def validate(self) -> None:
        if self.config.coding not in CODINGS:
            self.fail("coding", f"one of {CODINGS}")
        if not 1 <= self.config.bits <= 8:
            self.fail("bits", "an integer from 1 to 8")
        if self.config.block < 0:
            self.fail("block", "0 (one block per segment) or a positive block size")

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.config.stochastic

    def _packed_nbytes(self, count: int) -> int:
        return 8 * blocks(count, self.config.block) + packed_bytes(count, self.config.bits)

    def _key(self, x: torch.Tensor, gen: torch.Generator | None) -> tuple[int, int] | None:
        """The segment's uniform stream (stochastic rounding only: nearest rounding draws nothing)."""
        return uniforms.draw_key(gen, x.device) if self.config.stochastic and x.numel() else None

    def _chunked(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        return _chunked_encode(self._encode_one, x, out, self._key(x, gen), self.config.block)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        if self.config.coding == "ans":
            return self._ans(self._chunked, x, out, gen)
        return self._chunked(x, out, gen)

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes without the reconstruction, through reused chunk buffers."""
        if self.config.coding == "ans":
            self._ans(self._chunked, x, out, gen)
            return
        m, levels = x.numel(), (1 << self.config.bits) - 1
        if m == 0:
            return
        w = _BlockWriter(m, self.config.block, 2, self.config.bits, out, x.device)
        k = _encode_kernels(x)
        key = self._key(x, gen)
        k0, k1 = _key32(key)
        if k is not None:
            xn, pn = x.numpy(), w.params.numpy()
        for start, stop, b0, b1 in w.chunks():
            if k is not None:
                direct = self.config.bits == 8  # the codes are the bytes: written in place
                codes = w.host_codes[start:stop] if direct else kernels.scratch(stop - start, np.uint8)
                if k.kbit_codes(xn[start:stop], w.size, levels, key is not None, k0, k1, start, pn[b0:b1], codes):
                    if not direct:
                        w.put_host_codes(start, codes, k)
                    continue
            rows = _padded_rows(x[start:stop], w.size, fill_first=True)
            lo, hi = _row_range(rows)
            scale = torch.sub(hi, lo, out=w.params[b0:b1, 1]).div_(levels)
            w.params[b0:b1, 0] = lo
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            t = w.f32[:rows.numel()].view(rows.shape)
            torch.sub(rows, lo[:, None], out=t).div_(safe[:, None])
            if key is not None:  # the padded rows' uniforms too (past the segment: cut off below)
                t.add_(w.uniform(key, start, t.numel()).view(t.shape)).floor_()
            else:
                t.round_()
            q = w.u8[:stop - start]
            q.copy_(t.clamp_(0, levels).view(-1)[:stop - start])
            w.put_codes(start, q)
        w.write(out)

    def runs(self) -> bool:
        return self.config.coding == "packed"

    crc_on_write = True

    def write_segments(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int = 0, crc: int = 0) -> int:
        """One compiled call, continuing the payload's CRC32 as the codes are packed (``fn`` 0: none)."""
        stochastic = self.config.stochastic
        k0s, k1s = _stream_keys(k, gen, xs) if stochastic else _run_keys([None] * len(xs))
        step = max(_chunk_step(int(n), self.config.block) for n in ns.tolist())
        params = np.empty((blocks(step, self.config.block), 2), dtype=np.float32)
        return int(k.block_run(k.BLOCK_KBIT, ptrs, ns, self.config.block, (1 << self.config.bits) - 1, self.config.bits,
                               stochastic, k0s, k1s, offs, region, blockwise._ENCODE_CHUNK, params, kernels.scratch(step, np.uint8),
                               ok, fn, np.uint32(crc)))

    _run_kind, _run_per = "BLOCK_KBIT", 2  # runs (_BlockRuns): rows lo, scale per block

    def flat(self) -> bool:
        """Whether :meth:`write_flat` writes this codec's segments (packed codes)."""
        return self.config.coding == "packed"

    def write_flat(self, fl, segs: list[int], out: Writer, ctx) -> None:
        """Every segment of the flat buffer ``fl`` (:class:`fedcomp.codecs.flat.Flat`; ``segs``:
        their segment indices) in a constant number of torch ops: :meth:`write`'s bytes.

        Per block min and max over its true length (no padding: a block's fill-first padding
        changes neither); the rare blocks whose min or max is a zero or NaN (torch's reduction
        picks that zero's sign, that NaN's bits) are taken again by ``aminmax`` over the padded
        block, as :func:`fedcomp.codecs.blockwise._row_range` does: one host sync per encode. The
        scale is divided by a tensor, not the Python int (CUDA multiplies by a reciprocal)."""
        from fedcomp.codecs import flat as _flat

        levels = (1 << self.config.bits) - 1
        rows = fl.rows(self.config.block)
        x = fl.x
        lo, hi = rows.reduce(x, "min"), rows.reduce(x, "max")
        redo = ((lo == 0) | (hi == 0) | torch.isnan(lo) | torch.isnan(hi)) & rows.real_mask()
        bad = torch.nonzero(redo).reshape(-1).cpu().numpy()  # (the one sync)
        if bad.shape[0]:
            for these, (a, b) in _flat.redo_rows(rows, bad, True, lambda r: torch.aminmax(r, dim=1)):
                at = torch.from_numpy(these).to(x.device)
                lo[at], hi[at] = a, b
        scale = torch.sub(hi, lo).div_(torch.full_like(hi, float(levels)))
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        t = torch.sub(x, rows.expand(lo)).div_(rows.expand(safe))
        if self.config.stochastic:
            t.add_(fl.uniforms(_flat.stream_keys(ctx, segs))).floor_()
        else:
            t.round_()
        q = t.clamp_(0, levels).to(torch.uint8)  # padding: x = 0 in a row of zeros, code 0
        params = torch.stack([rows.real(lo), rows.real(scale)], dim=1)
        fl.assemble(out, params, 2 * rows.nrows, fl.pack(q, self.config.bits), self.config.bits)

    def _encode_one(self, x: torch.Tensor, out: Writer, key: tuple[int, int] | None, start: int) -> torch.Tensor:
        m, block, levels = x.numel(), self.config.block, (1 << self.config.bits) - 1
        if m == 0:
            return x
        rows = _blocked(x, block)
        pad = rows.numel() - m
        # padding must not widen the last block's range: fill it with that block's first value
        if pad:
            rows = rows.clone()
            rows[-1, rows.shape[1] - pad:] = rows[-1, 0]
        lo, hi = rows.min(dim=1).values, rows.max(dim=1).values
        scale = (hi - lo) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        t = (rows - lo[:, None]) / safe[:, None]
        t = torch.floor(t + _uniform(key, start, t.numel(), x.device).view(t.shape)) if key is not None else torch.round(t)
        q = t.clamp_(0, levels).reshape(-1)[:m].to(torch.uint8)
        out.tensor(torch.stack([lo, scale], dim=1))
        out.tensor(pack_bits(q, self.config.bits))
        return self._values(q, lo, scale, m)

    def _values(self, q: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, m: int) -> torch.Tensor:
        """q * scale + lo per block (q: integer codes of any dtype; a new fp32 tensor)."""
        return _per_block_(q.to(torch.float32, copy=True), self.config.block, scale, lo)

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        return self.read_values(src, count, device).dense()

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        block = self.config.block
        if count == 0:
            return Values.of(torch.empty(0, device=device))
        size, unit = block_size(count, block), _block_unit(count, block)
        if device.type == "cpu" and (k := kernels.get()) is not None:
            # numpy views, no torch op: a model of many small tensors reads one segment each
            pairs = src.take(8 * blocks(count, block)).numpy().view(np.float32)
            lo_np, scale_np = pairs[0::2].copy(), pairs[1::2].copy()
            codes = self._read_codes(src, count, device)
            levels = (1 << self.config.bits) - 1

            def run(a, b, i0, i1, out, s, w, add):
                k.kbit(codes.host(a, b, k), lo_np[a // size:], scale_np[a // size:], size, i0, i1, out, s, w, add, 0)

            def sq(a, b, i0, i1):
                return k.kbit_sq(codes.host(a, b, k), lo_np[a // size:], scale_np[a // size:], size, i0, i1, levels)
            return _fused(count, unit, device, run, sq)
        params = src.tensor(2 * blocks(count, block), torch.float32).to(device).view(-1, 2)
        lo_, scale = params[:, 0].contiguous(), params[:, 1].contiguous()
        codes = self._read_codes(src, count, device)

        def build(lo: int, hi: int) -> torch.Tensor:
            b = lo // size
            return self._values(codes(lo, hi), lo_[b:], scale[b:], hi - lo)
        return Values(count, unit, build, device)
