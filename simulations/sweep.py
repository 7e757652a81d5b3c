"""Accuracy against bytes: every codec on the default digits task, through the one experiment harness.

Each run is :func:`fedcomp.simulations.harness.run`: Flower's FedAvg wrapped by
:class:`~fedcomp.strategies.CompressedStrategy` (``upload=<spec>``, ``download='none()'``, the
client error feedback on or off), ``Strategy.start`` in one process, each node answered by the
project's ClientApp behind ``compression_mod`` (``simulations/client_app.py``: Dirichlet partitions,
alpha 0.5, local SGD 1 epoch, lr 0.3, batch 32, training seeds per (round, partition)); the server
evaluates on the held-out digits after every round. A spec with one ``auto`` parameter runs
:class:`~fedcomp.strategies.AdaptiveStrategy`. ``none()`` is the reference every ratio is taken
against (fp32 payloads through the same wrapper). Bytes are the Flower message bytes of the train
replies and messages; ``upload_bytes_dense`` is the wrapper's count of the same replies with the
model as plain arrays.

Writes ``<out>/sweep.json`` (per run: config, per-round accuracy and bytes), ``<out>/sweep.md``
(the table) and two plots (accuracy vs cumulative upload MB, accuracy vs round).

    python -m fedcomp.simulations.sweep                                  # the full sweep, 100 rounds
    python -m fedcomp.simulations.sweep --rounds 3 --codecs "none()" "topk(ratio=0.01)" --out /tmp/s
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
from pathlib import Path

import torch

# (spec, error feedback) pairs of the default sweep
DEFAULT_RUNS: tuple[tuple[str, bool], ...] = (
    ("none()", False),
    ("fp16()", False),
    ("kbit(bits=8)", True),
    ("kbit(bits=4)", True),
    ("sign()", True),
    ("twobit(threshold=0.001)", True),
    ("qsgd(bits=4)", False),
    ("terngrad()", True),
    ("topk(ratio=0.01)", True),
    ("topk(ratio=0.01)+qsgd(bits=4)", True),
    ("topk(ratio=0.01)+qsgd(bits=4)", False),
    ("topk(ratio=0.002)+qsgd(bits=4)", True),
    ("topk(ratio=0.002)+sign()", True),
    ("topk(ratio=0.001)+sign()", True),
    ("topk(ratio=0.0005)+sign()", True),
    ("randomk(ratio=0.01,rescale=false)", True),
    ("threshold(ratio=0.002)", True),
    ("dgc(ratio=0.001)+qsgd(bits=4)", True),
    ("powersgd(rank=2)", True),
)

DEFAULTS = {"model": "mlp", "local-epochs": 1, "lr": 0.3, "batch-size": 32, "seed": 0, "partition-alpha": 0.5}


def run_one(spec: str, error_feedback: bool, rounds: int, clients: int, cfg: dict | None = None) -> dict:
    """One federated run of upload ``spec`` through :func:`fedcomp.simulations.harness.run`; returns
    its config and per-round rows.

    A spec with one ``param=auto`` (``topk(ratio=auto)+qsgd(bits=4)``) is resolved each round by
    :class:`~fedcomp.strategies.AdaptiveStrategy` from the server's evaluation after the previous
    round; each row then records the round's ``upload_spec``, the knob's value (``strength``), the
    controller's ``budget``, its ``decision`` and the reply bytes besides the payload
    (``fixed_bytes``). ``cfg["adapt"]``: :class:`fedcomp.adapt.AdaptSettings` keyword arguments.
    """
    from fedcomp.adapt import AdaptSettings, is_auto
    from fedcomp.simulations import harness

    cfg = {**DEFAULTS, **(cfg or {})}
    torch.set_num_threads(1)
    settings = {"download": "none()", "error_feedback": error_feedback}
    if is_auto(spec) and cfg.get("adapt"):
        settings["adapt"] = AdaptSettings(**cfg["adapt"])
    h = harness.run(spec, task="digits", model=str(cfg["model"]), rounds=rounds, clients=clients,
                    seed=int(cfg["seed"]), lr=float(cfg["lr"]), local_epochs=int(cfg["local-epochs"]),
                    batch_size=int(cfg["batch-size"]), alpha=float(cfg["partition-alpha"]), **settings)
    keep = ("round", "accuracy", "loss", "upload_bytes", "upload_bytes_dense", "download_bytes",
            "download_bytes_dense", "upload_spec", "strength", "budget", "decision", "fixed_bytes")
    rows = [{k: r[k] for k in keep if k in r} for r in h.rows]
    return {"upload": spec, "resolved": h.upload, "error_feedback": error_feedback, "rounds": rows,
            "clients": clients, "config": cfg, "seconds": h.seconds, **({"error": h.error} if h.error else {})}


def _run_star(args):
    return run_one(*args)


def summarize(runs: list[dict]) -> list[dict]:
    """Per run: final accuracy, total bytes, reduction vs dense, bytes to (dense final - 1 point)."""
    dense = next((r for r in runs if r["upload"] == "none()"), None)
    dense_final = dense["rounds"][-1]["accuracy"] if dense else None
    dense_total = sum(x["upload_bytes"] for x in dense["rounds"]) if dense else None
    target = dense_final - 0.01 if dense else None
    dense_to_target = None
    out = []
    for r in runs:
        up = sum(x["upload_bytes"] for x in r["rounds"])
        up_dense = sum(x["upload_bytes_dense"] for x in r["rounds"])
        down = sum(x["download_bytes"] for x in r["rounds"])
        cum, to_target, round_at = 0, None, None
        for x in r["rounds"]:
            cum += x["upload_bytes"]
            if target is not None and to_target is None and x["accuracy"] >= target:
                to_target, round_at = cum, x["round"]
        if r is dense:
            dense_to_target = to_target
        out.append({
            "upload": r["upload"], "error_feedback": r["error_feedback"],
            "final_accuracy": r["rounds"][-1]["accuracy"], "best_accuracy": max(x["accuracy"] for x in r["rounds"]),
            "upload_bytes": up, "download_bytes": down, "reduction": up_dense / up if up else float("nan"),
            "delta_points": 100 * (r["rounds"][-1]["accuracy"] - dense_final) if dense else None,
            "bytes_to_target": to_target, "round_to_target": round_at, "seconds": r["seconds"],
        })
    for row in out:
        row["bytes_to_target_vs_dense"] = (
            dense_to_target / row["bytes_to_target"] if dense_to_target and row["bytes_to_target"] else None)
    return out


def write_outputs(runs: list[dict], out: Path, command: str) -> list[dict]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    table = summarize(runs)
    rounds = len(runs[0]["rounds"]) if runs else 0
    with open(out / "sweep.json", "w") as f:
        json.dump({"command": command, "summary": table, "runs": runs}, f, indent=1)
    lines = [
        f"`{command}` ({rounds} rounds, {runs[0]['clients'] if runs else 0} clients)", "",
        "| upload | EF | final acc | vs none() | best | upload MB | reduction | to (dense final - 1 pt): upload MB, x fewer than dense, round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        tt = (f"{t['bytes_to_target'] / 1e6:.3f} MB, {t['bytes_to_target_vs_dense']:.0f}x, r{t['round_to_target']}"
              if t["bytes_to_target"] else "not reached")
        delta = f"{t['delta_points']:+.2f}" if t["delta_points"] is not None else "-"
        lines.append(f"| `{t['upload']}` | {'on' if t['error_feedback'] else 'off'} | {100 * t['final_accuracy']:.2f}% | "
                     f"{delta} | {100 * t['best_accuracy']:.2f}% | {t['upload_bytes'] / 1e6:.3f} | {t['reduction']:.1f}x | {tt} |")
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    fig1, ax1 = plt.subplots(figsize=(10, 6))
    fig2, ax2 = plt.subplots(figsize=(10, 6))
    for r in runs:
        label = f"{r['upload']}{'' if r['error_feedback'] else ' (no EF)'}"
        cum, xs = 0, []
        for x in r["rounds"]:
            cum += x["upload_bytes"]
            xs.append(cum / 1e6)
        acc = [x["accuracy"] for x in r["rounds"]]
        ax1.plot(xs, acc, label=label, lw=1)
        ax2.plot([x["round"] for x in r["rounds"]], acc, label=label, lw=1)
    ax1.set_xscale("log")
    ax1.set_xlabel("cumulative upload (MB, Flower message bytes)")
    ax2.set_xlabel("round")
    for ax in (ax1, ax2):
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.5, 1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig1.tight_layout()
    fig2.tight_layout()
    fig1.savefig(out / "sweep_accuracy_vs_upload.png", dpi=110)
    fig2.savefig(out / "sweep_accuracy_vs_round.png", dpi=110)
    plt.close(fig1)
    plt.close(fig2)
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--codecs", nargs="+", help="specs (error feedback on; add ':noef' for off); default: the built-in list")
    ap.add_argument("--out", default="results/sweep")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="parallel runs")
    args = ap.parse_args(argv)
    runs_cfg = DEFAULT_RUNS if not args.codecs else tuple(
        (s.removesuffix(":noef"), not s.endswith(":noef")) for s in args.codecs)
    if not any(s == "none()" for s, _ in runs_cfg):
        runs_cfg = (("none()", False),) + tuple(runs_cfg)  # the reference every ratio is taken against
    work = [(s, ef, args.rounds, args.clients) for s, ef in runs_cfg]
    runs = []
    if args.jobs > 1:
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            for r in pool.imap(_run_star, work):
                runs.append(r)
                print(f"{r['upload']:38s} EF {'on ' if r['error_feedback'] else 'off'} acc {r['rounds'][-1]['accuracy']:.4f} "
                      f"({r['seconds']:.0f} s)", flush=True)
    else:
        for w in work:
            r = run_one(*w)
            runs.append(r)
            print(f"{r['upload']:38s} EF {'on ' if r['error_feedback'] else 'off'} acc {r['rounds'][-1]['accuracy']:.4f} "
                  f"({r['seconds']:.0f} s)", flush=True)
    import shlex
    import sys

    command = "python -m fedcomp.simulations.sweep " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    table = write_outputs(runs, Path(args.out), command.strip())
    print(Path(args.out, "sweep.md").read_text())
    hits = [(t["upload"], t["reduction"], t["delta_points"]) for t in table if t["delta_points"] is not None]
    for need, pts in ((300, -1.0), (1000, -2.0)):
        best = [h for h in hits if h[1] >= need and h[2] >= pts]
        print(f"target >= {need}x within {-pts:.0f} point(s): " + (
            "met by " + ", ".join(f"{u} ({r:.0f}x, {d:+.2f})" for u, r, d in best) if best else "NOT met"))


if __name__ == "__main__":
    main()
