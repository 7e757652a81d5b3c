"""The numba loops behind :mod:`fedcomp.kernels` (imported only through ``kernels.get()``).

Conventions: ``codes`` are uint8 codes of a run of elements starting at a block boundary (index
0 = the first element of block 0 of the parameter arrays passed); a kernel handles elements
[i0, i1) of that run and writes output element ``i - i0``. ``s`` is a float64 slice of the running
sum, ``w`` the weight; ``out`` an fp32 buffer. fp32 arithmetic is written operation by operation
as the torch path does it (no fast-math: each product and sum is rounded, nothing contracted).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_F32 = np.float32


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c rounded once (llvm.fma.f64): the sum step torch's ``add_(v, alpha=w)`` does on
    the CPU, so sums match it for every weight, not only where ``w * v`` is exact."""
    sig = types.float64(types.float64, types.float64, types.float64)

    def codegen(context, builder, signature, args):
        double = ir.DoubleType()
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(double, [double] * 3), "llvm.fma.f64")
        return builder.call(fma, args)
    return sig, codegen


def _bitcast(to, to_ir, frm, doc):
    """An intrinsic: the value of type ``to`` whose bits are those of its ``frm`` argument."""
    def impl(typingctx, v):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], to_ir)
        return to(frm), codegen
    impl.__doc__ = doc
    return intrinsic(impl)


_f32_bits = _bitcast(types.float32, ir.FloatType(), types.int32, "The fp32 whose bits are the int32 ``v``.")
_f64_bits = _bitcast(types.float64, ir.DoubleType(), types.int64, "The float64 whose bits are the int64 ``v``.")


@intrinsic
def _half_f32(typingctx, v):
    """The fp32 value of the fp16 whose bits are the uint16 ``v`` (exact; F16C converts 8 at a
    time where the CPU has it)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


@intrinsic
def _f32_half(typingctx, v):
    """The bits (uint16) of fp32 ``v`` rounded to fp16, to nearest even (``fptrunc``: F16C's
    conversion where the CPU has it; beyond fp16's range: inf)."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return sig, codegen


def _pointer(to, to_ir, doc):
    """An intrinsic: a pointer to values of type ``to`` at its int64 argument, an address (a CPU
    tensor's ``data_ptr()``, a numpy array's ``ctypes.data``; the caller keeps the memory alive)."""
    def impl(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], ir.PointerType(to_ir))
        return types.CPointer(to)(types.int64), codegen
    impl.__doc__ = doc
    return intrinsic(impl)


_f32_at = _pointer(types.float32, ir.FloatType(), "A pointer to fp32 values at an address.")
_f64_at = _pointer(types.float64, ir.DoubleType(), "A pointer to float64 values at an address.")
_u8_at = _pointer(types.uint8, ir.IntType(8), "A pointer to bytes at an address.")
_i64_at = _pointer(types.int64, ir.IntType(64), "A pointer to int64 values at an address.")


@intrinsic
def _call_crc32(typingctx, fn, crc, address, nbytes):
    """``fn(crc, address, nbytes)`` for ``fn`` the address of a C function ``uint32 f(uint32 crc,
    const uint8 *buf, uint64 len)`` that continues a CRC32 (ISA-L's ``crc32_gzip_refl``: zlib's
    ``crc32(buf, crc)``; :func:`fedcomp.kernels.crc32_function`). The address is an argument, not a
    constant, so the compiled loop stays cacheable across processes."""
    sig = types.uint32(types.int64, types.uint32, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        f, c, at, n = args
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), i8p, ir.IntType(64)])
        return builder.call(builder.inttoptr(f, fnty.as_pointer()), [c, builder.inttoptr(at, i8p), n])
    return sig, codegen


@njit(inline="always")
def _crc_upto(fn, crc, base, done, to):
    """The CRC32 ``crc`` of the bytes before address ``base + done`` continued up to ``base + to``
    (the bytes between a run's segments, and after its last); ``crc`` itself where ``fn`` is 0 (no
    checksum) or nothing lies between."""
    if fn and to > done:
        return _call_crc32(fn, crc, base + done, to - done)
    return crc


_PREFETCH_LINES = 32  # 2 kB: one qsgd bucket of 512 fp32, two kbit blocks of 256 (the defaults)


@intrinsic
def _prefetch_next(typingctx, arr, i):
    """Ask the CPU to bring the 64-byte lines of fp32 arr[i:i + 512] (1-D, C-contiguous) into
    cache, for reading: 32 prefetch instructions in a row (past the array's end they fetch
    nothing and never fault).

    Why: the blockwise encoders read a block twice (its range or norm, then its codes), the
    second time from L1; while they compute codes the hardware prefetcher, which follows the
    loads, has nothing to follow, so memory idles. Prefetching the next block during that pass
    overlaps the two (qsgd codes at 25M: 3.3 -> 2.6 read passes on this project's machine).
    Straight-line, not a loop: a loop of calls cannot be vectorized, and at a forced vector
    width (:func:`_vector_width`) LLVM prints a remark for each such loop."""
    sig = types.void(arr, i)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        at = builder.ptrtoint(ary.data, ir.IntType(64))
        index = context.cast(builder, args[1], signature.args[1], types.int64)
        at = builder.add(at, builder.mul(index, ir.Constant(ir.IntType(64), 4)))
        for line in range(_PREFETCH_LINES):
            ptr = builder.inttoptr(builder.add(at, ir.Constant(ir.IntType(64), 64 * line)), i8p)
            # read (0), keep in all cache levels (3), data cache (1)
            builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen


@njit(inline="always")
def _segment(ptrs, ns, s):
    """Segment s of a run: the ns[s] fp32 values at address ptrs[s] (the caller keeps them alive)."""
    return carray(_f32_at(ptrs[s]), (ns[s],))


@njit(inline="always")
def _put_f32(values, region, o):
    """The bytes of fp32 ``values`` (1-D) at region[o:] (any alignment)."""
    raw = values.view(np.uint8)
    for j in range(raw.shape[0]):
        region[o + j] = raw[j]


_i32_bits = _bitcast(types.int32, ir.IntType(32), types.float32, "The int32 whose bits are the fp32 ``v``.")


def _hardware_half() -> bool:
    """Whether LLVM converts fp16 in instructions for the CPU the loops are compiled for: always
    but on x86 without F16C, where ``fpext`` / ``fptrunc`` of half become calls to compiler-rt's
    ``__extendhfsf2`` / ``__truncsfhf2``, which numba's JIT does not link: LLVM aborts the whole
    process when such a loop is compiled (found compiling for a baseline x86-64, as QEMU's default
    CPU models and older or low-end CPUs such as Goldmont Celerons are)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if not llvm.get_process_triple().startswith(("x86_64", "i386", "i486", "i586", "i686")):
        return True
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else llvm.get_host_cpu_features().flatten()
    return "+f16c" in features.split(",")


@njit(inline="always")
def _half_f32_soft(v):
    """:func:`_half_f32` in integer operations (exact; a NaN keeps its sign and payload, quieted,
    as F16C does)."""
    b = np.int32(v)
    sign = np.int64(b & 0x8000) << 16
    e = (b >> 10) & 0x1F
    m = np.int64(b & 0x3FF)
    if e == 0:  # zero or subnormal: m * 2**-24, exact in fp32
        f = _F32(m) * _F32(2.0 ** -24)
        return -f if sign else f
    if e == 0x1F:
        bits = sign | 0x7F800000 | (m << 13) | (0x400000 if m else 0)
    else:
        bits = sign | (np.int64(e + 112) << 23) | (m << 13)
    return _f32_bits(np.int32(np.uint32(bits)))


@njit(inline="always")
def _f32_half_soft(x):
    """:func:`_f32_half` in integer operations: round to nearest even, beyond fp16's range inf, a
    NaN quieted with its sign and top payload bits (F16C's bits)."""
    b = np.int64(_i32_bits(x)) & 0xFFFFFFFF
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    if a >= 0x7F800000:  # inf, NaN
        h = 0x7C00 | ((a >> 13) & 0x3FF) | (0x200 if a > 0x7F800000 else 0)
    elif a >= 0x477FF000:  # 65520 and up: inf
        h = 0x7C00
    elif a >= 0x38800000:  # a normal fp16: drop 13 mantissa bits, to nearest even (a carry moves up)
        h = (a >> 13) - (112 << 10)
        rest = a & 0x1FFF
        if rest > 0x1000 or (rest == 0x1000 and (h & 1)):
            h += 1
    elif a < 0x33000000:  # at most 2**-25, half the smallest subnormal: 0 (a tie goes to even)
        h = 0
    else:  # a subnormal fp16 (or the smallest normal, by a carry)
        e = a >> 23
        m = (a & 0x7FFFFF) | 0x800000
        shift = 126 - e
        h = m >> shift
        rest = m & ((np.int64(1) << shift) - 1)
        halfway = np.int64(1) << (shift - 1)
        if rest > halfway or (rest == halfway and (h & 1)):
            h += 1
    return np.uint16(sign | h)


_half_f32_hw, _f32_half_hw = _half_f32, _f32_half
if not _hardware_half():
    _half_f32, _f32_half = _half_f32_soft, _f32_half_soft  # the loops below take these


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
    after it is summed, from L1, and form the same sums: in parts of 4 kB its pass over a 100 MB
    payload in 4 kB pages (as one from gRPC) measured 1.13-1.27 read passes against 1.36-1.54 in
    parts of 1 MB, the checksum's reads overlapping the next part's from memory (2026-11-26)."""
    t = 0.0
    for a in range(0, v.shape[0], SQ_PART):
        t += _sumsq_part(v[a:a + SQ_PART])
    return t


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
    of w xored with k1 ^ (k1 >> 16) (one three-input operation where the CPU has one). The codes
    pass over 25M values: 2.0-2.1 read passes with the codes stored, 1.6 packed in registers, 1.3
    with a hash per two values (2026-11-26, this project's machine, side by side in one
    process). The fused multiply-add is ``llvm.fma`` (one instruction where the CPU has FMA, a
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


# -- runs: every segment of an update in one call (a write's Python costs ~100 us per segment) --
@njit(inline="always")
def _chunk_step(m, size, block, chunk):
    """blockwise._chunk_step: elements per step (whole blocks, a multiple of 8 of them)."""
    if block == 0 or m <= chunk:
        return max(m, 1)
    return min(m, max(8, (chunk // size) // 8 * 8) * size)


_CRC_POLY = 0xEDB88320  # CRC-32 (zlib's), reflected: bit 31 is x^0


def _times_mod(a: int, b: int) -> int:
    """a(x) b(x) mod the CRC-32 polynomial, both reflected (a nonzero)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _x_powers() -> np.ndarray:
    """x^(2^k) mod the CRC-32 polynomial for k = 0..31 (reflected)."""
    out, p = [], 1 << 30  # x^1
    for _ in range(32):
        out.append(p)
        p = _times_mod(p, p)
    return np.array(out, dtype=np.uint32)


_X_POWERS = _x_powers()


@njit(inline="always")
def _times_mod_u32(a, b):
    """:func:`_times_mod` in the compiled loops (uint32 values, a nonzero)."""
    m = np.uint32(1 << 31)
    p = np.uint32(0)
    while True:
        if a & m:
            p ^= b
            if a & (m - np.uint32(1)) == 0:
                return p
        m >>= np.uint32(1)
        b = (b >> np.uint32(1)) ^ np.uint32(_CRC_POLY) if b & np.uint32(1) else b >> np.uint32(1)


@njit(cache=True, nogil=True)
def crc32_combine(crc1, crc2, len2):
    """The CRC-32 of A + B from crc1 = CRC-32 of A, crc2 = CRC-32 of B and len2 = len(B) (zlib's
    ``crc32_combine``): crc1 times x^(8 len2) mod the polynomial, plus crc2. ~32 steps of 32."""
    p = np.uint32(1 << 31)  # x^0
    n = len2
    k = 3  # x^(8 n) = x^(n 2^3)
    while n:
        if n & 1:
            p = _times_mod_u32(_X_POWERS[k & 31], p)
        n >>= 1
        k += 1
    return np.uint32(_times_mod_u32(p, np.uint32(crc1)) ^ np.uint32(crc2))


@njit(cache=True, nogil=True)
def block_run(kind, ptrs, ns, block, levels, bits, stochastic, k0s, k1s, offs, region, chunk, params, codes, ok,
              fn, crc):
    """KBit.write (``kind`` BLOCK_KBIT: [lo, scale] per block) or QSGD.write with max norms
    (BLOCK_QSGD: a norm per bucket) of each segment s (ns[s] fp32 values at ptrs[s]) at
    region[offs[s]:], then its packed codes, step by step as the one-by-one write does: the same
    bytes. ok[s] False where :func:`kbit_codes` / :func:`qsgd_codes` refuses a step (the caller
    writes that segment its own way). ``params`` ((blocks, parameters per block)) / ``codes``:
    scratch for one step.

    ``fn`` nonzero (:func:`_call_crc32`): continues the CRC32 ``crc`` of what precedes region over
    all of region and returns it (meaningless where an ok[s] is False). A segment's parameters
    precede its codes but are complete only at its end: the codes are checksummed step by step as
    they are packed (from cache), the parameters at the segment's end, and the two combined
    (:func:`crc32_combine`). Why: the writer's CRC at the end read the payload again from memory
    (~0.11-0.13 read passes of the update for 4-bit codes, 0.24 for 8-bit)."""
    per = params.shape[1]
    base = region.ctypes.data
    done_at = 0  # region[:done_at] is checksummed
    for s in range(ptrs.shape[0]):
        n = ns[s]
        x = _segment(ptrs, ns, s)
        size = n if block == 0 or block >= n else block
        step = _chunk_step(n, size, block, chunk)
        o = offs[s]
        at = o + 4 * per * ((n + size - 1) // size)  # the codes
        crc = _crc_upto(fn, crc, base, done_at, o)
        codes_crc = np.uint32(0)
        ok[s] = True
        for a in range(0, n, step):
            e = min(n, a + step)
            b0 = a // size
            nb = (e + size - 1) // size - b0
            p = params[:nb]
            if kind == BLOCK_KBIT:
                done = kbit_codes(x[a:e], size, levels, stochastic, k0s[s], k1s[s], a, p, codes)
            else:
                done = qsgd_codes(x[a:e], size, levels, bits - 1, True, p.reshape(nb), k0s[s], k1s[s], a, codes)
            if not done:
                ok[s] = False
                break
            _put_f32(p.reshape(per * nb), region, o + 4 * per * b0)
            lo = at + a * bits // 8
            m = ((e - a) * bits + 7) // 8
            pack(codes, e - a, bits, region[lo:lo + m])
            if fn:
                codes_crc = _call_crc32(fn, codes_crc, base + lo, m)
        if fn and ok[s]:
            m = (n * bits + 7) // 8
            crc = crc32_combine(_call_crc32(fn, crc, base + o, at - o), codes_crc, m)
            done_at = at + m
    return _crc_upto(fn, crc, base, done_at, region.shape[0])


@njit(cache=True, nogil=True)
def sign_run(ptrs, ns, block, std_block, qbits, absolute, offs, region, part0, amax, s, ks, scale, flags, ok):
    """Sign.write of each segment at region[offs[i]:] (scale per block, then sign bits): codes,
    and the scales of blocks of one part (<= ``std_block`` elements); segment i's parts' sums go to
    [part0[i], part0[i + 1]) of amax / s / ks. ok[i] False where a block has several parts: its
    scales are the caller's (``sign._sign_scales``, exact sums in Python integers)."""
    guess = NO_GUESS
    for i in range(ptrs.shape[0]):
        n = ns[i]
        size = n if block == 0 or block >= n else block
        sub = min(size, std_block)
        nb = (n + size - 1) // size
        o = offs[i]
        p0, p1 = part0[i], part0[i + 1]
        one = size <= sub
        sc = scale[:nb] if one else scale[:0]
        sign_stats(_segment(ptrs, ns, i), size, sub, qbits, absolute, amax[p0:p1], s[p0:p1], ks[p0:p1], sc, flags,
                   region[o + 4 * nb:o + 4 * nb + (n + 7) // 8], guess)
        if p1 > p0 and amax[p1 - 1] < np.inf:  # finite (NaN compares False)
            guess = ks[p1 - 1]
        if one:
            _put_f32(sc, region, o)
        ok[i] = one


@njit(cache=True, nogil=True)
def twobit_run(ptrs, ns, t, offs, region, chunk, codes, fn, crc):
    """TwoBit.write of each segment at region[offs[i]:] (packed 2-bit codes), ``chunk`` (a multiple
    of 4) elements at a time. ``fn`` nonzero: continues the CRC32 ``crc`` over region as each
    chunk's codes are packed (from cache) and returns it (:func:`block_run`)."""
    base = region.ctypes.data
    done_at = 0
    for i in range(ptrs.shape[0]):
        n = ns[i]
        x = _segment(ptrs, ns, i)
        o = offs[i]
        crc = _crc_upto(fn, crc, base, done_at, o)
        for a in range(0, n, chunk):
            e = min(n, a + chunk)
            twobit_codes(x[a:e], t, codes)
            m = (e - a + 3) // 4
            pack(codes, e - a, 2, region[o + a // 4:o + a // 4 + m])
            if fn:
                crc = _call_crc32(fn, crc, base + o + a // 4, m)
        done_at = max(done_at, o + (n + 3) // 4)
    return _crc_upto(fn, crc, base, done_at, region.shape[0])


@njit(cache=True, nogil=True)
def half_run(ptrs, ns, brain, limit, offs, region):
    """fp16 / bf16 .write of each segment at region[offs[i]:] (:func:`to_half`)."""
    for i in range(ptrs.shape[0]):
        n = ns[i]
        o = offs[i]
        to_half(_segment(ptrs, ns, i), brain, limit, region[o:o + 2 * n].view(np.uint16))


@njit(cache=True, nogil=True)
def half_run_crc(ptrs, ns, brain, limit, offs, region, fn, crc):
    """:func:`half_run`, continuing the CRC32 ``crc`` of what precedes region over region[:end of
    the last segment] (``fn``: :func:`_call_crc32`): each part of HALF_PART values is converted,
    then checksummed from cache (bytes between segments in order too). Returns the CRC.

    Why: the writer's CRC of the whole payload at the end reads it again from memory (~0.5 read
    passes of the fp32 update for fp16 codes); from cache it costs ~0.2."""
    base = region.ctypes.data
    at = 0
    for i in range(ptrs.shape[0]):
        n = ns[i]
        o = offs[i]
        crc = _crc_upto(fn, crc, base, at, o)
        x = _segment(ptrs, ns, i)
        for a in range(0, n, HALF_PART):
            e = min(n, a + HALF_PART)
            to_half(x[a:e], brain, limit, region[o + 2 * a:o + 2 * e].view(np.uint16))
            crc = _call_crc32(fn, crc, base + o + 2 * a, 2 * (e - a))
        at = max(at, o + 2 * n)
    return _crc_upto(fn, crc, base, at, region.shape[0])


@intrinsic
def _copy(typingctx, dst, src, nbytes):
    """memcpy(dst, src, nbytes) for addresses ``dst`` and ``src`` (LLVM's memcpy: the C
    library's for large sizes; numba's slice assignment compiles to its own loop, ~1.4x slower)."""
    sig = types.void(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        d, s, n = args
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(d, i8p), builder.inttoptr(s, i8p), n, 1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _stream64(typingctx, dst, src):
    """Copy the 64 bytes at address ``src`` to address ``dst`` (64-byte aligned) with a
    non-temporal store (``!nontemporal``: x86's ``vmovntps``), which writes memory without first
    reading the line into cache; :func:`_fence` orders such stores before what follows."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        d, s = args
        vector = ir.VectorType(ir.FloatType(), 16).as_pointer()
        value = builder.load(builder.inttoptr(s, vector), align=4)
        store = builder.store(value, builder.inttoptr(d, vector), align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _fence(typingctx):
    """A full memory fence (x86: ``mfence``, which orders non-temporal stores too)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return sig, codegen


@njit(inline="always")
def _stream_copy(dst, src, nbytes):
    """memcpy(dst, src, nbytes) by non-temporal stores but for the unaligned ends (the caller
    fences once after its last)."""
    head = min((-dst) % 64, nbytes)
    if head:
        _copy(dst, src, head)
    end = head + (nbytes - head) // 64 * 64
    for o in range(head, end, 64):
        _stream64(dst + o, src + o)
    if nbytes > end:
        _copy(dst + end, src + end, nbytes - end)


COPY_PART = 1 << 11  # values per part of raw_run_crc (8 kB of fp32: a part stays in L1)
STREAM_BYTES = 8 << 20  # regions this large are written by non-temporal stores (raw_run_crc)


@njit(cache=True, nogil=True)
def raw_run_crc(ptrs, ns, offs, region, fn, crc):
    """none().write of each segment (its fp32 bytes) at region[offs[i]:], continuing the CRC32
    ``crc`` of what precedes region over region[:end of the last segment] (``fn``:
    :func:`_call_crc32`): each part of COPY_PART values is copied, in a region of STREAM_BYTES or
    more by non-temporal stores, then checksummed from cache (the source: the same bytes); bytes
    between segments are checksummed in order too. Returns the CRC.

    Why: copying, then checksumming the payload at the end, read it twice from memory (3.0 read
    passes of the update at 25M against ``y.copy_(x)``'s 2.0-2.2, 2026-11-26). Checksumming each
    part as it was read from memory, then copying it from cache, took 1.7-1.9: the checksum keeps
    pace with memory (~1.0 read pass), and the copy came after it. A non-temporal copy from memory
    overlaps its reads and its writes (1.15-1.2 passes alone), and the checksum of what it just
    read, from L1, adds ~0.3: 1.24-1.6 passes in all (parts of 8-64 kB; 8 kB the quickest)."""
    base = region.ctypes.data
    stream = region.shape[0] >= STREAM_BYTES
    at = 0
    for i in range(ptrs.shape[0]):
        n = ns[i]
        o = offs[i]
        crc = _crc_upto(fn, crc, base, at, o)
        for a in range(0, n, COPY_PART):
            e = min(n, a + COPY_PART)
            src, dst, m = ptrs[i] + 4 * a, base + o + 4 * a, 4 * (e - a)
            if stream:
                _stream_copy(dst, src, m)
            else:
                _copy(dst, src, m)
            crc = _call_crc32(fn, crc, src, m)
        at = max(at, o + 4 * n)
    if stream:
        _fence()
    return _crc_upto(fn, crc, base, at, region.shape[0])


@njit(cache=True, nogil=True)
def stream_keys(seeds, k0s, k1s):
    """k0s[i], k1s[i]: the stream key ``uniforms.draw_key`` draws from a CPU ``torch.Generator``
    after ``manual_seed(seeds[i])``. torch's CPU generator is MT19937 seeded with the seed's low 32
    bits, and ``randint(0, 2**32, (2,))`` takes a 64-bit draw per value (two outputs) and keeps its
    low word: the key is the generator's 2nd and 4th outputs (tested against torch for many seeds).
    Those need the initial state's words 0-4 and 397-400 only.

    Why: seeding and drawing from a torch generator per segment cost ~0.5 ms an encode of a
    ResNet-50 layout's 161 tensors (the stochastic quantizers' runs); this takes ~0.05 ms."""
    mask = np.uint64(0xFFFFFFFF)
    for i in range(seeds.shape[0]):
        v = np.uint64(seeds[i]) & mask
        head = np.empty(5, dtype=np.uint64)
        tail = np.empty(4, dtype=np.uint64)
        head[0] = v
        for j in range(1, 401):
            v = (np.uint64(1812433253) * (v ^ (v >> np.uint64(30))) + np.uint64(j)) & mask
            if j < 5:
                head[j] = v
            elif j >= 397:
                tail[j - 397] = v
        for o in range(2):
            t = 2 * o + 1  # outputs 1 and 3
            y = (head[t] & np.uint64(0x80000000)) | (head[t + 1] & np.uint64(0x7FFFFFFF))
            w = tail[t] ^ (y >> np.uint64(1))
            if y & np.uint64(1):
                w ^= np.uint64(0x9908B0DF)
            w ^= w >> np.uint64(11)
            w ^= (w << np.uint64(7)) & np.uint64(0x9D2C5680)
            w ^= (w << np.uint64(15)) & np.uint64(0xEFC60000)
            w ^= w >> np.uint64(18)
            if o == 0:
                k0s[i] = np.uint32(w & mask)
            else:
                k1s[i] = np.uint32(w & mask)


# -- reading runs: every segment of a reply in one call (the server's check and add) -------------
@njit(cache=True, nogil=True)
def gather(body, starts, lens, out):
    """out = the bytes body[starts[i]:starts[i] + lens[i]] of every i, one after another."""
    o = 0
    for i in range(starts.shape[0]):
        a = starts[i]
        out[o:o + lens[i]] = body[a:a + lens[i]]
        o += lens[i]


@njit(inline="always")
def _codes(body, at, count, bits, scratch):
    """``count`` codes of ``bits`` bits from body[at:]: the bytes themselves for 8 bits, else
    unpacked into ``scratch``."""
    if bits == 8:
        return body[at:at + count]
    unpack(body[at:], count, bits, scratch)
    return scratch[:count]


@njit(inline="always")
def _geometry(n, block, bits):
    """(elements per block, elements per aligned unit: whole blocks whose codes start on a byte;
    8 codes where the segment is one block)."""
    if block == 0 or block >= n:
        return n, 8
    return block, 8 * block


@njit(inline="always")
def _block_sq(kind, c, prm, b, size, bits, levels, i0, i1):
    """Sum of squares of codes c[i0:i1] of a blockwise quantizer (``prm``: its parameter rows, from
    block b): kbit (lo, scale) or qsgd (norm / levels)."""
    if kind == BLOCK_KBIT:
        return kbit_sq(c, prm[0, b:], prm[1, b:], size, i0, i1, levels)
    return qsgd_sq(c, prm[0, b:], bits - 1, size, i0, i1)


@njit(inline="always")
def _block_add(kind, c, prm, b, size, bits, i0, i1, s, w, no, half):
    """s += w * values of codes c[i0:i1] of kbit (lo, scale), qsgd (norm / levels) or sign (scale);
    kbit's and qsgd's rounded to fp16 / bf16 where ``half`` is 1 / 2 (sign's scales are rounded
    already: ``Sign.round_tables``)."""
    if kind == BLOCK_KBIT:
        kbit(c, prm[0, b:], prm[1, b:], size, i0, i1, no, s, w, True, half)
    elif kind == BLOCK_QSGD:
        qsgd(c, prm[0, b:], bits - 1, size, i0, i1, no, s, w, True, half)
    else:
        sign(c, prm[0, b:], size, i0, i1, no, s, w, True)


@njit(inline="always")
def _block_values(kind, c, prm, b, size, bits, i0, i1, out):
    """out = the fp32 values of codes c[i0:i1] of kbit, qsgd or sign (as :func:`_block_add` adds them)."""
    no = np.empty(0, dtype=np.float64)
    if kind == BLOCK_KBIT:
        kbit(c, prm[0, b:], prm[1, b:], size, i0, i1, out, no, 0.0, False, 0)
    elif kind == BLOCK_QSGD:
        qsgd(c, prm[0, b:], bits - 1, size, i0, i1, out, no, 0.0, False, 0)
    else:
        sign(c, prm[0, b:], size, i0, i1, out, no, 0.0, False)


@njit(cache=True, nogil=True)
def block_sq_run(kind, body, coffs, ns, p0, params, block, bits, levels, chunk, codes, halves, vals, h16, out):
    """out[s] = segment s's sum of squares (kbit or qsgd codes at body[coffs[s]:], parameter rows
    ``params`` from block p0[s]), ``chunk`` elements at a time from its start as the per-segment
    check sums them (kbit_sq, qsgd_sq), so the same float; inf or NaN where not finite.
    halves[s] 1 / 2: the segment is a model's fp16 / bf16 tensor, whose values count rounded to
    it (:func:`rounded_sq` of the chunk's values, built in ``vals`` / ``h16``: chunk-sized scratch)."""
    for s in range(ns.shape[0]):
        n = ns[s]
        size, unit = _geometry(n, block, bits)
        tot = 0.0
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            a = i - i % unit
            c = _codes(body, coffs[s] + a * bits // 8, j - a, bits, codes)
            if halves[s]:
                v = vals[:j - i]
                _block_values(kind, c, params, p0[s] + a // size, size, bits, i - a, j - a, v)
                tot += rounded_sq(v, halves[s] == 2, h16[:j - i])
            else:
                tot += _block_sq(kind, c, params, p0[s] + a // size, size, bits, levels, i - a, j - a)
        out[s] = tot


@njit(cache=True, nogil=True)
def block_add_runs(kind, bodies, coffs, ns, p0, params, block, bits, sums, w, chunk, codes, halves):
    """Add replies r (payload bodies at bodies[r], parameter rows params[r]) of kbit, qsgd or sign
    into the float64 sums (segment s's at sums[s]) with weights w[r]: per segment, per ``chunk``
    elements of its sum, every reply in order (the per-segment path's additions, in its order:
    the same bits). halves[s] 1 / 2: values rounded to fp16 / bf16 first, in the add's loop."""
    no = np.empty(0, dtype=np.float32)
    for s in range(ns.shape[0]):
        n = ns[s]
        size, unit = _geometry(n, block, bits)
        end = coffs[s] + (n * bits + 7) // 8
        sm = carray(_f64_at(sums[s]), (n,))
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            a = i - i % unit
            b = p0[s] + a // size
            for r in range(bodies.shape[0]):
                body = carray(_u8_at(bodies[r]), (end,))
                c = _codes(body, coffs[s] + a * bits // 8, j - a, bits, codes)
                _block_add(kind, c, params[r], b, size, bits, i - a, j - a, sm[i:j], w[r], no, halves[s])


@njit(cache=True, nogil=True)
def block_values_run(kind, body, coffs, ns, p0, params, block, bits, outs, chunk, codes):
    """A dense decode of one reply of kbit, qsgd or sign (the segments :func:`block_add_runs`
    reads) in one call: segment s's fp32 values into the ns[s] values at address outs[s], as
    the per-segment decode makes them (:func:`_block_values`), ``chunk`` elements at a time."""
    for s in range(ns.shape[0]):
        n = ns[s]
        size, unit = _geometry(n, block, bits)
        out = carray(_f32_at(outs[s]), (n,))
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            a = i - i % unit
            c = _codes(body, coffs[s] + a * bits // 8, j - a, bits, codes)
            _block_values(kind, c, params, p0[s] + a // size, size, bits, i - a, j - a, out[i:j])


@njit(cache=True, nogil=True)
def sign_sq_run(ns, p0, scale, block, chunk, out):
    """Per segment: sum over its blocks of (elements) x scale^2, ``chunk`` elements at a time
    (sequential float64 sums: within a few ulps of the per-segment path's dot products)."""
    for s in range(ns.shape[0]):
        n = ns[s]
        size = n if block == 0 or block >= n else block
        tot = 0.0
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            part = 0.0
            for bk in range(i // size, (j - 1) // size + 1):
                v = np.float64(scale[p0[s] + bk])
                part += np.float64(min(j, (bk + 1) * size) - max(i, bk * size)) * (v * v)
            tot += part
        out[s] = tot


@njit(inline="always")
def _raw_half_bits(raw, kind, brain, vals, h16):
    """h16 = the fp16 / bf16 (``brain``) bits of raw values ``raw`` (bytes; kind 0: fp32, 1: fp16,
    2: bf16), rounded (``vals``: fp32 scratch of their count)."""
    if kind == 0:
        to_half(raw.view(np.float32), brain, _F32(np.inf), h16)
    else:
        r16 = raw.view(np.uint16)
        for j in range(r16.shape[0]):
            vals[j] = _half(r16[j], kind == 2)
        to_half(vals, brain, _F32(np.inf), h16)


@njit(inline="always")
def _raw_part_sq(raw, kind, half, vals, h16):
    """Sum of squares of one part (<= SQ_PART values) of raw values ``raw`` (bytes; kind 0: fp32,
    1: fp16, 2: bf16); rounded to fp16 / bf16 first where ``half`` is 1 / 2 and the values are of
    another kind (``vals`` / ``h16``: scratch of the part's length)."""
    if half != 0 and half != kind:
        _raw_half_bits(raw, kind, half == 2, vals, h16)
        return _half_sq_part(h16, half == 2)
    return _sumsq_part(raw.view(np.float32)) if kind == 0 else _half_sq_part(raw.view(np.uint16), kind == 2)


@njit(cache=True, nogil=True)
def raw_sq_run(body, coffs, ns, kind, chunk, halves, vals, h16, out):
    """Per segment, the sum of squares of raw values (kind 0: fp32, 1: fp16, 2: bf16), ``chunk``
    at a time, each chunk's in parts of SQ_PART as :func:`sumsq` / :func:`half_sq` form it; of the
    values rounded to fp16 / bf16 where halves[s] is 1 / 2 and the values are of another kind
    (:func:`_raw_part_sq`; ``vals`` / ``h16``: scratch of a chunk)."""
    width = 4 if kind == 0 else 2
    for s in range(ns.shape[0]):
        n = ns[s]
        o = coffs[s]
        tot = 0.0
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            part = 0.0
            for a in range(i, j, SQ_PART):
                e = min(j, a + SQ_PART)
                part += _raw_part_sq(body[o + width * a:o + width * e], kind, halves[s], vals[:e - a], h16[:e - a])
            tot += part
        out[s] = tot


@njit(cache=True, nogil=True)
def raw_crc_sq_run(body, coffs, ns, kind, chunk, fn, crc, halves, vals, h16, out):
    """:func:`raw_sq_run` with the payload's CRC32 continued over the same bytes (``fn``:
    :func:`_call_crc32`): each part of SQ_PART values is summed from memory, then checksummed
    from cache; bytes between segments are checksummed in order too. The sums are
    :func:`raw_sq_run`'s, bit for bit (the same parts, added in the same order). Returns (the CRC
    after body[:end], end: the end of the last segment); ``crc``: the CRC of what precedes the body.

    Why: a raw reply is read twice before it may count, for its checksum and for its norm, each
    time from memory (~1 read pass each); the checksum from cache costs ~0.4 (25M fp32, 2026-11-26:
    1.2 read passes against 2.0; checksum first, then the sum from cache: 1.5). Values of a
    model's half tensor of another kind count rounded, as :func:`raw_sq_run` sums them."""
    width = 4 if kind == 0 else 2
    base = body.ctypes.data
    at = 0  # body[:at] is checksummed
    for s in range(ns.shape[0]):
        n = ns[s]
        o = coffs[s]
        crc = _crc_upto(fn, crc, base, at, o)
        tot = 0.0
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            part = 0.0
            for a in range(i, j, SQ_PART):
                e = min(j, a + SQ_PART)
                part += _raw_part_sq(body[o + width * a:o + width * e], kind, halves[s], vals[:e - a], h16[:e - a])
                crc = _call_crc32(fn, crc, base + o + width * a, width * (e - a))
            tot += part
        out[s] = tot
        at = max(at, o + width * n)
    return crc, at


@njit(cache=True, nogil=True)
def raw_add_runs(bodies, coffs, ns, kind, sums, w, chunk, halves, vals):
    """:func:`block_add_runs` for raw values (kind 0: fp32, 1: fp16, 2: bf16); rounded to fp16 /
    bf16 first where halves[s] is 1 / 2 and the values are of another kind (``vals``: scratch)."""
    width = 4 if kind == 0 else 2
    for s in range(ns.shape[0]):
        n = ns[s]
        o = coffs[s]
        sm = carray(_f64_at(sums[s]), (n,))
        rnd = halves[s] != 0 and halves[s] != kind
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            for r in range(bodies.shape[0]):
                raw = carray(_u8_at(bodies[r]), (o + width * n,))[o + width * i:o + width * j]
                if rnd and kind == 0:
                    add_rounded(raw.view(np.float32), halves[s] == 2, sm[i:j], w[r])
                elif rnd:
                    r16 = raw.view(np.uint16)
                    v = vals[:j - i]
                    for q in range(j - i):
                        v[q] = _half(r16[q], kind == 2)
                    add_rounded(v, halves[s] == 2, sm[i:j], w[r])
                elif kind == 0:
                    add_f32(raw.view(np.float32), sm[i:j], w[r])
                else:
                    add_half(raw.view(np.uint16), kind == 2, sm[i:j], w[r])


@njit(cache=True, nogil=True)
def tern_run(ptrs, ns, s32, bound32, clips, k0s, k1s, offs, region, chunk, codes, ok, fn, crc):
    """TernGrad.write of each segment i with ok[i] at region[offs[i]:] (s, then packed 2-bit
    codes, :func:`tern_packed` ``chunk`` (a multiple of 4) elements at a time; ``codes`` its
    scratch). ``fn`` nonzero: continues the CRC32 ``crc`` over region as each chunk's codes are
    packed (from cache) and returns it (meaningless where an ok[i] is False; :func:`block_run`)."""
    base = region.ctypes.data
    done_at = 0
    for i in range(ptrs.shape[0]):
        if not ok[i]:
            continue
        n = ns[i]
        x = _segment(ptrs, ns, i)
        o = offs[i]
        crc = _crc_upto(fn, crc, base, done_at, o)
        _put_f32(s32[i:i + 1], region, o)
        if fn:
            crc = _call_crc32(fn, crc, base + o, 4)
        for a in range(0, n, chunk):
            e = min(n, a + chunk)
            m = (e - a + 3) // 4
            at = o + 4 + a // 4
            tern_packed(x[a:e], s32[i], bound32[i], clips[i], k0s[i], k1s[i], a, region[at:at + m], codes)
            if fn:
                crc = _call_crc32(fn, crc, base + o + 4 + a // 4, m)
        done_at = max(done_at, o + 4 + (n + 3) // 4)
    return _crc_upto(fn, crc, base, done_at, region.shape[0])


@njit(cache=True, nogil=True)
def ternary_bad_run(body, coffs, ns, bad):
    """The first segment whose 2-bit codes hold the unused code ``bad``, or -1."""
    for s in range(ns.shape[0]):
        if ns[s] and count_codes2(body[coffs[s]:], ns[s])[bad]:
            return s
    return -1


@njit(cache=True, nogil=True)
def ternary_sq_run(body, coffs, ns, table, chunk, out):
    """Per segment: sum of (count of each code) x table[s, code]^2, ``chunk`` elements at a time
    (sequential float64 sums: within a few ulps of the per-segment path's dot products)."""
    for s in range(ns.shape[0]):
        n = ns[s]
        tot = 0.0
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            a = i - i % 4
            data = body[coffs[s] + a // 4:]
            c = count_codes2(data, j - a) - count_codes2(data, i - a)
            part = 0.0
            for q in range(4):
                v = np.float64(table[s, q])
                part += np.float64(c[q]) * (v * v)
            tot += part
        out[s] = tot


@njit(cache=True, nogil=True)
def ternary_values_run(body, coffs, ns, table, outs, chunk, codes):
    """:func:`block_values_run` for 2-bit codes valued table[s, code] (twobit, terngrad)."""
    no = np.empty(0, dtype=np.float64)
    for s in range(ns.shape[0]):
        n = ns[s]
        out = carray(_f32_at(outs[s]), (n,))
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            a = i - i % 4
            unpack(body[coffs[s] + a // 4:], j - a, 2, codes)
            table2(codes, table[s], i - a, j - a, out[i:j], no, 0.0, False)


@njit(cache=True, nogil=True)
def raw_values_run(body, coffs, ns, kind, outs):
    """:func:`block_values_run` for raw values (kind 0: fp32, copied; 1: fp16, 2: bf16: exact
    conversions)."""
    for s in range(ns.shape[0]):
        n = ns[s]
        o = coffs[s]
        out = carray(_f32_at(outs[s]), (n,))
        if kind == 0:
            out[:] = body[o:o + 4 * n].view(np.float32)
        else:
            raw = body[o:o + 2 * n].view(np.uint16)
            for q in range(n):
                out[q] = _half(raw[q], kind == 2)


@njit(cache=True, nogil=True)
def ternary_add_runs(bodies, coffs, ns, table, sums, w, chunk, codes):
    """:func:`block_add_runs` for 2-bit codes valued table[r, s, code] (twobit, terngrad)."""
    no = np.empty(0, dtype=np.float32)
    for s in range(ns.shape[0]):
        n = ns[s]
        end = coffs[s] + (n * 2 + 7) // 8
        sm = carray(_f64_at(sums[s]), (n,))
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            a = i - i % 4
            for r in range(bodies.shape[0]):
                body = carray(_u8_at(bodies[r]), (end,))
                unpack(body[coffs[s] + a // 4:], j - a, 2, codes)
                table2(codes, table[r, s], i - a, j - a, no, sm[i:j], w[r], True)


# -- 16-lane loops for the hash-bound encoders ---------------------------------------------------
_WIDTH = 16  # fp32/int32 lanes of an AVX-512 register
_width = [0]  # the -force-vector-width in effect (0: LLVM's own choice, the default)


def _vector_width(dispatcher, width: int):
    """Compile ``dispatcher`` (and what it calls that compiles with it) with LLVM's
    ``-force-vector-width`` at ``width`` (0: LLVM's own choice), restored after.

    Why: on CPUs with AVX-512 LLVM prefers 256-bit vectors (8 fp32 lanes; wider registers may
    lower the clock on some CPUs), and numba exposes no per-function ``prefer-vector-width``.
    The counter hash and the codes loops around it are compute-bound: in cache, qsgd's codes
    loop measured 2.1 -> 1.4 read passes, kbit's 1.3 -> 1.0 and TernGrad's 1.6 -> 1.0
    (2026-11-23, this project's AVX-512 machine; on AVX2 or NEON LLVM splits a 16-lane loop into
    narrower halves: not measured).
    The bits are the same (these loops reduce only integers, exactly). The option is
    process-wide while set: it is set and restored under numba's compiler lock, which every
    numba compilation holds; a version loaded from numba's cache is used as it was compiled."""
    import llvmlite.binding as llvm
    from numba.core.compiler_lock import global_compiler_lock

    compile_ = dispatcher.compile

    def compile(sig):
        with global_compiler_lock:
            outer = _width[0]
            if width != outer:
                llvm.set_option("", f"-force-vector-width={width}")
            _width[0] = width
            try:
                return compile_(sig)
            finally:
                _width[0] = outer
                if width != outer:
                    llvm.set_option("", f"-force-vector-width={outer}")
    dispatcher.compile = compile
    return dispatcher


for _kernel in (kbit_codes, qsgd_codes, tern_codes, uniforms):
    _vector_width(_kernel, _WIDTH)
