"""``CompressedStrategy``: wrap any ``flwr.serverapp.strategy.Strategy`` with compressed transport.

Per training round:

1. The inner strategy samples nodes and builds its messages (model + config).
2. The wrapper moves each download tier's reference towards the model with one encode per
   tier (server-side error feedback, :mod:`fedcomp.broadcast`) and replaces the model in
   every message by what that client needs: the chain of steps since the reference it holds,
   or the full reference on first contact and resyncs; plus the layout, codec specs, seed,
   round (see :mod:`fedcomp.protocol`).
3. Replies carry the ``upload`` codec's payload of the client's update. The wrapper decodes
   each one as it arrives (:mod:`fedcomp.strategies.streaming`; a reply that fails is dropped with its
   reason logged; the round goes on). For weighted-mean strategies (FedAvg, FedProx, FedAvgM,
   the FedOpt family) it adds the update to a running mean and hands the inner strategy one
   reply holding it; for the others it rebuilds ``model_i = global model + update_i`` and hands
   over replies that look exactly like uncompressed ones (FedMedian, Krum...).
4. The next broadcast acknowledges each node's last aggregated round, so a client puts an
   update that never reached the aggregate back into its residual.

Bytes are counted as Flower sends them: the deflated size of every object in a message's
content tree (records, arrays, array chunks), per client.

Bandwidth budgets (``link_profile``, ``round_deadline_s``; :mod:`fedcomp.links`): clients
with a link fit their reply to its byte budget and report the concrete codec spec they used.
The wrapper accepts a reported spec only of the configured family (same stages in order,
:func:`fedcomp.budget.same_family`) and decodes each reply with it; skipped replies (budget too
small) are not aggregated. Per client it records bytes, budget, status and simulated times
(download of the bytes it was really sent, measured compute, upload), and per round
``sim_time_s``: the slowest participant, or the deadline when clients past it are dropped
(their replies are not aggregated).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable
from logging import INFO, WARNING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.server import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

import fedcomp
from fedcomp import protocol as P
from fedcomp.broadcast import Tier, parse_thresholds, parse_tiers
from fedcomp.budget import FALLBACKS, check_budgetable, same_family
from fedcomp import links
from fedcomp.strategies.streaming import RunningMean, StreamingGrid, can_stream


def _metric(content: RecordDict, key: str) -> float:
    for record in content.metric_records.values():
        if key in record:
            return float(record[key])
    raise fedcomp.FedcompError(f"reply has no metric {key!r} to weight its sketch by")


def message_bytes(record) -> int:
    """Bytes Flower transmits for a record (RecordDict, ArrayRecord, ...) and everything in it."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(record).values())


def canonical_order(msg: Message) -> tuple[int, bytes, int]:
    """Sort key of a reply that does not depend on arrival order or on node ids (random per
    simulation run): the SHA-256 of its payload, error replies last. Aggregating in this order
    makes a seeded simulation reproduce its floating-point sums bit for bit."""
    if msg.has_error():
        return 1, b"", msg.metadata.src_node_id
    record = msg.content.config_records.get(P.UPLOAD_RECORD)
    payload = record.get(P.PAYLOAD) if record is not None else None
    digest = hashlib.sha256(payload).digest() if isinstance(payload, bytes) else b""
    return 0, digest, msg.metadata.src_node_id


@dataclasses.dataclass
class RoundStats:
    """What one training round cost on the wire, summed over the round's clients."""

    upload_bytes: int = 0
    download_bytes: int = 0
    upload_bytes_dense: int = 0  # the same replies with the model as plain fp32 arrays
    download_bytes_dense: int = 0  # the same broadcasts with the model as plain fp32 arrays
    download_bytes_by_tier: dict[int, int] = dataclasses.field(default_factory=dict)
    encodes: int = 0  # broadcast encodes this round: one per tier with clients, not one per client
    downloads: list[dict] = dataclasses.field(default_factory=list)  # per client: node, tier, mode, steps, bytes
    clients: list[dict] = dataclasses.field(default_factory=list)  # per client: node, bytes, status
    links: list[dict] = dataclasses.field(default_factory=list)  # per client with a link: bytes, budget, times
    sim_time_s: float | None = None  # simulated round time (None: no client reported a link)


@dataclasses.dataclass
class _RoundState:
    """Replies of the round in progress, as they are received."""

    round: int
    running: RunningMean | None = None  # weighted mean of updates (streamable inner strategies)
    message_type: str = "train"
    arrays_key: str = ""
    seen: dict[int, Message] = dataclasses.field(default_factory=dict)  # replies already received, by identity
    collected: list[Message] = dataclasses.field(default_factory=list)  # rebuilt replies for the inner strategy
    metrics: list[RecordDict] = dataclasses.field(default_factory=list)  # non-model records (running mean)
    sketches: list[tuple[RecordDict, list[torch.Tensor]]] = dataclasses.field(default_factory=list)


class CompressedStrategy(Strategy):
    """Compress broadcasts and replies of any Flower strategy.

    Parameters
    ----------
    inner : Strategy
        The strategy that samples clients and aggregates, e.g. ``FedAvg()``.
    upload : str (default: ``"topk(ratio=0.01)+qsgd(bits=4)"``)
        Codec spec the clients use for their updates.
    download : str (default: ``"none()"``)
        Codec spec of the broadcasts, or tiers separated by ``|`` (tier 0 first, for the slowest
        links), e.g. ``"topk(ratio=0.01)+twobit() | topk(ratio=0.1)+kbit(bits=4) | kbit(bits=8)"``.
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
    download_max_stale : int (default: 10)
        A client more than this many steps of its tier behind (missed rounds) gets the full
        reference instead of a catch-up chain.
    error_feedback : bool (default: True)
        Clients keep what compression dropped in a residual and send it later.
    seed : int (default: 0)
        Run seed; with the round and node id it seeds random-k indices and stochastic rounding.
    aggregation : str (default: ``"decode"``)
        ``"decode"``: decode every reply and let the inner strategy aggregate the models.
        ``"sketch"``: FetchSGD (Rothchild et al. 2020), for linear upload codecs such as
        ``sketch(...)``: the server sums the clients' sketches without decoding them (weighted
        by ``num-examples``), keeps momentum and error accumulation in sketch space, applies the
        top-k heavy hitters of the accumulated error, and zeroes momentum and error at the cells
        those coordinates hash to. Clients keep no residual (error feedback is server side); the
        inner strategy still samples clients, but its aggregation is not used; integer buffers
        keep their broadcast values. Does not combine with budgets (clients' sketches would
        differ in ``cols``).
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
        norm and the bound in its status: an absurd or hostile update never reaches the
        aggregate. With ``aggregation="sketch"`` the bound applies to the sketch's norm divided
        by sqrt(rows) (each row of a count sketch preserves the norm in expectation). 0 turns
        it off. NaN and Inf updates are always dropped.
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

    def __init__(
        self,
        inner: Strategy,
        upload: str = "topk(ratio=0.01)+qsgd(bits=4)",
        download: str = "none()",
        error_feedback: bool = True,
        seed: int = 0,
        aggregation: str = "decode",
        server_momentum: float = 0.0,
        delta: float = 0.0,
        max_update_norm: float = 0.0,
        download_tier_kbps: str = "",
        download_max_stale: int = 10,
        link_profile: str = links.NONE,
        round_deadline_s: float = 0.0,
        budget_fallback: str = "skip",
        streaming: bool = True,
    ) -> None:
        self.inner = inner
        self.streaming = bool(streaming)
        self._round_state: _RoundState | None = None
        self._dense_model_bytes = 0
        self.upload = fedcomp.build_codec(upload)  # fails here, before any round, on a bad spec
        if isinstance(download_max_stale, bool) or not isinstance(download_max_stale, int) or download_max_stale < 1:
            raise fedcomp.SpecError(f"download_max_stale={download_max_stale!r} is invalid: it must be a positive integer")
        self.tiers = [Tier(i, spec, download_max_stale) for i, spec in enumerate(parse_tiers(download))]
        self.tier_kbps = ",".join(str(v) for v in parse_thresholds(download_tier_kbps, len(self.tiers)))
        self._held: dict[int, tuple[int, int, int]] = {}  # node -> (tier, version, crc) it reported
        self._aggregated: dict[int, int] = {}  # node -> round of its last reply that reached the aggregate
        self._want: dict[int, int] = {}  # node -> the tier it asked for
        if aggregation not in ("decode", "sketch"):
            raise fedcomp.SpecError(f"aggregation={aggregation!r} is invalid: aggregation must be 'decode' or 'sketch'")
        if aggregation == "sketch" and not self.upload.linear:
            raise fedcomp.SpecError(
                f"aggregation='sketch' needs a linear upload codec such as 'sketch(rows=1, cols=4000)', got {upload!r}"
            )
        if not 0 <= server_momentum < 1:
            raise fedcomp.SpecError(f"server_momentum={server_momentum!r} is invalid: it must be in [0, 1)")
        if not 0 <= delta <= 1:
            raise fedcomp.SpecError(f"delta={delta!r} is invalid: delta must be in [0, 1] (0 turns delta coding off)")
        if delta and aggregation == "sketch":
            raise fedcomp.SpecError("delta coding needs per-client decoding; it does not combine with aggregation='sketch'")
        if not (isinstance(max_update_norm, (int, float)) and 0 <= max_update_norm < float("inf")):
            raise fedcomp.SpecError(
                f"max_update_norm={max_update_norm!r} is invalid: it must be a finite float >= 0 (0 turns the bound off)")
        self.max_update_norm = float(max_update_norm)
        self.delta = delta
        links.check_profile(link_profile)
        if isinstance(round_deadline_s, bool) or not isinstance(round_deadline_s, (int, float)) or not (
                0 <= round_deadline_s < float("inf")):
            raise fedcomp.SpecError(f"round_deadline_s={round_deadline_s!r} is invalid: seconds >= 0 (0: no deadline)")
        if budget_fallback not in FALLBACKS:
            raise fedcomp.SpecError(f"budget_fallback={budget_fallback!r} is invalid: one of {FALLBACKS}")
        if link_profile != links.NONE and aggregation == "sketch":
            raise fedcomp.SpecError(
                "budgets give clients sketches of different cols, which cannot be summed in sketch space: "
                "use aggregation='decode' with link_profile, or link_profile='none'")
        if round_deadline_s > 0:
            check_budgetable(upload)  # every client with a link gets a budget: the codec needs a free parameter
        self.link_profile = link_profile
        self.round_deadline_s = float(round_deadline_s)
        self.budget_fallback = budget_fallback
        self._last: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # node -> (round, its last update)
        self.aggregation = aggregation
        self.server_momentum = server_momentum
        self._momentum: list[torch.Tensor] | None = None  # FetchSGD S_u, per segment
        self._error: list[torch.Tensor] | None = None  # FetchSGD S_e, per segment
        if aggregation == "sketch":
            error_feedback = False  # FetchSGD clients are stateless: the error lives on the server
        if self.upload.needs_error_feedback and not error_feedback and aggregation == "decode":
            log(WARNING, "fedcomp: upload codec %s is biased; without error feedback it may not converge", upload)
        self.error_feedback = error_feedback
        self.seed = seed
        self.rounds: dict[int, RoundStats] = {}
        self._base: dict[str, torch.Tensor] = {}  # the global model of this round: model_i = base + update_i
        self._sent: dict[int, list[int]] = {}  # round -> nodes sent a train message (to record who never replied)
        self._unattributed: dict[int, list[str]] = {}  # round -> reasons of errors from nodes not messaged
        self._layout: fedcomp.Layout | None = None

    def summary(self) -> None:
        log(INFO, "fedcomp: upload %s, download %s, error feedback %s, aggregation %s", self.upload.spec,
            " | ".join(t.codec.spec for t in self.tiers), "on" if self.error_feedback else "off", self.aggregation)
        if self.streaming and self.aggregation == "decode" and not can_stream(self.inner):
            log(INFO, "fedcomp: %s needs every reply at once: replies are decoded as they arrive, then collected",
                type(self.inner).__name__)
        self.inner.summary()

    # -- training ---------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        stats = self.rounds.setdefault(server_round, RoundStats())
        self._sent[server_round] = [m.metadata.dst_node_id for m in messages]
        if not messages:
            return messages
        model = dict(arrays.to_torch_state_dict())
        self._layout = fedcomp.Layout.of(model)
        self._base = {k: v.detach().cpu() for k, v in model.items()}
        self._dense_model_bytes = message_bytes(ArrayRecord(self._base))
        for tier in self.tiers:
            if tier.reference is None:  # all tiers start from the same model: early tier changes are cheap
                tier.start(model)
        nodes = [msg.metadata.dst_node_id for msg in messages]
        tier_of = {node: self._want.get(node, 0) for node in nodes}
        for tier in sorted(set(tier_of.values())):  # one encode per tier with clients this round
            self.tiers[tier].step(model, server_round, self.seed)
            stats.encodes += 1
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            array_keys = list(msg.content.array_records)
            if len(array_keys) != 1:
                raise ValueError(f"CompressedStrategy expects one ArrayRecord per train message, got {array_keys}")
            tier = self.tiers[tier_of[node]]
            plan = tier.plan(self._held.get(node))
            dense_bytes = message_bytes(msg.content)
            content = RecordDict({k: v for k, v in msg.content.items() if k != array_keys[0]})
            content[P.DOWNLOAD_RECORD] = ConfigRecord({
                P.MODE: plan.mode,
                P.PAYLOADS: list(plan.payloads),
                P.ROUNDS: list(plan.rounds),
                P.BASE_CRC: plan.base_crc,
                P.REF_CRC: plan.crc,
                P.TIER: plan.tier,
                P.TIERS: len(self.tiers),
                P.TIER_KBPS: self.tier_kbps,
                P.LAYOUT: self._layout.to_json(),
                P.UPLOAD_SPEC: self.upload.spec,
                P.DOWNLOAD_SPEC: tier.codec.spec,
                P.ERROR_FEEDBACK: self.error_feedback,
                P.SEED: self.seed,
                P.ROUND: server_round,
                P.ARRAYS_KEY: array_keys[0],
                P.DELTA: self.delta,
                P.DELTA_REF: self._last.get(node, (0, None))[0] if self.delta else 0,
                P.ACK_ROUND: self._aggregated.get(node, 0),
                P.LINK_PROFILE: self.link_profile,
                P.DEADLINE: self.round_deadline_s,
                P.FALLBACK: self.budget_fallback,
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

    def start(self, grid: Grid, *args, **kwargs):
        """Flower's round loop, with replies decoded as they arrive (:mod:`fedcomp.strategies.streaming`)."""
        if self.streaming:
            grid = StreamingGrid(grid, self._on_reply)
        return super().start(grid, *args, **kwargs)

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
        if self.aggregation == "sketch":
            return self._aggregate_sketches(state.sketches)
        if state.running is None:
            arrays, metrics = self.inner.aggregate_train(server_round, state.collected)
            return self._as_layout(arrays), metrics
        return self._finish_mean(server_round, state)

    def _state(self, server_round: int) -> _RoundState:
        if self._round_state is None or self._round_state.round != server_round:
            self._round_state = _RoundState(server_round, running=RunningMean() if self._mean_ready() else None)
        return self._round_state

    def _mean_ready(self) -> bool:
        return self.aggregation == "decode" and can_stream(self.inner) and self.streaming

    def _receive(self, server_round: int, msg: Message) -> None:
        """Count, check and decode one reply, and add it to the round's aggregate (once per reply)."""
        state = self._state(server_round)
        if id(msg) in state.seen:  # the grid streamed it in; Flower's loop passes it again
            return
        state.seen[id(msg)] = msg
        stats = self.rounds.setdefault(server_round, RoundStats())
        node = msg.metadata.src_node_id
        if msg.has_error():
            if state.running is None:
                state.collected.append(msg)  # the inner strategy counts and logs failures
            if node not in self._sent.get(server_round, (node,)):  # made by the SuperLink for a dead node
                self._unattributed.setdefault(server_round, []).append(msg.error.reason)
                return
            stats.clients.append({"node": node, "status": f"error: {msg.error.reason}"})
            return
        wire = message_bytes(msg.content)
        entry = {"node": node, "upload_bytes": wire, "status": "ok"}
        stats.upload_bytes += wire
        stats.clients.append(entry)
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
        try:
            rest, other_bytes, arrays_key, decoded = self._decode_reply(msg.content, server_round, node)
            weight = _metric(rest, self._weight_key()) if state.running is not None else None
        except (fedcomp.FedcompError, KeyError, TypeError) as exc:
            entry["status"] = f"dropped: reply lacks the key {exc}" if isinstance(exc, KeyError) else f"dropped: {exc}"
            log(WARNING, "fedcomp: dropping reply of node %s in round %s: %s", node, server_round, exc)
            return
        stats.upload_bytes_dense += other_bytes + self._dense_model_bytes
        self._aggregated[node] = server_round  # acknowledged in its next broadcast
        if self.aggregation == "sketch":
            state.sketches.append((rest, decoded))
        elif state.running is not None:
            state.running.add(decoded, weight)
            state.metrics.append(rest)
        else:
            rest[arrays_key] = ArrayRecord(self._rebuild(decoded))
            msg.content = rest
            state.collected.append(msg)

    def _weight_key(self) -> str:
        return getattr(self.inner, "weighted_by_key", "num-examples")

    def _rebuild(self, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``model_i = base + update_i`` in the model's dtypes."""
        return {name: (self._base[name].float() + delta[name].float()).to(self._base[name].dtype)
                if self._base[name].is_floating_point() else self._base[name] + delta[name].to(self._base[name].dtype)
                for name in self._layout.names}

    def _finish_mean(self, server_round: int, state: _RoundState) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Hand the inner strategy one reply holding the weighted mean model (its weight is the
        total, so FedAvg returns it unchanged and FedAdam & co. step from it); metrics are the
        inner strategy's aggregate of every reply's metrics."""
        running = state.running
        assert running is not None
        if running.count == 0 or running.weight <= 0:
            log(WARNING, "fedcomp: no usable replies in round %s", server_round)
            return None, None
        mean = running.mean()
        model = {}
        for name in self._layout.names:
            base = self._base[name]
            if base.is_floating_point():
                model[name] = (base.float() + mean[name]).to(base.dtype)
            else:  # FedAvg averages integer buffers as floats; _as_layout rounds them back
                model[name] = base.double() + mean[name]
        key = self._weight_key()
        arrays_key = state.arrays_key or "arrays"
        metric_aggr = getattr(self.inner, "train_metrics_aggr_fn", None)
        metrics = metric_aggr(state.metrics, key) if metric_aggr is not None else None
        merged = Message(RecordDict({arrays_key: ArrayRecord(model), "metrics": MetricRecord({key: running.weight})}),
                         dst_node_id=0, message_type="train")
        log(INFO, "fedcomp: round %s aggregated %d replies as they arrived", server_round, running.count)
        arrays, _ = self.inner.aggregate_train(server_round, [merged])
        return self._as_layout(arrays), metrics

    def _as_layout(self, arrays: ArrayRecord | None) -> ArrayRecord | None:
        """The aggregate in the model's dtypes (FedAvg turns integer buffers into float64), so
        the broadcast references keep one layout."""
        if arrays is None or self._layout is None:
            return arrays
        model = arrays.to_torch_state_dict()
        if fedcomp.Layout.of(model) == self._layout or set(model) != set(self._layout.names):
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
            return None  # _decode_reply drops it with its reason
        want = record.get(P.WANT_TIER)
        if isinstance(want, int) and 0 <= want < len(self.tiers):
            self._want[node] = want
        if P.RESYNC in record:
            self._held.pop(node, None)
            return str(record[P.RESYNC])
        try:
            held = (int(record[P.TIER]), int(record[P.REF_VERSION]), int(record[P.REF_CRC]))
        except (KeyError, TypeError, ValueError):
            self._held.pop(node, None)
            return None
        if 0 <= held[0] < len(self.tiers) and self.tiers[held[0]].verify(held[1], held[2]):
            self._held[node] = held
        else:
            self._held.pop(node, None)
            log(WARNING, "fedcomp: node %s reports a reference the server does not know %s; full model next time",
                node, held)
        return None

    def _aggregate_sketches(
        self, sketches: list[tuple[RecordDict, list[torch.Tensor]]]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FetchSGD: sum sketches, momentum and error in sketch space, apply the heavy hitters."""
        if not sketches or self._layout is None:
            return None, None
        key = self._weight_key()
        weights = [float(_metric(content, key)) for content, _ in sketches]
        total = sum(weights) or 1.0
        summed = None
        for (_, values), w in zip(sketches, weights):
            summed = [v * (w / total) for v in values] if summed is None else [
                acc + v * (w / total) for acc, v in zip(summed, values)]
        rho = self.server_momentum
        if self._momentum is None or len(self._momentum) != len(summed):
            self._momentum = [torch.zeros_like(v) for v in summed]
            self._error = [torch.zeros_like(v) for v in summed]
        reducer = self.upload.reducer
        model = dict(self._base)
        for j, ((seg, group), s_j) in enumerate(zip(self.upload.segments(self._layout), summed)):
            self._momentum[j] = rho * self._momentum[j] + s_j
            self._error[j] += self._momentum[j]
            delta = reducer.heavy_hitters(self._error[j], seg.numel)
            applied = reducer.sketch(delta) != 0
            self._momentum[j][applied] = 0
            self._error[j][applied] = 0
            offset = 0
            for i in group:
                spec = self._layout.tensors[i]
                part = delta[offset:offset + spec.numel].view(spec.shape)
                model[spec.name] = (self._base[spec.name].float() + part).to(self._base[spec.name].dtype)
                offset += spec.numel
        metrics = None
        aggr = getattr(self.inner, "train_metrics_aggr_fn", None)
        if aggr is not None:
            metrics = aggr([content for content, _ in sketches], key)
        return ArrayRecord(model), metrics

    def _decode_reply(
        self, content: RecordDict, server_round: int, node: int
    ) -> tuple[RecordDict, int, str, dict[str, torch.Tensor] | list[torch.Tensor]]:
        """The reply's other records, their bytes, the name of the model's ArrayRecord, and the
        decoded update (sketch aggregation: the undecoded sketch values)."""
        if P.UPLOAD_RECORD not in content.config_records:
            raise fedcomp.DecodeError(f"reply has no {P.UPLOAD_RECORD!r} record (is compression_mod installed on the client?)")
        if self._layout is None:
            raise fedcomp.DecodeError("reply arrived before any broadcast")
        record = content.config_records[P.UPLOAD_RECORD]
        payload = record[P.PAYLOAD]
        if not isinstance(payload, bytes):
            raise fedcomp.DecodeError(f"payload must be bytes, got {type(payload).__name__}")
        spec = str(record.get(P.SPEC, self.upload.spec))
        codec = self.upload
        if spec != self.upload.spec:  # a budgeted client: its own free parameters (k, bits, rank, cols)
            if not same_family(self.upload.spec, spec):
                raise fedcomp.DecodeError(
                    f"reported codec {spec!r} is not of the configured family {self.upload.spec!r}: a budget may "
                    f"change the free parameters only (k, bits, block, rank, cols), not the stages")
            codec = fedcomp.build_codec(spec)
        if self.aggregation == "sketch":
            if codec is not self.upload:
                raise fedcomp.DecodeError(f"sketch aggregation needs every client on {self.upload.spec!r}, got {spec!r}")
            values = self.upload.decode_values(payload, self._layout)
            if not all(bool(torch.isfinite(v).all()) for v in values):
                raise fedcomp.FedcompError("sketch has NaN or Inf values")
            rows = getattr(self.upload.reducer.config, "rows", 1)
            self._check_norm(math.sqrt(sum(float(v.double().pow(2).sum()) for v in values) / rows))
            rest = RecordDict({k: v for k, v in content.items() if k != P.UPLOAD_RECORD})
            _metric(rest, self._weight_key())  # weight must exist
            return rest, message_bytes(rest), str(record[P.ARRAYS_KEY]), values
        delta = codec.decode(payload, self._layout, round=server_round)
        for name, t in delta.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise fedcomp.FedcompError(f"update of {name!r} has NaN or Inf values")
        if self.delta:
            ref = int(record.get(P.DELTA_REF, 0))
            if ref:
                held = self._last.get(node)
                if held is None or held[0] != ref:
                    raise fedcomp.FedcompError(
                        f"delta against round {ref}, but the server holds round {held[0] if held else 'none'} for this node"
                    )
                delta = {k: v + self.delta * held[1][k] if k in held[1] else v for k, v in delta.items()}
        self._check_norm(math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values() if t.is_floating_point())))
        if self.delta:
            self._last[node] = (server_round, {k: v for k, v in delta.items() if v.is_floating_point()})
        rest = RecordDict({k: v for k, v in content.items() if k != P.UPLOAD_RECORD})
        return rest, message_bytes(rest), str(record[P.ARRAYS_KEY]), delta

    def _check_norm(self, norm: float) -> None:
        if self.max_update_norm and norm > self.max_update_norm:
            raise fedcomp.FedcompError(
                f"update norm {norm:.4g} exceeds max_update_norm={self.max_update_norm:g} (an absurd or hostile "
                f"update; raise max-update-norm if such updates are legitimate)"
            )

    # -- federated evaluation: passed through uncompressed (the project's app evaluates centrally) --
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)
