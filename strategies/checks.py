"""Reply checks: a hostile or broken client costs only its own reply.

Each train message carries a server token its reply must be bound to; one reply per node and
message is taken; a reply from a node that was sent no message, or without a fedcomp upload
record, is dropped; uploads are bounded by the configured codec's size; a reply built on a
reference the server never sent is dropped. The per-reply checks of the payload itself (tag,
nonce, norms, weights, metrics, running statistics) run in :class:`fedcomp.strategies.replies.RoundReplies`
with the guards built here (:mod:`fedcomp.strategies.guards`, threat model there).
"""

from __future__ import annotations

import secrets
from logging import WARNING

from flwr.common import log

from fedcomp import protocol as P
from fedcomp.aggregate import Accumulator
from fedcomp.strategies.guards import GuardHistory, RoundGuard, StateGuard, upload_bound
from fedcomp.strategies.part import Outgoing, Part, Reply, RoundState
from fedcomp.wire import REPLY_TOKEN, TOKEN_BITS


class ReplyChecks(Part):
    """Who may reply, with what; the guards' references across rounds."""

    def __init__(self) -> None:
        self.sent: dict[int, list[int]] = {}  # round -> nodes sent a train message (to record who never replied)
        self.unattributed: dict[int, list[str]] = {}  # round -> reasons of errors from nodes not messaged
        self.tokens: dict[int, dict[int, int]] = {}  # round -> node -> reply token sent with its train message
        self.bounds: dict[tuple, tuple[int, int]] = {}  # (upload spec, layout) -> (payload bytes, dense bytes) allowed
        self.guard_history = GuardHistory()  # the norms and weights the last aggregated round accepted
        self.state_guard: StateGuard | None = None  # per layout: running statistics and integer buffers

    def on_layout(self, layout) -> None:
        self.guard_history.clear()  # norms of another model say nothing about this one's
        guard = StateGuard(layout, Accumulator.offsets(layout))
        self.state_guard = guard if guard.active else None

    def on_train_message(self, out: Outgoing) -> None:
        """A fresh random token for this node's train message (:data:`fedcomp.wire.REPLY_TOKEN`): its
        reply must carry the tag binding its payload to it."""
        tokens = self.tokens.setdefault(out.round, {})
        tokens[out.node] = secrets.randbits(TOKEN_BITS)
        out.fields[REPLY_TOKEN] = tokens[out.node]

    def round_guard(self, server_round: int) -> RoundGuard:
        """The norm and weight guard of a round, against the last aggregated round's references."""
        upload, config = self.host.upload, self.host.config
        if self.guard_history.spec != upload.spec:  # another codec's norms (AdaptiveStrategy) say nothing
            self.guard_history.clear()
            self.guard_history.spec = upload.spec
        return RoundGuard(config.norm_factor, config.max_update_norm, config.norm_warmup, config.weight_factor,
                          quorum=len(self.sent.get(server_round, ())), history=self.guard_history)

    def upload_limit(self, record: dict) -> int | None:
        """Payload bytes a reply may have: the configured upload's size on this model (its bound
        where the size depends on the data), or the budget a client with a link reported, never more
        than a dense payload (:func:`fedcomp.strategies.guards.upload_bound`)."""
        layout = self.host.layout
        if layout is None:
            return None
        key = (self.host.upload.spec, layout)
        if key not in self.bounds:
            self.bounds[key] = upload_bound(self.host.upload.spec, layout)
        limit, dense = self.bounds[key]
        budget = record.get(P.BUDGET)
        if P.LINK in record and isinstance(budget, int) and not isinstance(budget, bool) and budget > limit:
            limit = min(budget, dense)
        return limit

    def admit(self, reply: Reply) -> bool:
        """One reply per node and message, from a node sent one, with an upload record; False: it
        stops here (recorded in the round's stats)."""
        state, node, stats = reply.state, reply.node, reply.state.stats
        msg = reply.msg
        if msg.has_error():
            if node in state.replied:
                return False  # one reply per node per message; an error after its reply changes nothing
            state.errors.append(msg)
            if node not in self.sent.get(state.round, (node,)):  # made by the SuperLink for a dead node
                self.unattributed.setdefault(state.round, []).append(msg.error.reason)
                return False
            state.replied.add(node)
            stats.clients.append({"node": node, "status": f"error: {msg.error.reason}"})
            return False
        entry = reply.entry
        sent = self.sent.get(state.round)
        foreign = sent is not None and node not in sent
        if foreign or node in state.replied:
            reason = (f"node {node} was sent no train message in round {state.round}" if foreign else
                      f"a second reply from node {node} in round {state.round} (one reply per node per message)")
            entry["status"] = f"dropped: {reason}"
            stats.extra.append(entry)
            log(WARNING, "fedcomp: dropping reply of node %s in round %s: %s", node, state.round, reason)
            return False
        state.replied.add(node)
        stats.clients.append(entry)
        if reply.record is None:
            state.unwrapped += 1
            entry["status"] = (f"dropped: reply has no {P.UPLOAD_RECORD!r} record (is compression_mod installed "
                               f"on the client?)")
            return False
        return True

    def check(self, reply: Reply) -> str | None:
        """Drop a train reply whose payload was built on a reference (tier, version, CRC) the server
        never sent (it trained from a model this server never sent: its update is not one of ours)."""
        record = reply.record
        if P.PAYLOAD not in record:
            return None
        try:
            held = (int(record[P.TIER]), int(record[P.REF_VERSION]), int(record[P.REF_CRC]))
        except (KeyError, TypeError, ValueError, OverflowError):
            unknown = ("reply reports no readable reference (tier, version, CRC): its update cannot be placed on a "
                       "model the server sent")
        else:
            if self.host._broadcasts.known(held):
                return None
            unknown = (f"reply was trained from a reference the server never sent (tier {held[0]}, version "
                       f"{held[1]}, CRC {held[2]:#010x}): a forged or corrupted broadcast; the node gets the full "
                       f"model next time")
        log(WARNING, "fedcomp: dropping reply of node %s in round %s: %s", reply.node, reply.state.round, unknown)
        return f"dropped: {unknown}"

    def on_round_end(self, state: RoundState) -> None:
        """Record a "no reply" entry for every node messaged that did not answer."""
        self.tokens.pop(state.round, None)
        stats = state.stats
        replied = {c["node"] for c in stats.clients}
        missing = [node for node in self.sent.pop(state.round, []) if node not in replied]
        unattributed = self.unattributed.pop(state.round, [])
        for node in missing:  # Flower hands over only what arrived before the round's timeout
            reason = f" ({unattributed[0]})" if len(missing) == len(unattributed) == 1 else ""
            stats.clients.append({"node": node, "status": f"no reply: timed out or node unavailable{reason}"})
