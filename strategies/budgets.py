"""Bandwidth budgets and simulated time (``link_profile``, ``round_deadline_s``; :mod:`fedcomp.links`).

Train messages carry the run's link profile, deadline and fallback; clients with a link fit their
reply to its byte budget and report the concrete spec, link, budget and status they used. The
server records per client bytes, budget, status and simulated times, drops a reply past its
client's deadline, and sets the round's ``sim_time_s``.
"""

from __future__ import annotations

from logging import WARNING

from flwr.common import log

from fedcomp import links
from fedcomp import protocol as P
from fedcomp.strategies.part import Outgoing, Part, Reply, RoundState


class Budgets(Part):
    """Link fields out; per-reply timing, the late drop and the round's simulated time in."""

    def on_train_message(self, out: Outgoing) -> None:
        config = self.host.config
        out.fields.update({P.LINK_PROFILE: config.link_profile, P.DEADLINE: config.round_deadline_s,
                           P.FALLBACK: config.budget_fallback})

    def observe(self, reply: Reply) -> None:
        stats = reply.state.stats
        sent = next((d["download_bytes"] for d in stats.downloads if d["node"] == reply.node), 0)
        timing = self.timing(reply.record, reply.node, reply.wire, sent)
        reply.notes["timing"] = timing
        if timing is not None:
            stats.links.append(timing)

    def check(self, reply: Reply) -> str | None:
        timing = reply.notes.get("timing")
        if timing is not None and (timing["late"] or timing["status"] == "too-small-skipped"):
            return "late" if timing["late"] else timing["status"]
        return None

    def on_round_end(self, state: RoundState) -> None:
        stats = state.stats
        if stats.links:
            stats.sim_time_s, _ = links.round_time({t["node"]: t["total_s"] for t in stats.links},
                                                   {t["node"]: t["deadline_s"] for t in stats.links})

    @staticmethod
    def timing(record, node: int, wire: int, download_bytes: int) -> dict | None:
        """Simulated times of one reply whose client reported a link (None: no link reported).

        download = the bytes this node was sent / downlink + latency; compute as the client
        timed it (decode, training, encode); upload = the reply's bytes / uplink + latency.
        Status: ``too-small-skipped`` / ``too-small-coarsest`` as the client reported, else
        ``over-budget`` or ``ok``; ``late``: past the client's deadline (dropped at it).
        """
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
