"""The torch path (what a CUDA client runs; ``FEDCOMP_KERNELS=0`` on the CPU) encodes an update in
a number of torch ops that does not grow with its number of tensors beyond a small constant per
tensor, for every codec family, and writes the compiled loops' bytes (issue 39).

Op counts are deterministic (``torch.profiler`` over one encode, no timing): the ResNet-50 layout
(scaled down) against the same layout with every tensor cut in two
(:func:`fedcomp.simulations.profile_encode.split`), whose difference per added tensor is the
slope. The CUDA tests (``pytest -m cuda``) check that a GPU writes the CPU's bytes where
docs/explanations/devices.md says it does; they skip without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

import fedcomp
from fedcomp import kernels
from fedcomp.simulations.bench_codecs import resnet50_shapes
from fedcomp.simulations.encode_fuzz import kernels as kernels_mode
from fedcomp.simulations.layouts import random_update
from fedcomp.simulations.profile_encode import counts, split

# (spec, most aten ops per added tensor on the torch path, as torch.profiler counts them: the
# tensor's flat view, torch.cat's own per-input ops, and where a quantizer draws uniforms its stream
# key's draw from the CPU generator). Dense quantizers: the flat encode (one padded buffer);
# selectors: one scan of all tensors.
SLOPES = [
    ("kbit(bits=4)", 12),
    ("kbit(bits=3,stochastic=True)", 12),
    ("qsgd(bits=4)", 12),
    ("sign()", 12),
    ("sign(block=64,scale='rms')", 12),
    ("terngrad()", 12),
    ("topk(ratio=0.01)+qsgd(bits=4)", 12),
    ("randomk()", 12),
    ("threshold()", 12),
]


def _layout(scale: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(n, tuple(d if d <= 8 else max(1, round(d * scale)) for d in s)) for n, s in resnet50_shapes()]
    return {n: torch.randn(s, generator=g) * 0.01 for n, s in shapes}


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("FEDCOMP_KERNELS", "0")
    monkeypatch.setattr(kernels, "for_encode", lambda: None)


@pytest.mark.parametrize("spec,bound", SLOPES)
def test_ops_per_tensor_are_a_small_constant(torch_path, spec, bound):
    codec = fedcomp.build_codec(spec)
    base = _layout()
    doubled = split(base)
    a, b = counts(codec, base, torch.device("cpu")), counts(codec, doubled, torch.device("cpu"))
    slope = (b["aten_ops"] - a["aten_ops"]) / (len(doubled) - len(base))
    assert slope <= bound, f"{spec}: {slope:.1f} aten ops per added tensor ({a['aten_ops']} -> {b['aten_ops']})"
    # and syncs (on a GPU) do not grow with the tensors at all
    assert b["sync_points"] <= a["sync_points"] + 2, f"{spec}: sync points {a['sync_points']} -> {b['sync_points']}"


def test_dense_quantizers_no_longer_loop_over_tensors(torch_path):
    """The flat encode of 161 tensors costs about what one tensor's did plus the per-tensor view
    and copy into the buffer (it was 100-300 ops a tensor)."""
    codec = fedcomp.build_codec("qsgd(bits=4)")
    base = _layout()
    one = {"w": torch.cat([t.reshape(-1) for t in base.values()])}
    n, o = counts(codec, base, torch.device("cpu")), counts(codec, one, torch.device("cpu"))
    assert n["aten_ops"] <= o["aten_ops"] + 12 * len(base)


DENSE = ["kbit()", "kbit(bits=3,stochastic=True)", "kbit(bits=8,block=0)", "kbit(bits=1,block=17)",
         "qsgd()", "qsgd(bits=3,bucket=0)", "qsgd(bits=8,bucket=100)", "sign()", "sign(block=64,scale='rms')",
         "sign(block=0,scale='rms')", "terngrad()", "terngrad(clip=0)"]


@pytest.mark.parametrize("spec", DENSE)
def test_flat_encode_writes_the_compiled_loops_bytes(spec):
    """Drawn layouts (simulations/layouts.py: odd sizes, 0-element and 0-d tensors, hundreds of
    tiny ones, mixed dtypes, zeros, ties, subnormals): the same payload from the compiled loops
    and from the flat torch encode."""
    codec = fedcomp.build_codec(spec)
    rng = random.Random(f"flat:{spec}")
    for i in range(12):
        update = random_update(rng)
        payloads = []
        for mode in ("1", "0"):
            with kernels_mode(mode):
                payloads.append(codec.encode(update, nonce=i, round=1).payload)
        assert payloads[0] == payloads[1], f"{spec}: draw {i}: the flat encode wrote other bytes"


@pytest.mark.parametrize("spec", ["kbit(bits=3,stochastic=True)", "qsgd(bucket=100)", "sign(block=0)", "terngrad()",
                                  "fp16()", "twobit()", "powersgd()+kbit()"])
def test_flat_buffers_of_a_chunk_write_the_same_bytes(monkeypatch, spec):
    """Flat buffers cut at FLAT_CHUNK elements (a segment larger than one written on its own):
    the bytes of one buffer and of the compiled loops."""
    from fedcomp import codec as codec_module

    monkeypatch.setattr(codec_module, "FLAT_CHUNK", 3000)
    codec = fedcomp.build_codec(spec)
    rng = random.Random(f"chunk:{spec}")
    for i in range(8):
        update = random_update(rng)
        payloads = []
        for mode in ("1", "0"):
            with kernels_mode(mode):
                payloads.append(codec.encode(update, nonce=i, round=1, state={}).payload)
        assert payloads[0] == payloads[1], f"{spec}: draw {i}"


def test_nan_and_signed_zeros_keep_the_per_segment_bytes():
    """Blocks whose min/max is a zero (its sign) or NaN (its bits) are taken again by torch's
    reduction over the padded block, as the per-segment path does."""
    x = torch.zeros(3000)
    x[::7] = -0.0
    x[5] = float("nan")
    x[2000:2100] = torch.linspace(-1, 1, 100)
    update = {"a": x, "b": -x[:999].clone(), "c": torch.full((17,), -0.0)}
    for spec in ("kbit()", "qsgd()", "sign(block=256)", "terngrad()", "kbit(stochastic=True,block=0)"):
        codec = fedcomp.build_codec(spec)
        payloads = []
        for mode in ("1", "0"):
            with kernels_mode(mode):
                payloads.append(codec.encode(update, nonce=3, round=1).payload)
        assert payloads[0] == payloads[1], spec


def test_stream_keys_are_the_cpu_generators():
    """Every device draws a segment's uniform stream key from the CPU generator (the GPU's
    Philox stream would give other keys, hence other roundings)."""
    from fedcomp import uniforms
    from fedcomp.base import StageContext
    from fedcomp.codecs.flat import stream_keys

    ctx = StageContext(987654321)
    k0, k1 = stream_keys(ctx, [0, 1, 5, 160])
    for i, j in enumerate([0, 1, 5, 160]):
        assert (int(k0[i]), int(k1[i])) == uniforms.draw_key(ctx.generator(j, "cpu"), torch.device("cpu"))


# -- a GPU writes the CPU's bytes (docs/explanations/devices.md) ------------------------------------
SAME_BYTES = DENSE + ["twobit()", "fp16()", "none()", "topk(ratio=0.01)+qsgd(bits=4)", "randomk()+kbit()",
                      "threshold()", "topk(ratio=0.05,scope='tensor')+sign()"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", SAME_BYTES)
def test_cuda_writes_the_cpu_bytes(spec):
    codec = fedcomp.build_codec(spec)
    rng = random.Random(f"cuda:{spec}")
    for i in range(6):
        update = random_update(rng)
        with kernels_mode("0"):
            cpu = codec.encode(update, nonce=i, round=1, state={}).payload
            gpu = codec.encode({k: v.cuda() for k, v in update.items()}, nonce=i, round=1, state={}).payload
        assert cpu == gpu, f"{spec}: draw {i}: the GPU wrote other bytes"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ["kbit(bits=4)", "qsgd(bits=4)", "sign()", "terngrad()"])
def test_cuda_launches_and_syncs_do_not_grow_with_tensors(spec):
    codec = fedcomp.build_codec(spec)
    base = {k: v.cuda() for k, v in _layout(0.25).items()}
    doubled = split(base)
    a, b = counts(codec, base, torch.device("cuda")), counts(codec, doubled, torch.device("cuda"))
    extra = len(doubled) - len(base)
    assert (b["kernel_launches"] - a["kernel_launches"]) / extra <= 3, (a, b)
    assert b["syncs"] <= a["syncs"] + 2, (a, b)


# -- PowerSGD: same-shape matrices stepped together off the CPU (forced on the CPU here) ------------
@pytest.fixture
def batched(monkeypatch):
    from fedcomp.codecs import powersgd

    monkeypatch.setattr(powersgd, "_BATCHED", {"cpu", "cuda"})


@pytest.mark.parametrize("spec", ["powersgd()", "powersgd(rank=3)+kbit(bits=4)"])
def test_powersgd_batched_ops_per_tensor(torch_path, batched, spec):
    codec = fedcomp.build_codec(spec)
    base = _layout()
    doubled = split(base)
    a, b = counts(codec, base, torch.device("cpu")), counts(codec, doubled, torch.device("cpu"))
    slope = (b["aten_ops"] - a["aten_ops"]) / (len(doubled) - len(base))
    assert slope <= 6, f"{spec}: {slope:.1f} aten ops per added tensor ({a['aten_ops']} -> {b['aten_ops']})"
    assert b["sync_points"] <= a["sync_points"] + 2


def test_powersgd_per_tensor_path_quantizes_flat(torch_path):
    """On the CPU the power steps stay one by one (the bytes every CPU writes), their values are
    quantized as one buffer: the loop costs what the steps cost, no per-tensor quantizer ops."""
    codec = fedcomp.build_codec("powersgd()+kbit(bits=4)")
    base = _layout()
    doubled = split(base)
    a, b = counts(codec, base, torch.device("cpu")), counts(codec, doubled, torch.device("cpu"))
    assert (b["aten_ops"] - a["aten_ops"]) / (len(doubled) - len(base)) <= 20


@pytest.mark.parametrize("spec", ["powersgd()", "powersgd(rank=3)+kbit(bits=8)", "powersgd(min_compression=0)+qsgd()"])
def test_powersgd_batched_steps_decode_to_what_they_report(batched, spec):
    """The batched steps (warm-started over rounds, two matrices of one shape) decode to the
    encoder's ``decoded`` and to within float noise of the one-by-one steps."""
    from fedcomp.simulations.layouts import FIXED, values

    codec = fedcomp.build_codec(spec)
    update = {n: values(s, d, "normal", 0.01, i) for i, (n, (s, d)) in enumerate(FIXED["transformer-block"].items())}
    update["extra.weight"] = torch.randn(96, 96) * 0.01  # the shape of attn.out_proj: a group of two
    layout = fedcomp.Layout.of(update)
    state = {}
    for rnd in range(3):
        enc = codec.encode(update, nonce=rnd, round=rnd, state=state)
        dec = codec.decode(enc.payload, layout, round=rnd)
        assert all(torch.equal(dec[k], enc.decoded[k]) for k in update)
        assert codec.size_bytes(layout, enc.kept, enc.index_bytes) == len(enc.payload)
    from fedcomp.codecs import powersgd

    one_by_one = {}
    saved = powersgd._BATCHED
    powersgd._BATCHED = set()
    try:
        for rnd in range(3):
            ref = codec.encode(update, nonce=rnd, round=rnd, state=one_by_one)
    finally:
        powersgd._BATCHED = saved
    ref_dec = codec.decode(ref.payload, layout)
    for k in update:
        assert torch.allclose(dec[k], ref_dec[k], atol=2e-3 * float(update[k].abs().max()) + 1e-6), k
