"""A server behaviour that lives outside fedcomp, as a user's would: one ``Part`` subclass.

``tests/test_parts.py`` registers it (``CompressedStrategy(inner, parts=[DenyList(...)])``, the one
line a new behaviour needs) and checks that the nodes it names never reach the aggregate.
"""

from __future__ import annotations

from logging import INFO

from flwr.common import log

from fedcomp.strategies.part import Part, Reply, RoundState


class DenyList(Part):
    """Drop every train reply from the nodes in ``nodes``; log each round's dropped count."""

    def __init__(self, nodes) -> None:
        self.nodes = set(nodes)
        self.dropped: dict[int, int] = {}  # round -> replies dropped here

    def check(self, reply: Reply) -> str | None:
        if reply.node not in self.nodes:
            return None  # let it pass on to the aggregate
        self.dropped[reply.state.round] = self.dropped.get(reply.state.round, 0) + 1
        return f"dropped: node {reply.node} is on the deny-list"

    def on_round_end(self, state: RoundState) -> None:
        log(INFO, "deny-list: round %s dropped %d replies", state.round, self.dropped.get(state.round, 0))
