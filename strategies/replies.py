"""Reply handling of ``CompressedStrategy``: count, check, decode and add one reply at a time.

A :class:`RoundReplies` lives for one training round. For every reply that carries a fedcomp
payload it

1. checks its metrics (:func:`fedcomp.strategies.guards.check_metrics`: one MetricRecord holding
   the weight key, the inner strategy's ``weighted_by_key``, ``num-examples`` by default; names and
   values Flower's metric aggregation can add) and the weight (:func:`fedcomp.aggregate.check_weight`:
   finite, > 0, at most ``max_weight``);
2. refuses a replay (a ``reply-round`` other than this round) and a payload larger than the server
   asked for (``upload_limit``);
3. decodes and checks the payload with the core (:class:`fedcomp.aggregate.Accumulator` or
   :class:`fedcomp.server_feedback.ServerFeedback`), adds back delta coding's reference; then checks
   the reply tag against the token the server sent with this message
   (:func:`fedcomp.wire.check_reply_tag`), the payload nonce against the node's earlier ones, and
   what the update does to running statistics and integer buffers
   (:class:`fedcomp.strategies.guards.StateGuard`);
4. offers the update's norm and weight to the round's :class:`fedcomp.strategies.guards.RoundGuard`
   and, once it is accepted (its weight clipped where it exceeds the guard's cap), adds it to the
   aggregate: the running weighted sum (weighted-mean strategies), the server-feedback sketch sum
   (FetchSGD), or ``model_i = base + update_i`` handed to the inner strategy (strategies that need
   every model: FedMedian, Krum...).

A reply that fails any step is dropped with its reason in ``entry["status"]``; the round goes
on. Replies held by the guard until its quorum are decoded again when decided (sparse and sketch
updates are kept instead: they are small), so memory stays one decoded reply. At the end of the
round, metrics whose names or kinds differ from the majority's are left out of the metric
aggregate (logged).
"""

from __future__ import annotations

from logging import INFO, WARNING
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import log

import fedcomp
from fedcomp import protocol as P
from fedcomp.aggregate import Accumulator, apply_step, check_weight
from fedcomp.budget import same_family
from fedcomp.server_feedback import ServerFeedback
from fedcomp.msgsize import message_bytes
from fedcomp.strategies.guards import (ReplyRejected, RoundGuard, StateGuard, check_exact, check_metrics,
                                       describe_schema, majority_schema)
from fedcomp.wire import HEADER, HEADER_BYTES, REPLY_TAG, check_reply_tag

NONCES_KEPT = 64  # per node: payload nonces remembered to refuse replays


def weight_of(content: RecordDict, key: str):
    """The reply's weight metric (raw: checked by :func:`check_weight`); the key must be in exactly
    one MetricRecord."""
    holders = [record[key] for record in content.metric_records.values() if key in record]
    if len(holders) == 1:
        return holders[0]
    if holders:
        raise fedcomp.FedcompError(f"metric {key!r} appears in {len(holders)} MetricRecords: it must be in exactly one")
    raise fedcomp.FedcompError(f"reply has no metric {key!r} to weight its update by")


@dataclass
class _Valid:
    """A decoded, checked reply waiting for (or past) the norm guard."""

    node: int
    msg: Message
    rest: RecordDict
    weight: float
    norm: float
    entry: dict
    update: object | None  # Update, sketch values, or None (decode again when decided)
    payload: bytes
    codec: object
    arrays_key: str
    metrics: tuple = ()  # (record name, metrics, schema) from check_metrics


@dataclass
class RoundReplies:
    """One training round's replies, from arrival to the aggregate (see module docstring).

    ``mode``: ``"mean"`` (running weighted sum), ``"sketch"`` (FetchSGD) or ``"collect"``.
    """

    round: int
    mode: str
    layout: fedcomp.Layout
    base: dict[str, torch.Tensor]
    accumulator: Accumulator | None
    feedback: ServerFeedback | None
    guard: RoundGuard
    config: object  # CompressionConfig
    upload: object  # the configured upload codec
    weight_key: str
    history: "ReplyHistory"
    on_accept: Callable[[int, dict, int], None]  # (node, entry, dense-equivalent bytes of the reply)
    dense_model_bytes: int = 0
    tokens: dict[int, int] | None = None  # node -> the reply token sent with its message (None: not checked)
    upload_limit: Callable[[dict], int | None] | None = None  # upload record -> payload bytes allowed (None: any)
    state_guard: StateGuard | None = None  # running statistics and integer buffers (None: the model has none)
    on_revoke: Callable[[int], None] | None = None  # an accepted reply left out after all (collect mode)
    pending: list[_Valid] = field(default_factory=list)
    collected: list[Message] = field(default_factory=list)  # collect mode: rebuilt replies
    metrics: list[RecordDict] = field(default_factory=list)  # mean / sketch mode: the replies' metrics (checked)
    schemas: list[tuple] = field(default_factory=list)  # the schema of each accepted reply's metrics
    accepted: list[tuple[int, dict]] = field(default_factory=list)  # (node, entry) of each accepted reply
    payloads: int = 0  # replies that carried a fedcomp payload record

    # -- one reply ----------------------------------------------------------------------------
    def handle(self, msg: Message, entry: dict) -> None:
        """Check, decode and (now or after the guard's warm-up) add one reply that carries an upload record."""
        node = msg.metadata.src_node_id
        self.payloads += 1
        try:
            valid = self._check(msg, node, entry)
            verdict = self.guard.offer(valid.norm, valid.weight)
        except (fedcomp.FedcompError, KeyError, TypeError, ValueError, OverflowError) as exc:
            self._drop(entry, f"reply lacks the key {exc}" if isinstance(exc, KeyError) else str(exc), node)
            return
        if verdict is None:
            if self.mode != "sketch" and not self.accumulator.sparse and not self.config.delta:
                valid.update = None  # dense: decode again when decided, to hold one decoded reply at most
            self.pending.append(valid)
            entry["status"] = "pending"
            if self.guard.ready():
                self._settle()
            return
        self._decide(valid, verdict)

    def _check(self, msg: Message, node: int, entry: dict) -> _Valid:
        content = msg.content
        record = content.config_records[P.UPLOAD_RECORD]
        payload = record[P.PAYLOAD]
        if not isinstance(payload, bytes):
            raise fedcomp.DecodeError(f"payload must be bytes, got {type(payload).__name__}")
        rest = RecordDict({k: v for k, v in content.items() if k != P.UPLOAD_RECORD})
        metrics = check_metrics(rest, self.weight_key)
        weight = check_weight(metrics[1][self.weight_key], self.config.max_weight)
        answered = record.get(P.REPLY_ROUND)
        if answered is not None and answered != self.round:
            raise fedcomp.FedcompError(f"replay: the payload answers round {answered}, this is round {self.round}")
        limit = self.upload_limit(dict(record)) if self.upload_limit is not None else None
        if limit is not None and len(payload) > limit:
            raise ReplyRejected(f"payload of {len(payload)} bytes exceeds the {limit} bytes the server asked for "
                                f"(upload {self.upload.spec!r} on this model{', or the budget reported' if P.BUDGET in record else ''})")
        codec = self._codec(record)
        if self.mode == "sketch":
            update = self.feedback.decode(payload)
            norm = self.feedback.norm(update)
        else:
            update = self.accumulator.decode(payload, round=self.round, codec=codec)
            if self.config.delta:
                update = self._add_delta_reference(record, node, update)
            norm = update.norm()
        self.history.check_nonce(node, HEADER.unpack_from(payload)[-1] if len(payload) >= HEADER_BYTES else 0,
                                 self.round)
        if self.tokens is not None:
            if node not in self.tokens:
                raise ReplyRejected(f"node {node} was sent no train message in round {self.round}")
            check_reply_tag(payload, record.get(REPLY_TAG), self.tokens[node])
        if self.state_guard is not None and self.mode != "sketch":
            self.state_guard.check(update, self.base)
        elif self.mode == "sketch" and self.feedback.exact_specs:
            check_exact(update[-1], self.feedback.exact_specs, self.base)
        return _Valid(node, msg, rest, weight, norm, entry, update, payload, codec, str(record[P.ARRAYS_KEY]),
                      metrics)

    def _codec(self, record):
        spec = str(record.get(P.SPEC, self.upload.spec))
        if spec == self.upload.spec:
            return self.upload
        if self.mode == "sketch":
            raise fedcomp.DecodeError(f"sketch aggregation needs every client on {self.upload.spec!r}, got {spec!r}")
        if not same_family(self.upload.spec, spec):  # a budgeted client: its own free parameters only
            raise fedcomp.DecodeError(
                f"reported codec {spec!r} is not of the configured family {self.upload.spec!r}: a budget may "
                f"change the free parameters only (k, bits, block, rank, cols), not the stages")
        return fedcomp.build_codec(spec)

    def _add_delta_reference(self, record, node: int, update: Update) -> Update:
        """Delta coding: the client sent ``update - delta * previous``; add ``delta * previous`` back."""
        dense = self.accumulator.to_dense(update)
        ref = int(record.get(P.DELTA_REF, 0))
        if ref:
            held = self.history.last.get(node)
            if held is None or held[0] != ref:
                raise fedcomp.FedcompError(
                    f"delta against round {ref}, but the server holds round {held[0] if held else 'none'} for this node")
            dense = {k: v + self.config.delta * held[1][k] if k in held[1] else v for k, v in dense.items()}
        self.history.last[node] = (self.round, {k: v for k, v in dense.items() if v.is_floating_point()})
        return self.accumulator.dense_update(dense)

    # -- decisions ----------------------------------------------------------------------------
    def _settle(self) -> None:
        pending, self.pending = self.pending, []
        for valid in pending:
            self._decide(valid, self.guard.settle(valid.norm))

    def _decide(self, valid: _Valid, accept: bool) -> None:
        if not accept:
            self._drop(valid.entry, self.guard.reason(valid.norm), valid.node)
            return
        weight, clipped, claimed = self.guard.weight(valid.weight, valid.norm)
        name, metrics, schema = valid.metrics
        checked = RecordDict({name: MetricRecord({**metrics, self.weight_key: _as_metric(weight, metrics[self.weight_key])})})
        dense_bytes = message_bytes(valid.rest) + self.dense_model_bytes  # before collect mode puts the model in
        try:
            self._commit(valid, weight, checked)
        except fedcomp.FedcompError as exc:
            self._drop(valid.entry, str(exc), valid.node)
            return
        valid.entry["status"] = "ok"
        if clipped is not None:  # a weight above the cap is a claim: warned; influence alone: noted
            valid.entry["weight"] = clipped
            log(WARNING if claimed else INFO, "fedcomp: node %s in round %s: %s", valid.node, self.round, clipped)
        self.guard.accept(valid.norm, weight)
        self.schemas.append(schema)
        self.accepted.append((valid.node, valid.entry))
        self.on_accept(valid.node, valid.entry, dense_bytes)

    def _commit(self, valid: _Valid, weight: float, checked: RecordDict) -> None:
        update = valid.update
        if update is None:  # deferred dense reply: decode again
            update = self.accumulator.decode(valid.payload, round=self.round, codec=valid.codec)
        if self.mode == "sketch":
            self.feedback.add_values(update, weight)
            self.metrics.append(checked)
        elif self.mode == "mean":
            self.accumulator.add_update(update, weight)
            self.metrics.append(checked)
        else:
            for key in list(valid.rest.metric_records):  # the checked metrics, at the weight counted
                del valid.rest[key]
            for key, record in checked.items():
                valid.rest[key] = record
            model = apply_step(self.base, self.accumulator.to_dense(update))
            # integer buffers as float64, as FedAvg makes them (the wrapper casts the aggregate back):
            # strategies that scale replies in place (QFedAvg, Flower 1.39) fail on int64 counters
            valid.rest[valid.arrays_key] = ArrayRecord({k: v if v.is_floating_point() else v.double()
                                                        for k, v in model.items()})
            valid.msg.content = valid.rest
            self.collected.append(valid.msg)

    def _drop(self, entry: dict, reason: str, node: int) -> None:
        entry["status"] = f"dropped: {reason}"
        log(WARNING, "fedcomp: dropping reply of node %s in round %s: %s", node, self.round, reason)

    # -- end of round -------------------------------------------------------------------------
    def count_aggregated(self) -> int:
        if self.mode == "mean":
            return self.accumulator.count
        if self.mode == "sketch":
            return self.feedback.count
        return len(self.collected)

    def finish(self) -> int:
        """Decide the replies still held by the guard; close the guard (this round's accepted norms
        and weights are the next one's reference); leave metrics of a minority schema out of the
        metric aggregate (collect mode: the reply, as the inner strategy needs one schema). The
        number of replies aggregated."""
        self._settle()
        self.guard.close()
        majority = majority_schema(self.schemas)
        keep = [s == majority for s in self.schemas]
        for (node, entry), ok in zip(self.accepted, keep):
            if ok:
                continue
            reason = f"its metrics differ from the round's majority ({describe_schema(majority)})"
            if self.mode == "collect":
                self._drop(entry, reason, node)
                if self.on_revoke is not None:
                    self.on_revoke(node)
            else:
                entry["metrics"] = f"left out of the round's metrics: {reason}"
                log(WARNING, "fedcomp: metrics of node %s in round %s left out of the round's metrics: %s",
                    node, self.round, reason)
        if self.mode == "collect":
            self.collected = [m for m, ok in zip(self.collected, keep) if ok]
        else:
            self.metrics = [m for m, ok in zip(self.metrics, keep) if ok]
        return self.count_aggregated()


def _as_metric(weight: float, declared):
    """The weight as a metric: the declared value where it counts as declared (an int stays an int)."""
    return declared if weight == declared else float(weight)


@dataclass
class ReplyHistory:
    """What the server remembers about nodes across rounds: delta references and used nonces."""

    last: dict[int, tuple[int, dict[str, torch.Tensor]]] = field(default_factory=dict)  # delta coding
    nonces: dict[int, dict[int, int]] = field(default_factory=dict)  # node -> {nonce: round}

    def check_nonce(self, node: int, nonce: int, server_round: int) -> None:
        """Refuse a payload whose nonce the node used in an earlier round (a replayed payload)."""
        used = self.nonces.setdefault(node, {})
        first = used.get(nonce)
        if first is not None and first != server_round:
            raise fedcomp.FedcompError(
                f"replay: this payload's nonce {nonce:#018x} was already used by node {node} in round {first}")
        used[nonce] = server_round
        while len(used) > NONCES_KEPT:
            used.pop(next(iter(used)))


class NoUsableReplies(fedcomp.FedcompError):
    """Too many consecutive rounds without a single usable reply: the run stops."""


class NonFiniteModel(fedcomp.FedcompError):
    """The aggregate has NaN or Inf values: the run stops instead of training on it."""


class MissingCompressionMod(fedcomp.FedcompError):
    """Replies carry no fedcomp payload: the ClientApp lacks ``compression_mod``."""


def summarize(statuses: list[str], limit: int = 3) -> str:
    """``"4 x error: ..., 1 x dropped: ..."``: the most frequent reasons first."""
    counts: dict[str, int] = {}
    for s in statuses:
        counts[s[:300]] = counts.get(s[:300], 0) + 1
    parts = [f"{n} x {s}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1])[:limit]]
    more = len(counts) - limit
    return "; ".join(parts) + (f"; and {more} other reasons" if more > 0 else "")


__all__ = ["RoundReplies", "ReplyHistory", "NoUsableReplies", "NonFiniteModel", "MissingCompressionMod", "summarize", "weight_of"]
