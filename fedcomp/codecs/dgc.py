"""Deep Gradient Compression (Lin et al. 2018) as a selector with client-side momentum.

DGC is top-k sparsification with error feedback plus four tricks: momentum correction, momentum
factor masking, local gradient clipping and a sparsity warm-up; its top-k is found by sampling a
threshold instead of sorting. Here the selection is :func:`fedcomp.codecs.sparsify.sampled_topk`, the
residual is the ordinary error-feedback residual that :func:`fedcomp.compress` keeps, and the
momentum lives in the client's codec ``state`` (the ``accumulate``/``after_encode`` hooks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedcomp.base import Segment, StageContext, register
from fedcomp.codecs.sparsify import INDEX_CODINGS, _CodedIndices, _kept, sample_generator, sampled_topk

STATE_PREFIX = "dgc.u/"  # client state key of a tensor's momentum: f"{STATE_PREFIX}{name}"


def momentum_key(name: str) -> str:
    """The ``state`` key under which DGC keeps the momentum of tensor ``name``."""
    return f"{STATE_PREFIX}{name}"


def warmup_fraction(ratio: float, warmup: int, round: int, start: float = 0.25) -> float:
    """Fraction of the elements kept in ``round`` (1 = first): ``start`` in round 1, falling
    geometrically to ``ratio``, which round ``warmup + 1`` reaches (start * (ratio / start) **
    ((round - 1) / warmup), floored at ``ratio``) for rounds 1..warmup; ``ratio`` after warm-up and
    when the round is unknown (0). ``start`` 0.25 and 4 rounds to 0.001 is the paper's schedule:
    75%, 93.7%, 98.4%, 99.6%, then 99.9% sparsity."""
    if 1 <= round <= warmup and start > ratio:
        return max(ratio, start * (ratio / start) ** ((round - 1) / warmup))
    return ratio


@register
class DGC(_CodedIndices):
    """Deep Gradient Compression for federated uploads (Lin et al. 2018).

    Per client and round, with g the client's round update (trained minus received model), u its
    momentum and v its residual (both kept on the client across rounds):

    1. Clip (``clip > 0``): g <- g * min(1, clip / ||g||_2), the norm taken over all float tensors.
    2. Momentum correction: u <- momentum * u + g.
    3. Accumulate: p = v + u (:meth:`accumulate` returns p; ``compress`` encodes it).
    4. Select by sampled threshold (:func:`~fedcomp.codecs.sparsify.sampled_topk`): about k elements,
       k = ceil(f * n) over the whole update (one global segment), where the kept fraction f falls
       geometrically from ``start`` in round 1 to ``ratio`` in round ``warmup`` + 1
       (:func:`warmup_fraction`) and is ``ratio`` after.
       The payload carries the count and positions (u32 k + Rice or fixed-width index stream),
       then the values through the pipeline quantizer (fp32 by default; ``dgc(...)+qsgd(bits=4)``
       quantizes the kept values as for ``topk``). The decoder needs no round or state.
    5. Residual: v <- p - decoded (done by ``compress``: zero where values are sent exactly).
    6. Momentum factor masking: u <- 0 wherever the decoded update is nonzero (:meth:`after_encode`).

    How the tricks map to FL: the "gradient" is the round update, already a multi-step move of
    the client's optimizer, so momentum runs across rounds on the client. The paper's momentum
    correction reproduces what a momentum optimizer would have applied; FedAvg applies the round
    update as it is, and a coordinate that waits many rounds in the residual is sent with up to
    1 / (1 - momentum) times the sum of its updates (factor masking resets only what was sent).
    The paper's 0.9 makes those steps up to 10x too long and a run can swing late in training; 0
    is plain error feedback and converges slowest; the default 0.7 bounds the factor at 3.3 (the
    measured comparison: the docs' results page "DGC as published"). Clipping bounds the norm of
    the whole round update before it enters the momentum (the paper clips each worker's gradient
    at N^-1/2 times the global threshold; here ``clip`` is the client's threshold itself; off by
    default). Warm-up runs over rounds, not epochs, from ``round`` passed to ``compress`` (round
    1 is the first; round 0, the default, means "unknown": no warm-up). The paper's schedule
    (``start=0.25``, 4 rounds to 99.9%) spends more upload bytes in its first rounds than 60
    rounds at 0.1% do, so in FL the warm-up starts lower (``start``) and lasts longer; it is off
    by default: it buys accuracy in the first rounds, not bytes.

    Without ``state`` (``compress(..., state=None)`` or a bare ``Codec.encode``) there is no
    momentum: steps 2 and 6 are skipped and DGC is error-feedback top-k with sampled selection
    (and clipping). Which elements were sent is read from the decoded update, so an element that
    a quantizer rounds to zero keeps its momentum, as it was not sent.
    """

    name = "dgc"
    budget_args = {"sample": 1.0}  # budgeted: exact top-k (see fedcomp.budget)
    # for clients that take part now and then (see the docs' Spec grammar: cross-device defaults);
    # the momentum that regime was measured with
    cross_device = {"ratio": 0.1, "momentum": 0.9}
    scope = "global"  # one segment over all float tensors

    @dataclass(frozen=True)
    class Config:
        ratio: float = 0.001  # fraction kept after warm-up, in (0, 1] (the paper's 99.9% sparsity)
        momentum: float = 0.7  # client momentum across rounds, in [0, 1); 0 = none
        clip: float = 0.0  # max L2 norm of the round update (all float tensors together); 0 = off
        warmup: int = 0  # rounds of exponentially rising sparsity, from `start` kept down to `ratio`; 0 = none
        start: float = 0.25  # fraction kept in the first warm-up round, in (0, 1]
        sample: float = 0.01  # fraction of |p| sampled to set the threshold (at least 1,024 elements)
        index: str = "rice"  # index coding: "rice" (gap coded) or "fixed" (ceil(log2 n) bits each)

    def validate(self) -> None:
        c = self.config
        if c.index not in INDEX_CODINGS:
            self.fail("index", f"one of {INDEX_CODINGS}")
        if not 0 < c.ratio <= 1:
            self.fail("ratio", "a fraction in (0, 1]")
        if not 0 <= c.momentum < 1:
            self.fail("momentum", "in [0, 1)")
        if not (c.clip >= 0 and math.isfinite(c.clip)):
            self.fail("clip", "0 (off) or a positive finite L2 norm")
        if c.warmup < 0:
            self.fail("warmup", "a number of rounds >= 0")
        if not 0 < c.sample <= 1:
            self.fail("sample", "a fraction in (0, 1]")
        if not 0 < c.start <= 1:
            self.fail("start", "a fraction in (0, 1]")

    def canonical(self) -> str:
        # without warm-up `start` does nothing and is left out: the specs (hence fingerprints and
        # payloads) of DGC without warm-up are the ones from before the option existed
        text = super().canonical()
        return text if self.config.warmup else text.replace(f",start={self.config.start!r}", "")

    # -- selection ------------------------------------------------------------------------------
    def select(self, x: torch.Tensor, ctx: StageContext, seg: Segment) -> torch.Tensor:
        c = self.config
        k = _kept(warmup_fraction(c.ratio, c.warmup, ctx.round, c.start), x.numel())
        return sampled_topk(x.abs(), k, sample_generator(ctx, seg), self.config.sample)

    # -- client state -----------------------------------------------------------------------------
    def clipped(self, update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The update scaled to global L2 norm ``clip`` if it is longer (``clip`` 0: unchanged)."""
        if self.config.clip <= 0:
            return update
        floats = [t for t in update.values() if t.is_floating_point()]
        norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in floats))
        if norm <= self.config.clip:
            return update
        factor = self.config.clip / norm
        return {n: t * factor if t.is_floating_point() else t for n, t in update.items()}

    def accumulate(self, update, residual, ctx):
        """p = v + u with u <- momentum * u + clip(g) (u stored in ``ctx.state``); v + clip(g) without state."""
        update = self.clipped(update)
        if ctx.state is None or self.config.momentum == 0:  # u would be g itself: nothing to keep
            return super().accumulate(update, residual, ctx)
        target = {}
        for name, g in update.items():
            if not g.is_floating_point():
                target[name] = g
                continue
            dtype = torch.promote_types(g.dtype, torch.float32)
            u = ctx.state.get(momentum_key(name))
            if u is None or u.shape != g.shape:  # first round, or the tensor changed shape: u was 0
                u = g.to(dtype).clone()
            else:
                u = self.config.momentum * u.to(g.device, dtype) + g.to(dtype)
            ctx.state[momentum_key(name)] = u
            p = u + residual[name].to(g.device, dtype) if name in residual else u
            target[name] = p.to(g.dtype)
        return target

    def after_encode(self, target, decoded, ctx):
        """Momentum factor masking: u <- 0 where the decoded update is nonzero (sent)."""
        if ctx.state is None:
            return
        for name, y in decoded.items():
            u = ctx.state.get(momentum_key(name))
            if u is not None and u.shape == y.shape:
                ctx.state[momentum_key(name)] = u.masked_fill(y.to(u.device) != 0, 0)
