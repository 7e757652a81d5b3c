"""Parser for codec spec strings: ``name(key=value, ...)`` stages joined by ``+``.

Examples: ``none()``, ``fp16``, ``topk(ratio=0.001)+qsgd(bits=4)``.
Values are numbers, booleans (``true``/``false``), or strings (quoted, or bare words).
Nothing is evaluated: the text is tokenized by a regular expression.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fedcomp.errors import SpecError

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<number>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![\w.])
      | (?P<name>[A-Za-z_][\w\-.]*)
      | (?P<string>'[^']*'|"[^"]*")
      | (?P<punct>[()=,+])
    )""",
    re.VERBOSE,
)

Value = int | float | bool | str
MAX_SPEC_CHARS = 4096  # specs travel in every broadcast; a longer one is refused before tokenizing
MAX_NUMBER_CHARS = 64


@dataclass(frozen=True)
class Stage:
    """One stage of a spec: a codec name and its explicitly given arguments."""

    name: str
    args: tuple[tuple[str, Value], ...] = ()


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise SpecError(f"cannot parse codec spec {text!r} at position {pos}: {text[pos:pos + 12]!r}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def _value(kind: str, raw: str) -> Value:
    if kind == "number":
        if len(raw) > MAX_NUMBER_CHARS:  # int() of thousands of digits raises a plain ValueError
            raise SpecError(f"number {raw[:20]}... in a codec spec has {len(raw)} characters; at most {MAX_NUMBER_CHARS}")
        return float(raw) if any(c in raw for c in ".eE") else int(raw)
    if kind == "string":
        return raw[1:-1]
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    return raw


def parse_spec(text: str) -> list[Stage]:
    """Parse a spec string into its stages, in order.

    Raises
    ------
    SpecError
        On any syntax error, with the position and the offending text.
    """
    if not isinstance(text, str) or not text.strip():
        raise SpecError(f"codec spec must be a non-empty string such as 'topk(ratio=0.01)+qsgd(bits=4)', got {text!r}")
    if len(text) > MAX_SPEC_CHARS:
        raise SpecError(f"codec spec of {len(text)} characters is longer than the {MAX_SPEC_CHARS} allowed")
    toks = _tokens(text)
    stages: list[Stage] = []
    i = 0

    def expect(*kinds_or_values: str) -> tuple[str, str]:
        nonlocal i
        if i >= len(toks):
            raise SpecError(f"codec spec {text!r} ends early; expected {' or '.join(kinds_or_values)}")
        tok = toks[i]
        if tok[0] not in kinds_or_values and tok[1] not in kinds_or_values:
            raise SpecError(f"codec spec {text!r}: expected {' or '.join(kinds_or_values)}, got {tok[1]!r}")
        i += 1
        return tok

    while True:
        _, name = expect("name")
        args: dict[str, Value] = {}
        if i < len(toks) and toks[i][1] == "(":
            i += 1
            if toks[i:i + 1] and toks[i][1] == ")":
                i += 1
            else:
                while True:
                    _, key = expect("name")
                    expect("=")
                    kind, raw = expect("number", "name", "string")
                    if key in args:
                        raise SpecError(f"codec spec {text!r}: argument {key!r} of {name}() given twice")
                    args[key] = _value(kind, raw)
                    if expect(",", ")")[1] == ")":
                        break
        stages.append(Stage(name.lower(), tuple(args.items())))
        if i == len(toks):
            return stages
        expect("+")
