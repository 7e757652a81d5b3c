"""The one experiment harness: Flower's round loop in process through the project's ClientApp,
its mods and the wrapper (small runs on digits)."""

from __future__ import annotations

import pytest

from fedcomp import protocol as P
from fedcomp.simulations import harness

TOPK = "topk(ratio=0.01)+qsgd(bits=4)"


BYTES = ("upload_bytes", "download_bytes", "upload_bytes_dense", "download_bytes_dense")


def _rows(history):
    return [{k: v for k, v in r.items() if k not in BYTES} for r in history.rows]


def _same_bytes(a, b, per_message=8):
    """Equal up to the wrapper's random reply tokens (``secrets``: a few deflated bytes per message)."""
    return all(abs(x[k] - y[k]) <= per_message * x["replies"] for x, y in zip(a.rows, b.rows) for k in BYTES)


def test_same_seed_same_history_and_another_seed_differs():
    a = harness.run(TOPK, rounds=2, clients=3, download="none()")
    b = harness.run(TOPK, rounds=2, clients=3, download="none()")
    c = harness.run(TOPK, rounds=2, clients=3, download="none()", seed=1)
    assert _rows(a) == _rows(b) and _same_bytes(a, b)
    assert a.error is None and len(a.rows) == 2 and a.initial["accuracy"] > 0
    assert _rows(a) != _rows(c)


def test_dense_baseline_against_compressed_bytes():
    dense = harness.run(harness.DENSE, rounds=2, clients=3)
    comp = harness.run(TOPK, rounds=2, clients=3, download="none()")
    assert dense.upload == "dense" and dense.stats == {}
    assert comp.upload.startswith("topk(") and comp.aggregation == "decode"
    for d, c in zip(dense.rows, comp.rows):
        assert d["replies"] == c["replies"] == c["aggregated"] == 3
        assert c["upload_bytes"] * 50 < d["upload_bytes"]
        # the bytes the grid saw are the bytes the wrapper counted; its dense reference is the baseline's size
        stats = comp.stats[c["round"]]
        assert c["upload_bytes"] == stats.upload_bytes and c["download_bytes"] == stats.download_bytes
        assert c["upload_bytes_dense"] == pytest.approx(d["upload_bytes"], rel=0.01)
    assert comp.upload_bytes == sum(s.upload_bytes for s in comp.stats.values())


@pytest.mark.parametrize("strategy", ["FedMedian", "QFedAvg"])
def test_collected_replies_count_the_dense_model_once(strategy):
    # strategies the wrapper hands decoded models (collect mode) have the same dense reference as the
    # plain mean: the baseline's message size, not the model twice
    dense = harness.run(harness.DENSE, strategy=strategy, rounds=1, clients=3, evaluate=False)
    comp = harness.run("qsgd(bits=4)", strategy=strategy, rounds=1, clients=3, download="none()",
                       aggregation="decode", evaluate=False)
    assert comp.stats[1].aggregated == 3
    assert comp.rows[0]["upload_bytes_dense"] == pytest.approx(dense.rows[0]["upload_bytes"], rel=0.01)


def test_a_reply_the_wrapper_drops_shows_in_its_stats():
    def garble(msg, context, call_next):  # node 101 sends a payload no decoder accepts
        reply = call_next(msg, context)
        if context.node_id == 101 and reply.has_content() and P.UPLOAD_RECORD in reply.content.config_records:
            reply.content.config_records[P.UPLOAD_RECORD][P.PAYLOAD] = b"\x00garbage"
        return reply

    h = harness.run(TOPK, rounds=1, clients=3, download="none()", mods=[garble])
    (row,) = h.rows
    assert row["replies"] == 3 and row["aggregated"] == 2
    status = {c["node"]: c["status"] for c in h.stats[1].clients}
    assert status[100] == status[102] == "ok" and status[101].startswith("dropped")


def test_a_raising_client_app_is_an_error_reply_and_the_run_goes_on():
    from fedcomp.simulations import client_app

    def app(msg, context):
        if context.node_id == 100:
            raise RuntimeError("out of memory")
        return client_app.app(msg, context)

    h = harness.run(TOPK, rounds=1, clients=3, download="none()", app=app)
    assert h.rows[0]["aggregated"] == 2 and h.error is None


def test_fraction_samples_nodes_and_the_mod_keeps_each_nodes_state():
    seen = []

    def watch(msg, context, call_next):
        seen.append((context.node_id, len(context.state.config_records) + len(context.state.array_records)))
        return call_next(msg, context)

    h = harness.run(TOPK, rounds=3, clients=4, fraction=0.5, download="none()", mods=[watch])
    assert [r["replies"] for r in h.rows] == [2, 2, 2]
    first = {}
    for node, held in seen:  # a node's second visit finds what the mod stored in its Context on the first
        if node in first:
            assert held > 0
        first.setdefault(node, held)


def test_observe_adds_to_the_rows_and_auto_records_its_strength():
    h = harness.run("topk(ratio=auto)+qsgd(bits=4)", rounds=2, clients=2, download="none()",
                    observe=lambda rnd, state: {"numel": sum(v.numel() for v in state.values())})
    assert all(r["numel"] > 1000 for r in h.rows)
    assert all("upload_spec" in r and "strength" in r for r in h.rows)


def test_dense_refuses_wrapper_settings():
    with pytest.raises(ValueError, match="dense baseline"):
        harness.run(harness.DENSE, rounds=1, clients=2, download="none()")


def test_delta_study_runs_the_real_mod_and_wrapper():
    """delta_study's error of delta coding, through InProcessGrid and CompressedStrategy(delta=...):
    the figures of docs/how-to/delta-coding.md."""
    from fedcomp.simulations.delta_study import consecutive_cosines, delta_error

    errors = [delta_error("kbit(bits=2,block=64)", beta, True) for beta in (0.0, 1.0)]
    assert errors == [pytest.approx(0.040, abs=5e-4), pytest.approx(0.009, abs=5e-4)]
    ((r, cos),) = consecutive_cosines(rounds=5, clients=2)
    assert r == 5 and 0 < cos < 1


def test_hidden_links_run_the_servers_measured_path():
    """run config link-profile='measured:mixed': MeasuredLinkStrategy around the wrapper, netsim_mod
    playing the links, as the project's ServerApp runs it; link_study summarizes the rows."""
    from fedcomp.simulations.link_study import summarize_estimates

    h = harness.run("topk(ratio=0.01,index='fixed')+qsgd(bits=4)", rounds=2, clients=2, download="none()",
                    round_deadline_s=12.0, run_config={"link-profile": "measured:mixed"})
    assert h.error is None
    assert all(len(r["link_estimates"]) == 2 and r["sim_time_s"] > 0 for r in h.rows)
    assert all("true_link" in e and e["budget"] >= 1 for r in h.rows for e in r["link_estimates"])
    summary = summarize_estimates(h.rows)
    assert summary["client_rounds"] == 4 and 0 <= summary["uploads_on_time"] <= 1
