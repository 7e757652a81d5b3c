"""The apps under examples/ run as a user runs them: `flwr run examples/<app>` for a few rounds.

Each test starts its own SuperLink (own ports, own FLWR_HOME) and stops it by PID, as
tests/test_flower.py does. The deployment example starts its own SuperLink and SuperNodes
(run_local.py) and stops them itself.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.slow

# The commands the README and the examples' READMEs show, run here as written (in the app's folder);
# tests/test_readme.py checks that every command of the README is run here, in .ci/run or by itself.
RUNS = {
    "quickstart": ("flwr federation simulation-config --num-supernodes 3",
                   'flwr run . --stream --run-config "num-server-rounds=4"'),
    "cross-device": ("flwr federation simulation-config --num-supernodes 10",
                     'flwr run . --stream --run-config "num-server-rounds=10"'),
}
DEPLOYMENT = "python run_local.py --supernodes 2 --rounds 3"
COMMANDS = [*(c for pair in RUNS.values() for c in pair), DEPLOYMENT, *(f"cd examples/{app}" for app in [*RUNS, "deployment"])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process started in its own session, with everything it spawned (its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


@pytest.fixture
def simulation_superlink(tmp_path):
    """A local simulation SuperLink; yields a function setting its number of SuperNodes and the env."""
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "examples"\n\n[superlink.examples]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    with open(home / "superlink.log", "wb") as log:
        proc = subprocess.Popen(
            ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
             "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"flower-superlink exited: {(home / 'superlink.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("flower-superlink did not answer within 60 s")
            time.sleep(0.5)

        def nodes(command: str) -> dict:
            subprocess.run(shlex.split(command), env=env, check=True, capture_output=True, timeout=60)
            return env
        yield nodes
    finally:
        _stop(proc)


def _flwr_run(env: dict, app: Path, command: str) -> str:
    done = subprocess.run(shlex.split(command), cwd=app, env=env, capture_output=True, text=True, timeout=400)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


def _summary(out: str, name: str) -> tuple[float, float]:
    """(accuracy, upload compression) from the app's last line."""
    m = re.search(rf"fedcomp {name}: accuracy ([0-9.]+) after \d+ rounds \| upload [0-9,]+ B \(([0-9.]+)x.*", out)
    assert m, out[-4000:]
    print(m.group(0))  # shown with pytest -s
    return float(m.group(1)), float(m.group(2))


def test_quickstart(simulation_superlink):
    nodes, run = RUNS["quickstart"]
    env = simulation_superlink(nodes)
    accuracy, ratio = _summary(_flwr_run(env, EXAMPLES / "quickstart", run), "quickstart")
    assert accuracy > 0.5 and ratio > 20, (accuracy, ratio)


def test_cross_device(simulation_superlink):
    nodes, run = RUNS["cross-device"]
    env = simulation_superlink(nodes)
    out = _flwr_run(env, EXAMPLES / "cross-device", run)
    accuracy, ratio = _summary(out, "cross-device")
    assert ratio > 20, ratio
    assert accuracy > 0.15, accuracy  # it learns (chance: 0.1); 10 rounds of 2 nodes
    # the seeded start holds: every broadcast is a chain, no node asked for a resync
    m = re.search(r"broadcasts: (\d+) chains, (\d+) full models \| resyncs: (\d+)", out)
    assert m and int(m.group(1)) > 0 and m.group(2) == "0" and m.group(3) == "0", out[-3000:]


def test_deployment_over_tls_with_node_auth(tmp_path):
    """run_local.py: certificates, a TLS SuperLink with SuperNode auth, registered SuperNodes,
    `flwr run`, and everything it started stopped again."""
    state_dir = tmp_path / "node-state"  # where a user's nodes would keep theirs: ~/.cache/fedcomp/client-state
    env = dict(os.environ, FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", FEDCOMP_STATE_DIR=str(state_dir))
    cmd = [sys.executable, *shlex.split(DEPLOYMENT)[1:], "--workdir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=EXAMPLES / "deployment", env=env,
                          capture_output=True, text=True, timeout=500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    accuracy, ratio = _summary(out, "deployment")
    assert accuracy > 0.2 and ratio > 20, (accuracy, ratio)
    assert "--enable-supernode-auth" in out and "flwr supernode register" in out
    pids = [int(p) for p in re.findall(r"stopped \S+ \(pid (\d+)\)", out)]
    assert len(pids) == 3 and not any(Path(f"/proc/{p}").exists() for p in pids), out[-2000:]
    assert len(list(state_dir.glob("run-*/node-*.pt"))) == 2  # each node's state in its file, not its Context
