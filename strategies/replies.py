"""Reply handling of ``CompressedStrategy``: count, check, decode and add one reply at a time.

A :class:`RoundReplies` lives for one training round. For every reply that carries a fedcomp
payload it

1. reads the weight (the inner strategy's ``weighted_by_key``, ``num-examples`` by default)
   and checks it (:func:`fedcomp.aggregate.check_weight`: finite, > 0, at most ``max_weight``);
2. refuses a replay (a payload nonce the node used in an earlier round, or a ``reply-round``
   other than this round);
3. decodes and checks the payload with the core (:class:`fedcomp.aggregate.Accumulator` or
   :class:`fedcomp.server_feedback.ServerFeedback`), adds back delta coding's reference;
4. offers the update's norm to the round's :class:`fedcomp.aggregate.NormGuard` and, once it
   is accepted, adds it to the aggregate: the running weighted sum (weighted-mean strategies),
   the server-feedback sketch sum (FetchSGD), or ``model_i = base + update_i`` handed to the inner strategy
   (strategies that need every model: FedMedian, Krum...).

A reply that fails any step is dropped with its reason in ``entry["status"]``; the round goes
on. Replies deferred by the guard's warm-up are decoded again when decided (sparse and sketch
updates are kept instead: they are small), so memory stays one decoded reply.
"""

from __future__ import annotations

from logging import WARNING
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.common import log

import fedcomp
from fedcomp import protocol as P
from fedcomp.aggregate import Accumulator, NormGuard, apply_step, check_weight
from fedcomp.budget import same_family
from fedcomp.server_feedback import ServerFeedback
from fedcomp.msgsize import message_bytes
from fedcomp.wire import HEADER, HEADER_BYTES

NONCES_KEPT = 64  # per node: payload nonces remembered to refuse replays


def weight_of(content: RecordDict, key: str):
    """The reply's weight metric (raw: checked by :func:`check_weight`)."""
    for record in content.metric_records.values():
        if key in record:
            return record[key]
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
    guard: NormGuard
    config: object  # CompressionConfig
    upload: object  # the configured upload codec
    weight_key: str
    history: "ReplyHistory"
    on_accept: Callable[[int, dict, int], None]  # (node, entry, dense-equivalent bytes of the reply)
    dense_model_bytes: int = 0
    pending: list[_Valid] = field(default_factory=list)
    collected: list[Message] = field(default_factory=list)  # collect mode: rebuilt replies
    metrics: list[RecordDict] = field(default_factory=list)  # mean / sketch mode: the replies' other records
    payloads: int = 0  # replies that carried a fedcomp payload record

    # -- one reply ----------------------------------------------------------------------------
    def handle(self, msg: Message, entry: dict) -> None:
        """Check, decode and (now or after the guard's warm-up) add one reply that carries an upload record."""
        node = msg.metadata.src_node_id
        self.payloads += 1
        try:
            valid = self._check(msg, node, entry)
        except (fedcomp.FedcompError, KeyError, TypeError) as exc:
            self._drop(entry, f"reply lacks the key {exc}" if isinstance(exc, KeyError) else str(exc), node)
            return
        verdict = self.guard.offer(valid.norm)
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
        weight = check_weight(weight_of(rest, self.weight_key), self.config.max_weight)
        answered = record.get(P.REPLY_ROUND)
        if answered is not None and answered != self.round:
            raise fedcomp.FedcompError(f"replay: the payload answers round {answered}, this is round {self.round}")
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
        return _Valid(node, msg, rest, weight, norm, entry, update, payload, codec, str(record[P.ARRAYS_KEY]))

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
        try:
            self._commit(valid)
        except fedcomp.FedcompError as exc:
            self._drop(valid.entry, str(exc), valid.node)
            return
        valid.entry["status"] = "ok"
        self.on_accept(valid.node, valid.entry, message_bytes(valid.rest) + self.dense_model_bytes)

    def _commit(self, valid: _Valid) -> None:
        update = valid.update
        if update is None:  # deferred dense reply: decode again
            update = self.accumulator.decode(valid.payload, round=self.round, codec=valid.codec)
        if self.mode == "sketch":
            self.feedback.add_values(update, valid.weight)
            self.metrics.append(valid.rest)
        elif self.mode == "mean":
            self.accumulator.add_update(update, valid.weight)
            self.metrics.append(valid.rest)
        else:
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
        """Decide the replies still waiting for the guard's warm-up; the number of replies aggregated."""
        self._settle()
        return self.count_aggregated()


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
