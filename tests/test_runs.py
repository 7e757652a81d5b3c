"""Every segment of an update in one compiled call (``fastpath.write_run``): the bytes of the
one-by-one writes, on layouts of many small tensors and a few large ones (written in steps),
with segments the kernels refuse (not finite, all zeros) written the one-by-one way in place."""

from __future__ import annotations

import zlib

import pytest
import torch

import fedcomp
from fedcomp import aggregate, codec as codec_module, kernels
from fedcomp.codecs import blockwise, fastpath

pytestmark = pytest.mark.skipif(kernels.get() is None, reason="numba not installed")

SPECS = ["kbit(bits=4)", "kbit(bits=8)", "kbit(bits=3,block=100)", "kbit(bits=2,block=0)",
         "kbit(bits=5,stochastic=true)", "kbit(bits=4,block=33,stochastic=true)", "qsgd(bits=4)", "qsgd(bits=8,bucket=0)",
         "qsgd(bits=3,bucket=100)", "sign()", "sign(block=100)", "sign(scale='rms')", "sign(block=3000,scale='rms')",
         "twobit(threshold=0.5)", "fp16()", "bf16()", "none()", "terngrad()", "terngrad(clip=0)"]


def _update(special: str = "") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    t = {f"bn{i}.weight": torch.randn(n, generator=g) for i, n in enumerate([64, 3, 1, 257, 9])}
    t["conv.weight"] = torch.randn(16, 3, 7, 7, generator=g)
    t["big"] = torch.randn(5003, generator=g)  # several steps (the test sets 1000 elements a step)
    t["huge"] = torch.randn(70000, generator=g) * 1e3  # several parts of a sign scale; beyond fp16's range
    t["half"] = torch.randn(40, generator=g).half()
    t["steps"] = torch.tensor(11)
    t["zeros"] = torch.zeros(70)
    if special == "inf":
        t["conv.weight"][1, 2, 3, 4] = float("inf")
    if special == "nan":
        t["big"][4000] = float("nan")  # in a later step
    return t


@pytest.mark.parametrize("special", ["", "inf", "nan"])
@pytest.mark.parametrize("spec", SPECS)
def test_a_run_writes_the_bytes_of_one_by_one_writes(spec, special, monkeypatch):
    monkeypatch.setattr(blockwise, "_ENCODE_CHUNK", 1000)
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    codec, update = fedcomp.build_codec(spec), _update(special)
    calls = []
    real = fastpath.write_run
    monkeypatch.setattr(codec_module, "write_run", lambda *a: calls.append(len(a[1])) or real(*a))
    run = codec.encode(update, nonce=9, round=2).payload
    assert calls == [len(update) - 1]  # every float tensor in one call, each in its own shape
    with monkeypatch.context() as m:  # no compiled checksum: the quantizer's _run, a CRC pass of its own
        m.setattr(kernels, "crc32_function", lambda: None)
        assert codec.encode(update, nonce=9, round=2).payload == run
    monkeypatch.setattr(codec_module, "runs", lambda q, k: False)
    assert codec.encode(update, nonce=9, round=2).payload == run
    monkeypatch.setenv("FEDCOMP_KERNELS", "0")  # the torch path: the same bytes again
    assert codec.encode(update, nonce=9, round=2).payload == run


# -- the server's side: a reply read at once (Codec.read_run), checked and added in one call each --
READ_SPECS = ["kbit(bits=4)", "kbit(bits=3,block=100)", "kbit(bits=8,block=0)", "kbit(bits=2,stochastic=true)",
              "qsgd(bits=4)", "qsgd(bits=3,bucket=100)", "qsgd(bits=8,bucket=0)", "sign()", "sign(block=100)",
              "sign(scale='rms',block=33)", "fp16()", "bf16()", "none()", "twobit(threshold=0.5)", "terngrad()",
              "terngrad(clip=0)"]
WEIGHTS = (1, 3.0, 0.3, 1e-7, 12345)


def _fp_model(seed: int, halves: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(71, 47, generator=g), "b": torch.randn(5, generator=g), "one": torch.randn(1, generator=g),
             "d": torch.randn(4, 3, 70, generator=g).double(), "n": torch.tensor([seed]),
             "big": torch.randn(3001, generator=g)}
    if halves:  # a model's fp16 / bf16 tensors: their values are checked and added rounded to them
        model["h"] = (torch.randn(1777, generator=g) * 300).half()
        model["hb"] = torch.randn(3, 500, generator=g).bfloat16()
        model["hb1"] = torch.randn(1, generator=g).bfloat16()
    return model


def _sum(codec, payloads, batch, runs_on, monkeypatch, halves=False):
    layout = fedcomp.Layout.of(_fp_model(0, halves))
    acc = aggregate.Accumulator(codec, layout, batch=batch)
    with monkeypatch.context() as m:
        if not runs_on:
            m.setattr(type(codec), "read_run", lambda *a, **kw: None)
        norms = []
        for p, w in zip(payloads, WEIGHTS):
            update = acc.decode(p, round=1)
            assert (update.run is not None) == runs_on
            norms.append(update.norm())
            acc.add_update(update, w)
        return norms, acc.sum()


@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("spec", READ_SPECS)
def test_replies_read_at_once_sum_to_the_bits_of_the_per_segment_path(spec, batch, halves, monkeypatch):
    monkeypatch.setattr(aggregate, "CHUNK", 600)  # chunks start inside blocks and tensors
    monkeypatch.setattr(aggregate, "SUM_CHUNK", 500)
    monkeypatch.setattr(aggregate, "RUN_SUM_CHUNK", 500)
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    codec = fedcomp.build_codec(spec)
    payloads = [codec.encode(_fp_model(i, halves), nonce=i, round=1).payload for i in range(1, len(WEIGHTS) + 1)]
    norms, sums = _sum(codec, payloads, batch, True, monkeypatch, halves)
    ref_norms, ref_sums = _sum(codec, payloads, batch, False, monkeypatch, halves)
    if spec.startswith(("sign", "twobit", "terngrad")):  # sequential sums of counts x squares, numpy's dot
        assert norms == pytest.approx(ref_norms, rel=1e-12)
    else:
        assert norms == ref_norms
    assert sums.keys() == ref_sums.keys()
    for name in sums:
        assert torch.equal(sums[name], ref_sums[name]), name


@pytest.mark.parametrize("spec", ["kbit(bits=4)", "qsgd(bits=4)", "sign()", "fp16()", "bf16()", "none()", "terngrad()"])
def test_a_reply_read_at_once_is_refused_for_a_value_not_finite_and_gives_its_pieces(spec, monkeypatch):
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    codec = fedcomp.build_codec(spec)
    layout = fedcomp.Layout.of(_fp_model(0))
    acc = aggregate.Accumulator(codec, layout)
    bad = _fp_model(1)
    bad["d"][1, 2, 3] = float("nan")
    with pytest.raises(aggregate.UpdateRejected, match="'d'"):
        acc.decode(codec.encode(bad, nonce=1).payload)
    payload = codec.encode(_fp_model(2), nonce=2).payload
    update = acc.decode(payload)
    assert update.run is not None
    dense = update.dense(acc._offsets, acc._shapes)  # read the per-segment way, on demand
    decoded = codec.decode(payload, layout)
    for name in ("w", "b", "one", "big"):
        assert torch.equal(dense[name], decoded[name]), name
    with pytest.raises(fedcomp.DecodeError):
        acc.decode(payload[:-30] + payload[-4:])


@pytest.mark.parametrize("spec,code", [("twobit()", 1), ("terngrad()", 3)])
def test_a_reply_read_at_once_with_the_unused_two_bit_code_is_refused(spec, code, monkeypatch):
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    codec = fedcomp.build_codec(spec)
    layout = fedcomp.Layout.of(_fp_model(0))
    payload = bytearray(codec.encode(_fp_model(1), nonce=1).payload)
    at = len(payload) - 4 - 8 - 100  # in the last float tensor's codes ("big": 751 bytes), before the raw "n"
    payload[at] = (code << 6) | (payload[at] & 0x3F)
    payload[-4:] = zlib.crc32(payload[:-4]).to_bytes(4, "little")
    with pytest.raises(fedcomp.DecodeError, match="unused code"):
        aggregate.Accumulator(codec, layout).decode(bytes(payload))


@pytest.mark.parametrize("spec", ["randomk()", "randomk(ratio=0.3,scope='tensor',rescale=false)",
                                  "topk(ratio=0.05)+qsgd(bits=4)", "topk(ratio=0.2,scope='tensor')+kbit(bits=3)"])
def test_sparse_replies_added_in_a_batch_sum_to_the_bits_of_index_add(spec, monkeypatch):
    """Sparse replies wait in a batch and go into the sums chunk by chunk in one compiled call
    (:meth:`Accumulator._add_sparse`), interleaved with dense replies of another codec: every
    sum has the bits of torch's ``index_add_`` one reply after another."""
    monkeypatch.setattr(aggregate, "SUM_CHUNK", 500)  # chunks end inside tensors
    monkeypatch.setattr(aggregate, "RUN_SUM_CHUNK", 500)
    codec, dense = fedcomp.build_codec(spec), fedcomp.build_codec("kbit(bits=4)")
    layout = fedcomp.Layout.of(_fp_model(0))
    replies = [(codec if i % 3 else dense, i) for i in range(1, 8)]
    payloads = [(c, c.encode(_fp_model(i), nonce=i, round=1).payload) for c, i in replies]

    def total(batch: int, compiled: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
        sizes = []
        with monkeypatch.context() as m:
            if not compiled:
                m.setattr(kernels, "get", lambda: None)
            add = aggregate.Accumulator._add_sparse
            m.setattr(aggregate.Accumulator, "_add_sparse", lambda self, p: (sizes.append(len(p)), add(self, p)))
            acc = aggregate.Accumulator(codec, layout, batch=batch)
            for (c, p), w in zip(payloads, WEIGHTS + (0.7, 2.5)):
                acc.add_update(acc.decode(p, round=1, codec=c), w)
            return acc.sum(), sizes

    (batched, sizes), (one, none), (ref, _) = total(4, True), total(1, True), total(4, False)
    assert max(sizes) > 1 and not none  # replies waited together; batch=1 adds each at once
    for name in ref:
        assert torch.equal(batched[name], ref[name]) and torch.equal(one[name], ref[name]), name
    assert any(bool(ref[name].ne(0).any()) for name in ref)


def test_sparse_positions_out_of_order_are_sorted_before_they_wait():
    """A held reply's positions are ascending (the batched loop walks them in order)."""
    pos, vals = torch.tensor([5, 1, 9, 1]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    got_pos, got_vals = aggregate._ascending(pos, vals)
    assert got_pos.tolist() == [1, 1, 5, 9] and got_vals.tolist() == [2.0, 4.0, 1.0, 3.0]
    same = torch.arange(4)
    assert aggregate._ascending(same, vals)[0] is same


@pytest.mark.parametrize("spec", ["topk(ratio=0.1,scope='tensor')", "randomk(ratio=0.2)", "threshold(ratio=0.1)"])
def test_selectors_reading_ascending_positions_skip_the_ordering_pass(spec, monkeypatch):
    """A built-in selector's reply (sparsifiers.reads_ascending) waits with its positions as read,
    without the ordering pass; one that reads its own way is still ordered; the sums are the same."""
    g = torch.Generator().manual_seed(12)
    model = {"a": torch.randn(300, generator=g), "n": torch.tensor([2]), "b": torch.randn(40, 5, generator=g)}
    layout = fedcomp.Layout.of(model)
    codec = fedcomp.build_codec(spec)
    payload = codec.encode(model, nonce=3).payload
    calls = []
    real = aggregate._ascending
    monkeypatch.setattr(aggregate, "_ascending", lambda p, v: calls.append(len(p)) or real(p, v))

    def total():
        acc = aggregate.Accumulator(codec, layout, batch=4)
        update = acc.decode(payload)
        acc.add_update(update, 2.0)
        return update.ascending, acc.sum()

    fast, got = total()
    assert fast and not calls
    read = type(codec.reducer).read_indices
    monkeypatch.setattr(type(codec.reducer), "read_indices", lambda self, *a: read(self, *a))  # its own reader
    checked, want = total()
    assert not checked and calls
    assert all(torch.equal(got[k], want[k]) for k in want) and any(bool(want[k].ne(0).any()) for k in want)


# -- raw replies: the checksum taken while the values are summed (Codec.read_run(sq_chunk=...)) --
def _big_model(seed: int) -> dict[str, torch.Tensor]:
    from fedcomp import _kernels as k

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(71, 47, generator=g), "one": torch.randn(1, generator=g),
            "big": torch.randn(2 * k.SQ_PART + 1001, generator=g),  # several parts of a sum, a ragged last one
            "n": torch.tensor([seed, 3]), "b": torch.randn(5, generator=g)}


@pytest.mark.parametrize("spec", ["none()", "fp16()", "bf16()"])
def test_a_raw_reply_is_checksummed_while_it_is_summed(spec, monkeypatch):
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    fused = kernels.crc32_function() is not None  # isal exports its CRC (the pinned version does)
    codec = fedcomp.build_codec(spec)
    layout = fedcomp.Layout.of(_big_model(0))
    payload = codec.encode(_big_model(1), nonce=1).payload
    chunk = 300_000  # a chunk of the norm holds parts of SQ_PART values and a ragged one
    run, _ = codec.read_run(payload, layout, sq_chunk=chunk)
    assert (run.sums is not None) == fused and (not fused or run.sums[0] == chunk)
    separate = codec.read_run(payload, layout)[0]
    assert separate.sums is None
    assert run.sq(chunk).tolist() == separate.sq(chunk).tolist()  # the same sums, bit for bit
    monkeypatch.setattr(aggregate, "CHUNK", chunk)
    acc = aggregate.Accumulator(codec, layout)
    acc.add(payload, 2)
    before = acc.sum()
    norm = acc.decode(payload).norm()
    with monkeypatch.context() as m:  # the per-segment path's norm: the same bits
        m.setattr(type(codec), "read_run", lambda *a, **kw: None)
        assert acc.decode(payload).norm() == norm
    with monkeypatch.context() as m:  # no compiled checksum: a pass of its own, the same result
        m.setattr(kernels, "crc32_function", lambda: None)
        assert acc.decode(payload).norm() == norm
    header, value, ints = 17, len(payload) // 2, len(payload) - 4 - 16 + 3  # nonce, a value of "big", "n"
    for at in (5, header, value, ints, len(payload) - 2):  # a fingerprint, the nonce, values, ints, the CRC
        bad = bytearray(payload)
        bad[at] ^= 0x10
        with pytest.raises(fedcomp.DecodeError, match="checksum"):
            acc.add(bytes(bad), 1)
    for cut in (payload[:-5], payload[:100], payload[:-4 - 40] + payload[-4:]):
        with pytest.raises(fedcomp.DecodeError, match="checksum"):
            acc.add(cut, 1)
    after = acc.sum()
    assert acc.count == 1 and all(torch.equal(before[n], after[n]) for n in before)


def test_the_fused_checksum_covers_bytes_between_segments():
    import numpy as np

    from fedcomp import _kernels as k

    rng = np.random.default_rng(0)
    body = rng.standard_normal(700_000).astype(np.float32).view(np.uint8)
    ns = np.array([10, 0, 600_000, 3], dtype=np.int64)
    coffs = np.array([8, 48, 52, 4 * 600_000 + 60], dtype=np.int64)  # gaps before the first and third
    out, ref = np.empty(4), np.empty(4)
    fn = kernels.crc32_function()
    if fn is None:
        pytest.skip("this isal does not export crc32_gzip_refl")
    scratch = np.empty(250_000, dtype=np.float32), np.empty(250_000, dtype=np.uint16)
    for halves in ([0, 0, 0, 0], [2, 0, 1, 2]):  # segments that are a model's bf16 / fp16 tensors
        halves = np.array(halves, dtype=np.int64)
        crc, end = k.raw_crc_sq_run(body, coffs, ns, 0, 250_000, fn, np.uint32(zlib.crc32(b"head")), halves, *scratch,
                                    out)
        assert end == coffs[-1] + 12
        assert crc == zlib.crc32(body[:end].tobytes(), zlib.crc32(b"head"))
        k.raw_sq_run(body, coffs, ns, 0, 250_000, halves, *scratch, ref)
        assert out.tolist() == ref.tolist()
        for s, half in enumerate(halves.tolist()):  # the squares of the values as the model's dtype holds them
            values = torch.from_numpy(body[coffs[s]:coffs[s] + 4 * ns[s]].view(np.float32).copy())
            values = values.to({0: torch.float32, 1: torch.float16, 2: torch.bfloat16}[half]).double()
            assert out[s] == pytest.approx(float((values ** 2).sum()), rel=1e-12)
    fp32 = torch.from_numpy(body[52:52 + 2_400_000].view(np.float32).copy()).double()
    assert out[2] != pytest.approx(float((fp32 ** 2).sum()), rel=1e-9)  # fp16's rounding moved it (~5e-7)


@pytest.mark.parametrize("spec,big", [("fp16()", 2_200_001), ("bf16()", 2_200_001), ("none()", 2_200_001),
                                      ("none()", 1_200_001), ("kbit(bits=8)", 4_200_001), ("qsgd(bits=4)", 8_400_001),
                                      ("kbit(bits=3,stochastic=true,block=100)", 11_000_001), ("terngrad()", 17_000_001),
                                      ("twobit(threshold=0.5)", 17_000_001)])
def test_a_half_payload_is_checksummed_as_it_is_written(spec, big, monkeypatch):
    """The writer's CRC is continued over each part as it is converted (none(): as each is
    copied, by non-temporal stores in a payload of STREAM_BYTES or more, else by memcpy):
    the payload's last read covers only what follows the values (the raw integer tensors), and
    the bytes are the same."""
    from fedcomp import wire

    if kernels.crc32_function() is None:
        pytest.skip("this isal does not export crc32_gzip_refl")
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    codec = fedcomp.build_codec(spec)
    g = torch.Generator().manual_seed(3)  # a payload built in place (wire.HUGE: 4 MB)
    model = {"w": torch.randn(71, 47, generator=g), "big": torch.randn(big, generator=g), "n": torch.tensor([1, 3]),
             "b": torch.randn(5, generator=g)}
    payload = codec.encode(model, nonce=4).payload
    read = []
    real = wire.crc32
    monkeypatch.setattr(wire, "crc32", lambda data, crc=0: read.append(len(data)) or real(data, crc))
    assert codec.encode(model, nonce=4).payload == payload
    assert sum(read) < 100  # the header, and the tail after the values
    with monkeypatch.context() as m:
        m.setattr(kernels, "crc32_function", lambda: None)  # a pass of its own at the end: the same bytes
        assert codec.encode(model, nonce=4).payload == payload
    assert sum(read) > len(payload) - 100
    assert zlib.crc32(payload[:-4]) == int.from_bytes(payload[-4:], "little")


def test_crc32_combine_is_the_crc_of_the_concatenation():
    import random

    k = kernels.get()
    if k is None:
        pytest.skip("numba not installed")
    rng = random.Random(5)
    for _ in range(200):
        a = rng.randbytes(rng.choice([0, 1, 3, 64, 1000]))
        b = rng.randbytes(rng.choice([0, 1, 7, 255, 4096, 70_000]))
        assert int(k.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))) == zlib.crc32(a + b)
    long = bytes(3 << 20)  # a length with many bits set: many squarings
    assert int(k.crc32_combine(zlib.crc32(b"head"), zlib.crc32(long[:-5]), len(long) - 5)) == zlib.crc32(b"head" + long[:-5])


def test_a_writer_checksums_the_whole_payload_where_a_part_lands_in_checksummed_bytes():
    from fedcomp import wire

    head = wire.header(b"L" * 8, 7, 9)
    out = wire.Writer(size=wire.HUGE + 28, head=head)
    first = out.empty(1000, torch.uint8)
    assert out.crc_before(first) == zlib.crc32(head)
    first.fill_(3)
    out.checksummed(first, zlib.crc32(first.numpy().tobytes(), zlib.crc32(head)))
    rest = out.empty(wire.HUGE - 1000, torch.uint8)
    assert out.crc_before(rest) is not None and out.crc_before(first) is None
    first.fill_(5)  # written again after it was checksummed: the writer cannot know, so ...
    out.tensor(rest.fill_(1))
    out.tensor(first)  # ... this test appends out of order, which the writer copies: whole CRC
    payload = out.getvalue(b"L" * 8, 7, 9)
    assert zlib.crc32(payload[:-4]) == int.from_bytes(payload[-4:], "little")
    other = wire.Writer(size=wire.HUGE + 28, head=head)
    part = other.empty(wire.HUGE, torch.uint8).fill_(2)
    other.checksummed(part, 12345)  # a wrong CRC, but the header given to getvalue differs: recomputed
    other.tensor(part)
    payload = other.getvalue(b"M" * 8, 7, 9)
    assert zlib.crc32(payload[:-4]) == int.from_bytes(payload[-4:], "little")


@pytest.mark.parametrize("runs_on", [True, False])
def test_a_value_beyond_a_half_tensors_range_is_refused_as_the_per_segment_path_refuses_it(runs_on, monkeypatch):
    """none()'s fp32 values of a model's fp16 tensor: 1e6 rounds to inf in fp16, so the reply is
    refused (the per-segment path's ``.to(torch.float16)``); 60001 is kept, rounded to 60000."""
    from fedcomp.wire import HEADER_BYTES

    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    if not runs_on:
        monkeypatch.setattr(codec_module.Codec, "read_run", lambda *a, **kw: None)
    codec = fedcomp.build_codec("none()")
    model = {"w": torch.randn(300), "h": torch.randn(50).half()}
    acc = aggregate.Accumulator(codec, fedcomp.Layout.of(model))
    payload = bytearray(codec.encode(model, nonce=1).payload)
    at = HEADER_BYTES + 4 * 300 + 4 * 7  # h[7]'s fp32 bytes
    for value, kept in ((60001.0, True), (1.0e6, False)):
        payload[at:at + 4] = torch.tensor([value]).numpy().tobytes()
        payload[-4:] = zlib.crc32(bytes(payload[:-4])).to_bytes(4, "little")
        if kept:
            update = acc.decode(bytes(payload))
            assert (update.run is not None) == runs_on
            acc.add_update(update, 1.0)
            assert acc.sum()["h"][7].item() == 60000.0
        else:
            with pytest.raises(aggregate.UpdateRejected, match="'h'"):
                acc.decode(bytes(payload))


@pytest.mark.parametrize("spec", ["kbit(bits=4)", "qsgd(bits=4)", "none()", "fp16()"])
def test_half_tensors_beyond_a_part_check_to_the_per_segment_norm(spec, monkeypatch):
    """fp16 / bf16 tensors of more than 2**18 values (several parts of the sums of squares per
    chunk of aggregate.CHUNK): the norm read at once has the per-segment path's bits."""
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    g = torch.Generator().manual_seed(4)
    model = {"h": (torch.randn(300_001, generator=g) * 50).half(), "hb": torch.randn(600, 700, generator=g).bfloat16(),
             "w": torch.randn(1000, generator=g)}
    codec = fedcomp.build_codec(spec)
    layout = fedcomp.Layout.of(model)
    payload = codec.encode(model, nonce=2).payload
    results = []
    for runs_on in (True, False):
        with monkeypatch.context() as m:
            if not runs_on:
                m.setattr(codec_module.Codec, "read_run", lambda *a, **kw: None)
            acc = aggregate.Accumulator(codec, layout)
            update = acc.decode(payload)
            assert (update.run is not None) == runs_on
            norm = update.norm()
            acc.add_update(update, 0.7)
            results.append((norm, acc.sum()))
    assert results[0][0] == results[1][0]
    for name in model:
        assert torch.equal(results[0][1][name], results[1][1][name]), name


def test_a_subclass_reading_positions_its_own_way_is_ordered_before_the_add():
    """A selector subclass whose reader returns positions out of order (in range) still gets them
    ordered before the compiled add (which walks them in order: unordered, it would write outside
    the tensor's sum), so the sum is its own dense decode."""
    from fedcomp.codecs import sparsify as sparsifiers

    class Shuffled(sparsifiers.TopK):
        def read_indices(self, src, seg, ctx, device):
            return super().read_indices(src, seg, ctx, device).flip(0)

    codec = fedcomp.build_codec("topk(ratio=0.5,scope='tensor')")
    codec.reducer = Shuffled(codec.reducer.config)
    assert not sparsifiers.reads_ascending(codec.reducer)
    g = torch.Generator().manual_seed(13)
    model = {"a": torch.randn(10, generator=g), "b": torch.randn(2, generator=g), "c": torch.randn(8, generator=g)}
    layout = fedcomp.Layout.of(model)
    payload = codec.encode(model, nonce=1).payload
    acc = aggregate.Accumulator(codec, layout, batch=4)
    update = acc.decode(payload)
    assert not update.ascending
    acc.add_update(update, 1.0)
    got, want = acc.sum(), codec.decode(payload, layout)  # its values at its positions, as it reads them
    assert all(torch.equal(got[name].float(), want[name]) for name in model)
    assert any(bool(want[name].ne(0).any()) for name in model)


# -- a dense decode read at once (Codec._decode_run): the per-segment decode's bits, in one call --
def _fp32_model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(71, 47, generator=g), "none": torch.zeros(0), "n": torch.tensor([seed, 7]),
            "one": torch.randn(1, generator=g), "c": torch.randn(8, 3, 3, 3, generator=g),
            "big": torch.randn(3001, generator=g) * 1e-3}


def _decoded_bits(codec, payload, layout, monkeypatch, per_segment: bool):
    with monkeypatch.context() as m:
        if per_segment:
            m.setattr(type(codec), "read_run", lambda *a, **kw: None)
        try:
            out = codec.decode(payload, layout)
        except fedcomp.DecodeError as e:
            return str(e)
    return {n: (t.view(torch.int32) if t.dtype == torch.float32 else t).clone() for n, t in out.items()}


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return a.keys() == b.keys() and all(a[n].shape == b[n].shape and torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("spec", READ_SPECS)
def test_a_dense_decode_read_at_once_has_the_per_segment_bits(spec, monkeypatch):
    """Every float tensor decoded in one compiled call (chunks that start inside blocks), with the
    bits of the per-segment decode (kernels) and of the torch path; bodies corrupted under a valid
    checksum decode alike or are refused alike."""
    monkeypatch.setattr(codec_module, "DECODE_CHUNK", 600)
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    codec = fedcomp.build_codec(spec)
    model = _fp32_model(3)
    layout = fedcomp.Layout.of(model)
    payload = codec.encode(model, nonce=5).payload
    calls = []
    real = codec_module.Codec._decode_run
    monkeypatch.setattr(codec_module.Codec, "_decode_run", lambda *a: calls.append(1) or real(*a))
    run = _decoded_bits(codec, payload, layout, monkeypatch, False)
    assert calls == [1] and not isinstance(run, str)
    assert _same(run, _decoded_bits(codec, payload, layout, monkeypatch, True))
    monkeypatch.setenv("FEDCOMP_KERNELS", "0")
    assert _same(run, _decoded_bits(codec, payload, layout, monkeypatch, False))
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    rng = torch.Generator().manual_seed(1)
    for _ in range(12):  # a few body bytes changed, the checksum made valid again
        bad = bytearray(payload)
        for at in torch.randint(30, len(payload) - 40, (3,), generator=rng).tolist():
            bad[at] ^= int(torch.randint(1, 256, (1,), generator=rng))
        bad[-4:] = zlib.crc32(bytes(bad[:-4])).to_bytes(4, "little")
        got = _decoded_bits(codec, bytes(bad), layout, monkeypatch, False)
        assert _same(got, _decoded_bits(codec, bytes(bad), layout, monkeypatch, True))


@pytest.mark.parametrize("spec", ["fp16()", "bf16()"])
def test_a_half_payload_read_at_once_decodes_every_bit_pattern_as_torch(spec, monkeypatch):
    """All 65,536 patterns of a half payload (NaNs and infinities included) decode to torch's
    conversions (exact), through the run's loop as through the per-segment path."""
    codec = fedcomp.build_codec(spec)
    model = {"w": torch.zeros(1 << 16)}
    layout = fedcomp.Layout.of(model)
    payload = bytearray(codec.encode(model, nonce=1).payload)
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    body = patterns.numpy().tobytes()
    payload[-4 - len(body):-4] = body  # the values: last, before the checksum
    payload[-4:] = zlib.crc32(bytes(payload[:-4])).to_bytes(4, "little")
    want = patterns.view(torch.float16 if spec == "fp16()" else torch.bfloat16).float().view(torch.int32)
    for flag in ("1", "0"):
        monkeypatch.setenv("FEDCOMP_KERNELS", flag)
        for per_segment in (False, True):
            got = _decoded_bits(codec, bytes(payload), layout, monkeypatch, per_segment)
            assert torch.equal(got["w"], want), (flag, per_segment)


@pytest.mark.parametrize("spec", ["sign(block={b})", "kbit(block={b})", "qsgd(bucket={b})"])
def test_a_block_larger_than_every_tensor_is_read_at_once_as_one_block(spec, monkeypatch):
    """The server's run reads a block past every tensor as block 0 (one block a tensor): its codes
    scratch was sized by the block (block=1e11 asked for 745 GB, 2**62 overflowed)."""
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    model = {"w": torch.randn(10, generator=torch.Generator().manual_seed(0)), "v": torch.randn(3000)}
    layout = fedcomp.Layout.of(model)
    one = fedcomp.build_codec(spec.format(b=0))
    want = one.decode(one.encode(model, nonce=1).payload, layout)
    for b in (3000, 10**11, 2**62):
        codec = fedcomp.build_codec(spec.format(b=b))
        payload = codec.encode(model, nonce=1).payload
        acc = aggregate.Accumulator(codec, layout)
        acc.add(payload, 2.0)
        assert acc.decode(payload).run is not None
        got = codec.decode(payload, layout)
        for name in model:
            assert torch.equal(got[name], want[name]), (b, name)
            assert torch.equal(acc.sum()[name], 2.0 * want[name].double()), (b, name)
