"""Streaming server-side aggregation: decode one reply at a time into a running weighted sum.

:class:`Accumulator` keeps one flat fp32 buffer over the layout's float tensors (and a float64
buffer for integer tensors) and, per reply:

1. decodes the whole payload into local tensors (checksum, fingerprints, every count and
   index checked; non-finite values rejected), so a bad payload raises before anything is added;
2. adds ``weight * update`` to the buffer in place:

   * sparsifiers (top-k, threshold, random-k, DGC): the kept values are scatter-added at their
     positions (``index_add_``); no dense update is ever built, the reply costs O(k) memory;
   * every other codec (quantizers, sketches, PowerSGD, policies): the dense update is decoded,
     added in place and freed before the next reply.

Memory is the buffer plus one decoded reply whatever the number of clients; ``mean()`` is the
weighted mean ``sum_i w_i u_i / sum_i w_i`` (FedAvg with ``w_i`` = the client's example count).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedcomp.base import Selector, StageContext
from fedcomp.codec import Codec
from fedcomp.errors import DecodeError, FedcompError
from fedcomp.layout import Layout
from fedcomp.wire import open_payload


_FINITE_CHUNK = 1 << 20


def _all_finite(t: torch.Tensor) -> bool:
    """torch.isfinite(t).all(), in chunks: no full-size boolean temporary (a quarter of a dense
    copy at fp32) at the server's peak."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + _FINITE_CHUNK]).all()) for i in range(0, flat.numel(), _FINITE_CHUNK))


class Accumulator:
    """Weighted running sum of decoded updates, one reply at a time.

    Parameters
    ----------
    codec : Codec or PolicyCodec
        The upload codec the replies were encoded with (``fedcomp.build_codec(spec)``).
    layout : Layout
        The model's layout; every reply must match it.
    device : torch.device or str (default: ``"cpu"``)
        Where the running sum lives and replies are decoded.
    """

    def __init__(self, codec, layout: Layout, device: torch.device | str = "cpu") -> None:
        self.codec = codec
        self.layout = layout
        self.device = torch.device(device)
        self.total_weight = 0.0
        self.count = 0  # replies added
        # float tensors, in layout order, share one flat buffer: a global segment is one slice
        self._offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for t in layout.tensors:
            if t.is_float:
                self._offsets[t.name] = (offset, t.numel)
                offset += t.numel
        self._sum = torch.zeros(offset, dtype=torch.float32, device=self.device)
        # integer tensors (step counters...) average in float64 and are rounded back in mean()
        self._ints = {t.name: torch.zeros(t.shape, dtype=torch.float64, device=self.device)
                      for t in layout.tensors if not t.is_float}
        reducer = getattr(codec, "reducer", None)
        # scatter-add path: a selector whose dense form is "values at positions, zero elsewhere"
        self._sparse = (
            isinstance(codec, Codec) and isinstance(reducer, Selector) and type(reducer).expand is Selector.expand
        )

    # -- adding -----------------------------------------------------------------------------
    def add(self, payload: bytes, weight: float, *, round: int = 0) -> None:
        """Decode one reply and add ``weight`` times its update to the sum.

        Raises
        ------
        DecodeError
            Malformed payload (as :meth:`Codec.decode`); the sum is unchanged.
        FedcompError
            Non-finite decoded values or an invalid weight; the sum is unchanged.
        """
        weight = self._check_weight(weight)
        if self._sparse:
            parts, ints = self._decode_sparse(payload, round)
            for start, idx, vals in parts:
                if not _all_finite(vals):
                    raise FedcompError("update has NaN or Inf values")
            self._check_ints(ints)
            for start, idx, vals in parts:
                self._sum.index_add_(0, idx + start if start else idx, vals, alpha=weight)
            self._add_ints(ints, weight)
        else:
            decoded = self.codec.decode(payload, self.layout, self.device, round=round)
            self.add_dense(decoded, weight)
            return  # add_dense counted the weight
        self.total_weight += weight
        self.count += 1

    def add_dense(self, tensors: Mapping[str, torch.Tensor], weight: float) -> None:
        """Add ``weight`` times a dense update (named tensors matching the layout)."""
        weight = self._check_weight(weight)
        missing = [n for n in self.layout.names if n not in tensors]
        if missing:
            raise FedcompError(f"update lacks tensors {missing[:3]} of the layout")
        for name, (start, numel) in self._offsets.items():
            t = tensors[name]
            if t.numel() != numel:
                raise FedcompError(f"update of {name!r} has {t.numel()} elements, the layout says {numel}")
            if not _all_finite(t):
                raise FedcompError(f"update of {name!r} has NaN or Inf values")
        self._check_ints({n: tensors[n] for n in self._ints})
        for name, (start, numel) in self._offsets.items():
            t = tensors[name].reshape(-1).to(self.device)
            self._sum[start:start + numel].add_(t, alpha=weight)  # add_ promotes fp16/bf16 in place
        self._add_ints({n: tensors[n] for n in self._ints}, weight)
        self.total_weight += weight
        self.count += 1

    # -- results ----------------------------------------------------------------------------
    def sum(self) -> dict[str, torch.Tensor]:
        """The weighted sum so far, per tensor (fp32 for float tensors, float64 for integer ones)."""
        out = {}
        for t in self.layout.tensors:
            if t.is_float:
                start, numel = self._offsets[t.name]
                out[t.name] = self._sum[start:start + numel].view(t.shape).clone()
            else:
                out[t.name] = self._ints[t.name].clone()
        return out

    def mean(self) -> dict[str, torch.Tensor]:
        """Weighted mean of the updates added, in the layout's order and dtypes (integer tensors
        rounded to the nearest integer)."""
        if not self.total_weight > 0:
            raise FedcompError(f"no weight to average over (total weight {self.total_weight}, {self.count} replies)")
        out = {}
        for t in self.layout.tensors:
            if t.is_float:
                start, numel = self._offsets[t.name]
                out[t.name] = (self._sum[start:start + numel] / self.total_weight).view(t.shape).to(t.torch_dtype)
            else:
                out[t.name] = torch.round(self._ints[t.name] / self.total_weight).to(t.torch_dtype)
        return out

    def reset(self) -> None:
        """Zero the sum for the next round (the buffers are reused)."""
        self._sum.zero_()
        for v in self._ints.values():
            v.zero_()
        self.total_weight = 0.0
        self.count = 0

    # -- internals --------------------------------------------------------------------------
    @staticmethod
    def _check_weight(weight: float) -> float:
        try:
            w = float(weight)
        except (TypeError, ValueError):
            raise FedcompError(f"weight must be a number, got {weight!r}") from None
        if not (math.isfinite(w) and w >= 0):
            raise FedcompError(f"weight must be finite and >= 0, got {weight!r}")
        return w

    def _check_ints(self, ints: Mapping[str, torch.Tensor]) -> None:
        for name, t in ints.items():
            if t.numel() != self._ints[name].numel():
                raise FedcompError(f"update of {name!r} has {t.numel()} elements, the layout says {self._ints[name].numel()}")

    def _add_ints(self, ints: Mapping[str, torch.Tensor], weight: float) -> None:
        for name, t in ints.items():
            self._ints[name].add_(t.to(self.device, torch.float64).view(self._ints[name].shape), alpha=weight)

    def _decode_sparse(self, payload: bytes, round: int):
        """(segment start, positions, values) per segment and the raw integer tensors, read the
        way :meth:`Codec.decode` reads them, without expanding to dense."""
        codec: Codec = self.codec
        src, nonce = open_payload(payload, self.layout.fingerprint(), codec.fingerprint)
        ctx = StageContext(nonce, round)
        try:
            parts = []
            for seg, group in codec.segments(self.layout):
                idx = codec.reducer.read(src, seg, ctx, self.device)
                vals = codec.quantizer.decode(src, codec.reducer.value_count(idx, seg), self.device)
                if vals.numel() != idx.numel():
                    raise DecodeError(f"{vals.numel()} values for {idx.numel()} positions")
                start = self._offsets[self.layout.tensors[group[0]].name][0]
                parts.append((start, idx, vals.float()))
            ints = {}
            for spec in self.layout.tensors:
                if not spec.is_float:
                    ints[spec.name] = src.tensor(spec.numel, spec.torch_dtype)
            src.finish()
        except FedcompError:
            raise
        except (RuntimeError, ValueError, IndexError, OverflowError) as exc:
            raise DecodeError(f"malformed payload: {exc}") from exc
        return parts, ints
