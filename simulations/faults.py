"""Fault injection for simulations: a client mod that makes clients crash, reply garbage, time out or sit out.

Configured by the run-config key ``faults`` (empty: off), comma-separated ``name=value`` items::

    faults = "crash=0.1,garbage=0.05,slow=0.05,sleep=5,late=0.05,absent=2-4,absent-frac=0.3"

==============  ========================================================================================
crash=P         with probability P per (round, client) the client trains, then raises: the reply is
                lost after its Context.state (residual, codec state) was updated, as in a real crash
garbage=P       with probability P the reply's payload is replaced by random bytes of the same length
slow=P          with probability P the client sleeps ``sleep`` seconds before training; with
                ``round-timeout`` below that, the server stops waiting and the round goes on
sleep=S         seconds a slow client sleeps (default 10)
late=P          with probability P the client replies after the round's deadline whatever the machine's
                load: it sleeps until ``late-margin`` seconds past the time the server created its message
                plus the run config's ``round-timeout`` (a ``slow`` client is late only while the round's
                honest clients finish within the timeout and the timeout is below ``sleep``)
late-margin=S   seconds past the deadline a late client replies (default 5)
absent=A-B      rounds A..B (inclusive) during which the clients picked by ``absent-frac`` sit out:
                they reply an error at once, without training or touching their state, and come
                back in round B + 1 with their residual (and a stale delta reference, which resyncs)
absent-frac=F   fraction of the clients (chosen once per client from the seed) that sit out (default 0.5)
==============  ========================================================================================

Every draw is seeded by (run seed, round, partition id, fault kind), so a run's faults are the same
each time it is repeated. Each fault is tried in the order absent, slow, late, crash, garbage; at most
one of crash and garbage hits a client in a round (adding ``late`` leaves the other draws as they
were). Train messages only; everything else passes through.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from flwr.app import Context, Error, Message
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode

import fedcomp
from fedcomp import protocol as P

FAULTS_KEY = "faults"  # run-config key read by faults_mod
_PROBABILITIES = ("crash", "garbage", "slow", "late")
_KEYS = (*_PROBABILITIES, "sleep", "late-margin", "absent", "absent-frac")
ROUND_TIMEOUT_KEY = "round-timeout"  # run-config key of the server's round timeout (a late client's deadline)


class InjectedFault(RuntimeError):
    """Raised by a client that fault injection made crash."""


@dataclass(frozen=True)
class FaultPlan:
    """Parsed ``faults`` setting; all zero means no fault."""

    crash: float = 0.0  # probability a client crashes after training, per round
    garbage: float = 0.0  # probability a client's payload is replaced by random bytes
    slow: float = 0.0  # probability a client sleeps `sleep` seconds first
    sleep: float = 10.0  # seconds a slow client sleeps
    absent: tuple[int, int] = (0, -1)  # rounds (first, last) in which the chosen clients sit out; empty by default
    absent_frac: float = 0.5  # fraction of clients that sit out during `absent`
    late: float = 0.0  # probability a client replies after the round's deadline
    late_margin: float = 5.0  # seconds past the deadline a late client replies

    @property
    def active(self) -> bool:
        return bool(self.crash or self.garbage or self.slow or self.late or self.absent[0] <= self.absent[1])


def parse_faults(text: str) -> FaultPlan:
    """Parse a ``faults`` setting; raises SpecError naming the item, its value and what is allowed."""
    if not isinstance(text, str):
        raise fedcomp.SpecError(f"faults={text!r} is invalid: it must be a string such as 'crash=0.1,absent=2-4'")
    values: dict = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or key not in _KEYS:
            raise fedcomp.SpecError(f"faults item {item!r} is invalid: items are name=value with name in {_KEYS}")
        if key in values:
            raise fedcomp.SpecError(f"faults item {key!r} given twice in {text!r}")
        try:
            if key == "absent":
                first, dash, last = raw.partition("-")
                rounds = (int(first), int(last) if dash else int(first))
                if not 1 <= rounds[0] <= rounds[1]:
                    raise ValueError
                values[key] = rounds
                continue
            number = float(raw)
        except ValueError:
            allowed = "rounds A-B with 1 <= A <= B (or one round A)" if key == "absent" else "a number"
            raise fedcomp.SpecError(f"faults {key}={raw!r} is invalid: {key} must be {allowed}") from None
        if key in ("sleep", "late-margin"):
            if not 0 <= number < 86400:
                raise fedcomp.SpecError(f"faults {key}={raw!r} is invalid: {key} must be seconds in [0, 86400)")
        elif not 0 <= number <= 1:
            raise fedcomp.SpecError(f"faults {key}={raw!r} is invalid: {key} must be a probability in [0, 1]")
        values[key.replace("-", "_")] = number
    plan = FaultPlan(**values)
    if plan.crash + plan.garbage > 1:
        raise fedcomp.SpecError(f"faults {text!r}: crash + garbage must be at most 1 (they exclude each other)")
    return plan


def _rng(seed: int, server_round: int, partition: int, kind: str) -> random.Random:
    return random.Random(f"{seed}/{server_round}/{partition}/{kind}")


def draw(plan: FaultPlan, seed: int, server_round: int, partition: int) -> str | None:
    """The fault (``absent``, ``slow``, ``late``, ``crash``, ``garbage``) hitting this client this round, or None.

    ``slow`` may combine with crash/garbage in reality, but one label per round keeps results
    readable; a slow client is slow only.
    """
    first, last = plan.absent
    if first <= server_round <= last and random.Random(f"{seed}/absent/{partition}").random() < plan.absent_frac:
        return "absent"
    if _rng(seed, server_round, partition, "slow").random() < plan.slow:
        return "slow"
    if plan.late and _rng(seed, server_round, partition, "late").random() < plan.late:
        return "late"
    u = _rng(seed, server_round, partition, "fail").random()
    if u < plan.crash:
        return "crash"
    if u < plan.crash + plan.garbage:
        return "garbage"
    return None


def _round_of(msg: Message) -> int:
    if P.DOWNLOAD_RECORD in msg.content.config_records:
        return int(msg.content.config_records[P.DOWNLOAD_RECORD][P.ROUND])
    config = msg.content.config_records.get("config")
    if config is not None and "server-round" in config:
        return int(config["server-round"])
    return int(msg.metadata.group_id) if str(msg.metadata.group_id).isdigit() else 0


def late_seconds(msg: Message, context: Context, plan: FaultPlan, now: float | None = None) -> float:
    """How long a late client sleeps: until ``late_margin`` seconds past its round's deadline, the
    time the server created the message plus the run config's ``round-timeout`` (a deadline counted
    from the message, not from when this client got to run: a loaded machine delays both alike).

    Raises :class:`fedcomp.SpecError` when the run config has no usable ``round-timeout``."""
    timeout = context.run_config.get(ROUND_TIMEOUT_KEY)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 86400:
        raise fedcomp.SpecError(f"faults late=... needs the run config's {ROUND_TIMEOUT_KEY} (seconds in (0, 86400)), "
                                f"got {timeout!r}")
    created = float(msg.metadata.created_at or 0.0)
    now = time.time() if now is None else now
    start = created if 0 < created <= now else now  # a clock from another machine ahead of ours: from now
    return max(0.0, start + float(timeout) + plan.late_margin - now)


def faults_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: inject the faults of the run config's ``faults`` setting (see module docstring).

    Place it before ``compression_mod`` (outermost), so a crash happens after the client updated
    its state and a garbage payload replaces the compressed one.
    """
    text = context.run_config.get(FAULTS_KEY, "")
    if not text or msg.metadata.message_type != "train" or not msg.has_content():
        return call_next(msg, context)
    plan = parse_faults(str(text))
    seed = int(context.run_config.get("seed", 0))
    partition = int(context.node_config.get("partition-id", context.node_id))
    server_round = _round_of(msg)
    fault = draw(plan, seed, server_round, partition)
    if fault == "absent":
        return Message(Error(ErrorCode.NODE_UNAVAILABLE, f"fault injection: client {partition} sits out round "
                             f"{server_round}"), reply_to=msg)
    if fault == "slow":
        time.sleep(plan.sleep)
    if fault == "late":
        time.sleep(late_seconds(msg, context, plan))
    reply = call_next(msg, context)
    if fault == "crash":
        raise InjectedFault(f"fault injection: client {partition} crashed in round {server_round} after training")
    record = reply.content.config_records.get(P.UPLOAD_RECORD) if reply.has_content() else None
    if fault == "garbage" and record is not None and P.PAYLOAD in record:  # (a resync request has no payload)
        size = len(record[P.PAYLOAD])
        record[P.PAYLOAD] = _rng(seed, server_round, partition, "bytes").randbytes(size)
    return reply
