"""Compressed broadcasts with server-side error feedback, in tiers, with catch-up for stale clients.

The server never sends the dense model after a client's first contact. For each download tier
``t`` it keeps the reference model ``R_t`` that the tier's clients hold, bit for bit, and each
round it encodes the difference to the global model ``G`` once for the whole tier::

    c_t = encode_t(G - R_t);    R_t <- R_t + decode_t(c_t)           (server, once per tier)
                                X   <- X   + decode_t(c_t)           (every client of tier t)

What ``encode_t`` drops stays in ``G - R_t`` and is sent in later rounds (error feedback on the
downlink, as in DoubleSqueeze and EF21-P): when ``G`` stops moving, ``R_t`` converges to it.
Each step of ``R_t`` is one entry of the tier's history ``(round, payload, crc)``, where ``crc``
is the CRC32 of ``R_t``'s bytes after the step. A client reports the tier, version (round) and
CRC of the reference it holds; the server sends it

* ``chain``: the history entries after its version (one entry when it took part last round,
  several after missed rounds: catch-up by replaying exactly what the tier's clients applied), or
* ``full``: ``R_t`` itself, exact, on first contact (unless the run uses the seeded round-0
  model, below), after a tier change, when the chain would cost more than the full model (or the
  client is staler than an optional ``max_stale``), or when the client asked for a resync.

History is bounded by bytes, not rounds: steps are kept while their total is below the full
model's bytes (an older step could only be part of a chain that costs more than the full model,
which is never sent), so a tier's memory is its reference plus at most one model's bytes.

Seeded first contact: every node can build the round-0 model from the run's seed (the project's
ClientApp does). A server that knows it (``seeded`` in :meth:`Tier.plan`) treats a node it has
never heard from as holding version 0 with the initial model's CRC (:attr:`Tier.initial_crc`),
so first contact is the chain since round 0 while it costs less than the full model.

Coupled steps (:meth:`Tier.append`): with server-side error feedback
(:meth:`fedcomp.server_feedback.ServerFeedback.step_broadcast`) the server moves the global model
by exactly the decoded broadcast payload, which then is the tier's step as is: the reference is
the global model itself and nothing is encoded twice.

Both sides apply a step with the same CPU operations, so references stay equal bit for bit; the
client checks the CRC before (``base_crc``) and after, and asks for a full resync on any
mismatch instead of training on a model the server does not know.

Tiers are independent (one reference and one error-feedback loop each). A shared base layer
with per-tier refinements would save server encode time but couples the tiers' references; with
a handful of tiers one encode per tier per round is cheap (see :class:`Tier`).
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedcomp.codec import Codec, derive_nonce
from fedcomp.errors import FedcompError, SpecError
from fedcomp.layout import Layout
from fedcomp.policy import build_codec
from fedcomp.steps import apply_step, model_step  # noqa: F401  (re-exported: the one way to apply a step)
from fedcomp.wire import OVERHEAD_BYTES, Writer, crc32, open_payload

FULL_FINGERPRINT = zlib.crc32(b"fedcomp.broadcast.full")  # the codec field of full-reference payloads


def encode_full(reference: Mapping[str, torch.Tensor]) -> bytes:
    """The reference as raw bytes, exact for every dtype (fp64 and integers included)."""
    out = Writer()
    for t in reference.values():
        out.tensor(t.detach().cpu())
    return out.getvalue(Layout.of(reference).fingerprint(), FULL_FINGERPRINT, 0)


def decode_full(payload: bytes, layout: Layout) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_full`; DecodeError for anything that is not one for ``layout``."""
    src, _ = open_payload(payload, layout.fingerprint(), FULL_FINGERPRINT)
    out = {t.name: src.tensor(t.numel, t.torch_dtype).view(t.shape) for t in layout.tensors}
    src.finish()
    return out


def full_nbytes(layout: Layout) -> int:
    return OVERHEAD_BYTES + sum(t.numel * t.torch_dtype.itemsize for t in layout.tensors)


def reference_crc(tensors: Mapping[str, torch.Tensor]) -> int:
    """CRC32 of the tensors' bytes, in order: equal references have equal CRCs (zlib's CRC, by
    ISA-L where installed: ~4x faster, 1.6 read passes of a 25M model against 6.5)."""
    crc = 0
    for t in tensors.values():
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        crc = crc32(data, crc)
    return crc


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32, or float64 for float64 tensors


def parse_tiers(spec: str) -> list[str]:
    """Split a download spec into tier specs: ``"topk(ratio=0.01)+twobit() | kbit(bits=8)"``.

    Tier 0 is the first (meant for the slowest links). A spec without ``|`` is one tier.
    """
    parts = [p.strip() for p in spec.split("|")]
    if any(not p for p in parts):
        raise SpecError(f"download spec {spec!r} has an empty tier; separate codec specs with '|'")
    for p in parts:
        build_codec(p)  # fails here on a bad spec
    return parts


def parse_thresholds(text: str, tiers: int) -> tuple[float, ...]:
    """Downlink kbps thresholds between tiers: ``"1000,8000"`` for 3 tiers (ascending)."""
    if not text.strip():
        return ()
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise SpecError(f"download tier thresholds {text!r} are invalid: give comma-separated kbps numbers") from None
    if len(values) != tiers - 1 or any(b <= a for a, b in zip(values, values[1:])) or any(v <= 0 for v in values):
        raise SpecError(
            f"download tier thresholds {text!r} are invalid: {tiers} tiers need {tiers - 1} ascending positive kbps values"
        )
    return values


def tier_for_kbps(kbps: float, thresholds: tuple[float, ...]) -> int:
    """Tier of a client with ``kbps`` of downlink: slower than thresholds[0] -> tier 0, and so on."""
    return sum(1 for t in thresholds if kbps >= t)


@dataclass(frozen=True)
class Step:
    """One entry of a tier's history: the payload that moved the reference to ``round``."""

    round: int
    payload: bytes
    crc: int  # CRC of the reference after this step
    base_crc: int  # CRC of the reference before it


@dataclass(frozen=True)
class Plan:
    """What one client is sent: a chain of steps, or the full reference."""

    tier: int
    mode: str  # "chain" or "full"
    payloads: tuple[bytes, ...]
    rounds: tuple[int, ...]
    base_crc: int  # chain: the CRC the client's reference must have before the first step
    crc: int  # the CRC after

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)


class Tier:
    """The server side of one download tier: reference, codec (and its state), history.

    Parameters
    ----------
    index : int
        The tier's number (part of its nonces).
    spec : str
        Codec spec of the tier's steps.
    max_stale : int or None (default: None)
        Optional cap on the steps kept for catch-up (a client more steps of the tier behind gets
        the full reference). None: history is bounded by bytes alone (see module docstring).
    """

    def __init__(self, index: int, spec: str, max_stale: int | None = None) -> None:
        if max_stale is not None and (isinstance(max_stale, bool) or not isinstance(max_stale, int)
                                      or max_stale < 1):
            raise SpecError(f"max_stale={max_stale!r} is invalid: a positive integer, or None (bounded by bytes)")
        self.index = index
        self.codec: Codec = build_codec(spec)
        self.max_stale = max_stale
        self.reference: dict[str, torch.Tensor] | None = None
        self.version = 0
        self.crc = 0
        self.initial_crc: int | None = None  # CRC of the round-0 model (seeded first contact)
        self.state: dict[str, torch.Tensor] = {}  # codec state (e.g. PowerSGD warm start)
        self.history: deque[Step] = deque()
        self._history_bytes = 0
        self.encodes = 0  # steps encoded so far (encoding cost is per tier, not per client)
        self._full: tuple[int, bytes] | None = None  # (crc, payload) of the last full reference sent

    def start(self, model: Mapping[str, torch.Tensor], version: int = 0) -> None:
        """Set the reference to the initial model (clients get it in full on first contact)."""
        self.reference = {k: v.detach().cpu().clone() for k, v in model.items()}
        self.version = version
        self.crc = reference_crc(self.reference)
        self.initial_crc = self.crc if version == 0 else None
        self.history.clear()
        self._history_bytes = 0

    def step(self, model: Mapping[str, torch.Tensor], server_round: int, seed: int = 0) -> Step:
        """Encode ``model - reference`` once for the tier and move the reference by what was sent."""
        if self.reference is None or Layout.of(model) != Layout.of(self.reference):
            self.start(model, self.version)  # first round, or the model changed shape or dtype
            assert self.reference is not None
        if server_round <= self.version:
            raise FedcompError(f"tier {self.index} is at round {self.version}; cannot step to round {server_round}")
        diff = {}
        for name, r in self.reference.items():
            g = model[name].detach().cpu()
            diff[name] = (g.to(_wide(r.dtype)) - r.to(_wide(r.dtype))).to(r.dtype) if r.is_floating_point() \
                else model_step(g, r)
        encoded = self.codec.encode(diff, nonce=derive_nonce(seed, server_round, -1 - self.index),
                                    round=server_round, state=self.state)
        self.encodes += 1
        # the reference moves by what a client decodes from these bytes, computed the way it does
        layout = Layout.of(diff)
        self.reference = apply_step(self.reference, self.codec.decode(encoded.payload, layout, round=server_round))
        base_crc, self.crc, self.version = self.crc, reference_crc(self.reference), server_round
        return self._record(Step(server_round, encoded.payload, self.crc, base_crc))

    def append(self, model: Mapping[str, torch.Tensor], server_round: int, payload: bytes) -> Step:
        """Record a step encoded elsewhere (coupled download): ``model`` is the reference after it,
        which the caller computed as ``apply_step(reference, codec.decode(payload, round=server_round))``
        exactly as a client does. Nothing is encoded here."""
        if self.reference is None:
            raise FedcompError(f"tier {self.index} has no reference yet: start() it with the initial model first")
        if server_round <= self.version:
            raise FedcompError(f"tier {self.index} is at round {self.version}; cannot step to round {server_round}")
        self.reference = {k: v.detach().cpu().clone() for k, v in model.items()}
        base_crc, self.crc, self.version = self.crc, reference_crc(self.reference), server_round
        return self._record(Step(server_round, payload, self.crc, base_crc))

    def _record(self, step: Step) -> Step:
        """Append to history; drop the oldest steps that no chain cheaper than the full model can use
        (the latest stays: it marks the version reached, and an already current client gets it again)."""
        self.history.append(step)
        self._history_bytes += len(step.payload)
        full = self.full_nbytes()
        while len(self.history) > 1 and (self._history_bytes >= full
                                or (self.max_stale is not None and len(self.history) > self.max_stale)):
            self._history_bytes -= len(self.history.popleft().payload)
        return step

    @property
    def history_nbytes(self) -> int:
        """Bytes of the step payloads kept (below one full model's)."""
        return self._history_bytes

    def seeded(self) -> tuple[int, int, int] | None:
        """What a node that never reported holds when it builds the round-0 model from the seed:
        ``(tier, 0, initial CRC)``; None when this tier did not start at round 0."""
        return None if self.initial_crc is None else (self.index, 0, self.initial_crc)

    def full(self) -> Plan:
        """The exact reference, for first contact and resyncs."""
        assert self.reference is not None
        if self._full is None or self._full[0] != self.crc:  # serialized once per version, not per client
            self._full = (self.crc, encode_full(self.reference))
        payload = self._full[1]
        return Plan(self.index, "full", (payload,), (self.version,), 0, self.crc)

    def plan(self, held: tuple[int, int, int] | None) -> Plan:
        """What to send a client that holds ``(tier, version, crc)`` (None: unknown or resyncing).

        A chain starts at the step whose base is the client's reference (matched by CRC, so a
        client may also join from another tier's reference while the two are still equal, as
        all tiers are in the first rounds); the full reference when there is none in history
        (first contact, more than ``max_stale`` steps behind, another tier's model) or when the
        chain would cost more.
        """
        if held is not None:
            crc = held[2]
            last = self.history[-1] if self.history else None
            if (last is not None and crc == self.crc and held[0] == self.index and held[1] == self.version
                    == last.round):
                # already current (federated evaluation sent it this step): the last step again,
                # which a client holding its result applies as nothing (see apply_plan)
                return Plan(self.index, "chain", (last.payload,), (last.round,), last.base_crc, self.crc)
            starts = [i for i, s in enumerate(self.history) if s.base_crc == crc]
            if starts:
                steps = list(self.history)[starts[-1]:]
                chain = Plan(self.index, "chain", tuple(s.payload for s in steps), tuple(s.round for s in steps),
                             crc, self.crc)
                if chain.nbytes < self.full_nbytes():
                    return chain
        return self.full()

    def full_nbytes(self) -> int:
        assert self.reference is not None
        return full_nbytes(Layout.of(self.reference))

    def verify(self, version: int, crc: int) -> bool:
        """Whether the tier's reference had CRC ``crc`` at ``version`` (as far as history reaches)."""
        if version == self.version:
            return crc == self.crc
        return any(s.round == version and s.crc == crc for s in self.history)


class ResyncNeeded(FedcompError):
    """The client cannot rebuild the reference the server describes; it must get the full model."""


def apply_plan(
    held: dict[str, torch.Tensor] | None,
    held_info: tuple[int, int, int] | None,
    *,
    mode: str,
    tier: int,
    spec: str,
    payloads: list[bytes],
    rounds: list[int],
    base_crc: int,
    crc: int,
    layout: Layout,
) -> tuple[dict[str, torch.Tensor], tuple[int, int, int]]:
    """The client side: the new reference and its ``(tier, version, crc)``.

    Raises :class:`ResyncNeeded` (never returns a model the server does not hold) when the
    client's reference is not the chain's base or the result's CRC differs.
    """
    if len(payloads) != len(rounds) or not payloads:
        raise ResyncNeeded(f"broadcast has {len(payloads)} payloads for {len(rounds)} rounds")
    if mode == "full":
        reference = decode_full(payloads[0], layout)
    elif mode == "chain":
        if held is None or held_info is None:
            raise ResyncNeeded("no reference model held (first contact or state lost)")
        if reference_crc(held) != held_info[2]:
            raise ResyncNeeded(f"the reference held for round {held_info[1]} does not match its CRC (state corrupted)")
        if held_info[2] == base_crc:  # the chain starts at the model held (maybe another tier's, still equal)
            todo = list(zip(rounds, payloads))
        elif held_info[0] == tier and held_info[1] in rounds:  # applied part of it already (its reply was lost)
            todo = [(r, p) for r, p in zip(rounds, payloads) if r > held_info[1]]
        else:
            raise ResyncNeeded(
                f"holds tier {held_info[0]} round {held_info[1]} (CRC {held_info[2]:#010x}), which is not the "
                f"chain's base (tier {tier}, CRC {base_crc:#010x})"
            )
        codec = build_codec(spec)
        reference = dict(held)
        for r, p in todo:
            reference = apply_step(reference, codec.decode(p, layout, round=r))
    else:
        raise ResyncNeeded(f"unknown broadcast mode {mode!r}; expected 'chain' or 'full'")
    got = reference_crc(reference)
    if got != crc:
        raise ResyncNeeded(f"reference CRC {got:#010x} after the broadcast, server has {crc:#010x}")
    return reference, (tier, rounds[-1], got)
