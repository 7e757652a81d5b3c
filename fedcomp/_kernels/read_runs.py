"""Read runs: every segment of a reply in one call (`fedcomp.codecs.fastpath.RunReply`): check,
sums of squares, dense decode and batched adds into the float64 sums.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from fedcomp._kernels.core import _F32, _call_crc32, _crc_upto, _f32_at, _f64_at, _put_f32, _segment, _u8_at
from fedcomp._kernels.dequant import (
    SQ_PART,
    add_f32,
    add_half,
    add_rounded,
    count_codes2,
    _half,
    _half_sq_part,
    kbit,
    kbit_sq,
    qsgd,
    qsgd_sq,
    rounded_sq,
    sign,
    _sumsq_part,
    to_half,
    unpack,
)
from fedcomp._kernels.encode import table2
from fedcomp._kernels.blocksums import BLOCK_KBIT, BLOCK_QSGD, tern_packed


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
    time from memory; the checksum from cache costs far less (see the docs' Results:
    performance). Values of a
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
