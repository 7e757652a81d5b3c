"""What ``compression_mod`` keeps for one node between rounds: one declared class, one load, one save.

Flower gives each node a ``Context`` whose ``state`` (a RecordDict) survives between messages;
:class:`ClientState` is its fedcomp part. ``load`` reads every field once at the start of a
message; the mod works on the fields; ``save`` writes back only the fields it assigned (a field
set to None removes its key). The keys are those of :mod:`fedcomp.protocol` (unchanged from the
ad hoc keys of earlier versions, so a node's state survives an upgrade). Tensors are kept on
the CPU; the mod moves them to its device.

Where the fields live (:func:`state_file`): in a simulation, in ``Context.state`` itself. In a
deployment (a ClientApp process that a SuperNode started for this node) they live in one file
per node and run, written before the reply leaves, and ``Context.state`` keeps only a pointer
to it. Flower 1.39 stores a ClientApp's ``Context`` when the process pushes it at exit, *after*
its reply: when the next round's message comes back sooner than a large state is pushed (a
compressed round is short, a model's reference and residual are two dense copies), the next
ClientApp is handed the state from before, and the node's reference no longer matches the
server's chain (a resync: a full model next round, the round's update lost). The file is
written before the reply exists, so the next round always reads it. The node config key
``fedcomp-state-dir`` picks the folder (``"context"``: keep the fields in ``Context.state``),
in a simulation too.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field, fields
from logging import WARNING
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common.logger import log

from fedcomp import protocol as P

Tensors = dict[str, torch.Tensor]


def _arrays(context: Context, key: str) -> Tensors | None:
    records = context.state.array_records
    return dict(records[key].to_torch_state_dict()) if key in records else None


def _config(context: Context, key: str) -> ConfigRecord | None:
    records = context.state.config_records
    return records[key] if key in records else None


STATE_DIR_KEY = "fedcomp-state-dir"  # node config: the state file's folder, or "context"
STATE_FILE = "fedcomp.state-file"  # Context.state: ConfigRecord {"path", "saves"} (deployment)
STATE_FILE_FORMAT = 1
STALE_SECONDS = 7 * 24 * 3600  # a run folder untouched this long is removed when a node starts another run


def default_state_dir() -> Path:
    """``$FEDCOMP_STATE_DIR``, else ``$XDG_CACHE_HOME/fedcomp/client-state`` (``~/.cache`` by default)."""
    if os.environ.get("FEDCOMP_STATE_DIR"):
        return Path(os.environ["FEDCOMP_STATE_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fedcomp" / "client-state"


def _deployed_for(context: Context) -> bool:
    """True in a ClientApp process a SuperNode started for this context's node (Flower sets the
    process's task identity to the node); False in a simulation (there it names the SuperLink)."""
    try:
        from flwr.common.constant import SUPERLINK_NODE_ID
        from flwr.supercore.task_identity import TaskIdentity

        return int(TaskIdentity.node_id) == int(context.node_id) != SUPERLINK_NODE_ID
    except (ImportError, RuntimeError, AttributeError, TypeError, ValueError):
        return False


def state_file(context: Context) -> Path | None:
    """The file this node's state lives in, or None to keep it in ``Context.state``.

    Node config ``fedcomp-state-dir``: a folder (any engine), or ``"context"``. Without it: the
    :func:`default_state_dir` in a deployment, ``Context.state`` in a simulation.
    """
    chosen = context.node_config.get(STATE_DIR_KEY) if context.node_config else None
    if chosen is not None:
        if not isinstance(chosen, str) or not chosen.strip():
            raise ValueError(f"node config {STATE_DIR_KEY}={chosen!r}: expected a folder path or 'context'")
        if chosen.strip() == "context":
            return None
        root = Path(chosen).expanduser()
    elif _deployed_for(context):
        root = default_state_dir()
    else:
        return None
    return root / f"run-{int(context.run_id)}" / f"node-{int(context.node_id)}.pt"


def _remove_stale_runs(path: Path) -> None:
    """Remove the state files (``node-*.pt`` and their temporaries) of sibling run folders
    untouched for :data:`STALE_SECONDS`, and the folders left empty (best effort: nothing else
    in a folder of the user's is touched)."""
    now = time.time()
    for run_dir in path.parent.parent.glob("run-*"):
        try:
            if run_dir == path.parent or not run_dir.is_dir() or now - run_dir.stat().st_mtime <= STALE_SECONDS:
                continue
            for f in [*run_dir.glob("node-*.pt"), *run_dir.glob("node-*.pt.*.tmp")]:
                f.unlink()
            if not any(run_dir.iterdir()):
                run_dir.rmdir()
        except OSError:
            pass


def _read_file(path: Path) -> dict | None:
    """The fields saved in ``path`` (None where there is none; {} and a warning where it is unreadable)."""
    try:
        if not path.exists():
            return None
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(saved, dict) or saved.get("format") != STATE_FILE_FORMAT:
            raise ValueError(f"not a fedcomp state file of format {STATE_FILE_FORMAT}")
        return dict(saved["fields"])
    except Exception as exc:  # noqa: BLE001 -- an unreadable file is an empty state (a resync), said aloud
        log(WARNING, "fedcomp: the node's state file %s could not be read (%s: %s); starting from an "
            "empty state (the server sends the full model next round)", path, type(exc).__name__, exc)
        return {}


def _write_file(path: Path, values: dict) -> None:
    """Write ``values`` to ``path`` atomically (a temporary file in the folder, then a rename)."""
    fresh = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    if fresh:
        _remove_stale_runs(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({"format": STATE_FILE_FORMAT, "fields": values}, fh)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
    # -- budgets: recent encode seconds and the payload bytes each made (the budget's encode reserve) --
    encode_seconds: list[float] = _slot(P.ENCODE_STATE, "seconds", factory=list)
    encode_bytes: list[float] = _slot(P.ENCODE_BYTES_STATE, "seconds", factory=list)
    # -- misconfiguration: this node already warned that the strategy is not wrapped --
    warned_unwrapped: bool = _slot(WARNED_STATE, "flag", default=False)

    def __setattr__(self, name: str, value) -> None:  # remember what to save
        super().__setattr__(name, value)
        self.__dict__.setdefault("_assigned", set()).add(name)

    @classmethod
    def load(cls, context: Context) -> "ClientState":
        """The node's state from its :func:`state_file` or ``context.state`` (missing: empty fields)."""
        path = state_file(context)
        values = _read_file(path) if path is not None else None
        if values is None:  # no file (yet): what Context.state holds (a node that could not write one keeps it there)
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
        known = {f.name for f in fields(cls)}
        state = cls(**{k: v for k, v in values.items() if k in known})
        if path is not None:
            state.__dict__["_file"] = path
        if state.reference is None or state.reference_info is None:  # half a reference is none
            state.reference, state.reference_info = None, None
        state._assigned.clear()  # loading is not assigning: nothing to save yet
        return state

    def save(self, context: Context) -> None:
        """Write the assigned fields (None or empty: remove them) to the state file, or to
        ``context.state`` where the node has none (see :func:`state_file`). A state file that
        cannot be written (a read-only home, a full disk) is logged, and the state goes to
        ``context.state`` from then on in this process."""
        path = self.__dict__.get("_file")
        if path is not None:
            if not self._assigned:
                return
            try:
                self._save_file(path, context)
                return
            except (OSError, RuntimeError) as exc:
                log(WARNING, "fedcomp: could not write this node's state file %s (%s: %s); its state goes "
                    "to Context.state instead (set the node config %s to a writable folder, or to "
                    "'context')", path, type(exc).__name__, exc, STATE_DIR_KEY)
                self.__dict__["_file"] = None
                try:  # a stale file would shadow the Context next round
                    path.unlink(missing_ok=True)
                except OSError:
                    pass
                self._assigned.update(f.name for f in fields(self))  # the Context may hold none of it yet
        for f in fields(self):
            if f.name not in self._assigned:
                continue
            key, value = f.metadata["key"], getattr(self, f.name)
            record = None if _empty(f, value) else _SAVE[f.metadata["kind"]](value)
            if record is not None:
                context.state[key] = record
            elif key in context.state:
                del context.state[key]
        self._assigned.clear()

    def _save_file(self, path: Path, context: Context) -> None:
        """Every non-empty field to ``path`` (atomically); ``context.state`` keeps a pointer."""
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["kind"] == "arrays" and value:
                value = {k: v.detach().cpu() for k, v in value.items()}
            if not _empty(f, value):
                values[f.name] = tuple(value) if f.metadata["kind"] == "ref-info" else value
        _write_file(path, values)
        for f in fields(self):  # what an earlier Context-kept state left there
            if f.metadata["key"] in context.state:
                del context.state[f.metadata["key"]]
        records = context.state.config_records
        saves = int(records[STATE_FILE]["saves"]) + 1 if STATE_FILE in records else 1
        context.state[STATE_FILE] = ConfigRecord({"path": str(path), "saves": saves})
        self._assigned.clear()


def _empty(f, value) -> bool:
    """A field with nothing to keep: None, or empty (a round number 0 is kept)."""
    return value is None or (not value and f.metadata["kind"] != "round")


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
