"""Shared fixtures."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def task_identity():
    """Flower Messages need a run/task identity, which a Flower process sets; restore it afterwards."""
    def current(name):
        try:
            return getattr(TaskIdentity, name)
        except RuntimeError:  # not set in this process
            return None

    saved = {name: current(name) for name in ("run_id", "task_id", "node_id")}
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    yield
    for name, value in saved.items():  # the public setters take None back
        setattr(TaskIdentity, name, value)


class FakeGrid:
    """The part of a Flower Grid that strategies' configure_* calls use: the connected node ids."""

    def __init__(self, node_ids):
        self.node_ids = node_ids

    def get_node_ids(self):
        return self.node_ids


class ModGrid(FakeGrid):
    """A Grid whose pushed messages run at once through the node's ``mods`` (the first one outermost),
    ``compression_mod`` and :func:`shift_trainer`; ``sent`` records (node, round, download record)."""

    def __init__(self, contexts, mods=()):
        super().__init__(sorted(contexts))
        self.contexts, self.mods, self.ready, self.sent = contexts, mods, {}, []

    def push_messages(self, messages):
        from fedcomp import protocol as P
        from fedcomp.clients.mod import compression_mod

        ids = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            record = msg.content.config_records[P.DOWNLOAD_RECORD]
            rnd = int(record[P.ROUND])
            self.sent.append((node, rnd, dict(record)))

            def call(m, c, node=node, rnd=rnd):
                return compression_mod(m, c, shift_trainer(node, rnd))
            for mod in reversed(self.mods):
                call = (lambda m, c, mod=mod, nxt=call: mod(m, c, nxt))
            reply = call(msg, self.contexts[node])
            mid = str(len(self.sent))
            reply.metadata.__dict__["_reply_to_message_id"] = mid
            self.ready[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self.ready.pop(k) for k in list(ids) if k in self.ready]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


# -- shared helpers for client/strategy tests (import them: `from conftest import ...`) -------------
def tiny_model(seed: int = 0, rows: int = 64, cols: int = 50, *, half: bool = False, steps: int = 3):
    """A small model: a rows x cols weight, a bias, optionally an fp16 tensor, an int64 counter."""
    import torch

    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(rows, cols, generator=g), "b": torch.randn(rows, generator=g)}
    if half:
        model["h"] = torch.randn(cols, generator=g).half()
    model["steps"] = torch.tensor(steps)
    return model


def shift_trainer(node: int, server_round: int, *, step: float = 0.05, stride: int = 1000, metrics=None):
    """A ClientApp stand-in: moves the received model by a seeded node- and round-dependent step
    (float tensors keep their dtype; integer ones count up) and reports ``metrics`` (default
    ``num-examples`` 10 + node)."""
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    def app(msg, context):
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        g = torch.Generator().manual_seed(stride * node + server_round)
        trained = {k: (v + step * torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v + 1
                   for k, v in received.items()}
        record = MetricRecord(metrics if metrics is not None else {"num-examples": 10 + node})
        return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": record}), reply_to=msg)

    return app


def node_context(node: int, **node_config):
    """A fresh Flower Context for ``node`` with this node config (keys with '-' via **{...})."""
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=node, node_config=node_config, state=RecordDict(), run_config={})


def run_round(strategy, model, contexts, server_round, *, app=None, present=None, tamper=None, lose=()):
    """One round as Flower drives it, in process: configure_train, each sampled node's
    ``compression_mod`` around ``app(node, round)`` (default :func:`shift_trainer`), then
    aggregate_train. ``present``: the connected nodes (default all of ``contexts``);
    ``tamper(node, reply)`` may edit a reply; replies of nodes in ``lose`` never arrive.
    Returns (the new model, or the old one when nothing was aggregated; replies; messages)."""
    from flwr.app import ArrayRecord, ConfigRecord

    from fedcomp.clients.mod import compression_mod

    app = app or shift_trainer
    grid = FakeGrid(sorted(present if present is not None else contexts))
    messages = list(strategy.configure_train(server_round, ArrayRecord(model), ConfigRecord({}), grid))
    replies = []
    for msg in messages:
        node = msg.metadata.dst_node_id
        reply = compression_mod(msg, contexts[node], app(node, server_round))
        if tamper is not None:
            tamper(node, reply)
        if node not in lose:
            replies.append(reply)
    arrays, _ = strategy.aggregate_train(server_round, replies)
    return (arrays.to_torch_state_dict() if arrays is not None else model), replies, messages
