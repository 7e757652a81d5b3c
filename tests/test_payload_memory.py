"""Payloads built in place (``fedcomp.wire``): a dense codec's writer allocates the final ``bytes``
up front (in huge pages where large) and its quantizer writes the codes there, so no body byte is
copied. These tests force that path on small tensors (``wire.HUGE = 0``) and check it against the
plain join, byte for byte."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

import fedcomp
from fedcomp import wire
from fedcomp.wire import Writer

DENSE = ["none()", "fp16()", "bf16()", "kbit(bits=4)", "kbit(bits=8,block=0)", "kbit(bits=3,stochastic=True)",
         "qsgd(bits=4)", "qsgd(bits=5,bucket=77,norm='l2')", "sign()", "sign(block=100)", "sign(scale='rms')",
         "twobit(threshold=0.5)", "terngrad()", "terngrad(clip=0)"]


def _update(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"conv.weight": torch.randn(8, 3, 5, 5, generator=g), "conv.bias": torch.randn(8, generator=g),
            "steps": torch.tensor(7), "fc.weight": torch.randn(10, 1001, generator=g),
            "half": torch.randn(33, generator=g).half()}


@pytest.mark.parametrize("kernels", ["0", "1"])  # torch ops, compiled loops
@pytest.mark.parametrize("spec", DENSE)
def test_a_payload_built_in_place_has_the_bytes_of_the_join(spec, kernels, monkeypatch):
    monkeypatch.setenv("FEDCOMP_KERNELS", kernels)
    codec, update = fedcomp.build_codec(spec), _update()
    joined = codec.encode(update, nonce=5).payload
    monkeypatch.setattr(wire, "HUGE", 0)  # every payload in place, however small
    calls = []
    monkeypatch.setattr(wire, "join", lambda views: calls.append(1) or b"".join(views))
    placed = codec.encode(update, nonce=5)
    assert placed.payload == joined
    assert not calls  # every part was at its place: nothing was joined
    layout = fedcomp.Layout.of(update)
    for name, t in codec.decode(placed.payload, layout).items():
        assert torch.equal(t, placed.decoded[name])


def test_parts_appended_out_of_order_still_give_the_right_payload(monkeypatch):
    monkeypatch.setattr(wire, "HUGE", 0)
    w = Writer(size=wire.OVERHEAD_BYTES + 12)
    a, b = w.empty(2, torch.float32), w.empty(4, torch.uint8)
    a.copy_(torch.tensor([1.5, -2.0]))
    b.copy_(torch.arange(4, dtype=torch.uint8))
    w.tensor(b)  # b was handed the place after a
    w.tensor(a)
    got = w.getvalue(b"01234567", 9, 3)
    ref = Writer()
    ref.tensor(torch.arange(4, dtype=torch.uint8))
    ref.tensor(torch.tensor([1.5, -2.0]))
    assert got == ref.getvalue(b"01234567", 9, 3)


def test_a_payload_of_another_size_than_announced_is_joined(monkeypatch):
    monkeypatch.setattr(wire, "HUGE", 0)
    w = Writer(size=wire.OVERHEAD_BYTES + 100)
    part = w.empty(3, torch.uint8)
    part.fill_(7)
    w.tensor(part)
    payload = w.getvalue(b"01234567", 9, 1)
    assert len(payload) == wire.OVERHEAD_BYTES + 3
    reader, nonce = wire.open_payload(payload, b"01234567", 9)
    assert nonce == 1 and reader.take(3).tolist() == [7, 7, 7]


def test_the_payload_outlives_its_writer_and_the_parts_keep_it_alive(monkeypatch):
    monkeypatch.setattr(wire, "HUGE", 0)
    w = Writer(size=wire.OVERHEAD_BYTES + 8)
    part = w.empty(8, torch.uint8)
    part.copy_(torch.arange(8, dtype=torch.uint8))
    w.tensor(part)
    payload = w.getvalue(b"01234567", 9, 1)
    refs = sys.getrefcount(payload)
    del w
    gc.collect()
    assert sys.getrefcount(payload) == refs  # the writer handed it out and keeps nothing
    del part
    gc.collect()
    assert sys.getrefcount(payload) == refs - 1  # the part (a view of its memory) held it
    assert wire.open_payload(payload, b"01234567", 9)[0].take(8).tolist() == list(range(8))
    assert hash(payload) == hash(bytes(bytearray(payload)))  # an ordinary, immutable bytes


def test_a_large_join_is_the_join():
    parts = [b"head", memoryview(torch.arange(3 << 20, dtype=torch.int32).numpy()).cast("B"), b"", b"tail"]
    joined = wire.join(parts)
    assert type(joined) is bytes and joined == b"".join(parts)


@pytest.mark.parametrize("spec", ["none()", "fp16()", "bf16()"])
def test_large_decodes_are_fresh_copies_with_the_values_of_torch_conversions(spec):
    """Decoded tensors of a large payload are built in buffers of their own (huge pages,
    ``wire.host_empty``): writable, apart from the payload, with the values torch's conversion
    gives (every fp16 / bf16 pattern class: normals, subnormals, +-0, +-inf)."""
    from fedcomp.aggregate import apply_step

    codec = fedcomp.build_codec(spec)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3_000_001, generator=g) * torch.logspace(-30, 30, 3_000_001)
    x[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-7, -6e-8])
    update = {"w": x}
    layout = fedcomp.Layout.of(update)
    payload = codec.encode(update, nonce=1).payload
    got = codec.decode(payload, layout)["w"]
    dtype = {"none()": torch.float32, "fp16()": torch.float16, "bf16()": torch.bfloat16}[spec]
    want = x.clamp(-65504, 65504).to(dtype).float() if spec == "fp16()" else x.to(dtype).float()
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
    before = bytes(payload)
    got.mul_(2)  # a copy: the payload is untouched
    assert payload == before and codec.decode(payload, layout)["w"].view(torch.int32).equal(want.view(torch.int32))
    stepped = apply_step(update, {"w": want})["w"]  # chunked, into a fresh huge-page buffer
    assert torch.equal(stepped, x + want) and stepped.shape == x.shape


def test_large_sparse_decodes_start_from_calloc_zeros():
    """A sparse decode of a large segment builds its dense form in ``wire.host_zeros`` (numpy's
    calloc: nothing written but the kept values): zero everywhere else, writable, and the same
    tensors as small chunks of it would give."""
    codec = fedcomp.build_codec("topk(ratio=0.001)+qsgd(bits=4)")
    g = torch.Generator().manual_seed(6)
    update = {"a": torch.randn(4_000_000, generator=g), "b": torch.randn(5_000_000, generator=g)}  # 36 MB together
    layout = fedcomp.Layout.of(update)
    enc = codec.encode(update, nonce=2)
    got = codec.decode(enc.payload, layout)
    flat = torch.cat([got["a"], got["b"]])
    kept = flat != 0
    assert int(kept.sum()) == 9000  # a global top-k of 0.1%: the rest stays zero
    assert torch.equal(got["a"], enc.decoded["a"]) and torch.equal(got["b"], enc.decoded["b"])
    got["a"].add_(1)  # writable, apart from the next decode
    assert int((codec.decode(enc.payload, layout)["a"] != 0).sum()) == int(kept[:4_000_000].sum())
    small = wire.host_zeros(10)
    assert small.dtype == torch.float32 and not small.any()


def test_large_elementwise_results_go_into_fresh_buffers_with_the_same_values():
    """update + residual and update - decoded of large tensors are written into
    ``wire.output_like`` buffers (huge pages): the values of torch's own ops, shape and dtype kept."""
    from fedcomp.base import add_residual
    from fedcomp.feedback import compress

    g = torch.Generator().manual_seed(8)
    t = torch.randn(3000, 3000, generator=g)  # 36 MB: past wire.MMAPPED
    r = torch.randn(3000, 3000, generator=g)
    out = wire.output_like(t, torch.float64)
    assert out.shape == t.shape and out.dtype == torch.float64 and out.is_contiguous()
    assert wire.output_like(torch.zeros(3, 2)).shape == (3, 2)
    summed = add_residual({"w": t}, {"w": r})["w"]
    assert torch.equal(summed, t + r)
    codec = fedcomp.build_codec("kbit(bits=4)")
    enc, residual = compress(codec, {"w": t}, {"w": r}, nonce=3)
    decoded = codec.decode(enc.payload, fedcomp.Layout.of({"w": t}))["w"]
    assert torch.equal(residual["w"], (t + r) - decoded)
