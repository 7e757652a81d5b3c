"""AdaptiveStrategy: the upload's `auto` parameter set each round from the server-side evaluation."""

from __future__ import annotations

import pytest
from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp.strategy import FedAvg

from conftest import ModGrid, node_context, run_round, tiny_model
from fedcomp import protocol as P
from fedcomp.adapt import AdaptError, AdaptSettings
from fedcomp.strategies.adaptive import AdaptiveStrategy

SPEC = "topk(ratio=auto)+qsgd(bits=4)"
FAST = AdaptSettings(min_reduction=4, max_reduction=400, start_reduction=400, window=1)


def _strategy(n=3, **kw):
    return AdaptiveStrategy(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n),
                            upload=kw.pop("upload", SPEC), adapt=kw.pop("adapt", FAST), **kw)


def test_each_round_sends_and_decodes_the_spec_the_evaluation_chose():
    contexts = {i: node_context(i) for i in (1, 2, 3)}
    grid = ModGrid(contexts)
    accuracy = {0: 0.1, 1: 0.5, 2: 0.9, 3: 0.9, 4: 0.9, 5: 0.9}  # progress, then a plateau

    def evaluate(server_round, arrays):
        return MetricRecord({"accuracy": accuracy[server_round], "loss": 1.0})

    strategy = _strategy()
    strategy.start(grid, ArrayRecord(tiny_model()), num_rounds=5, evaluate_fn=evaluate)
    history = strategy.history
    assert [h["round"] for h in history] == [1, 2, 3, 4, 5]  # the unrun round 6 is not kept
    # what the clients were told is the round's concrete spec (never 'auto'), one per round
    sent = {r: {str(rec[P.UPLOAD_SPEC]) for _, rr, rec in grid.sent if rr == r} for r in range(1, 6)}
    assert all(sent[h["round"]] == {h["spec"]} and "auto" not in h["spec"] for h in history)
    ratios = [h["ratio"] for h in history]
    decisions = [h["decision"] for h in history]
    # round 1's evaluation beat round 0's: tighten (already at the lowest: hold); round 2 beat it again;
    # rounds 3.. are flat: a probe relaxes, the next flat window reverts it
    assert decisions[2:4] == ["relax", "revert"]
    assert ratios[3] > ratios[2] and ratios[4] == ratios[2]
    # every reply decoded with its round's spec and reached the aggregate; bytes follow the ratio
    assert all(strategy.rounds[r].aggregated == 3 for r in range(1, 6))
    assert strategy.rounds[4].upload_bytes > strategy.rounds[3].upload_bytes
    # the replies' bytes besides the payload were measured every round and floor the budget
    assert all(h["fixed_bytes"] > 0 for h in history)
    assert strategy.auto.controller.lowest == int(FAST.fixed_share * strategy.auto.fixed_bytes) > strategy.auto.dense_bytes // 400


def test_cross_device_keeps_the_spec_the_controller_chose():
    """topk()'s cross-device default (ratio 0.1) fills only what a spec leaves out: the controller's
    ratio stands in every round, round 1 included, when half the nodes are sampled."""
    contexts = {i: node_context(i) for i in (1, 2, 3, 4)}
    grid = ModGrid(contexts)
    strategy = AdaptiveStrategy(FedAvg(fraction_train=0.5, fraction_evaluate=0.0, min_available_nodes=4, min_train_nodes=2),
                                upload=SPEC, adapt=FAST)
    strategy.start(grid, ArrayRecord(tiny_model()), num_rounds=2,
                   evaluate_fn=lambda r, arrays: MetricRecord({"accuracy": 0.1 * r}))
    for h in strategy.history:
        assert {str(rec[P.UPLOAD_SPEC]) for _, rr, rec in grid.sent if rr == h["round"]} == {h["spec"]}
        assert h["ratio"] < 0.1


def test_round_by_round_use_with_observe():
    contexts = {i: node_context(i) for i in (1, 2)}
    model = tiny_model()
    strategy = _strategy(2)
    new, replies, _ = run_round(strategy, model, contexts, 1)
    assert strategy.compressed.upload.spec == strategy.strength_of(1)["spec"] and len(replies) == 2
    strategy.observe(1, {"accuracy": 0.5})
    strategy.observe(2, {"accuracy": 0.5})  # round 2 not run: observing it still moves round 3
    assert strategy.strength_of(3)["ratio"] > strategy.strength_of(1)["ratio"]
    run_round(strategy, new, contexts, 3)
    assert strategy.compressed.upload.spec == strategy.strength_of(3)["spec"]
    assert strategy.rounds[3].aggregated == 2


def test_a_fixed_spec_and_sketch_aggregation_are_refused():
    with pytest.raises(AdaptError, match="auto"):
        _strategy(upload="topk(ratio=0.01)+qsgd(bits=4)")
    with pytest.raises(AdaptError, match="sketch"):
        _strategy(upload="sketch(rows=1,cols=auto)")


def test_start_needs_the_server_side_evaluation():
    with pytest.raises(AdaptError, match="evaluate_fn"):
        _strategy().start(ModGrid({1: node_context(1)}), ArrayRecord(tiny_model()), num_rounds=1)


def test_project_app_accepts_an_auto_upload_and_refuses_a_bad_one():
    import tomllib
    from pathlib import Path

    from fedcomp.simulations.server_app import validate_run_config

    root = Path(__file__).resolve().parents[1]
    defaults = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert validate_run_config({**defaults, "upload": SPEC})["upload"] == SPEC
    with pytest.raises(ValueError, match="upload="):
        validate_run_config({**defaults, "upload": "topk(ratio=auto, scope='nowhere')+qsgd(bits=4)"})


def test_batchnorm_statistics_stay_exact_whatever_the_round_spec():
    import torch

    model = {**tiny_model(), "bn.running_mean": torch.zeros(64), "bn.running_var": torch.ones(64)}
    contexts = {i: node_context(i) for i in (1, 2, 3)}
    strategy = _strategy()
    for rnd in (1, 2):
        strategy.observe(rnd - 1, MetricRecord({"accuracy": 0.1 * rnd}), ArrayRecord(model))
        model, _, _ = run_round(strategy, model, contexts, rnd)
        sent = strategy.compressed.upload.spec  # what configure_train sent and the replies were decoded with
        assert strategy.compressed.rounds[rnd].aggregated == 3
        assert sent == "name~*running_mean: none(); name~*running_var: none(); " + strategy.strength_of(rnd)["spec"]
        assert bool((model["bn.running_var"] > 0).all())
