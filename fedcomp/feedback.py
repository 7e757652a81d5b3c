"""Error feedback (Seide 2014; Karimireddy 2019): what compression drops is delayed, not lost.

    p = u + e;   c = encode(p);   e <- p - decode(c);   send c

The residual ``e`` is a plain mapping of tensors: the caller keeps it (fedcomp's Flower mod
keeps it in the node's ``Context.state``), so this module holds no state.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedcomp.codec import Codec, Encoded


def compress(
    codec: Codec,
    update: Mapping[str, torch.Tensor],
    residual: Mapping[str, torch.Tensor] | None = None,
    *,
    nonce: int = 0,
    error_feedback: bool = True,
) -> tuple[Encoded, dict[str, torch.Tensor]]:
    """Encode ``update`` (plus the residual, when error feedback is on).

    Returns the encoded update and the new residual (empty when error feedback is off or the
    codec is lossless). Residuals of tensors absent from ``update`` are dropped; a residual
    whose shape no longer matches its tensor is ignored rather than added.
    """
    # values travel as fp32 at most: none() is exact for fp32/fp16/bf16, not for float64
    exact = codec.lossless and all(t.dtype != torch.float64 for t in update.values())
    use_ef = error_feedback and not exact
    target = dict(update)
    if use_ef and residual:
        for name, r in residual.items():
            t = target.get(name)
            if t is not None and t.is_floating_point() and r.shape == t.shape:
                target[name] = t + r.to(device=t.device, dtype=t.dtype)
    encoded = codec.encode(target, nonce=nonce)
    if not use_ef:
        return encoded, {}
    new_residual = {}
    for name, t in target.items():
        if t.is_floating_point():
            dtype = torch.promote_types(t.dtype, torch.float32)  # fp32, or float64 for float64 tensors
            new_residual[name] = t.to(dtype) - encoded.decoded[name].to(dtype)
    return encoded, new_residual
