"""Budgets through the client mod and the strategy wrapper, in process: uploads within budgets,
simulated round time, reported specs, skipped replies, tiers from links."""

from __future__ import annotations

import pytest
import torch
from flwr.serverapp.strategy import FedAvg

from fedcomp.wire import REPLY_TAG
import fedcomp.clients.mod as mod
import fedcomp
from fedcomp.clients.mod import desired_tier
from conftest import node_context, run_round, tiny_model
from fedcomp import protocol as P
from fedcomp import links
from fedcomp.strategies.wrapper import CompressedStrategy

UPLOAD = "topk(ratio=0.1,index='fixed')+qsgd(bits=4)"


def _strategy(**kwargs):
    kwargs.setdefault("upload", UPLOAD)
    return CompressedStrategy(FedAvg(fraction_train=1.0, min_available_nodes=1, min_train_nodes=1), **kwargs)


def _round(strategy, model, contexts, server_round, tamper=None):
    new, replies, _ = run_round(strategy, model, contexts, server_round, tamper=tamper)
    return new, replies


def _fake_clock(monkeypatch, step):
    """The mod's clock advances ``step`` seconds per reading: measured times are deterministic."""
    clock = iter(step * i for i in range(1_000_000))
    monkeypatch.setattr(mod, "perf_counter", lambda: next(clock))


def test_every_upload_within_its_budget_every_round(monkeypatch):
    _fake_clock(monkeypatch, 0.001)
    # byte caps below the codec's largest message on a 3,250-parameter model, a deadline-derived
    # budget on 3g-edge, and simulated partitions on the 'mixed' profile
    caps = {1: 900, 2: 2000, 3: 4500}
    contexts = {n: node_context(n, **{"uplink-kbps": 100, "downlink-kbps": 1000, "latency-ms": 20, "byte-cap": c})
                for n, c in caps.items()}
    contexts[4] = node_context(4, link="3g-edge")
    for n in (5, 6, 7):
        contexts[n] = node_context(n, **{"partition-id": n, "num-partitions": 10})
    strategy = _strategy(download="kbit(bits=8)", link_profile="mixed", round_deadline_s=0.8)
    model = tiny_model()
    for r in range(1, 5):
        model, _ = _round(strategy, model, contexts, r)
        stats = strategy.rounds[r]
        assert [c["status"] for c in stats.clients] == ["ok"] * 7, stats.clients
        assert len(stats.links) == 7
        for entry in stats.links:
            assert entry["budget"] is not None
            assert entry["upload_bytes"] <= entry["budget"], entry
            assert entry["download_bytes"] == entry["download_bytes_seen"]  # client and server count alike
            assert entry["status"] == "ok" and not entry["late"]
        by_node = {e["node"]: e for e in stats.links}
        for node, cap in caps.items():
            assert by_node[node]["budget"] <= cap
            assert by_node[node]["upload_bytes"] >= 0.98 * by_node[node]["budget"]  # inside the codec's range
        # 3g-edge at 200 kbps: the budget is what the uplink carries until the deadline
        assert by_node[4]["budget"] < 0.8 * 200_000 / 8
        specs = {by_node[n]["spec"] for n in caps}
        assert len(specs) == 3  # each client its own k
        assert all(fedcomp.build_codec(s).spec == s for s in specs)
        assert stats.sim_time_s is not None and 0 < stats.sim_time_s <= 0.8


def test_simulated_round_time_hand_computed(monkeypatch):
    """Each perf_counter call of the mod advances a fake clock by 0.25 s: the client reports
    compute = 2 readings apart = 0.5 s (start, after training = encode start, encode end)."""
    _fake_clock(monkeypatch, 0.25)
    # A: 80 kbps up (10,000 B/s), 800 kbps down (100,000 B/s), 100 ms latency; B: 8 kbps up (1,000 B/s)
    contexts = {1: node_context(1, **{"uplink-kbps": 80, "downlink-kbps": 800, "latency-ms": 100}),
                2: node_context(2, **{"uplink-kbps": 8, "downlink-kbps": 800, "latency-ms": 100})}
    strategy = _strategy(upload="topk(ratio=0.05,index='fixed')+qsgd(bits=4)", link_profile="none")
    _round(strategy, tiny_model(), contexts, 1)
    stats = strategy.rounds[1]
    by_node = {e["node"]: e for e in stats.links}
    down = {d["node"]: d["download_bytes"] for d in stats.downloads}
    up = {c["node"]: c["upload_bytes"] for c in stats.clients}
    assert by_node[1]["compute_s"] == pytest.approx(0.5) and by_node[2]["compute_s"] == pytest.approx(0.5)
    t_a = down[1] / 100_000 + 0.1 + 0.5 + up[1] / 10_000 + 0.1
    t_b = down[2] / 100_000 + 0.1 + 0.5 + up[2] / 1_000 + 0.1
    assert by_node[1]["total_s"] == pytest.approx(t_a) and by_node[2]["total_s"] == pytest.approx(t_b)
    assert stats.sim_time_s == pytest.approx(max(t_a, t_b)) == pytest.approx(t_b)  # no deadline: the slowest

    # with a 3 s deadline on B's link: B's budget is what 1,000 B/s carries in 3 s - download
    # - compute so far (0.25 s: one clock step from start to after training) - the encode reserve
    # (first round: as long as that, 0.25 s) - 0.1 s upload latency; its upload fits, and the
    # round ends when B does
    contexts = {2: node_context(2, **{"uplink-kbps": 8, "downlink-kbps": 800, "latency-ms": 100, "deadline-s": 3.0})}
    strategy = _strategy(upload="topk(ratio=0.05,index='fixed')+qsgd(bits=4)")
    _fake_clock(monkeypatch, 0.25)
    _round(strategy, tiny_model(), contexts, 1)
    entry = strategy.rounds[1].links[0]
    seen = entry["download_bytes"]
    assert entry["budget"] == int((3.0 - (seen / 100_000 + 0.1) - 0.25 - 0.25 - 0.1) * 1000)
    assert entry["upload_bytes"] <= entry["budget"] and entry["status"] == "ok"
    assert strategy.rounds[1].sim_time_s == pytest.approx(entry["total_s"]) and entry["total_s"] <= 3.0


def test_late_client_dropped_at_the_deadline_round_lasts_the_deadline(monkeypatch):
    # the fake clock makes compute 2 x 5 s = 10 s, and node 2's deadline is 10 s: its budget is
    # already negative (0 B: skipped), and download and upload time make it late
    _fake_clock(monkeypatch, 5.0)
    contexts = {1: node_context(1, **{"uplink-kbps": 8000, "downlink-kbps": 8000, "latency-ms": 1, "byte-cap": 50_000}),
                2: node_context(2, **{"uplink-kbps": 8000, "downlink-kbps": 8000, "latency-ms": 1, "deadline-s": 10.0})}
    strategy = _strategy(budget_fallback="skip")
    model = tiny_model()
    new, _ = _round(strategy, model, contexts, 1)
    stats = strategy.rounds[1]
    status = {c["node"]: c["status"] for c in stats.clients}
    # node 2's budget: the deadline had passed before the upload (0 bytes): skipped, and late
    entry2 = {e["node"]: e for e in stats.links}[2]
    assert entry2["budget"] == 0 and entry2["status"] == "too-small-skipped" and entry2["late"]
    assert status[2] == "late"
    assert status[1] == "ok"
    assert stats.sim_time_s == pytest.approx(max(10.0, {e["node"]: e for e in stats.links}[1]["total_s"]))
    assert links.round_time({1: 3.0, 2: 12.0}, {1: None, 2: 10.0}) == (10.0, [2])
    # the aggregate is node 1's model alone
    assert not torch.equal(new["w"], model["w"])


def test_server_refuses_a_spec_of_another_family_and_the_round_goes_on(monkeypatch):
    _fake_clock(monkeypatch, 0.001)
    contexts = {n: node_context(n, **{"uplink-kbps": 100, "downlink-kbps": 1000, "latency-ms": 20, "byte-cap": 2000})
                for n in (1, 2, 3)}
    strategy = _strategy(link_profile="none")

    def tamper(node, reply):
        if node == 2:  # claims a codec of another family (same payload bytes)
            reply.content.config_records[P.UPLOAD_RECORD][P.SPEC] = "randomk(ratio=0.1)+kbit(bits=4)"

    model = tiny_model()
    new, _ = _round(strategy, model, contexts, 1, tamper=tamper)
    status = {c["node"]: c["status"] for c in strategy.rounds[1].clients}
    assert status[1] == status[3] == "ok"
    assert status[2].startswith("dropped:") and "not of the configured family" in status[2]
    assert "topk" in status[2] and "randomk" in status[2]
    assert not torch.equal(new["w"], model["w"])  # nodes 1 and 3 were aggregated


def test_budget_too_small_skip_and_coarsest(monkeypatch):
    _fake_clock(monkeypatch, 0.001)
    contexts = {1: node_context(1, **{"uplink-kbps": 100, "downlink-kbps": 1000, "latency-ms": 20, "byte-cap": 60}),
                2: node_context(2, **{"uplink-kbps": 100, "downlink-kbps": 1000, "latency-ms": 20, "byte-cap": 2000})}
    strategy = _strategy(budget_fallback="skip")
    model = tiny_model()
    _round(strategy, model, contexts, 1)
    by_node = {e["node"]: e for e in strategy.rounds[1].links}
    assert by_node[1]["status"] == "too-small-skipped"
    assert {c["node"]: c["status"] for c in strategy.rounds[1].clients}[1] == "too-small-skipped"
    # nothing was sent: the whole update waits in the residual
    residual = contexts[1].state.array_records[P.RESIDUAL_STATE].to_torch_state_dict()
    assert float(residual["w"].abs().sum()) > 0
    assert by_node[2]["status"] == "ok"

    contexts = {1: node_context(1, **{"uplink-kbps": 100, "downlink-kbps": 1000, "latency-ms": 20, "byte-cap": 60})}
    strategy = _strategy(budget_fallback="coarsest")
    _round(strategy, model, contexts, 1)
    entry = strategy.rounds[1].links[0]
    assert entry["status"] == "too-small-coarsest" and entry["upload_bytes"] > entry["budget"]  # reported, not silent
    assert strategy.rounds[1].clients[0]["status"] == "ok"  # decoded and aggregated


def test_no_link_behaves_as_before():
    contexts = {n: node_context(n, **{"partition-id": n, "num-partitions": 4}) for n in (1, 2)}
    strategy = _strategy()  # link_profile 'none'
    seen = []
    _round(strategy, tiny_model(), contexts, 1,
           tamper=lambda node, reply: seen.append(set(reply.content.config_records[P.UPLOAD_RECORD])))
    # round 1 brought the full reference: the reply also announces the mod's capabilities, once
    assert seen[0] == {P.PAYLOAD, P.ARRAYS_KEY, P.DELTA_REF, P.TIER, P.REF_VERSION, P.REF_CRC, P.WANT_TIER,
                       P.CAPABILITIES, REPLY_TAG}
    assert strategy.rounds[1].links == [] and strategy.rounds[1].sim_time_s is None


def test_download_tier_follows_the_link():
    assert desired_tier(node_context(1, link="3g-edge"), 3, "2000,50000", links.PRESETS["3g-edge"]) == 0
    assert desired_tier(node_context(1), 3, "2000,50000", links.PRESETS["4g"]) == 1
    assert desired_tier(node_context(1), 3, "2000,50000", links.PRESETS["broadband"]) == 2
    # without thresholds the partition decides, as before
    assert desired_tier(node_context(1, **{"partition-id": 4}), 3, "", links.PRESETS["3g-edge"]) == 1


@pytest.mark.parametrize("kwargs, match", [
    ({"link_profile": "mixed", "aggregation": "sketch", "upload": "sketch(rows=1,cols=400)"}, "different cols"),
    ({"round_deadline_s": 2.0, "upload": "none()"}, "no parameter a byte budget can set"),
    ({"budget_fallback": "drop"}, "budget_fallback='drop'"),
    ({"link_profile": "5g"}, "link-profile '5g' is invalid"),
    ({"round_deadline_s": -1.0}, "round_deadline_s=-1.0"),
])
def test_wrapper_refuses_bad_budget_settings(kwargs, match):
    with pytest.raises(fedcomp.FedcompError, match=match):
        _strategy(**kwargs)


def test_results_checks_from_round_records():
    from fedcomp.simulations.time_to_accuracy import budget_violations, late, series, skipped, time_to

    rounds = [
        {"round": 1, "accuracy": 0.5, "sim_time_s": 2.0, "links": [
            {"node": 1, "upload_bytes": 100, "budget": 100, "status": "ok"},
            {"node": 2, "upload_bytes": 300, "budget": 0, "status": "too-small-skipped", "late": True}]},
        {"round": 2, "accuracy": 0.9, "sim_time_s": 1.5, "links": [
            {"node": 1, "upload_bytes": 101, "budget": 100, "status": "too-small-coarsest"},
            {"node": 2, "upload_bytes": 90, "budget": 100, "status": "ok", "late": True}]},
    ]
    assert budget_violations(rounds) == [(2, 1, 101, 100)]  # coarsest fallbacks count, skipped replies not
    assert skipped(rounds) == 1 and late(rounds) == 2
    assert series(rounds) == ([2.0, 3.5], [50.0, 90.0])
    assert time_to(rounds, 0.9) == 3.5 and time_to(rounds, 0.95) is None
    # measured hidden links: lateness on the true links (link_estimates), not on the estimates clients reported
    rounds[1]["link_estimates"] = [{"node": 1, "true_link": "uplink-kbps=1 downlink-kbps=1", "late": True},
                                   {"node": 2, "true_link": "uplink-kbps=1 downlink-kbps=1", "late": True}]
    assert late(rounds) == 1 + 2
