"""The reply fuzzers (``fedcomp.simulations.fuzz_replies``) in CI, bounded, and the guards' pieces on
their own: reply tags, the round guard's references, metric checks, the upload bound."""

from __future__ import annotations

import math
import random

import pytest
import torch
from flwr.app import MetricRecord, RecordDict

import fedcomp
from fedcomp.simulations import fuzz_replies
from fedcomp.strategies.guards import GuardHistory, ReplyRejected, RoundGuard, check_metrics, upload_bound
from fedcomp.wire import REPLY_TAG_BYTES, check_reply_tag, reply_tag


@pytest.mark.parametrize("target, count", [("metrics", 3000), ("buffers", 1500), ("replies", 150)])
def test_reply_fuzzers_find_no_untyped_failure(target, count):
    report = fuzz_replies.run(count, seed=7, targets=(target,), chunk=500)
    assert report[target]["inputs"] >= count and report[target]["untyped_failures"] == 0, report[target]["failures"]


# -- reply tags -------------------------------------------------------------------------------------------
def test_reply_tag_binds_the_payload_to_the_token():
    payload = fedcomp.build_codec("topk(ratio=0.5)").encode({"w": torch.randn(20)}, nonce=5).payload
    tag = reply_tag(payload, 123)
    assert len(tag) == REPLY_TAG_BYTES and tag == reply_tag(payload, 123) and tag != reply_tag(payload, 124)
    check_reply_tag(payload, tag, 123)
    rewritten = bytearray(payload)
    rewritten[16] ^= 1  # the nonce
    for data, given, token, says in [(payload, tag, 124, "does not match"), (bytes(rewritten), tag, 123, "does not match"),
                                     (payload, None, 123, "has no 'reply-tag'"), (payload, b"123", 123, "8 bytes"),
                                     (payload, "x" * 8, 123, "8 bytes")]:
        with pytest.raises(fedcomp.DecodeError, match=says):
            check_reply_tag(data, given, token)
    for bad in (-1, 2**63, 1.5, True, "7"):
        with pytest.raises(fedcomp.DecodeError, match="reply token"):
            reply_tag(payload, bad)


# -- the round guard: references a minority cannot steer -----------------------------------------------------
def test_first_round_holds_every_reply_until_the_quorum_then_uses_the_median():
    guard = RoundGuard(10.0, 0.0, 3, 2.0, quorum=5, history=GuardHistory())
    offers = [guard.offer(n, w) for n, w in [(1e30, 1e12), (1e30, 1e12), (1.0, 10), (2.0, 20), (1.5, 15)]]
    assert offers[:4] == [None] * 4 and offers[4] is True  # colluders first: held, not deciding
    # lower medians of all five: norms [1, 1.5, 2, 1e30, 1e30] -> 2, weights [10, 15, 20, 1e12, 1e12] -> 20
    assert guard.settle(1e30) is False and guard.settle(2.0) is True and guard.bound() == pytest.approx(20.0)
    assert guard.weight(1e12, 1.0)[0] == pytest.approx(2.0 * 20)
    assert "clipped to weight_factor=2" in guard.weight(1e12, 1.0)[1] and guard.weight(1e12, 1.0)[2]
    assert guard.weight(15, 1.5) == (15, None, False)
    for n, w in [(1.0, 10), (2.0, 20), (1.5, 15)]:
        guard.accept(n, w)
    guard.close()
    nxt = RoundGuard(10.0, 0.0, 3, 2.0, quorum=5, history=guard.history)
    assert nxt.offer(1e30, 1e12) is False and "accepted last round" in nxt.reason(1e30)  # decided at once
    assert nxt.offer(1.2, 12) is True


def test_a_round_that_accepts_nothing_clears_the_reference():
    history = GuardHistory([1.0, 1.0, 1.0], [1, 1, 1])
    guard = RoundGuard(10.0, 0.0, 3, 2.0, quorum=4, history=history)
    assert guard.offer(50.0, 1) is False
    guard.close()
    assert history.norms == [] and not RoundGuard(10.0, 0.0, 3, 2.0, quorum=4, history=history).ready()


def test_influence_bound_limits_a_long_update_at_a_large_weight():
    guard = RoundGuard(10.0, 0.0, 3, 2.0, quorum=1, history=GuardHistory([1.0] * 5, [10.0] * 5))
    weight, reason, claimed = guard.weight(20.0, 8.0)  # inside both bounds alone, 16 typical replies together
    assert weight == pytest.approx(2.0 * 20.0 * 1.0 / 8.0) and "weight_factor**2" in reason and not claimed
    assert RoundGuard(10.0, 0.0, 3, 0.0, quorum=1, history=GuardHistory([1.0] * 5, [10.0] * 5)).weight(1e12, 8.0) \
        == (1e12, None, False)  # weight_factor=0: declared weights trusted


# -- metrics --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("records, says", [
    ({}, "no metric 'num-examples'"),
    ({"a": {"num-examples": 5}, "b": {"num-examples": 5}}, "appears in 2 MetricRecords"),
    ({"a": {"num-examples": 5}, "b": {"loss": 1.0}}, "has 2 MetricRecords"),
    ({"a": {"num-examples": 5, "loss": math.nan}}, "metric 'loss' is nan"),
    ({"a": {"num-examples": 5, "loss": [1.0] * 1025}}, "at most 1024"),
    ({"a": {"num-examples": [5]}}, "must be a number, got a list"),
    ({"a": {"num-examples": 5, "x" * 129: 1.0}}, "at most 128 characters"),
    ({"a": {"num-examples": 5, "big": 2**60}}, "outside"),
])
def test_bad_metrics_are_refused_naming_what_is_wrong(records, says):
    content = RecordDict({name: MetricRecord(items) for name, items in records.items()})
    with pytest.raises(ReplyRejected, match=says):
        check_metrics(content, "num-examples")


def test_good_metrics_give_their_schema():
    content = RecordDict({"m": MetricRecord({"num-examples": 5, "loss": 0.5, "hist": [1, 2, 3]})})
    name, metrics, schema = check_metrics(content, "num-examples")
    assert name == "m" and metrics["loss"] == 0.5
    assert schema == ("m", (("hist", ("list", 3)), ("loss", ("scalar",)), ("num-examples", ("scalar",))))


# -- upload bound ------------------------------------------------------------------------------------------
def test_upload_bound_is_the_configured_size_with_slack_and_dense_where_data_decides():
    model = {"w": torch.randn(200, 50), "b": torch.randn(200), "n": torch.tensor(3)}
    layout = fedcomp.Layout.of(model)
    dense = fedcomp.build_codec("none()").size_bytes(layout)
    limit, cap = upload_bound("topk(ratio=0.01)+qsgd(bits=4)", layout)
    assert limit < dense / 10 and cap >= dense
    assert len(fedcomp.build_codec("topk(ratio=1.0)+qsgd(bits=8)").encode(model).payload) > limit
    assert upload_bound("threshold(tau=0.01)", layout)[0] >= dense  # the count kept depends on the data
    g = torch.Generator().manual_seed(1)
    for _ in range(5):  # honest payloads of the configured codec always fit
        update = {k: torch.randn(v.shape, generator=g) * 10 ** random.uniform(-3, 3) if v.is_floating_point() else v
                  for k, v in model.items()}
        assert len(fedcomp.build_codec("topk(ratio=0.01)+qsgd(bits=4)").encode(update).payload) <= limit
