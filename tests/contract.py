"""The codec contract every registered stage must keep, as plain functions over a spec string.

``tests/test_codecs.py`` runs :func:`check_contract` on ``fedcomp.base.example_specs()`` (read
from the registry at collection), and ``tests/test_registry.py`` runs it on a codec registered by
a test. What it checks needs no knowledge of the codec beyond its declared traits:

- the decoded tensors have the layout's names, order, shapes and dtypes; ``Encoded.decoded`` is
  bit for bit what ``decode`` returns; non-float tensors (int64, bool) come back exactly;
- the same input and nonce give the same bytes; ``size_bytes`` is the payload's exact size;
- traits: ``lossless`` codecs return fp32 tensors exactly; ``sparse`` reducers send at most the
  kept values; ``linear`` reducers' values add up (values of a + values of b = values of a + b);
- malformed payloads (truncated, bit-flipped, another layout, random bytes) raise DecodeError only;
- a stage with ``budget_knobs`` can be fitted to a byte budget (message <= budget, same family).

Error bounds are codec-specific and live in test_codecs.py's table, not here.
"""

from __future__ import annotations

import random
import struct
import zlib

import torch

import fedcomp
from fedcomp import DecodeError, Layout
from fedcomp.base import REGISTRY
from fedcomp.budget import BudgetTooSmall, fit_update, limits, same_family
from fedcomp.spec import parse_spec

TRAILER = 4


def contract_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Matrices, a bias, fp16 and bf16 tensors, an int64 buffer and a bool mask, between floats."""
    g = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(24, 20, generator=g) * 0.05,
        "fc1.bias": torch.randn(24, generator=g) * 0.01,
        "bn.num_batches_tracked": torch.tensor(7 + seed, dtype=torch.int64),
        "mask": torch.rand(9, generator=g) < 0.5,
        "emb.weight": (torch.randn(12, 6, generator=g) * 0.1).half(),
        "out.weight": (torch.randn(4, 24, generator=g) * 0.05).bfloat16(),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _reseal(body_and_crc: bytes) -> bytes:
    body = bytes(body_and_crc[:-TRAILER])
    return body + struct.pack("<I", zlib.crc32(body))


def _decode_or_reject(codec, payload, layout) -> bool:
    """True when rejected with DecodeError; a decode must match the layout; anything else fails."""
    try:
        out = codec.decode(payload, layout)
    except DecodeError:
        return True
    assert list(out) == list(layout.names)
    for spec in layout.tensors:
        assert tuple(out[spec.name].shape) == spec.shape and out[spec.name].dtype == spec.torch_dtype
    return False


def check_round_trip(spec: str) -> None:
    codec = fedcomp.build_codec(spec)
    tensors = contract_model()
    layout = Layout.of(tensors)
    enc = codec.encode(tensors, nonce=11, round=1, state={})
    dec = codec.decode(enc.payload, layout, round=1)
    assert list(dec) == list(tensors) == list(enc.decoded), f"{spec}: names or order changed"
    for name, t in tensors.items():
        assert dec[name].shape == t.shape and dec[name].dtype == t.dtype, f"{spec}: {name} shape/dtype"
        assert torch.equal(_bits(dec[name]), _bits(enc.decoded[name])), f"{spec}: {name}: Encoded.decoded != decode"
        if not t.is_floating_point():
            assert torch.equal(_bits(dec[name]), _bits(t)), f"{spec}: {name} ({t.dtype}) not exact"
    if codec.lossless:
        for name, t in tensors.items():
            assert torch.equal(dec[name], t), f"{spec} is lossless but {name} changed"


def check_deterministic_and_sized(spec: str) -> None:
    codec = fedcomp.build_codec(spec)
    tensors = contract_model(1)
    layout = Layout.of(tensors)
    a = codec.encode(tensors, nonce=5, round=2, state={})
    b = codec.encode(tensors, nonce=5, round=2, state={})
    assert a.payload == b.payload, f"{spec}: same input and nonce gave different bytes"
    assert codec.size_bytes(layout, a.kept, a.index_bytes) == len(a.payload), f"{spec}: size_bytes is not exact"
    try:
        assert codec.size_bytes(layout) == len(a.payload), f"{spec}: data-independent size_bytes is not exact"
    except ValueError:
        pass  # the size depends on the data (Rice-coded indices, threshold counts): said so, fine


def check_traits(spec: str) -> None:
    codec = fedcomp.build_codec(spec)
    assert codec.needs_error_feedback == (not codec.unbiased)
    reducer = codec.reducer
    tensors = contract_model(2)
    layout = Layout.of(tensors)
    if reducer is not None and reducer.sparse:
        enc = codec.encode(tensors, nonce=3, state={})
        nonzero = sum(int(torch.count_nonzero(enc.decoded[n])) for n in layout.names if tensors[n].is_floating_point())
        assert nonzero <= sum(enc.kept), f"{spec} is sparse but decodes {nonzero} nonzeros from {sum(enc.kept)} values"
    if codec.linear:
        # fp32 throughout: a sum of half-precision tensors would round before the codec sees it
        fp32 = lambda m: {n: t.float() if t.is_floating_point() else t for n, t in m.items()}  # noqa: E731
        a, b = fp32(tensors), fp32(contract_model(3))
        both = {n: t + b[n] if t.is_floating_point() else t for n, t in a.items()}
        layout = Layout.of(a)
        va, vb, vab = (codec.decode_values(codec.encode(t, state={}).payload, layout) for t in (a, b, both))
        for x, y, z in zip(va, vb, vab):
            assert torch.allclose(x + y, z, atol=1e-4), f"{spec} is linear but its values do not add up"


def check_rejects_malformed(spec: str, seed: int = 0) -> None:
    codec = fedcomp.build_codec(spec)
    tensors = contract_model()
    layout = Layout.of(tensors)
    payload = codec.encode(tensors, nonce=9, state={}).payload
    for cut in sorted({0, 1, len(payload) // 2, len(payload) - 1}):
        assert _decode_or_reject(codec, payload[:cut], layout), f"{spec}: truncation to {cut} B accepted"
    rng = random.Random(seed)
    for _ in range(24):  # single bit flips, with the CRC left (caught there) and recomputed (reaches the body)
        data = bytearray(payload)
        data[rng.randrange(len(data) - TRAILER)] ^= 1 << rng.randrange(8)
        assert _decode_or_reject(codec, bytes(data), layout), f"{spec}: a bit flip passed the CRC"
        _decode_or_reject(codec, _reseal(bytes(data)), layout)
    for _ in range(8):
        _decode_or_reject(codec, _reseal(payload[:24] + rng.randbytes(rng.randrange(64)) + bytes(4)), layout)
    other = Layout.of({**tensors, "extra": torch.zeros(3)})
    assert _decode_or_reject(codec, payload, other), f"{spec}: decoded for another layout"
    assert _decode_or_reject(codec, b"", layout)


def check_budgetable(spec: str) -> None:
    """A spec whose first stage declares budget knobs fits a budget between its limits."""
    tensors = contract_model(4)
    layout = Layout.of(tensors)
    measure = lambda c: len(fedcomp.compress(c, tensors, nonce=1, state={})[0].payload)  # noqa: E731
    lo, hi = limits(spec, layout, measure=measure)
    for budget in (lo, (lo + hi) // 2, hi + 50):
        fit = fit_update(spec, tensors, budget, nonce=1, state={})
        assert fit.message_bytes <= budget and len(fit.encoded.payload) == fit.message_bytes
        assert same_family(spec, fit.spec), f"{fit.spec} is not of the family of {spec}"
    try:
        fit_update(spec, tensors, max(1, lo - 1), nonce=1, state={})
        raise AssertionError(f"{spec}: a budget below the smallest message was met")
    except BudgetTooSmall as exc:
        assert exc.minimum == lo


def check_contract(spec: str) -> None:
    """Every check above that applies to ``spec`` (the budget one where a knob is declared)."""
    check_round_trip(spec)
    check_deterministic_and_sized(spec)
    check_traits(spec)
    check_rejects_malformed(spec)
    first = REGISTRY[parse_spec(spec)[0].name]
    if first.budget_knobs:
        check_budgetable(spec)
