"""A SuperNode that times its own link and polls sooner: Flower's ``flower-supernode`` with two changes.

Run it in place of ``flower-supernode``, with the same arguments::

    python -m fedcomp.clients.supernode --insecure --superlink HOST:9092 --node-config "..."

1. **It times the bytes where they cross the link.** A SuperNode pulls each message's objects
   from the SuperLink and pushes each reply's objects back; only there does a transfer take the
   link's time. The server's own clocks see a broadcast leave and a reply arrive, and between
   them Flower's polling, the ClientApp's start and its local pulls, which on a fast link are
   most of the span. Per message this SuperNode records the object bytes and the seconds its
   pulls were in flight (the union of the calls' intervals: they run concurrently), and per reply
   the same for its pushes, in ``links/node-<node id>.json`` under
   :func:`fedcomp.clients.state.default_state_dir` (``$FEDCOMP_STATE_DIR``). The download is
   written before the message's objects are stored, so before its ClientApp can read them;
   ``compression_mod`` (``links.LINK_*`` keys) reports both to the server, which estimates the
   link from them (:class:`fedcomp.strategies.measured.MeasuredLinkStrategy`) and keeps what
   Flower adds as a separate overhead. A reply's upload is reported with the next message, as it
   ends after the reply has left.

   A call's time is more than its bytes on the link: the SuperLink reads and serialises an
   object before its first byte leaves, and this process parses it after the last arrives: a cost
   that grows with the object, not with the link's time, so on a fast link it reads as a slower
   rate. So while a
   transfer is in flight the SuperNode also samples its network namespace's interface counters
   (:func:`interface_bytes`, Linux's ``/proc/net/dev``, loopback left out) every
   :data:`WIRE_SAMPLE_S` seconds, and records as ``wire_s`` the seconds the transfer's bytes took
   crossing the interface at the rate its largest call's bytes did (:func:`transfer_wire_seconds`): the
   link's own rate, without the ends' work and without the round trips between calls. Where the
   counters did not see the transfer (a SuperLink on the same host, other traffic as large as
   the transfer, a call too short to sample, no call with most of the bytes) it records none, and
   the calls' time stands.
2. **It polls sooner while a run is active.** Flower 1.39's SuperNode waits 3 s after an empty
   poll of the SuperLink and 0.5 s between checks for a ClientApp's reply: 1.75 s a round on
   average, the same for a dense and a compressed round. Here a wait lasts at most
   :data:`IDLE_SHARE` (5%) of the time since the node's last message or reply, and no less than
   ``--poll-interval`` seconds (default :data:`DEFAULT_POLL_S`; ``0`` keeps Flower's): right
   after a reply it polls every 0.5 s, so the next round's message waits at most 5% longer than
   it has already waited; a node idle for a minute polls every 3 s, as Flower's does (each poll is
   a Fleet RPC, bytes on the node's link).

Everything else (the Fleet API, retries, authentication, the object store) is Flower's own code:
the changes wrap functions of :mod:`flwr.supernode.start_client_internal`, checked when it
starts (a Flower that renamed them gets an error naming what is missing, not a silent
SuperNode without timings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DEFAULT_POLL_S", "IDLE_SHARE", "LinkLog", "Transfer", "WireClock", "install", "interface_bytes", "link_file",
           "main", "read_link_file", "transfer_wire_seconds", "wire_seconds"]

DEFAULT_POLL_S = 0.5  # longest wait of the SuperNode's loop (Flower's: 3 s after an empty poll, 0.5 s for a reply)
POLL_ENV = "FEDCOMP_SUPERNODE_POLL_S"
IDLE_SHARE = 0.05  # a wait is at most this share of the time since the node's last message (and >= the poll interval)
LINK_FILE_FORMAT = 1
NET_DEV = "/proc/net/dev"  # Linux: this network namespace's interfaces and their byte counters
WIRE_SAMPLE_S = 0.004  # seconds between interface counter samples while a transfer is in flight
WIRE_MIN_SAMPLES = 10  # a call whose middle bytes crossed in fewer sampling intervals is not wire-timed
WIRE_MIN_BYTES = 65536  # nor is a smaller call: its time is TCP's and the link's start-up more than the rate
WIRE_TAIL = 0.1  # the first and last share of a call's bytes left out of its wire time (see wire_seconds)
WIRE_SHARE = 0.8  # a transfer is wire-timed by its largest call when that call carries at least this share


def _links_dir(folder: Path | None) -> Path:
    from fedcomp.clients.state import default_state_dir

    return (default_state_dir() if folder is None else Path(folder)) / "links"


def link_file(node_id: int, folder: Path | None = None) -> Path:
    """Where node ``node_id``'s SuperNode records its last transfers."""
    return _links_dir(folder) / f"node-{int(node_id)}.json"


def read_link_file(node_id: int, folder: Path | None = None) -> dict:
    """The last transfers node ``node_id``'s SuperNode recorded: ``{"down": {...}, "up": {...}}``,
    each ``{"message": id, "bytes": int, "seconds": float}`` and, where the interface counters
    timed it, ``"wire_s": float`` (``up``'s message: the one its reply answered); ``{}`` where
    there is no file or it cannot be read (a plain ``flower-supernode``)."""
    try:
        data = json.loads(link_file(node_id, folder).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != LINK_FILE_FORMAT:
        return {}
    return {k: v for k, v in data.items() if k in ("down", "up") and isinstance(v, dict)}


def interface_bytes(path: str = NET_DEV) -> tuple[int, int] | None:
    """(received, sent) bytes of this network namespace's interfaces, loopback left out (a node's
    ClientApps talk to its SuperNode over loopback); None where ``path`` cannot be read or parsed."""
    rx = tx = 0
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()[2:]
        for line in lines:
            name, rest = line.split(b":", 1)
            if name.strip() != b"lo":
                fields = rest.split()
                rx += int(fields[0])
                tx += int(fields[8])
    except (OSError, ValueError, IndexError):
        return None
    return rx, tx


def wire_seconds(samples: Sequence[tuple[float, int]], nbytes: int, interval: float = WIRE_SAMPLE_S) -> float | None:
    """Seconds ``nbytes`` took crossing the interface, from ``samples`` ``(time, counter)`` of one
    direction's byte counter taken from a transfer's start to its end.

    The counter's rise over the samples is the transfer's bytes on the wire (its payload plus TCP/IP
    framing). The time between :data:`WIRE_TAIL` and ``1 - WIRE_TAIL`` of that rise (each
    interpolated between samples) over ``1 - 2 x WIRE_TAIL`` is the time the whole rise took at the
    rate its middle ran. Outside it: what the SuperLink did before the first byte left and this
    process after the last arrived, the requests' and acknowledgements' few bytes, a token bucket's
    burst after an idle link, a flow-control window's wait for its update near the end. None where
    ``nbytes`` is under :data:`WIRE_MIN_BYTES`, where the counter did not see the transfer (it rose
    less than ``nbytes`` x 0.9: another path, such as loopback; or more than ``nbytes`` x 1.5: other
    traffic as large as the transfer shares the interface) or where the middle took fewer than
    :data:`WIRE_MIN_SAMPLES` sampling intervals (too short to time this way)."""
    if len(samples) < 2 or nbytes < WIRE_MIN_BYTES:
        return None
    base, rise = samples[0][1], samples[-1][1] - samples[0][1]
    if not 0.9 * nbytes <= rise <= 1.5 * nbytes:
        return None

    def crossing(level: float) -> float:
        for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
            if c1 - base >= level:
                return t1 if c1 == c0 else t0 + (t1 - t0) * (level - (c0 - base)) / (c1 - c0)
        return samples[-1][0]

    span = crossing((1 - WIRE_TAIL) * rise) - crossing(WIRE_TAIL * rise)
    if span < WIRE_MIN_SAMPLES * interval:
        return None
    return span / (1 - 2 * WIRE_TAIL)


class WireClock:
    """Samples one direction's interface byte counter (``'down'``: received, ``'up'``: sent) in a
    thread from :meth:`start` to :meth:`stop`. ``read``: the counters (default :func:`interface_bytes`)."""

    def __init__(self, direction: str, read=None, interval: float = WIRE_SAMPLE_S) -> None:
        if direction not in ("down", "up"):
            raise ValueError(f"direction={direction!r} is invalid: 'down' or 'up'")
        self.index, self.interval = (0 if direction == "down" else 1), interval
        self.read = interface_bytes if read is None else read
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> bool:
        counters = self.read()
        if counters is None:
            return False
        self.samples.append((time.monotonic(), counters[self.index]))
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and self._sample():
            pass

    def start(self) -> "WireClock":
        if self._sample():  # no counters here: nothing to sample
            self._thread = threading.Thread(target=self._run, name="fedcomp-wire-clock", daemon=True)
            self._thread.start()
        return self

    def stop(self, transfer: "Transfer | None") -> float | None:
        """Stop sampling; :func:`transfer_wire_seconds` of ``transfer`` (None: nothing to time)."""
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._sample()
        return None if transfer is None else transfer_wire_seconds(self.samples, transfer, self.interval)


def transfer_wire_seconds(samples: Sequence[tuple[float, int]], transfer: "Transfer",
                          interval: float = WIRE_SAMPLE_S) -> float | None:
    """The seconds ``transfer``'s bytes took on the wire at the rate its largest call's bytes crossed
    it (:func:`wire_seconds` over that call's interval of ``samples``): a transfer is a few calls
    with round trips between them, during which nothing crosses, and the small calls' bytes are
    mostly those round trips. None where the largest call carries less than :data:`WIRE_SHARE` of
    the bytes, or its bytes were not timed."""
    call = transfer.largest()
    if call is None or call[2] < WIRE_SHARE * transfer.bytes:
        return None
    start, end, nbytes = call
    before = [s for s in samples if s[0] <= start][-1:]
    after = [s for s in samples if s[0] >= end][:1]
    inside = [s for s in samples if start < s[0] < end]
    wire = wire_seconds(before + inside + after, nbytes, interval)
    return None if wire is None else wire * transfer.bytes / nbytes


class Transfer:
    """The calls of one transfer: bytes moved and the seconds any call was in flight (and, set by
    its caller, ``wire_s``: the seconds its bytes took on the interface, where they were timed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[tuple[float, float, int]] = []
        self.bytes = 0
        self.wire_s: float | None = None

    def add(self, start: float, end: float, nbytes: int) -> None:
        with self._lock:
            self._calls.append((start, end, int(nbytes)))
            self.bytes += int(nbytes)

    def largest(self) -> tuple[float, float, int] | None:
        """(start, end, bytes) of the call that moved the most bytes (None before any call)."""
        with self._lock:
            return max(self._calls, key=lambda call: call[2], default=None)

    @property
    def calls(self) -> int:
        return len(self._calls)

    @property
    def seconds(self) -> float:
        """Length of the union of the calls' intervals (concurrent calls count once)."""
        total, end = 0.0, -float("inf")
        for a, b, _ in sorted(self._calls):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total

    def timed(self, pull):
        """``pull`` (returning an object's bytes) adding each successful call's interval and bytes."""
        def call(*args):
            start = time.monotonic()
            content = pull(*args)
            self.add(start, time.monotonic(), len(content))
            return content
        return call


class LinkLog:
    """One node's file of its last download and upload (written atomically)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self._last: dict[str, dict] = {}
        self.warned = False

    def remove_stale(self) -> None:
        """Remove node files untouched for :data:`fedcomp.clients.state.STALE_SECONDS` (nodes that
        are gone: a SuperNode gets a new node id when it registers again)."""
        from fedcomp.clients.state import STALE_SECONDS

        folder = _links_dir(self.folder)
        cutoff = time.time() - STALE_SECONDS
        for path in folder.glob("node-*.json") if folder.is_dir() else ():
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
            except OSError:
                pass

    def record(self, node_id: int, direction: str, message_id: str, transfer: Transfer) -> None:
        if transfer.calls == 0 or transfer.bytes == 0:
            return
        self._last[direction] = {"message": str(message_id), "bytes": transfer.bytes,
                                 "seconds": round(transfer.seconds, 6), "calls": transfer.calls}
        if transfer.wire_s is not None:
            self._last[direction]["wire_s"] = round(transfer.wire_s, 6)
        path = link_file(node_id, self.folder)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": LINK_FILE_FORMAT, **self._last}, f)
            os.replace(tmp, path)
        except OSError as err:
            if not self.warned:  # the node still works; its server falls back to its own clocks
                from logging import WARNING

                from flwr.common.logger import log

                log(WARNING, "fedcomp: cannot write the link timings to %s (%s); the server times "
                    "this node's transfers from message timestamps", path, err)
                self.warned = True


class _CappedSleeps:
    """The ``time`` module of Flower's SuperNode loop, its waits shortened while a run is active:
    each ``sleep`` lasts at most ``max(cap, share x the seconds since the node's last message or
    reply)`` (:meth:`mark`), never longer than Flower's. Right after a message the loop waits
    ``cap``; a node idle for a minute or more waits as Flower's does (3 s), so it polls as seldom."""

    def __init__(self, cap: float, share: float = IDLE_SHARE) -> None:
        self.cap, self.share = cap, share
        self.last = -float("inf")

    def mark(self) -> None:
        self.last = time.monotonic()

    def sleep(self, seconds: float) -> None:
        idle = time.monotonic() - self.last
        time.sleep(min(seconds, max(self.cap, self.share * idle)))

    def __getattr__(self, name):
        return getattr(time, name)


_PATCHED = ("_pull_and_store_message", "_push_messages", "pull_objects", "time")


def install(poll_s: float = DEFAULT_POLL_S, folder: Path | None = None) -> LinkLog:
    """Wrap Flower's SuperNode loop in this process (see the module docstring); returns its log."""
    if poll_s < 0:
        raise ValueError(f"poll interval {poll_s!r} s is invalid: >= 0 (0 keeps Flower's waits)")
    from flwr.supernode import start_client_internal as sci

    missing = [name for name in _PATCHED if not hasattr(sci, name)]
    if missing:
        import flwr

        raise RuntimeError(f"fedcomp.clients.supernode wraps flwr.supernode.start_client_internal, whose "
                           f"{missing} this Flower ({flwr.__version__}) lacks: run flower-supernode instead")
    log = LinkLog(folder)
    log.remove_stale()
    sleeps = _CappedSleeps(poll_s)  # the loop's, where poll_s > 0
    current: dict = {}  # the message being pulled: the loop handles one at a time
    pull_and_store = getattr(sci._pull_and_store_message, "__wrapped__", sci._pull_and_store_message)
    push = getattr(sci._push_messages, "__wrapped__", sci._push_messages)
    pull_objects = getattr(sci.pull_objects, "__wrapped__", sci.pull_objects)

    def timed_pull_and_store(**kwargs):
        receive, state = kwargs["receive"], kwargs["state"]

        def noted_receive():
            got = receive()
            current.clear()
            if got is not None:
                current.update(message=got[0].metadata.message_id, node=state.get_node_id())
                sleeps.mark()
            return got
        kwargs["receive"] = noted_receive
        return pull_and_store(**kwargs)

    def timed_pull_objects(object_ids, pull_object_fn, **kwargs):
        transfer, clock = Transfer(), WireClock("down").start()
        try:
            out = pull_objects(object_ids, transfer.timed(pull_object_fn), **kwargs)
        finally:
            transfer.wire_s = clock.stop(transfer)
        if current:  # before the objects are stored: before the ClientApp can read them
            log.record(current["node"], "down", current["message"], transfer)
        return out

    def timed_push(**kwargs):
        send, push_object, state = kwargs["send"], kwargs["push_object"], kwargs["state"]
        sends: list = []  # (reply, object ids to push, its transfer)

        def noted_send(message, object_tree, runtime):
            ids, session = send(message, object_tree, runtime)
            sends.append((message, set(ids), Transfer()))
            return ids, session

        def timed_push_object(run_id, session_id, object_id, content):
            transfer = sends[-1][2]
            start = time.monotonic()
            push_object(run_id, session_id, object_id, content)
            transfer.add(start, time.monotonic(), len(content))

        kwargs.update(send=noted_send, push_object=timed_push_object)
        clock = WireClock("up").start()
        try:
            out = push(**kwargs)
        finally:  # one reply's bytes on the interface (Flower's loop sends one at a time)
            sent = sends[0][2] if len(sends) == 1 else None
            wire_s = clock.stop(sent)
        if sent is not None:
            sent.wire_s = wire_s
        sleeps.mark()
        for message, ids, transfer in sends:
            if transfer.calls == len(ids):  # every object arrived (a failure is logged by Flower)
                log.record(state.get_node_id(), "up", message.metadata.reply_to_message_id, transfer)
        return out

    for fn, original in ((timed_pull_and_store, pull_and_store), (timed_push, push), (timed_pull_objects, pull_objects)):
        fn.__wrapped__ = original
    sci._pull_and_store_message, sci._push_messages, sci.pull_objects = timed_pull_and_store, timed_push, timed_pull_objects
    if poll_s > 0:
        sci.time = sleeps
    return log


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fedcomp.clients.supernode", description=__doc__.split("\n")[0], add_help=False,
        epilog="Every other argument goes to Flower's flower-supernode unchanged (its options follow).")
    parser.add_argument("--poll-interval", type=float, default=None,
                        help=f"seconds the loop waits right after a message or reply, growing to Flower's 3 s "
                             f"(at most {IDLE_SHARE * 100:g}%% of the time since); 0: Flower's waits "
                             f"(default: ${POLL_ENV}, else {DEFAULT_POLL_S})")
    args, rest = parser.parse_known_args(argv)
    from flwr.supernode.cli import flower_supernode

    if "-h" in rest or "--help" in rest:  # ours, then Flower's (which exits)
        print(parser.format_help())
        sys.argv = ["flower-supernode", *rest]
        flower_supernode()
        return
    poll = args.poll_interval
    if poll is None:
        raw = os.environ.get(POLL_ENV, str(DEFAULT_POLL_S))
        try:
            poll = float(raw)
        except ValueError:
            parser.error(f"${POLL_ENV}={raw!r} is invalid: a number of seconds >= 0")
    if poll < 0:
        parser.error(f"--poll-interval {poll!r} is invalid: >= 0 (0 keeps Flower's 3 s and 0.5 s waits)")
    install(poll)
    sys.argv = ["flower-supernode", *rest]
    flower_supernode()


if __name__ == "__main__":
    main()
