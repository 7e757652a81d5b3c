"""FetchSGD's slow start in cross-device: ``python -m fedcomp.simulations.slow_start [options] NAMES...``.

In cross-device (100 clients, 10% per round) the FetchSGD default applies the codec's ``ratio``
of heavy hitters per round from the first round on, while the clients' early updates are spread
over many coordinates: accuracy lags dense FedAvg for the first rounds and catches up later
(issue 36). This study tries the warm-ups of :class:`fedcomp.server_feedback.Warmup`, handed to
the :class:`~fedcomp.server_feedback.ServerFeedback` the wrapper builds: a server step size
(``scale``: the round's mean table times a factor falling to 1; no byte more) and the heavy
hitters' share (``share``: falling to the codec's ratio, DGC's geometric schedule), with the
coupled download then carrying exactly the larger steps (``dgc(ratio=<share>, momentum=0,
warmup=<rounds>, start=<start>, sample=1)+kbit(bits=4, stochastic=true)``, the same count for the
same round). A node's first contact downloads the chain of every step since round 0 (seeded
start), so a larger share's bytes are paid by nearly every node: the download ratio is the
harness's count over the whole run.

A run is named as in :mod:`fedcomp.simulations.xdev_defaults` (``dense``, ``s<share>[-m<rho>]...``)
with optional warm-up knobs (:func:`split_name`): ``-L<scale>x<R>`` a server step size falling
from ``scale`` to 1 (``-l``: without the tables falling with it), ``-w<share>x<R>`` the heavy
hitters' share falling from ``share`` to the codec's ratio (with the dgc download above),
``-M<rho>x<R>`` a larger momentum early, ``-a<scale>x<R>`` the applied step scaled; e.g.
``s0.007-m0.5-L8x20``. The wrapper has no warm-up setting: the study hands ``warmup=`` to the
``ServerFeedback`` the wrapper constructs (:func:`server_warmup`, for the run only).

Each run appends one JSON line to ``--out`` (default ``results/slow-start/runs.jsonl``; runs
already there are skipped) and the table of the matching records is printed in Markdown: last-5
accuracy, paired difference to ``dense`` (mean, min..max), accuracy at rounds 5, 10 and 20, the
first round at 80%, upload and download x.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import torch

from fedcomp.server_feedback import Warmup
from fedcomp.simulations import xdev_defaults as xd

OUT = Path(__file__).resolve().parent.parent / "results" / "slow-start" / "runs.jsonl"
_KNOB = re.compile(r"-(?P<kind>[wlLMaN])(?P<value>[0-9.]+)x(?P<rounds>\d+)")


def split_name(name: str) -> tuple[str, Warmup | None, tuple[float, int] | None]:
    """(the xdev_defaults run name, the :class:`~fedcomp.server_feedback.Warmup` or None, the
    screening knobs of this study alone or None) of a run name: knobs ``-w<share>x<R>`` (heavy hitters'
    share from ``share`` down to the codec's ratio over R rounds), ``-L<scale>x<R>`` (the round's
    mean table times a factor from ``scale`` down to 1 over R rounds, the tables falling with it),
    ``-l<scale>x<R>`` (the same without the tables' fall: ``rescale=False``); screening knobs of this
    study alone: ``-M<rho>x<R>`` (server momentum ``rho`` for the steps of rounds 1..R),
    ``-a<scale>x<R>`` (the applied heavy hitters, not the mean table, times a factor from
    ``scale`` down to 1 over R rounds: the error table keeps its scale), ``-N<m>x<R>`` (for the
    steps of rounds 1..R, the step's L2 norm capped at m times the round's mean update's, estimated
    from its table; what the cap removes is dropped: sketching it back into the error table adds
    each cell's value once per element hashed there, about 15 times it with one row)."""
    knobs = {m["kind"]: (float(m["value"]), int(m["rounds"])) for m in _KNOB.finditer(name)}
    base = _KNOB.sub("", name)
    warmup = None
    if "l" in knobs and "L" in knobs:
        raise ValueError(f"run name {name!r} is invalid: -l and -L are two kinds of the same step size; one of them")
    if knobs.keys() & set("wlL"):
        share, rounds = knobs.get("w", (None, 0))
        scale, scale_rounds = knobs.get("L", knobs.get("l", (1.0, None)))
        warmup = Warmup(share=share, scale=scale, rounds=rounds, scale_rounds=scale_rounds, rescale="l" not in knobs)
    return base, warmup, {k: v for k, v in knobs.items() if k in "MaN"} or None


def settings_of(name: str, numel: int) -> tuple[str, dict, Warmup | None, tuple[float, int] | None]:
    """(upload, wrapper settings, warm-up, screening knobs) of a run name; ValueError for a bad name."""
    base, warmup, knobs = split_name(name)
    upload, settings = xd.settings_of(base, numel)
    if (warmup is not None or knobs) and settings.get("aggregation") != "sketch":
        raise ValueError(f"run name {name!r} is invalid: a warm-up (-w, -l, -L, -M, -a) needs a sketch run (s<share>...)")
    if warmup is not None and warmup.share is not None:  # the download carries the larger steps
        share = re.search(r"ratio=([0-9.]+)", upload)[1]
        bits = re.search(r"kbit\(bits=(\d+)", settings["download"])[1]
        settings["download"] = (f"dgc(ratio={share},momentum=0.0,warmup={warmup.rounds},start={warmup.share},"
                                f"sample=1.0)+kbit(bits={bits},stochastic=true)")
    return upload, settings, warmup, knobs


@contextlib.contextmanager
def server_warmup(warmup: Warmup | None, knobs: dict | None = None):
    """While open, the ServerFeedback the wrapper builds (it has no warm-up setting) gets
    ``warmup``, and the study's screening ``knobs`` (:func:`split_name`)."""
    if warmup is None and not knobs:
        yield
        return
    from fedcomp import server_feedback
    from fedcomp.codecs.dgc import warmup_fraction
    from fedcomp.fetchsgd import sketch_step
    from fedcomp.server_feedback import ServerFeedback
    from fedcomp.strategies import aggregation

    knobs = knobs or {}
    momentum = knobs.get("M")
    factor = [1.0, 1.0]  # the applied step's factor (-a), the warm-up's scale of the mean table

    cap = [0.0]  # the step's largest L2 norm this round (0: none)

    def scaled_step(reducer, momentum_t, error, summed, rho, numel, k=None):
        target = float(torch.linalg.vector_norm(summed)) / factor[1] / getattr(reducer, "rows", 1) ** 0.5
        delta = sketch_step(reducer, momentum_t, error, summed, rho, numel, k)
        if factor[0] != 1:
            delta.mul_(factor[0])
        norm = float(torch.linalg.vector_norm(delta))
        if cap[0] and norm > cap[0] * target > 0:
            delta.mul_(cap[0] * target / norm)
        return delta

    class WarmFeedback(ServerFeedback):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, warmup=warmup, **kwargs)
            self._rho = self.momentum

        def _step(self, broadcast, nonce, round):
            if momentum is not None:
                self.momentum = momentum[0] if 1 <= round <= momentum[1] else self._rho
            if "a" in knobs:
                factor[0] = warmup_fraction(1.0, knobs["a"][1], round, knobs["a"][0])
            factor[1] = self.scale(round)
            if "N" in knobs:
                cap[0] = knobs["N"][0] if 1 <= round <= knobs["N"][1] else 0.0
            return super()._step(broadcast, nonce, round)

    aggregation.ServerFeedback = WarmFeedback
    if "a" in knobs or "N" in knobs:
        server_feedback.sketch_step = scaled_step
    try:
        yield
    finally:
        aggregation.ServerFeedback = ServerFeedback
        server_feedback.sketch_step = sketch_step


def run_one(name: str, *, task: str, model: str, rounds: int, clients: int, fraction: float, lr: float | None,
            seed: int) -> dict:
    from fedcomp.simulations import harness

    upload, settings, warmup, knobs = settings_of(name, xd.numel_of(task, model, seed))
    t0 = time.perf_counter()
    with server_warmup(warmup, knobs):
        h = harness.run(upload, task=task, model=model, strategy="FedAvg", rounds=rounds, clients=clients,
                        fraction=fraction, seed=seed, lr=lr, **settings)
    acc = [r["accuracy"] for r in h.rows]
    up, up_dense = sum(r["upload_bytes"] for r in h.rows), sum(r["upload_bytes_dense"] for r in h.rows)
    down, down_dense = sum(r["download_bytes"] for r in h.rows), sum(r["download_bytes_dense"] for r in h.rows)
    return {"name": name, "task": task, "model": model, "rounds": rounds, "clients": clients, "fraction": fraction,
            "lr": h.config["lr"], "seed": seed, "upload": h.upload, "download": h.download,
            "aggregation": h.aggregation, "settings": settings, "warmup": dataclasses.asdict(warmup) if warmup else None, "knobs": knobs,
            "last5": sum(acc[-5:]) / max(1, len(acc[-5:])), "accuracy": acc,
            "up_x": up_dense / up if up else None, "down_x": down_dense / down if down else None,
            "upload_bytes": up, "download_bytes": down, "error": h.error,
            "download_bytes_per_round": [r["download_bytes"] for r in h.rows],
            "seconds": round(time.perf_counter() - t0, 1)}


def table(records: list[dict], *, task: str, model: str, rounds: int, clients: int, fraction: float,
          names: list[str] | None = None, reach: float = 0.8) -> str:
    """The Markdown table of the matching records (module docstring)."""
    where = (task, model, rounds, clients, fraction)
    recs = [r for r in records if (r["task"], r["model"], r["rounds"], r["clients"], r["fraction"]) == where]
    dense = {r["seed"]: r for r in recs if r["name"] == "dense"}
    order = list(dict.fromkeys(r["name"] for r in recs if not names or r["name"] in names))
    mean = xd._mean
    lines = [f"{task}/{model}, {clients} clients x {fraction} per round, {rounds} rounds",
             "",
             "| run | seeds | last-5 acc % | dense % (same seeds) | diff mean | diff min..max | acc r5 | acc r10 "
             f"| acc r20 | first round >= {reach * 100:.0f}% | up x | down x |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in order:
        rs = sorted((r for r in recs if r["name"] == name), key=lambda r: r["seed"])
        paired = [r for r in rs if r["seed"] in dense]
        diffs = [r["last5"] - dense[r["seed"]]["last5"] for r in paired] if name != "dense" else []
        diff = f"{mean(diffs) * 100:+.2f} | {xd._range(diffs)}" if diffs else " | "
        base = f"{mean([dense[r['seed']]['last5'] for r in paired]) * 100:.2f}" if paired else ""
        at = [mean([r["accuracy"][k - 1] for r in rs if len(r["accuracy"]) >= k]) * 100 for k in (5, 10, 20)]
        first = [next((i + 1 for i, a in enumerate(r["accuracy"]) if a >= reach), None) for r in rs]
        reached = [f for f in first if f]
        to_reach = ((f"{mean(reached):.1f}" if reached else "never")
                    + ("" if all(first) or not reached else f" ({first.count(None)} never)"))
        err = " (error)" if any(r["error"] for r in rs) else ""
        lines.append(f"| `{name}`{err} | {','.join(str(r['seed']) for r in rs)} | "
                     f"{mean([r['last5'] for r in rs]) * 100:.2f} | {base} | {diff} | "
                     + " | ".join(f"{a:.1f}" for a in at)
                     + f" | {to_reach} | {mean([r['up_x'] for r in rs if r['up_x']]):.1f} "
                     f"| {mean([r['down_x'] for r in rs if r['down_x']]):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    xd.run_arguments(p, OUT)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from fedcomp.simulations.harness import DEFAULT_LR

    lr = DEFAULT_LR.get((a.task, a.model), DEFAULT_LR.get(a.task, 0.05)) if a.lr is None else a.lr
    a.out.parent.mkdir(parents=True, exist_ok=True)
    done = {xd.key_of(r) for r in xd.load(a.out)}
    for name in a.names:
        settings_of(name, 1)  # a bad name fails before any run
    for seed in [int(s) for s in a.seeds.split(",")]:
        for name in a.names:
            if (name, a.task, a.model, a.rounds, a.clients, a.fraction, lr, seed) in done:
                continue
            rec = run_one(name, task=a.task, model=a.model, rounds=a.rounds, clients=a.clients,
                          fraction=a.fraction, lr=lr, seed=seed)
            with a.out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{name} seed {seed}: last5 {rec['last5'] * 100:.2f} first 10 "
                  f"{[round(x * 100) for x in rec['accuracy'][:10]]} up {rec['up_x']:.1f}x down {rec['down_x']:.1f}x ({rec['seconds']} s)"
                  f"{' ' + rec['error'] if rec['error'] else ''}", flush=True)
    print(table(xd.load(a.out), task=a.task, model=a.model, rounds=a.rounds, clients=a.clients,
                fraction=a.fraction, names=a.names or None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
