"""Federated evaluation through the download tiers, counted.

A client whose mod announced it handles evaluate broadcasts gets its tier's next reference (what
it will train from next round: one encode per tier, reused by the next training round) as a
chain or in full instead of the model; others get the dense model. Messages and replies are
counted in :class:`fedcomp.strategies.RoundStats`.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

import fedcomp
from fedcomp import protocol as P
from fedcomp.msgsize import message_bytes
from fedcomp.strategies.part import Part, Reply
from fedcomp.strategies.stats import RoundStats


class Evaluation(Part):
    """Evaluate messages through the tiers for capable clients; evaluate replies counted."""

    def __init__(self) -> None:
        self.capable: set[int] = set()  # nodes whose mod handles evaluate broadcasts

    def observe(self, reply: Reply) -> None:
        caps = reply.record.get(P.CAPABILITIES)
        if isinstance(caps, list) and P.EVALUATE_CAPABILITY in caps:
            self.capable.add(reply.node)

    def configure(self, server_round: int, messages: list[Message], arrays: ArrayRecord) -> list[Message]:
        host, broadcasts = self.host, self.host._broadcasts
        stats = host.rounds.setdefault(server_round, RoundStats())
        model = dict(arrays.to_torch_state_dict())
        compressible = (host.config.compress_evaluate and host.layout is not None
                        and fedcomp.Layout.of(model) == host.layout)
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            dense_bytes = message_bytes(msg.content)
            array_keys = list(msg.content.array_records)
            mode = "dense"
            if compressible and node in self.capable and len(array_keys) == 1:
                tier = broadcasts.tier_of(node)
                stats.encodes += broadcasts.step_tier(tier, model, server_round + 1)
                plan = tier.plan(broadcasts.holds(node, tier))
                content = RecordDict({k: v for k, v in msg.content.items() if k != array_keys[0]})
                content[P.DOWNLOAD_RECORD] = ConfigRecord({
                    **broadcasts.plan_fields(plan, tier, server_round + 1, array_keys[0]), P.KIND: "evaluate"})
                msg = Message(content=content, dst_node_id=node, message_type=msg.metadata.message_type,
                              group_id=msg.metadata.group_id)
                mode = plan.mode
            nbytes = message_bytes(msg.content)
            stats.evaluate_download_bytes += nbytes
            stats.evaluate_download_bytes_dense += dense_bytes
            stats.evaluate_clients.append({"node": node, "mode": mode, "download_bytes": nbytes})
            out.append(msg)
        return out

    def replies(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies the inner strategy aggregates: counted, resync requests left out, the
        fedcomp record taken off."""
        stats = self.host.rounds.setdefault(server_round, RoundStats())
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
                record = msg.content.config_records.get(P.UPLOAD_RECORD)
                resync = self.host._broadcasts.track_reference(record, msg.metadata.src_node_id)
                if resync is not None:
                    if entry is not None:
                        entry["status"] = f"resync: {resync}"
                    continue
                msg.content = RecordDict({k: v for k, v in msg.content.items() if k != P.UPLOAD_RECORD})
            passed.append(msg)
        return passed
