"""Every codec family at its README default against dense FedAvg, on one task, in two regimes.

Runs Flower's FedAvg wrapped by :class:`CompressedStrategy` with one upload spec per family (the
README's codec table defaults) and unwrapped (dense), through the one experiment harness
(:func:`fedcomp.simulations.harness.run`, via :func:`fedcomp.simulations.strategy_study.run_one`:
each node's ``compression_mod`` + the project's ClientApp, the server evaluating every round). One
JSON line per run in ``--out``; ``--table`` prints the Markdown table (mean accuracy of the last 5 rounds, upload bytes against the dense run
of the same regime and seed)::

    python -m fedcomp.simulations.family_study --task mnist --model cnn-bn --lr 0.05 --rounds 30 --clients 10
    python -m fedcomp.simulations.family_study --task mnist --model cnn-bn --lr 0.05 --rounds 30 \
        --clients 100 --fraction 0.1
    python -m fedcomp.simulations.family_study --table
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "results" / "families" / "results.jsonl"
DENSE = "dense"

#: family -> upload spec at the README's defaults (the codec table in "Codecs and the spec grammar")
FAMILIES = {
    "dense": DENSE,
    "topk": "topk()",
    "dgc": "dgc()",
    "randomk": "randomk()",
    "threshold": "threshold()",
    "sketch": "sketch()",
    "sign": "sign()",
    "twobit": "twobit()",
    "kbit": "kbit()",
    "qsgd": "qsgd()",
    "terngrad": "terngrad()",
    "powersgd": "powersgd()",
}


def run(spec: str, *, task: str, model: str, rounds: int, clients: int, fraction: float, lr: float,
        seed: int, family: str = "", error_feedback: bool = True) -> dict:
    """One FedAvg run with upload ``spec`` (``"dense"``: unwrapped); ``error_feedback=False``: no
    client residuals (recorded as ``spec`` + `` ef=off``)."""
    from fedcomp.simulations.strategy_study import run_one

    wrapped = spec != DENSE
    out = run_one("FedAvg", wrapped, task_name=task, model_name=model, rounds=rounds, clients=clients,
                  fraction=fraction, lr=lr, seed=seed, upload=spec if wrapped else None,
                  error_feedback=error_feedback)
    out["family"], out["spec"] = family or spec, spec if error_feedback or not wrapped else f"{spec} ef=off"
    return out


def _tail(run: dict, last: int = 5) -> float:
    return 100 * statistics.mean(r["accuracy"] for r in run["rounds"][-last:])


def table(path: Path = OUT) -> str:
    """Markdown table per regime: each spec's mean accuracy of the last 5 rounds (mean over seeds),
    gap to dense, upload bytes ratio, whether every round stayed finite."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    runs = [r for r in rows if "stopped" not in r]
    regime = lambda r: (r["task"], r["model"], len(r["rounds"]), r["clients"], r["fraction"])  # noqa: E731
    lines = []
    for key in sorted({regime(r) for r in runs}):
        group = [r for r in runs if regime(r) == key]
        dense = {r["seed"]: r for r in group if r["spec"] == DENSE}
        lines += [f"\n{key[0]}/{key[1]}, {key[3]} clients x {key[4]:g} per round, {key[2]} rounds "
                  f"(mean accuracy of the last 5 rounds; seeds {sorted(dense) or '-'})\n",
                  "| family | upload spec | accuracy % | dense % | gap (pt) | upload x fewer | seeds | finite |",
                  "|---|---|---|---|---|---|---|---|"]
        specs = []
        for r in group:
            if (r["family"], r["spec"]) not in specs:
                specs.append((r["family"], r["spec"]))
        for family, spec in specs:
            mine = [r for r in group if r["spec"] == spec and r["seed"] in dense]
            if not mine:
                continue
            acc = statistics.mean(_tail(r) for r in mine)
            base = statistics.mean(_tail(dense[r["seed"]]) for r in mine)
            ratio = statistics.mean(dense[r["seed"]]["rounds"][-1]["upload_bytes"] / r["rounds"][-1]["upload_bytes"]
                                    for r in mine)
            finite = all(x["finite"] for r in mine for x in r["rounds"])
            shown = "dense" if spec == DENSE else mine[-1]["upload"] + (" ef=off" if spec.endswith(" ef=off") else "")
            if spec.endswith("()") and mine[-1]["upload"] != spec:  # a default resolved for the regime
                shown = f"{spec}` as `{mine[-1]['upload']}"
            lines.append(f"| {family} | `{shown}` | {acc:.2f} | {base:.2f} | {acc - base:+.2f} | {ratio:.1f} | "
                         f"{len(mine)} | {'yes' if finite else 'NO'} |")
        for r in rows:
            if "stopped" in r and (r["task"], r["model"], r["planned_rounds"], r["clients"], r["fraction"]) == key:
                lines.append(f"| {r['family']} | `{r['spec']}` | stopped | | | | seed {r['seed']} | {r['stopped'][:160]} |")
    return "\n".join(lines).strip()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help=f"families (default: all of {list(FAMILIES)})")
    parser.add_argument("--spec", action="append", default=[], help="an extra upload spec to run (repeatable)")
    parser.add_argument("--task", default="mnist")
    parser.add_argument("--model", default="cnn-bn")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-error-feedback", action="store_true", help="wrapped runs without client residuals")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--table", action="store_true", help="print the tables from --out and exit")
    args = parser.parse_args(argv)
    import logging

    import fedcomp

    logging.getLogger("flwr").setLevel(logging.WARNING)
    if args.table:
        print(table(args.out))
        return
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; allowed: {list(FAMILIES)}")
    todo = [(f, FAMILIES[f]) for f in (args.families or ([] if args.spec else list(FAMILIES)))]
    todo += [(s.partition("(")[0].partition("+")[0].strip(), s) for s in args.spec]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for family, spec in todo:
        try:
            out = run(spec, task=args.task, model=args.model, rounds=args.rounds, clients=args.clients,
                      fraction=args.fraction, lr=args.lr, seed=args.seed, family=family,
                      error_feedback=not args.no_error_feedback)
        except fedcomp.FedcompError as exc:  # a run the wrapper stopped (non-finite model, no usable replies)
            print(f"{family:10s} {spec:40s} stopped: {exc}", flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps({"family": family, "spec": spec, "task": args.task, "model": args.model,
                                    "clients": args.clients, "fraction": args.fraction, "seed": args.seed,
                                    "planned_rounds": args.rounds, "stopped": str(exc)[:500]}) + "\n")
            continue
        with args.out.open("a") as f:
            f.write(json.dumps(out) + "\n")
        print(f"{family:10s} {spec:40s} acc(last5) {_tail(out):.2f}%  upload {out['rounds'][-1]['upload_bytes']:,} B  "
              f"{out['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
