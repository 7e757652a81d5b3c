"""FetchSGD's server (Rothchild et al. 2020): aggregate linear sketches without decoding them.

Per round, with ``S_i`` client i's count sketch (per segment) and ``w_i`` its weight:

1. ``S = sum_i w_i S_i / sum_i w_i``, summed as replies arrive (float64, order independent);
2. momentum ``S_u <- rho S_u + S`` and error ``S_e <- S_e + S_u``, in sketch space;
3. ``delta = top-k heavy hitters of unsketch(S_e)`` (the codec's ``ratio``), the step applied
   to the model (:func:`fedcomp.aggregate.apply_step`);
4. ``S_u`` and ``S_e`` are zeroed at the cells the applied coordinates hash to.

Clients keep no residual (the error lives here). Integer tensors keep their reference values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedcomp.aggregate import AggregationError, UpdateRejected, _finite, _sq_norm, apply_step, check_weight
from fedcomp.errors import SpecError
from fedcomp.layout import Layout


def sketch_step(reducer, momentum: torch.Tensor, error: torch.Tensor, summed: torch.Tensor, rho: float,
                numel: int) -> torch.Tensor:
    """One FetchSGD step for one segment's sketch, updating ``momentum`` and ``error`` in place:
    ``S_u <- rho S_u + S``; ``S_e <- S_e + S_u``; ``delta = heavy hitters of S_e`` (``numel``
    values, dense); momentum and error are zeroed at every cell ``delta`` hashes to. Returns the
    flat ``delta``."""
    momentum.mul_(rho).add_(summed)
    error.add_(momentum)
    delta = reducer.heavy_hitters(error, numel)
    applied = reducer.sketch(delta) != 0
    momentum[applied] = 0
    error[applied] = 0
    return delta


class FetchSGD:
    """Sketch-space aggregation, momentum and error accumulation for a linear upload codec.

    Parameters
    ----------
    codec : Codec
        A linear codec (``codec.linear``), e.g. ``fedcomp.build_codec("sketch(rows=1, cols=4000)")``.
    momentum : float (default: 0.0)
        rho, in [0, 1).
    """

    def __init__(self, codec, momentum: float = 0.0) -> None:
        if not getattr(codec, "linear", False):
            raise SpecError(f"FetchSGD needs a linear upload codec such as 'sketch(rows=1, cols=4000)', got {codec!r}")
        if not 0 <= momentum < 1:
            raise SpecError(f"server_momentum={momentum!r} is invalid: it must be in [0, 1)")
        self.codec = codec
        self.rho = float(momentum)
        self._momentum: list[torch.Tensor] | None = None  # S_u per segment
        self._error: list[torch.Tensor] | None = None  # S_e per segment
        self._sum: list[torch.Tensor] | None = None
        self.total_weight = 0.0
        self.count = 0

    def decode(self, payload: bytes, layout: Layout) -> list[torch.Tensor]:
        """One reply's sketch values per segment, checked (DecodeError, UpdateRejected)."""
        values = self.codec.decode_values(payload, layout)
        if not all(_finite(v) for v in values):
            raise UpdateRejected("sketch has NaN or Inf values")
        return values

    def norm(self, values: list[torch.Tensor]) -> float:
        """Estimate of the update's L2 norm: each row of a count sketch preserves it in expectation."""
        rows = getattr(self.codec.reducer.config, "rows", 1)
        return math.sqrt(sum(_sq_norm(v) for v in values) / rows)

    def add(self, values: list[torch.Tensor], weight: float) -> None:
        """Add ``weight`` times one reply's sketch to the round's sum."""
        w = check_weight(weight)
        if self._sum is None:
            self._sum = [torch.zeros(v.numel(), dtype=torch.float64) for v in values]
        if len(values) != len(self._sum) or any(v.numel() != s.numel() for v, s in zip(values, self._sum)):
            raise AggregationError("sketch shape differs from the round's other sketches")
        for s, v in zip(self._sum, values):
            s.add_(v.reshape(-1).to(torch.float64), alpha=w)
        self.total_weight += w
        self.count += 1

    def step(self, reference: Mapping[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
        """The new model: ``reference + heavy hitters of the error sketch``; starts the next round."""
        if self._sum is None or not self.total_weight > 0:
            raise AggregationError("no sketches to aggregate this round")
        summed = [(s / self.total_weight).float() for s in self._sum]
        self._sum, self.total_weight, self.count = None, 0.0, 0
        if self._momentum is None or len(self._momentum) != len(summed):
            self._momentum = [torch.zeros_like(v) for v in summed]
            self._error = [torch.zeros_like(v) for v in summed]
        assert self._error is not None
        reducer = self.codec.reducer
        step = {}
        for j, ((seg, group), s_j) in enumerate(zip(self.codec.segments(layout), summed)):
            delta = sketch_step(reducer, self._momentum[j], self._error[j], s_j, self.rho, seg.numel)
            offset = 0
            for i in group:
                spec = layout.tensors[i]
                step[spec.name] = delta[offset:offset + spec.numel].view(spec.shape)
                offset += spec.numel
        return {**reference, **apply_step({n: reference[n] for n in step}, step)}

    def discard_round(self) -> None:
        """Forget the round's sum (a round with no usable replies)."""
        self._sum, self.total_weight, self.count = None, 0.0, 0
