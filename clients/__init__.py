"""Flower client side of fedcomp (import `fedcomp.clients`): the compression mod and its per-node state."""

from fedcomp.clients.mod import compression_mod, make_compression_mod

__all__ = ["compression_mod", "make_compression_mod"]
