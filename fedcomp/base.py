"""Codec stages and their registry.

A codec is a pipeline of at most two stages: a *selector* (sparsifier) that picks which
elements of a segment travel, then a *quantizer* that codes the values of those elements.
Each stage class declares its parameters as a frozen ``Config`` dataclass (defaults there, one
comment per field) and its traits as class attributes; the registry maps spec names to classes.

Traits (read from the class by ``Codec``, the byte-budget controller and the contract tests):

    unbiased        E[decode(encode(x))] == x (a property where a parameter decides, e.g. kbit's stochastic)
    linear          (reducers) values of several encodes may be summed before expanding (sketch)
    sparse          (reducers) decodes to the kept values and zeros elsewhere (every Selector)
    scope           (reducers) "global": one segment over all float tensors; "tensor": one per tensor
    budget_knobs    the parameters a byte budget may move, with their scale and range (Knob)
    budget_args     arguments forced when budgeted (threshold and dgc select exactly: sample=1.0)
    feedback        error feedback applies (False for rescaled random-k: its residual would grow by n/k - 1)
    cross_device    defaults for a run where each client takes part now and then, taken as a set by a
                    spec that writes none of them (``fedcomp.cross_device_spec``); measured, not guessed

A codec that needs error feedback is one that is not unbiased (``Codec.needs_error_feedback``).

Adding a codec: subclass ``Quantizer`` (values -> bytes; ``write`` and ``read_values`` are optional
faster paths with defaults; a compiled fast path is ``fedcomp.codecs.fastpath.RunCodec``) or ``Reducer``/``Selector`` (segment ->
fewer values + side information), give it ``name``, ``Config`` and its traits, decorate it with
``@register``, and import its module where fedcomp loads the built-in ones (fedcomp/codec.py) or
in your own code before building specs. Nothing else names it: tests/test_codecs.py's registry
contract, the fuzz targets (fedcomp.simulations.fuzz) and fedcomp.budget enumerate the registry.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedcomp.errors import SpecError
from fedcomp.layout import TensorSpec
from fedcomp.wire import Reader, Writer, output_like, output_zeros

REGISTRY: dict[str, type["Stage"]] = {}
SCALES = ("fraction", "count", "block", "levels")  # how a budget knob's values run (see Knob)


def register(cls: type["Stage"]) -> type["Stage"]:
    """Class decorator: make a stage available to specs under ``cls.name``.

    That is all a new codec needs: the contract tests, the fuzz targets and the byte-budget
    controller enumerate this registry and read the class's traits (``unbiased``, ``linear``,
    ``sparse``, ``budget_knobs``...). :func:`unregister` undoes it (tests that define a codec).
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or getattr(cls, "kind", None) not in ("quantizer", "reducer"):
        raise SpecError(f"cannot register {cls!r}: a stage needs a non-empty str name and subclasses Quantizer or Reducer")
    old = REGISTRY.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):  # a reload may replace
        raise SpecError(f"a codec named {name!r} is already registered ({old.__module__}.{old.__qualname__}); "
                        f"pick another name")
    for knob in getattr(cls, "budget_knobs", ()):
        if knob.param not in {f.name for f in dataclasses.fields(cls.Config)}:
            raise SpecError(f"{name}: budget knob {knob.param!r} is not a field of {name}.Config")
    REGISTRY[name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a registered stage (a test-local codec): specs naming it fail again."""
    REGISTRY.pop(name, None)


@dataclass(frozen=True)
class Knob:
    """A parameter a byte budget may move (declared on the stage class in ``budget_knobs``).

    ``scale`` says how its values run; the controller (:mod:`fedcomp.budget`) bisects the fine
    scales and tries ``levels`` one by one, highest first::

        "fraction"  param = i / n, i = 1..n, n = elements of the stage's largest segment (ratio)
        "count"     param = i, i = lo..hi (hi None: the layout's float elements; e.g. sketch cols)
        "block"     param = elements per scale, from the most values a segment holds down to
                    ``lo`` (each step finer costs bytes; kbit block, qsgd bucket)
        "levels"    param = hi, hi - 1, ..., lo (bits, rank); a quantizer after a reducer only
                    moves up from the written value (the user's choice is a floor)
    """

    param: str  # the Config field the controller sets
    scale: str  # one of SCALES
    lo: int = 1  # smallest value ("block": smallest block; "levels"/"count": smallest level)
    hi: int | None = None  # largest value; None: from the layout (Stage.knob_limit)

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise SpecError(f"budget knob {self.param!r}: scale {self.scale!r} is not one of {SCALES}")

    @property
    def fine(self) -> bool:
        """Bisected (many close values) rather than tried level by level."""
        return self.scale != "levels"


class Stage:
    """Base of selectors and quantizers: config handling and traits."""

    name: ClassVar[str]
    kind: ClassVar[str]  # "reducer" or "quantizer"
    Config: ClassVar[type]
    # -- traits (class attributes; read by Codec, the budget controller, the contract tests) --
    unbiased: ClassVar[bool] = False  # E[decode(encode(x))] == x (may be a property where a parameter decides)
    budget_knobs: ClassVar[tuple[Knob, ...]] = ()  # parameters a byte budget may move, finest last
    budget_args: ClassVar[dict[str, Any]] = {}  # arguments a budgeted stage is forced to (exact selection)
    cross_device: ClassVar[dict[str, Any]] = {}  # defaults when each client takes part now and then
    feedback: ClassVar[bool] = True  # error feedback applies (may be a property where a parameter decides)
    wire_version: ClassVar[int] = 1  # payload format version its payloads carry (it reads all up to it)

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

    def knob_limit(self, knob: Knob, floats: list[TensorSpec]) -> int:
        """Largest value of a "levels" or "count" knob on a model with these float tensors
        (default: the knob's ``hi``, else the number of float elements)."""
        return knob.hi if knob.hi is not None else max(1, sum(t.numel for t in floats))

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

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """`encode`'s bytes without the reconstruction (a client's upload needs none). Override
        where skipping it saves work; the default calls `encode`."""
        self.encode(x, out, gen)

    def read_values(self, src: Reader, count: int, device: torch.device):
        """Read and check ``count`` values without dequantizing them yet (a
        `fedcomp.codecs.values.Values`, built range by range), so the server adds a reply to its
        sum without a dense copy. Override to keep codes packed; the default decodes at once and
        returns the tensor (`fedcomp.codecs.values.read_values` wraps it). Its values equal
        `decode`'s."""
        return self.decode(src, count, device)


@dataclass(frozen=True)
class Segment:
    """A stretch of the flattened update that one reducer call sees: one tensor, or all float tensors."""

    index: int  # position among the payload's segments
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int


class Reseeded:
    """``gen(i)``: one ``torch.Generator`` reseeded with ``seeds[i]`` at each call, valid until the
    next. ``seeds`` and ``device`` tell a caller that derives what the generators would draw some
    other way (``fastpath._stream_keys``: every segment's stream key in one compiled call)."""

    def __init__(self, seeds: list[int], device: torch.device | str = "cpu") -> None:
        self.seeds = seeds
        self.device = torch.device(device)
        self._gen = torch.Generator(device=device)

    def __call__(self, i: int) -> torch.Generator:
        return self._gen.manual_seed(self.seeds[i])


@dataclass
class StageContext:
    """What a stage may use besides its input: the nonce, the round, and (encoder side) state."""

    nonce: int = 0
    round: int = 0
    state: dict[str, torch.Tensor] | None = None  # client-side stage state, updated in place

    def generator(self, segment: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A private generator seeded from (nonce, segment): the decoder can rebuild it."""
        gen = torch.Generator(device=device)
        gen.manual_seed(self._seed(segment))
        return gen

    def generators(self, segments: Sequence[int], device: torch.device | str = "cpu") -> Reseeded:
        """``gen(i)``: :meth:`generator` of ``segments[i]`` as one generator reseeded at each call,
        valid until the next (callers that use each in turn). Why: making a ``torch.Generator``
        costs about as much as seeding and drawing from it (161 stream keys of a ResNet-50 layout
        1.2 ms made one by one, 0.65 ms reseeded)."""
        return Reseeded([self._seed(j) for j in segments], device)

    def _seed(self, segment: int) -> int:
        return (self.nonce * 0x9E3779B97F4A7C15 + segment + 1) & ((1 << 63) - 1)


class Reducer(Stage):
    """Turns a segment into fewer values (kept elements, sketch cells, low-rank factors) and back.

    The pipeline quantizer codes the values; the reducer writes whatever side information its
    decoder needs (positions, shapes) and rebuilds the dense segment from decoded values.
    """

    kind = "reducer"
    scope: str = "global"  # "global": one segment over all float tensors; "tensor": one per tensor
    linear: ClassVar[bool] = False  # values of several encodes may be summed before expand
    sparse: ClassVar[bool] = False  # decodes to a few nonzero elements (values at kept positions, zeros elsewhere)

    def max_values(self, floats: list[TensorSpec]) -> int:
        """Most values one segment hands the quantizer, for a model with these float tensors
        (at most: the segment's elements; the budget's "block" range for the quantizer)."""
        numels = [t.numel for t in floats]
        return (sum(numels) if self.scope == "global" else max(numels, default=0))

    def default_quantizer(self) -> Quantizer:
        return REGISTRY["none"].from_args({})

    def count(self, seg: Segment) -> int | None:
        """Number of values of a segment, where that does not depend on the data."""
        return None

    def side_nbytes(self, seg: Segment, count: int) -> int | None:
        """Bytes of side information where they depend on the segment and count only."""
        return None

    def reduce(self, x: torch.Tensor, seg: Segment, out: Writer, ctx: StageContext) -> tuple[torch.Tensor, Any, int]:
        """Write side information; return (values to quantize, aux for expand, side bytes)."""
        raise NotImplementedError

    def read(self, src: Reader, seg: Segment, ctx: StageContext, device: torch.device) -> Any:
        """Read side information; return the aux that :meth:`expand` and :meth:`value_count` take."""
        raise NotImplementedError

    def value_count(self, aux: Any, seg: Segment) -> int:
        raise NotImplementedError

    def expand(self, values: torch.Tensor, aux: Any, seg: Segment) -> torch.Tensor:
        """The dense segment (1-D, fp32) from decoded values."""
        raise NotImplementedError

    # -- error-feedback hooks (client side), per named tensor -----------------------------
    def accumulate(
        self, update: dict[str, torch.Tensor], residual: dict[str, torch.Tensor], ctx: StageContext
    ) -> dict[str, torch.Tensor]:
        """What gets encoded: by default update + residual (plain error feedback)."""
        return add_residual(update, residual)

    def after_encode(self, target: dict[str, torch.Tensor], decoded: dict[str, torch.Tensor], ctx: StageContext) -> None:
        """Update client state once the encode is known (DGC masks its momentum here)."""


class Selector(Reducer):
    """A sparsifier: picks the elements of a segment that travel, and codes their positions."""

    sparse = True
    budget_knobs = (Knob("ratio", "fraction"),)  # a subclass without a ratio sets its own (or ())

    def select(self, x: torch.Tensor, ctx: StageContext, seg: Segment) -> torch.Tensor:
        """Sorted int64 indices of the kept elements of the segment ``x``."""
        raise NotImplementedError

    def write_indices(self, idx: torch.Tensor, n: int, out: Writer) -> int:
        """Write the index stream; return its size in bytes."""
        raise NotImplementedError

    def read_indices(self, src: Reader, seg: Segment, ctx: StageContext, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def scale(self, n: int, k: int) -> float:
        """Factor applied to kept values before quantization (random-k's n/k when unbiased)."""
        return 1.0

    def reduce(self, x, seg, out, ctx):
        idx = self.select(x, ctx, seg)
        side = self.write_indices(idx, seg.numel, out)
        scale = self.scale(seg.numel, idx.numel())
        return (x[idx] * scale if scale != 1.0 else x[idx]), idx, side

    def read(self, src, seg, ctx, device):
        return self.read_indices(src, seg, ctx, device)

    def value_count(self, aux, seg):
        return aux.numel()

    def expand(self, values, aux, seg):
        y = output_zeros(seg.numel) if values.device.type == "cpu" else torch.zeros(seg.numel, device=values.device)
        y[aux] = values
        return y


def add_residual(
    update: Mapping[str, torch.Tensor], residual: Mapping[str, torch.Tensor], *, promote: bool = False
) -> dict[str, torch.Tensor]:
    """update + residual, per tensor: the one error-feedback add-back (encode, skip, re-send).

    Keys and order are ``update``'s: a tensor without a residual of its shape comes back as it is
    (a residual of another shape is stale, and ignored); residuals of other tensors are dropped.
    The sum is in the update's dtype, or with ``promote`` in the dtype a residual is kept in
    (fp32 at least, float64 stays float64), so that nothing of the residual is rounded away.
    """
    out = {}
    for n, t in update.items():
        if promote and t.is_floating_point():
            t = t.to(torch.promote_types(t.dtype, torch.float32))
        r = residual.get(n)
        out[n] = torch.add(t, r.to(t.device, t.dtype), out=output_like(t)) if r is not None and r.shape == t.shape else t
    return out


def block_size(count: int, block: int) -> int:
    """Elements per block for ``count`` elements: ``block``, or ``count`` when block is 0 or larger."""
    return count if block == 0 or block >= count else block


def blocks(count: int, block: int) -> int:
    """Number of blocks of ``block`` elements (0: one block) covering ``count`` elements."""
    return math.ceil(count / block_size(count, block)) if count else 0


def example_specs(names: list[str] | None = None) -> tuple[str, ...]:
    """Specs that exercise registered stages with their defaults (all of them, or ``names``).

    A quantizer alone and after ``topk(ratio=0.1)``; a reducer alone and before ``kbit()``. The
    contract tests (tests/test_codecs.py) and the fuzz targets (fedcomp.simulations.fuzz) run
    these, so a newly registered codec is tested and fuzzed without an edit there.
    """
    out = []
    for name in names if names is not None else list(REGISTRY):
        cls = REGISTRY[name]
        if cls.kind == "quantizer":
            out += [f"{name}()", f"topk(ratio=0.1)+{name}()"]
        else:
            out += [f"{name}()", f"{name}()+kbit()"]
    return tuple(out)
