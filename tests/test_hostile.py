"""A hostile client costs only its own reply (issue 37): every attack of the issue's table, in an
in-process federation of the project's digits app (10 clients, 2 of them hostile and replying first,
streamed into the round before any honest reply), ends within 2 points of the run with the two
simply dropped, logs its reason per reply, and never stops the run.

The federation is Flower's loop in one process: ``configure_train``, each node's
``compression_mod`` around the project's ``train`` (``fedcomp.simulations.client_app``), each reply
handed to the strategy as it arrives (the streaming path: colluders first), ``aggregate_train``,
then the global model on the test set.
"""

from __future__ import annotations

import logging
import math
import random
import struct

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from torch import nn

import fedcomp
from conftest import FakeGrid
from fedcomp import protocol as P
from fedcomp.broadcast import encode_full, reference_crc
from fedcomp.clients.mod import compression_mod
from fedcomp.simulations import client_app, task
from fedcomp.strategies.wrapper import CompressedStrategy
from fedcomp.wire import HEADER, REPLY_TAG, REPLY_TOKEN, crc32, reply_tag

CLIENTS = 10
ROUNDS = 5  # the runs (clean 67.2%, hostile clients dropped 65.8%); slow attacks: SLOW_ROUNDS
SLOW_ROUNDS = 20
HOSTILE = (100, 101)  # node ids of partitions 0 and 1
TOLERANCE = 0.02  # final accuracy within 2 points of the run with the hostile clients dropped
# the upload of the table (the cross-silo default then): the guards do not depend on the codec,
# and 5-round accuracies (~67%) move by several points with any change of the default's share
UPLOAD = "topk(ratio=0.01)+qsgd(bits=4)"


class BnMlp(nn.Module):
    """A digits MLP with BatchNorm (running statistics, a counter): the state rows of the table."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(64, 128), nn.BatchNorm1d(128), nn.Linear(128, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _build(model: str, seed: int = 0) -> nn.Module:
    if model == "mlp":
        return task.build_model("mlp", seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BnMlp()


def _train(model_name: str):
    """The project's ClientApp train for the digits MLP; the same loop for the BatchNorm MLP."""
    if model_name == "mlp":
        return client_app.train

    def train(msg: Message, context: Context) -> Message:
        cfg = context.run_config
        model = _build(model_name)
        model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
        pid = int(context.node_config["partition-id"])
        x, y = task.load_partition("digits", pid, CLIENTS, 0.5, 0)
        rnd = int(msg.content.config_records["config"].get("server-round", 0))
        loss = task.train(model, x, y, epochs=1, lr=float(cfg["lr"]), batch_size=32, seed=rnd * 1009 + pid,
                          device="cpu")
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"train_loss": float(loss), "num-examples": int(len(y))})}),
                       reply_to=msg)
    return train


class Attack:
    """What a hostile node does; the default is nothing (an honest client)."""

    def app(self, train, node, rnd):  # the ClientApp behind compression_mod
        return train

    def message(self, msg, node, rnd):  # the train message on its way to the node
        return msg

    def replies(self, reply, msg, node, rnd):  # what the node sends back (a list: extra replies allowed)
        return [reply]


def federation(rounds: int, attack: Attack | None = None, *, drop_hostile: bool = False, model: str = "mlp",
               lr: float = 0.3, **settings):
    """Final accuracy, the accuracy per round and the strategy of one run (see module docstring)."""
    random.seed(0)
    run_config = {"seed": 0, "task": "digits", "model": "mlp", "local-epochs": 1, "lr": lr, "batch-size": 32,
                  "partition-alpha": 0.5}
    contexts = {100 + p: Context(run_id=1, node_id=100 + p, node_config={"partition-id": p, "num-partitions": CLIENTS},
                                 state=RecordDict(), run_config=run_config) for p in range(CLIENTS)}
    nodes = [n for n in sorted(contexts) if not (drop_hostile and n in HOSTILE)]
    settings.setdefault("upload", UPLOAD)
    strategy = CompressedStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=len(nodes),
                                         min_train_nodes=len(nodes)), **settings)
    net = _build(model)
    x_test, y_test = task.load_test("digits", 0, num_partitions=CLIENTS)
    arrays, accuracies, train = ArrayRecord(net.state_dict()), [], _train(model)
    attack = attack or Attack()
    for rnd in range(1, rounds + 1):
        messages = list(strategy.configure_train(rnd, arrays, ConfigRecord({"server-round": rnd}), FakeGrid(nodes)))
        # colluders reply first: their replies reach the round before any honest one
        messages.sort(key=lambda m: (m.metadata.dst_node_id not in HOSTILE, m.metadata.dst_node_id))
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node in HOSTILE:
                msg = attack.message(msg, node, rnd)
                reply = compression_mod(msg, contexts[node], attack.app(train, node, rnd))
                sent = attack.replies(reply, msg, node, rnd)
            else:
                sent = [compression_mod(msg, contexts[node], train)]
            for reply in sent:
                strategy._on_reply(reply)  # streamed in as it arrives (StreamingGrid's callback)
                replies.append(reply)
        new, _ = strategy.aggregate_train(rnd, replies)
        arrays = new if new is not None else arrays
        net.load_state_dict(arrays.to_torch_state_dict())
        _, accuracy = task.evaluate(net, x_test, y_test, device="cpu")
        accuracies.append(accuracy)
    return accuracies[-1], accuracies, strategy


_BASELINES: dict = {}


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread (the federation is small; the machine's cores are shared): restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dropped(rounds: int, model: str = "mlp", **settings) -> float:
    """Final accuracy of the run with the hostile clients simply left out (memoised)."""
    key = (rounds, model, tuple(sorted(settings.items())))
    if key not in _BASELINES:
        _BASELINES[key] = federation(rounds, drop_hostile=True, model=model, **settings)[0]
    return _BASELINES[key]


def clean(rounds: int) -> float:
    """Final accuracy of the run with every client honest (memoised)."""
    if ("clean", rounds) not in _BASELINES:
        _BASELINES[("clean", rounds)] = federation(rounds)[0]
    return _BASELINES[("clean", rounds)]


def statuses(strategy, node):
    return [next((c["status"] for c in s.clients if c["node"] == node), None) for _, s in sorted(strategy.rounds.items())]


def _close_to_dropped(final, rounds, model="mlp", **settings):
    base = dropped(rounds, model, **settings)
    assert abs(final - base) <= TOLERANCE, f"final accuracy {final:.4f}, hostile clients dropped {base:.4f}"


# -- weights ----------------------------------------------------------------------------------------
class Weight(Attack):
    def __init__(self, value, key="num-examples"):
        self.value, self.key = value, key

    def app(self, train, node, rnd):
        def run(msg, context):
            reply = train(msg, context)
            reply.content["metrics"][self.key] = self.value
            return reply
        return run


INVALID_WEIGHTS = [  # one per hostile node and round, in turn
    (float("nan"), "finite number > 0, got nan"), (float("inf"), "finite number > 0, got inf"),
    (1e308, "exceeds the limit 2**53"), (0, "finite number > 0, got 0"), (-5, "finite number > 0, got -5"),
    (2**53 + 2, "exceeds the limit 2**53"),
]


class InvalidWeight(Weight):
    def __init__(self):
        super().__init__(None)

    @staticmethod
    def index(node, rnd):
        return (len(HOSTILE) * (rnd - 1) + HOSTILE.index(node)) % len(INVALID_WEIGHTS)

    def app(self, train, node, rnd):
        self.value = INVALID_WEIGHTS[self.index(node, rnd)][0]
        return super().app(train, node, rnd)


def test_invalid_weights_are_dropped_with_their_reason():
    final, _, strategy = federation(ROUNDS, InvalidWeight())
    for node in HOSTILE:
        seen = statuses(strategy, node)
        assert all(INVALID_WEIGHTS[InvalidWeight.index(node, r)][1] in s for r, s in enumerate(seen, 1)), seen
    _close_to_dropped(final, ROUNDS)


def test_a_weight_of_1e12_is_clipped_to_the_median_and_logged(caplog):
    caplog.set_level(logging.WARNING)
    final, _, strategy = federation(ROUNDS, Weight(1e12))
    clipped = [c for s in strategy.rounds.values() for c in s.clients if "weight" in c]
    assert sorted(c["node"] for c in clipped) == sorted(HOSTILE * ROUNDS)  # every hostile reply, every round
    assert all("weight 1e+12 clipped to weight_factor=2 x the lower median" in c["weight"] for c in clipped)
    assert sum("clipped to weight_factor=2" in r.getMessage() for r in caplog.records) == 2 * ROUNDS
    _close_to_dropped(final, ROUNDS)


def test_declared_weights_are_trusted_with_weight_factor_0():
    final, _, strategy = federation(ROUNDS, Weight(1e12), weight_factor=0.0)
    assert final < dropped(ROUNDS) - 0.2  # the opt-in: one client is the average, as declared


class BiasPush(Weight):
    """A 1e12 weight, and an update inside the norm guard: the honest update plus a push of the output
    bias towards class 0, three times the honest update's norm."""

    def __init__(self, scale=3.0):
        super().__init__(1e12)
        self.scale = scale

    def app(self, train, node, rnd):
        weighted = super().app(train, node, rnd)

        def run(msg, context):
            received = msg.content.array_records["arrays"].to_torch_state_dict()
            reply = weighted(msg, context)
            trained = reply.content.array_records["arrays"].to_torch_state_dict()
            norm = math.sqrt(sum(float((trained[k] - received[k]).float().pow(2).sum()) for k in trained))
            bias = list(trained)[-1]
            trained[bias] = trained[bias].clone()
            trained[bias][0] += self.scale * norm
            reply.content["arrays"] = ArrayRecord(trained)
            return reply
        return run


def test_1e12_weight_with_a_bias_push_inside_the_norm_guard_over_20_rounds(caplog):
    caplog.set_level(logging.WARNING)
    final, accuracies, strategy = federation(SLOW_ROUNDS, BiasPush())
    assert all(statuses(strategy, n) == ["ok"] * SLOW_ROUNDS for n in HOSTILE)  # inside every bound: counted, clipped
    assert sum("clipped to weight_factor=2" in r.getMessage() for r in caplog.records) == 2 * SLOW_ROUNDS  # logged per reply
    _close_to_dropped(final, SLOW_ROUNDS)


# -- norms: colluders replying first cannot steer the guard -------------------------------------------
class Huge(Attack):
    def __init__(self, norm=1e30):
        self.norm = norm

    def app(self, train, node, rnd):
        def run(msg, context):
            reply = train(msg, context)
            trained = reply.content.array_records["arrays"].to_torch_state_dict()
            received = msg.content.array_records["arrays"].to_torch_state_dict()
            delta = {k: trained[k] - received[k] for k in trained}
            total = math.sqrt(sum(float(d.pow(2).sum()) for d in delta.values()))
            reply.content["arrays"] = ArrayRecord({k: received[k] + delta[k] * (self.norm / total) for k in trained})
            return reply
        return run


def test_two_colluders_replying_first_with_1e30_norms_are_dropped_every_round():
    final, _, strategy = federation(ROUNDS, Huge(1e30))
    for node in HOSTILE:
        seen = statuses(strategy, node)
        assert all(s.startswith("dropped: update norm") and "x the median norm" in s for s in seen), seen
    assert "this round's first" in statuses(strategy, HOSTILE[0])[0]  # round 1: a held quorum
    assert "accepted last round" in statuses(strategy, HOSTILE[0])[-1]  # later: the last round's norms
    _close_to_dropped(final, ROUNDS)


def test_colluders_with_tiny_norms_first_do_not_get_honest_replies_dropped():
    final, _, strategy = federation(ROUNDS, Huge(1e-6))
    honest = [c["status"] for s in strategy.rounds.values() for c in s.clients if c["node"] not in HOSTILE]
    assert honest and set(honest) == {"ok"}


# -- metrics ------------------------------------------------------------------------------------------
class Metrics(Attack):
    def __init__(self, change):
        self.change = change

    def app(self, train, node, rnd):
        def run(msg, context):
            reply = train(msg, context)
            self.change(reply.content)
            return reply
        return run


def _second_record(content):
    content["more"] = MetricRecord({"num-examples": 10**6})


def _loss_as_list(content):
    content["metrics"]["train_loss"] = [1.0, 2.0, 3.0]


def _nan_loss(content):
    content["metrics"]["train_loss"] = float("nan")


def test_weight_key_in_a_second_metric_record_is_dropped():
    final, _, strategy = federation(ROUNDS, Metrics(_second_record))
    for node in HOSTILE:
        assert all("'num-examples' appears in 2 MetricRecords" in s for s in statuses(strategy, node))
    _close_to_dropped(final, ROUNDS)


def test_metric_sent_as_a_list_is_left_out_of_the_round_metrics(caplog):
    caplog.set_level(logging.WARNING)
    final, _, strategy = federation(ROUNDS, Metrics(_loss_as_list))
    entries = [c for s in strategy.rounds.values() for c in s.clients if c["node"] in HOSTILE]
    assert all("left out of the round's metrics" in c["metrics"] and "train_loss (number)" in c["metrics"]
               for c in entries)
    assert sum("left out of the round's metrics" in r.getMessage() for r in caplog.records) == 2 * ROUNDS
    _close_to_dropped(final, ROUNDS)


def test_metrics_of_the_round_are_the_honest_ones():
    strategy = federation(2, Metrics(_loss_as_list))[2]
    # the inner strategy's metric function ran on one schema: a scalar train_loss
    replies_ok = [c for c in strategy.rounds[2].clients if c["status"] == "ok"]
    assert len(replies_ok) == CLIENTS


def test_non_finite_metric_is_dropped():
    final, _, strategy = federation(ROUNDS, Metrics(_nan_loss))
    for node in HOSTILE:
        assert all("metric 'train_loss' is nan" in s for s in statuses(strategy, node))
    _close_to_dropped(final, ROUNDS)


# -- model state that is not a weight ----------------------------------------------------------------
class NegativeVariance(Attack):
    """An update inside the norm guard that makes BatchNorm's running_var negative in a few channels."""

    def app(self, train, node, rnd):
        def run(msg, context):
            reply = train(msg, context)
            trained = reply.content.array_records["arrays"].to_torch_state_dict()
            trained["bn.running_var"] = trained["bn.running_var"].clone()
            trained["bn.running_var"][:4] = -0.5
            reply.content["arrays"] = ArrayRecord(trained)
            return reply
        return run


class CounterJump(Attack):
    def app(self, train, node, rnd):
        def run(msg, context):
            reply = train(msg, context)
            trained = reply.content.array_records["arrays"].to_torch_state_dict()
            trained["bn.num_batches_tracked"] = trained["bn.num_batches_tracked"] + 2**62
            reply.content["arrays"] = ArrayRecord(trained)
            return reply
        return run


def test_update_making_a_running_variance_negative_is_dropped_before_the_sum():
    final, _, strategy = federation(ROUNDS, NegativeVariance(), model="bn", lr=0.1)
    for node in HOSTILE:
        seen = statuses(strategy, node)
        assert all("makes the running variance 'bn.running_var' negative" in s for s in seen), seen
    _close_to_dropped(final, ROUNDS, "bn", lr=0.1)


def test_counter_jump_of_2_62_is_dropped():
    final, _, strategy = federation(ROUNDS, CounterJump(), model="bn", lr=0.1)
    for node in HOSTILE:
        seen = statuses(strategy, node)
        assert all("integer buffer 'bn.num_batches_tracked' by 4611686018427387" in s for s in seen), seen
    _close_to_dropped(final, ROUNDS, "bn", lr=0.1)


# -- one reply per node per message -------------------------------------------------------------------
def _as_from(reply, node):
    fields = {f: getattr(reply.metadata, f) for f in ("run_id", "message_id", "dst_node_id", "reply_to_message_id",
                                                      "group_id", "created_at", "ttl", "message_type")}
    return Message(metadata=Metadata(src_node_id=node, **fields), content=reply.content)


class Duplicate(Attack):
    def replies(self, reply, msg, node, rnd):
        return [reply, _as_from(reply, node)]  # the same reply (same payload, same nonce) twice


class Foreign(Attack):
    def replies(self, reply, msg, node, rnd):
        return [reply, _as_from(reply, 900 + node)]  # and once as a node the server never sent a message


class Rewritten(Attack):
    """From round 2 on: last round's payload again, its nonce rewritten and its CRC recomputed."""

    def __init__(self):
        self.last = {}

    def replies(self, reply, msg, node, rnd):
        record = reply.content.config_records[P.UPLOAD_RECORD]
        old, self.last[node] = self.last.get(node), (bytes(record[P.PAYLOAD]), record.get(REPLY_TAG))
        if old is not None:
            payload = bytearray(old[0])
            fields = list(HEADER.unpack_from(payload))
            fields[-1] ^= 0x5A5A5A5A  # a nonce never used
            HEADER.pack_into(payload, 0, *fields)
            payload[-4:] = struct.pack("<I", crc32(bytes(payload[:-4])))
            record[P.PAYLOAD], record[REPLY_TAG] = bytes(payload), old[1]
        return [reply]


def test_duplicate_replies_are_dropped():
    final, _, strategy = federation(ROUNDS, Duplicate())
    for rnd, stats in strategy.rounds.items():
        assert [c["status"] for c in stats.clients if c["node"] in HOSTILE] == ["ok", "ok"]
        extra = [c["status"] for c in stats.extra]
        assert len(extra) == 2 and all("a second reply from node" in s for s in extra), extra
        assert stats.aggregated == CLIENTS
    assert abs(final - clean(ROUNDS)) <= TOLERANCE  # as if every node had replied once


def test_replies_from_nodes_never_sent_a_message_are_dropped():
    final, _, strategy = federation(ROUNDS, Foreign())
    for stats in strategy.rounds.values():
        extra = [c["status"] for c in stats.extra]
        assert len(extra) == 2 and all("was sent no train message" in s for s in extra), extra
        assert stats.aggregated == CLIENTS


def test_old_payload_with_a_rewritten_nonce_and_crc_is_dropped():
    final, _, strategy = federation(ROUNDS, Rewritten())
    for node in HOSTILE:
        seen = statuses(strategy, node)
        assert seen[0] == "ok" and all("'reply-tag' does not match the token" in s for s in seen[1:]), seen
    _close_to_dropped(final, ROUNDS)


def test_reply_without_the_tag_is_dropped():
    class Strip(Attack):
        def replies(self, reply, msg, node, rnd):
            del reply.content.config_records[P.UPLOAD_RECORD][REPLY_TAG]
            return [reply]

    final, _, strategy = federation(ROUNDS, Strip())
    for node in HOSTILE:
        assert all("reply has no 'reply-tag'" in s for s in statuses(strategy, node))
    _close_to_dropped(final, ROUNDS)


# -- upload size ------------------------------------------------------------------------------------------
class DensePayload(Attack):
    """A payload of the configured codec's family with every coordinate kept (top-k at ratio 1, 8 bits)."""

    SPEC = "topk(ratio=1.0)+qsgd(bits=8)"

    def message(self, msg, node, rnd):
        self.token = int(msg.content.config_records[P.DOWNLOAD_RECORD][REPLY_TOKEN])
        return msg

    def replies(self, reply, msg, node, rnd):
        record = reply.content.config_records[P.UPLOAD_RECORD]
        g = torch.Generator().manual_seed(rnd)
        update = {k: 0.001 * torch.randn(v.shape, generator=g) for k, v in self.model.items()}
        payload = fedcomp.build_codec(self.SPEC).encode(update, nonce=rnd).payload
        record[P.PAYLOAD], record[P.SPEC] = payload, self.SPEC
        record[REPLY_TAG] = reply_tag(payload, self.token)  # the attacker tags it with the token it was sent
        return [reply]


def test_dense_payload_of_the_codec_family_is_refused():
    attack = DensePayload()
    attack.model = _build("mlp").state_dict()
    final, _, strategy = federation(ROUNDS, attack)
    for node in HOSTILE:
        seen = statuses(strategy, node)
        assert all("exceeds the" in s and "bytes the server asked for" in s for s in seen), seen
    _close_to_dropped(final, ROUNDS)


# -- references the server never sent -----------------------------------------------------------------------
class ForgedBroadcast(Attack):
    """A man in the middle replaces the node's broadcast with a forged full model (its CRC valid)."""

    def message(self, msg, node, rnd):
        forged = {k: torch.randn(v.shape) if v.is_floating_point() else v
                  for k, v in _build("mlp", seed=99).state_dict().items()}
        record = msg.content.config_records[P.DOWNLOAD_RECORD]
        record[P.MODE], record[P.PAYLOADS], record[P.ROUNDS] = "full", [encode_full(forged)], [rnd]
        record[P.BASE_CRC], record[P.REF_CRC] = 0, reference_crc(forged)
        return msg


def test_reply_trained_on_a_forged_broadcast_is_dropped():
    final, _, strategy = federation(ROUNDS, ForgedBroadcast())
    for node in HOSTILE:
        seen = statuses(strategy, node)
        assert all("trained from a reference the server never sent" in s for s in seen), seen
    _close_to_dropped(final, ROUNDS)


def test_sketch_aggregation_checks_the_exact_statistics_too():
    sketch = "sketch(rows=1,cols=2000,ratio=0.05)+qsgd(bits=8)"
    for attack, says in ((NegativeVariance(), "makes the running variance 'bn.running_var' negative"),
                         (CounterJump(), "integer buffer 'bn.num_batches_tracked' by 4611686018427387")):
        _, _, strategy = federation(2, attack, model="bn", lr=0.1, upload=sketch)
        assert strategy.aggregation == "sketch"
        for node in HOSTILE:
            assert all(says in s for s in statuses(strategy, node)), statuses(strategy, node)
        assert all(s.aggregated == CLIENTS - len(HOSTILE) for s in strategy.rounds.values())


def test_a_push_at_9x_the_honest_norm_is_dropped_with_a_tighter_norm_factor():
    """Inside the default bound (norm_factor=10) a push at 9x the honest norm still moves the mean by
    its bounded share (about 3 points over 20 rounds here: the robust-aggregation question); honest
    digits norms stay within 2x their median, so norm_factor=4 drops it and costs honest runs nothing."""
    final, _, strategy = federation(SLOW_ROUNDS, BiasPush(9.0), norm_factor=4.0)
    for node in HOSTILE:
        assert sum("x the median norm" in s for s in statuses(strategy, node)) >= SLOW_ROUNDS - 1
    _close_to_dropped(final, SLOW_ROUNDS, norm_factor=4.0)
