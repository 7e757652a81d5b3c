"""Screen wrapped settings on one cell of the regime table, against its unwrapped runs.

``regime_table`` runs the defaults (``auto``); this runs the same cell wrapped with other settings
(``harness.run`` keyword arguments as JSON: ``upload``, ``download``, ``aggregation``,
``server_momentum``...) on the same regime and seeds, and appends one record per run to
``--out`` with the settings beside it. ``patch`` pins functions that pick a default (``"module:fn":
value``, e.g. ``robust_share``) for runs that try a default before it is one::

    python -m fedcomp.simulations.regime_screen silo:stdlib-chars/char-lstm:FedAvg \\
        '{"upload": "sketch(rows=1,cols=15187,ratio=0.1)+qsgd(bits=4)", "aggregation": "sketch", \\
          "server_momentum": 0.0}' --seeds 0 1
    python -m fedcomp.simulations.regime_screen silo:stdlib-chars/char-lstm:FedMedian \\
        '{"server_momentum": 0.0, "patch": {"fedcomp.strategies.wrapper:robust_share": 0.1, \\
          "fedcomp.strategies.resolution:robust_share": 0.1}}' --seeds 0

The gap printed is against the unwrapped run of the same cell and seed in ``regime_table``'s
records (``--table`` of that module); none there: the accuracy alone.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import time
from pathlib import Path

from fedcomp.simulations import regime_table as rt

OUT = Path("results/regimes/screen.jsonl")


def _pin(target: str, value):
    """Make ``module:function`` return ``value``; returns a callable that restores it."""
    module, _, name = target.partition(":")
    if not name:
        raise ValueError(f"patch target {target!r} is invalid: write 'module:function'")
    owner = importlib.import_module(module)
    before = getattr(owner, name)
    setattr(owner, name, lambda *args, **kwargs: value)
    return lambda: setattr(owner, name, before)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedcomp.simulations.regime_screen", description=__doc__.split("\n")[0])
    parser.add_argument("cell", help="regime:task/model:Strategy (one strategy)")
    parser.add_argument("settings", help="harness.run keyword arguments as JSON (upload defaults to 'auto')")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--rounds", type=int, default=None, help="override the regime's rounds (checks only)")
    args = parser.parse_args(argv)
    cells = rt.parse_cells(args.cell)
    if len(cells) != 1:
        parser.error(f"cell {args.cell!r}: give one strategy")
    cell = cells[0]
    settings = json.loads(args.settings)
    if not isinstance(settings, dict):
        parser.error(f"settings {args.settings!r}: a JSON object of harness.run keyword arguments")
    upload = settings.pop("upload", "auto")
    patch = settings.pop("patch", {})
    restore = [_pin(target, value) for target, value in patch.items()]
    try:
        _screen(cell, upload, settings, patch, args)
    finally:
        for undo in restore:
            undo()
    return 0


def _screen(cell, upload: str, settings: dict, patch: dict, args) -> None:
    import torch

    from fedcomp.simulations import harness

    torch.set_num_threads(1)
    clients, fraction, rounds = rt.REGIMES[cell.regime]
    rounds = args.rounds or rounds
    dense = {(r["regime"], r["task"], r["model"], r["strategy"], r["seed"]): rt.accuracy(r)
             for r in rt.load() if not r["wrapped"]}
    for seed in args.seeds:
        t0 = time.time()
        h = harness.run(upload, task=cell.task, model=cell.model, strategy=cell.strategy, rounds=rounds,
                        clients=clients, fraction=fraction, seed=seed, **settings)
        record = {"regime": cell.regime, "task": cell.task, "model": cell.model, "strategy": cell.strategy,
                  "wrapped": True, "seed": seed, "planned_rounds": rounds, "settings": dict(settings, upload=upload, **({"patch": patch} if patch else {})),
                  "upload": h.upload, "download": h.download, "error": h.error, "seconds": round(time.time() - t0, 1),
                  "commit": rt._commit(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "rounds": [{k: r[k] for k in ("round", "accuracy", "upload_bytes", "download_bytes",
                                                "upload_bytes_dense", "download_bytes_dense")} for r in h.rows]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        acc = rt.accuracy(record)
        ref = dense.get((cell.regime, cell.task, cell.model, cell.strategy, seed))
        gap = f"gap {acc - ref:+.2f}" if ref is not None else "no unwrapped run"
        print(f"{args.cell} seed {seed}: {acc:.2f}% ({gap}) upload {h.upload} download {h.download}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
