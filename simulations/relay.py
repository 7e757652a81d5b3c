"""A byte-counting TCP relay: put it between SuperNodes and the SuperLink's Fleet API.

It listens on ``127.0.0.1`` (an ephemeral port unless told otherwise), forwards every accepted
connection to a target address, and counts the bytes it forwards in each direction:
``client_to_server`` (SuperNode -> SuperLink: uploads, polls, heartbeats) and
``server_to_client`` (SuperLink -> SuperNode: broadcasts, replies). The counts are TCP payload
bytes, i.e. everything gRPC puts on the wire (HTTP/2 frames, HPACK headers, and, with TLS, the
TLS records and handshakes); TCP/IP headers are not counted.

It forwards the bytes unchanged, so it works with TLS as it is.

    with Relay("127.0.0.1", fleet_port) as relay:
        ... start SuperNodes with --superlink 127.0.0.1:{relay.port} ...
        before = relay.counts()
        ...
        used = relay.counts() - before   # a Counts with both directions and connections

The event loop runs in a daemon thread; :meth:`Relay.stop` closes every connection and joins it.

With ``http2=True`` (the default) the relay also parses what it forwards as HTTP/2 (cleartext
gRPC, i.e. ``--insecure``) and breaks each direction down into: the connection preface, frame
headers (9 bytes per frame), HEADERS/CONTINUATION payloads (HPACK request/response headers and
trailers), gRPC length prefixes (5 bytes per gRPC message), gRPC message bodies (the protobuf
requests/responses, which hold Flower's serialized objects), DATA padding, and control frames
(SETTINGS, PING, WINDOW_UPDATE, RST_STREAM, GOAWAY, PRIORITY). See :meth:`Relay.http2_counts`.
A connection that does not start with the HTTP/2 preface (e.g. TLS) is counted as ``opaque``.

A link (optional): ``latency_ms`` delays every chunk by that much in each direction (a delay line
per connection and direction: a chunk read at t is written at t + latency, in order), and
``up_kbps`` / ``down_kbps`` pace client->server / server->client with a token bucket per
connection (each chunk leaves when the bucket has its bytes; the bucket holds 20 ms of the rate
and the relay reads at most 50 ms ahead of it, so the sender feels the rate as TCP backpressure).
With kernel-shaped links (:mod:`fedcomp.simulations.shaped`: tc rates, no netem) the relay adds
only the latency; without them its token bucket is the fallback that runs anywhere. Bytes are
counted when read, before any delay.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import threading
import time

__all__ = ["Counts", "Relay", "RelayGroup", "H2_FIELDS"]

_CHUNK = 256 * 1024
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

#: Keys of each direction's dict in :meth:`Relay.http2_counts`. The ``*_bytes`` keys other than
#: ``opaque_bytes`` add up to the bytes of cleartext HTTP/2 connections; ``opaque_bytes`` is
#: everything else (TLS).
H2_FIELDS: tuple[str, ...] = (
    "preface_bytes", "frame_header_bytes", "headers_bytes", "grpc_prefix_bytes", "grpc_body_bytes",
    "padding_bytes", "control_bytes", "opaque_bytes",
    "frames", "headers_frames", "data_frames", "control_frames", "grpc_messages", "streams",
)


class _H2Meter:
    """Incremental HTTP/2 frame parser for one direction of one connection (counts only)."""

    def __init__(self, stats: dict[str, int], client_side: bool) -> None:
        self.stats = stats
        self.buf = bytearray()
        self.need_preface = client_side
        self.opaque = False
        self.need_settings = not client_side  # a server's first frame is SETTINGS on stream 0
        self.grpc: dict[int, list] = {}  # stream id -> [prefix bytearray, body bytes still to come]
        self.max_stream = 0

    def feed(self, data: bytes) -> None:
        st = self.stats
        if self.opaque:
            st["opaque_bytes"] += len(data)
            return
        self.buf += data
        if self.need_preface:
            if len(self.buf) < len(_PREFACE):
                if not _PREFACE.startswith(bytes(self.buf)):
                    self._go_opaque()
                return
            if bytes(self.buf[:len(_PREFACE)]) != _PREFACE:
                self._go_opaque()
                return
            st["preface_bytes"] += len(_PREFACE)
            del self.buf[:len(_PREFACE)]
            self.need_preface = False
        pos, buf = 0, self.buf
        while len(buf) - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            ftype, flags = buf[pos + 3], buf[pos + 4]
            stream = struct.unpack_from(">I", buf, pos + 5)[0] & 0x7FFFFFFF
            if self.need_settings:
                if ftype != 4 or stream != 0:
                    self._go_opaque()
                    return
                self.need_settings = False
            if len(buf) - pos < 9 + length:
                break
            start, end = pos + 9, pos + 9 + length
            st["frames"] += 1
            st["frame_header_bytes"] += 9
            if ftype == 0:  # DATA
                st["data_frames"] += 1
                if flags & 0x8 and length:  # PADDED: pad length byte + padding
                    pad = buf[start]
                    st["padding_bytes"] += pad + 1
                    start, end = start + 1, end - pad
                self._grpc(stream, buf, start, end)
                if flags & 0x1:  # END_STREAM
                    self.grpc.pop(stream, None)
            elif ftype in (1, 9):  # HEADERS, CONTINUATION
                st["headers_frames"] += 1
                st["headers_bytes"] += length
                if ftype == 1 and stream > self.max_stream:
                    self.max_stream = stream
                    st["streams"] += 1
                if flags & 0x1:
                    self.grpc.pop(stream, None)
            else:
                st["control_frames"] += 1
                st["control_bytes"] += length
            pos += 9 + length
        del buf[:pos]

    def _grpc(self, stream: int, buf: bytearray, i: int, n: int) -> None:
        """Split ``buf[i:n]`` (DATA content of ``stream``) into gRPC prefixes and message bodies."""
        st = self.stats
        state = self.grpc.setdefault(stream, [bytearray(), 0])
        while i < n:
            if state[1] > 0:  # inside a message body
                take = min(state[1], n - i)
                st["grpc_body_bytes"] += take
                state[1] -= take
                i += take
                continue
            take = min(5 - len(state[0]), n - i)
            state[0] += buf[i:i + take]
            st["grpc_prefix_bytes"] += take
            i += take
            if len(state[0]) == 5:
                st["grpc_messages"] += 1
                state[1] = int.from_bytes(state[0][1:5], "big")
                state[0] = bytearray()

    def _go_opaque(self) -> None:
        self.opaque = True
        self.stats["opaque_bytes"] += len(self.buf)
        self.buf = bytearray()


@dataclasses.dataclass(frozen=True)
class Counts:
    """A snapshot of a relay's counters (bytes forwarded per direction, connections accepted)."""

    client_to_server: int = 0
    server_to_client: int = 0
    connections: int = 0

    def __sub__(self, other: Counts) -> Counts:
        return Counts(
            self.client_to_server - other.client_to_server,
            self.server_to_client - other.server_to_client,
            self.connections - other.connections,
        )

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.client_to_server + other.client_to_server,
            self.server_to_client + other.server_to_client,
            self.connections + other.connections,
        )

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class Relay:
    """Forward TCP connections from ``listen_host:listen_port`` to ``target_host:target_port``.

    Parameters
    ----------
    target_host, target_port : str, int
        Where to forward (the SuperLink's Fleet API).
    listen_host : str
        Address to listen on; ``127.0.0.1`` by default (loopback only).
    listen_port : int
        Port to listen on; 0 (default) picks a free one, see :attr:`port` after :meth:`start`.
    """

    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1",
                 listen_port: int = 0, http2: bool = True, *, latency_ms: float = 0.0,
                 up_kbps: float | None = None, down_kbps: float | None = None) -> None:
        for key, value in (("up_kbps", up_kbps), ("down_kbps", down_kbps)):
            if value is not None and not value > 0:
                raise ValueError(f"{key}={value!r} is invalid: a positive rate in kbps, or None (no limit)")
        if not latency_ms >= 0:
            raise ValueError(f"latency_ms={latency_ms!r} is invalid: milliseconds >= 0")
        self.latency_ms, self.up_kbps, self.down_kbps = float(latency_ms), up_kbps, down_kbps
        self.target = (target_host, int(target_port))
        self.listen_host = listen_host
        self._listen_port = int(listen_port)
        self.port: int | None = None
        self._lock = threading.Lock()
        self._c2s = 0
        self._s2c = 0
        self._conns = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()
        self._errors: list[BaseException] = []
        self.http2 = http2
        self._h2 = {d: dict.fromkeys(H2_FIELDS, 0) for d in ("client_to_server", "server_to_client")}

    # -- public API ------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """``host:port`` a client should connect to."""
        if self.port is None:
            raise RuntimeError("relay not started")
        return f"{self.listen_host}:{self.port}"

    def counts(self) -> Counts:
        """A consistent snapshot of the counters."""
        with self._lock:
            return Counts(self._c2s, self._s2c, self._conns)

    def http2_counts(self) -> dict[str, dict[str, int]]:
        """Snapshot of the HTTP/2 breakdown: ``{"client_to_server": {...}, "server_to_client": {...}}``.

        Keys are :data:`H2_FIELDS`. Counts of a frame are added when the whole frame has passed.
        """
        with self._lock:
            return {d: dict(v) for d, v in self._h2.items()}

    def reset(self) -> None:
        """Set the counters back to zero (open connections keep being relayed)."""
        with self._lock:
            self._c2s = self._s2c = self._conns = 0
            for v in self._h2.values():
                v.update(dict.fromkeys(H2_FIELDS, 0))

    def start(self, timeout: float = 10.0) -> Relay:
        """Start listening (in a background thread); returns ``self``."""
        if self._thread is not None:
            raise RuntimeError("relay already started")
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._listen())
            except BaseException as exc:  # noqa: BLE001 - surfaced by start()
                self._errors.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

        self._thread = threading.Thread(target=run, name=f"relay->{self.target[0]}:{self.target[1]}", daemon=True)
        self._thread.start()
        if not started.wait(timeout) or self._errors:
            self.stop()
            raise RuntimeError(f"relay failed to start: {self._errors}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listening socket and every relayed connection; join the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            try:
                fut.result(timeout)
            except Exception:  # noqa: BLE001 - best effort; the loop is stopped below anyway
                pass
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._thread = None

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- event loop side -------------------------------------------------------------------
    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.listen_host, self._listen_port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _add(self, direction: str, data: bytes, meter: _H2Meter | None) -> None:
        with self._lock:
            if direction == "c2s":
                self._c2s += len(data)
            else:
                self._s2c += len(data)
            if meter is not None:
                meter.feed(data)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        meter = None
        if self.http2:
            meter = _H2Meter(self._h2["client_to_server" if direction == "c2s" else "server_to_client"],
                             client_side=direction == "c2s")
        kbps = self.up_kbps if direction == "c2s" else self.down_kbps
        if kbps or self.latency_ms > 0:
            await self._pump_link(reader, writer, direction, meter, kbps)
            return
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                writer.write(data)
                self._add(direction, data, meter)
                await writer.drain()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            try:
                if writer.can_write_eof():
                    writer.write_eof()
            except (OSError, RuntimeError):
                pass

    async def _pump_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str,
                         meter: _H2Meter | None, kbps: float | None) -> None:
        """Forward through a delay line of ``latency_ms``, paced at ``kbps`` (a token bucket) if set."""
        delay = self.latency_ms / 1000
        rate = kbps * 1000 / 8 if kbps else None  # bytes per second
        bucket = rate * 0.02 if rate else 0.0  # the bucket's depth: 20 ms of the rate
        chunk = _CHUNK if rate is None else int(min(_CHUNK, max(1500, bucket)))
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        self._tasks.add(sender)  # cancelled by stop() with the connections
        sender.add_done_callback(self._tasks.discard)
        free_at = 0.0  # when the modelled link has sent everything handed to it so far
        try:
            while True:
                data = await reader.read(chunk)
                if not data:
                    break
                self._add(direction, data, meter)
                now = time.monotonic()
                leaves = now
                if rate:
                    # token bucket: up to `bucket` bytes may go at once after an idle spell
                    free_at = max(free_at, now - bucket / rate) + len(data) / rate
                    leaves = max(now, free_at)
                    ahead = free_at - now - 0.05  # read at most 50 ms ahead of the link
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                queue.put_nowait((leaves + delay, data))
                if sender.done():
                    break
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            queue.put_nowait(None)
            try:
                await sender
            except (ConnectionError, OSError, RuntimeError, asyncio.CancelledError):
                pass
            try:
                if writer.can_write_eof():
                    writer.write_eof()
            except (OSError, RuntimeError):
                pass

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._writers.add(client_writer)
        server_writer = None
        try:
            try:
                server_reader, server_writer = await asyncio.open_connection(*self.target)
            except OSError:
                return  # target down: the client sees the connection close, as without a relay
            self._writers.add(server_writer)
            with self._lock:
                self._conns += 1
            await asyncio.gather(
                self._pump(client_reader, server_writer, "c2s"),
                self._pump(server_reader, client_writer, "s2c"),
            )
        except asyncio.CancelledError:
            pass
        finally:
            for writer in (client_writer, server_writer):
                if writer is not None:
                    self._writers.discard(writer)
                    writer.close()
            if task is not None:
                self._tasks.discard(task)


class RelayGroup:
    """Several relays read as one (one per node on per-node links): counts and the HTTP/2
    breakdown are summed over the members; :meth:`stop` stops them all."""

    def __init__(self, relays: list[Relay]) -> None:
        if not relays:
            raise ValueError("RelayGroup needs at least one relay")
        self.relays = list(relays)

    @property
    def address(self) -> str:
        return self.relays[0].address

    def counts(self) -> Counts:
        total = Counts()
        for relay in self.relays:
            total = total + relay.counts()
        return total

    def http2_counts(self) -> dict[str, dict[str, int]]:
        out = {d: dict.fromkeys(H2_FIELDS, 0) for d in ("client_to_server", "server_to_client")}
        for relay in self.relays:
            for d, values in relay.http2_counts().items():
                for k, v in values.items():
                    out[d][k] += v
        return out

    def reset(self) -> None:
        for relay in self.relays:
            relay.reset()

    def stop(self, timeout: float = 10.0) -> None:
        for relay in self.relays:
            relay.stop(timeout)
