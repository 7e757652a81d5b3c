"""Robust strategies under attack, wrapped and unwrapped: does compression keep their robustness?

Ten clients on digits, all training every round (``--clients``/``--fraction`` for cross-device);
``--attackers`` of them (partitions 0, 1...) train
honestly, then reply ``received + factor x (trained - received)``: ``flip`` sends the update
reversed and scaled (``--flip-factor``, default -4), ``scale`` sends it scaled (``--scale-factor``,
default 8); both stay inside the wrapper's default norm guard (10x), so what holds them is the
strategy. The attack happens before ``compression_mod`` encodes the reply, as a hostile client
running fedcomp would do it. For each strategy and seed, four runs: unwrapped and wrapped, without
and with the attack; the table gives final accuracy (mean of the last 3 rounds), the loss of
accuracy the attack costs, and the upload reduction.

    python -m fedcomp.simulations.robust_study --strategies FedMedian Krum FedTrimmedAvg \\
        --seeds 0 1 2 --rounds 30 --attack flip --json results/robust/flip.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedcomp.clients.mod import make_compression_mod
from fedcomp.simulations import client_app
from fedcomp.simulations.faults import faults_mod
from fedcomp.simulations.harness import DENSE, run
from fedcomp.simulations.netsim import netsim_mod

ATTACKS = {"flip": "flip-factor", "scale": "scale-factor"}


def attack_train(attackers: int, factor: float):
    """The project's ClientApp ``train`` whose partitions ``0..attackers-1`` reply ``received + factor x
    update``."""

    def train(msg: Message, context: Context) -> Message:
        reply = client_app.train(msg, context)
        if int(context.node_config["partition-id"]) >= attackers:
            return reply
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        trained = reply.content.array_records["arrays"].to_torch_state_dict()
        forged = {k: (received[k] + factor * (v - received[k])) if v.is_floating_point() else v
                  for k, v in trained.items()}
        content = RecordDict({"arrays": ArrayRecord(forged), "metrics": reply.content.metric_records["metrics"]})
        return Message(content, reply_to=msg)

    return train


def attack_app(attackers: int, factor: float) -> ClientApp:
    """The project's ClientApp (its mods) around :func:`attack_train`: the attack happens before
    ``compression_mod`` encodes the reply."""
    app = ClientApp(mods=[netsim_mod, faults_mod, make_compression_mod(initial_model=client_app.initial_model)])
    app.train()(attack_train(attackers, factor))
    return app


def final_accuracy(history, last: int = 3) -> float:
    accs = [r["accuracy"] for r in history.rows[-last:]]
    return sum(accs) / len(accs) if accs else float("nan")


def study(strategies: Sequence[str], seeds: Sequence[int], rounds: int, attackers: int, factor: float,
          upload: str, settings: dict, clients: int = 10, fraction: float = 1.0) -> list[dict]:
    rows = []
    for name in strategies:
        for seed in seeds:
            row = {"strategy": name, "seed": seed}
            for wrapped in (False, True):
                up = upload if wrapped else DENSE
                extra = settings if wrapped else {}
                clean = run(up, strategy=name, rounds=rounds, clients=clients, fraction=fraction, seed=seed, **extra)
                hit = run(up, strategy=name, rounds=rounds, clients=clients, fraction=fraction, seed=seed,
                          app=attack_app(attackers, factor), **extra)
                tag = "wrapped" if wrapped else "plain"
                row[f"{tag}_clean"] = final_accuracy(clean)
                row[f"{tag}_attacked"] = final_accuracy(hit)
                row[f"{tag}_error"] = clean.error or hit.error
                if wrapped:
                    row["upload"] = clean.upload
                    row["aggregation"] = clean.aggregation
                    dense = sum(r["upload_bytes_dense"] for r in clean.rows)
                    row["upload_x"] = dense / max(1, sum(r["upload_bytes"] for r in clean.rows))
                    down = sum(r["download_bytes_dense"] for r in clean.rows)
                    row["download_x"] = down / max(1, sum(r["download_bytes"] for r in clean.rows))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| strategy | plain clean | plain attacked | wrapped clean | wrapped attacked | attack cost plain | "
           "attack cost wrapped | upload x | download x |", "|---|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["strategy"] for r in rows):
        rs = [r for r in rows if r["strategy"] == name]

        def cell(key: str) -> str:
            v = [100 * r[key] for r in rs]
            return f"{statistics.mean(v):.1f} ± {(max(v) - min(v)) / 2:.1f}"

        def cost(tag: str) -> str:
            v = [100 * (r[f"{tag}_clean"] - r[f"{tag}_attacked"]) for r in rs]
            return f"{statistics.mean(v):.1f} ± {(max(v) - min(v)) / 2:.1f}"
        up = statistics.mean(r["upload_x"] for r in rs)
        down = statistics.mean(r["download_x"] for r in rs)
        out.append(f"| {name} | {cell('plain_clean')} | {cell('plain_attacked')} | {cell('wrapped_clean')} | "
                   f"{cell('wrapped_attacked')} | {cost('plain')} | {cost('wrapped')} | {up:.1f}x | {down:.1f}x |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", nargs="+", default=["FedMedian", "Krum", "FedTrimmedAvg"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--attackers", type=int, default=2, help="partitions 0..N-1 attack")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--fraction", type=float, default=1.0, help="of the clients sampled per round (cross-device: 0.1)")
    ap.add_argument("--attack", choices=sorted(ATTACKS), default="flip")
    ap.add_argument("--flip-factor", type=float, default=-4.0)
    ap.add_argument("--scale-factor", type=float, default=8.0)
    ap.add_argument("--upload", default="auto", help="the wrapped runs' upload spec (default: the regime's)")
    ap.add_argument("--aggregation", default="auto")
    ap.add_argument("--server-momentum", type=float, help="the wrapped runs' server_momentum (default: the wrapper's)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    factor = args.flip_factor if args.attack == "flip" else args.scale_factor
    t0 = time.time()
    settings = {"aggregation": args.aggregation}
    if args.server_momentum is not None:
        settings["server_momentum"] = args.server_momentum
    rows = study(args.strategies, args.seeds, args.rounds, args.attackers, factor, args.upload, settings,
                 clients=args.clients, fraction=args.fraction)
    print(f"{args.attack} x{factor:g}, {args.attackers} of {args.clients} clients ({args.fraction:g} a round), "
          f"{args.rounds} rounds, seeds {args.seeds}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.time() - t0:.0f} s")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": list(argv) if argv is not None else None, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
