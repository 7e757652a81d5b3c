"""Flower's quickstart-pytorch app (tests/apps/quickstart_pytorch: its CNN, train loop and FedAvg,
offline data) with the README's two additions, through `flwr run`, fedcomp's defaults: every
node every round, and a fraction of the nodes per round. No reply may fail or be dropped.

Its CNN has tensors of 450, 6, 2,400, 16, 48,000, 120, 10,080, 84, 840 and 10 elements: the
default upload codec once raised IndexError on 5% of its encodes (sizes not multiples of 16)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from test_flower import superlink  # noqa: F401  (the SuperLink fixture, stopped by PID)

APP = Path(__file__).resolve().parent / "apps" / "quickstart_pytorch"

pytestmark = pytest.mark.slow


def _run(env: dict, nodes: int, config: str) -> str:
    subprocess.run(["flwr", "federation", "simulation-config", "--num-supernodes", str(nodes)],
                   env=env, check=True, capture_output=True, timeout=60)
    done = subprocess.run(["flwr", "run", str(APP), "--stream", "--run-config", config],
                          env=env, capture_output=True, text=True, timeout=500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


def _check(out: str, rounds: int, per_round: int) -> None:
    sampled = [int(n) for n in re.findall(r"configure_train: Sampled (\d+) nodes", out)]
    assert sampled == [per_round] * rounds, out[-4000:]
    # the streaming path logs its count; the sketch path (a fraction per round) does not
    aggregated = [int(n) for n in re.findall(r"fedcomp: round \d+ aggregated (\d+) replies", out)]
    assert aggregated in ([], sampled), out[-4000:]
    assert len(re.findall(r"Aggregated MetricRecord: \{'train_loss'", out)) == rounds, out[-4000:]
    for bad in ("dropping reply", "Traceback", "Exit Code", "error reply"):
        assert bad not in out, out[-4000:]
    failures = [int(n) for n in re.findall(r"Received \d+ results and (\d+) failures", out)]
    assert failures and not any(failures), out[-4000:]
    assert "final model: 62006 parameters" in out, out[-3000:]


def test_quickstart_every_node_every_round(superlink):  # noqa: F811
    out = _run(superlink, 10, "num-server-rounds=3")
    _check(out, rounds=3, per_round=10)


def test_quickstart_a_fraction_per_round(superlink):  # noqa: F811
    out = _run(superlink, 20, "num-server-rounds=4 fraction-train=0.1 fraction-evaluate=0.1")
    _check(out, rounds=4, per_round=2)
