"""Accuracy against simulated wall time, budget checks and time-to-accuracy, from results.json files.

Each round record of a run with a link profile holds ``sim_time_s`` (the simulated duration of
that round, see :mod:`fedcomp.links`) and ``links``: one entry per client with its
``upload_bytes`` (whole message), ``budget`` (None: unlimited) and times.

Usage::

    python -m fedcomp.simulations.time_to_accuracy OUT.png DENSE_RUN BUDGETED_RUN... [--margin 0.02]

prints, per run, the simulated time to reach (dense final accuracy - margin), the speed-up over
the dense run, and the number of uploads over budget (must be 0), and writes the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["budget_violations", "late", "load_run", "plot_time_to_accuracy", "series", "skipped", "time_to"]


def load_run(item: str | pathlib.Path) -> tuple[str, dict]:
    """(label, results) of a results.json file or the directory that holds it; label = upload spec
    (and the link profile, where it is not 'none')."""
    path = pathlib.Path(item)
    path = path / "results.json" if path.is_dir() else path
    data = json.loads(path.read_text())
    label = str(data["config"].get("upload", path.parent.name))
    profile = str(data["config"].get("link-profile", "none"))
    return (label if profile == "none" else f"{label} [{profile}]"), data


def series(rounds: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float]]:
    """(cumulative simulated seconds, accuracy in %) at the end of each round with an accuracy."""
    xs, ys, clock = [], [], 0.0
    for record in rounds:
        if record.get("sim_time_s") is None:
            raise ValueError(f"round {record.get('round')} has no sim_time_s: run with a link-profile other than 'none'")
        clock += float(record["sim_time_s"])
        acc = record.get("accuracy")
        if acc is not None and math.isfinite(float(acc)):
            xs.append(clock)
            ys.append(100.0 * float(acc))
    return xs, ys


def time_to(rounds: Sequence[Mapping[str, Any]], target: float) -> float | None:
    """Simulated seconds until accuracy (a fraction) first reaches ``target``; None if never."""
    xs, ys = series(rounds)
    return next((x for x, y in zip(xs, ys) if y >= 100.0 * target - 1e-9), None)


def budget_violations(rounds: Sequence[Mapping[str, Any]]) -> list[tuple[int, Any, int, int]]:
    """(round, client, upload bytes, budget) for every upload larger than its budget.

    A client that skipped the round (status ``too-small-skipped``: its budget was below the
    codec's smallest message) sent no update, only the status reply Flower needs; those are
    counted by :func:`skipped`, not here. ``too-small-coarsest`` uploads do count here.
    """
    out = []
    for record in rounds:
        for c in record.get("links") or []:
            if c.get("status") == "too-small-skipped":
                continue
            b = c.get("budget")
            if b is not None and c.get("upload_bytes") is not None and int(c["upload_bytes"]) > int(b):
                out.append((int(record["round"]), c.get("node"), int(c["upload_bytes"]), int(b)))
    return out


def skipped(rounds: Sequence[Mapping[str, Any]]) -> int:
    """Client-rounds skipped because the budget was too small even for the coarsest setting."""
    return sum(1 for record in rounds for c in record.get("links") or [] if c.get("status") == "too-small-skipped")


def late(rounds: Sequence[Mapping[str, Any]]) -> int:
    """Client-rounds past the deadline: on the true links where the run measured hidden ones
    (``link_estimates``, link-profile 'measured:...'), else on the links the clients reported."""
    return sum(1 for record in rounds
               for c in (record.get("link_estimates") if record.get("link_estimates") and
                         "true_link" in record["link_estimates"][0] else record.get("links") or [])
               if c.get("late"))


def plot_time_to_accuracy(runs: Mapping[str, Sequence[Mapping[str, Any]]], path, *, target: float | None = None,
                          title: str = "Accuracy vs. simulated time") -> pathlib.Path:
    """One line per run: test accuracy against cumulative simulated seconds (log x axis)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, rounds in runs.items():
        xs, ys = series(rounds)
        ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.4, label=label)
    if target is not None:
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label=f"target {100 * target:.1f}%")
    ax.set_xscale("log")
    ax.set_xlabel("Simulated wall time (s, log scale)")
    ax.set_ylabel("Test accuracy (%)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="PNG file to write")
    parser.add_argument("dense", help="the dense (none()) run: results.json or its directory")
    parser.add_argument("runs", nargs="+", help="budgeted runs: results.json files or directories")
    parser.add_argument("--margin", type=float, default=0.02, help="target = dense final accuracy - margin")
    parser.add_argument("--target", type=float, default=None,
                        help="target accuracy (a fraction) instead; the first run is then the reference of the speed-up "
                             "(e.g. the declared-link run against the measured-link one)")
    args = parser.parse_args(argv)
    dense_label, dense = load_run(args.dense)
    if args.target is None:
        target = float(dense["rounds"][-1]["accuracy"]) - args.margin
        dense_label += " (dense)"
        print(f"target accuracy {100 * target:.2f}% (dense final {100 * (target + args.margin):.2f}% - "
              f"{100 * args.margin:.0f} points)")
    else:
        target = args.target
        print(f"target accuracy {100 * target:.2f}%; speed-up against {dense_label}")
    runs = {dense_label: dense["rounds"]}
    t_dense = time_to(dense["rounds"], target)
    print(f"{'run':55s} {'final acc':>9s} {'time to target':>15s} {'speed-up':>9s} {'over budget':>11s} "
          f"{'skipped':>7s} {'late':>5s} {'uploads':>7s}")
    status = 0
    for label, data in [(dense_label, dense)] + [load_run(r) for r in args.runs]:
        rounds = data["rounds"]
        runs[label] = rounds
        t = time_to(rounds, target)
        bad = budget_violations(rounds)
        status |= bool(bad)
        speed = f"{t_dense / t:.1f}x" if t and t_dense else "-"
        t_text = f"{t:.1f} s" if t is not None else "never"
        uploads = sum(len(r.get("links") or []) for r in rounds)
        print(f"{label:55s} {100 * rounds[-1]['accuracy']:8.2f}% {t_text:>15s} {speed:>9s} {len(bad):>11d} "
              f"{skipped(rounds):>7d} {late(rounds):>5d} {uploads:>7d}")
    print(plot_time_to_accuracy(runs, args.out, target=target))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
