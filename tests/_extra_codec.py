"""A codec that lives outside fedcomp, as a user's would: one class, nothing registered on import.

``tests/test_registry.py`` registers it (:func:`fedcomp.base.register`, the one line a new codec
needs), shows that the contract checks, the fuzz targets and the byte-budget controller pick it
up from the registry, and unregisters it so no other test sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedcomp.base import Knob, Quantizer
from fedcomp.bitpack import pack_bits, packed_bytes, unpack_codes
from fedcomp.wire import Reader, Writer


class Uniform(Quantizer):
    """One (min, step) pair per segment, then ``bits``-bit codes: q = round((x - min) / step)."""

    name = "uniform-test"
    budget_knobs = (Knob("bits", "levels", 2, 8),)  # no fine knob: the budget picks the bits

    @dataclass(frozen=True)
    class Config:
        bits: int = 6  # 2..8 bits per value

    def validate(self) -> None:
        if not 2 <= self.config.bits <= 8:
            self.fail("bits", "an integer from 2 to 8")

    def nbytes(self, count: int) -> int:
        return (8 if count else 0) + packed_bytes(count, self.config.bits)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        if x.numel() == 0:
            return x
        lo, hi = x.min(), x.max()
        step = (hi - lo) / ((1 << self.config.bits) - 1)
        q = torch.round((x - lo) / step).clamp_(0, (1 << self.config.bits) - 1) if step > 0 else torch.zeros_like(x)
        q = q.to(torch.uint8)
        out.tensor(torch.stack([lo, step]))
        out.tensor(pack_bits(q, self.config.bits))
        return q.float() * step + lo

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, device=device)
        lo, step = src.tensor(2, torch.float32).to(device)
        q = unpack_codes(src.take(packed_bytes(count, self.config.bits)).to(device), count, self.config.bits)
        return q.float() * step + lo
