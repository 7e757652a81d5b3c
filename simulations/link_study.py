"""Measured-bandwidth budgets against declared-link budgets, clients not knowing their link.

Each of ``--clients`` simulated clients has a hidden link from the ``mixed`` profile
(:func:`fedcomp.links.link_for`). Every round it downloads the dense broadcast of the digits ``mlp``
(``--download-bytes``), trains for its own compute time (a per-client base, jittered), and uploads
what its budget allows (98-100% of it, as :mod:`fedcomp.budget` fills one, at most the dense
reply); transfers take the link model's time. The server sees each transfer's bytes and seconds
with a measurement error (``--jitter``, relative, Gaussian: a deployment measures them from
message timestamps) and feeds them to
:class:`fedcomp.adapt.MeasuredBudgets`; the budget it derives is compared with the one the hidden
link would give if declared (:func:`fedcomp.links.upload_budget`), both capped at the largest
message.

Done when (issue #17): estimated budgets within 10% of the declared-link budgets within 5 rounds,
and >= 98% of uploads within the true link's deadline.

Writes ``<out>/links.json`` (per node per round: estimate, budget, declared budget, error, whether
the upload met the deadline) and ``<out>/links.png`` (relative error per round, per preset).

    python -m fedcomp.simulations.link_study
    python -m fedcomp.simulations.link_study --in-process --clients 10 --rounds 10   # the real mod and wrapper

The first is a model of the estimator alone (no training, no messages); ``--in-process`` and
``--results`` summarize runs of the real app path (``link-profile='measured:mixed'``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import shlex
import sys
from pathlib import Path

from fedcomp import links
from fedcomp.adapt import MeasuredBudgets



def simulate(clients: int, rounds: int, deadline_s: float, download_bytes: int, max_upload: int, jitter: float,
             seed: int = 0) -> dict:
    rng = random.Random(seed)
    true = {n: links.with_deadline(links.link_for(n, clients, "mixed", seed), deadline_s) for n in range(clients)}
    base = {n: rng.uniform(0.3, 2.0) for n in range(clients)}  # each client's compute seconds
    mb = MeasuredBudgets(deadline_s)
    rows = []
    for rnd in range(1, rounds + 1):
        for n in range(clients):
            link = true[n]
            compute_s = base[n] * (1 + jitter * rng.uniform(-1, 1))
            # the client's compute so far (known to it) enters both budgets the same way
            declared = min(max_upload, links.upload_budget(link, download_bytes, compute_s))
            budget = min(max_upload, mb.budget(n, rnd, download_bytes=download_bytes, compute_s=compute_s,
                                               declared=declared))
            mb.history[-1].update(budget=budget, error=budget / declared - 1 if declared else None)
            sent = max(1, int(budget * rng.uniform(0.98, 1.0)))
            up_s, down_s = link.upload_s(sent), link.download_s(download_bytes)  # the link model's times
            on_time = down_s + compute_s + up_s <= deadline_s
            noise_up, noise_down = (max(0.5, 1 + jitter * rng.gauss(0, 1)) for _ in range(2))  # measuring them
            mb.observe(n, up_bytes=sent, up_s=up_s * noise_up, down_bytes=download_bytes, down_s=down_s * noise_down)
            row = {**mb.history[-1], "preset": links.mixed_preset(n, seed), "sent": sent, "on_time": on_time,
                   "total_s": down_s + compute_s + up_s}
            rows.append({k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in row.items()})
    return {"rows": rows, "links": {n: true[n].describe() for n in true}}


def summarize(rows: list[dict], tol: float = 0.10) -> dict:
    by_node: dict[int, list[dict]] = {}
    for r in rows:
        by_node.setdefault(r["node"], []).append(r)
    settle = {}
    for node, rs in by_node.items():
        rs.sort(key=lambda r: r["round"])
        last_bad = max((r["round"] for r in rs if r["error"] is None or abs(r["error"]) > tol), default=0)
        settle[node] = last_bad + 1  # first round from which every budget is within tol
    on_time = sum(r["on_time"] for r in rows) / len(rows)
    later = [abs(r["error"]) <= tol for r in rows if r["round"] >= 5 and r["error"] is not None]
    return {"rounds_to_within_10pct": settle, "max_rounds_to_within_10pct": max(settle.values()),
            "uploads_on_time": on_time, "within_10pct_from_round_5": sum(later) / len(later) if later else None}


def summarize_estimates(rounds: list[dict], tol: float = 0.10) -> dict:
    """The summary of a run with hidden links from its round records' ``link_estimates``. Client-rounds
    whose declared-link budget is 0 (the measured compute alone ran past the deadline: no budget to
    compare) are left out of the error."""
    rows = [{**e, "on_time": not e.get("late", False)} for r in rounds for e in r.get("link_estimates", [])
            if "true_link" in e]
    if not rows:
        raise ValueError("no link_estimates with a true link: run with link-profile='measured:<profile>'")
    compared = [r for r in rows if r.get("declared_budget")]
    summary = summarize(compared, tol)
    summary["uploads_on_time"] = sum(r["on_time"] for r in rows) / len(rows)
    summary["client_rounds"], summary["compared"] = len(rows), len(compared)
    return summary


def from_results(path: str, tol: float = 0.10) -> dict:
    """The same summary from a Flower run with hidden links (``link-profile='measured:<profile>'``): the
    ``link_estimates`` of its results.json."""
    p = Path(path)
    data = json.loads((p / "results.json" if p.is_dir() else p).read_text())
    try:
        return summarize_estimates(data["rounds"], tol)
    except ValueError as exc:
        raise SystemExit(f"{path}: {exc}") from None


def in_process(clients: int, rounds: int, deadline_s: float, profile: str = "mixed", seed: int = 0,
               upload: str = "topk(ratio=0.01,index='fixed')+qsgd(bits=4)", tol: float = 0.10) -> dict:
    """The summary of a run through the experiment harness (:func:`fedcomp.simulations.harness.run`,
    the project's ServerApp's measured-link path: ``MeasuredLinkStrategy`` around the wrapper, the
    ClientApp's ``netsim_mod`` playing the hidden links), digits ``mlp``."""
    from fedcomp.simulations import harness

    h = harness.run(upload, rounds=rounds, clients=clients, seed=seed, download="none()",
                    round_deadline_s=deadline_s, run_config={"link-profile": f"measured:{profile}"})
    summary = summarize_estimates(h.rows, tol)
    summary["accuracy"], summary["error"] = h.accuracy, h.error
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", help="summarize a Flower run with hidden links (its results.json or directory) instead")
    ap.add_argument("--in-process", action="store_true",
                    help="instead: a digits run with hidden links through the experiment harness (--clients, --rounds, "
                         "--deadline-s), summarized as --results")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--deadline-s", type=float, default=12.0)
    ap.add_argument("--download-bytes", type=int, default=937_000, help="the broadcast (digits mlp, dense)")
    ap.add_argument("--max-upload", type=int, default=937_000, help="the largest reply (digits mlp, dense)")
    ap.add_argument("--jitter", type=float, nargs="+", default=[0.02, 0.05],
                    help="relative error of measured times (and the compute's jitter); one run each, the first plotted")
    ap.add_argument("--out", default="results/adapt")
    args = ap.parse_args(argv)
    if args.results or args.in_process:
        s = from_results(args.results) if args.results else in_process(args.clients, args.rounds, args.deadline_s)
        settle = sorted(s["rounds_to_within_10pct"].values())
        late = s["within_10pct_from_round_5"]
        print(f"{args.results or 'in process'}: {s['client_rounds']} client-rounds ({s['compared']} with a "
              f"declared-link budget > 0); every node's budget within 10% of its declared-link budget from round "
              f"{settle[-1]} on (90% of nodes: round {settle[int(0.9 * len(settle))]}); within 10% from round 5: "
              f"{'n/a' if late is None else f'{100 * late:.1f}%'}; uploads within the true link's deadline: "
              f"{100 * s['uploads_on_time']:.2f}%")
        return
    runs = {j: simulate(args.clients, args.rounds, args.deadline_s, args.download_bytes, args.max_upload, j)
            for j in args.jitter}
    summaries = {j: summarize(r["rows"]) for j, r in runs.items()}
    res = runs[args.jitter[0]]
    command = "python -m fedcomp.simulations.link_study " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with open(out / "links.json", "w") as f:
        json.dump({"command": command.strip(), "date": date, "args": vars(args),
                   "runs": [{"jitter": j, "summary": summaries[j], **runs[j]} for j in args.jitter]}, f)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"datacenter": "tab:blue", "broadband": "tab:green", "4g": "tab:orange", "3g-edge": "tab:red"}
    for node in sorted({r["node"] for r in res["rows"]}):
        rs = [r for r in res["rows"] if r["node"] == node]
        ax.plot([r["round"] for r in rs], [100 * r["error"] for r in rs], color=colors[rs[0]["preset"]], lw=0.7, alpha=0.6)
    for name, c in colors.items():
        ax.plot([], [], color=c, label=name)
    ax.axhspan(-10, 10, color="0.9")
    ax.set_ylim(-100, 30)
    ax.set_xlabel("round")
    ax.set_ylabel("measured-link budget vs declared-link budget (%)")
    ax.set_title(f"{args.clients} clients, mixed links hidden from them, deadline {args.deadline_s:g} s, "
                 f"timing error {100 * args.jitter[0]:g}%", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "links.png", dpi=100)
    lines = [f"`{command.strip()}`, {date}: {args.clients} clients, {args.rounds} rounds, deadline {args.deadline_s:g} s.", ""]
    for j in args.jitter:
        s = summaries[j]
        settle = sorted(s["rounds_to_within_10pct"].values())
        when = lambda r: f"from round {r} on" if r <= args.rounds else f"not within {args.rounds} rounds"  # noqa: E731
        lines.append(f"- timing error {100 * j:g}%: every node's budget within 10% of its declared-link budget "
                     f"{when(settle[-1])} (90% of nodes: {when(settle[int(0.9 * len(settle))])}); budgets within 10% "
                     f"from round 5: {100 * s['within_10pct_from_round_5']:.1f}%; uploads within the true link's "
                     f"deadline: {100 * s['uploads_on_time']:.2f}%")
    lines += ["", "![links](links.png)", ""]
    (out / "links.md").write_text("# Measured-link budgets (issue #17)\n\n" + "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
