"""Streaming aggregation: decode each reply into the round's aggregate as it arrives.

Flower's ``Grid.send_and_receive`` pushes a round's messages and returns only when every reply
is in (or the timeout passed); the strategy then decodes everything at once. Decoding is the
server's main cost with compressed uploads, and most of it can overlap the wait for slower
clients: :class:`StreamingGrid` pulls replies as they arrive and hands each one to a callback
(the wrapper checks and decodes it and adds it to the core's running sum,
:class:`fedcomp.aggregate.Accumulator`), so the round's aggregate is ready shortly after the
last reply, not "last reply + decode everything".

Only strategies whose aggregate is a weighted mean of the client models can use the running
sum (:data:`STREAMABLE`); for the others (FedMedian, Krum, trimmed means, QFedAvg, DP
wrappers...) replies are still decoded on arrival, then collected for the inner strategy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from flwr.app import Message
from flwr.server import Grid
from flwr.serverapp.strategy import (Bulyan, FedAdagrad, FedAdam, FedAvg, FedAvgM, FedMedian, FedProx, FedTrimmedAvg,
                                     FedYogi, Krum, MultiKrum, QFedAvg, Strategy)

# aggregate_train of these is a function of the num-examples-weighted mean of the replies' models
STREAMABLE = (FedAvg, FedProx, FedAvgM, FedAdam, FedAdagrad, FedYogi)


# aggregate_train of these compares or re-weights the clients' updates one by one (robust
# aggregators, QFedAvg's loss weighting) or normalizes the mean per coordinate (FedAdam, FedAdagrad,
# FedYogi): sparse or sketched uploads defeat them (config.py's docstring; docs, Results)
SPARSE_AVERSE = (FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan, QFedAvg, FedAdam, FedAdagrad, FedYogi)


def sparse_averse(strategy: Strategy) -> bool:
    """True for the strategies (or subclasses) of :data:`SPARSE_AVERSE`, except Flower's own FedAdam,
    FedYogi and FedAdagrad: the wrapper runs their step on accumulated updates
    (:mod:`fedcomp.strategies.optimizer_sketch`); a subclass may step otherwise and stays averse."""
    if type(strategy) in (FedAdam, FedAdagrad, FedYogi):
        return False
    return isinstance(strategy, SPARSE_AVERSE)


def can_stream(strategy: Strategy) -> bool:
    """Exact type match: FedMedian, FedTrimmedAvg, Krum, QFedAvg subclass FedAvg but need every reply."""
    return type(strategy) in STREAMABLE


class DelegatingGrid(Grid):
    """A Grid around another: ``send_and_receive`` pushes and polls through this grid's own
    ``push_messages``/``pull_messages`` (so a subclass sees every message leave and every reply come
    back, whoever sends) and hands each reply to :meth:`on_reply` as it is pulled. Same contract
    as ``Grid.send_and_receive`` (all replies, or those in by ``timeout``); it polls every
    ``poll_interval`` seconds (Flower's HTTP grid sleeps 3 s between pulls). Everything else is
    delegated to the wrapped grid."""

    def __init__(self, grid: Grid, poll_interval: float = 0.05) -> None:
        self.grid = grid
        self.poll_interval = poll_interval

    def on_reply(self, msg: Message) -> None:
        """Called once per reply as soon as it is pulled (default: nothing)."""

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        pending = set(self.push_messages(messages))
        end = time.monotonic() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while pending and (timeout is None or time.monotonic() < end):
            arrived = list(self.pull_messages(pending))
            for msg in arrived:
                pending.discard(msg.metadata.reply_to_message_id)
                self.on_reply(msg)
                replies.append(msg)
            if pending and not arrived:
                time.sleep(self.poll_interval)
        return replies

    # -- delegated ------------------------------------------------------------------------------
    @property
    def run(self):  # noqa: D102
        return self.grid.run

    def set_run(self, run_id: int) -> None:  # noqa: D102
        self.grid.set_run(run_id)

    def create_message(self, *args, **kwargs) -> Message:  # noqa: D102
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return self.grid.pull_messages(message_ids)

    def __getattr__(self, name):  # anything a newer Grid adds
        return getattr(self.grid, name)


class StreamingGrid(DelegatingGrid):
    """A Grid that hands every reply to ``on_reply`` as soon as it is pulled (streaming aggregation)."""

    def __init__(self, grid: Grid, on_reply: Callable[[Message], None], poll_interval: float = 0.05) -> None:
        super().__init__(grid, poll_interval)
        self.on_reply = on_reply
