"""The fused CPU loops (fedcomp.kernels, numba) give the bits of the torch path they replace:
decoded values, sums for any weight (integer or not), and norms to the last few ulps."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import fedcomp
from fedcomp import DecodeError, aggregate, bitpack, kernels
from fedcomp.codecs import blockwise, fp
from fedcomp.aggregate import Accumulator

pytestmark = pytest.mark.skipif(kernels.get() is None, reason="numba not installed")

SPECS = [
    "none()", "fp16()", "bf16()", "sign()", "sign(block=100)", "kbit(bits=4)", "kbit(bits=8)", "kbit(bits=1)",
    "kbit(bits=2)", "kbit(bits=3,block=100)", "kbit(bits=7,block=33)", "kbit(bits=5,block=0,stochastic=true)",
    "kbit(bits=4,coding='ans')", "qsgd(bits=4)", "qsgd(bits=2)", "qsgd(bits=8)", "qsgd(bits=3,bucket=77)",
    "qsgd(bits=6,bucket=0,norm='l2')", "powersgd(rank=2)", "powersgd(rank=1)",
    "powersgd(rank=3,min_compression=0)+qsgd(bits=8)", "twobit(threshold=0.5)", "twobit(threshold=0.001)",
    "terngrad()", "terngrad(clip=0)",
]
WEIGHTS = (1, 3.0, 0.3, 1e-7, 12345)


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(71, 47, generator=g), "b": torch.randn(5, generator=g),
            "h": torch.randn(33, 9, generator=g).half(), "d": torch.randn(4, 3, 7, generator=g).double(),
            "z": torch.zeros(100), "n": torch.tensor([seed], dtype=torch.int64)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]) if t.is_floating_point() else t


def _run(spec: str):
    codec = fedcomp.build_codec(spec)
    layout = fedcomp.Layout.of(_model(0))
    acc = Accumulator(codec, layout)
    decoded, norms = [], []
    for i, w in enumerate(WEIGHTS, start=1):
        payload = codec.encode(_model(i), nonce=i, round=1, state={}).payload
        decoded.append(codec.decode(payload, layout, round=1))
        update = acc.decode(payload, round=1)
        norms.append(update.norm())
        acc.add_update(update, w)
    return decoded, norms, acc.sum()


@pytest.mark.parametrize("spec", SPECS)
def test_kernels_give_the_torch_paths_bits(spec, monkeypatch):
    monkeypatch.setattr(aggregate, "CHUNK", 600)  # chunks start inside blocks and tensors
    monkeypatch.setattr(blockwise, "_ENCODE_CHUNK", 1000)
    monkeypatch.setenv("FEDCOMP_KERNELS", "0")
    ref = _run(spec)
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    got = _run(spec)
    for a, b in zip(ref[0], got[0]):
        for name in a:
            assert torch.equal(_bits(a[name]), _bits(b[name])), name
    for name in ref[2]:  # FMA like torch's add_(alpha=w): the same sum for non-integer weights too
        assert torch.equal(_bits(ref[2][name]), _bits(got[2][name])), name
    # the kernels' check pass takes linear quantizers' squares from exact sums of their codes: the
    # exact values' norm, which the fp32 values' (each within 2**-24 relative) match to ~1e-7
    for a, b in zip(ref[1], got[1]):
        assert math.isclose(a, b, rel_tol=1e-6)


def test_kernel_norm_refuses_non_finite(monkeypatch):
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    codec = fedcomp.build_codec("none()")
    layout = fedcomp.Layout.of({"x": torch.zeros(3000)})
    x = torch.randn(3000)
    x[2999] = float("inf")
    acc = Accumulator(codec, layout)
    with pytest.raises(aggregate.UpdateRejected):
        acc.add(codec.encode({"x": x}).payload, 1.0)
    assert acc.count == 0


def test_unpack_matches_unpack_codes():
    k = kernels.get()
    g = torch.Generator().manual_seed(0)
    for bits in range(1, 9):
        for count in (1, 7, 8, 9, 100, 1001):
            codes = torch.randint(0, 1 << bits, (count,), generator=g, dtype=torch.int64)
            packed = bitpack.pack_bits(codes, bits)
            out = torch.empty(count, dtype=torch.uint8)
            k.unpack(packed.numpy(), count, bits, out.numpy())
            assert torch.equal(out.long(), codes), (bits, count)


ENCODE_SPECS = [
    "sign()", "sign(block=100)", "sign(block=7)", "sign(block=2500,scale='rms')", "sign(scale='rms')", "kbit(bits=4)", "kbit(bits=8)", "kbit(bits=1)", "kbit(bits=2)",
    "kbit(bits=3,block=100)", "kbit(bits=7,block=33)", "kbit(bits=5,block=0,stochastic=true)",
    "kbit(bits=4,stochastic=true)", "qsgd(bits=4)", "qsgd(bits=2)", "qsgd(bits=8)", "qsgd(bits=3,bucket=77)",
    "qsgd(bits=6,bucket=0,norm='l2')", "qsgd(bits=4,norm='l2')", "topk(ratio=0.01)+qsgd(bits=4)",
    "topk(ratio=0.1)+kbit(bits=4)", "topk(ratio=0.01)+sign()", "powersgd(rank=2)+qsgd(bits=8)",
    "kbit(bits=4,coding='ans')", "twobit(threshold=0.5)", "twobit(threshold=1e-45)",
    "topk(ratio=0.1)+twobit(threshold=0.3)", "terngrad()", "terngrad(clip=0)", "terngrad(clip=0.5)",
    "topk(ratio=0.1)+terngrad()", "kbit(bits=4,stochastic=true,coding='ans')", "qsgd(bits=4,coding='ans')",
]


def _encode_inputs():
    g = torch.Generator().manual_seed(0)
    yield "randn", {"w": torch.randn(61, 147, generator=g), "b": torch.randn(5, generator=g),
                    "h": torch.randn(33, 9, generator=g).half()}
    yield "const", {"w": torch.full((3000,), 0.5)}
    yield "zeros", {"w": torch.where(torch.rand(2049, generator=g) < 0.5, 0.0, -0.0)}  # signed zeros
    yield "relu", {"w": -torch.relu(torch.randn(3000, generator=g))}  # blocks whose max is a zero
    yield "one", {"w": torch.tensor([3.0])}
    yield "ties", {"w": (torch.randint(-3, 4, (5000,), generator=g) / 2).float()}
    for bad, at in ((float("nan"), 17), (float("inf"), 700), (-float("inf"), 3999)):
        x = torch.randn(4000, generator=g)
        x[at] = bad
        yield f"{bad}", {"w": x}
    yield "huge", {"w": torch.randn(7000, generator=g) * 1e30}
    yield "subnormal", {"w": torch.randn(7000, generator=g) * 1e-40}
    # the exact sums' fp32 lanes (terngrad's std, sign's scale; blockwise._STD_BLOCK 1000 here):
    # magnitudes from 1e-45 to 1e20 in every block (products below fp32's normal range), and
    # tensors whose every block has max |x| = f * 2**e, f in [0.5, 1), at k = 20 - e = 120, 127
    # (fp32's largest power of two) and 128 (the float64 loop)
    spread = torch.randn(7000, generator=g) * torch.pow(10.0, torch.empty(7000).uniform_(-45, 20, generator=g))
    yield "spread", {"w": spread}
    for k in (120, 127, 128):
        edge = spread[:3000].reshape(3, 1000)
        edge = edge / edge.abs().amax(dim=1, keepdim=True) * (0.75 * 2.0 ** (20 - k))
        yield f"k={k}", {"w": edge.reshape(-1)}
    tiny = torch.randn(7000, generator=g) * 1e-40  # qsgd's levels / norm overflows fp32: not 0 * inf
    tiny[::13] = 0.0
    yield "subnormal-zeros", {"w": tiny}


@pytest.mark.parametrize("spec", ENCODE_SPECS)
def test_encode_kernels_give_the_same_payload(spec, monkeypatch):
    monkeypatch.setattr(blockwise, "_ENCODE_CHUNK", 3000)  # several chunks, a ragged last one
    monkeypatch.setattr(blockwise, "_STD_BLOCK", 1000)  # terngrad's std, sign's scale from several exact block sums
    codec = fedcomp.build_codec(spec)
    for name, x in _encode_inputs():
        payloads = []
        for flag in ("0", "1"):
            monkeypatch.setenv("FEDCOMP_KERNELS", flag)
            try:
                payloads.append(codec.encode(x, nonce=5, round=2, state={}).payload)
            except fedcomp.FedcompError as e:  # refused alike either way
                payloads.append(type(e).__name__)
        assert payloads[0] == payloads[1], name


@pytest.mark.parametrize("spec", ["powersgd(rank=2)", "powersgd(rank=3,min_compression=0)+qsgd(bits=8)",
                                  "powersgd(rank=1)+fp16()"])
def test_powersgd_dense_decode_in_the_loop_is_reconstructs(spec, monkeypatch):
    """A dense decode's P Q^T from the compiled loop (kernels loaded) has reconstruct()'s bits, in
    one allocation with the decode's other tensors (its arena)."""
    g = torch.Generator().manual_seed(4)
    model = {"w": torch.randn(37, 53, generator=g), "c": torch.randn(16, 3, 5, 5, generator=g),
             "b": torch.randn(7, generator=g), "big": torch.randn(3000, 2900, generator=g)}  # an arena: 32 MB
    codec, layout = fedcomp.build_codec(spec), fedcomp.Layout.of(model)
    payload = codec.encode(model, nonce=2).payload
    monkeypatch.setenv("FEDCOMP_KERNELS", "0")
    want = codec.decode(payload, layout)
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    got = codec.decode(payload, layout)
    for name in model:
        assert torch.equal(_bits(got[name]), _bits(want[name])), name
    assert got["w"].untyped_storage().data_ptr() == got["c"].untyped_storage().data_ptr()
    assert want["w"].untyped_storage().data_ptr() != want["c"].untyped_storage().data_ptr()


def test_powersgd_expand_keeps_torchs_nan_and_inf_bits(monkeypatch):
    """Factors holding +-NaN, +-inf and zeros: expand (the compiled loop, or torch's ops where a factor
    is NaN) gives reconstruct()'s bits; the loop and torch keep different NaNs where two meet."""
    import itertools

    from fedcomp.codecs.powersgd import reconstruct

    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    codec = fedcomp.build_codec("powersgd(rank=2,min_compression=0)")
    seg, _ = codec.segments(fedcomp.Layout.of({"w": torch.zeros(4, 3)}))[0]
    n, m, r = codec.reducer.factors(seg)
    specials = [float(np.uint32(b).view(np.float32)) for b in (0x7FC00000, 0xFFC00001)] + [1.0, -float("inf"), 0.0]
    for p0, p1, q0, q1 in itertools.product(specials, repeat=4):
        v = torch.ones(r * (n + m))
        v[0], v[1], v[n * r], v[n * r + 1] = p0, p1, q0, q1
        got = codec.reducer.expand(v, None, seg)
        want = reconstruct(v[: n * r].view(n, r), v[n * r:].view(m, r)).reshape(-1)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (p0, p1, q0, q1)


@pytest.mark.parametrize("clip", [False, True])
def test_terngrad_packed_groups_are_the_codes_loop_packed(clip):
    """tern_packed (groups of 32 in vector IR, a hash per two values, the codes never stored) writes
    pack(tern_codes(...))'s bytes: lengths around a group, odd starts (the codes loop), hash
    indices whose Weyl terms wrap 2**32, s = 0, and s below 2**-109 (s * 2**-17 not exact: the
    codes loop does all of it), strided x (the codes loop)."""
    k = kernels.get()
    g = np.random.default_rng(5)
    x = g.standard_normal(4099).astype(np.float32)
    x[::7] *= -1e-3
    x[5::11] = 0.0
    x[6::13] = -0.0
    codes, small = np.empty(4099, dtype=np.uint8), np.empty(16, dtype=np.uint8)
    for scale in (1.0, 1e-38):
        xs = (x * np.float32(scale)).astype(np.float32)
        top = np.float32(np.abs(xs).max())
        for s in (top, np.float32(top * np.float32(0.3)), np.float32(0.0)):
            bound = s if clip else np.float32(np.inf)
            for n in (1, 15, 16, 17, 31, 32, 33, 63, 65, 4099):
                for start in (0, 5, 2**32 - 3, 2**33 - 64, 2**33 - 6):
                    want = np.zeros((n + 3) // 4, dtype=np.uint8)
                    k.tern_codes(xs[:n], s, bound, clip, 12345, 678, start, codes)
                    k.pack(codes, n, 2, want)
                    got = np.full((n + 3) // 4 + 1, 0xAB, dtype=np.uint8)
                    k.tern_packed(xs[:n], s, bound, clip, 12345, 678, start, got, small)
                    assert got[:-1].tobytes() == want.tobytes(), (scale, s, n, start)
                    assert got[-1] == 0xAB  # nothing written past the codes
                    strided = np.repeat(xs[:n], 2)[::2]
                    got[:] = 0xAB
                    k.tern_packed(strided, s, bound, clip, 12345, 678, start, got, small)
                    assert got[:-1].tobytes() == want.tobytes(), (scale, s, n, start)
    assert np.float32(top * np.float32(2.0**-17)) * np.float32(2.0**17) != top  # the second scale: the fallback


@pytest.mark.parametrize("spec,code", [("twobit()", 1), ("terngrad()", 3)])
def test_unused_two_bit_code_is_refused_before_adding(spec, code, monkeypatch):
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    codec = fedcomp.build_codec(spec)
    layout = fedcomp.Layout.of({"x": torch.zeros(1000)})
    good = codec.encode({"x": torch.randn(1000)}, nonce=1).payload
    acc = Accumulator(codec, layout)
    acc.add(good, 2.0)
    before = acc.sum()["x"]
    body = bytearray(good)
    body[-5] = (body[-5] & 0b11111100) | code  # the last code of the last tensor: the unused one
    from fedcomp.wire import crc32
    body[-4:] = crc32(bytes(body[:-4])).to_bytes(4, "little")
    with pytest.raises(fedcomp.DecodeError, match="unused code"):
        acc.add(bytes(body), 1.0)
    assert torch.equal(acc.sum()["x"], before) and acc.count == 1


def test_square_sums_of_codes_are_the_values_and_see_overflow():
    """The check pass's closed forms (exact integer sums of codes) against the fp32 values one by
    one; a block whose values overflow fp32 gives inf, one that only comes near does not."""
    k = kernels.get()
    g = np.random.default_rng(0)
    codes = g.integers(0, 16, 3000).astype(np.uint8)
    lo = g.normal(size=12).astype(np.float32)
    scale = g.random(12).astype(np.float32)
    values = codes.astype(np.float32) * np.repeat(scale, 256)[:3000] + np.repeat(lo, 256)[:3000]
    want = float(np.sum(values.astype(np.float64) ** 2))
    assert math.isclose(k.kbit_sq(codes, lo, scale, 256, 0, 3000, 15), want, rel_tol=1e-6)
    assert math.isclose(k.kbit_sq(codes, lo, scale, 256, 700, 2900, 15),
                        float(np.sum(values[700:2900].astype(np.float64) ** 2)), rel_tol=1e-6)
    unit = g.random(12).astype(np.float32)
    levels = (codes & 7).astype(np.float32) * np.repeat(unit, 256)[:3000]
    assert math.isclose(k.qsgd_sq(codes, unit, 3, 256, 0, 3000), float(np.sum(levels.astype(np.float64) ** 2)),
                        rel_tol=1e-6)
    big_lo, big_scale = np.array([-1e38], np.float32), np.array([3e37], np.float32)
    assert math.isinf(k.kbit_sq(np.array([15], np.uint8), big_lo, big_scale, 256, 0, 1, 15))  # 15 x 3e37 overflows
    assert k.kbit_sq(np.array([0, 1], np.uint8), big_lo, big_scale, 256, 0, 2, 15) == pytest.approx(1e76 + 4.9e75, rel=1e-6)  # -1e38, -7e37: finite
    assert math.isinf(k.qsgd_sq(np.array([7], np.uint8), np.array([1e38], np.float32), 3, 256, 0, 1))
    assert math.isfinite(k.qsgd_sq(np.array([1], np.uint8), np.array([1e38], np.float32), 3, 256, 0, 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_conversions_in_the_loop_equal_torchs_for_every_pattern(dtype):
    """fp16 / bf16 values converted inside the add and square loops (F16C, a shift) are torch's
    for all 65,536 bit patterns but NaNs (refused by the check pass before any add)."""
    k = kernels.get()
    bits = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):
        want = fp._half_table(dtype).astype(np.float64)
    ok = ~np.isnan(want)
    s = np.zeros(1 << 16)
    k.add_half(bits, dtype == torch.bfloat16, s, 1.0)
    assert np.array_equal(s[ok], want[ok]) and np.isnan(s[~ok]).all()
    finite = np.isfinite(want)
    assert k.half_sq(bits[finite], dtype == torch.bfloat16) == pytest.approx(float(np.sum(want[finite] ** 2)), rel=1e-12)
    assert math.isinf(k.half_sq(bits[~np.isnan(want) & ~finite], dtype == torch.bfloat16))


@pytest.mark.parametrize("count", [0, 1, 3, 4, 5, 17, 1000, (1 << 22) + 7])
def test_count_codes2_counts_every_code(count):
    """The ternary codecs' check (a bad code refuses the reply) and norm (counts x squares)."""
    data = np.random.default_rng(count).integers(0, 256, count // 4 + 1).astype(np.uint8)
    codes = np.stack([(data >> s) & 3 for s in (6, 4, 2, 0)], axis=1).reshape(-1)[:count]
    assert kernels.get().count_codes2(data, count).tolist() == np.bincount(codes, minlength=4).tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_encoding_in_the_loop_equals_torchs(dtype):
    """fp16 / bf16 encode (kernels.to_half: clamp and convert in one pass) writes the bits of
    torch's clamp + conversion: random fp32 patterns (NaNs, infinities, subnormals included), every
    997th pattern, and the rounding and overflow edges."""
    edges = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FFFFFFF,
             0x477FE000, 0x477FEFFF, 0x477FF000, 0x38800000, 0x33800000, 0x33000000, 0x33000001, 0x3F808000,
             0x3F818000, 0x7F7FFFFF, 0x00000001, 0x807FFFFF]
    rng = np.random.default_rng(3)
    u = np.concatenate([np.array(edges, dtype=np.uint32), rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32),
                        np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32)])
    x = u.view(np.float32)
    out = np.empty(x.shape[0], dtype=np.uint16)
    kernels.get().to_half(x, dtype == torch.bfloat16, np.float32(fp._FP16_MAX), out)
    t = torch.from_numpy(x)
    if dtype == torch.float16:
        t = torch.clamp(t, -fp._FP16_MAX, fp._FP16_MAX)
    assert np.array_equal(out, t.to(dtype).view(torch.int16).numpy().view(np.uint16))


@pytest.mark.parametrize("n,k", [(1, 1), (100, 0), (100, 100), (5000, 7), (1 << 20, 999), (1 << 16, 3000)])
def test_rice_decode_loop_gives_the_torch_indices(n, k, monkeypatch):
    """Golomb-Rice index streams: the compiled pass and torch ops give the same indices, for
    every Rice parameter around the chosen one (0 included)."""
    g = torch.Generator().manual_seed(n + k)
    idx = torch.randperm(n, generator=g)[:k].sort().values
    best = bitpack.choose_rice_parameter(idx, n)
    for r in sorted({0, max(0, best - 2), best, best + 3}):
        unary, rem = bitpack.rice_encode(idx, r)
        fast = bitpack.rice_decode(unary, rem, k, r, n)
        with monkeypatch.context() as m:
            m.setattr(kernels, "get", lambda: None)
            slow = bitpack.rice_decode(unary, rem, k, r, n)
        assert torch.equal(fast, slow) and torch.equal(fast, idx), r


@pytest.mark.parametrize("defect", ["extra-zero", "missing-zero", "trailing-byte", "index-n", "gap", "short-rem"])
def test_rice_decode_loop_refuses_what_torch_refuses(defect):
    """A malformed stream raises the torch path's DecodeError (the loop only says it is bad)."""
    n, idx = 1000, torch.tensor([3, 40, 41, 900])
    k, r = idx.numel(), 4
    unary, rem = bitpack.rice_encode(idx, r)
    unary, rem = unary.clone(), rem.clone()
    if defect == "extra-zero":
        unary[-1] = 0
    elif defect == "missing-zero":
        k += 1
        rem = torch.cat([rem, torch.zeros(bitpack.packed_bytes(k, r) - rem.numel(), dtype=torch.uint8)])
    elif defect == "trailing-byte":
        unary = torch.cat([unary, torch.tensor([0xFF], dtype=torch.uint8)])
    elif defect == "index-n":
        n = 900
    elif defect == "gap":
        n = 40
    else:
        rem = rem[:-1]
    with pytest.raises(DecodeError):
        bitpack.rice_decode(unary, rem, k, r, n)


def test_rice_decode_refuses_a_gap_beyond_the_segment_on_both_paths(monkeypatch):
    """Every gap is checked, not only the last index: a remainder of r = 40 bits makes each gap up
    to 2**40, and enough of them would wrap int64's sum back below n (as strictly ascending
    positions below n is what the server adds without ordering them)."""
    n, r = 100, 40
    unary, rem = bitpack.rice_encode(torch.tensor([0, 1]), r)
    rem = torch.full_like(rem, 0xFF)  # each gap 2**40
    for compiled in (True, False):
        with monkeypatch.context() as m:
            if not compiled:
                m.setattr(kernels, "get", lambda: None)
            with pytest.raises(DecodeError, match="gap"):
                bitpack.rice_decode(unary, rem, 2, r, n)


class _FakeDispatcher:
    """Records the forced vector width in effect when numba would compile it."""

    def __init__(self, inner=None, fail=False):
        self.seen, self.inner, self.fail = [], inner, fail

    def compile(self, sig):
        from fedcomp._kernels import core as nk
        self.seen.append(nk._width[0])
        if self.inner is not None:
            self.inner.compile(sig)
        if self.fail:
            raise RuntimeError("typing failed")
        return sig


def test_vector_width_is_set_for_the_compile_and_restored():
    from fedcomp._kernels import core as nk
    inner = nk._vector_width(_FakeDispatcher(), 0)  # nested at another width, then back
    outer = nk._vector_width(_FakeDispatcher(inner), nk._WIDTH)
    assert outer.compile("sig") == "sig"
    assert outer.seen == [nk._WIDTH] and inner.seen == [0]
    assert nk._width[0] == 0
    failing = nk._vector_width(_FakeDispatcher(fail=True), nk._WIDTH)
    with pytest.raises(RuntimeError):
        failing.compile("sig")
    assert failing.seen == [nk._WIDTH] and nk._width[0] == 0  # restored on errors too


_FRESH_COMPILE = """
import sys, torch, fedcomp
from fedcomp import kernels
assert kernels.for_encode() is not None
x = {"w": torch.randn(20000, generator=torch.Generator().manual_seed(3))}
for spec in sys.argv[1:]:
    sys.stdout.write(fedcomp.build_codec(spec).encode(x, nonce=5, round=2, state={}).payload.hex() + "\\n")
"""


def test_wide_kernels_compile_quietly_to_the_torch_paths_bytes(tmp_path, monkeypatch):
    """A fresh numba cache: the 16-lane encoders compile (LLVM prints nothing: a loop it cannot
    vectorize at a forced width would print a remark) and write the torch path's bytes."""
    import subprocess
    import sys

    specs = ["qsgd(bits=4)", "kbit(bits=4,stochastic=true)", "kbit(bits=8)", "terngrad()"]
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), FEDCOMP_KERNELS="1")
    got = subprocess.run([sys.executable, "-c", _FRESH_COMPILE, *specs], env=env, capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr
    assert "remark" not in got.stderr and "vectorized" not in got.stderr, got.stderr
    monkeypatch.setenv("FEDCOMP_KERNELS", "0")  # the torch path, here
    x = {"w": torch.randn(20000, generator=torch.Generator().manual_seed(3))}
    expected = [fedcomp.build_codec(spec).encode(x, nonce=5, round=2, state={}).payload.hex() for spec in specs]
    assert got.stdout.split() == expected


def test_software_half_conversions_are_the_hardwares_bits():
    """Where x86 has no F16C the loops convert fp16 in integer operations (LLVM's own lowering
    calls compiler-rt, which numba does not link: the process aborted): every fp16 pattern to
    fp32, and fp32 to fp16 around every boundary (subnormals, the smallest normal, 65504 and
    65520, inf and NaN payloads) and on random patterns, bit for bit F16C's (this machine's
    instructions where it has them; else the fp16 values torch converts)."""
    from numba import njit

    import fedcomp._kernels.core as nk

    def converter(up, down):  # one loop per pair (the hardware's must not compile where it has none)
        @njit
        def convert(half, out32, xs, out16):
            for b in range(half.shape[0]):
                out32[b] = up(half[b])
            for j in range(xs.shape[0]):
                out16[j] = down(xs[j])
        return convert
    g = np.random.default_rng(9)
    edges = [np.arange(a - 3000, a + 3000, dtype=np.int64) for a in (0, 0x33000000, 0x38800000, 0x477FE000, 0x477FF000,
                                                                      0x7F800000, 0x7FC00000)]
    bits = np.concatenate(edges + [g.integers(0, 1 << 32, 300_000)]) & 0xFFFFFFFF
    bits = np.concatenate([bits, bits ^ 0x80000000]).astype(np.uint32)
    xs = bits.view(np.float32)
    half = np.arange(1 << 16, dtype=np.uint16)
    soft32, soft16 = np.empty(1 << 16, np.float32), np.empty(xs.size, np.uint16)
    converter(nk._half_f32_soft, nk._f32_half_soft)(half, soft32, xs, soft16)
    if nk._hardware_half() and nk._half_f32 is nk._half_f32_hw:
        hw32, hw16 = np.empty(1 << 16, np.float32), np.empty(xs.size, np.uint16)
        converter(nk._half_f32_hw, nk._f32_half_hw)(half, hw32, xs, hw16)
        assert np.array_equal(soft32.view(np.uint32), hw32.view(np.uint32))
        assert np.array_equal(soft16, hw16)
    finite = ~np.isnan(xs)  # torch's own conversion: the same values (NaN payloads aside)
    want16 = torch.from_numpy(xs[finite]).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(soft16[finite], want16)
    ordinary = (half & 0x7C00) != 0x7C00
    assert np.array_equal(soft32[ordinary], torch.from_numpy(half[ordinary].view(np.float16)).float().numpy())


def test_loops_compile_and_run_without_f16c(tmp_path, monkeypatch):
    """Compiled for an x86-64 without F16C (NUMBA_CPU_FEATURES), the loops that convert fp16 build
    and give the torch path's bytes and values (before, LLVM aborted the process)."""
    import subprocess
    import sys

    if not nk_is_x86():
        pytest.skip("an x86 feature set")
    specs = ["fp16()", "kbit(bits=4)", "none()"]
    code = _FRESH_COMPILE + """
from fedcomp._kernels import core as nk
from fedcomp.aggregate import Accumulator
assert not nk._hardware_half() and nk._half_f32 is nk._half_f32_soft
layout = fedcomp.Layout.of({"h": torch.zeros(3000, dtype=torch.float16)})
for spec in sys.argv[1:]:
    codec = fedcomp.build_codec(spec)
    h = {"h": torch.randn(3000, generator=torch.Generator().manual_seed(4)).half()}
    payload = codec.encode(h, nonce=1).payload
    acc = Accumulator(codec, layout)
    acc.add(payload, 1.0)
    sys.stdout.write(payload.hex() + " " + acc.sum()["h"].double().numpy().tobytes().hex() + "\\n")
"""
    features = "+64bit,+sse,+sse2,+cmov,+cx16,+mmx,-avx,-avx2,-fma,-f16c,-avx512f"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), FEDCOMP_KERNELS="1", NUMBA_CPU_NAME="x86-64",
               NUMBA_CPU_FEATURES=features)
    got = subprocess.run([sys.executable, "-c", code, *specs], env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    lines = got.stdout.split("\n")
    monkeypatch.setenv("FEDCOMP_KERNELS", "0")
    x = {"w": torch.randn(20000, generator=torch.Generator().manual_seed(3))}
    layout = fedcomp.Layout.of({"h": torch.zeros(3000, dtype=torch.float16)})
    expected = [fedcomp.build_codec(spec).encode(x, nonce=5, round=2, state={}).payload.hex() for spec in specs]
    assert lines[:len(specs)] == expected
    for spec, line in zip(specs, lines[len(specs):]):
        codec = fedcomp.build_codec(spec)
        h = {"h": torch.randn(3000, generator=torch.Generator().manual_seed(4)).half()}
        payload = codec.encode(h, nonce=1).payload
        acc = Accumulator(codec, layout)
        acc.add(payload, 1.0)
        assert line == payload.hex() + " " + acc.sum()["h"].double().numpy().tobytes().hex(), spec


def nk_is_x86() -> bool:
    import llvmlite.binding as llvm

    return llvm.get_process_triple().startswith(("x86_64", "i386", "i686"))


@pytest.mark.parametrize("spec", ["terngrad()", "sign(scale='rms')", "sign()"])
def test_blocks_just_below_a_power_of_two_sum_exactly_in_the_max_loop(spec, monkeypatch):
    """Whole 65,536-value blocks of 0.99999: |q| = 2**20 - 10 each, so a chunk's sum of squares
    comes within 0.01% of 2**53, the largest exact one; every block after the first takes its sums
    in the max's loop (the k of the block before). The kernels' bytes are the torch path's
    (a cut-off below 2**53 had dropped those sums: a negative variance, a wrong rms scale)."""
    values = {"const": torch.full((2 * 65536 + 7,), 0.99999), "pair": torch.tensor([0.99999, 0.99998]).repeat(65540)}
    codec = fedcomp.build_codec(spec)
    for name, x in values.items():
        payloads = []
        for flag in ("0", "1"):
            monkeypatch.setenv("FEDCOMP_KERNELS", flag)
            payloads.append(codec.encode({"w": x}, nonce=3, round=1, state={}).payload)
        assert payloads[0] == payloads[1], name
        if spec == "sign(scale='rms')":  # the rms of +-0.99999... is 0.99999...
            assert float(codec.decode(payloads[1], fedcomp.Layout.of({"w": x}))["w"].abs().max()) == pytest.approx(0.99999, rel=1e-5)
