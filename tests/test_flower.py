"""Flower integration: the client mod and the strategy wrapper, in process and through `flwr run`."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedMedian

import fedcomp
from fedcomp.clients.mod import compression_mod
from conftest import FakeGrid
from fedcomp import protocol as P
from fedcomp.strategies.wrapper import CompressedStrategy

ROOT = Path(__file__).resolve().parents[1]


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(64, generator=g), "steps": torch.tensor(5)}


def _client_app(shift: dict[str, torch.Tensor], examples: int):
    """A ClientApp stand-in that 'trains' by adding a fixed shift to the model it received."""

    def app(msg: Message, context: Context) -> Message:
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        trained = {k: v + shift[k] for k, v in received.items()}
        content = RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": examples})})
        return Message(content, reply_to=msg)

    return app


def _context(node_id):
    return Context(run_id=1, node_id=node_id, node_config={}, state=RecordDict(), run_config={})


def _round(strategy, model, shifts, contexts, server_round=1, tamper=None):
    messages = list(strategy.configure_train(server_round, ArrayRecord(model), ConfigRecord({}), FakeGrid(list(contexts))))
    replies = []
    for msg in messages:
        node = msg.metadata.dst_node_id
        reply = compression_mod(msg, contexts[node], _client_app(shifts[node], examples=10 * node))
        if tamper and node in tamper:
            tamper[node](reply)
        replies.append(reply)
    return strategy.aggregate_train(server_round, replies)


def _shift(seed, scale=0.01):
    g = torch.Generator().manual_seed(seed)
    return {"w": scale * torch.randn(64, 32, generator=g), "b": scale * torch.randn(64, generator=g), "steps": torch.tensor(1)}


def test_lossless_round_equals_fedavg_of_trained_models():
    model = _model()
    shifts = {1: _shift(1), 2: _shift(2)}
    contexts = {1: _context(1), 2: _context(2)}
    strategy = CompressedStrategy(FedAvg(min_available_nodes=2), upload="none()", download="none()")
    arrays, _ = _round(strategy, model, shifts, contexts)
    out = arrays.to_torch_state_dict()
    for name in ("w", "b"):
        expected = model[name] + (10 * shifts[1][name] + 20 * shifts[2][name]) / 30
        torch.testing.assert_close(out[name], expected, rtol=0, atol=1e-6)
    assert not any(P.RESIDUAL_STATE in c.state for c in contexts.values()), "lossless codec keeps no residual"


def test_reply_carries_payload_and_client_keeps_residual():
    model = _model()
    contexts = {3: _context(3)}
    strategy = CompressedStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1), upload="topk(ratio=0.05)", download="none()")
    shift = _shift(3)
    arrays, _ = _round(strategy, model, {3: shift}, contexts)
    stats = strategy.rounds[1]
    assert stats.upload_bytes * 5 < stats.upload_bytes_dense, stats
    residual = contexts[3].state.array_records[P.RESIDUAL_STATE].to_torch_state_dict()
    got = arrays.to_torch_state_dict()
    for name in ("w", "b"):  # what was applied plus what stayed behind is exactly the update
        torch.testing.assert_close(got[name] - model[name] + residual[name], shift[name], rtol=0, atol=1e-6)
    assert int(got["steps"]) == int(model["steps"]) + 1  # integer tensors travel exactly
    # the second round adds the residual: over two rounds more of the update arrives
    arrays2, _ = _round(strategy, got, {3: shift}, contexts, server_round=2)
    residual2 = contexts[3].state.array_records[P.RESIDUAL_STATE].to_torch_state_dict()
    got2 = arrays2.to_torch_state_dict()
    torch.testing.assert_close(got2["w"] - model["w"] + residual2["w"], 2 * shift["w"], rtol=0, atol=1e-6)


def test_corrupted_reply_is_dropped_and_round_goes_on():
    model = _model()
    shifts = {1: _shift(1), 2: _shift(2)}
    contexts = {1: _context(1), 2: _context(2)}

    def flip_a_bit(reply):
        record = reply.content.config_records[P.UPLOAD_RECORD]
        data = bytearray(record[P.PAYLOAD])
        data[len(data) // 2] ^= 0x10
        record[P.PAYLOAD] = bytes(data)

    strategy = CompressedStrategy(FedAvg(min_available_nodes=2), upload="none()", download="none()")
    arrays, _ = _round(strategy, model, shifts, contexts, tamper={2: flip_a_bit})
    out = arrays.to_torch_state_dict()
    torch.testing.assert_close(out["w"], model["w"] + shifts[1]["w"], rtol=0, atol=1e-6)
    statuses = {c["node"]: c["status"] for c in strategy.rounds[1].clients}
    assert statuses[1] == "ok" and statuses[2].startswith("dropped") and "checksum" in statuses[2]


def test_non_finite_update_is_dropped():
    model = _model()
    shifts = {1: _shift(1), 2: _shift(2)}
    shifts[2]["w"][0, 0] = float("nan")
    contexts = {1: _context(1), 2: _context(2)}
    strategy = CompressedStrategy(FedAvg(min_available_nodes=2), upload="none()")
    arrays, _ = _round(strategy, model, shifts, contexts)
    out = arrays.to_torch_state_dict()
    assert bool(torch.isfinite(out["w"]).all())
    torch.testing.assert_close(out["w"], model["w"] + shifts[1]["w"], rtol=0, atol=1e-6)
    statuses = {c["node"]: c["status"] for c in strategy.rounds[1].clients}
    assert "NaN" in statuses[2] and statuses[1] == "ok"


def test_round_without_compression_mod_raises_naming_it():
    """Replies without a fedcomp record in a wrapped round: the ClientApp lacks the mod; say so."""
    from fedcomp.strategies import MissingCompressionMod

    model = _model()
    strategy = CompressedStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1), upload="none()")
    (msg,) = strategy.configure_train(1, ArrayRecord(model), ConfigRecord({}), FakeGrid([7]))
    plain = Message(RecordDict({"arrays": ArrayRecord(model), "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
    with pytest.raises(MissingCompressionMod, match=r"compression_mod.*ClientApp\(mods=\[compression_mod\]\)"):
        strategy.aggregate_train(1, [plain])
    assert "compression_mod" in strategy.rounds[1].clients[0]["status"]


def test_wraps_other_strategies():
    model = _model()
    shifts = {i: _shift(i) for i in (1, 2, 3)}
    contexts = {i: _context(i) for i in (1, 2, 3)}
    strategy = CompressedStrategy(FedMedian(min_available_nodes=3), upload="none()")
    arrays, _ = _round(strategy, model, shifts, contexts)
    expected = model["w"] + torch.stack([shifts[i]["w"] for i in (1, 2, 3)]).median(dim=0).values
    torch.testing.assert_close(arrays.to_torch_state_dict()["w"], expected, rtol=0, atol=1e-6)


def test_bad_spec_fails_at_construction():
    with pytest.raises(fedcomp.SpecError, match="topk"):
        CompressedStrategy(FedAvg(), upload="topk(ratio=2)")
    with pytest.raises(fedcomp.SpecError, match="available"):
        CompressedStrategy(FedAvg(), download="zip()")


def test_mod_passes_through_unrelated_messages():
    seen = []

    def app(msg, context):
        seen.append(msg)
        return Message(RecordDict({"metrics": MetricRecord({"x": 1.0})}), reply_to=msg)

    msg = Message(RecordDict({"config": ConfigRecord({"a": 1})}), dst_node_id=5, message_type="evaluate")
    reply = compression_mod(msg, _context(5), app)
    assert seen == [msg] and list(reply.content) == ["metrics"]


def test_compressed_upload_smaller_than_dense_by_promised_factor():
    model = {"w": torch.randn(512, 384), "b": torch.randn(512)}
    strategy = CompressedStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1), upload="topk(ratio=0.01)+qsgd(bits=4)")
    shift = {"w": 0.01 * torch.randn(512, 384), "b": 0.01 * torch.randn(512)}
    _round(strategy, model, {1: shift}, {1: _context(1)})
    stats = strategy.rounds[1]
    assert stats.upload_bytes_dense / stats.upload_bytes >= 100, stats


@pytest.mark.parametrize("key, value, message", [
    ("fraction-train", 0.0, "fraction-train=0.0 is invalid"),
    ("model", "resnet", "one of ('mlp', 'mlp-large', 'mlp-xl')"),
    ("lr", -1.0, "lr=-1.0 is invalid"),
    ("error-feedback", "yes", "true or false"),
    ("num-server-rounds", 0, "positive integer"),
])
def test_run_config_validation_names_key_value_and_allowed(key, value, message):
    from fedcomp.simulations.server_app import validate_run_config

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    validate_run_config(config)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_run_config({**config, key: value})


def test_app_config_defaults():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    from fedcomp.simulations.server_app import CONFIG_KEYS

    assert set(CONFIG_KEYS) == set(config)
    # picked from the regime at round 1 (fedcomp.strategies.config.CompressionConfig.resolve)
    assert config["upload"] == config["download"] == config["aggregation"] == "auto"
    assert config["error-feedback"] is True


# ---------------------------------------------------------------------------------------------
# End to end: `flwr run .` against a SuperLink this test starts (own ports, own FLWR_HOME) and
# stops by PID.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    home = tmp_path_factory.mktemp("flwr-home")
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "fedcomp-test"\n\n[superlink.fedcomp-test]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    log = open(home / "superlink.log", "wb")
    proc = subprocess.Popen(
        ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
         "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"flower-superlink exited: {(home / 'superlink.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        subprocess.run(["flwr", "federation", "simulation-config", "--num-supernodes", "4"],
                       env=env, check=True, capture_output=True, timeout=60)
        yield env
    finally:
        # the SuperLink leads its own session: its process group holds it and the simulation it spawned
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        log.close()


def _flwr_run(env, out_dir: Path, overrides: str) -> dict:
    cmd = ["flwr", "run", str(ROOT), "--stream", "--run-config", f"{overrides} out-dir='{out_dir}'"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    results = out_dir / "results.json"
    assert done.returncode == 0 and results.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(results.read_text())


@pytest.mark.slow
def test_flwr_run_end_to_end(superlink, tmp_path):
    # compressed both ways; half the clients per round, so clients sit out rounds and come back
    # to a catch-up chain (8 rounds: all 4 nodes keep a contiguous run of rounds with p < 0.001)
    rounds = 8
    compressed = _flwr_run(superlink, tmp_path / "topk", f"num-server-rounds={rounds} fraction-train=0.5 "
                           "upload='topk(ratio=0.01)+qsgd(bits=4)' download='topk(ratio=0.1)+kbit(bits=8)'")
    # dense uploads, 8-bit broadcasts, federated evaluation on half the nodes (through the references too)
    dense = _flwr_run(superlink, tmp_path / "dense",
                      "num-server-rounds=4 upload='none()' download='kbit(bits=8)' fraction-evaluate=0.5")

    for run, per_round in ((compressed, 2), (dense, 4)):
        assert [r["round"] for r in run["rounds"]] == list(range(1, len(run["rounds"]) + 1))
        for r in run["rounds"]:
            assert {"round", "accuracy", "loss", "upload_bytes", "download_bytes", "upload_bytes_dense",
                    "download_bytes_dense", "clients", "downloads", "download_bytes_by_tier"} <= set(r)
            assert len(r["clients"]) == per_round and all(c["status"] == "ok" for c in r["clients"]), r["clients"]
        accuracy = [r["accuracy"] for r in run["rounds"]]
        assert accuracy[-1] > max(0.3, accuracy[0]), accuracy  # it learns (chance is 0.1)

    assert compressed["config"]["upload"] == "topk(ratio=0.01)+qsgd(bits=4)"
    up = sum(r["upload_bytes"] for r in compressed["rounds"])
    up_dense = sum(r["upload_bytes_dense"] for r in compressed["rounds"])
    assert up_dense / up >= 100, (up, up_dense)
    # broadcasts: first contact is the chain from the seeded round-0 model every node builds
    # (round 1's step is empty, so it starts at step 2), or the full model where that chain costs
    # more; a node that sat out replays every step of its tier it missed (catch-up), and its
    # reference stayed bit-exact (no resync requested)
    seen, last, caught_up, seeded = set(), {}, 0, 0
    for r in compressed["rounds"]:
        for d in r["downloads"]:
            if d["node"] in seen:
                assert d["mode"] == "chain" and d["steps"] == r["round"] - last[d["node"]], (r["round"], d)
                caught_up += d["steps"] > 1
            elif d["mode"] == "chain":
                assert d["steps"] == max(1, r["round"] - 1), (r["round"], d)
                seeded += 1
            else:
                assert d["mode"] == "full" and r["round"] > 2, (r["round"], d)
            seen.add(d["node"])
            last[d["node"]] = r["round"]
    assert caught_up >= 1 and seeded >= 2  # round 1's two nodes at least
    chain = [d["download_bytes"] / d["steps"] for r in compressed["rounds"] for d in r["downloads"]
             if d["mode"] == "chain"]
    dense_message = compressed["rounds"][0]["download_bytes_dense"] / 2
    assert dense_message / (sum(chain) / len(chain)) > 4, (chain, dense_message)  # top-k 10% + 8 bits: ~5x
    # with none() the payload stands in for the ArrayRecord at near-equal cost, and the
    # dense estimate matches what the uncompressed run actually sent
    dense_up = sum(r["upload_bytes"] for r in dense["rounds"])
    dense_up_est = sum(r["upload_bytes_dense"] for r in dense["rounds"])
    assert 0.95 < dense_up / dense_up_est < 1.05
    assert (tmp_path / "topk" / "accuracy_vs_upload.png").read_bytes()[:4] == b"\x89PNG"
    # evaluate messages are counted (the compressed run has federated evaluation off: zero); every
    # node trained in round 1 (its mod announced it), so it evaluates its tier's next reference from
    # a one-step chain, without a resync, and trains from it next round (a one-step chain again)
    assert all(r["evaluate_download_bytes"] == 0 and not r["evaluate_clients"] for r in compressed["rounds"])
    for r in dense["rounds"]:
        assert r["evaluate_download_bytes"] > 0 and r["evaluate_reply_bytes"] > 0
        assert len(r["evaluate_clients"]) == 2
        assert all(c["mode"] == "chain" and "status" not in c for c in r["evaluate_clients"]), r["evaluate_clients"]
        assert r["evaluate_download_bytes"] < r["evaluate_download_bytes_dense"] / 3
        if r["round"] > 1:
            assert all(d["mode"] == "chain" and d["steps"] <= 1 for d in r["downloads"]), r["downloads"]


# -- delta coding of uploads ------------------------------------------------------------------


def _delta_rounds(strategy, shifts_by_round, tamper_round=None):
    model = {"w": torch.zeros(64, 32), "b": torch.zeros(64)}
    context = _context(9)
    refs, history = [], []
    for r, shift in enumerate(shifts_by_round, start=1):
        (msg,) = strategy.configure_train(r, ArrayRecord(model), ConfigRecord({}), FakeGrid([9]))
        reply = compression_mod(msg, context, _client_app(shift, examples=1))
        refs.append(int(reply.content.config_records[P.UPLOAD_RECORD][P.DELTA_REF]))
        if r == tamper_round:
            record = reply.content.config_records[P.UPLOAD_RECORD]
            record[P.PAYLOAD] = record[P.PAYLOAD][:-1] + bytes([record[P.PAYLOAD][-1] ^ 1])
        arrays, _ = strategy.aggregate_train(r, [reply])
        if arrays is not None:
            model = arrays.to_torch_state_dict()
        history.append({k: v.clone() for k, v in model.items()})
    return history, refs


def _drifting_shifts(rounds, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = {"w": 0.05 * torch.randn(64, 32, generator=g), "b": 0.05 * torch.randn(64, generator=g)}
    return [{k: v + 0.002 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(rounds)]


def test_delta_coding_is_exact_with_a_lossless_codec():
    shifts = _drifting_shifts(4)
    history, refs = _delta_rounds(CompressedStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1),
                                                     upload="none()", delta=1.0), shifts)
    assert refs == [0, 1, 2, 3]  # every reply after the first is a delta against the previous round
    total = {k: torch.zeros_like(v) for k, v in shifts[0].items()}
    for shift, model in zip(shifts, history):
        total = {k: total[k] + shift[k] for k in total}
        torch.testing.assert_close(model["w"], total["w"], rtol=0, atol=1e-5)


def test_delta_coding_sends_correlated_updates_better():
    shifts = _drifting_shifts(12)
    ideal = sum(s["w"] for s in shifts)

    def error(delta):
        strategy = CompressedStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1),
                                      upload="sign(block=64)", delta=delta)
        history, _ = _delta_rounds(strategy, shifts)
        return float((history[-1]["w"] - ideal).norm() / ideal.norm())

    assert error(1.0) < 0.5 * error(0.0)  # measured 0.042 against 0.227


def test_delta_reference_mismatch_resyncs_with_a_plain_update():
    strategy = CompressedStrategy(FedAvg(min_available_nodes=1, min_train_nodes=1), upload="none()", delta=1.0)
    history, refs = _delta_rounds(strategy, _drifting_shifts(4), tamper_round=2)
    statuses = [c["status"] for r in (1, 2, 3, 4) for c in strategy.rounds[r].clients]
    assert statuses[0] == "ok" and statuses[1].startswith("dropped") and statuses[2:] == ["ok", "ok"]
    # round 3: the client's reference (round 2) was never accepted; the server holds round 1 and
    # says so, so the client sends a plain update (ref 0) and both start over from round 3
    assert refs == [0, 1, 0, 3]


def test_delta_parameter_checked():
    with pytest.raises(fedcomp.SpecError, match="delta"):
        CompressedStrategy(FedAvg(), delta=1.5)
    with pytest.raises(fedcomp.SpecError, match="sketch"):
        CompressedStrategy(FedAvg(), upload="sketch()", aggregation="sketch", delta=0.5)


@pytest.mark.parametrize("upload", ["kbit(bits=4)", "none()", "sign()"])
def test_an_fp16_model_aggregates_to_the_bits_of_the_per_segment_path(upload, monkeypatch):
    """A model with an fp16 tensor (Flower's ArrayRecord carries fp16, not bf16): replies read at
    once (values rounded to fp16 in the compiled loops) give the model the per-segment path gives."""
    from fedcomp import codec as codec_module, kernels

    if kernels.get() is None:
        pytest.skip("numba not installed")
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    model = {"w": _model()["w"].half(), "b": _model()["b"], "steps": torch.tensor(5)}
    shifts = {n: {"w": _shift(n)["w"].half(), "b": _shift(n)["b"], "steps": torch.tensor(1)} for n in (1, 2, 3)}
    outs, read_at_once = [], []
    real = codec_module.Codec.read_run
    for runs_on in (True, False):
        with monkeypatch.context() as m:
            m.setattr(codec_module.Codec, "read_run", lambda *a, **kw: read_at_once.append(real(*a, **kw)) or
                      read_at_once[-1] if runs_on else None)
            contexts = {n: _context(n) for n in shifts}
            strategy = CompressedStrategy(FedAvg(min_available_nodes=3), upload=upload, download="none()")
            arrays, _ = _round(strategy, model, shifts, contexts)
            outs.append(arrays.to_torch_state_dict())
    assert len(read_at_once) >= 3 and all(r is not None for r in read_at_once)  # deferred replies read again
    assert outs[0]["w"].dtype == torch.float16
    for name in model:
        assert torch.equal(outs[0][name], outs[1][name]), name
    assert not torch.equal(outs[0]["w"], model["w"])  # the round moved it
