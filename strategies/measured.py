"""``MeasuredLinkStrategy``: upload budgets from links the server measures, not links nodes declare.

Wraps a :class:`CompressedStrategy` (or an :class:`AdaptiveStrategy`) and sits between it and
Flower's grid (:class:`ObservingGrid`), so it sees every train message leave and every reply come
back. Per node it keeps a :class:`fedcomp.adapt.MeasuredBudgets` estimate (uplink and downlink
kbps, latency: :class:`fedcomp.adapt.LinkEstimator`), and each round:

1. Before a train message leaves, the estimate goes into its download record
   (:data:`fedcomp.links.ESTIMATE`, node-config text such as ``uplink-kbps=512.3 downlink-kbps=4012
   latency-ms=81.2 deadline-s=1.5``, margins folded in). ``compression_mod`` budgets from it when the
   node declares no link (node-config link keys or the run's link-profile win); it measures its own
   compute as always. First contact: a probe of ``first`` bytes (4 kB) whatever the link, and the
   most compressed download tier; then slow start (each upload at most ``growth`` x the largest
   one seen) until the upload latency is fitted. The bytes the estimate adds to the broadcast are
   counted in the round's download bytes.
2. When the reply arrives, the transfer times go to the estimator:

   * deployment (wall clocks): download = the client's ``received-at`` (its mod's clock when the
     broadcast reached it) - the server's push time; upload = the arrival at the ServerApp - the
     client's ``received-at`` - its measured compute (decode, training, encode). Both include
     Flower's own delays (SuperNode polling, ClientApp start), which is what a deadline sees;
     clocks are assumed synchronised (NTP: milliseconds), a skew moves time from one direction
     to the other. Where the client reports its process start (``process-started-at``) between the
     push and ``received-at`` (a deployment: one ClientApp process per message), the record splits
     the download into ``process_start_s`` (push to process start) and ``startup_s`` (process
     start to ``received-at``). The process start does not end the download: Flower 1.39's
     SuperNode creates the ClientApp's task, and the SuperExec starts its process, before the
     message's arrays are pulled (the ClientApp then waits for them), so it marks about the
     download's start.
   * simulation: a simulated network (``fedcomp.simulations.netsim``) adds the hidden link's
     transfer times to the reply (:data:`fedcomp.links.NETSIM_RECORD`); this observer takes them
     out before the wrapped strategy counts or decodes the reply, and records the true times,
     the true deadline check and the budget the hidden link would give if declared.

``estimates`` holds per node and round what was sent, what was observed, the estimate after the
observation, the client's budget, the budget the estimate gives on the client's measured compute and,
in simulation, the declared-link budget on the same compute and the relative error.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord
from flwr.common.constant import ErrorCode
from flwr.server import Grid
from flwr.serverapp.strategy import Strategy

from fedcomp import links
from fedcomp import protocol as P
from fedcomp.adapt import AdaptError, MeasuredBudgets
from fedcomp.msgsize import message_bytes
from fedcomp.strategies.streaming import DelegatingGrid

MIN_SECONDS = 1e-3  # an observed transfer shorter than this (clock resolution, skew) counts as this


def _wire(record, key: str, seconds: float) -> float | None:
    """A SuperNode's wire time of a transfer (None where it has none); at most the calls' ``seconds``
    and at least :data:`MIN_SECONDS`."""
    if key not in record:
        return None
    return min(max(float(record[key]), MIN_SECONDS), seconds)


@dataclass
class _Sent:
    round: int
    link: links.Link
    download_bytes: int
    pushed_at: float


class ObservingGrid(DelegatingGrid):
    """A Grid that adds each node's estimate to its train messages and times their replies, in
    ``push_messages``/``pull_messages`` (``send_and_receive`` goes through them: a non-streaming
    strategy's replies are timed as they arrive too); everything else is delegated."""

    def __init__(self, grid: Grid, owner: "MeasuredLinkStrategy", poll_interval: float = 0.05,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(grid, poll_interval)
        self.owner, self.clock = owner, clock

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        nodes = [self.owner._annotate(msg) for msg in messages]
        now = self.clock()
        ids = list(self.grid.push_messages(messages))
        for mid, sent in zip(ids, nodes):
            if sent is not None:
                sent[1].pushed_at = now
                self.owner._sent[mid] = sent
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.grid.pull_messages(message_ids))
        now = self.clock()
        return [self.owner._observe(msg, now) for msg in replies]


class MeasuredLinkStrategy(Strategy):
    """Budget each node's upload from its measured link (see the module docstring).

    Parameters
    ----------
    inner : CompressedStrategy or AdaptiveStrategy
        The compressing strategy; its ``upload`` codec needs a free parameter (budgets move it)
        and ``aggregation='decode'``.
    deadline_s : float
        The round deadline the budgets must meet (> 0): the run's ``round_deadline_s``.
    z, first, growth, prior
        :class:`fedcomp.adapt.MeasuredBudgets` settings (margin in standard errors, first
        contact's probe bytes, slow-start growth, the relative error assumed before 3 transfers).
    """

    def __init__(self, inner: Strategy, deadline_s: float, *, z: float = 1.0, first: int = 4096,
                 growth: float = 4.0, prior: float = 0.1) -> None:
        compressed = getattr(inner, "compressed", inner)
        if not hasattr(compressed, "rounds") or not hasattr(compressed, "aggregation"):
            raise AdaptError(f"MeasuredLinkStrategy wraps a CompressedStrategy or AdaptiveStrategy, got "
                             f"{type(inner).__name__}")
        if compressed.aggregation == "sketch":
            raise AdaptError("measured-link budgets need aggregation='decode': budgets give clients sketches of "
                             "different cols, which cannot be summed in sketch space")
        self.inner, self.compressed = inner, compressed
        self.budgets = MeasuredBudgets(float(deadline_s), z=z, first=first, growth=growth, prior=prior)
        self.estimates: list[dict] = []
        self._sent: dict[str, tuple[int, _Sent]] = {}  # message id -> (node, what was sent)
        self._compute: dict[int, float] = {}  # node -> its last reported compute seconds
        # node -> (message its last reply answered, that round's wall seconds less its link download)
        self._last_reply: dict[int, tuple[str, float]] = {}

    # -- delegated --------------------------------------------------------------------------------
    def __getattr__(self, name):  # rounds, history, strength_of, auto, upload... of the wrapped strategy
        if name in ("inner", "compressed"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def summary(self) -> None:
        self.inner.summary()

    def estimates_of(self, server_round: int) -> list[dict]:
        """The per-node records of ``server_round`` (one per reply from a node that was sent an estimate)."""
        return [e for e in self.estimates if e["round"] == server_round]

    def true_round_time(self, server_round: int) -> float | None:
        """Simulation: the round's duration on the hidden links (the slowest node, or the deadline
        when nodes were past it); None without a simulated network."""
        rows = [e for e in self.estimates_of(server_round) if "true_total_s" in e]
        if not rows:
            return None
        return links.round_time({e["node"]: e["true_total_s"] for e in rows}, self.budgets.deadline_s)[0]

    def start(self, grid: Grid, *args, **kwargs):
        """The wrapped strategy's loop, through an :class:`ObservingGrid`."""
        return self.inner.start(ObservingGrid(grid, self), *args, **kwargs)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        return self.inner.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)

    # -- the observer -------------------------------------------------------------------------------
    def _annotate(self, msg: Message) -> tuple[int, _Sent] | None:
        """Add the node's estimate to a train message (counted in the round's download bytes)."""
        if not msg.has_content() or msg.metadata.message_type.split(".")[0] != "train":
            return None
        record = msg.content.config_records.get(P.DOWNLOAD_RECORD)
        if record is None or record.get(P.KIND) == "evaluate":
            return None
        node = msg.metadata.dst_node_id
        server_round = int(record[P.ROUND])
        before = message_bytes(msg.content)
        link = self.budgets.link(node, download_bytes=before, compute_s=self._compute.get(node, 0.0))
        record[links.ESTIMATE] = link.describe()
        added = message_bytes(msg.content) - before
        stats = self.compressed.rounds.get(server_round)
        if stats is not None:
            stats.download_bytes += added
            for d in stats.downloads:
                if d["node"] == node:
                    d["download_bytes"] += added
                    stats.download_bytes_by_tier[d["tier"]] = stats.download_bytes_by_tier.get(d["tier"], 0) + added
        return node, _Sent(server_round, link, before + added, 0.0)

    def _observe(self, msg: Message, arrival: float) -> Message:
        """Record one reply's transfer times and update the node's estimate. Returns the reply, or,
        in simulation, an error reply in its place when the hidden link's times put it past the
        deadline: on that link it would have missed the round, so it is not aggregated."""
        sent = self._sent.pop(msg.metadata.reply_to_message_id, None)
        if sent is None:
            return msg
        self._record(msg, arrival, *sent)
        entry = self.estimates[-1]
        if not entry.get("late"):
            return msg
        reason = (f"late: {entry['true_total_s']:.2f} s on its simulated link ({entry['true_link']}) against the "
                  f"{self.budgets.deadline_s:g} s deadline; dropped as the deadline would have dropped it")
        return Message(metadata=copy.copy(msg.metadata), error=Error(ErrorCode.UNKNOWN, reason))

    def _record(self, msg: Message, arrival: float, node: int, s: _Sent) -> None:
        entry: dict = {"node": node, "round": s.round, "sent_link": s.link.describe(),
                       "download_bytes": s.download_bytes}
        self.estimates.append(entry)
        if msg.has_error():
            entry["status"] = "error"
            return
        netsim = msg.content.config_records.get(links.NETSIM_RECORD)
        if netsim is not None:  # the simulated network's times: not part of what the client sent
            del msg.content[links.NETSIM_RECORD]
        record = msg.content.config_records.get(P.UPLOAD_RECORD)
        wire = message_bytes(msg.content)
        entry.update(upload_bytes=wire, status="ok")
        if record is None:
            entry["status"] = "no fedcomp record"
            return
        compute_s = float(record.get(P.COMPUTE_S, 0.0))
        budget = int(record.get(P.BUDGET, -1))
        self._compute[node] = compute_s
        entry.update(budget=None if budget < 0 else budget, compute_s=compute_s,
                     budget_status=str(record.get(P.BUDGET_STATUS, "ok")))
        if netsim is not None:
            down_s, up_s = float(netsim["down-s"]), float(netsim["up-s"])
        elif links.RECEIVED_AT in record:
            received = float(record[links.RECEIVED_AT])
            down_s, up_s = received - s.pushed_at, arrival - received - compute_s
            started = float(record.get(links.STARTED_AT, -math.inf))
            if s.pushed_at < started <= received:  # a process for this message (a deployment): where the time went
                entry.update(process_start_s=started - s.pushed_at, startup_s=received - started)
            if links.LINK_DOWN_S in record:  # the node's SuperNode timed its link: estimate from that
                self._record_link(msg, record, entry, node, s, wall_s=down_s + up_s)
                return
        else:  # the node budgets from a link it declares: nothing to split the round trip with
            entry["status"] = "declared link" if P.LINK in record else "no link"
            return
        down_s, up_s = max(down_s, MIN_SECONDS), max(up_s, MIN_SECONDS)
        self.budgets.observe(node, up_bytes=wire, up_s=up_s, down_bytes=s.download_bytes, down_s=down_s)
        up = self.budgets.estimator.estimate(node, "up")
        down = self.budgets.down_estimate(node)
        entry.update(observed_down_s=down_s, observed_up_s=up_s,
                     est_up_kbps=up[0], est_up_latency_s=up[1], est_down_kbps=down[0], est_down_latency_s=down[1])
        estimated = self._estimated_budget(entry, s, compute_s)
        if netsim is not None:
            true = links.with_deadline(links.link_from_mapping(
                dict(kv.split("=", 1) for kv in str(netsim["link"]).split()), "simulated link"),
                self.budgets.deadline_s)
            t = links.client_time(true, s.download_bytes, wire, compute_s)
            declared = min(links.upload_budget(true, s.download_bytes, compute_s), self._cap())
            entry.update(true_link=str(netsim["link"]), true_total_s=t.total_s, late=t.total_s > true.deadline_s,
                         declared_budget=declared,
                         error=(entry["estimated_budget"] / declared - 1) if declared and estimated is not None
                         else None)

    def _record_link(self, msg: Message, record, entry: dict, node: int, sent: _Sent, wall_s: float) -> None:
        """Observe the transfers a node's SuperNode timed on its link (``fedcomp.clients.supernode``):
        this broadcast's pull now, the node's previous reply's push (it ends after that reply left,
        so it comes with this one), and as the node's overhead the rest of that previous round:
        its wall time from push to arrival, less its compute and both link transfers. Where the
        SuperNode timed a transfer's bytes on the wire, the estimator's rate comes from that. A
        reply in time lets slow start grow from its size before its push is timed."""
        down_bytes, down_s = int(record[links.LINK_DOWN_BYTES]), max(float(record[links.LINK_DOWN_S]), MIN_SECONDS)
        down_wire = _wire(record, links.LINK_DOWN_WIRE_S, down_s)
        up_bytes = up_s = up_wire = None
        previous = self._last_reply.get(node)
        if previous is not None and str(record.get(links.LINK_UP_OF, "")) == previous[0]:
            up_bytes = int(record[links.LINK_UP_BYTES])
            up_s = max(float(record[links.LINK_UP_S]), MIN_SECONDS)
            up_wire = _wire(record, links.LINK_UP_WIRE_S, up_s)
            self.budgets.observe_overhead(node, previous[1] - up_s)
        self._last_reply[node] = (msg.metadata.reply_to_message_id, wall_s - down_s)
        self.budgets.observe(node, up_bytes=up_bytes, up_s=up_s, down_bytes=down_bytes, down_s=down_s,
                             up_wire_s=up_wire, down_wire_s=down_wire)
        if wall_s + entry["compute_s"] <= self.budgets.deadline_s:  # slow start grows before the push is timed
            self.budgets.observe_arrival(node, entry["upload_bytes"])
        up = self.budgets.estimator.estimate(node, "up")
        down = self.budgets.down_estimate(node)
        entry.update(timed_by="supernode", observed_down_s=down_s, link_down_bytes=down_bytes,
                     observed_up_s=up_s, link_up_bytes=up_bytes, wire_down_s=down_wire, wire_up_s=up_wire, wall_s=wall_s,
                     overhead_s=self.budgets.overhead_s(node), est_down_kbps=down[0], est_down_latency_s=down[1],
                     est_up_kbps=None if up is None else up[0], est_up_latency_s=None if up is None else up[1])
        self._estimated_budget(entry, sent, entry["compute_s"])

    def _estimated_budget(self, entry: dict, sent: _Sent, compute_s: float) -> int | None:
        """Record what the link sent gives on the client's measured compute (capped at the dense
        reply: :meth:`_cap`) as ``estimated_budget``; returns the uncapped budget (None: unbudgeted)."""
        estimated = links.upload_budget(sent.link, sent.download_bytes, compute_s)
        entry["estimated_budget"] = None if estimated is None else min(estimated, self._cap())
        return estimated

    def _cap(self) -> int:
        """Budgets compared up to the dense reply (above it every codec saturates)."""
        dense = int(getattr(self.compressed, "_dense_model_bytes", 0) or 0)
        return dense + 1024 if dense else 2**62


__all__ = ["MeasuredLinkStrategy", "ObservingGrid"]
