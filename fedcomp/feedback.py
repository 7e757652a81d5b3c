"""Error feedback (Seide 2014; Karimireddy 2019): what compression drops is delayed, not lost.

    p = u + e;   c = encode(p);   e <- p - decode(c);   send c

The residual ``e`` and the codec's own state (e.g. PowerSGD's warm-start factors, DGC's
momentum) are plain mappings of tensors: the caller keeps them (fedcomp's Flower mod keeps them
in the node's ``Context.state``), so this module holds no state. A reducer may change how the
update and the residual combine (DGC accumulates momentum, not the raw update).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedcomp.base import Reducer, StageContext, add_residual
from fedcomp.codec import Codec, Encoded, LazyDecoded
from fedcomp.layout import Layout
from fedcomp.wire import arena, output_like


def compress(
    codec: Codec,
    update: Mapping[str, torch.Tensor],
    residual: Mapping[str, torch.Tensor] | None = None,
    *,
    nonce: int = 0,
    error_feedback: bool = True,
    round: int = 0,
    state: dict[str, torch.Tensor] | None = None,
) -> tuple[Encoded, dict[str, torch.Tensor]]:
    """Encode ``update`` (plus the residual, when error feedback is on).

    Returns the encoded update and the new residual (empty when error feedback is off or the
    codec is lossless). Residuals of tensors absent from ``update`` are dropped; a residual
    whose shape no longer matches its tensor is ignored rather than added. ``state`` (the
    codec's client state) is updated in place.
    """
    # values travel as fp32 at most: none() is exact for fp32/fp16/bf16, not for float64
    exact = codec.lossless and all(t.dtype != torch.float64 for t in update.values())
    use_ef = error_feedback and not exact and getattr(codec, "takes_error_feedback", True)
    ctx = StageContext(nonce, round, state)
    update = dict(update)
    kept = {}
    if use_ef and residual:
        kept = {
            n: r for n, r in residual.items()
            if n in update and update[n].is_floating_point() and r.shape == update[n].shape
        }
    if use_ef and codec.reducer is not None:
        target = codec.reducer.accumulate(update, kept, ctx)  # DGC adds momentum here
        own = type(codec.reducer).accumulate is Reducer.accumulate  # plain sums: fresh tensors
    else:
        target = add_residual(update, kept)
        own = True
    encoded = codec.encode(target, nonce=nonce, round=round, state=state)
    if codec.reducer is not None and use_ef:
        codec.reducer.after_encode(target, encoded.decoded, ctx)
    if not use_ef:
        return encoded, {}
    # e = p - decoded, in place where p is a tensor this call made (update + residual); a
    # sparsifier's decoded is subtracted at its k positions only (no dense decoded is built)
    decoded = encoded.decoded
    subtract = decoded.subtract_ if isinstance(decoded, LazyDecoded) else None
    new_residual = {}
    plan = {}  # name -> (tensor, its residual's dtype: fp32, or float64 for float64; reused in place)
    for name, t in target.items():
        if t.is_floating_point():
            dtype = torch.promote_types(t.dtype, torch.float32)
            plan[name] = (t, dtype, subtract is not None and own and name in kept and t.dtype == dtype
                          and t is not update[name])
    # the fp32 buffers this makes out of one allocation (wire.arena), sized for those alone
    with arena.fp32(t.numel() for t, dtype, fresh in plan.values() if dtype == torch.float32 and not fresh):
        for name, (t, dtype, fresh) in plan.items():
            if subtract is None:
                new_residual[name] = torch.sub(t.to(dtype), decoded[name].to(dtype), out=output_like(t, dtype))
                continue
            e = t if fresh else output_like(t, dtype).copy_(t)
            new_residual[name] = subtract(name, e)
    if hasattr(codec, "without_feedback"):  # a policy with a rule that takes none
        for name in codec.without_feedback(Layout.of(target), round):
            new_residual.pop(name, None)
    return encoded, new_residual
