"""Accuracy-driven compression strength against every fixed ratio of the same codec family.

For each model of a task, 100 rounds in-process: the dense run, the family at a grid of fixed
ratios, and the family with its ratio written ``auto`` (:class:`fedcomp.adapt.AutoStrength`, default
settings on every model and task: no per-task tuning). The target is the dense run's final accuracy
minus 1 point, as in the sweep.

Every run goes through the one experiment harness (:func:`fedcomp.simulations.harness.run`:
Flower's FedAvg wrapped as the README tells users to, :class:`~fedcomp.strategies.CompressedStrategy`
or :class:`~fedcomp.strategies.AdaptiveStrategy` for ``auto``, the project's ClientApp behind
``compression_mod``, ``Strategy.start`` in one process; bytes are the real messages' Flower bytes):

- ``digits`` (the default task): :func:`fedcomp.simulations.sweep.run_one` (lr 0.3; ``none()``
  through the wrapper, as in the sweep).
- any other task (``--task mnist --model cnn-bn --lr 0.05``): :func:`run_flower` (``none()``: FedAvg
  unwrapped); BatchNorm statistics travel exact as the wrapper sends them.

Done when (issue #17), per model: the ``auto`` run reaches the target with no more cumulative upload
bytes than the best fixed ratio (the fewest bytes to the target among the fixed ratios), and
finishes within 1 point of dense.

Writes ``<out>/results.json`` (digits) or ``<out>/results-<task>.json`` (every run's per-round rows;
the ``auto`` rows carry ``upload_spec``, ``strength`` (the knob's value), ``budget``,
``decision`` and ``fixed_bytes``), after every finished run, so an interrupted study keeps what it ran;
``<out>/README.md`` (per task: the table, the command and the date; then ``<out>/notes.md``, kept by
hand) and per model ``<out>/<model>.png`` (digits) or ``<out>/<task>-<model>.png`` (accuracy and the
chosen ratio per round; accuracy against cumulative upload bytes).

``--reuse`` takes the dense and fixed-ratio runs already in the results file when their settings
match (task, model, rounds, clients, lr, seed) and runs only the rest: after a change of the
controller's policy, only the ``auto`` runs (never reused) run again. ``--no-auto`` runs the rest
only (to start the long fixed runs before the policy is settled).

    python -m fedcomp.simulations.adapt_study                       # digits, both models, 100 rounds
    python -m fedcomp.simulations.adapt_study --reuse               # only the auto runs again
    python -m fedcomp.simulations.adapt_study --task mnist --models cnn-bn --lr 0.05 \
        --ratios 0.01 0.003 0.001 0.0005 0.0002 --jobs 1
    python -m fedcomp.simulations.adapt_study --models mlp --rounds 5 --ratios 0.01 --out /tmp/a
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import shlex
import sys
from pathlib import Path

from fedcomp.simulations.sweep import run_one, summarize

FAMILY = "topk(ratio={})+qsgd(bits=4)"
RATIOS = (0.01, 0.005, 0.003, 0.002, 0.001, 0.0005)


DIGITS_LR = 0.3  # the sweep's (fedcomp.simulations.sweep.DEFAULTS)


def run_flower(spec: str, error_feedback: bool, rounds: int, clients: int, *, task: str, model: str, lr: float,
               seed: int = 0, subsample: float = 1.0) -> dict:
    """One FedAvg run of ``task``/``model`` through :func:`fedcomp.simulations.harness.run`; rows as
    :func:`fedcomp.simulations.sweep.run_one`'s (``upload_bytes`` per round). ``spec`` ``"none()"``:
    FedAvg unwrapped (dense); with ``auto``: :class:`AdaptiveStrategy` fed the server's evaluation.
    ``subsample`` < 1: each client keeps that fraction of its partition (a seeded sample, the same in
    every round and run), to make a round cheaper; the test set stays whole."""
    import torch

    from fedcomp.simulations import harness
    from fedcomp.simulations import task as tasks

    torch.set_num_threads(1)
    tasks.check_task_model(task, model)
    if subsample < 1:
        load = tasks.load_partition

        def smaller(task, partition_id, *a, **kw):
            x, y = load(task, partition_id, *a, **kw)
            g = torch.Generator().manual_seed(seed * 7919 + partition_id)
            keep = torch.randperm(len(y), generator=g)[:max(1, round(subsample * len(y)))].sort().values
            return x[keep], y[keep]

        tasks.load_partition = smaller  # what the ClientApp's train calls (restored below)
    try:
        h = harness.run(harness.DENSE if spec == "none()" else spec, task=task, model=model, rounds=rounds,
                        clients=clients, lr=lr, seed=seed,
                        **({} if spec == "none()" else {"error_feedback": error_feedback, "download": "none()"}))
    finally:
        if subsample < 1:
            tasks.load_partition = load
    cfg = {"seed": seed, "task": task, "model": model, "local-epochs": 1, "lr": lr, "batch-size": 32,
           "partition-alpha": 0.5, "subsample": subsample}
    keep = ("round", "accuracy", "loss", "upload_bytes", "upload_bytes_dense", "download_bytes",
            "download_bytes_dense", "upload_spec", "strength", "budget", "decision", "fixed_bytes")
    return {"upload": spec, "error_feedback": error_feedback, "rounds": [{k: r[k] for k in keep if k in r} for r in h.rows],
            "clients": clients, "config": cfg, "seconds": h.seconds}


def _run(args):
    task, model, spec, ef, rounds, clients, lr, subsample = args
    if task == "digits":
        return model, run_one(spec, ef, rounds, clients, {"model": model, "lr": lr})
    return model, run_flower(spec, ef, rounds, clients, task=task, model=model, lr=lr, subsample=subsample)


def _key(task: str, model: str, spec: str, ef: bool, rounds: int, clients: int, lr: float, subsample: float) -> tuple:
    return task, model, spec, bool(ef), int(rounds), int(clients), float(lr), float(subsample)


def _key_of(task: str, model: str, run: dict) -> tuple:
    cfg = run["config"]
    return _key(task, model, run["upload"], run["error_feedback"], len(run["rounds"]), run["clients"], cfg["lr"],
                cfg.get("subsample", 1.0))


def _ratio(spec: str) -> float:
    try:
        return float(spec.split("ratio=")[1].split(")")[0].split(",")[0])
    except (IndexError, ValueError):
        return 0.0


def results_path(out: Path, task: str) -> Path:
    """Where a task's runs are kept (digits: ``results.json``, as before tasks existed)."""
    return out / ("results.json" if task == "digits" else f"results-{task}.json")


def figure_name(task: str, model: str) -> str:
    return f"{model}.png" if task == "digits" else f"{task}-{model}.png"


def verdict(runs: list[dict]) -> dict:
    """The Done-when check of one model's runs (dense, fixed ratios, one ``auto`` run)."""
    table = {(t["upload"], t["error_feedback"]): t for t in summarize(runs)}
    auto = next(t for (u, _), t in table.items() if "auto" in u)
    fixed = [t for (u, ef), t in table.items() if ef and "auto" not in u and u != "none()"]
    reached = [t for t in fixed if t["bytes_to_target"]]
    best = min(reached, key=lambda t: t["bytes_to_target"]) if reached else None
    best_ok = min((t for t in reached if t["delta_points"] >= -1.0), key=lambda t: t["bytes_to_target"], default=None)
    return {
        "auto": auto, "best_fixed": best, "best_fixed_finishing_within_1pt": best_ok,
        "reaches_target": auto["bytes_to_target"] is not None,
        "bytes_le_best_fixed": bool(auto["bytes_to_target"] and best and auto["bytes_to_target"] <= best["bytes_to_target"]),
        "finishes_within_1pt": auto["delta_points"] >= -1.0,
    }


def plot(task: str, model: str, runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax3) = plt.subplots(1, 2, figsize=(13, 5))
    auto = next((r for r in runs if "auto" in r["upload"]), None)
    ax2 = ax1.twinx()
    for r in runs:
        label = r["upload"].replace("+qsgd(bits=4)", "+qsgd4")
        rounds = [x["round"] for x in r["rounds"]]
        acc = [x["accuracy"] for x in r["rounds"]]
        cum, xs = 0, []
        for x in r["rounds"]:
            cum += x["upload_bytes"]
            xs.append(cum / 1e6)
        style = dict(lw=2.0, color="k") if r is auto else dict(lw=0.8, alpha=0.8)
        if r is auto or r["upload"] == "none()":
            ax1.plot(rounds, acc, label=label, **({"color": "0.5", "lw": 1} if r is not auto else style))
        ax3.plot(xs, acc, label=label, **style)
    if auto is not None:
        ax2.step([x["round"] for x in auto["rounds"]], [x["strength"] for x in auto["rounds"]], where="post",
                 color="tab:red", lw=1.2, label="chosen top-k ratio")
        ax2.set_yscale("log")
        ax2.legend(loc="center right", fontsize=7)
    ax2.set_ylabel("top-k ratio chosen for the round", color="tab:red")
    dense_final = next(r for r in runs if r["upload"] == "none()")["rounds"][-1]["accuracy"]
    for ax in (ax1, ax3):
        ax.axhline(dense_final - 0.01, color="0.6", ls=":", lw=1)
        ax.set_ylim(max(0.0, round(dense_final - 0.35, 1)), 1.0)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    ax1.set_xlabel("round")
    ax1.set_title(f"{task}, {model}: accuracy and the controller's ratio")
    ax1.legend(loc="lower right", fontsize=7)
    ax3.set_xscale("log")
    ax3.set_xlabel("cumulative upload (MB, Flower message bytes)")
    ax3.set_title("accuracy vs bytes (dotted: dense final - 1 point)")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / figure_name(task, model), dpi=100)
    plt.close(fig)


def report(results: dict) -> str:
    task = results.get("task", "digits")
    lines = [f"## {task}", "",
             f"`{results['command']}`, {results['date']} ({results['rounds']} rounds, {results['clients']} clients, "
             f"{task}, lr {results.get('lr', DIGITS_LR)}"
             + (f", each client keeps {results['subsample']:g} of its partition" if results.get("subsample", 1) < 1 else "")
             + ").", ""]
    for model, entry in results["models"].items():
        v = entry.get("verdict")
        lines += [f"### {model}", "",
                  "| upload | final acc | vs dense | upload MB (100 rounds) | to dense final - 1 pt: MB, round |",
                  "|---|---|---|---|---|"]
        for t in summarize(entry["runs"]):
            tt = f"{t['bytes_to_target'] / 1e6:.3f} MB, r{t['round_to_target']}" if t["bytes_to_target"] else "not reached"
            lines.append(f"| `{t['upload']}`{'' if t['error_feedback'] else ' (no EF)'} | {100 * t['final_accuracy']:.2f}% | "
                         f"{t['delta_points']:+.2f} | {t['upload_bytes'] / 1e6:.3f} | {tt} |")
        if v is not None:
            best = v["best_fixed"]
            lines += ["", f"auto reaches the target: {v['reaches_target']}; with no more bytes than the best fixed ratio "
                          f"({best['upload'] if best else '-'}): {v['bytes_le_best_fixed']}; finishes within 1 point of dense: "
                          f"{v['finishes_within_1pt']}."]
        lines += ["", f"![{model}]({figure_name(task, model)})", ""]
    return "\n".join(lines)


def write_readme(out: Path) -> str:
    """``<out>/README.md`` from every task's results file, then ``<out>/notes.md`` (kept by hand)."""
    parts = ["# Accuracy-driven compression strength (issue #17)", ""]
    files = sorted(out.glob("results*.json"), key=lambda p: (p.name != "results.json", p.name))
    for path in files:
        parts.append(report(json.loads(path.read_text())))
    notes = out / "notes.md"
    if notes.exists():
        parts.append(notes.read_text())
    text = "\n".join(parts)
    (out / "README.md").write_text(text)
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="digits")
    ap.add_argument("--models", nargs="+", default=None, help="default: digits: mlp mlp-large; else the task's first model")
    ap.add_argument("--lr", type=float, default=DIGITS_LR)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--ratios", nargs="*", type=float, default=list(RATIOS), help="fixed ratios of the family (none: only dense and auto)")
    ap.add_argument("--out", default="results/adapt")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--reuse", action="store_true", help="take matching dense and fixed runs from the results file")
    ap.add_argument("--no-auto", action="store_true", help="skip the auto runs")
    ap.add_argument("--subsample", type=float, default=1.0,
                    help="fraction of each client's partition kept (not digits; the same in every run)")
    args = ap.parse_args(argv)
    if not 0 < args.subsample <= 1 or (args.task == "digits" and args.subsample != 1):
        ap.error(f"--subsample {args.subsample} is invalid: a fraction in (0, 1], and 1 on digits")
    from fedcomp.simulations import task as tasks

    models = args.models or (["mlp", "mlp-large"] if args.task == "digits" else [tasks.TASKS[args.task].models[0]])
    for model in models:
        tasks.check_task_model(args.task, model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = results_path(out, args.task)
    command = "python -m fedcomp.simulations.adapt_study " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    old = json.loads(path.read_text()) if path.exists() else {"models": {}}
    planned: dict[str, list[tuple]] = {}
    for model in models:
        planned[model] = [(args.task, model, "none()", False, args.rounds, args.clients, args.lr, args.subsample)]
        planned[model] += [(args.task, model, FAMILY.format(r), True, args.rounds, args.clients, args.lr, args.subsample) for r in args.ratios]
        if not args.no_auto:
            planned[model].append((args.task, model, FAMILY.format("auto"), True, args.rounds, args.clients, args.lr, args.subsample))
    by_model: dict[str, list[dict]] = {m: [] for m in models}
    kept = {}
    if args.reuse:
        for model in models:
            for r in old["models"].get(model, {}).get("runs", []):
                if "auto" not in r["upload"]:
                    kept[_key_of(args.task, model, r)] = r
    work = []
    for model in models:
        for w in planned[model]:
            if _key(*w) in kept:
                by_model[model].append(kept[_key(*w)])
                print(f"{model:9s} {w[2]:32s} reused from {path}", flush=True)
            else:
                work.append(w)

    def save() -> dict:
        results = {"command": command.strip(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   "task": args.task, "lr": args.lr, "subsample": args.subsample, "rounds": args.rounds, "clients": args.clients, "models": {}}
        now = json.loads(path.read_text()) if path.exists() else {"models": {}}  # another invocation may have added runs
        for model, runs in by_model.items():
            mine = {_key_of(args.task, model, r) for r in runs}
            runs = runs + [r for r in now["models"].get(model, {}).get("runs", []) if _key_of(args.task, model, r) not in mine]
            runs.sort(key=lambda r: (r["upload"] != "none()", "auto" in r["upload"], -_ratio(r["upload"])))
            entry = {"runs": runs}
            if any(r["upload"] == "none()" for r in runs) and any("auto" in r["upload"] for r in runs):
                entry["verdict"] = verdict(runs)
            results["models"][model] = entry
        for model, entry in now["models"].items():  # models of this task not run now stay
            results["models"].setdefault(model, entry)
        path.write_text(json.dumps(results, indent=1))
        return results

    def done(model: str, r: dict) -> None:
        by_model[model].append(r)
        print(f"{model:9s} {r['upload']:32s} acc {r['rounds'][-1]['accuracy']:.4f} ({r['seconds']:.0f} s)", flush=True)
        save()

    if args.jobs > 1 and len(work) > 1:
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            for model, r in pool.imap_unordered(_run, work):
                done(model, r)
    else:
        for w in work:
            done(*_run(w))
    results = save()
    for model, entry in results["models"].items():
        if model in models and any(r["upload"] == "none()" for r in entry["runs"]):
            plot(args.task, model, entry["runs"], out)
    print(write_readme(out))


if __name__ == "__main__":
    main()
