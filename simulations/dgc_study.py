"""DGC settings against uncompressed FedAvg, with paired seeds, on one task.

Every candidate upload spec runs through the one experiment harness
(:func:`fedcomp.simulations.harness.run`: Flower's FedAvg wrapped by ``CompressedStrategy``, each
node's ``compression_mod`` + the project's ClientApp, the server evaluating every round), and so
does the unwrapped FedAvg run of the same seed (the baseline ``dense``). The seed fixes the model's
initialisation, the partitions and the training order, so a spec and the baseline of one seed are a
pair: the table gives, per spec, the mean over seeds of (spec - dense) and its spread (lowest and
highest paired gap, and the standard deviation), for the last round's accuracy and for the mean of
the last 5 rounds, and the upload ratio: the dense run's reply bytes over the spec's (Flower message
bytes of every train reply, all rounds, warm-up rounds included).

One JSON line per run in ``--out`` (``results/dgc/runs.jsonl``); a run already there (same canonical
spec, seed and settings) is not run again, so a sweep can be stopped and resumed. Specs are keyed by
their canonical form (every argument spelled out), so ``dgc()`` runs recorded under one set of
defaults are not mistaken for another's::

    python -m fedcomp.simulations.dgc_study --seeds 0,1,2 --rounds 60 --clients 10 'dgc()' \
        'dgc(ratio=0.001)' 'dgc(ratio=0.001)+qsgd(bits=4)'
    python -m fedcomp.simulations.dgc_study --seeds 0,1,2 --table --speed 'dgc()'      # print only
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "results" / "dgc" / "runs.jsonl"
DENSE = "dense"
TAIL = 5  # rounds averaged for the "last 5" accuracy


def canonical(spec: str) -> str:
    """The spec with every argument spelled out (``dense`` stays)."""
    if spec == DENSE:
        return DENSE
    from fedcomp import build_codec

    return build_codec(spec).spec


def _key(spec: str, seed: int, a) -> tuple:
    return (canonical(spec), seed, a.task, a.model, a.rounds, a.clients, a.fraction, a.lr)


def _row_key(r: dict) -> tuple:
    return (r["canonical"], r["seed"], r["task"], r["model"], r["planned_rounds"], r["clients"], r["fraction"], r["lr"])


def run_one(spec: str, seed: int, a) -> dict:
    """One run of ``spec`` (``dense``: FedAvg unwrapped) for ``seed``; per-round accuracy and bytes."""
    import torch

    from fedcomp.simulations import harness

    torch.set_num_threads(1)
    h = harness.run(harness.DENSE if spec == DENSE else spec, task=a.task, model=a.model, strategy="FedAvg",
                    rounds=a.rounds, clients=a.clients, fraction=a.fraction, lr=a.lr, seed=seed)
    return {"spec": spec, "canonical": canonical(spec), "upload": h.upload, "seed": seed, "task": a.task,
            "model": a.model, "planned_rounds": a.rounds, "clients": a.clients, "fraction": a.fraction, "lr": a.lr,
            "accuracy": [r["accuracy"] for r in h.rows], "upload_bytes": [r["upload_bytes"] for r in h.rows],
            "finite": all(r["finite"] for r in h.rows), "seconds": round(h.seconds, 1),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **({"error": h.error} if h.error else {})}


def load(path: Path) -> dict[tuple, dict]:
    """The runs in ``path`` by key. A run's spec is keyed by its canonical form as it ran (every
    argument spelled out then) read again with today's code: a parameter added since then takes
    its default, which must (and for DGC's ``start`` without warm-up does) reproduce what the run
    did, and a default changed since then does not move the run."""
    if not path.exists():
        return {}
    from fedcomp import SpecError

    out = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        try:
            r["canonical"] = canonical(r["canonical"])
        except SpecError:  # a parameter that no longer exists: not comparable
            continue
        out[_row_key(r)] = r
    return out


def _final(r: dict) -> float:
    return 100 * r["accuracy"][-1] if r["accuracy"] else 0.0


def _tail(r: dict) -> float:
    return 100 * statistics.mean(r["accuracy"][-TAIL:]) if r["accuracy"] else 0.0


def _spread(gaps: list[float]) -> str:
    sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
    return f"{statistics.mean(gaps):+.2f} [{min(gaps):+.2f}, {max(gaps):+.2f}] sd {sd:.2f}"


def table(specs: list[str], seeds: list[int], a, runs: dict[tuple, dict]) -> str:
    """Markdown table: per spec, dense accuracy, the paired gaps (mean [min, max] sd) of the final
    round and of the last 5 rounds, and the upload ratio (dense bytes / spec bytes, mean over seeds)."""
    lines = [f"{a.task}/{a.model}, {a.clients} clients x {a.fraction:g} per round, {a.rounds} rounds, lr {a.lr:g}, "
             f"FedAvg; gaps: spec - dense of the same seed, mean [lowest, highest] and standard deviation",
             "", "| upload spec | seeds | accuracy % (final) | gap final (pt) | accuracy % (last 5) | gap last 5 (pt) "
             "| upload x fewer | finite |", "|---|---|---|---|---|---|---|---|"]
    dense = {s: runs.get(_key(DENSE, s, a)) for s in seeds}
    for spec in [DENSE] + [s for s in specs if s != DENSE]:
        pairs = [(runs.get(_key(spec, s, a)), dense[s]) for s in seeds]
        pairs = [(r, d) for r, d in pairs if r is not None and d is not None]
        if not pairs:
            lines.append(f"| `{spec}` | 0 | not run | | | | | |")
            continue
        final = statistics.mean(_final(r) for r, _ in pairs)
        tail = statistics.mean(_tail(r) for r, _ in pairs)
        ratio = statistics.mean(sum(d["upload_bytes"]) / max(1, sum(r["upload_bytes"])) for r, d in pairs)
        finite = all(r["finite"] and "error" not in r and len(r["accuracy"]) == a.rounds for r, _ in pairs)
        lines.append(f"| `{spec}` | {','.join(str(r['seed']) for r, _ in pairs)} | {final:.2f} | "
                     f"{_spread([_final(r) - _final(d) for r, d in pairs])} | {tail:.2f} | "
                     f"{_spread([_tail(r) - _tail(d) for r, d in pairs])} | {ratio:.1f} | {'yes' if finite else 'NO'} |")
    return "\n".join(lines)


def _reached(r: dict, level: float) -> int | None:
    """The first round whose accuracy is at least ``level`` (None: never)."""
    return next((i + 1 for i, acc in enumerate(r["accuracy"]) if acc >= level), None)


def speed(specs: list[str], seeds: list[int], a, runs: dict[tuple, dict], levels=(0.8, 0.9, 0.95)) -> str:
    """Markdown table of how fast each spec gets there (means over the seeds run): accuracy of the
    first 10 rounds and of the 5 rounds up to mid-run, and per accuracy level the first round at or
    above it and the upload bytes sent until then (all clients; "never" when a seed did not reach it)."""
    mid = a.rounds // 2
    head = " | ".join(f"{100 * lv:g}%: round, upload kB" for lv in levels)
    lines = [f"| upload spec | seeds | accuracy % rounds 1-10 | accuracy % rounds {mid - TAIL + 1}-{mid} | {head} |",
             "|---|---|---|---|" + "---|" * len(levels)]
    for spec in [DENSE] + [s for s in specs if s != DENSE]:
        mine = [runs[_key(spec, s, a)] for s in seeds if _key(spec, s, a) in runs]
        if not mine:
            continue
        early = statistics.mean(100 * statistics.mean(r["accuracy"][:10]) for r in mine)
        middle = statistics.mean(100 * statistics.mean(r["accuracy"][mid - TAIL:mid]) for r in mine)
        cells = []
        for lv in levels:
            at = [_reached(r, lv) for r in mine]
            if any(t is None for t in at):
                cells.append(f"never in {sum(t is None for t in at)} of {len(at)}")
                continue
            kb = statistics.mean(sum(r["upload_bytes"][:t]) / 1e3 for r, t in zip(mine, at))
            cells.append(f"{statistics.mean(at):.1f}, {kb:,.0f}")
        lines.append(f"| `{spec}` | {len(mine)} | {early:.1f} | {middle:.1f} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="*", default=["dgc()"], help="candidate upload specs (default: dgc())")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (each paired with its dense run)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--task", default="digits")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--table", action="store_true", help="print the table from --out, run nothing")
    parser.add_argument("--speed", action="store_true", help="also print rounds and bytes to 80/90/95%% accuracy")
    a = parser.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    specs = list(dict.fromkeys(a.specs))
    for spec in specs:  # a bad spec fails here, before any run
        canonical(spec)
    if not a.table:
        import logging

        logging.getLogger("flwr").setLevel(logging.WARNING)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        for seed in seeds:
            for spec in [DENSE] + [s for s in specs if s != DENSE]:
                if _key(spec, seed, a) in load(a.out):
                    continue
                r = run_one(spec, seed, a)
                with a.out.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                print(f"seed {seed} {spec:45s} final {_final(r):.2f}% last5 {_tail(r):.2f}% "
                      f"upload {sum(r['upload_bytes']):,} B {r['seconds']:.0f} s", flush=True)
    runs = load(a.out)
    print(table(specs, seeds, a, runs))
    if a.speed:
        print()
        print(speed(specs, seeds, a, runs))


if __name__ == "__main__":
    main()
