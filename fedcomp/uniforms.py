"""Counter-based uniforms for stochastic rounding: ``u_i = hash(key, i)``, not a generator's stream.

Why: drawing one uniform per element from a ``torch.Generator`` (``torch.rand``) costs ~23 read
passes of the data on one CPU thread, more than everything else a stochastic quantizer does. A
hash of (key, element index) costs ~1-2 passes inside a fused loop and needs no uniform array.
The key is drawn once per encoded segment from the caller's generator, so a seeded run stays
reproducible and every (node, round, segment) gets its own stream, as before.

The function (all arithmetic mod 2**32; ``key`` = (k0, k1), two 32-bit words; ``i`` the
element's index in the segment)::

    h = (k0 + i * G) xor k1                                                      G = 0x9E3779B9
    h = lowbias32(h)     # h ^= h >> 16; h *= 0x7FEB352D; h ^= h >> 15; h *= 0x846CA68B; h ^= h >> 16
    u_i = (h >> 8) / 2**24                                                       # in [0, 1), 24 bits

A Weyl sequence through a bijective 32-bit mixer (Wellons' ``lowbias32``), 32-bit rather than
splitmix64's 64-bit arithmetic because AVX2 has no 64-bit vector multiply (about twice as fast
here). k1 enters after the Weyl
step, so streams of different keys are different sequences, not shifts of one. The stream
repeats after 2**32 elements of one segment (16 GB of fp32; no update is that large). u_i is a
multiple of 2**-24, as an fp32 ``torch.rand`` value is. The fused CPU loops
(`fedcomp._kernels.hashing`, ``_u24w``) and :func:`fill` (torch int32 ops: CUDA tensors, no
numba, ``FEDCOMP_KERNELS=0``) give the same bits, so a payload's bytes do not depend on which
path encoded it.

Half-width uniforms (TernGrad's draws, :func:`fill16`): the two 16-bit halves of one hash serve
two elements, m_i = (h_(i >> 1) >> 16 * (i & 1)) & 0xFFFF (the low half for the even element), and
u_i = (m_i + 1/2) / 2**16: centred in its 2**-16 cell. The stream repeats after 2**33 elements.
Why: TernGrad's codes loop is compute-bound and the hash was most of its vector operations; a
hash per two values speeds it up (see the docs' Results: performance). What it costs: P(u_i * s < a) is a / s rounded to the
nearest multiple of 2**-16 (2**-24 before), a bias of at most min(|x|, s * 2**-17) per element,
either way, so it averages out over values spread across the cells (plus the rounding of the fp32
product u * s, which dominates for a subnormal s, below ~1.2e-38, as it did with 24 bits). Why centred: with
u = m / 2**16, m = 0 passed every a > 0, so every value below s * 2**-16 was sent with
probability 2**-16, a bias of up to s * 2**-16 that always pointed away from zero and added up
over a tensor (100,000 values of 1e-7 beside one of 1.0 decoded to a sum of ~1.5 against 0.01);
now such a value is not sent (a sum of 0). The centre costs no operation in the compiled loop
(one fused multiply-add where there was a multiply).
"""

from __future__ import annotations

import numpy as np
import torch

G = 0x9E3779B9  # Weyl increment (2**32 / golden ratio, odd)
A = 0x7FEB352D  # lowbias32's multipliers
B = 0x846CA68B
M32 = 0xFFFFFFFF
SCALE = 2.0 ** -24
SCALE17 = 2.0 ** -17  # the half-width u = (2 m + 1) * 2**-17


def draw_key(gen: torch.Generator | None, device: torch.device) -> tuple[int, int]:
    """(k0, k1): the 64-bit key of one segment's stream, two 32-bit draws from ``gen`` (on the
    generator's device; the global generator of ``device`` when ``gen`` is None)."""
    dev = gen.device if gen is not None else device
    k = torch.randint(0, 1 << 32, (2,), generator=gen, device=dev, dtype=torch.int64).tolist()
    return int(k[0]), int(k[1])


def reference_hash(key: tuple[int, int], i: int) -> int:
    """h_i, the 32-bit hash of element i, in plain Python (the definition; for tests)."""
    k0, k1 = key
    h = ((k0 + i * G) & M32) ^ k1
    h ^= h >> 16
    h = (h * A) & M32
    h ^= h >> 15
    h = (h * B) & M32
    return h ^ (h >> 16)


def reference(key: tuple[int, int], i: int) -> float:
    """u_i in plain Python (the definition; for tests)."""
    return (reference_hash(key, i) >> 8) * SCALE


def reference16(key: tuple[int, int], i: int) -> float:
    """u_i of the half-width stream (:func:`fill16`) in plain Python (the definition; for tests)."""
    return (((reference_hash(key, i >> 1) >> 16 * (i & 1)) & 0xFFFF) * 2 + 1) * SCALE17


def smallest(key: tuple[int, int], n: int, k: int, *, load: bool = True, sigmas: float = 8.0) -> torch.Tensor:
    """The k positions in [0, n) of the smallest 32-bit hashes h_i of the stream ``key`` (the h
    of u_i = (h >> 8) / 2**24), ties broken by position, ascending (int64, CPU): a uniformly
    random k-subset, the same one on every path. A fused loop where numba is loaded (one pass:
    every position whose hash lies below a band of ``sigmas`` binomial deviations around the
    expected k-th is in, the band's own are ranked; two exact passes in the rare case the band
    misses, ``sigmas=0`` forces them in tests); otherwise torch ops (``torch.topk`` over keys
    h * 2**31 + i). ``load=False`` (a client's encode) uses the loop only where numba is loaded
    already (:func:`fedcomp.kernels.for_encode`: a fresh ClientApp process would pay ~1.4 s).
    Why not ``randperm(n)[:k]``: it costs ~280 read passes of a 25M-element update on one thread,
    for the encoder and again for the decoder, and its stream is torch's, not ours."""
    if not 0 <= k <= n < 1 << 31:
        raise ValueError(f"k={k}, n={n}: need 0 <= k <= n < 2**31")
    from fedcomp import kernels

    k_ = kernels.get() if load else kernels.for_encode()
    if k_ is not None:
        out = np.empty(k, dtype=np.int64)
        k0, k1 = np.uint32(key[0]), np.uint32(key[1])
        if not k_.smallest_hashes(k0, k1, n, k, out, float(sigmas)):
            k_.smallest_exact(k0, k1, n, k, out)
        return torch.from_numpy(out)
    h = _mix(key, 0, n, torch.device("cpu")).to(torch.int64).bitwise_and_(M32)
    h.bitwise_left_shift_(31).add_(torch.arange(n, dtype=torch.int64))
    keys = torch.topk(h, k, largest=False, sorted=False).values if k < n else h
    return keys.bitwise_and_((1 << 31) - 1).sort().values


STRATA = 0x6A09E667  # k1 ^ this: random-k's strata stream, apart from the quantizer's of the same key


def strata(key: tuple[int, int], n: int, k: int, *, load: bool = True) -> torch.Tensor:
    """Random-k's positions (payload format 3): [0, n) cut into k consecutive strata of n // k
    elements (the first n % k one longer), and in stratum j the element at offset
    (h_j * size_j) >> 32 of its start, h_j the 32-bit hash of j in the stream of (k0, k1 ^
    STRATA): k distinct positions, ascending (int64, CPU), the same on every path.

    Why not the k smallest of n hashes (:func:`smallest`, format 2): that reads a hash per element
    (~7 read passes at 25M elements, for the encoder and again for every reply the server adds);
    this is one per kept element. Each element is kept with probability 1 / size_j (k / n where k
    divides n), so scaling a kept value by its stratum's size (:func:`stratum_sizes`) is unbiased,
    and the error a draw leaves, E||x - kept||^2 = sum (1 - 1/size_j) x_i^2, is a uniform
    k-subset's (1 - k/n) ||x||^2 where k divides n (both depend on the per-element probabilities
    only). What differs: two neighbours in one stratum are never kept together, and every
    stretch of the update gets its share of the k. ``load``: as :func:`smallest`."""
    if not 0 <= k <= n < 1 << 31:
        raise ValueError(f"k={k}, n={n}: need 0 <= k <= n < 2**31")
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    from fedcomp import kernels

    k0, k1 = key[0], key[1] ^ STRATA
    k_ = kernels.get() if load else kernels.for_encode()
    if k_ is not None:
        out = np.empty(k, dtype=np.int64)
        k_.stratum_positions(np.uint32(k0), np.uint32(k1), n, k, out)
        return torch.from_numpy(out)
    s, r = divmod(n, k)
    h = _mix((k0, k1), 0, k, torch.device("cpu")).to(torch.int64).bitwise_and_(M32)
    h[:r].mul_(s + 1)  # in place, few temporaries: h * size_j >> 32, plus the start j * s + min(j, r)
    h[r:].mul_(s)
    h.bitwise_right_shift_(32).add_(torch.arange(0, k * s, s, dtype=torch.int64))
    h[:r].add_(torch.arange(r, dtype=torch.int64))
    h[r:].add_(r)
    return h


def stratum_sizes(n: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The k strata's sizes of :func:`strata` (n // k, the first n % k of them one more)."""
    s, r = divmod(n, k) if k else (0, 0)
    size = torch.full((k,), s, dtype=dtype)
    size[:r] += 1
    return size


def _mix(key: tuple[int, int], start: int, n: int, device: torch.device,
         work: torch.Tensor | None = None) -> torch.Tensor:
    """h_(start + j) for j < n: the 32-bit hashes, as int32 (their bits) in ``work`` or fresh."""
    k0, k1 = key
    if work is None or work.numel() < 2 * n or work.dtype != torch.int32:
        work = torch.empty(2 * n, dtype=torch.int32, device=device)
    h, t = work[:n], work[n:2 * n]
    torch.arange(0, n, dtype=torch.int32, device=device, out=h)
    h.mul_(_s32(G)).add_(_s32((k0 + start * G) & M32)).bitwise_xor_(_s32(k1))  # k0 + (start + j) G
    for shift, mul in ((16, A), (15, B), (16, None)):
        torch.bitwise_right_shift(h, shift, out=t).bitwise_and_(M32 >> shift)
        h.bitwise_xor_(t)
        if mul is not None:
            h.mul_(_s32(mul))
    return h


def fill(key: tuple[int, int], start: int, out: torch.Tensor, work: torch.Tensor | None = None) -> torch.Tensor:
    """out[j] = u_(start + j) (``out``: fp32, any device) with torch int32 ops. ``work``: a
    reused int32 buffer of at least 2 * len(out) elements on out's device (fresh temporaries
    cost more in page faults than the arithmetic).

    uint32 arithmetic in int32 tensors: products and sums wrap mod 2**32 (two's complement), and
    right shifts are masked to act as logical shifts (torch's >> is arithmetic)."""
    n = out.numel()
    if n == 0:
        return out
    h = _mix(key, start, n, out.device, work)
    h.bitwise_right_shift_(8).bitwise_and_(M32 >> 8)
    return out.copy_(h).mul_(SCALE)


def fill16(key: tuple[int, int], start: int, out: torch.Tensor, work: torch.Tensor | None = None) -> torch.Tensor:
    """out[j] = the half-width u_(start + j) (module docstring; TernGrad's draws) with torch int32
    ops; ``work`` as :func:`fill`'s. The hashes h_m, m from start >> 1, give their low halves to
    the even elements and their high halves to the odd ones."""
    n = out.numel()
    if n == 0:
        return out
    m0 = start >> 1
    count = ((start + n - 1) >> 1) - m0 + 1
    h = _mix(key, m0, count, out.device, work)
    reuse = work is not None and work.dtype == torch.int32 and work.numel() >= 2 * count  # _mix's h is in it
    lo = work[count:2 * count] if reuse else torch.empty_like(h)
    torch.bitwise_and(h, 0xFFFF, out=lo).mul_(2).add_(1)  # 2 m + 1
    h.bitwise_right_shift_(16).bitwise_and_(0xFFFF).mul_(2).add_(1)
    halves = (lo, h) if start % 2 == 0 else (h, lo[1:])  # out[0] is the low half of h_m0 where start is even
    evens, odds = out[0::2], out[1::2]
    evens.copy_(halves[0][:evens.numel()])
    odds.copy_(halves[1][:odds.numel()])
    return out.mul_(SCALE17)


def _s32(v: int) -> int:
    """A uint32 as the int32 with its bits."""
    return v - (1 << 32) if v >= 1 << 31 else v
