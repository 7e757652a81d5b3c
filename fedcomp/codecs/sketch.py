"""Count sketch (Charikar et al. 2002) as a reducer, and the sketch-space arithmetic FetchSGD needs.

A segment x of n elements becomes a table S of ``rows`` x ``cols`` cells:
S[r, h_r(j)] += s_r(j) x_j, with hashes h_r and signs s_r drawn from ``seed`` (shared by every
client and the server, so no hash tables travel). Sketches are linear: S(a) + S(b) = S(a + b),
so a server can sum clients' tables without decoding them. Decoding ("unsketching") estimates
x_j = median_r s_r(j) S[r, h_r(j)] and keeps the k = ceil(ratio * n) largest estimates (the
heavy hitters); with cols >= 8k and a few rows, every estimate is within O(||tail_k(x)|| / sqrt(k)).
Upload compression is n / (rows * cols).

Default dimensions scale with the segment: ``sketch()`` is one row of ``cols = ceil(0.068 n)``
cells (at least ``min(n, MIN_AUTO_COLS)``) whose values travel as ``qsgd(bits=4)`` unless a
quantizer is written after it: about 116x fewer bytes than fp32 on any model (15,921 cells for
the 234k-parameter digits MLP, 28,679 for mnist ``cnn-bn``), the dimensions of the cross-device
default (``fedcomp.strategies.config``). Keep the cells many and coarse rather than few and
exact: with one row every coordinate of a heavy-hitter cell gets the cell's whole value, so n/64
fp32 cells (the same bytes) made training diverge. A spec that names ``cols``
keeps it, 5 rows, ``ratio=0.005`` and fp32 cells (the former defaults), so specs written before
the scaling are the same codec (``sketch(cols=1000)`` is still ``sketch(rows=5,cols=1000,ratio=0.005,seed=0)``).
With automatic cols the heavy hitters' share is 0.02 (smaller shares lost accuracy across
devices; see the docs' Results: codec families).

Hashes (payload format 2): h_r(j) and s_r(j) come from the counter hash of j in
row r's stream (:mod:`fedcomp.uniforms`), computed chunk by chunk where the data is; payloads of
format 1 (tables drawn from a CPU ``torch.Generator``) still decode with theirs.

Memory: no n-sized hash table is kept (format 1: none for rows x n > ``HASH_CACHE``; they are
regenerated chunk by chunk from saved generator states), and unsketching estimates and ranks
``SELECT_CHUNK`` elements at a time, so sketching, estimating and taking the heavy hitters cost
chunk-sized temporaries plus 2k candidates (and the dense result where one is asked for).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp import kernels, uniforms
from fedcomp.base import REGISTRY, Knob, Reducer, Segment, StageContext, register
from fedcomp.codecs.blockwise import _encode_kernels
from fedcomp.codecs.sparsify import read_rice, write_rice
from fedcomp.errors import DecodeError
from fedcomp.wire import MMAPPED, Reader, Writer, host_empty, host_zeros

HASH_CACHE = 1 << 21  # hash entries (rows x elements) kept as tables; larger segments regenerate them
HASH_CHUNK = 1 << 18  # hash entries per regenerated chunk (temporaries of about 4 MB)
# ... on a GPU (format 2): each torch op per row and chunk is a kernel launch, so larger chunks
# (~50 MB of temporaries) keep it from being launch-bound (see the docs' Results: performance)
DEVICE_HASH_CHUNK = 1 << 22
# estimates ranked per torch.topk call when unsketching (its scratch: 16 bytes an estimate); every
# model of the project's tasks (up to 1.2M floats) is one chunk, as before chunking
SELECT_CHUNK = 1 << 21
# the compiled unsketch (top_dense): elements per thread at least (fewer: fewer threads)
THREAD_MIN = 1 << 20
AUTO_COLS_PER_ELEMENT = 0.068  # cols=0 (default): ceil(0.068 n) cells in one row, 4-bit values (module docstring)
MIN_AUTO_COLS = 256  # ... but at least this many (or n for a smaller segment)
EXPLICIT_COLS_ROWS = 5  # rows=0 (default) with cols given: the former default (fp32 cells)
AUTO_RATIO = 0.02  # ratio=0 (default) with automatic cols: heavy hitters applied per round (module docstring)
EXPLICIT_COLS_RATIO = 0.005  # ratio=0 with cols given: the former default
SKETCH_SALT = 0x5851F42D  # in k1 of every row's hash stream: apart from a quantizer's stream of the same key
ROW_SALT = 0x632BE5AB  # times the row, in k1: each row its own stream


@register
class CountSketch(Reducer):
    """Count sketch of the whole update (one global segment); decodes to its top-k heavy hitters."""

    name = "sketch"
    linear = True
    # payload format: 2 = counter hashes (_row_keys); 1 = tables drawn from a
    # torch.Generator (read still: a format-1 payload decodes with its own hashes; a server that
    # sums sketches refuses it, as a sum of tables under two hashes means nothing)
    wire_version = 2
    budget_knobs = (Knob("cols", "count"),)  # 1 .. the float elements, rows cells per step

    @dataclass(frozen=True)
    class Config:
        rows: int = 0  # hash rows (estimates combined by median); 0: 1 with automatic cols, else 5
        cols: int = 0  # cells per row; 0: ceil(0.068 n) for a segment of n, cells sent as qsgd(bits=4)
        ratio: float = 0.0  # fraction of elements recovered as heavy hitters; 0: 0.02 with automatic cols, else 0.005
        seed: int = 0  # seeds hashes and signs; must be the same on every client and the server

    def validate(self) -> None:
        if not 0 <= self.config.rows <= 64:
            self.fail("rows", "an integer from 1 to 64 (0: 1 with automatic cols, else 5)")
        if not 0 <= self.config.cols <= 2**28:
            self.fail("cols", "a positive integer up to 2**28 (0: ceil(0.068 n) cells for a segment of n)")
        if not 0 <= self.config.ratio <= 1:
            self.fail("ratio", "a fraction in (0, 1] (0: 0.02 with automatic cols, else 0.005)")
        if not 0 <= self.config.seed < 2**32:  # seeds torch.Generator via seed * 1_000_003 + n (< 2**63)
            self.fail("seed", "an integer in [0, 2**32)")
        # 0 means "from the defaults": written out, so the canonical spec names what is used, and a
        # spec that gives cols keeps the former defaults' canonical form (sketch(cols=1000) is
        # sketch(rows=5,cols=1000,ratio=0.005,seed=0), as before the scaling)
        explicit = bool(self.config.cols)
        self.config = dataclasses.replace(
            self.config, rows=self.config.rows or (EXPLICIT_COLS_ROWS if explicit else 1),
            ratio=self.config.ratio or (EXPLICIT_COLS_RATIO if explicit else AUTO_RATIO))
        # per (segment size, device): the hash tables themselves (small segments), or the
        # generator's state at every HASH_BLOCK-aligned position (large ones: regenerated per chunk)
        self._hashes: dict[tuple[int, str], tuple] = {}

    @classmethod
    def signature(cls) -> str:
        return (f"sketch(rows=1, cols=0, ratio={AUTO_RATIO!r}, seed=0) (cols=0: ceil({AUTO_COLS_PER_ELEMENT} n) "
                f"cells, 4-bit QSGD; with cols given, rows and ratio default to {EXPLICIT_COLS_ROWS} and "
                f"{EXPLICIT_COLS_RATIO}, cells fp32)")

    # -- dimensions -------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """Hash rows: as written, else 1 with automatic cols and 5 with cols given."""
        return self.config.rows

    def cols(self, n: int) -> int:
        """Cells per row for a segment of ``n`` elements: as written, else ``ceil(0.068 n)``
        (at least ``min(n, MIN_AUTO_COLS)``, at least 1)."""
        if self.config.cols:
            return self.config.cols
        return max(1, min(n, MIN_AUTO_COLS), math.ceil(round(AUTO_COLS_PER_ELEMENT * n, 6)))

    @property
    def ratio(self) -> float:
        """Heavy hitters' share: as written, else 0.02 with automatic cols and 0.005 (the former
        default) with cols given."""
        return self.config.ratio

    def default_quantizer(self):
        """``qsgd(bits=4)`` for automatic cols (module docstring), fp32 for written ones."""
        if self.config.cols:
            return super().default_quantizer()
        return REGISTRY["qsgd"].from_args({"bits": 4})

    # -- hashing ----------------------------------------------------------------------------
    # Format 2 (the default): element j of row r goes to cell (h * cols) >> 32
    # with the sign - where h is odd, h the 32-bit counter hash of j in row r's stream
    # (:func:`_row_keys`; :mod:`fedcomp.uniforms`' hash), computed where the data is (torch int32
    # ops on any device, or inside the compiled loop of ``fedcomp._kernels.sketch_add``). Why: the
    # format-1 tables below are torch.randint draws from a CPU generator, generated on the CPU even
    # for a CUDA update and many times slower than these hashes (see the docs' Results: performance).
    # Format 1: hashes and signs are torch.randint draws from one CPU generator seeded by (seed, n): all
    # buckets row by row, then all signs row by row (one 32-bit draw per value, in order). Small
    # segments keep the tables; large ones keep the generator's state every `block` elements of
    # each row and regenerate the tables chunk by chunk (the same values, no n-sized table).
    def _block(self) -> int:
        """Elements per regenerated chunk: a power of two, rows x block <= HASH_CHUNK."""
        return 1 << max(0, (HASH_CHUNK // self.rows).bit_length() - 1)

    def _plan(self, n: int, device: torch.device) -> tuple:
        key = (n, str(device))
        if key not in self._hashes:
            rows, cols = self.rows, self.cols(n)
            gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + n)
            self._hashes.clear()  # one layout at a time: bounded memory
            if rows * n <= HASH_CACHE:
                buckets = torch.randint(0, cols, (rows, n), generator=gen)
                cells = buckets + (torch.arange(rows) * cols)[:, None]
                signs = torch.randint(0, 2, (rows, n), generator=gen, dtype=torch.int8) * 2 - 1
                self._hashes[key] = ("tables", cells.to(device), signs.to(device=device, dtype=torch.float32))
            else:
                block, states = self._block(), []
                for high, dtype in ((cols, torch.int64), (2, torch.int8)):  # buckets, then signs
                    for _ in range(rows):
                        row = []
                        for a in range(0, n, block):
                            row.append(gen.get_state())
                            torch.randint(0, high, (min(block, n - a),), generator=gen, dtype=dtype)
                        states.append(row)
                self._hashes[key] = ("states", states[:rows], states[rows:])
        return self._hashes[key]

    def _row_keys(self, n: int) -> list[tuple[int, int]]:
        """(k0, k1) of each row's hash stream for a segment of ``n`` elements (format 2): the
        format-1 generator's seed (seed * 1_000_003 + n) split into two words, each row its k1."""
        s = self.config.seed * 1_000_003 + n
        return [(s & uniforms.M32, ((s >> 32) ^ SKETCH_SALT ^ (r * ROW_SALT)) & uniforms.M32)
                for r in range(self.rows)]

    def _hash_chunks(self, n: int, device: torch.device, lo: int = 0, hi: int | None = None, version: int = 2):
        """(a, b, flat cell indices rows x (b - a), signs rows x (b - a)) over [lo, hi) in chunks
        (lo: a multiple of the chunk size); the cells and signs of all n elements under the hashes
        of payload format ``version``."""
        hi = n if hi is None else hi
        if version >= 2:
            yield from self._counter_chunks(n, device, lo, hi)
            return
        plan = self._plan(n, device)
        rows, cols = self.rows, self.cols(n)
        if plan[0] == "tables":
            _, cells, signs = plan
            step = max(1, HASH_CHUNK // rows)
            for a in range(lo, hi, step):
                b = min(hi, a + step)
                yield a, b, cells[:, a:b], signs[:, a:b]
            return
        _, bucket_states, sign_states = plan
        block = self._block()
        offsets = (torch.arange(rows) * cols)[:, None]
        gen = torch.Generator()
        for a in range(lo, hi, block):
            b = min(hi, a + block)
            buckets = torch.empty(rows, b - a, dtype=torch.int64)
            signs = torch.empty(rows, b - a, dtype=torch.int8)
            for r in range(rows):
                gen.set_state(bucket_states[r][a // block])
                torch.randint(0, cols, (b - a,), generator=gen, out=buckets[r])
                gen.set_state(sign_states[r][a // block])
                torch.randint(0, 2, (b - a,), generator=gen, dtype=torch.int8, out=signs[r])
            yield a, b, (buckets + offsets).to(device), (signs * 2 - 1).to(device=device, dtype=torch.float32)

    def _counter_chunks(self, n: int, device: torch.device, lo: int, hi: int):
        """Format 2's cells and signs (torch int32 ops, on ``device``), chunk by chunk."""
        rows, cols = self.rows, self.cols(n)
        per = HASH_CHUNK if device.type == "cpu" else DEVICE_HASH_CHUNK
        step = 1 << max(0, (per // rows).bit_length() - 1)  # the cells of any chunking are the same
        keys = self._row_keys(n)
        work = torch.empty(2 * max(1, min(step, hi - lo)), dtype=torch.int32, device=device)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            cells = torch.empty(rows, b - a, dtype=torch.int64, device=device)
            signs = torch.empty(rows, b - a, dtype=torch.float32, device=device)
            for r, key in enumerate(keys):
                h = uniforms._mix(key, a, b - a, device, work)  # a view of work: used up before the next row
                cells[r].copy_(h).bitwise_and_(uniforms.M32).mul_(cols).bitwise_right_shift_(32).add_(r * cols)
                signs[r].copy_(h.bitwise_and(1)).mul_(-2).add_(1)
            yield a, b, cells, signs

    def sketch(self, x: torch.Tensor, version: int = 2) -> torch.Tensor:
        """The table (rows * cols, flattened) of a 1-D vector, under the hashes of payload format
        ``version``; each cell adds its elements in index order (``scatter_add_`` chunk by chunk, or
        the compiled loop for format 2 on the CPU: the same fp32 sums)."""
        n = x.numel()
        if x.device.type == "cpu":  # huge pages where large: cells are hit at random, a 4 kB page a TLB miss
            table = host_empty(self.cells(n), torch.float32).zero_()
        else:
            table = torch.zeros(self.cells(n), device=x.device)
        k = _encode_kernels(x) if version >= 2 else None
        if k is not None:
            keys = np.array(self._row_keys(n), dtype=np.uint32).reshape(-1, 2)
            k.sketch_add(x.numpy(), keys[:, 0].copy(), keys[:, 1].copy(), self.cols(n), table.numpy())
            return table
        for a, b, cells, signs in self._hash_chunks(n, x.device, version=version):
            # scatter_add_: index_add_'s sums in the same order on the CPU, ~20% faster into a large table
            table.scatter_add_(0, cells.reshape(-1), (signs * x[a:b]).reshape(-1))
        return table

    def _estimates(self, table: torch.Tensor, n: int, lo: int, hi: int, version: int = 2) -> torch.Tensor:
        """Median-of-rows estimates of elements [lo, hi)."""
        out = torch.empty(hi - lo, device=table.device)
        for a, b, cells, signs in self._hash_chunks(n, table.device, lo, hi, version):
            est = signs * torch.index_select(table, 0, cells.reshape(-1)).view(cells.shape)  # ~6x table[cells] (CPU)
            out[a - lo:b - lo] = est[0] if est.shape[0] == 1 else est.median(dim=0).values  # one row: itself
        return out

    def estimate(self, table: torch.Tensor, n: int, version: int = 2) -> torch.Tensor:
        """Median-of-rows estimate of every element (hashes of payload format ``version``)."""
        return self._estimates(table, n, 0, n, version)

    def top_entries(self, table: torch.Tensor, n: int, k: int | None = None,
                    version: int = 2, *, load: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, estimates) of the k largest estimates in magnitude; where several tie at the
        k-th magnitude, the lowest positions among them.

        Ties are the rule, not the exception: every element hashed to a cell of a one-row sketch
        has that cell's magnitude. ``torch.topk`` breaks them differently on the CPU and CUDA, so
        a client unsketching on its GPU (the residual of error feedback) and a server on its CPU
        would keep different elements; the lowest positions make the choice the same everywhere.
        Estimates are formed and ranked SELECT_CHUNK elements at a time (per chunk, then among the
        chunk's and the running candidates, in position order), so the memory is a chunk plus 2k
        candidates; the k entries of one total order (magnitude, then position) are kept in any
        chunking. On the CPU the compiled passes of :meth:`top_dense` find the same entries
        (``load``: as there).
        """
        k = self.kept(n) if k is None else k
        fast = self.top_dense(table, n, k, version, load=load)
        if fast is not None:
            idx, y = fast
            return idx, y[idx]
        return self._top_entries(table, n, k, version)

    def _top_entries(self, table: torch.Tensor, n: int, k: int, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`top_entries` in torch ops (any device), chunk by chunk."""
        best_idx = torch.empty(0, dtype=torch.int64, device=table.device)
        best_val = torch.empty(0, device=table.device)
        for lo in range(0, n, SELECT_CHUNK):
            hi = min(n, lo + SELECT_CHUNK)
            est = self._estimates(table, n, lo, hi, version)
            top = _top_lowest_ties(est.abs(), min(k, hi - lo))
            idx, val = torch.cat([best_idx, top + lo]), torch.cat([best_val, est[top]])
            del est, top
            if idx.numel() > k:  # candidates are in position order: earlier chunks', then this one's
                keep = _top_lowest_ties(val.abs(), k)
                idx, val = idx[keep], val[keep]
            best_idx, best_val = idx, val
        return best_idx, best_val

    def heavy_hitters(self, table: torch.Tensor, n: int, k: int | None = None, version: int = 2, *,
                      load: bool = False) -> torch.Tensor:
        """Dense vector holding the k largest estimates (others zero)."""
        k = self.kept(n) if k is None else k
        fast = self.top_dense(table, n, k, version, load=load)
        if fast is not None:
            return fast[1]
        idx, val = self._top_entries(table, n, k, version)
        y = host_zeros(n) if table.device.type == "cpu" else torch.zeros(n, device=table.device)
        y[idx] = val
        return y

    def top_dense(self, table: torch.Tensor, n: int, k: int | None = None, version: int = 2, *,
                  load: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(kept positions, ascending; the dense vector of the k largest estimates, zero elsewhere)
        in compiled passes over the elements (:mod:`fedcomp._kernels.unsketch`), the same entries as
        :meth:`_top_entries` (magnitude, then position); None where they do not apply (a table not
        on the CPU or not fp32, payload format 1, no compiled loops, NaN estimates): then the
        torch path runs. ``load``: import the compiled loops if need be (a server, whose decode
        loaded them already), else use them only where loaded (:func:`fedcomp.kernels.for_encode`:
        a client's decode in a fresh process).

        Why: the torch path forms estimates in ~15 int32 ops per row and chunk, ranks each chunk
        and builds the dense vector apart, ~30 read passes of the vector (see the docs' Results:
        server step). Here: one pass forms every estimate into the output and a histogram of its
        magnitude's top 16 bits; one streaming pass (only where the k-th's bin is not taken whole)
        histograms the low bits within that bin; one streaming pass keeps the top k. The element
        range is cut among up to ``torch.get_num_threads()`` threads (at least THREAD_MIN each):
        each thread's kept ties are known from the histograms, so the choice is the same for any
        number of threads."""
        k = self.kept(n) if k is None else k
        if (version < 2 or table.device.type != "cpu" or table.dtype != torch.float32 or not 0 < k < n
                or n >= 1 << 31 or table.numel() != self.cells(n)):
            return None
        k_ = kernels.get() if load else kernels.for_encode()
        if k_ is None:
            return None
        tab = table.detach().contiguous().numpy()
        keys = np.array(self._row_keys(n), dtype=np.uint32).reshape(-1, 2)
        k0s, k1s, cols = keys[:, 0].copy(), keys[:, 1].copy(), self.cols(n)
        parts = max(1, min(torch.get_num_threads(), n // THREAD_MIN))
        cuts = [n * t // parts for t in range(parts + 1)]
        spans = list(zip(cuts[:-1], cuts[1:]))
        if self.rows == 1:
            got = self._top_one_row(k_, tab, k0s[0], k1s[0], cols, n, k, spans)
            if got is not False:
                return got
        y = host_empty(n, torch.float32, at_least=MMAPPED)
        yn = y.numpy()
        hists = [np.zeros(k_.BINS, dtype=np.int64) for _ in spans]
        nans = kernels.run_parallel(
            (lambda a=a, b=b, h=h: k_.estimate_hist(tab, k0s, k1s, cols, a, yn[a:b], h))
            for (a, b), h in zip(spans, hists))
        if sum(nans):
            return None
        hist = np.sum(hists, axis=0)
        top, need = _bin_of(hist, k)  # the k-th largest is in bin `top`; `need` of that bin are taken
        if need == hist[top]:  # the bin is taken whole: no finer cut
            cut, ties = (top << 16) - 1, [0] * len(spans)
            above = [int(h[top:].sum()) for h in hists]
        else:
            lows = [np.zeros(k_.BINS, dtype=np.int64) for _ in spans]
            kernels.run_parallel((lambda a=a, b=b, h=h: k_.refine_hist(yn[a:b], top, h))
                                 for (a, b), h in zip(spans, lows))
            low, take = _bin_of(np.sum(lows, axis=0), need)
            cut = (top << 16) | low
            above = [int(h[top + 1:].sum()) + int(lo_[low + 1:].sum()) for h, lo_ in zip(hists, lows)]
            ties = []
            for lo_ in lows:  # the ties at the cut, taken in position order: thread by thread
                ties.append(min(int(lo_[low]), take))
                take -= ties[-1]
        counts = [a + t for a, t in zip(above, ties)]
        assert sum(counts) == k, (sum(counts), k)
        offsets = np.cumsum([0] + counts)
        pos = np.empty(k, dtype=np.int64)
        got = kernels.run_parallel(
            (lambda a=a, b=b, o=o, t=t, c=c: k_.keep_top(yn[a:b], a, cut, t, pos[o:o + c]))
            for (a, b), o, t, c in zip(spans, offsets[:-1], ties, counts))
        assert list(got) == counts, (got, counts)
        return torch.from_numpy(pos), y

    def _cell_counts(self, k_, n: int, k0, k1, cols: int, spans) -> np.ndarray:
        """Elements per cell of a one-row sketch of n (int32, cached for the last n: a property of the
        hashes, the same every round)."""
        key = ("counts", n)
        if key not in self._hashes:
            per = [np.zeros(cols, dtype=np.int32) for _ in spans]  # n < 2**31
            kernels.run_parallel((lambda a=a, b=b, c=c: k_.cell_counts(k0, k1, cols, a, b, c))
                                 for (a, b), c in zip(spans, per))
            for old in [x for x in self._hashes if x[0] == "counts"]:
                del self._hashes[old]  # one layout at a time
            for more in per[1:]:
                per[0] += more
            self._hashes[key] = per[0]
        return self._hashes[key]

    @property
    def cache_nbytes(self) -> int:
        """Bytes this reducer keeps between calls: format-1 hash tables or generator states aside,
        the element count per cell of a one-row sketch (:meth:`top_dense`; 4 bytes a cell)."""
        return sum(v.nbytes for key, v in self._hashes.items() if key[0] == "counts")

    def _top_one_row(self, k_, tab: np.ndarray, k0, k1, cols: int, n: int, k: int, spans):
        """:meth:`top_dense` for one row, where an element's estimate is its cell's value (signed):
        the k-th magnitude is found over the cells, weighted by their element counts (cached), and
        one pass over the elements keeps those whose cell is at or above it (a bitmap of the cells,
        ~cols / 8 bytes, in cache). False where it does not apply (many ties at the cut: the
        general passes), None for NaN estimates."""
        counts = self._cell_counts(k_, n, k0, k1, cols, spans)
        hist = np.zeros(k_.BINS, dtype=np.int64)
        if k_.cells_hist(tab, counts, -1, hist):
            return None
        top, need = _bin_of(hist, k)
        if need == hist[top]:
            cut, take, tied = (top << 16) - 1, 0, 0
        else:
            low_hist = np.zeros(k_.BINS, dtype=np.int64)
            k_.cells_hist(tab, counts, top, low_hist)
            low, take = _bin_of(low_hist, need)
            cut, tied = (top << 16) | low, int(low_hist[low])
            if take == tied:  # every tie is taken: keep all at or above the cut
                cut, take, tied = cut - 1, 0, 0
            elif tied > max(k, THREAD_MIN):  # the ties' lists would be large: the general passes
                return False
        words = (cols + 63) // 64
        marks, prefix = np.empty(words, dtype=np.uint64), np.empty(words, dtype=np.int64)
        vals = np.empty(cols, dtype=np.float32)  # only the marked cells' pages are touched
        k_.cells_mark(tab, counts, cut + (1 if tied == 0 else 0), marks, prefix, vals)  # no ties: only those above
        y = host_empty(n, torch.float32, at_least=MMAPPED)
        yn = y.numpy()
        bufs = [(np.empty(min(k, b - a), dtype=np.int64), np.empty(min(tied, b - a), dtype=np.int64))
                for a, b in spans]
        got = kernels.run_parallel(
            (lambda a=a, b=b, p=p, t=t: k_.keep_cells(marks, prefix, vals, k0, k1, cols, cut, a, yn[a:b], p, t))
            for (a, b), (p, t) in zip(spans, bufs))
        pieces = []
        for (o, t), (p, ties) in zip(got, bufs):  # the ties at the cut, taken in position order
            use = min(t, take)
            take -= use
            if t == 0:
                pieces.append(p[:o])
                continue
            out = np.empty(o + use, dtype=np.int64)
            k_.merge_ties(p, o, ties[:t], use, out, yn)
            pieces.append(out)
        pos = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        assert pos.shape[0] == k, (pos.shape[0], k)
        return torch.from_numpy(pos), y

    def zero_cells(self, positions: torch.Tensor, y: torch.Tensor, *tables: torch.Tensor, load: bool = True) -> None:
        """Zero ``tables`` (momentum, error) at every cell where the sketch of ``y`` is nonzero, ``y``
        nonzero at ``positions`` (ascending) only: FetchSGD's ``S[sketch(delta) != 0] = 0``, from the
        k kept coordinates instead of a sketch of the whole dense vector (their fp32 sums are the
        same: zeros add nothing)."""
        n = y.numel()
        k_ = (kernels.get() if load else kernels.for_encode()) if all(
            t.device.type == "cpu" and t.dtype == torch.float32 for t in (y, *tables)) else None
        if k_ is None:
            applied = self.sketch(y) != 0
            for t in tables:
                t[applied] = 0
            return
        mask = self.sketch_entries(positions, y[positions], n)  # the sketch of the k kept values alone
        for t in tables:
            k_.zero_where(mask.numpy(), t.numpy())

    def sketch_entries(self, positions: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
        """The table of the n-element vector holding ``values`` at ``positions`` (ascending, distinct)
        and zero elsewhere: :meth:`sketch`'s bits, hashing only those positions where the compiled
        loops are loaded."""
        k_ = kernels.get() if positions.device.type == "cpu" and values.device.type == "cpu" \
            and values.dtype == torch.float32 else None
        if k_ is None:
            y = torch.zeros(n, device=values.device)
            y[positions] = values.float()
            return self.sketch(y)
        table = torch.zeros(self.cells(n))
        keys = np.array(self._row_keys(n), dtype=np.uint32).reshape(-1, 2)
        k_.sketch_values_at(positions.contiguous().numpy(), values.contiguous().numpy(), keys[:, 0].copy(),
                            keys[:, 1].copy(), self.cols(n), table.numpy())
        return table

    def cells(self, n: int) -> int:
        """Table size (rows x cols) for a segment of ``n`` elements."""
        return self.rows * self.cols(n)

    def kept(self, n: int) -> int:
        return min(n, max(1, math.ceil(round(self.ratio * n, 6)))) if n else 0

    # -- reducer ----------------------------------------------------------------------------
    def count(self, seg: Segment) -> int | None:
        return self.cells(seg.numel)

    def side_nbytes(self, seg: Segment, count: int) -> int | None:
        return 0

    def reduce(self, x: torch.Tensor, seg: Segment, out: Writer, ctx: StageContext):
        return self.sketch(x, self.wire_version), None, 0

    def read(self, src: Reader, seg: Segment, ctx: StageContext, device: torch.device):
        return src.version  # the payload's format: its hashes

    def value_count(self, aux, seg: Segment) -> int:
        return self.cells(seg.numel)

    def expand(self, values: torch.Tensor, aux, seg: Segment) -> torch.Tensor:
        return self.heavy_hitters(values, seg.numel, version=aux or self.wire_version)


@register
class SketchCells(Reducer):
    """The download of a one-row FetchSGD step: its cells, not its coordinates.

    With one hash row every element hashed to a heavy-hitter cell gets that cell's value (times
    its sign), so the server's step (:func:`fedcomp.fetchsgd.sketch_step`) is constant per cell up
    to the sign: ``x_j = s(j) w[h(j)]``. ``cells(cols, seed)`` sends ``w`` at the cells where the
    segment is nonzero, under the hashes of ``sketch(rows=1, cols=cols, seed=seed)`` on the same
    segment (payload format 2), and decodes every element of a sent cell as ``s(j) w[h(j)]``. A
    step of k coordinates in cells of about ``n / cols`` elements travels as about ``k cols / n``
    values: 1/15 of ``topk(ratio=...)`` at the automatic ``cols = 0.068 n``.

    Any segment encodes: ``w`` is the signed mean of the nonzero elements of each cell, so a vector
    that is not constant per cell comes back projected onto the cells (lossy, biased: error
    feedback applies). ``ServerFeedback`` keeps what the quantizer after it drops in the cells'
    units (:meth:`cell_mean`). ``cols`` and ``seed`` must be the upload sketch's (and the segment
    the same tensors), or the cells mean nothing; the coupled download that ``CompressedStrategy``
    writes for a one-row sketch copies them.
    """

    name = "cells"
    wire_version = 2

    @dataclass(frozen=True)
    class Config:
        cols: int = 0  # the upload sketch's cells per row; 0: its automatic ceil(0.068 n)
        seed: int = 0  # the upload sketch's seed

    def validate(self) -> None:
        if not 0 <= self.config.cols <= 2**28:
            self.fail("cols", "a positive integer up to 2**28 (0: ceil(0.068 n) cells for a segment of n, as sketch())")
        if not 0 <= self.config.seed < 2**32:
            self.fail("seed", "an integer in [0, 2**32)")
        self.hashes = CountSketch.from_args({"rows": 1, "cols": self.config.cols, "seed": self.config.seed})

    def matches(self, sketch: "CountSketch") -> bool:
        """Whether these cells are ``sketch``'s (one row, the same cols and seed)."""
        return (sketch.rows == 1 and sketch.config.cols == self.config.cols
                and sketch.config.seed == self.config.seed)

    def cols(self, n: int) -> int:
        return self.hashes.cols(n)

    def _chunks(self, n: int, device: torch.device):
        for a, b, cells, signs in self.hashes._hash_chunks(n, device):
            yield a, b, cells[0], signs[0]

    def cell_mean(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per cell, the signed mean ``sum s(j) x_j / count`` over the elements of ``x`` (1-D, a
        whole segment) where ``mask`` (default: ``x != 0``) holds; 0 in cells without any (fp32,
        ``cols`` values)."""
        n = x.numel()
        sums = torch.zeros(self.cols(n), dtype=torch.float64, device=x.device)
        counts = torch.zeros_like(sums)
        for a, b, cells, signs in self._chunks(n, x.device):
            part = x[a:b]
            use = (part != 0) if mask is None else mask[a:b]
            sums.index_add_(0, cells, (signs * part).double() * use)
            counts.index_add_(0, cells, use.double())
        return torch.where(counts > 0, sums / counts.clamp_min(1), 0.0).float()

    def _key(self, n: int) -> tuple[int, int]:
        return self.hashes._row_keys(n)[0]

    def reduce(self, x: torch.Tensor, seg: Segment, out: Writer, ctx: StageContext):
        n = seg.numel
        sums = torch.zeros(self.cols(n), dtype=torch.float64, device=x.device)
        counts = torch.zeros_like(sums)
        k = _encode_kernels(x)  # the compiled loop where loaded (a server, a warm worker): the same sums
        if k is not None:
            k.cells_sums(x.numpy(), *self._key(n), self.cols(n), sums.numpy(), counts.numpy())
        else:
            for a, b, cells, signs in self._chunks(n, x.device):
                part = x[a:b]
                sums.index_add_(0, cells, (signs * part).double())
                counts.index_add_(0, cells, (part != 0).double())
        kept = torch.nonzero(counts).squeeze(1)
        values = (sums[kept] / counts[kept]).float()
        return values, kept, _write_rice(kept, self.cols(n), out)

    def read(self, src: Reader, seg: Segment, ctx: StageContext, device: torch.device):
        return _read_rice(src, self.cols(seg.numel), device)

    def value_count(self, aux, seg: Segment) -> int:
        return aux.numel()

    def expand(self, values: torch.Tensor, aux, seg: Segment) -> torch.Tensor:
        n = seg.numel
        table = torch.zeros(self.cols(n), device=values.device)
        table[aux] = values.float()
        k = _encode_kernels(table)
        if k is not None:
            y = host_empty(n, torch.float32)
            k.cells_expand(table.numpy(), *self._key(n), self.cols(n), y.numpy())
            return y
        y = host_zeros(n) if values.device.type == "cpu" else torch.zeros(n, device=values.device)
        for a, b, cells, signs in self._chunks(n, values.device):
            y[a:b] = signs * torch.index_select(table, 0, cells)
        return y


def _write_rice(idx: torch.Tensor, n: int, out: Writer) -> int:
    """Sorted positions in [0, n): their count, then ``topk``'s Rice-coded stream; its bytes."""
    out.u32(idx.numel())
    return 4 + write_rice(idx.cpu(), n, out)


def _read_rice(src: Reader, n: int, device: torch.device) -> torch.Tensor:
    k = src.u32()
    if k > n:
        raise DecodeError(f"payload claims {k} cells of {n}")
    return read_rice(src, k, n, device)


def _bin_of(hist: np.ndarray, k: int) -> tuple[int, int]:
    """(the bin holding the k-th largest counted in ``hist``, how many of that bin are among the k
    largest): bins ordered as their values (1 <= k <= hist.sum())."""
    from_top = np.cumsum(hist[::-1])
    i = int(np.searchsorted(from_top, k))  # the first count from the top reaching k
    b = hist.shape[0] - 1 - i
    return b, k - int(from_top[i] - hist[b])


def _top_lowest_ties(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (ascending) of the k largest of ``mag``, the lowest positions among those tied
    at the k-th largest: the same set on every device. A NaN (not finite estimates) falls back to
    ``torch.topk``'s choice."""
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=mag.device)
    if k >= mag.numel():
        return torch.arange(mag.numel(), device=mag.device)
    if mag.device.type == "cpu":  # introselect: ~3.5x faster than topk's values at k = a quarter of mag
        a = mag.numpy()
        cut = float(np.partition(a, a.size - k)[a.size - k])
    else:
        cut = float(torch.topk(mag, k, sorted=False).values.min())
    above = mag > cut
    need = k - int(above.sum())
    at = torch.nonzero(mag == cut).squeeze(1)
    if need < 0 or at.numel() < need:  # NaN among the values: no total order to follow
        return torch.topk(mag, k, sorted=False).indices.sort().values
    above[at[:need]] = True
    return torch.nonzero(above).squeeze(1)
