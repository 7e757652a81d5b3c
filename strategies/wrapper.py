"""``CompressedStrategy``: wrap any ``flwr.serverapp.strategy.Strategy`` with compressed transport.

Per training round the inner strategy samples nodes and builds its messages; the wrapper replaces
the model in each by what that client needs (:mod:`fedcomp.strategies.broadcasts`), takes each
reply as it arrives through the reply checks (:mod:`fedcomp.strategies.checks`,
:mod:`fedcomp.strategies.replies`), budgets (:mod:`fedcomp.strategies.budgets`) and into the
aggregate (:mod:`fedcomp.strategies.aggregation`), and stops the run loudly when it cannot go on
(:mod:`fedcomp.strategies.failures`). Federated evaluation goes through the same tiers
(:mod:`fedcomp.strategies.evaluation`). Every message sent or received is counted, per round in
:class:`RoundStats`, and the run ends with a one-line bytes summary (:mod:`fedcomp.strategies.report`).

The wrapper itself is Flower's ``Strategy`` methods walking an ordered list of parts
(:class:`fedcomp.strategies.part.Part`); a new server behaviour is a new part.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from logging import INFO

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.server import Grid
from flwr.serverapp.strategy import Strategy

import fedcomp
from fedcomp import protocol as P
from fedcomp.broadcast import Tier, parse_thresholds, parse_tiers
from fedcomp.msgsize import message_bytes
from fedcomp.strategies import resolution
from fedcomp.strategies.aggregation import Aggregation
from fedcomp.strategies.broadcasts import Broadcasts
from fedcomp.strategies.budgets import Budgets
from fedcomp.strategies.checks import ReplyChecks
from fedcomp.strategies.config import CompressionConfig
from fedcomp.strategies.evaluation import Evaluation
from fedcomp.strategies.failures import Failures
from fedcomp.strategies.part import Outgoing, Part, Reply, RoundState
from fedcomp.strategies.replies import MissingCompressionMod, NonFiniteModel, NoUsableReplies
from fedcomp.strategies.report import Report
from fedcomp.strategies.stats import RoundStats
from fedcomp.strategies.optimizer_sketch import SERVER_OPTIMIZERS, variant_of
from fedcomp.strategies.robust_sketch import robust_in_sketch_space, robust_momentum, robust_share
from fedcomp.strategies.streaming import StreamingGrid, can_stream, sparse_averse
from fedcomp.tensor_kinds import exact_state_policy

__all__ = ["CompressedStrategy", "CompressionConfig", "RoundStats", "message_bytes", "MissingCompressionMod",
           "NoUsableReplies", "NonFiniteModel", "canonical_order"]


def canonical_order(msg: Message) -> tuple[int, bytes, int]:
    """Sort key of a reply that does not depend on arrival order or on node ids (random per
    simulation run): the SHA-256 of its payload, error replies last. Aggregating in this order
    makes a seeded simulation reproduce its results bit for bit."""
    if msg.has_error():
        return 1, b"", msg.metadata.src_node_id
    record = msg.content.config_records.get(P.UPLOAD_RECORD)
    payload = record.get(P.PAYLOAD) if record is not None else None
    digest = hashlib.sha256(payload).digest() if isinstance(payload, bytes) else b""
    return 0, digest, msg.metadata.src_node_id


class CompressedStrategy(Strategy):
    """Compress broadcasts and replies of any Flower strategy.

    Parameters
    ----------
    inner : Strategy
        The strategy that samples clients and aggregates, e.g. ``FedAvg()``.
    config : CompressionConfig, optional
        The settings below as one frozen object (instead of keyword arguments).
    parts : sequence of Part, optional
        Extra server behaviours (:class:`fedcomp.strategies.part.Part`); their hooks run after
        the built-in parts' (reply checks, broadcast tiers, aggregation, budgets, evaluation).

    Other Parameters
    ----------------
    upload : str (default: ``"auto"``)
        Codec spec the clients use for their updates. ``"auto"`` picks it from the regime at the
        first training round (:class:`CompressionConfig`): every connected node sampled every round ->
        ``topk(ratio=0.02)+qsgd(bits=4)`` with client error feedback; fewer (``fraction_train < 1``)
        -> ``sketch(rows=1, cols=ceil(0.068 n), ratio=0.007)+qsgd(bits=4)`` (n = float parameters)
        with server-side error feedback (``aggregation="sketch"``). Link budgets and ``delta``
        keep the first in every regime.
    download : str (default: ``"auto"``)
        Codec spec of the broadcasts, or tiers separated by ``|`` (tier 0 first, for the slowest
        links), e.g. ``"topk(ratio=0.01)+twobit() | topk(ratio=0.1)+kbit(bits=4) | kbit(bits=8)"``.
        ``"auto"``: ``none()`` with decoded aggregation; with ``aggregation="sketch"`` the coupled
        ``cells(cols=<the sketch's>,seed=<its seed>)+kbit(bits=4,stochastic=true)`` (``coupled_download``):
        one value per heavy-hitter cell of a one-row sketch; ``topk(ratio=<the sketch's ratio>)+...``
        for a sketch of several rows.
        Each tier keeps its own reference model and error feedback (:mod:`fedcomp.broadcast`).
        A client's tier: node config ``download-tier``, else its ``downlink-kbps`` against
        ``download_tier_kbps``, else (simulation) ``partition-id`` modulo the number of tiers.
    download_tier_kbps : str (default: ``""``)
        Downlink kbps thresholds between tiers, ascending, e.g. ``"1000,8000"`` for three tiers.
    streaming : bool (default: True)
        Decode each reply as it arrives and, where the inner strategy's aggregate is a weighted
        mean (FedAvg, FedProx, FedAvgM, FedAdam, FedAdagrad, FedYogi), add it to a running mean
        instead of keeping every client's model (:mod:`fedcomp.strategies.streaming`). Other inner
        strategies get all decoded replies at the end (logged). ``False``: decode everything
        when the last reply is in, as Flower's loop does.
    download_max_stale : int (default: 0)
        Optional cap: a client more than this many steps of its tier behind gets the full
        reference instead of a catch-up chain. 0: no cap; a tier keeps its steps while they
        total less than the full model's bytes (so a chain is sent whenever it is cheaper).
    seeded_init : bool (default: False)
        Every node can build the initial model from the run's seed (its ClientApp uses
        ``make_compression_mod(initial_model=...)``, as the project's does): a node on first
        contact gets the chain of compressed steps since round 0 instead of the full model. The
        client checks the model's CRC; on a mismatch, or with a plain ``compression_mod``, it asks
        for a resync (that round without its update) and gets the full model next round.
    coupled_download : bool (default: False; ``download="auto"`` sets it with sketch aggregation)
        With ``aggregation="sketch"``: tier 0's step is the server's step itself
        (:meth:`fedcomp.server_feedback.ServerFeedback.step_broadcast`): encoded once with tier 0's
        codec, the global model moves by exactly what it decodes to, and what the download drops
        goes back into the server's error table, so tier 0's reference is the global model (no
        second error-feedback loop lagging behind it). Use a stochastic quantizer in tier 0
        (``kbit(bits=4,stochastic=true)``): nearest rounding can lock the coupled loop.
    error_feedback : bool (default: True)
        Clients keep what compression dropped in a residual and send it later.
    seed : int (default: 0)
        Run seed; with the round and node id it seeds random-k indices and stochastic rounding.
    aggregation : str (default: ``"auto"``)
        ``"auto"``: ``"sketch"`` for linear upload codecs (``sketch(...)``), ``"decode"`` otherwise.
        ``"decode"``: decode every reply and let the inner strategy aggregate the models.
        ``"sketch"``: FetchSGD (Rothchild et al. 2020) with server-side error feedback
        (:class:`fedcomp.server_feedback.ServerFeedback`), for upload codecs whose reducer is
        linear, quantizer allowed, e.g. ``sketch(rows=1, cols=16000, ratio=0.02)+qsgd(bits=4)``:
        each reply's tables are dequantized and added to a float64 running sum as it arrives
        (weighted by ``num-examples``), the server keeps momentum and error accumulation in
        sketch space, applies the top-k heavy hitters of the accumulated error, and zeroes
        momentum and error at the cells those coordinates hash to. Clients keep no residual
        (error feedback is server side, so it holds when each client takes part rarely); the
        inner strategy still samples clients, but its aggregation is not used. Running
        statistics (``exact_statistics``) travel exact beside the sketch and are averaged,
        integer buffers advance by the clients' rounded mean increment. Does not combine with
        budgets (clients' sketches would differ in ``cols``).
    server_momentum : float or "auto" (default: ``"auto"``)
        FetchSGD's momentum rho in sketch space (``aggregation="sketch"`` only). ``"auto"``: 0.9
        for robust strategies aggregated in sketch space with the auto upload
        (:mod:`fedcomp.strategies.robust_sketch`), 0 otherwise.
    server_warmup : float or "auto" (default: ``"auto"``)
        FetchSGD's step size in round 1 (``aggregation="sketch"`` with an averaging strategy): the
        round's mean table is multiplied by a factor falling geometrically from it to 1 over 20
        rounds, the momentum and error tables falling with it
        (:class:`fedcomp.server_feedback.Warmup`); 1 is off. It costs no byte; where it helps and
        where it diverges: docs, Results, Slow start. ``"auto"``: 1 (off).
    delta : float (default: 0.0)
        Delta coding of uploads: a client encodes ``update - delta * previous`` where
        ``previous`` is the update the server reconstructed from that client's last reply, and
        the server adds ``delta * previous`` back. Consecutive updates of a client correlate
        so the coded vector is smaller. Client and server check that
        they hold the same reference (its round); a client whose reply was dropped, or that sat
        out, sends a plain update and both sides start over. Costs one dense update per client
        on the server. 0 turns it off.
    max_update_norm : float (default: 0.0)
        Drop a reply whose decoded update (all float tensors, L2) is longer than this, with the
        norm and the bound in its status. With ``aggregation="sketch"`` norms are the sketch's
        norm divided by sqrt(rows) (each row of a count sketch preserves the norm in
        expectation). 0 turns it off. NaN and Inf updates are always dropped.
    norm_factor : float (default: 10.0)
        Drop a reply whose update norm exceeds ``norm_factor`` times a reference norm that a
        minority cannot steer (:mod:`fedcomp.strategies.guards`): the lower median of the norms the
        previous round accepted (decided at once); in a round without one (the first, or after a
        round that aggregated nothing) the replies wait until every message sent has its reply, or
        the round ends, and the lower median of their norms is the reference (a set, not an arrival
        order: streamed and batch rounds aggregate the same). 0 turns it off.
    norm_warmup : int (default: 3)
        Accepted norms a round needs to be the next round's reference; the least quorum.
    max_weight : float (default: 0.0)
        Cap on a reply's weight (``num-examples`` or the inner strategy's ``weighted_by_key``).
        Weights must be finite numbers > 0 and at most 2**53 in any case; a reply failing this
        is dropped with the reason. 0: no cap below 2**53.
    weight_factor : float (default: 2.0)
        Clip a reply's weight to this many times the lower median of the reference weights: the
        weights the previous round accepted, or (first round) those of a quorum of the round's
        replies (:class:`fedcomp.strategies.guards.RoundGuard`), so a client declaring 1e12
        examples weighs at most ``weight_factor`` median clients; logged per reply. Honest clients
        above it count at the cap: raise it where partitions are that uneven. 0 trusts declared weights (for deployments that authenticate them).
    max_failed_rounds : int (default: 3)
        Stop the run (:class:`NoUsableReplies`, naming the clients' errors) after this many
        consecutive rounds in which no reply reached the aggregate.
    compress_evaluate : bool (default: True)
        Federated evaluation messages go through the tiers' references to clients whose mod
        announced it handles them (a chain instead of the model); others get the dense model.
        Either way they are counted in :class:`RoundStats`.
    link_profile : str (default: ``"none"``)
        Simulation: maps ``partition-id`` to a link (``fedcomp.links``): a preset
        (``datacenter``, ``broadband``, ``4g``, ``3g-edge``), ``"mixed"``, or the path of a
        ``.csv``/``.toml`` per-client table. Node-config link keys take precedence. ``"none"``:
        clients without link keys have no link, no budget and no simulated time.
    round_deadline_s : float (default: 0.0)
        Round deadline in seconds for links without their own (0: none). Clients' byte budgets
        come from it (what the uplink carries in the time left after download and compute);
        clients past it are dropped and the round lasts the deadline.
    budget_fallback : str (default: ``"skip"``)
        A client whose budget is below the coarsest setting of the codec: ``"skip"`` (sends no
        update, keeps it in its residual) or ``"coarsest"`` (sends the coarsest setting, over
        budget, reported as such).
    """

    def __init__(self, inner: Strategy, config: CompressionConfig | None = None, *, parts: Sequence[Part] = (),
                 **settings) -> None:
        if config is not None and settings:
            raise fedcomp.SpecError(f"pass either config= or keyword settings, not both (got {sorted(settings)})")
        if config is None:
            unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(CompressionConfig)})
            if unknown:
                raise TypeError(f"CompressedStrategy got unknown settings {unknown}; allowed: "
                                f"{', '.join(f.name for f in dataclasses.fields(CompressionConfig))}")
            config = CompressionConfig(**settings)
        self.inner = inner
        self.requested = config  # as given ('auto' specs included)
        self.rounds: dict[int, RoundStats] = {}
        self.layout: fedcomp.Layout | None = None  # the global model's layout (None before the first round)
        self.base: dict[str, torch.Tensor] = {}  # the global model of this round: model_i = base + update_i
        self.dense_model_bytes = 0
        self._round_state: RoundState | None = None
        # the parts, in the order their hooks run; the named ones are reached by the others
        self._broadcasts, self._aggregate, self._checks = Broadcasts(), Aggregation(), ReplyChecks()
        self._evaluation, self._failures = Evaluation(), Failures()
        self.parts: list[Part] = [self._broadcasts, self._aggregate, Budgets(), self._checks, self._evaluation,
                                  Report(), self._failures, *parts]
        for part in self.parts:
            part.bind(self)
        # 'auto' specs: provisional from the inner strategy's fraction_train until the first
        # training round, which knows the nodes sampled, the nodes connected and the model's size
        self.sparse_averse = sparse_averse(inner)
        self._upload_set = False  # set_upload was called (AdaptiveStrategy): no regime resolution of the upload
        partial = float(getattr(inner, "fraction_train", 1.0)) < 1
        self._use(config.resolve(partial=partial, sparse_averse=self.sparse_averse,
                                 robust_sketch=robust_in_sketch_space(inner, partial),
                                 robust_momentum=robust_momentum(inner, partial),
                                 robust_share=robust_share(inner, partial),
                                 server_optimizer=variant_of(inner) if type(inner) in SERVER_OPTIMIZERS else None))
        if not config.auto:
            resolution.warn_biased(self)
        resolution.warn_sparse_averse(self)

    def _use(self, config: CompressionConfig) -> None:
        """Take a concrete config: codecs, aggregation, tiers (before any round)."""
        self.config = config
        self.upload = fedcomp.build_codec(config.upload)
        self.aggregation = config.resolved_aggregation
        self.error_feedback = config.client_error_feedback
        self.tiers = [Tier(i, spec, config.download_max_stale or None)
                      for i, spec in enumerate(parse_tiers(config.download))]
        self.tier_kbps = ",".join(str(v) for v in parse_thresholds(config.download_tier_kbps, len(self.tiers)))

    def set_upload(self, spec: str) -> None:
        """Use ``spec`` for the uploads of the rounds configured from now on (``AdaptiveStrategy``
        sets each round's spec this way); running statistics stay exact as for the configured spec."""
        codec = fedcomp.build_codec(spec)
        self._upload_set = True  # the caller owns the upload now: the round-1 regime resolution keeps it
        statistics = self._aggregate.statistics_layout
        if statistics is not None and not codec.lossless:
            codec = fedcomp.build_codec(exact_state_policy(spec, statistics))
        self.upload = codec

    # settings read by the project's app and tests
    seed = property(lambda self: self.config.seed)
    delta = property(lambda self: self.config.delta)
    streaming = property(lambda self: self.config.streaming)
    max_update_norm = property(lambda self: self.config.max_update_norm)
    link_profile = property(lambda self: self.config.link_profile)
    round_deadline_s = property(lambda self: self.config.round_deadline_s)
    budget_fallback = property(lambda self: self.config.budget_fallback)
    server_momentum = property(lambda self: self.config.server_momentum)
    feedback = property(lambda self: self._aggregate.feedback, doc="FetchSGD's server-side error feedback (or None)")
    _capable = property(lambda self: self._evaluation.capable)

    def _statistics_names(self) -> list[str]:
        return self._aggregate.statistics_names()

    def summary(self) -> None:
        if self.requested.auto and self.layout is None:
            log(INFO, "fedcomp: upload %s, download %s: picked at the first round from the nodes sampled and the "
                "model's size (provisional: %s, %s)", self.requested.upload, self.requested.download,
                self.upload.spec, " | ".join(t.codec.spec for t in self.tiers))
        else:
            log(INFO, "fedcomp: upload %s, download %s, error feedback %s, aggregation %s", self.upload.spec,
                " | ".join(t.codec.spec for t in self.tiers), "on" if self.error_feedback else "off",
                self.aggregation)
        if self.aggregation == "decode" and not can_stream(self.inner):
            log(INFO, "fedcomp: %s needs every reply at once: replies are decoded as they arrive, then collected",
                type(self.inner).__name__)
        self.inner.summary()

    # -- training: broadcasts ---------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        stats = self.rounds.setdefault(server_round, RoundStats())
        self._checks.sent[server_round] = [m.metadata.dst_node_id for m in messages]
        if not messages:
            return messages
        if self.layout is None:
            connected = len(list(grid.get_node_ids()))
            resolution.resolve(self, len(messages), connected, arrays)
            resolution.warn_stale_residuals(self, len(messages), connected)
        model = self._set_model(arrays)
        stats.encodes += self._broadcasts.step_tiers([m.metadata.dst_node_id for m in messages], model, server_round)
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            array_keys = list(msg.content.array_records)
            if len(array_keys) != 1:
                raise ValueError(f"CompressedStrategy expects one ArrayRecord per train message, got {array_keys}")
            outgoing = Outgoing(server_round, node, array_keys[0], download={"node": node})
            for part in self.parts:
                part.on_train_message(outgoing)
            dense_bytes = message_bytes(msg.content)
            content = RecordDict({k: v for k, v in msg.content.items() if k != array_keys[0]})
            content[P.DOWNLOAD_RECORD] = ConfigRecord(outgoing.fields)
            nbytes = message_bytes(content)
            tier = outgoing.download["tier"]
            stats.download_bytes += nbytes
            stats.download_bytes_dense += dense_bytes
            stats.download_bytes_by_tier[tier] = stats.download_bytes_by_tier.get(tier, 0) + nbytes
            stats.downloads.append({**outgoing.download, "download_bytes": nbytes})
            out.append(Message(content=content, dst_node_id=node,
                               message_type=msg.metadata.message_type, group_id=msg.metadata.group_id))
            state = self._state(server_round)
            state.arrays_key, state.message_type = array_keys[0], msg.metadata.message_type
        return out

    def _set_model(self, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
        model = dict(arrays.to_torch_state_dict())
        layout = fedcomp.Layout.of(model)
        if layout != self.layout:
            for part in self.parts:
                part.on_layout(layout)
        self.layout = layout
        self.base = {k: v.detach().cpu() for k, v in model.items()}
        self.dense_model_bytes = message_bytes(ArrayRecord(self.base))
        self._broadcasts.start_tiers(model)
        return model

    # -- training: replies --------------------------------------------------------------------
    def start(self, grid: Grid, *args, **kwargs):
        """Flower's round loop, with replies handled as they arrive (:mod:`fedcomp.strategies.streaming`),
        ending with the run's bytes summary (logged at INFO).

        Raises :class:`MissingCompressionMod` or :class:`NoUsableReplies` instead of returning a
        model no reply ever reached.
        """
        if self.config.streaming:
            grid = StreamingGrid(grid, self._on_reply)
        result = super().start(grid, *args, **kwargs)
        for part in self.parts:
            part.on_run_end(self.rounds)
        return result

    def _on_reply(self, msg: Message) -> None:
        if self._round_state is not None and msg.metadata.message_type == self._round_state.message_type:
            self._receive(self._round_state.round, msg)

    def _receive(self, server_round: int, msg: Message) -> None:
        """Count one reply, let every part observe it, then judge it; one that passes goes to the
        round's reply handler (once per reply)."""
        state = self._state(server_round)
        if id(msg) in state.seen:  # the grid streamed it in; Flower's loop passes it again
            return
        state.seen[id(msg)] = msg
        reply = Reply(state, msg, msg.metadata.src_node_id)
        if not msg.has_error():
            reply.wire = message_bytes(msg.content)
            reply.entry = {"node": reply.node, "upload_bytes": reply.wire, "status": "ok"}
            reply.record = msg.content.config_records.get(P.UPLOAD_RECORD)
            state.stats.upload_bytes += reply.wire
        if not self._checks.admit(reply):
            return
        for part in self.parts:
            part.observe(reply)
        for part in self.parts:
            status = part.check(reply)
            if status is not None:
                reply.entry["status"] = status
                return
        if state.replies is None:
            reply.entry["status"] = "dropped: reply arrived before any broadcast"
            return
        state.replies.handle(msg, reply.entry)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        state = self._state(server_round)
        # those not streamed in already, in a fixed order (streamed ones need no payload hash)
        for msg in sorted((m for m in replies if id(m) not in state.seen), key=canonical_order):
            self._receive(server_round, msg)
        self._round_state = None
        for part in self.parts:
            part.on_round_end(state)
        arrays, metrics = self._aggregate.aggregate(state) if state.stats.aggregated else (None, None)
        for part in self.parts:
            part.on_aggregated(state, arrays)
        return arrays, metrics

    def _state(self, server_round: int) -> RoundState:
        if self._round_state is None or self._round_state.round != server_round:
            self._round_state = RoundState(server_round, self.rounds.setdefault(server_round, RoundStats()),
                                           self._aggregate.new_replies(server_round))
        return self._round_state

    # -- federated evaluation: through the tiers' references, counted -------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The inner strategy's evaluate messages; a client whose mod handles evaluate broadcasts
        gets its tier's next reference as a chain or in full instead of the model."""
        messages = list(self.inner.configure_evaluate(server_round, arrays, config, grid))
        return self._evaluation.configure(server_round, messages, arrays) if messages else messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, self._evaluation.replies(server_round, replies))
