"""Parsing what arrives off the wire: codec specs and layout descriptions, old way vs fedcomp's.

Side by side in one process (so the ratio holds on a busy machine), best of ``--repeat`` runs:

* spec tokenizer, on a 4 kB spec of real stages and on a 4 kB run of digits: the previous
  backtracking regular expression (kept below as the reference) vs ``fedcomp.spec._Scanner``;
* ``Layout.from_json`` of 50,000 entries: the previous loop (frozen-dataclass entries, the cyclic
  collector running) vs fedcomp's, and its fingerprint over 10 decodes (recomputed each time
  before; once per layout now).

    python -m fedcomp.simulations.bench_parse
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass

from fedcomp.layout import Layout, TensorSpec
from fedcomp.spec import _Scanner

# -- the references: the previous implementations, verbatim in what matters -------------------------
_OLD_TOKEN = re.compile(
    r"""\s*(?:
        (?P<number>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![\w.])
      | (?P<name>[A-Za-z_][\w\-.]*)
      | (?P<string>'[^']*'|"[^"]*")
      | (?P<punct>[()=,+])
    )""",
    re.VERBOSE,
)


def old_tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _OLD_TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            return out  # the old code raised here
        out.append((m.lastgroup, m.group(m.lastgroup)))
        pos = m.end()
    return out


@dataclass(frozen=True)
class _OldSpec:
    name: str
    shape: tuple
    dtype: str


def old_from_json(text: str) -> tuple:
    specs, names, total = [], set(), 0
    for name, shape, dtype in json.loads(text):
        if not isinstance(name, str) or name in names or not isinstance(shape, list):
            raise ValueError(name)
        if not all(type(s) is int and 0 <= s for s in shape):
            raise ValueError(shape)
        names.add(name)
        total += math.prod(shape)
        specs.append(_OldSpec(name, tuple(shape), dtype))
    return tuple(specs)


def old_fingerprint(specs: tuple) -> bytes:
    text = json.dumps([[t.name, list(t.shape), t.dtype] for t in specs], separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--entries", type=int, default=50_000)
    args = parser.parse_args(argv)
    spec = ("topk(ratio=0.01,index='fixed')+qsgd(bits=4)+" * 90)[:4000] + "none"
    digits = "1" * 4095 + "a"
    print(f"{'what':44s} {'before':>10s} {'now':>10s} {'ratio':>8s}")
    for label, text in (("tokenize a 4 kB spec of stages", spec), ("tokenize a 4 kB run of digits", digits)):
        old = best(lambda: old_tokens(text), args.repeat)
        new = best(lambda: _Scanner(text).tokens() if text is spec else _try(text), args.repeat)
        print(f"{label:44s} {old * 1e3:8.2f}ms {new * 1e3:8.2f}ms {old / new:7.1f}x")
    layout = Layout(tuple(TensorSpec(f"layer{i}.weight", (3, i % 7 + 1), "float32") for i in range(args.entries)))
    text = layout.to_json()
    gc.collect()
    old = best(lambda: old_from_json(text), args.repeat)
    new = best(lambda: Layout.from_json(text), args.repeat)
    print(f"{f'Layout.from_json, {args.entries} entries':44s} {old * 1e3:8.1f}ms {new * 1e3:8.1f}ms {old / new:7.1f}x")
    floor = best(lambda: json.loads(text), args.repeat)
    print(f"{'  (json.loads of the same text alone)':44s} {'':10s} {floor * 1e3:8.1f}ms")
    specs, parsed = old_from_json(text), Layout.from_json(text)
    old = best(lambda: [old_fingerprint(specs) for _ in range(10)], 1)
    new = best(lambda: [parsed.fingerprint() for _ in range(10)], 1)
    print(f"{'fingerprint for 10 decodes':44s} {old * 1e3:8.1f}ms {new * 1e3:8.3f}ms {old / new:7.0f}x")


def _try(text: str) -> None:
    try:
        _Scanner(text).tokens()
    except ValueError:
        pass


if __name__ == "__main__":
    main()
