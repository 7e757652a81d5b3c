"""The fast encode paths give what the plain ones give: lazy decoded, in-place residuals,
multi-tensor top-k without concatenation, zero-heavy and tied top-k, chunk-buffered quantizers."""

from __future__ import annotations

import pytest
import torch

import fedcomp
from fedcomp.codec import LazyDecoded
from fedcomp.pieces import Pieces
from fedcomp.codecs.powersgd import power_step, reconstruct
from fedcomp.codecs.sparsify import exact_topk_sampled
from fedcomp.wire import Writer


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("spec", ["topk(ratio=0.01)+qsgd(bits=4)", "kbit(bits=4)", "powersgd(rank=2)",
                                  "threshold(ratio=0.01)", "topk(ratio=0.05,scope='tensor')+fp16"])
def test_lazy_decoded_equals_decode_and_residual_is_target_minus_decoded(spec):
    g = _gen()
    u = {"a": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g), "n": torch.tensor([3, 4])}
    r = {"a": torch.randn(64, 48, generator=g) * 0.1, "b": torch.randn(48, generator=g) * 0.1}
    codec = fedcomp.build_codec(spec)
    enc, residual = fedcomp.compress(codec, u, r, nonce=5, round=1)
    assert isinstance(enc.decoded, LazyDecoded) and list(enc.decoded) == list(u)
    out = codec.decode(enc.payload, fedcomp.Layout.of(u), round=1)
    for name in u:
        assert torch.equal(enc.decoded[name], out[name]), name
    for name in ("a", "b"):
        assert torch.equal(residual[name], (u[name] + r[name]) - out[name]), name
    assert torch.equal(r["a"], torch.randn(64, 48, generator=_gen()) * 0 + r["a"])  # the caller's residual untouched
    assert set(residual) == {"a", "b"}


def test_compress_leaves_the_callers_update_alone():
    u = {"w": torch.randn(5000, generator=_gen(1))}
    before = u["w"].clone()
    enc, residual = fedcomp.compress(fedcomp.build_codec("topk(ratio=0.01)"), u)
    assert torch.equal(u["w"], before)
    assert torch.equal(residual["w"], before - enc.decoded["w"])


def test_global_topk_over_pieces_matches_the_concatenation():
    g = _gen(2)
    parts = [torch.randn(n, generator=g) for n in (300_000, 7, 250_000, 1, 180_000)]
    whole = torch.cat(parts)
    k = 700
    a = exact_topk_sampled(Pieces(parts), k, _gen(9))
    b = exact_topk_sampled(whole, k, _gen(9))
    assert torch.equal(a, b)
    assert torch.equal(Pieces(parts).gather_sorted(a), whole[a])
    pos = torch.randint(whole.numel(), (999,), generator=g)
    assert torch.equal(Pieces(parts).gather(pos), whole[pos])


def test_topk_on_a_zero_heavy_update_keeps_every_nonzero_then_the_lowest_zeros():
    n, k = 2_000_000, 2000
    x = torch.zeros(n)
    nz = torch.randperm(n, generator=_gen(3))[:1500]
    x[nz] = torch.randn(1500, generator=_gen(4))
    idx = exact_topk_sampled(x, k, _gen(5))
    assert idx.numel() == k and torch.equal(idx, idx.sort().values)
    assert set(nz.tolist()) <= set(idx.tolist())
    zeros = sorted(set(idx.tolist()) - set(nz.tolist()))
    assert zeros == torch.nonzero(x == 0).reshape(-1)[:500].tolist()


def test_topk_on_a_zero_heavy_update_with_more_than_k_nonzeros_is_the_exact_top_set():
    n, k = 2_000_000, 1000
    x = torch.zeros(n)
    nz = torch.randperm(n, generator=_gen(6))[:1800]
    x[nz] = torch.randn(1800, generator=_gen(7))
    idx = exact_topk_sampled(x, k, _gen(8))
    assert torch.equal(idx, torch.topk(x.abs(), k).indices.sort().values)


def test_topk_on_tied_values_keeps_the_larger_then_the_lowest_tied_positions():
    n, k = 2_000_000, 2000
    x = torch.full((n,), 0.5)
    big = torch.randperm(n, generator=_gen(10))[:300]
    x[big] = 2.0
    x[::3] *= -1
    idx = exact_topk_sampled(x, k, _gen(11))
    assert idx.numel() == k
    assert set(big.tolist()) <= set(idx.tolist())
    rest = sorted(set(idx.tolist()) - set(big.tolist()))
    assert rest == [i for i in range(4000) if i not in set(big.tolist())][: k - 300]


@pytest.mark.parametrize("spec", ["kbit(bits=4)", "kbit(bits=3,stochastic=True)", "kbit(bits=8,block=0)",
                                  "qsgd(bits=4)", "qsgd(bits=5,bucket=77,norm='l2')", "sign()", "sign(block=100)",
                                  "twobit(threshold=0.5)", "fp16()", "bf16()", "terngrad()", "terngrad(clip=0)"])
@pytest.mark.parametrize("n", [0, 1, 9, 1_100_001])  # past one 1M-element chunk
def test_quantizer_write_gives_the_bytes_of_encode(spec, n):
    q = fedcomp.build_codec(spec).quantizer
    x = torch.randn(n, generator=_gen(12))
    if n > 5:
        x[::7], x[3], x[4] = 0.5, 1e6, -1e6  # on the twobit threshold; beyond fp16's range
    a, b = Writer(), Writer()
    if n > 1000:  # blocks holding both zeros (kbit's range on the torch path), a NaN payload in one
        x[500:900:2], x[501:900:2] = 0.0, -0.0
        x[2000] = torch.tensor(0x7FC00123, dtype=torch.int32).view(torch.float32)
    q.encode(x, a, _gen(13))
    q.write(x, b, _gen(13))
    assert a.getvalue(b"01234567", 1, 2) == b.getvalue(b"01234567", 1, 2)


def test_power_step_and_reconstruct_match_the_plain_math():
    g = _gen(14)
    m, q = torch.randn(300, 200, generator=g), torch.randn(200, 3, generator=g)
    p_hat, q_new = power_step(m, q)
    torch.testing.assert_close(q_new, m.t() @ p_hat, rtol=1e-5, atol=1e-5)
    y = p_hat[:, 0:1] * q_new[:, 0]
    for k in range(1, 3):
        y = y + p_hat[:, k:k + 1] * q_new[:, k]
    assert torch.equal(reconstruct(p_hat, q_new), y)


@pytest.mark.parametrize("kernels_on", ["0", "1"])
@pytest.mark.parametrize("spec", ["none()", "qsgd(bits=4)", "terngrad()", "kbit(bits=4,stochastic=true)", "fp16()"])
def test_parameters_views_and_other_dtypes_encode_as_their_plain_copies(spec, kernels_on, monkeypatch):
    """A model's own parameters (requiring grad), a non-contiguous view, a negated view, a float64
    and a bf16 tensor, an empty one and an integer one: the bytes of the same values as plain
    contiguous tensors (the run path takes contiguous fp32 CPU tensors as they are, the rest through
    copies)."""
    monkeypatch.setenv("FEDCOMP_KERNELS", kernels_on)
    g = torch.Generator().manual_seed(4)
    layer = torch.nn.Linear(33, 17)
    wide = torch.randn(40, 30, generator=g)
    model = {"w": layer.weight, "b": layer.bias, "t": wide.t(), "d": torch.randn(9, generator=g, dtype=torch.float64),
             "h": torch.randn(70, generator=g).to(torch.bfloat16), "e": torch.zeros(0, 3), "n": torch.arange(5),
             "z": wide[1:30:2], "neg": torch.randn(21, generator=g)._neg_view()}  # a lazily negated view
    plain = {k: v.detach().resolve_neg().contiguous().clone() for k, v in model.items()}
    codec = fedcomp.build_codec(spec)
    got = codec.encode(model, nonce=3).payload
    assert got == codec.encode(plain, nonce=3).payload
    assert layer.weight.requires_grad and layer.weight.grad is None  # the model is left as it was


def test_a_tensor_on_another_device_than_the_first_is_refused_by_torch_not_read_as_cpu_memory():
    """The compiled run loops read CPU memory by address: a tensor on another device (here 'meta',
    which has none) goes the per-segment way, where torch refuses it, instead of into the loop."""
    import subprocess
    import sys

    code = ("import os, torch; os.environ['FEDCOMP_KERNELS'] = '1'; import fedcomp\n"
            "for spec in ['qsgd(bits=4)', 'none()', 'kbit(bits=4)', 'terngrad()']:\n"
            "    try:\n"
            "        fedcomp.build_codec(spec).encode({'a': torch.randn(5), 'b': torch.empty(7, device='meta')})\n"
            "    except (RuntimeError, NotImplementedError) as e:\n"
            "        print('refused', spec)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]  # not a crash (a segfault before)
    assert done.stdout.count("refused") == 4
