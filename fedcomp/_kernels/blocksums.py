"""Exact block sums (TernGrad's std, sign's scale): integer sums of x scaled by a power of 2 per
block, the same numbers as the torch path's; TernGrad's and sign's codes.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from fedcomp._kernels.core import _F32, _f32_bits, _f64_bits, _segment
from fedcomp._kernels.encode import _absbits, _negative, pack, _pack_flags
from fedcomp._kernels.hashing import _U17, _A, _B, _G, _base, _low32, _u16


# -- exact block sums (terngrad's std, sign's scale) ---------------------------------------------
@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _qsums(v, sc, absolute):
    """(sum q, sum q^2), or (sum |q|, 0) (``absolute``), of q = rint(float64(v) * sc), |q| <=
    2**qbits: float64 sums of integers whose every partial sum stays below 2**53 (len(v) <= 8192;
    qbits <= 20 for q^2, <= 40 for |q|) are exact in any order, so the vectorized (reassociated)
    loop gives the same result as any other. :func:`_maxsums32` where sc is an fp32."""
    t1 = 0.0
    t2 = 0.0
    for j in range(v.shape[0]):
        q = np.rint(np.float64(v[j]) * sc)
        if absolute:
            t1 += abs(q)
        else:
            t1 += q
            t2 += q * q
    return t1, t2


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _maxsums32(v, vb, s32, absolute):
    """(:func:`_absbits` of ``vb``, v's int32 view, and :func:`_qsums`' sums of v) in one loop,
    for ``s32`` = 2**k an fp32 (-126 <= k <= 127), with q formed in fp32 lanes (16 a register, not
    8): v * s32 is then exact in fp32 as in float64 (a power of two only moves the exponent; a
    product below fp32's normal range is below 0.5 and rounds to 0 either way), so q is the same
    integer. The square is fused with its sum (q^2 < 2**53 and every partial sum exact: an fma
    rounds nothing). Why: the float64 loop's conversion, multiply and rounding per 8 values made
    the sums compute-bound (0.8 read passes from L2 at 25M; 0.6 in fp32 lanes)."""
    mx = np.int32(0)
    low = np.int32(0x7FFFFFFF)
    t1 = 0.0
    t2 = 0.0
    for j in range(v.shape[0]):
        mx = np.int32(max(mx, np.int32(vb[j] & low)))
        q = np.float64(np.rint(v[j] * s32))
        if absolute:
            t1 += abs(q)
        else:
            t1 += q
            t2 += q * q
    return mx, t1, t2


@njit(inline="always")
def _qexp(bits, qbits):
    """k = qbits - exponent(max |x|) for the bits of max |x| (finite), 0 for a zero block."""
    k = 0
    if bits >= 0x00800000:  # normal: max |x| = f * 2**e, f in [0.5, 1), e = biased exponent - 126
        k = qbits - ((bits >> 23) - 126)
    elif bits > 0:
        k = qbits - math.frexp(np.float64(_f32_bits(bits)))[1]
    return k


@njit(inline="always")
def _whole(p):
    """A chunk's float64 sum of integers as int64; 0 where it cannot be one (beyond 2**53, inf or
    NaN: a guessed exponent that was wrong, whose sums are dropped). A right guess's sums reach
    2**53 itself (8192 values of |q| = 2**20: a block of values just below a power of two)."""
    return np.int64(p) if abs(p) <= 9007199254740992.0 else np.int64(0)


NO_GUESS = 1 << 20  # _block_qsums' guess where there is none


@njit(cache=True, nogil=True)
def _block_qsums(x, xb, a, e, qbits, sums, absolute, guess):
    """One block x[a:e] (``xb``: x's int32 view): (bits of max |x|, k, s1, s2), the exact integer
    sums of :func:`_qsums` for q = rint(x * 2**k), k = qbits - exponent(max |x|) (0 for a zero
    block), so that |q| <= 2**qbits. Where a value is not finite (bits >= 0x7F800000: inf, or
    above it NaN) or ``sums`` is False, only the bits (k = s1 = s2 = 0).

    ``guess``: a k to try (the block before's; NO_GUESS for none). Where 2**guess is an fp32, the
    sums for it are taken in the max's loop (the block read from memory once) and kept if the
    block's k is the guess, else taken again (from cache) for its k: the same sums either way.
    Why: the max from memory, then the sums from L2, cost ~1.7 read passes at 25M (TernGrad's
    first pass); one loop ~1.05 where the guess holds (blocks of one tensor mostly share their
    max's exponent: 9 of 381 blocks missed on a Gaussian; on the worst scale, a max straddling a
    power of two, 41% missed and the pass took 1.3-1.5)."""
    if sums and -126 <= guess <= 127:
        s32 = _F32(_f64_bits(np.int64(guess + 1023) << 52))
        bits = np.int32(0)
        t1 = np.int64(0)
        t2 = np.int64(0)
        for c in range(a, e, 8192):
            d = min(e, c + 8192)
            cb, p1, p2 = _maxsums32(x[c:d], xb[c:d], s32, absolute)
            bits = max(bits, cb)
            t1 += _whole(p1)
            t2 += _whole(p2)
        if bits >= 0x7F800000:
            return bits, 0, np.int64(0), np.int64(0)
        if _qexp(bits, qbits) == guess:
            return bits, guess, t1, t2
    else:
        bits = _absbits(xb[a:e])
        if bits >= 0x7F800000 or not sums:
            return bits, 0, np.int64(0), np.int64(0)
    k = _qexp(bits, qbits)
    sc = _f64_bits(np.int64(k + 1023) << 52)  # 2**k (|k| < 400: a normal float64)
    t1 = np.int64(0)
    t2 = np.int64(0)
    for c in range(a, e, 8192):
        d = min(e, c + 8192)
        if -126 <= k <= 127:
            _, p1, p2 = _maxsums32(x[c:d], xb[c:d], _F32(sc), absolute)
        else:
            p1, p2 = _qsums(x[c:d], sc, absolute)
        t1 += np.int64(p1)
        t2 += np.int64(p2)
    return bits, k, t1, t2


@njit(cache=True, nogil=True)
def tern_stats(x, block, qbits, sums, amax, s1, s2, ks, guess):
    """Per block of ``block`` elements (<= 2**16): amax[b] = max |x|, and (``sums``) the exact
    integer sums s1[b] = sum q, s2[b] = sum q^2 of q = rint(x * 2**ks[b]), ks[b] chosen so that
    |q| <= 2**qbits (qbits <= 20) (TernGrad's std: ``terngrad._tern_std``). False where a value
    is not finite. ``guess``: the first block's k to try (:func:`_block_qsums`); each next block
    tries the k of the one before."""
    m = x.shape[0]
    nb = (m + block - 1) // block
    xb = x.view(np.int32)
    for b in range(nb):
        a = b * block
        bits, k, t1, t2 = _block_qsums(x, xb, a, min(m, a + block), qbits, sums, False, guess)
        if bits >= 0x7F800000:
            return False
        amax[b] = _f32_bits(bits)
        ks[b] = k
        s1[b] = t1
        s2[b] = t2
        guess = k
    return True


@njit(cache=True, nogil=True)
def tern_stats_run(ptrs, ns, block, qbits, clips, b0, amax, s1, s2, ks, ok):
    """:func:`tern_stats` of every segment i of a run, its blocks at [b0[i], b0[i + 1]) of the
    outputs (the sums only where clips[i]); ok[i] False where a value is not finite. Each
    segment's first block tries the k of the last block summed before it."""
    guess = NO_GUESS
    for i in range(ptrs.shape[0]):
        a = b0[i]
        e = b0[i + 1]
        ok[i] = tern_stats(_segment(ptrs, ns, i), block, qbits, clips[i], amax[a:e], s1[a:e], s2[a:e], ks[a:e],
                           guess)
        if ok[i] and clips[i]:
            guess = ks[e - 1]


SIGN_TILE = 16384  # elements whose sign bits are packed at once (their flags still in cache)


@njit(cache=True, nogil=True)
def sign_stats(x, size, sub, qbits, absolute, amax, s, ks, scale, flags, out, guess):
    """Sign.write in one pass: blocks of ``size`` elements, each cut into parts of ``sub`` (<= 2**16;
    a block's last part shorter); part i: amax[i] = max |x| (inf or NaN where a value is), ks[i],
    s[i] = sum |q| (``absolute``) or sum q^2 (:func:`_block_qsums`; 0 for a part not finite).
    The sign bits (``pack_bits(x < 0, 1)``) are written every SIGN_TILE elements or more, while
    those are in cache (a partial last byte is written again, whole, with the next tile). Blocks
    of one part (size <= sub) get their fp32 scale here, as ``sign._sign_scales`` computes
    it: fp32(float64(s) / count (sqrt for rms) * 2**-k), or max |x| where it is inf or NaN.
    ``flags``: uint8 scratch of sub + SIGN_TILE + 8. ``guess``: the first part's k to try
    (:func:`_block_qsums`); each next part tries the k of the one before."""
    m = x.shape[0]
    xb = x.view(np.int32)
    i = 0
    lo = 0  # the first element whose bit is not written yet (a multiple of 8); flags[0] is its flag
    for a0 in range(0, m, size):
        e0 = min(m, a0 + size)
        for a in range(a0, e0, sub):
            e = min(e0, a + sub)
            bits, k, t1, t2 = _block_qsums(x, xb, a, e, qbits, True, absolute, guess)
            if bits < 0x7F800000:
                guess = k
            amax[i] = _f32_bits(bits)
            ks[i] = k
            s[i] = t1 if absolute else t2
            if size <= sub:
                if bits >= 0x7F800000:
                    scale[i] = amax[i]
                else:
                    v = np.float64(s[i]) / np.float64(e - a)
                    if not absolute:
                        v = math.sqrt(v)
                    scale[i] = np.float32(v * _f64_bits(np.int64(1023 - k) << 52))
            i += 1
            if e - lo >= SIGN_TILE or e == m:
                _negative(x[lo:e], flags)  # from cache (in the sums' loop: no faster)
                _pack_flags(flags[:e - lo], out[lo >> 3:])
                lo = e & ~7


@njit(cache=True, nogil=True)
def tern_codes(x, s, bound, clip, k0, k1, start, codes):
    """TernGrad codes: a = min(|x|, bound) (``clip``) or |x|; 1 (+s) or 2 (-s, x < 0) where
    u_i * s < a, u_i the half-width uniform (uniforms.fill16: (m + 1/2) / 2**16), else 0; fp32
    operations as the torch path's (finite x only)."""
    b0 = _base(k0, 0)
    for j in range(x.shape[0]):
        v = x[j]
        a = min(abs(v), bound) if clip else abs(v)
        keep = _u16(b0, k1, start + j) * s < a
        codes[j] = (np.uint8(2) if v < 0 else np.uint8(1)) if keep else np.uint8(0)


def _splat(builder, scalar, lanes=16):
    """A vector of ``lanes`` copies of ``scalar``."""
    vt = ir.VectorType(scalar.type, lanes)
    one = builder.insert_element(ir.Constant(vt, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined), zeros)


@intrinsic
def _tern_groups(typingctx, xaddr, oaddr, groups, w, k1, s17, bound):
    """:func:`tern_codes` of ``groups`` groups of 32 fp32 values at ``xaddr`` (contiguous; the first
    one's index even) packed as ``pack(codes, 32, 2)`` packs them, 8 bytes a group at ``oaddr``:
    the same bytes, the codes never stored. ``w``: the Weyl term (:func:`_base`) of the first
    value's hash, index >> 1; ``s17`` = s * 2**-17 (exact: the caller checks), so that u * s =
    (2 m + 1) * s17 (m the uniform's 16 bits) is fma(m, 2 * s17, s17), the same real product
    rounded once alike; ``bound``: inf where there is no clipping (finite values only).

    Why written in vector IR: the codes loop is compute-bound (the hash), and storing the codes a
    byte each, then packing them in a loop of their own, took ~5 of its ~20 vector operations per
    16 values and another ~0.04 ns a value. Here a group's 16 hashes, read as 32 little-endian
    16-bit lanes, are its 32 uniforms in order (the low half of h_m for value 2m, the high half for
    2m + 1: uniforms.fill16), and the 32 codes (kept: 1, or 2 where the sign bit is set) are bytes
    in a 256-bit register. Each 4 of them (b0..b3, read as a little-endian int32 d: numba's
    platforms are all little-endian) become pack's byte b0 << 6 | b1 << 4 | b2 << 2 | b3, the top
    byte of d * 0x40100401: each code lands in its own 2 bits, the other partial products below bit
    24 or past bit 31, none overlapping (no carries). The hash's first xorshift of w ^ k1 is that
    of w xored with k1 ^ (k1 >> 16) (one three-input operation where the CPU has one). Packing in
    registers and a hash per two values make the codes pass faster (see the docs' Results:
    performance). The fused multiply-add is ``llvm.fma`` (one instruction where the CPU has FMA, a
    correctly rounded library call where it has not: the same bits, slower), never
    ``llvm.fmuladd``, which may round twice."""
    sig = types.void(types.int64, types.int64, types.int64, types.uint32, types.uint32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        xa, oa, count, w0, key, s, b = args
        i32 = ir.IntType(32)
        vh, vi, v8 = ir.VectorType(i32, 16), ir.VectorType(i32, 32), ir.VectorType(i32, 8)
        vf = ir.VectorType(ir.FloatType(), 32)

        def const(v, t=vi):
            return ir.Constant(t, [int(v) & 0xFFFFFFFF] * t.count)

        def bytes_(v):
            return ir.Constant(ir.VectorType(ir.IntType(8), 32), [v] * 32)
        k = _low32(builder, key)
        kk = _splat(builder, builder.xor(k, builder.lshr(k, ir.Constant(i32, 16))))
        cv, bv = _splat(builder, s, 32), _splat(builder, b, 32)
        sv = builder.fadd(cv, cv)  # 2 * s17, exact
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), "llvm.fma.v32f32")
        lanes = ir.Constant(vh, [(int(_G) * e) & 0xFFFFFFFF for e in range(16)])
        wslot = cgutils.alloca_once_value(builder, builder.add(_splat(builder, _low32(builder, w0)), lanes))
        xp = builder.inttoptr(xa, vf.as_pointer())
        op = builder.inttoptr(oa, ir.IntType(64).as_pointer())
        with cgutils.for_range(builder, count) as loop:
            x = builder.load(builder.gep(xp, [loop.index]), align=4)
            w = builder.load(wslot)
            builder.store(builder.add(w, const(16 * int(_G), vh)), wslot)
            h = builder.xor(builder.xor(w, builder.lshr(w, const(16, vh))), kk)  # lowbias32 of w ^ k1 (_mix_ir)
            h = builder.mul(h, const(_A, vh))
            h = builder.xor(h, builder.lshr(h, const(15, vh)))
            h = builder.mul(h, const(_B, vh))
            h = builder.xor(h, builder.lshr(h, const(16, vh)))
            u = builder.zext(builder.bitcast(h, ir.VectorType(ir.IntType(16), 32)), vi)
            p = builder.call(fma, [builder.sitofp(u, vf), sv, cv])  # (m + 1/2) * 2**-16 * s, rounded once
            bits = builder.bitcast(x, vi)
            ax = builder.bitcast(builder.and_(bits, const(0x7FFFFFFF)), vf)
            a = builder.select(builder.fcmp_ordered("<", bv, ax), bv, ax)  # min(|x|, bound)
            keep = builder.fcmp_ordered("<", p, a)
            neg = builder.icmp_signed("<", bits, const(0))  # -0.0 is never kept (a = 0)
            codes = builder.select(keep, builder.select(neg, bytes_(2), bytes_(1)), bytes_(0))
            d = builder.mul(builder.bitcast(codes, v8), const(0x40100401, v8))
            packed = builder.trunc(builder.lshr(d, const(24, v8)), ir.VectorType(ir.IntType(8), 8))
            builder.store(builder.bitcast(packed, ir.IntType(64)), builder.gep(op, [loop.index]), align=1)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True)
def tern_packed(x, s, bound, clip, k0, k1, start, out, codes):
    """``pack(tern_codes(x, ...), n, 2)`` into out[:(n + 3) // 4], the same bytes: whole groups of 32
    values through :func:`_tern_groups`, the rest (and all of x where ``start`` is odd or s * 2**-17
    is not exact, as it may not be for s below 2**-109) through :func:`tern_codes` in ``codes``
    (uint8 scratch of 16 or more); so does a strided x or out (the vector loop reads and writes
    their memory as contiguous)."""
    n = x.shape[0]
    s17 = s * _U17
    dense = x.strides[0] == 4 and out.strides[0] == 1
    full = n - n % 32 if dense and start % 2 == 0 and s17 * _F32(131072.0) == s else 0
    if full:
        _tern_groups(x.ctypes.data, out.ctypes.data, full // 32, _base(k0, start >> 1), k1, s17,
                     bound if clip else _F32(np.inf))
    step = codes.shape[0] // 4 * 4
    for a in range(full, n, step):
        e = min(n, a + step)
        tern_codes(x[a:e], s, bound, clip, k0, k1, start + a, codes)
        pack(codes, e - a, 2, out[a // 4:])


BLOCK_KBIT, BLOCK_QSGD, BLOCK_SIGN = 0, 1, 2  # what a block's parameters are (block_run, block_sq_run, ...)
