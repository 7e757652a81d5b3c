"""Cross-device defaults in the wrapper and the mod: server-side error feedback for sketch uploads,
the non-finite guard, seeded first contact, byte-bounded tier history, coupled downloads, and the
regime-picked defaults (issue 15; the study: simulations/figures/xdev/README.md)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAdam, FedAvg, FedMedian

import fedcomp
from fedcomp.server_feedback import ServerFeedback
from fedcomp.strategies import CompressedStrategy, NonFiniteModel

from conftest import node_context, run_round, tiny_model

QSKETCH = "sketch(rows=1,cols=600,ratio=0.02)+qsgd(bits=4)"


def _contexts(n):
    return {i: node_context(i, **{"partition-id": i - 1, "num-partitions": n}) for i in range(1, n + 1)}


# -- 1. aggregation='sketch' through one ServerFeedback -------------------------------------------
def test_quantized_sketch_upload_is_summed_in_sketch_space_by_server_feedback():
    strategy = CompressedStrategy(FedAvg(), upload=QSKETCH, download="none()")
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
    # integer buffers (counters) advance by the clients' rounded mean increment (+1 each), as in decoded rounds
    assert int(step["steps"]) == 1 and torch.equal(new["steps"], model["steps"] + 1)
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


# -- 2. downloads: seeded first contact, byte-bounded history, coupled steps ----------------------
def _drive(strategy, model, contexts, server_round, mod, *, nodes=None):
    """One round with ``mod`` on every sampled node (conftest's run_round uses the plain mod)."""
    from flwr.app import ConfigRecord

    from conftest import FakeGrid, shift_trainer

    grid = FakeGrid(sorted(nodes if nodes is not None else contexts))
    messages = list(strategy.configure_train(server_round, ArrayRecord(model), ConfigRecord({}), grid))
    replies = [mod(m, contexts[m.metadata.dst_node_id], shift_trainer(m.metadata.dst_node_id, server_round))
               for m in messages]
    arrays, _ = strategy.aggregate_train(server_round, replies)
    return (arrays.to_torch_state_dict() if arrays is not None else model), replies


def _modes(strategy, server_round):
    return sorted(d["mode"] for d in strategy.rounds[server_round].downloads)


def _status(strategy, server_round):
    return sorted(c["status"].split(":")[0] for c in strategy.rounds[server_round].clients)


def test_seeded_first_contact_is_a_chain_and_the_client_holds_the_servers_reference():
    from fedcomp.clients import make_compression_mod

    model = tiny_model()
    mod = make_compression_mod(initial_model=lambda context: tiny_model())
    strategy = CompressedStrategy(FedAvg(fraction_train=0.5), upload="topk(ratio=0.1)+qsgd(bits=4)",
                                  download="topk(ratio=0.1)+kbit(bits=8)", seeded_init=True)
    contexts = _contexts(4)
    announced = set()
    for r in (1, 2, 3):
        model, replies = _drive(strategy, model, contexts, r, mod)
        assert _modes(strategy, r) == ["chain", "chain"]  # never the full model, first contact included
        assert _status(strategy, r) == ["ok", "ok"]
        announced |= {m.metadata.src_node_id for m in replies
                      if "capabilities" in m.content.config_records["fedcomp.upload"]}
    assert announced and announced <= strategy._capable  # seeded first contact says what the mod can do
    tier = strategy.tiers[0]
    for c in contexts.values():
        if "fedcomp.reference" in c.state.array_records:
            held = c.state.array_records["fedcomp.reference"].to_torch_state_dict()
            info = c.state.config_records["fedcomp.reference-info"]
            assert tier.verify(int(info["ref-version"]), int(info["ref-crc"]))
            if int(info["ref-version"]) == tier.version:
                assert all(torch.equal(held[k], tier.reference[k]) for k in held)


@pytest.mark.parametrize("initial", ["plain", "other-seed"])
def test_a_node_that_cannot_build_the_seeded_model_resyncs_once_then_gets_the_full_model(initial):
    from fedcomp.clients import compression_mod, make_compression_mod

    mod = compression_mod if initial == "plain" else make_compression_mod(initial_model=lambda c: tiny_model(seed=7))
    strategy = CompressedStrategy(FedAvg(), upload="topk(ratio=0.1)+qsgd(bits=4)",
                                  download="topk(ratio=0.1)+kbit(bits=8)", seeded_init=True)
    model, contexts = tiny_model(), _contexts(2)
    model, _ = _drive(strategy, model, contexts, 1, mod)
    assert _modes(strategy, 1) == ["chain", "chain"] and _status(strategy, 1) == ["resync", "resync"]
    model, _ = _drive(strategy, model, contexts, 2, mod)
    assert _modes(strategy, 2) == ["full", "full"] and _status(strategy, 2) == ["ok", "ok"]
    _drive(strategy, model, contexts, 3, mod)
    assert _modes(strategy, 3) == ["chain", "chain"] and _status(strategy, 3) == ["ok", "ok"]


def test_a_plain_strategy_keeps_the_full_model_on_first_contact():
    from fedcomp.clients import make_compression_mod

    mod = make_compression_mod(initial_model=lambda c: tiny_model())
    strategy = CompressedStrategy(FedAvg(), upload="topk(ratio=0.1)+qsgd(bits=4)", download="kbit(bits=8)")
    _drive(strategy, tiny_model(), _contexts(2), 1, mod)
    assert _modes(strategy, 1) == ["full", "full"]


def test_tier_history_is_bounded_by_the_full_models_bytes_not_by_rounds():
    from fedcomp.broadcast import Tier

    model = tiny_model(rows=40, cols=40)
    tier = Tier(0, "topk(ratio=0.05)+kbit(bits=8)")
    tier.start(model)
    g = torch.Generator().manual_seed(3)
    for r in range(1, 80):
        model = {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                 for k, v in model.items()}
        tier.step(model, r)
        assert tier.history_nbytes == sum(len(s.payload) for s in tier.history) < tier.full_nbytes()
        assert tier.history[-1].round == r
    kept = len(tier.history)
    assert 10 < kept < 79  # more than the old 10-step cap, fewer than all
    # a client as stale as the oldest step kept still gets a chain (cheaper than the full model)
    oldest = tier.history[0]
    plan = tier.plan((0, oldest.round - 1, oldest.base_crc))
    assert plan.mode == "chain" and plan.nbytes < tier.full_nbytes() and len(plan.rounds) == kept
    assert tier.plan(tier.seeded()).mode == "full"  # round 0's step is gone: full
    capped = Tier(0, "topk(ratio=0.05)+kbit(bits=8)", max_stale=5)
    capped.start(model)
    for r in range(1, 9):
        capped.step({k: v + r if v.is_floating_point() else v for k, v in model.items()}, r)
    assert len(capped.history) == 5


def test_coupled_download_moves_the_model_by_exactly_what_it_broadcasts():
    from fedcomp.clients import make_compression_mod

    model0 = tiny_model(rows=64, cols=60)
    mod = make_compression_mod(initial_model=lambda c: tiny_model(rows=64, cols=60))
    strategy = CompressedStrategy(FedAvg(fraction_train=0.5), upload=QSKETCH, seeded_init=True)
    assert strategy.config.coupled_download and strategy.config.download.startswith("cells(cols=600,seed=0)+kbit(bits=4")
    contexts = _contexts(4)
    model = model0
    for r in range(1, 5):
        model, _ = _drive(strategy, model, contexts, r, mod)
        tier = strategy.tiers[0]
        assert tier.version == r + 1 and all(torch.equal(tier.reference[k], model[k]) for k in model)
        if r > 1:
            assert strategy.rounds[r].encodes == 0  # the aggregate's payload is the tier's step: no second encode
    # weights moved; the counter advanced by the clients' mean increment (+1) every round, through the broadcast
    assert not torch.equal(model["w"], model0["w"]) and int(model["steps"]) == int(model0["steps"]) + 4
    # a node replaying the chain from the seeded model holds the global model bit for bit
    _drive(strategy, model, contexts, 5, mod)
    for c in contexts.values():
        info = c.state.config_records.get("fedcomp.reference-info")
        if info is not None and int(info["ref-version"]) == 5:
            held = c.state.array_records["fedcomp.reference"].to_torch_state_dict()
            assert all(torch.equal(held[k], model[k]) for k in model)
            break
    else:
        pytest.fail("no node trained in round 5")


def test_coupled_download_needs_sketch_aggregation():
    with pytest.raises(fedcomp.SpecError, match="coupled_download=True needs aggregation='sketch'"):
        CompressedStrategy(FedAvg(), upload="topk(ratio=0.01)", download="kbit(bits=8)", coupled_download=True)


# -- 3. defaults picked from the regime -----------------------------------------------------------
@pytest.mark.parametrize("fraction, min_nodes, regime", [(1.0, 2, "silo"), (0.5, 2, "device"), (0.5, 4, "silo")])
def test_auto_specs_follow_the_nodes_sampled_and_the_models_size(fraction, min_nodes, regime):
    import math

    from fedcomp.strategies.config import SKETCH_RATIO, SKETCH_SERVER_MOMENTUM

    model = tiny_model(rows=64, cols=60)
    strategy = CompressedStrategy(FedAvg(fraction_train=fraction, min_train_nodes=min_nodes, min_available_nodes=2))
    run_round(strategy, model, _contexts(4), 1)
    numel = 64 * 60 + 64
    if regime == "silo":
        assert strategy.upload.spec.startswith("topk(ratio=0.02") and strategy.error_feedback
        # the broadcast: the aggregate's support (4 nodes x 2%), 4-bit, stochastic rounding
        assert strategy.aggregation == "decode" and not strategy.config.coupled_download
        assert strategy.tiers[0].codec.spec.startswith("topk(ratio=0.08,") and "kbit(bits=4" in strategy.tiers[0].codec.spec
        assert strategy.config.server_warmup == 1.0 and strategy.config.warmup is None
    else:
        assert strategy.upload.spec.startswith(f"sketch(rows=1,cols={math.ceil(0.068 * numel)},ratio={SKETCH_RATIO}")
        assert strategy.aggregation == "sketch" and not strategy.error_feedback
        assert strategy.config.coupled_download and "stochastic=True" in strategy.tiers[0].codec.spec
        assert strategy.tiers[0].codec.spec.startswith(f"cells(cols={math.ceil(0.068 * numel)},seed=0)+")  # its cells
        assert strategy.config.momentum == SKETCH_SERVER_MOMENTUM
        assert strategy.config.server_warmup == 1.0 and strategy._aggregate.feedback.warmup is None  # opt-in
    assert strategy.rounds[1].aggregated == (4 if regime == "silo" else 2)


@pytest.mark.parametrize("upload, fraction, expected", [
    ("topk()", 0.5, "topk(ratio=0.1,"),  # cross-device: the unwritten ratio takes topk's cross-device default
    ("topk()", 1.0, "topk(ratio=0.01,"),  # every node every round: the codec table's default
    ("topk(ratio=0.02)+qsgd(bits=4)", 0.5, "topk(ratio=0.02,"),  # a written ratio stands
])
def test_an_explicit_upload_takes_its_cross_device_defaults_for_what_it_leaves_out(upload, fraction, expected):
    strategy = CompressedStrategy(FedAvg(fraction_train=fraction, min_available_nodes=4, min_train_nodes=2),
                                  upload=upload, download="none()")
    run_round(strategy, tiny_model(), _contexts(4), 1)
    assert strategy.upload.spec.startswith(expected) and strategy.requested.upload == upload
    assert strategy.rounds[1].aggregated == (2 if fraction < 1 else 4)


def test_auto_keeps_decoded_aggregation_with_link_budgets_or_delta():
    for settings in ({"link_profile": "4g"}, {"delta": 0.5}):
        cfg = CompressedStrategy(FedAvg(fraction_train=0.1), **settings).requested.resolve(partial=True, numel=10_000)
        assert cfg.upload.startswith("topk(") and cfg.download == "none()" and not cfg.coupled_download


@pytest.mark.parametrize("exact", [True, False])
def test_auto_keeps_batchnorm_statistics_out_of_the_sketch(exact):
    """A model with running statistics, cross-device: the sketch with the statistics exact beside it
    (their clients' mean, no momentum), or in the sketch when the user turned exact_statistics off."""
    model = {**tiny_model(rows=64, cols=60), "bn.running_mean": torch.zeros(64), "bn.running_var": torch.ones(64),
             "bn.num_batches_tracked": torch.tensor(0)}
    strategy = CompressedStrategy(FedAvg(fraction_train=0.5, min_train_nodes=2, min_available_nodes=2),
                                  exact_statistics=exact)
    new, _, _ = run_round(strategy, model, _contexts(4), 1)
    if exact:
        assert strategy.aggregation == "sketch" and "running_var: none(); sketch(" in strategy.upload.spec
        assert bool((new["bn.running_var"] > 0).all())
    else:
        assert strategy.aggregation == "sketch" and "running_var: none()" not in strategy.upload.spec


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_robust_strategies_sketch_a_batchnorm_model_with_its_statistics_exact(fraction):
    from flwr.serverapp.strategy import FedMedian

    model = {**tiny_model(rows=64, cols=60), "bn.running_mean": torch.zeros(64), "bn.running_var": torch.ones(64),
             "bn.num_batches_tracked": torch.tensor(0)}
    strategy = CompressedStrategy(FedMedian(fraction_train=fraction, min_train_nodes=2, min_available_nodes=2))
    new, _, _ = run_round(strategy, model, _contexts(4), 1)
    assert strategy.aggregation == "sketch" and "running_var: none(); sketch(" in strategy.upload.spec
    assert bool((new["bn.running_var"] > 0).all()) and bool(torch.isfinite(new["w"]).all())


def test_a_dense_tier_keeps_its_latest_step_so_evaluate_and_train_encode_once():
    from flwr.app import ConfigRecord

    from conftest import FakeGrid

    strategy = CompressedStrategy(FedAvg(fraction_evaluate=1.0), upload="topk(ratio=0.1)+qsgd(bits=4)",
                                  download="none()")  # a none() step costs a full model: history keeps one
    model, contexts = tiny_model(), _contexts(2)
    model, _, _ = run_round(strategy, model, contexts, 1)
    strategy.configure_evaluate(1, ArrayRecord(model), ConfigRecord({}), FakeGrid([1, 2]))
    tier = strategy.tiers[0]
    assert len(tier.history) == 1 and tier.version == 2
    run_round(strategy, model, contexts, 2)  # trains from the version evaluate reached: no second step
    assert strategy.rounds[2].encodes == 0 and tier.version == 2


def test_a_reply_that_makes_a_running_variance_negative_is_dropped():
    """A variance below 0 would make BatchNorm output NaN from then on: the wrapper's guards drop
    such a reply before the sum (strategies/guards.py), and the model keeps its variance."""
    model = {**tiny_model(rows=64, cols=60), "bn.running_mean": torch.zeros(64), "bn.running_var": torch.full((64,), 1e-3)}

    def shrink(node, server_round):
        from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

        def app(msg, context):
            state = msg.content.array_records["arrays"].to_torch_state_dict()
            state["bn.running_var"] = state["bn.running_var"] - 1.0  # a (broken) client pushes it below 0
            return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": 5})}),
                           reply_to=msg)
        return app

    strategy = CompressedStrategy(FedAvg(min_available_nodes=2, min_train_nodes=2), upload="none()")
    new, _, _ = run_round(strategy, model, _contexts(2), 1, app=shrink)
    assert torch.equal(new["bn.running_var"], model["bn.running_var"])
    statuses = [c["status"] for c in strategy.rounds[1].clients]
    assert len(statuses) == 2 and all("running variance 'bn.running_var' negative" in s for s in statuses)


def _flwr_warnings():
    import logging

    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    return seen, Catch(level=logging.WARNING)


@pytest.mark.parametrize("upload, fraction, warned", [
    ("topk(ratio=0.01)", 0.5, True),  # biased, client residuals, half the nodes per round
    ("topk(ratio=0.1)+qsgd(bits=4)", 0.5, False),  # a tenth per upload: measured to hold cross-device
    ("powersgd(rank=4)", 0.5, True),  # low rank: most of the update stays in the residual
    ("topk(ratio=0.1)", 1.0, False),  # every node every round: residuals stay fresh
    ("qsgd(bits=4)", 0.5, False),  # unbiased
    ("kbit(bits=4)", 0.5, False),  # dense 4 bit: a small residual (measured within 1 point)
    ("twobit()", 0.5, False),  # threshold 0.001: measured within 2 points cross-device
    ("sign(scale='mean')", 0.5, True),  # 1 bit, mean |x| scale: -3.7 points cross-device (5 seeds)
    ("sign()", 0.5, False),  # cross-device default scale 'rms': held
    ("powersgd()", 0.5, False),  # cross-device default rank 8: held
    ("threshold()", 0.5, False),  # Strom's static threshold: measured within 2 points cross-device
    ("randomk()", 0.5, False),  # cross-device default: a quarter, rescaled (unbiased, no residual)
    ("sketch(rows=1,cols=400)", 0.5, False),  # FetchSGD: the error lives on the server
])
def test_biased_upload_with_partial_participation_warns_once(upload, fraction, warned):
    import logging

    seen, handler = _flwr_warnings()
    logging.getLogger("flwr").addHandler(handler)
    try:
        strategy = CompressedStrategy(FedAvg(fraction_train=fraction, min_available_nodes=4, min_train_nodes=2),
                                      upload=upload, download="none()")
        model, contexts = tiny_model(), _contexts(4)
        for r in (1, 2):
            model, _, _ = run_round(strategy, model, contexts, r)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert sum("stale" in m for m in seen) == (1 if warned else 0)


def test_xdev_study_schemes_are_wrapper_settings_run_through_the_harness():
    """The study's schemes run the real wrapper and mod (simulations/harness.py), tiny here."""
    from fedcomp.simulations import xdev_study as x

    by_name = {s.name: s for s in x.SCHEMES}
    assert by_name["dense"].settings() == {}
    coupled = by_name["fetchsgd-c16000-q4+coupled"].settings()
    assert coupled["aggregation"] == "sketch" and coupled["coupled_download"] and coupled["seeded_init"]
    assert not any("ef21" in s.name or "decay" in s.name for s in x.SCHEMES)  # not expressible by the wrapper
    with pytest.raises(ValueError, match="server learning rate"):
        x.Scheme("bad", "sketch(rows=1,cols=400)", mode="fetchsgd", server_lr=0.1)
    tiny = x.Regime("tiny", 4, 2, rounds=2)
    dense = x.run(by_name["dense"], tiny)
    seeded = x.run(by_name["down-seeded"], tiny)
    assert dense.error is None and dense.download_modes["dense"] == 4 and abs(dense.up_ratio - 1) < 1e-9
    assert seeded.error is None and seeded.download_modes["chain"] == 4 and seeded.down_ratio > 50
    assert 0 < seeded.accuracy <= 1 and len(seeded.curve) == 1


@pytest.mark.parametrize("inner", [lambda: FedMedian(fraction_train=0.5, min_available_nodes=4, min_train_nodes=2),
                                   lambda: FedAdam(fraction_train=0.5, min_available_nodes=4, min_train_nodes=2)])
def test_warmup_is_for_averaging_strategies_only(inner):
    # robust strategies and server optimizers keep no warm-up under 'auto' ...
    strategy = CompressedStrategy(inner())
    run_round(strategy, tiny_model(), _contexts(4), 1)
    assert strategy.aggregation == "sketch" and strategy.config.server_warmup == 1.0
    # ... and refuse one written out, naming the setting and what is allowed
    strategy = CompressedStrategy(inner(), server_warmup=4)
    with pytest.raises(fedcomp.SpecError, match=r"server_warmup=4 applies to FetchSGD with an averaging strategy"):
        run_round(strategy, tiny_model(), _contexts(4), 1)


@pytest.mark.parametrize("warmup, scale", [("auto", None), (4, 4.0), (1, None)])
def test_server_warmup_is_opt_in_and_reaches_the_servers_feedback(warmup, scale):
    from fedcomp.strategies.config import SKETCH_WARMUP_ROUNDS

    strategy = CompressedStrategy(FedAvg(fraction_train=0.5, min_available_nodes=20, min_train_nodes=2),
                                  server_warmup=warmup)
    run_round(strategy, tiny_model(), _contexts(20), 1)
    assert strategy.aggregation == "sketch" and strategy.rounds[1].aggregated == 10
    feedback_warmup = strategy._aggregate.feedback.warmup
    if scale is None:  # 'auto' is off in every regime (it diverged a transformer cross-device)
        assert strategy.config.server_warmup == 1.0 and feedback_warmup is None
    else:  # step size 4 in round 1, falling to 1 over 20 rounds
        assert (feedback_warmup.scale, feedback_warmup.rounds) == (scale, SKETCH_WARMUP_ROUNDS)


@pytest.mark.parametrize("sampled, expected", [(None, "none()"), (1, "topk(ratio=0.02)+kbit(bits=4,stochastic=true)"),
                                               (10, "topk(ratio=0.2)+kbit(bits=4,stochastic=true)"),
                                               (25, "kbit(bits=4,stochastic=true)"), (100, "kbit(bits=4,stochastic=true)")])
def test_silo_download_is_the_aggregates_support_at_4_bits(sampled, expected):
    from fedcomp.strategies.config import silo_download

    assert silo_download(sampled) == expected
    assert silo_download(sampled, "kbit(bits=4)") == "none()"  # no top-k share: nothing to bound the support


def test_silo_download_leaves_server_optimizers_and_written_specs_dense():
    from flwr.serverapp.strategy import FedAdam

    model = tiny_model(rows=64, cols=60)
    adam = CompressedStrategy(FedAdam(fraction_train=1.0, min_available_nodes=2, min_train_nodes=2))
    run_round(adam, model, _contexts(4), 1)
    assert adam.upload.spec.startswith("topk(ratio=0.02") and adam.tiers[0].codec.spec == "none()"
    written = CompressedStrategy(FedAvg(fraction_train=1.0, min_available_nodes=2, min_train_nodes=2),
                                 upload="topk(ratio=0.02)+qsgd(bits=4)")
    run_round(written, model, _contexts(4), 1)
    assert written.tiers[0].codec.spec == "none()"  # a written upload: download 'auto' stays dense


def test_silo_download_stays_dense_for_fedavgm():
    from flwr.serverapp.strategy import FedAvgM

    strategy = CompressedStrategy(FedAvgM(fraction_train=1.0, min_available_nodes=2, min_train_nodes=2))
    run_round(strategy, tiny_model(rows=64, cols=60), _contexts(4), 1)
    assert strategy.upload.spec.startswith("topk(ratio=0.02") and strategy.tiers[0].codec.spec == "none()"


def test_recurrent_models_take_fetchsgd_cross_silo():
    """Every node every round, a model with recurrent layers: the averaging strategies take FetchSGD
    at a 0.1 share without server momentum (top-k 2% lost 5 points on an LSTM; docs: Results,
    Regimes); FedAdam keeps its top-k; a model without them keeps the silo defaults."""
    from fedcomp.strategies.config import RECURRENT_SKETCH_RATIO

    lstm = {k: v.detach().clone() for k, v in torch.nn.LSTM(8, 16).state_dict().items()}
    lstm["out.weight"] = torch.randn(4, 16)
    avg = CompressedStrategy(FedAvg(fraction_train=1.0, min_available_nodes=2, min_train_nodes=2))
    run_round(avg, lstm, _contexts(4), 1)
    assert avg.aggregation == "sketch" and f"ratio={RECURRENT_SKETCH_RATIO})" in avg.config.upload
    assert avg.config.momentum == 0.0 and avg.config.coupled_download
    assert avg.tiers[0].codec.spec.startswith("cells(")
    adam = CompressedStrategy(FedAdam(fraction_train=1.0, min_available_nodes=2, min_train_nodes=2))
    run_round(adam, lstm, _contexts(4), 1)
    assert adam.aggregation == "decode" and adam.upload.spec.startswith("topk(ratio=0.02")
    mlp = CompressedStrategy(FedAvg(fraction_train=1.0, min_available_nodes=2, min_train_nodes=2))
    run_round(mlp, tiny_model(rows=64, cols=60), _contexts(4), 1)
    assert mlp.aggregation == "decode" and mlp.upload.spec.startswith("topk(ratio=0.02")
