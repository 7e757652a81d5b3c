"""Error feedback through ``fedcomp.compress``: what compression drops is delayed, not lost.

With p_t = u_t + e_{t-1}, e_t = p_t - D(C(p_t)) and e_0 = 0, the sum of what was sent telescopes:
sum_t u_t - sum_t D(C(p_t)) = e_T. These tests check that identity over many rounds for every
lossy codec, that the residual stays bounded where theory says it must, and the bookkeeping
rules of ``compress`` (lossless codecs, missing tensors, shape changes).
"""

from __future__ import annotations

import math

import pytest
import torch

import fedcomp
from fedcomp import build_codec, compress

ROUNDS = 200

# every registered lossy stage, alone and in combinations
LOSSY = [
    "fp16",
    "bf16",
    "sign",
    "sign(block=64)",
    "twobit(threshold=0.05)",
    "kbit(bits=2)",
    "kbit(bits=4, block=64, stochastic=true)",
    "qsgd(bits=2, bucket=128)",
    "qsgd(bits=4, norm='l2')",
    "terngrad",
    "terngrad(clip=0)",
    "topk(ratio=0.05)",
    "topk(ratio=0.1, scope='tensor', index='fixed')",
    "randomk(ratio=0.1, rescale=false)",
    "randomk(ratio=0.1)",  # rescaled (the default): no residual
    "threshold(tau=0.05)",
    "threshold(tau=0.05)+fp16",
    "topk(ratio=0.05)+qsgd(bits=4)",
    "topk(ratio=0.05, scope='tensor')+kbit(bits=4, block=16)",
    "randomk(ratio=0.1, rescale=false)+sign",
    "threshold(ratio=0.05)",
    "threshold(ratio=0.1, mode='signed', scope='tensor')+fp16",
    "dgc(ratio=0.05)",
    "dgc(ratio=0.05, warmup=3)+qsgd(bits=4)",
    "powersgd(rank=1)",
    "powersgd(rank=2)+fp16",
    "sketch(rows=5, cols=512, ratio=0.05)",  # client-side error feedback needs a sketch that recovers well
    "cells(cols=100)+kbit(bits=4)",  # a projection onto the cells: what is not constant per cell waits
]


def base_update(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fc.weight": torch.randn(24, 20, generator=g) * 0.05,
        "fc.bias": torch.randn(20, generator=g) * 0.01,
        "bn.num_batches_tracked": torch.tensor(3, dtype=torch.int64),
        "out.weight": torch.randn(5, 20, generator=g) * 0.05,
    }


def updates(kind: str, rounds: int = ROUNDS, seed: int = 0):
    """A fixed update every round, or one that drifts (random walk) with per-round noise."""
    base = base_update(seed)
    g = torch.Generator().manual_seed(seed + 1000)
    drift = {k: torch.zeros(v.shape) for k, v in base.items()}
    for t in range(rounds):
        if kind == "fixed":
            yield base
            continue
        u = {}
        for name, v in base.items():
            if not v.is_floating_point():
                u[name] = v + t
                continue
            std = float(v.std())
            drift[name] += 0.02 * std * torch.randn(v.shape, generator=g)
            u[name] = v + drift[name] + 0.5 * std * torch.randn(v.shape, generator=g)
        yield u


def flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for v in d.values() if v.is_floating_point()])


def run(spec: str, kind: str, *, error_feedback: bool = True, rounds: int = ROUNDS):
    """Returns (sum of u, sum of decoded, residual norms per round, final residual, sum of ||p_t||)."""
    codec = build_codec(spec)
    residual = None
    sum_u = sum_d = 0
    norms, p_norms = [], 0.0
    for t, u in enumerate(updates(kind, rounds)):
        p = flat(u) + (flat(residual) if residual else 0)
        p_norms += float(p.norm())
        enc, residual = compress(codec, u, residual, nonce=t, error_feedback=error_feedback)
        sum_u = sum_u + flat(u)
        sum_d = sum_d + flat(enc.decoded)
        norms.append(float(flat(residual).norm()) if residual else 0.0)
    return sum_u, sum_d, norms, residual, p_norms


def test_lossy_list_covers_every_registered_stage():
    named = {s.split("(")[0].strip() for spec in LOSSY for s in spec.split("+")}
    assert set(fedcomp.available_codecs()) - {"none"} <= named


@pytest.mark.parametrize("kind", ["fixed", "drift"])
@pytest.mark.parametrize("spec", LOSSY)
def test_error_feedback_identity(spec, kind):
    """sum u - sum decoded == final residual, for every lossy codec (fp32 tensors: to float rounding)."""
    sum_u, sum_d, norms, residual, p_norms = run(spec, kind)
    if not build_codec(spec).takes_error_feedback:  # rescaled random-k: unbiased, no residual kept
        assert residual == {}
        return
    e = flat(residual)
    tol = 2**-21 * p_norms + 1e-9  # a few fp32 roundings of p and e per round
    assert float((sum_u - sum_d - e).norm()) <= tol
    assert abs(float((sum_u - sum_d).norm()) - float(e.norm())) <= tol
    assert not build_codec(spec).lossless
    assert float(e.norm()) > 0  # lossy indeed


def test_error_feedback_identity_float16_tensor():
    """A float16 tensor: compress adds the fp32 residual into the fp16 tensor, so each round's
    p is rounded to fp16; the identity holds up to those roundings (and no worse)."""
    codec = build_codec("topk(ratio=0.05)+qsgd(bits=4)")
    g = torch.Generator().manual_seed(3)
    base = (torch.randn(16, 12, generator=g) * 0.05).half()
    residual = None
    sum_u = torch.zeros(base.shape, dtype=torch.float64)
    sum_d = torch.zeros(base.shape, dtype=torch.float64)
    bound = torch.zeros(base.shape, dtype=torch.float64)
    for t in range(ROUNDS):
        u = {"w": (base.float() + 0.02 * torch.randn(base.shape, generator=g)).half()}
        e_prev = residual["w"].double() if residual else torch.zeros_like(bound)
        bound += 2**-10 * (u["w"].double().abs() + e_prev.abs()) + 2**-23
        enc, residual = compress(codec, u, residual, nonce=t)
        assert residual["w"].dtype == torch.float32
        sum_u += u["w"].double()
        sum_d += enc.decoded["w"].double()
    gap = (sum_u - sum_d - residual["w"].double()).abs()
    assert bool((gap <= bound).all())
    assert float(gap.norm()) <= 0.01 * float(sum_u.norm())


@pytest.mark.parametrize("kind", ["fixed", "drift"])
@pytest.mark.parametrize("spec", ["topk(ratio=0.05)", "topk(ratio=0.1, scope='tensor')"])
def test_topk_residual_within_contraction_bound(spec, kind):
    """Top-k is a delta-contraction (||x - C(x)||^2 <= (1 - delta)||x||^2, delta = k/n), so
    ||e_t|| <= sqrt(1-delta) / (1 - sqrt(1-delta)) * max ||u||, whatever the number of rounds."""
    delta = 0.05 if "0.05" in spec else 0.1
    c = math.sqrt(1 - delta)
    max_u = max(float(flat(u).norm()) for u in updates(kind))
    _, _, norms, _, _ = run(spec, kind)
    assert max(norms) <= c / (1 - c) * max_u


@pytest.mark.parametrize("kind", ["fixed", "drift"])
@pytest.mark.parametrize("spec", ["topk(ratio=0.05)+qsgd(bits=4)", "topk(ratio=0.05)+qsgd(bits=4, norm='l2')", "sign", "sign(block=64)"])
def test_residual_stays_bounded(spec, kind):
    """The residual does not grow linearly with the rounds: the decoded sum tracks the true sum."""
    sum_u, sum_d, norms, _, _ = run(spec, kind)
    half = ROUNDS // 2
    # linear growth would double the residual from round 100 to round 200
    assert max(norms[half:]) <= 1.6 * max(norms[:half])
    assert float((sum_u - sum_d).norm()) <= 0.15 * float(sum_u.norm())


@pytest.mark.parametrize("kind", ["fixed", "drift"])
def test_topk_without_error_feedback_loses_most_of_the_update(kind):
    sum_u, sum_d, norms, residual, _ = run("topk(ratio=0.05)", kind, error_feedback=False)
    assert residual == {} and set(norms) == {0.0}
    assert float((sum_u - sum_d).norm()) >= 0.5 * float(sum_u.norm())
    with_ef = run("topk(ratio=0.05)", kind)
    assert float((with_ef[0] - with_ef[1]).norm()) <= 0.1 * float(sum_u.norm())


# -- bookkeeping -------------------------------------------------------------------------------
def _residual_like(u, seed=9, scale=0.01):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * scale for k, v in u.items() if v.is_floating_point()}


def test_lossless_codec_keeps_no_residual():
    codec = build_codec("none()")
    u = base_update()
    enc, residual = compress(codec, u, _residual_like(u), nonce=4)
    assert residual == {}
    assert enc.payload == codec.encode(u, nonce=4).payload  # a given residual is not added either
    for name in u:
        assert torch.equal(enc.decoded[name], u[name])


def test_error_feedback_off_ignores_and_returns_no_residual():
    codec = build_codec("topk(ratio=0.05)")
    u = base_update()
    enc, residual = compress(codec, u, _residual_like(u), nonce=4, error_feedback=False)
    assert residual == {}
    assert enc.payload == codec.encode(u, nonce=4).payload


def test_rescaled_randomk_takes_no_error_feedback_alone_or_in_a_policy():
    """Unbiased random-k (decoded values x n/k) would grow its residual by (n/k - 1) ||x||^2 a round:
    compress keeps none for it, as for error_feedback=False; unscaled random-k keeps one."""
    u = base_update()
    for spec in ("randomk(ratio=0.1,rescale=true)", "name~*bias: topk(ratio=0.2); randomk(ratio=0.1,rescale=true)"):
        codec = build_codec(spec)
        enc, residual = compress(codec, u, _residual_like(u), nonce=4)
        off, _ = compress(codec, u, None, nonce=4, error_feedback=False)
        kept = {n for n in u if u[n].is_floating_point() and "bias" in n} if ";" in spec else set()
        assert set(residual) == kept and codec.takes_error_feedback == bool(kept)
        if not kept:
            assert enc.payload == off.payload  # the given residual was not added either
    _, residual = compress(build_codec("randomk(ratio=0.1,rescale=false)"), u, None, nonce=4)
    assert residual and all(float(r.norm()) > 0 for r in residual.values())


def test_residual_is_added_before_encoding():
    codec = build_codec("topk(ratio=0.05)+qsgd(bits=4)")
    u = base_update()
    r = _residual_like(u)
    enc, residual = compress(codec, u, r, nonce=6)
    target = {k: (v + r[k] if k in r else v) for k, v in u.items()}
    assert enc.payload == codec.encode(target, nonce=6).payload
    assert list(residual) == [k for k, v in u.items() if v.is_floating_point()]
    for name, e in residual.items():
        assert e.dtype == torch.float32
        assert torch.equal(e, target[name].float() - enc.decoded[name].float())


def test_residual_ignored_when_the_shape_changed():
    codec = build_codec("sign")
    u = base_update()
    stale = _residual_like(u)
    stale["fc.weight"] = torch.ones(20, 24)  # the tensor was reshaped since
    enc, residual = compress(codec, u, stale, nonce=2)
    target = dict(u, **{k: u[k] + stale[k] for k in ("fc.bias", "out.weight")})
    assert enc.payload == codec.encode(target, nonce=2).payload
    assert residual["fc.weight"].shape == u["fc.weight"].shape
    assert torch.equal(residual["fc.weight"], u["fc.weight"] - enc.decoded["fc.weight"])


def test_residual_of_missing_or_non_float_tensors():
    codec = build_codec("kbit(bits=2)")
    u = base_update()
    r = _residual_like(u)
    r["gone.weight"] = torch.ones(3)  # a tensor no longer in the update: dropped
    r["bn.num_batches_tracked"] = torch.tensor(5.0)  # non-float tensors take no residual
    enc, residual = compress(codec, u, r, nonce=1)
    assert "gone.weight" not in residual and "bn.num_batches_tracked" not in residual
    assert torch.equal(enc.decoded["bn.num_batches_tracked"], u["bn.num_batches_tracked"])
    target = {k: (v + r[k] if v.is_floating_point() else v) for k, v in u.items()}
    assert enc.payload == codec.encode(target, nonce=1).payload


def test_compress_leaves_its_inputs_alone():
    codec = build_codec("topk(ratio=0.05)+qsgd(bits=2)")
    u = base_update()
    r = _residual_like(u)
    u0 = {k: v.clone() for k, v in u.items()}
    r0 = {k: v.clone() for k, v in r.items()}
    compress(codec, u, r, nonce=3)
    assert all(torch.equal(u[k], u0[k]) for k in u)
    assert all(torch.equal(r[k], r0[k]) for k in r)


def test_compress_payload_decodes_with_the_update_layout():
    codec = build_codec("randomk(ratio=0.1)+sign")
    u = base_update()
    enc, _ = compress(codec, u, _residual_like(u), nonce=8)
    out = codec.decode(enc.payload, fedcomp.Layout.of(u))
    for name in u:
        assert torch.equal(out[name], enc.decoded[name])


# -- one add-back: encode (compress), skip (budgeting), re-send (the mod's unacknowledged update) ----
def test_add_residual_keeps_update_keys_and_ignores_stale_shapes():
    from fedcomp.base import add_residual

    update = {"a": torch.ones(3), "b": torch.ones(2, 2), "n": torch.tensor([4])}
    residual = {"a": torch.full((3,), 0.5), "b": torch.ones(4), "gone": torch.ones(1)}
    out = add_residual(update, residual)
    assert list(out) == ["a", "b", "n"]
    assert torch.equal(out["a"], torch.full((3,), 1.5)) and out["b"] is update["b"] and out["n"] is update["n"]


def test_add_residual_promote_keeps_the_residual_precision():
    from fedcomp.base import add_residual

    half = {"h": torch.tensor([1.0, 2.0]).half(), "d": torch.tensor([1.0], dtype=torch.float64)}
    residual = {"h": torch.tensor([1e-4, 0.0]), "d": torch.tensor([1e-12], dtype=torch.float64)}
    plain = add_residual(half, residual)
    kept = add_residual(half, residual, promote=True)
    assert plain["h"].dtype == torch.float16 and float(plain["h"][0]) == 1.0  # 1e-4 rounds away in fp16
    assert kept["h"].dtype == torch.float32 and float(kept["h"][0]) == pytest.approx(1.0001)
    assert kept["d"].dtype == torch.float64 and float(kept["d"][0]) - 1.0 == pytest.approx(1e-12)


def test_budget_skip_keeps_float64_residual_unrounded():
    """A round skipped for its budget keeps update + residual in the residual, float64 included."""
    from flwr.app import RecordDict

    from fedcomp import links
    from fedcomp.clients.budgeting import budgeted_upload

    update = {"w": torch.full((64, 64), 1e-9, dtype=torch.float64) + 1.0}
    residual = {"w": torch.full((64, 64), 1e-12, dtype=torch.float64)}
    link = links.Link(uplink_kbps=1.0, downlink_kbps=1.0, latency_ms=0.0, byte_cap=40)
    out = budgeted_upload("topk(ratio=0.01,index='fixed')", update, residual, link=link, download_bytes=0,
                          compute_s=0.0, build=lambda payload, spec: RecordDict(), nonce=0, round=1, state=None,
                          error_feedback=True, fallback="skip")
    assert out.status == "too-small-skipped" and out.residual["w"].dtype == torch.float64
    assert torch.equal(out.residual["w"], update["w"] + residual["w"])
