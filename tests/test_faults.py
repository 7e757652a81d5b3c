"""Bad replies and faulty clients: each is dropped with a clear reason and the round still aggregates the rest.

Driven in process: the wrapper's configure_train, the client mod around a stand-in ClientApp,
then aggregate_train (tests/conftest.py FakeGrid).
"""

from __future__ import annotations

import math
import subprocess

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

import fedcomp
from fedcomp.clients.mod import compression_mod
from conftest import FakeGrid
from fedcomp import protocol as P
from fedcomp.simulations.server_app import validate_run_config
from fedcomp.strategies.wrapper import CompressedStrategy


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.randn(16, generator=g), "steps": torch.tensor(5)}


def _shift(seed, scale=0.01):
    g = torch.Generator().manual_seed(seed)
    return {"w": scale * torch.randn(16, 8, generator=g), "b": scale * torch.randn(16, generator=g),
            "steps": torch.tensor(1)}


def _app(shift, examples=10, reshape=None):
    """A ClientApp stand-in: 'trains' by adding ``shift``; ``reshape`` gives it another model."""

    def app(msg: Message, context: Context) -> Message:
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        trained = {k: v + shift[k] for k, v in received.items()}
        if reshape:
            trained = reshape(trained)
        content = RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": examples})})
        return Message(content, reply_to=msg)

    return app


def _round(strategy, model, apps, server_round=1, tamper=None, contexts=None):
    contexts = contexts or {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
                            for n in apps}
    messages = strategy.configure_train(server_round, ArrayRecord(model), ConfigRecord({}), FakeGrid(sorted(apps)))
    replies = []
    for msg in messages:
        node = msg.metadata.dst_node_id
        reply = compression_mod(msg, contexts[node], apps[node])
        if tamper and node in tamper:
            tamper[node](reply)
        replies.append(reply)
    arrays, _ = strategy.aggregate_train(server_round, replies)
    return arrays.to_torch_state_dict(), {c["node"]: c["status"] for c in strategy.rounds[server_round].clients}


def _only_node_1(out, model, shift):
    """The aggregate is node 1's model alone: the bad reply was left out, the round went on."""
    for name in ("w", "b"):
        torch.testing.assert_close(out[name], model[name] + shift[name], rtol=0, atol=1e-6)


def _set_payload(payload: bytes):
    def tamper(reply):
        reply.content.config_records[P.UPLOAD_RECORD][P.PAYLOAD] = payload
    return tamper


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_update_is_dropped_and_round_aggregates_the_rest(bad):
    model, s1, s2 = _model(), _shift(1), _shift(2)
    s2["b"][3] = bad
    strategy = CompressedStrategy(FedAvg(min_available_nodes=2), upload="none()")
    out, status = _round(strategy, model, {1: _app(s1), 2: _app(s2)})
    _only_node_1(out, model, s1)
    assert status[1] == "ok" and status[2].startswith("dropped") and "NaN or Inf" in status[2]


def test_norm_bound_drops_absurd_update_with_reason():
    model, s1, s2 = _model(), _shift(1), _shift(2, scale=1e4)
    norm2 = math.sqrt(float(s2["w"].pow(2).sum() + s2["b"].pow(2).sum()))
    strategy = CompressedStrategy(FedAvg(min_available_nodes=2), upload="none()", max_update_norm=10.0)
    out, status = _round(strategy, model, {1: _app(s1), 2: _app(s2)})
    _only_node_1(out, model, s1)
    assert status[1] == "ok"
    assert status[2].startswith("dropped") and "exceeds max_update_norm=10" in status[2]
    assert f"{norm2:.4g}" in status[2]
    # the bounds do the work: without them (no absolute bound, relative guard off) it is averaged in
    off = CompressedStrategy(FedAvg(min_available_nodes=2), upload="none()", norm_factor=0)
    out, status = _round(off, model, {1: _app(s1), 2: _app(s2)})
    assert set(status.values()) == {"ok"} and float((out["w"] - model["w"]).abs().max()) > 100


def test_norm_bound_with_compressed_upload_and_sketch_aggregation():
    model, s1, s2 = _model(), _shift(1), _shift(2, scale=1e4)
    for kwargs in ({"upload": "topk(ratio=0.2)+qsgd(bits=4)"},
                   {"upload": "sketch(rows=3, cols=200, ratio=0.3)", "aggregation": "sketch"}):
        strategy = CompressedStrategy(FedAvg(min_available_nodes=2), max_update_norm=10.0, **kwargs)
        out, status = _round(strategy, model, {1: _app(s1), 2: _app(s2)})
        assert status[1] == "ok" and "exceeds max_update_norm" in status[2], kwargs
        assert float((out["w"] - model["w"]).abs().max()) < 1, kwargs


def test_max_update_norm_parameter_checked():
    for bad in (-1.0, float("inf"), float("nan"), "1"):
        with pytest.raises(fedcomp.SpecError, match="max_update_norm"):
            CompressedStrategy(FedAvg(), max_update_norm=bad)


def test_client_with_another_model_gets_a_clear_error_and_round_goes_on():
    model, s1, s2 = _model(), _shift(1), _shift(2)

    def other_model(trained):
        return {**trained, "w": torch.zeros(16, 9)}  # another architecture: w is 16 x 9

    strategy = CompressedStrategy(FedAvg(min_available_nodes=1), upload="none()")
    out, status = _round(strategy, model, {1: _app(s1), 2: _app(s2, reshape=other_model)})
    _only_node_1(out, model, s1)
    assert status[1] == "ok"
    assert status[2].startswith("error") and "does not match the server's layout" in status[2] and "(16, 9)" in status[2]


def test_payload_for_another_layout_is_dropped_with_reason():
    model, s1 = _model(), _shift(1)
    foreign = fedcomp.build_codec("none()").encode({"w": torch.zeros(4, 4)}).payload
    strategy = CompressedStrategy(FedAvg(min_available_nodes=1), upload="none()")
    out, status = _round(strategy, model, {1: _app(s1), 2: _app(_shift(2))}, tamper={2: _set_payload(foreign)})
    _only_node_1(out, model, s1)
    assert status[2].startswith("dropped") and "another model layout" in status[2]


@pytest.mark.parametrize("payload, reason", [
    (b"", "shorter"),
    (b"\x80\x04garbage" * 10, "not a fedcomp payload"),
    (None, "lacks the key 'payload'"),
    ("a string", "bytes"),
])
def test_garbage_payloads_are_dropped_with_reason(payload, reason):
    model, s1 = _model(), _shift(1)
    strategy = CompressedStrategy(FedAvg(min_available_nodes=1), upload="topk(ratio=0.5)")
    out, status = _round(strategy, model, {1: _app(s1), 2: _app(_shift(2))}, tamper={2: _set_payload(payload)}
                         if payload is not None else {2: _drop_payload})
    assert status[1] == "ok" and status[2].startswith("dropped") and reason in status[2]
    assert torch.isfinite(out["w"]).all()


def _drop_payload(reply):
    del reply.content.config_records[P.UPLOAD_RECORD][P.PAYLOAD]


def test_payload_of_another_codec_is_dropped_with_reason():
    model, s1 = _model(), _shift(1)
    other = fedcomp.build_codec("fp16").encode({k: v for k, v in _shift(2).items()}).payload
    strategy = CompressedStrategy(FedAvg(min_available_nodes=1), upload="none()")
    _, status = _round(strategy, model, {1: _app(s1), 2: _app(_shift(2))}, tamper={2: _set_payload(other)})
    assert status[2].startswith("dropped") and "another codec" in status[2]


def test_run_config_max_update_norm_validated():
    from test_flower import ROOT  # noqa: F401  (the same pyproject defaults the app reads)
    import tomllib

    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert validate_run_config(defaults)["max-update-norm"] == 0.0
    for bad in (-1.0, float("inf"), "big", True):
        with pytest.raises(ValueError, match=r"max-update-norm=.* must be a finite float >= 0"):
            validate_run_config({**defaults, "max-update-norm": bad})


# -- configuration: every key validated at start, naming key, value and what is allowed -----------
BAD_RUN_CONFIG = {
    "num-server-rounds": (0, "positive integer"),
    "fraction-train": (1.5, "a fraction in (0, 1]"),
    "fraction-evaluate": (-0.5, "a fraction in [0, 1]"),
    "task": ("imagenet", "one of"),
    "model": ("resnet", "one of"),
    "local-epochs": (0, "positive integer"),
    "lr": (0.0, "a positive float"),
    "batch-size": (-1, "positive integer"),
    "seed": (-3, "non-negative integer"),
    "partition-alpha": (0.0, "positive float"),
    "upload": ("topk(ratio=2)", "ratio must be a fraction in (0, 1]"),
    "download": ("gzip()", "unknown codec 'gzip'"),
    "download-tier-kbps": ("8000,1000", "ascending"),
    "download-max-stale": (-1, "an integer >= 0"),
    "link-profile": ("5g-dream", "link-profile='5g-dream' is invalid"),
    "round-deadline-s": (-1.0, "seconds >= 0"),
    "budget-fallback": ("retry", "one of"),
    "streaming": ("yes", "true or false"),
    "error-feedback": ("yes", "true or false"),
    "out-dir": ("  ", "a directory path"),
    "aggregation": ("mean", "'auto', 'decode' or 'sketch'"),
    "server-momentum": (1.0, "a float in [0, 1)"),
    "server-warmup": (0.5, "'auto' or a factor in [1, 100]"),
    "delta": (2.0, "a float in [0, 1]"),
    "max-update-norm": (-1.0, "a finite float >= 0"),
    "weight-factor": (0.5, "0 (trust declared weights) or a finite float >= 1"),
    "faults": ("crash=2", "crash must be a probability in [0, 1]"),
    "round-timeout": (0.0, "seconds > 0"),
}


def _defaults():
    import tomllib

    from test_flower import ROOT

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def test_every_run_config_key_has_a_rejection_test():
    from fedcomp.simulations.server_app import CONFIG_KEYS

    assert set(BAD_RUN_CONFIG) == set(CONFIG_KEYS)


@pytest.mark.parametrize("key", sorted(BAD_RUN_CONFIG))
def test_bad_run_config_value_names_key_value_and_allowed(key):
    value, allowed = BAD_RUN_CONFIG[key]
    defaults = _defaults()
    validate_run_config(defaults)
    with pytest.raises(ValueError) as info:
        validate_run_config({**defaults, key: value})
    message = str(info.value)
    assert f"{key}={value!r}" in message and allowed in message, message


def test_wrong_type_and_unknown_keys_are_rejected():
    defaults = _defaults()
    with pytest.raises(ValueError, match=r"num-server-rounds='3' is invalid"):
        validate_run_config({**defaults, "num-server-rounds": "3"})
    with pytest.raises(ValueError, match=r"unknown keys \['max-update-nrom'\]; allowed: .*max-update-norm"):
        validate_run_config({**defaults, "max-update-nrom": 1.0})
    with pytest.raises(ValueError, match="lacks"):
        validate_run_config({k: v for k, v in defaults.items() if k != "upload"})


def test_bad_spec_fails_before_any_round():
    """The ServerApp validates first: a bad spec raises before the strategy sends anything."""
    from flwr.app import Context as AppContext

    from fedcomp.simulations import server_app

    class NoGrid:
        def __getattr__(self, name):
            raise AssertionError(f"the grid was used ({name}) before the config was checked")

    context = AppContext(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                         run_config={**_defaults(), "upload": "topk(ratio=0.01)+qsgd(bits=9)"})
    main = server_app.main.__wrapped__ if hasattr(server_app.main, "__wrapped__") else server_app.main
    with pytest.raises(ValueError, match=r"upload='topk\(ratio=0.01\)\+qsgd\(bits=9\)' is invalid.*bits"):
        main(NoGrid(), context)


@pytest.mark.parametrize("node_config, message", [
    ({"num-partitions": 4}, "lacks 'partition-id'"),
    ({"partition-id": 0}, "lacks 'num-partitions'"),
    ({"partition-id": 4, "num-partitions": 4}, "partition-id=4 is invalid: partition-id must be an integer in [0, 4)"),
    ({"partition-id": -1, "num-partitions": 4}, "partition-id=-1 is invalid"),
    ({"partition-id": "0", "num-partitions": 4}, "partition-id='0' is invalid"),
    ({"partition-id": 0, "num-partitions": 0}, "num-partitions=0 is invalid: num-partitions must be a positive integer"),
    ({"partition-id": 0, "num-partitions": True}, "num-partitions=True is invalid"),
    ({"partition-id": 0, "num-partitions": 4, "device": "gpu0"}, "device='gpu0' is invalid: device must be a torch device"),
    ({"partition-id": 0, "num-partitions": 4, "device": 3}, "device=3 is invalid"),
])
def test_bad_node_config_names_key_value_and_allowed(node_config, message):
    from fedcomp.simulations.client_app import validate_node_config

    with pytest.raises(ValueError) as info:
        validate_node_config(node_config)
    assert message in str(info.value)


def test_good_node_config_passes():
    from fedcomp.simulations.client_app import validate_node_config

    assert validate_node_config({"partition-id": 2, "num-partitions": 5, "device": "cpu"}) == (2, 5)


# -- fault injection: crashes, garbage, timeouts, clients that sit out and come back ---------------
from flwr.app import Error  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402

from fedcomp.simulations.faults import FaultPlan, draw, faults_mod, parse_faults  # noqa: E402

FAULTS = "crash=0.15,garbage=0.15,slow=0.1,sleep=0,absent=3-4,absent-frac=0.34"


def test_parse_faults():
    plan = parse_faults(FAULTS)
    assert plan == FaultPlan(crash=0.15, garbage=0.15, slow=0.1, sleep=0.0, absent=(3, 4), absent_frac=0.34)
    assert not parse_faults("").active and parse_faults("absent=2").absent == (2, 2)
    for bad, message in [("crash", "name=value"), ("boom=0.1", "name=value"), ("crash=x", "crash must be a number"),
                         ("absent=4-2", "absent must be rounds A-B"), ("slow=-0.1", "probability"),
                         ("crash=0.6,garbage=0.6", "at most 1"), ("sleep=1e9", "sleep must be seconds"),
                         ("crash=0.1,crash=0.2", "given twice")]:
        with pytest.raises(fedcomp.SpecError, match=message):
            parse_faults(bad)


def test_late_client_sleeps_past_its_rounds_deadline_counted_from_the_message():
    from fedcomp.simulations.faults import late_seconds

    plan = parse_faults("late=1,late-margin=2")
    assert plan.late == 1.0 and plan.late_margin == 2.0
    msg = Message(RecordDict({}), dst_node_id=1, message_type="train")
    created = msg.metadata.created_at
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={"round-timeout": 30.0})
    # however long the client waited to run (a loaded machine), it replies 2 s past the deadline
    for waited in (0.0, 10.0, 29.0, 40.0):
        assert late_seconds(msg, context, plan, now=created + waited) == pytest.approx(max(0.0, 32.0 - waited))
    with pytest.raises(fedcomp.SpecError, match="round-timeout"):
        late_seconds(msg, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}), plan)


def test_adding_late_leaves_the_other_draws_as_they_were():
    plan, late = parse_faults(FAULTS), parse_faults(FAULTS + ",late=0.2")
    grid = [[draw(plan, 3, r, p) for p in range(6)] for r in range(1, 9)]
    with_late = [[draw(late, 3, r, p) for p in range(6)] for r in range(1, 9)]
    assert any(f == "late" for row in with_late for f in row)
    assert all(b == "late" or a == b for ra, rb in zip(grid, with_late) for a, b in zip(ra, rb))


def test_fault_draws_are_seeded_per_seed_round_partition():
    plan = parse_faults(FAULTS)
    grid = [[draw(plan, 3, r, p) for p in range(6)] for r in range(1, 9)]
    assert grid == [[draw(plan, 3, r, p) for p in range(6)] for r in range(1, 9)]
    assert grid != [[draw(plan, 4, r, p) for p in range(6)] for r in range(1, 9)]
    assert all(grid[r - 1][p] == "absent" for r in (3, 4) for p in range(6) if grid[2][p] == "absent")


def _simulate(faults, rounds=8, n=6, seed=3, upload="topk(ratio=0.2)+qsgd(bits=4)", node_ids=None, order=None, **kw):
    """Rounds of the wrapper and the real faults_mod + compression_mod chain, driven as Flower would:
    an exception in the ClientApp becomes an error reply, a reply later than the round timeout
    (a slow client) is never handed to the strategy."""
    plan = parse_faults(faults)
    node_ids = node_ids or [100 + p for p in range(n)]
    partition = dict(zip(node_ids, range(n)))
    contexts = {node: Context(run_id=1, node_id=node, node_config={"partition-id": p, "num-partitions": n},
                              state=RecordDict(), run_config={"faults": faults, "seed": seed})
                for node, p in partition.items()}
    strategy = CompressedStrategy(FedAvg(), upload=upload, seed=seed, **kw)
    model, history, payloads, faults_seen = _model(), [], [], []
    for r in range(1, rounds + 1):
        messages = list(strategy.configure_train(r, ArrayRecord(model), ConfigRecord({}), FakeGrid(node_ids)))
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            p = partition[node]
            app = _app(_shift(1000 * r + p), examples=10 + p)
            try:
                reply = faults_mod(msg, contexts[node], lambda m, c: compression_mod(m, c, app))
            except Exception as exc:  # what Flower makes of an exception raised in a ClientApp
                reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(exc).__name__}: {exc}"),
                                reply_to=msg)
            fault = draw(plan, seed, r, p)
            faults_seen.append((r, p, fault))
            if fault == "slow":
                continue  # arrived after the round's timeout
            if not reply.has_error():
                payloads.append((r, p, bytes(reply.content.config_records[P.UPLOAD_RECORD][P.PAYLOAD])))
            replies.append(reply)
        arrays, _ = strategy.aggregate_train(r, order(replies) if order else replies)
        if arrays is not None:
            model = arrays.to_torch_state_dict()
        history.append({k: v.clone() for k, v in model.items()})
    return strategy, history, payloads, faults_seen, contexts, partition


def test_fault_injection_run_completes_finite_and_records_drops():
    strategy, history, _, seen, contexts, partition = _simulate(FAULTS)
    kinds = {f for _, _, f in seen}
    assert {"crash", "garbage", "slow", "absent", None} <= kinds, kinds  # every fault happened at least once
    assert all(torch.isfinite(t.float()).all() for t in history[-1].values())
    assert not torch.equal(history[-1]["w"], _model()["w"])  # the model moved: rounds aggregated
    node_of = {p: node for node, p in partition.items()}
    expected = {
        "crash": "error: InjectedFault: fault injection: client {p} crashed in round {r} after training",
        "garbage": "dropped: not a fedcomp payload",
        "slow": "no reply: timed out or node unavailable",
        "absent": "error: fault injection: client {p} sits out round {r}",
        None: "ok",
    }
    for r, p, fault in seen:
        status = {c["node"]: c["status"] for c in strategy.rounds[r].clients}[node_of[p]]
        assert status.startswith(expected[fault].format(p=p, r=r)), (r, p, fault, status)
    # the clients that sat out rounds 3-4 are back from round 5 (the status loop above checked each)
    back = {p for r, p, f in seen if r == 3 and f == "absent"}
    assert back and back == {p for r, p, f in seen if r == 4 and f == "absent"}
    assert not back & {p for r, p, f in seen if r == 5 and f == "absent"}


def test_absent_client_keeps_its_residual_while_away():
    """A client that sits out does not touch its state: the residual it had is applied when it returns."""
    faults = "absent=2-3,absent-frac=1"
    plan = parse_faults(faults)
    node, ctx_state = 7, RecordDict()
    context = Context(run_id=1, node_id=node, node_config={"partition-id": 0, "num-partitions": 1},
                      state=ctx_state, run_config={"faults": faults, "seed": 0})
    strategy = CompressedStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1), upload="topk(ratio=0.1)")
    model, residuals = _model(), {}
    for r in range(1, 5):
        msg = list(strategy.configure_train(r, ArrayRecord(model), ConfigRecord({}), FakeGrid([node])))[0]
        reply = faults_mod(msg, context, lambda m, c: compression_mod(m, c, _app(_shift(r))))
        assert reply.has_error() == (draw(plan, 0, r, 0) == "absent") == (r in (2, 3))
        residuals[r] = {k: v.clone() for k, v in context.state.array_records[P.RESIDUAL_STATE].to_torch_state_dict().items()}
        arrays, _ = strategy.aggregate_train(r, [reply])
        model = arrays.to_torch_state_dict() if arrays is not None else model
    assert all(torch.equal(residuals[1][k], residuals[3][k]) for k in residuals[1])  # untouched while away
    assert not torch.equal(residuals[4]["w"], residuals[1]["w"])  # used and renewed on return
    assert {c["status"] for c in strategy.rounds[4].clients} == {"ok"}


# -- the same faults through `flwr run` (simulation engine, real timeouts and exceptions) ---------
from test_flower import _flwr_run, superlink  # noqa: E402,F401  (the SuperLink fixture, stopped by PID)

# seed 3 draws (rounds 1-4 x partitions 0-3): garbage+crash, absent, absent, garbage. No slow or late
# client: a reply later than the round timeout needs a timeout the honest clients finish within, and on
# a loaded machine (load 14: every node timed out at 50 s) no fixed timeout does; the timeout itself is
# tested in process (test_streaming: StreamingGrid returns what arrived; _simulate: a late reply is
# never handed over) and a late client's sleep counts from its message (test_late_client_*). The round
# timeout here only bounds a run that hangs.
E2E_FAULTS = "crash=0.15,garbage=0.15,absent=2-3,absent-frac=0.25"


@pytest.mark.slow
def test_flwr_run_with_fault_injection(superlink, tmp_path):  # noqa: F811
    seed, rounds, n = 3, 4, 4
    plan = parse_faults(E2E_FAULTS)
    expected = {r: [draw(plan, seed, r, p) for p in range(n)] for r in range(1, rounds + 1)}
    assert {f for fs in expected.values() for f in fs} >= {"crash", "garbage", "absent", None}
    # one actor per client, so a sleeping client does not hold up the others (2 cores: oversubscribed)
    subprocess.run(["flwr", "federation", "simulation-config", "--num-supernodes", str(n),
                    "--client-resources-num-cpus", "1", "--init-args-num-cpus", str(n)],
                   env=superlink, check=True, capture_output=True, timeout=60)
    run = _flwr_run(superlink, tmp_path / "faults",
                    f"num-server-rounds={rounds} seed={seed} faults='{E2E_FAULTS}' round-timeout=1800.0 "
                    f"upload='topk(ratio=0.05)+qsgd(bits=4)'")
    assert [r["round"] for r in run["rounds"]] == list(range(1, rounds + 1))
    for r in run["rounds"]:
        assert math.isfinite(r["loss"]) and math.isfinite(r["accuracy"])
        statuses = [c["status"] for c in r["clients"]]
        faults = expected[r["round"]]
        assert len(statuses) == n, statuses
        assert statuses.count("ok") == faults.count(None), (faults, statuses)
        assert sum(s.startswith("dropped: not a fedcomp payload") for s in statuses) == faults.count("garbage")
        assert sum(s.startswith("no reply") for s in statuses) == faults.count("slow"), (faults, statuses)
        for p, f in enumerate(faults):
            if f in ("crash", "absent"):
                word = "crashed" if f == "crash" else "sits out"
                assert any(f"client {p} {word} in round" in s or f"client {p} {word} round" in s
                           for s in statuses), (p, f, statuses)
    assert run["rounds"][-1]["loss"] < math.log(10) - 0.05  # it still learns (chance: loss ln 10, accuracy 0.1)


# -- determinism: same seed and config, same bytes and the same model, whatever the reply order ---
def test_same_seed_gives_same_bytes_and_model_in_any_reply_order_and_node_ids():
    upload = "topk(ratio=0.2)+qsgd(bits=4)"  # stochastic rounding: the nonce matters
    _, hist_a, pay_a, seen_a, _, _ = _simulate(FAULTS, rounds=5, upload=upload)
    _, hist_b, pay_b, seen_b, _, _ = _simulate(FAULTS, rounds=5, upload=upload,
                                               node_ids=[9_000_001, 17, 5_555, 42, 77_777, 3],  # random per run in Flower
                                               order=lambda replies: replies[::-1])
    assert sorted(seen_a, key=str) == sorted(seen_b, key=str)
    assert sorted(pay_a) == sorted(pay_b)  # the same payload bytes per (round, partition)
    for a, b in zip(hist_a, hist_b):
        assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    _, _, pay_c, _, _, _ = _simulate(FAULTS, rounds=5, upload=upload, seed=4)
    assert sorted(pay_c) != sorted(pay_a)  # the seed does change the run


def test_canonical_order_is_needed_for_bitwise_sums():
    """Without a fixed order FedAvg's float sums depend on arrival order (why the wrapper sorts)."""
    g = torch.Generator().manual_seed(0)
    contents = [RecordDict({"arrays": ArrayRecord({"w": torch.randn(1000, generator=g) * 10 ** i}),
                            "metrics": MetricRecord({"num-examples": 7 + i})}) for i in range(6)]
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    forward = aggregate_arrayrecords(contents, "num-examples").to_torch_state_dict()["w"]
    backward = aggregate_arrayrecords(contents[::-1], "num-examples").to_torch_state_dict()["w"]
    assert not torch.equal(forward, backward)


@pytest.mark.slow
def test_flwr_run_twice_gives_the_same_curve(superlink, tmp_path):  # noqa: F811
    config = "num-server-rounds=2 seed=5 upload='topk(ratio=0.05)+qsgd(bits=4)'"
    runs = [_flwr_run(superlink, tmp_path / f"run{i}", config) for i in range(2)]
    curves = [[(r["accuracy"], r["loss"], r["upload_bytes"]) for r in run["rounds"]] for run in runs]
    assert curves[0] == curves[1] and len(curves[0]) == 2


# -- deployment: a SuperNode killed mid-run and restarted has lost Context.state ------------------
def _nodes(dep) -> list[dict]:
    import json

    from fedcomp.simulations import deploy

    out = dep.flwr("supernode", "list", deploy.CONNECTION, "--format", "json").stdout
    return json.loads(out[out.index("{"):])["nodes"]


def _wait_rounds(path, count, proc, timeout):
    import json
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        if len(data.get("rounds", [])) >= count:
            return data
        if not proc.alive():
            break
        time.sleep(0.2)
    raise AssertionError(f"run did not reach round {count}:\n{proc.log()[-3000:]}")


def _restart_supernode(dep, index, timeout=240):
    """Start SuperNode ``index`` again with its key. The SuperLink refuses to activate a node id
    it still believes online (Flower exit code 305) until the dead one misses its heartbeats, so
    retry until the SuperLink logs a new activation."""
    import time

    from fedcomp.simulations import deploy

    deadline = time.monotonic() + timeout
    attempt = 0
    while time.monotonic() < deadline:
        attempt += 1
        activations = len(dep.activated_nodes())
        proc = deploy.start_supernode(dep, index, len(dep.supernodes), key=dep.node_keys[index],
                                      name=f"supernode-{index}-restart{attempt}")
        while time.monotonic() < deadline and proc.alive() and len(dep.activated_nodes()) == activations:
            time.sleep(0.5)
        if proc.alive() and len(dep.activated_nodes()) > activations:
            return proc
        deploy.stop_process(proc)
        time.sleep(5)
    raise AssertionError(f"SuperNode {index} was not activated again within {timeout}s")


@pytest.mark.slow
def test_supernode_killed_and_restarted_resyncs_and_run_goes_on(tmp_path):
    """TLS and SuperNode authentication (an unregistered key is refused, no cleartext on the wire),
    and a crash: SIGKILL one of two SuperNodes after round 2 and start it again with the same key (so the
    same node id): its ClientApp state (broadcast reference, residual) is gone. The server still
    holds the node's old reference, the node answers with a resync request, gets a full model in
    the next round, and the run finishes every round with a finite model."""
    import os
    import signal

    from fedcomp.simulations import deploy

    from fedcomp.simulations.certs import make_node_keys

    rounds = 6
    with deploy.deployment(tmp_path / "deploy", 2, tls=True, auth=True) as dep:
        # SuperNode authentication: the two registered keys are activated; a key that was never
        # registered, started next to the run, is refused (checked when the run is over)
        registered = {int(n["node-id"]) for n in _nodes(dep)}
        assert len(registered) == 2 and set(dep.activated_nodes()) == registered
        (intruder_key,) = make_node_keys(tmp_path / "intruder", ["intruder"])
        intruder = deploy.start_supernode(dep, 0, 1, key=intruder_key, name="intruder", max_retries=2)
        dep.extra.append(intruder)  # stopped with the deployment if still alive
        out = tmp_path / "run"
        out.mkdir()
        config = (f"num-server-rounds={rounds} download='topk(ratio=0.2)+qsgd(bits=8)' round-timeout=120.0 "
                  f"out-dir='{out}'")
        run = deploy._spawn("flwr-run", ["flwr", "run", str(deploy.ROOT), deploy.CONNECTION, "--stream",
                                         "--run-config", config], dep.cli_env, out / "flwr-run.log", dep.workdir)
        try:
            before = _wait_rounds(out / "results.json", 2, run, 400)
            victim = dep.supernodes[1]
            kids = deploy.descendants(victim.pid)
            os.killpg(victim.pid, signal.SIGKILL)  # a crash, not a shutdown
            deploy._signal_pids(kids, signal.SIGKILL)
            deploy.stop_process(victim)  # reaps it and closes its log
            dep.supernodes[1] = _restart_supernode(dep, 1)
            data = _wait_rounds(out / "results.json", rounds, run, 600)
            run.popen.wait(timeout=120)
        finally:
            if run.alive():
                deploy.stop_process(run)
        code = intruder.popen.wait(timeout=60)
        assert code != 0, intruder.log()[-2000:]
        assert "Failed to activate SuperNode" in intruder.log()
        assert "No SuperNode found with the given public key" in dep.superlink.log()
        assert {int(n["node-id"]) for n in _nodes(dep)} == registered  # the intruder never joined
        # TLS on the wire: the relay saw no cleartext HTTP/2 in the whole deployment
        h2 = dep.relay.http2_counts()["client_to_server"]
        assert h2["preface_bytes"] == 0 and h2["opaque_bytes"] == dep.relay.counts().client_to_server > 0
    assert run.popen.returncode == 0, run.log()[-3000:]
    assert [r["round"] for r in data["rounds"]] == list(range(1, rounds + 1))
    assert all(math.isfinite(r["loss"]) for r in data["rounds"])
    nodes = {c["node"] for c in before["rounds"][0]["clients"]}
    assert len(nodes) == 2
    later = data["rounds"][2:]
    statuses = [(r["round"], c["node"], c["status"]) for r in later for c in r["clients"]]
    resyncs = [(r, n, s) for r, n, s in statuses if s.startswith("resync:")]
    assert resyncs, statuses  # the server noticed (the restarted node holds no reference)
    r_resync, node, _ = resyncs[0]
    assert node in nodes  # the same node id came back
    full = [r for r in data["rounds"] if r["round"] > r_resync
            for d in r["downloads"] if d["node"] == node and d["mode"] == "full"]
    assert full, "no full model was sent after the resync request"
    ok_after = [r for r, n, s in statuses if n == node and s == "ok" and r > r_resync]
    assert ok_after, statuses  # and it takes part again
    assert data["rounds"][-1]["accuracy"] > data["rounds"][0]["accuracy"]


def test_superlink_error_for_a_dead_node_is_recorded_under_that_node():
    """Flower answers for a node that stopped heartbeating with an error whose sender is not the
    node: the wrapper records it once, as that node's missing reply, with the SuperLink's reason."""
    model, s1 = _model(), _shift(1)
    strategy = CompressedStrategy(FedAvg(min_available_nodes=1), upload="none()")
    messages = sorted(strategy.configure_train(1, ArrayRecord(model), ConfigRecord({}), FakeGrid([1, 2])),
                      key=lambda m: m.metadata.dst_node_id)
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    ok = compression_mod(messages[0], context, _app(s1))
    from flwr.app import Metadata

    made = Message(Error(ErrorCode.NODE_UNAVAILABLE, "Node Unavailable: no heartbeat"), reply_to=messages[1])
    fields = {f: getattr(made.metadata, f) for f in ("run_id", "message_id", "dst_node_id", "reply_to_message_id",
                                                     "group_id", "created_at", "ttl", "message_type")}
    dead = Message(metadata=Metadata(src_node_id=0, **fields), error=made.error)  # sender: the SuperLink, not node 2
    arrays, _ = strategy.aggregate_train(1, [ok, dead])
    _only_node_1(arrays.to_torch_state_dict(), model, s1)
    status = {c["node"]: c["status"] for c in strategy.rounds[1].clients}
    assert status == {1: "ok", 2: "no reply: timed out or node unavailable (Node Unavailable: no heartbeat)"}


def test_streamed_mean_does_not_depend_on_arrival_order():
    """Streaming aggregation adds replies as they arrive; its float64 sum of weight x fp32 values
    is exact here, so any arrival order gives the same bits."""
    from fedcomp.aggregate import Accumulator

    g = torch.Generator().manual_seed(1)
    updates = [({"w": torch.randn(4000, generator=g) * 0.01 * (1 + i), "n": torch.tensor([i])}, 30.0 + 7 * i)
               for i in range(8)]
    layout = fedcomp.Layout.of(updates[0][0])
    base = {"w": torch.randn(4000, generator=g), "n": torch.tensor([3])}
    means = []
    for order in (updates, updates[::-1], updates[3:] + updates[:3]):
        acc = Accumulator(fedcomp.build_codec("none()"), layout)
        for update, weight in order:
            acc.add_dense(update, weight)
        means.append(acc.apply_mean(base))
    assert all(torch.equal(m["w"], means[0]["w"]) and torch.equal(m["n"], means[0]["n"]) for m in means[1:])