"""The counter-based hash behind `fedcomp.uniforms` (u_i = hash(key, i)), the count sketch, random
and hashed selection, Rice-coded positions and scatter adds at positions.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from fedcomp._kernels.core import _F32, _f32_at, _f64_at, _i64_at


# -- counter-based uniforms (fedcomp.uniforms): u_i = hash(key, i), the bits of uniforms.fill ----
_G = np.uint32(0x9E3779B9)
_A = np.uint32(0x7FEB352D)
_B = np.uint32(0x846CA68B)
_U24 = _F32(2.0 ** -24)
_U17 = _F32(2.0 ** -17)


@njit(inline="always")
def _base(k0, i0):
    """uint32(k0 + i0 * G): the Weyl term of element i0 (:func:`_h32` counts j from it; a loop
    carries it with :func:`_step`)."""
    return np.uint32(k0 + np.uint32(i0 & 0xFFFFFFFF) * _G)


def _low32(builder, v):
    """The low 32 bits of an integer IR value."""
    i32 = ir.IntType(32)
    width = v.type.width
    return v if width == 32 else builder.trunc(v, i32) if width > 32 else builder.zext(v, i32)


def _mix_ir(builder, h):
    """lowbias32's finalizer of the i32 ``h`` (:mod:`fedcomp.uniforms`)."""
    def const(v):
        return ir.Constant(ir.IntType(32), v)
    h = builder.xor(h, builder.lshr(h, const(16)))
    h = builder.mul(h, const(int(_A)))
    h = builder.xor(h, builder.lshr(h, const(15)))
    h = builder.mul(h, const(int(_B)))
    return builder.xor(h, builder.lshr(h, const(16)))


@intrinsic
def _h32(typingctx, base, k1, j):
    """h_(i0 + j) of the stream of key (k0, k1), base = _base(k0, i0): see :mod:`fedcomp.uniforms`
    (each argument's low 32 bits). Written in 32-bit IR: numba widens integer arithmetic to
    int64, and its vectorized loops then multiplied 64-bit lanes (vpmullq, 8 per AVX-512
    register, several times slower than vpmulld's 16). Loops over consecutive elements use
    :func:`_hw` instead."""
    sig = types.uint32(base, k1, j)

    def codegen(context, builder, signature, args):
        b, k, jj = (_low32(builder, a) for a in args)
        return _mix_ir(builder, builder.xor(builder.add(b, builder.mul(jj, ir.Constant(ir.IntType(32), int(_G)))), k))
    return sig, codegen


@intrinsic
def _hw(typingctx, w, k1):
    """The hash of Weyl term ``w`` (uint32(k0 + i * G), :func:`_base`): h_i of key (k0, k1).

    Why: a loop that carries w (``w = _step(w)``) adds a vector of 16 * G per 16 lanes where
    _h32's ``j * G`` stayed a vpmulld (LLVM does not strength-reduce vector multiplies): one of
    the hash's three multiplies."""
    sig = types.uint32(w, k1)

    def codegen(context, builder, signature, args):
        ww, k = (_low32(builder, a) for a in args)
        return _mix_ir(builder, builder.xor(ww, k))
    return sig, codegen


@intrinsic
def _step(typingctx, w):
    """The next Weyl term, w + G mod 2**32, in 32-bit IR (so that the loop's induction is 32 bits:
    numba's own uint32 arithmetic widens it to 64-bit lanes)."""
    sig = types.uint32(w)

    def codegen(context, builder, signature, args):
        return builder.add(_low32(builder, args[0]), ir.Constant(ir.IntType(32), int(_G)))
    return sig, codegen


@njit(inline="always")
def _u24w(w, k1):
    """u_i = (h_i >> 8) / 2**24 of Weyl term ``w`` (:func:`_hw`)."""
    return _F32(np.int32(_hw(w, k1) >> np.uint32(8))) * _U24


@njit(inline="always")
def _u16(b0, k1, i):
    """The half-width u_i (uniforms.fill16): (m + 1/2) / 2**16, m the half i & 1 of h_(i >> 1);
    b0 = _base(k0, 0)."""
    h = _h32(b0, k1, i >> 1)
    return _F32(np.int32((h >> np.uint32(16 * (i & 1))) & np.uint32(0xFFFF)) * np.int32(2) + np.int32(1)) * _U17


@njit(cache=True, nogil=True)
def sketch_add(x, k0s, k1s, cols, table):
    """CountSketch.sketch, payload format 2 (:meth:`fedcomp.codecs.sketch.CountSketch._hash_chunks`):
    for row r and element j, h = h_j of the stream (k0s[r], k1s[r]), the cell r * cols +
    (h * cols >> 32), the sign - where h is odd; table[cell] += sign * x[j], row by row and
    element by element in index order, as ``scatter_add_`` and ``index_add_`` add them (the same fp32 sums)."""
    n = x.shape[0]
    c64 = np.uint64(cols)
    one = np.uint32(1)
    for r in range(k0s.shape[0]):
        base = _base(k0s[r], 0)
        k1 = k1s[r]
        off = r * cols
        for j in range(n):
            h = _h32(base, k1, j)
            c = off + np.int64((np.uint64(h) * c64) >> np.uint64(32))
            v = x[j]
            table[c] += -v if h & one else v


@njit(cache=True, nogil=True)
def cells_sums(x, k0, k1, cols, sums, counts):
    """SketchCells.reduce (one row, format 2's hashes, as :func:`sketch_add`): for every nonzero
    x[j] (NaN included), sums[c] += sign * x[j] in float64 and counts[c] += 1, c = h_j * cols >> 32."""
    c64 = np.uint64(cols)
    w = _base(k0, 0)
    for j in range(x.shape[0]):
        h = _hw(w, k1)
        w = _step(w)
        v = x[j]
        if v != 0:
            c = np.int64((np.uint64(h) * c64) >> np.uint64(32))
            d = np.float64(v)
            sums[c] += -d if h & np.uint32(1) else d
            counts[c] += 1.0


@njit(cache=True, nogil=True)
def cells_expand(table, k0, k1, cols, y):
    """SketchCells.expand: y[j] = sign_j * table[h_j * cols >> 32] (fp32; -0.0 where a negative
    sign meets an empty cell, as the torch path's product)."""
    c64 = np.uint64(cols)
    w = _base(k0, 0)
    for j in range(y.shape[0]):
        h = _hw(w, k1)
        w = _step(w)
        v = table[np.int64((np.uint64(h) * c64) >> np.uint64(32))]
        y[j] = -v if h & np.uint32(1) else v


_HBLOCK = 1 << 16  # hashes per step of smallest_hashes (a block's top bits fit one small buffer)


@njit(cache=True, nogil=True)
def smallest_hashes(k0, k1, n, k, out, sigmas):
    """out[:k] = the positions of the k smallest (h_i, i) over i < n, ascending
    (:func:`fedcomp.uniforms.smallest`); False (out undefined) where the band missed.

    One pass where the hashes behave as uniforms: the k-th smallest h lies within ``sigmas``
    binomial standard deviations of k / n * 2**32, so every position below that band is in, and
    only the band's own (a few thousand) are ranked exactly. Per block of 65,536: the hashes in
    a vectorized loop, then branch-free scans. If the band misses the k-th (for 8 sigmas, about
    once in 10**15 draws), the caller runs :func:`smallest_exact` (two passes, the same answer;
    called from here, it slowed this loop 5x)."""
    if k == 0:
        return True
    p = k / n
    spread = sigmas * math.sqrt(n * p * (1.0 - p)) + 64.0
    lo = np.int64(max(0.0, math.floor((k - spread) / n * 4294967296.0)))
    width = np.int64(min(4294967296.0, math.ceil((k + spread) / n * 4294967296.0))) - lo
    hs = np.empty(_HBLOCK, dtype=np.uint32)
    sel = np.empty(_HBLOCK, dtype=np.int64)
    cut = np.empty(_HBLOCK, dtype=np.int64)
    band = np.empty(4096, dtype=np.int64)
    nb = 0
    o = 0
    for a in range(0, n, _HBLOCK):
        m = min(n, a + _HBLOCK) - a
        w = _base(k0, a)
        h = hs[:m]
        for j in range(m):  # vectorized: the hashes alone
            h[j] = _hw(w, k1)
            w = _step(w)
        c = 0
        d = 0
        for j in range(m):  # branch-free: write always, advance where below / in the band
            v = np.int64(h[j]) - lo
            sel[c] = a + j
            c += v < 0
            cut[d] = (v << 31) + a + j
            d += np.uint64(v) < np.uint64(width)
        if o + c > k:
            return False
        out[o:o + c] = sel[:c]
        o += c
        if nb + d > band.shape[0]:
            grown = np.empty(2 * (nb + d), dtype=np.int64)
            grown[:nb] = band[:nb]
            band = grown
        band[nb:nb + d] = cut[:d]
        nb += d
    if o + nb < k:
        return False
    keys = np.sort(band[:nb])[:k - o]
    _merge(out, o, np.sort(keys & ((1 << 31) - 1)), k)
    return True


@njit(cache=True, nogil=True)
def stratum_positions(k0, k1, n, k, out):
    """out[j] = random-k's position in stratum j of k (:func:`fedcomp.uniforms.strata`): the
    stratum's start plus (h_j * its size) >> 32, strata of n // k elements, the first n % k one
    longer."""
    s = np.uint64(n // k)
    r = np.uint64(n % k)
    base = _base(k0, 0)
    for j in range(k):  # vectorized: 32 x 32 -> 64-bit products (all operands below 2**32)
        u = np.uint64(j)
        size = s + np.uint64(u < r)
        h = np.uint64(_h32(base, k1, j))
        out[j] = np.int64(u * s + min(u, r) + ((h * size) >> np.uint64(32)))


@njit(cache=True, nogil=True)
def add_at(target, pos, offset, values, w):
    """target[pos[j] - offset] += w * float64(values[j]), in order (the bits of ``index_add_``
    with ``alpha=w``)."""
    for j in range(pos.shape[0]):
        target[pos[j] - offset] += w * np.float64(values[j])


@njit(cache=True, nogil=True)
def add_at_runs(sums, starts, numels, pos_at, val_at, cuts, weights, chunk):
    """:func:`add_at` for a batch of sparse replies: reply r's ascending flat positions (int64 at
    address pos_at[r]) and fp32 values (at val_at[r]), those of tensor t being cuts[r, t] to
    cuts[r, t + 1]; tensor t's float64 sum at address sums[t] (numels[t] elements, flat offset
    starts[t]). Per tensor, per ``chunk`` elements of its sum, every reply in order: the chunk
    stays in the cache, and each element gets its additions in reply order (the bits of add_at
    reply after reply)."""
    nr = weights.shape[0]
    cur = np.empty(nr, dtype=np.int64)
    for t in range(numels.shape[0]):
        n = numels[t]
        off = starts[t]
        sm = carray(_f64_at(sums[t]), (n,))
        for r in range(nr):
            cur[r] = cuts[r, t]
        for c in range(0, n, chunk):
            hi = off + min(n, c + chunk)
            for r in range(nr):
                end = cuts[r, t + 1]
                pos = carray(_i64_at(pos_at[r]), (end,))
                val = carray(_f32_at(val_at[r]), (end,))
                w = weights[r]
                j = cur[r]
                while j < end and pos[j] < hi:
                    sm[pos[j] - off] += w * np.float64(val[j])
                    j += 1
                cur[r] = j


@njit(cache=True, nogil=True)
def rice_decode(unary, rem, k, r, n, out):
    """:func:`fedcomp.bitpack.rice_decode` into out[:k] in one pass over the two bit streams
    (MSB first; a gap g is g >> r ones and a zero in ``unary``, its low r bits in ``rem``). True
    where the streams are well formed; False for any fault, which the caller re-reads with torch
    ops to raise the exact error."""
    j = 0
    idx = np.int64(-1)
    q = np.int64(0)
    limit = n >> r
    last = 0  # the byte of the last zero
    for b in range(unary.shape[0]):
        byte = unary[b]
        if byte == 0xFF:
            q += 8
            continue
        for t in range(7, -1, -1):
            if (byte >> t) & 1:
                q += 1
                continue
            if j == k or q > limit:
                return False
            g = np.int64(0)
            o = j * r
            for i in range(o, o + r):  # the r-bit remainder, MSB first
                g = (g << 1) | ((rem[i >> 3] >> (7 - (i & 7))) & 1)
            idx += (q << r) + g + 1
            if idx >= n:  # checked at every index: later sums cannot wrap
                return False
            out[j] = idx
            j += 1
            q = 0
            last = b
    return j == k and (k == 0 or last == unary.shape[0] - 1)


@njit(cache=True, nogil=True)
def ascending(a):
    """Whether a[j] >= a[j - 1] for every j (one vectorized pass)."""
    ok = True
    for j in range(1, a.shape[0]):
        ok &= a[j] >= a[j - 1]
    return ok


@njit(cache=True, nogil=True)
def _merge(out, o, chosen, k):
    """out[:k] = the ascending merge of out[:o] and ``chosen`` (k - o positions), in place."""
    i = o - 1
    j = chosen.shape[0] - 1
    for w in range(k - 1, -1, -1):
        if j < 0:
            break
        if i >= 0 and out[i] > chosen[j]:
            out[w] = out[i]
            i -= 1
        else:
            out[w] = chosen[j]
            j -= 1


@njit(cache=True, nogil=True)
def smallest_exact(k0, k1, n, k, out):
    """:func:`smallest_hashes` in two passes, whatever the hashes: a histogram of their top 16
    bits finds the bin of the k-th smallest; the second pass keeps every position below that bin
    and ranks the bin's own by (low bits, position)."""
    hist = np.zeros(1 << 16, dtype=np.int64)
    top = np.empty(_HBLOCK, dtype=np.uint32)
    for a in range(0, n, _HBLOCK):
        m = min(n, a + _HBLOCK) - a
        w = _base(k0, a)
        t = top[:m]
        for j in range(m):
            t[j] = _hw(w, k1) >> 16
            w = _step(w)
        for j in range(m):
            hist[t[j]] += 1
    cut = 0
    below = 0
    while below + hist[cut] < k:
        below += hist[cut]
        cut += 1
    cand = np.empty(hist[cut], dtype=np.int64)  # (low 16 bits) * 2**31 + position
    c = 0
    o = 0
    for a in range(0, n, _HBLOCK):
        m = min(n, a + _HBLOCK) - a
        base = _base(k0, a)
        for j in range(m):
            h = _h32(base, k1, j)
            hb = np.int64(h >> 16)
            if hb < cut:
                out[o] = a + j
                o += 1
            elif hb == cut:
                cand[c] = (np.int64(h & 0xFFFF) << 31) + a + j
                c += 1
    cand.sort()
    _merge(out, o, np.sort(cand[:k - o] & ((1 << 31) - 1)), k)
