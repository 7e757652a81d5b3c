"""Decode side: unpack codes, dequantize (``out``) or dequantize and add (``s += w * value``), and
the sums of squares of decoded values (the server's check: finiteness and the norm).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fedcomp._kernels.core import _F32, _f32_bits, _f32_half, _fma, _half_f32, _i32_bits


# -- codes -------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def unpack(data, count, bits, out):
    """MSB-first packed codes of ``bits`` (1..8) bits -> out[:count] (uint8)."""
    if bits == 8:
        for i in range(count):
            out[i] = data[i]
    elif bits == 4:
        half = count >> 1
        for j in range(half):
            b = data[j]
            out[2 * j] = b >> 4
            out[2 * j + 1] = b & 15
        if count & 1:
            out[count - 1] = data[half] >> 4
    elif bits == 2:
        full = count >> 2
        for j in range(full):
            b = data[j]
            out[4 * j] = b >> 6
            out[4 * j + 1] = (b >> 4) & 3
            out[4 * j + 2] = (b >> 2) & 3
            out[4 * j + 3] = b & 3
        for i in range(4 * full, count):
            out[i] = (data[i >> 2] >> (6 - 2 * (i & 3))) & 3
    elif bits == 1:
        full = count >> 3
        for j in range(full):
            b = data[j]
            for k in range(8):
                out[8 * j + k] = (b >> (7 - k)) & 1
        for i in range(8 * full, count):
            out[i] = (data[i >> 3] >> (7 - (i & 7))) & 1
    else:
        mask = (1 << bits) - 1
        n = data.shape[0]
        for i in range(count):
            pos = i * bits
            b = pos >> 3
            off = pos & 7
            word = np.int32(data[b]) << 8
            if b + 1 < n:
                word |= np.int32(data[b + 1])
            out[i] = (word >> (16 - off - bits)) & mask


# -- dequantize (out) or dequantize and add (s += w * value) ------------------------------------
# Inner loops run over local slices from index 0: the form LLVM vectorizes (about 4x faster).
@njit(inline="always")
def _as_half(v, half):
    """fp32 ``v`` rounded to fp16 (``half`` 1) or bf16 (2), as fp32 (:func:`_to_half1`'s bits)."""
    return _half(_to_half1(v, half == 2), half == 2)


@njit(cache=True, nogil=True)
def kbit(codes, lo, scale, size, i0, i1, out, s, w, add, half):
    """value = fp32(code) * scale[b] + lo[b] (two fp32 roundings, as KBit._values); added rounded
    to fp16 / bf16 where ``half`` is 1 / 2 (a model's half tensor, as the per-segment path adds it)."""
    b = i0 // size
    i = i0
    while i < i1:
        e = min(i1, (b + 1) * size)
        sc = scale[b]
        mn = lo[b]
        c = codes[i:e]
        if add:
            t = s[i - i0:e - i0]
            if half == 1:
                for j in range(e - i):
                    t[j] = _fma(w, np.float64(_as_half(_F32(c[j]) * sc + mn, 1)), t[j])
            elif half == 2:
                for j in range(e - i):
                    t[j] = _fma(w, np.float64(_as_half(_F32(c[j]) * sc + mn, 2)), t[j])
            else:
                for j in range(e - i):
                    t[j] = _fma(w, np.float64(_F32(c[j]) * sc + mn), t[j])
        else:
            o = out[i - i0:e - i0]
            for j in range(e - i):
                o[j] = _F32(c[j]) * sc + mn
        i = e
        b += 1


@njit(cache=True, nogil=True)
def qsgd(codes, unit, top, size, i0, i1, out, s, w, add, half):
    """value = fp32(+-(code & (2**top - 1))) * unit[b], the sign in bit ``top`` (QSGD._values;
    ``unit`` = norm / levels, computed in fp32 by the caller). A level of 0 is +0.0 either sign.
    The signed level by two's complement arithmetic on 32-bit masks (no branch, no variable
    shift): the loop vectorizes (AVX2 has no 64-bit arithmetic shift or int64 -> float). Added
    rounded to fp16 / bf16 where ``half`` is 1 / 2 (rounding is symmetric: +-level * unit rounds
    to +- the rounded magnitude)."""
    mask = (1 << top) - 1
    m32 = np.int32(mask)
    sbit = np.int32(1 << top)
    b = i0 // size
    i = i0
    while i < i1:
        e = min(i1, (b + 1) * size)
        u = unit[b]
        c = codes[i:e]
        if add:  # level * (+-unit): a select of two scalars, ~2x faster than a signed level
            t = s[i - i0:e - i0]  # (a zero level may give -0.0: the same sum, which is never -0.0)
            nu = -u
            if half == 1:
                for j in range(e - i):
                    cj = np.int32(c[j])
                    uu = nu if np.int32(cj & sbit) else u
                    t[j] = _fma(w, np.float64(_as_half(_F32(np.int32(cj & m32)) * uu, 1)), t[j])
            elif half == 2:
                for j in range(e - i):
                    cj = np.int32(c[j])
                    uu = nu if np.int32(cj & sbit) else u
                    t[j] = _fma(w, np.float64(_as_half(_F32(np.int32(cj & m32)) * uu, 2)), t[j])
            else:
                for j in range(e - i):
                    cj = np.int32(c[j])
                    uu = nu if np.int32(cj & sbit) else u
                    t[j] = _fma(w, np.float64(_F32(np.int32(cj & m32)) * uu), t[j])
        else:
            o = out[i - i0:e - i0]
            for j in range(e - i):
                cj = np.int32(c[j])
                ng = np.int32(-np.int32((cj & sbit) != 0))
                o[j] = _F32(np.int32(np.int32(np.int32(cj & m32) ^ ng) - ng)) * u
        i = e
        b += 1


# -- sums of squares of decoded values (the server's check pass: finiteness and the norm) -------
# A block of a linear quantizer holds values lo + c * scale for integer codes c: its sum of
# squares is n lo^2 + 2 lo scale sum(c) + scale^2 sum(c^2), from exact integer sums of its codes
# (a vectorized integer pass). That is the norm of the exact values; each value the server adds
# is that value rounded to fp32, so the two differ by ~1e-7 relative at most. Finiteness: where
# the largest value the block's parameters allow is finite in fp32, every value is (c * scale +
# lo is monotone in c, and so is its rounding); elsewhere the block's values are built one by one.
@njit(inline="always")
def _csums32(c, m):
    """(sum, sum of squares) of ``c & m`` for at most 32,768 uint8 codes: int32 sums (255**2 *
    32768 < 2**31), each step truncated (numba widens integer arithmetic), over a slice from 0:
    the form LLVM vectorizes (AVX2 has no 64-bit multiply)."""
    p1 = np.int32(0)
    p2 = np.int32(0)
    for j in range(c.shape[0]):
        v = np.int32(np.int32(c[j]) & m)
        p1 = np.int32(p1 + v)
        p2 = np.int32(p2 + np.int32(v * v))
    return p1, p2


@njit(inline="always")
def _csums(c, mask):
    """(sum, sum of squares) of ``c & mask`` (uint8 codes), exact int64."""
    m = np.int32(mask)
    n = c.shape[0]
    if n <= 32768:
        p1, p2 = _csums32(c, m)
        return np.int64(p1), np.int64(p2)
    t1 = np.int64(0)
    t2 = np.int64(0)
    for a in range(0, n, 32768):
        p1, p2 = _csums32(c[a:min(n, a + 32768)], m)
        t1 += p1
        t2 += p2
    return t1, t2


@njit(cache=True, nogil=True)
def kbit_sq(codes, lo, scale, size, i0, i1, levels):
    """Sum of squares over elements [i0, i1) of :func:`kbit`'s values (``levels``: the largest
    code); inf or NaN exactly when one of those fp32 values is."""
    b = i0 // size
    i = i0
    t = 0.0
    top = _F32(levels)
    while i < i1:
        e = min(i1, (b + 1) * size)
        sc = scale[b]
        mn = lo[b]
        c = codes[i:e]
        if np.isfinite(mn) and np.isfinite(sc) and np.isfinite(top * sc + mn) and np.isfinite(top * sc):
            t1, t2 = _csums(c, 255)
            s64, m64 = np.float64(sc), np.float64(mn)
            t += (e - i) * m64 * m64 + 2.0 * m64 * s64 * np.float64(t1) + s64 * s64 * np.float64(t2)
        else:
            for j in range(e - i):
                v = np.float64(_F32(c[j]) * sc + mn)
                t += v * v
        i = e
        b += 1
    return t


@njit(cache=True, nogil=True)
def qsgd_sq(codes, unit, top, size, i0, i1):
    """Sum of squares over elements [i0, i1) of :func:`qsgd`'s values (the sign does not change
    a square): unit^2 sum(level^2) per block; inf or NaN exactly when a value is."""
    mask = (1 << top) - 1
    b = i0 // size
    i = i0
    t = 0.0
    while i < i1:
        e = min(i1, (b + 1) * size)
        u = unit[b]
        c = codes[i:e]
        if np.isfinite(_F32(mask) * u):
            t1, t2 = _csums(c, mask)
            t += np.float64(u) * np.float64(u) * np.float64(t2)
        else:
            for j in range(e - i):
                v = np.float64(_F32(np.int32(c[j]) & mask) * u)
                t += v * v
        i = e
        b += 1
    return t


@njit(inline="always")
def _pc4(m):
    """How many of bits 0, 2, 4, 6 of the uint8 ``m`` are set (each step truncated to uint8)."""
    p = np.uint8((m & np.uint8(0x33)) + ((m >> np.uint8(2)) & np.uint8(0x33)))
    return np.uint8((p & np.uint8(0x0F)) + (p >> np.uint8(4)))


@njit(inline="always")
def _hit(v, t, strict):
    return abs(v) > t if strict else abs(v) >= t


@njit(cache=True, nogil=True)
def candidates(x, t, strict, out):
    """Positions j (ascending) with |x[j]| >= t (> t if ``strict``; t >= 0, NaN never) into
    ``out``; their number, or -1 where more than ``len(out)`` qualify. Per group of 64, whether
    any qualifies (a vectorized or-reduction), and only then which: top-k's candidate scan, where
    about one element in 600 qualifies (~1.5 read passes; numpy's abs + compare + flatnonzero ~3)."""
    n = x.shape[0]
    c = 0
    cap = out.shape[0]
    for a in range(0, n, 64):
        blk = x[a:min(n, a + 64)]
        h = 0
        for j in range(blk.shape[0]):
            h |= np.int64(_hit(blk[j], t, strict))
        if h:
            for j in range(blk.shape[0]):
                if _hit(blk[j], t, strict):
                    if c == cap:
                        return -1
                    out[c] = a + j
                    c += 1
    return c


@njit(cache=True, nogil=True)
def count_codes2(data, count):
    """How many of the first ``count`` 2-bit codes (MSB first) take each value 0..3. Per byte,
    bit tricks on its four fields (code 3: both bits set, 1: low only, 2: high only), uint8
    arithmetic that vectorizes 32 bytes at a time, into int32 sums of 2**20 bytes (~5x faster
    than a histogram of the bytes, whose increments stall on repeated values)."""
    full = count >> 2
    c1 = np.int64(0)
    c2 = np.int64(0)
    c3 = np.int64(0)
    for a in range(0, full, 1 << 20):
        blk = data[a:min(full, a + (1 << 20))]
        p1 = np.int32(0)
        p2 = np.int32(0)
        p3 = np.int32(0)
        for j in range(blk.shape[0]):
            b = blk[j]
            hi = np.uint8(b >> np.uint8(1))
            p3 = np.int32(p3 + np.int32(_pc4(np.uint8(b & hi & np.uint8(0x55)))))
            p1 = np.int32(p1 + np.int32(_pc4(np.uint8(b & ~hi & np.uint8(0x55)))))
            p2 = np.int32(p2 + np.int32(_pc4(np.uint8(~b & hi & np.uint8(0x55)))))
        c1 += p1
        c2 += p2
        c3 += p3
    n = np.zeros(4, dtype=np.int64)
    n[1], n[2], n[3] = c1, c2, c3
    n[0] = 4 * full - c1 - c2 - c3
    for i in range(4 * full, count):
        n[(data[i >> 2] >> (6 - 2 * (i & 3))) & 3] += 1
    return n


@njit(cache=True, nogil=True)
def sign(flags, scale, size, i0, i1, out, s, w, add):
    """value = -scale[b] where the (unpacked) sign flag is set, else scale[b] (Sign's values)."""
    b = i0 // size
    i = i0
    while i < i1:
        e = min(i1, (b + 1) * size)
        sc = scale[b]
        c = flags[i:e]
        if add:
            t = s[i - i0:e - i0]
            for j in range(e - i):
                t[j] = _fma(w, np.float64(-sc if c[j] else sc), t[j])
        else:
            o = out[i - i0:e - i0]
            for j in range(e - i):
                o[j] = -sc if c[j] else sc
        i = e
        b += 1


@njit(cache=True, nogil=True)
def add_f32(values, s, w):
    """s += w * float64(values), one rounding per element (as torch's add_(values, alpha=w))."""
    for j in range(values.shape[0]):
        s[j] = _fma(w, np.float64(values[j]), s[j])


@njit(inline="always")
def _half(b, brain):
    """fp32 value of fp16 (``brain`` False) or bf16 bits ``b`` (uint16): exact conversions, so
    the values of the lookup table (torch's conversion) for every non-NaN pattern."""
    return _f32_bits(np.int32(np.int32(b) << 16)) if brain else _half_f32(b)


@njit(cache=True, nogil=True)
def add_half(bits16, brain, s, w):
    """s += w * float64(value) of fp16 / bf16 bits, converted in the loop (vectorized) instead of
    looked up in :func:`lut_u16`'s table: the same values for every pattern but NaNs, which the
    check pass refuses before anything is added."""
    if brain:
        for j in range(bits16.shape[0]):
            s[j] = _fma(w, np.float64(_half(bits16[j], True)), s[j])
    else:
        for j in range(bits16.shape[0]):
            s[j] = _fma(w, np.float64(_half(bits16[j], False)), s[j])


@njit(cache=True, nogil=True)
def to_half(x, brain, limit, out):
    """out (uint16) = the fp16 (``brain`` False; x clamped to +-``limit`` first) or bf16 bits of
    fp32 x, in one pass, with the bits of torch's CPU conversion: round to nearest even; a NaN
    keeps its sign and top payload bits in fp16 (as F16C does) and becomes 0xFFFF in bf16 (what
    torch 2.13 writes on the CPU; a NaN payload is refused by every decoder anyway)."""
    if brain:
        for j in range(x.shape[0]):
            u = np.uint32(_i32_bits(x[j]))
            r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            out[j] = np.uint16(0xFFFF) if x[j] != x[j] else np.uint16(r)
    else:
        for j in range(x.shape[0]):
            v = x[j]
            if v > limit:
                v = limit
            elif v < -limit:
                v = -limit
            out[j] = _f32_half(v)


@njit(inline="always")
def _to_half1(v, brain):
    """The fp16 (``brain`` False; no clamp: beyond fp16's range, inf) or bf16 bits of fp32 ``v``:
    :func:`to_half`'s, element by element."""
    if brain:
        u = np.uint32(_i32_bits(v))
        r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return np.uint16(0xFFFF) if v != v else np.uint16(r)
    return _f32_half(v)


@njit(cache=True, nogil=True)
def add_rounded(values, brain, s, w):
    """s += w * float64(fp32 ``values`` rounded to fp16 / bf16): the per-segment path's
    ``add_(values.to(dtype), alpha=w)`` for a model's half tensor (:func:`add_half` of
    :func:`to_half`'s bits), in one loop."""
    if brain:
        for j in range(values.shape[0]):
            s[j] = _fma(w, np.float64(_as_half(values[j], 2)), s[j])
    else:
        for j in range(values.shape[0]):
            s[j] = _fma(w, np.float64(_as_half(values[j], 1)), s[j])


@njit(cache=True, nogil=True)
def rounded_sq(values, brain, bits16):
    """:func:`half_sq` of fp32 ``values`` rounded to fp16 / bf16 (``bits16``: uint16 scratch of
    their length): the per-segment check's sum for a chunk of a model's half tensor."""
    to_half(values, brain, _F32(np.inf), bits16)
    return half_sq(bits16, brain)


SQ_PART = 1 << 10  # values per partial sum of sumsq / half_sq (4 kB of fp32: they stay in L1)
HALF_PART = 1 << 18  # values per part of half_run_crc (512 kB of halves: they stay in L2)


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _half_sq_part(bits16, brain):
    t = 0.0
    if brain:
        for j in range(bits16.shape[0]):
            v = np.float64(_half(bits16[j], True))
            t += v * v
    else:
        for j in range(bits16.shape[0]):
            v = np.float64(_half(bits16[j], False))
            t += v * v
    return t


@njit(cache=True, nogil=True)
def half_sq(bits16, brain):
    """Sum of float64(value)**2 of fp16 / bf16 bits (inf or NaN exactly when a value is), as
    :func:`sumsq` forms it: partial sums of SQ_PART values, added in order."""
    t = 0.0
    for a in range(0, bits16.shape[0], SQ_PART):
        t += _half_sq_part(bits16[a:a + SQ_PART], brain)
    return t


@njit(cache=True, nogil=True)
def lut_u16(bits16, table, out):
    """out = table[bits16] (fp16 / bf16 bit patterns to fp32)."""
    for j in range(bits16.shape[0]):
        out[j] = table[bits16[j]]


@njit(cache=True, nogil=True)
def lowrank_sq(p, q, r):
    """(sum((P^T P) * (Q^T Q)), max |P|, max |Q|, all finite) for P (n x r) and Q (m x r) fp32,
    row-major and flat: ||P Q^T||_F^2 from the r x r Gram matrices in float64, in a fixed order
    (PowerSGD's check at the server: ``powersgd.PowerSGD.sq_all``; torch ops cost ~35 us a tensor)."""
    gp = np.zeros((r, r))
    gq = np.zeros((r, r))
    top_p = 0.0
    top_q = 0.0
    finite = True
    for f in range(2):
        v = p if f == 0 else q
        g = gp if f == 0 else gq
        top = 0.0
        for i in range(v.shape[0] // r):
            for a in range(r):
                x = np.float64(v[i * r + a])
                if not np.isfinite(x):
                    finite = False
                top = max(top, abs(x))
                for b in range(r):
                    g[a, b] += x * np.float64(v[i * r + b])
        if f == 0:
            top_p = top
        else:
            top_q = top
    total = 0.0
    for a in range(r):
        for b in range(r):
            total += gp[a, b] * gq[a, b]
    return total, top_p, top_q, finite


@njit(cache=True, nogil=True)
def lowrank(p, qt, r, m, lo, hi, out, s, w, add):
    """Elements [lo, hi) of P Q^T (n x m, row-major), summed rank-1 term by term in order with
    each product and sum rounded to fp32 (powersgd.reconstruct). ``p``: P flat (n * r, row-major),
    ``qt``: Q^T flat (r * m): 1-D slices, the form LLVM vectorizes."""
    row = np.empty(m if add else 0, dtype=np.float32)
    i = lo // m
    e = lo
    while e < hi:
        j0 = e - i * m
        j1 = min(m, hi - i * m)
        n = j1 - j0
        a = e - lo
        v = row[:n] if add else out[a:a + n]  # (the result's own place where it is not added)
        q0 = qt[j0:j1]
        p0 = p[i * r]
        for j in range(n):
            v[j] = p0 * q0[j]
        for k in range(1, r):
            qk = qt[k * m + j0:k * m + j1]
            pk = p[i * r + k]
            for j in range(n):
                v[j] = v[j] + pk * qk[j]
        if add:
            t = s[a:a + n]
            for j in range(n):
                t[j] = _fma(w, np.float64(v[j]), t[j])
        e = i * m + j1
        i += 1


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _sumsq_part(v):
    t = 0.0
    for j in range(v.shape[0]):
        x = np.float64(v[j])
        t += x * x
    return t


@njit(cache=True, nogil=True)
def sumsq(v):
    """Sum of float64(v[j])**2 (v: fp32 or fp64): partial sums of SQ_PART values, added in order.
    Within a part, reassociation only (no other fast-math): the loop is vectorized with partial
    sums, so the last bits depend on the CPU's vector width (as torch's reductions do), not on
    anything else. The parts are L1-sized so that :func:`raw_crc_sq_run` can checksum each one
    after it is summed, from L1, and form the same sums (larger parts were slower: see the docs'
    Results: performance)."""
    t = 0.0
    for a in range(0, v.shape[0], SQ_PART):
        t += _sumsq_part(v[a:a + SQ_PART])
    return t
