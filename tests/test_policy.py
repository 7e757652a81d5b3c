"""Layer-wise policies and round schedules (fedcomp.policy)."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp.policy import PolicyCodec


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"fc1.weight": torch.randn(256, 64, generator=g), "fc1.bias": torch.randn(256, generator=g),
            "fc2.weight": torch.randn(10, 256, generator=g), "fc2.bias": torch.randn(10, generator=g),
            "steps": torch.tensor(4)}


LAYOUT = fedcomp.Layout.of(_model())
SPECS = [
    "numel<5000: fp16(); topk(ratio=0.01)+qsgd(bits=4)",
    "name~*.bias: none(); name~fc2.*: kbit(bits=8); topk(ratio=0.05)",
    "round<5: kbit(bits=8); topk(ratio=0.01)+qsgd(bits=4)",
    "round<10: topk(ratio=0.05); round<30 & numel>=1000: topk(ratio=0.02); topk(ratio=0.01)",
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("round", [1, 7, 12, 40])
def test_round_trip_and_sizes(spec, round):
    codec = fedcomp.build_codec(spec)
    assert isinstance(codec, PolicyCodec)
    enc = codec.encode(_model(), nonce=3, round=round)
    out = codec.decode(enc.payload, LAYOUT, round=round)
    assert list(out) == list(LAYOUT.names)
    for name, t in out.items():
        assert t.dtype == _model()[name].dtype and t.shape == _model()[name].shape
        assert torch.equal(t, enc.decoded[name])
    assert fedcomp.build_codec(codec.spec).spec == codec.spec


def test_rules_pick_codecs_per_tensor():
    codec = fedcomp.build_codec(SPECS[0])
    groups = {i: sub.names for i, sub in codec.groups(LAYOUT, round=1)}
    assert groups == {0: ("fc1.bias", "fc2.weight", "fc2.bias", "steps"), 1: ("fc1.weight",)}
    enc = codec.encode(_model(), round=1)
    m = _model()
    for small in ("fc1.bias", "fc2.weight", "fc2.bias"):  # fp16: close everywhere
        torch.testing.assert_close(enc.decoded[small], m[small], rtol=1e-3, atol=1e-3)
    assert int((enc.decoded["fc1.weight"] != 0).sum()) == 164  # 1% of 16384, top-k
    by_name = fedcomp.build_codec(SPECS[1]).encode(m, round=1).decoded
    assert torch.equal(by_name["fc1.bias"], m["fc1.bias"]) and torch.equal(by_name["fc2.bias"], m["fc2.bias"])


def test_schedule_changes_with_rounds():
    codec = fedcomp.build_codec(SPECS[3])
    nonzero = {r: int((codec.encode(_model(), round=r).decoded["fc1.weight"] != 0).sum()) for r in (1, 15, 40)}
    assert nonzero[1] > nonzero[15] > nonzero[40] > 0
    warm = fedcomp.build_codec(SPECS[2])
    assert len(warm.encode(_model(), round=1).payload) > 5 * len(warm.encode(_model(), round=5).payload)


def test_size_formula_where_sizes_are_data_independent():
    codec = fedcomp.build_codec("numel<5000: fp16(); kbit(bits=4)")
    assert codec.size_bytes(LAYOUT) == len(codec.encode(_model()).payload)


def test_decoding_for_another_round_or_layout_fails_cleanly():
    codec = fedcomp.build_codec(SPECS[2])
    payload = codec.encode(_model(), round=9).payload
    with pytest.raises(fedcomp.DecodeError, match="rule"):
        codec.decode(payload, LAYOUT, round=1)
    other = fedcomp.Layout.of({"x": torch.zeros(3)})
    with pytest.raises(fedcomp.DecodeError, match="layout"):
        codec.decode(payload, other, round=9)


def _recrc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=25, deadline=None, database=None)
@given(data=st.data())
def test_mutated_payloads_raise_only_decode_error(spec, data):
    codec = fedcomp.build_codec(spec)
    payload = codec.encode(_model(), nonce=1, round=3).payload
    body = bytearray(payload[:-4])
    pos = data.draw(st.integers(24, len(body) - 1))
    body[pos] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.integers(0, len(payload)))
    for bad in (_recrc(bytes(body)), payload[:cut] if cut < len(payload) else b"", bytes(body) + payload[-4:]):
        try:
            out = codec.decode(bad, LAYOUT, round=3)
        except fedcomp.DecodeError:
            continue
        assert [t.shape for t in out.values()] == [t.shape for t in _model().values()]


@pytest.mark.parametrize("spec, word", [
    ("numel<x: fp16(); none()", "non-negative integer"),
    ("round<5: fp16()", "last rule must have no condition"),
    ("size<3: none(); none()", "cannot read condition"),
    ("fp16(); none()", "only the last rule"),
    ("name<3: none(); none()", "names match with ~"),
    ("numel<3: nosuch(); none()", "unknown codec"),
])
def test_bad_policies(spec, word):
    with pytest.raises(fedcomp.SpecError, match=word):
        fedcomp.build_codec(spec)


def test_policy_through_error_feedback():
    codec = fedcomp.build_codec(SPECS[0])
    residual, sent, total = None, None, None
    for r in range(1, 30):
        update = {k: v * 0.01 for k, v in _model(r).items() if v.is_floating_point()}
        enc, residual = fedcomp.compress(codec, update, residual, nonce=r, round=r)
        sent = enc.decoded if sent is None else {k: sent[k] + enc.decoded[k] for k in sent}
        total = update if total is None else {k: total[k] + update[k] for k in total}
    for k in total:  # what arrived plus what waits in the residual is everything
        torch.testing.assert_close(sent[k] + residual[k], total[k], rtol=0, atol=1e-4)
