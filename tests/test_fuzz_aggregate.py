"""Fuzzing the server's aggregation: payloads, weights, norms and sums. Whatever a client sends,
the aggregator raises a FedcompError (and leaves the sum as it was) or adds a finite update;
it never returns inf or NaN."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp.aggregate import Accumulator, AggregationError, NormGuard, WeightError, check_weight
from fedcomp.server_feedback import ServerFeedback

SPECS = ["topk(ratio=0.1)+qsgd(bits=4)", "randomk(ratio=0.2)", "kbit(bits=4)", "powersgd(rank=1)", "none()",
         "threshold(ratio=0.1)", "sign()", "terngrad()", "qsgd(bits=4)"]
# fp16 / bf16 tensors: dense replies are read at once, their values rounded in the loops
_LAYOUT_MODEL = {"w": torch.zeros(12, 8), "b": torch.zeros(8), "h": torch.zeros(6, dtype=torch.float16),
                 "hb": torch.zeros(5, dtype=torch.bfloat16), "n": torch.zeros(2, dtype=torch.int64)}
LAYOUT = fedcomp.Layout.of(_LAYOUT_MODEL)


def _payload(spec: str, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    update = {k: torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point() else torch.tensor([seed, 1])
              for k, v in _LAYOUT_MODEL.items()}
    return fedcomp.build_codec(spec).encode(update, nonce=seed, state={}).payload


PAYLOADS = {spec: _payload(spec, 1) for spec in SPECS}

weights = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-(10**500), max_value=10**500),
    st.text(max_size=5), st.none(), st.booleans(), st.just(2**53), st.just(2**53 + 1),
)


@settings(max_examples=300, deadline=None)
@given(weights, st.floats(min_value=0, max_value=1e300))
def test_check_weight_accepts_only_finite_positive_numbers_within_the_cap(weight, cap):
    try:
        w = check_weight(weight, cap)
    except WeightError as exc:
        assert str(exc)
        return
    assert math.isfinite(w) and 0 < w <= 2.0**53 and (cap == 0 or w <= cap)
    assert not isinstance(weight, (bool, str)) and weight is not None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SPECS), st.data())
def test_mutated_payloads_raise_typed_errors_and_leave_the_sum(spec, data):
    codec = fedcomp.build_codec(spec)
    acc = Accumulator(codec, LAYOUT)
    acc.add(PAYLOADS[spec], 3.0)
    before = acc.sum()
    payload = bytearray(PAYLOADS[spec])
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "extend", "zero"]))
        if kind == "flip" and payload:
            i = data.draw(st.integers(0, len(payload) - 1))
            payload[i] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            del payload[data.draw(st.integers(0, len(payload))):]
        elif kind == "extend":
            payload += data.draw(st.binary(min_size=1, max_size=16))
        elif kind == "zero" and payload:
            i = data.draw(st.integers(0, len(payload) - 1))
            payload[i:i + 8] = bytes(len(payload[i:i + 8]))
    weight = data.draw(weights)
    try:
        acc.add(bytes(payload), weight)
    except fedcomp.FedcompError:
        after = acc.sum()
        assert acc.count == 1 and all(torch.equal(before[k], after[k]) for k in before)
        return
    assert acc.count == 2
    mean = acc.mean()
    assert all(bool(torch.isfinite(t.double()).all()) for t in mean.values())


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.floats(min_value=-3e38, max_value=3e38, allow_nan=False),
                          st.floats(min_value=1e-300, max_value=2.0**53)), min_size=1, max_size=6),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_sums_never_return_inf(values, dtype):
    layout = fedcomp.Layout.of({"x": torch.zeros(3, dtype=dtype)})
    acc = Accumulator(fedcomp.build_codec("none()"), layout)
    for v, w in values:
        t = torch.full((3,), v, dtype=torch.float64).to(dtype)
        try:
            acc.add_dense({"x": t}, w)
        except AggregationError:  # a value that overflows the dtype is not finite: refused
            assert not bool(torch.isfinite(t).all())
    if not acc.count:
        return
    base = {"x": torch.full((3,), values[0][0], dtype=torch.float64).to(dtype)}
    for take in (acc.mean, lambda: acc.apply_mean(base)):
        try:
            out = take()
        except AggregationError:
            continue
        assert all(bool(torch.isfinite(t).all()) for t in out.values())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e300), min_size=1, max_size=12),
       st.floats(min_value=1, max_value=100), st.integers(1, 5))
def test_norm_guard_never_accepts_beyond_its_bound(norms, factor, warmup):
    guard = NormGuard(factor=factor, warmup=warmup)
    deferred, accepted = [], []
    for n in norms:
        verdict = guard.offer(n)
        if verdict is None:
            deferred.append(n)
        elif verdict:
            accepted.append((n, guard.bound()))
        if guard.ready() and deferred:
            accepted += [(d, guard.bound()) for d in deferred if guard.settle(d)]
            deferred = []
    accepted += [(d, guard.bound()) for d in deferred if guard.settle(d)]
    assert all(n <= bound for n, bound in accepted)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_fetchsgd_refuses_bad_sketches_and_weights(data):
    codec = fedcomp.build_codec("sketch(rows=2, cols=40, ratio=0.1)")
    layout = fedcomp.Layout.of({"w": torch.zeros(30, 4), "b": torch.zeros(4)})
    fetch = ServerFeedback(codec, layout)
    good = codec.encode({"w": torch.randn(30, 4), "b": torch.randn(4)}).payload
    payload = bytearray(good)
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] ^= data.draw(st.integers(1, 255))
    try:
        values = fetch.decode(bytes(payload))
        fetch.add_values(values, data.draw(weights))
    except fedcomp.FedcompError:
        return
    model = fetch.step()
    assert all(bool(torch.isfinite(t).all()) for t in model.values())
