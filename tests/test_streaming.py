"""Streaming aggregation: replies decoded into the aggregate as they arrive, equal to the batch path."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvg, FedMedian, FedProx

from fedcomp.clients.mod import compression_mod
from fedcomp import protocol as P
from fedcomp.aggregate import Accumulator
from fedcomp.strategies.streaming import StreamingGrid, can_stream
from fedcomp.strategies.wrapper import CompressedStrategy


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(64, generator=g), "steps": torch.tensor(5)}


def _trainer(node: int, server_round: int):
    def app(msg: Message, context: Context) -> Message:
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        g = torch.Generator().manual_seed(100 * node + server_round)
        trained = {k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v + 1
                   for k, v in received.items()}
        metrics = MetricRecord({"num-examples": 5 + 7 * node, "train_loss": 1.0 / node})
        return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": metrics}), reply_to=msg)

    return app


class PushPullGrid:
    """A Grid stand-in: pushed messages go through the client mod at once; ``pull_messages``
    releases ``per_pull`` replies per call, so replies arrive over several pulls."""

    def __init__(self, contexts, per_pull=1, tamper=None):
        self.contexts, self.per_pull, self.tamper = contexts, per_pull, tamper or {}
        self.ready: dict[str, Message] = {}
        self.events: list[str] = []
        self.round = 0

    def get_node_ids(self):
        return sorted(self.contexts)

    def push_messages(self, messages):
        ids = []
        self.round += 1
        for i, msg in enumerate(messages):
            node = msg.metadata.dst_node_id
            reply = compression_mod(msg, self.contexts[node], _trainer(node, self.round))
            if node in self.tamper:
                self.tamper[node](reply)
            key = f"{self.round}-{i}"
            reply.metadata.__dict__["_reply_to_message_id"] = key  # what Flower's reply_to would carry
            self.ready[key] = reply
            ids.append(key)
        return ids

    def pull_messages(self, message_ids):
        wanted = set(message_ids)
        out = [self.ready.pop(k) for k in [k for k in sorted(self.ready) if k in wanted][: self.per_pull]]
        self.events.append(f"pull {len(out)}")
        return out

    def send_and_receive(self, messages, *, timeout=None):  # Flower's batch semantics
        ids = set(self.push_messages(messages))
        replies = []
        while ids:
            got = self.pull_messages(ids)
            ids -= {m.metadata.reply_to_message_id for m in got}
            replies += got
        return replies


def _contexts(n=5):
    return {node: Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})
            for node in range(1, n + 1)}


def _corrupt(reply):
    record = reply.content.config_records[P.UPLOAD_RECORD]
    record[P.PAYLOAD] = record[P.PAYLOAD][:-1] + bytes([record[P.PAYLOAD][-1] ^ 1])


def _run(inner, streaming, rounds=3, tamper=None):
    strategy = CompressedStrategy(inner, upload="topk(ratio=0.1)+qsgd(bits=4)", download="topk(ratio=0.2)+kbit(bits=8)",
                                  streaming=streaming)
    grid = PushPullGrid(_contexts(), per_pull=2, tamper=tamper)
    metrics = []
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=rounds,
                            evaluate_fn=lambda r, arrays: metrics.append(arrays.to_torch_state_dict()) or None)
    return strategy, result, metrics


def _inner(kind):
    common = dict(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=5)
    return {"fedavg": FedAvg, "fedprox": FedProx, "fedadam": FedAdam}[kind](**common)


@pytest.mark.parametrize("kind", ["fedavg", "fedprox", "fedadam"])
def test_streamed_aggregate_equals_batch_aggregate(kind):
    tamper = {3: _corrupt}
    stream, res_s, models_s = _run(_inner(kind), True, tamper=tamper)
    batch, res_b, models_b = _run(_inner(kind), False, tamper=tamper)
    assert len(models_s) == len(models_b) == 4
    # one aggregator either way: the float64 sum does not depend on the order replies arrive in
    for a, b in zip(models_s, models_b):
        for name in a:
            assert a[name].dtype == b[name].dtype
            assert torch.equal(a[name], b[name]), name
    for r in (1, 2, 3):  # same replies dropped, for the same reason, in both
        s = sorted((c["node"], c["status"][:40]) for c in stream.rounds[r].clients)
        assert s == sorted((c["node"], c["status"][:40]) for c in batch.rounds[r].clients)
        assert [st for node, st in s if node == 3][0].startswith("dropped")
        ms, mb = res_s.train_metrics_clientapp[r], res_b.train_metrics_clientapp[r]
        assert ms["train_loss"] == pytest.approx(mb["train_loss"], rel=1e-12)


def test_replies_are_decoded_while_others_are_still_outstanding():
    strategy = CompressedStrategy(_inner("fedavg"), upload="topk(ratio=0.1)", download="none()")
    grid = PushPullGrid(_contexts(), per_pull=1)
    decoded_at = []
    original = strategy._receive

    def spy(server_round, msg):
        decoded_at.append(len(grid.ready))  # replies not yet pulled when this one is decoded
        original(server_round, msg)

    strategy._receive = spy
    strategy.start(grid=grid, initial_arrays=ArrayRecord(_model()), num_rounds=1)
    assert decoded_at[:5] == [4, 3, 2, 1, 0]  # each reply decoded right after its pull, before the next


def test_strategies_that_need_every_reply_fall_back_to_collecting():
    assert can_stream(FedAvg()) and can_stream(FedAdam()) and not can_stream(FedMedian())
    strategy, _, models = _run(FedMedian(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=5), True, rounds=2)
    assert strategy._round_state is None and len(models) == 3
    assert all(torch.isfinite(m["w"]).all() for m in models)


def test_running_sum_is_the_weighted_mean():
    import fedcomp

    g = torch.Generator().manual_seed(0)
    updates = [{"x": torch.randn(100, generator=g), "n": torch.tensor([i])} for i in range(7)]
    weights = [1.0, 2.0, 0.5, 3.0, 1.0, 4.0, 2.5]
    acc = Accumulator(fedcomp.build_codec("none()"), fedcomp.Layout.of(updates[0]))
    for u, w in zip(updates, weights):
        acc.add_dense(u, w)
    expected = sum(w * u["x"].double() for u, w in zip(updates, weights)) / sum(weights)
    torch.testing.assert_close(acc.sum()["x"] / sum(weights), expected, rtol=1e-12, atol=1e-12)
    assert acc.mean()["n"].dtype == torch.int64 and acc.count == 7


def test_streaming_grid_honours_timeout_and_returns_what_arrived():
    class Silent:
        def push_messages(self, messages):
            return ["a", "b"]

        def pull_messages(self, ids):
            return []

    seen = []
    grid = StreamingGrid(Silent(), seen.append, poll_interval=0.01)
    assert list(grid.send_and_receive([], timeout=0.1)) == [] and seen == []


# -- client side: segment bytes copied to the host while the next segment encodes ---------------

import fedcomp  # noqa: E402
from fedcomp.wire import Writer  # noqa: E402


def test_flushed_writer_bytes_equal_one_piece_bytes():
    g = torch.Generator().manual_seed(1)
    parts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (5, 0, 17, 300)]
    flushed, whole = Writer(), Writer()
    for p in parts:
        flushed.tensor(p)
        flushed.flush()
        whole.tensor(p)
    assert flushed.getvalue(b"12345678", 7, 9) == whole.getvalue(b"12345678", 7, 9)


def _tensors(device):
    g = torch.Generator().manual_seed(2)
    return {f"layer{i}": torch.randn(64, 33, generator=g).to(device) for i in range(6)}


@pytest.mark.parametrize("spec", ["kbit(bits=4)", "topk(ratio=0.05,scope='tensor')+qsgd(bits=4)", "sign()",
                                  "powersgd(rank=2)"])
def test_per_tensor_encode_roundtrips_through_flushed_segments(spec):
    codec = fedcomp.build_codec(spec)
    tensors = _tensors("cpu")
    enc = codec.encode(tensors, nonce=3, state={})
    out = codec.decode(enc.payload, fedcomp.Layout.of(tensors))
    assert all(torch.equal(out[k], enc.decoded[k]) for k in tensors)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["kbit(bits=4)", "topk(ratio=0.05,scope='tensor')+qsgd(bits=4)", "sign()"])
def test_cuda_encode_overlapping_copies_gives_the_bytes_of_what_it_decoded(spec):
    codec = fedcomp.build_codec(spec)
    tensors = _tensors("cuda")
    for _ in range(3):  # reuse of freed device memory must not corrupt copies in flight
        enc = codec.encode(tensors, nonce=3, state={})
        out = codec.decode(enc.payload, fedcomp.Layout.of(tensors))
        assert all(torch.equal(out[k], enc.decoded[k].cpu()) for k in tensors)
