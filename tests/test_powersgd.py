"""PowerSGD (``powersgd``): exact on rank-r input, never better than the truncated SVD and close
to it once warm-started, per-tensor policy (factors or raw values) with exact sizes, error
feedback bookkeeping, and device-independent decoding.

The references here (SVD optimum, rank-r inputs, size formulas) are computed independently of
fedcomp.powersgd.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp import Layout, SpecError, build_codec, compress

OVERHEAD = 28  # wire header 24 + CRC trailer 4
STATE_KEY = "powersgd.q/{}"


def low_rank(n: int, m: int, r: int, scale: float, gen: torch.Generator) -> torch.Tensor:
    """An n x m matrix of rank exactly r (almost surely), Frobenius norm about ``scale``."""
    a = torch.randn(n, r, generator=gen, dtype=torch.float64)
    b = torch.randn(r, m, generator=gen, dtype=torch.float64)
    x = a @ b
    return (x * (scale / x.norm())).float()


def svd_tail(x: torch.Tensor, r: int) -> float:
    """||x - best rank-r approximation||_F: the root of the sum of the squared tail singular values."""
    s = torch.linalg.svdvals(x.double().reshape(x.shape[0], -1))
    return float(s[r:].pow(2).sum().sqrt())


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


# -- exactness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("r", [1, 2, 4])
def test_rank_r_input_is_exact_for_every_tensor(r):
    """Cold start, one encode: every tensor of rank r comes back, whatever the norms of tensors
    that share its shape (factors normalised across a batch of matrices would fail this)."""
    g = torch.Generator().manual_seed(r)
    tensors = {f"same{i}.weight": low_rank(64, 48, r, scale, g) for i, scale in enumerate([1e-4, 1.0, 1e4, 3e-2])}
    tensors["conv.weight"] = low_rank(16, 72, r, 0.5, g).view(16, 8, 3, 3)  # viewed as 16 x 72
    tensors["tall.weight"] = low_rank(200, 24, r, 2.0, g)
    codec = build_codec(f"powersgd(rank={r})")
    enc = codec.encode(tensors, nonce=3)
    decoded = codec.decode(enc.payload, Layout.of(tensors))
    for name, x in tensors.items():
        assert rel_err(enc.decoded[name], x) < 1e-3, name
        assert torch.equal(decoded[name], enc.decoded[name]), name
    assert enc.kept == tuple(r * (t.shape[0] + t.numel() // t.shape[0]) for t in tensors.values())


def test_rank_below_r_is_exact_too():
    """A rank-1 matrix through rank 3: the extra columns of P_hat are arbitrary but orthonormal."""
    g = torch.Generator().manual_seed(0)
    x = {"w": low_rank(40, 30, 1, 1.0, g), "z": torch.zeros(40, 30)}
    enc = build_codec("powersgd(rank=3)").encode(x)
    assert rel_err(enc.decoded["w"], x["w"]) < 1e-4
    assert torch.equal(enc.decoded["z"], x["z"])


def test_rank_larger_than_matrix_is_clamped():
    """min_compression=0 factorises everything; rank 8 on a 3 x 5 matrix becomes rank 3 (exact)."""
    g = torch.Generator().manual_seed(1)
    x = {"w": torch.randn(3, 5, generator=g), "v": torch.randn(6, 2, generator=g)}
    enc = build_codec("powersgd(rank=8, min_compression=0)").encode(x)
    assert enc.kept == (3 * (3 + 5), 2 * (6 + 2))
    for name in x:
        assert rel_err(enc.decoded[name], x[name]) < 1e-5


# -- against the truncated SVD -------------------------------------------------------------------
def spectrum_matrix(n: int, m: int, gen: torch.Generator) -> torch.Tensor:
    """A matrix with singular values 1/k (k = 1, 2, ...): a gradient-like slow decay."""
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    k = min(n, m)
    s = 1.0 / torch.arange(1, k + 1, dtype=torch.float64)
    return (u[:, :k] * s) @ v[:, :k].t()


@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("quantizer", ["", "+fp16"])
def test_never_below_svd_optimum_and_close_after_warm_rounds(r, quantizer):
    g = torch.Generator().manual_seed(10 + r)
    for trial in range(3):
        m64 = spectrum_matrix(60, 40, g) if trial else torch.randn(60, 40, generator=g, dtype=torch.float64)
        x = m64.float()
        opt = svd_tail(x, r)
        codec = build_codec(f"powersgd(rank={r}){quantizer}")
        state: dict[str, torch.Tensor] = {}
        errs = []
        for rnd in range(10):
            enc, _ = compress(codec, {"w": x}, None, error_feedback=False, state=state, nonce=rnd)
            errs.append(float((enc.decoded["w"].double() - x.double()).norm()))
        assert min(errs) >= opt * (1 - 1e-5), (errs, opt)
        slack = 1.03 if not quantizer else 1.05
        assert errs[-1] <= slack * opt, (errs, opt)


@pytest.mark.parametrize("quantizer, bound", [("fp16", 1e-3), ("qsgd(bits=8)", 0.05), ("kbit(bits=8)", 0.05)])
def test_factors_are_balanced_for_block_scaled_quantizers(quantizer, bound):
    """P_hat has unit columns, Q the scale of M: sent as they are, a per-block scale set by Q
    crushes P_hat (qsgd: over 100% error). Balanced, the error does not depend on the scale of M."""
    g = torch.Generator().manual_seed(12)
    shape_only = low_rank(384, 512, 2, 1.0, g)
    codec = build_codec(f"powersgd(rank=2)+{quantizer}")
    errs = []
    for rms in (1.0, 1e-2, 1e-4, 1e-6):
        x = shape_only * (rms * math.sqrt(shape_only.numel()))
        errs.append(rel_err(codec.encode({"w": x}).decoded["w"], x))
    assert max(errs) <= bound, errs
    assert max(errs) <= 1.5 * min(errs) + 1e-6, errs


# -- warm start ------------------------------------------------------------------------------------
def test_warm_start_persists_and_is_used():
    g = torch.Generator().manual_seed(4)
    x = {"a.weight": spectrum_matrix(50, 30, g).float(), "a.bias": torch.randn(50, generator=g), "b.weight": spectrum_matrix(20, 64, g).float()}
    codec = build_codec("powersgd(rank=2)")
    cold = codec.encode(x)
    state: dict[str, torch.Tensor] = {}
    first = codec.encode(x, state=state)
    assert first.payload == cold.payload  # the first round is a cold start either way
    assert sorted(state) == sorted(STATE_KEY.format(n) for n in ("a.weight", "b.weight"))  # no state for raw tensors
    assert tuple(state[STATE_KEY.format("a.weight")].shape) == (30, 2)
    assert tuple(state[STATE_KEY.format("b.weight")].shape) == (64, 2)
    saved = {k: v.clone() for k, v in state.items()}
    second = codec.encode(x, state=state)
    assert second.payload != first.payload
    for name in ("a.weight", "b.weight"):
        e_cold = float((first.decoded[name] - x[name]).norm())
        e_warm = float((second.decoded[name] - x[name]).norm())
        assert e_warm < e_cold, name
    # the second encode started from the saved Q: replaying it from a copy gives the same bytes
    assert codec.encode(x, state={k: v.clone() for k, v in saved.items()}).payload == second.payload
    # without state, encodes do not drift: every one is the cold start
    assert codec.encode(x).payload == cold.payload


def test_stale_or_broken_state_falls_back_to_cold_start():
    g = torch.Generator().manual_seed(5)
    x = {"w": torch.randn(32, 24, generator=g)}
    codec = build_codec("powersgd(rank=2)")
    cold = codec.encode(x).payload
    for bad in (torch.randn(24, 3), torch.randn(32, 2), torch.full((24, 2), float("nan"))):
        state = {STATE_KEY.format("w"): bad}
        assert codec.encode(x, state=state).payload == cold
        assert tuple(state[STATE_KEY.format("w")].shape) == (24, 2)  # replaced by a good one
        assert bool(torch.isfinite(state[STATE_KEY.format("w")]).all())


def test_cold_start_depends_on_seed_not_global_rng():
    g = torch.Generator().manual_seed(6)
    x = {"w": torch.randn(32, 24, generator=g)}
    torch.manual_seed(123)
    a = build_codec("powersgd(rank=1)").encode(x).payload
    after = torch.rand(1)
    torch.manual_seed(999)
    b = build_codec("powersgd(rank=1)").encode(x).payload
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), after)  # encode drew nothing from the global RNG
    assert a == b
    c = build_codec("powersgd(rank=1, seed=1)").encode(x)
    assert c.payload[28:] != a[28:]  # another seed, another Q (different codec fingerprint aside)


# -- policy and sizes ---------------------------------------------------------------------------------
def expected_count(shape: tuple[int, ...], rank: int, min_compression: float) -> int:
    numel = math.prod(shape)
    if len(shape) < 2 or numel == 0:
        return numel
    n, m = shape[0], numel // shape[0]
    r = min(rank, n, m)
    return r * (n + m) if (n + m) * r * min_compression <= n * m else numel


POLICY_MODEL = {
    "scalar": (),
    "bias": (300,),
    "small": (3, 3),  # (3+3)*1*2 = 12 > 9: raw
    "edge": (4, 4),  # (4+4)*1*2 = 16 <= 16: factors (the rule is <=)
    "conv": (32, 16, 3, 3),  # 32 x 144
    "fc": (100, 50),
    "wide": (2, 500),  # (502)*2 = 1004 <= 1000? no: raw at rank 1
    "empty": (0, 5),
}


@pytest.mark.parametrize("spec, bytes_per_value", [("powersgd(rank=1)", 4), ("powersgd(rank=2)+fp16", 2), ("powersgd(rank=4)+bf16", 2)])
def test_raw_and_factor_paths_and_sizes(spec, bytes_per_value):
    g = torch.Generator().manual_seed(7)
    tensors = {name: torch.randn(shape, generator=g) for name, shape in POLICY_MODEL.items()}
    tensors["steps"] = torch.tensor(5, dtype=torch.int64)
    codec = build_codec(spec)
    rank = codec.reducer.config.rank
    layout = Layout.of(tensors)
    enc = codec.encode(tensors, nonce=1)
    want = tuple(expected_count(s, rank, 2.0) for s in POLICY_MODEL.values())
    assert enc.kept == want
    assert want[2] == 9  # small: raw
    assert want[3] == (8 if rank == 1 else 16)  # edge: factors at rank 1 only
    assert codec.size_bytes(layout) == len(enc.payload) == codec.size_bytes(layout, enc.kept, enc.index_bytes)
    assert len(enc.payload) == OVERHEAD + bytes_per_value * sum(want) + 8
    assert enc.index_bytes == (0,) * len(want)
    quantized = codec.quantizer
    for name, shape in POLICY_MODEL.items():
        raw = expected_count(shape, rank, 2.0) == math.prod(shape)
        if raw:  # raw path: exactly what the quantizer makes of the values
            x = tensors[name].reshape(-1)
            back = x.half().float() if quantized.name == "fp16" else x.bfloat16().float() if quantized.name == "bf16" else x
            assert torch.equal(enc.decoded[name].reshape(-1), back), name
        else:  # factor path: a rank-r matrix
            y = enc.decoded[name].reshape(shape[0], -1)
            assert int(torch.linalg.matrix_rank(y.double(), rtol=1e-4)) <= rank, name  # fp32 rounding aside
    decoded = codec.decode(enc.payload, layout)
    for name in tensors:
        assert torch.equal(decoded[name], enc.decoded[name]), name


def test_compression_rate_is_nm_over_r_n_plus_m():
    x = {"w": torch.randn(256, 512, generator=torch.Generator().manual_seed(8))}
    for r in (1, 2, 4, 8):
        body = len(build_codec(f"powersgd(rank={r})").encode(x).payload) - OVERHEAD
        assert body == 4 * r * (256 + 512)
        assert 4 * x["w"].numel() / body == pytest.approx(256 * 512 / (r * (256 + 512)))


@settings(max_examples=60, deadline=None, database=None)
@given(
    shape=st.lists(st.integers(0, 16), min_size=0, max_size=4).map(tuple),
    rank=st.integers(1, 50),
    min_compression=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]),
)
def test_any_shape_round_trips_with_the_stated_count(shape, rank, min_compression):
    x = {"t": torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))}
    codec = build_codec(f"powersgd(rank={rank}, min_compression={min_compression})")
    enc = codec.encode(x, state={})
    assert enc.kept == (expected_count(shape, rank, min_compression),)
    layout = Layout.of(x)
    assert codec.size_bytes(layout) == len(enc.payload)
    out = codec.decode(enc.payload, layout)
    assert torch.equal(out["t"], enc.decoded["t"]) and out["t"].shape == x["t"].shape
    assert bool(torch.isfinite(out["t"]).all())
    if len(shape) >= 2 and math.prod(shape):
        # P_hat P_hat^T M is an orthogonal projection of M: never larger than M
        assert float(out["t"].norm()) <= float(x["t"].norm()) * (1 + 1e-4) + 1e-6


# -- error feedback -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["powersgd(rank=1)", "powersgd(rank=2)+fp16"])
def test_error_feedback_identity_over_many_rounds(spec):
    """sum of decoded + final residual == sum of updates; the warm start rides along in state."""
    g = torch.Generator().manual_seed(9)
    base = {"fc.weight": torch.randn(40, 30, generator=g) * 0.05, "fc.bias": torch.randn(40, generator=g) * 0.01,
            "conv.weight": torch.randn(8, 4, 3, 3, generator=g) * 0.1, "steps": torch.tensor(0)}
    codec = build_codec(spec)
    residual, state = None, {}
    sum_u = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in base.items() if v.is_floating_point()}
    sum_d = {k: torch.zeros_like(v) for k, v in sum_u.items()}
    p_norms, norms = 0.0, []
    for t in range(60):
        u = {k: (v + 0.02 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v + t) for k, v in base.items()}
        p_norms += sum(float((u[k] + (residual[k] if residual else 0)).norm()) for k in sum_u)
        enc, residual = compress(codec, u, residual, nonce=t, state=state, round=t)
        for k in sum_u:
            sum_u[k] += u[k].double()
            sum_d[k] += enc.decoded[k].double()
        norms.append(math.sqrt(sum(float(r.norm()) ** 2 for r in residual.values())))
    assert STATE_KEY.format("fc.weight") in state
    gap = math.sqrt(sum(float((sum_u[k] - sum_d[k] - residual[k].double()).norm()) ** 2 for k in sum_u))
    assert gap <= 2**-21 * p_norms + 1e-9
    assert all(float(residual[k].norm()) > 0 for k in ("fc.weight", "conv.weight"))
    # the residual levels off (it would double from round 30 to 60 if it grew linearly)
    assert max(norms[30:]) <= 1.5 * max(norms[:30])


# -- spec -------------------------------------------------------------------------------------------------
def test_defaults_and_traits():
    codec = build_codec("powersgd")
    assert codec.spec == "powersgd(rank=2,min_compression=2.0,seed=0)"
    assert fedcomp.available_codecs()["powersgd"] == "powersgd(rank=2, min_compression=2.0, seed=0)"
    assert codec.quantizer.name == "none"
    assert not codec.unbiased and not codec.linear and codec.needs_error_feedback and not codec.lossless
    assert codec.reducer.scope == "tensor"
    assert codec.reducer.__doc__ and "n m / (r (n + m))" in codec.reducer.__doc__


@pytest.mark.parametrize(
    "spec, named",
    [
        ("powersgd(rank=0)", "rank=0"),
        ("powersgd(rank=-3)", "rank=-3"),
        ("powersgd(rank=1.5)", "rank=1.5"),
        ("powersgd(min_compression=-1)", "min_compression=-1"),
        ("powersgd(min_compression=1e400)", "min_compression=inf"),
        ("powersgd(seed=-1)", "seed=-1"),
        ("powersgd(scope='global')", "'scope'"),
    ],
)
def test_bad_values_name_the_value(spec, named):
    with pytest.raises(SpecError) as err:
        build_codec(spec)
    assert named in str(err.value), str(err.value)


def test_nan_min_compression_rejected():
    cls = type(build_codec("powersgd").reducer)
    with pytest.raises(SpecError, match="min_compression=nan"):
        cls(cls.Config(min_compression=float("nan")))


# -- devices ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ["powersgd(rank=1)", "powersgd(rank=2)+fp16", "powersgd(rank=4)+qsgd(bits=8)"])
def test_cuda_encode_decodes_like_cpu(spec):
    g = torch.Generator().manual_seed(11)
    tensors = {"fc1.weight": torch.randn(300, 200, generator=g), "fc1.bias": torch.randn(300, generator=g),
               "conv.weight": torch.randn(64, 32, 3, 3, generator=g), "small": torch.randn(3, 3, generator=g)}
    layout = Layout.of(tensors)
    codec = build_codec(spec)
    state: dict[str, torch.Tensor] = {}
    for rnd in range(2):  # cold, then warm (state on the GPU)
        enc = codec.encode({k: v.cuda() for k, v in tensors.items()}, nonce=rnd, state=state)
        assert all(t.device.type == "cuda" for t in enc.decoded.values())
        assert all(t.device.type == "cuda" for t in state.values())
        on_cpu = codec.decode(enc.payload, layout)
        for name in tensors:
            assert torch.equal(enc.decoded[name].cpu(), on_cpu[name]), name
        on_gpu = codec.decode(enc.payload, layout, device="cuda")
        for name in tensors:
            assert torch.equal(on_gpu[name].cpu(), on_cpu[name]), name
        assert codec.size_bytes(layout) == len(enc.payload)


def test_the_check_from_factors_is_the_same_compiled_or_in_torch_ops(monkeypatch):
    """``sq_all`` (the server's norm of a factored segment) in one compiled call equals the torch
    ops' Gram-matrix form to rounding, and both refuse what they refused before: NaN for a factor
    not finite, None (build the values) for a range or a product that may overflow fp32."""
    from fedcomp import kernels
    from fedcomp.base import Segment

    if kernels.get() is None:
        pytest.skip("numba not installed")
    codec = fedcomp.build_codec("powersgd(rank=3,min_compression=0)")
    red = codec.reducer
    seg = codec.segments(fedcomp.Layout.of({"w": torch.zeros(40, 30)}))[0][0]
    assert isinstance(seg, Segment) and red.factors(seg) == (40, 30, 3)
    g = torch.Generator().manual_seed(2)
    cases = {"plain": torch.randn(210, generator=g), "big": torch.randn(210, generator=g) * 1e30}
    cases["inf"], cases["nan"] = cases["plain"].clone(), cases["plain"].clone()
    cases["inf"][7], cases["nan"][150] = float("inf"), float("nan")
    got = {name: red.sq_all(v, None, seg, 0, 1200) for name, v in cases.items()}
    assert red.sq_all(cases["plain"], None, seg, 0, 600) is None
    monkeypatch.setattr(kernels, "get", lambda: None)
    want = {name: red.sq_all(v, None, seg, 0, 1200) for name, v in cases.items()}
    assert got["plain"] == pytest.approx(want["plain"], rel=1e-12)
    assert got["big"] is None and want["big"] is None
    assert math.isnan(got["inf"]) and math.isnan(want["inf"]) and math.isnan(got["nan"]) and math.isnan(want["nan"])
    dense = red.expand(cases["plain"], None, seg).double()
    assert got["plain"] == pytest.approx(float((dense * dense).sum()), rel=1e-6)
