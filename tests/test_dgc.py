"""Deep Gradient Compression and sampled-threshold top-k.

Sampled top-k (``fedcomp.sparsifiers``): exact where it says so, 0.8k..1.3k elements otherwise,
always a top set, no zeros, no global RNG. The adaptive threshold keeps about ``ratio``. DGC
(``fedcomp.dgc``): momentum correction and factor masking against a hand computation, warm-up
counts per round, clipping, and the error-feedback identity with momentum. The codec contract
(round trip, sizes, malformed payloads) runs in tests/test_codecs.py; here only what it cannot
reach: payloads of warm-up rounds and of codecs with client state.
"""

from __future__ import annotations

import math
import random
import struct
import zlib

import pytest
import torch

from fedcomp import DecodeError, Layout, SpecError, build_codec, compress
from fedcomp.codecs.dgc import momentum_key, warmup_fraction
from fedcomp.codecs.sparsify import sampled_threshold, sampled_topk, topk_from_threshold

HEADER, TRAILER = 24, 4


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def true_topk(mag: torch.Tensor, k: int) -> set[int]:
    return set(torch.topk(mag, k).indices.tolist())


def separated(n: int, k: int, seed: int) -> torch.Tensor:
    """k magnitudes in [10, 11) far above n - k in [0, 1): the top-k is unambiguous."""
    g = gen(seed)
    mag = torch.rand(n, generator=g)
    mag[torch.randperm(n, generator=g)[:k]] = 10 + torch.rand(k, generator=g)
    return mag


def assert_top_set(mag: torch.Tensor, idx: torch.Tensor) -> None:
    """Sorted, distinct, nonzero, and no unselected entry larger than a selected one."""
    assert bool((torch.diff(idx) > 0).all()), "positions not sorted and distinct"
    assert bool((mag[idx] > 0).all()), "a zero entry was kept"
    rest = torch.ones_like(mag, dtype=torch.bool)
    rest[idx] = False
    if idx.numel() and bool(rest.any()):
        assert float(mag[idx].min()) >= float(mag[rest].max()), "not a top set"


def assert_count(c: int, k: int) -> None:
    assert c == k or math.ceil(0.8 * k) <= c <= math.floor(1.3 * k), f"{c} kept, k = {k}"


# -- sampled top-k --------------------------------------------------------------------------
@pytest.mark.parametrize("thr", [0.5, 1e30], ids=["below-k-th: exact among candidates", "too high: exact fallback"])
def test_threshold_rule_exact_paths_return_the_true_top_k(thr):
    """thr 0.5 lets ~n/2 > 1.3k candidates pass (step 2); 1e30 * 0.8**9 still passes nothing (step 4)."""
    mag, k = separated(20_000, 37, seed=1), 37
    idx = topk_from_threshold(mag, k, torch.tensor(thr))
    assert idx.numel() == k
    assert set(idx.tolist()) == true_topk(mag, k)


def test_threshold_rule_accepts_a_threshold_passing_between_0_8k_and_1_3k():
    mag = torch.arange(1, 1001, dtype=torch.float32)  # 1..1000, distinct
    k = 100
    for passing in (80, 100, 130):  # thr = 1001 - passing lets exactly `passing` through
        idx = topk_from_threshold(mag, k, torch.tensor(float(1001 - passing)))
        assert idx.tolist() == list(range(1000 - passing, 1000))
    # 131 pass: more than 1.3k, so exactly the top 100; 79 pass: lowered by 0.8 (922 * 0.8: 263 pass, exact top 100)
    for passing in (131, 79):
        assert topk_from_threshold(mag, k, torch.tensor(float(1001 - passing))).tolist() == list(range(900, 1000))
    # none pass at 1100.625; lowered once to 880.5, 120 pass: accepted (not the exact top 100)
    assert topk_from_threshold(mag, k, torch.tensor(1100.625)).tolist() == list(range(880, 1000))


def test_sampled_topk_is_exact_whenever_its_first_threshold_overshoots():
    """Predict the path from the first sampled threshold (same generator seed): more than 1.3k
    passing means the exact path, so the result must be the true top-k."""
    n, k = 50_000, 50
    exact_runs = 0
    for seed in range(30):
        mag = separated(n, k, seed)
        thr = sampled_threshold(mag, k, gen(seed), 0.01)
        idx = sampled_topk(mag, k, gen(seed), 0.01)
        if int((mag >= thr).sum()) > 1.3 * k:
            exact_runs += 1
            assert set(idx.tolist()) == true_topk(mag, k), seed
        assert_top_set(mag, idx)
        assert_count(idx.numel(), k)
    assert exact_runs >= 8  # the exact path was exercised (about 3 runs in 4)


def _magnitudes(kind: str, n: int, seed: int) -> torch.Tensor:
    g = gen(seed)
    if kind == "normal":
        return torch.randn(n, generator=g).abs()
    if kind == "cauchy":
        return torch.empty(n).cauchy_(generator=g).abs()
    if kind == "spiky":  # 97% zeros
        return torch.randn(n, generator=g).abs() * (torch.rand(n, generator=g) < 0.03)
    if kind == "ties":  # 16 distinct values
        return torch.randint(0, 16, (n,), generator=g).float()
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["normal", "cauchy", "spiky", "ties"])
@pytest.mark.parametrize("n, k", [(30_000, 1), (30_000, 30), (30_000, 300), (30_000, 3000), (900, 90)])
def test_sampled_topk_count_within_slack_and_top_set(kind, n, k):
    for seed in range(8):
        mag = _magnitudes(kind, n, seed)
        idx = sampled_topk(mag, k, gen(100 + seed), 0.01)
        assert_top_set(mag, idx)
        nnz = int(torch.count_nonzero(mag))
        if nnz <= k:
            assert idx.numel() == nnz  # every nonzero entry, no zeros
        elif n <= 1024:  # no larger than the sample: the exact top-k
            assert idx.numel() == k
        else:
            assert_count(idx.numel(), k)


def test_sampled_topk_keeps_no_zeros():
    mag = torch.zeros(10_000)
    mag[[3, 500, 9_999]] = torch.tensor([1.0, 2.0, 0.5])
    assert sampled_topk(mag, 100, gen(0)).tolist() == [3, 500, 9_999]
    assert sampled_topk(torch.zeros(5000), 10, gen(0)).numel() == 0
    # a zero threshold estimate (the sample held too few nonzeros) passes only the nonzero entries
    dense = torch.rand(2000, generator=gen(1)) + 0.5
    dense[torch.randperm(2000, generator=gen(2))[:190]] = 0
    assert topk_from_threshold(dense, 1800, torch.tensor(0.0)).tolist() == torch.nonzero(dense).reshape(-1).tolist()
    assert sampled_topk(mag, 0, gen(0)).numel() == 0


def test_no_global_rng_use():
    before = torch.random.get_rng_state()
    mag = torch.randn(50_000, generator=gen(0)).abs()
    sampled_topk(mag, 100, gen(1))
    update = {"w": torch.randn(300, 200, generator=gen(2)), "b": torch.randn(200, generator=gen(3))}
    for spec in ("dgc(ratio=0.01, warmup=3)+qsgd(bits=4)", "threshold(ratio=0.01)", "threshold(ratio=0.01, mode='signed')"):
        state: dict = {}
        residual = None
        for r in (1, 2, 5):
            _, residual = compress(build_codec(spec), update, residual, nonce=r, round=r, state=state)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_selection_is_seeded_by_the_nonce():
    update = {"w": torch.randn(100_000, generator=gen(4))}
    codec = build_codec("dgc(ratio=0.001)")
    assert codec.encode(update, nonce=7).payload == codec.encode(update, nonce=7).payload
    kept = {codec.encode(update, nonce=i).kept for i in range(12)}
    assert len(kept) > 1  # different samples, different thresholds


# -- adaptive threshold ---------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_adaptive_threshold_keeps_about_ratio_on_gaussian_data(ratio):
    n = 100_000
    x = {"w": torch.randn(n, generator=gen(5)) * 0.01}
    k = math.ceil(ratio * n)
    counts = []
    for nonce in range(8):
        enc = build_codec(f"threshold(ratio={ratio})").encode(x, nonce=nonce)
        (c,) = enc.kept
        assert_count(c, k)
        assert_top_set(x["w"].abs(), torch.nonzero(enc.decoded["w"]).reshape(-1))
        counts.append(c)
    assert 0.9 <= sum(counts) / len(counts) / k <= 1.2, counts


def test_adaptive_threshold_signed_mode_keeps_ratio_of_each_sign():
    """Dryden: separate thresholds; on data shifted positive, |x| alone (Aji) starves the negatives."""
    n, ratio = 100_000, 0.01
    x = torch.randn(n, generator=gen(6)) + 1.0
    pos, neg = x > 0, x < 0
    signed = build_codec(f"threshold(ratio={ratio}, mode='signed')+none").encode({"w": x}, nonce=1).decoded["w"]
    for side in (pos, neg):
        sent = (signed != 0) & side
        assert_count(int(sent.sum()), math.ceil(ratio * int(side.sum())))
        mag = torch.where(side, x.abs(), torch.zeros_like(x))
        assert_top_set(mag, torch.nonzero(sent).reshape(-1))
    assert torch.equal(signed[signed != 0], x[signed != 0])  # +none: exact values
    plain = build_codec(f"threshold(ratio={ratio})+none").encode({"w": x}, nonce=1).decoded["w"]
    assert int(((plain != 0) & neg).sum()) < 0.1 * ratio * int(neg.sum())


def test_adaptive_threshold_alone_sends_signs_of_the_mean_kept_magnitude_and_ignores_tau():
    x = {"w": torch.randn(50_000, generator=gen(7))}
    a = build_codec("threshold(ratio=0.02)").encode(x, nonce=3)
    b = build_codec("threshold(tau=7.0, ratio=0.02)").encode(x, nonce=3)
    assert torch.equal(a.decoded["w"], b.decoded["w"])
    kept = a.decoded["w"] != 0
    scale = x["w"][kept].abs().mean()
    torch.testing.assert_close(a.decoded["w"][kept], torch.sign(x["w"][kept]) * scale)
    # 1 bit per kept element + one fp32 scale, after the index stream
    assert len(a.payload) == HEADER + TRAILER + a.index_bytes[0] + 4 + math.ceil(a.kept[0] / 8)


# -- DGC ------------------------------------------------------------------------------------
def test_dgc_momentum_and_masking_match_a_hand_computation():
    """g = [1, 0.5, -0.25, 0.1] every round, momentum 0.5, k = 1 (ratio 0.25 of 4):

    round 1: u = g = [1, .5, -.25, .1];  p = u;  send #0 (1);  v = [0, .5, -.25, .1];  u = [0, .5, -.25, .1]
    round 2: u = .5 u + g = [1, .75, -.375, .15];  p = v + u = [1, 1.25, -.625, .25];  send #1 (1.25)
             v = [1, 0, -.625, .25];  u = [1, 0, -.375, .15]
    round 3: u = [1.5, .5, -.4375, .175];  p = [2.5, .5, -1.0625, .425];  send #0 (2.5)
             v = [0, .5, -1.0625, .425];  u = [0, .5, -.4375, .175]
    """
    codec = build_codec("dgc(ratio=0.25, momentum=0.5)")
    g = {"w": torch.tensor([1.0, 0.5, -0.25, 0.1]), "steps": torch.tensor(3)}
    want = [
        ([1, 0, 0, 0], [0, 0.5, -0.25, 0.1], [0, 0.5, -0.25, 0.1]),
        ([0, 1.25, 0, 0], [1, 0, -0.625, 0.25], [1, 0, -0.375, 0.15]),
        ([2.5, 0, 0, 0], [0, 0.5, -1.0625, 0.425], [0, 0.5, -0.4375, 0.175]),
    ]
    state: dict = {}
    residual = None
    for r, (sent, v, u) in enumerate(want, start=1):
        enc, residual = compress(codec, g, residual, nonce=r, round=r, state=state)
        torch.testing.assert_close(enc.decoded["w"], torch.tensor(sent, dtype=torch.float32), rtol=0, atol=1e-7)
        torch.testing.assert_close(residual["w"], torch.tensor(v, dtype=torch.float32), rtol=0, atol=1e-7)
        torch.testing.assert_close(state[momentum_key("w")], torch.tensor(u, dtype=torch.float32), rtol=0, atol=1e-7)
        assert torch.equal(enc.decoded["steps"], g["steps"])
        assert set(state) == {momentum_key("w")}


def test_dgc_without_state_is_error_feedback_topk():
    """No state: no momentum (whatever ``momentum`` says); on segments of at most 1,024 elements
    the sampled selection is the exact top-k, so DGC equals topk round for round."""
    dgc, topk = build_codec("dgc(ratio=0.05, momentum=0.9)"), build_codec("topk(ratio=0.05)")
    rd = rt = None
    for r in range(1, 8):
        u = {"w": torch.randn(30, 20, generator=gen(r)), "b": torch.randn(20, generator=gen(50 + r))}
        a, rd = compress(dgc, u, rd, nonce=r, round=r)
        b, rt = compress(topk, u, rt, nonce=r, round=r)
        assert a.decoded.keys() == b.decoded.keys()
        for name in u:
            assert torch.equal(a.decoded[name], b.decoded[name])
            assert torch.equal(rd[name], rt[name])


def test_dgc_clips_the_update_by_its_global_norm():
    g = {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}  # ||g|| = 5
    codec = build_codec("dgc(ratio=1.0, clip=2.5, momentum=0.5)")
    state: dict = {}
    enc, residual = compress(codec, g, None, state=state, round=1)
    torch.testing.assert_close(enc.decoded["w"], torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(enc.decoded["b"], torch.tensor([2.0]))
    torch.testing.assert_close(state[momentum_key("w")], torch.tensor([0.0, 0.0]))  # sent: masked
    enc, _ = compress(build_codec("dgc(ratio=1.0, clip=5.5)"), g, None)  # shorter than clip: unchanged
    assert torch.equal(enc.decoded["w"], g["w"]) and torch.equal(enc.decoded["b"], g["b"])


def test_dgc_momentum_of_a_reshaped_tensor_starts_from_zero():
    codec = build_codec("dgc(ratio=0.5, momentum=0.9)")
    state = {momentum_key("w"): torch.ones(3)}
    g = {"w": torch.tensor([[1.0, -2.0], [0.5, 0.25]])}
    compress(codec, g, None, state=state, round=1)
    # u = g (old u ignored), then masked where sent (the two largest)
    torch.testing.assert_close(state[momentum_key("w")], torch.tensor([[0.0, 0.0], [0.5, 0.25]]))


def test_warmup_fraction_schedule():
    """Geometric from ``start`` in round 1 to ``ratio`` in round warmup + 1; 0.25 over 4 rounds to
    0.001 is the paper's 75%, 93.75%, 98.4%, 99.6%, 99.9% sparsity."""
    paper = [warmup_fraction(0.001, 4, t) for t in range(7)]
    assert paper[0] == paper[5] == paper[6] == 0.001  # round 0 (unknown): no warm-up
    assert paper[1] == 0.25
    for got, want in zip(paper[2:5], [0.25**2, 0.25**3, 0.25**4]):
        assert abs(got / want - 1) < 0.02, paper
    short = [warmup_fraction(0.001, 2, t, start=0.016) for t in range(5)]
    assert short[:2] == [0.001, 0.016] and abs(short[2] - 0.004) < 1e-12 and short[3:] == [0.001, 0.001]
    assert warmup_fraction(0.3, 4, 2) == 0.3  # start (0.25) below ratio: ratio throughout
    assert warmup_fraction(0.001, 0, 1) == 0.001  # no warm-up
    assert warmup_fraction(0.01, 3, 2, start=0.005) == 0.01


def test_dgc_warmup_counts_per_round():
    """1,000 elements (exact path): k_t = ceil(1000 * 0.25 * 0.016 ** ((t - 1) / 6)) in rounds 1..6, then ceil(1000 * 0.004)."""
    codec = build_codec("dgc(ratio=0.004, warmup=6)")
    x = {"w": torch.randn(1000, generator=gen(8))}
    kept = [codec.encode(x, nonce=1, round=t).kept[0] for t in range(9)]
    assert kept == [4, 250, 126, 63, 32, 16, 8, 4, 4]
    kept = [build_codec("dgc(ratio=0.004, warmup=2, start=0.016)").encode(x, nonce=1, round=t).kept[0] for t in range(5)]
    assert kept == [4, 16, 8, 4, 4]


def test_dgc_warmup_counts_on_a_large_segment_and_decoding_needs_no_round():
    n, ratio, warmup = 100_000, 0.001, 5
    codec = build_codec(f"dgc(ratio={ratio}, warmup={warmup})+kbit(bits=4)")
    x = {"w": torch.randn(n, generator=gen(9))}
    layout = Layout.of(x)
    for t in range(1, warmup + 3):
        enc = codec.encode(x, nonce=t, round=t)
        assert_count(enc.kept[0], math.ceil(n * warmup_fraction(ratio, warmup, t)))
        assert torch.equal(codec.decode(enc.payload, layout)["w"], enc.decoded["w"])
        assert codec.size_bytes(layout, enc.kept, enc.index_bytes) == len(enc.payload)


def test_start_is_in_the_canonical_spec_only_with_a_warmup():
    """Without warm-up ``start`` does nothing: the spec, fingerprint and payloads are those from
    before the option existed; with one it is spelled out and round-trips."""
    old = "dgc(ratio=0.01,momentum=0.9,clip=0.0,warmup=0,sample=0.01,index='rice')"
    assert build_codec("dgc(ratio=0.01, momentum=0.9, start=0.5)").spec == old
    assert build_codec(old).fingerprint == zlib.crc32(old.encode())
    warm = build_codec("dgc(warmup=8, start=0.01)").spec
    assert "warmup=8,start=0.01," in warm and build_codec(warm).spec == warm
    x = {"w": torch.randn(5000, generator=gen(13))}
    assert build_codec("dgc(start=0.5)").encode(x, nonce=2, round=1).payload == build_codec("dgc()").encode(
        x, nonce=2, round=1).payload


def test_defaults_and_the_cross_device_defaults():
    """``dgc()``: the paper's 99.9% sparsity with momentum 0.7 and no warm-up; for clients that
    take part now and then the spec that regime was measured with (a tenth, momentum 0.9)."""
    import fedcomp

    assert build_codec("dgc()").spec == "dgc(ratio=0.001,momentum=0.7,clip=0.0,warmup=0,sample=0.01,index='rice')"
    assert fedcomp.cross_device_spec("dgc()") == "dgc(ratio=0.1,momentum=0.9,clip=0.0,warmup=0,sample=0.01,index='rice')"


def _updates(rounds: int, seed: int = 0):
    base = {"fc.weight": torch.randn(40, 30, generator=gen(seed)) * 0.05, "fc.bias": torch.randn(30, generator=gen(seed + 1)) * 0.01}
    g = gen(seed + 2)
    for _ in range(rounds):
        yield {n: b + 0.5 * b.std() * torch.randn(b.shape, generator=g) for n, b in base.items()}


def _flat(d) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for v in d.values()])


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("quantizer", ["", "+qsgd(bits=4)"])
def test_error_feedback_identity_with_momentum(momentum, quantizer):
    """With p_t = v_{t-1} + u'_t, u'_t = m u_{t-1} + g_t, v_t = p_t - d_t, u_t = u'_t masked, u_0 = v_0 = 0:

        sum_t d_t = sum_t (p_t - v_t) = sum_t u'_t - v_T = sum_t g_t + m sum_{t<T} u_t - v_T

    so  sum d + v_T == sum g + m * (the masked momenta carried from each round into the next).
    Momentum re-injects m u each round; masking only decides how much is carried. m = 0 is
    plain error feedback."""
    codec = build_codec(f"dgc(ratio=0.05, momentum={momentum}, warmup=2){quantizer}")
    state: dict = {}
    residual = None
    sum_g = sum_d = carried = 0
    scale = 0.0  # sum over rounds of the norms that fp32 rounds (u, p, v): the tolerance's scale
    rounds = 30
    for t, g in enumerate(_updates(rounds), start=1):
        enc, residual = compress(codec, g, residual, nonce=t, round=t, state=state)
        sum_g = sum_g + _flat(g)
        sum_d = sum_d + _flat(enc.decoded)
        u = _flat({n: state[momentum_key(n)] for n in g}) if momentum else torch.zeros(1, dtype=torch.float64)
        scale += float(_flat(g).norm() + _flat(enc.decoded).norm() + _flat(residual).norm() + momentum * u.norm())
        if t < rounds:
            carried = carried + momentum * u
    lhs = sum_d + _flat(residual)
    rhs = sum_g + carried
    assert float((lhs - rhs).norm()) <= 2**-21 * scale + 1e-9
    assert float(_flat(residual).norm()) > 0


def test_dgc_with_a_quantizer_codes_the_kept_values_like_the_quantizer_alone():
    """dgc(...)+qsgd: the kept values (in position order) go through qsgd exactly as qsgd would
    code them on their own (same nonce, same generator stream)."""
    x = {"w": torch.randn(300, 100, generator=gen(10)), "b": torch.randn(100, generator=gen(11))}
    alone = build_codec("dgc(ratio=0.01)").encode(x, nonce=5).decoded
    both = build_codec("dgc(ratio=0.01)+qsgd(bits=4, bucket=64)").encode(x, nonce=5).decoded
    flat_alone, flat_both = _flat(alone).float(), _flat(both).float()
    kept = flat_alone != 0
    assert not bool((flat_both[~kept] != 0).any())
    values = build_codec("qsgd(bits=4, bucket=64)").encode({"v": flat_alone[kept]}, nonce=5).decoded["v"]
    assert torch.equal(flat_both[kept], values)


def test_warmup_payload_rejects_malformed_bytes_with_decode_error_only():
    codec = build_codec("dgc(ratio=0.002, warmup=4)+kbit(bits=4)")
    x = {"w": torch.randn(64, 70, generator=gen(12)), "n": torch.tensor(5)}
    layout = Layout.of(x)
    enc = codec.encode(x, nonce=9, round=2)
    p = enc.payload
    rng = random.Random(0)
    for cut in range(0, len(p), max(1, len(p) // 50)):
        with pytest.raises(DecodeError):
            codec.decode(p[:cut], layout)
    def reseal(b: bytes) -> bytes:
        return b[:-TRAILER] + struct.pack("<I", zlib.crc32(b[:-TRAILER]))

    for _ in range(300):
        bad = bytearray(p)
        bad[rng.randrange(HEADER, len(p) - TRAILER)] ^= 1 << rng.randrange(8)
        try:
            out = codec.decode(reseal(bytes(bad)), layout)
        except DecodeError:
            continue
        assert out["w"].shape == x["w"].shape and out["w"].dtype == torch.float32


@pytest.mark.parametrize(
    "spec, named",
    [
        ("dgc(ratio=0)", "ratio=0"),
        ("dgc(momentum=1.0)", "momentum=1.0"),
        ("dgc(momentum=-0.1)", "momentum=-0.1"),
        ("dgc(clip=-1)", "clip=-1"),
        ("dgc(clip=1e400)", "clip=inf"),
        ("dgc(warmup=-1)", "warmup=-1"),
        ("dgc(warmup=1.5)", "warmup=1.5"),
        ("dgc(sample=0)", "sample=0"),
        ("dgc(start=0)", "start=0"),
        ("dgc(start=1.5)", "start=1.5"),
        ("dgc(index='zip')", "'zip'"),
        ("dgc(scope='tensor')", "'scope'"),
        ("threshold(ratio=1.5)", "ratio=1.5"),
        ("threshold(ratio=-0.1)", "ratio=-0.1"),
        ("threshold(mode='dryden')", "'dryden'"),
        ("threshold(sample=2)", "sample=2"),
    ],
)
def test_bad_parameters_name_the_value(spec, named):
    with pytest.raises(SpecError) as err:
        build_codec(spec)
    assert named in str(err.value), str(err.value)


# -- the study script (simulations/dgc_study.py): pairing and keys, on made-up runs -------------
def test_dgc_study_pairs_seeds_and_keys_runs_by_the_spec_they_ran(tmp_path):
    """A run is keyed by its canonical spec as it ran: an old ``dgc(ratio=0.001)`` run (momentum 0.9
    then) is ``dgc(momentum=0.9)`` today, not ``dgc()``; gaps are paired per seed."""
    import argparse
    import json

    from fedcomp.simulations import dgc_study

    a = argparse.Namespace(task="digits", model="mlp", rounds=2, clients=10, fraction=1.0, lr=0.3)

    def row(spec, ran_as, seed, acc, up):
        return {"spec": spec, "canonical": ran_as, "upload": spec, "seed": seed, "task": "digits", "model": "mlp",
                "planned_rounds": 2, "clients": 10, "fraction": 1.0, "lr": 0.3, "accuracy": acc,
                "upload_bytes": up, "finite": True}

    old = "dgc(ratio=0.001,momentum=0.9,clip=0.0,warmup=0,sample=0.01,index='rice')"
    rows = [row("dense", "dense", 0, [0.5, 0.9], [1000, 1000]), row("dense", "dense", 1, [0.5, 0.8], [1000, 1000]),
            row("dgc(ratio=0.001)", old, 0, [0.4, 0.8], [10, 10]), row("dgc(ratio=0.001)", old, 1, [0.4, 0.8], [20, 20])]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = dgc_study.load(path)
    assert dgc_study._key("dgc(momentum=0.9)", 0, a) in runs and dgc_study._key("dgc()", 0, a) not in runs
    text = dgc_study.table(["dgc(momentum=0.9)", "dgc()"], [0, 1], a, runs)
    line = next(x for x in text.splitlines() if x.startswith("| `dgc(momentum=0.9)`"))
    # final: 80 - 90 = -10 and 80 - 80 = 0; ratio: 2000/20 and 2000/40
    assert "| 0,1 | 80.00 | -5.00 [-10.00, +0.00] sd 7.07 |" in line and "| 75.0 | yes |" in line
    assert "| `dgc()` | 0 | not run |" in text
