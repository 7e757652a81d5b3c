"""``CompressedStrategy``: wrap any ``flwr.serverapp.strategy.Strategy`` with compressed transport.

Per training round:

1. The inner strategy samples nodes and builds its messages (model + config).
2. The wrapper moves each download tier's reference towards the model with one encode per
   tier (server-side error feedback, :mod:`fedcomp.broadcast`) and replaces the model in
   every message by what that client needs: the chain of steps since the reference it holds,
   or the full reference on first contact and resyncs; plus the layout, codec specs, seed,
   round (see :mod:`fedcomp.protocol`).
3. Replies carry the ``upload`` codec's payload of the client's update. The wrapper decodes
   each one (a reply that fails is dropped with its reason logged; the round goes on),
   rebuilds ``model_i = global model + update_i`` and hands the inner strategy replies
   that look exactly like uncompressed ones, so FedAvg, FedAdam, FedMedian, Krum... aggregate
   as usual.

Bytes are counted as Flower sends them: the deflated size of every object in a message's
content tree (records, arrays, array chunks), per client.
"""

from __future__ import annotations

import dataclasses
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


def _metric(content: RecordDict, key: str) -> float:
    for record in content.metric_records.values():
        if key in record:
            return float(record[key])
    raise fedcomp.FedcompError(f"reply has no metric {key!r} to weight its sketch by")


def message_bytes(record) -> int:
    """Bytes Flower transmits for a record (RecordDict, ArrayRecord, ...) and everything in it."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(record).values())


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
        keep their broadcast values.
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
        download_tier_kbps: str = "",
        download_max_stale: int = 10,
    ) -> None:
        self.inner = inner
        self.upload = fedcomp.build_codec(upload)  # fails here, before any round, on a bad spec
        if isinstance(download_max_stale, bool) or not isinstance(download_max_stale, int) or download_max_stale < 1:
            raise fedcomp.SpecError(f"download_max_stale={download_max_stale!r} is invalid: it must be a positive integer")
        self.tiers = [Tier(i, spec, download_max_stale) for i, spec in enumerate(parse_tiers(download))]
        self.tier_kbps = ",".join(str(v) for v in parse_thresholds(download_tier_kbps, len(self.tiers)))
        self._held: dict[int, tuple[int, int, int]] = {}  # node -> (tier, version, crc) it reported
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
        self.delta = delta
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
        self._layout: fedcomp.Layout | None = None

    def summary(self) -> None:
        log(INFO, "fedcomp: upload %s, download %s, error feedback %s, aggregation %s", self.upload.spec,
            " | ".join(t.codec.spec for t in self.tiers), "on" if self.error_feedback else "off", self.aggregation)
        self.inner.summary()

    # -- training ---------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        stats = self.rounds.setdefault(server_round, RoundStats())
        if not messages:
            return messages
        model = dict(arrays.to_torch_state_dict())
        self._layout = fedcomp.Layout.of(model)
        self._base = {k: v.detach().cpu() for k, v in model.items()}
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
            })
            nbytes = message_bytes(content)
            stats.download_bytes += nbytes
            stats.download_bytes_dense += dense_bytes
            stats.download_bytes_by_tier[plan.tier] = stats.download_bytes_by_tier.get(plan.tier, 0) + nbytes
            stats.downloads.append({"node": node, "tier": plan.tier, "mode": plan.mode, "steps": len(plan.rounds),
                                    "download_bytes": nbytes})
            out.append(Message(content=content, dst_node_id=node,
                               message_type=msg.metadata.message_type, group_id=msg.metadata.group_id))
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        stats = self.rounds.setdefault(server_round, RoundStats())
        dense_model_bytes = message_bytes(ArrayRecord(self._base)) if self._base else 0
        decoded_replies = []
        sketches = []  # (reply content, sketch values) for aggregation="sketch"
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                stats.clients.append({"node": node, "status": f"error: {msg.error.reason}"})
                decoded_replies.append(msg)  # the inner strategy counts and logs failures
                continue
            wire = message_bytes(msg.content)
            entry = {"node": node, "upload_bytes": wire, "status": "ok"}
            stats.upload_bytes += wire
            resync = self._track_reference(msg.content, node)
            if resync is not None:
                entry["status"] = f"resync: {resync}"
                log(WARNING, "fedcomp: node %s asked for a full model in round %s: %s", node, server_round, resync)
                stats.clients.append(entry)
                continue
            try:
                content, other_bytes, values = self._decode_reply(msg.content, server_round, node)
            except (fedcomp.FedcompError, KeyError, TypeError) as exc:
                entry["status"] = f"dropped: {exc}"
                log(WARNING, "fedcomp: dropping reply of node %s in round %s: %s", node, server_round, exc)
                stats.clients.append(entry)
                continue
            stats.upload_bytes_dense += other_bytes + dense_model_bytes
            stats.clients.append(entry)
            msg.content = content
            decoded_replies.append(msg)
            if values is not None:
                sketches.append((content, values))
        if self.aggregation == "sketch":
            return self._aggregate_sketches(sketches)
        arrays, metrics = self.inner.aggregate_train(server_round, decoded_replies)
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
        key = getattr(self.inner, "weighted_by_key", "num-examples")
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
    ) -> tuple[RecordDict, int, list[torch.Tensor] | None]:
        """The reply as the inner strategy expects it, the bytes of its non-model records, and
        (sketch aggregation) the undecoded sketch values."""
        if P.UPLOAD_RECORD not in content.config_records:
            raise fedcomp.DecodeError(f"reply has no {P.UPLOAD_RECORD!r} record (is compression_mod installed on the client?)")
        if self._layout is None:
            raise fedcomp.DecodeError("reply arrived before any broadcast")
        record = content.config_records[P.UPLOAD_RECORD]
        payload = record[P.PAYLOAD]
        if not isinstance(payload, bytes):
            raise fedcomp.DecodeError(f"payload must be bytes, got {type(payload).__name__}")
        if self.aggregation == "sketch":
            values = self.upload.decode_values(payload, self._layout)
            if not all(bool(torch.isfinite(v).all()) for v in values):
                raise fedcomp.FedcompError("sketch has NaN or Inf values")
            rest = RecordDict({k: v for k, v in content.items() if k != P.UPLOAD_RECORD})
            _metric(rest, getattr(self.inner, "weighted_by_key", "num-examples"))  # weight must exist
            return rest, message_bytes(rest), values
        delta = self.upload.decode(payload, self._layout, round=server_round)
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
            self._last[node] = (server_round, {k: v for k, v in delta.items() if v.is_floating_point()})
        model = {name: (self._base[name].float() + delta[name].float()).to(self._base[name].dtype)
                 if self._base[name].is_floating_point() else self._base[name] + delta[name]
                 for name in self._layout.names}
        rest = RecordDict({k: v for k, v in content.items() if k != P.UPLOAD_RECORD})
        other_bytes = message_bytes(rest)
        rest[str(record[P.ARRAYS_KEY])] = ArrayRecord(model)
        return rest, other_bytes, None

    # -- federated evaluation: passed through uncompressed (the project's app evaluates centrally) --
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)
