"""The project's ServerApp: FedAvg wrapped in CompressedStrategy, central evaluation on digits.

Prints one line per round and writes ``<out-dir>/results.json`` (after every round) and
``<out-dir>/accuracy_vs_upload.png`` (at the end). A run that fedcomp stops (a non-finite global
model, rounds without usable replies, clients without the mod) writes ``<out-dir>/error.json``
(the error's class and message) and re-raises, so Flower marks the run failed.
"""

from __future__ import annotations

import json
import random
import resource
import time
from logging import ERROR, INFO
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common import log
from flwr.server import Grid
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg

import fedcomp
from fedcomp.simulations.faults import parse_faults
from fedcomp.broadcast import parse_thresholds, parse_tiers
from fedcomp.budget import FALLBACKS
from fedcomp import links
from fedcomp.simulations import results, task
from fedcomp.adapt import is_auto, without_auto
from fedcomp.strategies.adaptive import AdaptiveStrategy
from fedcomp.strategies.measured import MeasuredLinkStrategy
from fedcomp.strategies.wrapper import CompressedStrategy

app = ServerApp()

CONFIG_KEYS = (
    "num-server-rounds", "fraction-train", "fraction-evaluate", "task", "model", "local-epochs", "lr", "batch-size", "seed",
    "partition-alpha", "upload", "download", "error-feedback", "out-dir", "aggregation", "server-momentum", "server-warmup", "delta",
    "download-tier-kbps", "download-max-stale", "link-profile", "round-deadline-s", "budget-fallback",
    "streaming",
    "max-update-norm", "weight-factor", "faults", "round-timeout",
)


def _check(cfg: dict, key: str, kind: type, allowed: str, ok) -> None:
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = cfg[key] = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)) or not ok(value):
        raise ValueError(f"run config {key}={value!r} is invalid: {key} must be {allowed}")


def validate_run_config(run_config) -> dict:
    """The run config as a dict, every key checked; raises ValueError naming the key, value and what is allowed."""
    cfg = dict(run_config)
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"run config lacks {missing}; defaults live in pyproject.toml [tool.flwr.app.config]")
    unknown = sorted(k for k in cfg if k not in CONFIG_KEYS)
    if unknown:  # a typo such as max-update-nrom would otherwise be ignored silently
        raise ValueError(f"run config has unknown keys {unknown}; allowed: {', '.join(CONFIG_KEYS)}")
    _check(cfg, "num-server-rounds", int, "a positive integer", lambda v: v >= 1)
    _check(cfg, "fraction-train", float, "a fraction in (0, 1]", lambda v: 0 < v <= 1)
    _check(cfg, "fraction-evaluate", float, "a fraction in [0, 1] (0: central evaluation only)", lambda v: 0 <= v <= 1)
    _check(cfg, "task", str, f"one of {tuple(task.TASKS)}", lambda v: v in task.TASKS)
    _check(cfg, "model", str, f"one of {task.TASKS[cfg['task']].models} for task {cfg['task']!r}",
           lambda v: v in task.TASKS[cfg["task"]].models)
    _check(cfg, "local-epochs", int, "a positive integer", lambda v: v >= 1)
    _check(cfg, "lr", float, "a positive float", lambda v: v > 0)
    _check(cfg, "batch-size", int, "a positive integer", lambda v: v >= 1)
    _check(cfg, "seed", int, "a non-negative integer", lambda v: v >= 0)
    _check(cfg, "partition-alpha", float, "a positive float", lambda v: v > 0)
    _check(cfg, "error-feedback", bool, "true or false", lambda v: True)
    _check(cfg, "upload", str, "a codec spec such as 'topk(ratio=0.01)+qsgd(bits=4)'", lambda v: True)
    _check(cfg, "download", str, "a codec spec such as 'none()', or tiers such as 'topk(ratio=0.01)+qsgd(bits=4) | kbit(bits=8)'",
           lambda v: True)
    _check(cfg, "download-tier-kbps", str, "'' or ascending kbps thresholds between tiers such as '1000,8000'", lambda v: True)
    _check(cfg, "download-max-stale", int, "an integer >= 0 (steps a client may miss before a full model; 0: no cap, "
           "chains are kept while cheaper than the full model)", lambda v: v >= 0)
    def upload(spec: str):  # one parameter may be 'auto' (adaptive strength: AdaptiveStrategy)
        return fedcomp.build_codec(without_auto(spec) if is_auto(spec) else spec)

    for key, parse in (("upload", upload), ("download", parse_tiers)):  # bad specs fail here, before any round
        if cfg[key] == "auto":  # picked from the regime at the first round (CompressionConfig.resolve)
            continue
        try:
            parse(cfg[key])
        except fedcomp.SpecError as exc:
            raise ValueError(f"run config {key}={cfg[key]!r} is invalid: {exc}") from None
    try:
        tiers = 1 if cfg["download"] == "auto" else len(parse_tiers(cfg["download"]))  # 'auto' is one tier
        parse_thresholds(cfg["download-tier-kbps"], tiers)
    except fedcomp.SpecError as exc:
        raise ValueError(f"run config download-tier-kbps={cfg['download-tier-kbps']!r} is invalid: {exc}") from None
    _check(cfg, "out-dir", str, "a directory path", lambda v: bool(v.strip()))
    _check(cfg, "aggregation", str, "'auto', 'decode' or 'sketch'", lambda v: v in ("auto", "decode", "sketch"))
    for key, allowed, ok in (("server-momentum", "'auto' or a float in [0, 1)", lambda v: 0 <= v < 1),
                             ("server-warmup", "'auto' or a factor in [1, 100] (1: off)", lambda v: 1 <= v <= 100)):
        if cfg[key] != "auto":  # 'auto': the wrapper's regime default (CompressionConfig.resolve)
            _check(cfg, key, float, allowed, ok)
    _check(cfg, "delta", float, "a float in [0, 1] (0: off)", lambda v: 0 <= v <= 1)
    _check(cfg, "link-profile", str, f"'none', 'mixed', one of {sorted(links.PRESETS)}, a .csv/.toml table path, "
           f"'measured' or 'measured:<one of those>'",
           lambda v: bool(v.strip()))
    try:
        links.check_profile(str(cfg["link-profile"]))
    except links.LinkError as exc:
        raise ValueError(f"run config link-profile={cfg['link-profile']!r} is invalid: {exc}") from None
    _check(cfg, "round-deadline-s", float, "seconds >= 0 (0: no deadline)", lambda v: 0 <= v < float("inf"))
    _check(cfg, "budget-fallback", str, f"one of {FALLBACKS}", lambda v: v in FALLBACKS)
    _check(cfg, "streaming", bool, "true or false", lambda v: True)
    if cfg["link-profile"] != links.NONE and _aggregation(cfg) == "sketch":
        raise ValueError(f"run config link-profile={cfg['link-profile']!r} needs aggregation='decode': budgets give "
                         f"clients sketches of different cols, which cannot be summed in sketch space")
    if links.measured_profile(cfg["link-profile"]) is not None:  # budgets from links the server measures
        if cfg["round-deadline-s"] <= 0:
            raise ValueError(f"run config link-profile={cfg['link-profile']!r} needs round-deadline-s > 0: measured "
                             f"links give budgets only against a deadline")
        if cfg["upload"] == "auto":
            raise ValueError(f"run config link-profile={cfg['link-profile']!r} needs an explicit upload codec with a "
                             f"budget knob, e.g. \"topk(ratio=0.01,index='fixed')+qsgd(bits=4)\" (got upload='auto')")
    _check(cfg, "max-update-norm", float, "a finite float >= 0 (0: off)", lambda v: 0 <= v < float("inf"))
    _check(cfg, "weight-factor", float, "0 (trust declared weights) or a finite float >= 1",
           lambda v: v == 0 or 1 <= v < float("inf"))
    _check(cfg, "round-timeout", float, "seconds > 0 the server waits for a round's replies", lambda v: 0 < v < float("inf"))
    _check(cfg, "faults", str, "'' (off) or fault items such as 'crash=0.1,garbage=0.05,slow=0.05,absent=2-4'",
           lambda v: True)
    try:
        parse_faults(cfg["faults"])
    except fedcomp.SpecError as exc:
        raise ValueError(f"run config faults={cfg['faults']!r} is invalid: {exc}") from None
    return cfg


def _ratio(value: float | None) -> str:
    """``12.3x``, or ``n/a`` when nothing was sent (never ``nan``)."""
    return "n/a" if value is None else f"{value:.1f}x"


def _aggregation(cfg: dict) -> str:
    """'auto' aggregates linear codecs (sketches) in compressed space (FetchSGD), others decoded
    (upload 'auto' with link budgets is decoded: CompressionConfig.resolve)."""
    if cfg["aggregation"] != "auto":
        return str(cfg["aggregation"])
    if cfg["upload"] == "auto":
        return "decode"
    codec = fedcomp.build_codec(str(cfg["upload"]))
    return "sketch" if codec.reducer is not None and codec.reducer.linear else "decode"


def _rss_mb() -> float:
    """This process's resident memory now, in MiB (Linux /proc; 0.0 where it cannot be read)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = validate_run_config(context.run_config)
    seed = int(cfg["seed"])
    random.seed(seed)  # Flower's strategies sample nodes with the process-global random: the seed fixes who trains
    model = task.build_model(str(cfg["model"]), seed=seed, task=str(cfg["task"]))
    x_test, y_test = task.load_test(str(cfg["task"]), seed)
    out_dir = Path(str(cfg["out-dir"])).expanduser().resolve()

    # an upload with one parameter 'auto' (topk(ratio=auto)+qsgd(bits=4)): its strength follows `evaluate`
    adaptive = is_auto(str(cfg["upload"]))
    strategy = (AdaptiveStrategy if adaptive else CompressedStrategy)(
        FedAvg(fraction_train=float(cfg["fraction-train"]), fraction_evaluate=float(cfg["fraction-evaluate"]),
               min_evaluate_nodes=1),
        upload=str(cfg["upload"]),
        download=str(cfg["download"]),
        error_feedback=bool(cfg["error-feedback"]),
        seed=seed,
        aggregation=str(cfg["aggregation"]),
        server_momentum=cfg["server-momentum"],
        server_warmup=cfg["server-warmup"],
        delta=float(cfg["delta"]),
        download_tier_kbps=str(cfg["download-tier-kbps"]),
        download_max_stale=int(cfg["download-max-stale"]),
        # measured links: the profile (if any) is the simulated network's hidden truth, not told to clients
        link_profile=links.NONE if links.measured_profile(cfg["link-profile"]) is not None else str(cfg["link-profile"]),
        round_deadline_s=float(cfg["round-deadline-s"]),
        budget_fallback=str(cfg["budget-fallback"]),
        streaming=bool(cfg["streaming"]),
        max_update_norm=float(cfg["max-update-norm"]),
        weight_factor=float(cfg["weight-factor"]),
        seeded_init=True,  # the ClientApp builds the round-0 model from the seed (make_compression_mod)
    )
    compressed = strategy.compressed if adaptive else strategy
    measured = None
    if links.measured_profile(cfg["link-profile"]) is not None:  # budgets from links the server measures
        strategy = measured = MeasuredLinkStrategy(strategy, float(cfg["round-deadline-s"]))
    rounds: list[dict] = []
    log(INFO, "fedcomp: results go to %s", out_dir / "results.json")
    clock = [time.perf_counter()]  # when the previous round's evaluation began: the server's time per round

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        round_s, clock[0] = time.perf_counter() - clock[0], time.perf_counter()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = task.evaluate(model, x_test, y_test, device="cpu")
        if server_round == 0:
            return MetricRecord({"accuracy": accuracy, "loss": loss})
        s = strategy.rounds.get(server_round)
        row = {
            "round": server_round, "accuracy": accuracy, "loss": loss,
            "upload_bytes": s.upload_bytes, "download_bytes": s.download_bytes,
            "upload_bytes_dense": s.upload_bytes_dense, "download_bytes_dense": s.download_bytes_dense,
            "download_bytes_by_tier": {str(t): b for t, b in sorted(s.download_bytes_by_tier.items())},
            "broadcast_encodes": s.encodes, "downloads": s.downloads, "aggregated": s.aggregated,
            "clients": s.clients, "sim_time_s": s.sim_time_s, "links": s.links,
            "evaluate_download_bytes": s.evaluate_download_bytes,
            "evaluate_download_bytes_dense": s.evaluate_download_bytes_dense,
            "evaluate_reply_bytes": s.evaluate_reply_bytes, "evaluate_clients": s.evaluate_clients,
            # wall seconds of one round as the server lives it (the previous evaluation, sampling, broadcast
            # encodes, waiting for the clients, decode + aggregate) and this process's memory
            "server_round_s": round_s, "server_rss_mb": _rss_mb(),
            "server_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if measured is not None:  # per node: estimate sent, transfers observed, budgets (and in simulation the truth)
            row["link_estimates"] = measured.estimates_of(server_round)
            true_time = measured.true_round_time(server_round)
            if true_time is not None:  # simulated time on the hidden links, not on the estimates clients report
                row["sim_time_s_estimated_links"], row["sim_time_s"] = row["sim_time_s"], true_time
        strength = strategy.strength_of(server_round) if adaptive else None
        if strength is not None:  # the round's concrete upload spec and the controller's budget
            row.update(upload_spec=strength["spec"], strength=strength[strategy.auto.param],
                       strength_budget=strength["budget"])
        rounds.append(row)
        cfg["resolved"] = {"upload": compressed.upload.spec,
                           "download": " | ".join(t.codec.spec for t in compressed.tiers),
                           "aggregation": compressed.aggregation, "error-feedback": compressed.error_feedback,
                           "coupled-download": compressed.config.coupled_download}
        log(INFO, "fedcomp round %3d | acc %.4f | loss %.4f | up %9d B (%s less than dense) | down %9d B (%s)%s%s",
            server_round, accuracy, loss, s.upload_bytes, _ratio(s.upload_ratio), s.download_bytes,
            _ratio(s.download_ratio),
            f" | eval down {s.evaluate_download_bytes} B up {s.evaluate_reply_bytes} B" if s.evaluate_clients else "",
            "" if s.sim_time_s is None else f" | sim {s.sim_time_s:.2f} s")
        results.write_results(out_dir, cfg, rounds)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    try:
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=int(cfg["num-server-rounds"]),
            timeout=float(cfg["round-timeout"]),
            train_config=ConfigRecord({}),
            evaluate_fn=evaluate,
        )
    except fedcomp.FedcompError as exc:  # NonFiniteModel, NoUsableReplies, MissingCompressionMod: say so, stop
        error = {"error": type(exc).__name__, "message": str(exc), "rounds_done": len(rounds)}
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "error.json").write_text(json.dumps(error, indent=2))
        log(ERROR, "fedcomp: the run stopped after %d rounds: %s: %s (written to %s)", len(rounds),
            type(exc).__name__, exc, out_dir / "error.json")
        raise
    if rounds:
        results.plot_accuracy_vs_upload(rounds, out_dir / "accuracy_vs_upload.png", label=str(cfg["upload"]) if adaptive else compressed.upload.spec)
        total_up = sum(r["upload_bytes"] for r in rounds)
        total_dense = sum(r["upload_bytes_dense"] for r in rounds)
        log(INFO, "fedcomp: final accuracy %.4f, uploads %d B (%s less than dense); wrote %s",
            rounds[-1]["accuracy"], total_up, _ratio(total_dense / total_up if total_up and total_dense else None),
            out_dir)
