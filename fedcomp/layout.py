"""A model's layout: tensor names, shapes and dtypes, in order, and its fingerprint."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedcomp.errors import SpecError

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64,
        torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
    )
}


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def is_float(self) -> bool:
        return self.torch_dtype.is_floating_point


@dataclass(frozen=True)
class Layout:
    """The ordered tensors of a model. Encoders and decoders must agree on it."""

    tensors: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> "Layout":
        """The layout of a mapping of named tensors, in the mapping's order."""
        specs = []
        for name, t in tensors.items():
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise SpecError(f"tensor {name!r} has dtype {t.dtype}, supported: {sorted(_DTYPES)}")
            specs.append(TensorSpec(str(name), tuple(int(s) for s in t.shape), dtype))
        return cls(tuple(specs))

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def dense_bytes(self) -> int:
        """Bytes of the tensors as plain fp32 (non-float tensors at their own width)."""
        return sum(
            t.numel * (4 if t.is_float else t.torch_dtype.itemsize) for t in self.tensors
        )

    def to_json(self) -> str:
        """A compact JSON description, e.g. to send the layout to a client."""
        return json.dumps([[t.name, list(t.shape), t.dtype] for t in self.tensors], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Layout":
        """Inverse of :meth:`to_json`; raises SpecError on anything malformed."""
        try:
            items = json.loads(text)
            specs = []
            for name, shape, dtype in items:
                if not isinstance(name, str) or dtype not in _DTYPES:
                    raise ValueError(f"bad entry {name!r}: {dtype!r}")
                if not all(isinstance(s, int) and 0 <= s < 2**40 for s in shape):
                    raise ValueError(f"bad shape {shape!r} of {name!r}")
                specs.append(TensorSpec(name, tuple(shape), dtype))
        except (ValueError, TypeError) as exc:
            raise SpecError(f"malformed layout description: {exc}") from exc
        return cls(tuple(specs))

    def fingerprint(self) -> bytes:
        """8 bytes identifying names, shapes and dtypes; sent in every payload instead of them."""
        return hashlib.blake2b(self.to_json().encode(), digest_size=8).digest()

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise SpecError unless ``tensors`` matches this layout exactly."""
        other = Layout.of(tensors)
        if other != self:
            diff = [f"{a} != {b}" for a, b in zip(self.tensors, other.tensors) if a != b][:3]
            raise SpecError(
                f"tensors do not match the layout ({len(other.tensors)} vs {len(self.tensors)} tensors; "
                f"first differences: {diff or 'tensor count'})"
            )
