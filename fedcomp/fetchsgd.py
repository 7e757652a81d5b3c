"""FetchSGD's server step (Rothchild et al. 2020), in sketch space, for one segment.

Per round, with ``S`` the weighted mean of the clients' count sketches of a segment (summed as
replies arrive by :class:`fedcomp.server_feedback.ServerFeedback`, float64, order independent):

1. momentum ``S_u <- rho S_u + S`` and error ``S_e <- S_e + S_u``, in sketch space;
2. ``delta = top-k heavy hitters of unsketch(S_e)`` (the codec's ``ratio``), the step applied
   to the model;
3. ``S_u`` and ``S_e`` are zeroed at the cells the applied coordinates hash to.

Clients keep no residual (the error lives on the server). Integer tensors keep their reference values.

On the CPU with the compiled loops (a server's), steps 2 and 3 are compiled passes over the
elements (:meth:`fedcomp.codecs.sketch.CountSketch.top_dense`, then the cells of the k kept
coordinates alone, :meth:`~fedcomp.codecs.sketch.CountSketch.zero_cells`): the same delta and
tables as the torch ops below, which CUDA tensors, ``FEDCOMP_KERNELS=0`` and NaN estimates take.
"""

from __future__ import annotations

import torch


def sketch_step(reducer, momentum: torch.Tensor, error: torch.Tensor, summed: torch.Tensor, rho: float,
                numel: int, k: int | None = None) -> torch.Tensor:
    """One FetchSGD step for one segment's sketch, updating ``momentum`` and ``error`` in place:
    ``S_u <- rho S_u + S``; ``S_e <- S_e + S_u``; ``delta = heavy hitters of S_e`` (``numel``
    values, dense; ``k`` of them, None: the codec's ``ratio``, as ``reducer.kept(numel)``);
    momentum and error are zeroed at every cell ``delta`` hashes to. Returns the flat ``delta``."""
    momentum.mul_(rho).add_(summed)
    error.add_(momentum)
    fast = reducer.top_dense(error, numel, k, load=True)  # the compiled passes (CPU), or None
    if fast is not None:
        positions, delta = fast
        reducer.zero_cells(positions, delta, momentum, error)
        return delta
    delta = reducer.heavy_hitters(error, numel, k)
    applied = reducer.sketch(delta) != 0
    momentum[applied] = 0
    error[applied] = 0
    return delta
