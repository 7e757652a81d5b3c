"""Kernel-shaped links for a loopback deployment: one network namespace per SuperNode, veth pairs, tc.

Each node ``i`` gets a network namespace ``<prefix>-<pid>-<i>`` joined to the root namespace by a
veth pair: ``fs<pid>h<i>`` (root end, ``10.<b>.<i>.1/30``) and ``fs<pid>n<i>`` (inside the
namespace, ``10.<b>.<i>.2/30``; ``b`` is a second octet in 200-249 that no root address uses yet).
Each end gets an egress rate limit (``tc qdisc ... tbf``, or ``htb``): the node's end limits its
uplink (node -> server), the root end its downlink (server -> node). Processes started with
:meth:`ShapedNetwork.exec_prefix` (``ip netns exec <ns> ...``) live in the namespace, and so do
their children (a SuperNode's ClientApp processes); they reach the root namespace only through
the veth, at ``10.<b>.<i>.1``. Nothing else is reachable from a namespace: it has no default route.

Latency: this kernel has tbf and htb but no netem, and a tbf's ``latency`` is only the longest a
packet may wait in its queue, not a delay. The one-way latency of a link is therefore added in
user space, by the byte-counting relay the node talks to (:class:`fedcomp.simulations.relay.Relay`
with ``latency_ms``: each chunk is forwarded ``latency_ms`` after it arrived, in both directions).

Everything is created by this process and torn down in :meth:`ShapedNetwork.close` (namespaces
deleted, which deletes their veth pairs); namespaces with this module's prefix whose creating
process is gone are deleted first (:func:`cleanup_stale`). Needs Linux, root, ``ip`` and ``tc``:
:func:`check_available` raises :class:`ShapingUnavailable` naming what is missing, and callers
fall back to the relay's own token bucket (``Relay(up_kbps=..., down_kbps=...)``), which runs
anywhere.

    with ShapedNetwork([Link(1000, 10000, 40), Link(5000, 50000, 20)]) as net:
        net.node(0).host_addr        # where the relay for node 0 listens ('10.200.0.1')
        net.exec_prefix(0) + ["flower-supernode", ...]
        measure_throughput(net, 0, "up")   # kbps a TCP stream gets through node 0's uplink
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from fedcomp.links import Link

__all__ = [
    "MIXES", "node_links", "PREFIX", "NodeNet", "ShapedNetwork", "ShapingUnavailable", "available", "check_available",
    "cleanup_stale", "measure_throughput", "tc_rate_args",
]

PREFIX = "fcshp"  # namespace names: fcshp-<pid>-<index>
QDISCS = ("tbf", "htb")


# Deployment link mixes (node i gets mix[i % len(mix)]): 'mbit-mix' is the mixed uplinks of
# 1, 5 and 20 Mbit/s with 10x faster downlinks (the simulator's 'mixed' spans 200 kbit/s to 10 Gbit/s:
# too slow at one end for a dense model and too fast at the other for this machine to shape).
MIXES: dict[str, list[Link]] = {
    "mbit-mix": [Link(uplink_kbps=1_000, downlink_kbps=10_000, latency_ms=50),
                 Link(uplink_kbps=5_000, downlink_kbps=50_000, latency_ms=30),
                 Link(uplink_kbps=20_000, downlink_kbps=200_000, latency_ms=10)],
}


def node_links(profile: str, count: int, seed: int = 0) -> list[Link]:
    """One link per node: a mix of :data:`MIXES` (cycled), or anything ``link-profile`` takes
    (a preset of :data:`fedcomp.links.PRESETS`, ``'mixed'``, a .csv/.toml table by partition id)."""
    from fedcomp import links as L

    if profile in MIXES:
        mix = MIXES[profile]
        return [mix[i % len(mix)] for i in range(count)]
    if profile in (L.NONE, L.MEASURED) or L.measured_profile(profile) is not None:
        raise ValueError(f"links={profile!r} is invalid: a mix {sorted(MIXES)}, a preset {sorted(L.PRESETS)}, "
                         f"'mixed' or a table path (the links to shape, not a run's link-profile)")
    return [L.link_for(i, count, profile, seed) for i in range(count)]


class ShapingUnavailable(RuntimeError):
    """Network namespaces or tc cannot be used here (not Linux, not root, no ip/tc, refused)."""


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, list(cmd), done.stdout, done.stderr)
    return done


def _fail(cmd: Sequence[str], exc: subprocess.CalledProcessError) -> str:
    return f"`{' '.join(cmd)}` failed ({exc.returncode}): {(exc.stderr or exc.stdout or '').strip()}"


_checked: dict[str, str | None] = {}


def check_available(qdisc: str = "tbf") -> None:
    """Raise :class:`ShapingUnavailable` unless namespaces, veth pairs and ``tc qdisc add <qdisc>``
    work here (tried once per process on a throwaway namespace, then remembered)."""
    if qdisc not in QDISCS:
        raise ValueError(f"qdisc={qdisc!r} is invalid: one of {QDISCS}")
    if qdisc in _checked:
        if _checked[qdisc]:
            raise ShapingUnavailable(_checked[qdisc])
        return
    reason = _probe(qdisc)
    _checked[qdisc] = reason
    if reason:
        raise ShapingUnavailable(reason)


def available(qdisc: str = "tbf") -> tuple[bool, str]:
    """(True, '') where shaped links work, else (False, the reason): for pytest's skip."""
    try:
        check_available(qdisc)
    except ShapingUnavailable as exc:
        return False, str(exc)
    return True, ""


def _probe(qdisc: str) -> str | None:
    if not sys.platform.startswith("linux"):
        return f"shaped links need Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "shaped links need root (ip netns add, tc qdisc add); run as root or use the relay's token bucket"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"shaped links need `{tool}` (iproute2) on PATH"
    ns, a, b = f"{PREFIX}-{os.getpid()}-probe", f"fs{os.getpid()}pa", f"fs{os.getpid()}pb"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", a, "type", "veth", "peer", "name", b, "netns", ns],
        ["tc", "qdisc", "add", "dev", a, "root", *tc_rate_args(1000, qdisc)[0]],
    ]
    try:
        for cmd in steps:
            try:
                _run(cmd)
            except subprocess.CalledProcessError as exc:
                return f"shaped links unavailable: {_fail(cmd, exc)}"
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"shaped links unavailable: `{' '.join(cmd)}`: {exc}"
    finally:
        _run(["ip", "link", "del", a], check=False)
        _run(["ip", "netns", "del", ns], check=False)
    return None


# tc meters Ethernet frames (14 B header + IP 20 + TCP 32 with timestamps per 1,448 B segment at MTU
# 1500): TCP payload gets 1448/1514 of the rate. Links here are payload rates (the simulator's
# bytes / kbps), so the qdisc rate is raised by this factor.
FRAME_FACTOR = 1514 / 1448


def tc_rate_args(kbps: float, qdisc: str = "tbf") -> list[list[str]]:
    """tc arguments (after ``tc qdisc add dev X root``, then any ``tc class add dev X`` commands)
    limiting TCP payload to ``kbps`` (1,000 bit/s; the frame rate is ``kbps *`` :data:`FRAME_FACTOR`).
    tbf: a bucket of 5 ms at the rate (at least 4 kB, more than one full-size packet) and up to
    400 ms of queue (at least 64 kB: TCP keeps the link busy); htb: one class at that rate and
    ceiling, its default queue."""
    bits = int(round(kbps * 1000 * FRAME_FACTOR))
    if bits <= 0:
        raise ValueError(f"kbps={kbps!r} is invalid: a positive rate")
    burst = max(4096, int(bits / 8 * 0.005))
    limit = max(65536, int(bits / 8 * 0.4))
    if qdisc == "tbf":
        return [["tbf", "rate", f"{bits}bit", "burst", str(burst), "limit", str(limit)]]
    if qdisc == "htb":
        return [["handle", "1:", "htb", "default", "10"],
                ["parent", "1:", "classid", "1:10", "htb", "rate", f"{bits}bit", "ceil", f"{bits}bit",
                 "burst", str(burst), "cburst", str(burst)]]
    raise ValueError(f"qdisc={qdisc!r} is invalid: one of {QDISCS}")


def _shape(dev: str, kbps: float, qdisc: str, netns: str | None = None) -> None:
    pre = ["ip", "netns", "exec", netns] if netns else []
    args = tc_rate_args(kbps, qdisc)
    _run([*pre, "tc", "qdisc", "replace", "dev", dev, "root", *args[0]])
    for cls in args[1:]:
        _run([*pre, "tc", "class", "add", "dev", dev, *cls])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix>-<pid>-...`` whose creating process ``pid`` is gone
    (a run that was killed before its ``finally``); returns their names. Others are left alone."""
    done = _run(["ip", "netns", "list"], check=False)
    removed = []
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == prefix and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


def _free_octet() -> int:
    """A second octet b (200-249) such that no root-namespace address is in 10.b.0.0/16."""
    used = set()
    for line in _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout.splitlines():
        for word in line.split():
            if word.startswith("10.") and "/" in word:
                used.add(int(word.split(".")[1]))
    for b in range(200, 250):
        if b not in used:
            return b
    raise ShapingUnavailable("no free 10.b.0.0/16 block (b in 200-249) for the veth addresses")


@dataclasses.dataclass(frozen=True)
class NodeNet:
    """One node's namespace and veth pair."""

    index: int
    netns: str
    host_dev: str  # root end: its egress is the downlink
    node_dev: str  # namespace end: its egress is the uplink
    host_addr: str  # where the node reaches the root namespace
    node_addr: str
    link: Link


class ShapedNetwork:
    """Namespaces + veth pairs + tc for ``links`` (one node each); a context manager.

    ``qdisc``: ``'tbf'`` (default) or ``'htb'``. Rates are the links' ``uplink_kbps`` and
    ``downlink_kbps``; their ``latency_ms`` is not applied here (no netem): give it to the relay.
    """

    def __init__(self, links: Sequence[Link], qdisc: str = "tbf", prefix: str = PREFIX) -> None:
        if not links:
            raise ValueError("ShapedNetwork needs at least one link")
        if len(links) > 250:
            raise ValueError(f"{len(links)} links: at most 250 (one /30 per node in a 10.b.0.0/16)")
        self.links, self.qdisc, self.prefix = list(links), qdisc, prefix
        self.nodes: list[NodeNet] = []
        self._created: list[str] = []
        self._pid = os.getpid()

    def __enter__(self) -> ShapedNetwork:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> ShapedNetwork:
        check_available(self.qdisc)
        cleanup_stale(self.prefix)
        octet = _free_octet()
        try:
            for i, link in enumerate(self.links):
                self.nodes.append(self._add(i, link, octet))
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, i: int, link: Link, octet: int) -> NodeNet:
        ns, host, node = f"{self.prefix}-{self._pid}-{i}", f"fs{self._pid}h{i}", f"fs{self._pid}n{i}"
        host_addr, node_addr = f"10.{octet}.{i}.1", f"10.{octet}.{i}.2"
        in_ns = ["ip", "netns", "exec", ns]
        cmds = [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", host, "type", "veth", "peer", "name", node, "netns", ns],
            ["ip", "addr", "add", f"{host_addr}/30", "dev", host],
            ["ip", "link", "set", host, "up"],
            [*in_ns, "ip", "link", "set", "lo", "up"],  # the SuperNode's own APIs and its ClientApps
            [*in_ns, "ip", "addr", "add", f"{node_addr}/30", "dev", node],
            [*in_ns, "ip", "link", "set", node, "up"],
        ]
        for k, cmd in enumerate(cmds):
            try:
                _run(cmd)
            except subprocess.CalledProcessError as exc:
                raise ShapingUnavailable(f"setting up node {i}'s link: {_fail(cmd, exc)}") from exc
            if k == 0:
                self._created.append(ns)
        try:
            _shape(node, link.uplink_kbps, self.qdisc, netns=ns)
            _shape(host, link.downlink_kbps, self.qdisc)
        except subprocess.CalledProcessError as exc:
            raise ShapingUnavailable(f"shaping node {i}'s link: {_fail(exc.cmd, exc)}") from exc
        return NodeNet(i, ns, host, node, host_addr, node_addr, link)

    def close(self) -> None:
        """Delete every namespace this object created (their veth pairs go with them)."""
        for ns in reversed(self._created):
            _run(["ip", "netns", "del", ns], check=False)
        for i in range(len(self.links)):  # a root end left behind by a half-made pair
            if os.path.exists(f"/sys/class/net/fs{self._pid}h{i}"):
                _run(["ip", "link", "del", f"fs{self._pid}h{i}"], check=False)
        self._created.clear()

    def node(self, index: int) -> NodeNet:
        return self.nodes[index]

    def exec_prefix(self, index: int) -> list[str]:
        """Command prefix that runs a program inside node ``index``'s namespace."""
        return ["ip", "netns", "exec", self.nodes[index].netns]

    def qdisc_stats(self, index: int) -> dict[str, str]:
        """``tc -s qdisc`` of both ends of node ``index``'s link (sent bytes, drops, overlimits)."""
        n = self.nodes[index]
        return {"uplink": _run([*self.exec_prefix(index), "tc", "-s", "qdisc", "show", "dev", n.node_dev],
                               check=False).stdout,
                "downlink": _run(["tc", "-s", "qdisc", "show", "dev", n.host_dev], check=False).stdout}


# -------------------------------------------------------------------------- checking the rate

_PEER = r"""
import socket, sys, time
host, port, mode, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
s = socket.create_connection((host, port), timeout=120)
if mode == "send":
    chunk = b"\0" * 65536
    left = n
    while left > 0:
        left -= s.send(chunk[:min(left, len(chunk))])
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
else:
    got = 0
    while got < n:
        data = s.recv(1 << 20)
        if not data:
            break
        got += len(data)
    s.sendall(b"k")
s.close()
"""


def measure_throughput(net: ShapedNetwork, index: int, direction: str, nbytes: int | None = None,
                       timeout: float = 300) -> dict[str, float]:
    """Time a TCP transfer through node ``index``'s link: ``'up'`` (a sender in the namespace, the
    receiver here) or ``'down'`` (the reverse). ``nbytes`` defaults to ~3 s at the shaped rate.
    Returns ``{'kbps': ..., 'seconds': ..., 'bytes': ..., 'configured_kbps': ...}``.

    Timing: up, from the first byte received to the last (TCP's handshake and first window are
    outside); down, from the first byte sent to the receiver's 1-byte acknowledgement (one round
    trip more, under 1% of a 3 s transfer on these links)."""
    if direction not in ("up", "down"):
        raise ValueError(f"direction={direction!r} is invalid: 'up' or 'down'")
    node = net.node(index)
    rate = node.link.uplink_kbps if direction == "up" else node.link.downlink_kbps
    nbytes = int(nbytes or max(256 * 1024, rate * 1000 / 8 * 3))
    srv = socket.socket()
    srv.bind((node.host_addr, 0))
    srv.listen(1)
    srv.settimeout(timeout)
    port = srv.getsockname()[1]
    peer = subprocess.Popen(
        [*net.exec_prefix(index), sys.executable, "-c", _PEER, node.host_addr, str(port),
         "send" if direction == "up" else "recv", str(nbytes)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    result: dict[str, float] = {}
    try:
        conn, _ = srv.accept()
        conn.settimeout(timeout)
        with conn:
            if direction == "up":
                got, first = 0, None
                while got < nbytes:
                    data = conn.recv(1 << 20)
                    if not data:
                        break
                    if first is None:
                        first = time.perf_counter()
                        got0 = len(data)
                    got += len(data)
                seconds = time.perf_counter() - first
                conn.sendall(b"k")
                moved = got - got0
            else:
                chunk, left = b"\0" * 65536, nbytes
                t0 = time.perf_counter()
                while left > 0:
                    left -= conn.send(chunk[:min(left, len(chunk))])
                conn.recv(1)
                seconds = time.perf_counter() - t0
                moved = nbytes
        result = {"kbps": moved * 8 / seconds / 1000, "seconds": seconds, "bytes": float(moved),
                  "configured_kbps": float(rate)}
    finally:
        srv.close()
        try:
            peer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(peer.pid, 9)
            peer.wait()
    if not math.isfinite(result.get("kbps", float("nan"))):
        raise RuntimeError(f"throughput check on node {index} ({direction}) failed: {peer.stderr.read()[-500:]}")
    return result


def _main() -> int:  # python -m fedcomp.simulations.shaped: a quick check of the rates on this machine
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fedcomp.simulations.shaped",
                                     description="Make shaped links, time a TCP transfer each way, tear down.")
    parser.add_argument("--up", default="1000,5000,20000", help="uplink kbps per node, comma-separated")
    parser.add_argument("--down-factor", type=float, default=10.0, help="downlink = factor x uplink")
    parser.add_argument("--qdisc", default="tbf", choices=QDISCS)
    args = parser.parse_args()
    ups = [float(x) for x in args.up.split(",")]
    links = [Link(uplink_kbps=u, downlink_kbps=u * args.down_factor, latency_ms=0.0) for u in ups]
    with ShapedNetwork(links, qdisc=args.qdisc) as net:
        for i in range(len(links)):
            for direction in ("up", "down"):
                r = measure_throughput(net, i, direction)
                print(f"node {i} {direction:>4}: configured {r['configured_kbps']:>9,.0f} kbps, measured "
                      f"{r['kbps']:>9,.0f} kbps ({r['kbps'] / r['configured_kbps'] - 1:+.1%}) over "
                      f"{r['bytes'] / 1e6:.2f} MB in {r['seconds']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
