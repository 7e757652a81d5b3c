"""The drop-in holds: loud misconfiguration, every byte counted, a hostile client costs only its own reply."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

import fedcomp
from fedcomp import protocol as P
from fedcomp.aggregate import (
    Accumulator, AggregateOverflow, NormGuard, UpdateRejected, WeightError, apply_step, check_weight,
)
from fedcomp.broadcast import apply_plan
from fedcomp.clients.mod import compression_mod
from fedcomp.strategies import CompressedStrategy, MissingCompressionMod, NoUsableReplies


# -- a tiny in-process federation ---------------------------------------------------------------
class Grid:
    """Pushed messages go through ``handle(node, msg)`` at once; replies come back on the next pull."""

    def __init__(self, nodes, handle):
        self.nodes, self.handle = nodes, handle
        self.ready: dict[str, Message] = {}
        self.count = 0

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            reply = self.handle(msg.metadata.dst_node_id, msg)
            self.count += 1
            key = str(self.count)
            reply.metadata.__dict__["_reply_to_message_id"] = key
            self.ready[key] = reply
            ids.append(key)
        return ids

    def pull_messages(self, ids):
        out = [self.ready.pop(k) for k in list(ids) if k in self.ready]
        return out

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


def _contexts(n):
    return {i: Context(run_id=1, node_id=i, node_config={"partition-id": i - 1, "num-partitions": n},
                       state=RecordDict(), run_config={}) for i in range(1, n + 1)}


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)}


def _toy_trainer(node, weight=None):
    def app(msg: Message, context: Context) -> Message:
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        g = torch.Generator().manual_seed(node * 1000 + len(msg.content.config_records))
        trained = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in received.items()}
        w = 10 + node if weight is None else weight
        return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": w})}),
                       reply_to=msg)
    return app


def _fedavg(n, **kw):
    return FedAvg(fraction_train=1.0, fraction_evaluate=kw.pop("fraction_evaluate", 0.0), min_available_nodes=n,
                  min_train_nodes=n, **kw)


# -- misconfiguration fails loudly ----------------------------------------------------------------
def test_missing_mod_run_raises_naming_compression_mod():
    """Wrapper on, mod forgotten: the user's train function fails on every client with KeyError
    'arrays' (the model went out compressed); the run stops in round 1 naming the fix."""
    def handle(node, msg):
        return Message(Error(code=0, reason="<class 'KeyError'>:<'arrays'>"), reply_to=msg)

    strategy = CompressedStrategy(_fedavg(3), upload="topk(ratio=0.1)")
    with pytest.raises(MissingCompressionMod, match=r"compression_mod") as info:
        strategy.start(grid=Grid([1, 2, 3], handle), initial_arrays=ArrayRecord(_model()), num_rounds=3)
    assert "round 1" in str(info.value) and "ClientApp(mods=[compression_mod])" in str(info.value)


def test_rounds_without_usable_replies_stop_the_run_with_the_errors():
    def handle(node, msg):
        return Message(Error(code=0, reason="could not split 1437 samples into 1000 Dirichlet partitions"),
                       reply_to=msg)

    strategy = CompressedStrategy(_fedavg(3), upload="topk(ratio=0.1)", max_failed_rounds=2)
    with pytest.raises(NoUsableReplies, match=r"2 consecutive rounds .*3 x error: could not split") as info:
        strategy.start(grid=Grid([1, 2, 3], handle), initial_arrays=ArrayRecord(_model()), num_rounds=5)
    assert "max_failed_rounds=2" in str(info.value)
    assert all(s.upload_ratio is None for s in strategy.rounds.values())  # never a NaN ratio


def test_run_that_never_aggregates_does_not_succeed():
    contexts = _contexts(2)

    def handle(node, msg):
        return compression_mod(msg, contexts[node], _toy_trainer(node, weight=float("nan")))

    strategy = CompressedStrategy(_fedavg(2), upload="topk(ratio=0.1)")  # 2 rounds < max_failed_rounds
    with pytest.raises(NoUsableReplies, match="no reply reached the aggregate in any of the run's 2 rounds"):
        strategy.start(grid=Grid([1, 2], handle), initial_arrays=ArrayRecord(_model()), num_rounds=2)


def test_auto_aggregation_and_config_object():
    from fedcomp.strategies import CompressionConfig

    assert CompressedStrategy(FedAvg(), upload="sketch(rows=1, cols=50)").aggregation == "sketch"
    assert CompressedStrategy(FedAvg(), upload="topk(ratio=0.1)").aggregation == "decode"
    cfg = CompressionConfig(upload="kbit(bits=4)", norm_factor=5.0)
    strategy = CompressedStrategy(FedAvg(), config=cfg)
    # the config as given; the one in use has download='auto' resolved (none(): decoded aggregation)
    assert strategy.requested is cfg and strategy.upload.spec.startswith("kbit(bits=4")
    assert strategy.config.download == "none()" and strategy.config.norm_factor == 5.0
    with pytest.raises(fedcomp.SpecError, match="either config= or keyword"):
        CompressedStrategy(FedAvg(), config=cfg, upload="none()")
    for bad in ({"aggregation": "median"}, {"norm_factor": 0.5}, {"max_weight": -1.0}, {"max_failed_rounds": 0}):
        with pytest.raises(fedcomp.SpecError):
            CompressedStrategy(FedAvg(), **bad)
    with pytest.raises(AttributeError):
        cfg.upload = "none()"  # frozen


# -- hostile weights and updates --------------------------------------------------------------------
def _regression_run(hostile: dict, rounds=3, honest=5, upload="topk(ratio=0.5)+qsgd(bits=8)", **kw):
    """FedAvg on a least-squares task (each client: one gradient step on its own data);
    ``hostile``: node -> (weight, update scale) of extra clients. Returns (test accuracy of the
    sign of the prediction, the final model, the strategy)."""
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(20, generator=g)
    data = {}
    for i in range(1, honest + len(hostile) + 1):
        x = torch.randn(64, 20, generator=g)
        data[i] = (x, x @ truth + 0.1 * torch.randn(64, generator=g))
    x_test = torch.randn(500, 20, generator=g)
    y_test = x_test @ truth
    n = honest + len(hostile)
    contexts = _contexts(n)

    def handle(node, msg):
        def app(m: Message, context: Context) -> Message:
            w = m.content.array_records["arrays"].to_torch_state_dict()["w"]
            x, y = data[node]
            step = -0.1 * x.T @ (x @ w - y) / len(y)
            weight = len(y)
            if node in hostile:
                weight, scale = hostile[node]
                step = step * scale
            return Message(RecordDict({"arrays": ArrayRecord({"w": w + step}),
                                       "metrics": MetricRecord({"num-examples": weight})}), reply_to=m)
        return compression_mod(msg, contexts[node], app)

    strategy = CompressedStrategy(_fedavg(n), upload=upload, **kw)
    result = strategy.start(grid=Grid(list(range(1, n + 1)), handle),
                            initial_arrays=ArrayRecord({"w": torch.zeros(20)}), num_rounds=rounds)
    w = result.arrays.to_torch_state_dict()["w"]
    accuracy = float(((x_test @ w > 0) == (y_test > 0)).float().mean())
    return accuracy, w, strategy


def test_hostile_weights_and_a_huge_update_cost_only_their_own_reply():
    """NaN, inf, negative, 1e308 weights, a 1e12 weight under a cap and a 1e30-norm update under the
    default norm guard: all dropped with their reason; the model is the honest clients' run."""
    hostile = {6: (float("nan"), 1.0), 7: (float("inf"), 1.0), 8: (-1e12, 1.0), 9: (1e308, 1.0),
               10: (1e12, 1.0), 11: (64, 1e30)}
    clean, w_clean, _ = _regression_run({})
    attacked, w_attacked, strategy = _regression_run(hostile, max_weight=1e6)
    assert clean > 0.8 and abs(attacked - clean) <= 0.02
    assert torch.equal(w_attacked, w_clean)  # every hostile reply dropped: exactly the honest run
    for stats in strategy.rounds.values():
        status = {c["node"]: c["status"] for c in stats.clients}
        assert all(status[i] == "ok" for i in range(1, 6)), status
        assert "finite number > 0, got nan" in status[6] and "got inf" in status[7]
        assert "got -1e+12" in status[8] and "1e+308 exceeds" in status[9]
        assert "exceeds max_weight=1e+06" in status[10]
        assert "median norm" in status[11], status[11]
        assert stats.aggregated == 5
    # without a cap, 1e308 still fails the hard limit; 1e12 is a (huge) valid count: the cap is the user's call
    _, _, uncapped = _regression_run({6: (1e308, 1.0)}, rounds=1)
    assert "exceeds the limit 2**53" in {c["node"]: c["status"] for c in uncapped.rounds[1].clients}[6]


def test_huge_update_is_accepted_only_with_the_guard_off():
    """The default guard is what keeps a 1e30-norm update out (with it off the model is ruined)."""
    for kw in ({}, {"norm_factor": 0}):
        accuracy, w, strategy = _regression_run({4: (64, 1e30)}, rounds=1, honest=3, upload="none()", **kw)
        if kw:
            assert strategy.rounds[1].aggregated == 4 and float(w.abs().max()) > 1e20
        else:
            assert strategy.rounds[1].aggregated == 3 and float(w.abs().max()) < 10


# -- replays ---------------------------------------------------------------------------------------
def test_replayed_payload_is_dropped_with_its_reason():
    contexts, last = _contexts(4), {}

    def handle(node, msg):
        reply = compression_mod(msg, contexts[node], _toy_trainer(node))
        record = reply.content.config_records[P.UPLOAD_RECORD]
        if node == 4 and 4 in last:
            record[P.PAYLOAD] = last[4]  # last round's bytes as this round's
        last[node] = record[P.PAYLOAD]
        return reply

    strategy = CompressedStrategy(_fedavg(4), upload="topk(ratio=0.2)+qsgd(bits=4)")
    strategy.start(grid=Grid([1, 2, 3, 4], handle), initial_arrays=ArrayRecord(_model()), num_rounds=2)
    status = {c["node"]: c["status"] for c in strategy.rounds[2].clients}
    assert status[4].startswith("dropped: replay") and "already used by node 4 in round 1" in status[4]
    assert [status[i] for i in (1, 2, 3)] == ["ok"] * 3


def test_reply_answering_another_round_is_dropped():
    contexts = _contexts(3)

    def handle(node, msg):
        reply = compression_mod(msg, contexts[node], _toy_trainer(node))
        if node == 3:
            reply.content.config_records[P.UPLOAD_RECORD][P.REPLY_ROUND] = 7
        return reply

    strategy = CompressedStrategy(_fedavg(3), upload="topk(ratio=0.2)")
    strategy.start(grid=Grid([1, 2, 3], handle), initial_arrays=ArrayRecord(_model()), num_rounds=1)
    status = {c["node"]: c["status"] for c in strategy.rounds[1].clients}
    assert "replay: the payload answers round 7, this is round 1" in status[3] and status[1] == "ok"


# -- federated evaluation is counted, and goes through the references --------------------------------
def _evaluator(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"eval_loss": 0.5, "num-examples": 10})}), reply_to=msg)


def test_federated_evaluation_bytes_are_counted():
    contexts = _contexts(3)

    def handle(node, msg):
        if msg.metadata.message_type.startswith("evaluate"):
            return compression_mod(msg, contexts[node], _evaluator)
        return compression_mod(msg, contexts[node], _toy_trainer(node))

    totals = []
    for fraction in (0.0, 1.0):
        strategy = CompressedStrategy(_fedavg(3, fraction_evaluate=fraction, min_evaluate_nodes=3),
                                      upload="topk(ratio=0.2)", download="kbit(bits=8)")
        strategy.start(grid=Grid([1, 2, 3], handle), initial_arrays=ArrayRecord(_model()), num_rounds=2)
        totals.append(sum(s.download_bytes + s.upload_bytes + s.evaluate_download_bytes + s.evaluate_reply_bytes
                          for s in strategy.rounds.values()))
        if fraction:
            s = strategy.rounds[2]
            assert s.evaluate_download_bytes > 0 and s.evaluate_reply_bytes > 0
            assert len(s.evaluate_clients) == 3 and s.evaluate_download_bytes_dense >= s.evaluate_download_bytes
    assert totals[1] > totals[0]


def test_capable_client_evaluates_its_tiers_next_reference_through_a_chain():
    """A client whose mod announced it handles evaluate broadcasts gets a chain (bytes < dense),
    applies it like a train broadcast, and the next training round reuses that step (one encode)."""
    strategy = CompressedStrategy(_fedavg(1, fraction_evaluate=1.0, min_evaluate_nodes=1),
                                  upload="none()", download="topk(ratio=0.1)+kbit(bits=8)")
    contexts = _contexts(1)
    held = {}

    def handle(node, msg):
        if msg.metadata.message_type.startswith("evaluate"):
            cfg = msg.content.config_records[P.DOWNLOAD_RECORD]
            assert cfg[P.KIND] == "evaluate" and not msg.content.array_records
            layout = fedcomp.Layout.from_json(str(cfg[P.LAYOUT]))
            ref, info = apply_plan(held.get("ref"), held.get("info"), mode=str(cfg[P.MODE]), tier=int(cfg[P.TIER]),
                                   spec=str(cfg[P.DOWNLOAD_SPEC]), payloads=list(cfg[P.PAYLOADS]),
                                   rounds=list(cfg[P.ROUNDS]), base_crc=int(cfg[P.BASE_CRC]), crc=int(cfg[P.REF_CRC]),
                                   layout=layout)
            held.update(ref=ref, info=info, mode=str(cfg[P.MODE]))
            return Message(RecordDict({"metrics": MetricRecord({"eval_loss": 0.1, "num-examples": 3}),
                                       P.UPLOAD_RECORD: ConfigRecord({P.TIER: info[0], P.REF_VERSION: info[1],
                                                                      P.REF_CRC: info[2], P.WANT_TIER: 0})}),
                           reply_to=msg)
        reply = compression_mod(msg, contexts[node], _toy_trainer(node))
        reply.content.config_records[P.UPLOAD_RECORD][P.CAPABILITIES] = [P.EVALUATE_CAPABILITY]
        stored = contexts[node].state
        held.update(ref=stored.array_records[P.REF_STATE].to_torch_state_dict(),
                    info=tuple(int(stored.config_records[P.REF_INFO_STATE][k]) for k in (P.TIER, P.REF_VERSION, P.REF_CRC)))
        return reply

    strategy.start(grid=Grid([1], handle), initial_arrays=ArrayRecord(_model()), num_rounds=3)
    s1, s2 = strategy.rounds[1], strategy.rounds[2]
    assert s1.evaluate_clients[0]["mode"] == "chain" and held["mode"] == "chain"
    assert s1.evaluate_download_bytes < s1.evaluate_download_bytes_dense / 3
    assert (s1.encodes, s2.encodes) == (2, 1)  # round 2's train step was round 1's evaluation step
    assert strategy.tiers[0].encodes == 4  # versions 1 (train), 2, 3, 4 (evaluation, reused by training)
    assert s2.downloads[0]["mode"] == "chain" and s2.downloads[0]["steps"] == 1
    assert [c["status"] for c in s2.clients] == ["ok"]


# -- core guards -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0, 10**400, 1e39, "12", None, True])
def test_weights_refused_with_a_typed_error(bad):
    with pytest.raises(WeightError):
        check_weight(bad)


def test_weight_cap_and_hard_limit():
    assert check_weight(5) == 5.0 and check_weight(2**53) == 2.0**53
    with pytest.raises(WeightError, match="max_weight=100"):
        check_weight(101, max_weight=100)


def test_norm_guard_warmup_and_median():
    guard = NormGuard(factor=10.0, warmup=3)
    assert guard.offer(1.0) is None and guard.offer(1e30) is None  # waiting for 3 norms
    assert guard.offer(2.0) is True and guard.ready()
    assert guard.settle(1.0) and not guard.settle(1e30) and guard.settle(2.0)
    assert guard.offer(25.0) is False and "median norm" in guard.reason(25.0)
    two = NormGuard()
    two.offer(1.0), two.offer(1e30)
    assert two.settle(1.0) and not two.settle(1e30)  # two replies: the smaller norm is the reference
    with pytest.raises(UpdateRejected):
        NormGuard().offer(float("nan"))
    assert NormGuard(max_norm=5.0).offer(6.0) is False


def test_sums_that_overflow_are_refused():
    layout = fedcomp.Layout.of({"h": torch.zeros(4, dtype=torch.float16)})
    acc = Accumulator(fedcomp.build_codec("none()"), layout)
    acc.add_dense({"h": torch.full((4,), 60000.0, dtype=torch.float16)}, 1.0)
    with pytest.raises(AggregateOverflow, match="does not fit torch.float16"):
        acc.apply_mean({"h": torch.full((4,), 60000.0, dtype=torch.float16)})
    with pytest.raises(WeightError):
        acc.add_dense({"h": torch.ones(4, dtype=torch.float16)}, 10**400)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_mean_applied_in_the_models_dtype_without_truncation(dtype):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(50, generator=g, dtype=torch.float64) * 100).to(dtype)
    ups = [(torch.randn(50, generator=g, dtype=torch.float64) * 3).to(dtype) for _ in range(3)]
    layout = fedcomp.Layout.of({"t": base})
    acc = Accumulator(fedcomp.build_codec("none()"), layout)
    for i, u in enumerate(ups):
        acc.add_dense({"t": u}, float(i + 1))
    out = acc.apply_mean({"t": base})["t"]
    exact = base.double() + sum((i + 1) * u.double() for i, u in enumerate(ups)) / 6
    expected = exact.round().to(dtype) if not dtype.is_floating_point else exact.to(dtype)
    assert out.dtype == dtype
    if dtype == torch.float64:  # within float64 rounding, far below fp32's (~1e-5 here)
        assert float((out - expected).abs().max()) < 1e-12
    else:
        assert torch.equal(out, expected)
    if dtype == torch.float64:  # float64 models keep float64 steps (no fp32 truncation)
        assert torch.equal(apply_step({"t": base}, {"t": ups[0]})["t"], base + ups[0])


def test_mod_evaluates_through_chains_exactly_the_reference_it_will_train_from():
    """The real mod on both sides of evaluation: it announces the capability after its first full
    reference, then gets evaluate broadcasts as chains, hands the app exactly its tier's reference
    (bit for bit what the server holds), and the next training round needs no resync."""
    contexts = _contexts(2)
    seen = {}

    def evaluator(node):
        def evaluate(msg: Message, context: Context) -> Message:
            seen[node] = dict(msg.content.array_records["arrays"].to_torch_state_dict())
            return Message(RecordDict({"metrics": MetricRecord({"eval_loss": 0.1, "num-examples": 3})}),
                           reply_to=msg)
        return evaluate

    def handle(node, msg):
        if msg.metadata.message_type.startswith("evaluate"):
            return compression_mod(msg, contexts[node], evaluator(node))
        return compression_mod(msg, contexts[node], _toy_trainer(node))

    strategy = CompressedStrategy(_fedavg(2, fraction_evaluate=1.0, min_evaluate_nodes=2),
                                  upload="topk(ratio=0.2)", download="topk(ratio=0.1)+kbit(bits=8)")
    strategy.start(grid=Grid([1, 2], handle), initial_arrays=ArrayRecord(_model()), num_rounds=3)
    for r in (1, 2, 3):
        s = strategy.rounds[r]
        assert sorted(c["mode"] for c in s.evaluate_clients) == ["chain", "chain"], s.evaluate_clients
        assert s.evaluate_download_bytes < s.evaluate_download_bytes_dense / 3
        assert all("status" not in c for c in s.evaluate_clients)
        assert [c["status"] for c in s.clients] == ["ok", "ok"]
    tier = strategy.tiers[0]
    for node in (1, 2):
        held = contexts[node].state.array_records[P.REF_STATE].to_torch_state_dict()
        assert all(torch.equal(seen[node][k], held[k]) for k in held)
        assert all(torch.equal(held[k], tier.reference[k]) for k in held)
    assert all(d["mode"] == "chain" for r in (2, 3) for d in strategy.rounds[r].downloads)
