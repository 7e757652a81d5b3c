"""Payloads built in place (``fedcomp.wire``): a dense codec's writer allocates the final ``bytes``
up front (in huge pages where large) and its quantizer writes the codes there, so no body byte is
copied. These tests force that path on small tensors (``wire.HUGE = 0``) and check it against the
plain join, byte for byte."""

from __future__ import annotations

import gc
import sys

import numpy as np
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


def test_an_arena_carves_aligned_results_in_order_and_falls_back_when_full():
    """Inside ``wire.arena(n)`` this thread's fp32 results (output_empty, output_zeros,
    output_like) are consecutive views of one zeroed storage at 64-byte aligned addresses;
    scratch (host_empty, host_zeros), another dtype, a request past its end, another thread's, one
    after the scope, one inside ``arena(0)`` and any in a scope below MMAPPED bytes get buffers of
    their own."""
    import threading

    n = wire.MMAPPED
    with wire.arena(n):
        a = wire.output_empty(5)
        b = wire.output_zeros(3)
        c = wire.output_like(torch.ones(2, 3))
        scratch = [wire.host_empty(7, torch.float32), wire.host_zeros(7), wire.output_empty(7, torch.float64)]
        with wire.arena(n):  # a nested scope has its own storage; the outer one goes on after it
            inner = wire.output_empty(4)
        with wire.arena(0):  # hides the outer one
            hidden = wire.output_empty(4)
        d = wire.output_empty(7)
        empty = wire.output_empty(0)  # keeps no storage alive
        other = []
        thread = threading.Thread(target=lambda: other.append(wire.output_empty(5)))
        thread.start()
        thread.join()
        big = wire.output_zeros(n // 4)  # does not fit what is left
    after = wire.output_empty(5)
    base = a.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in (a, b, c, d))
    assert [t.data_ptr() % 64 for t in (a, b, c, d)] == [0, 0, 0, 0]
    assert a.data_ptr() < b.data_ptr() < c.data_ptr() < d.data_ptr() < a.data_ptr() + 4 * 64
    assert c.shape == (2, 3) and c.dtype == torch.float32 and not b.any() and not d.any()
    for t in (*scratch, inner, hidden, other[0], big, after):
        assert t.untyped_storage().data_ptr() != base
    assert empty.numel() == 0 and empty.untyped_storage().nbytes() == 0
    assert inner.untyped_storage().nbytes() >= n and not big.any() and big.numel() == n // 4
    a.fill_(1.0)  # writable, and apart from its neighbours
    assert not b.any() and a.sum() == 5
    with wire.arena(n - 1):
        small = wire.output_empty(5)
    assert small.untyped_storage().nbytes() == 20


def test_an_arena_the_system_refuses_carves_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        raise MemoryError("no")

    with monkeypatch.context() as m:
        m.setattr(wire.np, "zeros", refuse)
        with wire.arena(wire.MMAPPED):
            t = wire.output_empty(5)
    assert t.untyped_storage().nbytes() == 20


def test_a_dense_decode_of_many_tensors_fills_one_storage_with_the_same_values():
    """A CPU decode of an fp32 model carves its float tensors out of one allocation (``wire.arena``):
    each is what the decode gave before, writable and apart from the others; the dict saves
    (``torch.save``: one dtype in the storage, integer tensors apart). A model with a half tensor
    decodes as before (no conversion's fp32 scratch is kept alive by the others)."""
    import io

    g = torch.Generator().manual_seed(8)
    update = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate((1_500_000, 3, 7_000_001, 1000))}
    update["steps"] = torch.tensor([3, 4])
    layout = fedcomp.Layout.of(update)
    assert 4 * layout.numel >= wire.MMAPPED
    for spec in ("none()", "kbit(bits=4)", "topk(ratio=0.01)+qsgd(bits=4)", "randomk()"):
        codec = fedcomp.build_codec(spec)
        enc = codec.encode(update, nonce=3)
        got = codec.decode(enc.payload, layout)
        with monkeypatch_arena_off():
            want = codec.decode(enc.payload, layout)
        assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in update), spec
        assert len({got[k].untyped_storage().data_ptr() for k in ("t0", "t1", "t2", "t3")}) == 1, spec
        assert got["steps"].untyped_storage().data_ptr() != got["t0"].untyped_storage().data_ptr()
        if spec in ("none()", "kbit(bits=4)"):  # (a global selector's tensors are views of one segment anyway)
            assert want["t0"].untyped_storage().data_ptr() != want["t2"].untyped_storage().data_ptr(), spec
        if spec == "none()":
            assert all(torch.equal(got[k], update[k]) for k in update)
        torch.save(got, io.BytesIO())
        got["t1"].fill_(7.0)
        assert torch.equal(got["t0"], want["t0"]) and torch.equal(got["t2"], want["t2"]), spec
    mixed = dict(update, half=torch.randn(100_000, generator=g).half())
    codec = fedcomp.build_codec("kbit(bits=4)")
    got = codec.decode(codec.encode(mixed, nonce=3).payload, fedcomp.Layout.of(mixed))
    assert got["half"].dtype == torch.float16
    assert got["t0"].untyped_storage().data_ptr() != got["t2"].untyped_storage().data_ptr()


@pytest.mark.parametrize("spec", ["kbit(bits=4)", "topk(ratio=0.01)+qsgd(bits=4)"])
def test_large_residuals_share_one_allocation_and_keep_their_values(spec):
    """compress()'s new residual of a large many-tensor update is carved out of one allocation
    (``wire.arena``), with the values of update - decoded, tensor by tensor."""
    from fedcomp.feedback import compress

    g = torch.Generator().manual_seed(9)
    update = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate((4_000_000, 5_000_000, 17))}
    codec = fedcomp.build_codec(spec)
    encoded, residual = compress(codec, update, nonce=5)
    decoded = codec.decode(encoded.payload, fedcomp.Layout.of(update))
    assert all(torch.equal(residual[k], update[k] - decoded[k]) for k in update)
    assert residual["t0"].untyped_storage().data_ptr() == residual["t1"].untyped_storage().data_ptr()
    residual["t0"].zero_()
    assert torch.equal(residual["t1"], update["t1"] - decoded["t1"])
    # the next round adds the residual in place: an fp16 tensor's fp32 residual is the only new
    # buffer, in a storage of its own size (not in an arena sized for every tensor)
    update["h"] = torch.randn(250_000, generator=g).half()
    _, residual = compress(codec, update, residual=residual, nonce=6)
    assert residual["h"].dtype == torch.float32 and residual["h"].untyped_storage().nbytes() == 4 * 250_000


class monkeypatch_arena_off:
    """Decode without the arena (wire.MMAPPED above any scope: nothing is carved)."""

    def __enter__(self):
        self.saved = wire.MMAPPED
        wire.MMAPPED = 1 << 62

    def __exit__(self, *exc):
        wire.MMAPPED = self.saved


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


class _Counting:
    """wire._BYTES_API with its allocator counted."""

    def __init__(self, api):
        self.api, self.made = api, 0

    def __iter__(self):
        new, address, madvise = self.api

        def counted(ptr, n):
            self.made += 1
            return new(ptr, n)
        return iter((counted, address, madvise))


@pytest.fixture
def spares(monkeypatch):
    """A clean pool of spare payloads whose allocations are counted."""
    if not wire._HASH_SLOT:
        pytest.skip("this interpreter's bytes layout is not CPython's: payloads are never reused")
    wire.release_spares()
    monkeypatch.setattr(wire, "HUGE", 1 << 20)  # every _large payload built in place
    counting = _Counting(wire._BYTES_API)
    monkeypatch.setattr(wire, "_BYTES_API", tuple(counting))
    yield counting
    wire.release_spares()


def _large(seed: int) -> dict[str, torch.Tensor]:  # payloads of 1 MB or more
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(7, generator=g), "b": torch.randn(1_100_003, generator=g)}


@pytest.mark.parametrize("kernels", ["0", "1"])
@pytest.mark.parametrize("spec", ["none()", "fp16()", "kbit(bits=8)"])
def test_a_payload_nothing_refers_to_is_written_again_and_a_held_one_never(spec, kernels, spares, monkeypatch):
    monkeypatch.setenv("FEDCOMP_KERNELS", kernels)
    codec = fedcomp.build_codec(spec)
    want = {}
    with monkeypatch.context() as m:
        m.setenv("FEDCOMP_SPARE_PAYLOADS", "0")  # every payload fresh
        for seed in range(4):
            want[seed] = codec.encode(_large(seed), nonce=seed).payload
    wire.release_spares()
    monkeypatch.setenv("FEDCOMP_SPARE_PAYLOADS", "3")
    spares.made = 0
    first = codec.encode(_large(0), nonce=0).payload
    second = codec.encode(_large(1), nonce=1).payload  # the first is held: a new one
    assert spares.made == 2 and first == want[0] and second == want[1]
    hashes = {hash(first), hash(second)}  # cached in the objects
    views = [memoryview(first), np.frombuffer(second, dtype=np.uint8)]
    del first, second
    third = codec.encode(_large(2), nonce=2).payload  # views refer to both: a new one
    assert spares.made == 3 and bytes(views[0]) == want[0] and views[1].tobytes() == want[1] and third == want[2]
    hashes.add(hash(third))
    del views, third
    gc.collect()
    again = codec.encode(_large(3), nonce=3).payload  # nothing refers to the spares: one is written
    assert spares.made == 3 and again == want[3]
    assert hash(again) == hash(bytes(bytearray(again))) and hash(again) not in hashes  # the cached hash cleared
    layout = fedcomp.Layout.of(_large(3))
    assert all(torch.equal(t, codec.decode(want[3], layout)[n]) for n, t in codec.decode(again, layout).items())


def test_spare_payloads_are_bounded_can_be_released_or_turned_off(spares, monkeypatch):
    codec = fedcomp.build_codec("none()")
    for seed in range(5):
        codec.encode(_large(seed), nonce=seed)
    assert len(wire._SPARES) == 1 and spares.made == 1  # one size, each payload dropped before the next
    held = [codec.encode(_large(seed), nonce=seed).payload for seed in range(4)]
    assert len(wire._SPARES) == 2 and spares.made == 4 and len({id(p) for p in held}) == 4
    del held
    wire.release_spares()
    assert wire._SPARES == []
    monkeypatch.setenv("FEDCOMP_SPARE_PAYLOADS", "0")
    codec.encode(_large(0), nonce=0)
    codec.encode(_large(0), nonce=0)
    assert wire._SPARES == [] and spares.made == 6
    monkeypatch.setenv("FEDCOMP_SPARE_PAYLOADS", "")  # empty: the default
    codec.encode(_large(0), nonce=0)
    assert len(wire._SPARES) == 1
    monkeypatch.setenv("FEDCOMP_SPARE_PAYLOADS", "two")
    with pytest.raises(ValueError, match="FEDCOMP_SPARE_PAYLOADS='two'.*0 or more"):
        codec.encode(_large(0), nonce=0)


def test_payloads_are_never_reused_where_the_bytes_layout_is_unknown(spares, monkeypatch):
    monkeypatch.setattr(wire, "_HASH_SLOT", False)
    codec = fedcomp.build_codec("none()")
    for seed in range(3):
        codec.encode(_large(seed), nonce=seed)
    assert spares.made == 3 and wire._SPARES == []


def test_threads_encoding_at_once_each_get_their_own_payload(spares):
    from concurrent.futures import ThreadPoolExecutor

    codec = fedcomp.build_codec("none()")
    updates = [_large(seed) for seed in range(4)]
    want = [bytes(bytearray(codec.encode(u, nonce=i).payload)) for i, u in enumerate(updates)]

    def work(i: int) -> bool:
        return all(codec.encode(updates[i], nonce=i).payload == want[i] for _ in range(6))
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4)))
