"""Layer-wise policies and schedules: different codecs for different tensors and rounds.

A policy spec is a list of rules separated by ``;``, tried in order; each tensor uses the first
rule whose condition holds, and the last rule may have no condition (the default)::

    numel<10000: fp16(); topk(ratio=0.01)+qsgd(bits=4)           small tensors dense fp16
    name~*bias: none(); topk(ratio=0.01)                          by name (shell-style glob)
    round<5: kbit(bits=8); topk(ratio=0.01)+qsgd(bits=4)          warm-up schedule
    round<10: topk(ratio=0.05); round<30: topk(ratio=0.02); topk(ratio=0.01)   ratio rising with rounds

Conditions: ``numel<N``, ``numel>=N``, ``name~GLOB``, ``round<R``, ``round>=R``; join several
with ``&``. Tensors that pick the same rule are encoded together by that rule's codec; the
payload holds one sub-payload per rule used. Decoding needs the round the payload was encoded
for (``Codec.decode(..., round=r)``), since the grouping depends on it.
"""

from __future__ import annotations

import fnmatch
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedcomp.codec import Codec, Encoded, check_decodable
from fedcomp.errors import DecodeError, SpecError
from fedcomp.layout import Layout, TensorSpec
from fedcomp.spec import MAX_SPEC_CHARS
from fedcomp.wire import OVERHEAD_BYTES, Writer, open_payload

_COND = re.compile(r"^\s*(numel|name|round)\s*(<|>=|~)\s*(\S+)\s*$")


@dataclass(frozen=True)
class Condition:
    field: str  # "numel", "name" or "round"
    op: str  # "<", ">=" or "~"
    value: str | int

    def holds(self, tensor: TensorSpec, round: int) -> bool:
        if self.field == "name":
            return fnmatch.fnmatchcase(tensor.name, str(self.value))
        actual = tensor.numel if self.field == "numel" else round
        return actual < self.value if self.op == "<" else actual >= self.value  # type: ignore[operator]


def _condition(text: str, spec: str) -> Condition:
    m = _COND.match(text)
    if m is None:
        raise SpecError(
            f"policy {spec!r}: cannot read condition {text.strip()!r}; use numel<N, numel>=N, name~GLOB, "
            f"round<R or round>=R, joined with &"
        )
    field, op, value = m.groups()
    if field == "name":
        if op != "~":
            raise SpecError(f"policy {spec!r}: names match with ~ (a glob), got {text.strip()!r}")
        return Condition(field, op, value)
    if op == "~" or not (value.isascii() and value.isdigit() and len(value) <= 20):  # no '²', no 5000 digits
        raise SpecError(f"policy {spec!r}: {field} takes < or >= and a non-negative integer, got {text.strip()!r}")
    return Condition(field, op, int(value))


def is_policy(spec: str) -> bool:
    return isinstance(spec, str) and (";" in spec or re.match(r"^\s*(numel|name|round)\s*(<|>=|~)", spec) is not None)


class PolicyCodec:
    """A codec per rule; behaves like :class:`fedcomp.Codec` (encode, decode, sizes, traits)."""

    def __init__(self, spec: str) -> None:
        if len(spec) > 4 * MAX_SPEC_CHARS:
            raise SpecError(f"policy of {len(spec)} characters is longer than the {4 * MAX_SPEC_CHARS} allowed")
        self.rules: list[tuple[tuple[Condition, ...], Codec]] = []
        parts = [p for p in spec.split(";") if p.strip()]
        if not parts:
            raise SpecError(f"policy {spec!r} has no rules")
        for i, part in enumerate(parts):
            head, sep, body = part.partition(":")
            if not sep:
                if i != len(parts) - 1:
                    raise SpecError(f"policy {spec!r}: only the last rule may have no condition ({part.strip()!r})")
                self.rules.append(((), Codec(part)))
                continue
            conditions = tuple(_condition(c, spec) for c in head.split("&"))
            self.rules.append((conditions, Codec(body)))
        if self.rules[-1][0]:
            raise SpecError(f"policy {spec!r}: the last rule must have no condition (the default codec)")
        if len(self.rules) > 255:
            raise SpecError(f"policy {spec!r} has {len(self.rules)} rules; at most 255")
        self.spec = "; ".join(
            (" & ".join(f"{c.field}{c.op}{c.value}" for c in conds) + ": " if conds else "") + codec.spec
            for conds, codec in self.rules
        )
        self.fingerprint = zlib.crc32(self.spec.encode())
        self.reducer = None  # error feedback is plain update + residual for every rule

    # -- traits ------------------------------------------------------------------------------
    @property
    def lossless(self) -> bool:
        return all(codec.lossless for _, codec in self.rules)

    @property
    def unbiased(self) -> bool:
        return all(codec.unbiased for _, codec in self.rules)

    @property
    def needs_error_feedback(self) -> bool:
        return not self.unbiased

    @property
    def takes_error_feedback(self) -> bool:
        return any(codec.takes_error_feedback for _, codec in self.rules)

    def without_feedback(self, layout: Layout, round: int) -> list[str]:
        """Tensors whose rule's codec takes no error feedback (rescaled random-k): no residual kept."""
        return [n for i, sub in self.groups(layout, round) if not self.rules[i][1].takes_error_feedback
                for n in sub.names]

    linear = False

    def __repr__(self) -> str:
        return f"PolicyCodec({self.spec!r})"

    # -- grouping ----------------------------------------------------------------------------
    def groups(self, layout: Layout, round: int) -> list[tuple[int, Layout]]:
        """(rule index, sub-layout) for each rule used this round, in rule order."""
        chosen: dict[int, list[TensorSpec]] = {}
        for t in layout.tensors:
            rule = next(i for i, (conds, _) in enumerate(self.rules) if all(c.holds(t, round) for c in conds))
            chosen.setdefault(rule, []).append(t)
        return [(i, Layout(tuple(chosen[i]))) for i in sorted(chosen)]

    def size_bytes(self, layout: Layout, kept=None, index_bytes=None, *, round: int = 0) -> int:
        """Exact size where every rule's codec has a data-independent size."""
        return OVERHEAD_BYTES + sum(
            5 + self.rules[i][1].size_bytes(sub) for i, sub in self.groups(layout, round)
        )

    # -- encode / decode ------------------------------------------------------------------------
    def encode(self, tensors: Mapping[str, torch.Tensor], nonce: int = 0, *, round: int = 0,
               state: dict[str, torch.Tensor] | None = None):
        layout = Layout.of(tensors)
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        out = Writer(device)
        decoded: dict[str, torch.Tensor] = {}
        kept, side = [], []
        for i, sub in self.groups(layout, round):
            enc = self.rules[i][1].encode({n: tensors[n] for n in sub.names}, nonce + i, round=round, state=state)
            out.u8(i)
            out.u32(len(enc.payload))
            out.raw(enc.payload)
            decoded.update(enc.decoded)
            kept += enc.kept
            side += enc.index_bytes
        payload = out.getvalue(layout.fingerprint(), self.fingerprint, nonce)
        return Encoded(payload, {n: decoded[n] for n in layout.names}, tuple(kept), tuple(side))

    def decode(self, payload: bytes, layout: Layout, device: torch.device | str = "cpu", *, round: int = 0):
        check_decodable(layout)
        src, nonce = open_payload(payload, layout.fingerprint(), self.fingerprint)
        out: dict[str, torch.Tensor] = {}
        for i, sub in self.groups(layout, round):
            rule = src.u8()
            if rule != i:
                raise DecodeError(f"policy payload holds rule {rule} where round {round} expects rule {i}")
            body = src.take(src.u32()).numpy().tobytes()
            out.update(self.rules[i][1].decode(body, sub, device, round=round))
        src.finish()
        return {n: out[n] for n in layout.names}


def build_codec(spec: str) -> Codec | PolicyCodec:
    """Build a codec from a spec string (see :class:`fedcomp.Codec`), or a policy of rules
    separated by ``;`` (see this module)."""
    return PolicyCodec(spec) if is_policy(spec) else Codec(spec)
