"""Codecs built from spec strings: encode named tensors to bytes, decode bytes to named tensors.

Data path of one encode: float tensors are flattened to fp32 and cut into *segments* (one per
tensor, or one over all float tensors for a global reducer); per segment the reducer turns the
segment into fewer values and writes its side information (positions...), and the quantizer
codes the values. Non-float tensors travel raw (exact).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp import codecs as _codecs  # noqa: F401  (registers the built-in codecs)
from fedcomp.base import REGISTRY, Quantizer, Reducer, Segment, Selector, StageContext
from fedcomp.errors import DecodeError, FedcompError, SpecError
from fedcomp.layout import MAX_NUMEL, Layout
from fedcomp.pieces import Pieces
from fedcomp import kernels
from fedcomp.codecs.flat import Flat
from fedcomp.codecs.fastpath import HALF_CODES, RunCodec, runs, write_run
from fedcomp.codecs.values import read_values, write_values
from fedcomp.spec import parse_spec
from fedcomp.wire import OVERHEAD_BYTES, Reader, Writer, arena, header, open_payload, output_empty, output_like

_MASK64 = (1 << 64) - 1
DECODE_CHUNK = 1 << 20  # elements per step of a run decode (aggregate.CHUNK's)
# elements of one flat encode buffer (Codec._write_flat): 16 MB of fp32 on the CPU, where a
# model-sized set of temporaries costs page faults and memory; a GPU takes larger ones
FLAT_CHUNK = 1 << 22
FLAT_CHUNK_DEVICE = 1 << 26


def derive_nonce(*parts: int) -> int:
    """A 64-bit nonce from integers such as (run seed, round, node id)."""
    data = b"".join(int(p).to_bytes(16, "little", signed=True) for p in parts)
    return int.from_bytes(zlib.crc32(data).to_bytes(4, "little") + zlib.adler32(data).to_bytes(4, "little"), "little")


@dataclass(frozen=True)
class Encoded:
    """One encoded update: the bytes and what the decoder will reconstruct from them.

    ``decoded`` is built on first access (a :class:`LazyDecoded` from :meth:`Codec.encode`): an
    encode that only needs the bytes never pays for a dense reconstruction, and error feedback
    (:func:`fedcomp.compress`) subtracts a sparsifier's kept values from the residual in place.
    """

    payload: bytes
    decoded: Mapping[str, torch.Tensor]  # exactly what Codec.decode(payload) returns
    kept: tuple[int, ...]  # values sent per segment (kept elements, sketch cells, factor entries)
    index_bytes: tuple[int, ...]  # bytes of each segment's side information (positions...)


class LazyDecoded(Mapping):
    """The decoded tensors of an encode, built when first read.

    Sparsifier codecs keep (positions, decoded values) per segment and build a tensor as zeros
    plus a scatter; other codecs decode their own payload once, on first access. Either way the
    tensors equal ``Codec.decode(payload)``'s.
    """

    def __init__(self, layout: Layout, build, sparse, exact: dict[str, torch.Tensor]) -> None:
        self._layout = layout
        self._build = build  # () -> dict of every tensor (dense codecs), or None
        self._sparse = sparse  # name -> (global positions, values, start of the tensor), or None
        self._cache = dict(exact)  # raw (non-float) tensors, copied at encode time

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is not None:
            return t
        if self._sparse is None:
            if name not in self._layout.names:
                raise KeyError(name)
            self._cache.update(self._build())
            return self._cache[name]
        idx, vals, start = self._kept(name)
        spec = self._layout.tensors[self._layout.names.index(name)]
        y = torch.zeros(spec.numel, dtype=torch.float32, device=vals.device)
        y[idx - start if start else idx] = vals
        t = self._cache[name] = y.view(spec.shape).to(spec.torch_dtype)
        return t

    def _kept(self, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(segment-global positions, values, the tensor's start) of a tensor's kept elements:
        its slice of the segment's, cut here (when asked for) rather than at encode time."""
        idx, vals, start, *cut = self._sparse[name]
        if cut:
            lo, hi = cut
            idx, vals = idx[lo:hi], vals[lo:hi]
        return idx, vals, start

    def __iter__(self):
        return iter(self._layout.names)

    def __len__(self) -> int:
        return len(self._layout.names)

    def subtract_(self, name: str, target: torch.Tensor) -> torch.Tensor:
        """``target -= decoded[name]`` in place (target: a float tensor of the tensor's shape)."""
        if self._sparse is None or name in self._cache:
            return target.sub_(self[name].to(target.device, target.dtype))
        idx, vals, start = self._kept(name)
        flat = target.view(-1)
        local = idx - start if start else idx
        flat[local] = flat[local] - vals.to(target.device, target.dtype)
        return target


class Codec:
    """A parsed spec: an optional reducer (sparsifier, sketch, low rank) followed by a quantizer.

    Parameters
    ----------
    spec : str
        e.g. ``"none()"``, ``"kbit(bits=8)"``, ``"topk(ratio=0.01)+qsgd(bits=4)"``.
    """

    def __init__(self, spec: str) -> None:
        stages = [_build_stage(stage.name, dict(stage.args)) for stage in parse_spec(spec)]
        kinds = [s.kind for s in stages]
        if kinds not in (["quantizer"], ["reducer"], ["reducer", "quantizer"]):
            raise SpecError(
                f"codec spec {spec!r} chains {' + '.join(s.name for s in stages)}; a codec is one quantizer, "
                f"one sparsifier/reducer, or a reducer followed by a quantizer (e.g. 'topk(ratio=0.01)+qsgd(bits=4)')"
            )
        self.reducer: Reducer | None = stages[0] if kinds[0] == "reducer" else None  # type: ignore[assignment]
        self.quantizer: Quantizer = stages[-1] if kinds[-1] == "quantizer" else self.reducer.default_quantizer()  # type: ignore[union-attr,assignment]
        self.spec = "+".join(s.canonical() for s in stages)
        self.fingerprint = zlib.crc32(self.spec.encode())
        # payloads carry the newest format a stage writes; older formats of it still decode
        self.wire_version = max(s.wire_version for s in stages)
        self._layouts: dict[Layout, tuple] = {}  # _per_layout() of recent layouts

    @property
    def selector(self) -> Reducer | None:
        """The reducer stage (kept under its first name: every sparsifier is one)."""
        return self.reducer

    # -- traits -----------------------------------------------------------------------------
    @property
    def unbiased(self) -> bool:
        """E[decode(encode(x))] == x."""
        return bool(self.quantizer.unbiased and (self.reducer is None or self.reducer.unbiased))

    @property
    def lossless(self) -> bool:
        """Exact for fp32, fp16 and bf16 tensors (values travel as fp32 at most: float64 is rounded)."""
        return self.reducer is None and self.quantizer.name == "none"

    @property
    def linear(self) -> bool:
        """Encoded values of several updates may be summed before decoding (sketches)."""
        return bool(self.reducer is not None and self.reducer.linear and self.quantizer.name == "none")

    @property
    def takes_error_feedback(self) -> bool:
        """Error feedback applies: False where a stage scales its decoded values up (rescaled random-k)."""
        return bool((self.reducer is None or self.reducer.feedback) and self.quantizer.feedback)

    @property
    def needs_error_feedback(self) -> bool:
        """Biased codecs converge only with error feedback."""
        return not self.unbiased

    def __repr__(self) -> str:
        return f"Codec({self.spec!r})"

    # -- segments ---------------------------------------------------------------------------
    def segments(self, layout: Layout) -> list[tuple[Segment, tuple[int, ...]]]:
        """The payload's segments, each with the layout positions of its tensors (kept for the
        last few layouts: ~0.5 ms to build for a ResNet-50's 161 tensors, every encode and decode)."""
        return list(self._per_layout(layout)[0])

    def _per_layout(self, layout: Layout) -> tuple[tuple, int | None]:
        """(:meth:`_segments`, :meth:`_dense_size`) of ``layout``, kept for the last 8 layouts."""
        found = self._layouts.get(layout)
        if found is None:
            segments = tuple(self._segments(layout))
            if len(self._layouts) >= 8:
                self._layouts.clear()
            found = self._layouts[layout] = (segments, self._dense_size(layout, list(segments)))
        return found

    def _segments(self, layout: Layout) -> list[tuple[Segment, tuple[int, ...]]]:
        floats = [i for i, t in enumerate(layout.tensors) if t.is_float]
        if self.reducer is not None and self.reducer.scope == "global":
            groups = [tuple(floats)] if floats else []
        else:
            groups = [(i,) for i in floats]
        return [
            (Segment(j, tuple(layout.tensors[i].name for i in g), tuple(layout.tensors[i].shape for i in g),
                     sum(layout.tensors[i].numel for i in g)), g)
            for j, g in enumerate(groups)
        ]

    # -- sizes ------------------------------------------------------------------------------
    def size_bytes(
        self, layout: Layout, kept: tuple[int, ...] | None = None, index_bytes: tuple[int, ...] | None = None
    ) -> int:
        """Exact encoded size. ``kept``/``index_bytes`` are needed only where they depend on the
        data (threshold selection, Rice-coded indices): pass ``Encoded.kept``/``Encoded.index_bytes``.
        """
        return self._size(layout, self.segments(layout), kept, index_bytes)

    def _size(self, layout: Layout, segments, kept, index_bytes) -> int:
        """:meth:`size_bytes` for ``segments`` (``self.segments(layout)``, computed by the caller)."""
        total = OVERHEAD_BYTES + sum(t.numel * t.torch_dtype.itemsize for t in layout.tensors if not t.is_float)
        for j, (seg, _) in enumerate(segments):
            if self.reducer is None:
                total += self.quantizer.nbytes(seg.numel)
                continue
            k = kept[j] if kept is not None else self.reducer.count(seg)
            side = index_bytes[j] if index_bytes is not None else self.reducer.side_nbytes(seg, k or 0)
            if k is None or side is None:
                raise ValueError(f"size of {self.spec} depends on the data; pass kept= and index_bytes= from encode")
            total += side + self.quantizer.nbytes(k)
        return total

    # -- encode -----------------------------------------------------------------------------
    def encode(
        self,
        tensors: Mapping[str, torch.Tensor],
        nonce: int = 0,
        *,
        round: int = 0,
        state: dict[str, torch.Tensor] | None = None,
    ) -> Encoded:
        """Encode named tensors on their device; only the final bytes are copied to the host.

        ``state`` is the client's codec state (e.g. PowerSGD's warm-start factors), updated in
        place; ``round`` drives schedules such as DGC's warm-up.
        """
        layout = Layout.of(tensors)
        values = list(tensors.values())
        device = values[0].device if values else torch.device("cpu")
        ctx = StageContext(nonce & _MASK64, round, state)
        kept_segments, dense_size = self._per_layout(layout)
        segments = list(kept_segments)
        out = Writer(device, dense_size,
                     head=header(layout.fingerprint(), self.fingerprint, ctx.nonce, self.wire_version))
        sparse = self._sparse_expand
        kept_values: dict[str, tuple[torch.Tensor, torch.Tensor, int]] | None = {} if sparse else None
        kept, side_bytes = [], []
        # Pieces on the CPU (no model-sized copy); elsewhere one concatenated tensor, whose scans
        # are a few ops and syncs in all rather than some per tensor
        pieces_ok = getattr(self.reducer, "accepts_pieces", False) and device.type == "cpu"
        # segments wait to go to the quantizer's compiled loop together (write_run), in order
        run: list[tuple[int, torch.Tensor]] | None = \
            [] if self.reducer is None and device.type == "cpu" and runs(self.quantizer, kernels.for_encode()) else None
        if run is None and self.reducer is None and self._write_flat(values, segments, out, ctx, device):
            kept, side_bytes, segments = [seg.numel for seg, _ in segments], [0] * len(segments), []
        elif self.reducer is not None and (done := self._reduce_flat(values, segments, out, ctx, device)) is not None:
            kept, side_bytes, segments = done, [0] * len(segments), []
        for seg, group in segments:
            t = values[group[0]] if run is not None and len(group) == 1 else None
            if t is not None and t.dtype == torch.float32 and t.is_cpu and not t.requires_grad and t.is_contiguous() \
                    and not t.is_neg() and seg.numel:  # the common case, quickly (~4 us a tensor less)
                x = t  # its own shape, into the run below: write_run reads contiguous tensors of any shape
            else:
                parts = [_flat_view(values[i]) for i in group]  # views where contiguous
                # a half / float64 tensor's fp32 copy in huge pages where large (a fresh torch
                # tensor faults page by page)
                parts = [p if p.dtype == torch.float32 else output_like(p, torch.float32).copy_(p) for p in parts]
                if len(parts) == 1:
                    x = parts[0]
                elif pieces_ok:
                    x = Pieces(parts)
                else:
                    x = torch.cat(parts)
            if run is not None:
                if seg.numel and x.is_cpu and x.is_contiguous() and not x.requires_grad:  # (a tensor on
                    # another device than the first is written its own way, as without the kernels)
                    run.append((seg.index, x))
                    kept.append(seg.numel)
                    side_bytes.append(0)
                    continue
                self._write_run(run, out, ctx, device)
            # a CPU generator on every device: its stream keys are the ones the CPU draws (a CUDA
            # generator's Philox stream gives others: other roundings, other bytes on a GPU)
            gen = ctx.generator(seg.index, "cpu")
            if self.reducer is None:
                write_values(self.quantizer, x, out, gen)
                kept.append(seg.numel)
                side_bytes.append(0)
            else:
                vals, aux, side = self.reducer.reduce(x, seg, out, ctx)
                if sparse:
                    y = self.quantizer.encode(vals, out, gen)  # k values: cheap to reconstruct here
                    self._keep_sparse(aux, y, group, layout, kept_values)
                else:
                    write_values(self.quantizer, vals, out, gen)
                kept.append(vals.numel())
                side_bytes.append(side)
            out.flush()  # on CUDA: this segment's bytes go to the host while the next one encodes
        if run:
            self._write_run(run, out, ctx, device)
        exact = {}
        for i, spec in enumerate(layout.tensors):
            if not spec.is_float:
                out.tensor(values[i])
                exact[spec.name] = values[i].detach().clone()
        payload = out.getvalue(layout.fingerprint(), self.fingerprint, ctx.nonce, self.wire_version)
        decode = None if sparse else (lambda: self.decode(payload, layout, device, round=round))
        return Encoded(payload, LazyDecoded(layout, decode, kept_values, exact), tuple(kept), tuple(side_bytes))

    def _write_flat(self, values: list[torch.Tensor], segments, out: Writer, ctx: StageContext,
                    device: torch.device) -> bool:
        """Write every segment as one flat buffer (:mod:`fedcomp.codecs.flat`: a constant number of
        torch ops per encode, where the per-segment path costs dozens a tensor), where the quantizer
        can (``flat()``) and every float tensor is on ``device``; False: nothing was written."""
        q = self.quantizer
        if not (hasattr(q, "write_flat") and q.flat()):
            return False
        picked = [(seg, group[0]) for seg, group in segments if seg.numel]
        if not picked or any(values[i].device != device for _, i in picked):
            return False
        _flat_write(q, [(seg.index, _flat_view(values[i])) for seg, i in picked], out, ctx, device)
        return True

    def _reduce_flat(self, values: list[torch.Tensor], segments, out: Writer, ctx: StageContext,
                     device: torch.device) -> list[int] | None:
        """A reducer that writes no side information (``values_only``: PowerSGD) and a quantizer
        with a flat encode: every segment reduced (``reduce_many``: same-shape matrices batched
        off the CPU), then all their values quantized as one flat buffer; the values counted per
        segment. None: nothing was written (the per-segment loop takes it)."""
        r, q = self.reducer, self.quantizer
        if not (getattr(r, "values_only", False) and hasattr(q, "write_flat") and q.flat()):
            return None
        if any(values[g[0]].device != device for _, g in segments):
            return None
        xs = []
        for _, group in segments:
            x = _flat_view(values[group[0]])
            xs.append(x if x.dtype == torch.float32 else x.to(torch.float32))
        vals = r.reduce_many(xs, [seg for seg, _ in segments], ctx)
        _flat_write(q, [(seg.index, v) for (seg, _), v in zip(segments, vals) if v.numel()], out, ctx, device)
        return [v.numel() for v in vals]

    def _write_run(self, run: list[tuple[int, torch.Tensor]], out: Writer, ctx: StageContext,
                   device: torch.device) -> None:
        """Write the waiting small segments (segment index, values) in one call; empty the list."""
        if run:
            write_run(self.quantizer, [x for _, x in run], out, ctx.generators([j for j, _ in run], device))
            run.clear()

    def _dense_size(self, layout: Layout, segments) -> int | None:
        """The payload's size where it does not depend on the data (no reducer, fixed-width
        codes), else None: the writer then builds the payload in place (:meth:`Writer.empty`)."""
        if self.reducer is not None:
            return None
        try:
            return self._size(layout, segments, None, None)
        except ValueError:  # entropy-coded values
            return None

    @property
    def _sparse_expand(self) -> bool:
        """A selector whose dense form is "decoded values at the kept positions, zero elsewhere"."""
        return isinstance(self.reducer, Selector) and type(self.reducer).expand is Selector.expand

    @staticmethod
    def _keep_sparse(idx: torch.Tensor, y: torch.Tensor, group: tuple[int, ...], layout: Layout, into: dict) -> None:
        """Split a segment's (sorted positions, values) per tensor, positions still segment-global."""
        if len(group) == 1:
            into[layout.tensors[group[0]].name] = (idx, y, 0)
            return
        starts, offset = [], 0
        for i in group:
            starts.append(offset)
            offset += layout.tensors[i].numel
        if idx.device.type == "cpu" and not idx.requires_grad:  # numpy: no torch op
            cuts = np.searchsorted(idx.numpy(), np.array(starts + [offset], dtype=np.int64)).tolist()
        else:
            cuts = torch.searchsorted(idx, torch.tensor(starts + [offset], device=idx.device)).tolist()
        for j, i in enumerate(group):  # sliced when read (LazyDecoded._kept): no op per tensor here
            into[layout.tensors[i].name] = (idx, y, starts[j], cuts[j], cuts[j + 1])

    @staticmethod
    def _split(y: torch.Tensor, group: tuple[int, ...], layout: Layout, out: list) -> None:
        offset = 0
        for i in group:
            spec = layout.tensors[i]
            v = y[offset:offset + spec.numel].view(spec.shape)
            # another dtype (fp16, bf16, float64): converted into huge pages where large (output_like)
            out[i] = v if v.dtype == spec.torch_dtype else output_like(v, spec.torch_dtype).copy_(v)
            offset += spec.numel

    # -- decode -----------------------------------------------------------------------------
    def decode(
        self, payload: bytes, layout: Layout, device: torch.device | str = "cpu", *, round: int = 0
    ) -> dict[str, torch.Tensor]:
        """Decode a payload for ``layout``.

        Raises
        ------
        DecodeError
            For every malformed payload (and nothing else): truncated, corrupted, another
            version, layout or codec, or any length, count or index inconsistent with the layout.
        """
        return self._decode(payload, layout, torch.device(device), round, expand=True)

    def decode_values(self, payload: bytes, layout: Layout, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """The reducer's values per segment, before expansion (for linear codecs: sum, then expand)."""
        return self._decode(payload, layout, torch.device(device), 0, expand=False)

    def decode_parts(self, payload: bytes, layout: Layout, device: torch.device | str = "cpu", *, round: int = 0,
                     lazy: bool = False):
        """Read and check a whole payload without expanding it (what :meth:`decode` reads before it
        builds dense tensors): ``([(segment, layout positions, aux, values)], {position: raw tensor})``
        where ``aux`` is the reducer's side information (a selector's kept positions).

        ``lazy=True``: ``values`` are :class:`fedcomp.codecs.values.Values`, read and checked but not
        dequantized (built range by range on demand: ``values.chunk(lo, hi)``, ``values.dense()``),
        so a reply can be added to a sum without a dense copy of it."""
        return self._decode(payload, layout, torch.device(device), round, expand=None, lazy=lazy)

    def read_run(self, payload: bytes, layout: Layout, device: torch.device | str = "cpu", *,
                 sq_chunk: int | None = None):
        """Read and length-check a whole payload of a quantizer that reads runs
        (:class:`fedcomp.codecs.fastpath.RunReply`: every segment at once, for the server's compiled
        check and add), or None where this codec, device or machine reads segment by segment
        (:meth:`decode_parts`). Returns ``(run, {position: raw tensor})``; raises
        :class:`DecodeError` as :meth:`decode` does.

        ``sq_chunk``: also compute the run's sums of squares (``run.sq(sq_chunk)``) here, where
        the quantizer can while it checksums the payload (raw values: one read of the values
        from memory instead of two); the checksum is verified before this returns, either way."""
        device = torch.device(device)
        q = self.quantizer
        if self.reducer is not None or device.type != "cpu" or not runs(q, kernels.get()):
            return None
        check_decodable(layout)
        fused = None
        if sq_chunk is not None and q.crc_on_read:
            fused = kernels.crc32_function()
        versions = tuple(range(1, self.wire_version + 1))
        try:
            src, _ = open_payload(payload, layout.fingerprint(), self.fingerprint, versions, check_crc=fused is None)
            ns = np.array([t.numel for t in layout.tensors if t.is_float], dtype=np.int64)
            sizes = np.fromiter((q.nbytes(n) for n in ns.tolist()), dtype=np.int64, count=ns.shape[0])
            offs = np.zeros(ns.shape[0], dtype=np.int64)
            np.cumsum(sizes[:-1], out=offs[1:])
            body = src.take(int(sizes.sum())).numpy()
            raw = {i: src.tensor(spec.numel, spec.torch_dtype) for i, spec in enumerate(layout.tensors)
                   if not spec.is_float}
            src.finish()
            run = q.read_run(body, ns, offs, (self, payload, layout, device))
            halves = np.fromiter((HALF_CODES.get(t.torch_dtype, 0) for t in layout.tensors if t.is_float),
                                 dtype=np.int64, count=ns.shape[0])
            run.set_halves(halves)
        except DecodeError:
            if fused is not None:  # what is wrong with a corrupted payload is its checksum
                open_payload(payload, layout.fingerprint(), self.fingerprint, versions)
            raise
        if fused is not None:
            q.crc_sq(run, sq_chunk, fused, payload)
        return run, raw

    def expand(self, values: list[torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
        """Dense tensors from per-segment values (e.g. a sum of sketches)."""
        if self.reducer is None:
            raise ValueError(f"{self.spec} has no reducer to expand")
        decoded: list[torch.Tensor | None] = [None] * len(layout.tensors)
        for (seg, group), vals in zip(self.segments(layout), values):
            self._split(self.reducer.expand(vals, None, seg), group, layout, decoded)
        return {name: t for name, t in zip(layout.names, decoded) if t is not None}  # type: ignore[misc]

    def _decode(self, payload, layout, device, round, expand, lazy=False):
        check_decodable(layout)
        carve = expand and not lazy and torch.device(device).type == "cpu" \
            and all(t.torch_dtype == torch.float32 for t in layout.tensors if t.is_float)
        k = kernels.for_encode() if carve and self.reducer is None else None  # (a client's decode imports no numba)
        try:
            if k is not None and isinstance(self.quantizer, RunCodec):
                got = self.read_run(payload, layout, device)
                if got is not None:
                    return self._decode_run(k, *got, layout)
            src, nonce = open_payload(payload, layout.fingerprint(), self.fingerprint,
                                      tuple(range(1, self.wire_version + 1)))
            with arena(0):  # nothing from a caller's arena (a lazy decode inside compress()'s scope)
                return self._decode_body(src, StageContext(nonce, round), layout, device, expand, lazy, carve)
        except FedcompError:
            raise
        except (RuntimeError, ValueError, IndexError, OverflowError) as exc:  # defence in depth: fuzzing finds none
            raise DecodeError(f"malformed payload: {exc}") from exc

    def _decode_run(self, k, run, raw: dict[int, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
        """A dense decode of an fp32 model read as a run (:meth:`read_run`: read and checked before
        anything model-sized is allocated): every float tensor's values in one compiled call, into
        one allocation (:class:`fedcomp.wire.arena`), the values the per-segment decode gives.

        Why: the per-segment decode costs tens of microseconds of Python a tensor, which adds up on
        models with many tensors (see the docs' Results: performance)."""
        floats = [t.numel for t in layout.tensors if t.is_float]
        with arena(0), arena.fp32(floats):
            outs = [output_empty(n) for n in floats]
        self.quantizer.values_run(k, run, np.fromiter((o.data_ptr() for o in outs), dtype=np.int64, count=len(outs)),
                                  DECODE_CHUNK)
        made = iter(outs)
        return {spec.name: (next(made) if spec.is_float else raw[i]).view(spec.shape)
                for i, spec in enumerate(layout.tensors)}

    def _decode_body(self, src: Reader, ctx: StageContext, layout: Layout, device: torch.device, expand: bool,
                     lazy: bool = False, carve: bool = False):
        # Two passes: read and check the whole body first (every length against the layout,
        # no trailing bytes), and only then build the dense tensors, so a malformed payload
        # never costs a model-sized allocation.
        # ``carve`` (a dense decode of an fp32 model on the CPU): the tensors are carved out of one
        # allocation (wire.arena: a buffer per tensor was mapped afresh on every decode), where
        # they are made: a quantizer's values as they are read, a reducer's dense forms as they
        # are expanded (its kept values are scratch, and go where they went)
        # (an empty list: an arena of 0 bytes, which carves nothing)
        floats = [t.numel for t in layout.tensors if t.is_float] if carve else []
        read = []
        values = (lambda n: read_values(self.quantizer, src, n, device)) if lazy else (
            lambda n: self.quantizer.decode(src, n, device))
        with arena.fp32(floats if self.reducer is None else []):
            for seg, group in self.segments(layout):
                if self.reducer is None:
                    read.append((seg, group, None, values(seg.numel)))
                else:
                    aux = self.reducer.read(src, seg, ctx, device)
                    read.append((seg, group, aux, values(self.reducer.value_count(aux, seg))))
        raw = {i: src.tensor(spec.numel, spec.torch_dtype) for i, spec in enumerate(layout.tensors) if not spec.is_float}
        src.finish()
        if expand is None:
            return read, raw
        if not expand:
            return [vals for _, _, _, vals in read]
        decoded: list[torch.Tensor | None] = [None] * len(layout.tensors)
        with arena.fp32(floats if self.reducer is not None else []):
            for seg, group, aux, vals in read:
                y = vals if self.reducer is None else self.reducer.expand(vals, aux, seg)
                self._split(y, group, layout, decoded)
        for i, t in raw.items():
            decoded[i] = t.view(layout.tensors[i].shape).to(device)
        return {name: t for name, t in zip(layout.names, decoded)}  # type: ignore[misc]


def _flat_write(q: Quantizer, items: list[tuple[int, torch.Tensor]], out: Writer, ctx: StageContext,
                device: torch.device) -> None:
    """Write segments ``items`` ((segment index, flat values), in payload order, none empty) with
    the quantizer's flat encode, in buffers of at most FLAT_CHUNK elements: the ops grow with the
    update's size over the chunk, not with its tensors. A segment larger than a chunk is written
    on its own (the quantizer steps through it in chunk-sized temporaries, as before)."""
    limit = FLAT_CHUNK if device.type == "cpu" else FLAT_CHUNK_DEVICE
    align = getattr(q, "flat_align", 8)
    group: list[tuple[int, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        if group:
            q.write_flat(Flat([x for _, x in group], device, align), [j for j, _ in group], out, ctx)
            group.clear()
            out.flush()  # on CUDA: these bytes go to the host while the next buffer encodes

    for j, x in items:
        n = x.numel()
        if n > limit:
            flush()
            size = 0
            write_values(q, x if x.dtype == torch.float32 else x.to(torch.float32), out, ctx.generator(j, "cpu"))
            continue
        if size + n > limit:
            flush()
            size = 0
        group.append((j, x))
        size += n
    flush()


def _flat_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat tensor in the fewest torch ops (a view where contiguous: one op)."""
    if t.requires_grad:
        t = t.detach()
    if t.is_neg():
        t = t.resolve_neg()
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def check_decodable(layout: Layout, max_numel: int = MAX_NUMEL) -> None:
    """Refuse, before reading a byte, a layout whose dense tensors no decoder should allocate."""
    if layout.numel > max_numel:
        raise DecodeError(f"layout of {layout.numel} elements exceeds the decoder's limit of {max_numel} elements")


def _build_stage(name: str, args: dict):
    cls = REGISTRY.get(name)
    if cls is None:
        raise SpecError(f"unknown codec {name!r}; available: {', '.join(c.signature() for c in REGISTRY.values())}")
    return cls.from_args(args)


def cross_device_spec(spec: str) -> str:
    """``spec`` with each stage's ``cross_device`` defaults (see :mod:`fedcomp.base`), canonical;
    ``spec`` itself when no stage takes any. A stage takes them as a set, where the spec writes none
    of them: ``topk()`` becomes ``topk(ratio=0.1,...)``, ``topk(ratio=0.01)`` stays as written.

    For runs where each client takes part now and then (cross-device): what a biased codec keeps
    on the client is many rounds stale when its client comes back, and the defaults for
    every-round participation lose several points there (see the docs' Spec grammar: cross-device
    defaults).
    """
    stages = parse_spec(spec)
    filled = []
    for stage in stages:
        written = dict(stage.args)
        cls = REGISTRY.get(stage.name)
        cross = getattr(cls, "cross_device", {})
        extra = {} if set(cross) & set(written) else dict(cross)
        filled.append((stage.name, {**written, **extra}, bool(extra)))
    if not any(changed for _, _, changed in filled):
        return spec
    return "+".join(_build_stage(name, args).canonical() for name, args, _ in filled)


def available_codecs() -> dict[str, str]:
    """Spec name -> signature with defaults, for every registered stage."""
    return {name: cls.signature() for name, cls in REGISTRY.items()}
