"""Robust aggregation in sketch space (fedcomp.strategies.robust_sketch): the inner strategy's own
aggregate over the clients' count-sketch tables, then FetchSGD's server step."""

from __future__ import annotations

import pytest
import torch
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, Krum

import fedcomp
from fedcomp.server_feedback import ServerFeedback
from fedcomp.strategies.robust_sketch import RobustFeedback, robust_in_sketch_space

SPEC = "sketch(rows=1,cols=4000,ratio=0.03)"


def _layout() -> fedcomp.Layout:
    return fedcomp.Layout.of({"w": torch.zeros(100, 100), "b": torch.zeros(100)})


HOT = torch.randperm(100 * 100, generator=torch.Generator().manual_seed(1234))[:50]  # the honest signal


def _update(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A common direction (the honest signal) plus client noise."""
    g = torch.Generator().manual_seed(seed)
    w = torch.zeros(100 * 100)
    w[HOT] = 1.0
    w += 0.01 * torch.randn(w.numel(), generator=g)
    return {"w": scale * w.view(100, 100), "b": scale * 0.01 * torch.randn(100, generator=g)}


def _step(feedback, codec, updates, weights=None):
    for i, u in enumerate(updates):
        feedback.add(codec.encode(u, nonce=i + 1).payload, (weights or [1.0] * len(updates))[i])
    return feedback.step()


@pytest.mark.parametrize("strategy", [FedMedian(), FedTrimmedAvg(beta=0.2), Krum(num_malicious_nodes=2),
                                      FedMedian(arrayrecord_key="weights")])
def test_two_sign_flipped_attackers_do_not_move_the_robust_step(strategy):
    codec = fedcomp.build_codec(SPEC)
    honest = [_update(s) for s in range(8)]
    clean = _step(RobustFeedback(codec, _layout(), 0.0, strategy, "num-examples"), codec, honest)
    attacked = _step(RobustFeedback(codec, _layout(), 0.0, strategy, "num-examples"), codec,
                     [_update(100, -4.0), _update(101, -4.0)] + honest)
    mean_attacked = _step(ServerFeedback(codec, _layout()), codec, [_update(100, -4.0), _update(101, -4.0)] + honest)
    w, w_attacked, w_mean = (s["w"].reshape(-1)[HOT] for s in (clean, attacked, mean_attacked))
    assert bool((w > 0.5).all())
    # the signal's coordinates keep their sign and most of their size under the robust aggregate
    assert bool((w_attacked > 0.5).float().mean() >= 0.9)
    # where the plain mean of the tables is pulled below zero
    assert float(w_mean.mean()) < 0


def test_median_of_tables_is_the_cellwise_median():
    codec = fedcomp.build_codec("sketch(rows=1,cols=4000,ratio=1.0)")
    fb = RobustFeedback(codec, _layout(), 0.0, FedMedian(), "num-examples")
    updates = [_update(s) for s in range(5)]
    tables = []
    for i, u in enumerate(updates):
        values = fb.decode(codec.encode(u, nonce=i + 1).payload)
        tables.append(values[0])
        fb.add_values(values, 1.0)
    got = fb.robust_table()
    assert torch.allclose(got[0], torch.stack(tables).median(dim=0).values.to(got[0].dtype), atol=1e-6)


def test_zero_weight_replies_count_for_nothing_and_a_round_can_be_discarded():
    codec = fedcomp.build_codec(SPEC)
    fb = RobustFeedback(codec, _layout(), 0.0, FedMedian(), "num-examples")
    fb.add(codec.encode(_update(0), nonce=1).payload, 0)
    assert fb.count == 0 and fb.robust_table() is None
    fb.add(codec.encode(_update(0), nonce=2).payload, 3)
    fb.discard_round()
    assert fb.count == 0 and fb.robust_table() is None


def test_only_translation_equivariant_robust_strategies_aggregate_in_sketch_space():
    assert robust_in_sketch_space(FedMedian()) and robust_in_sketch_space(Krum())
    assert not robust_in_sketch_space(FedAvg())


def test_attack_app_reverses_and_scales_the_attackers_updates_only():
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from fedcomp.simulations import client_app, robust_study, task

    model = task.build_model("mlp", seed=0).state_dict()
    cfg = {"seed": 0, "task": "digits", "model": "mlp", "local-epochs": 1, "lr": 0.3, "batch-size": 32,
           "partition-alpha": 0.5}
    msg = Message(RecordDict({"arrays": ArrayRecord(model), "config": ConfigRecord({"server-round": 1})}),
                  dst_node_id=1, message_type="train")
    forged_train = robust_study.attack_train(1, -4.0)
    for pid, factor in ((0, -4.0), (1, 1.0)):
        ctx = Context(run_id=1, node_id=1, node_config={"partition-id": pid, "num-partitions": 3}, state=RecordDict(),
                      run_config=dict(cfg))
        honest = client_app.train(msg, ctx).content.array_records["arrays"].to_torch_state_dict()
        sent = forged_train(msg, ctx).content.array_records["arrays"].to_torch_state_dict()
        for k, v in model.items():
            assert torch.allclose(sent[k], v + factor * (honest[k] - v), atol=1e-5), (pid, k)
