"""Every Flower strategy, wrapped by :class:`CompressedStrategy` and unwrapped, on the project's tasks.

Integrated the way the README tells users to: the Flower strategy object (``flwr.serverapp.strategy``)
wrapped as it is, the project's ClientApp with ``compression_mod``, through the one experiment
harness (:func:`fedcomp.simulations.harness.run`: Flower's ``Strategy.start`` in one process, the
server evaluating every round on the task's test set). Unwrapped runs send the same messages
without fedcomp (the mod passes them through). The strategies' settings:
:func:`fedcomp.simulations.harness.strategies`.

Command (rows appended to ``--out``, one JSON line per run; ``--table`` prints the Markdown table)::

    python -m fedcomp.simulations.strategy_study --task digits --model mlp --rounds 30 --clients 10
    python -m fedcomp.simulations.strategy_study --table
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent.parent / "results" / "strategies" / "results.jsonl"


def run_one(name: str, wrapped: bool, *, task_name: str, model_name: str, rounds: int, clients: int,
            fraction: float, lr: float, seed: int, upload: str | None = None, error_feedback: bool = True) -> dict:
    """One run of strategy ``name`` through :func:`fedcomp.simulations.harness.run`; returns its config,
    accuracy per round, cumulative upload bytes and time."""
    from fedcomp.simulations import harness

    torch.set_num_threads(1)
    settings = {} if error_feedback else {"error_feedback": False}
    h = harness.run((upload or "auto") if wrapped else harness.DENSE, task=task_name, model=model_name,
                    strategy=name, rounds=rounds, clients=clients, fraction=fraction, lr=lr, seed=seed, **settings)
    rows, up, down = [], 0, 0
    for r in h.rows:
        up += r["upload_bytes"]
        down += r["download_bytes"]
        rows.append({"round": r["round"], "accuracy": r["accuracy"], "loss": r["loss"], "upload_bytes": up,
                     "download_bytes": down, "finite": r["finite"]})
    return {"strategy": name, "wrapped": wrapped, "upload": h.upload, "download": h.download,
            "task": task_name, "model": model_name, "rounds": rows, "clients": clients, "fraction": fraction,
            "lr": lr, "seed": seed, "seconds": round(h.seconds, 1), **({"error": h.error} if h.error else {})}


def table(path: Path = OUT) -> str:
    """Markdown table: each strategy and task, unwrapped vs wrapped (mean accuracy of the last 5 rounds)."""
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def tail(run):
        return 100 * statistics.mean(r["accuracy"] for r in run["rounds"][-5:])

    from fedcomp.simulations.harness import strategies

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
    if args.table:
        print(table(args.out))
        return
    from fedcomp.simulations.harness import strategies

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
