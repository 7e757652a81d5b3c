"""Replies added chunk by chunk (no dense copy of a reply, no n-sized sketch tables): the same bits
as the dense path, and a bad reply still leaves the sum untouched.

Chunk sizes are patched small so that every multi-chunk path runs on small tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

import fedcomp
from fedcomp import aggregate
from fedcomp.aggregate import Accumulator, UpdateRejected
from fedcomp.base import REGISTRY, example_specs
from fedcomp.codecs import blockwise as quantizers  # (the blockwise encoders' _ENCODE_CHUNK)
from fedcomp.codecs import sketch
from fedcomp.codecs.sketch import CountSketch

# every registered quantizer alone (dense replies), a few non-default blocks, and PowerSGD
DENSE = sorted(s for s in example_specs() if "+" not in s and REGISTRY[s.split("(")[0]].kind == "quantizer") + [
    "kbit(bits=3,block=100)", "kbit(bits=5,block=0,stochastic=true)", "kbit(bits=4,coding='ans')",
    "qsgd(bits=3,bucket=77)", "qsgd(bits=6,bucket=0,norm='l2')", "sign(block=100)",
    "powersgd(rank=2)", "powersgd(rank=3,min_compression=0)+qsgd(bits=8)",
]


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(61, 47, generator=g), "b": torch.randn(5, generator=g),
            "h": torch.randn(33, 9, generator=g).half(), "d": torch.randn(4, 3, 7, generator=g).double(),
            "n": torch.tensor([seed], dtype=torch.int64)}


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(aggregate, "CHUNK", 256)  # pieces start inside tensors, ragged last ones
    monkeypatch.setattr(aggregate, "SUM_CHUNK", 200)  # the batched pass, in several chunks per tensor
    monkeypatch.setattr(aggregate, "RUN_SUM_CHUNK", 200)
    monkeypatch.setattr(quantizers, "_ENCODE_CHUNK", 100)


@pytest.mark.parametrize("spec", DENSE)
def test_fused_sum_equals_dense_decode(spec, small_chunks):
    codec = fedcomp.build_codec(spec)
    layout = fedcomp.Layout.of(_model(0))
    fused, dense = Accumulator(codec, layout), Accumulator(codec, layout)
    for i, weight in [(1, 1), (2, 3), (3, 2)]:
        payload = codec.encode(_model(i), nonce=i, round=1, state={}).payload
        update = fused.decode(payload, round=1)
        # nothing dense held between check and add: values still coded (per segment, or the whole
        # reply read at once: quantizers.RunReply, its fp16 tensor "h" rounded in the loops)
        assert (update.lazy or update.run is not None) and not update.parts
        reference = dense.dense_update(codec.decode(payload, layout, round=1))  # the dense path
        # the check pass takes squares from exact sums of codes (linear quantizers), counts (sign,
        # ternary codes) or factors (PowerSGD): the exact values' norm, ~1e-7 from the fp32 values'
        assert update.norm() == pytest.approx(reference.norm(), rel=1e-6)
        fused.add_update(update, weight)
        dense.add_update(reference, weight)
    got, want = fused.sum(), dense.sum()
    assert all(torch.equal(got[k], want[k]) for k in want)
    ref = _model(0)
    got, want = fused.apply_mean(ref), dense.apply_mean(ref)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == ref[k].dtype for k in ref)


@pytest.mark.parametrize("spec", ["kbit(bits=4)", "qsgd(bits=3,bucket=77)", "sign()", "none()", "powersgd(rank=2)", "terngrad()"])
def test_batched_adds_have_the_bits_of_one_at_a_time(spec, small_chunks):
    """Replies waiting for a shared pass over the sum (any batch, a dense reply cutting in, a
    reset between rounds) give the sum adding each on arrival gives, bit for bit."""
    codec = fedcomp.build_codec(spec)
    layout = fedcomp.Layout.of(_model(0))
    payloads = [codec.encode(_model(i), nonce=i, round=1, state={}).payload for i in range(1, 7)]
    weights = [1, 3, 0.3, 1e-7, 2, 5]
    dense = codec.decode(payloads[2], layout, round=1)
    sums = []
    for batch in (1, 2, 4, 8):
        acc = Accumulator(codec, layout, batch=batch)
        acc.add(payloads[0], 9)
        acc.reset()  # a waiting reply of the last round does not leak into this one
        for i, (payload, w) in enumerate(zip(payloads, weights)):
            acc.add(payload, w)
            if i == 3:
                acc.add_dense(dense, 0.5)  # not batchable: what waits is added first
        assert len(acc._pending) == (0 if batch == 1 else (len(payloads) - 4) % batch)
        sums.append(acc.sum())
        assert not acc._pending and acc.count == len(payloads) + 1
    assert all(torch.equal(s[k], sums[0][k]) for s in sums[1:] for k in sums[0])


def test_batch_is_checked_and_fp32_replies_wait_eight_at_a_time():
    codec = fedcomp.build_codec("none()")
    layout = fedcomp.Layout.of(_model(0))
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(aggregate.AggregationError, match="batch="):
            Accumulator(codec, layout, batch=bad)
    acc = Accumulator(codec, layout, batch=16)
    for i in range(1, 8):
        acc.add(codec.encode(_model(i), nonce=i).payload, 1)
        assert len(acc._pending) == i
    acc.add(codec.encode(_model(8), nonce=8).payload, 1)  # eight fp32 payloads: four float64 sums' bytes
    assert not acc._pending


@pytest.mark.parametrize("spec", ["kbit(bits=3,block=100)", "qsgd(bits=4,bucket=77)", "sign(block=9)", "fp16()", "none()"])
def test_values_ranges_equal_decode(spec, small_chunks):
    codec = fedcomp.build_codec(spec)
    x = {"w": torch.randn(3001, generator=torch.Generator().manual_seed(5))}
    layout = fedcomp.Layout.of(x)
    payload = codec.encode(x, nonce=1).payload
    want = codec.decode(payload, layout)["w"]
    (_, _, _, values), = codec.decode_parts(payload, layout, lazy=True)[0]
    assert torch.equal(values.dense(), want)
    for lo, hi in [(0, 3001), (0, 1), (7, 800), (800, 2999), (2048, 3001), (3000, 3001)]:
        assert torch.equal(values.chunk(lo, hi), want[lo:hi]), (lo, hi)


def test_powersgd_rows_equal_expand():
    codec = fedcomp.build_codec("powersgd(rank=3)")
    x = {"w": torch.randn(57, 41, generator=torch.Generator().manual_seed(2))}
    layout = fedcomp.Layout.of(x)
    (seg, _, aux, vals), = codec.decode_parts(codec.encode(x, state={}).payload, layout)[0]
    full = codec.reducer.expand(vals, aux, seg)
    for lo, hi in [(0, 2337), (0, 40), (40, 83), (100, 2337), (2336, 2337)]:
        assert torch.equal(codec.reducer.expand_range(vals, aux, seg, lo, hi), full[lo:hi])


@pytest.mark.parametrize("spec", ["kbit(bits=4)", "none()", "powersgd(rank=2)"])
def test_bad_reply_adds_nothing(spec, small_chunks):
    """All or nothing: a corrupted, truncated or non-finite reply raises before the first chunk is added."""
    codec = fedcomp.build_codec(spec)
    layout = fedcomp.Layout.of(_model(0))
    acc = Accumulator(codec, layout)
    acc.add(codec.encode(_model(1), nonce=1, state={}).payload, 2)
    before = acc.sum()
    good = codec.encode(_model(2), nonce=2, state={}).payload
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x40
    for bad in (bytes(flipped), good[:-7], good[: len(good) // 2]):
        with pytest.raises(fedcomp.DecodeError):
            acc.add(bad, 1)
    poisoned = _model(3)
    poisoned["d"][-1, -1, -1] = float("inf")  # the last float tensor: earlier ones would already be added
    with pytest.raises(UpdateRejected):
        acc.add(codec.encode(poisoned, nonce=3, state={}).payload, 1)
    after = acc.sum()
    assert acc.count == 1 and acc.total_weight == 2
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- count sketch: hashes regenerated chunk by chunk, estimates ranked chunk by chunk -----------
def _regenerating(rows, cols, monkeypatch):
    monkeypatch.setattr(sketch, "HASH_CACHE", 0)  # no tables: generator states every block
    monkeypatch.setattr(sketch, "HASH_CHUNK", 64)
    return CountSketch(CountSketch.Config(rows=rows, cols=cols, seed=4))


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_regenerated_hashes_equal_tables(rows, monkeypatch):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rows))
    cached_table = CountSketch(CountSketch.Config(rows=rows, cols=50, seed=4)).sketch(x)
    cached_est = CountSketch(CountSketch.Config(rows=rows, cols=50, seed=4)).estimate(cached_table, 1000)
    regen = _regenerating(rows, 50, monkeypatch)
    assert regen._plan(1000, torch.device("cpu"))[0] == "states"
    assert torch.equal(regen.sketch(x), cached_table)  # format 2: counter hashes, no tables either way
    # format 1 (generator tables): regenerated chunk by chunk from saved states, the same bits
    cached_v1 = CountSketch(CountSketch.Config(rows=rows, cols=50, seed=4)).sketch(x, version=1)
    assert torch.equal(regen.sketch(x, version=1), cached_v1)  # each cell adds in index order
    assert torch.equal(regen.estimate(cached_v1, 1000, version=1),
                       CountSketch(CountSketch.Config(rows=rows, cols=50, seed=4)).estimate(cached_v1, 1000, version=1))
    assert torch.equal(regen.estimate(cached_table, 1000), cached_est)


@pytest.mark.parametrize("rows", [1, 5])
def test_counter_hashes_give_the_same_sketch_in_any_chunking(rows, monkeypatch):
    """Format 2's cells and signs are functions of the position, so a GPU's larger chunks
    (sketch.DEVICE_HASH_CHUNK) sketch and estimate what the CPU's do (the torch path here)."""
    monkeypatch.setenv("FEDCOMP_KERNELS", "0")
    x = torch.randn(5000, generator=torch.Generator().manual_seed(rows))
    cs = CountSketch(CountSketch.Config(rows=rows, cols=300, seed=4))
    table = cs.sketch(x)
    est = cs.estimate(table, 5000)
    for chunk in (64, 5 * 4096, sketch.DEVICE_HASH_CHUNK):
        monkeypatch.setattr(sketch, "HASH_CHUNK", chunk)
        assert torch.equal(cs.sketch(x), table)  # each cell adds its elements in index order
        assert torch.equal(cs.estimate(table, 5000), est)


def test_chunked_top_k_keeps_the_largest(monkeypatch):
    cs = CountSketch(CountSketch.Config(rows=3, cols=400, ratio=0.02, seed=4))
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    table = cs.sketch(x)
    one = cs.heavy_hitters(table, 5000)  # one chunk: torch.topk over all estimates
    monkeypatch.setattr(sketch, "SELECT_CHUNK", 512)
    idx, val = cs.top_entries(table, 5000)
    est = cs.estimate(table, 5000)
    k = cs.kept(5000)
    assert idx.numel() == k == len(set(idx.tolist())) and torch.equal(val, est[idx])
    rest = torch.ones(5000, dtype=torch.bool)
    rest[idx] = False
    assert float(val.abs().min()) >= float(est[rest].abs().max())
    assert torch.equal(cs.heavy_hitters(table, 5000), one)  # ties included: lowest positions in any chunking


@pytest.mark.parametrize("chunk", [None, 300, 1000])
def test_heavy_hitters_tied_at_the_cut_are_the_lowest_positions(chunk, monkeypatch):
    """A one-row sketch gives every element of a cell the cell's magnitude: the cut goes through ties.
    The kept set is the first k of the order (magnitude descending, position ascending) however the
    estimates are chunked, so every device (torch.topk breaks ties its own way) keeps the same."""
    cs = CountSketch(CountSketch.Config(rows=1, cols=37, ratio=0.1, seed=2))
    n = 2000
    table = cs.sketch(torch.randn(n, generator=torch.Generator().manual_seed(5)))
    est = cs.estimate(table, n)
    k = cs.kept(n)
    want = sorted(range(n), key=lambda j: (-abs(float(est[j])), j))[:k]
    assert abs(float(est[want[-1]])) == abs(float(est[want[-2]]))  # the cut does go through a tie
    if chunk:
        monkeypatch.setattr(sketch, "SELECT_CHUNK", chunk)
    idx, val = cs.top_entries(table, n)
    assert sorted(idx.tolist()) == sorted(want) and torch.equal(val, est[idx])
    assert cs.top_entries(table, n, 0)[0].numel() == 0 and cs.top_entries(table, n, n)[0].numel() == n
    mag = torch.tensor([1.0, float("nan"), 3.0, 3.0, 2.0])  # not finite: torch.topk's choice, still k of them
    assert sketch._top_lowest_ties(mag, 2).numel() == 2
    assert sketch._top_lowest_ties(torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0]), 2).tolist() == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_model_tensor_is_added_and_squared_as_torch_would(dtype):
    """A model's fp16 / bf16 tensor is added into its float64 sum by the compiled loop with the
    bits of ``add_(values, alpha=w)``, and its chunk's sum of squares is the float64 one."""
    from fedcomp import kernels

    if kernels.get() is None:
        pytest.skip("numba not installed")
    g = torch.Generator().manual_seed(9)
    values = (torch.randn(70_001, generator=g) * 300).to(dtype)
    codec = fedcomp.build_codec("kbit(bits=4)")
    acc = Accumulator(codec, fedcomp.Layout.of({"h": values}))
    for w in (1.0, 0.3, 1e-7, 12345.0):
        start = torch.randn(70_001, generator=g, dtype=torch.float64)
        got, want = start.clone(), start.clone()
        acc._add_dense(got, 0, values, w)
        want.add_(values, alpha=w)
        assert torch.equal(got, want)
    assert aggregate._chunk_sq(values) == pytest.approx(float((values.double() ** 2).sum()), rel=1e-12)
    values[5] = float("inf")
    assert not math.isfinite(aggregate._chunk_sq(values))
