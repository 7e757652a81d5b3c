"""Client links: bandwidth, latency, byte caps and deadlines; byte budgets and simulated round time.

Where a client's link comes from:

* Deployment: the SuperNode's node config, e.g.
  ``flower-supernode ... --node-config "uplink-kbps=512 downlink-kbps=4096 latency-ms=80"``
  (optional ``byte-cap=20000`` bytes per upload and ``deadline-s=2.5``; or ``link='4g'`` to
  name a preset). :func:`link_from_node_config`.
* Simulation: Flower gives simulated nodes only ``partition-id``/``num-partitions``, so the run
  config's ``link-profile`` maps partitions to links (:func:`link_for`): a preset name (every
  client the same), ``'mixed'`` (each partition draws a preset from :data:`MIXED_WEIGHTS`
  with a generator seeded by (seed, partition id): the same link whatever the number of
  partitions), or the path of a per-client table (``.csv`` or ``.toml``, :func:`load_table`).

Units: kbps = 1,000 bits per second; bytes are payload bytes on the wire.

Time model, per client and round (:func:`client_time`)::

    download = down_bytes * 8 / (downlink_kbps * 1000) + latency
    upload   = up_bytes   * 8 / (uplink_kbps   * 1000) + latency
    total    = download + compute (local training, encode and decode, measured) + upload

A round takes the slowest participating client; with a deadline, clients whose total exceeds
it are dropped and the round takes the deadline (:func:`round_time`). A client's byte budget
(:func:`upload_budget`) is the byte cap, or what its uplink carries in the time the deadline
leaves after download, compute and the upload's latency, whichever is smaller.
"""

from __future__ import annotations

import csv
import math
import random
import tomllib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from fedcomp.errors import FedcompError


class LinkError(FedcompError, ValueError):
    """A link description is invalid (unknown preset, bad number, missing table row)."""


@dataclass(frozen=True)
class Link:
    """One client's network link."""

    uplink_kbps: float  # client -> server bandwidth, kilobits (1,000 bits) per second
    downlink_kbps: float  # server -> client bandwidth
    latency_ms: float  # one-way latency added to each transfer
    byte_cap: int | None = None  # most bytes one upload may take (None: no cap)
    deadline_s: float | None = None  # round deadline for this client (None: none)

    def __post_init__(self) -> None:
        for name in ("uplink_kbps", "downlink_kbps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
                raise LinkError(f"link {name.replace('_', '-')}={v!r} is invalid: a positive number of kilobits/s")
        if not (isinstance(self.latency_ms, (int, float)) and math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise LinkError(f"link latency-ms={self.latency_ms!r} is invalid: a number of milliseconds >= 0")
        if self.byte_cap is not None and not (isinstance(self.byte_cap, int) and self.byte_cap > 0):
            raise LinkError(f"link byte-cap={self.byte_cap!r} is invalid: a positive integer number of bytes")
        if self.deadline_s is not None and not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise LinkError(f"link deadline-s={self.deadline_s!r} is invalid: a positive number of seconds")

    def download_s(self, nbytes: int) -> float:
        """Seconds to receive ``nbytes``: transfer plus latency."""
        return nbytes * 8 / (self.downlink_kbps * 1000) + self.latency_ms / 1000

    def upload_s(self, nbytes: int) -> float:
        """Seconds to send ``nbytes``: transfer plus latency."""
        return nbytes * 8 / (self.uplink_kbps * 1000) + self.latency_ms / 1000

    def to_config(self) -> dict[str, float | int]:
        """The node-config keys describing this link (inverse of :func:`link_from_node_config`)."""
        out: dict[str, float | int] = {
            "uplink-kbps": self.uplink_kbps, "downlink-kbps": self.downlink_kbps, "latency-ms": self.latency_ms,
        }
        if self.byte_cap is not None:
            out["byte-cap"] = self.byte_cap
        if self.deadline_s is not None:
            out["deadline-s"] = self.deadline_s
        return out

    def describe(self) -> str:
        """``uplink-kbps=512 downlink-kbps=4096 latency-ms=80``: the --node-config string."""
        return " ".join(f"{k}={v}" for k, v in self.to_config().items())


# Named presets: typical figures (kbps up, kbps down, one-way latency ms).
PRESETS: dict[str, Link] = {
    "datacenter": Link(uplink_kbps=10_000_000, downlink_kbps=10_000_000, latency_ms=0.5),
    "broadband": Link(uplink_kbps=20_000, downlink_kbps=100_000, latency_ms=20),
    "4g": Link(uplink_kbps=5_000, downlink_kbps=20_000, latency_ms=50),
    "3g-edge": Link(uplink_kbps=200, downlink_kbps=1_000, latency_ms=300),
}
MIXED_WEIGHTS: dict[str, float] = {"datacenter": 0.1, "broadband": 0.3, "4g": 0.4, "3g-edge": 0.2}
NONE = "none"  # link-profile value: no links, no budgets, no simulated time
MEASURED = "measured"  # link-profile value: budgets from links the server measures ('measured:<profile>':
# in a simulation whose network plays <profile>, hidden from the clients; fedcomp.strategies.measured)

# Measured links (issue #17; fedcomp.adapt.MeasuredBudgets, fedcomp.strategies.measured): record keys
ESTIMATE = "link-estimate"  # str (server -> client, in the download record): the link the server measured
# for this node, as node-config text (margins applied); the client budgets from it when it declares no link
RECEIVED_AT = "received-at"  # float (client -> server, in the upload record, estimated links only): the
# client's wall clock (Unix seconds) when its mod received the broadcast
STARTED_AT = "process-started-at"  # float (client -> server, next to RECEIVED_AT; Linux only): when the
# ClientApp's process started (Unix seconds); in a deployment (a process per message) it splits the measured
# download into Flower's polls and the process's start-up (fedcomp.strategies.measured); in simulation one
# process serves many messages and it predates the push (ignored)
LINK_DOWN_BYTES = "link-down-bytes"  # int (client -> server, next to RECEIVED_AT, deployment with
LINK_DOWN_S = "link-down-s"  # float  fedcomp.clients.supernode): the object bytes of this broadcast and
# the seconds the node's SuperNode was pulling them over its link (nothing of Flower's polls or start-ups)
LINK_UP_OF = "link-up-of"  # str: the message whose reply the node's SuperNode pushed last, and
LINK_UP_BYTES = "link-up-bytes"  # int  that reply's object bytes and the seconds its push took
LINK_UP_S = "link-up-s"  # float  (a reply's upload ends after the reply left: reported one message later)
LINK_DOWN_WIRE_S = "link-down-wire-s"  # float: of LINK_DOWN_S and LINK_UP_S, the seconds the bytes took on
LINK_UP_WIRE_S = "link-up-wire-s"  # float  the link itself (the SuperNode's interface counters), where timed
NETSIM_RECORD = "fedcomp.netsim"  # ConfigRecord a simulated network adds to a reply: the hidden link's
# transfer times (simulation only; the server's observer removes it before anything counts the reply)

_KEYS = {"uplink-kbps": "uplink_kbps", "downlink-kbps": "downlink_kbps", "latency-ms": "latency_ms",
         "byte-cap": "byte_cap", "deadline-s": "deadline_s"}


def _number(key: str, value, source: str) -> float | int:
    if isinstance(value, bool):
        raise LinkError(f"{source}: {key}={value!r} must be a number")
    if isinstance(value, (int, float)):
        return value
    try:
        text = str(value).strip()
        return int(text) if text.lstrip("+-").isdigit() else float(text)
    except ValueError:
        raise LinkError(f"{source}: {key}={value!r} must be a number") from None


def link_from_mapping(config: Mapping, source: str = "node config") -> Link | None:
    """A Link from ``uplink-kbps``/``downlink-kbps``/``latency-ms`` (+ ``byte-cap``, ``deadline-s``)
    keys, or a ``link`` key naming a preset (other keys override its fields); None when the
    mapping has none of these keys. Other keys (``partition-id``, ``device``...) are ignored."""
    has_link = "link" in config
    given = {k: config[k] for k in _KEYS if k in config}
    if not has_link and not given:
        return None
    if has_link:
        name = str(config["link"])
        if name not in PRESETS:
            raise LinkError(f"{source}: link={name!r} is not a preset; presets: {sorted(PRESETS)}")
        base = PRESETS[name]
    else:
        missing = [k for k in ("uplink-kbps", "downlink-kbps") if k not in given]
        if missing:
            raise LinkError(f"{source} describes a link without {missing}; give uplink-kbps and downlink-kbps "
                            f"(and latency-ms), or link=<preset> with presets {sorted(PRESETS)}")
        base = None
    values = {_KEYS[k]: _number(k, v, source) for k, v in given.items()}
    if "byte_cap" in values:
        cap = values["byte_cap"]
        if not float(cap).is_integer():
            raise LinkError(f"{source}: byte-cap={cap!r} must be a whole number of bytes")
        values["byte_cap"] = int(cap)
    if base is not None:
        return replace(base, **values)
    values.setdefault("latency_ms", 0.0)
    return Link(**values)


def link_from_node_config(node_config: Mapping) -> Link | None:
    """The link a SuperNode's ``--node-config`` describes (see :func:`link_from_mapping`)."""
    return link_from_mapping(node_config, "node config")


def load_table(path: str | Path) -> dict[int, Link]:
    """Per-client links from a table file: partition id -> Link.

    CSV: a header ``partition-id,uplink-kbps,downlink-kbps,latency-ms`` (optional columns
    ``byte-cap``, ``deadline-s``, or ``link`` naming a preset; empty cells are absent)::

        partition-id,uplink-kbps,downlink-kbps,latency-ms
        0,512,4096,80
        1,20000,100000,20

    TOML: one table per partition id, same keys::

        [0]
        uplink-kbps = 512
        downlink-kbps = 4096
        latency-ms = 80
        [1]
        link = "4g"
    """
    path = Path(path)
    if not path.is_file():
        raise LinkError(f"link table {str(path)!r} does not exist")
    rows: dict[str, Mapping] = {}
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or "partition-id" not in reader.fieldnames:
                raise LinkError(f"link table {str(path)!r}: the header must start with partition-id")
            for line, row in enumerate(reader, start=2):
                pid = str(row.pop("partition-id", "")).strip()
                rows[f"{pid}@{line}"] = {k: v for k, v in row.items() if k and v not in (None, "")}
    elif path.suffix == ".toml":
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise LinkError(f"link table {str(path)!r} is not valid TOML: {exc}") from exc
        for pid, row in data.items():
            if not isinstance(row, dict):
                raise LinkError(f"link table {str(path)!r}: entry {pid!r} must be a table of link keys")
            rows[f"{pid}@[{pid}]"] = row
    else:
        raise LinkError(f"link table {str(path)!r}: use a .csv or .toml file")
    table: dict[int, Link] = {}
    for key, row in rows.items():
        pid, where = key.split("@", 1)
        if not pid.isdigit():
            raise LinkError(f"link table {str(path)!r} at {where}: partition-id {pid!r} must be an integer >= 0")
        unknown = set(row) - set(_KEYS) - {"link"}
        if unknown:
            raise LinkError(f"link table {str(path)!r} at {where}: unknown keys {sorted(unknown)}; "
                            f"allowed: {sorted(_KEYS) + ['link']}")
        if int(pid) in table:
            raise LinkError(f"link table {str(path)!r} at {where}: partition {pid} listed twice")
        table[int(pid)] = link_from_mapping(row, f"link table {path.name} at {where}")  # type: ignore[assignment]
    return table


def _is_table(profile: str) -> bool:
    return profile.endswith((".csv", ".toml"))


def measured_profile(profile: str) -> str | None:
    """The hidden profile of a measured-link profile: ``'measured'`` (a deployment: links measured
    from message timestamps) -> ``'none'``; ``'measured:<profile>'`` (a simulation whose network
    plays ``<profile>``, hidden from the clients) -> ``'<profile>'``; any other profile -> None."""
    if profile == MEASURED:
        return NONE
    if profile.startswith(MEASURED + ":"):
        return profile[len(MEASURED) + 1:]
    return None


def check_profile(profile: str) -> None:
    """Raise LinkError unless ``profile`` is 'none', a preset, 'mixed', an existing table file, or
    'measured' / 'measured:<one of those but none>'."""
    if profile in (NONE, "mixed") or profile in PRESETS:
        return
    hidden = measured_profile(profile)
    if hidden is not None:
        if hidden != NONE and profile != MEASURED and measured_profile(hidden) is None:
            check_profile(hidden)
            return
        if profile == MEASURED:
            return
        raise LinkError(f"link-profile {profile!r} is invalid: 'measured' (links measured in a deployment) or "
                        f"'measured:<profile>' with a preset, 'mixed' or a table path as the simulation's hidden links")
    if _is_table(profile):
        load_table(profile)
        return
    raise LinkError(f"link-profile {profile!r} is invalid: 'none', 'mixed', one of {sorted(PRESETS)}, "
                    f"or the path of a .csv/.toml per-client table")


def mixed_preset(partition_id: int, seed: int) -> str:
    """The preset partition ``partition_id`` draws under 'mixed' (independent of the partition count)."""
    rng = random.Random(zlib.crc32(f"{seed}/{partition_id}".encode()))
    names = list(MIXED_WEIGHTS)
    return rng.choices(names, weights=[MIXED_WEIGHTS[n] for n in names])[0]


def link_for(partition_id: int, num_partitions: int, profile: str, seed: int = 0) -> Link | None:
    """The link of simulated partition ``partition_id`` under run-config ``link-profile``.

    None for profile 'none'. Raises LinkError for an unknown profile, a partition outside
    0..num_partitions-1, or a table without a row for the partition.
    """
    if not 0 <= int(partition_id) < int(num_partitions):
        raise LinkError(f"partition-id {partition_id} is outside 0..{int(num_partitions) - 1}")
    if profile == NONE or measured_profile(profile) is not None:  # measured: the server's estimate, not this
        return None
    if profile in PRESETS:
        return PRESETS[profile]
    if profile == "mixed":
        return PRESETS[mixed_preset(int(partition_id), int(seed))]
    if _is_table(profile):
        table = load_table(profile)
        if int(partition_id) not in table:
            raise LinkError(f"link table {profile!r} has no row for partition {partition_id}")
        return table[int(partition_id)]
    check_profile(profile)
    return None  # unreachable: check_profile raised


def resolve_link(node_config: Mapping, profile: str, seed: int = 0) -> Link | None:
    """A client's link: its node config's link keys first, else the run's profile for its partition."""
    link = link_from_node_config(node_config)
    if link is not None or profile == NONE:
        return link
    if "partition-id" not in node_config or "num-partitions" not in node_config:
        raise LinkError(f"link-profile {profile!r} maps partitions to links, but this node's config has no "
                        f"partition-id/num-partitions; give it link keys (uplink-kbps=...) instead")
    return link_for(int(node_config["partition-id"]), int(node_config["num-partitions"]), profile, seed)


# -- budgets and time --------------------------------------------------------------------------
def with_deadline(link: Link, deadline_s: float | None) -> Link:
    """The link with the run's deadline where the link has none of its own."""
    return link if deadline_s is None or link.deadline_s is not None else replace(link, deadline_s=float(deadline_s))


def upload_budget(link: Link, download_bytes: int, compute_s: float) -> int | None:
    """Bytes this client may upload: min(byte cap, uplink bytes in the time the deadline leaves).

    time left = deadline - download time (incl. latency) - compute - upload latency, so an upload
    of that many bytes ends exactly at the deadline. None when the link has neither a cap nor a
    deadline; 0 when the deadline has already passed.
    """
    limits = []
    if link.byte_cap is not None:
        limits.append(link.byte_cap)
    if link.deadline_s is not None:
        left = link.deadline_s - link.download_s(download_bytes) - compute_s - link.latency_ms / 1000
        limits.append(max(0, math.floor(left * link.uplink_kbps * 1000 / 8)))
    return min(limits) if limits else None


@dataclass(frozen=True)
class ClientTime:
    """Simulated seconds of one client's round."""

    download_s: float
    compute_s: float
    upload_s: float

    @property
    def total_s(self) -> float:
        return self.download_s + self.compute_s + self.upload_s


def client_time(link: Link, download_bytes: int, upload_bytes: int, compute_s: float) -> ClientTime:
    """Download, compute (training + encode/decode, measured) and upload time of one client."""
    return ClientTime(link.download_s(download_bytes), float(compute_s), link.upload_s(upload_bytes))


def round_time(totals: Mapping[int, float],
               deadline_s: float | Mapping[int, float | None] | None = None) -> tuple[float, list[int]]:
    """(simulated round seconds, dropped clients) from each participant's total seconds.

    ``deadline_s``: one deadline for every client, or one per client (None: that client has
    none). Clients past their deadline are dropped at it: the round lasts as long as the slowest
    client kept, or the latest deadline a client was dropped at, whichever is longer. Without
    any deadline: the slowest client.
    """
    if not totals:
        return 0.0, []
    per = deadline_s if isinstance(deadline_s, Mapping) else dict.fromkeys(totals, deadline_s)
    dropped = sorted(c for c, t in totals.items() if per.get(c) is not None and t > per[c])
    ends = [t for c, t in totals.items() if c not in dropped] + [float(per[c]) for c in dropped]
    return float(max(ends)), dropped


__all__ = [
    "MEASURED", "MIXED_WEIGHTS", "NONE", "PRESETS", "ClientTime", "Link", "LinkError", "check_profile", "client_time",
    "link_for", "link_from_mapping", "link_from_node_config", "load_table", "measured_profile", "mixed_preset", "resolve_link",
    "round_time", "upload_budget", "with_deadline",
]
