"""The one experiment harness: Flower's own round loop, in this process, through the code users run.

Every study and benchmark that trains runs :func:`run`. It builds the strategy a user would write
(a Flower strategy from ``flwr.serverapp.strategy``, wrapped by
:class:`~fedcomp.strategies.CompressedStrategy`, or by :class:`~fedcomp.strategies.AdaptiveStrategy`
when one upload parameter is ``auto``; bare for the dense baseline) and calls its ``start`` on an
:class:`InProcessGrid`. That grid answers each message at once with the project's ClientApp
(:data:`fedcomp.simulations.client_app.app`: its ``train``/``evaluate`` behind ``netsim_mod``,
``faults_mod`` and the seeded ``compression_mod``) and a persistent Flower ``Context`` per node, as
the simulation engine keeps one (node config ``partition-id``/``num-partitions``). The server
evaluates the global model on the task's test set after every round (``evaluate_fn``), as the
project's ServerApp does. No Ray, no SuperLink, no replay: a fix in the mod or the wrapper reaches
every figure.

Deterministic for a seed: Flower samples nodes with the process-global ``random``, seeded here at
the start of each run; training seeds come from (run seed, round, partition) in the ClientApp.
Accuracy, losses and payloads repeat exactly; message bytes within a few bytes per message (the
wrapper's reply tokens are drawn with ``secrets``, and deflate sizes them differently).

Bytes are Flower message bytes (:func:`fedcomp.msgsize.message_bytes`) of the train messages and
replies as they cross the grid, the same measure for dense and compressed runs; wrapped runs also
keep the wrapper's own `fedcomp.strategies.stats.RoundStats` per round.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict

DENSE = "dense"  # ``upload`` of the baseline: the bare strategy, no wrapper
# the app's default for digits; other tasks need theirs (``lr=``); a (task, model) key wins over the task's
# (char-lstm: 2.0, the codec-families study's; 0.05 did not learn: docs, Results, Regimes)
DEFAULT_LR = {"digits": 0.3, ("stdlib-chars", "char-transformer"): 5.0, ("stdlib-chars", "char-lstm"): 2.0}

Mod = Callable[[Message, Context, Callable[[Message, Context], Message]], Message]


def strategies(clients: int, fraction: float = 1.0, lr: float = 0.3) -> dict[str, Callable]:
    """Flower's strategies by name, as the studies build them (Flower's defaults unless stated);
    every one samples ``fraction`` of ``clients`` per round and leaves evaluation to the server."""
    from flwr.serverapp import strategy as s

    common = {"fraction_train": fraction, "fraction_evaluate": 0.0, "min_available_nodes": clients,
              "min_train_nodes": max(1, min(clients, max(2, int(clients * fraction))))}
    return {
        "FedAvg": lambda: s.FedAvg(**common),
        "FedProx": lambda: s.FedProx(**common, proximal_mu=0.01),  # the project's client ignores the term
        "FedAvgM": lambda: s.FedAvgM(**common, server_momentum=0.9),
        "FedAdam": lambda: s.FedAdam(**common, eta=0.01, eta_l=0.05),
        "FedAdagrad": lambda: s.FedAdagrad(**common, eta=0.01, eta_l=0.05),
        "FedYogi": lambda: s.FedYogi(**common, eta=0.01, eta_l=0.05),
        "FedMedian": lambda: s.FedMedian(**common),
        "FedTrimmedAvg": lambda: s.FedTrimmedAvg(**common, beta=0.2),
        "Krum": lambda: s.Krum(**common, num_malicious_nodes=1),
        "MultiKrum": lambda: s.MultiKrum(**common, num_malicious_nodes=1, num_nodes_to_select=5),
        "Bulyan": lambda: s.Bulyan(**common, num_malicious_nodes=1),
        "QFedAvg": lambda: s.QFedAvg(client_learning_rate=lr, **common),
    }


class InProcessGrid:
    """A Flower Grid whose pushed messages are answered at once by ``app`` (a ClientApp or any
    ``(message, context) -> message`` callable) with the destination node's ``Context``.

    ``mods`` wrap ``app`` outermost first (a mod may edit or replace the reply); a ClientApp that
    raises answers with an error message, as Flower's runtime does. ``sent``/``received`` hold the
    message bytes per message type since the last :meth:`reset`.
    """

    def __init__(self, app, contexts: dict[int, Context], mods: Sequence[Mod] = ()) -> None:
        self.app, self.contexts, self.mods = app, contexts, tuple(mods)
        self.ready: dict[str, Message] = {}
        self.count = 0
        self.reset()

    def reset(self) -> None:
        self.sent: dict[str, int] = {}
        self.received: dict[str, int] = {}
        self.replies: dict[str, int] = {}

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def _call(self, msg: Message, context: Context) -> Message:
        call = self.app
        for mod in reversed(self.mods):
            call = (lambda m, c, mod=mod, nxt=call: mod(m, c, nxt))
        try:
            return call(msg, context)
        except Exception as exc:  # noqa: BLE001 - Flower's runtime turns a raising ClientApp into an error reply
            from flwr.common.constant import ErrorCode

            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(exc).__name__}: {exc}"), reply_to=msg)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        from fedcomp.msgsize import message_bytes

        ids = []
        for msg in messages:
            self.count += 1
            mid = f"m{self.count}"
            msg.metadata.__dict__["_message_id"] = mid  # what the SuperLink assigns on push
            kind = msg.metadata.message_type.split(".")[0]
            self.sent[kind] = self.sent.get(kind, 0) + message_bytes(msg.content)
            reply = self._call(msg, self.contexts[msg.metadata.dst_node_id])
            reply.metadata.__dict__["_reply_to_message_id"] = mid
            if reply.has_content():
                self.received[kind] = self.received.get(kind, 0) + message_bytes(reply.content)
            self.replies[kind] = self.replies.get(kind, 0) + 1
            self.ready[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.ready.pop(k) for k in list(message_ids) if k in self.ready]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))


@dataclasses.dataclass
class History:
    """One run: per-round rows, the wrapper's stats, and what the run was."""

    rows: list[dict]  # per round: accuracy, loss, bytes (see run), replies, aggregated, finite, + observe's keys
    initial: dict  # the initial model's accuracy and loss (round 0)
    stats: dict  # round -> RoundStats of the wrapper (empty for the dense baseline)
    upload: str  # the upload spec as resolved at round 1 (the last round's for an 'auto' parameter; 'dense')
    download: str  # the resolved download tiers ('dense' for the baseline)
    aggregation: str  # 'decode' or 'sketch' (wrapped), 'dense'
    config: dict  # the run's settings
    seconds: float
    final: dict  # the final global model (state dict)
    error: str | None = None  # a FedcompError that stopped the run (NonFiniteModel, NoUsableReplies...)

    @property
    def accuracy(self) -> float:
        """The last round's accuracy (0.0 when the run stopped before any round ended)."""
        return self.rows[-1]["accuracy"] if self.rows else 0.0

    @property
    def upload_bytes(self) -> int:
        return sum(r["upload_bytes"] for r in self.rows)

    @property
    def download_bytes(self) -> int:
        return sum(r["download_bytes"] for r in self.rows)


def _identity() -> None:
    """Flower Messages need a run/task identity, which a Flower process sets; set one if none is."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("run_id", "task_id", "node_id"):
        try:
            getattr(TaskIdentity, name)
        except RuntimeError:
            setattr(TaskIdentity, name, 1)


def build_strategy(inner, upload: str, *, clients: int, fraction: float, lr: float, seed: int, **settings):
    """``inner`` (a name of :func:`strategies`, a Strategy, or a factory) wrapped for ``upload``:
    bare for :data:`DENSE`, :class:`AdaptiveStrategy` with an ``auto`` parameter, else
    :class:`CompressedStrategy` (``settings``: its keyword arguments)."""
    from fedcomp.adapt import is_auto
    from fedcomp.strategies import AdaptiveStrategy, CompressedStrategy

    if isinstance(inner, str):
        table = strategies(clients, fraction, lr)
        if inner not in table:
            raise ValueError(f"unknown strategy {inner!r}; allowed: {sorted(table)}")
        inner = table[inner]()
    elif callable(inner) and not hasattr(inner, "configure_train"):
        inner = inner()
    if upload == DENSE:
        if settings:
            raise ValueError(f"the dense baseline runs the bare strategy: wrapper settings {sorted(settings)} "
                             f"do not apply")
        return inner
    if is_auto(upload):
        return AdaptiveStrategy(inner, upload=upload, seed=seed, **settings)
    return CompressedStrategy(inner, upload=upload, seed=seed, **settings)


def run(
    upload: str = DENSE,
    *,
    task: str = "digits",
    model: str = "mlp",
    strategy="FedAvg",
    rounds: int = 5,
    clients: int = 10,
    fraction: float = 1.0,
    seed: int = 0,
    lr: float | None = None,
    local_epochs: int = 1,
    batch_size: int = 32,
    alpha: float = 0.5,
    run_config: dict | None = None,
    mods: Sequence[Mod] = (),
    app=None,
    observe: Callable[[int, dict], dict] | None = None,
    evaluate: bool = True,
    quiet: bool = True,
    **settings,
) -> History:
    """One federated run: ``strategy.start`` on an :class:`InProcessGrid` of ``clients`` nodes.

    ``upload``: :data:`DENSE` for the bare strategy, else the wrapper's upload spec (``"auto"``, a
    spec, or a spec with one ``auto`` parameter); ``settings``: the wrapper's other settings
    (``download``, ``error_feedback``, ``aggregation``, ``server_momentum``, ...). ``seeded_init``
    defaults to True, as in the project's ServerApp (its ClientApp builds the round-0 model from
    the seed). ``strategy``: a name of :func:`strategies` (sampling ``fraction`` of the nodes), a
    Flower strategy, or a factory. ``run_config``: extra ClientApp run config keys (``faults``,
    ``link-profile``...); ``mods``: extra mods around the ClientApp, outermost first; ``app``:
    another ClientApp (default the project's). ``observe(round, state)`` returns extra keys for
    the round's row (``state``: the global model after the round). ``evaluate=False``: no test-set
    evaluation (accuracy and loss NaN; a quicker run for checks of the model state). ``quiet``:
    Flower's log at ERROR during the run (its per-round lines, the baseline's unwrapped warnings).

    Rows: ``round``, ``accuracy``, ``loss`` (server-side, on the task's test set), ``upload_bytes``
    and ``download_bytes`` (the round's train replies and messages, Flower message bytes),
    ``upload_bytes_dense``/``download_bytes_dense`` (the same with the model as plain arrays: the
    wrapper's count; the measured bytes for the dense baseline), ``replies``, ``aggregated``,
    ``finite``; wrapped runs also ``sim_time_s`` (links: :mod:`fedcomp.links`); with run config
    ``link-profile='measured:<profile>'`` (and ``round_deadline_s``) the wrapper is driven by
    :class:`~fedcomp.strategies.measured.MeasuredLinkStrategy`, as in the project's ServerApp, and
    rows carry ``link_estimates``; with an ``auto`` upload also ``upload_spec``, ``strength``, ``budget``, ``decision``,
    ``fixed_bytes``. A :class:`fedcomp.FedcompError` ends the run early: ``History.error``.
    """
    import fedcomp
    from fedcomp import links
    from fedcomp.simulations import client_app, task as tasks
    from fedcomp.strategies.measured import MeasuredLinkStrategy

    _identity()
    tasks.check_task_model(task, model)
    lr = DEFAULT_LR.get((task, model), DEFAULT_LR.get(task, 0.05)) if lr is None else lr
    if upload != DENSE:
        settings.setdefault("seeded_init", True)
    config = {"upload": upload, "task": task, "model": model, "strategy": strategy if isinstance(strategy, str) else
              type(strategy).__name__, "rounds": rounds, "clients": clients, "fraction": fraction, "seed": seed,
              "lr": lr, "local-epochs": local_epochs, "batch-size": batch_size, "partition-alpha": alpha,
              **({"run_config": dict(run_config)} if run_config else {}), **settings}
    random.seed(seed)  # Flower's strategies sample with the process-global random: the seed fixes who trains
    strat = build_strategy(strategy, upload, clients=clients, fraction=fraction, lr=lr, seed=seed, **settings)
    cfg = {"seed": seed, "task": task, "model": model, "local-epochs": local_epochs, "lr": lr,
           "batch-size": batch_size, "partition-alpha": alpha, **(run_config or {})}
    measured = wrapped = upload != DENSE
    if wrapped and links.measured_profile(str(cfg.get("link-profile", links.NONE))) is not None:
        # links hidden from the clients (netsim_mod plays them): budgets from what the server measures,
        # as the project's ServerApp runs link-profile='measured:<profile>'
        strat = MeasuredLinkStrategy(strat, float(settings.get("round_deadline_s", 0.0)))
    else:
        measured = False
    contexts = {100 + p: Context(run_id=1, node_id=100 + p, node_config={"partition-id": p, "num-partitions": clients},
                                 state=RecordDict(), run_config=dict(cfg)) for p in range(clients)}
    grid = InProcessGrid(app if app is not None else client_app.app, contexts, mods)
    net = tasks.build_model(model, seed=seed, task=task)
    x_test, y_test = tasks.load_test(task, seed, num_partitions=clients, alpha=alpha) if evaluate else (None, None)
    initial: dict = {}
    rows: list[dict] = []
    final: dict = {}
    compressed = getattr(strat, "compressed", strat)  # AdaptiveStrategy holds its CompressedStrategy

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        state = arrays.to_torch_state_dict()
        finite = all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())
        if not evaluate:
            loss = accuracy = float("nan")
        elif finite:
            net.load_state_dict(state)
            loss, accuracy = tasks.evaluate(net, x_test, y_test, device="cpu")
        else:
            loss, accuracy = float("nan"), 0.0  # a diverged model scores 0
        if server_round == 0:
            initial.update(accuracy=accuracy, loss=loss)
            grid.reset()
            return MetricRecord({"accuracy": accuracy, "loss": loss})
        final.clear()
        final.update(state)
        up, down = grid.received.get("train", 0), grid.sent.get("train", 0)
        row = {"round": server_round, "accuracy": accuracy, "loss": loss, "upload_bytes": up, "download_bytes": down,
               "upload_bytes_dense": up, "download_bytes_dense": down, "replies": grid.replies.get("train", 0),
               "aggregated": grid.replies.get("train", 0), "finite": finite}
        if wrapped:
            s = strat.rounds[server_round]
            row.update(upload_bytes_dense=s.upload_bytes_dense, download_bytes_dense=s.download_bytes_dense,
                       aggregated=s.aggregated, sim_time_s=s.sim_time_s)
            if measured:  # per node: the estimate sent, the transfers observed, the budgets, the hidden truth
                row["link_estimates"] = strat.estimates_of(server_round)
                true_time = strat.true_round_time(server_round)
                if true_time is not None:
                    row["sim_time_s_estimated_links"], row["sim_time_s"] = row["sim_time_s"], true_time
        if observe is not None:
            row.update(observe(server_round, state))
        rows.append(row)
        grid.reset()
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    if quiet:  # Flower logs every round's metrics, the dense baseline's mods warn that nothing is wrapped
        flwr_log.setLevel(logging.ERROR)
    error, t0 = None, time.perf_counter()
    try:
        strat.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=rounds,
                    train_config=ConfigRecord({}), evaluate_fn=central)
    except fedcomp.FedcompError as exc:  # the run stopped (NonFiniteModel, NoUsableReplies...): what it did stays
        error = f"{type(exc).__name__}: {exc}"
    finally:
        flwr_log.setLevel(level)
    for row in rows if hasattr(strat, "strength_of") else ():  # decided after evaluate_fn returned
        h = strat.strength_of(row["round"])
        if h is not None:
            row.update(upload_spec=h["spec"], strength=h[strat.auto.param], budget=h["budget"],
                       decision=h.get("decision"), fixed_bytes=h.get("fixed_bytes"))
    if wrapped:
        up_spec = str(compressed.config.upload)  # 'auto' resolved at round 1, as the config writes it
        down_spec = " | ".join(t.codec.spec for t in compressed.tiers) if compressed.tiers else ""
        aggregation = compressed.aggregation
    else:
        up_spec = down_spec = aggregation = DENSE
    return History(rows=rows, initial=initial, stats=dict(compressed.rounds) if wrapped else {}, upload=up_spec,
                   download=down_spec, aggregation=aggregation, config=config, seconds=time.perf_counter() - t0,
                   final=final, error=error)
