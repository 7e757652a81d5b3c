"""Aggregation: from checked replies to the round's new global model.

Three modes, picked per round (:class:`fedcomp.strategies.replies.RoundReplies` adds each reply):

* ``mean``: weighted-mean strategies (FedAvg, FedProx, FedAvgM, the FedOpt family) get one reply
  holding the running weighted mean of the decoded updates (:class:`fedcomp.aggregate.Accumulator`);
* ``sketch``: FetchSGD sums sketches with server-side error feedback
  (:mod:`fedcomp.server_feedback`); with ``coupled_download`` the step is tier 0's broadcast itself;
* ``collect``: other strategies (FedMedian, Krum...) get ``model_i = global model + update_i`` per reply.

Train messages tell clients the upload codec, error feedback, delta coding's reference and the
last round each node's reply reached the aggregate (so an update that never did goes back into
the client's residual). Running statistics (BatchNorm) travel exact while ``exact_statistics``
is on: compressed like weights, with error feedback, they drift and a variance goes negative.
"""

from __future__ import annotations

from logging import INFO, WARNING

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp.strategy import FedAvg, FedProx

import fedcomp
from fedcomp import links
from fedcomp import protocol as P
from fedcomp.aggregate import Accumulator, apply_step
from fedcomp.broadcast import reference_crc
from fedcomp.codec import derive_nonce
from fedcomp.server_feedback import BroadcastFailed, ServerFeedback
from fedcomp.strategies.optimizer_sketch import (SERVER_OPTIMIZERS, OptimizerFeedback, SparseServerOptimizer,
                                                 optimizer_model)
from fedcomp.strategies.part import Outgoing, Part, RoundState
from fedcomp.strategies.replies import ReplyHistory, RoundReplies
from fedcomp.strategies.robust_sketch import RobustFeedback, robust_in_sketch_space
from fedcomp.strategies.stats import RoundStats
from fedcomp.strategies.streaming import can_stream
from fedcomp.tensor_kinds import COUNTER, STATISTIC, exact_state_policy, split_kinds

_MEAN_IS_THE_MODEL = (FedAvg, FedProx)  # aggregate_train of one reply of the total weight returns its model


class Aggregation(Part):
    """The round's reply handler, the acknowledgements and delta references, the new model."""

    def __init__(self) -> None:
        self.feedback: ServerFeedback | None = None  # aggregation 'sketch': built with the model's layout
        self.optimizer: SparseServerOptimizer | None = None  # FedAdam/FedYogi/FedAdagrad on sparse decoded uploads
        self.accumulator: Accumulator | None = None  # reused across rounds while the layout holds
        self.statistics_layout: fedcomp.Layout | None = None  # set when running statistics travel exact
        self.history = ReplyHistory()  # delta references, used nonces
        self.aggregated: dict[int, int] = {}  # node -> round of its last reply that reached the aggregate
        self.previous_ack: dict[int, int] = {}  # node -> its ack before this round's (a reply revoked at the end)

    # -- the model ---------------------------------------------------------------------------------
    def on_layout(self, layout: fedcomp.Layout) -> None:
        self.accumulator = None
        self.exact_statistics(layout)
        host = self.host
        # the server optimizers' step on updates that arrive in bursts (fedcomp.strategies.optimizer_sketch):
        # Flower's normalizes a burst of K rounds down to one round's step
        server_optimizer = type(host.inner) in SERVER_OPTIMIZERS
        self.optimizer = SparseServerOptimizer.of(host.inner, momentum=False) if server_optimizer else None
        if host.aggregation == "sketch":  # server-side error feedback: tables per segment of this layout
            if host.config.warmup is not None and (robust_in_sketch_space(host.inner) or server_optimizer):
                raise fedcomp.SpecError(
                    f"server_warmup={host.config.server_warmup!r} applies to FetchSGD with an averaging strategy "
                    f"(FedAvg, FedProx, FedAvgM), not {type(host.inner).__name__}: use server_warmup=1 (off)")
            if robust_in_sketch_space(host.inner):  # the robust aggregate of the clients' tables
                self.feedback = RobustFeedback(host.upload, layout, host.config.momentum, host.inner,
                                               self.weight_key())
            elif server_optimizer:  # the optimizer after FetchSGD's unsketch, where the heavy hitters are
                self.feedback = OptimizerFeedback(host.upload, layout, host.config.momentum, self.optimizer)
            else:
                self.feedback = ServerFeedback(host.upload, layout, host.config.momentum, warmup=host.config.warmup)

    def exact_statistics(self, layout: fedcomp.Layout) -> None:
        """Send the model's running statistics (BatchNorm's ``running_mean``/``running_var``) exact:
        the upload and every lossy download tier get ``name~*running_*: none();`` rules in front,
        before any tier has encoded. With FetchSGD (``aggregation="sketch"``) they travel beside the
        sketch and are averaged exactly (:class:`fedcomp.server_feedback.ServerFeedback`)."""
        host = self.host
        if not host.config.exact_statistics or not split_kinds(layout)[STATISTIC]:
            return
        if host.config.link_profile != links.NONE:
            log(WARNING, "fedcomp: the model has running statistics (BatchNorm), compressed like weights here "
                "(byte budgets need a plain spec); a negative variance is possible: prefer no link budgets for it")
            return
        self.statistics_layout = layout
        host.set_upload(host.upload.spec)
        for tier in host.tiers:
            if tier.reference is None and not tier.codec.lossless:
                tier.codec = fedcomp.build_codec(exact_state_policy(tier.codec.spec, layout))
        log(INFO, "fedcomp: running statistics travel exact; upload %s", host.upload.spec)

    def statistics_names(self) -> list[str]:
        """Entries that keep the clients' mean after a server step: running statistics and counters,
        while ``exact_statistics`` is on and the model has statistics."""
        if self.statistics_layout is None:
            return []
        kinds = split_kinds(self.statistics_layout)
        return kinds[STATISTIC] + kinds[COUNTER]

    # -- out ---------------------------------------------------------------------------------------
    def on_train_message(self, out: Outgoing) -> None:
        host = self.host
        out.fields.update({
            P.UPLOAD_SPEC: host.upload.spec,
            P.ERROR_FEEDBACK: host.error_feedback,
            P.DELTA: host.config.delta,
            P.DELTA_REF: self.history.last.get(out.node, (0, None))[0] if host.config.delta else 0,
            P.ACK_ROUND: self.aggregated.get(out.node, 0),
        })

    # -- in ----------------------------------------------------------------------------------------
    def new_replies(self, server_round: int) -> RoundReplies | None:
        host, checks = self.host, self.host._checks
        if host.layout is None:
            return None
        if host.aggregation == "sketch":
            mode = "sketch"
        else:
            mode = "mean" if can_stream(host.inner) else "collect"
        if self.accumulator is None:
            self.accumulator = Accumulator(host.upload, host.layout)
        else:
            self.accumulator.reset()
        guard = checks.round_guard(server_round)
        if isinstance(self.feedback, RobustFeedback):
            self.feedback.server_round = server_round
        return RoundReplies(
            round=server_round, mode=mode, layout=host.layout, base=host.base, accumulator=self.accumulator,
            feedback=self.feedback, guard=guard,
            config=host.config, upload=host.upload, weight_key=self.weight_key(), history=self.history,
            on_accept=self._accepted(server_round), dense_model_bytes=host.dense_model_bytes,
            tokens=checks.tokens.setdefault(server_round, {}), upload_limit=checks.upload_limit,
            state_guard=checks.state_guard, on_revoke=self._revoke)

    def _accepted(self, server_round: int):
        def note(node: int, entry: dict, dense_bytes: int) -> None:
            self.previous_ack[node] = self.aggregated.get(node, 0)
            self.aggregated[node] = server_round  # acknowledged in its next broadcast
            self.host.rounds.setdefault(server_round, RoundStats()).upload_bytes_dense += dense_bytes
        return note

    def _revoke(self, node: int) -> None:
        """An accepted reply left out at the end of the round after all: not acknowledged."""
        self.aggregated[node] = self.previous_ack.get(node, 0)

    def on_round_end(self, state: RoundState) -> None:
        handler = state.replies
        state.stats.aggregated = handler.finish() if handler is not None else 0
        if not state.stats.aggregated and self.feedback is not None:
            self.feedback.discard_round()

    # -- the new model -----------------------------------------------------------------------------
    def aggregate(self, state: RoundState) -> tuple[ArrayRecord | None, MetricRecord | None]:
        handler, server_round = state.replies, state.round
        if handler.mode == "sketch":
            return ArrayRecord(self.sketch_step(server_round)), self.aggregate_metrics(handler.metrics)
        if handler.mode == "collect":
            arrays, metrics = self.host.inner.aggregate_train(server_round, handler.collected + state.errors)
            return self.as_layout(arrays), metrics
        return self.finish_mean(state)

    def weight_key(self) -> str:
        return getattr(self.host.inner, "weighted_by_key", "num-examples")

    def aggregate_metrics(self, records: list[RecordDict]) -> MetricRecord | None:
        """The inner strategy's metric aggregate of the aggregated replies' checked metrics (one
        schema, weights as counted); a function that fails anyway costs the round's metrics only."""
        aggr = getattr(self.host.inner, "train_metrics_aggr_fn", None)
        if aggr is None or not records:
            return None
        try:
            return aggr(records, self.weight_key())
        except Exception as exc:  # noqa: BLE001 - the user's function: the model is aggregated already
            log(WARNING, "fedcomp: the train metrics aggregation failed (%s: %s); this round has no train metrics",
                type(exc).__name__, exc)
            return None

    def finish_mean(self, state: RoundState) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The weighted mean model; strategies that step from it (FedAvgM, FedAdam...) get one
        reply holding it, of the total weight. Metrics: the inner strategy's aggregate of every
        aggregated reply's metrics."""
        inner, server_round = self.host.inner, state.round
        acc = state.replies.accumulator
        total = acc.total_weight
        model = acc.apply_mean(self.host.base)
        metrics = self.aggregate_metrics(state.replies.metrics)
        log(INFO, "fedcomp: round %s aggregated %d replies", server_round, state.replies.count_aggregated())
        if type(inner) in _MEAN_IS_THE_MODEL:  # FedAvg of one reply is that reply: skip its copies
            return ArrayRecord(model), metrics
        if self.optimizer is not None and getattr(getattr(self.host.upload, "reducer", None), "sparse", False):
            # sparse uploads with residuals: the optimizer's step on the mean update, its second moment
            # corrected by each coordinate's arrival rate; statistics and counters take the mean
            return self.as_layout(ArrayRecord(optimizer_model(self.optimizer, self.host.base, model))), metrics
        key = self.weight_key()
        merged = Message(RecordDict({state.arrays_key or "arrays": ArrayRecord(model),
                                     "metrics": MetricRecord({key: total})}),
                         dst_node_id=0, message_type="train")
        # statistics and counters are the mean: the inner strategy's server step (FedAvgM's momentum,
        # FedAdam's normalisation) is for weights; on running_var it goes negative (fedcomp.tensor_kinds)
        exact = {name: model[name] for name in self.statistics_names()}
        del model
        arrays, _ = inner.aggregate_train(server_round, [merged])
        return self.as_layout(arrays, exact), metrics

    def as_layout(self, arrays: ArrayRecord | None,
                  exact: dict[str, torch.Tensor] | None = None) -> ArrayRecord | None:
        """The aggregate in the model's dtypes (FedAvg turns integer buffers into float64), so
        the broadcast references keep one layout; entries in ``exact`` replace the aggregate's."""
        layout = self.host.layout
        if arrays is None or layout is None:
            return arrays
        model = arrays.to_torch_state_dict()
        if set(model) != set(layout.names):  # not the model's entries: left as the strategy made it
            return ArrayRecord({**model, **exact}) if exact else arrays
        model.update(exact or {})
        if fedcomp.Layout.of(model) == layout and not exact:
            return arrays
        dtypes = {t.name: t.torch_dtype for t in layout.tensors}
        return ArrayRecord({k: v.round().to(dtypes[k]) if v.is_floating_point() and not dtypes[k].is_floating_point
                            else v.to(dtypes[k]) for k, v in model.items()})

    def sketch_step(self, server_round: int) -> dict[str, torch.Tensor]:
        """The new model from the server-side error feedback. With ``coupled_download`` the step is
        encoded once with tier 0's codec, the model moves by exactly what that payload decodes to
        (what the download dropped goes back into the error table), and the payload is tier 0's
        step to the next round as is: its reference is the global model."""
        host = self.host
        tier, base, coupled = host.tiers[0], host.base, host.config.coupled_download
        if not coupled or tier.reference is None or tier.crc != reference_crc(base):
            if coupled:
                log(WARNING, "fedcomp: tier 0's reference is not the global model in round %s; its step is encoded "
                    "apart this round", server_round)
            return apply_step(base, self.feedback.step(round=server_round + 1))
        try:
            sent, payload = self.feedback.step_broadcast(
                tier.codec, nonce=derive_nonce(host.config.seed, server_round + 1, -1), round=server_round + 1)
        except BroadcastFailed as exc:  # the step applies uncompressed; tier 0 restarts from the model
            log(WARNING, "fedcomp: round %s's coupled download step failed (%s); the step applies as computed and "
                "tier 0's clients get the full model next round", server_round, exc)
            model = apply_step(base, exc.step)
            host._broadcasts.restart(tier, model, server_round + 1)
            return model
        model = apply_step(base, sent)
        tier.append(model, server_round + 1, payload)
        return model
