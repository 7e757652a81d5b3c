"""Server optimizers (FedAdam, FedYogi, FedAdagrad) on aggressive uploads: which scheme holds?

Each run is ``fedcomp.simulations.harness.run`` in the common protocol (cross-silo: 10 clients, all
every round, 30 rounds; cross-device: 100 clients, 10 a round, 60 rounds); a row per run goes to
``--out`` (JSON lines, appended, so a long study can stop and go on), and ``--table`` prints the
paired comparison with the unwrapped strategy (mean of the last 5 rounds' accuracy, the mean
difference and its min..max over the seeds, upload and download reduction).

Schemes (``SCHEMES``; ``{share}`` is the top-k or heavy-hitter share):

* ``dense``: the unwrapped strategy (the baseline);
* ``qsgd4``: today's default for these strategies, ``qsgd(bits=4)``;
* ``topk{share}``: ``topk(ratio=share)+qsgd(bits=4)`` with client error feedback, the strategy's own step;
* ``topk{share}-freq``: the same uploads, the step of
  :class:`fedcomp.strategies.optimizer_sketch.OptimizerOnUpdates` (second moment corrected for the
  arrival rate, momentum); ``-freq-nomom``: without momentum;
* ``sketch{share}-freq``: FetchSGD (``sketch(rows=1,cols=ceil(0.068 n),ratio=share)+qsgd(bits=4)``,
  server-side error, coupled download) with the optimizer after the unsketch
  (:class:`~fedcomp.strategies.optimizer_sketch.OptimizerFeedback`), server momentum 0;
  ``-m<rho>``: server momentum ``rho`` (``-m9``: 0.9, ``-m0.5``: 0.5); ``-d<share>``: the download
  ``topk(ratio=share)+kbit(bits=4,stochastic=true)`` not coupled (its tier's own error feedback);
* ``sketch{share}``: FetchSGD as FedAvg would run it (the inner optimizer unused), for reference.

    python -m fedcomp.simulations.optimizer_study --regime silo --schemes dense topk0.01 topk0.01-freq \\
        --seeds 0 1 2 --out results/optimizers/silo.jsonl
    python -m fedcomp.simulations.optimizer_study --table --out results/optimizers/silo.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from collections.abc import Sequence

from fedcomp.simulations import harness
from fedcomp.simulations.harness import DENSE
from fedcomp.strategies.config import cross_device_upload
from fedcomp.strategies.optimizer_sketch import OptimizerOnUpdates, OptimizerSketchPart

REGIMES = {"silo": {"clients": 10, "fraction": 1.0, "rounds": 30},
           "device": {"clients": 100, "fraction": 0.1, "rounds": 60}}
LAST = 5  # rounds averaged for a run's accuracy (the common protocol)
SCHEME = re.compile(r"^(dense|qsgd4|topk(?P<tshare>[0-9.]+)(?P<freq>-freq(?P<nomom>-nomom)?)?"
                    r"|sketch(?P<sshare>[0-9.]+)(?P<sfreq>-freq)?(?P<m>-m(?P<rho>[0-9.]+))?(?P<d>-d(?P<dshare>[0-9.]+))?)$")


def numel_of(task: str, model: str) -> int:
    from fedcomp.simulations import task as tasks

    net = tasks.build_model(model, seed=0, task=task)
    return sum(int(v.numel()) for v in net.state_dict().values() if v.is_floating_point())


def scheme_run(scheme: str, *, strategy: str, task: str, model: str, seed: int, clients: int, fraction: float,
               rounds: int) -> dict:
    """One run of ``scheme``: its row (settings, accuracy per round, bytes)."""
    m = SCHEME.match(scheme)
    if m is None:
        raise ValueError(f"unknown scheme {scheme!r}: dense, qsgd4, topk<share>[-freq[-nomom]], "
                         f"sketch<share>[-freq][-m<rho>][-d<share>]")
    factory = harness.strategies(clients, fraction)[strategy]
    inner, upload, settings = strategy, DENSE, {}
    if scheme == "qsgd4":
        upload = "qsgd(bits=4)"
    elif m["tshare"]:
        upload = f"topk(ratio={float(m['tshare'])})+qsgd(bits=4)"
        if m["freq"]:
            inner = lambda: OptimizerOnUpdates(factory(), momentum=not m["nomom"])  # noqa: E731
    elif m["sshare"]:
        upload = cross_device_upload(numel_of(task, model), float(m["sshare"]))
        rho = float(m["rho"]) if m["rho"] else 0.0
        settings = {"aggregation": "sketch", "server_momentum": 0.9 if rho == 9 else rho}  # -m9: 0.9
        if m["sfreq"]:
            settings["parts"] = [OptimizerSketchPart()]
        if m["dshare"]:  # a download of its own share, not coupled: the tier keeps its own error feedback
            settings.update(download=f"topk(ratio={float(m['dshare'])})+kbit(bits=4,stochastic=true)",
                            coupled_download=False)
    t0 = time.time()
    h = harness.run(upload, task=task, model=model, strategy=inner, rounds=rounds, clients=clients,
                    fraction=fraction, seed=seed, **settings)
    accs = [r["accuracy"] for r in h.rows]
    up = sum(r["upload_bytes"] for r in h.rows)
    down = sum(r["download_bytes"] for r in h.rows)
    return {"scheme": scheme, "strategy": strategy, "task": task, "model": model, "seed": seed, "clients": clients,
            "fraction": fraction, "rounds": rounds, "upload": h.upload, "download": h.download,
            "aggregation": h.aggregation, "accuracy": sum(accs[-LAST:]) / max(1, len(accs[-LAST:])),
            "accuracies": accs, "upload_x": sum(r["upload_bytes_dense"] for r in h.rows) / max(1, up),
            "download_x": sum(r["download_bytes_dense"] for r in h.rows) / max(1, down), "upload_bytes": up,
            "download_bytes": down, "error": h.error,
            "seconds": round(time.time() - t0, 1)}


def table(rows: list[dict]) -> str:
    """Per (task, model, strategy, regime, scheme): mean accuracy, its paired difference with the
    dense run of the same seed (mean, min..max), upload x (the dense run's measured Flower message
    bytes over this run's: the wrapper's own dense count, ``upload_x`` in a row, counts the model
    twice for strategies whose replies it collects) and download x (the wrapper's: the unwrapped
    FedAdam's broadcasts are float64 from round 2 on, twice the model's own bytes)."""
    out = ["| task / model | strategy | regime | scheme | seeds | accuracy | vs dense (min..max) | up x | down x |",
           "|---|---|---|---|---|---|---|---|---|"]
    key = lambda r: (r["task"], r["model"], r["strategy"], r["clients"], r["fraction"], r["rounds"])  # noqa: E731
    dense = {(*key(r), r["seed"]): r for r in rows if r["scheme"] == "dense"}
    groups: dict = {}
    for r in rows:
        groups.setdefault((*key(r), r["scheme"]), []).append(r)
    for (task, model, strat, clients, fraction, rounds, scheme), rs in groups.items():
        acc = statistics.mean(100 * r["accuracy"] for r in rs)
        diffs = [100 * (r["accuracy"] - dense[(task, model, strat, clients, fraction, rounds, r["seed"])]["accuracy"])
                 for r in rs if (task, model, strat, clients, fraction, rounds, r["seed"]) in dense]
        vs = (f"{statistics.mean(diffs):+.2f} ({min(diffs):+.1f}..{max(diffs):+.1f})" if diffs and scheme != "dense"
              else "")
        ups = []
        for r in rs:  # against the dense run's measured bytes (the wrapper's dense count doubles in collect mode)
            base = dense.get((task, model, strat, clients, fraction, rounds, r["seed"]))
            ok = base is not None and "upload_bytes" in r and "upload_bytes" in base
            ups.append(base["upload_bytes"] / r["upload_bytes"] if ok else r["upload_x"])
        downs = [r["download_x"] for r in rs]
        regime = f"{clients} x {fraction:g}, {rounds} r"
        out.append(f"| {task} {model} | {strat} | {regime} | {scheme} | {','.join(str(r['seed']) for r in rs)} | "
                   f"{acc:.2f} | {vs} | {statistics.mean(ups):.1f} | {statistics.mean(downs):.1f} |")
    return "\n".join(out)


def load(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", choices=sorted(REGIMES), default="silo")
    ap.add_argument("--schemes", nargs="+", default=["dense", "topk0.01", "topk0.01-freq"])
    ap.add_argument("--strategy", default="FedAdam")
    ap.add_argument("--task", default="digits")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, help="default: the regime's")
    ap.add_argument("--out", required=True, help="JSON lines, appended; runs already there are skipped")
    ap.add_argument("--table", action="store_true", help="only print the table of --out")
    args = ap.parse_args(argv)
    if not args.table:
        import torch

        torch.set_num_threads(1)
        regime = dict(REGIMES[args.regime])
        if args.rounds:
            regime["rounds"] = args.rounds
        done = {(r["scheme"], r["strategy"], r["task"], r["model"], r["seed"], r["clients"], r["fraction"],
                 r["rounds"]) for r in load(args.out)}
        for seed in args.seeds:
            for scheme in args.schemes:
                if (scheme, args.strategy, args.task, args.model, seed, regime["clients"], regime["fraction"],
                        regime["rounds"]) in done:
                    continue
                row = scheme_run(scheme, strategy=args.strategy, task=args.task, model=args.model, seed=seed,
                                 **regime)
                row["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                print(json.dumps({k: v for k, v in row.items() if k != "accuracies"}), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(load(args.out)))


if __name__ == "__main__":
    main()
