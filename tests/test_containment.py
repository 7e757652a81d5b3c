"""A server-side encode that fails (a codec bug) costs that round's compression, not the run: the
download tier's step, the evaluate broadcast and FetchSGD's coupled step each fall back to the
full model (or the uncompressed step) for the affected nodes, with the reason logged."""

from __future__ import annotations

import logging

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import FedAvg

from conftest import FakeGrid, node_context, run_round, shift_trainer, tiny_model
from fedcomp.clients.mod import compression_mod
from fedcomp.codec import Codec
from fedcomp.strategies.wrapper import CompressedStrategy


def _fail_next_encode(monkeypatch, count=1):
    """Codec.encode raises IndexError for the next ``count`` calls, then works again."""
    real = Codec.encode
    left = [count]

    def encode(self, *args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise IndexError("index 4100 is out of bounds for dimension 0 with size 4096 (injected)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Codec, "encode", encode)
    return left


def _fedavg(n=3, **kw):
    return FedAvg(fraction_train=1.0, min_available_nodes=n, min_train_nodes=n, **kw)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_failed_download_tier_encode_sends_the_full_model_and_the_run_goes_on(monkeypatch, caplog):
    strategy = CompressedStrategy(_fedavg(), upload="topk(ratio=0.2)+qsgd(bits=8)", download="topk(ratio=0.5)+kbit(bits=8)")
    contexts = {n: node_context(n) for n in (1, 2, 3)}
    model = tiny_model()
    model, _, _ = run_round(strategy, model, contexts, 1)
    model, _, _ = run_round(strategy, model, contexts, 2)
    assert {d["mode"] for d in strategy.rounds[2].downloads} == {"chain"}
    left = _fail_next_encode(monkeypatch)
    caplog.set_level(logging.WARNING)
    new, replies, _ = run_round(strategy, model, contexts, 3)
    assert left[0] == 0  # the tier's encode was the one that failed
    assert any("download tier 0 could not encode its step to round 3" in m and "IndexError" in m
               and "full model" in m for m in _warnings(caplog))
    assert {d["mode"] for d in strategy.rounds[3].downloads} == {"full"}
    assert {c["status"] for c in strategy.rounds[3].clients} == {"ok"}
    assert not torch.equal(new["w"], model["w"])
    new2, _, _ = run_round(strategy, new, contexts, 4)  # compressed again from there
    assert {d["mode"] for d in strategy.rounds[4].downloads} == {"chain"}
    assert {c["status"] for c in strategy.rounds[4].clients} == {"ok"}


def test_failed_evaluate_broadcast_encode_sends_the_full_model(monkeypatch, caplog):
    strategy = CompressedStrategy(_fedavg(fraction_evaluate=1.0, min_evaluate_nodes=3),
                                  upload="topk(ratio=0.2)+qsgd(bits=8)", download="topk(ratio=0.5)+kbit(bits=8)")
    contexts = {n: node_context(n) for n in (1, 2, 3)}
    model, _, _ = run_round(strategy, tiny_model(), contexts, 1)  # the mods announce evaluate broadcasts
    left = _fail_next_encode(monkeypatch)
    caplog.set_level(logging.WARNING)
    messages = list(strategy.configure_evaluate(1, ArrayRecord(model), ConfigRecord({}), FakeGrid([1, 2, 3])))
    assert left[0] == 0 and len(messages) == 3
    assert any("could not encode its step to round 2" in m and "IndexError" in m for m in _warnings(caplog))
    assert {c["mode"] for c in strategy.rounds[1].evaluate_clients} == {"full"}
    for msg in messages:  # the clients take the full reference and evaluate
        node = msg.metadata.dst_node_id
        seen = []

        def evaluator(m, c):
            seen.append(m.content.array_records["arrays"].to_torch_state_dict())
            from flwr.app import Message, MetricRecord, RecordDict
            return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1, "acc": 0.5})}), reply_to=m)

        reply = compression_mod(msg, contexts[node], evaluator)
        assert not reply.has_error() and torch.equal(seen[0]["w"], model["w"])
    new, _, _ = run_round(strategy, model, contexts, 2)  # training goes on from the evaluated reference
    assert {c["status"] for c in strategy.rounds[2].clients} == {"ok"}


def test_failed_sketch_step_encode_applies_the_step_uncompressed(monkeypatch, caplog):
    strategy = CompressedStrategy(FedAvg(fraction_train=0.5, min_available_nodes=4, min_train_nodes=2),
                                  upload="sketch(rows=1,cols=400,ratio=0.05)+qsgd(bits=8)", seeded_init=False)
    assert strategy.aggregation == "sketch"
    contexts = {n: node_context(n) for n in (1, 2, 3, 4)}
    model = tiny_model()
    model, _, _ = run_round(strategy, model, contexts, 1)
    assert strategy.config.coupled_download
    # round 2, by hand: the clients' encodes work, the server's coupled step encode fails
    grid = FakeGrid([1, 2, 3, 4])
    messages = list(strategy.configure_train(2, ArrayRecord(model), ConfigRecord({}), grid))
    replies = [compression_mod(m, contexts[m.metadata.dst_node_id], shift_trainer(m.metadata.dst_node_id, 2))
               for m in messages]
    left = _fail_next_encode(monkeypatch)
    caplog.set_level(logging.WARNING)
    arrays, _ = strategy.aggregate_train(2, replies)
    assert left[0] == 0 and arrays is not None
    assert any("coupled download step failed" in m and "IndexError" in m for m in _warnings(caplog))
    new = arrays.to_torch_state_dict()
    assert not torch.equal(new["w"], model["w"]) and all(torch.isfinite(t.float()).all() for t in new.values())
    for r in (3, 4):  # the run goes on; tier 0 restarted from the global model
        new, _, _ = run_round(strategy, new, contexts, r)
        assert {c["status"] for c in strategy.rounds[r].clients} == {"ok"}, strategy.rounds[r].clients
    assert strategy.tiers[0].history  # compressed steps again
