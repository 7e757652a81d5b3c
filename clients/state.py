"""What ``compression_mod`` keeps for one node between rounds: one declared class, one load, one save.

Flower gives each node a ``Context`` whose ``state`` (a RecordDict) survives between messages;
:class:`ClientState` is its fedcomp part. ``load`` reads every field once at the start of a
message; the mod works on the fields; ``save`` writes back only the fields it assigned (a field
set to None removes its key). The keys are those of :mod:`fedcomp.protocol` (unchanged from the
ad hoc keys of earlier versions, so a node's state survives an upgrade). Tensors are kept on
the CPU; the mod moves them to its device.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context

from fedcomp import protocol as P

Tensors = dict[str, torch.Tensor]


def _arrays(context: Context, key: str) -> Tensors | None:
    records = context.state.array_records
    return dict(records[key].to_torch_state_dict()) if key in records else None


def _config(context: Context, key: str) -> ConfigRecord | None:
    records = context.state.config_records
    return records[key] if key in records else None


WARNED_STATE = "fedcomp.warned-unwrapped"  # Context.state: ConfigRecord {"warned": True} (client only)


def _slot(key: str, kind: str, default=None, factory=None):
    """A field stored under Context.state[key]; ``kind`` says how (see ClientState._LOAD/_SAVE)."""
    meta = {"key": key, "kind": kind}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass
class ClientState:
    """A node's fedcomp state (see the module docstring); every field None/empty when new."""

    # -- the broadcast reference (fedcomp.broadcast): what the server's chains apply to --
    reference: Tensors | None = _slot(P.REF_STATE, "arrays")  # the reference model this node holds
    reference_info: tuple[int, int, int] | None = _slot(P.REF_INFO_STATE, "ref-info")  # (tier, version, CRC32)
    # -- error feedback and the codec's own state (fedcomp.feedback) --
    residual: Tensors | None = _slot(P.RESIDUAL_STATE, "arrays")  # what compression dropped, re-added next round
    codec_state: Tensors = _slot(P.CODEC_STATE, "arrays", factory=dict)  # warm starts, momentum
    # -- delta coding: the update the server reconstructed from this node's last reply --
    last_sent: Tensors | None = _slot(P.LAST_SENT_STATE, "arrays")
    last_round: int | None = _slot(P.LAST_ROUND_STATE, "round")  # the round last_sent was sent in
    # -- nothing lost: the last reply until the server acknowledges it (fedcomp.protocol.ACK_ROUND) --
    pending: Tensors | None = _slot(P.PENDING_STATE, "arrays")  # as the server decodes it
    pending_round: int | None = _slot(P.PENDING_INFO_STATE, "round")  # the round it was sent in
    # -- budgets: recent encode seconds (the budget reserves the longest of them) --
    encode_seconds: list[float] = _slot(P.ENCODE_STATE, "seconds", factory=list)
    # -- misconfiguration: this node already warned that the strategy is not wrapped --
    warned_unwrapped: bool = _slot(WARNED_STATE, "flag", default=False)

    def __setattr__(self, name: str, value) -> None:  # remember what to save
        super().__setattr__(name, value)
        self.__dict__.setdefault("_assigned", set()).add(name)

    @classmethod
    def load(cls, context: Context) -> "ClientState":
        """The node's state from ``context.state`` (missing keys: empty fields)."""
        values = {}
        for f in fields(cls):
            key, kind = f.metadata["key"], f.metadata["kind"]
            if kind == "arrays":
                value = _arrays(context, key)
            else:
                rec = _config(context, key)
                value = None if rec is None else _LOAD[kind](rec)
            if value is not None:
                values[f.name] = value
        state = cls(**values)
        if state.reference is None or state.reference_info is None:  # half a reference is none
            state.reference, state.reference_info = None, None
        state._assigned.clear()  # loading is not assigning: nothing to save yet
        return state

    def save(self, context: Context) -> None:
        """Write the assigned fields to ``context.state`` (None or empty: remove the key)."""
        for f in fields(self):
            if f.name not in self._assigned:
                continue
            key, value = f.metadata["key"], getattr(self, f.name)
            record = None if value is None or (not value and f.metadata["kind"] != "round") else _SAVE[f.metadata["kind"]](value)
            if record is not None:
                context.state[key] = record
            elif key in context.state:
                del context.state[key]
        self._assigned.clear()


_LOAD = {
    "ref-info": lambda r: (int(r[P.TIER]), int(r[P.REF_VERSION]), int(r[P.REF_CRC])),
    "round": lambda r: int(r["round"]),
    "seconds": lambda r: [float(v) for v in r["s"]],
    "flag": lambda r: bool(r["warned"]),
}
_SAVE = {
    "arrays": lambda t: ArrayRecord({k: v.detach().cpu() for k, v in t.items()}),
    "ref-info": lambda v: ConfigRecord(dict(zip((P.TIER, P.REF_VERSION, P.REF_CRC), v))),
    "round": lambda v: ConfigRecord({"round": int(v)}),
    "seconds": lambda v: ConfigRecord({"s": [float(x) for x in v]}),
    "flag": lambda v: ConfigRecord({"warned": True}),
}
