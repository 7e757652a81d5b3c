"""A byte-counting TCP relay: put it between SuperNodes and the SuperLink's Fleet API.

It listens on ``127.0.0.1`` (an ephemeral port unless told otherwise), forwards every accepted
connection to a target address, and counts the bytes it forwards in each direction:
``client_to_server`` (SuperNode -> SuperLink: uploads, polls, heartbeats) and
``server_to_client`` (SuperLink -> SuperNode: broadcasts, replies). The counts are TCP payload
bytes, i.e. everything gRPC puts on the wire (HTTP/2 frames, HPACK headers, and, with TLS, the
TLS records and handshakes); TCP/IP headers are not counted.

It relays bytes without looking at them, so it works with TLS as it is.

    with Relay("127.0.0.1", fleet_port) as relay:
        ... start SuperNodes with --superlink 127.0.0.1:{relay.port} ...
        before = relay.counts()
        ...
        used = relay.counts() - before   # a Counts with both directions and connections

The event loop runs in a daemon thread; :meth:`Relay.stop` closes every connection and joins it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

__all__ = ["Counts", "Relay"]

_CHUNK = 256 * 1024


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
                 listen_port: int = 0) -> None:
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

    def reset(self) -> None:
        """Set the counters back to zero (open connections keep being relayed)."""
        with self._lock:
            self._c2s = self._s2c = self._conns = 0

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

    def _add(self, direction: str, n: int) -> None:
        with self._lock:
            if direction == "c2s":
                self._c2s += n
            else:
                self._s2c += n

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                writer.write(data)
                self._add(direction, len(data))
                await writer.drain()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
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
