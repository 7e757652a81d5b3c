"""Fault injection for simulations: a client mod that makes clients crash, reply garbage, time out or sit out.

Configured by the run-config key ``faults`` (empty: off), comma-separated ``name=value`` items::

    faults = "crash=0.1,garbage=0.05,slow=0.05,sleep=5,absent=2-4,absent-frac=0.3"

==============  ========================================================================================
crash=P         with probability P per (round, client) the client trains, then raises: the reply is
                lost after its Context.state (residual, codec state) was updated, as in a real crash
garbage=P       with probability P the reply's payload is replaced by random bytes of the same length
slow=P          with probability P the client sleeps ``sleep`` seconds before training; with
                ``round-timeout`` below that, the server stops waiting and the round goes on
sleep=S         seconds a slow client sleeps (default 10)
absent=A-B      rounds A..B (inclusive) during which the clients picked by ``absent-frac`` sit out:
                they reply an error at once, without training or touching their state, and come
                back in round B + 1 with their residual (and a stale delta reference, which resyncs)
absent-frac=F   fraction of the clients (chosen once per client from the seed) that sit out (default 0.5)
==============  ========================================================================================

Every draw is seeded by (run seed, round, partition id, fault kind), so a run's faults are the same
each time it is repeated. Each fault is tried in the order absent, slow, crash, garbage; at most one
of crash and garbage hits a client in a round. Train messages only; everything else passes through.
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
_PROBABILITIES = ("crash", "garbage", "slow")
_KEYS = (*_PROBABILITIES, "sleep", "absent", "absent-frac")


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

    @property
    def active(self) -> bool:
        return bool(self.crash or self.garbage or self.slow or self.absent[0] <= self.absent[1])


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
        if key == "sleep":
            if not 0 <= number < 86400:
                raise fedcomp.SpecError(f"faults sleep={raw!r} is invalid: sleep must be seconds in [0, 86400)")
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
    """The fault (``absent``, ``slow``, ``crash``, ``garbage``) hitting this client this round, or None.

    ``slow`` may combine with crash/garbage in reality, but one label per round keeps results
    readable; a slow client is slow only.
    """
    first, last = plan.absent
    if first <= server_round <= last and random.Random(f"{seed}/absent/{partition}").random() < plan.absent_frac:
        return "absent"
    if _rng(seed, server_round, partition, "slow").random() < plan.slow:
        return "slow"
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
    reply = call_next(msg, context)
    if fault == "crash":
        raise InjectedFault(f"fault injection: client {partition} crashed in round {server_round} after training")
    record = reply.content.config_records.get(P.UPLOAD_RECORD) if reply.has_content() else None
    if fault == "garbage" and record is not None and P.PAYLOAD in record:  # (a resync request has no payload)
        size = len(record[P.PAYLOAD])
        record[P.PAYLOAD] = _rng(seed, server_round, partition, "bytes").randbytes(size)
    return reply
