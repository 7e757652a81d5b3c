"""The wrapper's parts: the run's bytes summary, and a server behaviour added as one new part."""

import logging
import re

import pytest
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvg

from _extra_part import DenyList
from conftest import ModGrid, node_context, tiny_model
from fedcomp.strategies import CompressedStrategy
from fedcomp.strategies.part import Part
from fedcomp.strategies.stats import RoundStats, bytes_summary


def _strategy(n, **kw):
    return CompressedStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n,
                                     min_train_nodes=n), upload="topk(ratio=0.1)+qsgd(bits=4)", **kw)


def _start(strategy, n, rounds=2):
    contexts = {i: node_context(i, **{"partition-id": i - 1, "num-partitions": n}) for i in range(1, n + 1)}
    return strategy.start(grid=ModGrid(contexts), initial_arrays=ArrayRecord(tiny_model()), num_rounds=rounds)


def test_start_ends_with_the_bytes_summary(caplog):
    caplog.set_level(logging.INFO)
    strategy = _strategy(3)
    _start(strategy, 3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fedcomp: 2 rounds |")]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    m = re.fullmatch(r"fedcomp: 2 rounds \| replies: 6 aggregated, 0 dropped, 0 missing \| upload ([\d,]+) B "
                     r"\(([\d.]+)x fewer than dense\) \| download ([\d,]+) B \(([\d.]+)x fewer than dense\)", lines[0])
    assert m, lines[0]
    stats = strategy.rounds.values()
    assert int(m[1].replace(",", "")) == sum(s.upload_bytes for s in stats)
    assert int(m[3].replace(",", "")) == sum(s.download_bytes for s in stats)
    assert float(m[2]) > 1


def test_bytes_summary_counts_dropped_and_missing_replies():
    stats = RoundStats(upload_bytes=10, aggregated=1, clients=[
        {"node": 1, "status": "ok"}, {"node": 2, "status": "late"}, {"node": 3, "status": "no reply: timed out"}])
    line = bytes_summary({1: stats})
    assert line.startswith("fedcomp: 1 rounds | replies: 1 aggregated, 1 dropped, 1 missing | upload 10 B "
                           "(no dense reference) | download 0 B"), line


def test_a_new_part_drops_replies_from_a_deny_list(caplog):
    caplog.set_level(logging.INFO)
    deny = DenyList({2})
    strategy = _strategy(3, parts=[deny])
    assert strategy.parts[-1] is deny and deny.host is strategy
    _start(strategy, 3)
    for stats in strategy.rounds.values():
        status = {c["node"]: c["status"] for c in stats.clients}
        assert status == {1: "ok", 2: "dropped: node 2 is on the deny-list", 3: "ok"}, status
        assert stats.aggregated == 2
    assert deny.dropped == {1: 1, 2: 1}
    assert "deny-list: round 2 dropped 1 replies" in [r.getMessage() for r in caplog.records]


def test_parts_are_called_in_order_with_every_hook():
    calls = []

    class Tracer(Part):
        def __getattribute__(self, name):
            if name in ("on_layout", "on_train_message", "observe", "check", "on_round_end", "on_aggregated",
                        "on_run_end"):
                calls.append(name)
            return object.__getattribute__(self, name)

    strategy = _strategy(2, parts=[Tracer()])
    _start(strategy, 2, rounds=1)
    assert calls == ["on_layout", "on_train_message", "on_train_message", "observe", "check", "observe", "check",
                     "on_round_end", "on_aggregated", "on_run_end"]


def test_parts_is_keyword_only_and_settings_stay_checked():
    with pytest.raises(TypeError, match="unknown settings"):
        _strategy(2, part=[DenyList({1})])


def test_seeded_start_on_another_model_names_the_cause():
    """A node whose seeded round-0 model is not the server's initial model asks for a resync, and the
    reason says what to fix (the server's initial_arrays), not only the CRC values."""
    from flwr.app import ConfigRecord

    from conftest import FakeGrid, shift_trainer
    from fedcomp import protocol as P
    from fedcomp.clients import make_compression_mod

    strategy = _strategy(2, seeded_init=True, download="topk(ratio=0.1)+kbit(bits=8)")
    mod = make_compression_mod(initial_model=lambda context: tiny_model(seed=1))  # the server starts from seed 0
    messages = strategy.configure_train(1, ArrayRecord(tiny_model(seed=0)), ConfigRecord({}), FakeGrid([1, 2]))
    for msg in messages:
        node = msg.metadata.dst_node_id
        assert msg.content.config_records[P.DOWNLOAD_RECORD][P.MODE] == "chain"
        reply = mod(msg, node_context(node), shift_trainer(node, 1))
        reason = str(reply.content.config_records[P.UPLOAD_RECORD][P.RESYNC])
        assert "not the chain's base" in reason and "initial_arrays" in reason, reason


def test_a_node_whose_state_was_lost_is_told_so_not_blamed_on_the_seed():
    """A node that trained in rounds 1-2 but comes to round 3 with an empty Context.state (a lost
    state push) resyncs, and the reason says its state was empty, not that the seed is wrong."""
    from flwr.app import ConfigRecord

    from conftest import FakeGrid, shift_trainer
    from fedcomp import protocol as P
    from fedcomp.clients import make_compression_mod

    strategy = _strategy(2, seeded_init=True, download="topk(ratio=0.1)+kbit(bits=8)")
    mod = make_compression_mod(initial_model=lambda context: tiny_model(seed=0))
    contexts = {n: node_context(n) for n in (1, 2)}
    model = ArrayRecord(tiny_model(seed=0))
    for rnd in (1, 2, 3):
        if rnd == 3:
            contexts = {n: node_context(n) for n in (1, 2)}  # the state of round 2 did not persist
        messages = list(strategy.configure_train(rnd, model, ConfigRecord({}), FakeGrid([1, 2])))
        replies = [mod(m, contexts[m.metadata.dst_node_id], shift_trainer(m.metadata.dst_node_id, rnd))
                   for m in messages]
        if rnd < 3:
            assert all(P.RESYNC not in r.content.config_records[P.UPLOAD_RECORD] for r in replies)
            model, _ = strategy.aggregate_train(rnd, replies)
    reasons = [str(r.content.config_records[P.UPLOAD_RECORD].get(P.RESYNC, "")) for r in replies]
    assert reasons and all("state was empty" in x and "initial_arrays" not in x for x in reasons), reasons
