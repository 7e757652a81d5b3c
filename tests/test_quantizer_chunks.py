"""Blockwise quantizers encode large segments in block-aligned chunks; the payload must read back
exactly as the encoder's reconstruction, at the size the codec states, within the error bound."""

from __future__ import annotations

import pytest
import torch

import fedcomp
from fedcomp.codecs import blockwise


@pytest.mark.parametrize("spec", [
    "kbit(bits=4)", "kbit(bits=3,block=100)", "kbit(bits=8,stochastic=true)", "kbit(bits=2,block=0)",
    "qsgd(bits=4)", "qsgd(bits=5,bucket=77)", "qsgd(bits=2,norm='l2')",
    "topk(ratio=0.5)+qsgd(bits=4)", "terngrad()",
])
def test_chunked_encode_round_trips(spec, monkeypatch):
    monkeypatch.setattr(blockwise, "_ENCODE_CHUNK", 2048)  # many chunks and a ragged last one
    x = {"w": torch.randn(173, 301, generator=torch.Generator().manual_seed(3)), "b": torch.randn(5)}
    layout = fedcomp.Layout.of(x)
    codec = fedcomp.build_codec(spec)
    enc = codec.encode(x, nonce=9)
    dec = codec.decode(enc.payload, layout)
    for name in x:
        assert torch.equal(dec[name], enc.decoded[name])
    assert codec.size_bytes(layout, enc.kept, enc.index_bytes) == len(enc.payload)
    if spec.startswith("kbit") and "stochastic" not in spec:
        # nearest rounding: |error| <= half a step of the block's range (a loose global bound here)
        assert (dec["w"] - x["w"]).abs().max() <= (x["w"].max() - x["w"].min()) / 2 ** (int(spec[10]) - 1)
    # one unchunked call gives the same bytes, stochastic rounding included (its uniforms are
    # counted by element index from one key per segment, not drawn chunk by chunk)
    monkeypatch.setattr(blockwise, "_ENCODE_CHUNK", 1 << 30)
    assert codec.encode(x, nonce=9).payload == enc.payload
