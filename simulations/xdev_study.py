"""Cross-device compression study: ``python -m fedcomp.simulations.xdev_study [--rounds N] [names...]``.

Which upload and download schemes hold when each client takes part in a round now and then
(issue 15): 100 clients, 10 sampled per round, 60 rounds, digits MLP, the app's defaults
(lr 0.3, 1 local epoch, batch 32, Dirichlet 0.5), against the cross-silo regime (10 clients, all
of them every round). Every run goes through the one experiment harness
(:func:`fedcomp.simulations.harness.run`): Flower's FedAvg (FedAvgM where a scheme sets a server
learning rate or momentum on decoded updates) wrapped by
:class:`~fedcomp.strategies.CompressedStrategy` with the scheme's settings, the project's ClientApp
behind ``compression_mod``, ``Strategy.start`` in one process; the dense scheme runs FedAvg
unwrapped. Bytes are Flower message bytes of the train messages and replies; dense: the wrapper's
count of the same messages with the model as plain arrays (the baseline: as measured).

A scheme (:class:`Scheme`) is a set of wrapper settings:

* ``mode``: ``client-ef`` (client residuals, ``error_feedback=True``), ``no-ef`` (stateless
  clients), ``fetchsgd`` (``aggregation="sketch"``: clients upload count sketches, the server keeps
  momentum ``server_momentum`` and error in sketch space);
* ``server_lr``/``server_momentum`` on decoded updates: the inner strategy is Flower's ``FedAvgM``;
* ``download_mode``: ``dense`` (``download="none()"``), ``tier`` (``download=<spec>``, a full model on
  first contact, chains capped at ``max_stale`` steps), ``seeded`` (the same with ``seeded_init``:
  first contact is the chain from the seeded round-0 model), ``coupled`` (``fetchsgd`` only:
  ``coupled_download``, the server applies exactly what it broadcasts).

Dropped when the study moved onto the wrapper (the records under ``results/xdev/`` keep them): the
residual policies for stale clients (``decay:G``, ``drop:N``, ``cap:C``) and EF21, which the client
mod does not implement, and a server learning rate with sketch aggregation, which the wrapper's
FetchSGD step does not take. The memory columns of the old records (server and client bytes held
between rounds) are not measured by the harness.

Results: ``results/xdev/results.jsonl`` (one JSON line per run) and README.md there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "results" / "xdev"
MODES = ("client-ef", "no-ef", "fetchsgd")
DOWNLOAD_MODES = ("dense", "tier", "seeded", "coupled")


@dataclass(frozen=True)
class Scheme:
    """One option measured: how clients upload, how the server steps, how clients download."""

    name: str
    upload: str = "none()"  # upload codec spec ('none()' with a dense download: the unwrapped baseline)
    mode: str = "client-ef"  # client-ef | no-ef | fetchsgd
    server_lr: float = 1.0  # decoded updates: FedAvgM's server learning rate
    server_momentum: float = 0.0  # FedAvgM's beta; FetchSGD's rho in sketch space
    download: str = "none()"  # download step codec spec (tier / seeded / coupled)
    download_mode: str = "dense"  # dense | tier | seeded | coupled
    max_stale: int = 10  # tier: steps kept for catch-up

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.download_mode not in DOWNLOAD_MODES:
            raise ValueError(f"scheme {self.name!r}: mode must be one of {MODES} and download_mode one of "
                             f"{DOWNLOAD_MODES}, got {self.mode!r} / {self.download_mode!r}")
        if self.mode == "fetchsgd" and self.server_lr != 1.0:
            raise ValueError(f"scheme {self.name!r}: the wrapper's FetchSGD step takes no server learning rate")

    @property
    def dense(self) -> bool:
        return self.upload == "none()" and self.download_mode == "dense" and self.mode != "fetchsgd"

    def strategy(self, clients: int, per_round: int):
        """The inner Flower strategy: FedAvg, or FedAvgM for a server lr/momentum on decoded updates."""
        from flwr.serverapp.strategy import FedAvg, FedAvgM

        common = {"fraction_train": per_round / clients, "fraction_evaluate": 0.0, "min_available_nodes": clients,
                  "min_train_nodes": per_round}
        if self.mode != "fetchsgd" and (self.server_lr != 1.0 or self.server_momentum):
            return FedAvgM(**common, server_learning_rate=self.server_lr, server_momentum=self.server_momentum)
        return FedAvg(**common)

    def settings(self) -> dict:
        """The wrapper's settings for this scheme (none for the dense baseline)."""
        if self.dense:
            return {}
        out = {"upload": self.upload, "error_feedback": self.mode == "client-ef",
               "aggregation": "sketch" if self.mode == "fetchsgd" else "decode",
               "download": self.download if self.download_mode != "dense" else "none()",
               "seeded_init": self.download_mode in ("seeded", "coupled")}
        if self.mode == "fetchsgd":
            out["server_momentum"] = self.server_momentum
        if self.download_mode == "tier":
            out["download_max_stale"] = self.max_stale
        if self.download_mode == "coupled":
            out["coupled_download"] = True
        return out


@dataclass(frozen=True)
class Regime:
    name: str
    clients: int
    per_round: int
    rounds: int = 60
    lr: float = 0.3
    epochs: int = 1
    batch: int = 32
    alpha: float = 0.5


REGIMES = {
    "cross-device": Regime("cross-device", 100, 10),
    "cross-silo": Regime("cross-silo", 10, 10),
    "silo-half": Regime("silo-half", 10, 5),  # the fraction-train=0.5 row: where does client EF stop holding?
}


@dataclass
class Result:
    scheme: str
    regime: str
    seed: int
    accuracy: float  # the last round's (0.0 for a run the wrapper stopped)
    curve: list[float]  # every 10th round and the last
    upload_bytes: int
    upload_bytes_dense: int
    download_bytes: int
    download_bytes_dense: int
    download_modes: dict[str, int]  # train messages by broadcast mode (dense: the unwrapped baseline)
    seconds: float
    error: str | None = None
    config: dict = field(default_factory=dict)

    @property
    def up_ratio(self) -> float:
        return self.upload_bytes_dense / self.upload_bytes

    @property
    def down_ratio(self) -> float:
        return self.download_bytes_dense / self.download_bytes


def run(scheme: Scheme, regime: Regime, seed: int = 0) -> Result:
    """One run of ``scheme`` in ``regime`` through :func:`fedcomp.simulations.harness.run`."""
    import torch

    from fedcomp.simulations import harness

    torch.set_num_threads(1)
    settings = scheme.settings()
    upload = settings.pop("upload", harness.DENSE)
    h = harness.run(upload, strategy=scheme.strategy(regime.clients, regime.per_round), task="digits", model="mlp",
                    rounds=regime.rounds, clients=regime.clients, fraction=regime.per_round / regime.clients,
                    seed=seed, lr=regime.lr, local_epochs=regime.epochs, batch_size=regime.batch, alpha=regime.alpha,
                    **settings)
    modes = {"dense": 0, "full": 0, "chain": 0}
    for stats in h.stats.values():
        for d in stats.downloads:
            modes[d["mode"]] = modes.get(d["mode"], 0) + 1
    if not h.stats:
        modes["dense"] = sum(r["replies"] for r in h.rows)
    curve = [r["accuracy"] for r in h.rows if r["round"] % 10 == 0 or r["round"] == regime.rounds]
    finished = h.error is None and len(h.rows) == regime.rounds
    return Result(scheme.name, regime.name, seed, h.accuracy if finished else 0.0, curve,
                  sum(r["upload_bytes"] for r in h.rows), sum(r["upload_bytes_dense"] for r in h.rows),
                  sum(r["download_bytes"] for r in h.rows), sum(r["download_bytes_dense"] for r in h.rows),
                  modes, h.seconds, h.error, asdict(scheme))


TOPKQ = "topk(ratio=0.01)+qsgd(bits=4)"
SK16 = "sketch(rows=1,cols=16000,ratio=0.01)+qsgd(bits=4)"
SK16_K2 = "sketch(rows=1,cols=16000,ratio=0.02)+qsgd(bits=4)"
DOWN = "topk(ratio=0.01)+kbit(bits=4)"

SCHEMES = [
    Scheme("dense"),
    # upload options (download dense)
    Scheme("topk-clientEF", TOPKQ),
    Scheme("topk-noEF", TOPKQ, mode="no-ef"),
    Scheme("randk-unbiased-m0.9", "randomk(ratio=0.01,rescale=true)+qsgd(bits=4)", mode="no-ef",
           server_lr=0.1, server_momentum=0.9),
    Scheme("randk-unbiased-lr0.05", "randomk(ratio=0.01,rescale=true)+qsgd(bits=4)", mode="no-ef", server_lr=0.05),
    Scheme("fetchsgd-c4000", "sketch(rows=1,cols=4000,ratio=0.01)", mode="fetchsgd"),
    Scheme("fetchsgd-c2300", "sketch(rows=1,cols=2300,ratio=0.01)", mode="fetchsgd"),
    Scheme("fetchsgd-c16000-q4", SK16, mode="fetchsgd"),
    Scheme("fetchsgd-c32000-q2", "sketch(rows=1,cols=32000,ratio=0.01)+qsgd(bits=2)", mode="fetchsgd"),
    Scheme("fetchsgd-c16000-q4-m0.9", SK16, mode="fetchsgd", server_momentum=0.9),
    Scheme("fetchsgd-c16000-q4-k0.02", "sketch(rows=1,cols=16000,ratio=0.02)+qsgd(bits=4)", mode="fetchsgd"),
    Scheme("fetchsgd-c16000-q4-k0.005", "sketch(rows=1,cols=16000,ratio=0.005)+qsgd(bits=4)", mode="fetchsgd"),
    Scheme("fetchsgd-c8000-q8", "sketch(rows=1,cols=8000,ratio=0.01)+qsgd(bits=8)", mode="fetchsgd"),
    Scheme("fetchsgd-r3-c5000-q4", "sketch(rows=3,cols=5000,ratio=0.01)+qsgd(bits=4)", mode="fetchsgd"),
    # download options (upload dense)
    Scheme("down-tier", download=DOWN, download_mode="tier"),
    Scheme("down-seeded", download=DOWN, download_mode="seeded"),
    Scheme("down-seeded-k0.005", download="topk(ratio=0.005)+kbit(bits=4)", download_mode="seeded"),
    # both
    Scheme("down-seeded-q8", download="topk(ratio=0.01)+qsgd(bits=8)", download_mode="seeded"),
    # both
    Scheme("fetchsgd-c16000-q4+down-seeded", SK16, mode="fetchsgd", download=DOWN, download_mode="seeded"),
    Scheme("fetchsgd-c16000-q4+down-seeded-k0.005", SK16, mode="fetchsgd", download="topk(ratio=0.005)+kbit(bits=4)",
           download_mode="seeded"),
    Scheme("topk-clientEF+down-seeded", TOPKQ, download=DOWN, download_mode="seeded"),
    Scheme("fetchsgd-c16000-q4+coupled", SK16, mode="fetchsgd", download=DOWN, download_mode="coupled"),
    Scheme("fetchsgd-c16000-q4+coupled-stoch", SK16, mode="fetchsgd",
           download="topk(ratio=0.01)+kbit(bits=4,stochastic=true)", download_mode="coupled"),
    Scheme("fetchsgd-k0.02+coupled-k0.02", SK16_K2, mode="fetchsgd", download="topk(ratio=0.02)+kbit(bits=4)",
           download_mode="coupled"),
    # the heavy hitters' share with the coupled stochastic download (2026-11-26: 1% throttled a small CNN
    # with several local epochs through flwr run; these check the MLP regimes the default was tuned on)
    Scheme("fetchsgd-k0.02+coupled-stoch-k0.02", SK16_K2, mode="fetchsgd",
           download="topk(ratio=0.02)+kbit(bits=4,stochastic=true)", download_mode="coupled"),
    Scheme("fetchsgd-k0.05+coupled-stoch-k0.05", "sketch(rows=1,cols=16000,ratio=0.05)+qsgd(bits=4)", mode="fetchsgd",
           download="topk(ratio=0.05)+kbit(bits=4,stochastic=true)", download_mode="coupled"),
    Scheme("fetchsgd-k0.02+down-seeded", SK16_K2, mode="fetchsgd", download=DOWN, download_mode="seeded"),
    Scheme("fetchsgd-k0.02+down-seeded-kbit8", SK16_K2, mode="fetchsgd", download="topk(ratio=0.01)+kbit(bits=8)",
           download_mode="seeded"),
    Scheme("fetchsgd-c16000-q4+down-seeded-kbit8", SK16, mode="fetchsgd", download="topk(ratio=0.01)+kbit(bits=8)",
           download_mode="seeded"),
    Scheme("fetchsgd-c16000-q4+down-seeded-k0.015", SK16, mode="fetchsgd", download="topk(ratio=0.015)+kbit(bits=4)",
           download_mode="seeded"),
]


def table(path: Path) -> str:
    """Markdown table of a results file: mean over seeds per scheme and regime (last row wins per seed)."""
    rows: dict[tuple[str, str, int], dict] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        rows[(r["scheme"], r["regime"], r["seed"])] = r
    order = [s.name for s in SCHEMES]
    order += sorted({n for n, _, _ in rows} - set(order))  # schemes of older records (dropped since)
    regimes = list(REGIMES)
    out = ["| scheme | regime | seeds | accuracy % (per seed) | vs dense (pt) | upload x | download x | download modes "
           "(full/chain) |", "|---|---|---|---|---|---|---|---|"]
    for name in order:
        for g in regimes:
            got = sorted((r for (n, rg, _), r in rows.items() if n == name and rg == g), key=lambda r: r["seed"])
            if not got:
                continue
            seeds = [r["seed"] for r in got]
            acc = [r["accuracy"] for r in got]
            base = [a for (n, rg, sd), r in rows.items() if n == "dense" and rg == g and sd in seeds
                    for a in [r["accuracy"]]]
            gap = 100 * (sum(acc) / len(acc) - sum(base) / len(base)) if len(base) == len(acc) else float("nan")
            up = sum(r["upload_bytes_dense"] for r in got) / sum(r["upload_bytes"] for r in got)
            down = sum(r["download_bytes_dense"] for r in got) / sum(r["download_bytes"] for r in got)
            modes = got[0]["download_modes"]
            out.append(
                f"| {name} | {g} | {len(got)} | {100 * sum(acc) / len(acc):.2f} "
                f"({', '.join(f'{100 * a:.2f}' for a in acc)}) "
                f"| {gap:+.2f} | {up:.1f} | {down:.1f} | {modes.get('full', 0)}/{modes.get('chain', 0)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="schemes to run (default: all)")
    ap.add_argument("--regimes", default="cross-device,cross-silo")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the regime's, 60)")
    ap.add_argument("--out", default=str(OUT_DIR / "results.jsonl"))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(Path(args.out)))
        return 0
    if args.list:
        for s in SCHEMES:
            print(s.name)
        return 0
    wanted = [s for s in SCHEMES if not args.names or s.name in args.names]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for regime_name in args.regimes.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            for s in wanted:
                regime = REGIMES[regime_name]
                r = run(s, regime if args.rounds is None else dataclasses.replace(regime, rounds=args.rounds), seed)
                row = asdict(r)
                row.update(up_ratio=r.up_ratio, down_ratio=r.down_ratio)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{regime_name:12s} seed {seed} {s.name:34s} acc {100 * r.accuracy:6.2f} "
                      f"up {r.up_ratio:7.1f}x down {r.down_ratio:6.1f}x modes {r.download_modes} "
                      f"{r.seconds:5.1f}s{'  ' + r.error if r.error else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
