"""Compressed tiered broadcasts: server-side error feedback, bit-exact references, catch-up, resync."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

import fedcomp
from fedcomp.clients.mod import compression_mod
from conftest import FakeGrid
from fedcomp import protocol as P
from fedcomp.broadcast import ResyncNeeded, Tier, apply_plan, parse_thresholds, parse_tiers, reference_crc
from fedcomp.strategies.wrapper import CompressedStrategy

TIERS = "topk(ratio=0.05)+twobit(threshold=0.5) | topk(ratio=0.2)+kbit(bits=4) | kbit(bits=8)"


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(48, 40, generator=g), "b": torch.randn(48, generator=g),
            "h": torch.randn(40, generator=g).half(), "steps": torch.tensor(3)}


def _trainer(node: int, server_round: int):
    """A ClientApp stand-in: moves the received model by a node- and round-dependent step."""

    def app(msg: Message, context: Context) -> Message:
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        g = torch.Generator().manual_seed(1000 * node + server_round)
        trained = {k: (v + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v + 1
                   for k, v in received.items()}
        content = RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 10 + node})})
        return Message(content, reply_to=msg)

    return app


def _context(node, tier=None):
    config = {} if tier is None else {"download-tier": tier}
    return Context(run_id=1, node_id=node, node_config=config, state=RecordDict(), run_config={})


def _held(context):
    return context.state.array_records[P.REF_STATE].to_torch_state_dict()


def _round(strategy, model, contexts, server_round, present, lose_reply=()):
    """One round with only the ``present`` nodes connected; replies of ``lose_reply`` never arrive."""
    grid = FakeGrid(sorted(present))
    messages = list(strategy.configure_train(server_round, ArrayRecord(model), ConfigRecord({}), grid))
    replies = []
    for msg in messages:
        node = msg.metadata.dst_node_id
        reply = compression_mod(msg, contexts[node], _trainer(node, server_round))
        if node not in lose_reply:
            replies.append(reply)
    arrays, _ = strategy.aggregate_train(server_round, replies)
    return (arrays.to_torch_state_dict() if arrays is not None else model), messages


def _assert_bit_exact(strategy, contexts, nodes):
    for node in nodes:
        info = contexts[node].state.config_records[P.REF_INFO_STATE]
        tier = strategy.tiers[int(info[P.TIER])]
        held = _held(contexts[node])
        assert int(info[P.REF_VERSION]) == tier.version
        for name, ref in tier.reference.items():
            assert held[name].dtype == ref.dtype
            assert torch.equal(held[name], ref), (node, name)  # bit for bit, not approximately


def _strategy(**kwargs):
    return CompressedStrategy(FedAvg(fraction_train=1.0, min_available_nodes=1, min_train_nodes=1),
                              upload="topk(ratio=0.1)+kbit(bits=8)", download=TIERS, **kwargs)


def test_references_bit_exact_every_round_every_tier_with_missed_rounds():
    strategy = _strategy()
    contexts = {node: _context(node, tier=node % 3) for node in range(1, 7)}
    model = _model()
    schedule = [{1, 2, 3, 4, 5, 6}, {1, 2, 3}, {1, 2, 3}, {4, 5}, {1, 2, 3, 4, 5, 6}, {6}, {2, 3, 6}, {1, 4, 5, 6}]
    modes = []
    for r, present in enumerate(schedule, start=1):
        model, _ = _round(strategy, model, contexts, r, present)
        _assert_bit_exact(strategy, contexts, present)
        modes += [(d["node"], d["mode"], d["steps"]) for d in strategy.rounds[r].downloads]
        assert all(c["status"] == "ok" for c in strategy.rounds[r].clients), strategy.rounds[r].clients
    # first contact is full, everything after it a chain; nodes that sat out replayed several steps
    assert all(mode == "full" for node, mode, _ in modes[:6])
    assert all(mode == "chain" for _, mode, _ in modes[6:])
    assert max(steps for _, mode, steps in modes if mode == "chain") >= 3
    # the last model the server holds is what clients train from, up to compression error
    assert set(strategy.rounds[8].download_bytes_by_tier) == {0, 1, 2}


def test_one_encode_per_tier_per_round_not_per_client():
    strategy = _strategy()
    contexts = {node: _context(node, tier=0 if node < 5 else 2) for node in range(1, 9)}
    model = _model()
    for r in range(1, 4):
        model, _ = _round(strategy, model, contexts, r, set(contexts))
        # round 1: every node is new (tier 0, full model); then tiers 0 and 2 have clients, tier 1 none
        assert strategy.rounds[r].encodes == (1 if r == 1 else 2)
    assert [t.encodes for t in strategy.tiers] == [3, 0, 2]
    # every client of a tier receives the same step bytes (Flower can deduplicate them)
    messages = list(strategy.configure_train(4, ArrayRecord(model), ConfigRecord({}), FakeGrid(sorted(contexts))))
    steps = {msg.metadata.dst_node_id: bytes(msg.content.config_records[P.DOWNLOAD_RECORD][P.PAYLOADS][0])
             for msg in messages}
    assert len({steps[n] for n in range(1, 5)}) == 1 and len({steps[n] for n in range(5, 9)}) == 1


def test_frozen_server_model_clients_converge_to_it():
    """Server-side error feedback: with the global model fixed, what compression drops arrives later."""
    target = _model(5)
    tier = Tier(0, "topk(ratio=0.1)+kbit(bits=8)")
    tier.start(_model(6))  # clients hold an older model
    held, info = dict(tier.reference), (0, 0, tier.crc)
    layout = fedcomp.Layout.of(target)
    errors = []
    for r in range(1, 61):
        step = tier.step(target, r)
        held, info = apply_plan(held, info, mode="chain", tier=0, spec=tier.codec.spec, payloads=[step.payload],
                                rounds=[r], base_crc=step.base_crc, crc=step.crc, layout=layout)
        errors.append(float((held["w"] - target["w"]).norm() / target["w"].norm()))
    assert errors[-1] < 1e-3 * errors[0], errors[::10]
    assert all(b <= a * 1.01 for a, b in zip(errors, errors[1:])), "the error never grows"
    assert torch.equal(held["steps"], target["steps"])
    # without error feedback (a fresh encode of the target each round, nothing carried) it stalls
    codec = fedcomp.build_codec("topk(ratio=0.1)+kbit(bits=8)")
    once = codec.decode(codec.encode({k: target[k] - _model(6)[k] for k in target}).payload, layout)
    no_ef = float((_model(6)["w"] + once["w"] - target["w"]).norm() / target["w"].norm())
    assert errors[-1] < 0.01 * no_ef


def test_lost_reply_client_skips_steps_it_already_applied():
    strategy = _strategy()
    contexts = {1: _context(1, tier=1), 2: _context(2, tier=1)}
    model = _model()
    model, _ = _round(strategy, model, contexts, 1, {1, 2})
    model, _ = _round(strategy, model, contexts, 2, {1, 2}, lose_reply={2})  # node 2 applied round 2
    model, _ = _round(strategy, model, contexts, 3, {1, 2})
    d = {x["node"]: x for x in strategy.rounds[3].downloads}
    assert d[2]["mode"] == "chain" and d[2]["steps"] == 2  # the server only knew round 1
    _assert_bit_exact(strategy, contexts, {1, 2})


def test_stale_client_gets_full_model_and_restarted_client_resyncs():
    strategy = _strategy(download_max_stale=2)
    contexts = {1: _context(1, tier=0), 2: _context(2, tier=0)}
    model = _model()
    for r in range(1, 5):
        model, _ = _round(strategy, model, contexts, r, {1, 2} if r == 1 else {1})
    model, _ = _round(strategy, model, contexts, 5, {1, 2})  # node 2 missed 3 rounds > max_stale 2
    d = {x["node"]: x for x in strategy.rounds[5].downloads}
    assert d[1]["mode"] == "chain" and d[2]["mode"] == "full"
    _assert_bit_exact(strategy, contexts, {1, 2})

    contexts[2] = _context(2, tier=0)  # the node restarted: its Context.state is gone
    model, _ = _round(strategy, model, contexts, 6, {1, 2})
    status = {c["node"]: c["status"] for c in strategy.rounds[6].clients}
    assert status[1] == "ok" and status[2].startswith("resync: no reference model held"), status
    model, _ = _round(strategy, model, contexts, 7, {1, 2})
    d = {x["node"]: x for x in strategy.rounds[7].downloads}
    assert d[2]["mode"] == "full"
    assert all(c["status"] == "ok" for c in strategy.rounds[7].clients)
    _assert_bit_exact(strategy, contexts, {1, 2})


def test_corrupted_reference_is_detected_and_resynced():
    strategy = _strategy()
    contexts = {1: _context(1, tier=2), 2: _context(2, tier=2)}
    model = _model()
    model, _ = _round(strategy, model, contexts, 1, {1, 2})
    held = _held(contexts[2])
    held["w"][0, 0] += 1e-3  # a silently diverged copy: same version, other bits
    contexts[2].state[P.REF_STATE] = ArrayRecord(held)
    model, _ = _round(strategy, model, contexts, 2, {1, 2})
    status = {c["node"]: c["status"] for c in strategy.rounds[2].clients}
    assert status[2].startswith("resync:") and "state corrupted" in status[2], status
    model, _ = _round(strategy, model, contexts, 3, {1, 2})
    assert {x["node"]: x["mode"] for x in strategy.rounds[3].downloads}[2] == "full"
    _assert_bit_exact(strategy, contexts, {1, 2})


def test_tier_change_and_tier_choice_by_downlink():
    strategy = _strategy(download_tier_kbps="1000,8000")
    contexts = {1: _context(1), 2: _context(2), 3: _context(3)}
    for node, kbps in ((1, 500), (2, 4000), (3, 50_000)):
        contexts[node].node_config["downlink-kbps"] = kbps
    model = _model()
    model, _ = _round(strategy, model, contexts, 1, {1, 2, 3})  # first contact: tier 0 in full
    # each joins its own tier; all tiers still hold the initial model, so a chain suffices
    model, _ = _round(strategy, model, contexts, 2, {1, 2, 3})
    d = {x["node"]: (x["tier"], x["mode"]) for x in strategy.rounds[2].downloads}
    assert d == {1: (0, "chain"), 2: (1, "chain"), 3: (2, "chain")}
    _assert_bit_exact(strategy, contexts, {1, 2, 3})
    # a later tier change, when the tiers' references differ, is a full model
    contexts[1].node_config["downlink-kbps"] = 9000
    model, _ = _round(strategy, model, contexts, 3, {1, 2, 3})
    model, _ = _round(strategy, model, contexts, 4, {1, 2, 3})
    d = {x["node"]: (x["tier"], x["mode"]) for x in strategy.rounds[4].downloads}
    assert d == {1: (2, "full"), 2: (1, "chain"), 3: (2, "chain")}
    _assert_bit_exact(strategy, contexts, {1, 2, 3})


def test_compressed_tiers_cost_less_than_dense_broadcasts():
    contexts = {node: _context(node, tier=node % 3) for node in range(1, 7)}
    strategy = _strategy()
    model = _model()
    for r in range(1, 6):
        model, _ = _round(strategy, model, contexts, r, set(contexts))
    later = [strategy.rounds[r] for r in range(2, 6)]
    tier_bytes = {t: sum(s.download_bytes_by_tier[t] for s in later) for t in range(3)}
    dense = sum(s.download_bytes_dense for s in later) / 3
    assert tier_bytes[0] < tier_bytes[1] < tier_bytes[2] < dense, (tier_bytes, dense)
    assert dense / tier_bytes[0] > 8


def test_spec_and_threshold_errors_name_the_value():
    with pytest.raises(fedcomp.SpecError, match="empty tier"):
        parse_tiers("kbit(bits=8) | ")
    with pytest.raises(fedcomp.SpecError, match="unknown codec"):
        parse_tiers("kbit(bits=8) | zip()")
    with pytest.raises(fedcomp.SpecError, match="3 tiers need 2 ascending"):
        parse_thresholds("8000,1000", 3)
    with pytest.raises(fedcomp.SpecError, match="download_max_stale=-1"):  # 0: no cap (bounded by bytes)
        CompressedStrategy(FedAvg(), download="none()", download_max_stale=-1)


def test_apply_plan_refuses_what_it_cannot_rebuild():
    model = _model()
    layout = fedcomp.Layout.of(model)
    tier = Tier(0, "kbit(bits=8)")
    tier.start(model)
    step = tier.step({k: v + 1 if v.is_floating_point() else v for k, v in model.items()}, 1)
    kwargs = dict(mode="chain", tier=0, spec=tier.codec.spec, payloads=[step.payload], rounds=[1],
                  base_crc=step.base_crc, crc=step.crc, layout=layout)
    with pytest.raises(ResyncNeeded, match="no reference"):
        apply_plan(None, None, **kwargs)
    with pytest.raises(ResyncNeeded, match="not the chain's base"):
        other = {k: v + 1 for k, v in model.items()}
        apply_plan(other, (0, 0, reference_crc(other)), **kwargs)
    with pytest.raises(ResyncNeeded, match="state corrupted"):
        apply_plan(model, (0, 0, reference_crc(model) ^ 1), **kwargs)
    with pytest.raises(ResyncNeeded, match="CRC"):
        apply_plan(model, (0, 0, reference_crc(model)), **{**kwargs, "crc": step.crc ^ 1})
    with pytest.raises(fedcomp.DecodeError):
        apply_plan(model, (0, 0, reference_crc(model)), **{**kwargs, "payloads": [step.payload[:-3]]})
    got, info = apply_plan(model, (0, 0, reference_crc(model)), **kwargs)
    assert info == (0, 1, step.crc) and all(torch.equal(got[k], tier.reference[k]) for k in got)


# -- nothing lost: a reply that never reaches the aggregate goes back into the residual ----------


def _shift_app(shift):
    def app(msg: Message, context: Context) -> Message:
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        trained = {k: v + shift[k] if v.is_floating_point() else v for k, v in received.items()}
        return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 4})}),
                       reply_to=msg)

    return app


@pytest.mark.parametrize("lose", ["corrupt", "lost"])
def test_update_of_a_dropped_reply_returns_to_the_residual(lose):
    g = torch.Generator().manual_seed(3)
    model = {"w": torch.zeros(40, 30), "b": torch.zeros(30)}
    shift = {"w": torch.randn(40, 30, generator=g), "b": torch.randn(30, generator=g)}
    strategy = CompressedStrategy(FedAvg(fraction_train=1.0, min_available_nodes=1, min_train_nodes=1),
                                  upload="topk(ratio=0.05)", download="none()")
    context = _context(1)
    for r in (1, 2, 3):
        (msg,) = strategy.configure_train(r, ArrayRecord(model), ConfigRecord({}), FakeGrid([1]))
        reply = compression_mod(msg, context, _shift_app(shift))
        if r == 2 and lose == "corrupt":
            record = reply.content.config_records[P.UPLOAD_RECORD]
            record[P.PAYLOAD] = record[P.PAYLOAD][:-1] + bytes([record[P.PAYLOAD][-1] ^ 1])
        replies = [] if (r == 2 and lose == "lost") else [reply]
        arrays, _ = strategy.aggregate_train(r, replies)
        if arrays is not None:
            model = arrays.to_torch_state_dict()
    residual = context.state.array_records[P.RESIDUAL_STATE].to_torch_state_dict()
    # what reached the model plus what waits in the residual is every update the client made
    for name in shift:
        torch.testing.assert_close(model[name] + residual[name], 3 * shift[name], rtol=0, atol=1e-5)
