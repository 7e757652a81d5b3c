"""Running statistics (BatchNorm) travel exact through a wrapped strategy: the aggregate of
``running_var`` is the clients' weighted mean, never a compressed estimate that can go negative."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedcomp import protocol as P
from fedcomp.strategies import CompressedStrategy
from conftest import FakeGrid, node_context, run_round

NODES = (1, 2, 3, 4)


def _model():
    g = torch.Generator().manual_seed(0)
    return {"conv.weight": torch.randn(16, 8, generator=g), "bn.weight": torch.ones(16), "bn.bias": torch.zeros(16),
            "bn.running_mean": torch.zeros(16), "bn.running_var": torch.ones(16),
            "bn.num_batches_tracked": torch.tensor(0)}


def _variance(node: int, server_round: int) -> torch.Tensor:
    """What client ``node`` measured: small positive variances, spread over two decades."""
    g = torch.Generator().manual_seed(100 * node + server_round)
    return 10 ** (-2 * torch.rand(16, generator=g))


def _trainer(node, server_round):
    def app(msg, context):
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        g = torch.Generator().manual_seed(node + 10 * server_round)
        trained = {k: v + 0.1 * torch.randn(v.shape, generator=g) if k.endswith(("weight", "bias")) else v
                   for k, v in received.items()}
        trained["bn.running_var"] = _variance(node, server_round)
        trained["bn.running_mean"] = received["bn.running_mean"] + 0.5 * torch.randn(16, generator=g)
        trained["bn.num_batches_tracked"] = received["bn.num_batches_tracked"] + 3
        return Message(RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 10 * node})}),
                       reply_to=msg)
    return app


def _run(rounds=3, inner=FedAvg, **settings):
    strategy = CompressedStrategy(inner(fraction_train=1.0, min_available_nodes=4, min_train_nodes=4,
                                        fraction_evaluate=0.0), **settings)
    contexts = {n: node_context(n, **{"partition-id": n, "num-partitions": 4}) for n in NODES}
    model, sent = _model(), {}
    for r in range(1, rounds + 1):
        model, _, _ = run_round(strategy, model, contexts, r, app=_trainer)
    sent = _last_broadcast(strategy, model)
    return model, sent, strategy


def _last_broadcast(strategy, model, nodes=NODES):
    """A broadcast as the strategy would send it next (after the run: it steps the tiers)."""
    from flwr.app import ConfigRecord

    msg = next(iter(strategy.configure_train(99, ArrayRecord(model), ConfigRecord({}), FakeGrid(list(nodes)))))
    return dict(msg.content.config_records[P.DOWNLOAD_RECORD])


@pytest.mark.parametrize("upload", ["sign()", "topk(ratio=0.05)+qsgd(bits=4)", "randomk(ratio=0.1)"])
def test_running_variance_is_the_clients_mean(upload):
    model, sent, _ = _run(upload=upload, download="topk(ratio=0.1)+kbit(bits=4)")
    weights = torch.tensor([10.0 * n for n in NODES])
    expected = sum(w * _variance(n, 3) for w, n in zip(weights, NODES)) / weights.sum()
    assert torch.allclose(model["bn.running_var"], expected, rtol=1e-6, atol=0)
    assert int(model["bn.num_batches_tracked"]) == 9  # three rounds of +3: the counter advances
    # what the broadcasts told the clients (the mod takes the record out of the message it handles)
    assert sent[P.UPLOAD_SPEC].startswith("name~*running_mean: none(); name~*running_var: none(); ")
    assert sent[P.DOWNLOAD_SPEC].startswith("name~*running_mean: none(); name~*running_var: none(); ")


@pytest.mark.parametrize("inner", ["FedAvgM", "FedAdam", "FedYogi"])
def test_a_server_step_moves_weights_not_statistics(inner):
    """Strategies that step from the mean (server momentum, Adam) step the weights; the statistics
    and counters stay the clients' mean. FedAvgM's momentum alone drives running_var below zero
    (measured on mnist cnn-bn: stopped in round 2 before)."""
    import flwr.serverapp.strategy as fs

    model, _, strategy = _run(upload="topk(ratio=0.05)+qsgd(bits=4)", inner=getattr(fs, inner))
    weights = torch.tensor([10.0 * n for n in NODES])
    expected = sum(w * _variance(n, 3) for w, n in zip(weights, NODES)) / weights.sum()
    assert torch.allclose(model["bn.running_var"], expected, rtol=1e-6, atol=0)
    assert int(model["bn.num_batches_tracked"]) == 9 and model["bn.num_batches_tracked"].dtype == torch.int64
    assert strategy._statistics_names() == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert not torch.equal(model["conv.weight"], _model()["conv.weight"])  # the weights did move


def test_qfedavg_runs_on_a_model_with_counters():
    """Flower 1.39's QFedAvg scales each reply in place and fails on an int64 buffer (BatchNorm's
    num_batches_tracked); wrapped, it gets counters as float64 and the aggregate is cast back."""
    import flwr.serverapp.strategy as fs

    def qfedavg(**kw):
        return fs.QFedAvg(client_learning_rate=0.1, train_loss_key="num-examples", **kw)

    model, _, _ = _run(upload="qsgd(bits=4)", inner=qfedavg)
    assert model["bn.num_batches_tracked"].dtype == torch.int64 and 0 < int(model["bn.num_batches_tracked"]) <= 9
    assert bool((model["bn.running_var"] > 0).all())


def test_fetchsgd_carries_statistics_beside_the_sketch(download="auto"):
    """aggregation='sketch': the statistics travel exact beside the sketch and are the clients'
    weighted mean, the counter advances, the weights still move by heavy hitters (coupled
    download included: 'auto' broadcasts the server's step with the statistics exact)."""
    model, sent, strategy = _run(upload="sketch(ratio=0.1)", aggregation="sketch", download=download)
    weights = torch.tensor([10.0 * n for n in NODES])
    expected = sum(w * _variance(n, 3) for w, n in zip(weights, NODES)) / weights.sum()
    assert torch.allclose(model["bn.running_var"], expected, rtol=1e-6, atol=0)
    assert int(model["bn.num_batches_tracked"]) == 9
    assert sent[P.UPLOAD_SPEC] == "name~*running_mean: none(); name~*running_var: none(); sketch(rows=1,cols=0,ratio=0.1,seed=0)"
    moved = (model["conv.weight"] != _model()["conv.weight"]).sum()
    assert 0 < moved < 128  # heavy hitters only, 3 rounds of ceil(0.1 x 160)
    # tables cover the 160 weights, not the statistics (plus what the reducer caches: cell counts)
    assert strategy.feedback.nbytes - strategy.feedback.reducer.cache_nbytes == 2 * 4 * 160
    if download == "auto":
        assert strategy.config.coupled_download
        # the step's cells, under the upload sketch's own hashes (cols 0: automatic on both sides)
        assert sent[P.DOWNLOAD_SPEC].startswith("name~*running_mean: none(); name~*running_var: none(); cells(cols=0,seed=0)+")


def test_compressed_like_weights_they_are_not_the_mean():
    """The same run with the rule off: sign() sends the variance as a scaled sign plus a residual,
    which drives it below zero; the replies that would do so are dropped before the sum (BatchNorm
    would output NaN), with the reason."""
    model, _, strategy = _run(upload="sign()", exact_statistics=False)
    assert any("makes the running variance 'bn.running_var' negative" in c["status"]
               for s in strategy.rounds.values() for c in s.clients)
    assert float(model["bn.running_var"].min()) >= 0


def test_models_without_statistics_keep_their_spec():
    strategy = CompressedStrategy(FedAvg(fraction_train=1.0, min_available_nodes=2, min_train_nodes=2),
                                  upload="sign()")
    contexts = {n: node_context(n) for n in (1, 2)}
    model, _, _ = run_round(strategy, {"w": torch.randn(8, 8)}, contexts, 1, app=_plain)
    assert strategy.upload.spec == _last_broadcast(strategy, model, (1, 2))[P.UPLOAD_SPEC] == "sign(block=0)"


def _plain(node, server_round):
    def app(msg, context):
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        return Message(RecordDict({"arrays": ArrayRecord({k: v + node for k, v in received.items()}),
                                   "metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)
    return app
