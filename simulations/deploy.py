"""Run fedcomp on Flower's deployment engine on this machine's loopback, and measure the wire.

One SuperLink, N SuperNodes (``flower-supernode --grpc-rere``, each with
``--node-config "partition-id=i num-partitions=N"``) and ``flwr run .`` against them, with a
byte-counting TCP relay (:mod:`fedcomp.simulations.relay`) between the SuperNodes and the SuperLink's
Fleet API. Optional TLS (certificates from :mod:`fedcomp.simulations.certs`) and SuperNode
authentication (keys registered with ``flwr supernode register``).

    python -m fedcomp.simulations.deploy --supernodes 2 --rounds 3 \\
        --run-config "model='mlp-large' upload='topk(ratio=0.01)+qsgd(bits=4)'" \\
        --run-config "model='mlp-large' upload='none()'"
    python -m fedcomp.simulations.deploy --supernodes 2 --rounds 2 --tls --auth --intruder

Every ``--run-config`` is one ``flwr run`` on the same deployment. For each run it prints a
per-round table joining ``results.json`` (``upload_bytes``: the serialized message content,
summed over clients) with the relay's client->server bytes of the same round (snapshot when
``results.json`` is rewritten after the round), and before the runs, Flower's idle traffic
(bytes per SuperNode per second with the nodes connected and no run). Without TLS it also breaks
the client->server bytes down into HTTP/2 framing, request headers, gRPC length prefixes and
protobuf bodies (the relay parses the frames) and counts the Fleet RPCs by name (the SuperLink
runs with ``FLWR_LOG_LEVEL=DEBUG`` and logs each one), and it counts the ClientApp processes the
SuperNodes start (one per message) with their lifetime and CPU time.

Links (``--links``, :func:`deployment`'s ``links``): each SuperNode gets its own link, uplink and
downlink rates and a latency. ``--shaping kernel`` puts each SuperNode in its own network
namespace behind a veth pair with tc rate limits per direction (:mod:`fedcomp.simulations.shaped`)
and its own relay on the veth's root end (which adds the latency: no netem here); ``--shaping
relay`` keeps everything on loopback and lets each node's relay pace both directions with a token
bucket (the fallback that runs anywhere); ``auto`` (default) picks kernel where namespaces and tc
work. ``python -m fedcomp.simulations.deploy_links`` runs the time-to-accuracy study on such links.

Everything listens on 127.0.0.1 only (with kernel-shaped links: also on the root ends of the veth
pairs this process creates, 10.b.i.1), on free ports. Every process is started here in its own
session and stopped by PID (its process group, then any descendant that left the group), in
``finally``. Importable: the tests use :func:`deployment`, :func:`run_app` and friends.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from fedcomp.clients.warm_exec import DEFAULT_PRELOAD
from fedcomp.links import Link
from fedcomp.simulations.certs import NodeKey, TlsFiles, make_ca_and_server_cert, make_node_keys
from fedcomp.simulations.relay import Counts, Relay, RelayGroup
from fedcomp.simulations.shaped import MIXES, ShapedNetwork, ShapingUnavailable, check_available, node_links

__all__ = [
    "ClientAppSampler",
    "Deployment",
    "Proc",
    "RoundWire",
    "RunResult",
    "deployment",
    "format_breakdown",
    "format_table",
    "free_port",
    "measure_idle",
    "reap_adopted",
    "register_node",
    "run_app",
    "start_superlink",
    "start_supernode",
    "stop_process",
    "wait_for_nodes",
    "SHAPINGS",
    "sigterm_raises",
    "main",
]

ROOT = Path(__file__).resolve().parents[1]
CONNECTION = "fedcomp-deploy"
RESERVED_PORTS = range(39091, 39094)  # someone else's SuperLink on this machine
_ACTIVATED = re.compile(r"Activated node_id=(\d+)")
_NODE_ID = re.compile(r"SuperNode ID: (\d+)")
# Fleet RPCs as the SuperLink logs them at DEBUG; PullMessages logs two lines per call ("node_id=..."
# and "Request: ..."), SendNodeHeartbeat only "Request: ...": count one line per call
_RPC = re.compile(r"\[Fleet\.(\w+)\] (Request: )?")
SHAPINGS = ("auto", "kernel", "relay")  # how per-node links are made (see the module docstring)
ISOLATIONS = ("subprocess", "process", "warm")  # who starts ClientApps (start_supernode)
SUPERNODES = ("fedcomp", "flower")  # fedcomp.clients.supernode (link timings, short polls) or flower-supernode
WARM_PRELOAD = ",".join([*DEFAULT_PRELOAD, "fedcomp.simulations.client_app"])  # 'warm': the project's app too


# --------------------------------------------------------------------------------- processes


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (never 39091-39093)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in RESERVED_PORTS:
            return port


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for every Flower process: own FLWR_HOME, no runtime `uv sync`."""
    env = dict(os.environ, FLWR_HOME=str(flwr_home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    env.pop("FLWR_INTERNAL_GRPC_CONTROL_API", None)  # no extra gRPC Control API listener
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@dataclasses.dataclass
class Proc:
    """A process started here in its own session (its PID is its process group id)."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    _log_file: object = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None


def _spawn(name: str, cmd: Sequence[str], env: dict[str, str], log_path: Path, cwd: Path) -> Proc:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path.parent / "commands.sh", "a") as commands:  # what was run, to copy from
        commands.write(f"# {name}\nFLWR_HOME={shlex.quote(env.get('FLWR_HOME', ''))} {shlex.join(cmd)}\n")
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed in stop_process
    try:
        popen = subprocess.Popen(
            list(cmd), env=env, cwd=cwd, stdout=log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    except BaseException:
        log_file.close()
        raise
    return Proc(name=name, popen=popen, log_path=log_path, _log_file=log_file)


def _children() -> dict[int, list[int]]:
    """ppid -> child pids, from /proc (Linux)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the command name is in parentheses and may hold spaces: split after the last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid`` (children first, then theirs)."""
    tree = _children()
    out, todo = [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_pids(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2:].split()[1])


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def _set_subreaper(on: bool) -> bool:
    """Make this process adopt orphaned descendants (Linux prctl PR_SET_CHILD_SUBREAPER).

    Flower's SuperNode starts its SuperExec without waiting for it; when both are stopped the
    SuperExec's exit status would be left to init. As a subreaper, this process adopts it and
    :func:`stop_process` reaps it (by PID), so nothing is left behind, not even a zombie.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1 if on else 0, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER = 36
    except (OSError, AttributeError):
        return False


def _reap(pids: Sequence[int]) -> None:
    """Collect the exit status of the given PIDs where they became our children."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


_ADOPTABLE = ("flower-superexe", "flwr-clientapp", "flwr-serverapp")  # /proc comm (15 chars max)


def _adopted() -> list[tuple[int, str]]:
    """(pid, state) of Flower helper processes that are now children of this process.

    As a subreaper (see :func:`_set_subreaper`) this process adopts the SuperExec of a
    SuperNode that exited on its own (e.g. a refused one); these are its descendants by
    construction, never processes started by anyone else.
    """
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) == me and comm.startswith(_ADOPTABLE):
            out.append((int(entry), fields[0]))
    return out


def reap_adopted(timeout: float = 5.0) -> None:
    """Wait for adopted Flower helpers to exit (they watch their parent), SIGTERM them after
    ``timeout``, SIGKILL after twice that, and collect their exit status."""
    deadline = time.monotonic() + timeout
    while adopted := _adopted():
        _reap([pid for pid, state in adopted if state == "Z"])
        alive = [pid for pid, state in adopted if state != "Z"]
        now = time.monotonic()
        if now > deadline + 2 * timeout:
            break
        if alive and now > deadline:
            _signal_pids(alive, signal.SIGKILL if now > deadline + timeout else signal.SIGTERM)
        time.sleep(0.1)


def stop_process(proc: Proc, timeout: float = 15.0) -> None:
    """Stop ``proc``: SIGTERM to its process group and to descendants that left it, then SIGKILL.

    Flower's SuperLink starts its SuperExec in a new session, so the group alone is not enough;
    the descendants are collected (by PID, from /proc) before anything is signalled.
    """
    try:
        kids = descendants(proc.pid)
        everyone = list(kids)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        _signal_pids(kids, signal.SIGTERM)
        try:
            proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in kids):
            time.sleep(0.1)
        late = descendants(proc.pid)
        everyone += late
        kids = [p for p in kids if _alive(p)] + late
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _signal_pids(kids, signal.SIGKILL)
        try:
            proc.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # adopted descendants (see _set_subreaper): reap them; others are reaped by their parents
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            _reap(everyone)
            if not any(_ppid(p) == os.getpid() for p in everyone):
                break
            time.sleep(0.1)
    finally:
        if proc._log_file is not None:
            proc._log_file.close()
            proc._log_file = None


# -------------------------------------------------------------------------------- deployment


@dataclasses.dataclass
class Deployment:
    """A running SuperLink (Fleet API behind a relay) and its SuperNodes."""

    workdir: Path
    cli_env: dict[str, str]  # env for the `flwr` CLI: FLWR_HOME holds config.toml
    superlink: Proc
    relay: Relay | RelayGroup  # with per-node links: every node's relay, read as one
    fleet_port: int
    http_port: int
    tls: TlsFiles | None = None
    auth: bool = False
    node_keys: list[NodeKey] = dataclasses.field(default_factory=list)
    supernodes: list[Proc] = dataclasses.field(default_factory=list)
    extra: list[Proc] = dataclasses.field(default_factory=list)  # e.g. an unregistered node
    links: list[Link] | None = None  # per-node links (None: plain loopback, one relay)
    shaping: str | None = None  # 'kernel' or 'relay' with links
    net: ShapedNetwork | None = None  # the namespaces, with kernel shaping
    node_relays: list[Relay] = dataclasses.field(default_factory=list)  # one per node, with links

    def relay_of(self, index: int) -> Relay | RelayGroup:
        """The relay SuperNode ``index`` connects to."""
        if self.node_relays:
            return self.node_relays[index if index < len(self.node_relays) else 0]
        return self.relay

    def exec_prefix(self, index: int) -> list[str]:
        """Prefix that runs a command in SuperNode ``index``'s namespace ([] without kernel shaping)."""
        if self.net is None:
            return []
        return self.net.exec_prefix(min(index, len(self.net.nodes) - 1))

    def log_offset(self) -> int:
        """Current length of the SuperLink log (to count RPCs from here on, see :meth:`rpcs`)."""
        return len(self.superlink.log())

    def rpcs(self, start: int = 0, end: int | None = None) -> dict[str, int]:
        """Fleet RPCs the SuperLink logged (needs ``count_rpcs``) in ``log[start:end]``, by name."""
        counts: dict[str, int] = {}
        for name, request_line in _RPC.findall(self.superlink.log()[start:end]):
            if name == "PullMessages" and request_line:
                continue
            counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items()))

    def node_ids(self) -> dict[int, int]:
        """Flower node id -> SuperNode index (partition id), from the SuperNodes' logs."""
        out = {}
        for i, proc in enumerate(self.supernodes):
            m = _NODE_ID.search(proc.log())
            if m:
                out[int(m.group(1))] = i
        return out

    def activated_nodes(self) -> list[int]:
        """Node ids the SuperLink has activated so far (from its log)."""
        return [int(m) for m in _ACTIVATED.findall(self.superlink.log())]

    def flwr(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """Run the ``flwr`` CLI against this SuperLink."""
        done = subprocess.run(["flwr", *args], env=self.cli_env, cwd=self.workdir, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise RuntimeError(f"flwr {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done


def _write_cli_config(home: Path, http_port: int, tls: TlsFiles | None) -> None:
    home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]",
             f'address = "127.0.0.1:{http_port}"']
    if tls is None:
        lines.append("insecure = true")
    else:
        lines.append(f'root-certificates = "{tls.ca_cert}"')
    (home / "config.toml").write_text("\n".join(lines) + "\n")


def _wait_port(port: int, proc: Proc, timeout: float, in_namespace: bool = False) -> None:
    """Wait until ``proc`` listens on 127.0.0.1:``port``; ``in_namespace``: its own loopback (a node's
    network namespace), which this process cannot reach: wait for the server's log line instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.log()[-3000:]}")
        if in_namespace:
            if f"running on http://127.0.0.1:{port}" in proc.log():
                return
        else:
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} did not listen on 127.0.0.1:{port} within {timeout}s:\n{proc.log()[-3000:]}")


def start_superlink(workdir: Path, tls: TlsFiles | None, auth: bool, count_rpcs: bool = False,
                    extra_env: dict[str, str] | None = None) -> tuple[Proc, int, int]:
    """Start ``flower-superlink`` with its Fleet API and HTTP API on free loopback ports.

    ``count_rpcs`` runs it with ``FLWR_LOG_LEVEL=DEBUG``, so it logs every Fleet RPC.
    """
    fleet_port, http_port, grpc_control_port = free_port(), free_port(), free_port()
    cmd = ["flower-superlink"]
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert),
                "--ssl-keyfile", str(tls.server_key)]
    if auth:
        cmd.append("--enable-supernode-auth")
    cmd += [
        "--fleet-api-address", f"127.0.0.1:{fleet_port}",  # SuperNodes (through the relay)
        "--host", "127.0.0.1", "--port", str(http_port),  # Runtime + Control HTTP API (flwr CLI)
        # deprecated gRPC Control API: only started with FLWR_INTERNAL_GRPC_CONTROL_API=1 (which
        # flower_env removes), its default would be 0.0.0.0:9093, so pin it to loopback anyway
        "--control-api-address", f"127.0.0.1:{grpc_control_port}",
    ]
    home = workdir / "superlink-home"
    home.mkdir(parents=True, exist_ok=True)
    env = flower_env(home)
    if count_rpcs:
        env["FLWR_LOG_LEVEL"] = "DEBUG"
    env.update(extra_env or {})
    proc = _spawn("superlink", cmd, env, workdir / "logs" / "superlink.log", workdir)
    try:
        _wait_port(http_port, proc, 60)
        _wait_port(fleet_port, proc, 30)
    except BaseException:
        stop_process(proc)
        raise
    return proc, fleet_port, http_port


def start_supernode(
    dep: Deployment,
    index: int,
    num_partitions: int,
    *,
    key: NodeKey | None = None,
    device: str | None = None,
    name: str | None = None,
    max_retries: int | None = None,
    isolation: str = "subprocess",
    declare_link: bool = False,
    extra_env: dict[str, str] | None = None,
    supernode: str = "fedcomp",
) -> Proc:
    """Start one ``flower-supernode`` connecting to its relay, with its partition as node config
    (and, with ``declare_link``, its link's keys: ``uplink-kbps=... downlink-kbps=... latency-ms=...``).
    With kernel-shaped links it runs in its namespace (``ip netns exec``: the same PID).
    ``supernode``: ``'fedcomp'`` (:mod:`fedcomp.clients.supernode`: Flower's SuperNode timing its
    own link, with short polls) or ``'flower'`` (``flower-supernode`` as installed)."""
    if supernode not in SUPERNODES:
        raise ValueError(f"supernode={supernode!r} is invalid: one of {SUPERNODES}")
    name = name or f"supernode-{index}"
    node_config = f"partition-id={index} num-partitions={num_partitions}"
    if device:
        node_config += f" device='{device}'"
    if declare_link and dep.links and index < len(dep.links):
        node_config += " " + dep.links[index].describe()
    program = [sys.executable, "-m", "fedcomp.clients.supernode"] if supernode == "fedcomp" else ["flower-supernode"]
    cmd = [*dep.exec_prefix(index), *program, "--grpc-rere", "--superlink", dep.relay_of(index).address]
    if dep.tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--root-certificates", str(dep.tls.ca_cert)]
    if key is not None:
        cmd += ["--auth-supernode-private-key", str(key.private_key)]
    if max_retries is not None:
        cmd += ["--max-retries", str(max_retries)]
    runtime_port = free_port()
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation={isolation!r} is invalid: one of {ISOLATIONS}")
    cmd += ["--host", "127.0.0.1", "--port", str(runtime_port),
            "--isolation", "subprocess" if isolation == "subprocess" else "process", "--node-config", node_config]
    home = dep.workdir / f"{name}-home"  # own FLWR_HOME: nodes install the app bundle separately
    home.mkdir(parents=True, exist_ok=True)
    env = flower_env(home)
    env["FEDCOMP_STATE_DIR"] = str(home / "fedcomp-state")  # the node's state files, removed with the workdir
    env.update(extra_env or {})
    proc = _spawn(name, cmd, env, dep.workdir / "logs" / f"{name}.log", dep.workdir)
    if isolation != "subprocess":
        # the SuperNode does not start a SuperExec: run one next to it, as one would in a
        # separate container, on the SuperNode's Runtime API (plain HTTP on loopback here);
        # 'warm': fedcomp's, whose ClientApps fork from a process with Flower and torch imported
        superexec = (["flower-superexec"] if isolation == "process"
                     else [sys.executable, "-m", "fedcomp.clients.warm_exec", "--preload", WARM_PRELOAD])
        try:
            _wait_port(runtime_port, proc, 60, in_namespace=bool(dep.exec_prefix(index)))
            dep.extra.append(_spawn(
                f"{name}-superexec",
                [*dep.exec_prefix(index), *superexec, "--insecure", "--runtime-api-address", f"127.0.0.1:{runtime_port}",
                 "--parent-pid", str(proc.pid)],
                env, dep.workdir / "logs" / f"{name}-superexec.log", dep.workdir,
            ))
        except BaseException:
            stop_process(proc)
            raise
    return proc


def register_node(dep: Deployment, key: NodeKey) -> int:
    """``flwr supernode register <key>.pub``: returns the node id the SuperLink assigned."""
    done = dep.flwr("supernode", "register", str(key.public_key), CONNECTION, "--name", key.name,
                    "--format", "json")
    data = json.loads(done.stdout[done.stdout.index("{"):])
    if not data.get("success"):
        raise RuntimeError(f"registering {key.name} failed: {done.stdout}")
    return int(data["node-id"])


def wait_for_nodes(dep: Deployment, count: int, timeout: float = 120) -> list[int]:
    """Wait until the SuperLink has activated ``count`` nodes; returns their ids."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = sorted(set(dep.activated_nodes()))
        if len(ids) >= count:
            return ids
        dead = [p for p in dep.supernodes if not p.alive()]
        if dead or not dep.superlink.alive():
            p = dead[0] if dead else dep.superlink
            raise RuntimeError(f"{p.name} exited ({p.popen.returncode}):\n{p.log()[-3000:]}")
        time.sleep(0.25)
    raise RuntimeError(f"only {len(set(dep.activated_nodes()))}/{count} SuperNodes activated in {timeout}s")


@contextlib.contextmanager
def deployment(
    workdir: str | Path,
    num_supernodes: int,
    *,
    tls: bool = False,
    auth: bool = False,
    device: str | None = None,
    isolation: str = "subprocess",
    wait: bool = True,
    count_rpcs: bool = True,
    superlink_env: dict[str, str] | None = None,
    links: Sequence[Link] | None = None,
    shaping: str = "auto",
    qdisc: str = "tbf",
    declare_links: bool = False,
    supernode_env: dict[str, str] | None = None,
    supernode: str = "fedcomp",
) -> Iterator[Deployment]:
    """SuperLink + relay + ``num_supernodes`` SuperNodes; everything is stopped on exit.

    With ``auth`` (needs ``tls``), one key pair per SuperNode is made and registered with
    ``flwr supernode register`` before the SuperNodes start.

    ``links`` (one per SuperNode): per-node links, made as ``shaping`` says: ``'kernel'`` (a
    namespace per node, tc rates, the relay adds the latency; raises
    :class:`~fedcomp.simulations.shaped.ShapingUnavailable` where namespaces or tc do not work),
    ``'relay'`` (loopback, each node's relay paces both directions and adds the latency), ``'auto'``
    (kernel where it works, else relay). ``declare_links`` also puts each link into its node's
    ``--node-config`` (budgets from declared links; leave it off for measured links).
    ``supernode``: which SuperNode program (:func:`start_supernode`).
    """
    if auth and not tls:
        raise ValueError("SuperNode authentication needs TLS (Flower refuses it without)")
    if shaping not in SHAPINGS:
        raise ValueError(f"shaping={shaping!r} is invalid: one of {SHAPINGS}")
    if links is not None:
        links = list(links)
        if len(links) != num_supernodes:
            raise ValueError(f"{len(links)} links for {num_supernodes} SuperNodes: give one link per SuperNode")
        if shaping == "auto":
            try:
                check_available(qdisc)
                shaping = "kernel"
            except ShapingUnavailable as exc:
                print(f"deploy: kernel-shaped links unavailable ({exc}); the relays' token buckets shape instead",
                      file=sys.stderr)
                shaping = "relay"
        if shaping == "kernel":
            check_available(qdisc)
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    tls_files = make_ca_and_server_cert(workdir / "certs") if tls else None
    cli_home = workdir / "cli-home"
    _write_cli_config(cli_home, 0, tls_files)  # rewritten once the port is known
    superlink = relay = net = None
    node_relays: list[Relay] = []
    dep: Deployment | None = None
    subreaper = _set_subreaper(True)
    previous_sigint = _sigint_raises()
    try:
        superlink, fleet_port, http_port = start_superlink(workdir, tls_files, auth, count_rpcs, superlink_env)
        _write_cli_config(cli_home, http_port, tls_files)
        if links is None:
            relay = Relay("127.0.0.1", fleet_port).start()
        else:
            if shaping == "kernel":
                net = ShapedNetwork(links, qdisc=qdisc).open()
            for i, link in enumerate(links):
                if net is not None:  # the kernel limits the rates; the relay adds the latency
                    node_relays.append(Relay("127.0.0.1", fleet_port, listen_host=net.node(i).host_addr,
                                             latency_ms=link.latency_ms).start())
                else:
                    node_relays.append(Relay("127.0.0.1", fleet_port, latency_ms=link.latency_ms,
                                             up_kbps=link.uplink_kbps, down_kbps=link.downlink_kbps).start())
            relay = RelayGroup(node_relays)
        dep = Deployment(workdir=workdir, cli_env=flower_env(cli_home), superlink=superlink, relay=relay,
                         fleet_port=fleet_port, http_port=http_port, tls=tls_files, auth=auth,
                         links=links, shaping=shaping if links is not None else None, net=net,
                         node_relays=node_relays)
        if auth:
            dep.node_keys = make_node_keys(workdir / "certs" / "keys",
                                           [f"supernode-{i}" for i in range(num_supernodes)])
            for key in dep.node_keys:
                register_node(dep, key)
        for i in range(num_supernodes):
            dep.supernodes.append(start_supernode(
                dep, i, num_supernodes, key=dep.node_keys[i] if auth else None, device=device,
                isolation=isolation, declare_link=declare_links, extra_env=supernode_env, supernode=supernode,
            ))
        if wait:
            wait_for_nodes(dep, num_supernodes)
        yield dep
    finally:
        if dep is not None:
            for proc in [*dep.extra, *dep.supernodes]:
                stop_process(proc)
        if relay is not None:
            relay.stop()
        else:
            for r in node_relays:
                r.stop()
        if superlink is not None:
            stop_process(superlink)
        if subreaper:
            reap_adopted()
            _set_subreaper(False)
        if net is not None:  # after the processes in the namespaces are gone
            net.close()
        if previous_sigint is not None:
            signal.signal(signal.SIGINT, previous_sigint)


def sigterm_raises() -> None:
    """Make SIGTERM raise KeyboardInterrupt in the main thread, so ``finally`` tears a deployment
    down (processes, relays, namespaces) when the CLI is terminated too, not only on Ctrl-C."""
    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise)


def _sigint_raises():
    """Make SIGINT raise KeyboardInterrupt (so ``finally`` tears everything down) where a caller
    had set it to be ignored or to a C handler; returns the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return previous


# ---------------------------------------------------------------------------------- measuring


def measure_idle(dep: Deployment, seconds: float) -> dict[str, float]:
    """Relay bytes with every SuperNode connected and no run, per SuperNode per second."""
    n = max(len(dep.supernodes), 1)
    before, h2_before, log0, t0 = dep.relay.counts(), dep.relay.http2_counts(), dep.log_offset(), time.monotonic()
    time.sleep(seconds)
    used, dt = dep.relay.counts() - before, time.monotonic() - t0
    return {
        "rpcs": dep.rpcs(log0),
        "http2": h2_delta(dep.relay.http2_counts(), h2_before),
        "seconds": dt,
        "supernodes": n,
        "client_to_server": used.client_to_server,
        "server_to_client": used.server_to_client,
        "c2s_per_node_per_s": used.client_to_server / n / dt,
        "s2c_per_node_per_s": used.server_to_client / n / dt,
    }


def h2_delta(after: dict, before: dict) -> dict[str, dict[str, int]]:
    """Difference of two :meth:`Relay.http2_counts` snapshots."""
    return {d: {k: after[d][k] - before[d].get(k, 0) for k in after[d]} for d in after}


@dataclasses.dataclass
class RoundWire:
    """One round: what results.json says was sent, and what the relay saw in that round's window."""

    round: int
    clients: int
    accuracy: float
    upload_bytes: int  # results.json: serialized message content, summed over clients
    download_bytes: int
    relay: Counts  # relay bytes between the previous round's snapshot and this one's
    seconds: float  # length of the window

    @property
    def overhead(self) -> int:
        """Relay client->server bytes minus the serialized content bytes."""
        return self.relay.client_to_server - self.upload_bytes

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["relay"] = self.relay.as_dict()
        d["overhead"] = self.overhead
        return d


@dataclasses.dataclass
class RunResult:
    returncode: int
    seconds: float
    out_dir: Path
    results: dict | None
    rounds: list[RoundWire]
    total: Counts  # relay bytes from just before `flwr run` to its end
    log: str
    http2: dict = dataclasses.field(default_factory=dict)  # relay HTTP/2 breakdown over the run
    rpcs: dict = dataclasses.field(default_factory=dict)  # Fleet RPCs the SuperLink logged in the run
    clientapps: dict = dataclasses.field(default_factory=dict)  # ClientAppSampler.summary()

    @property
    def upload_bytes(self) -> int:
        return sum(r.upload_bytes for r in self.rounds)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.results is not None

    def as_dict(self) -> dict:
        return {"returncode": self.returncode, "seconds": self.seconds, "out_dir": str(self.out_dir),
                "rounds": [r.as_dict() for r in self.rounds], "total": self.total.as_dict(),
                "upload_bytes": self.upload_bytes, "http2": self.http2, "rpcs": self.rpcs,
                "clientapps": self.clientapps}


class ClientAppSampler:
    """Watch the ClientApp processes the SuperNodes start (one per message), from /proc.

    Records, per ``flwr-clientapp`` process started below a SuperNode during the run: its start
    time, when it was last seen alive (sampled every ``interval`` s) and its CPU time; the
    lifetime is process start + imports + reading the message + training + encoding + reply.
    """

    def __init__(self, dep: Deployment, interval: float = 0.5) -> None:
        self.dep, self.interval = dep, interval
        self.seen: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="clientapp-sampler", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> ClientAppSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    @staticmethod
    def _uptime() -> float:
        return float(Path("/proc/uptime").read_text().split()[0])

    def _run(self) -> None:
        t0 = self._uptime() - 0.5  # processes started before this belong to an earlier run
        while not self._stop.is_set():
            now = self._uptime()
            tree = _children()
            roots = [*self.dep.supernodes, *(p for p in self.dep.extra if p.name.endswith("-superexec"))]
            for node in roots:
                todo = [(node.pid, "root")]
                while todo:
                    parent, parent_comm = todo.pop()
                    for pid in tree.get(parent, []):
                        try:
                            comm = Path(f"/proc/{pid}/comm").read_text().strip()
                            stat = Path(f"/proc/{pid}/stat").read_text()
                        except OSError:
                            continue
                        todo.append((pid, comm))
                        # a ClientApp process, not a helper it forked (which keeps its name)
                        if not comm.startswith("flwr-clientapp") or parent_comm.startswith("flwr-clientapp"):
                            continue
                        fields = stat[stat.rfind(")") + 2:].split()
                        started = int(fields[19]) / self._tick  # seconds after boot
                        if started < t0:
                            continue
                        cpu = (int(fields[11]) + int(fields[12])) / self._tick
                        entry = self.seen.setdefault(pid, {"node": node.name, "first": started, "last": now, "cpu": 0.0})
                        entry["cpu"] = max(entry["cpu"], cpu)
                        if fields[0] != "Z":  # a zombie has exited already
                            entry["last"] = now
            self._stop.wait(self.interval)

    def summary(self) -> dict:
        lifetimes = [e["last"] - e["first"] for e in self.seen.values()]
        cpus = [e["cpu"] for e in self.seen.values()]
        if not lifetimes:
            return {"processes": 0}
        return {"processes": len(lifetimes), "lifetime_mean_s": sum(lifetimes) / len(lifetimes),
                "lifetime_max_s": max(lifetimes), "cpu_mean_s": sum(cpus) / len(cpus)}


def _read_results(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_app(
    dep: Deployment,
    run_config: str,
    out_dir: str | Path,
    *,
    timeout: float = 600,
    app_dir: str | Path = ROOT,
) -> RunResult:
    """``flwr run <app_dir> <connection> --stream`` with ``run_config`` plus an absolute ``out-dir``.

    While it runs, ``results.json`` is polled; each time a round appears the relay counters are
    snapshot, so each round gets the relay bytes of its own window (from the previous round's
    snapshot, or from the run's start, to its own).
    """
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.json"
    if results_path.exists():
        results_path.unlink()
    config = f"{run_config} out-dir='{out_dir}'".strip()
    cmd = ["flwr", "run", str(app_dir), CONNECTION, "--stream", "--run-config", config]
    log_path = out_dir / "flwr-run.log"

    snapshots: list[tuple[int, Counts, float]] = []  # (rounds seen, counts, time)
    start_counts, h2_start, log0 = dep.relay.counts(), dep.relay.http2_counts(), dep.log_offset()
    t0 = time.monotonic()
    with ClientAppSampler(dep) as sampler:
        proc = _spawn("flwr-run", cmd, dep.cli_env, log_path, dep.workdir)
        seen = 0
        try:
            deadline = t0 + timeout
            while True:
                running = proc.alive()
                data = _read_results(results_path)
                n = len(data.get("rounds", [])) if isinstance(data, dict) else 0
                if n > seen:
                    snapshots.append((n, dep.relay.counts(), time.monotonic()))
                    seen = n
                if not running:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"flwr run did not finish in {timeout}s:\n{proc.log()[-3000:]}")
                time.sleep(0.05)
            returncode = proc.popen.returncode
        finally:
            if proc.alive():
                stop_process(proc)
            else:
                proc.popen.wait()
                if proc._log_file is not None:
                    proc._log_file.close()
                    proc._log_file = None
    seconds = time.monotonic() - t0
    total = dep.relay.counts() - start_counts
    http2 = h2_delta(dep.relay.http2_counts(), h2_start)
    rpcs = dep.rpcs(log0)
    results = _read_results(results_path)

    rounds: list[RoundWire] = []
    if results:
        prev_counts, prev_t = start_counts, t0
        by_round = {r["round"]: r for r in results["rounds"]}
        for n, counts, t in snapshots:
            row = by_round.get(n) or results["rounds"][n - 1]
            # rounds that appeared together (not seen separately) are folded into the last one
            first = rounds[-1].round + 1 if rounds else 1
            rows = [by_round[k] for k in range(first, n + 1) if k in by_round]
            rounds.append(RoundWire(
                round=row["round"],
                clients=sum(len(r.get("clients", [])) for r in rows),
                accuracy=float(row["accuracy"]),
                upload_bytes=sum(int(r["upload_bytes"]) for r in rows),
                download_bytes=sum(int(r["download_bytes"]) for r in rows),
                relay=counts - prev_counts,
                seconds=t - prev_t,
            ))
            prev_counts, prev_t = counts, t
    return RunResult(returncode=returncode, seconds=seconds, out_dir=out_dir, results=results,
                     rounds=rounds, total=total, log=proc.log(), http2=http2, rpcs=rpcs,
                     clientapps=sampler.summary())


def format_table(run: RunResult) -> str:
    """Per-round table: results.json upload bytes vs relay client->server bytes."""
    head = (f"{'round':>5} {'clients':>7} {'acc':>6} {'results.json up':>15} {'relay c2s':>11} "
            f"{'overhead':>9} {'ovh/client':>10} {'relay s2c':>11} {'results down':>12} {'secs':>6}")
    lines = [head, "-" * len(head)]
    for r in run.rounds:
        per_client = r.overhead / r.clients if r.clients else float("nan")
        lines.append(
            f"{r.round:>5} {r.clients:>7} {r.accuracy:>6.3f} {r.upload_bytes:>15,} {r.relay.client_to_server:>11,} "
            f"{r.overhead:>9,} {per_client:>10,.0f} {r.relay.server_to_client:>11,} {r.download_bytes:>12,} "
            f"{r.seconds:>6.1f}"
        )
    up = run.upload_bytes
    in_rounds = sum(r.relay.client_to_server for r in run.rounds)
    lines.append("-" * len(head))
    lines.append(f"run: {run.seconds:.1f} s, rc {run.returncode}; results.json upload {up:,} B; relay c2s in rounds "
                 f"{in_rounds:,} B, whole run {run.total.client_to_server:,} B (s2c {run.total.server_to_client:,} B)")
    ca = run.clientapps
    if ca.get("processes"):
        lines.append(f"ClientApp processes: {ca['processes']} (one per message), alive {ca['lifetime_mean_s']:.1f} s "
                     f"on average (max {ca['lifetime_max_s']:.1f} s), {ca['cpu_mean_s']:.1f} CPU s each")
    if run.rounds:
        clients = sum(r.clients for r in run.rounds)
        overhead = in_rounds - up
        lines.append(f"overhead in rounds: {overhead:,} B = {overhead / max(clients, 1):,.0f} B per client-round "
                     f"({in_rounds / max(up, 1):.4f}x the content)")
    return "\n".join(lines)


def format_breakdown(http2: dict, rpcs: dict, content_bytes: int | None = None) -> str:
    """Where the client->server bytes went: HTTP/2 framing, headers, gRPC bodies, vs the content."""
    c = http2.get("client_to_server", {})
    if not c:
        return "(no HTTP/2 breakdown)"
    total = sum(v for k, v in c.items() if k.endswith("_bytes"))
    if c.get("opaque_bytes"):
        return f"client->server {total:,} B are TLS records (opaque to the relay); no HTTP/2 breakdown"
    n_rpc = sum(rpcs.values())
    streams = c["streams"]
    parts = [
        f"client->server {total:,} B in {streams} gRPC calls (HTTP/2 streams; SuperLink logged {n_rpc} Fleet RPCs: "
        + ", ".join(f"{k} {v}" for k, v in rpcs.items()) + ")",
        f"  gRPC message bodies (protobuf requests) {c['grpc_body_bytes']:,} B"
        + (f" = content (results.json) {content_bytes:,} B + protobuf/Flower envelope "
           f"{c['grpc_body_bytes'] - content_bytes:,} B" if content_bytes is not None else ""),
        f"  request headers (HPACK) {c['headers_bytes']:,} B = {c['headers_bytes'] / max(streams, 1):,.0f} B/call; "
        f"HTTP/2 frame headers {c['frame_header_bytes']:,} B ({c['frames']:,} frames, 9 B each); "
        f"gRPC length prefixes {c['grpc_prefix_bytes']:,} B ({c['grpc_messages']} x 5 B); "
        f"control frames (SETTINGS/PING/WINDOW_UPDATE) {c['control_bytes']:,} B; preface {c['preface_bytes']} B",
    ]
    polling = rpcs.get("PullMessages", 0) + rpcs.get("SendNodeHeartbeat", 0)
    replies = rpcs.get("PushMessages", 0)
    if replies:
        parts.append(f"  {n_rpc - polling} RPCs move messages ({(n_rpc - polling) / replies:.1f} per reply, with "
                     f"GetRun/GetFab once per node and run), {polling} poll (PullMessages, SendNodeHeartbeat)")
    framing = total - c["grpc_body_bytes"]
    envelope = c["grpc_body_bytes"] - (content_bytes or 0)
    parts.append(f"  => per call: {framing / max(streams, 1):,.0f} B of HTTP/2 + gRPC framing and headers, "
                 f"{envelope / max(streams, 1):,.0f} B of protobuf envelope; "
                 f"{(framing + envelope) / max(streams, 1):,.0f} B per call beyond the content")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedcomp.simulations.deploy",
        description="SuperLink + N SuperNodes on loopback (Fleet API behind a byte-counting relay), "
                    "flwr run, and a per-round byte table.",
    )
    parser.add_argument("--supernodes", type=int, default=2, help="number of SuperNodes (default 2)")
    parser.add_argument("--tls", action="store_true", help="TLS with a self-signed CA (fedcomp.simulations.certs)")
    parser.add_argument("--auth", action="store_true",
                        help="SuperNode authentication (implies --tls): keys registered with flwr supernode register")
    parser.add_argument("--intruder", action="store_true",
                        help="with --auth: also start a SuperNode with an unregistered key and report its fate")
    parser.add_argument("--rounds", type=int, default=3, help="num-server-rounds (default 3)")
    parser.add_argument("--run-config", action="append", default=None,
                        help="extra run config, e.g. \"model='mlp-large' upload='none()'\"; repeat for "
                             "several runs on the same deployment (default: one run with the app's defaults)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where logs, certificates and results go (default: ./outputs/deploy-<time>)")
    parser.add_argument("--device", default=None, help="node-config device for every SuperNode, e.g. cuda")
    parser.add_argument("--isolation", default="subprocess", choices=ISOLATIONS,
                        help="SuperNode isolation: subprocess (the SuperNode starts its SuperExec), process "
                             "(this script starts a flower-superexec next to each SuperNode) or warm (fedcomp's "
                             "SuperExec, fedcomp.clients.warm_exec: ClientApps fork from a process with Flower "
                             "and torch imported)")
    parser.add_argument("--supernode", default="fedcomp", choices=SUPERNODES,
                        help="fedcomp (fedcomp.clients.supernode: times its link for measured budgets, polls "
                             "every 0.5 s right after a reply) or flower (flower-supernode: 3 s after an empty poll)")
    parser.add_argument("--idle-seconds", type=float, default=30.0,
                        help="measure Flower's idle traffic for this long before the runs (0: skip)")
    parser.add_argument("--timeout", type=float, default=1800, help="per-run timeout in seconds")
    parser.add_argument("--json", type=Path, default=None, help="also write all figures to this JSON file")
    parser.add_argument("--app-dir", type=Path, default=ROOT, help=f"Flower app to run (default: {ROOT})")
    parser.add_argument("--links", default=None,
                        help=f"a link per SuperNode: a mix {sorted(MIXES)}, a preset, 'mixed' or a .csv/.toml table "
                             "(default: none, plain loopback)")
    parser.add_argument("--shaping", default="auto", choices=SHAPINGS,
                        help="with --links: kernel (namespaces + tc), relay (token buckets), auto (kernel where it works)")
    parser.add_argument("--declare-links", action="store_true",
                        help="with --links: also give each SuperNode its link as node config (declared-link budgets)")
    args = parser.parse_args(argv)
    links = node_links(args.links, args.supernodes) if args.links else None
    sigterm_raises()
    if args.auth:
        args.tls = True
    if args.intruder and not args.auth:
        parser.error("--intruder needs --auth")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = (args.out_dir or Path("outputs") / f"deploy-{stamp}").resolve()
    configs = args.run_config or [""]
    report: dict = {"date": datetime.date.today().isoformat(), "argv": sys.argv, "supernodes": args.supernodes,
                    "tls": args.tls, "auth": args.auth, "runs": []}

    t_start = time.monotonic()
    with deployment(out / "deploy", args.supernodes, tls=args.tls, auth=args.auth, device=args.device,
                    isolation=args.isolation, links=links, shaping=args.shaping,
                    declare_links=args.declare_links, supernode=args.supernode) as dep:
        t_up = time.monotonic() - t_start
        if links is not None:
            print(f"links ({dep.shaping}-shaped): " + "; ".join(f"node {i} {link.describe()}" for i, link in enumerate(links)))
        print(f"SuperLink: Fleet API 127.0.0.1:{dep.fleet_port} behind relay {dep.relay.address}, "
              f"HTTP API 127.0.0.1:{dep.http_port}; {args.supernodes} SuperNodes activated in {t_up:.1f} s"
              f"{' (TLS' + (' + node auth' if args.auth else '') + ')' if args.tls else ''}; logs in {out / 'deploy' / 'logs'}")
        report["startup_seconds"] = t_up

        if args.intruder:
            report["intruder"] = _intruder(dep, args.supernodes)
            print(f"unregistered SuperNode: {report['intruder']['verdict']}")

        idle = None
        if args.idle_seconds > 0:
            idle = measure_idle(dep, args.idle_seconds)
            report["idle"] = idle
            print(f"idle ({idle['seconds']:.1f} s, {idle['supernodes']} SuperNodes, no run): "
                  f"c2s {idle['client_to_server']:,} B, s2c {idle['server_to_client']:,} B = "
                  f"{idle['c2s_per_node_per_s']:.1f} B/s c2s + {idle['s2c_per_node_per_s']:.1f} B/s s2c per SuperNode")
            print(format_breakdown(idle["http2"], idle["rpcs"]))

        runs: list[RunResult] = []
        for k, extra in enumerate(configs):
            run_config = f"num-server-rounds={args.rounds} {extra}".strip()
            print(f"\nrun {k + 1}/{len(configs)}: --run-config \"{run_config}\"")
            run = run_app(dep, run_config, out / f"run-{k + 1}", timeout=args.timeout, app_dir=args.app_dir)
            runs.append(run)
            print(format_table(run))
            print(format_breakdown(run.http2, run.rpcs, run.upload_bytes if run.ok else None))
            report["runs"].append({"run_config": run_config, **run.as_dict()})
            if not run.ok:
                print(f"run failed (rc {run.returncode}); last log lines:\n{run.log[-3000:]}")
        if len(runs) > 1 and runs[0].ok:
            base = runs[0].total.client_to_server
            for k, run in enumerate(runs[1:], start=2):
                if run.ok and base:
                    print(f"relay client->server, run {k} / run 1: {run.total.client_to_server / base:.1f}x "
                          f"(results.json: {run.upload_bytes / max(runs[0].upload_bytes, 1):.1f}x)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0 if all(r.ok for r in runs) else 1


def _intruder(dep: Deployment, index: int) -> dict:
    """Start a SuperNode whose key was never registered; it must not be activated."""
    (key,) = make_node_keys(dep.workdir / "certs" / "intruder", ["intruder"])
    before = set(dep.activated_nodes())
    proc = start_supernode(dep, index, index + 1, key=key, name="intruder", max_retries=2)
    dep.extra.append(proc)
    try:
        proc.popen.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    new = set(dep.activated_nodes()) - before
    exited = proc.popen.poll()
    verdict = ("refused: exited with code %s, never activated" % exited if exited is not None and not new
               else f"NOT refused (activated {sorted(new)}, exit {exited})")
    return {"exit_code": exited, "activated": sorted(new), "verdict": verdict,
            "log_tail": proc.log()[-600:]}


if __name__ == "__main__":
    raise SystemExit(main())
