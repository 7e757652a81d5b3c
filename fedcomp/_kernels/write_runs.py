"""Write runs: every segment of an update in one call (`fedcomp.codecs.fastpath.write_run`), with
the payload's CRC32 continued as the bytes are written.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from fedcomp._kernels.core import _call_crc32, _crc_upto, _put_f32, _segment
from fedcomp._kernels.dequant import HALF_PART, to_half
from fedcomp._kernels.encode import kbit_codes, pack, qsgd_codes, twobit_codes
from fedcomp._kernels.blocksums import BLOCK_KBIT, NO_GUESS, sign_stats


# -- runs: every segment of an update in one call (a write's Python costs much per segment) ------
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

    Why: copying, then checksumming the payload at the end, reads it twice from memory. A
    non-temporal copy overlaps its reads and writes, and the checksum of what it just read, from
    L1, adds little (see the docs' Results: performance)."""
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
