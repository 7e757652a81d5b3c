"""Robust aggregators (FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan) aggregate in sketch space by
default; Flower's server optimizers (FedAdam, FedAdagrad, FedYogi) get the averaging strategies'
uploads with the wrapper's step (``optimizer_sketch``); QFedAvg and subclasses of the optimizers get a
dense upload; an upload that defeats them is warned about (``strategies/config.py``)."""

from __future__ import annotations

import logging

import pytest
import torch

import fedcomp
from flwr.serverapp import strategy as fs

from conftest import node_context, run_round, tiny_model
from fedcomp.strategies.config import (DENSE_UPLOAD, ROBUST_SERVER_MOMENTUM, ROBUST_SKETCH_RATIO, SILO_UPLOAD,
                                       SKETCH_SERVER_MOMENTUM, OPTIMIZER_SKETCH_RATIO, SKETCH_RATIO, SELECTING_SKETCH_RATIO,
                                       CompressionConfig)
from fedcomp.strategies.robust_sketch import RobustFeedback
from fedcomp.strategies.wrapper import CompressedStrategy

ROBUST = [fs.FedMedian, fs.FedTrimmedAvg, fs.Krum, fs.MultiKrum, fs.Bulyan]
class _OwnAdam(fs.FedAdam):
    """A subclass may step otherwise: it keeps the dense upload."""


DENSE_AVERSE = [lambda **kw: fs.QFedAvg(client_learning_rate=0.1, **kw), _OwnAdam]
OPTIMIZERS = [fs.FedAdam, fs.FedAdagrad, fs.FedYogi]


@pytest.mark.parametrize("make", DENSE_AVERSE)
@pytest.mark.parametrize("fraction", [1.0, 0.1])
def test_auto_upload_is_dense_for_per_coordinate_and_loss_weighted_strategies(make, fraction):
    strategy = CompressedStrategy(make(fraction_train=fraction))
    assert strategy.sparse_averse
    assert strategy.config.upload == DENSE_UPLOAD and strategy.aggregation == "decode"
    assert strategy.config.momentum == 0.0


@pytest.mark.parametrize("make", OPTIMIZERS)
@pytest.mark.parametrize("fraction", [1.0, 0.1])
def test_server_optimizers_take_the_averaging_uploads_without_server_momentum(make, fraction):
    from fedcomp.strategies.optimizer_sketch import OptimizerFeedback

    strategy = CompressedStrategy(make(fraction_train=fraction))
    assert not strategy.sparse_averse and strategy.config.momentum == 0.0
    if fraction == 1.0:
        assert strategy.config.upload == SILO_UPLOAD and strategy.aggregation == "decode"
    elif make is not fs.FedAdam:  # the sketch cost FedYogi and FedAdagrad accuracy (docs: Results)
        assert strategy.config.upload == DENSE_UPLOAD and strategy.aggregation == "decode"
    else:
        assert strategy.config.upload.startswith("sketch(") and strategy.aggregation == "sketch"
        assert f"ratio={OPTIMIZER_SKETCH_RATIO}" in strategy.config.upload
        strategy._aggregate.on_layout(fedcomp.Layout.of(tiny_model()))
        assert isinstance(strategy._aggregate.feedback, OptimizerFeedback)


@pytest.mark.parametrize("fraction", [1.0, 0.1])
@pytest.mark.parametrize("make", ROBUST)
def test_robust_strategies_aggregate_in_sketch_space(make, fraction):
    strategy = CompressedStrategy(make(fraction_train=fraction))
    assert strategy.sparse_averse and strategy.aggregation == "sketch"
    selecting = make in (fs.Krum, fs.MultiKrum, fs.Bulyan)  # one client's table a round
    share = SELECTING_SKETCH_RATIO if selecting else ROBUST_SKETCH_RATIO if fraction == 1.0 else SKETCH_RATIO
    assert strategy.config.upload.startswith("sketch(") and f"ratio={share}" in strategy.config.upload
    cols = strategy.config.upload.split("cols=")[1].split(",")[0]  # the download sends the sketch's own cells
    assert strategy.config.coupled_download and strategy.config.download.startswith(f"cells(cols={cols},seed=0)+")
    # selecting strategies with a fraction of the nodes a round: no server momentum (a round an
    # attacker won would be carried on; docs: Results, Robust strategies under attack)
    momentum = ROBUST_SERVER_MOMENTUM if fraction == 1.0 else 0.0 if selecting else SKETCH_SERVER_MOMENTUM
    assert strategy.config.momentum == momentum
    strategy._aggregate.on_layout(fedcomp.Layout.of(tiny_model()))
    assert isinstance(strategy._aggregate.feedback, RobustFeedback)


def test_an_explicit_server_momentum_or_upload_is_kept_for_robust_strategies():
    assert CompressedStrategy(fs.FedMedian(), server_momentum=0.0).config.momentum == 0.0
    explicit = CompressedStrategy(fs.FedMedian(), upload=DENSE_UPLOAD)
    assert explicit.config.upload == DENSE_UPLOAD and explicit.aggregation == "decode"
    assert explicit.config.momentum == 0.0
    # link budgets need per-client decoding: robust strategies go back to the dense upload
    budgets = CompressionConfig(link_profile="4g").resolve(partial=True, sparse_averse=True, robust_sketch=True)
    assert budgets.upload == DENSE_UPLOAD and budgets.momentum == 0.0


@pytest.mark.parametrize("fraction", [1.0, 0.1])
def test_averaging_strategies_keep_the_regime_defaults(fraction):
    strategy = CompressedStrategy(fs.FedAvgM(fraction_train=fraction))
    assert not strategy.sparse_averse
    assert (strategy.config.upload == SILO_UPLOAD) == (fraction == 1.0)
    # FetchSGD in cross-device takes its server momentum; explicit specs keep 0
    assert strategy.config.momentum == (0.0 if fraction == 1.0 else SKETCH_SERVER_MOMENTUM)
    explicit = CompressedStrategy(fs.FedAvgM(fraction_train=fraction), upload="sketch(rows=1,cols=100,ratio=0.01)")
    assert explicit.config.momentum == 0.0


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("make, upload, words", [
    (fs.FedMedian, "topk(ratio=0.01)+qsgd(bits=4)", "sparse uploads"),
    (fs.FedMedian, "sketch(rows=1,cols=100)", None),  # its aggregate over the tables
    (_OwnAdam, "sketch(rows=1,cols=100)", "replaces its aggregation"),
    (fs.FedAdam, "sketch(rows=1,cols=100)", None),  # the wrapper's optimizer step after the unsketch
    (fs.FedMedian, "kbit(bits=4)", None), (fs.FedMedian, DENSE_UPLOAD, None)])
def test_a_defeating_upload_is_warned_at_construction(make, upload, words):
    handler = _Records()
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        CompressedStrategy(make(), upload=upload)
    finally:
        logger.removeHandler(handler)
    warned = [m for m in handler.messages if make.__name__ in m]
    assert (words is None) == (not warned), handler.messages
    if words:
        assert words in warned[0] and DENSE_UPLOAD in warned[0]


def test_median_of_sparse_updates_stays_put_and_dense_updates_move():
    """The mechanism behind the default: three clients' top-1% updates rarely share a coordinate,
    so FedMedian's per-coordinate median is 0 almost everywhere; with the dense default it moves."""
    moved = {}
    for upload in ("topk(ratio=0.01)+qsgd(bits=4)", DENSE_UPLOAD):
        strategy = CompressedStrategy(fs.FedMedian(min_available_nodes=3, min_train_nodes=3), upload=upload)
        model = tiny_model()
        contexts = {n: node_context(n) for n in (1, 2, 3)}
        new, _, _ = run_round(strategy, model, contexts, 1)
        moved[upload] = int((new["w"] != model["w"]).sum())
    assert moved["topk(ratio=0.01)+qsgd(bits=4)"] <= 0.01 * tiny_model()["w"].numel()
    assert moved[DENSE_UPLOAD] >= 0.5 * tiny_model()["w"].numel()  # qsgd rounds some small values to 0
    assert torch.isfinite(new["w"]).all()


@pytest.mark.parametrize("make", [fs.FedMedian, fs.Krum])
def test_robust_strategies_drop_server_momentum_on_recurrent_models_cross_silo(make):
    """Every node every round, momentum 0.9 in sketch space diverged on an LSTM (docs: Results,
    Regimes): a model with recurrent layers gets 0; cross-device keeps the regime's."""
    from fedcomp.strategies.robust_sketch import has_recurrent_layers

    lstm = {k: v.detach().clone() for k, v in torch.nn.LSTM(8, 16).state_dict().items()}
    lstm["out.weight"] = torch.randn(4, 16)
    assert has_recurrent_layers(lstm) and not has_recurrent_layers(tiny_model())
    contexts = {n: node_context(n) for n in range(1, 5)}
    for model, momentum in ((lstm, 0.0), (tiny_model(), ROBUST_SERVER_MOMENTUM)):
        strategy = CompressedStrategy(make(fraction_train=1.0, min_available_nodes=4, min_train_nodes=4))
        run_round(strategy, model, contexts, 1)
        assert strategy.aggregation == "sketch" and strategy.config.momentum == momentum
        share = 0.1 if momentum == 0.0 or make is fs.Krum else ROBUST_SKETCH_RATIO  # recurrent: 0.1 for all
        assert f"ratio={share})" in strategy.config.upload
    xdev = CompressedStrategy(fs.FedMedian(fraction_train=0.5, min_available_nodes=4, min_train_nodes=2))
    run_round(xdev, lstm, contexts, 1)
    assert xdev.config.momentum == SKETCH_SERVER_MOMENTUM
