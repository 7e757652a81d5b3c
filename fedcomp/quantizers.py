"""Quantizers: how the values that travel are coded. Each works on a 1-D float32 vector.

Per-block parameters (scales, minima, norms) are fp32 and precede the packed codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedcomp import kernels, uniforms
from fedcomp.base import Knob, Quantizer, block_size, blocks, register
from fedcomp.bitpack import pack_bits, packed_bytes, unpack_bits, unpack_codes, unpack_flags
from fedcomp.errors import DecodeError
from fedcomp.wire import CHECKSUM_MISMATCH, HEADER_BYTES, TRAILER_BYTES, Reader, Writer, carving, crc32, output_empty

_FP16_MAX = 65504.0
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


class Values:
    """A segment's decoded values, read and checked but not yet dequantized (what
    :func:`read_values` returns): :meth:`chunk` builds any range on demand, so a server can add a
    reply to its sum chunk by chunk without a dense copy of it (:mod:`fedcomp.aggregate`).

    ``build(lo, hi)`` returns the fp32 values of elements [lo, hi) for ``lo`` a multiple of
    ``unit`` and ``hi`` a multiple of ``unit`` or the count; every value has the bits it has in
    :meth:`dense`, which is what the quantizer's ``decode`` returns (elementwise arithmetic only).
    """

    def __init__(self, count: int, unit: int, build, device: torch.device, add=None, sq=None, into=None) -> None:
        self.numel = count
        self.unit = max(1, unit)
        self._build = build
        self.device = torch.device(device)
        # fused CPU loops (fedcomp.kernels), any lo: add (lo, hi, float64 numpy sum slice, weight);
        # sq (lo, hi) -> float64 sum of squares; into (lo, hi, fp32 numpy out), lo a multiple of unit
        self._add, self._sq, self._into = add, sq, into

    def sq(self, lo: int, hi: int) -> float | None:
        """Sum of squares (float64) of values [lo, hi) without building them in fresh memory, where
        a fused loop can (None otherwise): inf or NaN exactly when a value is."""
        return None if self._sq is None else self._sq(lo, hi)

    def add_to(self, lo: int, hi: int, target: torch.Tensor, weight: float) -> bool:
        """``target += weight * values[lo:hi]`` (target: a float64 CPU tensor of ``hi - lo``) in one
        fused loop (:mod:`fedcomp.kernels`), the same bits as adding :meth:`chunk`'s values with
        ``add_(alpha=weight)`` for integer weights below 2**29; False (nothing done) where there is
        no such loop (no numba, another device or dtype)."""
        if self._add is None or target.dtype != torch.float64 or target.device.type != "cpu":
            return False
        self._add(lo, hi, target.numpy(), float(weight))
        return True

    def adder(self):
        """The fused add as ``f(lo, hi, s, w)`` (``s``: a float64 numpy slice of ``hi - lo``), for a
        caller that adds many short ranges (:class:`fedcomp.aggregate.Accumulator`'s batched
        pass); None where there is no such loop."""
        return self._add if self._add is not None and self.device.type == "cpu" else None

    @classmethod
    def of(cls, values: torch.Tensor) -> "Values":
        """Values already dequantized (quantizers without a chunked reader)."""
        flat = values.reshape(-1)
        return cls(flat.numel(), 1, lambda lo, hi: flat[lo:hi], flat.device)

    def chunk(self, lo: int, hi: int) -> torch.Tensor:
        """fp32 values of elements [lo, hi) (read-only: it may be a view)."""
        a = lo - lo % self.unit
        b = min(self.numel, -(-hi // self.unit) * self.unit)
        y = self._build(a, b)
        return y if (a, b) == (lo, hi) else y[lo - a:hi - a]

    def step(self) -> int:
        """A whole number of units of about _ENCODE_CHUNK elements."""
        return max(1, _ENCODE_CHUNK // self.unit) * self.unit

    def dense(self) -> torch.Tensor:
        """Every value, one fp32 tensor (built chunk by chunk: temporaries stay chunk-sized)."""
        m = self.numel
        cpu = self.device.type == "cpu"
        if m <= self.step() and not (m and cpu and carving()):  # (in an open arena: built into its buffer)
            return self._build(0, m) if m else torch.empty(0, device=self.device)
        # on the CPU in huge pages where large (wire.output_empty): a fresh 100 MB torch tensor faults 25,600 4 kB pages
        y = output_empty(m) if cpu else torch.empty(m, device=self.device)
        for lo in range(0, m, self.step()):
            hi = min(m, lo + self.step())
            if self._into is not None:
                self._into(lo, hi, y[lo:hi].numpy())
            else:
                y[lo:hi] = self._build(lo, hi)
        return y


def _ternary_kernels(device: torch.device, *, load: bool = True):
    """The kernels for a ternary read on ``device`` (CPU only; else None): loaded where need be
    (``load``: a server's read), or only where loaded already or asked for
    (:func:`fedcomp.kernels.for_encode`): a fresh ClientApp process decoding its own payload for
    error feedback keeps the torch ops (numba's import ~1.7 s)."""
    if device.type != "cpu":
        return None
    return kernels.get() if load else kernels.for_encode()


def _ternary(src: Reader, count: int, device: torch.device, bad: int, message: str, table: list) -> Values:
    """Values of a 2-bit code with one unused code (twobit, terngrad; CPU kernels): the codes are
    checked now, and each value is ``table[code]`` in fp32, built chunk by chunk. Without kernels
    the quantizers decode whole (their torch paths)."""
    k = kernels.get()
    data = src.take(packed_bytes(count, 2))
    raw = data.numpy()
    if k.count_codes2(raw, count)[bad]:
        raise DecodeError(message)
    codes, values = _Codes(data, count, 2), np.array(table, dtype=np.float32)
    squares = values.astype(np.float64) ** 2

    def run(a, b, i0, i1, out, s, w, add):
        k.table2(codes.host(a, b, k), values, i0, i1, out, s, w, add)

    def sq(a, b, i0, i1):  # a value per code: how many of each code x its square
        counts = k.count_codes2(raw[a // 4:], i1) - k.count_codes2(raw[a // 4:], i0)  # a: a whole byte
        return float(np.dot(counts.astype(np.float64), squares))
    return _fused(count, 4, device, run, sq)


def read_values(quantizer: Quantizer, src: Reader, count: int, device: torch.device) -> Values:
    """Read and check ``count`` coded values from ``src`` without dequantizing them, where the
    quantizer can (its ``read_values`` method: the codes stay packed, as views of the payload);
    otherwise through ``decode``. ``read_values(...).dense()`` equals ``quantizer.decode(...)``."""
    read = getattr(quantizer, "read_values", None)
    if read is not None:
        return read(src, count, device)
    return Values.of(quantizer.decode(src, count, device))


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


_NO32 = np.empty(0, dtype=np.float32)
_NO64 = np.empty(0, dtype=np.float64)


def _fused(count: int, unit: int, device: torch.device, run, sq_run=None) -> Values:
    """:class:`Values` whose every path is a kernel call ``run(a, b, i0, i1, out, s, w, add)`` over
    elements [a + i0, a + i1), ``a`` a multiple of ``unit`` (CPU only); ``sq_run(a, b, i0, i1)``,
    where given, returns their sum of squares without building them."""
    k = kernels.get()

    def into(lo: int, hi: int, out: np.ndarray) -> None:
        run(lo, hi, 0, hi - lo, out, _NO64, 0.0, False)

    def build(lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=torch.float32)
        into(lo, hi, out.numpy())
        return out

    def add(lo: int, hi: int, s: np.ndarray, w: float) -> None:
        a = lo - lo % unit
        run(a, hi, lo - a, hi - a, _NO32, s, w, True)

    def sq(lo: int, hi: int) -> float:
        a = lo - lo % unit
        if sq_run is not None:
            return float(sq_run(a, hi, lo - a, hi - a))
        buf = kernels.scratch(hi - a, np.float32)
        into(a, hi, buf)
        return float(k.sumsq(buf[lo - a:]))
    return Values(count, unit, build, device, add, sq, into)


def _block_unit(count: int, block: int) -> int:
    """Elements of 8 whole blocks: ranges starting at a multiple of it start a block, and their
    packed codes of any width start on a byte."""
    return 8 * block_size(count, block) if block else 8


def runs(quantizer: Quantizer, k) -> bool:
    """Whether ``quantizer`` writes runs of segments (:func:`write_run`) with the kernels ``k``
    (None: no kernels)."""
    return k is not None and getattr(quantizer, "_run", None) is not None and getattr(quantizer, "runs", lambda: True)()


def write_run(quantizer: Quantizer, xs: list[torch.Tensor], out: Writer, gen) -> None:
    """Write segments ``xs`` (contiguous fp32 CPU tensors of any shape, none empty) in one compiled call: the
    bytes of ``write_values`` on each in turn. ``gen(i)`` gives segment i's generator (seeded only
    where the quantizer draws from it; valid until the next ``gen`` call).

    Why: writing one segment costs ~100 us of Python beside its loops (buffers, views, calls);
    a ResNet-50 has 161 tensors, 119 of them below 65,536 elements: ~16 ms a round, about two
    read passes of its 25.6M values. A segment the kernel refuses (a value not finite, ...) is
    written the one-by-one way into its place."""
    k = kernels.for_encode()
    sizes = np.fromiter((quantizer.nbytes(x.numel()) for x in xs), dtype=np.int64, count=len(xs))
    offs = np.zeros(len(xs), dtype=np.int64)
    np.cumsum(sizes[:-1], out=offs[1:])
    place = out.empty(int(sizes.sum()), torch.uint8)
    region = place.numpy()
    ptrs = np.fromiter((x.data_ptr() for x in xs), dtype=np.int64, count=len(xs))
    ns = np.fromiter((x.numel() for x in xs), dtype=np.int64, count=len(xs))
    ok = np.zeros(len(xs), dtype=np.bool_)
    crc = out.crc_before(place) if getattr(quantizer, "_run_crc", None) is not None else None
    fn = None if crc is None else kernels.crc32_function()
    if fn is not None:  # the payload's CRC continued over each part as it is written, from cache
        crc = quantizer._run_crc(k, xs, gen, ptrs, ns, offs, region, ok, fn, crc)
    else:
        quantizer._run(k, xs, gen, ptrs, ns, offs, region, ok)
    for i in np.flatnonzero(~ok).tolist():
        alone = Writer(xs[i].device)
        write_values(quantizer, xs[i].reshape(-1), alone, gen(i))
        region[offs[i]:offs[i] + sizes[i]] = np.frombuffer(alone.body(), dtype=np.uint8)
    if fn is not None and ok.all():
        out.checksummed(place, crc)
    out.tensor(place)


class RunReply:
    """A reply's dense segments read at once (:meth:`fedcomp.Codec.read_run`), for the server's
    check (:meth:`sq`) and add (the quantizer's ``_add_runs``) in one compiled call each, where
    the per-segment path (:class:`Values`) costs ~80 us of Python per segment and reply.

    The codes stay in the payload (``body``, numpy: a view); each segment's parameters are copied
    out, aligned: ``params`` (a 2-D float32 array: a row per kind of parameter, a column per
    block, segment s's from block ``p0[s]``; twobit / terngrad: a row of code values per segment);
    its codes at ``body[coffs[s]:]``. ``read``: (codec, payload, layout, device) to
    read it the per-segment way where a caller needs that (:meth:`fedcomp.aggregate.Update.pieces`)."""

    def __init__(self, quantizer, body: np.ndarray, ns: np.ndarray, coffs: np.ndarray, params: np.ndarray, p0: np.ndarray,
                 read: tuple) -> None:
        self.quantizer, self.body, self.ns, self.coffs, self.params, self.p0 = quantizer, body, ns, coffs, params, p0
        self.read = read
        self.address = body.ctypes.data
        # per segment 0, or 1 / 2: a model's fp16 / bf16 tensor (set_halves)
        self.halves = np.zeros(ns.shape[0], dtype=np.int64)

    sums: tuple[int, np.ndarray] | None = None  # (chunk, sq(chunk)) computed while reading (Codec.read_run)

    def set_halves(self, halves: np.ndarray) -> None:
        """Mark the segments that are a model's fp16 (1) or bf16 (2) tensor (0: fp32 or float64):
        their values are checked and added rounded to that dtype, as the per-segment path's
        ``.to(dtype)`` rounds them: by the kernels value by value, or here once per table of values
        (quantizers with ``_round_tables``: sign's scales, the 2-bit codes' four values)."""
        self.halves = halves
        round_tables = getattr(self.quantizer, "_round_tables", None)
        if round_tables is not None and halves.any():
            round_tables(self, halves)

    def sq(self, chunk: int) -> np.ndarray:
        """Per segment, the sum of squares of its values (float64; inf or NaN where one is not
        finite), ``chunk`` elements at a time from the segment's start (the per-segment sums)."""
        if self.sums is not None and self.sums[0] == chunk:
            return self.sums[1]
        return self.quantizer._run_sq(kernels.get(), self, chunk)


HALF_CODES = {torch.float16: 1, torch.bfloat16: 2}  # RunReply.halves' codes of a model's half tensors


def _round_by(values: np.ndarray, halves: np.ndarray) -> None:
    """Round fp32 ``values`` in place to fp16 where ``halves`` (broadcast to them) is 1, to bf16
    where it is 2 (torch's conversions); the rest stay."""
    halves = np.broadcast_to(halves, values.shape)
    for dtype, code in HALF_CODES.items():
        at = halves == code
        if at.any():
            values[at] = torch.from_numpy(values[at]).to(dtype).float().numpy()


def _run_scratch(chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """fp32 and uint16 scratch of ``chunk`` elements (a half segment's values and their bits)."""
    return kernels.scratch(chunk, np.float32), kernels.scratch(chunk, np.uint16)


def _block_params(body: np.ndarray, offs: np.ndarray, nb: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray]:
    """The fp32 parameters (``per`` per block, nb[s] blocks at offs[s]) of every segment, copied
    out and aligned, and p0 (segment s's first block)."""
    p0 = np.zeros(nb.shape[0] + 1, dtype=np.int64)
    np.cumsum(nb, out=p0[1:])
    params = np.empty(per * int(p0[-1]), dtype=np.float32)
    kernels.get().gather(body, offs, 4 * per * nb, params.view(np.uint8))
    return params, p0


class _BlockRuns:
    """Reading runs of blockwise codes (kbit, qsgd, sign): per segment ``_run_per`` fp32 parameters
    per block of ``_run_block`` elements, then codes of ``_run_bits`` bits; ``_run_kind`` names
    the per-block values in the kernels (``_numba_kernels.BLOCK_KBIT``, ...)."""

    _run_block_field = "block"  # the config field of elements per block (qsgd's is "bucket")

    @property
    def _run_block(self) -> int:
        return getattr(self.config, self._run_block_field)

    @property
    def _run_bits(self) -> int:
        return self.config.bits

    def read_run(self, body: np.ndarray, ns: np.ndarray, offs: np.ndarray, read: tuple) -> RunReply:
        block, per = self._run_block, self._run_per
        nb = np.fromiter((blocks(n, block) for n in ns.tolist()), dtype=np.int64, count=ns.shape[0])
        params, p0 = _block_params(body, offs, nb, per)
        rows = self._run_rows(np.ascontiguousarray(params.reshape(-1, per).T))
        return RunReply(self, body, ns, offs + 4 * per * nb, rows, p0, read)

    def _run_rows(self, rows: np.ndarray) -> np.ndarray:
        """The parameter rows as the kernels take them (as read, by default)."""
        return rows

    def _run_scratch(self, chunk: int, ns: np.ndarray) -> np.ndarray:
        """Codes of a chunk read from the start of its aligned unit (``_numba_kernels._geometry``:
        8 blocks where a segment has several, else 8 codes). (Sized by the block alone, a block
        larger than any tensor asked for block * 8 bytes: 745 GB for block=1e11.)"""
        block = self._run_block
        several = block > 0 and bool((ns > block).any())
        return kernels.scratch(chunk + 8 * (block if several else 1), np.uint8)

    def _run_sq(self, k, run: RunReply, chunk: int) -> np.ndarray:
        out = np.empty(run.ns.shape[0], dtype=np.float64)
        bits = self._run_bits
        k.block_sq_run(getattr(k, self._run_kind), run.body, run.coffs, run.ns, run.p0, run.params, self._run_block,
                       bits, (1 << bits) - 1, chunk, self._run_scratch(chunk, run.ns), run.halves,
                       *_run_scratch(chunk), out)
        return out

    def _values_run(self, k, run: RunReply, outs: np.ndarray, chunk: int) -> None:
        """A dense decode of ``run``: segment s's fp32 values into ``run.ns[s]`` at address outs[s]."""
        k.block_values_run(getattr(k, self._run_kind), run.body, run.coffs, run.ns, run.p0, run.params, self._run_block,
                           self._run_bits, outs, chunk, self._run_scratch(chunk, run.ns))

    def _add_runs(self, k, runs: list[RunReply], w: np.ndarray, sums: np.ndarray, chunk: int) -> None:
        """Add replies ``runs`` (weights ``w``) into the float64 sums at addresses ``sums``."""
        first = runs[0]
        k.block_add_runs(getattr(k, self._run_kind), np.array([r.address for r in runs], dtype=np.int64), first.coffs,
                         first.ns, first.p0, np.stack([r.params for r in runs]), self._run_block, self._run_bits, sums,
                         w, chunk, self._run_scratch(chunk, first.ns), first.halves)


class _RawRuns:
    """Reading runs of raw values (none(): fp32, fp16, bf16); ``_raw_kind`` 0, 1 or 2."""

    _raw_kind = 0

    def read_run(self, body: np.ndarray, ns: np.ndarray, offs: np.ndarray, read: tuple) -> RunReply:
        return RunReply(self, body, ns, offs, np.empty((0, 0), dtype=np.float32), np.zeros(ns.shape[0] + 1, dtype=np.int64),
                        read)

    def _run_sq(self, k, run: RunReply, chunk: int) -> np.ndarray:
        out = np.empty(run.ns.shape[0], dtype=np.float64)
        k.raw_sq_run(run.body, run.coffs, run.ns, self._raw_kind, chunk, run.halves, *_run_scratch(chunk), out)
        return out

    def crc_sq(self, run: RunReply, chunk: int, fn: int, payload: bytes) -> None:
        """Verify the payload's CRC32 and compute ``run.sq(chunk)`` in one read of the values
        (``_numba_kernels.raw_crc_sq_run``: each part summed, then checksummed from cache; ``fn``:
        :func:`fedcomp.kernels.crc32_function`); :class:`DecodeError` on a checksum mismatch.
        The header and what follows the values (integer tensors) are checksummed here."""
        view = memoryview(payload).cast("B")
        out = np.empty(run.ns.shape[0], dtype=np.float64)
        crc, end = kernels.get().raw_crc_sq_run(run.body, run.coffs, run.ns, self._raw_kind, chunk, fn,
                                                np.uint32(crc32(view[:HEADER_BYTES])), run.halves,
                                                *_run_scratch(chunk), out)
        crc = crc32(view[HEADER_BYTES + end:-TRAILER_BYTES], int(crc))
        if crc != int.from_bytes(view[-TRAILER_BYTES:], "little"):
            raise DecodeError(CHECKSUM_MISMATCH)
        run.sums = (chunk, out)

    def _values_run(self, k, run: RunReply, outs: np.ndarray, chunk: int) -> None:
        k.raw_values_run(run.body, run.coffs, run.ns, self._raw_kind, outs)

    def _add_runs(self, k, runs: list[RunReply], w: np.ndarray, sums: np.ndarray, chunk: int) -> None:
        k.raw_add_runs(np.array([r.address for r in runs], dtype=np.int64), runs[0].coffs, runs[0].ns, self._raw_kind,
                       sums, w, chunk, runs[0].halves, _run_scratch(chunk)[0])


class _TernaryRuns:
    """Reading runs of 2-bit codes with one unused code (twobit, terngrad): ``_bad`` the unused
    code and its message; ``_tables(body, ns, offs)`` -> (code offsets, fp32 value per code per
    segment)."""

    def read_run(self, body: np.ndarray, ns: np.ndarray, offs: np.ndarray, read: tuple) -> RunReply:
        coffs, table = self._tables(body, ns, offs)
        bad, message = self._bad
        if kernels.get().ternary_bad_run(body, coffs, ns, bad) >= 0:
            raise DecodeError(message)
        return RunReply(self, body, ns, coffs, table, np.zeros(ns.shape[0] + 1, dtype=np.int64), read)

    def _run_sq(self, k, run: RunReply, chunk: int) -> np.ndarray:
        out = np.empty(run.ns.shape[0], dtype=np.float64)
        k.ternary_sq_run(run.body, run.coffs, run.ns, run.params, chunk, out)
        return out

    def _round_tables(self, run: RunReply, halves: np.ndarray) -> None:
        """Every value is one of its segment's four: a half segment's row rounded once."""
        _round_by(run.params, halves[:, None])

    def _values_run(self, k, run: RunReply, outs: np.ndarray, chunk: int) -> None:
        k.ternary_values_run(run.body, run.coffs, run.ns, run.params, outs, chunk, kernels.scratch(chunk + 4, np.uint8))

    def _add_runs(self, k, runs: list[RunReply], w: np.ndarray, sums: np.ndarray, chunk: int) -> None:
        k.ternary_add_runs(np.array([r.address for r in runs], dtype=np.int64), runs[0].coffs, runs[0].ns,
                           np.stack([r.params for r in runs]), sums, w, chunk, kernels.scratch(chunk + 4, np.uint8))


class _ChecksummedRun:
    """Quantizers whose :func:`write_run` loop continues the payload's CRC32 as it writes where it
    is given a CRC function (``_run_crc``; ``fn`` 0: none): ``_run`` is that loop without one."""

    def _run(self, k, xs, gen, ptrs, ns, offs, region, ok) -> None:
        self._run_crc(k, xs, gen, ptrs, ns, offs, region, ok, 0, 0)


def _stream_keys(k, gen, xs: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Every segment's stream key (``uniforms.draw_key(gen(i))``) as the kernels take them: in one
    compiled call where ``gen`` is a CPU :class:`fedcomp.base.Reseeded` (the same keys), else drawn
    one by one."""
    seeds = getattr(gen, "seeds", None)
    if seeds is not None and gen.device.type == "cpu":
        k0s, k1s = np.empty(len(xs), dtype=np.uint32), np.empty(len(xs), dtype=np.uint32)
        k.stream_keys(np.array(seeds, dtype=np.int64), k0s, k1s)
        return k0s, k1s
    return _run_keys([uniforms.draw_key(gen(i), x.device) for i, x in enumerate(xs)])


def _run_keys(keys: list) -> tuple[np.ndarray, np.ndarray]:
    """Per-segment stream keys (None: no stream) as the kernels take them."""
    k0 = np.fromiter((0 if key is None else key[0] for key in keys), dtype=np.uint32, count=len(keys))
    k1 = np.fromiter((0 if key is None else key[1] for key in keys), dtype=np.uint32, count=len(keys))
    return k0, k1


def write_values(quantizer: Quantizer, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
    """Write the code of ``x`` without building the reconstruction, where the quantizer can
    (its ``write`` method); otherwise through ``encode``. The bytes are the same either way."""
    write = getattr(quantizer, "write", None)
    if write is not None:
        write(x, out, gen)
    else:
        quantizer.encode(x, out, gen)


def _uniform(key: tuple[int, int], start: int, n: int, device: torch.device) -> torch.Tensor:
    """u_start .. u_(start + n - 1) of the stream ``key`` (a fresh fp32 tensor)."""
    return uniforms.fill(key, start, torch.empty(n, dtype=torch.float32, device=device))


def _key32(key: tuple[int, int] | None) -> tuple[np.uint32, np.uint32]:
    """A stream's key as the kernels take it (uint32 scalars; zeros for no stream)."""
    return (np.uint32(0), np.uint32(0)) if key is None else (np.uint32(key[0]), np.uint32(key[1]))


@register
class Identity(_RawRuns, Quantizer):
    """Plain fp32 values (lossless)."""

    name = "none"
    unbiased = True

    @dataclass(frozen=True)
    class Config:
        pass

    def nbytes(self, count: int) -> int:
        return 4 * count

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        out.tensor(x)
        return x

    def _run(self, k, xs, gen, ptrs, ns, offs, region, ok) -> None:
        """:func:`write_run`'s copies: numpy's (memcpy: ~1.4x faster than a compiled loop)."""
        for x, o, n in zip(xs, offs.tolist(), ns.tolist()):
            region[o:o + 4 * n].view(np.float32)[:] = x.numpy().reshape(-1)
        ok[:] = True

    def _run_crc(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int, crc: int) -> int:
        """:meth:`_run` continuing the payload's CRC32 ``crc`` over what it copies, each part as
        it is read (:func:`fedcomp._numba_kernels.raw_run_crc`); returns the CRC."""
        crc = k.raw_run_crc(ptrs, ns, offs, region, fn, np.uint32(crc))
        ok[:] = True
        return int(crc)

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        return src.tensor(count, torch.float32, output=True).to(device)

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        data = src.take(4 * count)  # a view of the payload: copied chunk by chunk
        if device.type == "cpu" and (k := kernels.get()) is not None:
            raw = data.numpy()

            def add(lo: int, hi: int, s: np.ndarray, w: float) -> None:
                k.add_f32(raw[4 * lo:4 * hi].view(np.float32), s, w)

            def sq(lo: int, hi: int) -> float:  # read in place
                return float(k.sumsq(raw[4 * lo:4 * hi].view(np.float32)))
            return Values(count, 1, lambda lo, hi: data[4 * lo:4 * hi].clone().view(torch.float32), device, add, sq)
        return Values(count, 1, lambda lo, hi: data[4 * lo:4 * hi].clone().view(torch.float32).to(device), device)


class _HalfFloat(_RawRuns, Quantizer):
    dtype: torch.dtype

    @dataclass(frozen=True)
    class Config:
        pass

    def nbytes(self, count: int) -> int:
        return 2 * count

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        y = x.clamp(-_FP16_MAX, _FP16_MAX).to(self.dtype) if self.dtype == torch.float16 else x.to(self.dtype)
        out.tensor(y)
        return y.float()

    @property
    def _raw_kind(self) -> int:  # type: ignore[override]
        return 2 if self.dtype == torch.bfloat16 else 1

    def _run(self, k, xs, gen, ptrs, ns, offs, region, ok) -> None:
        """:func:`write_run`'s compiled call (:func:`fedcomp._numba_kernels.half_run`)."""
        k.half_run(ptrs, ns, self.dtype == torch.bfloat16, np.float32(_FP16_MAX), offs, region)
        ok[:] = True

    def _run_crc(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int, crc: int) -> int:
        """:meth:`_run` continuing the payload's CRC32 ``crc`` over what it writes, part by part
        while each is in cache (:func:`fedcomp._numba_kernels.half_run_crc`); returns the CRC."""
        crc = k.half_run_crc(ptrs, ns, self.dtype == torch.bfloat16, np.float32(_FP16_MAX), offs, region, fn,
                             np.uint32(crc))
        ok[:] = True
        return int(crc)

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes: one output tensor, clamped and converted chunk by chunk."""
        m = x.numel()
        y = out.empty(m, self.dtype, x.device)
        k = _encode_kernels(x)
        if k is not None and m:  # clamp and convert in one loop (kernels.to_half: the same bits)
            k.to_half(x.numpy(), self.dtype == torch.bfloat16, np.float32(_FP16_MAX),
                      y.view(torch.int16).numpy().view(np.uint16))
            out.tensor(y)
            return
        step = _ENCODE_CHUNK // 4
        buf = torch.empty(min(m, step), dtype=torch.float32, device=x.device) if self.dtype == torch.float16 else None
        for lo in range(0, m, step):
            xc = x[lo:lo + step]
            if buf is not None:
                xc = torch.clamp(xc, -_FP16_MAX, _FP16_MAX, out=buf[:xc.numel()])
            y[lo:lo + step].copy_(xc)
        out.tensor(y)

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":  # converted chunk by chunk into one fp32 buffer (huge pages where large)
            return self.read_values(src, count, device).dense()
        return src.tensor(count, self.dtype).to(device).float()

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        data = src.take(2 * count)
        if device.type == "cpu" and (k := kernels.get()) is not None:
            raw, table = data.numpy(), _half_table(self.dtype)
            brain = self.dtype == torch.bfloat16

            def add(lo: int, hi: int, s: np.ndarray, w: float) -> None:
                k.add_half(raw[2 * lo:2 * hi].view(np.uint16), brain, s, w)

            def into(lo: int, hi: int, out: np.ndarray) -> None:
                k.lut_u16(raw[2 * lo:2 * hi].view(np.uint16), table, out)

            def sq(lo: int, hi: int) -> float:
                return float(k.half_sq(raw[2 * lo:2 * hi].view(np.uint16), brain))

            def build(lo: int, hi: int) -> torch.Tensor:
                out = torch.empty(hi - lo, dtype=torch.float32)
                into(lo, hi, out.numpy())
                return out
            return Values(count, 1, build, device, add, sq, into)
        return Values(count, 1, lambda lo, hi: data[2 * lo:2 * hi].clone().view(self.dtype).to(device).float(), device)


_HALF_TABLES: dict = {}


def _half_table(dtype: torch.dtype) -> np.ndarray:
    """The fp32 value of each of the 65,536 bit patterns of fp16 / bf16 (torch's conversion)."""
    if dtype not in _HALF_TABLES:
        _HALF_TABLES[dtype] = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).float().numpy()
    return _HALF_TABLES[dtype]


@register
class Float16(_HalfFloat):
    """IEEE half precision; values beyond +-65504 are clamped (error feedback keeps the rest)."""

    name = "fp16"
    dtype = torch.float16


@register
class BFloat16(_HalfFloat):
    """bfloat16: fp32's range with 8 bits of mantissa."""

    name = "bf16"
    dtype = torch.bfloat16


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
    encode's ``min``/``max`` agree). On the CPU ``aminmax`` over rows measured 14x slower than
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
    (``_numba_kernels._block_qsums``): numpy arrays (amax fp32, ks, s1, s2) with, for ``sums``,
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


def _sign_scales(amax, ks, s, m: int, size: int, sub: int, rms: bool) -> np.ndarray:
    """Sign's fp32 scale per block of ``size`` (m elements) from its parts' exact sums (parts of
    ``sub``, :meth:`Sign._write`): mean |x| = sum |q| / count or rms = sqrt(sum q^2 / count), times
    2**-k; inf or NaN where a part's max |x| is. One part per block: in numpy (each sum below
    2**53 for ``mean``, float64 for ``rms``); several: combined in Python integers, divided once."""
    per, nb = -(-size // sub), -(-m // size)
    finite = np.isfinite(amax)
    if per == 1:
        counts = np.full(nb, float(size))
        if m % size:
            counts[-1] = m % size
        v = s.astype(np.float64) / counts
        if rms:
            v = np.sqrt(v)
        v *= np.ldexp(1.0, -ks.astype(np.int32))  # exact powers of 2: one rounding, as the fused loop's
        return np.where(finite, v, amax).astype(np.float32)
    scale = np.empty(nb, dtype=np.float32)
    for b in range(nb):
        lo, hi = b * per, min(b * per + per, amax.shape[0])
        if not finite[lo:hi].all():
            scale[b] = amax[lo:hi].max()  # NaN where a value is NaN, else inf
            continue
        top = int(ks[lo:hi].max())
        v = _shifted_sum(s[lo:hi], ks[lo:hi], top, 2 if rms else 1) / min(size, m - b * size)
        scale[b] = math.ldexp(math.sqrt(v) if rms else v, -top)
    return scale


@register
class Sign(_BlockRuns, Quantizer):
    """1-bit sign with one scale per block.

    ``scale="mean"``: the block's mean |x| (EF-signSGD's ||x||_1 / d), the least-squares scale:
    ||x - scale * sign(x)||^2 = ||x||^2 - ||x||_1^2 / d <= ||x||^2. The decoded block is shorter
    than x by the factor ||x||_1 / (sqrt(d) ||x||_2) (0.8 for Gaussian values, less for heavy tails).
    ``scale="rms"``: ||x||_2 / sqrt(d), the decoded block has x's length. Where a client's update
    reaches the model at once rather than through many rounds of error feedback (a client that
    takes part now and then), the shorter step is what was lost: mnist cnn-bn, 100 clients at 10%,
    30 rounds, 5 seeds: ``mean`` -3.7 points against dense (-2.9 without error feedback), ``rms``
    +0.8 (its cross-device default). Only the encoder differs: both decode alike.
    """

    name = "sign"
    cross_device = {"scale": "rms"}

    @dataclass(frozen=True)
    class Config:
        block: int = 0  # elements per scale; 0 = one scale per segment (a tensor, or the kept values)
        scale: str = "mean"  # "mean": mean |x| per block (least squares); "rms": ||x||_2 / sqrt(d) (keeps the length)

    def validate(self) -> None:
        if self.config.block < 0:
            self.fail("block", "0 (one scale per segment) or a positive block size")
        if self.config.scale not in ("mean", "rms"):
            self.fail("scale", "'mean' (mean |x| per block) or 'rms' (the block's root mean square)")

    def canonical(self) -> str:
        # the default scale is left out: specs (hence fingerprints) from before the option stay the same
        return super().canonical().replace(",scale='mean'", "")

    def nbytes(self, count: int) -> int:
        return 4 * blocks(count, self.config.block) + packed_bytes(count, 1)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        m = x.numel()
        if m == 0:
            return x
        return self._expand(self._write(x, out), x < 0, m)

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes without the reconstruction."""
        if x.numel():
            self._write(x, out)

    def _write(self, x: torch.Tensor, out: Writer) -> torch.Tensor:
        """Write [scale per block (fp32), sign bits]; returns the scales (on x's device).

        A block's scale comes from exact integer sums (the way TernGrad's std does,
        :func:`_tern_std`): the block is cut into parts of at most _STD_BLOCK elements, each part's
        values are put on a grid of 2**-qbits of its max |x| (q = rint(x * 2**k)), sum |q|
        (``mean``, qbits 30) or sum q^2 (``rms``, qbits 20; q^2 sums must stay exact) per part are
        combined exactly in Python integers and divided once. So the fused CPU loop (one pass:
        sums and sign bits of each part while it is in cache, no fresh dense memory) and the torch
        path (CUDA, no numba) give the same bytes, whatever the order of their sums. Accuracy: each
        value moves by at most 2**-(qbits+1) of its part's max |x|; on Gaussian and heavy-tailed
        updates the scale is within ~1e-7 of the float64 mean |x| / rms (a float32 sum, what torch
        did before, is off by about as much). A value not finite makes its block's scale NaN
        (a NaN) or inf, as the float sums did; finite values never overflow (no x*x in fp32)."""
        m = x.numel()
        size = block_size(m, self.config.block)
        sub = min(size, _STD_BLOCK)
        rms = self.config.scale == "rms"
        qbits = _STD_QBITS if rms else _SIGN_QBITS
        scale_out = out.empty(blocks(m, self.config.block), torch.float32, x.device)  # in the order they are written
        codes = out.empty(packed_bytes(m, 1), torch.uint8, x.device)
        k = _encode_kernels(x)
        if k is not None:
            n = (m // size) * -(-size // sub) + -(-(m % size) // sub)
            amax, s, ks = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
            scale = scale_out.numpy() if size == sub else np.empty(0, dtype=np.float32)
            k.sign_stats(x.numpy(), size, sub, qbits, not rms, amax, s, ks, scale,
                         kernels.scratch(sub + k.SIGN_TILE + 8, np.uint8), codes.numpy(), k.NO_GUESS)
        else:
            starts = range(0, m, size) if size > sub else [0]
            stats = [_qstats_torch(x[a:a + size] if size > sub else x, sub, qbits, True, not rms) for a in starts]
            amax, ks, s1, s2 = (np.concatenate(v) for v in zip(*stats))
            s = s2 if rms else s1
            step = max(8, _ENCODE_CHUNK // 8 * 8)
            for lo in range(0, m, step):
                _pack_into(torch.lt(x[lo:lo + step], 0), 1, codes[lo // 8:lo // 8 + packed_bytes(min(step, m - lo), 1)])
        if k is None or size > sub:
            scale_out.copy_(torch.from_numpy(_sign_scales(amax, ks, s, m, size, sub, rms)))
        out.tensor(scale_out)
        out.tensor(codes)
        return scale_out

    _run_kind, _run_per, _run_bits = "BLOCK_SIGN", 1, 1  # runs (_BlockRuns): a scale per block, sign bits

    def _run_sq(self, k, run: RunReply, chunk: int) -> np.ndarray:
        """Every value is +-scale: elements per block x scale**2, from the scales alone."""
        out = np.empty(run.ns.shape[0], dtype=np.float64)
        k.sign_sq_run(run.ns, run.p0, run.params[0], self.config.block, chunk, out)
        return out

    def _round_tables(self, run: RunReply, halves: np.ndarray) -> None:
        """Every value is +-scale: a half segment's scales rounded once (the check's squares; the
        add rounds each value again, to the same value)."""
        _round_by(run.params[0], np.repeat(halves, np.diff(run.p0)))

    def _run(self, k, xs, gen, ptrs, ns, offs, region, ok) -> None:
        """:func:`write_run`'s compiled call (:func:`fedcomp._numba_kernels.sign_run`); the scales
        of blocks of several parts are combined here, as :meth:`_write` does."""
        block, rms = self.config.block, self.config.scale == "rms"
        sizes = [block_size(n, block) for n in ns.tolist()]
        subs = [min(size, _STD_BLOCK) for size in sizes]
        part0 = np.zeros(len(xs) + 1, dtype=np.int64)
        part0[1:] = np.cumsum([(n // size) * -(-size // sub) + -(-(n % size) // sub)
                               for n, size, sub in zip(ns.tolist(), sizes, subs)])
        total = int(part0[-1])
        amax, s, ks = np.empty(total, dtype=np.float32), np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
        scale = np.empty(max(blocks(n, block) for n in ns.tolist()), dtype=np.float32)
        k.sign_run(ptrs, ns, block, _STD_BLOCK, _STD_QBITS if rms else _SIGN_QBITS, not rms, offs, region, part0, amax, s, ks,
                   scale, kernels.scratch(_STD_BLOCK + k.SIGN_TILE + 8, np.uint8), ok)
        for i in np.flatnonzero(~ok).tolist():
            n, p0, p1 = int(ns[i]), part0[i], part0[i + 1]
            sc = _sign_scales(amax[p0:p1], ks[p0:p1], s[p0:p1], n, sizes[i], subs[i], rms)
            region[offs[i]:offs[i] + 4 * sc.shape[0]] = sc.view(np.uint8)
            ok[i] = True

    def _expand(self, scale: torch.Tensor, negative: torch.Tensor, m: int) -> torch.Tensor:
        per = scale.repeat_interleave(block_size(m, self.config.block))[:m]
        return torch.where(negative, -per, per)

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        return self.read_values(src, count, device).dense()

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        block = self.config.block
        if count == 0:
            return Values.of(torch.empty(0, device=device))
        scale = src.tensor(blocks(count, block), torch.float32).to(device)
        data = src.take(packed_bytes(count, 1))
        size = block_size(count, block)

        def build(lo: int, hi: int) -> torch.Tensor:
            negative = unpack_flags(data[lo // 8:lo // 8 + packed_bytes(hi - lo, 1)].to(device), hi - lo)
            # +-scale per block: (1 - 2 negative) * scale is exactly _expand's where(negative, -s, s)
            y = negative.to(torch.float32).mul_(-2).add_(1)
            return _per_block_(y, block, scale[lo // size:])
        unit = _block_unit(count, block)
        if device.type == "cpu" and (k := kernels.get()) is not None:
            flags, sc = _Codes(data, count, 1), scale.numpy()

            def run(a, b, i0, i1, out, s, w, add):  # a: a multiple of 8 elements and of the block
                k.sign(flags.host(a, b, k), sc[a // size:], size, i0, i1, out, s, w, add)

            def sq(a, b, i0, i1):  # every value is +-scale: elements per block x scale**2
                lo, hi = a + i0, a + i1
                first = lo // size
                edges = np.arange(first, (hi - 1) // size + 2, dtype=np.int64) * size
                edges[0], edges[-1] = lo, hi
                scales = sc[first:first + edges.size - 1].astype(np.float64)
                return float(np.dot(np.diff(edges).astype(np.float64), scales * scales))
            return _fused(count, unit, device, run, sq)
        return Values(count, unit, build, device)


class FixedSign(Quantizer):
    """Sign bits decoding to +-tau: the value coding of Strom's threshold sparsifier (not a spec name)."""

    name = "fixed-sign"

    @dataclass(frozen=True)
    class Config:
        tau: float = 1e-3

    def nbytes(self, count: int) -> int:
        return packed_bytes(count, 1)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        negative = x < 0
        out.tensor(pack_bits(negative, 1))
        return self._expand(negative)

    def _expand(self, negative: torch.Tensor) -> torch.Tensor:
        tau = self.config.tau
        return torch.where(negative, -tau, tau).float()

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        negative = unpack_bits(src.take(packed_bytes(count, 1)).to(device), count, 1).bool()
        return self._expand(negative)


@register
class TwoBit(_ChecksummedRun, _TernaryRuns, Quantizer):
    """MXNet's 2-bit codec: x >= t -> +t (11), x <= -t -> -t (10), else 0 (00).

    Elementwise |error| <= |x|: the remainder stays in the residual (error feedback). ``t`` is an
    absolute value and must be on the scale of what is sent: MXNet's 0.5 is for gradients, while a
    federated round's update is about 1e-3 per weight (digits mlp, mnist cnn-bn), where 0.5 sends
    nothing until a residual reaches it and then a step of 0.5 (mnist cnn-bn: -72 points against
    dense). The default 0.001 held within 2 points on both tasks (README, codec families).
    """

    name = "twobit"

    @dataclass(frozen=True)
    class Config:
        threshold: float = 0.001  # t: the magnitude every sent value carries (the updates' scale)

    def validate(self) -> None:
        if not self.config.threshold > 0:
            self.fail("threshold", "a positive float")

    def nbytes(self, count: int) -> int:
        return packed_bytes(count, 2)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        t = self.config.threshold
        codes = torch.where(x >= t, 3, torch.where(x <= -t, 2, 0)).to(torch.uint8)
        out.tensor(pack_bits(codes, 2))
        return self._values(codes)

    _bad = (1, "twobit payload holds the unused code 01")

    def _tables(self, body: np.ndarray, ns: np.ndarray, offs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = self.config.threshold
        return offs, np.tile(np.array([0.0, 0.0, -t, t], dtype=np.float32), (ns.shape[0], 1))

    def _run_crc(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int, crc: int) -> int:
        """:meth:`_run` continuing the payload's CRC32 ``crc`` over what it writes (``fn`` 0:
        none), each chunk as it is packed; returns the CRC."""
        step = max(4, _ENCODE_CHUNK // 16 * 4)
        crc = k.twobit_run(ptrs, ns, np.float32(self.config.threshold), offs, region, step,
                           kernels.scratch(step, np.uint8), fn, np.uint32(crc))
        ok[:] = True
        return int(crc)

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes: code = 2 sent + positive, chunk by chunk into one output."""
        m, t = x.numel(), self.config.threshold
        if m == 0:
            return
        packed = out.empty(packed_bytes(m, 2), torch.uint8, x.device)
        step = max(4, _ENCODE_CHUNK // 16 * 4)  # a multiple of 4 codes: every chunk but the last ends on a byte
        code = torch.empty(min(m, step), dtype=torch.uint8, device=x.device)
        pos = torch.empty(min(m, step), dtype=torch.bool, device=x.device)
        k = _encode_kernels(x)
        t32 = np.float32(t)
        for lo in range(0, m, step):
            xc = x[lo:lo + step]
            if k is not None:  # the same codes in one loop, packed by another
                c = code[:xc.numel()].numpy()
                k.twobit_codes(xc.numpy(), t32, c)
                k.pack(c, xc.numel(), 2, packed[lo // 4:lo // 4 + packed_bytes(xc.numel(), 2)].numpy())
                continue
            c, p = code[:xc.numel()], pos[:xc.numel()]
            torch.ge(xc, t, out=p)
            torch.le(xc, -t, out=c.view(torch.bool)).logical_or_(p)  # sent
            c.bitwise_left_shift_(1).bitwise_or_(p.view(torch.uint8))
            _pack_into(c, 2, packed[lo // 4:lo // 4 + packed_bytes(xc.numel(), 2)])
        out.tensor(packed)

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        t = self.config.threshold
        return torch.where(codes == 3, t, torch.where(codes == 2, -t, 0.0)).float()

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        if count and _ternary_kernels(device, load=False) is not None:  # the compiled table loop (torch: ~65 read passes)
            return self.read_values(src, count, device).dense()
        codes = unpack_codes(src.take(packed_bytes(count, 2)).to(device), count, 2)
        if bool((codes == 1).any()):
            raise DecodeError("twobit payload holds the unused code 01")
        return self._values(codes)

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        if count == 0 or _ternary_kernels(device) is None:
            return Values.of(self.decode(src, count, device))
        t = self.config.threshold  # fp32 values as _values gives them: +t, -t (rounded), 0
        return _ternary(src, count, device, 1, "twobit payload holds the unused code 01", [0.0, 0.0, -t, t])


@register
class KBit(_ChecksummedRun, _BlockRuns, _EntropyCoded, Quantizer):
    """Linear k-bit quantization per block: q = round((x - min) / scale), scale = (max - min) / (2^b - 1).

    |error| <= scale / 2 with nearest rounding; < scale and unbiased with stochastic rounding.
    """

    name = "kbit"
    budget_knobs = (Knob("bits", "levels", 1, 8), Knob("block", "block", 32))

    @dataclass(frozen=True)
    class Config:
        bits: int = 4  # 1..8 bits per value
        block: int = 256  # elements per (min, scale) pair; 0 = one pair per segment
        stochastic: bool = False  # stochastic rounding: unbiased, twice the worst-case error
        coding: str = "packed"  # codes: "packed" (bits each) or "ans" (entropy coded: size depends on data)

    def validate(self) -> None:
        if self.config.coding not in CODINGS:
            self.fail("coding", f"one of {CODINGS}")
        if not 1 <= self.config.bits <= 8:
            self.fail("bits", "an integer from 1 to 8")
        if self.config.block < 0:
            self.fail("block", "0 (one block per segment) or a positive block size")

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.config.stochastic

    def _packed_nbytes(self, count: int) -> int:
        return 8 * blocks(count, self.config.block) + packed_bytes(count, self.config.bits)

    def _key(self, x: torch.Tensor, gen: torch.Generator | None) -> tuple[int, int] | None:
        """The segment's uniform stream (stochastic rounding only: nearest rounding draws nothing)."""
        return uniforms.draw_key(gen, x.device) if self.config.stochastic and x.numel() else None

    def _chunked(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        return _chunked_encode(self._encode_one, x, out, self._key(x, gen), self.config.block)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        if self.config.coding == "ans":
            return self._ans(self._chunked, x, out, gen)
        return self._chunked(x, out, gen)

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes without the reconstruction, through reused chunk buffers."""
        if self.config.coding == "ans":
            self._ans(self._chunked, x, out, gen)
            return
        m, levels = x.numel(), (1 << self.config.bits) - 1
        if m == 0:
            return
        w = _BlockWriter(m, self.config.block, 2, self.config.bits, out, x.device)
        k = _encode_kernels(x)
        key = self._key(x, gen)
        k0, k1 = _key32(key)
        if k is not None:
            xn, pn = x.numpy(), w.params.numpy()
        for start, stop, b0, b1 in w.chunks():
            if k is not None:
                direct = self.config.bits == 8  # the codes are the bytes: written in place
                codes = w.host_codes[start:stop] if direct else kernels.scratch(stop - start, np.uint8)
                if k.kbit_codes(xn[start:stop], w.size, levels, key is not None, k0, k1, start, pn[b0:b1], codes):
                    if not direct:
                        w.put_host_codes(start, codes, k)
                    continue
            rows = _padded_rows(x[start:stop], w.size, fill_first=True)
            lo, hi = _row_range(rows)
            scale = torch.sub(hi, lo, out=w.params[b0:b1, 1]).div_(levels)
            w.params[b0:b1, 0] = lo
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            t = w.f32[:rows.numel()].view(rows.shape)
            torch.sub(rows, lo[:, None], out=t).div_(safe[:, None])
            if key is not None:  # the padded rows' uniforms too (past the segment: cut off below)
                t.add_(w.uniform(key, start, t.numel()).view(t.shape)).floor_()
            else:
                t.round_()
            q = w.u8[:stop - start]
            q.copy_(t.clamp_(0, levels).view(-1)[:stop - start])
            w.put_codes(start, q)
        w.write(out)

    def runs(self) -> bool:
        return self.config.coding == "packed"

    def _run_crc(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int, crc: int) -> int:
        """:meth:`_run` continuing the payload's CRC32 ``crc`` over what it writes (``fn`` 0:
        none), the codes as they are packed; returns the CRC."""
        stochastic = self.config.stochastic
        k0s, k1s = _stream_keys(k, gen, xs) if stochastic else _run_keys([None] * len(xs))
        step = max(_chunk_step(int(n), self.config.block) for n in ns.tolist())
        params = np.empty((blocks(step, self.config.block), 2), dtype=np.float32)
        return int(k.block_run(k.BLOCK_KBIT, ptrs, ns, self.config.block, (1 << self.config.bits) - 1, self.config.bits,
                               stochastic, k0s, k1s, offs, region, _ENCODE_CHUNK, params, kernels.scratch(step, np.uint8),
                               ok, fn, np.uint32(crc)))

    _run_kind, _run_per = "BLOCK_KBIT", 2  # runs (_BlockRuns): rows lo, scale per block

    def _encode_one(self, x: torch.Tensor, out: Writer, key: tuple[int, int] | None, start: int) -> torch.Tensor:
        m, block, levels = x.numel(), self.config.block, (1 << self.config.bits) - 1
        if m == 0:
            return x
        rows = _blocked(x, block)
        pad = rows.numel() - m
        # padding must not widen the last block's range: fill it with that block's first value
        if pad:
            rows = rows.clone()
            rows[-1, rows.shape[1] - pad:] = rows[-1, 0]
        lo, hi = rows.min(dim=1).values, rows.max(dim=1).values
        scale = (hi - lo) / levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        t = (rows - lo[:, None]) / safe[:, None]
        t = torch.floor(t + _uniform(key, start, t.numel(), x.device).view(t.shape)) if key is not None else torch.round(t)
        q = t.clamp_(0, levels).reshape(-1)[:m].to(torch.uint8)
        out.tensor(torch.stack([lo, scale], dim=1))
        out.tensor(pack_bits(q, self.config.bits))
        return self._values(q, lo, scale, m)

    def _values(self, q: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, m: int) -> torch.Tensor:
        """q * scale + lo per block (q: integer codes of any dtype; a new fp32 tensor)."""
        return _per_block_(q.to(torch.float32, copy=True), self.config.block, scale, lo)

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        return self.read_values(src, count, device).dense()

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        block = self.config.block
        if count == 0:
            return Values.of(torch.empty(0, device=device))
        size, unit = block_size(count, block), _block_unit(count, block)
        if device.type == "cpu" and (k := kernels.get()) is not None:
            # numpy views, no torch op: a model of many small tensors reads one segment each
            pairs = src.take(8 * blocks(count, block)).numpy().view(np.float32)
            lo_np, scale_np = pairs[0::2].copy(), pairs[1::2].copy()
            codes = self._read_codes(src, count, device)
            levels = (1 << self.config.bits) - 1

            def run(a, b, i0, i1, out, s, w, add):
                k.kbit(codes.host(a, b, k), lo_np[a // size:], scale_np[a // size:], size, i0, i1, out, s, w, add, 0)

            def sq(a, b, i0, i1):
                return k.kbit_sq(codes.host(a, b, k), lo_np[a // size:], scale_np[a // size:], size, i0, i1, levels)
            return _fused(count, unit, device, run, sq)
        params = src.tensor(2 * blocks(count, block), torch.float32).to(device).view(-1, 2)
        lo_, scale = params[:, 0].contiguous(), params[:, 1].contiguous()
        codes = self._read_codes(src, count, device)

        def build(lo: int, hi: int) -> torch.Tensor:
            b = lo // size
            return self._values(codes(lo, hi), lo_[b:], scale[b:], hi - lo)
        return Values(count, unit, build, device)


@register
class QSGD(_ChecksummedRun, _BlockRuns, _EntropyCoded, Quantizer):
    """QSGD (Alistarh et al. 2017): per bucket, ||v|| * sign(v_j) * xi_j with xi_j stochastic over s levels.

    ``bits`` counts the sign: s = 2^(bits-1) - 1 levels above zero. Unbiased; elementwise
    |error| <= scale / s, where scale is the bucket's norm.

    ``norm="l2"`` is the paper's scaling: E||Q(v) - v||^2 <= min(d / s^2, sqrt(d) / s) ||v||^2,
    which exceeds ||v||^2 for buckets larger than s^2 elements. Such a compressor is not
    contractive, and error feedback on top of it diverges (measured: top-k 1% + 4-bit l2 QSGD
    with error feedback falls to chance accuracy on digits). ``norm="max"`` (the default) scales
    by the bucket's max |v|, so levels are spread over the values' actual range; still
    unbiased, with E(Q(v_j) - v_j)^2 <= max|v|^2 / (4 s^2).
    """

    name = "qsgd"
    unbiased = True
    budget_knobs = (Knob("bits", "levels", 2, 8), Knob("bucket", "block", 32))

    @dataclass(frozen=True)
    class Config:
        bits: int = 4  # bits per value including the sign bit (2..8)
        bucket: int = 512  # elements per norm; 0 = one norm per segment
        norm: str = "max"  # bucket scale: "max" (max |v|, contractive) or "l2" (the paper's ||v||_2)
        coding: str = "packed"  # codes: "packed" (bits each) or "ans" (entropy coded: size depends on data)

    def validate(self) -> None:
        if self.config.norm not in ("max", "l2"):
            self.fail("norm", "'max' or 'l2'")
        if self.config.coding not in CODINGS:
            self.fail("coding", f"one of {CODINGS}")
        if not 2 <= self.config.bits <= 8:
            self.fail("bits", "an integer from 2 to 8 (sign bit included)")
        if self.config.bucket < 0:
            self.fail("bucket", "0 (one bucket per segment) or a positive bucket size")

    @property
    def levels(self) -> int:
        return (1 << (self.config.bits - 1)) - 1

    def _packed_nbytes(self, count: int) -> int:
        return 4 * blocks(count, self.config.bucket) + packed_bytes(count, self.config.bits)

    def _chunked(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        key = uniforms.draw_key(gen, x.device) if x.numel() else None
        return _chunked_encode(self._encode_one, x, out, key, self.config.bucket)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        if self.config.coding == "ans":
            return self._ans(self._chunked, x, out, gen)
        return self._chunked(x, out, gen)

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes without the reconstruction, through reused chunk buffers."""
        if self.config.coding == "ans":
            self._ans(self._chunked, x, out, gen)
            return
        m, s, bits = x.numel(), self.levels, self.config.bits
        if m == 0:
            return
        w = _BlockWriter(m, self.config.bucket, 1, bits, out, x.device)
        k = _encode_kernels(x)
        use_max = self.config.norm == "max"
        key = uniforms.draw_key(gen, x.device)
        k0, k1 = _key32(key)
        for start, stop, b0, b1 in w.chunks():
            xc = x[start:stop]
            if k is not None:
                norms = w.params[b0:b1, 0]
                if not use_max:  # torch's reduction, as the torch path computes it
                    norms.copy_(torch.linalg.vector_norm(_padded_rows(xc, w.size, fill_first=False), dim=1))
                codes = kernels.scratch(stop - start, np.uint8)
                if k.qsgd_codes(xc.numpy(), w.size, s, bits - 1, use_max, norms.numpy(), k0, k1, start, codes):
                    w.put_host_codes(start, codes, k)
                    continue
            rows = _padded_rows(xc, w.size, fill_first=False)
            mag = torch.abs(rows, out=w.f32[:rows.numel()].view(rows.shape))
            if self.config.norm == "max":
                norm = torch.amax(mag, dim=1)
            else:
                norm = torch.linalg.vector_norm(rows, dim=1)
            w.params[b0:b1, 0] = norm
            ratio = self._ratio_(mag, norm).view(-1)[:stop - start]
            ratio.add_(w.uniform(key, start, stop - start)).floor_().clamp_(0, s)
            code = w.u8[:stop - start]
            code.copy_(ratio)
            code.bitwise_or_(torch.lt(xc, 0).view(torch.uint8) << (bits - 1))
            w.put_codes(start, code)
        w.write(out)

    def runs(self) -> bool:
        return self.config.coding == "packed" and self.config.norm == "max"  # l2 norms are torch's

    _run_kind, _run_per, _run_block_field = "BLOCK_QSGD", 1, "bucket"  # runs (_BlockRuns): norm / levels per bucket

    def _run_rows(self, rows: np.ndarray) -> np.ndarray:
        """norm / levels per bucket (fp32, as :meth:`read_values` divides)."""
        with np.errstate(all="ignore"):  # a NaN or inf norm (fuzzed payloads) is refused by the check
            return rows / np.float32(self.levels)

    def _run_crc(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int, crc: int) -> int:
        """:meth:`_run` continuing the payload's CRC32 ``crc`` over what it writes (``fn`` 0:
        none), the codes as they are packed; returns the CRC."""
        k0s, k1s = _stream_keys(k, gen, xs)
        step = max(_chunk_step(int(n), self.config.bucket) for n in ns.tolist())
        return int(k.block_run(k.BLOCK_QSGD, ptrs, ns, self.config.bucket, self.levels, self.config.bits, True, k0s, k1s,
                               offs, region, _ENCODE_CHUNK, np.empty((blocks(step, self.config.bucket), 1), dtype=np.float32),
                               kernels.scratch(step, np.uint8), ok, fn, np.uint32(crc)))

    def _ratio_(self, mag: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """In place: mag (|x| as rows of buckets) times r = fp32(levels / norm) per bucket (norm 0:
        r = levels), one fp32 multiply per element, the kernel's arithmetic; where r overflows (a
        norm below levels / fp32's max, where 0 * r would be NaN) |x| * levels / norm instead."""
        safe = torch.where(norm > 0, norm, torch.ones_like(norm))
        r = torch.full_like(safe, float(self.levels)).div_(safe)
        big = torch.isinf(r)
        if bool(big.any()):
            mag[big] = mag[big].mul(self.levels).div_(safe[big][:, None])
            r[big] = 1.0
        return mag.mul_(r[:, None])

    def _encode_one(self, x: torch.Tensor, out: Writer, key: tuple[int, int] | None, start: int) -> torch.Tensor:
        m, s = x.numel(), self.levels
        if m == 0:
            return x
        rows = _blocked(x, self.config.bucket)
        norm = rows.abs().amax(dim=1) if self.config.norm == "max" else torch.linalg.vector_norm(rows, dim=1)
        ratio = self._ratio_(rows.abs(), norm).reshape(-1)[:m]
        ratio.add_(_uniform(key, start, m, x.device)).floor_().clamp_(0, s)
        level = ratio.to(torch.uint8)
        negative = (x < 0).to(torch.uint8)
        out.tensor(norm)
        out.tensor(pack_bits((negative << (self.config.bits - 1)) | level, self.config.bits))
        return self._values(norm, level, negative, m)

    def _values(self, norm: torch.Tensor, level: torch.Tensor, negative: torch.Tensor, m: int) -> torch.Tensor:
        """norm * (+-level) / s per bucket (level, negative: uint8; a new fp32 tensor)."""
        signed = level.to(torch.int8) * (1 - 2 * negative.to(torch.int8))  # int8: |level| <= 127
        # Divided by a tensor, not the Python int: CUDA divides by a scalar as a multiply by its
        # reciprocal, which is not correctly rounded, so norm / levels would differ from the CPU's
        # (kernels and numpy) by an ulp and a GPU's decode from every other decode of the payload.
        per_level = norm / torch.full_like(norm, float(self.levels))
        return _per_block_(signed.to(torch.float32), self.config.bucket, per_level)

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        return self.read_values(src, count, device).dense()

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        bucket = self.config.bucket
        if count == 0:
            return Values.of(torch.empty(0, device=device))
        top = self.config.bits - 1
        size, unit = block_size(count, bucket), _block_unit(count, bucket)
        if device.type == "cpu" and (k := kernels.get()) is not None:
            # numpy, no torch op (one segment per tensor); the fp32 division _values does
            with np.errstate(all="ignore"):  # a NaN or inf norm (fuzzed payloads) is refused by the check
                per_level = src.take(4 * blocks(count, bucket)).numpy().view(np.float32) / np.float32(self.levels)
            codes = self._read_codes(src, count, device)

            def run(a, b, i0, i1, out, s, w, add):
                k.qsgd(codes.host(a, b, k), per_level[a // size:], top, size, i0, i1, out, s, w, add, 0)

            def sq(a, b, i0, i1):
                return k.qsgd_sq(codes.host(a, b, k), per_level[a // size:], top, size, i0, i1)
            return _fused(count, unit, device, run, sq)
        norm = src.tensor(blocks(count, bucket), torch.float32).to(device)
        codes = self._read_codes(src, count, device)

        def build(lo: int, hi: int) -> torch.Tensor:
            c = codes(lo, hi)
            return self._values(norm[lo // size:], c & ((1 << top) - 1), c >> top, hi - lo)
        return Values(count, unit, build, device)


def _tern_std(n: int, ks, s1, s2) -> float:
    """TernGrad's std(x) (n - 1 normalization) from exact per-block integer sums: block b holds
    s1 = sum q, s2 = sum q^2 of q = rint(x * 2**ks[b]) (|q| <= 2**20: x to 20 bits of its block's
    max |x|). Combined exactly (Python integers), divided once (correctly rounded), so the result
    depends on neither the order of the sums nor the path (fused loop or torch ops).

    Why not ``torch.std``: it costs ~7 read passes on one thread (more than the rest of the
    encode), and a float sum's last bits depend on its order, so a fused loop could not give
    torch's bits. The rounding (each value moves by at most 2**-20 of its block's max |x|) moves
    the std by at most 2**-20 * max|x| (the centred vector moves by at most that per element);
    rounding errors of continuous data average out, so on Gaussian updates it agrees with
    ``torch.std`` to ~1e-8 relative (``tests/test_uniforms.py`` checks 1e-6)."""
    if len(ks) == 1:  # one block (most of a ResNet's tensors): nothing to shift
        top, a, b = int(ks[0]), int(s1[0]), int(s2[0])
    else:
        top = int(max(ks))
        a = _shifted_sum(s1, ks, top, 1)
        b = _shifted_sum(s2, ks, top, 2)
    var = (n * b - a * a) / (n * (n - 1))
    return math.ldexp(math.sqrt(var), -top)


def _tern_stats_kernel(x: torch.Tensor, clip: bool, k):
    """(max |x|, std or None) through the fused loop; None where a value is not finite."""
    m = x.numel()
    nb = -(-m // _STD_BLOCK)
    amax = np.empty(nb, dtype=np.float32)
    s1, s2, ks = np.empty(nb, dtype=np.int64), np.empty(nb, dtype=np.int64), np.empty(nb, dtype=np.int64)
    if not k.tern_stats(x.numpy(), _STD_BLOCK, _STD_QBITS, clip, amax, s1, s2, ks, k.NO_GUESS):
        return None
    return amax.max(), (_tern_std(m, ks, s1, s2) if clip else None)


def _tern_stats_torch(x: torch.Tensor, clip: bool):
    """:func:`_tern_stats_kernel` in torch ops (any device), blocks of _STD_BLOCK (zero padding
    changes neither max |x| nor the sums); std NaN where a value is not finite."""
    amax, ks, s1, s2 = _qstats_torch(x, _STD_BLOCK, _STD_QBITS, clip)
    a = np.float32(amax.max())
    if not clip:
        return a, None
    return a, (_tern_std(x.numel(), ks, s1, s2) if bool(np.isfinite(amax).all()) else float("nan"))


@register
class TernGrad(_ChecksummedRun, _TernaryRuns, Quantizer):
    """TernGrad (Wen et al. 2017): s * sign(g) * b, b ~ Bernoulli(|g| / s), s = max|g| per segment.

    With ``clip`` > 0, g is first clipped to +-clip * std(g) (biased; error feedback keeps the
    clipped part). Unbiased with clip = 0, to the draws' resolution: P(sent) is |g| / s rounded to
    the nearest multiple of 2**-16, a bias of at most min(|g|, s * 2**-17) per element, either
    way. Elementwise |error| <= s.

    std(g) is computed from exact integer sums (:func:`_tern_std`; within ~1e-6 of ``torch.std``,
    which costs ~7 read passes), so the fused CPU loop and the torch path (CUDA, no numba) give
    the same bytes; the Bernoulli draws use the segment's half-width counter-based uniforms
    (16 bits, two from one hash: :func:`fedcomp.uniforms.fill16`).
    """

    name = "terngrad"

    @dataclass(frozen=True)
    class Config:
        clip: float = 2.5  # clip at clip * std before scaling; 0 disables clipping

    def validate(self) -> None:
        if self.config.clip < 0:
            self.fail("clip", "0 (no clipping) or a positive multiple of the standard deviation")

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.config.clip == 0

    def nbytes(self, count: int) -> int:
        return (4 if count else 0) + packed_bytes(count, 2)

    def encode(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> torch.Tensor:
        if x.numel() == 0:
            return x
        s, packed = self._write(x, out, gen)
        return self._values(s, unpack_codes(packed, x.numel(), 2))

    def write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> None:
        """:meth:`encode`'s bytes without the reconstruction."""
        if x.numel():
            self._write(x, out, gen)

    def _write(self, x: torch.Tensor, out: Writer, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [s, 2-bit codes]; returns (s as a 1-element fp32 tensor, the packed codes).

        1. The clip bound ``clip * std(x)`` (:func:`_tern_std`; skipped for clip = 0 or one value).
        2. s = max |clipped x| = min(max |x|, bound), in fp32.
        3. Per element: a = min(|x|, bound); code 1 (+s) or 2 (-s, x < 0) where u_i * s < a (so
           P(sent) = a / s rounded to the nearest multiple of 2**-16), else 0; u_i the segment's
           half-width counter-based uniform (:func:`fedcomp.uniforms.fill16`), so the chunking
           and the path (fused CPU loop or torch ops) do not change the bytes. A non-finite x
           gives s = NaN (or inf without clipping) and every code 0, as before the rework."""
        m = x.numel()
        key = uniforms.draw_key(gen, x.device)
        clip = self.config.clip > 0 and m > 1
        k = _encode_kernels(x)
        stats = _tern_stats_kernel(x, clip, k) if k is not None else None
        if stats is None:  # no kernels, or a value is not finite
            k = None
            stats = _tern_stats_torch(x, clip)
        s32, bound32 = self._scale(*stats, clip)
        s_out = out.empty(1, torch.float32, x.device)  # the writer's places go in the order they are written
        packed = out.empty(packed_bytes(m, 2), torch.uint8, x.device)
        step = min(m, max(4, _ENCODE_CHUNK // 4 * 4))  # a multiple of 4 codes: chunks end on a byte
        s_t = torch.from_numpy(np.array([s32], dtype=np.float32)).to(x.device)
        if k is not None:
            k0, k1 = _key32(key)
            codes = kernels.scratch(max(step, 16), np.uint8)
            for lo in range(0, m, step):
                xc = x[lo:lo + step].numpy()
                n = xc.shape[0]
                dst = packed[lo // 4:lo // 4 + packed_bytes(n, 2)].numpy()
                k.tern_packed(xc, s32, bound32, clip, k0, k1, lo, dst, codes)
        else:
            u = torch.empty(step, dtype=torch.float32, device=x.device)
            work = torch.empty(2 * step, dtype=torch.int32, device=x.device)
            mag = torch.empty(step, dtype=torch.float32, device=x.device)
            code = torch.empty(step, dtype=torch.uint8, device=x.device)
            keep = torch.empty(step, dtype=torch.bool, device=x.device)
            b_t = torch.tensor(bound32, dtype=torch.float32, device=x.device)
            for lo in range(0, m, step):
                xc = x[lo:lo + step]
                n = xc.numel()
                a = torch.abs(xc, out=mag[:n])
                if clip:
                    torch.minimum(a, b_t, out=a)
                uc = uniforms.fill16(key, lo, u[:n], work).mul_(s_t)
                torch.lt(uc, a, out=keep[:n])
                c = torch.lt(xc, 0, out=code[:n].view(torch.bool)).view(torch.uint8).add_(1)
                c.mul_(keep[:n].view(torch.uint8))
                _pack_into(c, 2, packed[lo // 4:lo // 4 + packed_bytes(n, 2)])
        out.tensor(s_out.copy_(s_t))
        out.tensor(packed)
        return s_t, packed

    _bad = (3, "terngrad payload holds the unused code 11")

    def _tables(self, body: np.ndarray, ns: np.ndarray, offs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        nb = (ns > 0).astype(np.int64)  # one s per non-empty segment
        s, p0 = _block_params(body, offs, nb, 1)
        per = np.zeros(ns.shape[0], dtype=np.float32)
        per[nb > 0] = s
        return offs + 4 * nb, np.stack([np.zeros_like(per), per, -per, np.zeros_like(per)], axis=1)

    def _scale(self, amax, bound, clip: bool) -> tuple[np.float32, np.float32]:
        """(s, the clip bound) in fp32 from max |x| and std (``bound``): scalars, or arrays of
        segments (elementwise, the same fp32 operations)."""
        s32, bound32 = amax, np.float32(np.inf)
        if clip:
            with np.errstate(invalid="ignore", over="ignore"):  # std past fp32's range: inf
                bound32 = np.float32(np.float32(self.config.clip) * np.float32(bound))
                s32 = np.minimum(amax, bound32)
        return s32, bound32

    def _run_crc(self, k, xs, gen, ptrs, ns, offs, region, ok, fn: int, crc: int) -> int:
        """:func:`write_run`'s compiled calls: every segment's block statistics in one
        (:func:`fedcomp._numba_kernels.tern_stats_run`), s and the clip bound per segment here as
        :meth:`_write` computes them (the exact std in Python integers; the fp32 scale for all
        segments at once), the codes in one (:func:`fedcomp._numba_kernels.tern_run`). A segment
        with a value not finite is left to :meth:`_write` (ok False). ``fn`` nonzero: the codes'
        call continues the payload's CRC32 ``crc`` as it packs them; returns the CRC.

        Why: per segment, the statistics' call, arrays and scalar arithmetic cost ~25 us: ~4 ms
        on a ResNet-50's 161 tensors, about one read pass of its 25.6M values."""
        count = len(xs)
        clips = (ns > 1) if self.config.clip > 0 else np.zeros(count, dtype=np.bool_)
        b0 = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(-(-ns // _STD_BLOCK), out=b0[1:])
        total = int(b0[-1])
        amax = np.empty(total, dtype=np.float32)
        s1, s2, ks = (np.empty(total, dtype=np.int64) for _ in range(3))
        k.tern_stats_run(ptrs, ns, _STD_BLOCK, _STD_QBITS, clips, b0, amax, s1, s2, ks, ok)
        s32 = np.maximum.reduceat(amax, b0[:-1])  # max |x| per segment (every segment has a block)
        bound32 = np.full(count, np.inf, dtype=np.float32)
        use = np.flatnonzero(clips & ok)
        if use.shape[0]:  # the scale of _write, for every clipped segment at once
            nl, kl, s1l, s2l, bl = ns.tolist(), ks.tolist(), s1.tolist(), s2.tolist(), b0.tolist()  # Python ints:
            # numpy scalars cost ~2 ms a ResNet-50 layout in _tern_std's loops
            std = np.array([_tern_std(nl[i], kl[bl[i]:bl[i + 1]], s1l[bl[i]:bl[i + 1]], s2l[bl[i]:bl[i + 1]])
                            for i in use.tolist()], dtype=np.float64)
            s32[use], bound32[use] = self._scale(s32[use], std, True)
        k0s, k1s = _stream_keys(k, gen, xs)
        step = max(4, _ENCODE_CHUNK // 4 * 4)
        codes = kernels.scratch(max(step, 16), np.uint8)
        return int(k.tern_run(ptrs, ns, s32, bound32, clips, k0s, k1s, offs, region, step, codes, ok, fn, np.uint32(crc)))

    def _values(self, s: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        s = s.reshape(())
        return torch.where(codes == 1, s, torch.where(codes == 2, -s, torch.zeros_like(s))).float()

    def read_values(self, src: Reader, count: int, device: torch.device) -> Values:
        if count == 0 or _ternary_kernels(device) is None:
            return Values.of(self.decode(src, count, device))
        s = float(src.tensor(1, torch.float32)[0])
        return _ternary(src, count, device, 3, "terngrad payload holds the unused code 11", [0.0, s, -s, 0.0])

    def decode(self, src: Reader, count: int, device: torch.device) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, device=device)
        if _ternary_kernels(device, load=False) is not None:  # the compiled table loop (torch ops: ~65 read passes)
            return self.read_values(src, count, device).dense()
        s = src.tensor(1, torch.float32).to(device)[0]
        codes = unpack_codes(src.take(packed_bytes(count, 2)).to(device), count, 2)
        if bool((codes == 3).any()):
            raise DecodeError("terngrad payload holds the unused code 11")
        return self._values(s, codes)
