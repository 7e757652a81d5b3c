"""Flower server side of fedcomp: the strategy wrapper and the project's ServerApp."""

from fedcomp.strategies.wrapper import CompressedStrategy, RoundStats, message_bytes

__all__ = ["CompressedStrategy", "RoundStats", "message_bytes"]
