"""One way to move a reference by a step, shared by the client and the server.

`apply_step` is how the server applies the round's mean, how a broadcast tier moves its
reference and how a client applies a broadcast; `model_step` is its inverse for one tensor.
Both sides import it from here, so a client never imports the server's aggregation code.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedcomp.wire import MMAPPED, host_empty

APPLY_CHUNK = 1 << 18  # elements per step of apply_step (three wide temporaries each: 5 MB)

__all__ = ["APPLY_CHUNK", "apply_step", "model_step"]


def _apply_one(r: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if r.dtype == torch.bool:  # a bool tensor's step says which flags flip (model_step: XOR)
        flip = torch.round(s.to(r.device, torch.float64)) != 0 if s.is_floating_point() else s.to(r.device, torch.bool)
        return torch.logical_xor(r, flip)
    if not r.is_floating_point():
        if s.is_floating_point():  # a mean of integer tensors: rounded back to the integer dtype
            return torch.round(r.to(torch.float64) + s.to(r.device, torch.float64)).to(r.dtype)
        return r + s.to(r.device, r.dtype)
    wide = torch.promote_types(torch.promote_types(r.dtype, s.dtype if s.is_floating_point() else r.dtype),
                               torch.float32)
    if r.numel() <= APPLY_CHUNK:
        return (r.to(wide) + s.to(r.device, wide)).to(r.dtype)
    # on the CPU in huge pages: a fresh large torch tensor would fault page by page
    out = host_empty(r.numel(), r.dtype, MMAPPED).view(r.shape) if r.device.type == "cpu" \
        else torch.empty_like(r, memory_format=torch.contiguous_format)
    rf, sf, of = r.reshape(-1), s.reshape(-1), out.view(-1)
    for i in range(0, rf.numel(), APPLY_CHUNK):  # elementwise: the same bits in any chunks
        j = i + APPLY_CHUNK
        of[i:j] = (rf[i:j].to(wide) + sf[i:j].to(r.device, wide)).to(r.dtype)
    return out


def model_step(new: torch.Tensor, reference: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``new - reference`` for one tensor, in ``new``'s dtype: what :func:`apply_step` adds back.
    Bool tensors have no subtraction: their step is the flags that flip (``new XOR reference``)."""
    if new.dtype == torch.bool:
        return torch.logical_xor(new, reference.to(new.device, torch.bool))
    return torch.sub(new, reference, out=out)


def apply_step(reference: Mapping[str, torch.Tensor], step: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``reference + step`` in the reference's dtypes, computed the same way everywhere.

    Floats add in ``promote(reference dtype, step dtype, fp32)`` (fp32 for fp32/fp16/bf16
    models and fp32 steps, float64 for float64 models or float64 steps such as a mean) and are
    rounded once to the reference's dtype; integer tensors add exactly (a floating step, i.e. a
    mean, is rounded to the nearest integer); bool tensors flip where the step is nonzero (a
    mean of flips: where most clients flipped). Broadcast references, client models and the
    server's aggregate all move through this function, so both sides of a broadcast get the
    same bits (on the same device type). Large tensors go in chunks of ``APPLY_CHUNK`` elements.
    """
    return {name: _apply_one(r, step[name]) for name, r in reference.items()}
