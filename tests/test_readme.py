"""README.md as the front door: short, every command in it run somewhere, every snippet true.

- the Quick start's first two fenced blocks are the main job and the tests, as `.ci/run` runs them;
- every shell command is run by `.ci/run`, by tests/test_examples.py (``COMMANDS``) or here;
- every complete Python snippet runs; an excerpt (first line ``# <path> (excerpt)``) is made of
  lines of that file, so it cannot drift from the example it quotes;
- every codec spec parses, the regime table states the defaults ``strategies/config.py`` holds,
  and relative links point at files that exist;
- docs/reference/run-config.md lists pyproject's run config keys with their defaults.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import fedcomp

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


def blocks(text: str, lang: str | None = None) -> list[str]:
    return [body for kind, body in FENCE.findall(text) if lang is None or kind == lang]


def commands(block: str) -> list[str]:
    """The block's command lines: comments and blank lines dropped, trailing comments cut."""
    out = []
    for line in block.splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def test_readme_is_short():
    assert len(README.splitlines()) < 400


def test_quick_start_blocks_are_the_main_job_and_the_tests():
    section = README.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    first, second = FENCE.findall(section)[:2]
    assert first[0] == second[0] == "bash"
    main_job, tests = first[1].strip(), second[1].strip()
    assert main_job.startswith("export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 && ")
    assert main_job.endswith("flwr run . --stream")
    assert tests == 'pip install -c constraints.txt -e ".[dev]" && python -m pytest -q'
    ci = (ROOT / ".ci" / "run").read_text()
    assert main_job in ci and tests in ci
    assert "set -euo pipefail" in ci and "mkdocs build --strict" in ci


def test_every_command_is_run_by_ci_or_a_test():
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from test_examples import COMMANDS
    finally:
        sys.path.remove(str(ROOT / "tests"))
    ci = (ROOT / ".ci" / "run").read_text()
    missing = []
    for block in blocks(README, "bash"):
        for line in commands(block):
            if not (line in ci or line in COMMANDS):
                missing.append(line)
    assert not missing, f"README commands no test or CI runs: {missing}"
    for line in COMMANDS:
        if line.startswith("cd "):
            assert (ROOT / line[3:]).is_dir(), line


def _snippets() -> list[str]:
    return [b for b in blocks(README, "python") if not b.lstrip().startswith("# ") or "(excerpt)" not in b.split("\n")[0]]


def _excerpts() -> list[tuple[str, str]]:
    out = []
    for b in blocks(README, "python"):
        first = b.split("\n", 1)[0]
        m = re.fullmatch(r"# (\S+) \(excerpt\)", first.strip())
        if m:
            out.append((m.group(1), b.split("\n", 1)[1]))
    return out


@pytest.mark.parametrize("snippet", _snippets(), ids=lambda s: s.strip().split("\n")[0][:40])
def test_python_snippet_runs(snippet):
    done = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_there_are_excerpts_and_snippets():
    assert len(_excerpts()) >= 4 and len(_snippets()) >= 1


@pytest.mark.parametrize("path, excerpt", _excerpts(), ids=[p for p, _ in _excerpts()])
def test_excerpt_matches_its_file(path, excerpt):
    source = {line.strip() for line in (ROOT / path).read_text().splitlines()}
    for line in excerpt.splitlines():
        if line.strip():
            assert line.strip() in source, f"{path} has no line {line.strip()!r}"


def _specs() -> list[str]:
    """Backticked codec specs in the README's tables (``ceil(0.068 n)`` is a formula, not a value)."""
    specs = set()
    table = "\n".join(line for line in README.splitlines() if line.startswith("| "))
    for cell in re.findall(r"`([^`\n]+)`", table):
        if re.fullmatch(r"[a-z0-9]+\([^|;]*\)(\+[a-z0-9]+\([^|;]*\))?", cell):
            specs.add(cell.replace("ceil(0.068 n)", "1000"))
    return sorted(specs)


@pytest.mark.parametrize("spec", _specs())
def test_spec_parses(spec):
    codec = fedcomp.build_codec(spec)
    assert codec.spec


def test_codec_table_names_every_registered_codec():
    table = "\n".join(line for line in README.splitlines() if line.startswith("| `"))
    missing = [name for name in fedcomp.available_codecs() if f"`{name}(" not in table and f"+{name}(" not in table]
    assert not missing, f"the README's codec table lacks {missing}"


def test_regime_table_states_the_code_defaults():
    from fedcomp.strategies import config

    rows = {line.split("|")[1].strip(): line for line in README.splitlines() if line.startswith("| ")}
    silo = rows["every node every round (cross-silo)"]
    assert f"`{config.SILO_UPLOAD}`" in silo
    assert config.silo_download(10) == "topk(ratio=0.2)+kbit(bits=4,stochastic=true)"
    assert "`topk(ratio=0.2)+kbit(bits=4,stochastic=true)` with 10 nodes" in silo and f"`{config.SILO_DOWNLOAD}`" in silo
    xdev = rows["a fraction of the nodes per round (cross-device)"]
    assert f"cols=ceil({config.SKETCH_COLS_PER_PARAM} n),ratio={config.SKETCH_RATIO}" in xdev
    assert "`cells(cols=ceil(0.068 n))+kbit(bits=4,stochastic=true)`" in xdev
    assert config.coupled_download(config.SKETCH_RATIO, fedcomp.build_codec("sketch(rows=1,cols=9)").reducer) == \
        "cells(cols=9,seed=0)+kbit(bits=4,stochastic=true)"
    assert f"server momentum {config.SKETCH_SERVER_MOMENTUM}" in xdev
    assert "statistics exact" in rows["cross-device, model with BatchNorm statistics"]
    robust = rows["FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan (any regime)"]
    assert f"ratio={config.ROBUST_SKETCH_RATIO})+qsgd(bits=4)" in robust
    assert f"momentum {config.ROBUST_SERVER_MOMENTUM}" in robust
    assert "`cells(cols=ceil(0.068 n))+kbit(bits=4,stochastic=true)`" in robust
    assert f"`{config.DENSE_UPLOAD}`" in rows["QFedAvg, subclasses of the server optimizers (any regime)"]
    assert "server momentum 0" in rows["FedAdam, FedAdagrad, FedYogi (Flower's own)"]


def test_relative_links_exist():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_run_config_reference_matches_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    page = (ROOT / "docs" / "reference" / "run-config.md").read_text()
    rows = re.findall(r"^\| `([a-z-]+)` \| `([^`]*)` \|", page, re.M)
    assert [k for k, _ in rows] == list(config), "docs/reference/run-config.md: keys differ from pyproject"
    for key, default in rows:
        assert tomllib.loads(f"v = {default}")["v"] == config[key], key
