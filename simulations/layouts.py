"""Arbitrary model layouts and updates, for the property-based contract and the fuzzers.

Sizes that are not multiples of a block, run or lane width (1, 3, 17, 84, 450, primes),
0-element and 0-d tensors, hundreds of tiny tensors, mixed dtypes, one large tensor beside tiny
ones, and fixed models (Flower's quickstart CNN, a ResNet block, a transformer block). Choices
come from a :class:`Draw` (hypothesis data in the tests, ``random.Random`` or atheris in the
fuzzers), so every caller draws layouts the same way.
"""

from __future__ import annotations

import random
from typing import Protocol

import torch

# around block, run and lane widths (16, 32, 64, 256, 512), primes, the quickstart CNN's sizes
SIZES = (0, 1, 2, 3, 5, 6, 7, 10, 15, 16, 17, 31, 33, 63, 65, 84, 120, 127, 255, 257, 450, 511, 513, 840, 1021)
# large enough for the sampled top-k (n > 4 * 64 / ratio: ratio 0.01 -> n > 25,600)
LARGE = (4099, 10080, 27_361, 48_000, 65_537)
TINY = (1, 2, 3, 5, 6, 7, 15, 17)
DTYPES = (torch.float32, torch.float32, torch.float32, torch.float16, torch.bfloat16, torch.float64,
          torch.int64, torch.bool)
PATTERNS = ("normal", "normal", "normal", "zeros", "sparse", "ties", "tiny", "mixed-scale")
SCALES = (1e-4, 0.01, 1.0, 50.0)
KINDS = ("few", "few", "few", "many-tiny", "large-and-tiny", "fixed")
MAX_DENSE = 70_000  # elements of a drawn multi-dimensional tensor (keeps each draw quick)

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


class Draw(Protocol):
    """Where the choices come from."""

    def int(self, lo: int, hi: int) -> int: ...  # inclusive bounds


class RandomDraw:
    """A :class:`Draw` over ``random.Random``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


def _pick(draw: Draw, options):
    return options[draw.int(0, len(options) - 1)]


# Flower's quickstart-pytorch CNN (its `Net`: conv 3->6 k5, conv 6->16 k5, fc 400-120-84-10)
QUICKSTART_NET: Layout = {
    name: (shape, torch.float32) for name, shape in {
        "conv1.weight": (6, 3, 5, 5), "conv1.bias": (6,), "conv2.weight": (16, 6, 5, 5), "conv2.bias": (16,),
        "fc1.weight": (120, 400), "fc1.bias": (120,), "fc2.weight": (84, 120), "fc2.bias": (84,),
        "fc3.weight": (10, 84), "fc3.bias": (10,),
    }.items()
}


def resnet_block() -> Layout:
    """A torchvision-style ResNet stem and basic block (BatchNorm with its 0-d int64 counter)."""
    out: Layout = {"conv1.weight": ((64, 3, 7, 7), torch.float32)}
    for prefix in ("bn1", "layer1.0.bn1", "layer1.0.bn2"):
        for name in ("weight", "bias", "running_mean", "running_var"):
            out[f"{prefix}.{name}"] = ((64,), torch.float32)
        out[f"{prefix}.num_batches_tracked"] = ((), torch.int64)
        if prefix == "bn1":
            out["layer1.0.conv1.weight"] = ((64, 64, 3, 3), torch.float32)
    out["layer1.0.conv2.weight"] = ((64, 64, 3, 3), torch.float32)
    out["fc.weight"] = ((10, 64), torch.float32)
    out["fc.bias"] = ((10,), torch.float32)
    return out


def transformer_block(d: int = 96, vocab: int = 97, ctx: int = 33) -> Layout:
    """A decoder block: embeddings, attention, LayerNorms, MLP, head."""
    f = torch.float32
    return {
        "tok_emb.weight": ((vocab, d), f), "pos_emb.weight": ((ctx, d), f),
        "ln1.weight": ((d,), f), "ln1.bias": ((d,), f),
        "attn.in_proj_weight": ((3 * d, d), f), "attn.in_proj_bias": ((3 * d,), f),
        "attn.out_proj.weight": ((d, d), f), "attn.out_proj.bias": ((d,), f),
        "ln2.weight": ((d,), f), "ln2.bias": ((d,), f),
        "mlp.0.weight": ((4 * d, d), f), "mlp.0.bias": ((4 * d,), f),
        "mlp.2.weight": ((d, 4 * d), f), "mlp.2.bias": ((d,), f),
        "head.weight": ((vocab, d), f),
    }


FIXED: dict[str, Layout] = {
    "quickstart-cnn": QUICKSTART_NET,
    "resnet-block": resnet_block(),
    "transformer-block": transformer_block(),
}


def draw_shape(draw: Draw, large: bool = False) -> tuple[int, ...]:
    ndim = _pick(draw, (0, 1, 1, 2, 2, 4))
    if ndim == 0:
        return ()
    if large:
        n = _pick(draw, LARGE)
        return (n,) if ndim == 1 else (n, 1)
    dims = [_pick(draw, SIZES) for _ in range(ndim)]
    while ndim > 1 and _numel(dims) > MAX_DENSE:
        dims[draw.int(0, ndim - 1)] = _pick(draw, (1, 2, 3, 5))
    return tuple(dims)


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def draw_layout(draw: Draw) -> Layout:
    """name -> (shape, dtype): a few tensors of any shape and dtype, hundreds of tiny ones, one
    large tensor among small ones, or a fixed model's. Always at least one float tensor."""
    kind = _pick(draw, KINDS)
    if kind == "fixed":
        return dict(FIXED[_pick(draw, sorted(FIXED))])
    if kind == "many-tiny":
        return {f"t{i}": ((_pick(draw, TINY),), torch.float32) for i in range(draw.int(100, 300))}
    count = draw.int(1, 8)
    big = draw.int(0, count - 1) if kind == "large-and-tiny" else -1
    out: Layout = {}
    for i in range(count):
        dtype = torch.float32 if i == big else _pick(draw, DTYPES)
        out[f"layer{i}.w"] = (draw_shape(draw, large=i == big), dtype)
    if not any(d.is_floating_point for _, d in out.values()):
        out["last.w"] = ((_pick(draw, SIZES[1:]),), torch.float32)
    return out


def values(shape: tuple[int, ...], dtype: torch.dtype, pattern: str, scale: float, seed: int) -> torch.Tensor:
    """A tensor of ``pattern``: normal, zeros, sparse (2% nonzero), ties (+-scale), tiny (1e-30
    scale: subnormal in fp32, zero in fp16) or mixed-scale (1e-6 .. 1e2 times ``scale``)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    if pattern == "zeros":
        x.zero_()
    elif pattern == "sparse":
        x *= torch.rand(shape, generator=g, dtype=torch.float64) < 0.02
    elif pattern == "ties":
        x = torch.sign(x) * scale
    elif pattern == "tiny":
        x *= 1e-30
    elif pattern == "mixed-scale":
        x *= 10.0 ** torch.randint(-6, 3, shape, generator=g).to(torch.float64)
    return x.to(dtype)


def draw_update(draw: Draw) -> dict[str, torch.Tensor]:
    """An update over :func:`draw_layout`'s layout, its values of one pattern at one scale."""
    layout = draw_layout(draw)
    pattern, scale, seed = _pick(draw, PATTERNS), _pick(draw, SCALES), draw.int(0, 2**31 - 1)
    return {name: values(shape, dtype, pattern, scale, seed + i) for i, (name, (shape, dtype)) in enumerate(layout.items())}


def random_update(rng: random.Random) -> dict[str, torch.Tensor]:
    """:func:`draw_update` with choices from ``rng``."""
    return draw_update(RandomDraw(rng))
