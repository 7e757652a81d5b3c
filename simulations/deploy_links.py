"""Wall-clock time-to-accuracy of Flower's deployment engine on shaped links: dense vs fedcomp.

One deployment (:func:`fedcomp.simulations.deploy.deployment` with ``links``): a SuperLink and N
SuperNodes, each SuperNode in its own network namespace with tc rate limits per direction and the
latency added by its relay (:mod:`fedcomp.simulations.shaped`; ``--shaping relay`` where namespaces
are unavailable). On it, one ``flwr run`` of the project's app per configuration:

* ``dense``: ``upload='none()' download='none()'`` (what plain Flower sends),
* ``defaults``: fedcomp's defaults (``upload='auto' download='auto'``),
* ``budgets``: every node's shaped link declared (``link-profile`` = a per-partition table of the
  same rates) and a round deadline: budgeted uploads,
* ``measured``: ``link-profile='measured'`` and the same deadline: budgets from the links the
  server measures from message timestamps (nothing declared).

Per run and round it records the wall seconds since ``flwr run`` started (when ``results.json``
showed the round), the accuracy and the bytes (``results.json`` and each node's relay), and writes
under ``--out``: ``study.json`` (everything), ``table.md`` (time to the dense run's final accuracy
minus ``--margin``, rounds, bytes, speed-up over dense), ``time_to_accuracy.png`` (accuracy against
wall seconds) and, for the measured run, ``estimates.md`` (the estimated uplink and downlink kbps
per node and round against the shaped rates).

    python -m fedcomp.simulations.deploy_links --supernodes 8 --links mbit-mix --model mlp-large \\
        --rounds dense=4,defaults=8,budgets=6,measured=6 --out results/shaped-links
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fedcomp.links import Link
from fedcomp.simulations import deploy
from fedcomp.simulations.shaped import MIXES, node_links

__all__ = ["CONFIGS", "estimator_errors", "main", "time_to", "write_table"]

BUDGET_UPLOAD = "topk(ratio=0.01,index='fixed')+qsgd(bits=4)"  # a codec with a free parameter (k)
CONFIGS = ("dense", "defaults", "budgets", "measured")


def run_config(name: str, model: str, deadline: float, table: Path, extra: str) -> str:
    base = f"model='{model}' {extra}".strip()
    if name == "dense":
        return f"{base} upload='none()' download='none()'"
    if name == "defaults":
        return base
    budget = f"round-deadline-s={deadline} upload=\"{BUDGET_UPLOAD}\" budget-fallback='coarsest'"
    if name == "budgets":
        return f"{base} link-profile='{table}' {budget}"
    if name == "measured":
        return f"{base} link-profile='measured' {budget}"
    raise ValueError(f"configuration {name!r} is invalid: one of {CONFIGS}")


def write_link_table(links: list[Link], path: Path) -> Path:
    """The shaped links as a link-profile table (partition-id -> rates): what 'budgets' declares."""
    rows = ["partition-id,uplink-kbps,downlink-kbps,latency-ms"]
    rows += [f"{i},{link.uplink_kbps:g},{link.downlink_kbps:g},{link.latency_ms:g}" for i, link in enumerate(links)]
    path.write_text("\n".join(rows) + "\n")
    return path


def series(run: deploy.RunResult) -> list[dict]:
    """Per round: wall seconds since flwr run started, accuracy, bytes (content and relay)."""
    out, clock, up, down, c2s, s2c = [], 0.0, 0, 0, 0, 0
    for r in run.rounds:
        clock += r.seconds
        up += r.upload_bytes
        down += r.download_bytes
        c2s += r.relay.client_to_server
        s2c += r.relay.server_to_client
        out.append({"round": r.round, "wall_s": clock, "accuracy": r.accuracy, "upload_bytes": up,
                    "download_bytes": down, "relay_c2s": c2s, "relay_s2c": s2c, "round_s": r.seconds})
    return out


def time_to(rows: list[dict], target: float) -> dict | None:
    """The first round reaching ``target`` accuracy (its row), or None."""
    for row in rows:
        if row["accuracy"] >= target:
            return row
    return None


def estimator_errors(results: dict, node_index: dict[int, int], links: list[Link]) -> list[dict]:
    """Per node and round of a measured run: estimated up/down kbps against the shaped rates."""
    out = []
    for r in results.get("rounds", []):
        for e in r.get("link_estimates", []):
            i = node_index.get(int(e["node"]))
            if i is None or "est_up_kbps" not in e:
                continue
            link = links[i]
            up, down = e["est_up_kbps"], e["est_down_kbps"]
            by_node = e.get("timed_by") == "supernode"  # bytes and seconds of the SuperNode's own transfers
            out.append({"round": r["round"], "node": i, "up_kbps": link.uplink_kbps, "down_kbps": link.downlink_kbps,
                        "est_up_kbps": up, "est_down_kbps": down, "timed_by": e.get("timed_by", "server"),
                        "up_error": None if up is None else up / link.uplink_kbps - 1,
                        "down_error": None if down is None else down / link.downlink_kbps - 1,
                        "observed_up_s": e.get("observed_up_s"), "observed_down_s": e.get("observed_down_s"),
                        "wall_s": e.get("wall_s"), "overhead_s": e.get("overhead_s"),
                        "upload_bytes": e.get("link_up_bytes") if by_node else e.get("upload_bytes"),
                        "download_bytes": e.get("link_down_bytes") if by_node else e.get("download_bytes"),
                        "est_up_latency_s": e.get("est_up_latency_s"), "est_down_latency_s": e.get("est_down_latency_s"),
                        "budget": e.get("budget"), "compute_s": e.get("compute_s"),
                        "wire_up_s": e.get("wire_up_s"), "wire_down_s": e.get("wire_down_s")})
    for e in out:  # what the shaped link alone would take: bytes at its rate plus its latency
        link = links[e["node"]]
        if e["upload_bytes"] and e["observed_up_s"] is not None:
            e["shaped_up_s"] = e["upload_bytes"] * 8 / (link.uplink_kbps * 1000) + link.latency_ms / 1000
            e["excess_up_s"] = e["observed_up_s"] - e["shaped_up_s"]
        if e["download_bytes"] and e["observed_down_s"] is not None:
            e["shaped_down_s"] = e["download_bytes"] * 8 / (link.downlink_kbps * 1000) + link.latency_ms / 1000
            e["excess_down_s"] = e["observed_down_s"] - e["shaped_down_s"]
    return out


LEVELS = (0.5, 0.6, 0.7)  # fixed accuracies, timed besides the target


def write_table(study: dict, margin: float) -> str:
    runs = study["runs"]
    dense = runs.get("dense")
    lines = []
    if not dense or not dense["series"]:
        return "(no dense run)"
    final = dense["series"][-1]["accuracy"]
    target = final - margin
    base = time_to(dense["series"], target)
    lines.append(f"Target: the dense run's final accuracy {final:.2%} minus {margin * 100:g} point(s) = {target:.2%}.\n")
    lines.append("| run | rounds | final acc | wall s (run) | time to target | rounds to target | speed-up vs dense | "
                 "upload MB (results.json) | relay up MB | relay down MB | mean round s | "
                 + " | ".join(f"time to {v:.0%}" for v in LEVELS) + " |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(LEVELS))
    for name, run in runs.items():
        rows = run["series"]
        if not rows:
            lines.append(f"| {name} | failed (rc {run['returncode']}) | | | | | | | | | |")
            continue
        hit = time_to(rows, target)
        speed = (f"{base['wall_s'] / hit['wall_s']:.2f}x" if hit and base else "-")
        last = rows[-1]
        mean_round = sum(r["round_s"] for r in rows) / len(rows)
        lines.append(
            f"| {name} | {len(rows)} | {last['accuracy']:.2%} | {run['seconds']:.0f} | "
            f"{'%.0f s' % hit['wall_s'] if hit else 'not reached'} | {hit['round'] if hit else '-'} | {speed} | "
            f"{last['upload_bytes'] / 1e6:.2f} | {last['relay_c2s'] / 1e6:.2f} | {last['relay_s2c'] / 1e6:.2f} | "
            f"{mean_round:.1f} | "
            + " | ".join((f"{h['wall_s']:.0f} s (r{h['round']})" if (h := time_to(rows, v)) else "-") for v in LEVELS)
            + " |")
    return "\n".join(lines)


def _span(errors: list[float | None]) -> str:
    errors = [e for e in errors if e is not None]
    return f"{min(errors):+.0%}..{max(errors):+.0%}" if errors else "-"


def write_estimates(errors: list[dict], links: list[Link], from_round: int = 5) -> str:
    if not errors:
        return "(no link estimates)"
    lines = ["| node | shaped up / down kbps | est. up kbps (round 1..) | est. down kbps (round 1..) | "
             f"up error from round {from_round} | down error from round {from_round} |", "|---|---|---|---|---:|---:|"]
    for i, link in enumerate(links):
        mine = sorted((e for e in errors if e["node"] == i), key=lambda e: e["round"])
        late = [e for e in mine if e["round"] >= from_round]
        up = ", ".join("-" if e["est_up_kbps"] is None else f"{e['est_up_kbps']:,.0f}" for e in mine)
        down = ", ".join("-" if e["est_down_kbps"] is None else f"{e['est_down_kbps']:,.0f}" for e in mine)
        ue, de = (_span([e[f"{d}_error"] for e in late]) for d in ("up", "down"))
        lines.append(f"| {i} | {link.uplink_kbps:,.0f} / {link.downlink_kbps:,.0f} | {up} | {down} | {ue} | {de} |")
    late = [e for e in errors if e["round"] >= from_round]
    if late:
        ok_up = sum(e["up_error"] is not None and abs(e["up_error"]) <= 0.15 for e in late)
        ok_down = sum(e["down_error"] is not None and abs(e["down_error"]) <= 0.15 for e in late)
        lines.append(f"\nFrom round {from_round}: uplink estimates within 15% of the shaped rate in {ok_up}/{len(late)} "
                     f"node-rounds, downlink in {ok_down}/{len(late)}.")
    lines.append("\nWhat the server observed against what the shaped link alone takes (bytes at the rate + latency), "
                 "per direction, over all node-rounds:\n")
    lines.append("| direction | bytes (median) | observed s (median) | shaped link s (median) | excess s (min / median / max) "
                 "| timed on the wire | wire s / shaped s at the rate (min / median / max) |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for d, key in (("down", "download_bytes"), ("up", "upload_bytes")):
        rows = [e for e in errors if f"excess_{d}_s" in e]
        if not rows:
            continue
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        ex = [e[f"excess_{d}_s"] for e in rows]
        wired = [e for e in rows if e.get(f"wire_{d}_s") is not None]
        rate = lambda e: e[f"{d}_kbps"] * 1000 / 8  # noqa: E731
        ratios = [e[f"wire_{d}_s"] / (e[key] / rate(e)) for e in wired]
        spread = f"{min(ratios):.3f} / {med(ratios):.3f} / {max(ratios):.3f}" if ratios else "-"
        lines.append(f"| {d} | {med([e[key] for e in rows]):,} | {med([e[f'observed_{d}_s'] for e in rows]):.2f} | "
                     f"{med([e[f'shaped_{d}_s'] for e in rows]):.2f} | {min(ex):.2f} / {med(ex):.2f} / {max(ex):.2f} "
                     f"| {len(wired)} of {len(rows)} | {spread} |")
    return "\n".join(lines)


def plot(study: dict, path: Path, margin: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, run in study["runs"].items():
        rows = run["series"]
        if rows:
            ax.plot([r["wall_s"] for r in rows], [r["accuracy"] * 100 for r in rows], marker="o",
                    markersize=3, label=f"{name} ({rows[-1]['upload_bytes'] / 1e6:.1f} MB up)")
    dense = study["runs"].get("dense", {}).get("series")
    if dense:
        ax.axhline((dense[-1]["accuracy"] - margin) * 100, color="grey", linestyle=":", linewidth=1,
                   label="dense final - %g pt" % (margin * 100))
    ax.set_xlabel("wall-clock seconds since flwr run")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{study['supernodes']} SuperNodes on {study['shaping']}-shaped links ({study['links_name']}), "
                 f"{study['model']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=deploy.ROOT, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedcomp.simulations.deploy_links", description=__doc__.split("\n")[0])
    parser.add_argument("--supernodes", type=int, default=8)
    parser.add_argument("--links", default="mbit-mix", help=f"a mix {sorted(MIXES)}, a preset, 'mixed' or a table")
    parser.add_argument("--shaping", default="auto", choices=deploy.SHAPINGS)
    parser.add_argument("--model", default="mlp-large")
    parser.add_argument("--rounds", default="dense=4,defaults=8,budgets=6,measured=6",
                        help="runs and their rounds, in order, e.g. dense=4,defaults=8 (names: %s)" % ", ".join(CONFIGS))
    parser.add_argument("--deadline", type=float, default=15.0, help="round-deadline-s of budgets and measured")
    parser.add_argument("--margin", type=float, default=0.01, help="target = dense final accuracy - margin")
    parser.add_argument("--run-config", default="", help="extra run config for every run")
    parser.add_argument("--supernode", default="fedcomp", choices=deploy.SUPERNODES,
                        help="fedcomp (times its link: the measured run's estimates; short polls) or flower")
    parser.add_argument("--isolation", default="warm", choices=deploy.ISOLATIONS,
                        help="who starts the ClientApps (deploy.start_supernode): warm (default: forked from a "
                             "process with Flower and torch imported, fedcomp.clients.warm_exec), subprocess "
                             "(Flower's default: a new interpreter per message) or process")
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per ClientApp (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/shaped-links"))
    parser.add_argument("--work", type=Path, default=Path("outputs/shaped-links"),
                        help="logs and results.json files (default: outputs/shaped-links, ignored by git and the FAB)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs OUT/study.json holds (finished, rc 0) and run only the others")
    parser.add_argument("--report-only", action="store_true",
                        help="no runs: rewrite table.md and the plot from OUT/study.json (and the measured run's "
                             "results.json under --work)")
    args = parser.parse_args(argv)
    plan = []
    for item in args.rounds.split(","):
        name, _, n = item.partition("=")
        if name not in CONFIGS or not n.isdigit():
            parser.error(f"--rounds item {item!r} is invalid: name=rounds with name in {CONFIGS}")
        plan.append((name, int(n)))
    links = node_links(args.links, args.supernodes)
    out = args.out.resolve()
    if args.report_only:
        return _report(json.loads((out / "study.json").read_text()), out, links, args.margin, args.work.resolve())
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    table = write_link_table(links, out / "links.csv")
    deploy.sigterm_raises()  # the deployment's finally tears everything down

    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)} if args.threads else None
    study: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "commit": _commit(), "argv": sys.argv, "supernodes": args.supernodes, "links_name": args.links,
                   "links": [link.describe() for link in links], "model": args.model, "deadline_s": args.deadline,
                   "margin": args.margin, "isolation": args.isolation, "supernode": args.supernode, "runs": {}, "load_before": os.getloadavg()}
    if args.resume and (out / "study.json").is_file():
        old = json.loads((out / "study.json").read_text())
        kept = {k: v for k, v in old["runs"].items() if v.get("returncode") == 0 and v.get("series")}
        study["runs"] = kept
        study["resumed"] = {"kept": sorted(kept), "kept_from": {k: old.get(k) for k in ("date", "commit", "argv")}}
        plan = [(name, n) for name, n in plan if name not in kept]
        print(f"resuming: kept {sorted(kept)} from {old.get('date')}; running {[name for name, _ in plan]}", flush=True)
    t0 = time.monotonic()
    with deploy.deployment(work / "deploy", args.supernodes, links=links, shaping=args.shaping,
                           supernode_env=env, isolation=args.isolation, supernode=args.supernode) as dep:
        study["shaping"] = dep.shaping
        study["startup_s"] = time.monotonic() - t0
        nodes = dep.node_ids()
        print(f"{args.supernodes} SuperNodes on {dep.shaping}-shaped links up in {study['startup_s']:.1f} s: "
              + "; ".join(f"{i}: {link.describe()}" for i, link in enumerate(links)), flush=True)
        for name, rounds in plan:
            config = f"num-server-rounds={rounds} " + run_config(name, args.model, args.deadline, table, args.run_config)
            print(f"\n[{name}] --run-config \"{config}\"", flush=True)
            load = os.getloadavg()
            per_node0 = [r.counts() for r in dep.node_relays]
            run = deploy.run_app(dep, config, work / name, timeout=args.timeout)
            per_node = [(r.counts() - c).as_dict() for r, c in zip(dep.node_relays, per_node0)]
            rows = series(run) if run.ok else []
            entry = {"run_config": config, "returncode": run.returncode, "seconds": run.seconds, "series": rows,
                     "per_node_relay": per_node, "load_before": load, "load_after": os.getloadavg(),
                     "clientapps": run.clientapps}
            if run.ok and name == "measured":
                entry["estimates"] = estimator_errors(run.results, nodes, links)
            if run.ok:
                entry["resolved"] = run.results.get("config", {}).get("resolved")
            study["runs"][name] = entry
            print(deploy.format_table(run), flush=True)
            if not run.ok:
                print(f"run failed (rc {run.returncode}):\n{run.log[-3000:]}", flush=True)
            (out / "study.json").write_text(json.dumps(study, indent=1, default=str))
    study["node_ids"] = {str(k): v for k, v in nodes.items()}
    return _report(study, out, links, args.margin, work)


def _report(study: dict, out: Path, links: list[Link], margin: float, work: Path) -> int:
    text = write_table(study, margin)
    measured = study["runs"].get("measured")
    if measured is not None and measured.get("returncode") == 0:
        results = work / "measured" / "results.json"
        if "node_ids" not in study:  # from the SuperNodes' logs ("SuperNode ID: ...")
            found = {}
            for i in range(len(links)):
                log = work / "deploy" / "logs" / f"supernode-{i}.log"
                m = deploy._NODE_ID.search(log.read_text(errors="replace")) if log.is_file() else None
                if m:
                    found[m.group(1)] = i
            if found:
                study["node_ids"] = found
        if "node_ids" in study and results.is_file():  # recomputed: the analysis may be newer than the run
            nodes = {int(k): v for k, v in study["node_ids"].items()}
            measured["estimates"] = estimator_errors(json.loads(results.read_text()), nodes, links)
        text += "\n\nMeasured-link estimates against the shaped rates:\n\n" + write_estimates(measured["estimates"], links)
    (out / "table.md").write_text(text + "\n")
    (out / "study.json").write_text(json.dumps(study, indent=1, default=str))
    plot(study, out / "time_to_accuracy.png", margin)
    print("\n" + text)
    print(f"\nwritten: {out / 'table.md'}, {out / 'time_to_accuracy.png'}, {out / 'study.json'}")
    return 0 if all(r["returncode"] == 0 for r in study["runs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
