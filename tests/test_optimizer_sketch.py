"""Server optimizers on compressed, accumulated updates (fedcomp.strategies.optimizer_sketch): Flower's
rule on dense updates, a burst of K rounds moving the model K rounds' worth, FetchSGD's step rescaled
where the heavy hitters are."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedYogi

import fedcomp
from fedcomp.server_feedback import ServerFeedback
from fedcomp.simulations.harness import _identity
from fedcomp.strategies.optimizer_sketch import (OptimizerFeedback, OptimizerOnUpdates, SparseServerOptimizer,
                                                 variant_of)

_identity()  # Flower Messages need a run identity outside a Flower process


def _replies(models: list[dict[str, torch.Tensor]]) -> list[Message]:
    return [Message(RecordDict({"arrays": ArrayRecord(m), "metrics": MetricRecord({"num-examples": 10 + i})}),
                    dst_node_id=0, message_type="train") for i, m in enumerate(models)]


@pytest.mark.parametrize("cls", [FedAdam, FedYogi, FedAdagrad])
def test_dense_updates_take_flowers_own_step(cls):
    flower, ours = cls(eta=0.01, eta_l=0.05), OptimizerOnUpdates(cls(eta=0.01, eta_l=0.05))
    g = torch.Generator().manual_seed(0)
    model_f = model_o = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)}
    for server_round in range(1, 7):
        deltas = [{k: 0.1 * torch.randn(v.shape, generator=g) for k, v in model_f.items()} for _ in range(3)]
        flower.current_arrays = {k: v.numpy() for k, v in model_f.items()}
        ours._current = {k: v.clone() for k, v in model_o.items()}
        out_f, _ = flower.aggregate_train(server_round, _replies([{k: model_f[k] + d[k] for k in d} for d in deltas]))
        out_o, _ = ours.aggregate_train(server_round, _replies([{k: model_o[k] + d[k] for k in d} for d in deltas]))
        model_f = {k: v.float() for k, v in out_f.to_torch_state_dict().items()}
        model_o = out_o.to_torch_state_dict()
    for k in model_f:
        assert torch.allclose(model_f[k], model_o[k], atol=1e-6), k


def _movement(optimizer, updates: list[torch.Tensor]) -> float:
    total = torch.zeros(1, dtype=torch.float64)
    for d in updates:
        total += optimizer.step({"x": d})["x"]
    return float(total)


@pytest.mark.parametrize("momentum", [True, False])
def test_a_burst_of_k_rounds_moves_the_model_k_rounds_worth(momentum):
    k, rounds = 10, 200
    dense = [torch.ones(1)] * rounds
    burst = [torch.full((1,), float(k)) if (r + 1) % k == 0 else torch.zeros(1) for r in range(rounds)]

    def adam():
        return SparseServerOptimizer(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3, momentum=momentum)

    moved_dense, moved_burst = _movement(adam(), dense), _movement(adam(), burst)
    assert moved_dense == pytest.approx(0.01 * rounds, rel=0.05)  # Adam on a constant update: eta a round
    assert moved_burst == pytest.approx(moved_dense, rel=0.25)
    # Flower's rule on the same bursts (no arrival rate: the second moment sees K^2 g^2) lags far behind
    flower = FedAdam(eta=0.01, eta_l=0.05)
    x = torch.zeros(1)
    for r, d in enumerate(burst, start=1):
        flower.current_arrays = {"x": x.numpy()}
        out, _ = flower.aggregate_train(r, _replies([{"x": x + d}]))
        x = out.to_torch_state_dict()["x"].float()
    assert float(x) < 0.5 * moved_burst


def test_without_momentum_the_step_is_zero_where_the_update_is():
    opt = SparseServerOptimizer(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3, momentum=False)
    opt.step({"x": torch.tensor([1.0, -2.0, 0.0, 3.0])})
    step = opt.step({"x": torch.tensor([0.0, 5.0, 0.0, 0.0])})["x"]
    assert step[0] == 0 and step[2] == 0 and step[3] == 0 and step[1] > 0


def test_running_statistics_take_the_mean_not_a_step():
    ours = OptimizerOnUpdates(FedAdam(eta=0.5, eta_l=0.05))
    current = {"fc.weight": torch.zeros(2, 2), "bn.running_var": torch.ones(2),
               "bn.num_batches_tracked": torch.tensor(4)}
    ours._current = current
    models = [{"fc.weight": torch.full((2, 2), 0.1), "bn.running_var": torch.full((2,), v),
               "bn.num_batches_tracked": torch.tensor(6)} for v in (0.5, 1.5)]
    out, _ = ours.aggregate_train(1, _replies(models))
    state = out.to_torch_state_dict()
    weights = torch.tensor([10.0, 11.0])
    assert torch.allclose(state["bn.running_var"], torch.full((2,), float((weights * torch.tensor([0.5, 1.5])).sum()
                                                                         / weights.sum())))
    assert int(state["bn.num_batches_tracked"]) == 6
    assert bool((state["fc.weight"] > 0.1).all())  # Adam's first step: about eta, far past the mean's 0.1


SPEC = "sketch(rows=1,cols=4000,ratio=0.01)"


def _layout() -> fedcomp.Layout:
    return fedcomp.Layout.of({"w": torch.zeros(100, 100), "b": torch.zeros(100)})


def _update(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = 0.01 * torch.randn(100 * 100, generator=g)
    w[:40] += torch.linspace(1, 4, 40)  # heavy hitters of different sizes
    return {"w": w.view(100, 100), "b": 0.01 * torch.randn(100, generator=g)}


def test_sketch_step_is_fetchsgds_heavy_hitters_rescaled_where_they_are():
    codec = fedcomp.build_codec(SPEC)
    eta, beta_2, tau = 0.05, 0.99, 1e-3
    plain = ServerFeedback(codec, _layout())
    ours = OptimizerFeedback(codec, _layout(), 0.0, SparseServerOptimizer(eta=eta, beta_1=0.9, beta_2=beta_2,
                                                                          tau=tau, momentum=False))
    for fb in (plain, ours):
        for i in range(3):
            fb.add(codec.encode(_update(i), nonce=i + 1).payload, 1.0)
    d, step = plain.step(), ours.step()
    for name in d:
        where = d[name] != 0
        assert torch.equal(where, step[name] != 0)
        # first step: rate 1 where sent, v = (1 - beta_2) d^2, Flower's sqrt(1 - beta_2^2) factor
        expect = eta * math.sqrt(1 - beta_2 ** 2) * d[name] / (math.sqrt(1 - beta_2) * d[name].abs() + tau)
        assert torch.allclose(step[name], expect, atol=1e-6)
    # the sizes are normalized: every heavy hitter applied (sizes 1 to 4) moves by about the same amount
    hh = step["w"].reshape(-1)[:40]
    hh = hh[hh != 0]
    assert hh.numel() >= 20 and float(hh.abs().max() / hh.abs().min()) < 1.1
    raw = d["w"].reshape(-1)[:40]
    raw = raw[raw != 0]
    assert float(raw.abs().max() / raw.abs().min()) > 1.5  # where FetchSGD's own step keeps their sizes


def test_coupled_download_applies_exactly_what_it_sends():
    codec = fedcomp.build_codec(SPEC)
    broadcast = fedcomp.build_codec("topk(ratio=0.01)+kbit(bits=4,stochastic=true)")
    fb = OptimizerFeedback(codec, _layout(), 0.0, SparseServerOptimizer(eta=0.05, beta_1=0.9, beta_2=0.99,
                                                                          tau=1e-3, momentum=False))
    for r in range(1, 4):
        for i in range(3):
            fb.add(codec.encode(_update(10 * r + i), nonce=10 * r + i).payload, 1.0)
        sent, payload = fb.step_broadcast(broadcast, nonce=r, round=r)
        decoded = broadcast.decode(payload, _layout(), round=r)
        for name in sent:
            assert torch.equal(sent[name], decoded[name])
        assert any(bool((v != 0).any()) for v in sent.values())


def test_settings_are_checked():
    with pytest.raises(fedcomp.SpecError, match="variant"):
        SparseServerOptimizer(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3, variant="sgd")
    with pytest.raises(fedcomp.SpecError, match="eta"):
        SparseServerOptimizer(eta=0.0, beta_1=0.9, beta_2=0.99, tau=1e-3)
    with pytest.raises(fedcomp.SpecError, match="beta_2"):
        SparseServerOptimizer(eta=0.1, beta_1=0.9, beta_2=1.0, tau=1e-3)
    with pytest.raises(fedcomp.SpecError, match="FedAvg"):
        SparseServerOptimizer.of(FedAvg())
    with pytest.raises(fedcomp.SpecError, match="momentum"):
        OptimizerFeedback(fedcomp.build_codec(SPEC), _layout(), 0.0, SparseServerOptimizer.of(FedAdam()))
    assert [variant_of(s) for s in (FedAdam(), FedYogi(), FedAdagrad(), FedAvg())] == ["adam", "yogi", "adagrad", None]
