"""An update's float segments encoded as one flat buffer: a constant number of torch ops per encode.

Why: on the torch path (CUDA clients, or a CPU client without the compiled loops) the blockwise
quantizers cost a few dozen torch ops and a host sync or two per segment, so a model of 161
tensors launched thousands of kernels and synced hundreds of times for one encode (see the docs'
Results: GPU clients). Here every float tensor is copied once into one fp32 buffer, and each
step is one op over all of them: per-block reductions over the blocks' true lengths
(``torch.segment_reduce``), per-block parameters broadcast back by ``repeat_interleave``, the
counter-hash uniforms (:mod:`fedcomp.uniforms`) from a per-element index and per-segment keys,
the codes of all segments packed at once, and the payload's body (each segment's parameters, then
its codes) gathered from them in one ``index_select``. The bytes are the per-segment path's.

Geometry: segment s is padded with zeros to a multiple of 8 elements in the buffer (its packed
codes of any width then start on a byte); blocks are the segment's (``block_size(n, block)``
elements, the last one shorter); a segment's padding forms a row of its own, whose parameters
are dropped. Everything that depends on the layout alone is computed once (numpy) and kept.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from fedcomp import kernels, uniforms
from fedcomp.base import block_size
from fedcomp.bitpack import packed_bytes
from fedcomp.uniforms import A, B, G, M32, _s32


class Flat:
    """Float segments (element counts ``ns``, in payload order) as one padded fp32 buffer ``x``
    on ``device``; ``starts[s]``: segment s's first element in it (a multiple of 8)."""

    def __init__(self, parts: list[torch.Tensor], device: torch.device, align: int = 8) -> None:
        self.device = device
        self.ns = np.fromiter((p.numel() for p in parts), dtype=np.int64, count=len(parts))
        self.padded = -(-self.ns // align) * align  # (align 1: the values back to back, raw codecs)
        self.starts = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(self.padded, out=self.starts[1:])
        self.total = int(self.starts[-1])
        pads = (self.padded - self.ns).tolist()
        self.x = torch.empty(self.total, dtype=torch.float32, device=device)
        if any(pads):  # zeros between segments (kept tensors of 1-7 zeros: no op a segment)
            seq = []
            for p, pad in zip(parts, pads):
                seq.append(p)
                if pad:
                    seq.append(_zeros(pad, device))
            parts = seq
        if parts:
            torch.cat(parts, out=self.x)  # fp16 / bf16 / float64 converted as .to(float32) does
        self._geo = _geometry(tuple(self.ns.tolist()), align)

    def seg_lengths(self) -> torch.Tensor:
        """Padded length of each segment (int64, on the device): ``repeat_interleave``'s repeats."""
        return _on(self._geo["padded"], self.device)

    def per_element(self, values: torch.Tensor) -> torch.Tensor:
        """values[s] at every element of segment s (padding included)."""
        return torch.repeat_interleave(values, self.seg_lengths(), dim=0, output_size=self.total)

    def rows(self, block: int, sub: int | None = None) -> "Rows":
        return Rows(self, block, sub)

    def hashes(self, keys: tuple[np.ndarray, np.ndarray], half: bool = False) -> torch.Tensor:
        """h_i of every element (int32 bits): the 32-bit hash of element i of its segment's
        stream (``half``: of i >> 1, the half-width stream's, :func:`fedcomp.uniforms.fill16`)."""
        k0, k1 = keys
        first = self.starts[:-1]
        if half:  # h of m = (e - start) >> 1 = (e >> 1) - (start >> 1) (starts are even)
            first = first >> 1
        off = (k0.astype(np.int64) - first * G) & M32  # h = k0 + m G = m' G + off for m' = the buffer's index
        base = torch.from_numpy(_as_s32(off)).to(self.device)
        xor = torch.from_numpy(_as_s32(k1.astype(np.int64))).to(self.device)
        h = torch.arange(self.total, dtype=torch.int32, device=self.device)
        if half:
            h.bitwise_right_shift_(1)
        h.mul_(_s32(G)).add_(self.per_element(base)).bitwise_xor_(self.per_element(xor))
        t = torch.empty_like(h)
        for shift, mul in ((16, A), (15, B), (16, None)):
            torch.bitwise_right_shift(h, shift, out=t).bitwise_and_(M32 >> shift)
            h.bitwise_xor_(t)
            if mul is not None:
                h.mul_(_s32(mul))
        return h

    def uniforms(self, keys: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        """u_i of every element (fp32; :func:`fedcomp.uniforms.fill`'s bits)."""
        h = self.hashes(keys)
        return h.bitwise_right_shift_(8).bitwise_and_(M32 >> 8).to(torch.float32).mul_(uniforms.SCALE)

    def uniforms16(self, keys: tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        """The half-width u_i of every element (:func:`fedcomp.uniforms.fill16`'s bits)."""
        h = self.hashes(keys, half=True)
        odd = torch.arange(self.total, dtype=torch.int32, device=self.device).bitwise_and_(1).mul_(16)
        return h.bitwise_right_shift_(odd).bitwise_and_(0xFFFF).mul_(2).add_(1).to(torch.float32).mul_(uniforms.SCALE17)

    def pack(self, codes: torch.Tensor, bits: int) -> torch.Tensor:
        """Codes (uint8 < 2**bits, one per buffer element, padding's 0) packed MSB first: segment
        s's at byte ``starts[s] * bits // 8``."""
        if bits == 8:
            return codes
        if 8 % bits == 0:
            per = 8 // bits
            shifts = torch.arange(8 - bits, -1, -bits, device=codes.device, dtype=torch.uint8)
            return (codes.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)
        # 8 codes -> a (8 * bits)-bit big-endian word -> bits bytes
        shifts = torch.arange(7 * bits, -1, -bits, device=codes.device, dtype=torch.int64)
        word = (codes.view(-1, 8).to(torch.int64) << shifts).sum(dim=1)
        out = torch.arange(8 * (bits - 1), -1, -8, device=codes.device, dtype=torch.int64)
        return (word[:, None] >> out).bitwise_and_(0xFF).to(torch.uint8).reshape(-1)

    def assemble(self, out, params: torch.Tensor | None, nparams: np.ndarray, codes: torch.Tensor,
                 bits: int) -> None:
        """Write the body: per segment its parameters (``nparams[s]`` fp32 of ``params``, in
        order), then its ``packed_bytes(n, bits)`` code bytes (from :meth:`pack`'s stream), in
        one gather into the writer's place."""
        key = ("assemble", bits, tuple(nparams.tolist()))
        geo = self._geo
        if key not in geo:
            ns, starts = self.ns, self.starts[:-1]
            pbytes = 4 * nparams
            cbytes = np.array([packed_bytes(n, bits) for n in ns.tolist()], dtype=np.int64)
            psrc = np.zeros(len(ns), dtype=np.int64)
            np.cumsum(pbytes[:-1], out=psrc[1:])
            ptotal = int(pbytes.sum())
            csrc = ptotal + starts * bits // 8
            lengths = np.stack([pbytes, cbytes], axis=1).reshape(-1)
            src = np.stack([psrc, csrc], axis=1).reshape(-1)
            dst = np.zeros(lengths.shape[0], dtype=np.int64)
            np.cumsum(lengths[:-1], out=dst[1:])
            geo[key] = (int(lengths.sum()), lengths, src - dst)
        total, lengths, delta = geo[key]
        place = out.empty(total, torch.uint8, self.device)
        if total == 0:
            return
        parts = [codes] if params is None else [params.reshape(-1).view(torch.uint8), codes]
        source = torch.cat(parts) if len(parts) > 1 else parts[0]
        index = torch.arange(total, dtype=torch.int64, device=self.device)
        index.add_(torch.repeat_interleave(_on(delta, self.device), _on(lengths, self.device), output_size=total))
        torch.index_select(source, 0, index, out=place)
        out.tensor(place)


class Rows:
    """The blocks of every segment (``block_size(n, block)`` elements, the last one shorter; with
    ``sub``, each block cut in parts of at most ``sub``) and each segment's padding as rows of the
    buffer, for per-row reductions. ``seg_rows[s]``: segment s's first real row among the real
    rows (``real``), ``nrows[s]`` their count."""

    def __init__(self, flat: Flat, block: int, sub: int | None = None) -> None:
        self.flat = flat
        key = ("rows", block, sub)
        geo = flat._geo
        if key not in geo:
            lengths, real, widths, seg = [], [], [], []
            for s, (n, p) in enumerate(zip(flat.ns.tolist(), flat.padded.tolist())):
                if n:
                    size = block_size(n, block)
                    part = size if sub is None else min(size, sub)
                    for a in range(0, n, size) if part < size else [0]:
                        e = min(n, a + size) if part < size else n
                        full, rest = divmod(e - a, part)
                        lengths += [part] * full + ([rest] if rest else [])
                        count = full + (1 if rest else 0)
                        real += [True] * count
                        widths += [part] * count
                        seg += [s] * count
                if p - n:
                    lengths.append(p - n)
                    real.append(False)
                    widths.append(0)
                    seg.append(s)
            lengths_np = np.array(lengths, dtype=np.int64)
            real_np = np.array(real, dtype=np.bool_)
            starts = np.zeros(lengths_np.shape[0], dtype=np.int64)
            if lengths_np.shape[0]:
                np.cumsum(lengths_np[:-1], out=starts[1:])
            nrows = np.bincount(np.array(seg, dtype=np.int64)[real_np], minlength=len(flat.ns)).astype(np.int64)
            seg_rows = np.zeros(len(flat.ns) + 1, dtype=np.int64)
            np.cumsum(nrows, out=seg_rows[1:])
            geo[key] = dict(lengths=lengths_np, real=real_np, all_real=bool(real_np.all()), keep=np.flatnonzero(real_np),
                            widths=np.array(widths, dtype=np.int64), starts=starts, nrows=nrows, seg_rows=seg_rows)
        g = geo[key]
        self.lengths_np, self.widths, self.row_starts = g["lengths"], g["widths"], g["starts"]
        self.nrows, self.seg_rows, self.all_real, self._keep = g["nrows"], g["seg_rows"], g["all_real"], g["keep"]
        self._real_np = g["real"]
        self.count = self.lengths_np.shape[0]

    def real_mask(self) -> torch.Tensor:
        """Which rows are blocks (bool, on the device)."""
        return _on(self._real_np, self.flat.device)

    def real_np(self, values: np.ndarray) -> np.ndarray:
        return values if self.all_real else values[self._keep]

    def real_index(self) -> np.ndarray:
        """Row index of each real row."""
        return self._keep

    @property
    def lengths(self) -> torch.Tensor:
        return _on(self.lengths_np, self.flat.device)

    def reduce(self, x: torch.Tensor, how: str) -> torch.Tensor:
        """Per row: ``how`` ("max", "min", "sum") of x's elements (a float tensor over the buffer)."""
        return torch.segment_reduce(x, how, lengths=self.lengths, unsafe=True)

    def expand(self, values: torch.Tensor) -> torch.Tensor:
        """values[r] at every element of row r."""
        return torch.repeat_interleave(values, self.lengths, output_size=self.flat.total)

    def real(self, values: torch.Tensor) -> torch.Tensor:
        """The rows that are blocks (a segment's padding dropped), in order."""
        return values if self.all_real else values.index_select(0, _on(self._keep, values.device))

    def padded_rows(self, rows: np.ndarray, fill_first: bool) -> tuple[torch.Tensor, np.ndarray]:
        """Rows ``rows`` (indices; all of one width w) as a (len, w) tensor padded as the
        per-segment path pads a block (its first value, or zeros)."""
        w = int(self.widths[rows[0]])
        x = self.flat.x
        idx = torch.from_numpy(self.row_starts[rows]).to(x.device)[:, None] + torch.arange(w, device=x.device)
        lens = torch.from_numpy(self.lengths_np[rows]).to(x.device)
        valid = torch.arange(w, device=x.device)[None, :] < lens[:, None]
        if fill_first:
            idx = torch.where(valid, idx, idx[:, :1])
            return x[idx], rows
        return torch.where(valid, x[idx.clamp_(max=x.numel() - 1)], torch.zeros((), device=x.device)), rows


_ZEROS: dict = {}


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    """n fp32 zeros on ``device``, made once (never written: cat's input)."""
    key = (n, str(device))
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros(n, dtype=torch.float32, device=device)
    return z


def _as_s32(a: np.ndarray) -> np.ndarray:
    """uint32 values (in int64) as int32 with their bits."""
    return (a & M32).astype(np.uint32).view(np.int32)


@functools.lru_cache(maxsize=8)
def _geometry(ns: tuple[int, ...], align: int) -> dict:
    """What depends on the segments' sizes alone (filled in as asked for: rows, assembly)."""
    n = np.array(ns, dtype=np.int64)
    return {"padded": -(-n // align) * align}


_DEVICE_COPIES: dict = {}


def _on(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A layout's numpy array as a tensor on ``device``, kept (a copy to a GPU costs a launch)."""
    if device.type == "cpu":
        return torch.from_numpy(a)
    key = (id(a), str(device))
    got = _DEVICE_COPIES.get(key)
    if got is None or got[0] is not a:
        if len(_DEVICE_COPIES) > 256:
            _DEVICE_COPIES.clear()
        got = _DEVICE_COPIES[key] = (a, torch.from_numpy(a).to(device))
    return got[1]


def stream_keys(ctx, segments: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each segment's uniform stream key (``uniforms.draw_key`` of ``ctx.generator(j, "cpu")``:
    a CPU generator on every device, so a GPU's encode draws the CPU's keys): in one compiled
    call where the kernels are loaded, else one ``random_`` of a reseeded CPU generator each."""
    seeds = [ctx._seed(j) for j in segments]
    k = kernels.for_encode()
    k0, k1 = np.empty(len(seeds), dtype=np.uint32), np.empty(len(seeds), dtype=np.uint32)
    if k is not None:
        k.stream_keys(np.array(seeds, dtype=np.int64), k0, k1)
        return k0, k1
    gen = torch.Generator()
    buf = torch.empty(2, dtype=torch.int64)
    for i, seed in enumerate(seeds):
        gen.manual_seed(seed)
        a, b = buf.random_(0, 1 << 32, generator=gen).tolist()
        k0[i], k1[i] = a, b
    return k0, k1


_RINT = 1.5 * 2.0 ** 52


def redo_rows(rows: Rows, bad: np.ndarray, fill_first: bool, op) -> list[tuple[np.ndarray, tuple]]:
    """``op(padded rows)`` for the rows ``bad`` (indices), grouped by width, each group's rows
    padded as the per-segment path pads a block: [(rows, op's result)]. For the rare rows whose
    reduction torch decides bit by bit (a zero's sign, a NaN's bits), so the bytes stay the
    per-segment path's."""
    out = []
    for w in np.unique(rows.widths[bad]).tolist():
        these = bad[rows.widths[bad] == w]
        padded, _ = rows.padded_rows(these, fill_first)
        out.append((these, op(padded)))
    return out


def qstats(rows: Rows, qbits: int, absolute: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row (every row, a segment's padding included), on the host: max |x| (fp32), and the
    exact integer sums of q = rint(x * 2**k) (k = qbits - exponent of the row's max |x|; 0 for a
    zero row or one not finite, whose sums are 0): s1 = sum q (``absolute``: sum |q|), s2 = sum
    q^2 (0 with ``absolute``) -- :func:`fedcomp.codecs.blockwise._qstats_torch`'s numbers, for all
    segments in one pass and one copy to the host. The sums are float64 segment sums of integers
    below 2**53 (q^2 in two 20-bit halves), so exact in any order."""
    x = rows.flat.x
    amax = rows.reduce(x.abs(), "max")
    ok = torch.isfinite(amax)
    ks = torch.where(ok & (amax > 0), qbits - torch.frexp(amax).exponent.long(), 0)
    pow2 = ((ks + 1023) << 52).view(torch.float64)
    q = x.to(torch.float64).mul_(rows.expand(pow2))
    q = torch.round(q) if q.device.type != "cpu" else q.add_(_RINT).sub_(_RINT)
    q = torch.where(rows.expand(ok), q, torch.zeros((), dtype=torch.float64, device=q.device))
    if absolute:
        s1 = rows.reduce(q.abs_(), "sum")
        stats = torch.stack([s1, torch.zeros_like(s1)])
    else:
        s1 = rows.reduce(q, "sum")
        sq = q.long()
        sq.mul_(sq)
        hi = sq >> 20
        lo = sq.bitwise_and_((1 << 20) - 1)
        stats = torch.stack([s1, rows.reduce(hi.to(torch.float64), "sum"), rows.reduce(lo.to(torch.float64), "sum")])
    host = torch.cat([amax.to(torch.float64)[None], ks.to(torch.float64)[None], stats]).cpu().numpy()  # one copy
    amax_np = host[0].astype(np.float32)  # exact (a NaN's bits: below)
    ks_np = host[1].astype(np.int64)
    s1_np = host[2].astype(np.int64)
    s2_np = np.zeros_like(s1_np) if absolute else (host[3].astype(np.int64) << 20) + host[4].astype(np.int64)
    nan = np.flatnonzero(np.isnan(amax_np) & rows._real_np)
    if nan.shape[0]:  # the NaN's bits as the padded row's amax gives them
        for these, got in redo_rows(rows, nan, False, lambda r: r.abs().amax(dim=1)):
            amax_np[these] = got.cpu().numpy()
    return amax_np, ks_np, s1_np, s2_np
