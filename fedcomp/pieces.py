"""A segment made of several flat tensors, read in place (no concatenated copy).

A global-scope selector (top-k over all float tensors of a model) sees one segment over every
float tensor; concatenating them costs a model-sized fresh allocation (on Linux about 12x a read
pass, page faults included). :class:`Pieces` lets a selector sample, scan and gather across the
tensors by global position instead.
"""

from __future__ import annotations

import numpy as np
import torch


class Pieces:
    """Flat fp32 tensors seen as one vector (positions are global, in order)."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + p.numel())
        self.device = parts[0].device if parts else torch.device("cpu")
        # numpy views of the pieces where all are flat contiguous fp32 CPU tensors (gathers in numpy)
        self._host = [p.numpy() for p in parts] if all(
            p.device.type == "cpu" and p.dtype == torch.float32 and p.dim() == 1 and p.is_contiguous()
            and not p.requires_grad for p in parts) else None

    def numel(self) -> int:
        return self.starts[-1]

    def gather(self, pos: torch.Tensor) -> torch.Tensor:
        """Values at global positions ``pos`` (int64, any order)."""
        order = torch.argsort(pos)
        out = torch.empty(pos.numel(), dtype=torch.float32, device=self.device)
        out[order] = self.gather_sorted(pos[order])
        return out

    def gather_sorted(self, idx: torch.Tensor) -> torch.Tensor:
        """Values at sorted global positions ``idx`` (one slice of ``idx`` per piece)."""
        if self._host is not None and idx.device.type == "cpu" and not idx.requires_grad:
            # numpy on the CPU: no torch op per piece (np.take is as quick as index_select)
            at = idx.numpy()
            cuts = np.searchsorted(at, np.array(self.starts, dtype=np.int64)).tolist()
            out_np = np.empty(at.shape[0], dtype=np.float32)
            for j in np.flatnonzero(np.diff(cuts)).tolist():
                lo, hi = cuts[j], cuts[j + 1]
                np.take(self._host[j], at[lo:hi] - self.starts[j], out=out_np[lo:hi])
            return torch.from_numpy(out_np)
        cuts = torch.searchsorted(idx, torch.tensor(self.starts, dtype=torch.int64, device=idx.device)).tolist()
        out = torch.empty(idx.numel(), dtype=torch.float32, device=self.device)
        for j in np.flatnonzero(np.diff(cuts)).tolist():  # the parts holding positions
            lo, hi = cuts[j], cuts[j + 1]
            out[lo:hi] = torch.index_select(self.parts[j], 0, idx[lo:hi] - self.starts[j])  # ~6x p[...] on the CPU
        return out

    def cat(self) -> torch.Tensor:
        return torch.cat(self.parts) if len(self.parts) != 1 else self.parts[0]
