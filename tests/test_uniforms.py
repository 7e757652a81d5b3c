"""The counter-based uniforms of stochastic rounding (fedcomp.uniforms): one definition, the same
bits from Python, torch ops and the fused loops, uniform and unbiased enough, reproducible from
the caller's generator; TernGrad's exact-integer std and sign's exact-integer scale."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fedcomp
from fedcomp import bitpack, kernels, uniforms
from fedcomp.base import block_size
from fedcomp.codecs import blockwise, fastpath, terngrad
from fedcomp.codecs.sparsify import RandomK
from fedcomp.wire import Writer

KEYS = [(0, 0), (0xDEADBEEF, 0x12345678), (0xFFFFFFFF, 0xFFFFFFFF), (1, 0x80000000)]
STARTS = [0, 5, (1 << 31) - 100, (1 << 32) - 100, (1 << 40) + 3]


@pytest.mark.parametrize("key", KEYS)
def test_torch_fill_is_the_definition(key):
    for start in STARTS:
        out = uniforms.fill(key, start, torch.empty(300))
        ref = torch.tensor([uniforms.reference(key, start + j) for j in range(300)], dtype=torch.float64)
        assert torch.equal(out.double(), ref), start


@pytest.mark.skipif(kernels.get() is None, reason="numba not installed")
@pytest.mark.parametrize("key", KEYS)
def test_kernel_uniforms_have_the_torch_bits(key):
    import numpy as np

    k = kernels.get()
    for start in STARTS:
        a = uniforms.fill(key, start, torch.empty(5000))
        b = torch.empty(5000)
        k.uniforms(np.uint32(key[0]), np.uint32(key[1]), start, b.numpy())
        assert torch.equal(a, b), start


@pytest.mark.parametrize("key", KEYS)
def test_half_width_fill_is_the_definition_on_both_paths(key):
    """TernGrad's uniforms: the low half of h_m for element 2m, the high half for 2m + 1, from
    torch ops (with and without a work buffer; even and odd starts, one element, hash indices past
    2**32) and from the compiled loop."""
    k = kernels.get()
    for start in STARTS + [1, (1 << 33) - 7]:
        for n in (1, 2, 3, 300):
            ref = torch.tensor([uniforms.reference16(key, start + j) for j in range(n)], dtype=torch.float64)
            assert torch.equal(uniforms.fill16(key, start, torch.empty(n)).double(), ref), (start, n)
            work = torch.full((2 * n,), -1, dtype=torch.int32)
            assert torch.equal(uniforms.fill16(key, start, torch.empty(n), work).double(), ref), (start, n)
            if k is not None:
                b = torch.empty(n)
                k.uniforms16(np.uint32(key[0]), np.uint32(key[1]), start, b.numpy())
                assert torch.equal(b.double(), ref), (start, n)
    h = uniforms.reference_hash(key, 3)
    assert uniforms.reference16(key, 6) == ((h & 0xFFFF) + 0.5) / 2**16  # centred in its cell
    assert uniforms.reference16(key, 7) == ((h >> 16) + 0.5) / 2**16


def test_half_width_uniforms_are_uniform_and_uncorrelated():
    """The two halves of one hash are two uniforms: cell centres (m + 1/2) / 2**16, mean and
    variance, a histogram, no correlation at lag 1 (the pair of one hash) or further, independent
    keys."""
    n = 1 << 20
    u = uniforms.fill16((0x2545F491, 0x9E3779B9), 0, torch.empty(n)).double()
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert torch.equal(u * 2**16 - 0.5, (u * 2**16 - 0.5).round())
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    counts = torch.histc(u, bins=64, min=0, max=1)
    chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 63 + 6 * math.sqrt(2 * 63)
    c = u - 0.5
    pairs = float((c[0::2] * c[1::2]).mean()) * 12  # the two halves of each hash
    assert abs(pairs) < 5 / math.sqrt(n / 2)
    for lag in (1, 2, 3, 32, 513):
        corr = float((c[:-lag] * c[lag:]).mean()) * 12
        assert abs(corr) < 5 / math.sqrt(n), lag
    v = uniforms.fill16((0x2545F491, 0x9E3779B8), 0, torch.empty(n)).double() - 0.5
    assert abs(float((c * v).mean()) * 12) < 5 / math.sqrt(n)


def test_terngrad_keeps_with_a_over_s_rounded_to_the_nearest_cell():
    """P(sent) = #{m < 2**16: fp32((m + 1/2) / 2**16 * s) < a} / 2**16, counted over every m: a / s
    to within 2**-17 either way (and the fp32 product's rounding), and a value below s * 2**-17 is
    never sent (with u = m / 2**16, m = 0 sent every a > 0: a bias of up to 2**-16 away from zero,
    adding up over a tensor)."""
    m = np.arange(1 << 16, dtype=np.float32)
    u = (m * 2 + 1) * np.float32(2.0**-17)
    for s in (np.float32(1.0), np.float32(0.37), np.float32(3e-5), np.float32(2.0**-100)):
        g = np.random.default_rng(3)
        for p in list(g.random(200)) + [1.0, 0.0, 2.0**-18, 2.0**-17 * 0.99, 2.0**-17 * 1.01, 1e-7, 1 - 2.0**-18]:
            a = np.float32(p * s)
            sent = float(np.count_nonzero(u * s < a)) / 2**16
            assert abs(sent - float(a) / float(s)) <= 2.0**-17 + 2.0**-22, (s, p)  # and the product's rounding
        assert np.count_nonzero(u * s < np.float32(s * np.float32(2.0**-17 * 0.99))) == 0
    # the tensor-wide sum of tiny values: sent as zero now, not as 100,000 * 2**-16 = 1.5
    x = torch.full((100_001,), 1e-7)
    x[0] = 1.0
    codec = fedcomp.build_codec("terngrad(clip=0)")
    tiny = sum(float(codec.decode(codec.encode({"x": x}, nonce=r).payload, fedcomp.Layout.of({"x": x}))["x"][1:].sum())
               for r in range(20))
    assert tiny == 0.0


def test_uniforms_are_uniform_and_uncorrelated():
    n = 1 << 20
    u = uniforms.fill((0x2545F491, 0x9E3779B9), 0, torch.empty(n)).double()
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert torch.equal(u * 2**24, (u * 2**24).round())  # 24-bit values, like fp32 torch.rand
    sd_mean = math.sqrt(1 / 12 / n)
    assert abs(float(u.mean()) - 0.5) < 5 * sd_mean
    assert abs(float(u.var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / n)  # var of (u - 1/2)^2: 1/180
    counts = torch.histc(u, bins=64, min=0, max=1)
    chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 63 + 6 * math.sqrt(2 * 63)  # 63 degrees of freedom, 6 sd
    c = u - 0.5
    for lag in (1, 2, 8, 512):
        corr = float((c[:-lag] * c[lag:]).mean()) * 12
        assert abs(corr) < 5 / math.sqrt(n), lag
    # two keys differing in one bit: independent streams, not shifts of one another
    v = uniforms.fill((0x2545F491, 0x9E3779B8), 0, torch.empty(n)).double() - 0.5
    assert abs(float((c * v).mean()) * 12) < 5 / math.sqrt(n)


def test_key_comes_from_the_callers_generator():
    a = uniforms.draw_key(torch.Generator().manual_seed(7), torch.device("cpu"))
    b = uniforms.draw_key(torch.Generator().manual_seed(7), torch.device("cpu"))
    c = uniforms.draw_key(torch.Generator().manual_seed(8), torch.device("cpu"))
    assert a == b != c and all(0 <= v < 1 << 32 for v in a + c)


def test_reseeded_generators_draw_each_segments_own_keys():
    from fedcomp.base import StageContext
    ctx = StageContext(nonce=12345)
    segments = [4, 0, 9, 4]
    gen = ctx.generators(segments)
    drawn = [uniforms.draw_key(gen(i), torch.device("cpu")) for i in (2, 0, 1, 3, 2)]  # any order, repeats
    own = [uniforms.draw_key(ctx.generator(segments[i]), torch.device("cpu")) for i in (2, 0, 1, 3, 2)]
    assert drawn == own and len(set(own)) == 3


@pytest.mark.skipif(kernels.get() is None, reason="numba not installed")
def test_compiled_stream_keys_are_the_keys_torch_draws():
    """``fedcomp._kernels.stream_keys`` (MT19937's 2nd and 4th outputs) against torch's generator."""
    import numpy as np

    from fedcomp.base import StageContext

    g = torch.Generator().manual_seed(11)
    seeds = [0, 1, 5489, (1 << 32) - 1, 1 << 32, (1 << 63) - 1] + torch.randint(0, 1 << 62, (300,), generator=g).tolist()
    seeds += [StageContext(nonce=n)._seed(j) for n in (0, 1, (1 << 64) - 1) for j in range(5)]
    k0s, k1s = np.empty(len(seeds), dtype=np.uint32), np.empty(len(seeds), dtype=np.uint32)
    kernels.get().stream_keys(np.array(seeds, dtype=np.int64), k0s, k1s)
    gen = torch.Generator()
    want = [uniforms.draw_key(gen.manual_seed(s), torch.device("cpu")) for s in seeds]
    assert list(zip(k0s.tolist(), k1s.tolist())) == want
    ctx = StageContext(nonce=99)
    reseeded = ctx.generators([3, 0, 7])
    got = fastpath._stream_keys(kernels.get(), reseeded, [torch.zeros(1)] * 3)  # the run path's keys
    ref = fastpath._run_keys([uniforms.draw_key(ctx.generator(j), torch.device("cpu")) for j in (3, 0, 7)])
    assert all(np.array_equal(a, b) for a, b in zip(got, ref)) and len(set(got[0].tolist())) == 3


@pytest.mark.parametrize("spec", ["qsgd(bits=4)", "qsgd(bits=2,bucket=0)", "terngrad(clip=0)", "kbit(bits=2,stochastic=true)"])
def test_one_encode_is_unbiased_over_many_elements(spec):
    """Within one encode (one key) the rounding errors of 262,144 elements average out: the mean
    error is within 5 standard deviations of zero (seeded: not flaky)."""
    n = 1 << 18
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 0.01 + 0.004
    q = fedcomp.build_codec(spec).quantizer
    err = (q.encode(x, Writer(), torch.Generator().manual_seed(4)) - x).double()
    assert float(err.abs().max()) > 0
    assert abs(float(err.mean())) < 5 * float(err.std()) / math.sqrt(n)


def test_terngrad_std_is_torchs_to_its_precision(monkeypatch):
    g = torch.Generator().manual_seed(5)
    cases = [torch.randn(300_001, generator=g) * 1e-3 + 2e-4,
             torch.cat([torch.randn(70_000, generator=g) * 1e-30, torch.randn(70_000, generator=g) * 1e20]),
             torch.full((70_000,), 0.25), torch.randn(2, generator=g)]
    cases[1][::1000] = 0.0
    for block in (1 << 16, 64):
        monkeypatch.setattr(blockwise, "_STD_BLOCK", block)
        for x in cases:
            amax, std = terngrad._tern_stats_torch(x, True)
            assert amax == float(x.abs().max())
            assert math.isclose(std, float(x.double().std()), rel_tol=1e-6, abs_tol=0), (block, x.numel())
            if kernels.get() is not None:
                assert terngrad._tern_stats_kernel(x, True, kernels.get()) == (amax, std)


def test_shifted_block_sums_are_exact():
    """Many blocks' integer sums (added in numpy by their k, high and low 32 bits apart) equal the
    sum in Python integers: extreme values of both signs, one shared k and k spread widely."""
    rng = np.random.default_rng(1)
    for trial in range(120):
        n, power = int(rng.integers(1, 600)), 1 + trial % 2
        lim = 2**56 if power == 2 else 2**36  # |sum q| <= 2**36 and sum q^2 <= 2**56 per block
        s = rng.integers(-lim if power == 1 else 0, lim, n, dtype=np.int64)
        if trial % 3 == 0:
            s[:] = lim - 1
        if trial % 5 == 0:
            s[:] = -lim if power == 1 else 0
        ks = rng.integers(-130, 130, n) if trial % 4 < 2 else 7 + (rng.random(n) < 0.05)
        top = int(ks.max())
        want = sum(int(v) << power * (top - int(k)) for v, k in zip(s.tolist(), ks.tolist()))
        assert blockwise._shifted_sum(s.tolist(), ks.tolist(), top, power) == want
        assert blockwise._shifted_sum(s, ks, top, power) == want


def _sign_payload(spec: str, x: torch.Tensor, flag: str, monkeypatch, write: bool) -> bytes:
    monkeypatch.setenv("FEDCOMP_KERNELS", flag)
    q, w = fedcomp.build_codec(spec).quantizer, Writer()
    (q.write if write else q.encode)(x, w, None)
    return b"".join(bytes(p.numpy()) for p in w.parts)


@pytest.mark.parametrize("spec", ["sign()", "sign(scale='rms')", "sign(block=2500)", "sign(block=300,scale='rms')"])
def test_sign_scale_is_the_float64_one_to_its_precision(spec, monkeypatch):
    """Sign's scale from exact integer sums (parts of _STD_BLOCK, several per block here) is the
    float64 mean |x| / rms within 1e-6, on Gaussian, heavy-tailed (Cauchy) and mixed-magnitude
    values, with the same bytes from encode and write, fused loop and torch ops."""
    monkeypatch.setattr(blockwise, "_STD_BLOCK", 1000)
    g = torch.Generator().manual_seed(11)
    cauchy = torch.tan(math.pi * (torch.rand(7001, generator=g) - 0.5))
    mixed = torch.cat([torch.randn(3000, generator=g) * 1e-30, torch.randn(4001, generator=g) * 1e20])
    q = fedcomp.build_codec(spec).quantizer
    for x in (torch.randn(7001, generator=g) * 1e-3, cauchy, mixed):
        payloads = {_sign_payload(spec, x, flag, monkeypatch, write) for flag in ("0", "1") for write in (False, True)}
        assert len(payloads) == 1
        size = block_size(x.numel(), q.config.block)
        nb = -(-x.numel() // size)
        scale = torch.frombuffer(bytearray(payloads.pop()[:4 * nb]), dtype=torch.float32).double()
        for b in range(nb):
            v = x[b * size:(b + 1) * size].double()
            ref = v.abs().mean() if q.config.scale == "mean" else v.square().mean().sqrt()
            assert math.isclose(float(scale[b]), float(ref), rel_tol=1e-6), (b, float(scale[b]), float(ref))


def test_sign_scale_of_values_not_finite_is_nan_or_inf_in_their_block(monkeypatch):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(12))
    x[10], x[1200], x[1300], x[2500] = float("nan"), float("inf"), float("nan"), -float("inf")
    for spec in ("sign(block=1000)", "sign(block=1000,scale='rms')", "sign()"):
        payloads = {_sign_payload(spec, x, flag, monkeypatch, write) for flag in ("0", "1") for write in (False, True)}
        assert len(payloads) == 1, spec
        body = payloads.pop()
        nb = 5 if "1000" in spec else 1
        scale = torch.frombuffer(bytearray(body[:4 * nb]), dtype=torch.float32)
        if nb == 1:
            assert math.isnan(scale[0])
            continue
        assert math.isnan(scale[0]) and math.isnan(scale[1]) and scale[2] == float("inf")
        assert bool(torch.isfinite(scale[3:]).all())
        negative = bitpack.unpack_bits(torch.frombuffer(bytearray(body[4 * nb:]), dtype=torch.uint8), 5000, 1).bool()
        assert torch.equal(negative, x < 0)  # NaN: not negative


def test_qsgd_of_a_subnormal_bucket_with_zeros_decodes_finite():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(9)) * 1e-40
    x[::7] = 0.0
    q = fedcomp.build_codec("qsgd(bits=4)").quantizer
    y = q.encode(x, Writer(), torch.Generator().manual_seed(2))
    assert bool(torch.isfinite(y).all()) and bool((y[::7] == 0).all())
    assert float((y - x).abs().max()) <= float(x.abs().max()) / 7 * 1.0001  # within one level


def test_terngrad_scale_is_the_clipped_max_and_codes_follow_the_bound():
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(6))
    x[7] = 40.0  # far past 2.5 std: clipped
    q = fedcomp.build_codec("terngrad(clip=2.5)").quantizer
    w = Writer()
    y = q.encode(x, w, torch.Generator().manual_seed(1))
    bound = torch.tensor(2.5, dtype=torch.float32) * torch.tensor(float(x.double().std()), dtype=torch.float32)
    assert math.isclose(float(y.abs().max()), float(bound), rel_tol=1e-6)
    assert set(y.unique().tolist()) <= {0.0, float(y.abs().max()), -float(y.abs().max())}
    assert float(y[7]) == float(y.abs().max())  # |x| >= bound: sent with probability 1


@pytest.mark.parametrize("n,k", [(10, 0), (10, 10), (10, 9), (1000, 7), (70000, 3000), (1 << 17, 1 << 16), (300001, 1)])
def test_smallest_hashes_same_on_every_path(n, k, monkeypatch):
    """randomk's positions: the k smallest (hash, position) of the stream, ascending, distinct; the
    one-pass loop, its exact fallback (sigmas=0 makes the band miss) and torch ops agree."""
    key = (123456789, 987654321)
    fast = uniforms.smallest(key, n, k)
    exact = uniforms.smallest(key, n, k, sigmas=0.0)
    monkeypatch.setattr(kernels, "get", lambda: None)
    torch_ops = uniforms.smallest(key, n, k)
    assert torch.equal(fast, torch_ops) and torch.equal(exact, torch_ops)
    assert fast.numel() == k and bool((fast[1:] > fast[:-1]).all()) and (k == 0 or 0 <= int(fast[0]) <= int(fast[-1]) < n)
    if n == 1000:  # the definition, in plain Python
        assert fast.tolist() == sorted(i for _, i in sorted((_h32(key, i), i) for i in range(n))[:k])


_h32 = uniforms.reference_hash  # the 32-bit hash of element i (u_i is its top 24 bits)


def test_randomk_older_formats_still_decode(monkeypatch):
    """randomk payloads of format 1 (randperm) and 2 (smallest hashes) decode to the positions
    they were drawn at; format 3 draws one per stratum; each gives the update's values there."""
    x = {"w": torch.randn(5000, generator=torch.Generator().manual_seed(0))}
    codec = fedcomp.build_codec("randomk(ratio=0.05,rescale=false)")
    layout = fedcomp.Layout.of(x)
    encoded = {3: codec.encode(x, nonce=3)}
    for version in (1, 2):
        monkeypatch.setattr(RandomK, "wire_version", version)
        encoded[version] = fedcomp.build_codec("randomk(ratio=0.05,rescale=false)").encode(x, nonce=3)
        monkeypatch.undo()
    kept = {}
    for version, enc in encoded.items():
        assert enc.payload[2] == version
        got = codec.decode(enc.payload, layout)["w"]
        kept[version] = got != 0
        assert int(kept[version].sum()) == 250 and torch.equal(got[kept[version]], x["w"][kept[version]])
    assert not torch.equal(kept[1], kept[2]) and not torch.equal(kept[2], kept[3])
    assert kept[3].view(250, 20).sum(1).eq(1).all()  # format 3: one in each stratum of 20


@pytest.mark.parametrize("n,k", [(10, 0), (10, 10), (10, 3), (7, 1), (1000, 7), (300001, 99999), (1 << 20, 1 << 16)])
def test_strata_same_on_every_path(n, k, monkeypatch):
    """randomk's format-3 positions: one per stratum (sizes n // k, the first n % k one more),
    ascending, distinct; the compiled loop, torch ops and plain Python agree."""
    key = (123456789, 987654321)
    fast = uniforms.strata(key, n, k)
    monkeypatch.setattr(kernels, "get", lambda: None)
    monkeypatch.setattr(kernels, "for_encode", lambda: None)
    assert torch.equal(fast, uniforms.strata(key, n, k))
    assert fast.numel() == k and bool((fast[1:] > fast[:-1]).all())
    sizes = uniforms.stratum_sizes(n, k, torch.int64)
    assert k == 0 or int(sizes.sum()) == n and int(sizes.max()) - int(sizes.min()) <= 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    assert bool((fast >= bounds[:-1]).all() and (fast < bounds[1:]).all())
    if k and n <= 1000:  # the definition, in plain Python
        s, r = divmod(n, k)
        k1 = (key[0], key[1] ^ uniforms.STRATA)
        want = [j * s + min(j, r) + (_h32(k1, j) * (s + (j < r)) >> 32) for j in range(k)]
        assert fast.tolist() == want


def test_randomk_rescaled_is_unbiased_per_stratum():
    """Rescaled random-k multiplies a kept value by its stratum's size: over many draws the mean
    of the decoded update is the update, also where strata differ in size (n % k != 0)."""
    x = {"w": torch.linspace(-1, 1, 103)}
    codec = fedcomp.build_codec("randomk(ratio=0.1)")  # k = 11: 4 strata of 10, 7 of 9
    layout = fedcomp.Layout.of(x)
    mean = sum(codec.decode(codec.encode(x, nonce=i).payload, layout)["w"].double() for i in range(4000)) / 4000
    assert float((mean - x["w"].double()).abs().max()) < 0.2  # ~4 standard errors; unscaled would be 0.9 off
    one = codec.decode(codec.encode(x, nonce=1).payload, layout)["w"]
    ratio = (one[one != 0] / x["w"][one != 0]).round().tolist()
    assert sorted(set(ratio)) == [9.0, 10.0] and ratio[:4] == [10.0] * 4
