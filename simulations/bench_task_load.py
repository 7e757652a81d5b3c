"""Per-message data cost of the ClientApp, per task: the first message of a worker process and the next ones.

Flower starts the ClientApp's ``train`` once per message, in a long-lived worker process; the
task's loaders are memoised per process (and the parsed offline data sets cached on disk under
``$FEDCOMP_CACHE_DIR`` or ``~/.cache/fedcomp``). This script calls the project's
``client_app.train`` handler with real Flower messages in a fresh process and splits each call
into data loading (``task.load_partition``, timed on its own first) and the whole handler.

    python -m fedcomp.simulations.bench_task_load --task mnist --model cnn-bn --clients 10
    python -m fedcomp.simulations.bench_task_load --task stdlib-chars --model char-lstm --clients 1000
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="digits")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--messages", type=int, default=3)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedcomp.simulations import client_app, task

    torch.set_num_threads(1)
    imports = time.perf_counter() - t0
    cfg = {"task": args.task, "model": args.model, "seed": 0, "local-epochs": 1, "lr": 0.05,
           "batch-size": 32, "partition-alpha": 0.5}
    loads = []
    for i in range(args.messages):
        pid = (7 * i) % args.clients
        t = time.perf_counter()
        task.load_partition(args.task, pid, args.clients, 0.5, 0)
        loads.append(time.perf_counter() - t)
    print(f"{args.task}: imports {imports:.2f} s; load_partition per message "
          + ", ".join(f"{x * 1000:.1f} ms" for x in loads) + " (first in a fresh process, then memoised)")
    model = task.build_model(args.model, 0, args.task)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1  # what a Flower process sets
    for i in range(args.messages):
        pid = (7 * i + 1) % args.clients
        msg = Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                  "config": ConfigRecord({"server-round": i + 1})}),
                      dst_node_id=pid + 1, message_type="train")
        context = Context(run_id=1, node_id=pid + 1, node_config={"partition-id": pid, "num-partitions": args.clients},
                          state=RecordDict(), run_config=cfg)
        t = time.perf_counter()
        reply = client_app.train(msg, context)
        total = time.perf_counter() - t
        t = time.perf_counter()
        task.load_partition(args.task, pid, args.clients, 0.5, 0)
        load = time.perf_counter() - t
        print(f"message {i + 1}: handler {total:.2f} s (training included), of which data {load * 1000:.1f} ms; "
              f"{int(reply.content.metric_records['metrics']['num-examples'])} examples")


if __name__ == "__main__":
    main()
