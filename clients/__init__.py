"""Flower client side of fedcomp: the compression mod and the project's ClientApp."""

from fedcomp.clients.mod import compression_mod

__all__ = ["compression_mod"]
