"""Encode side: pack codes, and the blockwise quantizers' codes with their stochastic rounding
(uniforms from the counter hash, `fedcomp.uniforms`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fedcomp._kernels.core import _F32, _f32_bits, _fma, _prefetch_next
from fedcomp._kernels.hashing import _base, _step, _u16, _u24w


# -- encode: blockwise quantizers' codes (the client's write path) ------------------------------
@njit(cache=True, nogil=True)
def pack(codes, count, bits, out):
    """codes[:count] (each < 2**bits) MSB-first into out (``bitpack.pack_bits``' bytes)."""
    if bits == 8:
        for i in range(count):
            out[i] = codes[i]
    elif bits == 4:
        half = count >> 1
        for j in range(half):
            out[j] = (codes[2 * j] << 4) | codes[2 * j + 1]
        if count & 1:
            out[half] = codes[count - 1] << 4
    elif bits == 2:
        full = count >> 2
        for j in range(full):
            out[j] = (codes[4 * j] << 6) | (codes[4 * j + 1] << 4) | (codes[4 * j + 2] << 2) | codes[4 * j + 3]
        if count & 3:
            b = 0
            for i in range(4 * full, count):
                b |= codes[i] << (6 - 2 * (i & 3))
            out[full] = b
    else:
        nbytes = (count * bits + 7) >> 3
        for j in range(nbytes):
            out[j] = 0
        for i in range(count):
            pos = i * bits
            b = pos >> 3
            off = pos & 7
            word = np.int32(codes[i]) << (16 - off - bits)
            out[b] |= (word >> 8) & 255
            if off + bits > 8:
                out[b + 1] |= word & 255


@njit(inline="always")
def _order_bits(b):
    """The int32 bits ``b`` of an fp32 mapped to an integer that orders as the float does (an
    involution: applied twice it gives ``b`` back). -0.0 maps below +0.0 (-1 and 0); NaN maps
    past +-inf (above 0x7F7FFFFF or below -0x7F800000). int32 throughout (numba widens integer
    arithmetic to int64, which does not vectorize in :func:`_range`'s loop)."""
    return np.int32(b ^ np.int32(np.int32(b >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@njit(cache=True, nogil=True)
def _range(b):
    """(min, max, finite) of fp32 values from their int32 view ``b``: one vectorized integer pass
    (min and max are the values themselves, exact; a zero's sign is the one of the zero that
    orders first or last, which callers check for)."""
    lo = np.int32(0x7FFFFFFF)
    hi = np.int32(-0x80000000)
    for j in range(b.shape[0]):
        k = _order_bits(b[j])
        lo = np.int32(min(lo, k))
        hi = np.int32(max(hi, k))
    finite = hi < np.int32(0x7F800000) and lo > np.int32(-0x7F800000)
    return _f32_bits(_order_bits(lo)), _f32_bits(_order_bits(hi)), finite


@njit(cache=True, nogil=True)
def uniforms(k0, k1, start, out):
    """out[j] = u_(start + j) (tests compare it with uniforms.fill)."""
    w = _base(k0, start)
    for j in range(out.shape[0]):
        out[j] = _u24w(w, k1)
        w = _step(w)


@njit(cache=True, nogil=True)
def uniforms16(k0, k1, start, out):
    """out[j] = the half-width u_(start + j) (tests compare it with uniforms.fill16)."""
    b0 = _base(k0, 0)
    for j in range(out.shape[0]):
        out[j] = _u16(b0, k1, start + j)


@njit(cache=True, nogil=True)
def kbit_codes(x, size, levels, stochastic, k0, k1, start, params, codes):
    """KBit.write for one chunk (whole blocks from a block boundary; ``start``: the chunk's first
    element's index in the segment): per block lo = min, scale = (max - min) / levels, code =
    round((x - lo) / scale) (or floor(. + u_i), u_i the counter-based uniform of element i),
    clamped to [0, levels]; params[b] = (lo, scale). fp32 operations in torch's order. False (the
    caller's torch path takes the chunk) where a value is not finite, or a block's min or max is
    a zero (whose sign torch's reduction picks)."""
    m = x.shape[0]
    nb = (m + size - 1) // size
    lv = _F32(levels)
    xb = x.view(np.int32)
    for b in range(nb):
        a = b * size
        e = min(m, a + size)
        blk = x[a:e]
        mn, mx, finite = _range(xb[a:e])
        if not finite or mn == 0 or mx == 0:
            return False
        scale = (mx - mn) / lv
        params[b, 0] = mn
        params[b, 1] = scale
        safe = scale if scale > 0 else _F32(1.0)
        c = codes[a:e]
        _prefetch_next(x, e)  # the next block, while this one's codes are computed
        if stochastic:
            w = _base(k0, start + a)
            for j in range(e - a):
                t = np.floor((blk[j] - mn) / safe + _u24w(w, k1))
                c[j] = np.uint8(min(max(t, _F32(0.0)), lv))
                w = _step(w)
        else:
            for j in range(e - a):
                t = np.rint((blk[j] - mn) / safe)
                c[j] = np.uint8(min(max(t, _F32(0.0)), lv))
    return True


@njit(cache=True, nogil=True)
def _absbits(b):
    """max over j of (bits of |v_j|), ``b`` the int32 view of fp32 values: one vectorized integer
    pass for both max |v| (non-negative floats order as their bits) and finiteness (the result is
    below 0x7F800000, the bits of inf, exactly when every value is finite)."""
    mx = np.int32(0)
    low = np.int32(0x7FFFFFFF)
    for j in range(b.shape[0]):  # int32 throughout (numba widens integer arithmetic to int64)
        mx = np.int32(max(mx, np.int32(b[j] & low)))
    return mx


@njit(cache=True, nogil=True)
def qsgd_codes(x, size, levels, top, use_max, norms, k0, k1, start, codes):
    """QSGD.write for one chunk (``start``: its first element's index in the segment): per bucket
    the norm (max |x|, or ``norms`` given), r = fp32(levels / norm), level = clamp(floor(|x| * r
    + u_i), 0, levels) (|x| * levels / norm where r overflows), code = level | (x < 0) << top. ``norms`` is written (max) or read (l2).
    False where a value or norm is not finite (the torch path takes it)."""
    m = x.shape[0]
    nb = (m + size - 1) // size
    s = _F32(levels)
    sign = np.int32(1 << top)
    xb = x.view(np.int32)
    for b in range(nb):
        a = b * size
        e = min(m, a + size)
        blk = x[a:e]
        bits = _absbits(xb[a:e])
        if bits >= 0x7F800000:
            return False
        if use_max:
            nm = _f32_bits(bits)
            norms[b] = nm
        else:
            nm = norms[b]
        if not np.isfinite(nm):
            return False
        safe = nm if nm > 0 else _F32(1.0)
        r = s / safe
        c = codes[a:e]
        w0 = _base(k0, start + a)
        _prefetch_next(x, e)  # the next block, while this one's codes are computed
        if np.isinf(r):  # a norm below levels / fp32's max: |x| * levels / norm, as QSGD._ratio
            w = w0
            for j in range(e - a):
                v = blk[j]
                t = np.floor(abs(v) * s / safe + _u24w(w, k1))
                lvl = np.int32(min(max(t, _F32(0.0)), s))
                c[j] = np.uint8(np.int32(lvl | (sign if v < 0 else np.int32(0))))
                w = _step(w)
            continue
        w = w0
        for j in range(e - a):
            v = blk[j]
            t = np.floor(abs(v) * r + _u24w(w, k1))
            lvl = np.int32(min(max(t, _F32(0.0)), s))  # int32 codes: uint8 ones widen (~10% slower)
            c[j] = np.uint8(np.int32(lvl | (sign if v < 0 else np.int32(0))))
            w = _step(w)
    return True


@njit(cache=True, nogil=True)
def _negative(v, flags):
    """flags[j] = v[j] < 0 (a function of its own: inline in a caller's loop it does not vectorize)."""
    for j in range(v.shape[0]):
        flags[j] = v[j] < 0


@njit(cache=True, nogil=True)
def _pack_flags(flags, out):
    """uint8 flags (0 or 1) MSB first into out (``pack_bits(flags, 1)``'s bytes): 8 at a time by
    one multiply (byte k of a little-endian word lands on bit 7 - k of the top byte)."""
    n = flags.shape[0]
    full = n >> 3
    words = flags[:full * 8].view(np.uint64)
    for j in range(full):
        out[j] = np.uint8((words[j] * np.uint64(0x8040201008040201)) >> np.uint64(56))
    if n & 7:
        b = np.uint8(0)
        for i in range(8 * full, n):
            b |= np.uint8(1 << (7 - (i & 7))) if flags[i] else np.uint8(0)
        out[full] = b


@njit(cache=True, nogil=True)
def table2(codes, table, i0, i1, out, s, w, add):
    """value = table[code] for 2-bit codes (twobit, terngrad: +-t or 0 per code)."""
    c = codes[i0:i1]
    t0, t1, t2, t3 = table[0], table[1], table[2], table[3]  # selects, not a gather: the loop vectorizes
    if add:
        t = s[:i1 - i0]
        for j in range(i1 - i0):
            cj = c[j]
            v = t3 if cj == 3 else (t2 if cj == 2 else (t1 if cj == 1 else t0))
            t[j] = _fma(w, np.float64(v), t[j])
    else:
        o = out[:i1 - i0]
        for j in range(i1 - i0):
            cj = c[j]
            o[j] = t3 if cj == 3 else (t2 if cj == 2 else (t1 if cj == 1 else t0))


@njit(cache=True, nogil=True)
def twobit_codes(x, t, codes):
    """TwoBit codes: 3 where x >= t, 2 where x <= -t, else 0 (NaN: 0); ``t`` is fp32, as torch
    compares an fp32 tensor with a Python float."""
    nt = -t
    for j in range(x.shape[0]):
        v = x[j]
        codes[j] = 3 if v >= t else (2 if v <= nt else 0)
