"""Codecs built from spec strings: encode named tensors to bytes, decode bytes to named tensors.

Data path of one encode: float tensors are flattened to fp32 and cut into *segments* (one per
tensor, or one over all float tensors for a global selector); per segment the selector writes
its index stream and the quantizer the kept values. Non-float tensors travel raw (exact).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedcomp import quantizers as _quantizers  # noqa: F401  (registers the quantizers)
from fedcomp import sparsifiers as _sparsifiers  # noqa: F401  (registers the selectors)
from fedcomp.base import REGISTRY, Quantizer, Selector
from fedcomp.errors import DecodeError, FedcompError, SpecError
from fedcomp.layout import Layout
from fedcomp.spec import parse_spec
from fedcomp.wire import OVERHEAD_BYTES, Reader, Writer, open_payload

_MASK64 = (1 << 64) - 1


def derive_nonce(*parts: int) -> int:
    """A 64-bit nonce from integers such as (run seed, round, node id)."""
    data = b"".join(int(p).to_bytes(16, "little", signed=True) for p in parts)
    return int.from_bytes(zlib.crc32(data).to_bytes(4, "little") + zlib.adler32(data).to_bytes(4, "little"), "little")


def _generator(nonce: int, segment: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((nonce * 0x9E3779B97F4A7C15 + segment + 1) & ((1 << 63) - 1))
    return gen


@dataclass(frozen=True)
class Encoded:
    """One encoded update: the bytes and what the decoder will reconstruct from them."""

    payload: bytes
    decoded: dict[str, torch.Tensor]  # exactly what Codec.decode(payload) returns
    kept: tuple[int, ...]  # elements sent per segment
    index_bytes: tuple[int, ...]  # bytes of each segment's index stream


@dataclass(frozen=True)
class _Segment:
    tensors: tuple[int, ...]  # positions in the layout
    numel: int


class Codec:
    """A parsed spec: an optional selector followed by a quantizer.

    Parameters
    ----------
    spec : str
        e.g. ``"none()"``, ``"kbit(bits=8)"``, ``"topk(ratio=0.01)+qsgd(bits=4)"``.
    """

    def __init__(self, spec: str) -> None:
        stages = [_build_stage(stage.name, dict(stage.args)) for stage in parse_spec(spec)]
        kinds = [s.kind for s in stages]
        if kinds not in (["quantizer"], ["selector"], ["selector", "quantizer"]):
            raise SpecError(
                f"codec spec {spec!r} chains {' + '.join(s.name for s in stages)}; a codec is one quantizer, "
                f"one selector, or a selector followed by a quantizer (e.g. 'topk(ratio=0.01)+qsgd(bits=4)')"
            )
        self.selector: Selector | None = stages[0] if kinds[0] == "selector" else None  # type: ignore[assignment]
        self.quantizer: Quantizer = stages[-1] if kinds[-1] == "quantizer" else self.selector.default_quantizer()  # type: ignore[union-attr,assignment]
        self.spec = "+".join(s.canonical() for s in stages)
        self.fingerprint = zlib.crc32(self.spec.encode())

    # -- traits -----------------------------------------------------------------------------
    @property
    def unbiased(self) -> bool:
        """E[decode(encode(x))] == x."""
        return bool(self.quantizer.unbiased and (self.selector is None or self.selector.unbiased))

    @property
    def lossless(self) -> bool:
        """Exact for fp32, fp16 and bf16 tensors (values travel as fp32 at most: float64 is rounded)."""
        return self.selector is None and self.quantizer.name == "none"

    @property
    def needs_error_feedback(self) -> bool:
        """Biased codecs converge only with error feedback."""
        return not self.unbiased

    def __repr__(self) -> str:
        return f"Codec({self.spec!r})"

    # -- segments ---------------------------------------------------------------------------
    def _segments(self, layout: Layout) -> list[_Segment]:
        floats = [i for i, t in enumerate(layout.tensors) if t.is_float]
        if self.selector is not None and self.selector.scope == "global":
            return [_Segment(tuple(floats), sum(layout.tensors[i].numel for i in floats))] if floats else []
        return [_Segment((i,), layout.tensors[i].numel) for i in floats]

    # -- sizes ------------------------------------------------------------------------------
    def size_bytes(
        self, layout: Layout, kept: tuple[int, ...] | None = None, index_bytes: tuple[int, ...] | None = None
    ) -> int:
        """Exact encoded size. ``kept``/``index_bytes`` are needed only where they depend on the
        data (threshold selection, Rice-coded indices): pass ``Encoded.kept``/``Encoded.index_bytes``.
        """
        segments = self._segments(layout)
        total = OVERHEAD_BYTES + sum(t.numel * t.torch_dtype.itemsize for t in layout.tensors if not t.is_float)
        for j, seg in enumerate(segments):
            if self.selector is None:
                total += self.quantizer.nbytes(seg.numel)
                continue
            k = kept[j] if kept is not None else self.selector.count(seg.numel)
            ib = index_bytes[j] if index_bytes is not None else self.selector.index_nbytes(seg.numel, k or 0)
            if k is None or ib is None:
                raise ValueError(f"size of {self.spec} depends on the data; pass kept= and index_bytes= from encode")
            total += ib + self.quantizer.nbytes(k)
        return total

    # -- encode -----------------------------------------------------------------------------
    def encode(self, tensors: Mapping[str, torch.Tensor], nonce: int = 0) -> Encoded:
        """Encode named tensors on their device; only the final bytes are copied to the host."""
        layout = Layout.of(tensors)
        values = list(tensors.values())
        device = values[0].device if values else torch.device("cpu")
        out = Writer(device)
        decoded: list[torch.Tensor | None] = [None] * len(values)
        kept, index_bytes = [], []
        for j, seg in enumerate(self._segments(layout)):
            x = torch.cat([values[i].detach().reshape(-1).float() for i in seg.tensors]) if seg.tensors else torch.empty(0)
            gen = _generator(nonce, j, device)
            if self.selector is None:
                y = self.quantizer.encode(x, out, gen)
                kept.append(seg.numel)
                index_bytes.append(0)
            else:
                idx = self.selector.select(x, _generator(nonce, j, torch.device("cpu")))
                index_bytes.append(self.selector.write_indices(idx, seg.numel, out))
                scale = self.selector.scale(seg.numel, idx.numel())
                vals = x[idx] * scale if scale != 1.0 else x[idx]
                y = torch.zeros_like(x)
                y[idx] = self.quantizer.encode(vals, out, gen)
                kept.append(idx.numel())
            self._split(y, seg, layout, decoded)
        for i, spec in enumerate(layout.tensors):
            if not spec.is_float:
                out.tensor(values[i])
                decoded[i] = values[i].detach().clone()
        payload = out.getvalue(layout.fingerprint(), self.fingerprint, nonce & _MASK64)
        named = {name: t for name, t in zip(layout.names, decoded)}  # type: ignore[misc]
        return Encoded(payload, named, tuple(kept), tuple(index_bytes))

    @staticmethod
    def _split(y: torch.Tensor, seg: _Segment, layout: Layout, out: list) -> None:
        offset = 0
        for i in seg.tensors:
            spec = layout.tensors[i]
            out[i] = y[offset:offset + spec.numel].view(spec.shape).to(spec.torch_dtype)
            offset += spec.numel

    # -- decode -----------------------------------------------------------------------------
    def decode(self, payload: bytes, layout: Layout, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Decode a payload for ``layout``.

        Raises
        ------
        DecodeError
            For every malformed payload (and nothing else): truncated, corrupted, another
            version, layout or codec, or any length, count or index inconsistent with the layout.
        """
        device = torch.device(device)
        src, nonce = open_payload(payload, layout.fingerprint(), self.fingerprint)
        try:
            decoded = self._decode_body(src, nonce, layout, device)
        except FedcompError:
            raise
        except (RuntimeError, ValueError, IndexError, OverflowError) as exc:  # defence in depth: fuzzing finds none
            raise DecodeError(f"malformed payload: {exc}") from exc
        return decoded

    def _decode_body(self, src: Reader, nonce: int, layout: Layout, device: torch.device) -> dict[str, torch.Tensor]:
        decoded: list[torch.Tensor | None] = [None] * len(layout.tensors)
        for j, seg in enumerate(self._segments(layout)):
            if self.selector is None:
                y = self.quantizer.decode(src, seg.numel, device)
            else:
                idx = self.selector.read_indices(src, seg.numel, _generator(nonce, j, torch.device("cpu")), device)
                y = torch.zeros(seg.numel, device=device)
                y[idx] = self.quantizer.decode(src, idx.numel(), device)
            self._split(y, seg, layout, decoded)
        for i, spec in enumerate(layout.tensors):
            if not spec.is_float:
                raw = src.tensor(spec.numel, spec.torch_dtype)
                decoded[i] = raw.view(spec.shape).to(device)
        src.finish()
        return {name: t for name, t in zip(layout.names, decoded)}  # type: ignore[misc]


def _build_stage(name: str, args: dict):
    cls = REGISTRY.get(name)
    if cls is None:
        raise SpecError(f"unknown codec {name!r}; available: {', '.join(c.signature() for c in REGISTRY.values())}")
    return cls.from_args(args)


def build_codec(spec: str) -> Codec:
    """Build a codec from a spec string (see :class:`Codec`)."""
    return Codec(spec)


def available_codecs() -> dict[str, str]:
    """Spec name -> signature with defaults, for every registered stage."""
    return {name: cls.signature() for name, cls in REGISTRY.items()}
