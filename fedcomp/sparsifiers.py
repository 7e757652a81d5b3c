"""Selectors (sparsifiers): which elements of a segment travel, and how their positions are coded.

Index coding (``index=``): ``rice`` codes the gaps between sorted positions (Golomb-Rice, within
about 1% of log2 C(n, k) for top-k), ``fixed`` spends ceil(log2 n) bits per position and has a
size that depends on k only. Random-k sends no positions: the decoder regenerates them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
from fedcomp.quantizers import FixedSign
from fedcomp.wire import Reader, Writer

SCOPES = ("global", "tensor")
INDEX_CODINGS = ("rice", "fixed")


def _kept(ratio: float, n: int) -> int:
    """ceil(ratio * n), at least 1; the product is rounded first so 0.07 * 100 keeps 7, not 8."""
    return min(n, max(1, math.ceil(round(ratio * n, 6)))) if n else 0


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
        r = choose_rice_parameter(idx, n)
        unary, rem = rice_encode(idx, r)
        out.u8(r)
        out.u32(unary.numel())
        out.tensor(unary)
        out.tensor(rem)
        return 9 + unary.numel() + rem.numel()

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
        r = src.u8()
        if r > 40:
            raise DecodeError(f"Rice parameter {r} out of range (0..40)")
        unary = src.take(src.u32())
        rem = src.take(packed_bytes(k, r))
        return rice_decode(unary, rem, k, r, n).to(device)

    def side_nbytes(self, seg: Segment, count: int) -> int | None:
        return 4 + packed_bytes(count, fixed_index_bits(seg.numel)) if self.config.index == "fixed" else None


@register
class TopK(_CodedIndices):
    """Keep the k = ceil(ratio * n) largest |x| of each segment."""

    name = "topk"

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

    def select(self, x: torch.Tensor, ctx: StageContext, seg: Segment) -> torch.Tensor:
        k = _kept(self.config.ratio, x.numel())
        return torch.topk(x.abs(), k, sorted=False).indices.sort().values


@register
class Threshold(_CodedIndices):
    """Strom's static threshold: send every |x| >= tau; alone it sends signs decoding to +-tau."""

    name = "threshold"

    @dataclass(frozen=True)
    class Config:
        tau: float = 1e-3  # magnitude at or above which an element is sent
        scope: str = "global"  # "global" or "tensor" (selection is elementwise; only the coding differs)
        index: str = "rice"  # "rice" or "fixed"

    def validate(self) -> None:
        super().validate()
        if not self.config.tau > 0:
            self.fail("tau", "a positive float")

    def default_quantizer(self) -> Quantizer:
        return FixedSign(FixedSign.Config(tau=self.config.tau))

    def select(self, x: torch.Tensor, ctx: StageContext, seg: Segment) -> torch.Tensor:
        return torch.nonzero(x.abs() >= self.config.tau).reshape(-1)


@register
class RandomK(Selector):
    """Keep k = ceil(ratio * n) positions drawn from a seeded generator; no positions travel.

    With ``rescale`` the kept values are multiplied by n / k, which makes the codec unbiased
    (use it without error feedback); unscaled is the right choice with error feedback.
    """

    name = "randomk"

    @dataclass(frozen=True)
    class Config:
        ratio: float = 0.01  # fraction of the segment's elements kept, in (0, 1]
        scope: str = "global"  # "global" or "tensor"
        rescale: bool = False  # multiply kept values by n / k (unbiased)

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

    def count(self, seg: Segment) -> int | None:
        return _kept(self.config.ratio, seg.numel)

    def select(self, x: torch.Tensor, ctx: StageContext, seg: Segment) -> torch.Tensor:
        return self._draw(x.numel(), ctx, seg).to(x.device)

    def _draw(self, n: int, ctx: StageContext, seg: Segment) -> torch.Tensor:
        gen = ctx.generator(seg.index, "cpu")  # CPU: the same positions whatever the device
        return torch.randperm(n, generator=gen)[: _kept(self.config.ratio, n)].sort().values

    def write_indices(self, idx: torch.Tensor, n: int, out: Writer) -> int:
        return 0

    def read_indices(self, src: Reader, seg: Segment, ctx: StageContext, device: torch.device) -> torch.Tensor:
        return self._draw(seg.numel, ctx, seg).to(device)

    def side_nbytes(self, seg: Segment, count: int) -> int | None:
        return 0

    def scale(self, n: int, k: int) -> float:
        return n / k if self.config.rescale and k else 1.0
