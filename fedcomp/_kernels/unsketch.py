"""FetchSGD's server step in compiled passes: a count sketch's estimates, their top k, and the
cells of what was kept (:meth:`fedcomp.codecs.sketch.CountSketch.top_dense`).

Why: the torch path forms the estimates 2M elements at a time (the counter hashes in ~15 int32
ops per row and chunk, a gather, a median), ranks each chunk (a partition, a nonzero, ...) and
then re-sketches the whole dense delta (a hash per element again) only to learn which cells it
touches: ~30 read passes of a 25M-element update and five n-sized temporaries. Here:

1. :func:`estimate_hist` (one pass, per thread over its range): the hash of each element in a
   vectorised block, the estimate (one gather per row; the median of the rows where there are
   several) written into the dense output, and a histogram of the top 16 bits of |estimate|
   (the bits of a non-negative fp32 order as its values do);
2. the bin of the k-th largest, then, only where that bin holds more than is taken from it,
   :func:`refine_hist` (streaming over the output) for the low 16 bits within that bin: the
   exact 32-bit magnitude of the k-th largest and how many of those tied at it are taken, by
   each thread in position order;
3. :func:`keep_top` (streaming): what is kept stays, the rest is zeroed, kept positions listed;
4. :func:`sketch_values_at`: the sketch of the k kept values alone, the fp32 sums ``sketch_add`` forms
   for the dense delta (zeros add nothing), so momentum and error are zeroed at exactly the cells
   the torch path zeroes (:func:`zero_where`).

The k kept are those of one total order, magnitude then position (the torch path's rule):
identical positions and values.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fedcomp._kernels.core import _F32, _i32_bits
from fedcomp._kernels.hashing import _base, _h32, _hw, _step

_EB = 2048  # elements per block of estimate_hist (its hashes, cells and signs stay in L1)
NAN_BITS = 0x7F800000  # |estimate| bits above this: NaN (the caller falls back to torch's path)
BINS = 1 << 16  # histogram bins: the top (then the low) 16 bits of |estimate|


@njit(inline="always")
def _mag(v):
    """The bits of |v| (fp32) as a non-negative int64: ordered as the magnitudes are."""
    return np.int64(_i32_bits(v) & np.int32(0x7FFFFFFF))


@njit(inline="always")
def _lo(a, b):
    """The smaller of two non-NaN fp32 values (b where equal)."""
    return a if a < b else b


@njit(inline="always")
def _hi(a, b):
    """The larger of two non-NaN fp32 values (a where equal)."""
    return b if a < b else a


@njit(cache=True, nogil=True)
def estimate_hist(table, k0s, k1s, cols, lo, y, hist):
    """y[j] = the median-of-rows estimate of element lo + j (``CountSketch._estimates``: sign *
    table cell, the lower median of the rows), hist[|y[j]| bits >> 16] += 1; returns how many
    estimates are NaN. Format 2's hashes (:meth:`CountSketch._counter_chunks`)."""
    rows = k0s.shape[0]
    m_all = y.shape[0]
    c64 = np.uint64(cols)
    cell = np.empty(_EB, dtype=np.int64)
    neg = np.empty(_EB, dtype=np.bool_)
    est = np.empty((rows, _EB), dtype=np.float32)
    col = np.empty(rows, dtype=np.float32)
    nan = 0
    mid = (rows - 1) // 2  # torch.median: the lower of the two middle values for an even count
    for a in range(0, m_all, _EB):
        m = min(m_all, a + _EB) - a
        for r in range(rows):
            w = _base(k0s[r], lo + a)
            k1 = k1s[r]
            for j in range(m):  # vectorised: the hashes alone
                h = _hw(w, k1)
                w = _step(w)
                cell[j] = r * cols + np.int64((np.uint64(h) * c64) >> np.uint64(32))
                neg[j] = (h & np.uint32(1)) != 0
            e = est[r]
            for j in range(m):
                v = table[cell[j]]
                e[j] = -v if neg[j] else v
        if rows == 1:
            e = est[0]
            for j in range(m):
                y[a + j] = e[j]
        elif rows == 5:  # Knuth's 9-comparator sorting network of min / max (branch-free, vectorised),
            # pruned to what the middle value needs (checked on every ordering of 5 values, ties included)
            for j in range(m):
                v0, v1, v2, v3, v4 = est[0, j], est[1, j], est[2, j], est[3, j], est[4, j]
                isnan = (v0 != v0) | (v1 != v1) | (v2 != v2) | (v3 != v3) | (v4 != v4)
                v0, v3 = _lo(v0, v3), _hi(v0, v3)
                v1, v4 = _lo(v1, v4), _hi(v1, v4)
                v0, v2 = _lo(v0, v2), _hi(v0, v2)
                v1, v3 = _lo(v1, v3), _hi(v1, v3)
                v1, v2 = _hi(v0, v1), _lo(v2, v4)  # (0,1), (2,4): the halves the middle needs
                v1, v2 = _lo(v1, v2), _hi(v1, v2)  # (1,2)
                v2 = _lo(v2, v3)  # (2,3); (3,4) does not change it
                y[a + j] = np.float32(np.nan) if isnan else v2
        else:
            for j in range(m):
                isnan = False
                for r in range(rows):  # insertion sort of the rows' estimates
                    v = est[r, j]
                    isnan |= v != v
                    i = r
                    while i > 0 and col[i - 1] > v:
                        col[i] = col[i - 1]
                        i -= 1
                    col[i] = v
                y[a + j] = np.float32(np.nan) if isnan else col[mid]
        for j in range(m):
            b = _mag(y[a + j])
            hist[b >> 16] += 1
            nan += b > NAN_BITS
    return nan


@njit(cache=True, nogil=True)
def refine_hist(y, top, hist):
    """hist[|y[j]| bits & 0xFFFF] += 1 for the estimates whose top 16 bits are ``top``."""
    for j in range(y.shape[0]):
        b = _mag(y[j])
        if (b >> 16) == top:
            hist[b & 0xFFFF] += 1


@njit(cache=True, nogil=True)
def keep_top(y, lo, cut, take, pos):
    """Keep y[j] where |y[j]| (bits) > cut, and the first ``take`` of those == cut; zero the rest;
    pos[:count] = lo + the kept j, ascending. Returns the count. (Branches: the kept are few, and
    a branch-free compaction measured ~3x slower.)"""
    o = 0
    zero = _F32(0.0)
    for j in range(y.shape[0]):
        b = _mag(y[j])
        if b >= cut:
            if b > cut or take > 0:
                if b == cut:
                    take -= 1
                pos[o] = lo + j
                o += 1
                continue
        y[j] = zero
    return o


# -- one row: estimates are the cells' values, so the ranking is over cells ------------------------
@njit(cache=True, nogil=True)
def cell_counts(k0, k1, cols, lo, hi, counts):
    """counts[c] += the elements of [lo, hi) that one row's hash sends to cell c."""
    c64 = np.uint64(cols)
    cell = np.empty(_EB, dtype=np.int64)
    for a in range(lo, hi, _EB):
        m = min(hi, a + _EB) - a
        w = _base(k0, a)
        for j in range(m):  # vectorised
            h = _hw(w, k1)
            w = _step(w)
            cell[j] = np.int64((np.uint64(h) * c64) >> np.uint64(32))
        for j in range(m):
            counts[cell[j]] += 1


@njit(cache=True, nogil=True)
def cells_hist(table, counts, top, hist):
    """hist[|table[c]| bits >> 16] += counts[c] (top < 0), or hist[bits & 0xFFFF] += counts[c] for
    the cells whose top 16 bits are ``top``; returns the elements whose estimate is NaN."""
    nan = 0
    for c in range(table.shape[0]):
        b = _mag(table[c])
        if top < 0:
            hist[b >> 16] += counts[c]
        elif (b >> 16) == top:
            hist[b & 0xFFFF] += counts[c]
        if b > NAN_BITS:
            nan += counts[c]
    return nan


@njit(cache=True, nogil=True)
def cells_mark(table, counts, cut, marks, prefix, vals):
    """The cells holding elements (counts[c] > 0) whose |table[c]| (bits) >= cut: bit c of ``marks`` (uint64 words), their values
    in cell order in vals[:count], and prefix[w] = the marked cells before word w (a cell's rank:
    prefix[c >> 6] + the bits below it in its word). Returns the count. Why: the pass over the
    elements then reads ~cols / 8 + 4 cols / 64 bytes and the few marked values, all in cache,
    not the table (4 bytes a cell, ~7 MB at 25M elements: a random read from memory, ~70 ns)."""
    o = 0
    for w in range(marks.shape[0]):
        prefix[w] = o
        word = np.uint64(0)
        for c in range(w * 64, min(table.shape[0], w * 64 + 64)):
            v = table[c]
            if _mag(v) >= cut and counts[c] > 0:
                word |= np.uint64(1) << np.uint64(c - w * 64)
                vals[o] = v
                o += 1
        marks[w] = word
    return o


@njit(inline="always")
def _popcount(x):
    """Set bits of a uint64 (LLVM turns this loop-free form into popcnt)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


@njit(cache=True, nogil=True)
def keep_cells(marks, prefix, vals, k0, k1, cols, cut, lo, y, pos, ties):
    """One row: y[j] = the estimate of element lo + j where its cell is marked (:func:`cells_mark`:
    magnitude >= cut), else 0; pos[:o] = lo + j of those above cut and ties[:t] of those at it,
    ascending. Returns (o, t)."""
    c64 = np.uint64(cols)
    cell = np.empty(_EB, dtype=np.int64)
    flag = np.empty(_EB, dtype=np.uint8)
    zero = _F32(0.0)
    one = np.uint64(1)
    o = 0
    t = 0
    for a in range(0, y.shape[0], _EB):
        m = min(y.shape[0], a + _EB) - a
        w = _base(k0, lo + a)
        for j in range(m):  # vectorised: the hashes alone; cell * 2 + the sign bit
            h = _hw(w, k1)
            w = _step(w)
            cell[j] = np.int64(((np.uint64(h) * c64) >> np.uint64(32)) << one) | np.int64(h & np.uint32(1))
        hit = 0
        for j in range(m):
            c = np.uint64(cell[j]) >> one
            f = np.uint8((marks[c >> np.uint64(6)] >> (c & np.uint64(63))) & one)
            flag[j] = f
            hit |= f
        yy = y[a:a + m]
        for j in range(m):
            yy[j] = zero
        if hit == 0:
            continue
        for j in range(m):
            if flag[j]:
                cs = np.uint64(cell[j])
                c = cs >> one
                word = marks[c >> np.uint64(6)]
                v = vals[prefix[c >> np.uint64(6)] + _popcount(word & ((one << (c & np.uint64(63))) - one))]
                yy[j] = -v if cs & one else v
                if _mag(v) > cut:
                    pos[o] = lo + a + j
                    o += 1
                else:
                    ties[t] = lo + a + j
                    t += 1
    return o, t


@njit(cache=True, nogil=True)
def merge_ties(pos, o, ties, take, out, y):
    """out[:o + take] = the ascending merge of pos[:o] and ties[:take]; y at ties[take:] zeroed."""
    zero = _F32(0.0)
    for i in range(take, ties.shape[0]):
        y[ties[i]] = zero
    i = 0
    j = 0
    for w in range(o + take):
        if j >= take or (i < o and pos[i] < ties[j]):
            out[w] = pos[i]
            i += 1
        else:
            out[w] = ties[j]
            j += 1


@njit(cache=True, nogil=True)
def sketch_values_at(pos, vals, k0s, k1s, cols, table):
    """table[cell] += sign * vals[i] for the positions ``pos`` (ascending), row by row: the fp32 sums
    ``sketch_add`` forms for the dense vector holding vals[i] at pos[i] and zero elsewhere (adding a
    zero changes no sum)."""
    c64 = np.uint64(cols)
    one = np.uint32(1)
    for r in range(k0s.shape[0]):
        base = _base(k0s[r], 0)
        k1 = k1s[r]
        off = r * cols
        for i in range(pos.shape[0]):
            h = _h32(base, k1, pos[i])
            c = off + np.int64((np.uint64(h) * c64) >> np.uint64(32))
            v = vals[i]
            table[c] += -v if h & one else v


@njit(cache=True, nogil=True)
def zero_where(mask, a):
    """a[c] = 0 where mask[c] != 0."""
    zero = _F32(0.0)
    for c in range(mask.shape[0]):
        a[c] = zero if mask[c] != zero else a[c]
