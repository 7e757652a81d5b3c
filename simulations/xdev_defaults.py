"""Cross-device defaults study: ``python -m fedcomp.simulations.xdev_defaults [options] NAMES...``.

Which FetchSGD settings make the cross-device default (100 clients, 10% per round, FedAvg)
aggressive both ways (issue 36: >= 100x up, >= 30x down) and as accurate as unwrapped FedAvg,
for models with and without BatchNorm. A client seen every tenth round downloads every step since
its last contact (coupled download: the chain of the server's broadcast steps), so the download
ratio falls with the heavy hitters' share per round; a smaller share needs a larger effective
server step, which FetchSGD's momentum in sketch space gives.

Every run goes through :func:`fedcomp.simulations.harness.run` (Flower's FedAvg wrapped by
``CompressedStrategy``, the project's ClientApp, ``Strategy.start`` in one process). A run is named
by its settings:

* ``dense``: FedAvg unwrapped (the baseline every other run is paired with, seed by seed);
* ``auto``: the wrapper's defaults as a user gets them (``upload='auto'``, ``download='auto'``);
  ``auto@<tag>`` the same under another name (the defaults at a later commit; a record keeps the
  specs they resolved to);
* ``s<share>[-m<rho>][-d<share>][-b<bits>][-q<bits>][-c<cols per param>]``: upload
  ``sketch(rows=1, cols=ceil(c n), ratio=<share>)+qsgd(bits=<q>)`` (n = float parameters;
  ``cross_device_upload``), ``aggregation='sketch'``, server momentum ``rho`` (default 0), coupled
  download ``topk(ratio=<d>)+kbit(bits=<b>,stochastic=true)`` (``d`` defaults to the upload's share,
  ``b`` to 4); a suffix ``-nx`` turns ``exact_statistics`` off.

Each run appends one JSON line to ``--out`` (default ``results/xdev-defaults/runs.jsonl``); runs
already there (same name, task, model, rounds, clients, fraction, lr, seed) are skipped. At the end
the table of every matching record is printed in Markdown: mean accuracy of the last 5 rounds,
the paired difference to ``dense`` (mean, min..max), accuracy at round 10 and 20 (the slow start),
the first round at 80%, upload and download x (dense bytes / compressed bytes as the harness
counts them). Each record also holds ``chain_union`` (how many distinct coordinates 5, 10 and 20
consecutive steps change, over the entries they hold: whether merging a node's chain of steps
would shrink its download) and, with ``--recalibrate K``, the accuracy every K rounds with the
BatchNorm statistics re-estimated on the global weights (printed as a second table).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent.parent / "results" / "xdev-defaults" / "runs.jsonl"
_NAME = re.compile(r"^s(?P<s>[0-9.]+)(?:-m(?P<m>[0-9.]+))?(?:-d(?P<d>[0-9.]+))?(?:-b(?P<b>\d+))?"
                   r"(?:-q(?P<q>\d+))?(?:-c(?P<c>[0-9.]+))?(?P<nx>-nx)?$")


def settings_of(name: str, numel: int) -> tuple[str, dict]:
    """(upload, wrapper settings) of a run name (module docstring); ValueError for a bad name."""
    from fedcomp.simulations.harness import DENSE
    from fedcomp.strategies.config import SKETCH_COLS_PER_PARAM

    if name == "dense":
        return DENSE, {}
    if name == "auto" or name.startswith("auto@"):  # auto@<tag>: the defaults again, after they changed
        return "auto", {}
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"run name {name!r} is invalid: 'dense', 'auto' or "
                         f"s<share>[-m<rho>][-d<share>][-b<bits>][-q<bits>][-c<cols per param>][-nx]")
    share = float(m["s"])
    cols = max(16, math.ceil(float(m["c"] or SKETCH_COLS_PER_PARAM) * numel))
    upload = f"sketch(rows=1,cols={cols},ratio={share})+qsgd(bits={int(m['q'] or 4)})"
    download = f"topk(ratio={float(m['d'] or share)})+kbit(bits={int(m['b'] or 4)},stochastic=true)"
    settings = {"aggregation": "sketch", "server_momentum": float(m["m"] or 0.0), "download": download,
                "coupled_download": True}
    if m["nx"]:
        settings["exact_statistics"] = False
    return upload, settings


def numel_of(task: str, model: str, seed: int = 0) -> int:
    """Float parameters of the model, as the wrapper counts them when it resolves the regime."""
    from fedcomp.simulations import task as tasks

    net = tasks.build_model(model, seed=seed, task=task)
    return sum(int(v.numel()) for v in net.state_dict().values() if v.is_floating_point())


def key_of(rec: dict) -> tuple:
    return (rec["name"], rec["task"], rec["model"], rec["rounds"], rec["clients"], rec["fraction"], rec["lr"],
            rec["seed"])


def load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def recalibrated(task: str, model: str, seed: int, clients: int, alpha: float = 0.5, samples: int = 2000):
    """``accuracy(state)``: the test accuracy of ``state`` with its BatchNorm running statistics
    re-estimated on the global weights (a cumulative average over ``samples`` training examples of
    the first partitions, train-mode forward passes, no gradient), to tell how much of a gap comes
    from statistics that do not match the weights (the clients' mean after their local steps)."""
    from fedcomp.simulations import task as tasks

    net = tasks.build_model(model, seed=seed, task=task)
    xs, n = [], 0
    for p in range(clients):
        x, _ = tasks.load_partition(task, p, clients, alpha, seed)
        xs.append(x)
        n += len(x)
        if n >= samples:
            break
    x_cal = torch.cat(xs)[:samples]
    x_test, y_test = tasks.load_test(task, seed, num_partitions=clients, alpha=alpha)
    norms = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]

    def accuracy(state: dict) -> float:
        net.load_state_dict(state)
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # cumulative average
        net.train()
        with torch.no_grad():
            for i in range(0, len(x_cal), 256):
                net(x_cal[i:i + 256])
        for m in norms:
            m.momentum = 0.1
        return tasks.evaluate(net, x_test, y_test, device="cpu")[1]

    return accuracy


def run_one(name: str, *, task: str, model: str, rounds: int, clients: int, fraction: float, lr: float | None,
            seed: int, recalibrate: int = 0) -> dict:
    from fedcomp.simulations import harness

    upload, settings = settings_of(name, numel_of(task, model, seed))
    recal = recalibrated(task, model, seed, clients) if recalibrate else None
    supports: list[torch.Tensor] = []  # per round: the flat positions of the float entries the step changed
    previous: list[torch.Tensor] = []

    def observe(_round: int, state: dict) -> dict:
        flat = torch.cat([v.reshape(-1).float() for v in state.values() if v.is_floating_point()])
        if previous:
            supports.append(torch.nonzero(flat != previous[0]).squeeze(1))
        previous[:] = [flat]
        if recal is not None and (_round % recalibrate == 0 or _round == rounds):
            return {"accuracy_recalibrated": recal(state)}
        return {}

    t0 = time.perf_counter()
    h = harness.run(upload, task=task, model=model, strategy="FedAvg", rounds=rounds, clients=clients,
                    fraction=fraction, seed=seed, lr=lr, observe=observe, **settings)
    acc = [r["accuracy"] for r in h.rows]
    up, up_dense = sum(r["upload_bytes"] for r in h.rows), sum(r["upload_bytes_dense"] for r in h.rows)
    down, down_dense = sum(r["download_bytes"] for r in h.rows), sum(r["download_bytes_dense"] for r in h.rows)
    return {"name": name, "task": task, "model": model, "rounds": rounds, "clients": clients, "fraction": fraction,
            "lr": h.config["lr"], "seed": seed, "upload": h.upload, "download": h.download,
            "aggregation": h.aggregation, "settings": settings,
            "last5": sum(acc[-5:]) / max(1, len(acc[-5:])), "accuracy": acc,
            "up_x": up_dense / up if up else None, "down_x": down_dense / down if down else None,
            "upload_bytes": up, "download_bytes": down, "error": h.error,
            "recalibrated": {r["round"]: r["accuracy_recalibrated"] for r in h.rows if "accuracy_recalibrated" in r},
            "chain_union": {str(n): chain_union(supports, n) for n in (5, 10, 20)},
            "seconds": round(time.perf_counter() - t0, 1)}


def chain_union(supports: list[torch.Tensor], length: int) -> float | None:
    """Mean over windows of ``length`` consecutive steps of |union of their supports| / sum of their
    sizes: what a catch-up download that sends one merged sparse difference instead of the chain of
    steps would keep of the chain's entries (1: no overlap; None: fewer steps than ``length``)."""
    ratios = []
    for i in range(len(supports) - length + 1):
        window = supports[i:i + length]
        total = sum(int(s.numel()) for s in window)
        if total:
            ratios.append(int(torch.unique(torch.cat(window)).numel()) / total)
    return sum(ratios) / len(ratios) if ratios else None


def recalibration_table(records: list[dict], *, task: str, model: str, rounds: int, clients: int,
                        fraction: float) -> str:
    """Accuracy as aggregated / with the statistics re-estimated on the global weights, per run and
    seed, at the rounds scored (``--recalibrate``); empty when no matching record has them."""
    where = (task, model, rounds, clients, fraction)
    recs = [r for r in records if r.get("recalibrated")
            and (r["task"], r["model"], r["rounds"], r["clients"], r["fraction"]) == where]
    if not recs:
        return ""
    marks = sorted({int(k) for r in recs for k in r["recalibrated"]})
    lines = ["| run | seed | " + " | ".join(f"round {m}" for m in marks) + " |",
             "|---|---|" + "---|" * len(marks)]
    for r in recs:
        cells = [f"{r['accuracy'][m - 1] * 100:.1f} / {r['recalibrated'][str(m)] * 100:.1f}"
                 if str(m) in r["recalibrated"] else "" for m in marks]
        lines.append(f"| `{label(r)}` | {r['seed']} | " + " | ".join(cells) + " |")
    return "\n".join(["accuracy % as aggregated / with statistics re-estimated on the global weights", "", *lines])


def label(rec: dict) -> str:
    """A record's row: its name, and for ``auto`` what it resolved to (the defaults move with the code)."""
    if not rec["name"].startswith("auto"):
        return rec["name"]
    share = re.search(r"ratio=([0-9.]+)", rec["upload"])
    return f"{rec['name']} ({rec['upload'].split('(')[0]} {share[1] if share else ''})".replace(" )", ")")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def table(records: list[dict], *, task: str, model: str, rounds: int, clients: int, fraction: float,
          names: list[str] | None = None, reach: float = 0.8) -> str:
    """The Markdown table of the matching records (module docstring)."""
    recs = [dict(r, name=label(r)) for r in records if (r["task"], r["model"], r["rounds"], r["clients"],
                                                         r["fraction"]) == (task, model, rounds, clients, fraction)]
    dense = {r["seed"]: r for r in recs if r["name"] == "dense"}
    order = list(dict.fromkeys(r["name"] for r in recs if not names or r["name"].split(" ")[0] in names))
    lines = [f"{task}/{model}, {clients} clients x {fraction} per round, {rounds} rounds",
             "",
             "| run | seeds | last-5 acc % | dense % (same seeds) | diff mean | diff min..max | acc r10 | acc r20 "
             f"| first round >= {reach * 100:.0f}% | up x | down x |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in order:
        rs = sorted((r for r in recs if r["name"] == name), key=lambda r: r["seed"])
        if not rs:
            continue
        paired = [r for r in rs if r["seed"] in dense]
        diffs = [r["last5"] - dense[r["seed"]]["last5"] for r in paired] if name != "dense" else []
        diff = f"{_mean(diffs) * 100:+.2f} | {_range(diffs)}" if diffs else " | "
        base = f"{_mean([dense[r['seed']]['last5'] for r in paired]) * 100:.2f}" if paired else ""
        r10 = _mean([r["accuracy"][9] for r in rs if len(r["accuracy"]) > 9]) * 100
        r20 = _mean([r["accuracy"][19] for r in rs if len(r["accuracy"]) > 19]) * 100
        up = _mean([r["up_x"] for r in rs if r["up_x"]])
        down = _mean([r["down_x"] for r in rs if r["down_x"]])
        err = " (error)" if any(r["error"] for r in rs) else ""
        seeds = ",".join(str(r["seed"]) for r in rs)
        first = [next((i + 1 for i, a in enumerate(r["accuracy"]) if a >= reach), None) for r in rs]
        reached = [f for f in first if f]
        to_reach = ((f"{_mean(reached):.1f}" if reached else "never")
                    + ("" if all(first) or not reached else f" ({first.count(None)} never)"))
        lines.append(f"| `{name}`{err} | {seeds} | {_mean([r['last5'] for r in rs]) * 100:.2f} | {base} | {diff} "
                     f"| {r10:.1f} | {r20:.1f} | {to_reach} | {up:.1f} | {down:.1f} |")
    return "\n".join(lines)


def _range(diffs: list[float]) -> str:
    return f"{min(diffs) * 100:+.2f}..{max(diffs) * 100:+.2f}"


def run_arguments(p: argparse.ArgumentParser, out: Path) -> None:
    """The run options this study shares with :mod:`fedcomp.simulations.slow_start` (names, the
    task and regime, seeds, the records' file ``out``)."""
    p.add_argument("names", nargs="*", help="runs (module docstring); none: only print the table")
    p.add_argument("--task", default="digits")
    p.add_argument("--model", default="mlp")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--fraction", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=None, help="client learning rate (default: the harness's)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--out", type=Path, default=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_arguments(p, OUT)
    p.add_argument("--recalibrate", type=int, default=0, metavar="K",
                   help="every K rounds also score the model with BatchNorm statistics re-estimated on the "
                        "global weights (0: off)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from fedcomp.simulations.harness import DEFAULT_LR

    lr = DEFAULT_LR.get(a.task, 0.05) if a.lr is None else a.lr
    a.out.parent.mkdir(parents=True, exist_ok=True)
    done = {key_of(r) for r in load(a.out)}
    for seed in [int(s) for s in a.seeds.split(",")]:
        for name in a.names:
            settings_of(name, 1)  # a bad name fails before any run
            rec_key = (name, a.task, a.model, a.rounds, a.clients, a.fraction, lr, seed)
            if rec_key in done:
                continue
            rec = run_one(name, task=a.task, model=a.model, rounds=a.rounds, clients=a.clients,
                          fraction=a.fraction, lr=lr, seed=seed, recalibrate=a.recalibrate)
            with a.out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{name} seed {seed}: last5 {rec['last5'] * 100:.2f} up {rec['up_x']:.1f}x down "
                  f"{rec['down_x']:.1f}x ({rec['seconds']} s){' ' + rec['error'] if rec['error'] else ''}",
                  flush=True)
    print(table(load(a.out), task=a.task, model=a.model, rounds=a.rounds, clients=a.clients, fraction=a.fraction,
                names=a.names or None))
    recal = recalibration_table(load(a.out), task=a.task, model=a.model, rounds=a.rounds, clients=a.clients,
                                fraction=a.fraction)
    if recal:
        print("\n" + recal)
    return 0


if __name__ == "__main__":
    sys.exit(main())
