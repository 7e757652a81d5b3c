"""Helpers shared by the blockwise quantizers (kbit, qsgd, sign, twobit, terngrad).

Chunked encoding into preallocated streams, per-block parameters, exact block sums (TernGrad's
std, sign's scale) and the entropy-coded option of kbit / qsgd. ``_ENCODE_CHUNK`` and
``_STD_BLOCK`` are read at call time, so tests may shrink them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedcomp import kernels, uniforms
from fedcomp.base import block_size, blocks
from fedcomp.bitpack import pack_bits, packed_bytes, unpack_codes
from fedcomp.errors import DecodeError
from fedcomp.wire import Reader, Writer


CODINGS = ("packed", "ans")  # how kbit/qsgd codes travel: fixed width, or entropy coded (fedcomp.entropy)


ANS_MODES = 4  # the payload format from which an entropy-coded segment says how its codes travel


class _EntropyCoded:
    """Mixin of kbit and qsgd: ``coding="ans"`` re-codes the packed codes with range ANS, where
    that is smaller (:mod:`fedcomp.entropy`: a byte per segment says which, from payload format
    :data:`ANS_MODES` on; older payloads, every segment ANS, still decode: format 1, or 2 and 3
    where random-k or a sketch set the codec's version).

    The canonical spec (hence the codec fingerprint and every payload byte) of ``coding="packed"``
    is the one from before the option existed, and so is its payload format (1)."""

    @property
    def wire_version(self) -> int:  # type: ignore[override]
        return ANS_MODES if self.config.coding == "ans" else 1  # type: ignore[attr-defined]

    def canonical(self) -> str:
        text = super().canonical()  # type: ignore[misc]
        return text.replace(",coding='packed'", "")

    def _code_bits(self) -> int:
        return self.config.bits  # type: ignore[attr-defined]

    def nbytes(self, count: int) -> int:
        if self.config.coding == "ans" and count:  # type: ignore[attr-defined]
            raise ValueError(f"{self.canonical()} codes values to a data-dependent size; use len(payload)")
        return self._packed_nbytes(count)

    def _ans(self, run, x: torch.Tensor, out: Writer, gen):
        """Run the packed coder into a scratch writer, then send its codes entropy coded where
        that is smaller, else packed (a byte says which)."""
        from fedcomp import entropy

        tmp = Writer(x.device)
        y = run(x, tmp, gen)
        if x.numel() == 0:
            return y
        params, codes = tmp.parts
        out.tensor(params)
        bits = self._code_bits()
        stream = None
        if entropy.table_bytes(bits) < codes.numel():  # else the table alone outweighs the codes
            stream = entropy.ans_stream(unpack_codes(codes, x.numel(), bits), bits)
        if stream is not None and entropy.stream_bytes(*stream) < codes.numel():  # a tie goes packed
            out.u8(1)
            entropy.put_stream(*stream, out)
        else:
            out.u8(0)
            out.tensor(codes)
        return y

    def _read_codes(self, src: Reader, count: int, device: torch.device):
        """(lo, hi) -> uint8 codes of elements [lo, hi) (lo: a multiple of 8 elements). Packed
        codes stay packed until asked for; entropy-coded ones are decoded here, once."""
        bits = self._code_bits()
        if self.config.coding == "ans":  # type: ignore[attr-defined]
            from fedcomp.entropy import ans_read

            mode = src.u8() if src.version >= ANS_MODES else 1
            if mode == 0:
                return _packed_reader(src, count, bits, device)
            if mode != 1:
                raise DecodeError(f"entropy-coded segment says its codes travel as {mode}: 0 (packed) or 1 (ANS)")
            return _Codes(ans_read(src, count, bits).to(device), count, 8)
        return _packed_reader(src, count, bits, device)


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """View x as (blocks, block) with zero padding at the end (block 0: one row)."""
    if x.numel() == 0:
        return x.reshape(0, 0)
    block = block_size(x.numel(), block)
    return F.pad(x, (0, (-x.numel()) % block)).view(-1, block)


def _block_counts(count: int, block: int, device: torch.device) -> torch.Tensor:
    nb, size = blocks(count, block), block_size(count, block)
    sizes = torch.full((nb,), float(size), device=device)
    if nb and count % size:
        sizes[-1] = count % size
    return sizes


def _per_block_(y: torch.Tensor, block: int, mul: torch.Tensor | None, add: torch.Tensor | None = None) -> torch.Tensor:
    """In place: y[j] = y[j] * mul[b] (+ add[b]) for each element j of block b (block 0: one
    block). Broadcast per block instead of repeating the parameters to full length."""
    m = y.numel()
    size = block_size(m, block)
    full = (m // size) * size
    nfull = full // size
    head = y[:full].view(nfull, size)
    if mul is not None:
        head.mul_(mul[:nfull, None])
    if add is not None:
        head.add_(add[:nfull, None])
    if full < m:
        if mul is not None:
            y[full:].mul_(mul[nfull])
        if add is not None:
            y[full:].add_(add[nfull])
    return y


_ENCODE_CHUNK = 1 << 20  # elements per encode step of blockwise quantizers (4 MB of fp32)


def _chunked_encode(encode_one, x: torch.Tensor, out: Writer, key, block: int) -> torch.Tensor:
    """Encode ``x`` in block-aligned chunks of about 1M elements with ``encode_one(chunk, writer,
    key, start) -> decoded chunk``, which writes [per-block parameters, packed codes]; the payload
    holds all parameters, then all codes, exactly as one call over ``x`` would lay them out.
    ``key``: the segment's uniform stream (:mod:`fedcomp.uniforms`; None: deterministic rounding),
    ``start``: the chunk's first element's index, so the chunking does not change the bytes.

    Why: a full-size temporary is a fresh allocation, and on Linux every fresh 4 kB page of it
    faults on first touch (about 8x the cost of writing into reused memory); chunk-sized
    temporaries are reused by the allocator. Chunks hold a multiple of 8 blocks, so packed codes
    of any width end on a byte boundary.
    """
    m = x.numel()
    if block == 0 or m <= _ENCODE_CHUNK:
        return encode_one(x, out, key, 0)
    size = block_size(m, block)
    step = max(8, (_ENCODE_CHUNK // size) // 8 * 8) * size
    if m <= step:
        return encode_one(x, out, key, 0)
    y = torch.empty(m, dtype=torch.float32, device=x.device)
    params, codes = [], []
    for start in range(0, m, step):
        part = Writer(x.device)
        y[start:start + step] = encode_one(x[start:start + step], part, key, start)
        params.append(part.parts[0])
        codes.append(part.parts[1])
    out.parts.append(torch.cat(params))
    out.parts.append(torch.cat(codes))
    return y


def _chunk_step(m: int, block: int) -> int:
    """Elements per encode step: whole blocks, a multiple of 8 of them (codes of any width end on a
    byte boundary), about _ENCODE_CHUNK elements; ``m`` (one step) for block 0 or a small input.
    The same steps as :func:`_chunked_encode`."""
    if block == 0 or m <= _ENCODE_CHUNK:
        return max(m, 1)
    size = block_size(m, block)
    return min(m, max(8, (_ENCODE_CHUNK // size) // 8 * 8) * size)


def _pack_into(q: torch.Tensor, bits: int, dst: torch.Tensor) -> None:
    """pack_bits(q, bits) written into ``dst`` (uint8 codes < 2**bits in q); the same bytes."""
    if q.dtype == torch.bool:
        q = q.view(torch.uint8)
    if bits == 8:
        dst.copy_(q)
        return
    if 8 % bits or q.numel() % (8 // bits) or (bits == 1 and q.device.type == "cpu"):
        dst.copy_(pack_bits(q, bits))
        return
    per = 8 // bits
    v = q.view(-1, per)
    torch.bitwise_left_shift(v[:, 0], 8 - bits, out=dst)
    for j in range(1, per):
        shift = 8 - bits * (j + 1)
        dst.bitwise_or_(v[:, j] << shift if shift else v[:, j])


def _encode_kernels(x: torch.Tensor):
    """The CPU kernels for encoding ``x`` (contiguous fp32 on the CPU), or None (torch path)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad or not x.is_contiguous():
        return None
    return kernels.for_encode()


class _BlockWriter:
    """Blockwise quantizer output, written chunk by chunk into two preallocated streams
    (per-block parameters, then packed codes) with reused chunk-sized scratch buffers."""

    def __init__(self, m: int, block: int, params_per_block: int, bits: int, out: Writer, device: torch.device) -> None:
        self.m, self.bits = m, bits
        self.size = block_size(m, block)
        self.step = _chunk_step(m, block)
        self.params = out.empty((blocks(m, block), params_per_block), torch.float32, device)
        self.codes = out.empty(packed_bytes(m, bits), torch.uint8, device)
        self._room = self.step + (-self.step) % self.size  # scratch for the padded last block
        self._f32: torch.Tensor | None = None  # torch path scratch, made on first use
        self._u8: torch.Tensor | None = None
        self._u: torch.Tensor | None = None
        self._work: torch.Tensor | None = None

    @property
    def f32(self) -> torch.Tensor:
        if self._f32 is None:
            self._f32 = torch.empty(self._room, dtype=torch.float32, device=self.codes.device)
        return self._f32

    @property
    def u8(self) -> torch.Tensor:
        if self._u8 is None:
            self._u8 = torch.empty(self._room, dtype=torch.uint8, device=self.codes.device)
        return self._u8

    def chunks(self):
        """(start, stop, first block, stop block) of each step."""
        for start in range(0, self.m, self.step):
            stop = min(self.m, start + self.step)
            yield start, stop, start // self.size, -(-stop // self.size)

    def uniform(self, key: tuple[int, int], start: int, n: int) -> torch.Tensor:
        """u_start .. u_(start + n - 1) of the stream ``key`` (stochastic rounding, torch path) in
        reused buffers."""
        if self._u is None:
            self._u = torch.empty(self.f32.numel(), dtype=torch.float32, device=self.f32.device)
            self._work = torch.empty(2 * self.f32.numel(), dtype=torch.int32, device=self.f32.device)
        return uniforms.fill(key, start, self._u[:n], self._work)

    def put_host_codes(self, start: int, codes: np.ndarray, k) -> None:
        """Pack uint8 codes (a CPU kernel's) into the code stream at element ``start``."""
        lo = start * self.bits // 8
        k.pack(codes, codes.shape[0], self.bits, self.host_codes[lo:lo + packed_bytes(codes.shape[0], self.bits)])

    @property
    def host_codes(self) -> np.ndarray:
        """The code stream as numpy (CPU only: a kernel's output)."""
        if not hasattr(self, "_host_codes"):
            self._host_codes = self.codes.numpy()
        return self._host_codes

    def put_codes(self, start: int, q: torch.Tensor) -> None:
        lo = start * self.bits // 8
        _pack_into(q, self.bits, self.codes[lo:lo + packed_bytes(q.numel(), self.bits)])

    def write(self, out: Writer) -> None:
        out.tensor(self.params)
        out.tensor(self.codes)


def _padded_rows(x: torch.Tensor, size: int, fill_first: bool) -> torch.Tensor:
    """x as (blocks, size); a partial last block is padded (zeros, or its first value)."""
    pad = (-x.numel()) % size
    if not pad:
        return x.view(-1, size)
    rows = F.pad(x, (0, pad)).view(-1, size)
    if fill_first:
        rows[-1, size - pad:] = rows[-1, 0]
    return rows


class _Codes:
    """uint8 codes of a segment: ``codes(lo, hi)`` as a tensor on the device, ``codes.host(lo,
    hi)`` as a numpy array (CPU kernels), for lo * bits a multiple of 8. Packed codes (``bits`` <
    8 or a payload view) stay packed until asked for."""

    def __init__(self, data: torch.Tensor, count: int, bits: int) -> None:
        self.data, self.count, self.bits = data, count, bits
        self._np = None

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        if self.bits == 8:
            return self.data[lo:hi]
        a = lo * self.bits // 8
        return unpack_codes(self.data[a:a + packed_bytes(hi - lo, self.bits)], hi - lo, self.bits)

    def host(self, lo: int, hi: int, k) -> np.ndarray:
        if self._np is None:
            self._np = self.data.numpy()
        if self.bits == 8:
            return self._np[lo:hi]
        buf = kernels.scratch(hi - lo, np.uint8)  # consumed by the caller's next kernel call
        a = lo * self.bits // 8
        k.unpack(self._np[a:a + packed_bytes(hi - lo, self.bits)], hi - lo, self.bits, buf)
        return buf


def _packed_reader(src: Reader, count: int, bits: int, device: torch.device) -> "_Codes":
    """The codes of elements of a packed stream (:class:`_Codes`); reads (and length-checks) the
    stream now, unpacks on demand."""
    data = src.take(packed_bytes(count, bits))
    if bits == 8:  # the codes are the bytes: copied to the device once (a view on the CPU)
        return _Codes(data.to(device), count, 8)
    return _Codes(data if device.type == "cpu" else data.to(device), count, bits)


def _block_unit(count: int, block: int) -> int:
    """Elements of 8 whole blocks: ranges starting at a multiple of it start a block, and their
    packed codes of any width start on a byte."""
    return 8 * block_size(count, block) if block else 8


def _uniform(key: tuple[int, int], start: int, n: int, device: torch.device) -> torch.Tensor:
    """u_start .. u_(start + n - 1) of the stream ``key`` (a fresh fp32 tensor)."""
    return uniforms.fill(key, start, torch.empty(n, dtype=torch.float32, device=device))


def _key32(key: tuple[int, int] | None) -> tuple[np.uint32, np.uint32]:
    """A stream's key as the kernels take it (uint32 scalars; zeros for no stream)."""
    return (np.uint32(0), np.uint32(0)) if key is None else (np.uint32(key[0]), np.uint32(key[1]))


# -- exact block sums (TernGrad's std, sign's scale): the same numbers from the fused loop and torch ops
_STD_BLOCK = 1 << 16  # elements per exact partial sum (TernGrad's std, sign's scale)
_STD_QBITS = 20  # |q| <= 2**20 per block: q^2 sums of 8192 stay exact in float64
_SIGN_QBITS = 30  # sign's mean |x|: sums of |q| <= 2**30 (8192 of them below 2**53: exact in float64)
_RINT = 1.5 * 2.0 ** 52  # x + _RINT - _RINT: x rounded to an integer (ties to even) for |x| < 2**51


def _shifted_sum(sums, ks, top: int, power: int) -> int:
    """sum over blocks of sums[b] * 2**(power * (top - ks[b])): per-block integer sums of q^power
    (q = rint(x * 2**ks[b])) brought to one grid 2**-top, exactly (Python integers).

    Many blocks: those that share a k (most of a tensor's) are added in numpy first, each int64
    split into its high and low 32 bits, whose sums fit int64 below 2**31 blocks (a 25M tensor's
    382 blocks: ~0.3 ms of Python integers a sum before)."""
    if len(sums) <= 16:
        return sum(int(v) << power * (top - int(k)) for v, k in zip(sums, ks))
    s, k = np.asarray(sums, dtype=np.int64), np.asarray(ks, dtype=np.int64)
    total = 0
    for kb in np.unique(k).tolist():
        part = s[k == kb]
        total += ((int((part >> 32).sum()) << 32) + int((part & 0xFFFFFFFF).sum())) << power * (top - kb)
    return total


def _row_range(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of each row, with the bits ``torch.aminmax`` gives (kbit's range; the one-by-one
    encode's ``min``/``max`` agree). On the CPU ``aminmax`` over rows is much slower than
    ``amin`` and ``amax`` apart, which may return either zero of a row holding +0 and -0 and a
    canonical NaN: rows whose min or max is a zero or NaN are taken again by ``aminmax``."""
    if rows.device.type != "cpu":
        return torch.aminmax(rows, dim=1)
    lo, hi = rows.amin(dim=1), rows.amax(dim=1)
    redo = (lo == 0) | (hi == 0) | torch.isnan(lo)  # a NaN in a row: amin and amax are both NaN
    if bool(redo.any()):
        lo[redo], hi[redo] = torch.aminmax(rows[redo], dim=1)
    return lo, hi


def _qstats_torch(x: torch.Tensor, width: int, qbits: int, sums: bool, absolute: bool = False):
    """Per row of ``width`` elements of x (the last one zero padded, which changes neither max |x|
    nor the sums), in torch ops (any device), the numbers of the fused loop
    (``fedcomp._kernels._block_qsums``): numpy arrays (amax fp32, ks, s1, s2) with, for ``sums``,
    the exact integer sums of q = rint(x * 2**ks) (ks = qbits - exponent of the row's max |x|,
    0 for a zero row): s1 = sum q, s2 = sum q^2, or s1 = sum |q|, s2 = 0 (``absolute``). A row
    with a value not finite: amax inf or NaN, ks = s1 = s2 = 0."""
    m, group = x.numel(), max(1, _ENCODE_CHUNK // width) * width
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    for lo in range(0, m, group):
        rows = _padded_rows(x[lo:lo + group], width, fill_first=False)
        amax = rows.abs().amax(dim=1)
        parts[0].append(amax)
        if not sums:
            continue
        ok = torch.isfinite(amax)
        ks = torch.where(ok & (amax > 0), qbits - torch.frexp(amax).exponent.long(), 0)
        pow2 = ((ks + 1023) << 52).view(torch.float64)  # 2**ks from its bits: exact on any device
        q = rows.to(torch.float64, copy=True).mul_(pow2[:, None])  # exact: a power-of-2 scale in float64
        # to the nearest integer, ties to even: torch.round on the CPU (~3 ns a value) or, there,
        # the same integers by adding and taking away 1.5 * 2**52 (exact for |q| <= 2**qbits < 2**51)
        q = torch.round(q) if q.device.type != "cpu" else q.add_(_RINT).sub_(_RINT)
        q = q.masked_fill_(~ok[:, None], 0).long()
        parts[1].append(ks)
        if absolute:
            parts[2].append(q.abs_().sum(dim=1))
            parts[3].append(torch.zeros_like(ks))
        else:
            parts[2].append(q.sum(dim=1))
            parts[3].append((q * q).sum(dim=1))
    if not sums:
        parts[1:] = [[torch.zeros(0, dtype=torch.long)]] * 3
    return tuple(torch.cat(p).cpu().numpy() for p in parts)
