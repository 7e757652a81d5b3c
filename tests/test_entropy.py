"""Entropy-coded values (coding='ans'): exact round trip, near the symbol entropy, malformed streams refused."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest
import torch

import fedcomp
from fedcomp.bitpack import packed_bytes, unpack_codes


def _x(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.01}


@pytest.mark.parametrize("spec", [
    "topk(ratio=0.01)+qsgd(bits=4,coding='ans')",
    "kbit(bits=3,coding='ans')",
    "qsgd(bits=2,bucket=0,coding='ans')",
    "topk(ratio=0.01,scope='tensor')+kbit(bits=8,coding='ans')",
])
def test_ans_decodes_to_the_packed_values(spec):
    x = {"a": torch.randn(300, 40), "b": torch.randn(7), "c": torch.zeros(0), "d": torch.ones(5)}
    layout = fedcomp.Layout.of(x)
    enc = fedcomp.build_codec(spec).encode(x, nonce=4)
    packed = fedcomp.build_codec(spec.replace(",coding='ans'", "")).encode(x, nonce=4)
    out = fedcomp.build_codec(spec).decode(enc.payload, layout)
    for name in x:
        assert torch.equal(out[name], packed.decoded[name]), name
        assert torch.equal(out[name], enc.decoded[name]), name


def test_packed_spec_and_bytes_unchanged_by_the_option():
    codec = fedcomp.build_codec("topk(ratio=0.01)+qsgd(bits=4,coding='packed')")
    assert codec.spec == "topk(ratio=0.01,scope='global',index='rice')+qsgd(bits=4,bucket=512,norm='max')"
    assert codec.fingerprint == fedcomp.build_codec("topk(ratio=0.01)+qsgd(bits=4)").fingerprint


def test_ans_within_5_percent_of_symbol_entropy():
    x = _x(2_500_000)
    packed = fedcomp.build_codec("topk(ratio=0.01)+qsgd(bits=4)").encode(x, nonce=1)
    enc = fedcomp.build_codec("topk(ratio=0.01)+qsgd(bits=4,coding='ans')").encode(x, nonce=1)
    k = enc.kept[0]
    raw = torch.frombuffer(bytearray(packed.payload[-4 - packed_bytes(k, 4):-4]), dtype=torch.uint8)
    counts = torch.bincount(unpack_codes(raw, k, 4).long()).double()
    p = counts[counts > 0] / k
    entropy = float(-(p * p.log2()).sum())
    # values bytes = payload - header/CRC - index stream - per-bucket norms
    value_bits = 8 * (len(enc.payload) - 28 - enc.index_bytes[0] - 4 * math.ceil(k / 512)) / k
    assert value_bits <= 1.05 * entropy
    assert len(enc.payload) < len(packed.payload)


def test_ans_size_is_data_dependent_and_says_so():
    codec = fedcomp.build_codec("kbit(bits=4,coding='ans')")
    with pytest.raises(ValueError, match="data-dependent"):
        codec.size_bytes(fedcomp.Layout.of(_x(1000)))


def _recrc(body: bytearray) -> bytes:
    return bytes(body[:-4]) + struct.pack("<I", zlib.crc32(bytes(body[:-4])))


def test_malformed_ans_streams_are_refused_with_decode_error():
    codec = fedcomp.build_codec("qsgd(bits=4,coding='ans')")
    x = _x(5000)
    layout = fedcomp.Layout.of(x)
    payload = bytearray(codec.encode(x, nonce=2).payload)
    norms = 4 * math.ceil(5000 / 512)
    mode = 24 + norms  # the byte before the codes: 1, entropy coded
    table = mode + 1
    assert payload[mode] == 1
    g = torch.Generator().manual_seed(3)
    refused = 0
    for trial in range(40):
        bad = bytearray(payload)
        if trial == 0:
            bad[table:table + 32] = bytes(32)  # empty symbol table
        elif trial == 1:
            bad[table + 32:table + 36] = struct.pack("<I", 1 << 30)  # word count past the end
        elif trial == 2:
            bad[mode] = 2
            with pytest.raises(fedcomp.DecodeError, match="0 \\(packed\\) or 1 \\(ANS\\)"):
                codec.decode(_recrc(bad), layout)
        elif trial == 3:
            bad[mode] = 0  # packed codes said, an ANS stream there: its length is not the packed one
        else:
            pos = int(torch.randint(table, len(bad) - 4, (1,), generator=g))
            bad[pos] ^= 1 + int(torch.randint(255, (1,), generator=g))
        try:
            out = codec.decode(_recrc(bad), layout)
        except fedcomp.DecodeError:
            refused += 1
            continue
        assert out["w"].shape == x["w"].shape  # a flip inside the stream may still decode: to valid codes
    assert refused >= 4


@pytest.mark.parametrize("spec", ["topk(ratio=0.01)+qsgd(bits=4,coding='ans')", "qsgd(bits=4,coding='ans')",
                                  "kbit(bits=4,coding='ans')"])
def test_ans_only_where_it_pays(spec):
    """A byte per segment says how its codes travel: ANS where its stream is smaller, else packed
    (its fixed ~40 bytes outweigh what it saves on a few hundred values), so an 'ans' payload is
    never more than that byte per segment over the packed one, and much smaller on large ones."""
    g = torch.Generator().manual_seed(5)
    small = {"w1": torch.randn(64, 64, generator=g), "b1": torch.randn(64, generator=g),
             "w2": torch.randn(10, 64, generator=g), "b2": torch.randn(10, generator=g)}
    for x in (small, _x(200_000)):
        layout = fedcomp.Layout.of(x)
        codec, packed = fedcomp.build_codec(spec), fedcomp.build_codec(spec.replace(",coding='ans'", ""))
        enc, ref = codec.encode(x, nonce=3), packed.encode(x, nonce=3)
        segments = len(codec.segments(layout))
        assert len(enc.payload) <= len(ref.payload) + segments
        out = codec.decode(enc.payload, layout)
        assert all(torch.equal(out[n], ref.decoded[n]) for n in x)
        if x is not small:  # ANS there: ~0.5 bits fewer a value, 2,000 values or more
            assert len(enc.payload) < len(ref.payload) - 100
    tiny = {"b": torch.randn(10, generator=g)}
    assert len(fedcomp.build_codec(spec).encode(tiny, nonce=1).payload) == len(
        fedcomp.build_codec(spec.replace(",coding='ans'", "")).encode(tiny, nonce=1).payload) + 1  # packed, and its byte


@pytest.mark.parametrize("spec,version", [("qsgd(bits=4,coding='ans')", 1),
                                          ("randomk(ratio=0.5)+qsgd(bits=4,coding='ans')", 2),
                                          ("randomk(ratio=0.5)+qsgd(bits=4,coding='ans')", 3)])
def test_older_ans_payloads_still_decode_and_old_decoders_refuse_format_4(spec, version):
    """Payloads of 'ans' codecs from before the per-segment byte (every segment ANS; format 1, or 2
    and 3 where random-k set it) decode as they did: here the new payload with its byte taken out
    and the version it had then (random-k's format 2 draws other positions: the bytes of a format-3
    draw under version 2 are still a valid payload, decoded without reading a mode byte). A format-4 payload offered to a decoder of formats up to 3 is
    refused by name."""
    from fedcomp import wire
    from fedcomp.codecs import blockwise

    x = _x(5000)
    layout = fedcomp.Layout.of(x)
    codec = fedcomp.build_codec(spec)
    assert codec.wire_version == blockwise.ANS_MODES == 4
    enc = codec.encode(x, nonce=2)
    new = enc.payload
    assert new[2] == 4  # b"FC", then the version
    mode = 24 + 4 * math.ceil(enc.kept[0] / 512)  # after the header and the bucket norms
    assert new[mode] == 1
    old = bytearray(new[:mode] + new[mode + 1:])
    old[2] = version
    out = codec.decode(_recrc(old), layout)["w"]
    if version == 2:  # the same values at format 2's positions
        assert torch.equal(out.sort().values, enc.decoded["w"].sort().values)
        assert not torch.equal(out, enc.decoded["w"])
    else:
        assert torch.equal(out, enc.decoded["w"])
    with pytest.raises(fedcomp.DecodeError, match="payload format version 4"):
        wire.open_payload(new, layout.fingerprint(), codec.fingerprint, (1, 2, 3))


def test_an_ans_stream_as_long_as_the_packed_codes_goes_packed(monkeypatch):
    """The choice is strict: a stream exactly as long as the packed codes is not taken (a tie,
    made here by a stream whose words fill the packed codes' bytes exactly)."""
    from fedcomp import entropy

    x = {"w": torch.randn(80, generator=torch.Generator().manual_seed(7))}  # 40 bytes of 4-bit codes
    real = entropy.ans_stream

    def tie(symbols, bits):
        freqs, _ = real(symbols, bits)
        return freqs, np.zeros((40 - entropy.table_bytes(bits)) // 4, dtype=np.uint32)
    monkeypatch.setattr(entropy, "ans_stream", tie)
    codec = fedcomp.build_codec("kbit(bits=4,block=0,coding='ans')")
    enc = codec.encode(x, nonce=1)
    packed = fedcomp.build_codec("kbit(bits=4,block=0)").encode(x, nonce=1)
    assert len(enc.payload) == len(packed.payload) + 1
    assert torch.equal(codec.decode(enc.payload, fedcomp.Layout.of(x))["w"], packed.decoded["w"])
