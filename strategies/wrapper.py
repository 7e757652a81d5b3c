"""``CompressedStrategy``: wrap any ``flwr.serverapp.strategy.Strategy`` with compressed transport.

Per training round:

1. The inner strategy samples nodes and builds its messages (model + config).
2. The wrapper moves each download tier's reference towards the model with one encode per
   tier (server-side error feedback, :mod:`fedcomp.broadcast`) and replaces the model in
   every message by what that client needs: the chain of steps since the reference it holds,
   or the full reference on first contact and resyncs; plus the layout, codec specs, seed,
   round (see :mod:`fedcomp.protocol`). With ``seeded_init`` a node never heard from holds the
   round-0 model every node builds from the seed, so first contact is a chain too; with
   ``coupled_download`` tier 0's step is the server's own step (encoded once in step 3's
   aggregate, nothing encoded here).
3. Replies carry the ``upload`` codec's payload of the client's update. Each one is counted,
   checked, decoded and added as it arrives (:mod:`fedcomp.strategies.replies`, on the core's
   :mod:`fedcomp.aggregate`; a reply that fails is dropped with its reason, the round goes on).
   Weighted-mean strategies (FedAvg, FedProx, FedAvgM, the FedOpt family) get one reply holding
   the weighted mean; FetchSGD (``aggregation="sketch"``) sums sketches with server-side error
   feedback (:mod:`fedcomp.server_feedback`);
   other strategies get ``model_i = global model + update_i`` per reply (FedMedian, Krum...).
4. The next broadcast acknowledges each node's last aggregated round, so a client puts an
   update that never reached the aggregate back into its residual.

Federated evaluation goes through the same tiers: a client whose mod handles evaluate
broadcasts gets a chain to its tier's next reference; others get the dense model. Every message
the wrapper sends or receives is counted (:func:`fedcomp.msgsize.message_bytes`), per round
in :class:`RoundStats`.

A hostile client costs only its own reply (:mod:`fedcomp.strategies.guards`, threat model there):
each train message carries a server token its reply must be bound to, one reply per node and
message is taken, uploads are bounded by the configured codec's size, replies built on a reference
the server never sent are dropped, norms and weights are judged against references a minority
cannot steer, metrics and non-weight state are checked per reply. A server-side encode that fails
(a tier's step, the coupled sketch step) costs that round's compression: the full model, logged.

Failures are loud: a round whose replies carry no fedcomp payload raises
:class:`MissingCompressionMod`; ``max_failed_rounds`` consecutive rounds without a usable reply
raise :class:`NoUsableReplies` with the clients' errors summarised; a global model with NaN or
Inf values raises :class:`NonFiniteModel` (the run stops instead of finishing at chance).

Bandwidth budgets (``link_profile``, ``round_deadline_s``; :mod:`fedcomp.links`): clients
with a link fit their reply to its byte budget and report the concrete codec spec they used;
the wrapper accepts a reported spec only of the configured family and records per client
bytes, budget, status and simulated times, and per round ``sim_time_s``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Iterable
from logging import INFO, WARNING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.server import Grid
from flwr.serverapp.strategy import FedAvg, FedProx, Strategy

import fedcomp
from fedcomp import links
from fedcomp import protocol as P
from fedcomp.aggregate import Accumulator, apply_step
from fedcomp.broadcast import Tier, parse_thresholds, parse_tiers, reference_crc
from fedcomp.codec import derive_nonce
from fedcomp.server_feedback import BroadcastFailed, ServerFeedback
from fedcomp.msgsize import message_bytes
from fedcomp.wire import REPLY_TOKEN, TOKEN_BITS
from fedcomp.strategies.config import AUTO, DENSE_UPLOAD, CompressionConfig
from fedcomp.strategies.replies import (MissingCompressionMod, NonFiniteModel, NoUsableReplies, ReplyHistory,
                                        RoundReplies, summarize)
from fedcomp.strategies.guards import GuardHistory, RoundGuard, StateGuard, upload_bound
from fedcomp.strategies.streaming import StreamingGrid, can_stream, sparse_averse
from fedcomp.tensor_kinds import COUNTER, STATISTIC, exact_state_policy, split_kinds

__all__ = ["CompressedStrategy", "CompressionConfig", "RoundStats", "message_bytes", "MissingCompressionMod",
           "NoUsableReplies", "NonFiniteModel", "canonical_order"]

_MEAN_IS_THE_MODEL = (FedAvg, FedProx)  # aggregate_train of one reply of the total weight returns its model
XDEV_SHARE = 0.1  # a sparsifier's share from which client residuals held in cross-device (measured)
XDEV_RANK = 8  # PowerSGD's rank from which it held in cross-device (measured)


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


@dataclasses.dataclass
class RoundStats:
    """What one round cost on the wire, summed over the round's clients, and what became of each reply."""

    upload_bytes: int = 0  # train replies as received (Flower message bytes)
    download_bytes: int = 0  # train messages as sent
    upload_bytes_dense: int = 0  # the aggregated replies with the model as plain arrays instead of the payload
    download_bytes_dense: int = 0  # the same train messages with the model as plain arrays
    download_bytes_by_tier: dict[int, int] = dataclasses.field(default_factory=dict)
    encodes: int = 0  # broadcast encodes this round: one per tier with clients, not one per client
    downloads: list[dict] = dataclasses.field(default_factory=list)  # per client: node, tier, mode, steps, bytes
    clients: list[dict] = dataclasses.field(default_factory=list)  # per train reply: node, upload_bytes, status
    links: list[dict] = dataclasses.field(default_factory=list)  # per client with a link: bytes, budget, times
    sim_time_s: float | None = None  # simulated round time (None: no client reported a link)
    aggregated: int = 0  # replies that reached the aggregate
    evaluate_download_bytes: int = 0  # federated-evaluation messages as sent
    evaluate_download_bytes_dense: int = 0  # the same messages with the model as plain arrays
    evaluate_reply_bytes: int = 0  # federated-evaluation replies as received
    evaluate_clients: list[dict] = dataclasses.field(default_factory=list)  # per evaluate message: node, mode, bytes
    extra: list[dict] = dataclasses.field(default_factory=list)  # replies dropped as not answering a message sent

    @property
    def upload_ratio(self) -> float | None:
        """Dense / compressed upload bytes (None when nothing was uploaded: never NaN)."""
        return self.upload_bytes_dense / self.upload_bytes if self.upload_bytes and self.upload_bytes_dense else None

    @property
    def download_ratio(self) -> float | None:
        return self.download_bytes_dense / self.download_bytes if self.download_bytes else None


@dataclasses.dataclass
class _RoundState:
    """The round in progress: replies already seen and the reply handler."""

    round: int
    replies: RoundReplies | None
    message_type: str = "train"
    arrays_key: str = ""
    seen: dict[int, Message] = dataclasses.field(default_factory=dict)  # replies already received, by identity
    errors: list[Message] = dataclasses.field(default_factory=list)  # error replies (collect mode hands them on)
    replied: set[int] = dataclasses.field(default_factory=set)  # nodes whose reply was taken (one per message)
    unwrapped: int = 0  # replies without a fedcomp upload record



class CompressedStrategy(Strategy):
    """Compress broadcasts and replies of any Flower strategy.

    Parameters
    ----------
    inner : Strategy
        The strategy that samples clients and aggregates, e.g. ``FedAvg()``.
    upload : str (default: ``"auto"``)
        Codec spec the clients use for their updates. ``"auto"`` picks it from the regime at the
        first training round (:class:`CompressionConfig`, measured in
        ``results/xdev/README.md``): every connected node sampled every round ->
        ``topk(ratio=0.01)+qsgd(bits=4)`` with client error feedback; fewer (``fraction_train < 1``)
        -> ``sketch(rows=1, cols=ceil(0.068 n), ratio=0.01)+qsgd(bits=4)`` (n = float parameters)
        with server-side error feedback (``aggregation="sketch"``). Link budgets and ``delta``
        keep the first in every regime.
    download : str (default: ``"auto"``)
        Codec spec of the broadcasts, or tiers separated by ``|`` (tier 0 first, for the slowest
        links), e.g. ``"topk(ratio=0.01)+twobit() | topk(ratio=0.1)+kbit(bits=4) | kbit(bits=8)"``.
        ``"auto"``: ``none()`` with decoded aggregation; with ``aggregation="sketch"`` the coupled
        ``topk(ratio=<the sketch's ratio>)+kbit(bits=4,stochastic=true)`` (``coupled_download``).
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
        (``kbit(bits=4,stochastic=true)``): with nearest rounding 2 of 5 runs collapsed.
    error_feedback : bool (default: True)
        Clients keep what compression dropped in a residual and send it later.
    seed : int (default: 0)
        Run seed; with the round and node id it seeds random-k indices and stochastic rounding.
    aggregation : str (default: ``"auto"``)
        ``"auto"``: ``"sketch"`` for linear upload codecs (``sketch(...)``), ``"decode"`` otherwise.
        ``"decode"``: decode every reply and let the inner strategy aggregate the models.
        ``"sketch"``: FetchSGD (Rothchild et al. 2020) with server-side error feedback
        (:class:`fedcomp.server_feedback.ServerFeedback`), for upload codecs whose reducer is
        linear, quantizer allowed, e.g. ``sketch(rows=1, cols=16000, ratio=0.01)+qsgd(bits=4)``:
        each reply's tables are dequantized and added to a float64 running sum as it arrives
        (weighted by ``num-examples``), the server keeps momentum and error accumulation in
        sketch space, applies the top-k heavy hitters of the accumulated error, and zeroes
        momentum and error at the cells those coordinates hash to. Clients keep no residual
        (error feedback is server side, so it holds when each client takes part rarely); the
        inner strategy still samples clients, but its aggregation is not used. Running
        statistics (``exact_statistics``) travel exact beside the sketch and are averaged,
        integer buffers advance by the clients' rounded mean increment. Does not combine with
        budgets (clients' sketches would differ in ``cols``).
    server_momentum : float (default: 0.0)
        FetchSGD's momentum rho in sketch space (``aggregation="sketch"`` only).
    delta : float (default: 0.0)
        Delta coding of uploads: a client encodes ``update - delta * previous`` where
        ``previous`` is the update the server reconstructed from that client's last reply, and
        the server adds ``delta * previous`` back. Consecutive updates of a client correlate
        (digits: cosine 0.4-0.8), so the coded vector is smaller. Client and server check that
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
        examples weighs at most ``weight_factor`` median clients; logged per reply (digits, 10
        clients, two declaring 1e12, 5 rounds: 66.1% at 2, 62.8% at 3, 36.4% trusted; 65.8%
        with the two dropped). Honest clients above it count at the cap: raise it where partitions
        are that uneven. 0 trusts declared weights (for deployments that authenticate them).
    max_failed_rounds : int (default: 3)
        Stop the run (:class:`NoUsableReplies`, naming the clients' errors) after this many
        consecutive rounds in which no reply reached the aggregate.
    compress_evaluate : bool (default: True)
        Federated evaluation messages go through the tiers' references to clients whose mod
        announced it handles them (a chain instead of the model); others get the dense model.
        Either way they are counted in :class:`RoundStats`.
    config : CompressionConfig, optional
        All of the above as one frozen object (instead of keyword arguments).
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


    def __init__(self, inner: Strategy, config: CompressionConfig | None = None, **settings) -> None:
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
        # 'auto' specs: provisional from the inner strategy's fraction_train until the first
        # training round, which knows the nodes sampled, the nodes connected and the model's size
        self.sparse_averse = sparse_averse(inner)
        self._upload_set = False  # set_upload was called (AdaptiveStrategy): no regime resolution of the upload
        self._use(config.resolve(partial=float(getattr(inner, "fraction_train", 1.0)) < 1, sparse_averse=self.sparse_averse))
        if not config.auto:
            self._warn_biased()
        self._warn_sparse_averse()
        self.feedback: ServerFeedback | None = None  # aggregation 'sketch': built with the model's layout
        self.rounds: dict[int, RoundStats] = {}
        # per node, across rounds
        self._held: dict[int, tuple[int, int, int]] = {}  # node -> (tier, version, crc) it reported
        self._aggregated: dict[int, int] = {}  # node -> round of its last reply that reached the aggregate
        self._want: dict[int, int] = {}  # node -> the tier it asked for
        self._capable: set[int] = set()  # nodes whose mod handles evaluate broadcasts
        self._history = ReplyHistory()  # delta references, used nonces
        self._unseeded: set[int] = set()  # nodes that asked for a resync: no seeded round-0 assumption
        # per round
        self._round_state: _RoundState | None = None
        self._base: dict[str, torch.Tensor] = {}  # the global model of this round: model_i = base + update_i
        self._layout: fedcomp.Layout | None = None
        self._statistics_layout: fedcomp.Layout | None = None  # set when running statistics travel exact
        self._accumulator: Accumulator | None = None  # reused across rounds while the layout holds
        self._dense_model_bytes = 0
        self._sent: dict[int, list[int]] = {}  # round -> nodes sent a train message (to record who never replied)
        self._unattributed: dict[int, list[str]] = {}  # round -> reasons of errors from nodes not messaged
        self._failed_rounds: list[int] = []  # consecutive rounds without a usable reply
        self._restarted: set[tuple[int, int]] = set()  # (tier, version): started from the model after a failed encode
        self._guard_history = GuardHistory()  # the norms and weights the last aggregated round accepted
        self._tokens: dict[int, dict[int, int]] = {}  # round -> node -> reply token sent with its train message
        self._previous_ack: dict[int, int] = {}  # node -> its ack before this round's (a reply revoked at the end)
        self._bounds: dict[tuple, tuple[int, int]] = {}  # (upload spec, layout) -> (payload bytes, dense bytes) allowed
        self._state_guard: StateGuard | None = None  # per layout: running statistics and integer buffers
        self._aggregated_rounds = 0

    def _use(self, config: CompressionConfig) -> None:
        """Take a concrete config: codecs, aggregation, tiers (before any round)."""
        self.config = config
        self.upload = fedcomp.build_codec(config.upload)
        self.aggregation = config.resolved_aggregation
        self.error_feedback = config.client_error_feedback
        self.tiers = [Tier(i, spec, config.download_max_stale or None)
                      for i, spec in enumerate(parse_tiers(config.download))]
        self.tier_kbps = ",".join(str(v) for v in parse_thresholds(config.download_tier_kbps, len(self.tiers)))

    def _resolve(self, sampled: int, connected: int, arrays: ArrayRecord) -> None:
        """Pick 'auto' specs, and an explicit upload's cross-device defaults, from the regime at the first
        training round (CompressionConfig.resolve)."""
        regime = self.requested.regime_dependent and not self._upload_set
        if self._layout is not None or not (self.requested.auto or regime):
            return
        state = arrays.to_torch_state_dict()
        numel = sum(int(v.numel()) for v in state.values() if v.is_floating_point())
        partial = sampled < connected
        statistics = bool(split_kinds(state)[STATISTIC])
        self._use(self.requested.resolve(partial=partial, numel=numel, sparse_averse=self.sparse_averse,
                                         statistics=statistics))
        if self.requested.auto:
            self._warn_biased()
        log(INFO, "fedcomp: %s (%d of %d nodes per round, %d parameters): upload %s, download %s, aggregation %s",
            "cross-device" if partial else "cross-silo", sampled, connected, numel, self.upload.spec,
            " | ".join(t.codec.spec for t in self.tiers), self.aggregation)

    def _warn_sparse_averse(self) -> None:
        """A robust, per-client or per-coordinate strategy given an upload that defeats it (measured in
        config.py's docstring)."""
        if not self.sparse_averse or self.config.upload == DENSE_UPLOAD:
            return
        reducer = getattr(self.upload, "reducer", None)
        if self.aggregation == "sketch":
            log(WARNING, "fedcomp: %s has its own aggregation, but aggregation='sketch' "
                "(FetchSGD) replaces its aggregation with a sum of sketches; use upload='%s' (or 'auto') to keep it",
                type(self.inner).__name__, DENSE_UPLOAD)
        elif reducer is not None and getattr(reducer, "sparse", False):
            log(WARNING, "fedcomp: %s looks at each client's update or at each coordinate on its own; sparse "
                "uploads (%s) defeat it (measured with topk(ratio=0.01)+qsgd(bits=4): FedMedian -59.6 points on "
                "digits, FedAdam -17.9 on an MNIST CNN; with %s within 1.3 points): use upload='%s' (or 'auto')",
                type(self.inner).__name__, self.upload.spec, DENSE_UPLOAD, DENSE_UPLOAD)

    def _warn_stale_residuals(self, sampled: int, connected: int) -> None:
        """A biased upload that relies on state kept on each client, at a setting that did not hold
        in a run where each client takes part now and then (measured in ``results/families``;
        the codecs' cross-device defaults are the settings that held)."""
        reducer = getattr(self.upload, "reducer", None)
        quantizer = getattr(self.upload, "quantizer", None)
        config = getattr(reducer, "config", None)
        ratio, rank = getattr(config, "ratio", 0.0), getattr(config, "rank", XDEV_RANK)
        failed = ((reducer is not None and not reducer.linear and (0 < ratio < XDEV_SHARE or rank < XDEV_RANK))
                  or (getattr(quantizer, "name", "") == "sign" and quantizer.config.scale == "mean"))
        if (self.requested.upload == AUTO or sampled >= connected or self.aggregation != "decode"
                or not failed or not self.upload.needs_error_feedback or not self.error_feedback):
            return
        log(WARNING, "fedcomp: upload %s relies on state kept on each client (residual, momentum, warm start), "
            "but %d of %d nodes take part per round: that state is stale when its client is sampled again, and "
            "this setting lost to dense (mnist cnn-bn, 100 clients at 10%%, 30 rounds: topk(ratio=0.01) -5.7 points "
            "over 3 seeds, dgc(ratio=0.01) -5.6 over 3, powersgd(rank=4) -3.0 over 5, sign(scale='mean') -3.7 over 5). "
            "Leave the argument out for the codec's cross-device default (topk/dgc ratio 0.1, powersgd rank 8, "
            "sign scale 'rms', all within 2 points), or use upload='auto'", self.upload.spec, sampled, connected)

    def _warn_biased(self) -> None:
        if self.upload.needs_error_feedback and not self.error_feedback and self.aggregation == "decode":
            log(WARNING, "fedcomp: upload codec %s is biased; without error feedback it may not converge",
                self.upload.spec)

    # settings read by the project's app and tests
    seed = property(lambda self: self.config.seed)
    delta = property(lambda self: self.config.delta)
    streaming = property(lambda self: self.config.streaming)
    max_update_norm = property(lambda self: self.config.max_update_norm)
    link_profile = property(lambda self: self.config.link_profile)
    round_deadline_s = property(lambda self: self.config.round_deadline_s)
    budget_fallback = property(lambda self: self.config.budget_fallback)
    server_momentum = property(lambda self: self.config.server_momentum)

    def summary(self) -> None:
        if self.requested.auto and self._layout is None:
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
        self._sent[server_round] = [m.metadata.dst_node_id for m in messages]
        if not messages:
            return messages
        if self._layout is None:
            connected = len(list(grid.get_node_ids()))
            self._resolve(len(messages), connected, arrays)
            self._warn_stale_residuals(len(messages), connected)
        model = self._set_model(arrays)
        nodes = [msg.metadata.dst_node_id for msg in messages]
        tier_of = {node: self._want.get(node, 0) for node in nodes}
        for tier in sorted(set(tier_of.values())):  # one encode per tier with clients this round
            stats.encodes += self._step_tier(self.tiers[tier], model, server_round)
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            array_keys = list(msg.content.array_records)
            if len(array_keys) != 1:
                raise ValueError(f"CompressedStrategy expects one ArrayRecord per train message, got {array_keys}")
            tier = self.tiers[tier_of[node]]
            plan = tier.plan(self._holds(node, tier))
            dense_bytes = message_bytes(msg.content)
            content = RecordDict({k: v for k, v in msg.content.items() if k != array_keys[0]})
            content[P.DOWNLOAD_RECORD] = ConfigRecord({
                **self._plan_fields(plan, tier, server_round, array_keys[0]),
                P.UPLOAD_SPEC: self.upload.spec,
                P.ERROR_FEEDBACK: self.error_feedback,
                P.DELTA: self.config.delta,
                P.DELTA_REF: self._history.last.get(node, (0, None))[0] if self.config.delta else 0,
                P.ACK_ROUND: self._aggregated.get(node, 0),
                P.LINK_PROFILE: self.config.link_profile,
                P.DEADLINE: self.config.round_deadline_s,
                P.FALLBACK: self.config.budget_fallback,
                REPLY_TOKEN: self._issue_token(server_round, node),
            })
            nbytes = message_bytes(content)
            stats.download_bytes += nbytes
            stats.download_bytes_dense += dense_bytes
            stats.download_bytes_by_tier[plan.tier] = stats.download_bytes_by_tier.get(plan.tier, 0) + nbytes
            stats.downloads.append({"node": node, "tier": plan.tier, "mode": plan.mode, "steps": len(plan.rounds),
                                    "download_bytes": nbytes})
            out.append(Message(content=content, dst_node_id=node,
                               message_type=msg.metadata.message_type, group_id=msg.metadata.group_id))
            state = self._state(server_round)
            state.arrays_key, state.message_type = array_keys[0], msg.metadata.message_type
        return out

    def _issue_token(self, server_round: int, node: int) -> int:
        """A fresh random token for this node's train message (:data:`fedcomp.wire.REPLY_TOKEN`): its
        reply must carry the tag binding its payload to it."""
        tokens = self._tokens.setdefault(server_round, {})
        tokens[node] = secrets.randbits(TOKEN_BITS)
        return tokens[node]

    def _upload_limit(self, record: dict) -> int | None:
        """Payload bytes a reply may have: the configured upload's size on this model (its bound
        where the size depends on the data), or the budget a client with a link reported, never more
        than a dense payload (:func:`fedcomp.strategies.guards.upload_bound`)."""
        if self._layout is None:
            return None
        key = (self.upload.spec, self._layout)
        if key not in self._bounds:
            self._bounds[key] = upload_bound(self.upload.spec, self._layout)
        limit, dense = self._bounds[key]
        budget = record.get(P.BUDGET)
        if P.LINK in record and isinstance(budget, int) and not isinstance(budget, bool) and budget > limit:
            limit = min(budget, dense)
        return limit

    def _set_model(self, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
        model = dict(arrays.to_torch_state_dict())
        layout = fedcomp.Layout.of(model)
        if layout != self._layout:
            self._accumulator = None
            self._guard_history.clear()  # norms of another model say nothing about this one's
            guard = StateGuard(layout, Accumulator.offsets(layout))
            self._state_guard = guard if guard.active else None
            self._exact_statistics(layout)
            if self.aggregation == "sketch":  # server-side error feedback: tables per segment of this layout
                self.feedback = ServerFeedback(self.upload, layout, self.config.server_momentum)
        self._layout = layout
        self._base = {k: v.detach().cpu() for k, v in model.items()}
        self._dense_model_bytes = message_bytes(ArrayRecord(self._base))
        for tier in self.tiers:
            if tier.reference is None:  # all tiers start from the same model: early tier changes are cheap
                tier.start(model)
        return model

    def _exact_statistics(self, layout: fedcomp.Layout) -> None:
        """Send the model's running statistics (BatchNorm's ``running_mean``/``running_var``) exact:
        compressed like weights, with error feedback, they drift and a variance goes negative
        (measured: ``python -m fedcomp.simulations.task_runs bn-check``). The upload and every lossy
        download tier get ``name~*running_*: none();`` rules in front, before any tier has encoded.
        With FetchSGD (``aggregation="sketch"``) they travel beside the sketch and are averaged
        exactly (:class:`fedcomp.server_feedback.ServerFeedback`)."""
        if not self.config.exact_statistics or not split_kinds(layout)[STATISTIC]:
            return
        if self.config.link_profile != links.NONE:
            log(WARNING, "fedcomp: the model has running statistics (BatchNorm), compressed like weights here "
                "(byte budgets need a plain spec); a negative variance is possible: prefer no link budgets for it")
            return
        self._statistics_layout = layout
        self.set_upload(self.upload.spec)
        for tier in self.tiers:
            if tier.reference is None and not tier.codec.lossless:
                tier.codec = fedcomp.build_codec(exact_state_policy(tier.codec.spec, layout))
        log(INFO, "fedcomp: running statistics travel exact; upload %s", self.upload.spec)

    def set_upload(self, spec: str) -> None:
        """Use ``spec`` for the uploads of the rounds configured from now on (``AdaptiveStrategy``
        sets each round's spec this way); running statistics stay exact as for the configured spec."""
        codec = fedcomp.build_codec(spec)
        self._upload_set = True  # the caller owns the upload now: the round-1 regime resolution keeps it
        if self._statistics_layout is not None and not codec.lossless:
            codec = fedcomp.build_codec(exact_state_policy(spec, self._statistics_layout))
        self.upload = codec

    def _step_tier(self, tier: Tier, model: dict[str, torch.Tensor], version: int) -> int:
        """Move a tier's reference to ``version`` (once: federated evaluation may have done it).

        An encode that fails (a codec bug) costs this round's compression, not the run: the tier
        restarts from the model itself, so its clients get the full model this round (logged with
        the reason), and steps again from there next round."""
        if tier.version >= version and tier.history and tier.history[-1].round == version:
            return 0
        if (tier.index, version) in self._restarted:
            return 0
        try:
            tier.step(model, version, self.config.seed)
        except Exception as exc:  # noqa: BLE001 - contained: the run goes on with the full model
            log(WARNING, "fedcomp: download tier %s could not encode its step to round %s with %r (%s: %s); its "
                "clients get the full model this round", tier.index, version, tier.codec.spec, type(exc).__name__, exc)
            tier.state = {}  # the codec state (warm start) may be half updated
            tier.start(model, version)
            self._restarted.add((tier.index, version))
            return 0
        return 1

    def _holds(self, node: int, tier: Tier) -> tuple[int, int, int] | None:
        """The reference a node holds: what it reported; for a node never heard from, with
        ``seeded_init``, the round-0 model every node builds from the seed (a node that asked for
        a resync gets no such assumption: it gets the full model)."""
        held = self._held.get(node)
        if held is None and self.config.seeded_init and node not in self._unseeded:
            return tier.seeded()
        return held

    def _plan_fields(self, plan, tier: Tier, server_round: int, arrays_key: str) -> dict:
        return {
            P.SEEDED_INIT: self.config.seeded_init,
            P.MODE: plan.mode, P.PAYLOADS: list(plan.payloads), P.ROUNDS: list(plan.rounds),
            P.BASE_CRC: plan.base_crc, P.REF_CRC: plan.crc, P.TIER: plan.tier, P.TIERS: len(self.tiers),
            P.TIER_KBPS: self.tier_kbps, P.LAYOUT: self._layout.to_json(), P.DOWNLOAD_SPEC: tier.codec.spec,
            P.SEED: self.config.seed, P.ROUND: server_round, P.ARRAYS_KEY: arrays_key,
        }

    # -- training: replies --------------------------------------------------------------------
    def start(self, grid: Grid, *args, **kwargs):
        """Flower's round loop, with replies handled as they arrive (:mod:`fedcomp.strategies.streaming`).

        Raises :class:`MissingCompressionMod` or :class:`NoUsableReplies` instead of returning a
        model no reply ever reached.
        """
        if self.config.streaming:
            grid = StreamingGrid(grid, self._on_reply)
        result = super().start(grid, *args, **kwargs)
        if self.rounds and not self._aggregated_rounds:
            last = self.rounds[max(self.rounds)]
            raise NoUsableReplies(
                f"fedcomp: no reply reached the aggregate in any of the run's {len(self.rounds)} rounds; the model is "
                f"the initial one. Last round: {summarize([c['status'] for c in last.clients]) or 'no replies'}")
        return result

    def _on_reply(self, msg: Message) -> None:
        if self._round_state is not None and msg.metadata.message_type == self._round_state.message_type:
            self._receive(self._round_state.round, msg)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        state = self._state(server_round)
        # those not streamed in already, in a fixed order (streamed ones need no payload hash)
        for msg in sorted((m for m in replies if id(m) not in state.seen), key=canonical_order):
            self._receive(server_round, msg)
        self._round_state = None
        self._tokens.pop(server_round, None)
        stats = self.rounds.setdefault(server_round, RoundStats())
        replied = {c["node"] for c in stats.clients}
        missing = [node for node in self._sent.pop(server_round, []) if node not in replied]
        unattributed = self._unattributed.pop(server_round, [])
        for node in missing:  # Flower hands over only what arrived before the round's timeout
            reason = f" ({unattributed[0]})" if len(missing) == len(unattributed) == 1 else ""
            stats.clients.append({"node": node, "status": f"no reply: timed out or node unavailable{reason}"})
        if stats.links:
            stats.sim_time_s, _ = links.round_time({t["node"]: t["total_s"] for t in stats.links},
                                                   {t["node"]: t["deadline_s"] for t in stats.links})
        handler = state.replies
        stats.aggregated = handler.finish() if handler is not None else 0
        self._check_wrapped(server_round, state, stats)
        if not stats.aggregated:
            return self._failed_round(server_round, stats, handler)
        self._failed_rounds.clear()
        self._aggregated_rounds += 1
        if handler.mode == "sketch":
            arrays, metrics = ArrayRecord(self._sketch_step(server_round)), self._aggregate_metrics(handler.metrics)
        elif handler.mode == "collect":
            arrays, metrics = self.inner.aggregate_train(server_round, handler.collected + state.errors)
            arrays = self._as_layout(arrays)
        else:
            arrays, metrics = self._finish_mean(server_round, state)
        self._check_finite(server_round, arrays, stats)
        return arrays, metrics

    def _sketch_step(self, server_round: int) -> dict[str, torch.Tensor]:
        """The new model from the server-side error feedback. With ``coupled_download`` the step is
        encoded once with tier 0's codec, the model moves by exactly what that payload decodes to
        (what the download dropped goes back into the error table), and the payload is tier 0's
        step to the next round as is: its reference is the global model."""
        tier = self.tiers[0]
        if not self.config.coupled_download or tier.reference is None or tier.crc != reference_crc(self._base):
            if self.config.coupled_download:
                log(WARNING, "fedcomp: tier 0's reference is not the global model in round %s; its step is encoded "
                    "apart this round", server_round)
            return apply_step(self._base, self.feedback.step())
        try:
            sent, payload = self.feedback.step_broadcast(
                tier.codec, nonce=derive_nonce(self.config.seed, server_round + 1, -1), round=server_round + 1)
        except BroadcastFailed as exc:  # the step applies uncompressed; tier 0 restarts from the model
            log(WARNING, "fedcomp: round %s's coupled download step failed (%s); the step applies as computed and "
                "tier 0's clients get the full model next round", server_round, exc)
            model = apply_step(self._base, exc.step)
            tier.state = {}
            tier.start(model, server_round + 1)
            self._restarted.add((tier.index, server_round + 1))
            return model
        model = apply_step(self._base, sent)
        tier.append(model, server_round + 1, payload)
        return model

    def _check_finite(self, server_round: int, arrays: ArrayRecord | None, stats: RoundStats) -> None:
        """Stop the run when the new global model has NaN or Inf values (every reply is checked,
        but a finite sum can still overflow or a server step diverge): training on from it would
        finish at chance with nothing said."""
        if arrays is None:
            return
        state = arrays.to_torch_state_dict()
        bad = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        negative = [name for name in split_kinds(state)[STATISTIC]
                    if name.endswith("running_var") and bool((state[name] < 0).any())]
        if negative:  # BatchNorm takes the square root: NaN activations from here on, at chance
            raise NonFiniteModel(
                f"fedcomp: the global model of round {server_round} has a negative running variance in "
                f"{negative[:5]} (aggregation {self.aggregation!r}, upload {self.upload.spec!r}); the run stops. "
                + (f"The statistics travelled exact: the inner strategy {type(self.inner).__name__}'s own "
                   f"aggregation of them made it negative" if self._statistics_layout is not None else
                   "Keep exact_statistics=True (the default) and no link budgets for a BatchNorm model"))
        if bad:
            raise NonFiniteModel(
                f"fedcomp: the global model of round {server_round} has NaN or Inf values in {bad[:5]}"
                f"{' and more' if len(bad) > 5 else ''} (aggregation {self.aggregation!r}, upload "
                f"{self.upload.spec!r}, {stats.aggregated} replies aggregated); the run stops. Lower the "
                f"learning rate, set max_update_norm, or use a larger sketch (cols) / more bits")

    def _check_wrapped(self, server_round: int, state: _RoundState, stats: RoundStats) -> None:
        """A round with replies but not one fedcomp payload record: the clients lack compression_mod."""
        if state.replies is not None and state.replies.payloads:
            return
        errors = [m.error.reason or "" for m in state.errors]
        key = state.arrays_key or "arrays"
        # without the mod the model never reaches the user's code: it fails looking the record up
        looks_unwrapped = state.unwrapped > 0 or (errors and all("KeyError" in e and f"'{key}'" in e for e in errors))
        if not looks_unwrapped:
            return
        raise MissingCompressionMod(
            f"fedcomp: no reply of round {server_round} carries a fedcomp payload ('{P.UPLOAD_RECORD}' record): the "
            f"ClientApp does not use compression_mod. CompressedStrategy sends the model compressed, and only "
            f"compression_mod turns it back into the '{key}' ArrayRecord your train function reads and compresses "
            f"the reply. Add it to the ClientApp: `from fedcomp.clients import compression_mod`, then "
            f"`app = ClientApp(mods=[compression_mod])`. Replies: {summarize([c['status'] for c in stats.clients])}")

    def _failed_round(self, server_round: int, stats: RoundStats, handler) -> tuple[None, None]:
        if self.feedback is not None:
            self.feedback.discard_round()
        self._failed_rounds.append(server_round)
        statuses = [c["status"] for c in stats.clients]
        log(WARNING, "fedcomp: no usable replies in round %s (%d of %d consecutive rounds allowed): %s", server_round,
            len(self._failed_rounds), self.config.max_failed_rounds, summarize(statuses) or "no replies")
        if len(self._failed_rounds) >= self.config.max_failed_rounds:
            first = self._failed_rounds[0]
            raise NoUsableReplies(
                f"fedcomp: {len(self._failed_rounds)} consecutive rounds ({first}-{server_round}) without a usable "
                f"reply; the model has not changed since round {first - 1}. Round {server_round}'s clients: "
                f"{summarize(statuses) or 'no replies (no node sampled or all timed out)'}. "
                f"(max_failed_rounds={self.config.max_failed_rounds}; raise it to tolerate longer outages)")
        return None, None

    def _state(self, server_round: int) -> _RoundState:
        if self._round_state is None or self._round_state.round != server_round:
            self._round_state = _RoundState(server_round, self._new_replies(server_round))
        return self._round_state

    def _new_replies(self, server_round: int) -> RoundReplies | None:
        if self._layout is None:
            return None
        if self.aggregation == "sketch":
            mode = "sketch"
        else:
            mode = "mean" if can_stream(self.inner) else "collect"
        if self._accumulator is None:
            self._accumulator = Accumulator(self.upload, self._layout)
        else:
            self._accumulator.reset()
        sent = len(self._sent.get(server_round, ()))
        if self._guard_history.spec != self.upload.spec:  # another codec's norms (AdaptiveStrategy) say nothing
            self._guard_history.clear()
            self._guard_history.spec = self.upload.spec
        guard = RoundGuard(self.config.norm_factor, self.config.max_update_norm, self.config.norm_warmup,
                           self.config.weight_factor, quorum=sent, history=self._guard_history)
        return RoundReplies(
            round=server_round, mode=mode, layout=self._layout, base=self._base, accumulator=self._accumulator,
            feedback=self.feedback, guard=guard,
            config=self.config, upload=self.upload, weight_key=self._weight_key(), history=self._history,
            on_accept=self._accepted(server_round), dense_model_bytes=self._dense_model_bytes,
            tokens=self._tokens.setdefault(server_round, {}), upload_limit=self._upload_limit,
            state_guard=self._state_guard, on_revoke=self._revoke)

    def _accepted(self, server_round: int):
        def note(node: int, entry: dict, dense_bytes: int) -> None:
            self._previous_ack[node] = self._aggregated.get(node, 0)
            self._aggregated[node] = server_round  # acknowledged in its next broadcast
            self.rounds.setdefault(server_round, RoundStats()).upload_bytes_dense += dense_bytes
        return note

    def _revoke(self, node: int) -> None:
        """An accepted reply left out at the end of the round after all: not acknowledged."""
        self._aggregated[node] = self._previous_ack.get(node, 0)

    def _receive(self, server_round: int, msg: Message) -> None:
        """Count one reply, note what it says about the client's reference and link, and hand it
        to the round's reply handler (once per reply)."""
        state = self._state(server_round)
        if id(msg) in state.seen:  # the grid streamed it in; Flower's loop passes it again
            return
        state.seen[id(msg)] = msg
        stats = self.rounds.setdefault(server_round, RoundStats())
        node = msg.metadata.src_node_id
        if msg.has_error():
            if node in state.replied:
                return  # one reply per node per message; an error after its reply changes nothing
            state.errors.append(msg)
            if node not in self._sent.get(server_round, (node,)):  # made by the SuperLink for a dead node
                self._unattributed.setdefault(server_round, []).append(msg.error.reason)
                return
            state.replied.add(node)
            stats.clients.append({"node": node, "status": f"error: {msg.error.reason}"})
            return
        wire = message_bytes(msg.content)
        entry = {"node": node, "upload_bytes": wire, "status": "ok"}
        stats.upload_bytes += wire
        sent = self._sent.get(server_round)
        foreign = sent is not None and node not in sent
        if foreign or node in state.replied:
            reason = (f"node {node} was sent no train message in round {server_round}" if foreign else
                      f"a second reply from node {node} in round {server_round} (one reply per node per message)")
            entry["status"] = f"dropped: {reason}"
            stats.extra.append(entry)
            log(WARNING, "fedcomp: dropping reply of node %s in round %s: %s", node, server_round, reason)
            return
        state.replied.add(node)
        stats.clients.append(entry)
        record = msg.content.config_records.get(P.UPLOAD_RECORD)
        if record is None:
            state.unwrapped += 1
            entry["status"] = (f"dropped: reply has no {P.UPLOAD_RECORD!r} record (is compression_mod installed "
                               f"on the client?)")
            return
        caps = record.get(P.CAPABILITIES)
        if isinstance(caps, list) and P.EVALUATE_CAPABILITY in caps:
            self._capable.add(node)
        sent = next((d["download_bytes"] for d in stats.downloads if d["node"] == node), 0)
        timing = self._timing(msg.content, node, wire, sent)
        if timing is not None:
            stats.links.append(timing)
        resync = self._track_reference(msg.content, node)
        if timing is not None and (timing["late"] or timing["status"] == "too-small-skipped") and resync is None:
            entry["status"] = "late" if timing["late"] else timing["status"]
            return
        if resync is not None:
            entry["status"] = f"resync: {resync}"
            log(WARNING, "fedcomp: node %s asked for a full model in round %s: %s", node, server_round, resync)
            return
        unknown = self._unknown_reference(msg.content)
        if unknown is not None:  # it trained from a model this server never sent: its update is not one of ours
            entry["status"] = f"dropped: {unknown}"
            log(WARNING, "fedcomp: dropping reply of node %s in round %s: %s", node, server_round, unknown)
            return
        if state.replies is None:
            entry["status"] = "dropped: reply arrived before any broadcast"
            return
        state.replies.handle(msg, entry)

    def _weight_key(self) -> str:
        return getattr(self.inner, "weighted_by_key", "num-examples")

    def _aggregate_metrics(self, records: list[RecordDict]) -> MetricRecord | None:
        """The inner strategy's metric aggregate of the aggregated replies' checked metrics (one
        schema, weights as counted); a function that fails anyway costs the round's metrics only."""
        aggr = getattr(self.inner, "train_metrics_aggr_fn", None)
        if aggr is None or not records:
            return None
        try:
            return aggr(records, self._weight_key())
        except Exception as exc:  # noqa: BLE001 - the user's function: the model is aggregated already
            log(WARNING, "fedcomp: the train metrics aggregation failed (%s: %s); this round has no train metrics",
                type(exc).__name__, exc)
            return None

    def _finish_mean(self, server_round: int, state: _RoundState) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The weighted mean model; strategies that step from it (FedAvgM, FedAdam...) get one
        reply holding it, of the total weight. Metrics: the inner strategy's aggregate of every
        aggregated reply's metrics."""
        acc = state.replies.accumulator
        total = acc.total_weight
        model = acc.apply_mean(self._base)
        metrics = self._aggregate_metrics(state.replies.metrics)
        log(INFO, "fedcomp: round %s aggregated %d replies", server_round, state.replies.count_aggregated())
        if type(self.inner) in _MEAN_IS_THE_MODEL:  # FedAvg of one reply is that reply: skip its copies
            return ArrayRecord(model), metrics
        key = self._weight_key()
        merged = Message(RecordDict({state.arrays_key or "arrays": ArrayRecord(model),
                                     "metrics": MetricRecord({key: total})}),
                         dst_node_id=0, message_type="train")
        # statistics and counters are the mean: the inner strategy's server step (FedAvgM's momentum,
        # FedAdam's normalisation) is for weights; on running_var it goes negative (fedcomp.tensor_kinds)
        exact = {name: model[name] for name in self._statistics_names()}
        del model
        arrays, _ = self.inner.aggregate_train(server_round, [merged])
        return self._as_layout(arrays, exact), metrics

    def _statistics_names(self) -> list[str]:
        """Entries that keep the clients' mean after a server step: running statistics and counters,
        while ``exact_statistics`` is on and the model has statistics."""
        if self._statistics_layout is None:
            return []
        kinds = split_kinds(self._statistics_layout)
        return kinds[STATISTIC] + kinds[COUNTER]

    def _as_layout(self, arrays: ArrayRecord | None,
                   exact: dict[str, torch.Tensor] | None = None) -> ArrayRecord | None:
        """The aggregate in the model's dtypes (FedAvg turns integer buffers into float64), so
        the broadcast references keep one layout; entries in ``exact`` replace the aggregate's."""
        if arrays is None or self._layout is None:
            return arrays
        model = arrays.to_torch_state_dict()
        if set(model) != set(self._layout.names):  # not the model's entries: left as the strategy made it
            return ArrayRecord({**model, **exact}) if exact else arrays
        model.update(exact or {})
        if fedcomp.Layout.of(model) == self._layout and not exact:
            return arrays
        dtypes = {t.name: t.torch_dtype for t in self._layout.tensors}
        return ArrayRecord({k: v.round().to(dtypes[k]) if v.is_floating_point() and not dtypes[k].is_floating_point
                            else v.to(dtypes[k]) for k, v in model.items()})

    def _timing(self, content: RecordDict, node: int, wire: int, download_bytes: int) -> dict | None:
        """Simulated times of one reply whose client reported a link (None: no link reported).

        download = the bytes this node was sent / downlink + latency; compute as measured by
        the client (decode, training, encode); upload = the reply's bytes / uplink + latency.
        Status: ``too-small-skipped`` / ``too-small-coarsest`` as the client reported, else
        ``over-budget`` or ``ok``; ``late``: past the client's deadline (dropped at it).
        """
        record = content.config_records.get(P.UPLOAD_RECORD)
        if record is None or P.LINK not in record:
            return None
        try:
            text = str(record[P.LINK])
            link = links.link_from_mapping(dict(kv.split("=", 1) for kv in text.split()), f"node {node}'s link")
            budget = int(record.get(P.BUDGET, -1))
            compute_s = float(record.get(P.COMPUTE_S, 0.0))
        except (ValueError, TypeError) as exc:
            log(WARNING, "fedcomp: node %s reported a link the server cannot read (%s); no simulated time", node, exc)
            return None
        if link is None:
            return None
        t = links.client_time(link, download_bytes, wire, compute_s)
        budget = None if budget < 0 else budget
        status = str(record.get(P.BUDGET_STATUS, "ok"))
        if status == "ok" and budget is not None and wire > budget:
            status = "over-budget"  # the client reported a fit that the server counts larger: never silent
        late = link.deadline_s is not None and t.total_s > link.deadline_s
        if status != "ok":
            log(WARNING, "fedcomp: node %s upload %s B, budget %s B: %s %s", node, wire, budget, status,
                record.get(P.BUDGET_REASON, ""))
        return {
            "node": node, "link": text, "spec": str(record.get(P.SPEC, "")), "status": status, "late": late,
            "upload_bytes": wire, "budget": budget, "download_bytes": download_bytes,
            "download_bytes_seen": int(record.get(P.DOWNLOAD_SEEN, -1)),
            "download_s": t.download_s, "compute_s": t.compute_s, "upload_s": t.upload_s, "total_s": t.total_s,
            "deadline_s": link.deadline_s,
        }

    def _track_reference(self, content: RecordDict, node: int) -> str | None:
        """Note the tier, version and CRC of the broadcast reference a reply reports.

        Returns the client's reason when it asked for a resync. A report the server cannot
        confirm (another CRC, a version out of history) also means a full model next time.
        """
        record = content.config_records.get(P.UPLOAD_RECORD)
        if record is None:
            return None
        want = record.get(P.WANT_TIER)
        if isinstance(want, int) and 0 <= want < len(self.tiers):
            self._want[node] = want
        if P.RESYNC in record:
            self._held.pop(node, None)
            self._unseeded.add(node)  # it could not use the seeded model (or lost its state): full next time
            return str(record[P.RESYNC])
        try:
            held = (int(record[P.TIER]), int(record[P.REF_VERSION]), int(record[P.REF_CRC]))
        except (KeyError, TypeError, ValueError):
            self._held.pop(node, None)
            return None
        if self._known(held):
            self._held[node] = held
        else:
            self._held.pop(node, None)
            log(WARNING, "fedcomp: node %s reports a reference the server does not know %s; full model next time",
                node, held)
        return None

    def _known(self, held: tuple[int, int, int]) -> bool:
        return 0 <= held[0] < len(self.tiers) and self.tiers[held[0]].verify(held[1], held[2])

    def _unknown_reference(self, content: RecordDict) -> str | None:
        """The reason to drop a train reply whose payload was built on a reference (tier, version,
        CRC) the server never sent; None when the server knows it (or the reply reports none)."""
        record = content.config_records.get(P.UPLOAD_RECORD)
        if record is None or P.PAYLOAD not in record:
            return None
        try:
            held = (int(record[P.TIER]), int(record[P.REF_VERSION]), int(record[P.REF_CRC]))
        except (KeyError, TypeError, ValueError, OverflowError):
            return ("reply reports no readable reference (tier, version, CRC): its update cannot be placed on a "
                    "model the server sent")
        if self._known(held):
            return None
        return (f"reply was trained from a reference the server never sent (tier {held[0]}, version {held[1]}, CRC "
                f"{held[2]:#010x}): a forged or corrupted broadcast; the node gets the full model next time")

    # -- federated evaluation: through the tiers' references, counted -------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The inner strategy's evaluate messages; a client whose mod handles evaluate broadcasts
        gets its tier's next reference (what it will train from next round: one encode per tier,
        reused by the next training round) as a chain or in full instead of the model."""
        messages = list(self.inner.configure_evaluate(server_round, arrays, config, grid))
        if not messages:
            return messages
        stats = self.rounds.setdefault(server_round, RoundStats())
        model = dict(arrays.to_torch_state_dict())
        compressible = (self.config.compress_evaluate and self._layout is not None
                        and fedcomp.Layout.of(model) == self._layout)
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            dense_bytes = message_bytes(msg.content)
            array_keys = list(msg.content.array_records)
            mode = "dense"
            if compressible and node in self._capable and len(array_keys) == 1:
                tier = self.tiers[self._want.get(node, 0)]
                stats.encodes += self._step_tier(tier, model, server_round + 1)
                plan = tier.plan(self._holds(node, tier))
                content = RecordDict({k: v for k, v in msg.content.items() if k != array_keys[0]})
                content[P.DOWNLOAD_RECORD] = ConfigRecord({
                    **self._plan_fields(plan, tier, server_round + 1, array_keys[0]), P.KIND: "evaluate"})
                msg = Message(content=content, dst_node_id=node, message_type=msg.metadata.message_type,
                              group_id=msg.metadata.group_id)
                mode = plan.mode
            nbytes = message_bytes(msg.content)
            stats.evaluate_download_bytes += nbytes
            stats.evaluate_download_bytes_dense += dense_bytes
            stats.evaluate_clients.append({"node": node, "mode": mode, "download_bytes": nbytes})
            out.append(msg)
        return out

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        stats = self.rounds.setdefault(server_round, RoundStats())
        passed = []
        for msg in replies:
            if msg.has_error():
                passed.append(msg)
                continue
            nbytes = message_bytes(msg.content)
            stats.evaluate_reply_bytes += nbytes
            entry = next((c for c in stats.evaluate_clients if c["node"] == msg.metadata.src_node_id
                          and "reply_bytes" not in c), None)
            if entry is not None:
                entry["reply_bytes"] = nbytes
            if P.UPLOAD_RECORD in msg.content.config_records:
                resync = self._track_reference(msg.content, msg.metadata.src_node_id)
                if resync is not None:
                    if entry is not None:
                        entry["status"] = f"resync: {resync}"
                    continue
                msg.content = RecordDict({k: v for k, v in msg.content.items() if k != P.UPLOAD_RECORD})
            passed.append(msg)
        return self.inner.aggregate_evaluate(server_round, passed)
