"""The client side on its own: ClientState (one declared class, one load/save), error replies
whose reasons say how to fix the problem, and the one warning per node for an unwrapped strategy."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy import FedAvg

from conftest import FakeGrid, node_context, run_round, shift_trainer, tiny_model
from fedcomp import protocol as P
from fedcomp.clients.mod import UNWRAPPED_WARNING, compression_mod
from fedcomp.clients.state import STATE_DIR_KEY, STATE_FILE, WARNED_STATE, ClientState
from fedcomp.strategies.wrapper import CompressedStrategy

UPLOAD = "topk(ratio=0.1)+qsgd(bits=4)"


def _strategy(**kwargs):
    kwargs.setdefault("upload", UPLOAD)
    return CompressedStrategy(FedAvg(fraction_train=1.0, min_available_nodes=1, min_train_nodes=1), **kwargs)


def _message(strategy, model, node=1, server_round=1):
    (msg,) = strategy.configure_train(server_round, ArrayRecord(model), ConfigRecord({}), FakeGrid([node]))
    return msg


# -- ClientState -----------------------------------------------------------------------------------
def test_state_of_a_new_node_is_empty_and_saving_it_writes_nothing():
    context = node_context(1)
    state = ClientState.load(context)
    assert state == ClientState() and state.residual is None and state.codec_state == {} and not state.warned_unwrapped
    state.save(context)
    assert len(context.state) == 0


def test_state_round_trips_through_context_state_under_the_protocol_keys():
    context = node_context(1)
    state = ClientState.load(context)
    state.reference, state.reference_info = {"w": torch.ones(2, 3)}, (1, 7, 12345)
    state.residual = {"w": torch.full((2, 3), 0.5)}
    state.last_sent, state.last_round = {"w": torch.zeros(2, 3)}, 7
    state.pending, state.pending_round = {"w": torch.ones(2, 3)}, 6
    state.encode_seconds, state.encode_bytes = [0.1, 0.2], [1000.0, 4000.0]
    state.warned_unwrapped = True
    state.save(context)
    assert set(context.state) == {P.REF_STATE, P.REF_INFO_STATE, P.RESIDUAL_STATE, P.LAST_SENT_STATE,
                                  P.LAST_ROUND_STATE, P.PENDING_STATE, P.PENDING_INFO_STATE, P.ENCODE_STATE,
                                  P.ENCODE_BYTES_STATE, WARNED_STATE}
    assert int(context.state.config_records[P.REF_INFO_STATE][P.REF_VERSION]) == 7  # the keys older versions wrote
    again = ClientState.load(context)
    assert again.reference_info == (1, 7, 12345) and again.last_round == 7 and again.pending_round == 6
    assert torch.equal(again.residual["w"], state.residual["w"]) and again.encode_seconds == [0.1, 0.2]
    assert again.encode_bytes == [1000.0, 4000.0] and again.warned_unwrapped
    again.residual, again.pending, again.pending_round = None, None, None  # None removes the key
    again.save(context)
    assert P.RESIDUAL_STATE not in context.state and P.PENDING_INFO_STATE not in context.state
    assert P.REF_STATE in context.state  # untouched fields are not rewritten, nor removed


def test_half_a_reference_is_no_reference():
    context = node_context(1)
    context.state[P.REF_STATE] = ArrayRecord({"w": torch.ones(2)})
    assert ClientState.load(context).reference is None


# -- error replies -----------------------------------------------------------------------------------
def _error(reply: Message) -> str:
    assert reply.has_error(), "expected an error reply"
    assert reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    return reply.error.reason


@pytest.mark.parametrize("key, value, says", [
    (P.LAYOUT, "[[", "same fedcomp version"),
    (P.UPLOAD_SPEC, "zip()", "same fedcomp version"),
    (P.TIERS, "three", "malformed"),
    (P.ROUND, None, "malformed"),  # None: the key is missing
])
def test_unreadable_broadcast_gets_an_error_reply(key, value, says):
    strategy, model = _strategy(), tiny_model()
    msg = _message(strategy, model)
    record = msg.content.config_records[P.DOWNLOAD_RECORD]
    if value is None:
        del record[key]
    else:
        record[key] = value
    trained = []
    reply = compression_mod(msg, node_context(1), lambda m, c: trained.append(m))
    assert says in _error(reply) and not trained  # the app never ran


def test_bad_node_config_gets_an_error_reply():
    model = tiny_model()
    fresh = lambda: _message(_strategy(download="kbit(bits=8) | none()"), model)  # noqa: E731
    reason = _error(compression_mod(fresh(), node_context(1, **{"download-tier": 5}), shift_trainer(1, 1)))
    assert "download-tier=5" in reason and "[0, 1]" in reason
    reason = _error(compression_mod(fresh(), node_context(1, **{"uplink-kbps": -3}),
                                    shift_trainer(1, 1)))
    assert "link" in reason and "uplink-kbps" in reason
    reason = _error(compression_mod(fresh(), node_context(1, device="gpu7"), shift_trainer(1, 1)))
    assert "device='gpu7'" in reason and "'cpu'" in reason


def test_reply_the_mod_cannot_compress_gets_an_error_reply():
    model = tiny_model()

    def two_records(msg, context):
        arrays = msg.content.array_records["arrays"]
        return Message(RecordDict({"a": arrays, "b": arrays, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    assert "exactly one ArrayRecord" in _error(compression_mod(_message(_strategy(), model), node_context(1), two_records))

    def other_model(msg, context):
        return Message(RecordDict({"arrays": ArrayRecord(tiny_model(rows=8)), "metrics": MetricRecord({"num-examples": 1})}),
                       reply_to=msg)

    assert "layout" in _error(compression_mod(_message(_strategy(), model), node_context(1), other_model))


def test_budget_on_a_codec_without_knob_gets_an_error_reply_and_the_server_records_it():
    strategy, model = _strategy(upload="sign()"), tiny_model()
    contexts = {1: node_context(1, **{"uplink-kbps": 100, "downlink-kbps": 1000, "latency-ms": 20, "byte-cap": 500}),
                2: node_context(2)}
    new, replies, _ = run_round(strategy, model, contexts, 1)
    reason = _error(next(r for r in replies if r.has_error()))
    assert "budget knob" in reason
    statuses = {c["node"]: c["status"] for c in strategy.rounds[1].clients}
    assert "budget knob" in statuses[1] and statuses[2] == "ok"


def test_reference_is_kept_when_the_client_app_raises():
    strategy, model = _strategy(), tiny_model()
    context = node_context(1)

    def crash(msg, context):
        raise ValueError("out of memory")

    with pytest.raises(ValueError):
        compression_mod(_message(strategy, model), context, crash)
    assert ClientState.load(context).reference is not None  # the broadcast was applied before the crash


# -- an unwrapped strategy: one warning per node -----------------------------------------------------
@pytest.fixture
def warnings_seen():
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Catch(level=logging.WARNING)
    logging.getLogger("flwr").addHandler(handler)
    yield seen
    logging.getLogger("flwr").removeHandler(handler)


def test_unwrapped_train_messages_warn_once_per_node(warnings_seen):
    plain = FedAvg(fraction_train=1.0, min_available_nodes=1, min_train_nodes=1)
    contexts = {1: node_context(1), 2: node_context(2)}
    model = tiny_model()
    for server_round in (1, 2, 3):
        messages = plain.configure_train(server_round, ArrayRecord(model), ConfigRecord({}), FakeGrid([1, 2]))
        for msg in messages:
            node = msg.metadata.dst_node_id
            reply = compression_mod(msg, contexts[node], shift_trainer(node, server_round))
            assert "arrays" in reply.content.array_records  # passed through, uncompressed
    assert warnings_seen.count(UNWRAPPED_WARNING) == 2  # one per node, not one per round
    assert "CompressedStrategy" in UNWRAPPED_WARNING and all(WARNED_STATE in c.state for c in contexts.values())


def test_evaluate_and_wrapped_messages_do_not_warn(warnings_seen):
    evaluate = Message(RecordDict({"config": ConfigRecord({"a": 1})}), dst_node_id=5, message_type="evaluate")
    compression_mod(evaluate, node_context(5), lambda m, c: Message(RecordDict({}), reply_to=m))
    run_round(_strategy(), tiny_model(), {1: node_context(1)}, 1)
    assert UNWRAPPED_WARNING not in warnings_seen


# -- an unexpected exception while encoding: an error reply naming the codec and the tensor ---------
def test_encode_failure_becomes_an_error_reply_naming_the_codec_and_the_tensor(monkeypatch):
    from fedcomp.codecs.sparsify import TopK

    def broken(self, x, seg, out, ctx):
        raise IndexError("index 4096 is out of bounds for dimension 0 with size 4096")

    monkeypatch.setattr(TopK, "reduce", broken)
    strategy, model = _strategy(), tiny_model()
    context = node_context(1)
    reply = compression_mod(_message(strategy, model), context, shift_trainer(1, 1))
    reason = _error(reply)
    assert "topk(ratio=0.1," in reason and "qsgd(bits=4," in reason and "IndexError" in reason and "out of bounds" in reason
    assert "'w'" in reason or "'b'" in reason, reason  # the segment the encode was at
    assert "Traceback" not in reason
    assert ClientState.load(context).reference is not None  # the broadcast was applied; the node can go on


def test_encode_failure_without_segment_context_lists_the_layouts_tensors(monkeypatch):
    import fedcomp

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(fedcomp, "compress", broken)
    reason = _error(compression_mod(_message(_strategy(), tiny_model()), node_context(1), shift_trainer(1, 1)))
    assert "RuntimeError: kernel failed" in reason and "topk(ratio=0.1," in reason
    assert "'w' (3200)" in reason and "'b' (64)" in reason


def test_server_records_the_encode_failure_and_aggregates_the_others(monkeypatch):
    from fedcomp.codecs.sparsify import TopK

    real = TopK.reduce

    def broken_on_node_2(self, x, seg, out, ctx):
        if broken_on_node_2.node == 2:
            raise IndexError("boom")
        return real(self, x, seg, out, ctx)

    monkeypatch.setattr(TopK, "reduce", broken_on_node_2)
    strategy, model = _strategy(), tiny_model()
    contexts = {1: node_context(1), 2: node_context(2), 3: node_context(3)}

    def app(node, server_round):
        inner = shift_trainer(node, server_round)

        def run(msg, context):
            broken_on_node_2.node = node
            return inner(msg, context)
        return run

    new, replies, _ = run_round(strategy, model, contexts, 1, app=app)
    statuses = {c["node"]: c["status"] for c in strategy.rounds[1].clients}
    assert statuses[1] == statuses[3] == "ok" and "could not encode" in statuses[2] and "IndexError" in statuses[2]
    assert not torch.equal(new["w"], model["w"])


# -- the state file (deployment; or node config fedcomp-state-dir) -------------------------------------
def _full_state(context):
    state = ClientState.load(context)
    state.reference, state.reference_info = {"w": torch.ones(2, 3)}, (1, 7, 12345)
    state.residual = {"w": torch.full((2, 3), 0.5)}
    state.pending, state.pending_round = {"w": torch.ones(2, 3)}, 6
    state.encode_seconds = [0.1, 0.2]
    state.save(context)
    return state


def test_state_file_is_chosen_by_node_config_and_by_the_engine(tmp_path, monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    from fedcomp.clients.state import state_file

    assert state_file(node_context(3)) is None  # a simulation: Context.state
    assert state_file(node_context(3, **{STATE_DIR_KEY: "context"})) is None
    assert state_file(node_context(3, **{STATE_DIR_KEY: str(tmp_path)})) == tmp_path / "run-1" / "node-3.pt"
    for bad in ("", 5):
        with pytest.raises(ValueError, match=STATE_DIR_KEY):
            state_file(node_context(3, **{STATE_DIR_KEY: bad}))
    monkeypatch.setenv("FEDCOMP_STATE_DIR", str(tmp_path / "env"))
    monkeypatch.setattr(TaskIdentity, "_node_id", 3)  # a ClientApp process that a SuperNode started for node 3
    assert state_file(node_context(3)) == tmp_path / "env" / "run-1" / "node-3.pt"
    assert state_file(node_context(4)) is None  # another node's
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)  # the simulation's: the SuperLink's id
    assert state_file(node_context(3)) is None and state_file(node_context(1)) is None


def test_state_file_round_trips_and_survives_a_stale_context(tmp_path):
    context = node_context(1, **{STATE_DIR_KEY: str(tmp_path)})
    state = _full_state(context)
    assert set(context.state) == {STATE_FILE}  # only the pointer travels with the Context
    assert (tmp_path / "run-1" / "node-1.pt").exists()
    stale = node_context(1, **{STATE_DIR_KEY: str(tmp_path)})  # what Flower hands over when the push came late
    again = ClientState.load(stale)
    assert again.reference_info == (1, 7, 12345) and again.pending_round == 6 and again.encode_seconds == [0.1, 0.2]
    assert torch.equal(again.residual["w"], state.residual["w"]) and torch.equal(again.reference["w"], state.reference["w"])
    again.residual, again.pending, again.pending_round = None, None, None  # None removes the field
    again.save(stale)
    third = ClientState.load(node_context(1, **{STATE_DIR_KEY: str(tmp_path)}))
    assert third.residual is None and third.pending is None and third.reference_info == (1, 7, 12345)
    assert not list((tmp_path / "run-1").glob("*.tmp"))  # written atomically, nothing left behind


def test_unreadable_state_file_is_an_empty_state_said_aloud(tmp_path, caplog):
    context = node_context(1, **{STATE_DIR_KEY: str(tmp_path)})
    _full_state(context)
    (tmp_path / "run-1" / "node-1.pt").write_bytes(b"not a state")
    with caplog.at_level(logging.WARNING):
        state = ClientState.load(context)
    assert state.reference is None and state.residual is None
    assert "could not be read" in caplog.text and "node-1.pt" in caplog.text


def test_unwritable_state_dir_is_said_aloud_and_the_state_goes_to_the_context(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    context = node_context(1, **{STATE_DIR_KEY: str(blocker)})  # a file where the folder should be
    with caplog.at_level(logging.WARNING):
        state = _full_state(context)
    assert str(blocker) in caplog.text and STATE_DIR_KEY in caplog.text
    assert P.RESIDUAL_STATE in context.state and P.REF_STATE in context.state  # nothing lost
    again = ClientState.load(context)  # no file: the Context's
    assert again.reference_info == (1, 7, 12345) and torch.equal(again.residual["w"], state.residual["w"])


def test_a_context_kept_state_moves_into_the_file(tmp_path):
    context = node_context(1)
    _full_state(context)  # kept in Context.state (a simulation, or an earlier version)
    context.node_config[STATE_DIR_KEY] = str(tmp_path)
    state = ClientState.load(context)  # no file yet: the Context's
    assert state.reference_info == (1, 7, 12345)
    state.encode_seconds = [0.3]
    state.save(context)
    assert set(context.state) == {STATE_FILE}  # moved, not left to travel with the Context
    again = ClientState.load(node_context(1, **{STATE_DIR_KEY: str(tmp_path)}))
    assert again.reference_info == (1, 7, 12345) and again.pending_round == 6 and again.encode_seconds == [0.3]


def test_bad_state_dir_gets_an_error_reply():
    model = tiny_model()
    msg = _message(_strategy(), model)
    reason = _error(compression_mod(msg, node_context(1, **{STATE_DIR_KEY: ""}), shift_trainer(1, 1)))
    assert STATE_DIR_KEY in reason and "'context'" in reason


def test_rounds_with_the_state_file_give_the_same_models_as_context_state(tmp_path):
    model = tiny_model()
    results = []
    for config in ({}, {STATE_DIR_KEY: str(tmp_path)}):
        strategy = _strategy(download="topk(ratio=0.2) | none()")
        contexts = {n: node_context(n, **config) for n in (1, 2)}
        current = model
        for rnd in (1, 2, 3):
            current, replies, _ = run_round(strategy, current, contexts, rnd)
            assert all(not r.has_error() for r in replies)
            if config:  # a Flower that lost every Context push: the state file still carries the node
                contexts = {n: node_context(n, **config) for n in (1, 2)}
        results.append(current)
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_a_new_run_removes_state_files_untouched_for_a_week(tmp_path):
    import os
    import time

    from fedcomp.clients.state import STALE_SECONDS

    old, mixed, recent = tmp_path / "run-7", tmp_path / "run-6", tmp_path / "run-8"
    for folder in (old, mixed, recent):
        folder.mkdir()
        (folder / "node-1.pt").write_bytes(b"x")
    (mixed / "notes.txt").write_text("the user's")
    week_ago = time.time() - STALE_SECONDS - 60
    for folder in (old, mixed):
        os.utime(folder, (week_ago, week_ago))
    _full_state(node_context(1, **{STATE_DIR_KEY: str(tmp_path)}))  # run 1 starts: its folder is new
    assert not old.exists() and (recent / "node-1.pt").exists() and (tmp_path / "run-1" / "node-1.pt").exists()
    assert (mixed / "notes.txt").exists() and not (mixed / "node-1.pt").exists()  # only state files go
