"""Parser for codec spec strings: ``name(key=value, ...)`` stages joined by ``+``.

Examples: ``none()``, ``fp16``, ``topk(ratio=0.001)+qsgd(bits=4)``.
Values are numbers, booleans (``true``/``false``), or strings (quoted, or bare words).
Nothing is evaluated: the text is tokenized in one pass (ASCII outside quoted strings).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedcomp.errors import SpecError

Value = int | float | bool | str
MAX_SPEC_CHARS = 4096  # specs travel in every broadcast; a longer one is refused before tokenizing
MAX_NUMBER_CHARS = 64


@dataclass(frozen=True)
class Stage:
    """One stage of a spec: a codec name and its explicitly given arguments."""

    name: str
    args: tuple[tuple[str, Value], ...] = ()


_DIGITS = frozenset("0123456789")
_NAME_START = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
_NAME_REST = _NAME_START | _DIGITS | frozenset("-.")
_WORD = _NAME_START | _DIGITS  # a number must not run into one of these (nor into a '.')
_SPACE = frozenset(" \t\n\r\f\v")
_PUNCT = frozenset("()=,+")


class _Scanner:
    """A hand-written, single-pass tokenizer: ASCII only outside quoted strings.

    Every character is looked at a bounded number of times (``steps`` counts the looks; a test
    checks it stays linear in the text's length, where a backtracking regular expression was
    quadratic on a long run of digits). Tokens: numbers (``[-+]?(d+[.d*]|.d+)([eE][-+]?d+)?``,
    not followed by a letter, digit, ``_`` or ``.``), names (``[A-Za-z_][A-Za-z0-9_.-]*``),
    quoted strings and the punctuation ``( ) = , +``.
    """

    def __init__(self, text: str) -> None:
        self.text, self.n, self.steps = text, len(text), 0

    def _at(self, i: int) -> str:
        self.steps += 1
        return self.text[i] if i < self.n else ""

    def _run(self, i: int, allowed: frozenset) -> int:
        while (c := self._at(i)) and c in allowed:
            i += 1
        return i

    def _number(self, pos: int) -> int | None:
        """End of the number starting at ``pos``, or None when none starts there."""
        i = pos + 1 if self._at(pos) in ("+", "-") else pos
        j = self._run(i, _DIGITS)
        if self._at(j) == ".":
            k = self._run(j + 1, _DIGITS)
            if j == i and k == j + 1:  # "." without a digit on either side
                return None
            j = k
        elif j == i:
            return None
        if self._at(j) in ("e", "E"):
            k = j + 1 + (self._at(j + 1) in ("+", "-"))
            m = self._run(k, _DIGITS)
            if m > k:
                j = m
        c = self._at(j)
        return None if c and (c in _WORD or c == ".") else j

    def tokens(self) -> list[tuple[str, str]]:
        text, out, pos = self.text, [], 0
        while True:
            pos = self._run(pos, _SPACE)
            if pos >= self.n:
                return out
            c = self._at(pos)
            end = self._number(pos) if c in _DIGITS or c in "+-." else None
            if end is not None:
                kind = "number"
            elif c in _NAME_START:
                kind, end = "name", self._run(pos + 1, _NAME_REST)
            elif c in ("'", '"'):
                close = text.find(c, pos + 1)  # one linear scan (str.find)
                self.steps += (close if close >= 0 else self.n) - pos
                if close < 0:
                    raise SpecError(f"cannot parse codec spec {text[:60]!r} at position {pos}: unterminated string "
                                    f"{text[pos:pos + 12]!r}")
                kind, end = "string", close + 1
            elif c in _PUNCT:
                kind, end = "punct", pos + 1
            elif c.isdigit() and c not in _DIGITS:
                raise SpecError(f"codec spec {text[:60]!r} has the non-ASCII digit {c!r} at position {pos}; "
                                f"write numbers with the digits 0-9")
            else:
                raise SpecError(f"cannot parse codec spec {text[:60]!r} at position {pos}: {text[pos:pos + 12]!r}")
            out.append((kind, text[pos:end]))
            pos = end


def _tokens(text: str) -> list[tuple[str, str]]:
    return _Scanner(text).tokens()


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
