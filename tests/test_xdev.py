"""Cross-device defaults in the wrapper and the mod: server-side error feedback for sketch uploads,
the non-finite guard, seeded first contact, byte-bounded tier history, coupled downloads, and the
regime-picked defaults (issue 15; the study: simulations/figures/xdev/README.md)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvg

import fedcomp
from fedcomp.server_feedback import ServerFeedback
from fedcomp.strategies import CompressedStrategy, NonFiniteModel

from conftest import node_context, run_round, tiny_model

QSKETCH = "sketch(rows=1,cols=600,ratio=0.02)+qsgd(bits=4)"


def _contexts(n):
    return {i: node_context(i, **{"partition-id": i - 1, "num-partitions": n}) for i in range(1, n + 1)}


# -- 1. aggregation='sketch' through one ServerFeedback -------------------------------------------
def test_quantized_sketch_upload_is_summed_in_sketch_space_by_server_feedback():
    strategy = CompressedStrategy(FedAvg(), upload=QSKETCH)
    assert strategy.aggregation == "sketch" and not strategy.error_feedback
    model, contexts = tiny_model(), _contexts(4)
    new, replies, messages = run_round(strategy, model, contexts, 1)
    assert isinstance(strategy.feedback, ServerFeedback)
    assert strategy.rounds[1].aggregated == 4
    # the same replies through a ServerFeedback of our own give the same step
    ref = ServerFeedback(fedcomp.build_codec(QSKETCH), fedcomp.Layout.of(model))
    for r in replies:
        ref.add(r.content.config_records["fedcomp.upload"]["payload"],
                r.content.metric_records["metrics"]["num-examples"])
    step = ref.step()
    assert int((step["w"] != 0).sum()) > 0
    assert torch.allclose(new["w"], model["w"] + step["w"], atol=1e-6)
    assert torch.equal(new["steps"], model["steps"])  # integer buffers keep the base
    # clients keep no residual (the error lives on the server)
    assert all("fedcomp.residual" not in c.state.array_records for c in contexts.values())


def test_sketch_aggregation_refuses_a_codec_whose_reducer_is_not_linear():
    with pytest.raises(fedcomp.SpecError, match="reducer is linear"):
        CompressedStrategy(FedAvg(), upload="topk(ratio=0.01)+qsgd(bits=4)", aggregation="sketch")


class _NaNAvg(FedAvg):
    """A non-streamable FedAvg (collect mode) whose aggregate is NaN: a diverged server step."""

    def aggregate_train(self, server_round, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        model = arrays.to_torch_state_dict()
        model["w"][0, 0] = float("nan")
        return ArrayRecord(model), metrics


def test_a_non_finite_global_model_stops_the_run_with_a_typed_error():
    strategy = CompressedStrategy(_NaNAvg(), upload="topk(ratio=0.1)+qsgd(bits=4)")
    with pytest.raises(NonFiniteModel, match="round 1 has NaN or Inf values in \\['w'\\]"):
        run_round(strategy, tiny_model(), _contexts(3), 1)
