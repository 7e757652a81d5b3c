"""Client side of bandwidth budgets: resolve the link, size the upload to its budget, report it.

``compression_mod`` calls :func:`budgeted_upload` in place of ``fedcomp.compress`` when the run
has a link profile (run config ``link-profile`` other than 'none') or the node config describes
a link. Steps per round:

1. The link: node-config keys first (deployment), else the run's ``link-profile`` for the
   node's ``partition-id`` (simulation); the run's ``round-deadline-s`` where the link has no
   deadline of its own (:func:`fedcomp.links.resolve_link`).
2. The budget: min(byte cap, uplink bytes in the time the deadline leaves after the download,
   the compute measured so far and the upload latency) (:func:`fedcomp.links.upload_budget`).
   No cap and no deadline: no budget, the configured codec as is. The compute includes a reserve
   for this round's encode, not yet measured (:func:`encode_reserve`): where recent encodes of
   different sizes show it growing with the bytes, at the size the budget leaves.
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
from fedcomp.adapt import rising_line

REFITS = 4  # fits at most per upload (the first plus corrections for the record's framing)


ENCODE_MARGIN = 1.5  # an encode's reserve: this many times its predicted (or longest recent) time


def _encode_line(sizes: list[int], seconds: list[float]) -> tuple[float, float] | None:
    """(fixed seconds, seconds per byte) of encodes' times on their sizes: least squares over pairs
    whose sizes differ 1.5x or more, with a positive slope; else None."""
    if len(sizes) < 2 or max(sizes) < 1.5 * max(min(sizes), 1):
        return None
    return rising_line(sizes, seconds)


def encode_reserve(link: links.Link, download_bytes: int, compute_s: float, seconds: list[float],
                   sizes: list[int]) -> float:
    """Seconds to reserve for this round's encode in the budget, from the node's recent encodes
    (``seconds``, and the payload ``sizes`` they made, oldest first; ``sizes`` may be shorter: older
    states kept no sizes). None yet: as long as decode and training took (``compute_s``). Sizes that
    differ (slow start spreads them) give a line of seconds on bytes (the fit searches more and each
    encode writes more as the budget grows): :data:`ENCODE_MARGIN` x that line at the budget it
    leaves, the largest ``b`` with ``b <= upload_budget(link, download_bytes, compute_s + reserve(b))``.
    Otherwise :data:`ENCODE_MARGIN` x the longest recent encode."""
    if not seconds:
        return compute_s
    longest = ENCODE_MARGIN * max(seconds)
    pairs = list(zip(sizes[::-1], seconds[::-1]))  # aligned from the newest
    line = _encode_line([b for b, _ in pairs], [t for _, t in pairs])
    if line is None:
        return longest
    fixed, per_byte = line

    def reserve(b: int) -> float:
        return ENCODE_MARGIN * (fixed + per_byte * b)

    def fits(b: int) -> bool:
        got = links.upload_budget(link, download_bytes, compute_s + reserve(b))
        return got is not None and b <= got

    top = links.upload_budget(link, download_bytes, compute_s + reserve(0))
    if top is None or top == 0:
        return reserve(0) if top == 0 else longest
    if fits(top):
        return reserve(top)
    lo, hi = 0, top  # fits(lo), not fits(hi): the budget falls as b grows, so bisect
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return reserve(lo)


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
