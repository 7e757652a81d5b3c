"""``AdaptiveStrategy``: a :class:`CompressedStrategy` whose upload strength follows the server's evaluation.

Written as ``upload="topk(ratio=auto)+qsgd(bits=4)"``: one parameter of the upload codec is ``auto``
(a knob the byte-budget controller moves: top-k ratio, bits, rank, sketch columns; see
:mod:`fedcomp.budget`). Each round:

1. Flower's loop calls the run's ``evaluate_fn`` on the new global model (round 0: the initial one).
2. This strategy passes the result on and feeds its ``accuracy`` (else minus its ``loss``) to a
   :class:`fedcomp.adapt.AutoStrength`, whose :class:`~fedcomp.adapt.StrengthController` moves the
   per-client byte budget (policy: :mod:`fedcomp.adapt`; bounds and start as reductions against the
   dense model, the same defaults for every task), with the round's mean reply size (the bytes
   besides the payload floor the budget: ``AutoStrength.observe_message``).
3. The budget is turned into the concrete spec of the next round (e.g. ``topk(ratio=0.0011,...)``),
   which the wrapped :class:`CompressedStrategy` sends to the clients as their upload spec and
   decodes their replies with. Clients need nothing new: they receive a concrete spec as always.

``history`` lists per round the spec, the knob's value, the budget, the signal and the decision
(``strength_of(round)`` for one round), for the app's results.

Composition: download tiers, delta coding and the norm guards are the wrapped strategy's, unchanged.
A client with a link budget (``link_profile``/node config) fits its own link's budget starting from
the round's spec, so on such clients the link, not the controller, sets the knob. FetchSGD
(``aggregation='sketch'``) keeps momentum and error in a sketch space that must not change size
between rounds: refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.server import Grid
from flwr.serverapp.strategy import Strategy

import fedcomp
from fedcomp.adapt import AdaptError, AdaptSettings, AutoStrength, is_auto, without_auto
from fedcomp.strategies.config import SILO_DOWNLOAD
from fedcomp.strategies.wrapper import CompressedStrategy


class AdaptiveStrategy(Strategy):
    """Compress like :class:`CompressedStrategy`, with the upload's ``auto`` parameter set each round.

    Parameters
    ----------
    inner : Strategy
        The strategy that samples clients and aggregates, e.g. ``FedAvg()``.
    upload : str
        Upload codec spec with exactly one parameter ``auto``, e.g. ``"topk(ratio=auto)+qsgd(bits=4)"``.
    adapt : AdaptSettings, optional
        The controller's bounds and policy (default: :class:`fedcomp.adapt.AdaptSettings()`).
    **settings
        Every other :class:`CompressedStrategy` setting (download, error_feedback, seed, ...).

    Notes
    -----
    Run it with ``start(..., evaluate_fn=...)``: the server-side evaluation is the controller's
    signal. Used round by round without ``start`` (tests, custom loops), call :meth:`observe`
    with each round's evaluation metrics.
    """

    def __init__(self, inner: Strategy, upload: str, adapt: AdaptSettings | None = None, **settings) -> None:
        if not isinstance(upload, str) or not is_auto(upload):
            raise AdaptError(f"upload={upload!r} is invalid for AdaptiveStrategy: write one codec parameter as "
                             f"'auto', e.g. 'topk(ratio=auto)+qsgd(bits=4)' (a fixed spec: use CompressedStrategy)")
        self.spec = upload
        self.adapt = adapt or AdaptSettings()
        if settings.get("download", "auto") == "auto":
            # what 'auto' resolves to for a decoded (non-sketch) upload in every regime; resolved here
            # so that the wrapper's round-1 resolution cannot reset the upload this strategy sets
            settings["download"] = SILO_DOWNLOAD
        self.compressed = CompressedStrategy(inner, upload=without_auto(upload), **settings)
        if self.compressed.aggregation == "sketch":
            raise AdaptError(f"upload={upload!r}: adaptive strength does not combine with aggregation='sketch' "
                             f"(FetchSGD's sketch-space momentum and error need the same sketch every round)")
        self.auto: AutoStrength | None = None  # built from the first model seen (its layout)
        self._next = 1  # the round whose spec is set

    @property
    def history(self) -> list[dict]:
        """Per round: spec, the ``auto`` parameter's value, budget (bytes), signal and decision."""
        return self.auto.history if self.auto is not None else []

    @property
    def rounds(self):
        """The wrapped strategy's per-round :class:`RoundStats`."""
        return self.compressed.rounds

    def strength_of(self, server_round: int) -> dict | None:
        """The history entry of ``server_round`` (None before it was configured)."""
        return next((h for h in self.history if h["round"] == server_round), None)

    def summary(self) -> None:
        log(INFO, "fedcomp: adaptive upload %s (bounds: %gx to %gx less than dense, start %gx)", self.spec,
            self.adapt.min_reduction, self.adapt.max_reduction, self.adapt.start_reduction)
        self.compressed.summary()

    # -- the round's spec ------------------------------------------------------------------------
    def _ensure(self, arrays: ArrayRecord) -> AutoStrength:
        if self.auto is None:
            layout = fedcomp.Layout.of(dict(arrays.to_torch_state_dict()))
            self.auto = AutoStrength(self.spec, layout, self.adapt, seed=self.compressed.seed)
        return self.auto

    def _apply(self, server_round: int) -> None:
        # the wrapper reads `upload` when it sends the round's spec and builds the round's decoder;
        # set_upload keeps BatchNorm statistics exact as for its own specs
        self.compressed.set_upload(self.auto.spec(server_round))
        self._next = server_round

    def observe(self, server_round: int, metrics, arrays: ArrayRecord | None = None) -> None:
        """Round ``server_round``'s evaluation of the global model (0: the initial model) moves the
        strength of round ``server_round + 1``."""
        if self.auto is None:
            if arrays is None:
                raise AdaptError("the first observation needs the model (arrays=) to size the codec")
            self._ensure(arrays)
        stats = self.compressed.rounds.get(server_round)
        sizes = [c["upload_bytes"] for c in (stats.clients if stats else ()) if c.get("status") == "ok"]
        if sizes and self.strength_of(server_round) is not None:
            # the replies' bytes besides the payload floor the budget (AutoStrength.observe_message)
            self.auto.observe_message(server_round, sum(sizes) / len(sizes))
        self.auto.observe(server_round, metrics)
        self._apply(server_round + 1)
        h = self.strength_of(server_round)
        if h is not None:
            log(INFO, "fedcomp adapt: round %s signal %.4f -> %s; round %s: %s", server_round, h["signal"],
                h["decision"], server_round + 1, self.auto.spec(server_round + 1))

    # -- Flower's loop: delegated, with the evaluation tapped ----------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None):
        """The wrapped strategy's loop; each ``evaluate_fn`` result also sets the next round's strength."""
        if evaluate_fn is None:
            raise AdaptError("AdaptiveStrategy needs the server-side evaluation as its signal: pass evaluate_fn= "
                             "to start() (a function (round, arrays) -> MetricRecord with 'accuracy' or 'loss')")

        def tapped(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            res = evaluate_fn(server_round, arrays)
            if res is None:
                raise AdaptError(f"evaluate_fn returned nothing for round {server_round}: AdaptiveStrategy needs "
                                 f"its 'accuracy' or 'loss' every round")
            self.observe(server_round, res, arrays)
            return res

        result = self.compressed.start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                                       tapped)
        if self.auto is not None:  # the last evaluation set a round that never ran
            self.auto.history[:] = [h for h in self.auto.history if h["round"] <= num_rounds]
        return result

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._ensure(arrays)
        if self.strength_of(server_round) is None:
            self._apply(server_round)
        return self.compressed.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        return self.compressed.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.compressed.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.compressed.aggregate_evaluate(server_round, replies)


__all__ = ["AdaptiveStrategy"]
