"""Codec stages and their registry.

A codec is a pipeline of at most two stages: a *selector* (sparsifier) that picks which
elements of a segment travel, then a *quantizer* that codes the values of those elements.
Each stage class declares its parameters as a frozen ``Config`` dataclass (defaults there, one
comment per field) and its traits as class attributes; the registry maps spec names to classes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from fedcomp.errors import SpecError
from fedcomp.wire import Reader, Writer

REGISTRY: dict[str, type["Stage"]] = {}


def register(cls: type["Stage"]) -> type["Stage"]:
    REGISTRY[cls.name] = cls
    return cls


class Stage:
    """Base of selectors and quantizers: config handling and traits."""

    name: ClassVar[str]
    kind: ClassVar[str]  # "selector" or "quantizer"
    unbiased: ClassVar[bool] = False  # E[decode(encode(x))] == x
    Config: ClassVar[type]

    def __init__(self, config: Any) -> None:
        self.config = config
        self.validate()

    def validate(self) -> None:
        """Raise SpecError for out-of-range parameters."""

    @classmethod
    def signature(cls) -> str:
        args = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Config))
        return f"{cls.name}({args})"

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "Stage":
        fields = {f.name: f for f in dataclasses.fields(cls.Config)}
        values = {}
        for key, value in args.items():
            if key not in fields:
                raise SpecError(f"{cls.name}() has no argument {key!r}; valid: {cls.signature()}")
            values[key] = _coerce(cls.name, key, value, type(fields[key].default))
        return cls(cls.Config(**values))

    def canonical(self) -> str:
        args = ",".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self.config).items())
        return f"{self.name}({args})"

    def fail(self, key: str, allowed: str) -> None:
        value = getattr(self.config, key)
        raise SpecError(f"{self.name}({key}={value!r}) is invalid: {key} must be {allowed}")


def _coerce(codec: str, key: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise SpecError(f"{codec}({key}={value!r}): {key} is out of range for a float") from None
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise SpecError(f"{codec}({key}={value!r}): {key} must be a {kind.__name__}")
    return value


class Quantizer(Stage):
    """Codes a 1-D float32 vector of values; sizes depend on the count only."""

    kind = "quantizer"

    def nbytes(self, count: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        """Write the code of ``x`` and return the reconstruction the decoder will produce."""
        raise NotImplementedError

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        raise NotImplementedError


class Selector(Stage):
    """Picks the elements of a segment that travel, and codes their positions."""

    kind = "selector"
    scope: str  # "global": one segment over all float tensors; "tensor": one per tensor

    def default_quantizer(self) -> Quantizer:
        return REGISTRY["none"].from_args({})

    def count(self, n: int) -> int | None:
        """Kept elements of a segment of n, where that does not depend on the data."""
        return None

    def select(self, x: torch.Tensor, gen_cpu: torch.Generator) -> torch.Tensor:
        """Sorted int64 indices of the kept elements of the segment ``x``."""
        raise NotImplementedError

    def write_indices(self, idx: torch.Tensor, n: int, out: Writer) -> int:
        """Write the index stream; return its size in bytes."""
        raise NotImplementedError

    def read_indices(self, src: Reader, n: int, gen_cpu: torch.Generator, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def index_nbytes(self, n: int, k: int) -> int | None:
        """Bytes of the index stream where they depend on n and k only (else None)."""
        return None

    def scale(self, n: int, k: int) -> float:
        """Factor applied to kept values before quantization (random-k's n/k when unbiased)."""
        return 1.0


def block_size(count: int, block: int) -> int:
    """Elements per block for ``count`` elements: ``block``, or ``count`` when block is 0 or larger."""
    return count if block == 0 or block >= count else block


def blocks(count: int, block: int) -> int:
    """Number of blocks of ``block`` elements (0: one block) covering ``count`` elements."""
    return math.ceil(count / block_size(count, block)) if count else 0
