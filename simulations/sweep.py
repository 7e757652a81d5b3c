"""Accuracy against bytes: every codec on the default digits task, in-process, without Flower's engine.

The federated loop is the one ``flwr run .`` runs (``simulations/client_app.py`` + ``clients/mod.py`` +
``simulations/server_app.py``), replayed in one process so a 100-round sweep of many codecs fits on two
cores:

1. Same task: ``fedcomp.simulations.task`` data split, Dirichlet partitions (alpha 0.5), model, local
   SGD (1 epoch, lr 0.3, batch 32) and the same training seeds per (round, partition).
2. Each client trains from the global model, computes its update, and calls
   :func:`fedcomp.compress` with its own residual and codec state (error feedback on or off).
3. The server streams the replies through :class:`fedcomp.aggregate.Accumulator` (the running
   sum ``CompressedStrategy`` uses), weighted by the clients' example counts (FedAvg), and moves
   the global model by the mean (:meth:`~fedcomp.aggregate.Accumulator.apply_mean`);
   accuracy is measured on the held-out digits after every round.
4. Bytes are Flower message bytes: each reply is built as the ``RecordDict`` the client mod
   sends (``fedcomp.upload`` ConfigRecord with the payload, plus the app's MetricRecord) and
   sized with ``fedcomp.msgsize.message_bytes``; the dense reference is the same reply with
   the model as an ArrayRecord. Downloads are the broadcast records the wrapper sends
   (``download='none()'``).

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
import time
import zlib
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
    """One federated run; returns its config and per-round rows.

    A spec with one ``param=auto`` (``topk(ratio=auto)+qsgd(bits=4)``) is resolved each round by
    :class:`fedcomp.adapt.AutoStrength` from the held-out accuracy after the previous round (what the
    project's ServerApp evaluates centrally); each row then records the round's ``upload_spec``, the
    knob's value (``strength``), the controller's ``budget``, its ``decision`` and the reply bytes besides
    the payload (``fixed_bytes``, which floor the budget).
    """
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    import fedcomp
    from fedcomp import protocol as P
    from fedcomp.aggregate import Accumulator
    from fedcomp.simulations import task
    from fedcomp.msgsize import message_bytes

    cfg = {**DEFAULTS, **(cfg or {})}
    torch.set_num_threads(1)
    seed = int(cfg["seed"])
    from fedcomp.adapt import AdaptSettings, AutoStrength, is_auto

    model = task.build_model(cfg["model"], seed=seed)
    train_set, test_set = task.load_digits_split(seed=seed)
    x_test, y_test = test_set.tensors
    parts = [task.partition(train_set, clients, pid, float(cfg["partition-alpha"]), seed) for pid in range(clients)]
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layout = fedcomp.Layout.of(global_state)
    auto = AutoStrength(spec, layout, AdaptSettings(**cfg.get("adapt", {})), seed=seed) if is_auto(spec) else None
    codec = fedcomp.build_codec(spec) if auto is None else None
    if auto is not None:  # the ServerApp's evaluate_fn(0): the initial model's accuracy is the first signal
        auto.observe(0, task.evaluate(model, x_test, y_test, device="cpu")[1])
    residuals: list[dict | None] = [None] * clients
    states: list[dict] = [{} for _ in range(clients)]
    rows = []
    sizes: dict[tuple[int, int], int] = {}
    down_bytes = down_bytes_dense = None  # the broadcast's size does not change between rounds
    t_start = time.perf_counter()
    for rnd in range(1, rounds + 1):
        if auto is not None:
            codec = fedcomp.build_codec(auto.spec(rnd))
            down_bytes = None  # the broadcast names the round's upload spec
        # the broadcast the wrapper sends with download='none()'
        down = fedcomp.build_codec("none()").encode(global_state, nonce=fedcomp.derive_nonce(seed, rnd, 0), round=rnd)
        ref_crc = zlib.crc32(down.payload)
        down_msg = RecordDict({"config": ConfigRecord({"server-round": rnd}), P.DOWNLOAD_RECORD: ConfigRecord({
            P.MODE: "full", P.PAYLOADS: [down.payload], P.ROUNDS: [rnd], P.BASE_CRC: 0, P.REF_CRC: ref_crc,
            P.TIER: 0, P.TIERS: 1, P.TIER_KBPS: "",
            P.LAYOUT: layout.to_json(), P.UPLOAD_SPEC: codec.spec, P.DOWNLOAD_SPEC: "none()",
            P.ERROR_FEEDBACK: error_feedback, P.SEED: seed, P.ROUND: rnd, P.ARRAYS_KEY: "arrays",
            P.DELTA: 0.0, P.DELTA_REF: 0, P.LINK_PROFILE: "none", P.DEADLINE: 0.0, P.FALLBACK: "skip"})})
        down_dense = RecordDict({"arrays": ArrayRecord(global_state), "config": ConfigRecord({"server-round": rnd})})
        if down_bytes is None:
            down_bytes, down_bytes_dense = message_bytes(down_msg), message_bytes(down_dense)
        acc = Accumulator(codec, layout)
        up = up_dense = 0
        for pid, (x, y) in enumerate(parts):
            model.load_state_dict(global_state)
            loss = task.train(model, x, y, epochs=int(cfg["local-epochs"]), lr=float(cfg["lr"]),
                              batch_size=int(cfg["batch-size"]), seed=seed * 100_003 + rnd * 1009 + pid, device="cpu")
            trained = model.state_dict()
            delta = {k: trained[k] - global_state[k] for k in layout.names}
            encoded, residuals[pid] = fedcomp.compress(
                codec, delta, residuals[pid], nonce=fedcomp.derive_nonce(seed, rnd, pid + 1),
                error_feedback=error_feedback, round=rnd, state=states[pid])
            metrics = MetricRecord({"train_loss": float(loss), "num-examples": int(x.shape[0])})
            reply = RecordDict({P.UPLOAD_RECORD: ConfigRecord({  # the fields clients/mod.py sends
                P.PAYLOAD: encoded.payload, P.ARRAYS_KEY: "arrays", P.DELTA_REF: 0,
                P.TIER: 0, P.REF_VERSION: rnd, P.REF_CRC: ref_crc, P.WANT_TIER: 0}), "metrics": metrics})
            key = (len(encoded.payload), pid)  # the size depends on the payload's length and the client's metrics only
            if key not in sizes:
                sizes[key] = message_bytes(reply)
            up += sizes[key]
            if rnd == 1 and pid == 0:
                dense_reply = message_bytes(RecordDict({"arrays": ArrayRecord(trained), "metrics": metrics}))
            up_dense += dense_reply  # the model record dominates; metrics differ by a few bytes per client
            acc.add(encoded.payload, float(x.shape[0]), round=rnd)
        global_state = acc.apply_mean(global_state)  # what CompressedStrategy does with a FedAvg round
        model.load_state_dict(global_state)
        loss, accuracy = task.evaluate(model, x_test, y_test, device="cpu")
        rows.append({"round": rnd, "accuracy": accuracy, "loss": loss, "upload_bytes": up,
                     "upload_bytes_dense": up_dense, "download_bytes": clients * down_bytes,
                     "download_bytes_dense": clients * down_bytes_dense})
        if auto is not None:
            auto.observe_message(rnd, up / clients)
            auto.observe(rnd, accuracy)
            h = auto.history[-1]
            rows[-1].update(upload_spec=h["spec"], strength=h[auto.param], budget=h["budget"], decision=h["decision"],
                            fixed_bytes=h["fixed_bytes"])
    return {"upload": spec, "error_feedback": error_feedback, "rounds": rows, "clients": clients, "config": cfg,
            "seconds": time.perf_counter() - t_start}


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
