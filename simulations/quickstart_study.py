"""Flower's quickstart-pytorch app, not the project's own, with fedcomp as the README integrates it.

The app is the copy under ``tests/apps/quickstart_pytorch`` (Flower's CNN, its local SGD with
momentum 0.9 at lr 0.1, FedAvg, its central evaluation; scikit-learn's digits scaled to
3 x 32 x 32 in place of CIFAR-10). Its ClientApp (with ``compression_mod``) answers Flower's
``Strategy.start`` in one process (:class:`fedcomp.simulations.harness.InProcessGrid`), ten nodes,
every node every round; the strategy is ``FedAvg`` unwrapped, or ``CompressedStrategy(FedAvg(...),
**settings)`` (no settings: the defaults). Paired seeds fix the initial model and who trains.
Accuracy is the app's central evaluation, mean of the last 3 rounds (the app's own curve is noisy).

    python -m fedcomp.simulations.quickstart_study --seeds 0 1 2 --rounds 20 \\
        --scheme dense --scheme defaults --scheme 'upload=topk(ratio=0.01)+qsgd(bits=4)'
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "tests" / "apps" / "quickstart_pytorch"
TAIL = 3


def _app():
    if str(APP) not in sys.path:
        sys.path.insert(0, str(APP))
    from pytorchexample import client_app, server_app, task

    return client_app, server_app, task


def parse_scheme(text: str) -> tuple[bool, dict]:
    """``dense``, ``defaults``, or ``key=value;key=value`` settings of the wrapper (values as JSON
    where they parse, else strings): (wrapped, settings)."""
    if text == "dense":
        return False, {}
    if text == "defaults":
        return True, {}
    settings = {}
    for part in text.split(";"):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"scheme {text!r}: expected 'dense', 'defaults' or 'key=value;key=value'")
        try:
            settings[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            settings[key.strip()] = value
    return True, settings


def run(seed: int, rounds: int, wrapped: bool, clients: int = 10, **settings) -> dict:
    """One run; accuracy per round (round 0 first), upload/download bytes and the resolved specs."""
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.simulations.harness import InProcessGrid, _identity
    from fedcomp.strategies import CompressedStrategy

    client_app, server_app, task = _app()
    torch.set_num_threads(1)
    _identity()
    random.seed(seed)
    cfg = {"batch-size": 32, "local-epochs": 1}
    contexts = {100 + p: Context(run_id=1, node_id=100 + p, node_config={"partition-id": p, "num-partitions": clients},
                                 state=RecordDict(), run_config=dict(cfg)) for p in range(clients)}
    grid = InProcessGrid(client_app.app, contexts)
    inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=clients, min_train_nodes=clients)
    strategy = CompressedStrategy(inner, **settings) if wrapped else inner
    accuracies, up, down = [], [0, 0], [0, 0]

    def evaluate(server_round, arrays):
        metrics = server_app.global_evaluate(server_round, arrays)
        accuracies.append(float(metrics["accuracy"]))
        if server_round:
            sent, received = grid.sent.get("train", 0), grid.received.get("train", 0)
            stats = strategy.rounds[server_round] if wrapped else None
            up[0] += received
            up[1] += stats.upload_bytes_dense if stats else received
            down[0] += sent
            down[1] += stats.download_bytes_dense if stats else sent
        grid.reset()
        return metrics

    torch.manual_seed(seed)  # the app builds its model unseeded: the seed fixes it
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.ERROR)
    t0 = time.perf_counter()
    try:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(task.Net().state_dict()),
                       train_config=ConfigRecord({"lr": 0.1}), num_rounds=rounds, evaluate_fn=evaluate)
    finally:
        flwr_log.setLevel(level)
    return {"seed": seed, "rounds": rounds, "wrapped": wrapped, "settings": settings,
            "upload": str(strategy.config.upload) if wrapped else "dense",
            "download": " | ".join(t.codec.spec for t in strategy.tiers) if wrapped else "dense",
            "accuracy": accuracies, "upload_x": up[1] / up[0], "download_x": down[1] / down[0],
            "seconds": round(time.perf_counter() - t0, 1)}


def tail(record: dict) -> float:
    return 100 * statistics.mean(record["accuracy"][-TAIL:])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--scheme", action="append", default=[], help="dense, defaults, or 'key=value;...'")
    parser.add_argument("--json", type=Path, default=None, help="append one JSON line per run")
    args = parser.parse_args(argv)
    try:
        schemes = [(text, *parse_scheme(text)) for text in (args.scheme or ["dense", "defaults"])]
    except ValueError as exc:
        parser.error(str(exc))
    results: dict[str, list[dict]] = {}
    for text, wrapped, settings in schemes:
        for seed in args.seeds:
            record = run(seed, args.rounds, wrapped, **settings)
            record["scheme"] = text
            results.setdefault(text, []).append(record)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                with args.json.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            print(f"{text:40s} seed {seed} last-{TAIL} {tail(record):6.2f}% up {record['upload_x']:.1f}x "
                  f"{record['seconds']:.0f} s", flush=True)
    base = {r["seed"]: tail(r) for r in results.get("dense", [])}
    print(f"\n| scheme | resolved upload | last-{TAIL} % per seed | mean | vs dense (min..max) | up x | down x |")
    print("|---|---|---|---:|---|---:|---:|")
    for text, records in results.items():
        accs = [tail(r) for r in records]
        gaps = [tail(r) - base[r["seed"]] for r in records if r["seed"] in base]
        gap = f"{statistics.mean(gaps):+.2f} ({min(gaps):+.2f}..{max(gaps):+.2f})" if gaps and text != "dense" else ""
        print(f"| {text} | `{records[0]['upload']}` | {' / '.join(f'{a:.1f}' for a in accs)} | "
              f"{statistics.mean(accs):.2f} | {gap} | {statistics.mean(r['upload_x'] for r in records):.1f} | "
              f"{statistics.mean(r['download_x'] for r in records):.1f} |")


if __name__ == "__main__":
    main()
