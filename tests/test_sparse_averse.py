"""Strategies that aggregate each client's update on its own (robust aggregators, QFedAvg) or
normalize per coordinate (FedAdam, FedAdagrad, FedYogi) get a dense upload by default and a warning
for one that defeats them (``strategies/config.py``)."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.serverapp import strategy as fs

from conftest import node_context, run_round, tiny_model
from fedcomp.strategies.config import DENSE_UPLOAD, SILO_UPLOAD
from fedcomp.strategies.wrapper import CompressedStrategy

SPARSE_AVERSE = [fs.FedMedian, fs.FedTrimmedAvg, fs.Krum, fs.MultiKrum, fs.Bulyan,
              lambda **kw: fs.QFedAvg(client_learning_rate=0.1, **kw), fs.FedAdam, fs.FedAdagrad, fs.FedYogi]


@pytest.mark.parametrize("make", SPARSE_AVERSE)
@pytest.mark.parametrize("fraction", [1.0, 0.1])
def test_auto_upload_is_dense_for_per_client_strategies(make, fraction):
    strategy = CompressedStrategy(make(fraction_train=fraction))
    assert strategy.sparse_averse
    assert strategy.config.upload == DENSE_UPLOAD and strategy.aggregation == "decode"


@pytest.mark.parametrize("fraction", [1.0, 0.1])
def test_averaging_strategies_keep_the_regime_defaults(fraction):
    strategy = CompressedStrategy(fs.FedAvgM(fraction_train=fraction))
    assert not strategy.sparse_averse
    assert (strategy.config.upload == SILO_UPLOAD) == (fraction == 1.0)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("upload, words", [("topk(ratio=0.01)+qsgd(bits=4)", "sparse uploads"),
                                           ("sketch(rows=1,cols=100)", "replaces its aggregation"),
                                           ("kbit(bits=4)", None), (DENSE_UPLOAD, None)])
def test_a_defeating_upload_is_warned_at_construction(upload, words):
    handler = _Records()
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        CompressedStrategy(fs.FedMedian(), upload=upload)
    finally:
        logger.removeHandler(handler)
    warned = [m for m in handler.messages if "FedMedian" in m]
    assert (words is None) == (not warned), handler.messages
    if words:
        assert words in warned[0] and DENSE_UPLOAD in warned[0]


def test_median_of_sparse_updates_stays_put_and_dense_updates_move():
    """The mechanism behind the default: three clients' top-1% updates rarely share a coordinate,
    so FedMedian's per-coordinate median is 0 almost everywhere; with the dense default it moves."""
    moved = {}
    for upload in ("topk(ratio=0.01)+qsgd(bits=4)", "auto"):
        strategy = CompressedStrategy(fs.FedMedian(min_available_nodes=3, min_train_nodes=3), upload=upload)
        model = tiny_model()
        contexts = {n: node_context(n) for n in (1, 2, 3)}
        new, _, _ = run_round(strategy, model, contexts, 1)
        moved[upload] = int((new["w"] != model["w"]).sum())
    assert moved["topk(ratio=0.01)+qsgd(bits=4)"] <= 0.01 * tiny_model()["w"].numel()
    assert moved["auto"] >= 0.5 * tiny_model()["w"].numel()  # qsgd rounds some small values to 0
    assert torch.isfinite(new["w"]).all()
