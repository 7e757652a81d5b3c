"""fedcomp.clients.supernode: Flower's SuperNode loop timing its own link, and the mod and the
server using those timings (the 2-node deployments in test_warm_exec.py run it end to end)."""

from __future__ import annotations

import json
import time

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedcomp import links
from fedcomp import protocol as P
from fedcomp.clients import supernode as sn


def test_a_transfer_counts_concurrent_calls_once():
    t = sn.Transfer()
    for start, end, nbytes in [(0.0, 1.0, 10), (0.5, 2.0, 20), (1.5, 1.8, 5), (3.0, 4.0, 1)]:
        t.add(start, end, nbytes)
    assert t.seconds == pytest.approx(3.0) and t.bytes == 36 and t.calls == 4
    assert sn.Transfer().seconds == 0.0


class _Meta:
    def __init__(self, message_id, reply_to=""):
        self.message_id, self.reply_to_message_id = message_id, reply_to


class _Msg:
    def __init__(self, message_id, reply_to=""):
        self.metadata = _Meta(message_id, reply_to)


class _State:
    def get_node_id(self):
        return 42


@pytest.fixture
def flower_loop(monkeypatch, tmp_path):
    """Flower's SuperNode functions replaced by stand-ins that call what they are given as Flower's
    do (receive, then pull the objects; send, then push them), then ``install``: the wrappers are
    tested on the calls Flower makes, without a SuperLink. Restored afterwards (monkeypatch)."""
    from flwr.supernode import start_client_internal as sci

    stored: list = []  # what the loop stored, and what the link file said when it did

    def pull_and_store(**kw):
        got = kw["receive"]()
        if got is None:
            return None
        contents = sci.pull_objects(["a", "b", "c"], lambda obj_id: kw["pull_object"](1, obj_id))
        stored.append((sorted(contents), sn.read_link_file(42, tmp_path)))
        return 1

    def push(**kw):
        reply = _Msg("reply-1", reply_to="msg-1")
        ids, session = kw["send"](reply, None, 0.5)
        for obj_id in sorted(ids):
            kw["push_object"](1, session, obj_id, b"x" * 1000)

    def pull_objects(object_ids, pull_object_fn, **kwargs):
        return {obj_id: pull_object_fn(obj_id) for obj_id in object_ids}

    for name, fn in (("_pull_and_store_message", pull_and_store), ("_push_messages", push),
                     ("pull_objects", pull_objects)):
        monkeypatch.setattr(sci, name, fn)
    monkeypatch.setattr(sci, "time", time)
    log = sn.install(poll_s=0.01, folder=tmp_path)
    return sci, stored, log


def test_the_download_is_recorded_before_the_objects_are_stored(flower_loop, tmp_path):
    sci, stored, _ = flower_loop

    def pull_object(run_id, obj_id):
        time.sleep(0.01)
        return obj_id.encode() * 100

    assert sci._pull_and_store_message(state=_State(), receive=lambda: (_Msg("msg-1"), None),
                                       pull_object=pull_object) == 1
    (ids, seen), = stored
    assert ids == ["a", "b", "c"]
    assert seen["down"]["message"] == "msg-1" and seen["down"]["bytes"] == 300 and seen["down"]["calls"] == 3
    assert 0.03 <= seen["down"]["seconds"] < 5 and "up" not in seen
    # an empty poll records nothing and leaves the last download
    assert sci._pull_and_store_message(state=_State(), receive=lambda: None, pull_object=pull_object) is None
    assert sn.read_link_file(42, tmp_path)["down"]["message"] == "msg-1"


def test_the_upload_is_recorded_with_the_message_its_reply_answers(flower_loop, tmp_path):
    sci, _, _ = flower_loop
    sci._push_messages(state=_State(), object_store=None, send=lambda m, tree, runtime: ({"o1", "o2"}, "session"),
                       push_object=lambda run, session, obj_id, content: None)
    up = sn.read_link_file(42, tmp_path)["up"]
    assert up["message"] == "msg-1" and up["bytes"] == 2000 and up["calls"] == 2


def test_a_failed_push_is_not_recorded(flower_loop, tmp_path):
    sci, _, _ = flower_loop

    def push_object(run, session, obj_id, content):
        if obj_id == "o2":
            raise RuntimeError("link down")

    with pytest.raises(RuntimeError):  # Flower's _push_messages logs it; the stand-in lets it through
        sci._push_messages(state=_State(), object_store=None, send=lambda m, tree, runtime: ({"o1", "o2"}, "s"),
                           push_object=push_object)
    assert "up" not in sn.read_link_file(42, tmp_path)


def test_install_caps_the_loops_waits_while_a_run_is_active_and_wraps_once(flower_loop, monkeypatch):
    sci, _, _ = flower_loop
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    sci.time.sleep(3)  # idle (no message yet): Flower's poll
    sci._pull_and_store_message(state=_State(), receive=lambda: (_Msg("m"), None), pull_object=lambda r, o: b"x")
    sci.time.sleep(3)  # just after a message: the poll interval
    sci.time.sleep(0.001)
    sci.time.last -= 20  # 20 s since the message: 5% of it
    sci.time.sleep(3)
    sci.time.last -= 100  # two minutes: Flower's
    sci.time.sleep(3)
    assert slept[0] == 3 and slept[1:3] == [0.01, 0.001] and slept[3] == pytest.approx(1.0, abs=0.01)
    assert slept[4] == 3 and sci.time.monotonic is time.monotonic
    wrapped = sci._pull_and_store_message.__wrapped__
    sn.install(poll_s=0.01)  # again: wraps Flower's function, not its own wrapper
    assert sci._pull_and_store_message.__wrapped__ is wrapped


def test_install_refuses_a_negative_poll_and_a_flower_without_the_functions(monkeypatch):
    from flwr.supernode import start_client_internal as sci

    with pytest.raises(ValueError, match="-1"):
        sn.install(poll_s=-1)
    monkeypatch.delattr(sci, "_push_messages")
    with pytest.raises(RuntimeError, match="_push_messages"):
        sn.install()


@pytest.mark.parametrize("argv, env, message", [
    (["--poll-interval", "-2"], None, "--poll-interval -2.0 is invalid"),
    ([], "soon", "FEDCOMP_SUPERNODE_POLL_S='soon' is invalid"),
])
def test_main_names_a_bad_poll_interval(monkeypatch, capsys, argv, env, message):
    if env is not None:
        monkeypatch.setenv(sn.POLL_ENV, env)
    with pytest.raises(SystemExit):
        sn.main(argv)
    assert message in capsys.readouterr().err


def test_help_shows_ours_then_flowers(capsys):
    with pytest.raises(SystemExit) as exc:
        sn.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.index("--poll-interval") < out.index("usage: flower-supernode")


@pytest.mark.parametrize("content", [None, "not json", json.dumps({"format": 99, "down": {}}), json.dumps([1])])
def test_a_missing_or_foreign_link_file_reads_as_nothing(tmp_path, content):
    if content is not None:
        path = sn.link_file(7, tmp_path)
        path.parent.mkdir(parents=True)
        path.write_text(content)
    assert sn.read_link_file(7, tmp_path) == {}


def test_an_unwritable_folder_warns_once_and_the_node_goes_on(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    log = sn.LinkLog(blocked)  # links/ cannot be made under a file
    t = sn.Transfer()
    t.add(0.0, 1.0, 10)
    log.record(1, "down", "m", t)
    log.record(1, "down", "m", t)
    assert log.warned


def test_install_removes_only_stale_node_files(flower_loop, tmp_path):
    import os

    old, fresh, other = sn.link_file(1, tmp_path), sn.link_file(2, tmp_path), tmp_path / "links" / "notes.txt"
    old.parent.mkdir(parents=True, exist_ok=True)
    for path in (old, fresh, other):
        path.write_text("{}")
    long_ago = time.time() - 8 * 24 * 3600
    os.utime(old, (long_ago, long_ago))
    os.utime(other, (long_ago, long_ago))
    sn.install(poll_s=0.01, folder=tmp_path)
    assert not old.exists() and fresh.exists() and other.exists()


# -- the mod reports them ------------------------------------------------------------------------
def _write(folder, down=None, up=None):
    path = sn.link_file(5, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": sn.LINK_FILE_FORMAT, **({"down": down} if down else {}),
                                **({"up": up} if up else {})}))


def _timings(monkeypatch, tmp_path, deployed=True):
    from fedcomp.clients import mod, state

    monkeypatch.setenv("FEDCOMP_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(state, "_deployed_for", lambda context: deployed)
    msg = Message(RecordDict(), dst_node_id=5, message_type="train")
    msg.metadata.__dict__["_message_id"] = "this-one"
    context = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    return mod._link_timings(msg, context), msg.metadata.message_id


def test_the_mod_reports_this_broadcasts_pull_and_the_last_push(monkeypatch, tmp_path):
    _write(tmp_path, down={"message": "MID", "bytes": 900, "seconds": 0.5},
           up={"message": "earlier", "bytes": 300, "seconds": 0.25})
    out, mid = _timings(monkeypatch, tmp_path)
    assert out[links.LINK_UP_OF] == "earlier" and out[links.LINK_UP_BYTES] == 300 and out[links.LINK_UP_S] == 0.25
    assert links.LINK_DOWN_S not in out  # the file's download is another message's
    _write(tmp_path, down={"message": mid, "bytes": 900, "seconds": 0.5})
    out, _ = _timings(monkeypatch, tmp_path)
    assert out == {links.LINK_DOWN_BYTES: 900, links.LINK_DOWN_S: 0.5}
    assert _timings(monkeypatch, tmp_path, deployed=False)[0] == {}  # a simulation: no SuperNode of its own
    _write(tmp_path, down={"message": mid, "bytes": "many", "seconds": 0.5})
    assert _timings(monkeypatch, tmp_path)[0] == {}
    _write(tmp_path, down={"message": mid, "bytes": 900, "seconds": 0.5, "wire_s": 0.25},
           up={"message": "earlier", "bytes": 300, "seconds": 0.25, "wire_s": None})
    out, _ = _timings(monkeypatch, tmp_path)
    assert out[links.LINK_DOWN_WIRE_S] == 0.25 and links.LINK_UP_WIRE_S not in out


# -- the server estimates from them --------------------------------------------------------------
def _reply(node, reply_to, *, received_at, compute_s=1.0, down=None, up=None, payload=0):
    """``down``: (bytes, seconds[, wire seconds]); ``up``: (message, bytes, seconds[, wire seconds]);
    ``payload``: bytes of an array in the reply."""
    record = {P.COMPUTE_S: compute_s, P.BUDGET: 1000, links.RECEIVED_AT: received_at}
    if down is not None:
        record.update({links.LINK_DOWN_BYTES: down[0], links.LINK_DOWN_S: down[1]})
        if len(down) > 2:
            record[links.LINK_DOWN_WIRE_S] = down[2]
    if up is not None:
        record.update({links.LINK_UP_OF: up[0], links.LINK_UP_BYTES: up[1], links.LINK_UP_S: up[2]})
        if len(up) > 3:
            record[links.LINK_UP_WIRE_S] = up[3]
    content = RecordDict({P.UPLOAD_RECORD: ConfigRecord(record)})
    if payload:
        import numpy as np
        from flwr.app import Array, ArrayRecord

        content["payload"] = ArrayRecord({"p": Array(np.zeros(payload, dtype=np.uint8))})
    msg = Message(content, dst_node_id=0, message_type="train")
    msg.metadata.__dict__["_reply_to_message_id"] = reply_to
    return msg


def test_the_server_estimates_the_link_from_the_supernodes_timings_and_keeps_the_rest_as_overhead():
    """Four rounds of one node: 1 MB pulled in 0.85 s each (10 Mbit/s plus 0.05 s), replies of
    2.5-40 kB pushed in their size at 1 Mbit/s plus 0.05 s, while the wall clocks see 6 s more each round (polls,
    process starts): the estimate is the link's, and the 6 s go to the node's overhead, which the
    budget keeps free."""
    from fedcomp.strategies.measured import MeasuredLinkStrategy, _Sent
    from fedcomp.strategies.wrapper import CompressedStrategy
    from flwr.serverapp.strategy import FedAvg

    strategy = MeasuredLinkStrategy(CompressedStrategy(FedAvg(), upload="topk(ratio=0.1,index='fixed')+qsgd(bits=4)",
                                                       download="none()"), 30.0)
    sizes = [2_500, 10_000, 40_000, 40_000]
    t, entries = 100.0, []
    for r, size in enumerate(sizes):
        up_s = 0.05 + size * 8 / 1e6
        previous = (f"m{r - 1}", sizes[r - 1], 0.05 + sizes[r - 1] * 8 / 1e6) if r else None
        sent = _Sent(r + 1, strategy.budgets.link(0), 1_000_000, t)
        received = t + 0.85 + 3.0  # the pull, and 3 s of polls and start-up
        arrival = received + 1.0 + up_s + 3.0  # compute, the push, 3 s more
        strategy._record(_reply(0, f"m{r}", received_at=received, down=(1_000_000, 0.85), up=previous),
                         arrival, 0, sent)
        entries.append(strategy.estimates[-1])
        t = arrival + 1
    assert all(e["timed_by"] == "supernode" for e in entries)
    assert entries[0]["observed_up_s"] is None and entries[0]["est_up_kbps"] is None  # its push comes later
    # broadcasts are one size: the upload's latency is taken out of them
    assert entries[-1]["est_down_kbps"] == pytest.approx(10_000, rel=1e-3)
    assert entries[-1]["est_up_kbps"] == pytest.approx(1_000, rel=1e-3)
    assert entries[-1]["est_up_latency_s"] == pytest.approx(0.05, rel=1e-3)
    assert strategy.budgets.overhead_s(0) == pytest.approx(6.0)  # equal samples: no spread
    # the budget keeps the overhead free: 30 s less 0.85 s down, 1 s compute, 0.05 s latency, 6 s
    assert strategy.budgets._left(0, 1_000_000, 1.0) == pytest.approx(30 - 0.85 - 1.0 - 0.05 - 6.0, rel=1e-3)
    # (the budget itself is slow start's: 4x the largest upload)
    assert strategy.budgets.budget(0, 5, download_bytes=1_000_000, compute_s=1.0) == 4 * 40_000
    link = strategy.budgets.link(0, download_bytes=1_000_000, compute_s=1.0)
    assert link.latency_ms == pytest.approx((0.05 * strategy.budgets._slack(0, "up") + 3.0) * 1000, rel=0.01)


def test_the_server_takes_the_rate_from_the_wire_and_grows_slow_start_from_replies_in_time():
    """A 200 Mbit/s downlink whose 34 MB pulls took 0.6 s besides their 1.37 s on the wire, and
    uploads timed on the wire too: the estimates are the link's rates; the replies arrived in time,
    so each round's cap is 4x the last reply, not 4x the last one timed."""
    from fedcomp.strategies.measured import MeasuredLinkStrategy, _Sent
    from fedcomp.strategies.wrapper import CompressedStrategy
    from flwr.serverapp.strategy import FedAvg

    strategy = MeasuredLinkStrategy(CompressedStrategy(FedAvg(), upload="topk(ratio=0.1,index='fixed')+qsgd(bits=4)",
                                                       download="none()"), 40.0)
    nbytes, wire = 34_000_000, 34_000_000 * 8 / 200e6
    t, caps, sizes = 100.0, [], [4_000, 16_000, 64_000, 256_000]
    for r, size in enumerate(sizes):
        up = (f"m{r - 1}", sizes[r - 1], 0.04 + sizes[r - 1] * 8 / 20e6, sizes[r - 1] * 8 / 20e6) if r else None
        sent = _Sent(r + 1, strategy.budgets.link(0), nbytes, t)
        caps.append(sent.link.byte_cap)
        received = t + wire + 0.6 + 1.0
        strategy._record(_reply(0, f"m{r}", received_at=received, down=(nbytes, wire + 0.6, wire), up=up,
                                payload=size), received + 2.0, 0, sent)
        t = received + 3.0
    e = strategy.estimates[-1]
    assert e["est_down_kbps"] == pytest.approx(200_000, rel=1e-6) and e["est_down_latency_s"] == pytest.approx(0.6)
    assert e["est_up_kbps"] == pytest.approx(20_000, rel=1e-6) and e["est_up_latency_s"] == pytest.approx(0.04)
    assert e["wire_down_s"] == pytest.approx(wire) and e["wire_up_s"] == pytest.approx(64_000 * 8 / 20e6)
    replies = [x["upload_bytes"] for x in strategy.estimates]
    assert all(size < got < size + 2_000 for size, got in zip(sizes, replies))
    assert caps == [4096] + [4 * got for got in replies[:-1]]  # each 4x the last reply, before its push was timed
    # a late reply does not grow it
    sent = _Sent(5, strategy.budgets.link(0), nbytes, t)
    strategy._record(_reply(0, "m4", received_at=t + 30, down=(nbytes, wire + 0.6, wire), payload=2_000_000),
                     t + 45, 0, sent)
    assert strategy.budgets._growth_cap(0) == 4 * replies[-1]


def test_an_upload_timing_of_another_message_is_not_observed():
    from fedcomp.strategies.measured import MeasuredLinkStrategy, _Sent
    from fedcomp.strategies.wrapper import CompressedStrategy
    from flwr.serverapp.strategy import FedAvg

    strategy = MeasuredLinkStrategy(CompressedStrategy(FedAvg(), upload="topk(ratio=0.1,index='fixed')+qsgd(bits=4)",
                                                       download="none()"), 30.0)
    strategy._record(_reply(0, "m0", received_at=110.0, down=(1000, 0.1)), 120.0, 0, _Sent(1, strategy.budgets.link(0), 1000, 100.0))
    strategy._record(_reply(0, "m1", received_at=130.0, down=(1000, 0.1), up=("not-m0", 500, 0.2)), 140.0, 0,
                     _Sent(2, strategy.budgets.link(0), 1000, 121.0))
    assert strategy.estimates[-1]["observed_up_s"] is None and strategy.budgets.overhead_s(0) == 0.0


# -- the bytes on the wire -----------------------------------------------------------------------
def _bulk(before_s, bulk_s, after_s, nbytes, step=0.004, frame=1.05):
    """Counter samples of a transfer: ``before_s`` of nothing (the SuperLink serialising), then
    ``nbytes`` x ``frame`` (framing) at a steady rate over ``bulk_s``, then ``after_s`` of nothing
    (this process parsing)."""
    samples, t, total = [], 0.0, 0
    wire = nbytes * frame
    while t <= before_s + bulk_s + after_s + 1e-9:
        if t > before_s:
            total = min(wire, wire * (t - before_s) / bulk_s)
        samples.append((round(t, 6), 1000 + int(total)))
        t += step
    return samples


def test_wire_seconds_is_the_bulks_time_without_the_ends_work():
    got = sn.wire_seconds(_bulk(0.4, 1.37, 0.18, 34_000_000), 34_000_000)
    assert got == pytest.approx(1.37, rel=0.01)  # the calls took 1.95 s; the link 1.37 s
    # what it leaves alone: no rise (loopback), other traffic as large, a bulk too short to sample
    assert sn.wire_seconds([(0.0, 5), (1.0, 5)], 1000) is None
    assert sn.wire_seconds(_bulk(0.1, 1.0, 0.1, 1000, frame=2.0), 1000) is None
    assert sn.wire_seconds(_bulk(0.01, 0.02, 0.01, 400_000), 400_000) is None  # 20 ms: 5 samples
    assert sn.wire_seconds(_bulk(0.1, 1.0, 0.1, 60_000), 60_000) is None  # under 64 KiB
    assert sn.wire_seconds([(0.0, 5)], 100_000) is None and sn.wire_seconds([], 0) is None
    # a burst after idle, acknowledgements at the end, a flow-control wait: outside the middle 80%
    samples = [(0.0, 0), (0.004, 6_000)] + [(0.004 + i * 0.004, 6_000 + i * 500) for i in range(1, 201)]
    samples += [(0.9, 106_000), (1.0, 106_100), (1.004, 106_100)]  # the last 100 B of acknowledgements later
    assert sn.wire_seconds(samples, 100_000) == pytest.approx(106_100 / 125_000, rel=0.02)


def test_interface_bytes_leaves_loopback_out(tmp_path):
    dev = tmp_path / "dev"
    dev.write_text("Inter-|   Receive |  Transmit\n face |bytes packets|bytes packets\n"
                   "    lo: 900 9 0 0 0 0 0 0 800 8 0 0 0 0 0 0\n"
                   "  eth0: 100 1 0 0 0 0 0 0 70 1 0 0 0 0 0 0\n"
                   "veth1: 20 1 0 0 0 0 0 0 3 1 0 0 0 0 0 0\n")
    assert sn.interface_bytes(str(dev)) == (120, 73)
    assert sn.interface_bytes(str(tmp_path / "missing")) is None
    dev.write_text("a\nb\neth0: x y\n")
    assert sn.interface_bytes(str(dev)) is None


def test_a_wire_clock_samples_while_running_and_needs_counters():
    start = time.monotonic()

    def counters():  # 1 MB a second from 0.05 s after the start, received; nothing sent
        return int(max(0.0, time.monotonic() - start - 0.05) * 1e6), 0

    clock = sn.WireClock("down", read=counters, interval=0.002).start()
    time.sleep(0.25)
    call = sn.Transfer()
    call.add(start, time.monotonic(), int((time.monotonic() - start - 0.05) * 1e6 / 1.02))  # ~200 kB
    got = clock.stop(call)
    assert got is not None and 0.1 < got < 0.3 and len(clock.samples) > 20
    assert sn.WireClock("up", read=lambda: None).start().stop(call) is None  # no counters: no thread, no time
    with pytest.raises(ValueError, match="'sideways'"):
        sn.WireClock("sideways")


def test_a_transfer_is_wire_timed_by_its_largest_call_without_the_round_trips_between_calls():
    """Three calls one after the other with 0.1 s round trips between and before them: 200 kB,
    then 20 kB, 10 kB; the wire rate is the big call's, so the transfer's 230 kB take 23/20 of its
    bulk, not the 0.4 s the bytes were spread over. A transfer without a call of most of its bytes
    is not wire-timed."""
    rate = 2_000_000  # bytes a second on the wire
    samples = [(round(i * 0.004, 4), 0) for i in range(26)]  # 0-0.1 s: the first round trip
    for i in range(1, 26):  # 0.1-0.2 s: 200 kB
        samples.append((round(0.1 + i * 0.004, 4), int(min(200_000, rate * i * 0.004))))
    for i in range(1, 51):  # 0.2-0.4 s: round trips and the small calls' 30 kB
        samples.append((round(0.2 + i * 0.004, 4), 200_000 + (20_000 if i > 25 else 0) + (10_000 if i > 45 else 0)))
    t = sn.Transfer()
    for call in [(0.0, 0.2, 200_000), (0.2, 0.3, 20_000), (0.3, 0.4, 10_000)]:
        t.add(*call)
    got = sn.transfer_wire_seconds(samples, t)
    assert got == pytest.approx(230_000 / rate, rel=0.1) and got < 0.2
    even = sn.Transfer()
    for call in [(0.0, 0.2, 200_000), (0.2, 0.3, 200_000)]:
        even.add(*call)
    assert sn.transfer_wire_seconds(samples, even) is None and sn.transfer_wire_seconds(samples, sn.Transfer()) is None
    assert sn.WireClock("up", read=lambda: (0, 0)).start().stop(None) is None


def test_the_wire_time_goes_with_the_transfer_into_the_file(flower_loop, tmp_path, monkeypatch):
    """The loop's pull with the interface counters rising as its calls run: the file has the
    calls' seconds and the wire's, the mod reports both, and the server's estimate is the wire's rate."""
    sci, stored, _ = flower_loop
    moved = [0]
    monkeypatch.setattr(sn, "interface_bytes", lambda: (moved[0], 0))

    def pull_object(run_id, obj_id):  # "a": the ends' work, then 200 kB in ~50 ms on the wire; "b", "c": small
        if obj_id != "a":
            return b"x"
        time.sleep(0.05)
        for _ in range(25):
            moved[0] += 8_000
            time.sleep(0.002)
        time.sleep(0.05)
        return b"x" * 199_998

    sci._pull_and_store_message(state=_State(), receive=lambda: (_Msg("msg-1"), None), pull_object=pull_object)
    down = sn.read_link_file(42, tmp_path)["down"]
    assert down["bytes"] == 200_000 and down["seconds"] > 0.15
    assert down["wire_s"] is not None and 0.03 < down["wire_s"] < down["seconds"] * 0.6
