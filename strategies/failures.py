"""Failures are loud: a run stops with a reason instead of finishing at chance.

A round whose replies carry no fedcomp payload raises :class:`MissingCompressionMod`;
``max_failed_rounds`` consecutive rounds without a usable reply, or a run in which no reply ever
reached the aggregate, raise :class:`NoUsableReplies` with the clients' errors summarised; a
global model with NaN, Inf or a negative running variance raises :class:`NonFiniteModel`.
"""

from __future__ import annotations

from logging import WARNING

import torch
from flwr.app import ArrayRecord
from flwr.common import log

from fedcomp import protocol as P
from fedcomp.strategies.part import Part, RoundState
from fedcomp.strategies.replies import MissingCompressionMod, NonFiniteModel, NoUsableReplies, summarize
from fedcomp.strategies.stats import RoundStats
from fedcomp.tensor_kinds import STATISTIC, split_kinds


class Failures(Part):
    """Stop the run on a missing mod, too many failed rounds, or a non-finite model."""

    def __init__(self) -> None:
        self.failed_rounds: list[int] = []  # consecutive rounds without a usable reply
        self.aggregated_rounds = 0

    def on_round_end(self, state: RoundState) -> None:
        self.check_wrapped(state)
        if state.stats.aggregated:
            self.failed_rounds.clear()
            self.aggregated_rounds += 1
            return
        stats, server_round, limit = state.stats, state.round, self.host.config.max_failed_rounds
        self.failed_rounds.append(server_round)
        statuses = [c["status"] for c in stats.clients]
        log(WARNING, "fedcomp: no usable replies in round %s (%d of %d consecutive rounds allowed): %s", server_round,
            len(self.failed_rounds), limit, summarize(statuses) or "no replies")
        if len(self.failed_rounds) >= limit:
            first = self.failed_rounds[0]
            raise NoUsableReplies(
                f"fedcomp: {len(self.failed_rounds)} consecutive rounds ({first}-{server_round}) without a usable "
                f"reply; the model has not changed since round {first - 1}. Round {server_round}'s clients: "
                f"{summarize(statuses) or 'no replies (no node sampled or all timed out)'}. "
                f"(max_failed_rounds={limit}; raise it to tolerate longer outages)")

    def check_wrapped(self, state: RoundState) -> None:
        """A round with replies but not one fedcomp payload record: the clients lack compression_mod."""
        if state.replies is not None and state.replies.payloads:
            return
        errors = [m.error.reason or "" for m in state.errors]
        key = state.arrays_key or "arrays"
        # without the mod the model never reaches the user's code: it fails looking the record up
        looks_unwrapped = state.unwrapped > 0 or (errors and all("KeyError" in e and f"'{key}'" in e for e in errors))
        if not looks_unwrapped:
            return
        raise MissingCompressionMod(
            f"fedcomp: no reply of round {state.round} carries a fedcomp payload ('{P.UPLOAD_RECORD}' record): the "
            f"ClientApp does not use compression_mod. CompressedStrategy sends the model compressed, and only "
            f"compression_mod turns it back into the '{key}' ArrayRecord your train function reads and compresses "
            f"the reply. Add it to the ClientApp: `from fedcomp.clients import compression_mod`, then "
            f"`app = ClientApp(mods=[compression_mod])`. "
            f"Replies: {summarize([c['status'] for c in state.stats.clients])}")

    def on_aggregated(self, state: RoundState, arrays: ArrayRecord | None) -> None:
        """Stop the run when the new global model has NaN or Inf values (every reply is checked,
        but a finite sum can still overflow or a server step diverge): training on from it would
        finish at chance with nothing said."""
        if arrays is None:
            return
        host, server_round = self.host, state.round
        model = arrays.to_torch_state_dict()
        bad = [name for name, t in model.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        negative = [name for name in split_kinds(model)[STATISTIC]
                    if name.endswith("running_var") and bool((model[name] < 0).any())]
        if negative:  # BatchNorm takes the square root: NaN activations from here on, at chance
            raise NonFiniteModel(
                f"fedcomp: the global model of round {server_round} has a negative running variance in "
                f"{negative[:5]} (aggregation {host.aggregation!r}, upload {host.upload.spec!r}); the run stops. "
                + (f"The statistics travelled exact: the inner strategy {type(host.inner).__name__}'s own "
                   f"aggregation of them made it negative" if host._aggregate.statistics_layout is not None else
                   "Keep exact_statistics=True (the default) and no link budgets for a BatchNorm model"))
        if bad:
            raise NonFiniteModel(
                f"fedcomp: the global model of round {server_round} has NaN or Inf values in {bad[:5]}"
                f"{' and more' if len(bad) > 5 else ''} (aggregation {host.aggregation!r}, upload "
                f"{host.upload.spec!r}, {state.stats.aggregated} replies aggregated); the run stops. Lower the "
                f"learning rate, set max_update_norm, or use a larger sketch (cols) / more bits")

    def on_run_end(self, rounds: dict[int, RoundStats]) -> None:
        if rounds and not self.aggregated_rounds:
            last = rounds[max(rounds)]
            raise NoUsableReplies(
                f"fedcomp: no reply reached the aggregate in any of the run's {len(rounds)} rounds; the model is "
                f"the initial one. Last round: {summarize([c['status'] for c in last.clients]) or 'no replies'}")
