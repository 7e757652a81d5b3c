"""Overhead of fedcomp with ``none()`` against plain Flower FedAvg, same task, same engine.

Runs Flower's simulation engine (``flwr.simulation.run_simulation``) twice per repeat, on the
default digits task with the apps' training code:

* ``plain``: FedAvg, a ClientApp without mods (Flower's own ArrayRecord transport);
* ``fedcomp``: ``CompressedStrategy(FedAvg, upload='none()', error_feedback=False)`` and the
  ClientApp with ``compression_mod``.

Wall time is taken inside the ServerApp from the end of the round-0 evaluation to the end of
the last round (engine start-up excluded), and the ratio fedcomp / plain is printed; repeats
alternate the two to spread the machine's load drift over both.

    python -m fedcomp.simulations.bench_overhead --rounds 10 --clients 10 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.server import Grid  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fedcomp.clients.mod import compression_mod  # noqa: E402
from fedcomp.simulations import task  # noqa: E402
from fedcomp.strategies.wrapper import CompressedStrategy  # noqa: E402

CFG = {"model": "mlp", "local-epochs": 1, "lr": 0.3, "batch-size": 32, "seed": 0, "partition-alpha": 0.5}
_TIMES: dict[str, list[float]] = {}


def _train(msg: Message, context: Context) -> Message:
    """simulations/client_app.py's train, with the run config fixed in CFG (run_simulation passes none)."""
    seed = CFG["seed"]
    model = task.build_model(CFG["model"], seed=seed)
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    train_set, _ = task.load_digits_split(seed=seed)
    pid, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    x, y = task.partition(train_set, parts, pid, CFG["partition-alpha"], seed)
    server_round = int(msg.content.config_records["config"].get("server-round", 0))
    loss = task.train(model, x, y, epochs=CFG["local-epochs"], lr=CFG["lr"], batch_size=CFG["batch-size"],
                      seed=seed * 100_003 + server_round * 1009 + pid, device="cpu")
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"train_loss": float(loss), "num-examples": int(x.shape[0])})}),
                   reply_to=msg)


plain_client = ClientApp()
plain_client.train()(_train)
fedcomp_client = ClientApp(mods=[compression_mod])
fedcomp_client.train()(_train)


def _server(kind: str, rounds: int, out_file: str) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        model = task.build_model(CFG["model"], seed=CFG["seed"])
        _, test = task.load_digits_split(seed=CFG["seed"])
        x_test, y_test = test.tensors
        inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
        strategy = inner if kind == "plain" else CompressedStrategy(inner, upload="none()", error_feedback=False)
        marks: dict[int, float] = {}
        acc: dict[int, float] = {}

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            _, a = task.evaluate(model, x_test, y_test, device="cpu")
            marks[server_round], acc[server_round] = time.perf_counter(), a
            return MetricRecord({"accuracy": a})

        strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds,
                       train_config=ConfigRecord({}), evaluate_fn=evaluate)
        with open(out_file, "w") as f:
            json.dump({"seconds": marks[rounds] - marks[0], "accuracy": acc[rounds]}, f)

    return app


def main(argv=None) -> None:
    from flwr.simulation import run_simulation

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import tempfile

    results: dict[str, list[dict]] = {"plain": [], "fedcomp": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = ("plain", "fedcomp") if rep % 2 == 0 else ("fedcomp", "plain")
            for kind in order:
                out = os.path.join(tmp, f"{kind}{rep}.json")
                run_simulation(_server(kind, args.rounds, out), plain_client if kind == "plain" else fedcomp_client,
                               num_supernodes=args.clients, backend_config={"client_resources": {"num_cpus": 1}})
                with open(out) as f:
                    res = json.load(f)
                results[kind].append(res)
                print(f"{kind:8s} repeat {rep}: {res['seconds']:.1f} s for {args.rounds} rounds, accuracy {res['accuracy']:.4f}",
                      flush=True)
    plain = statistics.median(r["seconds"] for r in results["plain"])
    comp = statistics.median(r["seconds"] for r in results["fedcomp"])
    print(f"median wall time: plain FedAvg {plain:.1f} s, fedcomp none() {comp:.1f} s, ratio {comp / plain:.3f} "
          f"(target <= 1.05: {'met' if comp / plain <= 1.05 else 'NOT met'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "ratio": comp / plain}, f, indent=1)


if __name__ == "__main__":
    main()
