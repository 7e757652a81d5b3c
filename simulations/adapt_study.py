"""Accuracy-driven compression strength against every fixed ratio of the same codec family.

For each digits model, 100 rounds in-process (:func:`fedcomp.simulations.sweep.run_one`, the loop
``flwr run .`` runs): the dense run, the family at a grid of fixed ratios, and the family with its
ratio written ``auto`` (:class:`fedcomp.adapt.AutoStrength`, default settings on every model: no
per-task tuning). The target is the dense run's final accuracy minus 1 point, as in the sweep.

Done when (issue #17), per model: the ``auto`` run reaches the target with no more cumulative upload
bytes than the best fixed ratio (the fewest bytes to the target among the fixed ratios), and
finishes within 1 point of dense.

Writes ``<out>/results.json`` (every run's per-round rows; the ``auto`` rows carry ``upload_spec``,
``strength`` (the knob's value), ``budget`` and ``decision``), ``<out>/README.md`` (the table, the
command and the date) and per model ``<out>/<model>.png`` (accuracy and the chosen ratio per round;
accuracy against cumulative upload bytes).

    python -m fedcomp.simulations.adapt_study                       # both models, 100 rounds
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


def _run(args):
    model, spec, ef, rounds, clients = args
    return model, run_one(spec, ef, rounds, clients, {"model": model})


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


def plot(model: str, runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax3) = plt.subplots(1, 2, figsize=(13, 5))
    auto = next(r for r in runs if "auto" in r["upload"])
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
    ax2.step([x["round"] for x in auto["rounds"]], [x["strength"] for x in auto["rounds"]], where="post",
             color="tab:red", lw=1.2, label="chosen top-k ratio")
    ax2.set_yscale("log")
    ax2.set_ylabel("top-k ratio chosen for the round", color="tab:red")
    dense_final = next(r for r in runs if r["upload"] == "none()")["rounds"][-1]["accuracy"]
    for ax in (ax1, ax3):
        ax.axhline(dense_final - 0.01, color="0.6", ls=":", lw=1)
        ax.set_ylim(0.6, 1.0)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    ax1.set_xlabel("round")
    ax1.set_title(f"digits, {model}: accuracy and the controller's ratio")
    ax1.legend(loc="lower right", fontsize=7)
    ax2.legend(loc="center right", fontsize=7)
    ax3.set_xscale("log")
    ax3.set_xlabel("cumulative upload (MB, Flower message bytes)")
    ax3.set_title("accuracy vs bytes (dotted: dense final - 1 point)")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{model}.png", dpi=100)
    plt.close(fig)


def report(results: dict, command: str) -> str:
    lines = [f"`{command}`, {results['date']} ({results['rounds']} rounds, {results['clients']} clients, digits).", ""]
    for model, entry in results["models"].items():
        v = entry["verdict"]
        lines += [f"### {model}", "",
                  "| upload | final acc | vs dense | upload MB (100 rounds) | to dense final - 1 pt: MB, round |",
                  "|---|---|---|---|---|"]
        for t in summarize(entry["runs"]):
            tt = f"{t['bytes_to_target'] / 1e6:.3f} MB, r{t['round_to_target']}" if t["bytes_to_target"] else "not reached"
            lines.append(f"| `{t['upload']}`{'' if t['error_feedback'] else ' (no EF)'} | {100 * t['final_accuracy']:.2f}% | "
                         f"{t['delta_points']:+.2f} | {t['upload_bytes'] / 1e6:.3f} | {tt} |")
        best = v["best_fixed"]
        lines += ["", f"auto reaches the target: {v['reaches_target']}; with no more bytes than the best fixed ratio "
                      f"({best['upload'] if best else '-'}): {v['bytes_le_best_fixed']}; finishes within 1 point of dense: "
                      f"{v['finishes_within_1pt']}.", "", f"![{model}]({model}.png)", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mlp", "mlp-large"])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--ratios", nargs="*", type=float, default=list(RATIOS), help="fixed ratios of the family (none: only dense and auto)")
    ap.add_argument("--out", default="simulations/figures/adapt")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = []
    for model in args.models:
        work += [(model, "none()", False, args.rounds, args.clients),
                 (model, FAMILY.format("auto"), True, args.rounds, args.clients)]
        work += [(model, FAMILY.format(r), True, args.rounds, args.clients) for r in args.ratios]
    by_model: dict[str, list[dict]] = {m: [] for m in args.models}
    def done(model: str, r: dict) -> None:
        by_model[model].append(r)
        print(f"{model:9s} {r['upload']:32s} acc {r['rounds'][-1]['accuracy']:.4f} ({r['seconds']:.0f} s)", flush=True)

    if args.jobs > 1:
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            for model, r in pool.imap_unordered(_run, work):
                done(model, r)
    else:
        for w in work:
            done(*_run(w))
    command = "python -m fedcomp.simulations.adapt_study " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    results = {"command": command.strip(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "rounds": args.rounds, "clients": args.clients, "models": {}}
    for model, runs in by_model.items():
        order = {w[1]: i for i, w in enumerate(work) if w[0] == model}
        runs.sort(key=lambda r: order[r["upload"]])
        results["models"][model] = {"verdict": verdict(runs), "runs": runs}
        plot(model, runs, out)
    with open(out / "results.json", "w") as f:
        json.dump(results, f, indent=1)
    text = report(results, results["command"])
    (out / "README.md").write_text("# Accuracy-driven compression strength (issue #17)\n\n" + text)
    print(text)


if __name__ == "__main__":
    main()
