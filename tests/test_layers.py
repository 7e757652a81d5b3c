"""The layers and installed names: fedcomp (core, no Flower) <- fedcomp.clients, fedcomp.strategies
(Flower glue, never each other) <- fedcomp.simulations; no import cycle; a user's own clients.py,
strategies.py or simulations.py cannot shadow fedcomp's."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"fedcomp": "fedcomp", "clients": "fedcomp.clients", "strategies": "fedcomp.strategies",
           "simulations": "fedcomp.simulations"}
LAYER = {"fedcomp": 0, "fedcomp.clients": 1, "fedcomp.strategies": 1, "fedcomp.simulations": 2}


def _package(module: str) -> str:
    """The layer package a dotted module name belongs to (fedcomp.clients.mod -> fedcomp.clients)."""
    parts = module.split(".")
    if parts[0] != "fedcomp":
        return ""
    return ".".join(parts[:2]) if len(parts) > 1 and ".".join(parts[:2]) in LAYER else "fedcomp"


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):  # subpackages too (fedcomp.codecs, ...)
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (never imported at run time)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(module: str, path: Path) -> set[str]:
    """Every fedcomp module ``module`` imports, at module level or inside functions."""
    found = set()
    modules = _modules()
    is_package = path.stem == "__init__"
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from package import submodule` imports the submodule; `from module import name` the module
            for a in node.names:
                found.add(f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix)
    modules = _modules()
    return {m for m in found if m in modules and m != module}


def test_sources_use_installed_names():
    """No module imports the bare folder names (clients, strategies, simulations)."""
    offenders = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{module}: {n}" for n in names if n.split(".")[0] in ("clients", "strategies", "simulations")]
    assert not offenders, offenders


def test_no_upward_or_sideways_import():
    bad = []
    for module, path in _modules().items():
        src = _package(module)
        for target in _imports(module, path):
            dst = _package(target)
            if LAYER[dst] > LAYER[src] or (LAYER[dst] == LAYER[src] and dst != src):
                bad.append(f"{module} -> {target}")
    assert not bad, "imports against the layers: " + ", ".join(bad)


def test_core_imports_no_flower_in_source():
    bad = [f"{m}: {n}" for m, p in _modules().items() if _package(m) == "fedcomp"
           for n in ast.walk(ast.parse(p.read_text()))
           if isinstance(n, (ast.Import, ast.ImportFrom))
           and any(x.split(".")[0] == "flwr" for x in ([a.name for a in n.names] if isinstance(n, ast.Import)
                                                        else [n.module or ""]))]
    assert not bad, bad


def test_no_import_cycle():
    modules = _modules()
    graph = {m: {t for t in _imports(m, p) if not (t == _package(m) and t != m and m.startswith(t))}
             for m, p in modules.items()}
    # a package's __init__ re-exporting its own submodules is not a cycle of the layers
    for m in graph:
        graph[m] = {t for t in graph[m] if not (m in LAYER and t.startswith(m + "."))}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if not state.get(t):
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if not state.get(m):
            visit(m)


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_import_fedcomp_imports_no_flower(tmp_path):
    done = _run("""
        import sys, fedcomp
        fedcomp.build_codec("topk(ratio=0.1)+qsgd(bits=4)")
        print(sorted(m for m in sys.modules if m.split(".")[0] == "flwr"))
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("shadow", ["clients", "strategies", "simulations"])
def test_user_module_does_not_shadow(tmp_path, shadow):
    """A user's app with its own clients.py / strategies.py / simulations.py next to it still gets
    fedcomp's mod and wrapper, and its own module stays its own."""
    (tmp_path / f"{shadow}.py").write_text("USER = True\n")
    done = _run(f"""
        import {shadow}
        assert {shadow}.USER and {shadow}.__file__.startswith({str(tmp_path)!r}), {shadow}.__file__
        from fedcomp.clients import compression_mod
        from fedcomp.strategies import CompressedStrategy
        from fedcomp.simulations import task
        import {shadow} as again
        assert again.USER
        print("ok", compression_mod.__module__, CompressedStrategy.__module__)
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", "fedcomp.clients.mod", "fedcomp.strategies.wrapper"]
