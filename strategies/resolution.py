"""Regime resolution: ``"auto"`` specs picked at the first training round, and the warnings for
settings that defeat the inner strategy or go stale in cross-device (:class:`CompressionConfig`)."""

from __future__ import annotations

from logging import INFO, WARNING

from flwr.app import ArrayRecord
from flwr.common import log
from flwr.serverapp.strategy import FedAvgM

from fedcomp.strategies.config import AUTO, DENSE_UPLOAD
from fedcomp.strategies.optimizer_sketch import SERVER_OPTIMIZERS, variant_of
from fedcomp.strategies.robust_sketch import (has_recurrent_layers, robust_in_sketch_space, robust_momentum,
                                               robust_share)


XDEV_SHARE = 0.1  # a sparsifier's share from which client residuals hold in cross-device (docs: Results)
XDEV_RANK = 8  # PowerSGD's rank from which it holds in cross-device (docs: Results)


def resolve(host: CompressedStrategy, sampled: int, connected: int, arrays: ArrayRecord) -> None:
    """Pick 'auto' specs, and an explicit upload's cross-device defaults, from the regime at the first
    training round (CompressionConfig.resolve)."""
    regime = host.requested.regime_dependent and not host._upload_set
    if host.layout is not None or not (host.requested.auto or regime):
        return
    state = arrays.to_torch_state_dict()
    numel = sum(int(v.numel()) for v in state.values() if v.is_floating_point())
    partial = sampled < connected
    recurrent = has_recurrent_layers(state)
    host._use(host.requested.resolve(partial=partial, numel=numel, sparse_averse=host.sparse_averse,
                                     recurrent=recurrent,
                                     robust_sketch=robust_in_sketch_space(host.inner, partial),
                                     support_nodes=None if isinstance(host.inner, FedAvgM) else sampled,  # its momentum: a dense step
                                     robust_momentum=robust_momentum(host.inner, partial, recurrent),
                                     robust_share=robust_share(host.inner, partial, recurrent),
                                     server_optimizer=variant_of(host.inner) if type(host.inner) in SERVER_OPTIMIZERS else None))
    if host.requested.auto:
        warn_biased(host)
    log(INFO, "fedcomp: %s (%d of %d nodes per round, %d parameters): upload %s, download %s, aggregation %s",
        "cross-device" if partial else "cross-silo", sampled, connected, numel, host.upload.spec,
        " | ".join(t.codec.spec for t in host.tiers), host.aggregation)


def warn_sparse_averse(host: CompressedStrategy) -> None:
    """A robust, per-client or per-coordinate strategy given an upload that defeats it."""
    if not host.sparse_averse or host.config.upload == DENSE_UPLOAD:
        return
    reducer = getattr(host.upload, "reducer", None)
    if host.aggregation == "sketch":
        if robust_in_sketch_space(host.inner):  # its own aggregate, over the clients' tables
            return
        log(WARNING, "fedcomp: %s has its own aggregation, but aggregation='sketch' "
            "(FetchSGD) replaces its aggregation with a sum of sketches; use upload='%s' (or 'auto') to keep it",
            type(host.inner).__name__, DENSE_UPLOAD)
    elif reducer is not None and getattr(reducer, "sparse", False):
        log(WARNING, "fedcomp: %s looks at each client's update or at each coordinate on its own; sparse "
            "uploads (%s) defeat it (it lost tens of points to %s in the studies: docs, Results, Accuracy): "
            "use upload='%s' (or 'auto')", type(host.inner).__name__, host.upload.spec, DENSE_UPLOAD, DENSE_UPLOAD)


def warn_stale_residuals(host: CompressedStrategy, sampled: int, connected: int) -> None:
    """A biased upload that relies on state kept on each client, at a setting that did not hold
    where each client takes part now and then (the codecs' cross-device defaults are the settings
    that held)."""
    reducer = getattr(host.upload, "reducer", None)
    quantizer = getattr(host.upload, "quantizer", None)
    config = getattr(reducer, "config", None)
    ratio, rank = getattr(config, "ratio", 0.0), getattr(config, "rank", XDEV_RANK)
    failed = ((reducer is not None and not reducer.linear and (0 < ratio < XDEV_SHARE or rank < XDEV_RANK))
              or (getattr(quantizer, "name", "") == "sign" and quantizer.config.scale == "mean"))
    if (host.requested.upload == AUTO or sampled >= connected or host.aggregation != "decode"
            or not failed or not host.upload.needs_error_feedback or not host.error_feedback):
        return
    log(WARNING, "fedcomp: upload %s relies on state kept on each client (residual, momentum, warm start), "
        "but %d of %d nodes take part per round: that state is stale when its client is sampled again, and "
        "this setting lost to dense there (docs, Results, Codec families). Leave the argument out for the "
        "codec's cross-device default (topk/dgc ratio 0.1, powersgd rank 8, sign scale 'rms'), or use "
        "upload='auto'", host.upload.spec, sampled, connected)


def warn_biased(host: CompressedStrategy) -> None:
    if host.upload.needs_error_feedback and not host.error_feedback and host.aggregation == "decode":
        log(WARNING, "fedcomp: upload codec %s is biased; without error feedback it may not converge",
            host.upload.spec)
