"""Flower server side of fedcomp: the strategy wrapper, composed of parts (:mod:`fedcomp.strategies.part`)."""

from fedcomp.msgsize import message_bytes
from fedcomp.strategies.adaptive import AdaptiveStrategy
from fedcomp.strategies.config import CompressionConfig
from fedcomp.strategies.measured import MeasuredLinkStrategy
from fedcomp.strategies.part import Part
from fedcomp.strategies.replies import MissingCompressionMod, NoUsableReplies, NonFiniteModel
from fedcomp.strategies.wrapper import CompressedStrategy, RoundStats

__all__ = ["AdaptiveStrategy", "CompressedStrategy", "CompressionConfig", "MeasuredLinkStrategy", "Part", "RoundStats", "message_bytes", "MissingCompressionMod",
           "NoUsableReplies", "NonFiniteModel"]
