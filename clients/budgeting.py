"""Client side of bandwidth budgets: resolve the link, size the upload to its budget, report it.

``compression_mod`` calls :func:`budgeted_upload` in place of ``fedcomp.compress`` when the run
has a link profile (run config ``link-profile`` other than 'none') or the node config describes
a link. Steps per round:

1. The link: node-config keys first (deployment), else the run's ``link-profile`` for the
   node's ``partition-id`` (simulation); the run's ``round-deadline-s`` where the link has no
   deadline of its own (:func:`fedcomp.links.resolve_link`).
2. The budget: min(byte cap, uplink bytes in the time the deadline leaves after the download,
   the compute measured so far and the upload latency) (:func:`fedcomp.links.upload_budget`).
   No cap and no deadline: no budget, the configured codec as is.
3. The fit: :func:`fedcomp.budget.fit_update` picks the codec's free parameter so that the whole
   reply, counted as the server counts it (Flower's serialized bytes of every record in the
   reply), fits the budget. The record's own bytes are measured on a reply built around an
   empty payload and checked on the real one; if the real reply is larger (length prefixes
   grow with the payload), the fit is redone with the excess taken off.
4. Too small even for the coarsest setting: logged, reported, and per run config
   ``budget-fallback``: ``'skip'`` (send no update this round; the residual keeps it all) or
   ``'coarsest'`` (send the coarsest setting, over budget, reported as such).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from flwr.app import RecordDict
from fedcomp.msgsize import message_bytes

import fedcomp
from fedcomp.base import add_residual
from fedcomp.budget import FALLBACKS, BudgetTooSmall, fit_update
from fedcomp import links

REFITS = 4  # fits at most per upload (the first plus corrections for the record's framing)


@dataclass
class BudgetedUpload:
    """What :func:`budgeted_upload` decided: the encode to send (None: skipped) and its report."""

    encoded: fedcomp.Encoded | None
    residual: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor] | None
    spec: str  # the concrete codec spec of the payload (what the server decodes with)
    budget: int | None  # whole-reply bytes allowed (None: unlimited)
    status: str  # "fit", "saturated", "unlimited", "too-small-skipped", "too-small-coarsest"
    content: RecordDict | None = None  # the reply built around the payload
    info: dict = field(default_factory=dict)


def budgeted_upload(
    spec: str,
    update: Mapping[str, torch.Tensor],
    residual: Mapping[str, torch.Tensor] | None,
    *,
    link: links.Link,
    download_bytes: int,
    compute_s: float,
    build: Callable[[bytes, str], RecordDict],
    nonce: int,
    round: int,
    state: dict[str, torch.Tensor] | None,
    error_feedback: bool,
    fallback: str = "skip",
) -> BudgetedUpload:
    """Encode ``update`` so the reply ``build(payload, spec)`` fits the link's budget (see module doc).

    ``build`` returns the complete reply content for a payload and the spec that made it; its
    size is what the budget bounds. ``state`` is not modified: the returned ``state`` is the
    codec state after the chosen encode.
    """
    if fallback not in FALLBACKS:
        raise fedcomp.SpecError(f"budget-fallback={fallback!r} is invalid: one of {FALLBACKS}")
    budget = links.upload_budget(link, download_bytes, compute_s)
    if budget is None:
        st = {k: v.clone() for k, v in state.items()} if state is not None else None
        codec = fedcomp.build_codec(spec)
        enc, res = fedcomp.compress(codec, update, residual, nonce=nonce, error_feedback=error_feedback,
                                    round=round, state=st)
        return BudgetedUpload(enc, res, st, codec.spec, None, "unlimited", build(enc.payload, codec.spec))
    overhead = message_bytes(build(b"", spec))
    target = budget
    for _ in range(REFITS):
        try:
            # a budget of 0 B (deadline already passed) is simply too small: ask for 1 B to get the coarsest
            fit = fit_update(spec, update, max(target, 1), residual, overhead=overhead, nonce=nonce, round=round,
                             state=state, error_feedback=error_feedback)
        except BudgetTooSmall as exc:
            return _too_small(exc, spec, update, residual, budget, build, fallback, nonce, round, state, error_feedback)
        content = build(fit.encoded.payload, fit.spec)
        real = message_bytes(content)
        if real <= budget:
            status = "saturated" if fit.saturated else "fit"
            return BudgetedUpload(fit.encoded, fit.residual or {}, fit.state, fit.spec, budget, status, content,
                                  {"fill": real / budget})
        # the framing grew with the payload (length prefixes): refit to the budget less that growth
        # (taking off only the excess over the budget can ask for the same fit again)
        target = min(target - 1, budget - (real - fit.message_bytes))
        if target <= overhead:
            break
    try:  # the framing alone leaves no room: what the codec's coarsest setting is, by asking for 1 B
        fit_update(spec, update, 1, residual, overhead=overhead, nonce=nonce, round=round, state=state,
                   error_feedback=error_feedback)
        exc = BudgetTooSmall(spec, budget, budget + 1, fedcomp.build_codec(spec).spec)  # not reached: 1 B never fits
    except BudgetTooSmall as too_small:
        exc = too_small
    return _too_small(exc, spec, update, residual, budget, build, fallback, nonce, round, state, error_feedback)


def _too_small(exc, spec, update, residual, budget, build, fallback, nonce, round, state, error_feedback):
    if fallback == "skip":
        # nothing is sent: the whole update stays in the residual (sent in a later round)
        floats = {n: t for n, t in update.items() if t.is_floating_point()}
        kept = add_residual(floats, residual or {}, promote=True) if error_feedback else {}
        return BudgetedUpload(None, kept, state, spec, budget, "too-small-skipped", None, {"reason": str(exc)})
    coarsest = exc.coarsest
    st = {k: v.clone() for k, v in state.items()} if state is not None else None
    enc, res = fedcomp.compress(fedcomp.build_codec(coarsest), update, residual, nonce=nonce,
                                error_feedback=error_feedback, round=round, state=st)
    return BudgetedUpload(enc, res, st, fedcomp.build_codec(coarsest).spec, budget, "too-small-coarsest",
                          build(enc.payload, coarsest), {"reason": str(exc)})
