"""The regime x model x strategy table: fedcomp's defaults (``auto``) against the unwrapped strategy.

Every cell is one regime, one task/model and one Flower strategy, run unwrapped (``harness.DENSE``)
and wrapped with the defaults (``upload='auto'``, ``download='auto'``) on the same paired seeds,
through the one experiment harness (:func:`fedcomp.simulations.harness.run`: Flower's
``Strategy.start`` in one process, the project's ClientApp behind ``compression_mod``). Regimes:

* ``silo``: 10 nodes, every node every round, 30 rounds;
* ``xdev``: 100 nodes, 10% per round, 60 rounds.

Accuracy is the mean of the last 5 rounds' server-side accuracy; the gap is wrapped minus
unwrapped, paired by seed (mean and min..max); ``up x`` / ``down x`` are the dense bytes over the
bytes sent (Flower message bytes as the harness counts them), summed over the run and the seeds.
A cell holds when the mean gap is at least -1 point (-2 where the unwrapped runs' own spread
across seeds is larger than 2 points), ``up x`` >= 100 and, cross-device, ``down x`` >= 30.

Runs are appended to ``--out`` as JSON lines (one per run, with the commit and the date); a run
already there (same cell, wrapped or not, seed) is skipped, so an interrupted table resumes;
``--rerun`` runs the wrapped ones again after a change of the defaults (the latest record counts)::

    python -m fedcomp.simulations.regime_table --cells silo:digits/mlp:FedAvg,FedAdam,FedMedian,Krum \\
        --cells xdev:digits/mlp:FedAvg,FedAdam,FedMedian,Krum --seeds 0 1 2
    python -m fedcomp.simulations.regime_table --table          # the Markdown table from --out
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "results" / "regimes" / "results.jsonl"
REGIMES = {"silo": (10, 1.0, 30), "xdev": (100, 0.1, 60)}  # clients, fraction per round, rounds
TAIL = 5  # rounds averaged for a run's accuracy


@dataclass(frozen=True)
class Cell:
    regime: str
    task: str
    model: str
    strategy: str

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.regime, self.task, self.model, self.strategy)


def parse_cells(text: str) -> list[Cell]:
    """``regime:task/model:Strategy1,Strategy2`` -> one :class:`Cell` per strategy."""
    from fedcomp.simulations import harness, task as tasks

    try:
        regime, tm, names = text.split(":")
        task, model = tm.split("/")
    except ValueError:
        raise ValueError(f"cell {text!r}: expected 'regime:task/model:Strategy[,Strategy...]', "
                         f"e.g. 'silo:digits/mlp:FedAvg,Krum'") from None
    if regime not in REGIMES:
        raise ValueError(f"cell {text!r}: regime {regime!r} not in {sorted(REGIMES)}")
    tasks.check_task_model(task, model)
    known = harness.strategies(1)
    cells = []
    for name in names.split(","):
        if name not in known:
            raise ValueError(f"cell {text!r}: strategy {name!r} not in {sorted(known)}")
        cells.append(Cell(regime, task, model, name))
    return cells


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_one(cell: Cell, wrapped: bool, seed: int, rounds: int | None = None) -> dict:
    """One run of ``cell`` (wrapped with the defaults or not) on ``seed``; the record to append."""
    import torch

    from fedcomp.simulations import harness

    torch.set_num_threads(1)
    clients, fraction, default_rounds = REGIMES[cell.regime]
    h = harness.run("auto" if wrapped else harness.DENSE, task=cell.task, model=cell.model,
                    strategy=cell.strategy, rounds=rounds or default_rounds, clients=clients,
                    fraction=fraction, seed=seed)
    return {"regime": cell.regime, "task": cell.task, "model": cell.model, "strategy": cell.strategy,
            "planned_rounds": rounds or default_rounds, "wrapped": wrapped, "seed": seed, "upload": h.upload, "download": h.download,
            "aggregation": h.aggregation, "error": h.error, "seconds": round(h.seconds, 1),
            "commit": _commit(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "rounds": [{k: r[k] for k in ("round", "accuracy", "loss", "upload_bytes", "download_bytes",
                                          "upload_bytes_dense", "download_bytes_dense")} for r in h.rows]}


def accuracy(run: dict) -> float:
    """Mean of the last :data:`TAIL` rounds' accuracy, in percent (0 for a run that ended early)."""
    rows = run["rounds"][-TAIL:]
    return 100 * statistics.mean(r["accuracy"] for r in rows) if rows else 0.0


def load(path: Path = OUT) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _latest(runs: list[dict]) -> dict[tuple, dict]:
    """The last record of every (cell, wrapped, seed) run for the regime's rounds: a rerun replaces an
    earlier one; shorter checks (``--rounds``) are not in the table."""
    out: dict[tuple, dict] = {}
    for r in runs:
        if r.get("planned_rounds", REGIMES[r["regime"]][2]) != REGIMES[r["regime"]][2]:
            continue
        out[(r["regime"], r["task"], r["model"], r["strategy"], r["wrapped"], r["seed"])] = r
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """One row per cell with both unwrapped and wrapped runs on at least one common seed."""
    latest = _latest(runs)
    cells = sorted({k[:4] for k in latest}, key=lambda k: (list(REGIMES).index(k[0]), k[1], k[2], k[3]))
    rows = []
    for key in cells:
        seeds = sorted(s for s in {k[5] for k in latest if k[:4] == key}
                       if (*key, False, s) in latest and (*key, True, s) in latest)
        if not seeds:
            continue
        plain = [latest[(*key, False, s)] for s in seeds]
        comp = [latest[(*key, True, s)] for s in seeds]
        gaps = [accuracy(c) - accuracy(p) for p, c in zip(plain, comp)]
        base = [accuracy(p) for p in plain]

        def ratio(field: str) -> float:
            sent = sum(r[field] for run in comp for r in run["rounds"])
            dense = sum(r[field + "_dense"] for run in comp for r in run["rounds"])
            return dense / sent if sent else float("nan")

        spread = max(base) - min(base)
        allowed = 2.0 if spread > 2.0 else 1.0
        up, down = ratio("upload_bytes"), ratio("download_bytes")
        holds = (statistics.mean(gaps) >= -allowed and up >= 100 and (key[0] != "xdev" or down >= 30)
                 and not any(c["error"] for c in comp))
        rows.append({"regime": key[0], "task": key[1], "model": key[2], "strategy": key[3], "seeds": seeds,
                     "plain": statistics.mean(base), "plain_spread": spread,
                     "wrapped": statistics.mean(accuracy(c) for c in comp), "gap": statistics.mean(gaps),
                     "gap_min": min(gaps), "gap_max": max(gaps), "allowed": allowed, "up": up, "down": down,
                     "upload": comp[-1]["upload"], "download": comp[-1]["download"], "holds": holds,
                     "commits": sorted({c["commit"] for c in comp}), "dates": sorted({c["date"][:10] for c in comp}),
                     "errors": [c["error"] for c in comp if c["error"]]})
    return rows


def table(runs: list[dict]) -> str:
    """The Markdown table of :func:`summarize`."""
    lines = ["| regime | task / model | strategy | seeds | unwrapped % (spread) | wrapped % | gap pt (min..max) "
             "| up x | down x | holds | upload / download (resolved) | wrapped runs at |",
             "|---|---|---|---|---:|---:|---|---:|---:|---|---|---|"]
    for r in summarize(runs):
        regime = "cross-silo 10/10" if r["regime"] == "silo" else "cross-device 100 at 10%"
        verdict = ("yes" if r["holds"] else "**no**") + (" (2 pt: spread)" if r["allowed"] == 2.0 else "")
        lines.append(f"| {regime} | {r['task']} / `{r['model']}` | {r['strategy']} | {len(r['seeds'])} "
                     f"| {r['plain']:.2f} ({r['plain_spread']:.1f}) | {r['wrapped']:.2f} "
                     f"| {r['gap']:+.2f} ({r['gap_min']:+.2f}..{r['gap_max']:+.2f}) | {r['up']:.1f} | {r['down']:.1f} "
                     f"| {verdict} | `{r['upload']}` / `{r['download'] or 'none()'}` | {', '.join(r['commits'])} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", action="append", default=[], help="regime:task/model:Strategy[,Strategy...]")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", choices=("wrapped", "unwrapped"), default=None)
    parser.add_argument("--rounds", type=int, default=None, help="override the regime's rounds (checks only)")
    parser.add_argument("--rerun", action="store_true", help="run the wrapped runs again (after a change of the defaults)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--table", action="store_true", help="print the table from --out and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table(load(args.out)))
        return
    try:
        cells = [c for text in args.cells for c in parse_cells(text)]
    except ValueError as exc:
        parser.error(str(exc))
    if not cells:
        parser.error("no --cells given, e.g. --cells silo:digits/mlp:FedAvg,Krum")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = _latest(load(args.out))
    modes = [m for m in (False, True) if args.only is None or m == (args.only == "wrapped")]
    for seed in args.seeds:
        for cell in cells:
            for wrapped in modes:
                prior = done.get((*cell.key, wrapped, seed))
                # unwrapped runs do not depend on fedcomp's code; wrapped ones are redone on --rerun
                # (after a change of the defaults; each record keeps its commit)
                if prior is not None and args.rounds in (None, REGIMES[cell.regime][2]) and not (wrapped and args.rerun):
                    continue
                run = run_one(cell, wrapped, seed, args.rounds)
                with args.out.open("a") as f:
                    f.write(json.dumps(run) + "\n")
                print(f"{cell.regime} {cell.task}/{cell.model} {cell.strategy:10s} {'wrapped' if wrapped else 'plain':8s} "
                      f"seed {seed} acc {accuracy(run):.2f}% {run['upload']} {run['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
