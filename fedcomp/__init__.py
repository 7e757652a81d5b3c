"""fedcomp: compression core for communication-efficient federated learning (no Flower import).

Quick use::

    import fedcomp
    codec = fedcomp.build_codec("topk(ratio=0.01)+qsgd(bits=4)")
    enc = codec.encode(model_delta)                       # Encoded: .payload bytes, .decoded tensors
    delta = codec.decode(enc.payload, fedcomp.Layout.of(model_delta))

Layers (each imports only those before it): ``fedcomp`` (this package: codecs, wire format, error
feedback, aggregation, broadcasts, budgets; no Flower) <- ``fedcomp.clients`` (``compression_mod``)
and ``fedcomp.strategies`` (``CompressedStrategy``), the Flower glue, which never import each other
<- ``fedcomp.simulations`` (the project's ServerApp/ClientApp, tasks, experiments, benchmarks).
"""

from pathlib import Path as _Path

# The Flower glue lives in the repository's folders clients/, strategies/ and simulations/, beside
# this one. Installed from a wheel they sit inside this package; in a source tree (a checkout,
# Flower's app bundle) they sit next to it, and the parent folder joins the search path so that
# `fedcomp.clients` & co. resolve there too. Nothing of them is imported here.
_parent = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "clients").is_dir() and (_parent / "clients" / "mod.py").is_file():
    __path__.append(str(_parent))  # noqa: F821  (a package's __path__)

from fedcomp.codec import Codec, Encoded, available_codecs, cross_device_spec, derive_nonce
from fedcomp.errors import DecodeError, FedcompError, SpecError
from fedcomp.feedback import compress
from fedcomp.layout import Layout, TensorSpec
from fedcomp.policy import build_codec

__all__ = [
    "Codec",
    "DecodeError",
    "Encoded",
    "FedcompError",
    "Layout",
    "SpecError",
    "TensorSpec",
    "available_codecs",
    "build_codec",
    "compress",
    "cross_device_spec",
    "derive_nonce",
]
