"""PowerSGD (Vogels, Karimireddy and Jaggi, 2019): rank-r factors of each weight matrix.

Three layers, as in epfml/powersgd: the math (:func:`power_step`, :func:`reconstruct`, pure
functions of tensors), the warm-start state around it (the client's ``Q`` per tensor, kept in
``StageContext.state``), and the policy (which tensors are worth factorising, :func:`factor_shape`).
Error feedback on the approximation error comes from :func:`fedcomp.compress`.

Wire format, per float tensor (one segment each), all values coded by the pipeline quantizer and
no side information (the path taken depends only on the shape and the config)::

    factor path: n*r values of P_hat C (n x r, row-major), then m*r values of Q C^-1 (m x r,
                 row-major); C is a positive diagonal that balances the two (see :func:`balance`)
    raw path:    the tensor's numel values

The decoder needs no state: ``P_hat @ Q^T`` (= (P_hat C)(Q C^-1)^T) is rebuilt from the decoded values alone, with a
fixed summation order (rank-1 terms added one after another, no fused multiply-add) so that CPU
and CUDA decode a payload to the same bits.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedcomp import kernels
from fedcomp.base import Knob, Reducer, Segment, StageContext, register
from fedcomp.wire import Reader, Writer, output_empty

_NO32 = np.empty(0, dtype=np.float32)  # the kernel's unused output (adding) or sum (building)
_NO64 = np.empty(0, dtype=np.float64)
_BATCHED = {"cuda"}  # device types whose encode steps same-shape matrices together (reduce_many)
STATE_PREFIX = "powersgd.q/"  # client-state key of a tensor's warm-start Q: STATE_PREFIX + name


def state_key(name: str) -> str:
    """The ``state`` key under which the warm-start Q of tensor ``name`` is kept."""
    return STATE_PREFIX + name


# -- policy: which tensors travel as factors ------------------------------------------------------
def factor_shape(shape: tuple[int, ...], rank: int, min_compression: float) -> tuple[int, int, int] | None:
    """(n, m, r) when a tensor of ``shape`` travels as rank-r factors, else None (raw values).

    The tensor is viewed as an n x m matrix (n = shape[0], m = numel / n); it is factorised iff
    (n + m) r * min_compression <= n m, with r = min(rank, n, m). With min_compression >= 1 a rank
    of min(n, m) or more never passes the rule ((n + m) min(n, m) > n m), so the clamp matters
    only for min_compression < 1.
    """
    if len(shape) < 2:
        return None
    numel = math.prod(shape)
    if numel == 0:
        return None
    n = shape[0]
    m = numel // n
    r = min(rank, n, m)
    if (n + m) * r * min_compression <= n * m:
        return n, m, r
    return None


# -- math ----------------------------------------------------------------------------------------
def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis (n x r) of the columns of one matrix ``p`` (n x r, r <= n).

    Householder QR of this matrix alone: never normalised together with other matrices. A zero
    or dependent column still gets a unit column orthogonal to the others, so the result is
    always a basis and ``P_hat P_hat^T M`` a projection of M.
    """
    return torch.linalg.qr(p, mode="reduced").Q


def power_step(m: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One subspace-iteration step: P_hat = orthonormalize(M Q), Q_new = M^T P_hat."""
    p_hat = orthonormalize(m @ q)
    # (P_hat^T M)^T: the same bits as M^T P_hat, but a row-major pass over M (on one CPU thread
    # torch's M^T @ P_hat takes ~44 read passes of M, this ~1.7)
    return p_hat, (p_hat.t() @ m).t()


def balance(p_hat: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P_hat C, Q C^-1) for a diagonal C that gives column k of both factors the same RMS entry.

    The product P_hat Q^T is unchanged, so the decoder needs nothing. Unbalanced, P_hat has unit
    columns while Q carries the scale of M: a quantizer with per-block scales (qsgd) coding both
    in one block crushes P_hat to a few levels (powersgd(rank=2)+qsgd(bits=8) on a rank-2
    384 x 512 matrix of RMS entry 1: 123% error unbalanced, 1.6% balanced), and fp16 pushes the Q
    of a tiny M into its subnormals. c_k = sqrt(||q_k|| sqrt(n / m)); a zero column keeps c_k = 1.
    """
    n, m = p_hat.shape[0], q.shape[0]
    norms = torch.linalg.vector_norm(q, dim=0)
    c = torch.where(norms > 0, (norms * math.sqrt(n / m)).sqrt(), torch.ones_like(norms))
    return p_hat * c, q / c


def reconstruct(p_hat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P_hat Q^T (n x m), summed rank-1 term by rank-1 term in order: the same bits on any device.

    The output is the only full-size allocation: each further rank-1 term is formed in a
    row-block-sized buffer and added in place (a product then a sum, each rounded: no FMA).
    """
    y = p_hat[:, 0:1] * q[:, 0]
    r, n, m = p_hat.shape[1], p_hat.shape[0], q.shape[0]
    if r == 1:
        return y
    rows = max(1, _RECONSTRUCT_BLOCK // max(m, 1))
    buf = torch.empty(min(rows, n), m, dtype=y.dtype, device=y.device)
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        tmp = buf[: hi - lo]
        for k in range(1, r):
            torch.mul(p_hat[lo:hi, k:k + 1], q[:, k], out=tmp)
            y[lo:hi].add_(tmp)
    return y


_RECONSTRUCT_BLOCK = 1 << 16  # elements of one rank-1 term formed at a time (256 kB: stays in cache)


def cold_start(m: int, r: int, seed: int, name: str, device: torch.device) -> torch.Tensor:
    """N(0, 1) Q (m x r) from a private CPU generator seeded by (seed, tensor name): device independent."""
    mixed = (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) & ((1 << 63) - 1)
    gen = torch.Generator().manual_seed(mixed)
    return torch.randn(m, r, generator=gen).to(device)


# -- the reducer ---------------------------------------------------------------------------------
@register
class PowerSGD(Reducer):
    """Rank-r approximation P_hat Q^T of each weight matrix, warm-started across rounds.

    Per float tensor, viewed as an n x m matrix M (n = shape[0], m = numel / n):

    1. If ``(n + m) r * min_compression > n m`` (r = min(rank, n, m)), or the tensor has fewer
       than 2 dims, send its values raw (coded by the pipeline quantizer) and stop.
    2. Q (m x r): the Q this client computed for the tensor last round (``state`` key
       ``powersgd.q/<name>``: warm start), or N(0, 1) from a generator seeded by (seed, name).
    3. P = M Q (n x r).
    4. P_hat = orthonormalize(P): QR of this matrix alone.
    5. Q = M^T P_hat (m x r); keep it in ``state`` for the next round.
    6. Send P_hat C and Q C^-1 (n r + m r values), C diagonal so that column k of both has the
       same RMS entry (:func:`balance`: the product is unchanged, but a block-scaled or fp16
       quantizer sees values of one scale); the decoder rebuilds M_hat = P_hat Q^T from them.

    With error feedback (``fedcomp.compress``) the residual M - M_hat joins the next round's M,
    and the warm start makes the rounds together a power iteration: the approximation of a
    slowly changing M approaches the best rank-r one (truncated SVD).

    Compression per factorised matrix is n m / (r (n + m)); biases, 0-d tensors and matrices
    that fail the rule of step 1 travel at the quantizer's rate. Defaults: rank 1,
    min_compression 2 (torch's ``powerSGD_hook`` rule, which uses a strict ``<``), seed 0.
    The default quantizer is ``none`` (fp32); ``powersgd(rank=2)+fp16`` halves every value,
    raw ones included. Not unbiased and not linear (products of factors do not add up to the
    factors of a sum), so the codec needs error feedback and the server decodes each client.
    """

    name = "powersgd"
    # for clients that take part now and then (see the docs' Spec grammar: cross-device defaults)
    cross_device = {"rank": 8}
    scope = "tensor"
    unbiased = False
    linear = False
    budget_knobs = (Knob("rank", "levels"),)  # limit: knob_limit (the largest useful rank)

    @dataclass(frozen=True)
    class Config:
        rank: int = 2  # rank r of each approximation; clamped to min(n, m) per matrix (rank 1 lost 2.4 points on a CNN)
        min_compression: float = 2.0  # factorise a matrix iff its factors are >= this many times smaller; 0: every matrix
        seed: int = 0  # seeds the cold-start Q (with the tensor name); need not match between clients

    def validate(self) -> None:
        if self.config.rank < 1:
            self.fail("rank", "a positive integer")
        if not (math.isfinite(self.config.min_compression) and self.config.min_compression >= 0):
            self.fail("min_compression", "a finite float >= 0 (torch's default is 2; 0 factorises every matrix)")
        if self.config.seed < 0:
            self.fail("seed", "a non-negative integer")

    def factors(self, seg: Segment) -> tuple[int, int, int] | None:
        """(n, m, r) when the segment's tensor travels as factors, else None."""
        return factor_shape(seg.shapes[0], self.config.rank, self.config.min_compression)

    def count(self, seg: Segment) -> int | None:
        f = self.factors(seg)
        return seg.numel if f is None else f[2] * (f[0] + f[1])

    def side_nbytes(self, seg: Segment, count: int) -> int | None:
        return 0

    def reduce(self, x: torch.Tensor, seg: Segment, out: Writer, ctx: StageContext) -> tuple[torch.Tensor, Any, int]:
        f = self.factors(seg)
        if f is None:
            return x, None, 0
        n, m, r = f
        mat = x.view(n, m)
        key = state_key(seg.names[0])
        q = ctx.state.get(key) if ctx.state is not None else None
        if q is None or tuple(q.shape) != (m, r) or not bool(torch.isfinite(q).all()):
            q = cold_start(m, r, self.config.seed, seg.names[0], x.device)
        p_hat, q_new = power_step(mat, q.to(x.device, torch.float32))
        if ctx.state is not None:
            ctx.state[key] = q_new
        p_send, q_send = balance(p_hat, q_new)
        return torch.cat([p_send.reshape(-1), q_send.reshape(-1)]), None, 0

    values_only = True  # no side information: a codec's encode may reduce every segment first (reduce_many)

    def reduce_many(self, xs: list[torch.Tensor], segs: list[Segment], ctx: StageContext) -> list[torch.Tensor]:
        """:meth:`reduce`'s values of every segment (flat fp32 ``xs``). On the CPU one by one (the
        bytes every CPU writes); elsewhere (``_BATCHED`` devices) the matrices of one (n, m, r)
        are stacked and stepped together (batched products and QR: a few ops a shape instead of
        dozens a tensor, the warm starts' finiteness checked in one sync a shape). A GPU's factors
        differ from a CPU's in their last bits either way (cuBLAS; see the docs' Explanations:
        same bytes on every device)."""
        if not xs or xs[0].device.type not in _BATCHED:
            return [self.reduce(x, seg, None, ctx)[0] for x, seg in zip(xs, segs)]  # type: ignore[arg-type]
        out: list[torch.Tensor | None] = [None] * len(xs)
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, seg in enumerate(segs):
            f = self.factors(seg)
            if f is None:
                out[i] = xs[i]
            else:
                groups.setdefault(f, []).append(i)
        for (n, m, r), ids in groups.items():
            device = xs[ids[0]].device
            mats = torch.stack([xs[i].view(n, m) for i in ids])
            keys = [state_key(segs[i].names[0]) for i in ids]
            qs = [ctx.state.get(k) if ctx.state is not None else None for k in keys]
            qs = [q if q is not None and tuple(q.shape) == (m, r) else None for q in qs]
            warm = [j for j, q in enumerate(qs) if q is not None]
            if warm:  # one check for the group's warm starts
                w = torch.stack([qs[j].to(device, torch.float32) for j in warm])
                ok = torch.isfinite(w).flatten(1).all(dim=1).tolist()
                for a, (j, good) in enumerate(zip(warm, ok)):
                    qs[j] = w[a] if good else None
            q = torch.stack([qs[j] if qs[j] is not None else cold_start(m, r, self.config.seed, segs[i].names[0], device)
                             for j, i in enumerate(ids)])
            p_hat = torch.linalg.qr(torch.bmm(mats, q), mode="reduced").Q
            q_new = torch.bmm(p_hat.transpose(1, 2), mats).transpose(1, 2)
            norms = torch.linalg.vector_norm(q_new, dim=1, keepdim=True)
            c = torch.where(norms > 0, (norms * math.sqrt(n / m)).sqrt(), torch.ones_like(norms))
            vals = torch.cat([(p_hat * c).reshape(len(ids), -1), (q_new / c).reshape(len(ids), -1)], dim=1)
            for j, i in enumerate(ids):
                if ctx.state is not None:
                    ctx.state[keys[j]] = q_new[j]
                out[i] = vals[j]
        return out  # type: ignore[return-value]

    def read(self, src: Reader, seg: Segment, ctx: StageContext, device: torch.device) -> Any:
        return None

    def value_count(self, aux: Any, seg: Segment) -> int:
        return self.count(seg)  # type: ignore[return-value]

    def expand(self, values: torch.Tensor, aux: Any, seg: Segment) -> torch.Tensor:
        f = self.factors(seg)
        if f is None:
            return values
        n, m, r = f
        if values.device.type == "cpu" and values.dtype == torch.float32 and (k := kernels.for_encode()) is not None \
                and not bool(torch.isnan(values).any()):
            # the compiled loop where it is loaded (a client's decode does not import numba for it),
            # into a buffer of the decode's arena (the rank-1 terms into fresh torch memory were most
            # of a dense decode).
            # Factors holding a NaN take torch's ops: where two NaNs meet, the loop and torch keep
            # different ones' sign and payload bits (NaNs made here, from inf, are all the one default NaN)
            out = output_empty(n * m)
            k.lowrank(*self._host_factors(values, n, m, r), r, m, 0, n * m, out.numpy(), _NO64, 0.0, False)
            return out
        return reconstruct(values[: n * r].view(n, r), values[n * r:].view(m, r)).reshape(-1)

    def expand_range(self, values: torch.Tensor, aux: Any, seg: Segment, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of :meth:`expand`'s result (the same bits), from the rows of P_hat Q^T
        that hold them: a server adds a reply to its sum without the dense matrix."""
        f = self.factors(seg)
        if f is None:
            return values[lo:hi]
        n, m, r = f
        if values.device.type == "cpu" and (k := kernels.get()) is not None:
            out = torch.empty(hi - lo, dtype=torch.float32)
            k.lowrank(*self._host_factors(values, n, m, r), r, m, lo, hi, out.numpy(), _NO64, 0.0, False)
            return out
        a, b = lo // m, -(-hi // m)
        y = reconstruct(values[: n * r].view(n, r)[a:b], values[n * r:].view(m, r)).reshape(-1)
        return y[lo - a * m:hi - a * m]

    def add_range(self, values: torch.Tensor, aux: Any, seg: Segment, lo: int, hi: int,
                  target: torch.Tensor, weight: float) -> bool:
        """``target += weight * expand_range(...)`` (a float64 CPU target) in one fused loop over
        the rows of P Q^T (:mod:`fedcomp.kernels`, the same fp32 values); False where there is
        none (no numba, another device or dtype)."""
        if target.dtype != torch.float64 or target.device.type != "cpu":
            return False
        add = self.range_adder(values, aux, seg)
        if add is None:
            return False
        add(lo, hi, target.numpy(), float(weight))
        return True

    def range_adder(self, values: torch.Tensor, aux: Any, seg: Segment):
        """``f(lo, hi, s, w)``: ``s += w * expand_range(...)`` into a float64 numpy ``s`` in one fused
        loop, with the factors prepared once (a server adding many short ranges); None where there
        is no fused loop (no numba, another device)."""
        k = kernels.get() if values.device.type == "cpu" else None
        if k is None:
            return None
        f = self.factors(seg)
        if f is None:
            flat = values.numpy()
            return lambda lo, hi, s, w: k.add_f32(flat[lo:hi], s, w)
        n, m, r = f
        p, qt = self._host_factors(values, n, m, r)
        return lambda lo, hi, s, w: k.lowrank(p, qt, r, m, lo, hi, _NO32, s, w, True)

    def sq_all(self, values: torch.Tensor, aux: Any, seg: Segment, lo: int, hi: int) -> float | None:
        """||P Q^T||_F^2 of the whole segment from its factors, sum((P^T P) * (Q^T Q)) in float64:
        O((n + m) r^2) instead of building n m values. NaN where a factor is not finite (then
        some value of P Q^T is: every value takes a product with each factor entry of its row
        and column); None (build the values) for a range, for raw values, and where
        r max|P| max|Q| comes near fp32's largest value (a value could overflow to inf). It is
        the norm of the exact product, within ~1e-7 relative of the fp32 values' norm (each
        value is rounded to fp32; the server adds the rounded values)."""
        f = self.factors(seg)
        if f is None:
            return None
        n, m, r = f
        if (lo, hi) != (0, n * m):
            return None
        if values.device.type == "cpu" and (k := kernels.get()) is not None:  # one compiled call
            total, top_p, top_q, finite = k.lowrank_sq(values[: n * r].numpy(), values[n * r:].numpy(), r)
            bound = r * top_p * top_q
            if not finite or not math.isfinite(bound):
                return math.nan
            return None if bound > 2.0 ** 127 else float(total)
        p = values[: n * r].view(n, r).double()
        q = values[n * r:].view(m, r).double()
        bound = r * float(p.abs().max()) * float(q.abs().max())
        if not math.isfinite(bound):
            return math.nan
        if bound > 2.0 ** 127:
            return None
        return float(((p.t() @ p) * (q.t() @ q)).sum())

    def sq_range(self, values: torch.Tensor, aux: Any, seg: Segment, lo: int, hi: int) -> float | None:
        """Sum of squares (float64) of ``expand_range(...)`` built in a reused buffer (CPU kernels;
        None where there are none)."""
        k = kernels.get() if values.device.type == "cpu" else None
        if k is None:
            return None
        f = self.factors(seg)
        if f is None:
            return float(k.sumsq(values[lo:hi].numpy()))
        n, m, r = f
        buf = kernels.scratch(hi - lo, np.float32)
        k.lowrank(*self._host_factors(values, n, m, r), r, m, lo, hi, buf, _NO64, 0.0, False)
        return float(k.sumsq(buf))

    @staticmethod
    def _host_factors(values: torch.Tensor, n: int, m: int, r: int):
        """(P, Q^T) flat for the kernel: P row-major as sent, Q^T (r rows of m) made contiguous."""
        return values[: n * r].numpy(), values[n * r:].view(m, r).t().contiguous().view(-1).numpy()

    # -- byte budgets: the rank's range, and the values the quantizer sees at the largest rank --
    def knob_limit(self, knob, floats):
        mc, top = self.config.min_compression, 1
        for t in (t for t in floats if len(t.shape) >= 2):
            n, m = t.shape[0], t.numel // t.shape[0]
            top = max(top, min(n, m) if mc <= 0 else min(n, m, int(n * m // ((n + m) * mc))))
        return top

    def max_values(self, floats):
        r, mc = self.knob_limit(None, floats), self.config.min_compression
        return max([t.numel for t in floats] + [t.numel if f is None else f[2] * (f[0] + f[1])
                                                for t in floats for f in [factor_shape(t.shape, r, mc)]], default=0)
