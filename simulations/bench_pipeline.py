"""Benchmark: time from the last reply's arrival to the aggregate, streaming vs batch decoding.

50 simulated clients of ``mlp-large`` reply one after another, a reply every ``--interval``
seconds (default 0.3 s: the round's replies spread over 15 s, as clients on different devices
and links finish seconds apart; the streaming server keeps up as long as its per-reply cost,
printed first, stays below the interval). Both runs
use the same replies and the same grid, polled every 50 ms:

* batch (``CompressedStrategy(streaming=False)``): Flower's loop, collect every reply, then
  decode them all and let FedAvg average the models;
* streaming (the default): each reply is decoded into a running mean as soon as it is pulled.

Prints the post-last-reply time of each and their ratio (absolute times are noise on a shared
CPU; the ratio is the figure)::

    python -m fedcomp.simulations.bench_pipeline [--clients 50] [--upload 'powersgd(rank=4)'] [--model mlp-large]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

import fedcomp
from fedcomp.clients.mod import compression_mod
from fedcomp.simulations import task
from fedcomp.simulations.harness import InProcessGrid
from fedcomp.strategies.wrapper import CompressedStrategy


class ScheduledGrid(InProcessGrid):
    """The experiment harness's grid (each node's ``compression_mod`` around :func:`_train`), with
    reply i pullable only ``(i + 1) * interval`` s after the push."""

    def __init__(self, nodes: int, interval: float, poll: float = 0.05) -> None:
        contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
                    for n in range(1, nodes + 1)}
        super().__init__(_train, contexts, mods=[compression_mod])
        self.interval, self.poll = interval, poll
        self.due: dict[str, float] = {}
        self.last_available = 0.0

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        start = time.monotonic()
        for i, key in enumerate(ids):
            self.due[key] = start + (i + 1) * self.interval
        if ids:  # (the evaluation round pushes nothing)
            self.last_available = start + len(ids) * self.interval
        return ids

    def pull_messages(self, ids):
        now = time.monotonic()
        return super().pull_messages([k for k in ids if k in self.ready and self.due[k] <= now])

    def send_and_receive(self, messages, *, timeout=None):
        """Flower's contract: every reply, then return (polling as Flower's in-memory grid does)."""
        pending, replies = set(self.push_messages(messages)), []
        while pending:
            got = self.pull_messages(pending)
            pending -= {m.metadata.reply_to_message_id for m in got}
            replies += got
            if pending:
                time.sleep(self.poll)
        return replies


def _train(msg: Message, context: Context) -> Message:
    """A ClientApp stand-in: the received model moved by a node-seeded step."""
    model = msg.content.array_records["arrays"].to_torch_state_dict()
    g = torch.Generator().manual_seed(context.node_id)
    trained = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in model.items()}
    return Message(RecordDict({"arrays": ArrayRecord(trained),
                               "metrics": MetricRecord({"num-examples": 10 + context.node_id})}), reply_to=msg)


def post_last_reply_seconds(model, upload: str, clients: int, interval: float, streaming: bool) -> float:
    strategy = CompressedStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=clients),
                                  upload=upload, download="none()", streaming=streaming)
    grid = ScheduledGrid(clients, interval)
    ready = []
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model), num_rounds=1,
                   evaluate_fn=lambda r, arrays: ready.append(time.monotonic()) or None)
    return ready[-1] - grid.last_available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--model", default="mlp-large", choices=task.MODELS)
    parser.add_argument("--upload", default="powersgd(rank=4)")
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between replies")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    model = task.build_model(args.model, seed=0).state_dict()
    codec = fedcomp.build_codec(args.upload)
    update = {k: 0.01 * torch.randn_like(v) for k, v in model.items()}
    payload, layout = codec.encode(update, state={}).payload, fedcomp.Layout.of(update)
    t = time.perf_counter()
    codec.decode(payload, layout)
    decode_s = time.perf_counter() - t
    per_reply = post_last_reply_seconds(model, args.upload, 10, 0.01, streaming=False) / 10
    interval = args.interval
    print(f"{args.model}: {layout.numel:,} parameters, upload {codec.spec}, decode {decode_s * 1e3:.0f} ms, "
          f"server cost {per_reply * 1e3:.0f} ms per reply (batch), {args.clients} clients, "
          f"a reply every {interval * 1e3:.0f} ms")
    rows = []
    for _ in range(args.repeats):
        batch = post_last_reply_seconds(model, args.upload, args.clients, interval, streaming=False)
        stream = post_last_reply_seconds(model, args.upload, args.clients, interval, streaming=True)
        rows.append((batch, stream))
        print(f"  last reply -> aggregate: batch {batch:.3f} s, streaming {stream:.3f} s, ratio {batch / stream:.1f}x")
    rows.sort(key=lambda r: r[0] / r[1])
    batch, stream = rows[len(rows) // 2]
    print(f"median: batch {batch:.3f} s, streaming {stream:.3f} s: streaming cuts the post-last-reply time "
          f"{batch / stream:.1f}x")


if __name__ == "__main__":
    main()
