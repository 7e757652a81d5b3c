"""Every Flower strategy, wrapped by :class:`CompressedStrategy` and unwrapped, on the project's tasks.

Integrated the way the README tells users to: the Flower strategy object (``flwr.serverapp.strategy``)
wrapped as it is, the project's ClientApp ``train`` function behind ``compression_mod``. The loop is
the one Flower's ``Strategy.start`` runs, in one process (no Ray, no SuperLink): each round
``configure_train`` samples nodes and builds their messages, each node's mod + ``train`` answers,
``aggregate_train`` returns the new model, the server evaluates it on the task's test set.
Unwrapped runs send the same messages without fedcomp (the mod passes them through).

Command (rows appended to ``--out``, one JSON line per run; ``--table`` prints the Markdown table)::

    python -m fedcomp.simulations.strategy_study --task digits --model mlp --rounds 30 --clients 10
    python -m fedcomp.simulations.strategy_study --table
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent.parent / "results" / "strategies" / "results.jsonl"


def strategies(clients: int, fraction: float, lr: float) -> dict:
    """Flower's strategies with the settings the study uses (Flower's defaults unless stated)."""
    from flwr.serverapp import strategy as s

    common = {"fraction_train": fraction, "fraction_evaluate": 0.0, "min_available_nodes": clients,
              "min_train_nodes": max(2, int(clients * fraction))}
    return {
        "FedAvg": lambda: s.FedAvg(**common),
        "FedProx": lambda: s.FedProx(**common, proximal_mu=0.01),  # the project's client ignores the term
        "FedAvgM": lambda: s.FedAvgM(**common, server_momentum=0.9),
        "FedAdam": lambda: s.FedAdam(**common, eta=0.01, eta_l=0.05),
        "FedAdagrad": lambda: s.FedAdagrad(**common, eta=0.01, eta_l=0.05),
        "FedYogi": lambda: s.FedYogi(**common, eta=0.01, eta_l=0.05),
        "FedMedian": lambda: s.FedMedian(**common),
        "FedTrimmedAvg": lambda: s.FedTrimmedAvg(**common, beta=0.2),
        "Krum": lambda: s.Krum(**common, num_malicious_nodes=1),
        "MultiKrum": lambda: s.MultiKrum(**common, num_malicious_nodes=1, num_nodes_to_select=5),
        "Bulyan": lambda: s.Bulyan(**common, num_malicious_nodes=1),
        "QFedAvg": lambda: s.QFedAvg(client_learning_rate=lr, **common),
    }


def run_one(name: str, wrapped: bool, *, task_name: str, model_name: str, rounds: int, clients: int,
            fraction: float, lr: float, seed: int, upload: str | None = None, error_feedback: bool = True) -> dict:
    """One run of strategy ``name``; returns its config, accuracy per round, bytes and time."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

    from fedcomp.clients.mod import compression_mod
    from fedcomp.msgsize import message_bytes
    from fedcomp.simulations import client_app, task
    from fedcomp.strategies.wrapper import CompressedStrategy

    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1  # what a Flower process sets
    torch.set_num_threads(1)
    # Flower samples nodes with the process-global random: seeded per run, a seed picks the same clients
    # each round whatever ran before in the process, and runs of one seed are paired (dense included)
    random.seed(seed)
    inner = strategies(clients, fraction, lr)[name]()
    settings = ({} if upload is None else {"upload": upload}) | ({} if error_feedback else {"error_feedback": False})
    strategy = CompressedStrategy(inner, **settings) if wrapped else inner
    run_config = {"seed": seed, "task": task_name, "model": model_name, "local-epochs": 1, "lr": lr,
                  "batch-size": 32, "partition-alpha": 0.5}
    contexts = {100 + p: Context(run_id=1, node_id=100 + p, node_config={"partition-id": p, "num-partitions": clients},
                                 state=RecordDict(), run_config=run_config) for p in range(clients)}
    grid = _Grid(sorted(contexts))
    model = task.build_model(model_name, seed=seed, task=task_name)
    x_test, y_test = task.load_test(task_name, seed, num_partitions=clients)
    arrays = ArrayRecord(model.state_dict())
    rows, up, t0 = [], 0, time.perf_counter()
    for rnd in range(1, rounds + 1):
        messages = list(strategy.configure_train(rnd, arrays, ConfigRecord({"server-round": rnd}), grid))
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            reply = compression_mod(msg, contexts[node], client_app.train)
            up += message_bytes(reply.content)
            replies.append(reply)
        new, _ = strategy.aggregate_train(rnd, replies)
        arrays = new if new is not None else arrays
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = task.evaluate(model, x_test, y_test, device="cpu")
        finite = all(torch.isfinite(v).all() for v in model.state_dict().values() if v.is_floating_point())
        rows.append({"round": rnd, "accuracy": accuracy, "loss": loss, "upload_bytes": up, "finite": bool(finite)})
    resolved = strategy.config.upload if wrapped else "dense"  # 'auto' resolved by the wrapper at round 1
    return {"strategy": name, "wrapped": wrapped, "upload": resolved,
            "task": task_name, "model": model_name, "rounds": rows, "clients": clients, "fraction": fraction,
            "lr": lr, "seed": seed, "seconds": round(time.perf_counter() - t0, 1)}


class _Grid:
    """The one method of Flower's Grid that strategies call in ``configure_train``."""

    def __init__(self, node_ids):
        self._ids = list(node_ids)

    def get_node_ids(self):
        return list(self._ids)


def table(path: Path = OUT) -> str:
    """Markdown table: each strategy and task, unwrapped vs wrapped (mean accuracy of the last 5 rounds)."""
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def tail(run):
        return 100 * statistics.mean(r["accuracy"] for r in run["rounds"][-5:])

    lines = ["| task | strategy | unwrapped % | wrapped % | upload | gap (pt) | upload x |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["task"], r["model"], r["rounds"][-1]["round"], r["clients"], r["fraction"]) for r in runs})
    for key in keys:
        group = [r for r in runs if (r["task"], r["model"], r["rounds"][-1]["round"], r["clients"], r["fraction"]) == key]
        for name in strategies(1, 1.0, 0.1):
            plain = [r for r in group if r["strategy"] == name and not r["wrapped"]]
            for w in (r for r in group if r["strategy"] == name and r["wrapped"]):
                base = tail(plain[-1]) if plain else float("nan")
                ratio = plain[-1]["rounds"][-1]["upload_bytes"] / w["rounds"][-1]["upload_bytes"] if plain else float("nan")
                lines.append(f"| {key[0]}/{key[1]}, {key[3]} clients x {key[4]:g}, {key[2]} rounds | {name} | {base:.2f} | "
                             f"{tail(w):.2f} | `{w['upload']}` | {tail(w) - base:+.2f} | {ratio:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="strategies (default: all)")
    parser.add_argument("--task", default="digits")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--upload", default=None, help="wrapped runs' upload spec (default: the wrapper's)")
    parser.add_argument("--only", choices=("wrapped", "unwrapped"), default=None)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--table", action="store_true", help="print the table from --out and exit")
    args = parser.parse_args(argv)
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)  # one INFO line per round and strategy otherwise
    if args.table:
        print(table(args.out))
        return
    names = args.names or list(strategies(1, 1.0, 0.1))
    unknown = sorted(set(names) - set(strategies(1, 1.0, 0.1)))
    if unknown:
        parser.error(f"unknown strategies {unknown}; allowed: {sorted(strategies(1, 1.0, 0.1))}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    modes = [m for m in (False, True) if args.only is None or m == (args.only == "wrapped")]
    for name in names:
        for wrapped in modes:
            run = run_one(name, wrapped, task_name=args.task, model_name=args.model, rounds=args.rounds,
                          clients=args.clients, fraction=args.fraction, lr=args.lr, seed=args.seed,
                          upload=args.upload if wrapped else None)
            with args.out.open("a") as f:
                f.write(json.dumps(run) + "\n")
            last = run["rounds"][-1]
            print(f"{name:14s} {'wrapped' if wrapped else 'plain':8s} acc {100 * last['accuracy']:.2f}% "
                  f"upload {last['upload_bytes']:,} B  {run['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
