"""Cross-device compression study: ``python -m fedcomp.simulations.xdev_study [--quick] [names...]``.

Which upload and download schemes hold when each client takes part in a round now and then
(issue 15): 100 clients, 10 sampled per round, 60 rounds, digits MLP, the app's defaults
(lr 0.3, 1 local epoch, batch 32, Dirichlet 0.5), against the cross-silo regime (10 clients, all
of them every round). Everything runs in one process, without Flower: per round the server
samples clients, each trains from the model it holds, encodes its update with the fedcomp core
(``fedcomp.build_codec``, ``fedcomp.compress``, ``Codec.decode``), and the server aggregates.

Bytes are ``len(payload) + MESSAGE_OVERHEAD`` per message (the header a real message needs
beside the payload: round, tier, version, CRC, codec spec; Flower's own record framing is left
out for every scheme alike), and a chain download of s steps is s payloads plus one overhead.
Dense = ``none()`` payloads (fp32, exact) to and from every participant.

Upload modes (``Scheme.mode``):

* ``client-ef``: today's clients: ``fedcomp.compress`` with the client's residual (error
  feedback), under a residual policy for stale clients (``Scheme.residual``: ``keep``,
  ``decay:G`` = times G**(rounds missed), ``drop:N`` = forget after more than N missed rounds,
  ``cap:C`` = shrink to at most C times the norm of the new update).
* ``no-ef``: stateless clients, ``error_feedback=False``.
* ``ef21``: EF21 with partial participation: client and server keep the same estimate g_i of
  client i's update; the client sends C(u_i - g_i), both add the decoded difference; the server
  averages the participants' g_i (memory: one model per client on the server).
* ``fetchsgd``: stateless clients upload a count sketch (optionally quantized; the server
  dequantizes, sums tables weighted by examples, keeps momentum and error in sketch space,
  applies the heavy hitters of the error and zeroes the cells they hash to, as the wrapper's
  ``aggregation="sketch"``), via :class:`fedcomp.server_feedback.ServerFeedback`.

Server step: ``G += server_lr * m`` with ``m = server_momentum * m + mean`` (FedAvgM-like;
0 and 1: plain FedAvg).

Download modes (``Scheme.download_mode``; the tier reference R chases G with error feedback,
one encode of ``C(G - R)`` per round, and every client trains from R):

* ``dense``: the full fp32 model G to every participant.
* ``tier``: today's wrapper: full fp32 R on first contact and when more than ``max_stale``
  rounds behind (or when the chain costs more), else the chain of steps since its version.
* ``seeded``: round 0's model is the seeded initialisation every node builds itself, so first
  contact is the chain from round 0; the server keeps the tier's step payloads (bytes, per tier,
  not per client) and sends the full model only when a chain would cost more.
* ``coupled`` (``fetchsgd`` only): no separate reference; the server applies exactly the payload
  that ``ServerFeedback.step_broadcast`` encodes with the download codec, clients replay those
  payloads from the seeded round-0 model (chains as in ``seeded``) and so hold G itself.

Results: ``results/xdev/results.jsonl`` (one JSON line per run) and README.md there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

import fedcomp
from fedcomp.server_feedback import ServerFeedback, plan_download
from fedcomp.simulations import task

MESSAGE_OVERHEAD = 64  # bytes per message beside the payload (round, tier, version, CRC, spec id)
OUT_DIR = Path(__file__).resolve().parent.parent / "results" / "xdev"


@dataclass(frozen=True)
class Scheme:
    """One option measured: how clients upload, how the server steps, how clients download."""

    name: str
    upload: str = "none()"  # upload codec spec
    mode: str = "client-ef"  # client-ef | no-ef | ef21 | fetchsgd
    residual: str = "keep"  # client-ef only: keep | decay:G | drop:N | cap:C
    server_lr: float = 1.0
    server_momentum: float = 0.0  # FedAvgM's beta; FetchSGD's rho in sketch space
    download: str = "none()"  # download step codec spec (tier / seeded)
    download_mode: str = "dense"  # dense | tier | seeded
    max_stale: int = 10  # tier: steps kept for catch-up


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


def _flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1).float() for v in d.values()])


def _norm(d: dict[str, torch.Tensor]) -> float:
    return float(_flat(d).norm())


def _add(a, b, s=1.0):
    return {k: a[k] + s * b[k] for k in a}


@dataclass
class Result:
    scheme: str
    regime: str
    seed: int
    accuracy: float
    accuracy_reference: float  # the model the clients last held (the tier reference)
    curve: list[float]
    upload_bytes: int
    upload_bytes_dense: int
    download_bytes: int
    download_bytes_dense: int
    download_modes: dict[str, int]
    server_memory_bytes: int
    client_memory_bytes: int  # per client, between rounds
    seconds: float
    config: dict = field(default_factory=dict)

    @property
    def up_ratio(self) -> float:
        return self.upload_bytes_dense / self.upload_bytes

    @property
    def down_ratio(self) -> float:
        return self.download_bytes_dense / self.download_bytes


def run(scheme: Scheme, regime: Regime, seed: int = 0) -> Result:
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    train_set, test_set = task.load_digits_split(seed=seed)
    x_test, y_test = test_set.tensors
    parts = [task.partition(train_set, regime.clients, i, regime.alpha, seed) for i in range(regime.clients)]
    model = task.build_model("mlp", seed)
    G = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layout = fedcomp.Layout.of(G)
    nbytes_model = 4 * layout.numel
    dense_payload = len(fedcomp.build_codec("none()").encode(G).payload) + MESSAGE_OVERHEAD
    codec = fedcomp.build_codec(scheme.upload)
    rng = np.random.default_rng(seed * 7919 + 1)

    # client state
    residual: dict[int, dict[str, torch.Tensor]] = {}
    last_round: dict[int, int] = {}
    ef21: dict[int, dict[str, torch.Tensor]] = {}  # same on client and server
    # server state
    momentum = None
    sfb = ServerFeedback(codec, layout, momentum=scheme.server_momentum) if scheme.mode == "fetchsgd" else None
    # download state
    down_codec = fedcomp.build_codec(scheme.download)
    R = {k: v.clone() for k, v in G.items()}
    history: list[int] = [0]  # history[t] = payload bytes of the step to round t (index 0: the seeded init)
    held: dict[int, int] = {}  # client -> version of R it holds
    modes = {"dense": 0, "full": 0, "chain": 0}
    up = up_dense = down = down_dense = 0
    curve = []

    for rnd in range(1, regime.rounds + 1):
        chosen = sorted(rng.choice(regime.clients, size=regime.per_round, replace=False).tolist())
        # -- download: move R towards G once per round, send each participant what it needs
        if scheme.download_mode == "coupled":  # G moves only by broadcast payloads: clients hold G
            start = G
            for i in chosen:
                plan = plan_download(held.get(i, 0), history, rnd - 1, dense_payload - MESSAGE_OVERHEAD,
                                     overhead=MESSAGE_OVERHEAD)
                down += plan.nbytes
                modes[plan.mode] += 1
                held[i] = rnd - 1
        elif scheme.download_mode == "dense":
            start = G
            for i in chosen:
                down += dense_payload
                modes["dense"] += 1
        else:
            diff = {k: G[k] - R[k] for k in G}
            enc = down_codec.encode(diff, nonce=fedcomp.derive_nonce(seed, rnd, -1), round=rnd)
            R = _add(R, down_codec.decode(enc.payload, layout, round=rnd))
            history.append(len(enc.payload))
            start = R
            for i in chosen:
                v = held.get(i, 0 if scheme.download_mode == "seeded" else None)
                plan = plan_download(v, history, rnd, dense_payload - MESSAGE_OVERHEAD, overhead=MESSAGE_OVERHEAD,
                                     max_stale=scheme.max_stale if scheme.download_mode == "tier" else None)
                down += plan.nbytes
                modes[plan.mode] += 1
                held[i] = rnd
        down_dense += dense_payload * len(chosen)

        # -- clients train from `start` and upload
        updates, weights = [], []
        for i in chosen:
            x, y = parts[i]
            model.load_state_dict(start)
            task.train(model, x, y, epochs=regime.epochs, lr=regime.lr, batch_size=regime.batch,
                       seed=seed * 100_003 + rnd * 1009 + i, device="cpu")
            trained = model.state_dict()
            u = {k: trained[k].detach() - start[k] for k in start}
            nonce = fedcomp.derive_nonce(seed, rnd, i)
            if scheme.mode == "client-ef":
                e = residual.get(i)
                if e is not None:
                    e = _residual_policy(scheme.residual, e, u, rnd - last_round[i] - 1)
                enc, new_e = fedcomp.compress(codec, u, e, nonce=nonce, error_feedback=True, round=rnd)
                residual[i], last_round[i] = new_e, rnd
                payload = enc.payload
            elif scheme.mode == "no-ef":
                enc, _ = fedcomp.compress(codec, u, None, nonce=nonce, error_feedback=False, round=rnd)
                payload = enc.payload
            elif scheme.mode == "ef21":
                g = ef21.get(i) or {k: torch.zeros_like(v) for k, v in u.items()}
                enc = codec.encode({k: u[k] - g[k] for k in u}, nonce=nonce, round=rnd)
                payload = enc.payload
            elif scheme.mode == "fetchsgd":
                payload = codec.encode(u, nonce=nonce, round=rnd).payload
            else:
                raise ValueError(f"unknown mode {scheme.mode!r}")
            up += len(payload) + MESSAGE_OVERHEAD
            up_dense += dense_payload
            # server side: decode what arrived
            if scheme.mode == "fetchsgd":
                updates.append(payload)
            elif scheme.mode == "ef21":
                g = ef21.get(i) or {k: torch.zeros_like(v) for k, v in u.items()}
                ef21[i] = _add(g, codec.decode(payload, layout, round=rnd))
                updates.append(ef21[i])
            else:
                updates.append(codec.decode(payload, layout, round=rnd))
            weights.append(float(len(y)))

        # -- aggregate and step
        total = sum(weights)
        if scheme.mode == "fetchsgd":
            try:
                for p, w in zip(updates, weights):
                    sfb.add(p, w)
            except fedcomp.DecodeError:  # a client trained from a non-finite model: the run diverged
                curve.append(float("nan"))
                G = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in G.items()}
                break
            if scheme.download_mode == "coupled":
                step, payload = sfb.step_broadcast(down_codec, nonce=fedcomp.derive_nonce(seed, rnd, -1), round=rnd)
                history.append(len(payload))
                R = G = _add(G, step)
            else:
                step = sfb.step()
                G = _add(G, step, scheme.server_lr)
        else:
            mean = {k: sum(w * u[k] for u, w in zip(updates, weights)) / total for k in G}
            if scheme.server_momentum:
                momentum = mean if momentum is None else _add(mean, momentum, scheme.server_momentum)
                mean = momentum
            G = _add(G, mean, scheme.server_lr)
        if not all(bool(torch.isfinite(v).all()) for v in G.values()):
            curve.append(float("nan"))
            break
        if rnd % 10 == 0 or rnd == regime.rounds:
            model.load_state_dict(G)
            curve.append(task.evaluate(model, x_test, y_test, "cpu")[1])

    model.load_state_dict(G)
    finite = all(bool(torch.isfinite(v).all()) for v in G.values())
    acc = task.evaluate(model, x_test, y_test, "cpu")[1] if finite else 0.0  # a diverged run scores 0
    model.load_state_dict(R)
    acc_r = task.evaluate(model, x_test, y_test, "cpu")[1] if scheme.download_mode != "dense" else acc
    server_mem = nbytes_model  # G
    if scheme.download_mode == "coupled":
        server_mem += sum(history)  # the step payloads (R is G)
    elif scheme.download_mode != "dense":
        server_mem += nbytes_model + sum(history)  # R and the tier's step payloads
    if scheme.server_momentum and scheme.mode != "fetchsgd":
        server_mem += nbytes_model
    if sfb is not None:
        server_mem += sfb.nbytes
    if scheme.mode == "ef21":
        server_mem += nbytes_model * len(ef21)
    client_mem = nbytes_model if scheme.mode in ("client-ef", "ef21") and codec.spec != "none()" else 0
    return Result(scheme.name, regime.name, seed, acc, acc_r, curve, up, up_dense, down, down_dense, modes,
                  server_mem, client_mem, time.perf_counter() - t0, asdict(scheme))


def _residual_policy(policy: str, e, u, missed: int):
    """A client's residual as it enters this round, ``missed`` rounds after its last."""
    kind, _, arg = policy.partition(":")
    if kind == "keep":
        return e
    if kind == "decay":
        return {k: v * float(arg) ** missed for k, v in e.items()}
    if kind == "drop":
        return None if missed > int(arg) else e
    if kind == "cap":
        ne, nu = _norm(e), _norm(u)
        limit = float(arg) * nu
        return e if ne <= limit or ne == 0 else {k: v * (limit / ne) for k, v in e.items()}
    raise ValueError(f"unknown residual policy {policy!r}")


TOPKQ = "topk(ratio=0.01)+qsgd(bits=4)"
SK16 = "sketch(rows=1,cols=16000,ratio=0.01)+qsgd(bits=4)"
SK16_K2 = "sketch(rows=1,cols=16000,ratio=0.02)+qsgd(bits=4)"
DOWN = "topk(ratio=0.01)+kbit(bits=4)"

SCHEMES = [
    Scheme("dense"),
    # upload options (download dense)
    Scheme("topk-clientEF", TOPKQ),
    Scheme("topk-noEF", TOPKQ, mode="no-ef"),
    Scheme("topk-clientEF-decay0.8", TOPKQ, residual="decay:0.8"),
    Scheme("topk-clientEF-drop2", TOPKQ, residual="drop:2"),
    Scheme("topk-clientEF-cap1", TOPKQ, residual="cap:1.0"),
    Scheme("topk-ef21", TOPKQ, mode="ef21"),
    Scheme("randk-unbiased-m0.9", "randomk(ratio=0.01,rescale=true)+qsgd(bits=4)", mode="no-ef",
           server_lr=0.1, server_momentum=0.9),
    Scheme("randk-unbiased-lr0.05", "randomk(ratio=0.01,rescale=true)+qsgd(bits=4)", mode="no-ef", server_lr=0.05),
    Scheme("fetchsgd-c4000", "sketch(rows=1,cols=4000,ratio=0.01)", mode="fetchsgd"),
    Scheme("fetchsgd-c2300", "sketch(rows=1,cols=2300,ratio=0.01)", mode="fetchsgd"),
    Scheme("fetchsgd-c16000-q4", SK16, mode="fetchsgd"),
    Scheme("fetchsgd-c32000-q2", "sketch(rows=1,cols=32000,ratio=0.01)+qsgd(bits=2)", mode="fetchsgd"),
    Scheme("fetchsgd-c16000-q4-m0.9", SK16, mode="fetchsgd", server_momentum=0.9),
    Scheme("fetchsgd-c16000-q4-m0.9-lr0.1", SK16, mode="fetchsgd", server_momentum=0.9, server_lr=0.1),
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
    regimes = list(REGIMES)
    out = ["| scheme | regime | seeds | accuracy % (per seed) | vs dense (pt) | upload x | download x | download modes "
           "(full/chain) | server memory MB | client memory MB |", "|---|---|---|---|---|---|---|---|---|---|"]
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
                f"| {gap:+.2f} | {up:.1f} | {down:.1f} | {modes['full']}/{modes['chain']} "
                f"| {got[0]['server_memory_bytes'] / 1e6:.2f} | {got[0]['client_memory_bytes'] / 1e6:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="schemes to run (default: all)")
    ap.add_argument("--regimes", default="cross-device,cross-silo")
    ap.add_argument("--seeds", default="0")
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
                r = run(s, REGIMES[regime_name], seed)
                row = asdict(r)
                row.update(up_ratio=r.up_ratio, down_ratio=r.down_ratio)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{regime_name:12s} seed {seed} {s.name:34s} acc {100 * r.accuracy:6.2f} "
                      f"(R {100 * r.accuracy_reference:6.2f}) "
                      f"up {r.up_ratio:7.1f}x down {r.down_ratio:6.1f}x modes {r.download_modes} "
                      f"srv {r.server_memory_bytes / 1e6:6.2f} MB {r.seconds:5.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
