"""Federated runs on any task through the one experiment harness, with a check of the model state
that is not a weight.

Each run is :func:`fedcomp.simulations.harness.run` (Flower's FedAvg, wrapped by
:class:`~fedcomp.strategies.CompressedStrategy` unless the upload is ``dense``, the project's
ClientApp behind ``compression_mod``, ``Strategy.start`` in one process) on any task of
:mod:`fedcomp.simulations.task`. After every round: test accuracy, and the state check of the
global model: the smallest BatchNorm ``running_var`` entry, the ``num_batches_tracked`` counters,
non-finite entries. ``exact_state=True`` is the wrapper's ``exact_statistics`` (statistics and
counters travel exact beside the compressed weights, :mod:`fedcomp.tensor_kinds`); off, they go
through the codec like weights. A run the wrapper stops (a non-finite model, a negative running
variance) records the error and the rounds before it.

Baselines (dense FedAvg) and the BN check, from the command line::

    python -m fedcomp.simulations.task_runs baseline --task mnist --model cnn-bn --rounds 30 --lr 0.05
    python -m fedcomp.simulations.task_runs bn-check --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

#: (task, model, lr) of the baselines; lr tuned coarsely for plain local SGD, batch 32, 1 epoch
#: (their accuracies: docs/how-to/project-simulations.md).
BASELINES: tuple[tuple[str, str, float], ...] = (
    ("mnist", "cnn-bn", 0.05),
    ("mnist", "resnet", 0.05),
    ("stdlib-chars", "char-lstm", 2.0),
)

#: One upload spec per codec family, for the BN check (sketch: FetchSGD aggregation).
BN_CHECK_CODECS: tuple[tuple[str, str, bool], ...] = (
    ("none()", "decode", False),
    ("fp16()", "decode", False),
    ("kbit(bits=4)", "decode", True),
    ("qsgd(bits=4)", "decode", False),
    ("sign()", "decode", True),
    ("terngrad()", "decode", True),
    ("topk(ratio=0.01)+qsgd(bits=4)", "decode", True),
    ("randomk(ratio=0.01,rescale=false)", "decode", True),
    ("dgc(ratio=0.001)+qsgd(bits=4)", "decode", True),
    ("powersgd(rank=2)", "decode", True),
    ("sketch(rows=1,cols=4000,ratio=0.01)", "sketch", False),
)


def state_check(state: dict[str, torch.Tensor]) -> dict:
    """Smallest ``running_var`` entry, the counters' values, and whether anything is non-finite."""
    variances = [v for k, v in state.items() if k.endswith("running_var")]
    counters = [int(v) for k, v in state.items() if k.endswith("num_batches_tracked")]
    return {
        "min_running_var": min(float(v.min()) for v in variances) if variances else None,
        "counters": sorted(set(counters)),
        "finite": all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point()),
    }


def federated_run(
    task_name: str,
    model_name: str,
    *,
    upload: str = "dense",
    aggregation: str = "decode",
    error_feedback: bool = True,
    exact_state: bool = False,
    clients: int = 10,
    fraction: float = 1.0,
    rounds: int = 30,
    lr: float = 0.05,
    local_epochs: int = 1,
    batch_size: int = 32,
    alpha: float = 0.5,
    seed: int = 0,
    server_momentum: float = 0.0,
    evaluate: bool = True,
    log=print,
) -> dict:
    """One FedAvg run through :func:`fedcomp.simulations.harness.run` (``upload="dense"``: FedAvg
    unwrapped); ``exact_state`` is the wrapper's ``exact_statistics``. Returns its config, the
    resolved spec and per-round rows with :func:`state_check` of the global model."""
    config = {k: v for k, v in locals().items() if k != "log"}
    from fedcomp.simulations import harness

    settings = {} if upload == harness.DENSE else {
        "aggregation": aggregation, "error_feedback": error_feedback, "exact_statistics": exact_state,
        "download": "none()", **({"server_momentum": server_momentum} if server_momentum else {})}

    def observe(rnd: int, state: dict) -> dict:
        check = state_check(state)
        log(f"{task_name}/{model_name} {upload} [{aggregation}{', exact state' if exact_state else ''}] round {rnd:3d} "
            f"min var {check['min_running_var']} counters {check['counters'][:3]}")
        return check

    h = harness.run(upload, task=task_name, model=model_name, rounds=rounds, clients=clients, fraction=fraction,
                    seed=seed, lr=lr, local_epochs=local_epochs, batch_size=batch_size, alpha=alpha,
                    observe=observe, evaluate=evaluate, **settings)
    rows = [{"round": r["round"], "accuracy": r["accuracy"], "loss": r["loss"], "upload_bytes": r["upload_bytes"],
             "clients": r["replies"], "aggregated": r["aggregated"], "min_running_var": r["min_running_var"],
             "counters": r["counters"], "finite": r["finite"]} for r in h.rows]
    return {"config": config, "spec": h.upload, "rounds": rows, "error": h.error, "seconds": round(h.seconds, 1)}


def bn_check(rounds: int = 3, clients: int = 4, exact_state: bool = False, codecs=BN_CHECK_CODECS,
             fraction: float = 1.0, batch_size: int = 32, evaluate: bool = True, log=print) -> list[dict]:
    """Train the BatchNorm CNN (task ``mnist``) through every codec family; one summary per codec:
    whether every round kept ``running_var >= 0`` and finite values, and whether the counters
    advanced every round."""
    out = []
    for upload, aggregation, ef in codecs:
        res = federated_run("mnist", "cnn-bn", upload=upload, aggregation=aggregation, error_feedback=ef,
                            exact_state=exact_state, clients=clients, fraction=fraction, rounds=rounds, lr=0.05,
                            batch_size=batch_size,
                            evaluate=evaluate, log=lambda *_: None)
        rows = res["rounds"]
        counters = [r["counters"] for r in rows]
        advanced = len(rows) == rounds and all(len(c) == 1 for c in counters) and all(
            b[0] > a[0] for a, b in zip([[0]] + counters[:-1], counters))
        summary = {
            "upload": upload, "aggregation": aggregation, "exact_state": exact_state,
            "var_nonnegative": len(rows) == rounds and all(
                r["min_running_var"] is not None and r["min_running_var"] >= 0 for r in rows),
            "min_running_var": min((r["min_running_var"] for r in rows if r["min_running_var"] is not None),
                                   default=None),
            "counters_advance": advanced, "counters": counters,
            "finite": all(r["finite"] for r in rows) and res["error"] is None, "error": res["error"],
            "accuracy": rows[-1]["accuracy"] if rows else float("nan"),
        }
        log(json.dumps(summary))
        out.append(summary)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("baseline", help="dense FedAvg (or any --upload) on one task")
    b.add_argument("--task", required=True)
    b.add_argument("--model", required=True)
    b.add_argument("--upload", default="dense", help="an upload spec, or 'dense': FedAvg unwrapped")
    b.add_argument("--aggregation", default="decode", choices=("decode", "sketch"))
    b.add_argument("--no-error-feedback", action="store_true")
    b.add_argument("--exact-state", action="store_true")
    b.add_argument("--clients", type=int, default=10)
    b.add_argument("--fraction", type=float, default=1.0)
    b.add_argument("--rounds", type=int, default=30)
    b.add_argument("--lr", type=float, required=True)
    b.add_argument("--local-epochs", type=int, default=1)
    b.add_argument("--batch-size", type=int, default=32)
    b.add_argument("--alpha", type=float, default=0.5)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--out", type=Path, default=None, help="write the run as JSON here")
    c = sub.add_parser("bn-check", help="BatchNorm statistics through every codec family")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--clients", type=int, default=4)
    c.add_argument("--exact-state", action="store_true")
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cmd == "baseline":
        result = federated_run(args.task, args.model, upload=args.upload, aggregation=args.aggregation,
                               error_feedback=not args.no_error_feedback, exact_state=args.exact_state,
                               clients=args.clients, fraction=args.fraction, rounds=args.rounds, lr=args.lr,
                               local_epochs=args.local_epochs, batch_size=args.batch_size, alpha=args.alpha,
                               seed=args.seed)
        best = max((r["accuracy"] for r in result["rounds"] if not math.isnan(r["accuracy"])), default=float("nan"))
        print(f"final accuracy {result['rounds'][-1]['accuracy']:.4f}, best {best:.4f}")
    else:
        result = bn_check(args.rounds, args.clients, args.exact_state)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
    main()
