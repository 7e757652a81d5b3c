"""Broadcast tiers: what each train message carries instead of the model.

Each download tier keeps its own reference model and server-side error feedback
(:mod:`fedcomp.broadcast`); once per round every tier with clients moves its reference towards the
model with one encode, and each client gets the chain of steps since the reference it holds, or
the full reference on first contact and resyncs. With ``seeded_init`` a node never heard from
holds the round-0 model every node builds from the seed, so first contact is a chain too.
Replies report the reference they hold (tier, version, CRC) and the tier they want; a reply
asking for a resync is dropped and its node gets the full model next time.
"""

from __future__ import annotations

from logging import WARNING

from flwr.common import log

from fedcomp import protocol as P
from fedcomp.broadcast import Tier
from fedcomp.strategies.part import Model, Outgoing, Part, Reply


class Broadcasts(Part):
    """Download tiers: one encode per tier and round, a plan per client, references tracked per node."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[int, int, int]] = {}  # node -> (tier, version, crc) it reported
        self.want: dict[int, int] = {}  # node -> the tier it asked for
        self.unseeded: set[int] = set()  # nodes that asked for a resync: no seeded round-0 assumption
        self.restarted: set[tuple[int, int]] = set()  # (tier, version): started from the model after a failed encode

    # -- the round's references -------------------------------------------------------------------
    def start_tiers(self, model: Model) -> None:
        for tier in self.host.tiers:
            if tier.reference is None:  # all tiers start from the same model: early tier changes are cheap
                tier.start(model)

    def step_tiers(self, nodes: list[int], model: Model, server_round: int) -> int:
        """Move every tier with clients this round to ``server_round``; the number of encodes."""
        return sum(self.step_tier(self.host.tiers[tier], model, server_round)
                   for tier in sorted({self.want.get(node, 0) for node in nodes}))

    def step_tier(self, tier: Tier, model: Model, version: int) -> int:
        """Move a tier's reference to ``version`` (once: federated evaluation may have done it).

        An encode that fails (a codec bug) costs this round's compression, not the run: the tier
        restarts from the model itself, so its clients get the full model this round (logged with
        the reason), and steps again from there next round."""
        if tier.version >= version and tier.history and tier.history[-1].round == version:
            return 0
        if (tier.index, version) in self.restarted:
            return 0
        try:
            tier.step(model, version, self.host.config.seed)
        except Exception as exc:  # noqa: BLE001 - contained: the run goes on with the full model
            log(WARNING, "fedcomp: download tier %s could not encode its step to round %s with %r (%s: %s); its "
                "clients get the full model this round", tier.index, version, tier.codec.spec, type(exc).__name__, exc)
            tier.state = {}  # the codec state (warm start) may be half updated
            tier.start(model, version)
            self.restarted.add((tier.index, version))
            return 0
        return 1

    def restart(self, tier: Tier, model: Model, version: int) -> None:
        """Restart ``tier`` from ``model`` after a failed server-side encode (coupled download)."""
        tier.state = {}
        tier.start(model, version)
        self.restarted.add((tier.index, version))

    # -- per client -------------------------------------------------------------------------------
    def tier_of(self, node: int) -> Tier:
        return self.host.tiers[self.want.get(node, 0)]

    def holds(self, node: int, tier: Tier) -> tuple[int, int, int] | None:
        """The reference a node holds: what it reported; for a node never heard from, with
        ``seeded_init``, the round-0 model every node builds from the seed (a node that asked for
        a resync gets no such assumption: it gets the full model)."""
        held = self.held.get(node)
        if held is None and self.host.config.seeded_init and node not in self.unseeded:
            return tier.seeded()
        return held

    def plan_fields(self, plan, tier: Tier, server_round: int, arrays_key: str) -> dict:
        host = self.host
        return {
            P.SEEDED_INIT: host.config.seeded_init,
            P.MODE: plan.mode, P.PAYLOADS: list(plan.payloads), P.ROUNDS: list(plan.rounds),
            P.BASE_CRC: plan.base_crc, P.REF_CRC: plan.crc, P.TIER: plan.tier, P.TIERS: len(host.tiers),
            P.TIER_KBPS: host.tier_kbps, P.LAYOUT: host.layout.to_json(), P.DOWNLOAD_SPEC: tier.codec.spec,
            P.SEED: host.config.seed, P.ROUND: server_round, P.ARRAYS_KEY: arrays_key,
        }

    def on_train_message(self, out: Outgoing) -> None:
        tier = self.tier_of(out.node)
        plan = tier.plan(self.holds(out.node, tier))
        out.fields.update(self.plan_fields(plan, tier, out.round, out.arrays_key))
        out.download.update({"tier": plan.tier, "mode": plan.mode, "steps": len(plan.rounds)})

    # -- replies ----------------------------------------------------------------------------------
    def observe(self, reply: Reply) -> None:
        reply.notes["resync"] = self.track_reference(reply.record, reply.node)

    def check(self, reply: Reply) -> str | None:
        resync = reply.notes.get("resync")
        if resync is None:
            return None
        log(WARNING, "fedcomp: node %s asked for a full model in round %s: %s", reply.node, reply.state.round, resync)
        return f"resync: {resync}"

    def track_reference(self, record, node: int) -> str | None:
        """Note the tier, version and CRC of the broadcast reference a reply reports.

        Returns the client's reason when it asked for a resync. A report the server cannot
        confirm (another CRC, a version out of history) also means a full model next time.
        """
        if record is None:
            return None
        want = record.get(P.WANT_TIER)
        if isinstance(want, int) and 0 <= want < len(self.host.tiers):
            self.want[node] = want
        if P.RESYNC in record:
            self.held.pop(node, None)
            self.unseeded.add(node)  # it could not use the seeded model (or lost its state): full next time
            return str(record[P.RESYNC])
        try:
            held = (int(record[P.TIER]), int(record[P.REF_VERSION]), int(record[P.REF_CRC]))
        except (KeyError, TypeError, ValueError):
            self.held.pop(node, None)
            return None
        if self.known(held):
            self.held[node] = held
        else:
            self.held.pop(node, None)
            log(WARNING, "fedcomp: node %s reports a reference the server does not know %s; full model next time",
                node, held)
        return None

    def known(self, held: tuple[int, int, int]) -> bool:
        tiers = self.host.tiers
        return 0 <= held[0] < len(tiers) and tiers[held[0]].verify(held[1], held[2])
