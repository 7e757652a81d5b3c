"""Streaming aggregation (fedcomp.aggregate.Accumulator) against decode-all-then-average."""

from __future__ import annotations

import pytest
import torch

import fedcomp
from fedcomp.aggregate import Accumulator

SPECS = [
    "none()",
    "fp16()",
    "kbit(bits=4)",
    "qsgd(bits=4)",
    "topk(ratio=0.05)",
    "topk(ratio=0.05)+qsgd(bits=4)",
    "topk(ratio=0.05,scope='tensor',index='fixed')+fp16()",
    "threshold(ratio=0.05)",
    "randomk(ratio=0.05,rescale=true)",
    "dgc(ratio=0.05)+kbit(bits=8)",
    "powersgd(rank=2)",
    "sketch(rows=3,cols=200,ratio=0.05)",
    "numel<100: fp16(); topk(ratio=0.05)",
]


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(40, 30, generator=g),
        "b1": torch.randn(30, generator=g),
        "steps": torch.tensor([seed * 3 + 1], dtype=torch.int64),
        "w2": torch.randn(30, 12, generator=g).to(torch.bfloat16),
    }


def _payloads(codec, n=5):
    ups = [_model(i) for i in range(n)]
    return ups, [codec.encode(u, nonce=100 + i, round=3).payload for i, u in enumerate(ups)]


def _reference(codec, layout, payloads, weights):
    """Decode every reply densely, then the weighted average (what the wrapper + FedAvg compute)."""
    decoded = [codec.decode(p, layout, round=3) for p in payloads]
    total = sum(weights)
    out = {}
    for t in layout.tensors:
        acc = sum(w * d[t.name].double() for w, d in zip(weights, decoded))
        out[t.name] = acc / total
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_mean_equals_decode_all_then_average(spec):
    codec = fedcomp.build_codec(spec)
    ups, payloads = _payloads(codec)
    layout = fedcomp.Layout.of(ups[0])
    weights = [3.0, 1.0, 7.0, 2.0, 5.0]
    acc = Accumulator(codec, layout)
    for p, w in zip(payloads, weights):
        acc.add(p, w, round=3)
    assert acc.count == 5 and acc.total_weight == sum(weights)
    mean = acc.mean()
    ref = _reference(codec, layout, payloads, weights)
    assert list(mean) == list(layout.names)
    for t in layout.tensors:
        assert mean[t.name].shape == t.shape and mean[t.name].dtype == t.torch_dtype
        if t.is_float:
            tol = 1e-2 if t.dtype == "bfloat16" else 1e-5
            # bf16: the reference sums values rounded to bf16 per reply, the stream sums them
            # before the one rounding; where replies cancel, that differs by ~2**-8 of the summands
            atol = tol * max(1.0, float(ref[t.name].abs().max())) if t.dtype == "bfloat16" else tol
            torch.testing.assert_close(mean[t.name].double(), ref[t.name], rtol=tol, atol=atol)
        else:
            assert torch.equal(mean[t.name], torch.round(ref[t.name]).to(t.torch_dtype))


@pytest.mark.parametrize("spec", ["none()", "topk(ratio=0.1)", "topk(ratio=0.1,scope='tensor')+fp16()"])
def test_exact_for_dyadic_values(spec):
    """Small integers and power-of-two weights: every sum is exact in fp32, so the streamed mean
    equals the reference bit for bit (sparse scatter-add and dense add alike)."""
    codec = fedcomp.build_codec(spec)
    g = torch.Generator().manual_seed(0)
    ups = [{"a": torch.randint(-50, 50, (20, 10), generator=g).float(),
            "b": torch.randint(-50, 50, (30,), generator=g).float()} for _ in range(4)]
    layout = fedcomp.Layout.of(ups[0])
    weights = [1.0, 2.0, 4.0, 1.0]
    payloads = [codec.encode(u, nonce=i).payload for i, u in enumerate(ups)]
    acc = Accumulator(codec, layout)
    for p, w in zip(payloads, weights):
        acc.add(p, w)
    decoded = [codec.decode(p, layout) for p in payloads]
    for name in layout.names:
        expected = sum(w * d[name] for w, d in zip(weights, decoded)) / sum(weights)
        assert torch.equal(acc.mean()[name], expected)
    assert torch.equal(acc.sum()["a"], sum(w * d["a"] for w, d in zip(weights, decoded)))


@pytest.mark.parametrize("spec", ["topk(ratio=0.05)+qsgd(bits=4)", "kbit(bits=4)", "randomk(ratio=0.1)"])
def test_bad_payload_leaves_sum_unchanged(spec):
    codec = fedcomp.build_codec(spec)
    ups, payloads = _payloads(codec, 3)
    layout = fedcomp.Layout.of(ups[0])
    acc = Accumulator(codec, layout)
    acc.add(payloads[0], 2.0, round=3)
    before = acc.sum()
    bad = bytearray(payloads[1])
    bad[30] ^= 0xFF
    truncated = payloads[1][:-9]
    other_codec = fedcomp.build_codec("fp16()").encode(ups[1]).payload
    for p in (bytes(bad), truncated, other_codec, b"", b"FC" + bytes(40)):
        with pytest.raises(fedcomp.DecodeError):
            acc.add(p, 1.0, round=3)
    with pytest.raises(fedcomp.FedcompError, match="weight"):
        acc.add(payloads[1], float("nan"))
    with pytest.raises(fedcomp.FedcompError, match="weight"):
        acc.add(payloads[1], -1.0)
    after = acc.sum()
    assert acc.count == 1 and acc.total_weight == 2.0
    for name in before:
        assert torch.equal(before[name], after[name])
    acc.add(payloads[1], 1.0, round=3)  # still usable afterwards
    assert acc.count == 2


def test_non_finite_update_rejected_before_adding():
    codec = fedcomp.build_codec("topk(ratio=0.5)")
    layout = fedcomp.Layout.of({"x": torch.zeros(10)})
    acc = Accumulator(codec, layout)
    acc.add(codec.encode({"x": torch.arange(10.0)}).payload, 1.0)
    before = acc.sum()["x"]
    nan = codec.encode({"x": torch.tensor([float("nan")] * 2 + [1.0] * 8)}).payload
    with pytest.raises(fedcomp.FedcompError, match="NaN"):
        acc.add(nan, 1.0)
    with pytest.raises(fedcomp.FedcompError, match="NaN"):
        acc.add_dense({"x": torch.full((10,), float("inf"))}, 1.0)
    assert torch.equal(acc.sum()["x"], before) and acc.count == 1


def test_add_dense_mixes_with_payloads_and_reset():
    codec = fedcomp.build_codec("topk(ratio=0.2)")
    ups, payloads = _payloads(codec, 2)
    layout = fedcomp.Layout.of(ups[0])
    acc = Accumulator(codec, layout)
    acc.add(payloads[0], 1.0, round=3)
    acc.add_dense(ups[1], 3.0)
    d0 = codec.decode(payloads[0], layout, round=3)
    torch.testing.assert_close(acc.mean()["w1"], (d0["w1"] + 3 * ups[1]["w1"]) / 4)
    with pytest.raises(fedcomp.FedcompError, match="lacks"):
        acc.add_dense({"w1": ups[1]["w1"]}, 1.0)
    acc.reset()
    assert acc.count == 0 and acc.total_weight == 0
    assert not acc.sum()["w1"].any()
    with pytest.raises(fedcomp.FedcompError, match="no weight"):
        acc.mean()


def test_memory_does_not_grow_with_clients():
    """The accumulator holds the same tensors after 1 and after 50 replies (no per-reply state)."""
    codec = fedcomp.build_codec("topk(ratio=0.01)+qsgd(bits=4)")
    layout = fedcomp.Layout.of({"x": torch.zeros(20000)})
    acc = Accumulator(codec, layout)
    g = torch.Generator().manual_seed(1)

    def held():
        return sum(t.numel() * t.element_size() for t in [*acc._sums.values(), *acc._ints.values()])

    acc.add(codec.encode({"x": torch.randn(20000, generator=g)}).payload, 1.0)
    first = held()
    for i in range(49):
        acc.add(codec.encode({"x": torch.randn(20000, generator=g)}, nonce=i).payload, 1.0)
    assert held() == first == 20000 * 8  # one float64 sum
