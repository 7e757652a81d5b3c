"""Measured-link budgets in Flower: MeasuredLinkStrategy's observer, the estimate in the broadcast,
compression_mod budgeting from it, and the simulated network (netsim_mod) hiding the true link."""

from __future__ import annotations

import dataclasses

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from conftest import ModGrid, tiny_model
from fedcomp import links
from fedcomp import protocol as P
from fedcomp.adapt import FAST_KBPS, AdaptError, MeasuredBudgets
from fedcomp.simulations.netsim import netsim_mod
from fedcomp.strategies.measured import MeasuredLinkStrategy
from fedcomp.strategies.wrapper import CompressedStrategy

SPEC = "topk(ratio=0.1,index='fixed')+qsgd(bits=4)"
DEADLINE = 5.0


def _ctx(node: int, profile: str = "measured:mixed", **node_config) -> Context:
    return Context(run_id=1, node_id=node, node_config={"partition-id": node, "num-partitions": 10, **node_config},
                   state=RecordDict(), run_config={"link-profile": profile, "seed": 0})


def _run(contexts, rounds=6, mods=(netsim_mod,), streaming=True, deadline=DEADLINE):
    n = len(contexts)
    inner = CompressedStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n,
                                      min_train_nodes=n), upload=SPEC, download="none()", round_deadline_s=deadline,
                               streaming=streaming)
    strategy = MeasuredLinkStrategy(inner, deadline)
    grid = ModGrid(contexts, mods)
    strategy.start(grid, ArrayRecord(tiny_model(rows=128, cols=100)), num_rounds=rounds,
                   evaluate_fn=lambda r, a: MetricRecord({"accuracy": 0.5}))
    return strategy, grid


def test_estimates_reach_clients_and_budgets_follow_the_hidden_link():
    contexts = {i: _ctx(i) for i in (0, 6)}  # 'mixed': partition 0 is 4g, 6 is 3g-edge
    strategy, grid = _run(contexts)
    # every train message carried an estimate; the clients were never told the profile
    assert all(links.ESTIMATE in rec and rec[P.LINK_PROFILE] == links.NONE for _, _, rec in grid.sent)
    first = [links.link_from_mapping(dict(kv.split("=", 1) for kv in rec[links.ESTIMATE].split()))
             for _, r, rec in grid.sent if r == 1]
    assert all(f.byte_cap == 4096 and f.uplink_kbps == FAST_KBPS for f in first)  # first contact: a probe
    rows = strategy.estimates
    assert {(e["node"], e["round"]) for e in rows} == {(n, r) for n in (0, 6) for r in range(1, 7)}
    for e in rows:
        assert e["status"] == "ok" and e["budget"] is not None and e["upload_bytes"] <= e["budget"]
        assert "true_link" in e and e["late"] is False  # the true deadline met every round
    # the estimate converges to the hidden link: 3g-edge uplink 200 kbps, 4g 5000 kbps
    last = {e["node"]: e for e in rows if e["round"] == 6}
    assert last[6]["est_up_kbps"] == pytest.approx(200, rel=0.1)
    assert last[0]["est_up_kbps"] == pytest.approx(5000, rel=0.1)
    assert last[6]["est_up_latency_s"] == pytest.approx(0.3, rel=0.1)
    # ...and so do the budgets it gives (same compute as the declared link's), up to slow start's cap:
    # 4x the node's largest upload so far (a budget never jumps to a size whose encode was never timed)
    for e in rows:
        if e["round"] < 5:
            continue
        cap = 4 * max(x["upload_bytes"] for x in rows if x["node"] == e["node"] and x["round"] < e["round"])
        assert abs(e["error"]) <= 0.1 or (e["budget"] <= cap and e["error"] < 0), (e["round"], e["error"], cap)
    assert any(abs(e["error"]) <= 0.1 for e in rows if e["round"] >= 5)
    # the simulated network's record never reached the wrapped strategy's byte counts
    for r in range(1, 7):
        assert strategy.rounds[r].upload_bytes == sum(e["upload_bytes"] for e in strategy.estimates_of(r))
        assert strategy.rounds[r].download_bytes == sum(e["download_bytes"] for e in strategy.estimates_of(r))
        assert strategy.true_round_time(r) <= DEADLINE


def test_a_declared_link_wins_and_no_link_stays_unbudgeted():
    contexts = {1: _ctx(1, profile="measured", **{"uplink-kbps": 300, "downlink-kbps": 1000, "latency-ms": 100}),
                2: _ctx(2, profile="measured")}
    strategy, grid = _run(contexts, rounds=2, streaming=False)  # ObservingGrid.send_and_receive times them too
    by_node = {(e["node"], e["round"]): e for e in strategy.estimates}
    for r in (1, 2):  # node 1 budgets from its own link; the server cannot split its round trip
        assert by_node[(1, r)]["status"] == "declared link" and by_node[(1, r)]["budget"] is not None
        assert "est_up_kbps" not in by_node[(1, r)]
    # node 2 declares nothing and the server's estimate is its link (no netsim here: no truth)
    assert by_node[(2, 2)]["status"] == "ok" and "true_link" not in by_node[(2, 2)]
    # the wall-clock observations were taken (received-at reported by the mod)
    assert by_node[(2, 1)]["observed_up_s"] > 0 and by_node[(2, 1)]["observed_down_s"] > 0
    # in-process, the "ClientApp" process (this one) started long before the push: no split
    assert "startup_s" not in by_node[(2, 1)] and "startup_s" not in by_node[(2, 2)]


def test_without_an_estimate_the_mod_is_unbudgeted():
    inner = CompressedStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1,
                                      min_train_nodes=1), upload=SPEC, download="none()")
    grid = ModGrid({3: _ctx(3, profile="none")}, mods=())
    inner.start(grid, ArrayRecord(tiny_model()), num_rounds=1, evaluate_fn=lambda r, a: MetricRecord({"accuracy": 0.5}))
    assert not inner.rounds[1].links  # no link reported, no budget


def test_link_folds_the_margins_into_what_the_client_budgets():
    mb = MeasuredBudgets(DEADLINE)
    truth = links.PRESETS["4g"]
    for size in (4096, 16384, 65536, 60000):
        mb.observe(5, up_bytes=size, up_s=truth.upload_s(size), down_bytes=20000, down_s=truth.download_s(20000))
    link = mb.link(5)
    # latency fitted, the deadline holds; slow start's cap stays: 4x the largest upload seen
    assert link.byte_cap == 4 * 65536 and link.deadline_s == DEADLINE
    assert mb.budget(5, 9, download_bytes=20000, compute_s=0.4) == 4 * 65536
    # without the cap, the client's budget from the sent link is MeasuredBudgets'
    # on the same compute (the sent link predicts the download with the upload's latency, the budget
    # with a lower-bound bandwidth: within 1%)
    client = links.upload_budget(dataclasses.replace(link, byte_cap=None), 20000, 0.4)
    mb.growth = 1e9
    assert client == pytest.approx(mb.budget(5, 9, download_bytes=20000, compute_s=0.4), rel=1e-2)
    # and is close to what the declared link would give
    assert client == pytest.approx(links.upload_budget(links.with_deadline(truth, DEADLINE), 20000, 0.4), rel=0.02)


def test_refuses_sketch_aggregation():
    inner = CompressedStrategy(FedAvg(), upload="sketch(cols=500)", aggregation="sketch")
    with pytest.raises(AdaptError, match="aggregation='decode'"):
        MeasuredLinkStrategy(inner, DEADLINE)


def test_measured_profiles_and_the_server_app_switch():
    from fedcomp.simulations.server_app import validate_run_config
    import tomllib
    from pathlib import Path

    assert links.measured_profile("measured") == links.NONE and links.measured_profile("measured:4g") == "4g"
    assert links.measured_profile("mixed") is None
    for bad in ("measured:none", "measured:measured:mixed", "measured:5g"):
        with pytest.raises(links.LinkError, match="invalid"):
            links.check_profile(bad)
    assert links.link_for(0, 2, "measured:4g") is None  # clients never read the hidden profile
    base = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    with pytest.raises(ValueError, match="round-deadline-s > 0"):
        validate_run_config({**base, "link-profile": "measured:mixed", "upload": SPEC, "round-deadline-s": 0.0})
    with pytest.raises(ValueError, match="explicit upload codec"):
        validate_run_config({**base, "link-profile": "measured", "round-deadline-s": 1.5})
    validate_run_config({**base, "link-profile": "measured:mixed", "round-deadline-s": 1.5, "upload": SPEC})


def test_link_study_summarizes_a_flower_run(tmp_path):
    import json

    from fedcomp.simulations.link_study import from_results

    row = lambda node, rnd, err, late=False, declared=1000: {  # noqa: E731
        "node": node, "round": rnd, "true_link": "uplink-kbps=200 downlink-kbps=1000", "error": err, "late": late,
        "declared_budget": declared}
    rounds = [{"round": r, "link_estimates": [row(1, r, -0.5 if r < 3 else 0.05), row(2, r, -0.2 if r < 5 else 0.0,
                                                                                     late=r == 2)]}
              for r in range(1, 7)]
    rounds[0]["link_estimates"].append(row(3, 1, None, late=True, declared=0))  # no budget to compare: left out
    (tmp_path / "results.json").write_text(json.dumps({"rounds": rounds}))
    s = from_results(str(tmp_path))
    assert s["rounds_to_within_10pct"] == {1: 3, 2: 5} and s["within_10pct_from_round_5"] == 1.0
    assert s["client_rounds"] == 13 and s["compared"] == 12 and s["uploads_on_time"] == pytest.approx(11 / 13)


def test_a_latency_bound_broadcast_never_reads_as_a_fast_downlink():
    # 3g-edge: 11 kB broadcasts take 0.088 s + 0.3 s latency; the upload latency fit came out 10% high
    mb = MeasuredBudgets(DEADLINE)
    for size in (4096, 16384, 65536):
        mb.observe(7, up_bytes=size, up_s=0.33 + size * 8 / 200e3, down_bytes=11000, down_s=0.3 + 11000 * 8 / 1e6)
    lower = 11000 * 8 / (0.3 + 11000 * 8 / 1e6) / 1000  # the bandwidth with no latency at all
    link = mb.link(7)
    assert lower < link.downlink_kbps <= 2 * lower < 2000  # a 2000 kbps tier threshold is not crossed


@pytest.mark.parametrize("streaming", [True, False])
def test_a_reply_late_on_its_hidden_link_is_not_aggregated(streaming):
    """First contact, 0.8 s deadline: the 3g-edge node's transfers alone (the full model down,
    the probe up, 0.3 s latency each way) take ~1.2 s on its simulated link, the 4g node's 0.16 s.
    The deadline would have dropped the first, so the observer hands the wrapped strategy an error
    reply instead: recorded, not aggregated."""
    contexts = {i: _ctx(i) for i in (0, 6)}  # 'mixed': partition 0 is 4g, 6 is 3g-edge
    strategy, _ = _run(contexts, rounds=1, streaming=streaming, deadline=0.8)
    late = [e for e in strategy.estimates if e["late"]]
    assert [(e["node"], e["round"]) for e in late] == [(6, 1)]
    assert late[0]["true_total_s"] - late[0]["compute_s"] > 1.0  # late by the link, whatever the compute
    statuses = {c["node"]: c["status"] for c in strategy.rounds[1].clients}
    assert statuses[6].startswith("error: late: ") and "deadline" in statuses[6] and statuses[0] == "ok"
    assert strategy.rounds[1].aggregated == 1


def _observed(started_at, *, pushed_at=100.0, received_at=130.0, arrival=140.0, compute_s=4.0):
    """The observer's record of one reply: pushed at ``pushed_at``, its mod's clock at ``received_at``,
    its process started at ``started_at`` (None: not reported), back at ``arrival``."""
    from flwr.app import Message

    from fedcomp.strategies.measured import _Sent

    strategy = MeasuredLinkStrategy(CompressedStrategy(FedAvg(), upload=SPEC, download="none()"), 20.0)
    record = {P.COMPUTE_S: compute_s, P.BUDGET: 1300, links.RECEIVED_AT: received_at}
    if started_at is not None:
        record[links.STARTED_AT] = started_at
    reply = Message(RecordDict({P.UPLOAD_RECORD: ConfigRecord(record)}), dst_node_id=0, message_type="train")
    sent = _Sent(1, strategy.budgets.link(4), 500_000, pushed_at)
    strategy._record(reply, arrival, 4, sent)
    return strategy.estimates[-1]


def test_a_process_start_after_the_push_splits_the_download_it_does_not_end():
    """A deployment's ClientApp process (one per message) started 8 s after the push and its mod got
    the broadcast 22 s later: the record says where the time went; the download stays push ->
    received-at (Flower 1.39 starts the process before the message's arrays are pulled: the process
    start is no download end), the upload from received-at."""
    e = _observed(108.0)
    assert e["process_start_s"] == pytest.approx(8.0) and e["startup_s"] == pytest.approx(22.0)
    assert e["observed_down_s"] == pytest.approx(30.0)
    assert e["observed_up_s"] == pytest.approx(140.0 - 130.0 - 4.0)
    assert e["est_down_kbps"] == pytest.approx(500_000 * 8 / 30.0 / 1000)
    assert _observed(130.0)["startup_s"] == pytest.approx(0.0)  # at received-at itself: still inside


@pytest.mark.parametrize("started_at", [None, 50.0, 100.0, 131.0])
def test_a_process_start_outside_push_to_received_is_ignored(started_at):
    """Not reported (no /proc), before the push (simulation: one process for many messages), at the
    push itself or after received-at (a clock that cannot be right): nothing split, same times."""
    e = _observed(started_at)
    assert "startup_s" not in e and "process_start_s" not in e
    assert e["observed_down_s"] == pytest.approx(30.0) and e["observed_up_s"] == pytest.approx(6.0)


def test_the_mod_reports_its_process_start():
    import time

    from fedcomp.clients.mod import process_started_at

    started = process_started_at()
    if started is None:
        pytest.skip("no /proc here: the mod reports no process start")
    assert 0 < started <= time.time()
    seen = []

    def capture(msg, context, call_next):
        reply = call_next(msg, context)
        seen.append(dict(reply.content.config_records[P.UPLOAD_RECORD]))
        return reply

    _run({2: _ctx(2, profile="measured")}, rounds=2, mods=(capture,))
    assert len(seen) == 2 and all(r[links.STARTED_AT] == pytest.approx(started, abs=0.05) for r in seen)
    assert all(r[links.STARTED_AT] < r[links.RECEIVED_AT] for r in seen)


def test_slow_start_keeps_probing_when_the_download_alone_passes_the_deadline():
    """Downloads measured at 25 s against a 20 s deadline (the ClientApp's start-up in them), 1.3 kB
    uploads: a budget of 0 would keep the upload sizes equal and its latency unfitted for good.
    Instead the probe grows (growth x the largest seen), on the server's budget and on the link sent."""
    mb = MeasuredBudgets(20.0)
    for _ in range(3):
        mb.observe(4, up_bytes=1300, up_s=3.0, down_bytes=500_000, down_s=25.0)
    assert mb.budget(4, 4, download_bytes=500_000, compute_s=2.0) == 4 * 1300
    link = mb.link(4, download_bytes=500_000, compute_s=2.0)
    assert link.byte_cap == 4 * 1300 and link.deadline_s is None
    assert links.upload_budget(link, 500_000, 2.0) == 4 * 1300  # what the client budgets from it
    from fedcomp.clients.mod import estimated_link  # ...which keeps it without the run's deadline
    assert estimated_link({links.ESTIMATE: link.describe(), P.DEADLINE: 20.0}) == link
    # without the broadcast's size the server cannot tell: the deadline stays (the client then budgets 0)
    assert mb.link(4).deadline_s == 20.0
    # a download that leaves time: the slow-start cap and the deadline both bound, as before
    fast = MeasuredBudgets(20.0)
    for _ in range(3):
        fast.observe(4, up_bytes=1300, up_s=3.0, down_bytes=500_000, down_s=2.0)
    assert fast.link(4, download_bytes=500_000, compute_s=2.0).deadline_s == 20.0
    assert fast.budget(4, 4, download_bytes=500_000, compute_s=2.0) == 4 * 1300
    # once the upload latency is fitted, an estimate past the deadline budgets 1 byte (no probe)
    for size in (5200, 20800):
        mb.observe(4, up_bytes=size, up_s=3.0 + size * 8 / 10e3, down_bytes=500_000, down_s=25.0)
    assert mb.link(4, download_bytes=500_000, compute_s=2.0).deadline_s == 20.0
    assert mb.budget(4, 5, download_bytes=500_000, compute_s=2.0) == 1
