"""``Part``: one server behaviour of :class:`fedcomp.strategies.CompressedStrategy`.

The wrapper is Flower's four ``Strategy`` methods walking an ordered list of parts. Each part
has one job and overrides the hooks it needs; the rest do nothing:

=====================  ===============================================================================
hook                   called
=====================  ===============================================================================
``on_layout``          the global model's layout changed (first round, another model)
``on_train_message``   once per train message: add fields to its download record (``out.fields``)
``observe``            once per reply that carries an upload record, before any part judges it
``check``              then in list order: a string drops the reply with that status (first one wins)
``on_round_end``       the round's replies are all in, before the aggregate
``on_aggregated``      the round's new global model (None when the round failed)
``on_run_end``         the end of ``start``, with every round's :class:`RoundStats`
=====================  ===============================================================================

``part.host`` is the wrapper (set by :meth:`Part.bind`): its resolved ``config``, ``upload``
codec, download ``tiers``, the round's ``layout`` and ``base`` model, and ``rounds``. A new server
behaviour is a new part passed as ``CompressedStrategy(inner, parts=[MyPart()])``; its hooks run
after the built-in parts' (docs: How-to, "A server behaviour").
"""

from __future__ import annotations

import dataclasses

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message

from fedcomp.strategies.stats import RoundStats



@dataclasses.dataclass
class RoundState:
    """The training round in progress: its stats, the replies already seen and the reply handler."""

    round: int
    stats: RoundStats
    replies: RoundReplies | None
    message_type: str = "train"
    arrays_key: str = ""
    seen: dict[int, Message] = dataclasses.field(default_factory=dict)  # replies already received, by identity
    errors: list[Message] = dataclasses.field(default_factory=list)  # error replies (collect mode hands them on)
    replied: set[int] = dataclasses.field(default_factory=set)  # nodes whose reply was taken (one per message)
    unwrapped: int = 0  # replies without a fedcomp upload record


@dataclasses.dataclass
class Outgoing:
    """One train message being built: parts add its download record's ``fields``; ``download`` is
    its :attr:`RoundStats.downloads` entry (the wrapper adds the bytes)."""

    round: int
    node: int
    arrays_key: str
    fields: dict = dataclasses.field(default_factory=dict)
    download: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Reply:
    """One train reply on its way to the aggregate."""

    state: RoundState
    msg: Message
    node: int
    entry: dict | None = None  # its RoundStats.clients entry (None for an error reply)
    record: ConfigRecord | None = None  # its fedcomp upload record
    wire: int = 0  # its bytes as received
    notes: dict = dataclasses.field(default_factory=dict)  # what a part's observe tells a later check


class Part:
    """Base class of the wrapper's parts: every hook does nothing."""

    host: CompressedStrategy  # the wrapper (fedcomp.strategies.CompressedStrategy); not imported: no cycle

    def bind(self, host: CompressedStrategy) -> None:
        """Attach to the wrapper (called once, at its construction)."""
        self.host = host

    def on_layout(self, layout) -> None:
        """The global model has a new :class:`fedcomp.Layout` (before any tier starts from it)."""

    def on_train_message(self, out: Outgoing) -> None:
        """Add this part's fields to one train message's download record."""

    def observe(self, reply: Reply) -> None:
        """Note what a reply says (its ``record`` is set); no verdict here."""

    def check(self, reply: Reply) -> str | None:
        """The status to drop the reply with (e.g. ``"dropped: ..."``), or None to let it pass."""
        return None

    def on_round_end(self, state: RoundState) -> None:
        """Every reply of the round is in; ``state.stats`` is the round's :class:`RoundStats`."""

    def on_aggregated(self, state: RoundState, arrays: ArrayRecord | None) -> None:
        """The round's new global model (None: no reply reached the aggregate)."""

    def on_run_end(self, rounds: dict[int, RoundStats]) -> None:
        """The run is over (end of ``start``)."""


Model = dict[str, torch.Tensor]
