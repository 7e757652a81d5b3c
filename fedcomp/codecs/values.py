"""A segment's values read and checked but not yet dequantized (`Values`), for the server's
chunked decode + add; `read_values` / `write_values` call the quantizer's `read_values` and
`write` (`fedcomp.base.Quantizer` gives both defaults: `decode` / `encode`).
"""

from __future__ import annotations

import numpy as np
import torch

from fedcomp import kernels
from fedcomp.base import Quantizer
from fedcomp.bitpack import packed_bytes
from fedcomp.codecs import blockwise
from fedcomp.codecs.blockwise import _Codes
from fedcomp.errors import DecodeError
from fedcomp.wire import Reader, Writer, carving, output_empty


class Values:
    """A segment's decoded values, read and checked but not yet dequantized (what
    :func:`read_values` returns): :meth:`chunk` builds any range on demand, so a server can add a
    reply to its sum chunk by chunk without a dense copy of it (:mod:`fedcomp.aggregate`).

    ``build(lo, hi)`` returns the fp32 values of elements [lo, hi) for ``lo`` a multiple of
    ``unit`` and ``hi`` a multiple of ``unit`` or the count; every value has the bits it has in
    :meth:`dense`, which is what the quantizer's ``decode`` returns (elementwise arithmetic only).
    """

    def __init__(self, count: int, unit: int, build, device: torch.device, add=None, sq=None, into=None) -> None:
        self.numel = count
        self.unit = max(1, unit)
        self._build = build
        self.device = torch.device(device)
        # fused CPU loops (fedcomp.kernels), any lo: add (lo, hi, float64 numpy sum slice, weight);
        # sq (lo, hi) -> float64 sum of squares; into (lo, hi, fp32 numpy out), lo a multiple of unit
        self._add, self._sq, self._into = add, sq, into

    def sq(self, lo: int, hi: int) -> float | None:
        """Sum of squares (float64) of values [lo, hi) without building them in fresh memory, where
        a fused loop can (None otherwise): inf or NaN exactly when a value is."""
        return None if self._sq is None else self._sq(lo, hi)

    def add_to(self, lo: int, hi: int, target: torch.Tensor, weight: float) -> bool:
        """``target += weight * values[lo:hi]`` (target: a float64 CPU tensor of ``hi - lo``) in one
        fused loop (:mod:`fedcomp.kernels`), the same bits as adding :meth:`chunk`'s values with
        ``add_(alpha=weight)`` for integer weights below 2**29; False (nothing done) where there is
        no such loop (no numba, another device or dtype)."""
        if self._add is None or target.dtype != torch.float64 or target.device.type != "cpu":
            return False
        self._add(lo, hi, target.numpy(), float(weight))
        return True

    def adder(self):
        """The fused add as ``f(lo, hi, s, w)`` (``s``: a float64 numpy slice of ``hi - lo``), for a
        caller that adds many short ranges (:class:`fedcomp.aggregate.Accumulator`'s batched
        pass); None where there is no such loop."""
        return self._add if self._add is not None and self.device.type == "cpu" else None

    @classmethod
    def of(cls, values: torch.Tensor) -> "Values":
        """Values already dequantized (quantizers without a chunked reader)."""
        flat = values.reshape(-1)
        return cls(flat.numel(), 1, lambda lo, hi: flat[lo:hi], flat.device)

    def chunk(self, lo: int, hi: int) -> torch.Tensor:
        """fp32 values of elements [lo, hi) (read-only: it may be a view)."""
        a = lo - lo % self.unit
        b = min(self.numel, -(-hi // self.unit) * self.unit)
        y = self._build(a, b)
        return y if (a, b) == (lo, hi) else y[lo - a:hi - a]

    def step(self) -> int:
        """A whole number of units of about blockwise._ENCODE_CHUNK elements."""
        return max(1, blockwise._ENCODE_CHUNK // self.unit) * self.unit

    def dense(self) -> torch.Tensor:
        """Every value, one fp32 tensor (built chunk by chunk: temporaries stay chunk-sized)."""
        m = self.numel
        cpu = self.device.type == "cpu"
        if m <= self.step() and not (m and cpu and carving()):  # (in an open arena: built into its buffer)
            return self._build(0, m) if m else torch.empty(0, device=self.device)
        # on the CPU in huge pages where large (wire.output_empty): a fresh 100 MB torch tensor faults 25,600 4 kB pages
        y = output_empty(m) if cpu else torch.empty(m, device=self.device)
        for lo in range(0, m, self.step()):
            hi = min(m, lo + self.step())
            if self._into is not None:
                self._into(lo, hi, y[lo:hi].numpy())
            else:
                y[lo:hi] = self._build(lo, hi)
        return y


def _ternary_kernels(device: torch.device, *, load: bool = True):
    """The kernels for a ternary read on ``device`` (CPU only; else None): loaded where need be
    (``load``: a server's read), or only where loaded already or asked for
    (:func:`fedcomp.kernels.for_encode`): a fresh ClientApp process decoding its own payload for
    error feedback keeps the torch ops (numba's import ~1.7 s)."""
    if device.type != "cpu":
        return None
    return kernels.get() if load else kernels.for_encode()


def _ternary(src: Reader, count: int, device: torch.device, bad: int, message: str, table: list) -> Values:
    """Values of a 2-bit code with one unused code (twobit, terngrad; CPU kernels): the codes are
    checked now, and each value is ``table[code]`` in fp32, built chunk by chunk. Without kernels
    the quantizers decode whole (their torch paths)."""
    k = kernels.get()
    data = src.take(packed_bytes(count, 2))
    raw = data.numpy()
    if k.count_codes2(raw, count)[bad]:
        raise DecodeError(message)
    codes, values = _Codes(data, count, 2), np.array(table, dtype=np.float32)
    squares = values.astype(np.float64) ** 2

    def run(a, b, i0, i1, out, s, w, add):
        k.table2(codes.host(a, b, k), values, i0, i1, out, s, w, add)

    def sq(a, b, i0, i1):  # a value per code: how many of each code x its square
        counts = k.count_codes2(raw[a // 4:], i1) - k.count_codes2(raw[a // 4:], i0)  # a: a whole byte
        return float(np.dot(counts.astype(np.float64), squares))
    return _fused(count, 4, device, run, sq)


def read_values(quantizer: Quantizer, src: Reader, count: int, device: torch.device) -> Values:
    """``quantizer.read_values``: the values read and checked, not yet dequantized (a tensor
    from the base class's default is wrapped)."""
    values = quantizer.read_values(src, count, device)
    return values if isinstance(values, Values) else Values.of(values)


_NO32 = np.empty(0, dtype=np.float32)
_NO64 = np.empty(0, dtype=np.float64)


def _fused(count: int, unit: int, device: torch.device, run, sq_run=None) -> Values:
    """:class:`Values` whose every path is a kernel call ``run(a, b, i0, i1, out, s, w, add)`` over
    elements [a + i0, a + i1), ``a`` a multiple of ``unit`` (CPU only); ``sq_run(a, b, i0, i1)``,
    where given, returns their sum of squares without building them."""
    k = kernels.get()

    def into(lo: int, hi: int, out: np.ndarray) -> None:
        run(lo, hi, 0, hi - lo, out, _NO64, 0.0, False)

    def build(lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=torch.float32)
        into(lo, hi, out.numpy())
        return out

    def add(lo: int, hi: int, s: np.ndarray, w: float) -> None:
        a = lo - lo % unit
        run(a, hi, lo - a, hi - a, _NO32, s, w, True)

    def sq(lo: int, hi: int) -> float:
        a = lo - lo % unit
        if sq_run is not None:
            return float(sq_run(a, hi, lo - a, hi - a))
        buf = kernels.scratch(hi - a, np.float32)
        into(a, hi, buf)
        return float(k.sumsq(buf[lo - a:]))
    return Values(count, unit, build, device, add, sq, into)


def write_values(quantizer: Quantizer, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
    """``quantizer.write``: the code of ``x`` without the reconstruction (`encode`'s bytes)."""
    quantizer.write(x, out, gen)
