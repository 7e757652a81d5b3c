"""Float codecs: `none` (fp32, lossless), `fp16` and `bf16`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedcomp import kernels
from fedcomp.base import Quantizer, register
from fedcomp.codecs import blockwise
from fedcomp.codecs.blockwise import _encode_kernels
from fedcomp.codecs.fastpath import _RawRuns
from fedcomp.codecs.values import Values
from fedcomp.wire import Reader, Writer


_FP16_MAX = 65504.0


@register
class Identity(_RawRuns, Quantizer):
    """Plain fp32 values (lossless)."""

    name = "none"
    unbiased = True

    @dataclass(frozen=True)
    class Config:
        pass

    def nbytes(self, count: int) -> int:
        return 4 * count

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        out.tensor(x)
        return x

    def write_segments(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int = 0, crc: int = 0) -> int:
        """Copies of the values: numpy's memcpy (faster than a compiled loop), or, with a CRC
        function, a loop that continues the payload's CRC32 over each part as it copies it."""
        ok[:] = True
        if not fn:
            for x, o, n in zip(xs, offs.tolist(), ns.tolist()):
                region[o:o + 4 * n].view(np.float32)[:] = x.numpy().reshape(-1)
            return 0
        return int(k.raw_run_crc(ptrs, ns, offs, region, fn, np.uint32(crc)))

    flat_align = 1  # the values back to back: the flat buffer is the body

    def flat(self) -> bool:
        return True

    def write_flat(self, fl, segs: list[int], out: Writer, ctx) -> None:
        """Every segment at once (:class:`fedcomp.codecs.flat.Flat`, unpadded): the buffer is the body."""
        out.tensor(fl.x)

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        return src.tensor(count, torch.float32, output=True).to(device)

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        data = src.take(4 * count)  # a view of the payload: copied chunk by chunk
        if device.type == "cpu" and (k := kernels.get()) is not None:
            raw = data.numpy()

            def add(lo: int, hi: int, s: np.ndarray, w: float) -> None:
                k.add_f32(raw[4 * lo:4 * hi].view(np.float32), s, w)

            def sq(lo: int, hi: int) -> float:  # read in place
                return float(k.sumsq(raw[4 * lo:4 * hi].view(np.float32)))
            return Values(count, 1, lambda lo, hi: data[4 * lo:4 * hi].clone().view(torch.float32), device, add, sq)
        return Values(count, 1, lambda lo, hi: data[4 * lo:4 * hi].clone().view(torch.float32).to(device), device)


class _HalfFloat(_RawRuns, Quantizer):
    dtype: torch.dtype

    @dataclass(frozen=True)
    class Config:
        pass

    def nbytes(self, count: int) -> int:
        return 2 * count

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        y = x.clamp(-_FP16_MAX, _FP16_MAX).to(self.dtype) if self.dtype == torch.float16 else x.to(self.dtype)
        out.tensor(y)
        return y.float()

    flat_align = 1  # the values back to back: the flat buffer, converted, is the body

    def flat(self) -> bool:
        return True

    def write_flat(self, fl, segs: list[int], out: Writer, ctx) -> None:
        """Every segment at once (:class:`fedcomp.codecs.flat.Flat`, unpadded): :meth:`write`'s
        clamp and conversion over the whole buffer."""
        y = out.empty(fl.total, self.dtype, fl.device)
        x = fl.x.clamp_(-_FP16_MAX, _FP16_MAX) if self.dtype == torch.float16 else fl.x
        y.copy_(x)
        out.tensor(y)

    @property
    def _raw_kind(self) -> int:  # type: ignore[override]
        return 2 if self.dtype == torch.bfloat16 else 1

    def write_segments(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int = 0, crc: int = 0) -> int:
        """Clamp and convert every segment in one compiled call; with a CRC function, continue
        the payload's CRC32 over each part while it is in cache."""
        ok[:] = True
        brain = self.dtype == torch.bfloat16
        if not fn:
            k.half_run(ptrs, ns, brain, np.float32(_FP16_MAX), offs, region)
            return 0
        return int(k.half_run_crc(ptrs, ns, brain, np.float32(_FP16_MAX), offs, region, fn, np.uint32(crc)))

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes: one output tensor, clamped and converted chunk by chunk."""
        m = x.numel()
        y = out.empty(m, self.dtype, x.device)
        k = _encode_kernels(x)
        if k is not None and m:  # clamp and convert in one loop (kernels.to_half: the same bits)
            k.to_half(x.numpy(), self.dtype == torch.bfloat16, np.float32(_FP16_MAX),
                      y.view(torch.int16).numpy().view(np.uint16))
            out.tensor(y)
            return
        step = blockwise._ENCODE_CHUNK // 4
        buf = torch.empty(min(m, step), dtype=torch.float32, device=x.device) if self.dtype == torch.float16 else None
        for lo in range(0, m, step):
            xc = x[lo:lo + step]
            if buf is not None:
                xc = torch.clamp(xc, -_FP16_MAX, _FP16_MAX, out=buf[:xc.numel()])
            y[lo:lo + step].copy_(xc)
        out.tensor(y)

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":  # converted chunk by chunk into one fp32 buffer (huge pages where large)
            return self.read_values(src, count, device).dense()
        return src.tensor(count, self.dtype).to(device).float()

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        data = src.take(2 * count)
        if device.type == "cpu" and (k := kernels.get()) is not None:
            raw, table = data.numpy(), _half_table(self.dtype)
            brain = self.dtype == torch.bfloat16

            def add(lo: int, hi: int, s: np.ndarray, w: float) -> None:
                k.add_half(raw[2 * lo:2 * hi].view(np.uint16), brain, s, w)

            def into(lo: int, hi: int, out: np.ndarray) -> None:
                k.lut_u16(raw[2 * lo:2 * hi].view(np.uint16), table, out)

            def sq(lo: int, hi: int) -> float:
                return float(k.half_sq(raw[2 * lo:2 * hi].view(np.uint16), brain))

            def build(lo: int, hi: int) -> torch.Tensor:
                out = torch.empty(hi - lo, dtype=torch.float32)
                into(lo, hi, out.numpy())
                return out
            return Values(count, 1, build, device, add, sq, into)
        return Values(count, 1, lambda lo, hi: data[2 * lo:2 * hi].clone().view(self.dtype).to(device).float(), device)


_HALF_TABLES: dict = {}


def _half_table(dtype: torch.dtype) -> np.ndarray:
    """The fp32 value of each of the 65,536 bit patterns of fp16 / bf16 (torch's conversion)."""
    if dtype not in _HALF_TABLES:
        _HALF_TABLES[dtype] = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).float().numpy()
    return _HALF_TABLES[dtype]


@register
class Float16(_HalfFloat):
    """IEEE half precision; values beyond +-65504 are clamped (error feedback keeps the rest)."""

    name = "fp16"
    dtype = torch.float16


@register
class BFloat16(_HalfFloat):
    """bfloat16: fp32's range with 8 bits of mantissa."""

    name = "bf16"
    dtype = torch.bfloat16
