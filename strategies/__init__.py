"""Flower server side of fedcomp: the strategy wrapper around the core's aggregation."""

from fedcomp.msgsize import message_bytes
from fedcomp.strategies.adaptive import AdaptiveStrategy
from fedcomp.strategies.config import CompressionConfig
from fedcomp.strategies.measured import MeasuredLinkStrategy
from fedcomp.strategies.replies import MissingCompressionMod, NoUsableReplies, NonFiniteModel
from fedcomp.strategies.wrapper import CompressedStrategy, RoundStats

__all__ = ["AdaptiveStrategy", "CompressedStrategy", "CompressionConfig", "MeasuredLinkStrategy", "RoundStats", "message_bytes", "MissingCompressionMod",
           "NoUsableReplies", "NonFiniteModel"]
