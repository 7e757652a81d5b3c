"""Closed-loop compression: a per-client byte budget driven by the training signal, and link
estimates measured from transfers instead of declared.

Both produce *byte budgets*, the input of :func:`fedcomp.budget.fit_update`, which moves the
codec's free parameter (top-k ratio, bits, rank, sketch columns) to fit; so they compose with
declared links (the smaller budget wins), download tiers and every budgetable codec.

Accuracy-driven (:class:`StrengthController`), once per round after the server evaluates::

    signal s_t (server-side accuracy, or minus the loss), best = max of earlier signals
    s_t > best + tolerance          on track: after `patience` such rounds, budget *= tighten
    s_t < best - tolerance          degrading: budget *= relax, then `cooldown` rounds without tightening
    otherwise (within tolerance)    stalled: after `patience` such rounds, budget *= relax
    budget clamped to [lowest, highest]

Tightening needs repeated progress and is blocked after every relax (hysteresis), so a noisy
signal makes the budget hold rather than oscillate. Relaxing on a stall costs bytes only when
training has settled below what less compression would reach; at `highest` it stops.

Measured links (:class:`LinkEstimator`): per node and direction, the last `window` transfers
(bytes, seconds) are fitted to ``seconds = latency + bytes * 8 / (kbps * 1000)`` by least squares
when their sizes differ enough to tell latency from bandwidth, else with the latency estimated
so far (or 0).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from fedcomp.errors import FedcompError


class AdaptError(FedcompError, ValueError):
    """An adaptive-compression setting or observation is invalid."""


def _positive(name: str, value: float, *, below_one: bool = False, above_one: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise AdaptError(f"{name}={value!r} is invalid: {name} must be a finite number > 0")
    if below_one and not value < 1:
        raise AdaptError(f"{name}={value!r} is invalid: {name} must be in (0, 1)")
    if above_one and not value > 1:
        raise AdaptError(f"{name}={value!r} is invalid: {name} must be > 1")
    return float(value)


@dataclass
class StrengthController:
    """A per-client upload byte budget moved by the training signal (see the module docstring)."""

    lowest: int  # smallest budget, bytes (the strongest compression allowed)
    highest: int  # largest budget, bytes (the weakest compression allowed)
    start: int  # first round's budget, bytes
    tighten: float = 0.7  # budget factor after `patience` on-track rounds (< 1)
    relax: float = 1.6  # budget factor when the signal drops or stalls (> 1)
    tolerance: float = 0.005  # signal change that counts (accuracy: half a point)
    patience: int = 2  # rounds of progress before tightening, of stall before relaxing
    cooldown: int = 3  # rounds after a relax in which the budget is not tightened
    budget: float = field(init=False)
    best: float = field(init=False, default=-math.inf)
    history: list[dict] = field(init=False, default_factory=list)  # per round: signal, decision, budget
    _progress: int = field(init=False, default=0)
    _stalled: int = field(init=False, default=0)
    _quiet: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        for name in ("lowest", "highest", "start"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AdaptError(f"{name}={v!r} is invalid: {name} must be a positive integer (bytes)")
        if not self.lowest <= self.start <= self.highest:
            raise AdaptError(f"start={self.start} is invalid: it must lie in [lowest={self.lowest}, highest={self.highest}]")
        _positive("tighten", self.tighten, below_one=True)
        _positive("relax", self.relax, above_one=True)
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) or not 0 <= self.tolerance < math.inf:
            raise AdaptError(f"tolerance={self.tolerance!r} is invalid: tolerance must be a finite number >= 0")
        for name in ("patience", "cooldown"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "patience" else 0):
                raise AdaptError(f"{name}={v!r} is invalid: {name} must be an integer >= {1 if name == 'patience' else 0}")
        self.budget = float(self.start)

    def current(self) -> int:
        """The budget for the next round, bytes."""
        return int(self.budget)

    def update(self, round: int, signal: float) -> int:
        """Take round ``round``'s signal (higher is better) and return the next round's budget."""
        if isinstance(signal, bool) or not isinstance(signal, (int, float)) or not math.isfinite(signal):
            raise AdaptError(f"signal={signal!r} for round {round} is invalid: it must be a finite number")
        decision = "hold"
        if signal > self.best + self.tolerance:
            self._progress, self._stalled = self._progress + 1, 0
            if self._progress >= self.patience and not self._quiet:
                decision, self._progress = "tighten", 0
        elif signal < self.best - self.tolerance:
            decision, self._progress, self._stalled = "relax", 0, 0
        else:
            self._progress, self._stalled = 0, self._stalled + 1
            if self._stalled >= self.patience:
                decision, self._stalled = "relax", 0
        self.best = max(self.best, signal)
        self._quiet = max(0, self._quiet - 1)
        if decision == "tighten":
            self.budget = max(float(self.lowest), self.budget * self.tighten)
        elif decision == "relax":
            if self.budget >= self.highest:
                decision = "hold"  # nothing left to relax
            self.budget = min(float(self.highest), self.budget * self.relax)
            self._quiet = self.cooldown
        self.history.append({"round": round, "signal": float(signal), "decision": decision, "budget": self.current()})
        return self.current()


@dataclass
class LinkEstimator:
    """Per node and direction ('up' or 'down'): kbps and latency fitted to observed transfers."""

    window: int = 8  # transfers kept per node and direction
    spread: float = 1.5  # largest/smallest size ratio above which latency is fitted, not assumed
    _seen: dict[tuple[int, str], deque] = field(init=False, default_factory=dict)

    def observe(self, node: int, direction: str, nbytes: int, seconds: float) -> None:
        """Record one transfer of ``nbytes`` that took ``seconds``."""
        if direction not in ("up", "down"):
            raise AdaptError(f"direction={direction!r} is invalid: it must be 'up' or 'down'")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise AdaptError(f"nbytes={nbytes!r} is invalid: it must be a positive integer")
        _positive("seconds", seconds)
        self._seen.setdefault((int(node), direction), deque(maxlen=self.window)).append((nbytes, float(seconds)))

    def estimate(self, node: int, direction: str) -> tuple[float, float] | None:
        """(kbps, latency seconds), or None before any transfer was seen."""
        seen = self._seen.get((int(node), direction))
        if not seen:
            return None
        sizes = [b for b, _ in seen]
        latency = 0.0
        if len(seen) >= 3 and max(sizes) >= self.spread * min(sizes):
            n = len(seen)
            mx = sum(sizes) / n
            my = sum(s for _, s in seen) / n
            sxx = sum((b - mx) ** 2 for b in sizes)
            slope = sum((b - mx) * (s - my) for b, s in seen) / sxx
            if slope > 0:
                latency = max(0.0, my - slope * mx)
        # bandwidth from the time left after latency, over all kept transfers (a sum, not a mean of ratios)
        busy = sum(max(s - latency, 1e-9) for _, s in seen)
        return sum(sizes) * 8 / busy / 1000, latency
