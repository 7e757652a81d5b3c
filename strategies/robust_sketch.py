"""Robust aggregation in sketch space: the user's robust strategy over the clients' count sketches.

A robust aggregator (FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan) needs every client's value
of the same coordinates. Sparse uploads do not give it that (each client sends its own top-k; the
median of mostly zeros is zero), which is why these strategies used to get a dense 4-bit upload
(7.9x). Count sketches do: every client hashes with the same seed, so cell ``c`` of every client's
table is the same signed sum of coordinates, and a sketch is linear. This feedback keeps each
client's dequantized table instead of summing them, hands the tables to the inner strategy's own
``aggregate_train`` as if they were models, and takes what it returns as the round's table for
FetchSGD's server step (momentum and error accumulation in sketch space, heavy hitters applied):

* coordinate-wise statistics (median, trimmed mean) become cell-wise statistics: an attacker
  moves a cell's median no more than a coordinate's;
* distance-based selection (Krum, MultiKrum, Bulyan) compares tables: a count sketch preserves
  inner products in expectation, so the client closest to the others stays the closest.

These strategies' aggregates are translation equivariant (``agg(m + x_i) = m + agg(x_i)``), so
aggregating the clients' update tables is aggregating their models. The entries that travel
exact beside the sketch (running statistics, counters) go through the same aggregate.
"""

from __future__ import annotations

import re

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Bulyan, FedMedian, FedTrimmedAvg, Krum, MultiKrum, Strategy

from fedcomp.errors import DecodeError
from fedcomp.layout import Layout
from fedcomp.server_feedback import ServerFeedback
from fedcomp.strategies.config import (RECURRENT_SKETCH_RATIO, ROBUST_SERVER_MOMENTUM, ROBUST_SKETCH_RATIO,
                                       SELECTING_SKETCH_RATIO, SKETCH_RATIO, SKETCH_SERVER_MOMENTUM)

# aggregate_train of these is translation equivariant and reads nothing but the replies' arrays and
# weights: it can aggregate the clients' update tables directly
SKETCH_ROBUST = (FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan)
# selecting strategies (one or a few clients win a round): with a fraction of the clients a round,
# server momentum carries a round an attacker won into the next ones; without it their robustness
# held (docs: Results, Robust strategies under attack)
SELECTING = (Krum, MultiKrum, Bulyan)
_RECURRENT = re.compile(r"(^|\.)weight_hh_l\d+(_reverse)?$")  # torch.nn.RNNBase's parameter names


def robust_in_sketch_space(strategy: Strategy, partial: bool = False) -> bool:
    """True for the strategies whose aggregate this module computes over sketches (exact types and
    subclasses of :data:`SKETCH_ROBUST`), in every regime (``partial``: a fraction of the nodes a
    round; see :func:`robust_momentum`)."""
    return isinstance(strategy, SKETCH_ROBUST)


def robust_share(strategy: Strategy, partial: bool, recurrent: bool = False) -> float:
    """The heavy hitters' share of a robust strategy's sketch (``upload='auto'``): 0.1 for the
    selecting ones (:data:`SELECTING`: one client's table a round) in every regime (in cross-device
    the averaging strategies' 0.007 lost 3 points for Krum, 0.1 gained 2.8 at 58x downloads: docs,
    Results, Regimes); for the others 0.05, or with a fraction of the nodes a round the averaging
    strategies' share; every node every round on a model with recurrent layers (``recurrent``)
    0.1, as the averaging strategies there (:data:`~fedcomp.strategies.config.RECURRENT_SKETCH_RATIO`)."""
    if isinstance(strategy, SELECTING):
        return SELECTING_SKETCH_RATIO
    if partial:
        return SKETCH_RATIO
    return RECURRENT_SKETCH_RATIO if recurrent else ROBUST_SKETCH_RATIO


def has_recurrent_layers(names) -> bool:
    """Whether a model's entry ``names`` hold a PyTorch recurrent layer's (``nn.LSTM``, ``nn.GRU``,
    ``nn.RNN``: ``weight_hh_l<k>``, the hidden-to-hidden weights)."""
    return any(_RECURRENT.search(name) for name in names)


def robust_momentum(strategy: Strategy, partial: bool, recurrent: bool = False) -> float:
    """FetchSGD's server momentum for a robust strategy in sketch space (``server_momentum='auto'``):
    with a fraction of the nodes a round 0 for the selecting ones (:data:`SELECTING`) and the
    averaging strategies' cross-device momentum for the others; every node every round the robust
    one (0.9), or 0 for a model with recurrent layers (``recurrent``, :func:`has_recurrent_layers`:
    0.9 diverged on an LSTM; the figures: docs, Results, Regimes)."""
    if not partial:
        return 0.0 if recurrent else ROBUST_SERVER_MOMENTUM
    return 0.0 if isinstance(strategy, SELECTING) else SKETCH_SERVER_MOMENTUM


class RobustFeedback(ServerFeedback):
    """:class:`ServerFeedback` whose round table is ``inner.aggregate_train`` of the clients' tables
    (module docstring) instead of their weighted mean."""

    def __init__(self, codec, layout: Layout, momentum: float, inner: Strategy, weight_key: str) -> None:
        super().__init__(codec, layout, momentum)
        self.inner = inner
        self.weight_key = weight_key
        self.server_round = 0  # passed to aggregate_train (Flower's strategies only log it)
        self._tables: list[tuple[list[torch.Tensor], float]] = []

    def add_values(self, values: list[torch.Tensor], weight: float = 1.0) -> None:
        weight = self._check_weight(weight)
        if self._tables and (len(values) != len(self._tables[0][0])
                             or any(v.numel() != s.numel() for v, s in zip(values, self._tables[0][0]))):
            raise DecodeError("upload's table shapes differ from the round's other uploads")
        if weight == 0:
            return
        self._tables.append(([v.reshape(-1).to(torch.float64) for v in values], weight))
        self.count += 1
        self.weight += weight

    def discard_round(self) -> None:
        self._tables = []
        super().discard_round()

    def robust_table(self) -> list[torch.Tensor] | None:
        """The inner strategy's aggregate of the round's tables (per sketched segment, then the exact
        entries), or None without tables."""
        if not self._tables:
            return None
        replies = [
            Message(RecordDict({
                getattr(self.inner, "arrayrecord_key", "arrays"): ArrayRecord({f"t{j}": v for j, v in enumerate(values)}),
                "metrics": MetricRecord({self.weight_key: float(weight)}),
            }), dst_node_id=0, message_type="train")
            for values, weight in self._tables
        ]
        arrays, _ = self.inner.aggregate_train(self.server_round, replies)
        if arrays is None:
            raise DecodeError(f"{type(self.inner).__name__}.aggregate_train returned no arrays for the sketches")
        out = arrays.to_numpy_ndarrays()
        return [torch.from_numpy(a.copy()).reshape(-1).to(torch.float64) for a in out]

    def _step(self, broadcast, nonce: int, round: int):
        try:
            combined = self.robust_table()
        finally:  # a round's tables never reach the next round, whatever the inner strategy did
            self._tables = []
        if combined is not None:  # the parent divides the sum by the weight: hand it the aggregate x weight
            self._sum = [c * self.weight for c in combined]
        return super()._step(broadcast, nonce, round)
