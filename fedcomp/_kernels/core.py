"""Building blocks of the loops: LLVM intrinsics (fma, bit casts, prefetch, CRC32 calls), fp16 /
bf16 conversions (in hardware where the CPU has F16C, else in integer operations), segment
access, and the per-dispatcher forced vector width.
"""

from __future__ import annotations

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


# -- 16-lane loops for the hash-bound encoders ---------------------------------------------------
_WIDTH = 16  # fp32/int32 lanes of an AVX-512 register
_width = [0]  # the -force-vector-width in effect (0: LLVM's own choice, the default)


def _vector_width(dispatcher, width: int):
    """Compile ``dispatcher`` (and what it calls that compiles with it) with LLVM's
    ``-force-vector-width`` at ``width`` (0: LLVM's own choice), restored after.

    Why: on CPUs with AVX-512 LLVM prefers 256-bit vectors (8 fp32 lanes; wider registers may
    lower the clock on some CPUs), and numba exposes no per-function ``prefer-vector-width``.
    The counter hash and the codes loops around it are compute-bound, and 16 lanes run them
    faster (see the docs' Results: performance).
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
