"""Fuzz targets for every fedcomp decoder, and an atheris harness for long runs.

The same targets serve two drivers: ``tests/test_fuzz.py`` (hypothesis, bounded, in CI) and
this module's ``main`` (atheris, coverage guided, for millions of inputs)::

    pip install -c constraints.txt atheris==3.0.0      # a manylinux wheel, no compiler needed
    python -m fedcomp.simulations.fuzz -runs=1000000            # all targets, round robin
    python -m fedcomp.simulations.fuzz --target 'topk(ratio=0.1)' -runs=100000

One fuzz input is a *mutation* of a real payload (see :func:`mutate`): bit flips, truncation,
extension, byte overwrites and insertions, header fields and 32-bit count fields set to
extreme values, random bodies behind a valid header, or plain random bytes. Most mutations
recompute the CRC32 trailers (the outer one, and a policy's sub-payload ones) so that the
input reaches the decoder body instead of stopping at the checksum.

The property (:func:`check`): decoding returns tensors of exactly the layout's names, shapes
and dtypes, or raises :class:`fedcomp.FedcompError` from an explicit check; any other exception
is a bug, and so is a DecodeError made by ``Codec.decode``'s last-resort conversion of a stray
RuntimeError/ValueError (it would hide a missing check). While a
decode runs, :func:`allocation_guard` fails any torch factory call (zeros, empty, randint...)
asking for more elements than ``ALLOC_FACTOR`` x (layout elements + payload bits): the
decoder's memory is bounded by the model it was given, never by what a payload claims.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Protocol

import torch

import fedcomp
from fedcomp.base import REGISTRY, example_specs
from fedcomp.simulations.layouts import random_update
from fedcomp.spec import parse_spec
from fedcomp.policy import PolicyCodec
from fedcomp.wire import HEADER_BYTES

# Hand-picked: every built-in stage, each index coding, scope and the policies' sub-payload framing.
# A registered stage none of these names is fuzzed with its defaults (all_specs).
SPECS: tuple[str, ...] = (
    "none()",
    "fp16",
    "bf16",
    "sign(block=8)",
    "twobit(threshold=0.3)",
    "kbit(bits=3, block=16)",
    "kbit(bits=8, block=0, stochastic=true)",
    "qsgd(bits=4, bucket=32)",
    "qsgd(bits=5, bucket=0, norm=l2)",
    "terngrad",
    "topk(ratio=0.1)",
    "topk(ratio=0.2, scope=tensor, index=fixed)+qsgd(bits=3, bucket=16)",
    "threshold(tau=0.5)",
    "threshold(ratio=0.1, mode=signed)+fp16",
    "randomk(ratio=0.1, rescale=true)+kbit(bits=2, block=8)",
    "dgc(ratio=0.05)",
    "dgc(ratio=0.1, index=fixed)+qsgd(bits=4)",
    "powersgd(rank=2)",
    "powersgd(rank=1, min_compression=0)+fp16",
    "sketch(rows=3, cols=64, ratio=0.1)",
    "numel<100: fp16; topk(ratio=0.1)+qsgd(bits=4)",
    "round<2: kbit(bits=8); name~b*: none(); sign(block=0)",
)



def all_specs() -> tuple[str, ...]:
    """SPECS, then example specs (fedcomp.base.example_specs) of every registered stage that SPECS
    does not use; the registry is read now, so a codec registered later joins."""
    used = {stage.name for spec in SPECS if ";" not in spec for stage in parse_spec(spec)}
    return SPECS + example_specs([name for name in REGISTRY if name not in used])


ALLOC_FACTOR = 64  # a decode may allocate 64 x (layout elements + payload bits), e.g. sketch rows x n


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small model with matrices, a 3-d tensor, a bias, half-precision, integer and bool tensors."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(24, 40, generator=g),
        "conv": torch.randn(6, 4, 3, generator=g),
        "b": torch.randn(24, generator=g),
        "h": torch.randn(10, generator=g).half(),
        "bb": torch.randn(7, generator=g).bfloat16(),
        "steps": torch.tensor([3, 4], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


@dataclass(frozen=True)
class Target:
    """A codec, the layout its decoder is given, a real payload and the round it was encoded for."""

    spec: str
    codec: object
    layout: fedcomp.Layout
    payload: bytes
    round: int
    name: str = ""  # the spec, or "spec @ layout j" for a drawn layout's target

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.spec)


def build_targets(specs: tuple[str, ...] | None = None) -> list[Target]:
    """One target per spec (default: :func:`all_specs`): a real encode of a random update of :func:`model`."""
    specs = all_specs() if specs is None else specs
    update = model(seed=1)
    layout = fedcomp.Layout.of(update)
    out = []
    for i, spec in enumerate(specs):
        codec = fedcomp.build_codec(spec)
        rnd = 1 + i % 3
        enc = codec.encode(update, nonce=fedcomp.derive_nonce(7, rnd, i), round=rnd, state={})
        out.append(Target(spec, codec, layout, enc.payload, rnd))
    return out


def build_layout_targets(specs: tuple[str, ...] | None = None, per_spec: int = 2, seed: int = 0) -> list[Target]:
    """``per_spec`` targets per spec on layouts drawn as the property tests draw them
    (:mod:`fedcomp.simulations.layouts`: sizes off every block width, 0-d and empty tensors, many
    tiny tensors, mixed dtypes, a large tensor among small ones, fixed models)."""
    specs = all_specs() if specs is None else specs
    out = []
    for i, spec in enumerate(specs):
        codec = fedcomp.build_codec(spec)
        for j in range(per_spec):
            update = random_update(random.Random(f"{seed}:{spec}:{j}"))
            rnd = 1 + (i + j) % 3
            enc = codec.encode(update, nonce=fedcomp.derive_nonce(seed, rnd, i), round=rnd, state={})
            out.append(Target(spec, codec, fedcomp.Layout.of(update), enc.payload, rnd, f"{spec} @ layout {j}"))
    return out


# -- mutations ------------------------------------------------------------------------------------
class Draw(Protocol):
    """Where a mutation takes its choices from (hypothesis data, atheris FuzzedDataProvider)."""

    def int(self, lo: int, hi: int) -> int: ...  # inclusive bounds
    def bytes(self, n: int) -> bytes: ...


def fix_crc(data: bytes, nested: bool = False) -> bytes:
    """Recompute the CRC32 trailer (and, for a policy payload, each sub-payload's, best effort)."""
    if len(data) < 4:
        return data
    body = bytearray(data[:-4])
    if nested:
        pos = HEADER_BYTES
        while pos + 5 <= len(body):
            (size,) = struct.unpack_from("<I", body, pos + 1)
            start, end = pos + 5, pos + 5 + size
            if size < 4 or end > len(body):
                break
            sub = bytes(body[start:end - 4])
            body[end - 4:end] = struct.pack("<I", zlib.crc32(sub))
            pos = end
    return bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))


EXTREMES = (0, 1, 2, 255, 256, 65535, 2**31 - 1, 2**31, 2**32 - 1)
MUTATIONS = 10


def mutate(payload: bytes, draw: Draw, nested: bool = False) -> bytes:
    """One mutation of ``payload``, chosen by ``draw`` (ops documented in the module docstring)."""
    op = draw.int(0, MUTATIONS - 1)
    data = bytearray(payload)
    n = len(data)
    if op in (0, 1):  # bit flips; op 1 recomputes the CRC so the body decoder sees them
        for _ in range(draw.int(1, 8)):
            pos = draw.int(0, n * 8 - 1)
            data[pos // 8] ^= 1 << (pos % 8)
        return fix_crc(bytes(data), nested) if op == 1 else bytes(data)
    if op == 2:  # truncation, CRC recomputed over what is left
        return fix_crc(bytes(data[: draw.int(0, n - 1)]), nested)
    if op == 3:  # extension
        return fix_crc(bytes(data[:-4]) + draw.bytes(draw.int(1, 64)) + bytes(4), nested)
    if op == 4:  # one header field (magic, version, flags, layout fp, codec fp, nonce) rewritten
        start, size = ((0, 2), (2, 1), (3, 1), (4, 8), (12, 4), (16, 8))[draw.int(0, 5)]
        data[start:start + size] = draw.bytes(size).ljust(size, b"\0")
        return fix_crc(bytes(data), nested)
    if op == 5:  # a body slice overwritten with random bytes
        pos = draw.int(HEADER_BYTES, max(HEADER_BYTES, n - 5))
        chunk = draw.bytes(draw.int(1, 16))
        data[pos:pos + len(chunk)] = chunk
        return fix_crc(bytes(data[:n]), nested)
    if op == 6:  # bytes inserted into or deleted from the body
        pos = draw.int(HEADER_BYTES, max(HEADER_BYTES, n - 4))
        if draw.int(0, 1):
            data[pos:pos] = draw.bytes(draw.int(1, 16))
        else:
            del data[pos:pos + draw.int(1, 16)]
        return fix_crc(bytes(data), nested)
    if op == 7:  # a 32-bit field (counts, lengths) set to an extreme value
        pos = draw.int(HEADER_BYTES, max(HEADER_BYTES, n - 8))
        value = EXTREMES[draw.int(0, len(EXTREMES) - 1)]
        if pos + 4 <= n - 4:
            data[pos:pos + 4] = struct.pack("<I", value)
        return fix_crc(bytes(data), nested)
    if op == 8:  # random bytes
        return draw.bytes(draw.int(0, 256))
    # op 9: the real header, a random body, a valid CRC
    return fix_crc(bytes(data[:HEADER_BYTES]) + draw.bytes(draw.int(0, 2 * n)) + bytes(4), nested)


# -- the property ---------------------------------------------------------------------------------
class AllocationError(AssertionError):
    """A decode asked torch for more memory than its layout and payload justify."""


_FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange")


def _numel(args: tuple, kwargs: dict, name: str) -> int:
    """Elements a torch factory call asks for (0 where the arguments are not plain sizes)."""
    try:
        if name == "randperm":
            return int(args[0])
        if name == "arange":
            nums = [float(a) for a in args if isinstance(a, (int, float))]
            start, end = (0.0, nums[0]) if len(nums) == 1 else (nums[0], nums[1])
            step = nums[2] if len(nums) > 2 else 1.0
            return max(0, math.ceil((end - start) / step))
        if name == "randint":
            size = kwargs.get("size", next((a for a in args if isinstance(a, (tuple, list, torch.Size))), ()))
        else:
            first = args[0] if args else ()
            size = kwargs.get("size", first if isinstance(first, (tuple, list, torch.Size)) else args)
        return math.prod(int(s) for s in size)
    except (TypeError, ValueError, IndexError):
        return 0


@contextlib.contextmanager
def allocation_guard(limit: int):
    """Fail any ``torch.<factory>`` call inside the block that asks for more than ``limit`` elements."""
    saved = {name: getattr(torch, name) for name in _FACTORIES}

    def guarded(name, fn):
        def call(*args, **kwargs):
            count = _numel(args, kwargs, name)
            if count > limit:
                raise AllocationError(f"torch.{name} of {count} elements during a decode (limit {limit})")
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(torch, name, guarded(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)


def check(target: Target, data: bytes) -> str:
    """Decode ``data`` as ``target`` would; return "ok" or "rejected", raise on a bug.

    Bugs: any exception other than FedcompError, an allocation above the bound, or a decode
    whose tensors do not match the layout.
    """
    limit = ALLOC_FACTOR * (target.layout.numel + 8 * len(data) + 1024)
    codec = target.codec
    try:
        with allocation_guard(limit):
            out = codec.decode(data, target.layout, round=target.round)
            if getattr(codec, "linear", False):
                codec.decode_values(data, target.layout)
    except fedcomp.FedcompError as exc:
        cause = exc.__cause__
        if cause is not None and not isinstance(cause, fedcomp.FedcompError):
            # Codec.decode turns stray RuntimeError/ValueError/... into DecodeError as a last line
            # of defence; reaching it means a missing check, so the fuzzer counts it as a failure
            raise AssertionError(f"{target.spec}: the decoder's fallback caught {cause!r}") from exc
        return "rejected"
    if list(out) != list(target.layout.names):
        raise AssertionError(f"{target.spec}: decoded names {list(out)} != layout {target.layout.names}")
    for spec in target.layout.tensors:
        t = out[spec.name]
        if tuple(t.shape) != spec.shape or t.dtype != spec.torch_dtype:
            raise AssertionError(f"{target.spec}: {spec.name} decoded as {tuple(t.shape)} {t.dtype}, layout {spec}")
        if t.dtype == torch.bool and bool((t.view(torch.uint8) > 1).any()):
            raise AssertionError(f"{target.spec}: bool tensor {spec.name} decoded with raw bytes other than 0/1")
    return "ok"


def is_nested(target: Target) -> bool:
    return isinstance(target.codec, PolicyCodec)


# -- atheris driver -------------------------------------------------------------------------------
class _AtherisDraw:
    def __init__(self, fdp) -> None:
        self.fdp = fdp

    def int(self, lo: int, hi: int) -> int:
        return self.fdp.ConsumeIntInRange(lo, hi) if hi > lo else lo

    def bytes(self, n: int) -> bytes:
        return self.fdp.ConsumeBytes(n)


def _instrument(atheris) -> None:
    """Coverage feedback from fedcomp's own code (imported before atheris was): every function
    and method of the fedcomp modules gets atheris's edge counters."""
    import inspect

    seen = set()
    for name, module in list(sys.modules.items()):
        if not (name == "fedcomp" or name.startswith("fedcomp.")):
            continue
        for obj in vars(module).values():
            funcs = [obj] if inspect.isfunction(obj) else (
                [v for v in vars(obj).values() if inspect.isfunction(v)] if inspect.isclass(obj) else [])
            for fn in funcs:
                if fn.__module__.startswith("fedcomp") and id(fn) not in seen:
                    seen.add(id(fn))
                    atheris.instrument_func(fn)


def main(argv: list[str] | None = None) -> None:
    import atheris  # only the long-run driver needs it (dev extra)

    _instrument(atheris)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", help="spec(s) to fuzz (default: all_specs())")
    args, rest = parser.parse_known_args(argv)
    specs = tuple(args.target) if args.target else None
    targets = build_targets(specs) + build_layout_targets(specs)
    counts = {t.name: [0, 0] for t in targets}
    runs = next((int(a.split("=", 1)[1]) for a in rest if a.startswith("-runs=")), 0)
    every = max(1, min(runs or 100_000, 100_000))

    def report() -> None:  # atheris exits the process itself: print from inside the loop
        total = sum(a + b for a, b in counts.values())
        print(f"fedcomp fuzz: {total} inputs, 0 failures (a failure stops the run and saves its input)", flush=True)
        for spec, (rejected, ok) in counts.items():
            print(f"  {spec:70s} rejected {rejected:8d}  decoded {ok:8d}", flush=True)

    def one_input(raw: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(raw)
        target = targets[fdp.ConsumeIntInRange(0, len(targets) - 1)]
        data = mutate(target.payload, _AtherisDraw(fdp), is_nested(target))
        result = check(target, data)
        counts[target.name][result == "ok"] += 1
        total = sum(a + b for a, b in counts.values())
        if total % every == 0 or total == runs:
            report()

    if not any(a.startswith("-max_len=") for a in rest):
        rest.append("-max_len=512")  # room for a mutation's choices and its random bytes
    atheris.Setup([sys.argv[0], *rest], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
