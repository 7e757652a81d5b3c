"""Contract suite run against every fedcomp codec.

Every codec in ``CASES`` must keep names, order, shapes and dtypes, round-trip bit for bit
through its bytes, be deterministic, stay within the error bound its documentation states
(the bounds are re-derived in this file, never taken from library helpers), cost exactly
what ``Codec.size_bytes`` says, and reject malformed payloads with ``DecodeError`` only.

Two layers. The registry contract (:mod:`contract`, run on ``fedcomp.base.example_specs()``,
read from the registry) holds for any registered stage, including one registered outside fedcomp
(tests/test_registry.py): structure, bit-exact round trip, determinism, exact size, declared
traits, rejection of malformed payloads, and a budget fit where the stage declares knobs.
The table ``CASES`` below adds, for fedcomp's own stages, many parameter settings and the error
bound each one documents; a built-in stage fails ``test_table_covers_every_registered_stage``
until it joins the table, and ``test_error_within_stated_bound`` until its bound is written here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import struct
import time
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp
from contract import check_contract
from fedcomp import DecodeError, Layout, SpecError, build_codec, compress
from fedcomp.base import REGISTRY, example_specs

# -- wire facts, from the format description in fedcomp/wire.py ------------------------------
HEADER = 24  # magic 2, version 1, flags 1, layout fingerprint 8, codec fingerprint 4, nonce 8
TRAILER = 4  # CRC32 of everything before it
VERSION_AT, FLAGS_AT, LAYOUT_FP_AT, CODEC_FP_AT, NONCE_AT = 2, 3, 4, 12, 16
OVERHEAD = HEADER + TRAILER

FUZZ = settings(
    max_examples=20,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- the codec table ------------------------------------------------------------------------
# Defaults as documented for each stage; test_documented_defaults checks the library agrees.
DEFAULTS: dict[str, dict] = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "sign": {"block": 0, "scale": "mean"},
    "twobit": {"threshold": 0.001},
    "kbit": {"bits": 4, "block": 256, "stochastic": False, "coding": "packed"},
    "qsgd": {"bits": 4, "bucket": 512, "norm": "max", "coding": "packed"},
    "terngrad": {"clip": 2.5},
    "topk": {"ratio": 0.01, "scope": "global", "index": "rice"},
    "threshold": {"tau": 1e-3, "ratio": 0.0, "mode": "abs", "sample": 0.01, "scope": "global", "index": "rice"},
    "randomk": {"ratio": 0.1, "scope": "global", "rescale": True},
    "dgc": {"ratio": 0.001, "momentum": 0.7, "clip": 0.0, "warmup": 0, "start": 0.25, "sample": 0.01, "index": "rice"},
    "powersgd": {"rank": 2, "min_compression": 2.0, "seed": 0},
    "sketch": {"rows": 1, "cols": 0, "ratio": 0.02, "seed": 0},  # cols 0: from the segment (README)
    "cells": {"cols": 0, "seed": 0},  # the sketch's cells, for its coupled download
}
SELECTORS = {"topk", "threshold", "randomk", "dgc"}
DENSE_REDUCERS = {"powersgd", "sketch", "cells"}  # reducers that are not sparsifiers; own bounds in their test files
REDUCERS = SELECTORS | DENSE_REDUCERS


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    stages: tuple  # ((name, ((key, value), ...)), ...) in spec order

    @property
    def spec(self) -> str:
        return "+".join(f"{name}({', '.join(f'{k}={v!r}' for k, v in args)})" for name, args in self.stages)

    def params(self, name: str) -> dict:
        for stage, args in self.stages:
            if stage == name:
                return {**DEFAULTS[stage], **dict(args)}
        raise KeyError(name)

    @property
    def selector(self) -> str | None:
        return self.stages[0][0] if self.stages[0][0] in SELECTORS else None

    @property
    def reducer(self) -> str | None:
        return self.stages[0][0] if self.stages[0][0] in REDUCERS else None

    @property
    def quantizer(self) -> tuple[str, dict]:
        """(name, params) of the value coding, the selector's default one included."""
        last = self.stages[-1][0]
        if last not in REDUCERS:
            return last, self.params(last)
        if last in DENSE_REDUCERS:
            return "none", {}
        if last == "threshold":  # alone: signs decoding to +-tau (static) or to +- mean |kept| (adaptive)
            p = self.params("threshold")
            return ("sign", {"block": 0, "scale": "mean"}) if p["ratio"] > 0 else ("fixed-sign", {"tau": p["tau"]})
        return "none", {}


def C(case_id: str, *stages: tuple[str, dict]) -> Case:
    return Case(case_id, tuple((name, tuple(args.items())) for name, args in stages))


CASES = [
    C("none", ("none", {})),
    C("fp16", ("fp16", {})),
    C("bf16", ("bf16", {})),
    C("sign-b0", ("sign", {"block": 0})),
    C("sign-b128", ("sign", {"block": 128})),
    C("sign-rms-b100", ("sign", {"block": 100, "scale": "rms"})),
    C("twobit-t0.05", ("twobit", {"threshold": 0.05})),
    C("twobit-default", ("twobit", {})),
    C("kbit1", ("kbit", {"bits": 1})),
    C("kbit3-b100", ("kbit", {"bits": 3, "block": 100})),  # width that does not divide 8
    C("kbit4", ("kbit", {"bits": 4})),
    C("kbit4-b0", ("kbit", {"bits": 4, "block": 0})),
    C("kbit8-b64", ("kbit", {"bits": 8, "block": 64})),
    C("kbit1-sto", ("kbit", {"bits": 1, "stochastic": True})),
    C("kbit4-sto", ("kbit", {"bits": 4, "stochastic": True})),
    C("kbit8-sto", ("kbit", {"bits": 8, "block": 64, "stochastic": True})),
    C("qsgd2-b128", ("qsgd", {"bits": 2, "bucket": 128})),
    C("qsgd3-b100", ("qsgd", {"bits": 3, "bucket": 100})),
    C("qsgd4", ("qsgd", {"bits": 4})),
    C("qsgd4-l2", ("qsgd", {"bits": 4, "norm": "l2"})),
    C("qsgd2-b128-l2", ("qsgd", {"bits": 2, "bucket": 128, "norm": "l2"})),
    C("qsgd8-b0", ("qsgd", {"bits": 8, "bucket": 0})),
    C("terngrad-clip2.5", ("terngrad", {"clip": 2.5})),
    C("terngrad-clip0", ("terngrad", {"clip": 0.0})),
    C("topk-global-rice", ("topk", {"ratio": 0.05})),
    C("topk-global-fixed", ("topk", {"ratio": 0.05, "index": "fixed"})),
    C("topk-tensor-rice", ("topk", {"ratio": 0.1, "scope": "tensor"})),
    C("topk-tensor-fixed", ("topk", {"ratio": 0.1, "scope": "tensor", "index": "fixed"})),
    C("topk-default", ("topk", {})),
    C("randomk-global", ("randomk", {"ratio": 0.1, "rescale": False})),
    C("randomk-rescale", ("randomk", {"ratio": 0.1, "rescale": True})),
    C("randomk-tensor-rescale", ("randomk", {"ratio": 0.2, "scope": "tensor", "rescale": True})),
    C("threshold-rice", ("threshold", {"tau": 0.05})),
    C("threshold-tensor-fixed", ("threshold", {"tau": 0.05, "scope": "tensor", "index": "fixed"})),
    C("threshold-default", ("threshold", {})),
    C("threshold+fp16", ("threshold", {"tau": 0.05}), ("fp16", {})),
    C("topk+qsgd4", ("topk", {"ratio": 0.05}), ("qsgd", {"bits": 4, "bucket": 32})),
    C("topk+qsgd4-l2", ("topk", {"ratio": 0.05}), ("qsgd", {"bits": 4, "norm": "l2"})),
    C("topk-tensor+kbit4", ("topk", {"ratio": 0.1, "scope": "tensor"}), ("kbit", {"bits": 4, "block": 16})),
    C("topk-fixed+kbit8-sto", ("topk", {"ratio": 0.05, "index": "fixed"}), ("kbit", {"bits": 8, "stochastic": True})),
    C("topk+sign", ("topk", {"ratio": 0.05}), ("sign", {"block": 0})),
    C("topk+bf16", ("topk", {"ratio": 0.05}), ("bf16", {})),
    C("topk-tensor+terngrad0", ("topk", {"ratio": 0.1, "scope": "tensor"}), ("terngrad", {"clip": 0.0})),
    C("randomk+sign", ("randomk", {"ratio": 0.1}), ("sign", {"block": 64})),
    C("randomk-rescale+qsgd2", ("randomk", {"ratio": 0.1, "rescale": True}), ("qsgd", {"bits": 2, "bucket": 64})),
    C("randomk-tensor+twobit", ("randomk", {"ratio": 0.2, "scope": "tensor"}), ("twobit", {"threshold": 0.05})),
    C("threshold+qsgd8", ("threshold", {"tau": 0.05}), ("qsgd", {"bits": 8})),
    C("threshold-tensor+terngrad", ("threshold", {"tau": 0.02, "scope": "tensor"}), ("terngrad", {})),
    C("threshold-adaptive", ("threshold", {"ratio": 0.05})),  # alone: +- mean |kept|
    C("threshold-adaptive-signed-tensor-fixed", ("threshold", {"ratio": 0.1, "mode": "signed", "scope": "tensor", "index": "fixed"})),
    C("threshold-adaptive+fp16", ("threshold", {"ratio": 0.05, "sample": 0.5}), ("fp16", {})),
    C("dgc-default", ("dgc", {})),
    C("dgc-r0.05", ("dgc", {"ratio": 0.05})),
    C("dgc-fixed", ("dgc", {"ratio": 0.05, "index": "fixed"})),
    C("dgc+qsgd4", ("dgc", {"ratio": 0.05}), ("qsgd", {"bits": 4, "bucket": 32})),
    C("dgc-warmup+kbit4", ("dgc", {"ratio": 0.02, "warmup": 4, "momentum": 0.5}), ("kbit", {"bits": 4, "block": 16})),
    C("powersgd-default", ("powersgd", {})),  # rank 1
    C("powersgd-r1-mc6", ("powersgd", {"rank": 1, "min_compression": 6.0})),  # emb.weight (20x8) travels raw
    C("powersgd-r2+fp16", ("powersgd", {"rank": 2}), ("fp16", {})),
    C("powersgd-r4-all+qsgd8", ("powersgd", {"rank": 4, "min_compression": 0.0}), ("qsgd", {"bits": 8})),
]
CASES += [
    C("sketch-r1", ("sketch", {"rows": 1, "cols": 64, "ratio": 0.05})),
    C("sketch-r5+fp16", ("sketch", {"rows": 5, "cols": 32, "ratio": 0.02}), ("fp16", {})),
    C("cells-c64", ("cells", {"cols": 64})),
    C("cells-c40+kbit4", ("cells", {"cols": 40, "seed": 3}), ("kbit", {"bits": 4, "block": 16, "stochastic": True})),
]
BY_ID = {c.id: c for c in CASES}
assert len(BY_ID) == len(CASES), "case ids must be unique"
ALL = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
KINDS = ["normal", "spiky", "zeros", "constant"]


# -- inputs ---------------------------------------------------------------------------------
def model(seed: int = 0, kind: str = "normal") -> dict[str, torch.Tensor]:
    """A small model-like update: 2-D weights and biases of different sizes, an int64 buffer
    (0-d, as BatchNorm's num_batches_tracked) between them and a float16 tensor."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    t = {
        "fc1.weight": r(48, 37, std=0.05),
        "fc1.bias": r(48, std=0.01),
        "bn.num_batches_tracked": torch.tensor(1000 + seed, dtype=torch.int64),
        "emb.weight": r(20, 8, std=0.1).half(),
        "fc2.weight": r(10, 48, std=0.05),
        "fc2.bias": r(10, std=0.02),
    }
    # a few outliers so the default twobit/threshold settings have something to send
    pos = torch.randperm(t["fc1.weight"].numel(), generator=g)[:6]
    t["fc1.weight"].view(-1)[pos] = torch.tensor([0.7, -0.9, 1.3, -0.55, 2.0, -1.6])
    for name, v in t.items():
        if not v.is_floating_point():
            continue
        if kind == "zeros":
            t[name] = torch.zeros_like(v)
        elif kind == "constant":
            t[name] = torch.full_like(v, 0.3)
        elif kind == "spiky":  # ~95% exact zeros
            keep = torch.rand(v.shape, generator=g) < 0.05
            t[name] = torch.where(keep, v * 10, torch.zeros_like(v))
    return t


@functools.lru_cache(maxsize=None)
def codec_of(case: Case) -> fedcomp.Codec:
    return build_codec(case.spec)


@functools.lru_cache(maxsize=None)
def encoded(case: Case, kind: str = "normal", seed: int = 0, nonce: int = 0):
    tensors = model(seed, kind)
    return tensors, codec_of(case).encode(tensors, nonce=nonce)


LAYOUT = Layout.of(model())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def assert_same_bits(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        assert same_bits(got[name], want[name]), f"{name} differs"


def reseal(data: bytes) -> bytes:
    """Replace the CRC trailer of a (possibly mutated) payload with the CRC of its other bytes."""
    body = bytes(data[:-TRAILER])
    return body + struct.pack("<I", zlib.crc32(body))


def with_body(payload: bytes, body: bytes) -> bytes:
    return reseal(payload[:HEADER] + body + b"\0" * TRAILER)


def decode_or_reject(codec: fedcomp.Codec, payload, layout: Layout = LAYOUT):
    """Decode; a DecodeError is an accepted outcome, any other exception fails the test.
    A successful decode must have the layout's names, order, shapes and dtypes."""
    try:
        out = codec.decode(payload, layout)
    except DecodeError:
        return None
    assert [n for n in out] == [t.name for t in layout.tensors]
    for spec in layout.tensors:
        assert tuple(out[spec.name].shape) == spec.shape
        assert out[spec.name].dtype == spec.torch_dtype
    return out


# -- the registry contract: every registered stage, with its defaults --------------------------
@pytest.mark.parametrize("spec", example_specs())
def test_registry_contract(spec):
    check_contract(spec)


# -- the table itself -----------------------------------------------------------------------
def test_table_covers_every_registered_stage():
    # fedcomp's own stages; one registered by other code has the registry contract only
    registered = {name for name, cls in REGISTRY.items() if cls.__module__.startswith("fedcomp.")}
    in_table = {name for case in CASES for name, _ in case.stages}
    missing = registered - in_table
    assert not missing, f"registered codecs missing from CASES in {__file__}: {sorted(missing)}"
    assert registered <= set(DEFAULTS), f"add documented defaults for {sorted(registered - set(DEFAULTS))}"
    for sel in registered & SELECTORS:
        assert any(c.selector == sel and len(c.stages) == 2 for c in CASES), f"{sel} never combined with a quantizer"


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_documented_defaults(name):
    assert name in fedcomp.available_codecs()
    codec = build_codec(name)
    stage = codec.reducer if name in REDUCERS else codec.quantizer
    assert stage.name == name
    assert dataclasses.asdict(stage.config) == DEFAULTS[name]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_cross_device_defaults_are_valid_arguments(name):
    """A stage's cross-device defaults name fields of its Config and build a valid stage."""
    cls = REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    assert set(cls.cross_device) <= fields, f"{name}.cross_device names {sorted(set(cls.cross_device) - fields)}"
    spec = f"{name}()" if cls.kind == "quantizer" else f"{name}()+none()"
    out = fedcomp.cross_device_spec(spec)
    assert (out == spec) == (not cls.cross_device)
    assert build_codec(out).spec == out or out == spec  # canonical, and it builds


def test_cross_device_spec_fills_only_what_the_spec_leaves_out():
    assert fedcomp.cross_device_spec("topk()") == "topk(ratio=0.1,scope='global',index='rice')"
    assert fedcomp.cross_device_spec("topk()+qsgd(bits=4)").startswith("topk(ratio=0.1,")
    assert fedcomp.cross_device_spec("topk(scope='tensor')") == "topk(ratio=0.1,scope='tensor',index='rice')"
    assert fedcomp.cross_device_spec("sign(block=64)") == "sign(block=64,scale='rms')"
    assert fedcomp.cross_device_spec("dgc(ratio=0.01)") == "dgc(ratio=0.01)"  # written: stands
    assert fedcomp.cross_device_spec("randomk()") == "randomk(ratio=0.25,scope='global',rescale=True)"
    assert build_codec("sign(scale='mean')").spec == "sign(block=0)"  # the default scale keeps the old spec
    for written in ("topk(ratio=0.01)", "qsgd(bits=4)", "sketch()", "none()", "sign(scale='mean')"):
        assert fedcomp.cross_device_spec(written) == written  # written arguments and stages without any stay


@ALL
def test_spec_is_parsed_as_the_table_means(case):
    codec = codec_of(case)
    if case.reducer:
        assert codec.reducer.name == case.reducer
        assert dataclasses.asdict(codec.reducer.config) == case.params(case.reducer)
    else:
        assert codec.reducer is None
    q_name, q_params = case.quantizer
    assert codec.quantizer.name == q_name
    assert dataclasses.asdict(codec.quantizer.config) == q_params
    # the canonical spec is itself a valid spec naming the same codec
    assert build_codec(codec.spec).spec == codec.spec
    assert build_codec(codec.spec).fingerprint == codec.fingerprint


def expected_unbiased(case: Case) -> bool:
    q_name, qp = case.quantizer
    q = q_name in ("none", "qsgd") or (q_name == "kbit" and qp["stochastic"]) or (q_name == "terngrad" and qp["clip"] == 0)
    s = case.reducer is None or (case.selector == "randomk" and case.params("randomk")["rescale"])
    return bool(q and s)


@ALL
def test_traits(case):
    codec = codec_of(case)
    assert codec.unbiased == expected_unbiased(case)
    assert codec.lossless == (case.id == "none")
    assert codec.needs_error_feedback == (not codec.unbiased)


# -- structure, round trip, determinism ------------------------------------------------------
@ALL
@pytest.mark.parametrize("kind", KINDS)
def test_names_order_shapes_dtypes(case, kind):
    tensors, enc = encoded(case, kind)
    for out in (enc.decoded, codec_of(case).decode(enc.payload, LAYOUT)):
        assert list(out) == list(tensors)
        for name, t in tensors.items():
            assert out[name].shape == t.shape, name
            assert out[name].dtype == t.dtype, name
            assert out[name].device.type == "cpu"
    assert torch.equal(enc.decoded["bn.num_batches_tracked"], tensors["bn.num_batches_tracked"])


@ALL
@pytest.mark.parametrize("kind", KINDS)
def test_serialized_round_trip_is_bit_exact(case, kind):
    _, enc = encoded(case, kind)
    assert isinstance(enc.payload, bytes)
    assert_same_bits(codec_of(case).decode(enc.payload, LAYOUT), enc.decoded)
    # bytearray and memoryview are bytes too
    assert_same_bits(codec_of(case).decode(memoryview(bytearray(enc.payload)), LAYOUT), enc.decoded)


@ALL
def test_deterministic_for_same_input_and_nonce(case):
    tensors = model(3)
    before = {k: v.clone() for k, v in tensors.items()}
    a = codec_of(case).encode(tensors, nonce=12345)
    b = build_codec(case.spec).encode(model(3), nonce=12345)
    assert a.payload == b.payload
    assert_same_bits(a.decoded, b.decoded)
    assert (a.kept, a.index_bytes) == (b.kept, b.index_bytes)
    assert_same_bits(tensors, before)  # encode leaves its input alone


@ALL
def test_non_contiguous_input_encodes_like_contiguous(case):
    tensors = model(4)
    strided = dict(tensors)
    strided["fc1.weight"] = tensors["fc1.weight"].t().contiguous().t()
    strided["fc2.weight"] = torch.empty(48, 10).t().copy_(tensors["fc2.weight"])
    assert not strided["fc1.weight"].is_contiguous()
    assert codec_of(case).encode(strided, nonce=5).payload == codec_of(case).encode(tensors, nonce=5).payload


@ALL
def test_edge_layout_round_trip(case):
    """A 0-d float, an empty tensor, a bool mask and a bfloat16 tensor."""
    g = torch.Generator().manual_seed(11)
    tensors = {
        "scalar": torch.tensor(0.7),
        "empty": torch.zeros(0, 4),
        "vec": torch.randn(5, generator=g),
        "mask": torch.tensor([True, False, True]),
        "bf": torch.randn(6, generator=g).bfloat16(),
    }
    layout = Layout.of(tensors)
    codec = codec_of(case)
    enc = codec.encode(tensors, nonce=2)
    out = codec.decode(enc.payload, layout)
    assert_same_bits(out, enc.decoded)
    assert [tuple(t.shape) for t in out.values()] == [tuple(t.shape) for t in tensors.values()]
    assert torch.equal(out["mask"], tensors["mask"])
    assert codec.size_bytes(layout, enc.kept, enc.index_bytes) == len(enc.payload)


def test_empty_mapping_round_trip():
    codec = build_codec("topk(ratio=0.1)+qsgd")
    enc = codec.encode({})
    assert len(enc.payload) == OVERHEAD
    assert codec.decode(enc.payload, Layout.of({})) == {}


# -- exactness where promised ----------------------------------------------------------------
def test_none_is_lossless_including_special_values():
    tensors = model(1)
    w = tensors["fc1.weight"].view(-1)
    w[:6] = torch.tensor([float("inf"), -float("inf"), -0.0, 1e-40, -3.4e38, 1.17549435e-38])
    e = tensors["emb.weight"].view(-1)
    e[:5] = torch.tensor([65504.0, -0.0, 6e-8, float("-inf"), 2**-14]).half()
    enc = build_codec("none()").encode(tensors, nonce=9)
    assert_same_bits(enc.decoded, tensors)
    assert_same_bits(build_codec("none").decode(enc.payload, LAYOUT), tensors)


def test_none_is_fp32_and_error_feedback_keeps_float64_rounding():
    """none() sends fp32 values: float64 tensors are rounded, and error feedback keeps the rest."""
    x = {"w": torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))}
    codec = build_codec("none()")
    decoded = codec.encode(x).decoded["w"]
    assert decoded.dtype == torch.float64 and same_bits(decoded, x["w"].float().double())
    enc, residual = compress(codec, x)
    torch.testing.assert_close(enc.decoded["w"] + residual["w"].double(), x["w"], rtol=0, atol=1e-12)


def _sparse_model(counts: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    """model() with exactly counts[name] nonzeros in each float tensor."""
    g = torch.Generator().manual_seed(seed)
    tensors = model(seed)
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        flat = torch.zeros(t.numel())
        pos = torch.randperm(t.numel(), generator=g)[: counts[name]]
        flat[pos] = torch.randn(len(pos), generator=g) + torch.sign(torch.randn(len(pos), generator=g))
        tensors[name] = flat.view(t.shape).to(t.dtype)
    return tensors


@pytest.mark.parametrize("index", ["rice", "fixed"])
@pytest.mark.parametrize("k", [1, 37, 200])
def test_topk_global_is_exact_on_k_sparse_input(k, index):
    floats = [s for s in LAYOUT.tensors if s.is_float]
    n = sum(s.numel for s in floats)
    # spread k nonzeros over the tensors
    counts, left = {}, k
    for s in floats:
        counts[s.name] = min(s.numel, left // 2 + 1, left)
        left -= counts[s.name]
    counts[floats[0].name] += left
    tensors = _sparse_model(counts, seed=k)
    ratio = (k - 0.5) / n  # ceil(ratio * n) == k
    codec = build_codec(f"topk(ratio={ratio!r}, index={index!r})")
    enc = codec.encode(tensors, nonce=1)
    assert enc.kept == (k,)
    assert_same_bits(codec.decode(enc.payload, LAYOUT), tensors)
    assert_same_bits(enc.decoded, tensors)


@pytest.mark.parametrize("index", ["rice", "fixed"])
def test_topk_per_tensor_is_exact_on_k_sparse_input(index):
    ratio = 0.1
    floats = [s for s in LAYOUT.tensors if s.is_float]
    counts = {s.name: math.ceil(ratio * s.numel) for s in floats}
    tensors = _sparse_model(counts, seed=5)
    codec = build_codec(f"topk(ratio={ratio}, scope='tensor', index={index!r})")
    enc = codec.encode(tensors, nonce=1)
    assert enc.kept == tuple(counts[s.name] for s in floats)
    assert_same_bits(codec.decode(enc.payload, LAYOUT), tensors)


@pytest.mark.parametrize("spec", ["topk(ratio=1.0)", "topk(ratio=1.0, scope='tensor', index='fixed')", "randomk(ratio=1.0)"])
def test_selectors_keeping_everything_are_exact(spec):
    tensors = model(6)
    enc = build_codec(spec).encode(tensors, nonce=3)
    assert_same_bits(enc.decoded, tensors)
    assert_same_bits(build_codec(spec).decode(enc.payload, LAYOUT), tensors)


def test_topk_keeps_ceil_ratio_n_for_decimal_ratios():
    x = {"w": torch.arange(1.0, 101.0)}
    assert build_codec("topk(ratio=0.07)").encode(x).kept == (7,)


@pytest.mark.parametrize("half", ["fp16", "bf16"])
def test_half_codecs_exact_on_representable_input(half):
    dtype = torch.float16 if half == "fp16" else torch.bfloat16
    tensors = {k: (v.to(dtype).to(v.dtype) if v.is_floating_point() else v) for k, v in model(7).items()}
    enc = build_codec(half).encode(tensors)
    assert_same_bits(enc.decoded, tensors)
    assert_same_bits(build_codec(half).decode(enc.payload, LAYOUT), tensors)


def test_fp16_clamps_beyond_range():
    x = {"w": torch.tensor([1e6, -1e6, 70000.0, 1.0])}
    got = build_codec("fp16").encode(x).decoded["w"]
    assert got.tolist() == [65504.0, -65504.0, 65504.0, 1.0]


@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("block", [0, 16])
def test_kbit_exact_on_its_grid(bits, block):
    levels = 2**bits - 1
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, levels + 1, (160,), generator=g)
    q[:: (block or 160)] = 0  # every block spans the full grid: min and max present
    q[1:: (block or 160)] = levels
    x = {"w": q.float() * 0.25 - 1.0}
    enc = build_codec(f"kbit(bits={bits}, block={block})").encode(x)
    assert_same_bits(enc.decoded, x)


# -- error bounds, written out independently --------------------------------------------------
def _blocks(n: int, block: int) -> list[slice]:
    size = block or n
    return [slice(i, min(i + size, n)) for i in range(0, n, size)] if n else []


def _close(w, expected, half, what, rtol=1e-5):
    tol = torch.where(half, expected.abs() * 2**-10 + 2**-24, expected.abs() * rtol + 1e-30)
    bad = ((w - expected).abs() > tol).nonzero().reshape(-1)
    assert bad.numel() == 0, f"{what}: {bad.numel()} values off, e.g. #{int(bad[0])}: {float(w[bad[0]])} vs {float(expected[bad[0]])}"


def _within(err, bound, half, w, what):
    slack = torch.where(half, w.abs() * 2**-10 + 2**-24, torch.zeros_like(w))
    bad = (err > bound + slack).nonzero().reshape(-1)
    assert bad.numel() == 0, f"{what}: {bad.numel()} errors over the bound, e.g. {float(err[bad[0]])} > {float(bound[bad[0]] if bound.dim() else bound)}"


def check_quantizer(name: str, p: dict, v: torch.Tensor, w: torch.Tensor, half: torch.Tensor) -> None:
    """v: the values the quantizer was given (fp32, in order), w: what came back;
    half: where w went through a float16 tensor (one more rounding)."""
    n = v.numel()
    v64, w64 = v.double(), w.double()
    err = (v64 - w64).abs()
    if name == "none":
        _close(w, v, half, "none")
    elif name == "fp16":
        _close(w, v.clamp(-65504, 65504).half().float(), half, "fp16", rtol=0)
    elif name == "bf16":
        _close(w, v.bfloat16().float(), half, "bf16", rtol=0)
    elif name == "fixed-sign":
        tau = p["tau"]
        _close(w, torch.where(v < 0, -tau, tau).float(), half, "+-tau")
    elif name == "twobit":
        t = p["threshold"]
        want = torch.where(v >= t, t, torch.where(v <= -t, -t, 0.0)).float()
        _close(w, want, half, "twobit codes")
        _within(err, v64.abs() * (1 + 1e-6), half, w64, "twobit |err| <= |x|")
    elif name == "sign":
        for b in _blocks(n, p["block"]):
            xb, wb = v64[b], w64[b]
            d = xb.numel()
            rms = p.get("scale", "mean") == "rms"
            s = (xb**2).sum().sqrt() / d**0.5 if rms else xb.abs().sum() / d
            _close(wb.abs(), torch.full_like(wb, float(s)), half[b], f"sign: |x^| is the block's {'rms' if rms else 'mean |x|'}")
            nz = xb != 0
            assert bool(((wb[nz] < 0) == (xb[nz] < 0)).all()), "sign flipped"
            err2 = ((xb - wb) ** 2).sum()
            norm2 = (xb**2).sum()
            if rms:  # the decoded block keeps x's length; no least-squares identity
                continue
            if not bool(half[b].any()):
                identity = norm2 - xb.abs().sum() ** 2 / d
                assert abs(float(err2 - identity)) <= 1e-5 * float(norm2) + 1e-30, "||x - x^||^2 != ||x||^2 - ||x||_1^2/d"
            assert float(err2) <= float(norm2) * (1 + 1e-3) + 1e-30
    elif name == "kbit":
        levels = 2 ** p["bits"] - 1
        for b in _blocks(n, p["block"]):
            lo, hi = v64[b].min(), v64[b].max()
            scale = (hi - lo) / levels
            eps = 1e-6 * float(max(abs(lo), abs(hi)))
            bound = scale if p["stochastic"] else scale / 2
            _within(err[b], bound + eps, half[b], w64[b], f"kbit bits={p['bits']} |err| <= {'scale' if p['stochastic'] else 'scale/2'}")
            assert float(w64[b].min()) >= float(lo) - eps - 1e-3 * float(half[b].any()) and float(w64[b].max()) <= float(hi) + eps + 1e-3 * float(half[b].any())
    elif name == "qsgd":
        s = 2 ** (p["bits"] - 1) - 1
        for b in _blocks(n, p["bucket"]):
            norm = v64[b].norm() if p["norm"] == "l2" else v64[b].abs().max()
            if float(norm) == 0:
                assert bool((w64[b] == 0).all())
                continue
            _within(err[b], norm / s * (1 + 1e-5), half[b], w64[b], f"qsgd |err| <= {p['norm']}(bucket)/{s}")
            lvl = w64[b].abs() * s / norm
            assert float(lvl.max()) <= s + 1e-3
            if not bool(half[b].any()):
                assert float((lvl - lvl.round()).abs().max()) < 1e-3, "qsgd value is not a level of norm(bucket)/s"
            nz = w64[b] != 0
            assert bool(((w64[b][nz] < 0) == (v64[b][nz] < 0)).all()), "qsgd sign flipped"
    elif name == "terngrad":
        g = v
        if p["clip"] > 0 and n > 1:
            bound = p["clip"] * v.std()
            g = v.clamp(-float(bound), float(bound))
        if n == 0:
            return
        s = g.abs().max().double()
        _close(w.abs(), torch.where(w == 0, 0.0, float(s)).float(), half, "terngrad |x^| in {0, s}")
        nz = w != 0
        assert bool(((w[nz] < 0) == (g[nz] < 0)).all()), "terngrad sign flipped"
        _within((g.double() - w64).abs(), s * (1 + 1e-6), half, w64, "terngrad |clip(g) - x^| <= s")
    else:
        pytest.fail(f"no error bound written for quantizer {name!r}: add one to check_quantizer")


def _segments(case: Case, tensors: dict[str, torch.Tensor], decoded: dict[str, torch.Tensor]):
    """(names, x, y, half) per segment as the codec cuts them: one per float tensor, or one over
    all float tensors in layout order for a global selector."""
    floats = [n for n, t in tensors.items() if t.is_floating_point()]
    glob = case.selector is not None and case.params(case.selector).get("scope", "global") == "global"  # dgc: global only
    for names in ([floats] if glob else [[n] for n in floats]):
        x = torch.cat([tensors[n].reshape(-1).float() for n in names])
        y = torch.cat([decoded[n].reshape(-1).float() for n in names])
        half = torch.cat([torch.full((tensors[n].numel(),), tensors[n].dtype == torch.float16) for n in names])
        yield names, x, y, half


def check_powersgd(case: Case, tensors, decoded) -> None:
    """Per float tensor viewed as n x m (n = shape[0]): a matrix with (n + m) r * min_compression
    <= n m (r = min(rank, n, m)) comes back with rank <= r, so its error is at least the truncated
    SVD's (Eckart-Young), and with fp32 factors at most ||M|| (P_hat P_hat^T M is an orthogonal
    projection); any other tensor travels raw, through the quantizer."""
    p = case.params("powersgd")
    q_name, q_params = case.quantizer
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        x, y = t.reshape(-1).float(), decoded[name].reshape(-1).float()
        half = torch.full((t.numel(),), t.dtype == torch.float16)
        shape, numel = tuple(t.shape), t.numel()
        if len(shape) >= 2 and numel:
            n, m = shape[0], numel // shape[0]
            r = min(p["rank"], n, m)
            if (n + m) * r * p["min_compression"] <= n * m:
                mx, my = x.double().view(n, m), y.double().view(n, m)
                rounding = (2**-11 if t.dtype == torch.float16 else 1e-5) * float(my.norm())  # of the output
                s = torch.linalg.svdvals(my)
                assert float(s[r:].pow(2).sum().sqrt()) <= rounding + 1e-30, f"{name}: rank above {r}"
                err, tail = float((mx - my).norm()), float(torch.linalg.svdvals(mx)[r:].pow(2).sum().sqrt())
                assert err >= tail - rounding - 1e-12, f"{name}: error {err} below the SVD optimum {tail}"
                if q_name == "none":
                    assert err <= float(mx.norm()) + rounding + 1e-12, f"{name}: error {err} above ||M||"
                continue
        check_quantizer(q_name, q_params, x, y, half)


def check_codec_output(case: Case, tensors, decoded, nonce: int) -> None:
    if case.reducer == "powersgd":
        return check_powersgd(case, tensors, decoded)
    if case.reducer in DENSE_REDUCERS:
        return  # no elementwise bound: tests/test_sketch.py and tests/test_powersgd.py check these
    mask_source = None
    if case.selector == "randomk":
        # random-k positions are drawn from the nonce; encode all-ones with random-k alone (no
        # quantizer) at the same nonce to see which positions travel
        sel = Case("", case.stages[:1])
        ones = {k: (torch.ones_like(v) if v.is_floating_point() else v) for k, v in tensors.items()}
        mask_source = build_codec(sel.spec).encode(ones, nonce=nonce).decoded
    for names, x, y, half in _segments(case, tensors, decoded):
        n = x.numel()
        scale = 1.0
        if case.selector is None:
            mask = torch.ones(n, dtype=torch.bool)
        else:
            p = case.params(case.selector)
            if case.selector == "topk":
                k = min(n, max(1, math.ceil(p["ratio"] * n))) if n else 0
                mask = torch.zeros(n, dtype=torch.bool)
                mask[torch.topk(x.abs(), k).indices] = True
                if 0 < k < n:  # the kept set is the k largest magnitudes
                    assert float(x.abs()[mask].min()) >= float(x.abs()[~mask].max())
            elif case.selector == "dgc" or (case.selector == "threshold" and p["ratio"] > 0):
                # sampled top-k: the kept set (from the selector's encode with exact values) holds
                # no zeros and is a top set of |x| (per sign in signed mode) of k = ceil(ratio * count)
                # elements, or of 0.8k..1.3k; all the nonzero ones where at most k are nonzero
                exact = build_codec(Case("", case.stages[:1]).spec + "+none()").encode(tensors, nonce=nonce).decoded
                mask = torch.cat([exact[m].reshape(-1).float() != 0 for m in names])
                signed = case.selector == "threshold" and p["mode"] == "signed"
                for side in ([x > 0, x < 0] if signed else [torch.ones(n, dtype=torch.bool)]):
                    kept, rest = mask & side, ~mask & side
                    c, nnz, k = int(kept.sum()), int((x[side] != 0).sum()), math.ceil(p["ratio"] * int(side.sum()))
                    assert c == nnz if nnz <= k else (c == k or math.ceil(0.8 * k) <= c <= math.floor(1.3 * k)), (c, k, nnz)
                    assert bool((x[kept] != 0).all())
                    if c and bool(rest.any()):
                        assert float(x.abs()[kept].min()) >= float(x.abs()[rest].max())
            elif case.selector == "threshold":
                mask = x.abs() >= p["tau"]
            else:
                mask = torch.cat([mask_source[m].reshape(-1) != 0 for m in names])
                k = min(n, max(1, math.ceil(p["ratio"] * n))) if n else 0
                assert int(mask.sum()) == k
                if p["rescale"]:  # one kept per stratum, scaled by the stratum's size (~n / k)
                    scale = fedcomp.uniforms.stratum_sizes(n, k)
            assert bool((y[~mask] == 0).all()), f"{case.selector}: values outside the kept set"
        q_name, q_params = case.quantizer
        check_quantizer(q_name, q_params, x[mask] if isinstance(scale, float) else x[mask] * scale, y[mask], half[mask])


@ALL
@pytest.mark.parametrize("kind", ["normal", "spiky"])
def test_error_within_stated_bound(case, kind):
    tensors, enc = encoded(case, kind, seed=0, nonce=0)
    check_codec_output(case, tensors, enc.decoded, nonce=0)


@pytest.mark.parametrize("case", [c for c in CASES if c.selector == "threshold" and c.params("threshold")["ratio"] == 0], ids=lambda c: c.id)
def test_threshold_sends_exactly_the_elements_at_or_above_tau(case):
    tau = case.params("threshold")["tau"]
    tensors = model(8)
    # elements exactly at tau are sent
    tensors["fc1.bias"][:2] = torch.tensor([tau, -tau])
    enc = codec_of(case).encode(tensors)
    never_zero = case.quantizer[0] in ("fixed-sign", "fp16", "none")  # a sent value cannot decode to 0
    for name, t in tensors.items():
        if t.is_floating_point():
            sent = enc.decoded[name] != 0
            wanted = t.float().abs() >= tau
            if never_zero:
                assert torch.equal(sent, wanted), name
            else:
                assert not bool((sent & ~wanted).any()), name
    if case.quantizer[0] == "fixed-sign":
        assert torch.equal(enc.decoded["fc1.bias"][:2], torch.tensor([tau, -tau]))


# -- unbiasedness ------------------------------------------------------------------------------
UNBIASED = ["qsgd2-b128", "qsgd4", "qsgd2-b128-l2", "kbit1-sto", "kbit4-sto", "terngrad-clip0", "randomk-rescale", "randomk-tensor-rescale"]
SAMPLES = 2000


def _small_input() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    return {"w": torch.randn(10, 12, generator=g) + 0.3, "b": torch.randn(30, generator=g) * 0.1}


def _step(case: Case, x: torch.Tensor) -> torch.Tensor:
    """Per element, the gap between the two values its stochastic code can take (randomk: 0 or x n/k)."""
    q_name, p = case.quantizer
    n = x.numel()
    if q_name == "qsgd":
        s = 2 ** (p["bits"] - 1) - 1
        norms = [x[b].norm() if p["norm"] == "l2" else x[b].abs().max() for b in _blocks(n, p["bucket"])]
        return torch.cat([torch.full((b.stop - b.start,), float(m) / s) for b, m in zip(_blocks(n, p["bucket"]), norms)])
    if q_name == "kbit":
        levels = 2 ** p["bits"] - 1
        return torch.cat([torch.full((b.stop - b.start,), float(x[b].max() - x[b].min()) / levels) for b in _blocks(n, p["block"])])
    if q_name == "terngrad":
        return torch.full((n,), float(x.abs().max()))
    raise AssertionError(q_name)


@pytest.mark.parametrize("case_id", UNBIASED)
def test_stochastic_codecs_are_unbiased(case_id):
    case = BY_ID[case_id]
    codec = codec_of(case)
    assert codec.unbiased and expected_unbiased(case)
    x = _small_input()
    flat_x = torch.cat([v.reshape(-1) for v in x.values()]).double()
    acc = torch.zeros_like(flat_x)
    acc2 = torch.zeros_like(flat_x)
    for nonce in range(SAMPLES):
        d = codec.encode(x, nonce=nonce).decoded
        y = torch.cat([v.reshape(-1) for v in d.values()]).double()
        acc += y
        acc2 += y * y
    mean = acc / SAMPLES
    var = (acc2 / SAMPLES - mean**2).clamp(min=0) * SAMPLES / (SAMPLES - 1)
    # standard deviation bound of one sample, per element
    if case.selector == "randomk":
        p = case.params("randomk")
        sizes = [flat_x.numel()] if p["scope"] == "global" else [v.numel() for v in x.values()]
        sd = torch.cat([
            seg.abs() * math.sqrt(n / min(n, max(1, math.ceil(p["ratio"] * n))) - 1)
            for seg, n in zip(flat_x.split(sizes), sizes)
        ])
    else:
        sd = torch.cat([_step(case, v.reshape(-1)) / 2 for v in x.values()]).double()
    err = (mean - flat_x).abs()
    tol = 5 * sd / math.sqrt(SAMPLES) + 1e-6 * (flat_x.abs() + sd)
    worst = int(torch.argmax(err - tol))
    assert bool((err <= tol).all()), f"element {worst}: mean {float(mean[worst])} vs x {float(flat_x[worst])}, tol {float(tol[worst])}"
    # all elements together: the squared bias is about the sum of the variances of the means
    assert float((err**2).sum()) <= 3 * float(var.sum()) / SAMPLES + 1e-12
    # and the variance really is there (not a deterministic codec)
    assert float(var.sum()) > 0


def test_unbiasedness_check_detects_a_biased_codec():
    """Power check of the estimator above: nearest-rounding kbit is caught."""
    codec = build_codec("kbit(bits=2, stochastic=false)")
    x = _small_input()
    flat_x = torch.cat([v.reshape(-1) for v in x.values()]).double()
    ys = torch.stack([torch.cat([v.reshape(-1) for v in codec.encode(x, nonce=i).decoded.values()]).double() for i in range(50)])
    bias2 = float(((ys.mean(0) - flat_x) ** 2).sum())
    assert bias2 > 3 * float(ys.var(0).sum()) / 50 + 1e-12


# -- sizes -------------------------------------------------------------------------------------
def data_dependent_size(case: Case) -> bool:
    return (case.selector in ("threshold", "dgc") or (case.selector == "topk" and case.params("topk")["index"] == "rice")
            or case.reducer == "cells")  # the cells where the update is nonzero, gap coded


@ALL
@pytest.mark.parametrize("kind", KINDS)
def test_size_formula_matches_payload(case, kind):
    _, enc = encoded(case, kind)
    assert codec_of(case).size_bytes(LAYOUT, enc.kept, enc.index_bytes) == len(enc.payload)


@ALL
def test_data_independent_size(case):
    codec = codec_of(case)
    if data_dependent_size(case):
        with pytest.raises(ValueError):
            codec.size_bytes(LAYOUT)
        return
    size = codec.size_bytes(LAYOUT)
    for kind, seed in [("normal", 0), ("normal", 1), ("zeros", 0), ("spiky", 2)]:
        assert len(encoded(case, kind, seed)[1].payload) == size, (kind, seed)


@pytest.mark.parametrize(
    "case_id, bits, block_bits, block",
    [
        ("sign-b0", 1, 32, 0),  # one fp32 scale per tensor
        ("sign-b128", 1, 32, 128),
        ("twobit-t0.05", 2, 0, 0),
        ("kbit1", 1, 64, 256),  # (min, scale) fp32 pair per block
        ("kbit3-b100", 3, 64, 100),
        ("kbit4", 4, 64, 256),
        ("kbit8-b64", 8, 64, 64),
        ("qsgd2-b128", 2, 32, 128),  # fp32 norm per bucket
        ("qsgd4", 4, 32, 512),
        ("terngrad-clip0", 2, 32, 0),
        ("fp16", 16, 0, 0),
        ("none", 32, 0, 0),
    ],
)
def test_bits_per_element(case_id, bits, block_bits, block):
    _, enc = encoded(BY_ID[case_id])
    floats = [s for s in LAYOUT.tensors if s.is_float]
    n = sum(s.numel for s in floats)
    raw = sum(s.numel * s.torch_dtype.itemsize for s in LAYOUT.tensors if not s.is_float)
    nblocks = sum(math.ceil(s.numel / (block or s.numel)) for s in floats)
    extra = 8 * (len(enc.payload) - OVERHEAD - raw) - bits * n
    assert 0 <= extra <= block_bits * nblocks + 7 * len(floats), f"{extra} bits beyond {bits} per element"


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_rice_index_cost_near_entropy_bound(ratio):
    n = 50_000
    x = {"w": torch.randn(n, generator=torch.Generator().manual_seed(1))}
    enc = build_codec(f"topk(ratio={ratio})").encode(x)
    k = enc.kept[0]
    bound = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
    header_bits = 9 * 8  # k, Rice parameter, unary length
    assert 8 * enc.index_bytes[0] - header_bits <= 1.05 * bound + 16
    fixed = build_codec(f"topk(ratio={ratio}, index='fixed')").encode(x)
    assert fixed.index_bytes[0] == 4 + math.ceil(k * math.ceil(math.log2(n)) / 8)


@pytest.mark.parametrize("spec", ["sign(block={b})", "kbit(block={b})", "qsgd(bucket={b})"], ids=["sign", "kbit", "qsgd"])
def test_block_larger_than_segment_is_one_block(spec):
    x = {"w": torch.randn(10, generator=torch.Generator().manual_seed(0))}
    one = build_codec(spec.format(b=0)).encode(x).decoded["w"]
    huge = build_codec(spec.format(b=2**62)).encode(x).decoded["w"]
    assert torch.equal(one, huge)


# -- malformed payloads --------------------------------------------------------------------
@ALL
def test_truncation_rejected(case):
    _, enc = encoded(case)
    p = enc.payload
    lengths = set(range(0, min(len(p), 64))) | set(range(64, len(p), max(1, len(p) // 40))) | {len(p) - 1}
    for cut in sorted(lengths):
        with pytest.raises(DecodeError):
            codec_of(case).decode(p[:cut], LAYOUT)


@ALL
def test_truncation_and_extension_with_valid_crc_rejected(case):
    """The CRC is rewritten, so the body's own length checks must catch these."""
    _, enc = encoded(case)
    p, codec = enc.payload, codec_of(case)
    body = p[HEADER:-TRAILER]
    cuts = set(range(0, min(len(body), 24))) | set(range(0, len(body), max(1, len(body) // 30))) | {len(body) - 1}
    for cut in sorted(c for c in cuts if c < len(body)):
        with pytest.raises(DecodeError):
            codec.decode(with_body(p, body[:cut]), LAYOUT)
    for tail in (b"\0", b"\xff" * 3, bytes(8), bytes(range(64))):
        with pytest.raises(DecodeError):
            codec.decode(with_body(p, body + tail), LAYOUT)


@ALL
def test_single_bit_flips_rejected(case):
    _, enc = encoded(case)
    p, codec = enc.payload, codec_of(case)
    rng = random.Random(case.id)
    positions = list(range(HEADER)) + rng.sample(range(HEADER, len(p)), min(48, len(p) - HEADER)) + list(range(len(p) - TRAILER, len(p)))
    for pos in positions:
        for bit in range(8):
            bad = bytearray(p)
            bad[pos] ^= 1 << bit
            with pytest.raises(DecodeError):
                codec.decode(bytes(bad), LAYOUT)


@ALL
def test_single_bit_flips_with_valid_crc(case):
    """Past the checksum: a flip is rejected or decodes to a well-formed result. Header flips
    other than in the nonce must always be rejected, but for a version flipped to an older one
    the codec still reads (random-k's 3 to 2 or 1: its payload read the way that format was)."""
    _, enc = encoded(case)
    p, codec = enc.payload, codec_of(case)
    rng = random.Random(case.id)
    for pos in range(NONCE_AT):
        for bit in range(8):
            bad = bytearray(p)
            bad[pos] ^= 1 << bit
            if pos == VERSION_AT and 1 <= bad[pos] <= codec.wire_version:
                decode_or_reject(codec, reseal(bad))
                continue
            with pytest.raises(DecodeError):
                codec.decode(reseal(bad), LAYOUT)
    body_positions = range(NONCE_AT, len(p) - TRAILER)
    for pos in rng.sample(body_positions, min(80, len(body_positions))):
        bad = bytearray(p)
        bad[pos] ^= 1 << rng.randrange(8)
        decode_or_reject(codec, reseal(bad))


@ALL
@pytest.mark.parametrize("version", [0, 2, 255])
def test_wrong_version_rejected(case, version):
    _, enc = encoded(case)
    bad = bytearray(enc.payload)
    newest = codec_of(case).wire_version  # formats 1..newest decode (randomk: 3, its draw)
    bad[VERSION_AT] = newest + 1 if 0 < version <= newest else version
    for payload in (bytes(bad), reseal(bad)):
        with pytest.raises(DecodeError, match="version"):
            codec_of(case).decode(payload, LAYOUT)


def _other_layouts() -> dict[str, Layout]:
    t = model()
    reordered = dict(reversed(list(t.items())))
    reshaped = dict(t, **{"fc1.weight": t["fc1.weight"].reshape(37, 48)})
    retyped = dict(t, **{"emb.weight": t["emb.weight"].float()})
    renamed = {("fc1.w" if k == "fc1.weight" else k): v for k, v in t.items()}
    fewer = {k: v for k, v in t.items() if k != "fc2.bias"}
    more = dict(t, extra=torch.zeros(3))
    return {
        name: Layout.of(x)
        for name, x in dict(reordered=reordered, reshaped=reshaped, retyped=retyped, renamed=renamed, fewer=fewer, more=more, empty={}).items()
    }


OTHER_LAYOUTS = _other_layouts()


@ALL
def test_wrong_layout_rejected(case):
    _, enc = encoded(case)
    for name, layout in OTHER_LAYOUTS.items():
        with pytest.raises(DecodeError, match="layout"):
            codec_of(case).decode(enc.payload, layout)


@ALL
def test_wrong_codec_rejected(case):
    _, enc = encoded(case)
    for other in CASES:
        if other.spec != case.spec:
            with pytest.raises(DecodeError, match="codec"):
                codec_of(other).decode(enc.payload, LAYOUT)


@ALL
def test_other_codec_body_with_forged_header(case):
    """Another codec's body under this codec's fingerprint and a valid CRC: structural
    validation alone must reject it or decode it to a well-formed result."""
    _, mine = encoded(case)
    for other in CASES:
        _, enc = encoded(other)
        forged = bytearray(enc.payload)
        forged[CODEC_FP_AT:NONCE_AT] = mine.payload[CODEC_FP_AT:NONCE_AT]
        decode_or_reject(codec_of(case), reseal(forged))


@ALL
def test_empty_and_non_bytes_rejected(case):
    codec = codec_of(case)
    for junk in (b"", bytearray(), b"FC", b"FC\x01" + bytes(40), "FC" * 30, None, 12, [1, 2, 3], bytes(OVERHEAD)):
        with pytest.raises(DecodeError):
            codec.decode(junk, LAYOUT)


@ALL
@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_rejected(case, data):
    with pytest.raises(DecodeError):
        codec_of(case).decode(data, LAYOUT)


@ALL
@FUZZ
@given(body=st.binary(max_size=400))
def test_random_body_with_valid_header(case, body):
    _, enc = encoded(case)
    decode_or_reject(codec_of(case), with_body(enc.payload, body))


U32S = [0, 1, 2, 7, 8, 9, 63, 64, 255, 256, 2473, 2474, 2475, 2**16, 2**24, 2**31 - 1, 2**31, 2**32 - 1]
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 2**20), st.integers(0, 7)),
        st.tuples(st.just("byte"), st.integers(0, 2**20), st.integers(0, 255)),
        st.tuples(st.just("u32"), st.integers(0, 2**20), st.sampled_from(U32S)),
        st.tuples(st.just("delete"), st.integers(0, 2**20), st.integers(1, 16)),
        st.tuples(st.just("insert"), st.integers(0, 2**20), st.binary(min_size=1, max_size=16)),
    ),
    min_size=1,
    max_size=4,
)


def _mutate(body: bytes, ops) -> bytes:
    b = bytearray(body)
    for op, pos, arg in ops:
        if op == "insert":
            at = pos % (len(b) + 1)
            b[at:at] = arg
            continue
        if not b:
            continue
        at = pos % len(b)
        if op == "flip":
            b[at] ^= 1 << arg
        elif op == "byte":
            b[at] = arg
        elif op == "u32":
            b[at:at + 4] = struct.pack("<I", arg)[: len(b) - at]
        elif op == "delete":
            del b[at:at + arg]
    return bytes(b)


@ALL
@FUZZ
@given(ops=_ops)
def test_random_mutations_with_valid_crc(case, ops):
    _, enc = encoded(case)
    decode_or_reject(codec_of(case), with_body(enc.payload, _mutate(enc.payload[HEADER:-TRAILER], ops)))


@ALL
def test_every_u32_overwrite_with_valid_crc(case):
    """Overwrite each 4-byte window of the body's first 64 bytes (counts, lengths, parameters)."""
    _, enc = encoded(case)
    body = enc.payload[HEADER:-TRAILER]
    for at in range(min(len(body), 64)):
        for value in (0, 1, 2**31, 2**32 - 1):
            decode_or_reject(codec_of(case), with_body(enc.payload, _mutate(body, [("u32", at, value)])))


@pytest.mark.parametrize(
    "spec",
    [
        "topk(ratio=0.05)",
        "topk(ratio=0.05, index='fixed')",
        "topk(ratio=0.1, scope='tensor')",
        "topk(ratio=0.05)+qsgd(bits=4)",
        "threshold(tau=0.05)",
        "threshold(tau=0.05, index='fixed')+fp16",
        "threshold(ratio=0.05)",
        "dgc(ratio=0.05)",
        "dgc(ratio=0.05, index='fixed')+qsgd(bits=4)",
    ],
)
@pytest.mark.parametrize("claim", ["n+1", "2n", "2**31", "2**32-1"])
def test_decompression_bomb_rejected(spec, claim):
    codec = build_codec(spec)
    tensors = model()
    enc = codec.encode(tensors)
    scope_global = "scope='tensor'" not in spec
    n = sum(t.numel() for t in tensors.values() if t.is_floating_point()) if scope_global else tensors["fc1.weight"].numel()
    body = enc.payload[HEADER:-TRAILER]
    (k,) = struct.unpack_from("<I", body, 0)
    assert k == enc.kept[0]  # the first segment's k leads the body
    huge = {"n+1": n + 1, "2n": 2 * n, "2**31": 2**31, "2**32-1": 2**32 - 1}[claim]
    bad = with_body(enc.payload, struct.pack("<I", huge) + body[4:])
    start = time.perf_counter()
    with pytest.raises(DecodeError):
        codec.decode(bad, LAYOUT)
    assert time.perf_counter() - start < 1.0
    if "fixed" not in spec:  # Rice: the unary stream length follows k (u32) and r (u8)
        bad = with_body(enc.payload, body[:5] + struct.pack("<I", 2**32 - 1) + body[9:])
        with pytest.raises(DecodeError):
            codec.decode(bad, LAYOUT)
        (r,) = struct.unpack_from("<B", body, 4)
        for r_bad in (41, 63, 255):
            with pytest.raises(DecodeError):
                codec.decode(with_body(enc.payload, body[:4] + bytes([r_bad]) + body[5:]), LAYOUT)


def _pack_msb(values, width: int) -> bytes:
    """Unsigned integers, ``width`` bits each, most significant bit first, zero padded."""
    bits = "".join(format(v, f"0{width}b") for v in values)
    bits += "0" * (-len(bits) % 8)
    return int(bits, 2).to_bytes(len(bits) // 8, "big") if bits else b""


def _hand_built_topk(index: str, idx: list[int], values: list[float], r: int = 4, pad_unary: bytes = b"") -> tuple:
    """A topk(index=...) payload for LAYOUT written from the documented wire format, not by fedcomp:
    u32 k, the index stream, k fp32 values, then the raw int64 buffer."""
    codec = build_codec(f"topk(ratio=0.01, index={index!r})")
    tensors = model()
    template = codec.encode(tensors).payload
    n = sum(s.numel for s in LAYOUT.tensors if s.is_float)
    body = struct.pack("<I", len(idx))
    if index == "fixed":
        body += _pack_msb(idx, math.ceil(math.log2(n)))
    else:
        gaps = [b - a - 1 for a, b in zip([-1] + idx[:-1], idx)]
        unary = "".join("1" * (g >> r) + "0" for g in gaps)
        unary += "1" * (-len(unary) % 8)
        unary_bytes = (int(unary, 2).to_bytes(len(unary) // 8, "big") if unary else b"") + pad_unary
        body += struct.pack("<BI", r, len(unary_bytes)) + unary_bytes + _pack_msb([g & ((1 << r) - 1) for g in gaps], r)
    body += struct.pack(f"<{len(values)}f", *values) + struct.pack("<q", int(tensors["bn.num_batches_tracked"]))
    return codec, with_body(template, body), n


@pytest.mark.parametrize("index", ["fixed", "rice"])
def test_hand_built_payload_decodes_as_documented(index):
    idx = [0, 5, 6, 100, 1775, 1776, 2000]
    vals = [1.5, -2.0, 0.25, 3.0, -1.0, 7.0, 0.5]
    codec, payload, n = _hand_built_topk(index, idx, vals)
    out = codec.decode(payload, LAYOUT)
    flat = torch.cat([out[s.name].reshape(-1).float() for s in LAYOUT.tensors if s.is_float])
    want = torch.zeros(n)
    want[idx] = torch.tensor(vals)
    assert torch.equal(flat, want)


@pytest.mark.parametrize(
    "idx",
    [[5, 5, 9], [9, 5, 100], [3, 7, 2474], [0, 1, 4095]],
    ids=["duplicate", "decreasing", "index-n", "index-max"],
)
def test_fixed_index_stream_must_be_increasing_and_in_range(idx):
    codec, payload, _ = _hand_built_topk("fixed", idx, [1.0, 2.0, 3.0])
    with pytest.raises(DecodeError):
        codec.decode(payload, LAYOUT)


@pytest.mark.parametrize("defect", ["trailing-unary-byte", "index-n", "k-too-small", "k-too-large"])
def test_rice_index_stream_inconsistencies_rejected(defect):
    idx, vals, pad = [3, 40, 900], [1.0, 2.0, 3.0], b""
    if defect == "trailing-unary-byte":
        pad = b"\xff"
    elif defect == "index-n":
        idx = [3, 40, 2474]
    codec, payload, _ = _hand_built_topk("rice", idx, vals, pad_unary=pad)
    if defect.startswith("k-"):
        body = bytearray(payload[HEADER:-TRAILER])
        body[0:4] = struct.pack("<I", 2 if defect == "k-too-small" else 4)
        payload = with_body(payload, bytes(body))
    with pytest.raises(DecodeError):
        codec.decode(payload, LAYOUT)


@pytest.mark.parametrize("spec, offset, code", [("twobit(threshold=0.05)", 0, 0b01), ("terngrad(clip=0)", 4, 0b11)])
def test_unused_two_bit_codes_rejected(spec, offset, code):
    """twobit never writes 01, terngrad never writes 11: such a code in the first tensor is an error."""
    codec = build_codec(spec)
    enc = codec.encode(model())
    body = bytearray(enc.payload[HEADER:-TRAILER])
    body[offset] = (body[offset] & 0x3F) | (code << 6)  # first element's code (MSB first)
    with pytest.raises(DecodeError):
        codec.decode(with_body(enc.payload, bytes(body)), LAYOUT)


def test_nonce_change_with_valid_crc_is_a_valid_payload():
    """The nonce seeds random-k positions: a different nonce is a different, legal payload."""
    case = BY_ID["randomk-global"]
    tensors = {k: (v.float() if v.is_floating_point() else v) for k, v in model().items()}  # no fp16 rounding
    enc = codec_of(case).encode(tensors, nonce=0)
    forged = bytearray(enc.payload)
    forged[NONCE_AT:NONCE_AT + 8] = struct.pack("<Q", 99)
    out = codec_of(case).decode(reseal(forged), Layout.of(tensors))

    def flat(d):
        return torch.cat([v.reshape(-1).float() for v in d.values() if v.is_floating_point()])

    # the same values, in the same order, at the positions nonce 99 draws
    moved = flat(codec_of(case).encode(tensors, nonce=99).decoded) != 0
    assert torch.equal(flat(out) != 0, moved)
    assert torch.equal(flat(out)[moved], flat(enc.decoded)[flat(enc.decoded) != 0])


# -- spec parser and errors ----------------------------------------------------------------------
def test_unknown_codec_lists_available():
    with pytest.raises(SpecError) as err:
        build_codec("zstd(level=3)")
    assert "'zstd'" in str(err.value)
    for name, signature in fedcomp.available_codecs().items():
        assert signature in str(err.value), name


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_unknown_argument_lists_valid_args_with_defaults(name):
    with pytest.raises(SpecError) as err:
        build_codec(f"{name}(nosuch=1)")
    msg = str(err.value)
    assert "'nosuch'" in msg
    for key, value in DEFAULTS[name].items():
        assert f"{key}={value!r}" in msg, (key, msg)


@pytest.mark.parametrize(
    "spec, named",
    [
        ("topk(ratio=0)", "ratio=0"),
        ("topk(ratio=1.5)", "ratio=1.5"),
        ("randomk(ratio=-0.1)", "ratio=-0.1"),
        ("kbit(bits=9)", "bits=9"),
        ("kbit(bits=0)", "bits=0"),
        ("kbit(block=-1)", "block=-1"),
        ("kbit(bits=4.5)", "bits=4.5"),
        ("kbit(stochastic=1)", "stochastic=1"),
        ("qsgd(bits=1)", "bits=1"),
        ("qsgd(bits=9)", "bits=9"),
        ("qsgd(bucket=-8)", "bucket=-8"),
        ("qsgd(norm='l1')", "'l1'"),
        ("twobit(threshold=-1)", "threshold=-1"),
        ("twobit(threshold=0)", "threshold=0"),
        ("sign(block=-2)", "block=-2"),
        ("terngrad(clip=-1)", "clip=-1"),
        ("threshold(tau=0)", "tau=0"),
        ("topk(scope='x')", "'x'"),
        ("topk(scope=x)", "'x'"),
        ("randomk(scope='layer')", "'layer'"),
        ("topk(index='zip')", "'zip'"),
        ("topk(ratio='half')", "'half'"),
        ("randomk(rescale='yes')", "'yes'"),
    ],
)
def test_bad_values_name_the_value(spec, named):
    with pytest.raises(SpecError) as err:
        build_codec(spec)
    assert named in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "spec",
    [
        "topk(ratio=0.1)+qsgd(bits=4)+none()",  # three stages
        "topk+randomk+qsgd",
        "qsgd(bits=4)+topk(ratio=0.1)",  # quantizer before selector
        "none()+topk",
        "fp16+bf16",  # two quantizers
        "topk+randomk",  # two selectors
    ],
)
def test_bad_chains_rejected(spec):
    with pytest.raises(SpecError, match="followed by a quantizer"):
        build_codec(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "   ",
        "+",
        "topk(",
        "topk)",
        "topk(ratio)",
        "topk(ratio=)",
        "topk(=0.1)",
        "topk(ratio=0.1,,)",
        "topk(ratio=0.1 scope=tensor)",
        "topk(ratio=0.1, ratio=0.2)",
        "topk(ratio=0.1)+",
        "topk(ratio=0.1)qsgd",
        "kbit(bits=4);fp16",
        "kbit(bits=0x4)",
        "kbit(bits=1_0)",
    ],
)
def test_syntax_errors(spec):
    with pytest.raises(SpecError):
        build_codec(spec)


@pytest.mark.parametrize("spec", [None, 3, b"fp16", ["fp16"]])
def test_non_string_spec_rejected(spec):
    with pytest.raises(SpecError):
        build_codec(spec)


def test_spec_is_never_evaluated(tmp_path):
    marker = tmp_path / "evaluated"
    attacks = [
        "__import__('os').system('x')",
        f"__import__('pathlib').Path({str(marker)!r}).touch()",
        f"kbit(bits=__import__('pathlib').Path({str(marker)!r}).touch())",
        f"kbit(bits={{__import__('pathlib').Path({str(marker)!r}).touch()}})",
        "topk(ratio=1/2)",
        "kbit(bits=2+2)",
        "eval('fp16')",
        "topk(ratio=0.1).__class__",
        "kbit(bits=4)\nimport os",
    ]
    for spec in attacks:
        with pytest.raises(SpecError):
            build_codec(spec)
    assert not marker.exists()


def test_equivalent_spellings_build_the_same_codec():
    same = [
        ["fp16", "fp16()", " fp16 ( ) ", "FP16"],
        ["topk(ratio=0.5, scope='tensor')", "topk(ratio=.5,scope=tensor)", 'TopK( ratio = 5e-1 , scope = "tensor" )', "topk(scope=tensor, ratio=0.5)"],
        ["kbit(bits=8, stochastic=true)", "kbit(stochastic=True, bits=8.0)", "kbit(bits=8,block=256,stochastic=TRUE)"],
        ["topk(ratio=1)", "topk(ratio=1.0)"],
    ]
    for group in same:
        specs = {build_codec(s).spec for s in group}
        assert len(specs) == 1, group


def test_huge_integer_literal_is_a_spec_error():
    with pytest.raises(SpecError):
        build_codec("topk(ratio=1" + "0" * 400 + ")")


_SPEC_ALPHABET = "abcdefgiklnopqrstuwxz_()=,+.-'\"0123456789 eE"
_names = st.sampled_from(sorted(DEFAULTS) + ["nosuch", "TOPK"])
_keys = st.sampled_from(sorted({k for d in DEFAULTS.values() for k in d} | {"x"}))
_values = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False).map(repr),
    st.sampled_from(["true", "false", "'global'", "tensor", "rice", "'fixed'", "nan", "inf", "-0", "1e-400", "1e400"]),
)
_stage = st.tuples(_names, st.lists(st.tuples(_keys, _values), max_size=3)).map(
    lambda s: f"{s[0]}({', '.join(f'{k}={v}' for k, v in s[1])})"
)


@settings(max_examples=150, deadline=None, database=None)
@given(text=st.one_of(st.text(alphabet=_SPEC_ALPHABET, max_size=40), st.lists(_stage, min_size=1, max_size=3).map("+".join)))
def test_spec_fuzz_raises_only_spec_error(text):
    try:
        codec = build_codec(text)
    except SpecError:
        return
    assert build_codec(codec.spec).spec == codec.spec


# -- CUDA ----------------------------------------------------------------------------------------
CUDA_CASES = list(BY_ID)  # every case: a GPU run is rare, and each case takes milliseconds there


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case_id", CUDA_CASES)
def test_cuda_encode_matches_cpu_decode(case_id):
    case = BY_ID[case_id]
    codec = codec_of(case)
    tensors = {k: v.cuda() for k, v in model(2).items()}
    enc = codec.encode(tensors, nonce=77)
    assert all(t.device.type == "cuda" for t in enc.decoded.values())
    on_cpu = codec.decode(enc.payload, LAYOUT)
    assert_same_bits({k: v.cpu() for k, v in enc.decoded.items()}, on_cpu)
    on_gpu = codec.decode(enc.payload, LAYOUT, device="cuda")
    assert all(t.device.type == "cuda" for t in on_gpu.values())
    assert_same_bits({k: v.cpu() for k, v in on_gpu.items()}, on_cpu)
    assert codec.size_bytes(LAYOUT, enc.kept, enc.index_bytes) == len(enc.payload)
    check_codec_output(case, {k: v.cpu() for k, v in tensors.items()}, on_cpu, nonce=77)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case_id", CUDA_CASES)
def test_cuda_accumulator_sums_what_the_cpu_sums(case_id):
    """The server's decode + add with its sums on the GPU (Accumulator(device='cuda')) against the
    CPU's (fused loops where numba is there), for replies encoded on the GPU: the same float64 sums
    up to rounding (the GPU's adds need not fuse the multiply-add as the CPU loops do)."""
    from fedcomp.aggregate import Accumulator

    codec = codec_of(BY_ID[case_id])
    payloads = [codec.encode({k: v.cuda() for k, v in model(seed).items()}, nonce=seed).payload for seed in (3, 4, 5)]
    sums = []
    for device in ("cpu", "cuda"):
        acc = Accumulator(codec, LAYOUT, device=device, batch=2)
        for i, payload in enumerate(payloads):
            acc.add(payload, 1.0 + i)
        sums.append({k: v.cpu() for k, v in acc.sum().items()})
    assert list(sums[0]) == list(sums[1])
    for name, want in sums[0].items():
        torch.testing.assert_close(sums[1][name], want, rtol=1e-12, atol=1e-12 * float(want.abs().max()) + 1e-300,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_segments_of_recent_layouts_are_kept_and_fresh_lists():
    codec = fedcomp.build_codec("kbit(bits=4)")
    layouts = [fedcomp.Layout.of({"a": torch.zeros(n, 3), "b": torch.zeros(2)}) for n in range(1, 12)]
    first = [codec.segments(lay) for lay in layouts]  # past the cache's 8: it starts over
    assert [s[0][0].numel for s in first] == [3 * n for n in range(1, 12)]
    again = codec.segments(fedcomp.Layout.of({"a": torch.zeros(5, 3), "b": torch.zeros(2)}))  # an equal layout
    assert again == first[4] == codec._segments(layouts[4])
    again.clear()  # the caller's own list
    assert codec.segments(layouts[4]) == first[4]
