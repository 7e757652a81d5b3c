"""The mod and the wrapper, in process, on models of any layout: drawn layouts (sizes off every
block width, 0-d and 0-element tensors, hundreds of tiny tensors, fp16 / float64 / int64 / bool
tensors, a large tensor beside tiny ones) and fixed ones (Flower's quickstart CNN, a ResNet block,
a transformer block), with the defaults in both regimes and a per-client strategy. Every reply is
aggregated and the model moves; nothing raises.

(bf16 tensors are left out: Flower's ArrayRecord cannot carry them.)"""

from __future__ import annotations

import random

import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedMedian

from conftest import node_context, run_round
from fedcomp.simulations.layouts import FIXED, RandomDraw, draw_layout, values
from fedcomp.strategies import CompressedStrategy


def _model(layout, seed: int) -> dict[str, torch.Tensor]:
    model = {name: values(shape, torch.float16 if dtype == torch.bfloat16 else dtype, "normal", 0.1, seed + i)
             for i, (name, (shape, dtype)) in enumerate(layout.items())}
    return {k: v.abs() + 1 if k.endswith("running_var") else v for k, v in model.items()}


def _trainer(node: int, server_round: int):
    """Moves float tensors by a seeded step, counts integers up, flips a few bools."""
    def app(msg, context):
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        g = torch.Generator().manual_seed(1000 * node + server_round)
        trained = {}
        for k, v in received.items():
            if k.endswith("running_var"):  # a variance stays > 0
                trained[k] = v * (1 + 0.05 * torch.rand(v.shape, generator=g)).to(v.dtype)
            elif v.is_floating_point():
                trained[k] = v + (0.05 * torch.randn(v.shape, generator=g)).to(v.dtype)
            elif v.dtype == torch.bool:
                trained[k] = torch.logical_xor(v, torch.rand(v.shape, generator=g) < 0.1)
            else:
                trained[k] = v + 1
        return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 10 + node})}),
                       reply_to=msg)
    return app


LAYOUTS = [(f"drawn-{seed}", draw_layout(RandomDraw(random.Random(seed)))) for seed in range(6)] + sorted(FIXED.items())
REGIMES = {
    "every-node": (lambda: FedAvg(fraction_train=1.0, fraction_evaluate=0.0), 3),
    "fraction": (lambda: FedAvg(fraction_train=0.3, fraction_evaluate=0.0, min_train_nodes=2,
                                min_available_nodes=2), 10),
    "fedmedian": (lambda: FedMedian(fraction_train=1.0, fraction_evaluate=0.0), 3),
}


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("name,layout", LAYOUTS, ids=[n for n, _ in LAYOUTS])
def test_defaults_on_any_model(name, layout, regime):
    make, nodes = REGIMES[regime]
    strategy = CompressedStrategy(make())
    model = _model(layout, 0)
    contexts = {node: node_context(node) for node in range(1, nodes + 1)}
    start = {k: v.clone() for k, v in model.items()}
    for server_round in (1, 2, 3):
        model, replies, messages = run_round(strategy, model, contexts, server_round, app=_trainer)
        stats = strategy.rounds[server_round]
        assert len(replies) == len(messages) > 0
        assert [c["status"] for c in stats.clients] == ["ok"] * len(messages), stats.clients
        assert stats.aggregated == len(messages)
    assert list(model) == list(start)
    for k, v in model.items():
        assert v.shape == start[k].shape and v.dtype == start[k].dtype, k
        if v.is_floating_point():
            assert bool(torch.isfinite(v).all()), k
    moved = [k for k, v in model.items() if v.numel() and v.is_floating_point() and not torch.equal(v, start[k])]
    assert moved, "the model did not move"
