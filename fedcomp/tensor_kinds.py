"""What each entry of a model's state dict is, and which entries must travel exact.

A PyTorch state dict mixes three kinds of tensors that federated averaging must treat
differently:

* ``weight``: trainable parameters. Their updates are what codecs compress (lossy, with error
  feedback, sketched, with server momentum).
* ``statistic``: float buffers that are statistics of the data, not gradients' integrals:
  BatchNorm's (and InstanceNorm's with ``track_running_stats``) ``running_mean`` and
  ``running_var``. The average of the clients' values is the right aggregate and keeps every
  variance >= 0; a lossy or biased update (top-k, sign, a sketch's heavy hitters, server
  momentum, a residual added back later) can drive a variance below zero, which turns every
  BatchNorm output into NaN.
* ``counter``: integer buffers (``num_batches_tracked``). Codecs carry them raw; an aggregation
  that applied only the float part (FetchSGD's sketch path once) froze them.

The rule this module encodes: ``statistic`` and ``counter`` entries travel exact (``none()``:
fp32 values, integers raw), are averaged plainly (weighted mean of the clients' deltas, rounded
for counters), and never enter error feedback, server momentum or a sketch.
:func:`exact_state_policy` writes that rule as a fedcomp policy spec for the decode path.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from fedcomp.errors import SpecError
from fedcomp.layout import Layout, TensorSpec

__all__ = ["COUNTER", "STATISTIC", "STATISTIC_GLOBS", "WEIGHT", "classify", "exact_state_policy", "split_kinds"]

WEIGHT = "weight"
STATISTIC = "statistic"
COUNTER = "counter"

#: Names (shell globs, as the policy's ``name~`` rules match them) of float statistics buffers.
STATISTIC_GLOBS: tuple[str, ...] = ("*running_mean", "*running_var")


def classify(tensor: TensorSpec) -> str:
    """The kind of one layout entry: ``counter`` (integer or bool dtype), ``statistic`` (a float
    whose name matches :data:`STATISTIC_GLOBS`) or ``weight`` (everything else)."""
    if not tensor.is_float:
        return COUNTER
    if any(fnmatch.fnmatchcase(tensor.name, g) for g in STATISTIC_GLOBS):
        return STATISTIC
    return WEIGHT


def split_kinds(layout: Layout | Mapping) -> dict[str, list[str]]:
    """Names of the layout's (or state dict's) entries grouped by kind, each in layout order."""
    if not isinstance(layout, Layout):
        layout = Layout.of(layout)
    out: dict[str, list[str]] = {WEIGHT: [], STATISTIC: [], COUNTER: []}
    for t in layout.tensors:
        out[classify(t)].append(t.name)
    return out


def exact_state_policy(spec: str, layout: Layout | Mapping) -> str:
    """``spec`` with statistics sent exact: a policy whose first rules send every statistic
    buffer with ``none()`` (counters already travel raw in every codec).

    Returns ``spec`` unchanged when the layout holds no statistic. With a sketch as the default
    rule the result is what FetchSGD's aggregation uses too: :class:`fedcomp.server_feedback.ServerFeedback`
    sums the sketched rule in sketch space and averages the ``none()`` rules beside it.

    Raises
    ------
    SpecError
        If ``spec`` is empty.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"spec must be a non-empty codec or policy spec, got {spec!r}")
    kinds = split_kinds(layout)
    if not kinds[STATISTIC]:
        return spec
    globs = [g for g in STATISTIC_GLOBS if any(fnmatch.fnmatchcase(n, g) for n in kinds[STATISTIC])]
    rules = "; ".join(f"name~{g}: none()" for g in globs)
    return f"{rules}; {spec.strip()}"
