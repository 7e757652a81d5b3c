"""Run this app on a real Flower deployment on one machine: a SuperLink and N SuperNodes on
loopback, TLS on every connection, and SuperNode authentication (only registered keys may join).

    python run_local.py --supernodes 2 --rounds 3

Each step is the command you would run on separate machines (printed as it runs):

1. certificates: a CA, the SuperLink's certificate, one key pair per SuperNode
   (``python -m fedcomp.simulations.certs certs --nodes N``; any PKI works);
2. ``flower-superlink`` with ``--ssl-*`` files and ``--enable-supernode-auth``;
3. ``flwr supernode register certs/keys/supernode-i.pub <connection>`` for each SuperNode;
4. ``flower-supernode --root-certificates certs/ca.crt --auth-supernode-private-key ...``;
5. ``flwr run . <connection> --stream``.

Everything it started is stopped at the end, by PID (also on Ctrl-C or an error). Linux only
(the processes the SuperLink spawns are found through /proc).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

APP = Path(__file__).resolve().parent
CONNECTION = "local-tls"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_env(home: Path) -> dict[str, str]:
    """Own FLWR_HOME per process; no runtime `uv sync` of the app's dependencies."""
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               PYTHONUNBUFFERED="1")
    env.pop("FLWR_INTERNAL_GRPC_CONTROL_API", None)
    return env


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the SuperLink starts its SuperExec in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Processes:
    """The processes this script started; :meth:`stop_all` ends them and what they spawned."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.procs = logs, []
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        print(f"$ {shlex.join(cmd)}", flush=True)
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=APP,
                                    start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for name, proc in reversed(self.procs):
            pids = [proc.pid, *descendants(proc.pid)]
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                try:
                    proc.wait(timeout=15)
                    time.sleep(0.5)  # let its children go too
                    if not any(Path(f"/proc/{p}").exists() and _state(p) != "Z" for p in pids[1:]):
                        break
                except subprocess.TimeoutExpired:
                    pass
            print(f"stopped {name} (pid {proc.pid})", flush=True)


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "Z"
    return stat[stat.rindex(")") + 2]


def wait_port(port: int, proc: subprocess.Popen, name: str, procs: Processes, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}):\n{procs.log(name)[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not listen on 127.0.0.1:{port} within {timeout} s")


def run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> str:
    print(f"$ {shlex.join(cmd)}", flush=True)
    done = subprocess.run(cmd, env=env, cwd=APP, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--supernodes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="certificates, FLWR_HOMEs and logs (default: a temp dir)")
    args = ap.parse_args(argv)
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="fedcomp-deploy-"))).resolve()
    certs, procs = work / "certs", Processes(work / "logs")
    print(f"work directory: {work}", flush=True)
    try:
        # 1. certificates and SuperNode keys
        run([sys.executable, "-m", "fedcomp.simulations.certs", str(certs), "--nodes", str(args.supernodes)],
            dict(os.environ))

        # 2. the SuperLink: Fleet API for SuperNodes, Control API for the flwr CLI, both TLS
        fleet, control = free_port(), free_port()
        superlink = procs.start("superlink", [
            "flower-superlink",
            "--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.crt"),
            "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth",
            "--fleet-api-address", f"127.0.0.1:{fleet}", "--host", "127.0.0.1", "--port", str(control),
        ], flower_env(work / "superlink-home"))
        wait_port(control, superlink, "superlink", procs)
        wait_port(fleet, superlink, "superlink", procs)

        # the flwr CLI's connection to it (FLWR_HOME/config.toml)
        cli = flower_env(work / "cli-home")
        (work / "cli-home" / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "127.0.0.1:{control}"\nroot-certificates = "{certs / "ca.crt"}"\n')

        # 3. register each SuperNode's public key; 4. start the SuperNodes with their private keys
        for i in range(args.supernodes):
            run(["flwr", "supernode", "register", str(certs / "keys" / f"supernode-{i}.pub"), CONNECTION,
                 "--name", f"supernode-{i}"], cli)
        for i in range(args.supernodes):
            procs.start(f"supernode-{i}", [
                "flower-supernode", "--grpc-rere", "--superlink", f"127.0.0.1:{fleet}",
                "--root-certificates", str(certs / "ca.crt"),
                "--auth-supernode-private-key", str(certs / "keys" / f"supernode-{i}"),
                "--host", "127.0.0.1", "--port", str(free_port()),
                "--node-config", f"partition-id={i} num-partitions={args.supernodes}",
            ], flower_env(work / f"supernode-{i}-home"))
        deadline = time.monotonic() + 120
        while len(set(re.findall(r"Activated node_id=(\d+)", procs.log("superlink")))) < args.supernodes:
            if time.monotonic() > deadline:
                raise RuntimeError("the SuperNodes did not connect within 120 s:\n" + procs.log("superlink")[-3000:])
            time.sleep(0.5)

        # 5. the run
        cmd = ["flwr", "run", ".", CONNECTION, "--stream", "--run-config", f"num-server-rounds={args.rounds}"]
        print(f"$ {shlex.join(cmd)}", flush=True)
        done = subprocess.run(cmd, env=cli, cwd=APP, timeout=900, stdin=subprocess.DEVNULL)
        return done.returncode
    finally:
        procs.stop_all()


if __name__ == "__main__":
    raise SystemExit(main())
