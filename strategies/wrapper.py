"""``CompressedStrategy``: wrap any ``flwr.serverapp.strategy.Strategy`` with compressed transport.

Per training round:

1. The inner strategy samples nodes and builds its messages (model + config).
2. The wrapper encodes the model with the ``download`` codec once and replaces the model
   in every message by the payload plus what the client mod needs (layout, codec specs,
   seed, round); see :mod:`fedcomp.protocol`.
3. Replies carry the ``upload`` codec's payload of the client's update. The wrapper decodes
   each one (a reply that fails is dropped with its reason logged; the round goes on),
   rebuilds ``model_i = broadcast model + update_i`` and hands the inner strategy replies
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
        Codec spec of the broadcast model.
    error_feedback : bool (default: True)
        Clients keep what compression dropped in a residual and send it later.
    seed : int (default: 0)
        Run seed; with the round and node id it seeds random-k indices and stochastic rounding.
    """

    def __init__(
        self,
        inner: Strategy,
        upload: str = "topk(ratio=0.01)+qsgd(bits=4)",
        download: str = "none()",
        error_feedback: bool = True,
        seed: int = 0,
    ) -> None:
        self.inner = inner
        self.upload = fedcomp.build_codec(upload)  # fails here, before any round, on a bad spec
        self.download = fedcomp.build_codec(download)
        if self.upload.needs_error_feedback and not error_feedback:
            log(WARNING, "fedcomp: upload codec %s is biased; without error feedback it may not converge", upload)
        self.error_feedback = error_feedback
        self.seed = seed
        self.rounds: dict[int, RoundStats] = {}
        self._base: dict[str, torch.Tensor] = {}  # the model as clients decode it this round
        self._layout: fedcomp.Layout | None = None

    def summary(self) -> None:
        log(INFO, "fedcomp: upload %s, download %s, error feedback %s", self.upload.spec, self.download.spec,
            "on" if self.error_feedback else "off")
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
        broadcast = self.download.encode(model, nonce=fedcomp.derive_nonce(self.seed, server_round, 0))
        self._base = broadcast.decoded
        out = []
        for msg in messages:
            array_keys = list(msg.content.array_records)
            if len(array_keys) != 1:
                raise ValueError(f"CompressedStrategy expects one ArrayRecord per train message, got {array_keys}")
            dense_bytes = message_bytes(msg.content)
            content = RecordDict({k: v for k, v in msg.content.items() if k != array_keys[0]})
            content[P.DOWNLOAD_RECORD] = ConfigRecord({
                P.PAYLOAD: broadcast.payload,
                P.LAYOUT: self._layout.to_json(),
                P.UPLOAD_SPEC: self.upload.spec,
                P.DOWNLOAD_SPEC: self.download.spec,
                P.ERROR_FEEDBACK: self.error_feedback,
                P.SEED: self.seed,
                P.ROUND: server_round,
                P.ARRAYS_KEY: array_keys[0],
            })
            stats.download_bytes += message_bytes(content)
            stats.download_bytes_dense += dense_bytes
            out.append(Message(content=content, dst_node_id=msg.metadata.dst_node_id,
                               message_type=msg.metadata.message_type, group_id=msg.metadata.group_id))
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        stats = self.rounds.setdefault(server_round, RoundStats())
        dense_model_bytes = message_bytes(ArrayRecord(self._base)) if self._base else 0
        decoded_replies = []
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                stats.clients.append({"node": node, "status": f"error: {msg.error.reason}"})
                decoded_replies.append(msg)  # the inner strategy counts and logs failures
                continue
            wire = message_bytes(msg.content)
            entry = {"node": node, "upload_bytes": wire, "status": "ok"}
            stats.upload_bytes += wire
            try:
                content, other_bytes = self._decode_reply(msg.content)
            except (fedcomp.FedcompError, KeyError, TypeError) as exc:
                entry["status"] = f"dropped: {exc}"
                log(WARNING, "fedcomp: dropping reply of node %s in round %s: %s", node, server_round, exc)
                stats.clients.append(entry)
                continue
            stats.upload_bytes_dense += other_bytes + dense_model_bytes
            stats.clients.append(entry)
            msg.content = content
            decoded_replies.append(msg)
        return self.inner.aggregate_train(server_round, decoded_replies)

    def _decode_reply(self, content: RecordDict) -> tuple[RecordDict, int]:
        """The reply as the inner strategy expects it, and the bytes of its non-model records."""
        if P.UPLOAD_RECORD not in content.config_records:
            raise fedcomp.DecodeError(f"reply has no {P.UPLOAD_RECORD!r} record (is compression_mod installed on the client?)")
        if self._layout is None:
            raise fedcomp.DecodeError("reply arrived before any broadcast")
        record = content.config_records[P.UPLOAD_RECORD]
        payload = record[P.PAYLOAD]
        if not isinstance(payload, bytes):
            raise fedcomp.DecodeError(f"payload must be bytes, got {type(payload).__name__}")
        delta = self.upload.decode(payload, self._layout)
        for name, t in delta.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise fedcomp.FedcompError(f"update of {name!r} has NaN or Inf values")
        model = {name: (self._base[name].float() + delta[name].float()).to(self._base[name].dtype)
                 if self._base[name].is_floating_point() else self._base[name] + delta[name]
                 for name in self._layout.names}
        rest = RecordDict({k: v for k, v in content.items() if k != P.UPLOAD_RECORD})
        other_bytes = message_bytes(rest)
        rest[str(record[P.ARRAYS_KEY])] = ArrayRecord(model)
        return rest, other_bytes

    # -- federated evaluation: passed through uncompressed (the project's app evaluates centrally) --
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)
