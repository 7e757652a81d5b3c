"""fedcomp: compression core for communication-efficient federated learning (no Flower import).

Quick use::

    import fedcomp
    codec = fedcomp.build_codec("topk(ratio=0.01)+qsgd(bits=4)")
    enc = codec.encode(model_delta)                       # Encoded: .payload bytes, .decoded tensors
    delta = codec.decode(enc.payload, fedcomp.Layout.of(model_delta))
"""

from fedcomp.codec import Codec, Encoded, available_codecs, build_codec, derive_nonce
from fedcomp.errors import DecodeError, FedcompError, SpecError
from fedcomp.feedback import compress
from fedcomp.layout import Layout, TensorSpec

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
    "derive_nonce",
]
