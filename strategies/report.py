"""Report: one INFO line at the end of a run with what it cost on the wire (:func:`fedcomp.strategies.stats.bytes_summary`)."""

from __future__ import annotations

from logging import INFO

from flwr.common import log

from fedcomp.strategies.part import Part
from fedcomp.strategies.stats import RoundStats, bytes_summary


class Report(Part):
    """Log the run's bytes summary when ``start`` ends (a wrapped user app gets it for free)."""

    def on_run_end(self, rounds: dict[int, RoundStats]) -> None:
        if rounds:
            log(INFO, "%s", bytes_summary(rounds))
