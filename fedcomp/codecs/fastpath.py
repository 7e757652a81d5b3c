"""The fast path: every segment of an update in one compiled call (CPU, numba).

A quantizer implements `RunCodec` or not; callers check `isinstance(q, RunCodec)`. Without it,
each tensor goes through the quantizer's `write`/`encode` and `read_values`/`decode` on its own.
With it, a client writes all segments at once (`write_run`) and the server reads a reply at once
(`fedcomp.Codec.read_run` -> `RunReply`), checks it (`RunReply.sq`) and adds a batch of replies
(`RunCodec.add_runs`) in one compiled call each. Why: the per-segment path pays tens of
microseconds of Python per tensor and reply, which dominates on models with many small tensors.
Both paths give the same payload bytes and the same sums, bit for bit.

The arrays the methods take: ``ptrs``/``ns`` (each segment's data address and element count),
``offs`` (each segment's byte offset in ``region``/``body``), ``k`` (the loaded kernels,
`fedcomp.kernels.get`), ``chunk`` (elements per step of a loop).
"""

from __future__ import annotations

import abc
from typing import ClassVar

import numpy as np
import torch

from fedcomp import kernels, uniforms
from fedcomp.base import Quantizer, blocks
from fedcomp.codecs.values import write_values
from fedcomp.errors import DecodeError
from fedcomp.wire import CHECKSUM_MISMATCH, HEADER_BYTES, TRAILER_BYTES, Writer, crc32


class RunCodec(abc.ABC):
    """The fast-path protocol a quantizer implements (a mixin beside `fedcomp.base.Quantizer`).

    Contract: every method gives the bytes, values and float64 sums of the per-segment path
    (`write_values`, `fedcomp.codecs.values.read_values`) for the same input.
    """

    crc_on_write: ClassVar[bool] = False  # write_segments can continue the payload's CRC32 as it writes
    crc_on_read: ClassVar[bool] = False  # crc_sq checks the payload's CRC32 while it sums squares

    def runs(self) -> bool:
        """Whether this configuration has the loops (kbit's entropy coding, for one, has none)."""
        return True

    @abc.abstractmethod
    def write_segments(self, k, xs: list[torch.Tensor], gen, ptrs: np.ndarray, ns: np.ndarray, offs: np.ndarray,
                       region: np.ndarray, ok: np.ndarray, fn: int = 0, crc: int = 0) -> int:
        """Write segments ``xs`` into ``region`` at ``offs`` and set ``ok[s]`` for each one written
        (the others, e.g. holding a value that is not finite, are rewritten one by one by the
        caller). ``gen(i)``: segment i's generator. With ``crc_on_write`` and ``fn`` (a CRC32
        function's address, `fedcomp.kernels.crc32_function`) nonzero, continue the payload's
        CRC32 ``crc`` over the bytes as they are written and return it; else return 0."""

    @abc.abstractmethod
    def read_run(self, body: np.ndarray, ns: np.ndarray, offs: np.ndarray, read: tuple) -> "RunReply":
        """Every segment of a reply (``body``: the payload's segments, a view), checked as
        `decode` checks them (`DecodeError`); ``read``: (codec, payload, layout, device)."""

    @abc.abstractmethod
    def run_sq(self, k, run: "RunReply", chunk: int) -> np.ndarray:
        """Per segment, the float64 sum of squares of its values (inf or NaN where one is not
        finite), summed ``chunk`` elements at a time as the per-segment check sums them."""

    @abc.abstractmethod
    def values_run(self, k, run: "RunReply", outs: np.ndarray, chunk: int) -> None:
        """A dense decode: segment s's fp32 values written to the address ``outs[s]``."""

    @abc.abstractmethod
    def add_runs(self, k, runs: list["RunReply"], w: np.ndarray, sums: np.ndarray, chunk: int) -> None:
        """Add replies ``runs`` (weights ``w``) into the float64 sums at the addresses ``sums``."""

    def round_tables(self, run: "RunReply", halves: np.ndarray) -> None:
        """Round a reply's value tables to fp16/bf16 where its segments are such tensors
        (`RunReply.set_halves`); quantizers whose values are tables (sign, twobit, terngrad)."""

    def crc_sq(self, run: "RunReply", chunk: int, fn: int, payload: bytes) -> None:
        """With ``crc_on_read``: verify the payload's CRC32 and set ``run.sums`` to
        ``(chunk, run_sq(chunk))`` in one read of the values; `DecodeError` on a mismatch."""
        raise NotImplementedError


def runs(quantizer: Quantizer, k) -> bool:
    """Whether ``quantizer`` writes runs of segments (:func:`write_run`) with the kernels ``k``
    (None: no kernels)."""
    return k is not None and isinstance(quantizer, RunCodec) and quantizer.runs()


def write_run(quantizer: RunCodec, xs: list[torch.Tensor], out: Writer, gen) -> None:
    """Write segments ``xs`` (contiguous fp32 CPU tensors of any shape, none empty) in one compiled call: the
    bytes of ``write_values`` on each in turn. ``gen(i)`` gives segment i's generator (seeded only
    where the quantizer draws from it; valid until the next ``gen`` call).

    Why: writing one segment costs about 100 us of Python beside its loops, which adds up on
    models with many small tensors. A segment the kernel refuses (a value not finite, ...) is
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
    crc = out.crc_before(place) if quantizer.crc_on_write else None
    fn = None if crc is None else kernels.crc32_function()
    if fn is not None:  # the payload's CRC continued over each part as it is written, from cache
        crc = quantizer.write_segments(k, xs, gen, ptrs, ns, offs, region, ok, fn, crc)
    else:
        quantizer.write_segments(k, xs, gen, ptrs, ns, offs, region, ok)
    for i in np.flatnonzero(~ok).tolist():
        alone = Writer(xs[i].device)
        write_values(quantizer, xs[i].reshape(-1), alone, gen(i))
        region[offs[i]:offs[i] + sizes[i]] = np.frombuffer(alone.body(), dtype=np.uint8)
    if fn is not None and ok.all():
        out.checksummed(place, crc)
    out.tensor(place)


class RunReply:
    """A reply's dense segments read at once (:meth:`fedcomp.Codec.read_run`), for the server's
    check (`sq`) and add (the quantizer's `RunCodec.add_runs`) in one compiled call each, where
    the per-segment path (`Values`) costs tens of microseconds of Python per segment and reply.

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
        (`RunCodec.round_tables`: sign's scales, the 2-bit codes' four values)."""
        self.halves = halves
        if halves.any():
            self.quantizer.round_tables(self, halves)

    def sq(self, chunk: int) -> np.ndarray:
        """Per segment, the sum of squares of its values (float64; inf or NaN where one is not
        finite), ``chunk`` elements at a time from the segment's start (the per-segment sums)."""
        if self.sums is not None and self.sums[0] == chunk:
            return self.sums[1]
        return self.quantizer.run_sq(kernels.get(), self, chunk)


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


class _BlockRuns(RunCodec):
    """Reading runs of blockwise codes (kbit, qsgd, sign): per segment ``_run_per`` fp32 parameters
    per block of ``_run_block`` elements, then codes of ``_run_bits`` bits; ``_run_kind`` names
    the per-block values in the kernels (``fedcomp._kernels.BLOCK_KBIT``, ...)."""

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
        """Codes of a chunk read from the start of its aligned unit (``fedcomp._kernels._geometry``:
        8 blocks where a segment has several, else 8 codes). (Sized by the block alone, a block
        larger than any tensor asked for block * 8 bytes: 745 GB for block=1e11.)"""
        block = self._run_block
        several = block > 0 and bool((ns > block).any())
        return kernels.scratch(chunk + 8 * (block if several else 1), np.uint8)

    def run_sq(self, k, run: RunReply, chunk: int) -> np.ndarray:
        out = np.empty(run.ns.shape[0], dtype=np.float64)
        bits = self._run_bits
        k.block_sq_run(getattr(k, self._run_kind), run.body, run.coffs, run.ns, run.p0, run.params, self._run_block,
                       bits, (1 << bits) - 1, chunk, self._run_scratch(chunk, run.ns), run.halves,
                       *_run_scratch(chunk), out)
        return out

    def values_run(self, k, run: RunReply, outs: np.ndarray, chunk: int) -> None:
        """A dense decode of ``run``: segment s's fp32 values into ``run.ns[s]`` at address outs[s]."""
        k.block_values_run(getattr(k, self._run_kind), run.body, run.coffs, run.ns, run.p0, run.params, self._run_block,
                           self._run_bits, outs, chunk, self._run_scratch(chunk, run.ns))

    def add_runs(self, k, runs: list[RunReply], w: np.ndarray, sums: np.ndarray, chunk: int) -> None:
        """Add replies ``runs`` (weights ``w``) into the float64 sums at addresses ``sums``."""
        first = runs[0]
        k.block_add_runs(getattr(k, self._run_kind), np.array([r.address for r in runs], dtype=np.int64), first.coffs,
                         first.ns, first.p0, np.stack([r.params for r in runs]), self._run_block, self._run_bits, sums,
                         w, chunk, self._run_scratch(chunk, first.ns), first.halves)


class _RawRuns(RunCodec):
    """Reading runs of raw values (none(): fp32, fp16, bf16); ``_raw_kind`` 0, 1 or 2."""

    _raw_kind = 0
    crc_on_write = crc_on_read = True

    def read_run(self, body: np.ndarray, ns: np.ndarray, offs: np.ndarray, read: tuple) -> RunReply:
        return RunReply(self, body, ns, offs, np.empty((0, 0), dtype=np.float32), np.zeros(ns.shape[0] + 1, dtype=np.int64),
                        read)

    def run_sq(self, k, run: RunReply, chunk: int) -> np.ndarray:
        out = np.empty(run.ns.shape[0], dtype=np.float64)
        k.raw_sq_run(run.body, run.coffs, run.ns, self._raw_kind, chunk, run.halves, *_run_scratch(chunk), out)
        return out

    def crc_sq(self, run: RunReply, chunk: int, fn: int, payload: bytes) -> None:
        """Verify the payload's CRC32 and compute ``run.sq(chunk)`` in one read of the values
        (``fedcomp._kernels.raw_crc_sq_run``: each part summed, then checksummed from cache; ``fn``:
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

    def values_run(self, k, run: RunReply, outs: np.ndarray, chunk: int) -> None:
        k.raw_values_run(run.body, run.coffs, run.ns, self._raw_kind, outs)

    def add_runs(self, k, runs: list[RunReply], w: np.ndarray, sums: np.ndarray, chunk: int) -> None:
        k.raw_add_runs(np.array([r.address for r in runs], dtype=np.int64), runs[0].coffs, runs[0].ns, self._raw_kind,
                       sums, w, chunk, runs[0].halves, _run_scratch(chunk)[0])


class _TernaryRuns(RunCodec):
    """Reading runs of 2-bit codes with one unused code (twobit, terngrad): ``_bad`` the unused
    code and its message; ``_tables(body, ns, offs)`` -> (code offsets, fp32 value per code per
    segment)."""

    def read_run(self, body: np.ndarray, ns: np.ndarray, offs: np.ndarray, read: tuple) -> RunReply:
        coffs, table = self._tables(body, ns, offs)
        bad, message = self._bad
        if kernels.get().ternary_bad_run(body, coffs, ns, bad) >= 0:
            raise DecodeError(message)
        return RunReply(self, body, ns, coffs, table, np.zeros(ns.shape[0] + 1, dtype=np.int64), read)

    def run_sq(self, k, run: RunReply, chunk: int) -> np.ndarray:
        out = np.empty(run.ns.shape[0], dtype=np.float64)
        k.ternary_sq_run(run.body, run.coffs, run.ns, run.params, chunk, out)
        return out

    def round_tables(self, run: RunReply, halves: np.ndarray) -> None:
        """Every value is one of its segment's four: a half segment's row rounded once."""
        _round_by(run.params, halves[:, None])

    def values_run(self, k, run: RunReply, outs: np.ndarray, chunk: int) -> None:
        k.ternary_values_run(run.body, run.coffs, run.ns, run.params, outs, chunk, kernels.scratch(chunk + 4, np.uint8))

    def add_runs(self, k, runs: list[RunReply], w: np.ndarray, sums: np.ndarray, chunk: int) -> None:
        k.ternary_add_runs(np.array([r.address for r in runs], dtype=np.int64), runs[0].coffs, runs[0].ns,
                           np.stack([r.params for r in runs]), sums, w, chunk, kernels.scratch(chunk + 4, np.uint8))


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
