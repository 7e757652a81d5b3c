"""Per-reply guards of ``CompressedStrategy`` that a hostile minority cannot steer.

Threat model: up to a minority of a round's sampled clients (fewer than half of the replies a
round waits for) collude; they may reply first, send any bytes, any metrics, any weight, any
update. Each guard costs a hostile client its own reply (or caps what it can weigh), never the
round or the run:

- **Relative norm bound** (:class:`RoundGuard`): an update longer than ``norm_factor`` x the
  reference norm is dropped. The reference is the lower median of the norms the previous round
  accepted (replies decided at once, streaming unchanged); with no such round (the first round,
  after a round that aggregated nothing) the replies are held until every message sent has its
  reply (or the round ends), then decided against the lower median of all of them: a set, not an
  arrival order, so a streamed round aggregates what a batch one does. Colluders replying first set
  neither reference: they are a minority of the last round's accepted replies and of this round's.
- **Weights** (:meth:`RoundGuard.weight`): a reply's weight (``num-examples``) is clipped to
  ``weight_factor`` x the lower median of the reference weights, and its influence (weight x
  update norm) to ``weight_factor**2`` x the median weight x the median norm, so one client
  declaring 1e12 examples, or a long update at a large weight, moves the mean no further than a
  few typical replies. Users who authenticate declared weights set ``weight_factor=0`` (trust them).
- **Metrics** (:func:`check_metrics`): exactly one MetricRecord, holding the weight key (Flower's
  strategies read it there), names that are short strings, values that are finite numbers or short
  lists of them. At the end of a round, replies whose metric names or kinds differ from the
  majority's are left out of the metric aggregate (logged), so the inner strategy's metric
  function never sees a mix it cannot add.
- **Model state that is not a weight** (:class:`StateGuard`): before an update reaches the sum,
  ``running_var`` of ``base + update`` must stay >= 0, counters (``num_batches_tracked``) may not
  go down, and every integer buffer moves by at most ``MAX_INTEGER_STEP``. The mean of such
  replies keeps them sane, so :class:`NonFiniteModel` stays a last resort.

What remains: a valid update inside every bound (a bias push within the norm bound, at a weight
the cap allows) still moves the mean by its share; bounding that is robust aggregation's question
(FedMedian, Krum... as the inner strategy). A hostile majority defeats any median.
"""

from __future__ import annotations

import math
import numbers
import statistics
from dataclasses import dataclass, field

import torch

import fedcomp
from fedcomp.aggregate import UpdateRejected
from fedcomp.tensor_kinds import COUNTER, classify

MAX_INTEGER_STEP = 2**24  # a reply moves an integer buffer by at most this much (exact in fp32 and fp64 sums)
MAX_METRICS = 256  # metric names per reply
MAX_METRIC_NAME = 128  # characters per metric name
MAX_METRIC_LIST = 1024  # values per list-valued metric
MAX_METRIC_VALUE = 2**53  # |an integer metric| (exact as a float)


class ReplyRejected(fedcomp.FedcompError):
    """A reply that a per-reply guard refused; its message is the reason logged."""


# -- norms and weights ---------------------------------------------------------------------------
@dataclass
class GuardHistory:
    """What the last round that aggregated accepted: the reference of the next round's guards."""

    norms: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    spec: str = ""  # the upload codec they were measured with (norms of another codec are no reference)

    def known(self, warmup: int) -> bool:
        return len(self.norms) >= warmup

    def clear(self) -> None:
        self.norms, self.weights = [], []


@dataclass
class RoundGuard:
    """One round's norm and weight decisions (see module docstring).

    ``quorum``: replies held before deciding when the history has no reference (the messages sent;
    at least ``warmup``); ``offer`` returns None while held. ``max_norm`` is absolute and always
    decides at once.
    """

    norm_factor: float
    max_norm: float
    warmup: int
    weight_factor: float
    quorum: int
    history: GuardHistory
    norms: list[float] = field(default_factory=list)  # this round's valid norms
    weights: list[float] = field(default_factory=list)  # and their declared weights
    accepted_norms: list[float] = field(default_factory=list)
    accepted_weights: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.quorum = max(int(self.quorum), int(self.warmup), 1)
        self._reference = self.history.known(self.warmup)  # decided at once against the last round

    @property
    def relative(self) -> bool:
        return bool(self.norm_factor or self.weight_factor)

    def offer(self, norm: float, weight: float) -> bool | None:
        """Record a valid update: True (accept), False (reject) or None (held until the quorum)."""
        if not math.isfinite(norm):
            raise UpdateRejected(f"update norm is {norm}")
        if self.max_norm and norm > self.max_norm:
            return False
        self.norms.append(norm)
        self.weights.append(weight)
        if not self.ready():
            return None
        return self.settle(norm)

    def ready(self) -> bool:
        """Whether held replies can be decided: a reference from the last round, or the quorum."""
        return not self.relative or self._reference or len(self.norms) >= self.quorum

    def _norm_reference(self) -> float:
        source = self.history.norms if self._reference else self.norms
        return statistics.median_low(source) if source else 0.0

    def bound(self) -> float:
        """The relative norm bound now (inf: off, or no reference yet)."""
        if not self.norm_factor:
            return math.inf
        ref = self._norm_reference()
        return self.norm_factor * ref if ref > 0 else math.inf

    def settle(self, norm: float) -> bool:
        """Decide a reply (held or not) with the bound as it stands."""
        return not (self.max_norm and norm > self.max_norm) and norm <= self.bound()

    def reason(self, norm: float) -> str:
        if self.max_norm and norm > self.max_norm:
            return (f"update norm {norm:.4g} exceeds max_update_norm={self.max_norm:g} (raise max-update-norm "
                    f"if such updates are legitimate)")
        where = ("the lower median of the norms accepted last round" if self._reference
                 else f"the lower median of this round's first {len(self.norms)} norms")
        return (f"update norm {norm:.4g} exceeds {self.norm_factor:g} x the median norm {self._norm_reference():.4g} "
                f"({where}; norm_factor, 0 turns this guard off)")

    def weight(self, declared: float, norm: float = 0.0) -> tuple[float, str | None, bool]:
        """The weight a reply counts with; the reason where it is less than declared (None: as
        declared); and whether the declared weight itself was above the cap (a claim no honest
        majority makes; the rest is influence: a long update at a large weight).

        Two bounds, both against the reference (the last round's accepted replies, or the quorum):
        the weight at most ``weight_factor`` x the lower median weight, and the reply's influence,
        weight x update norm, at most ``weight_factor**2`` x the median weight x the median norm, so
        that no reply moves the mean further than ``weight_factor**2`` typical replies together
        (an honest client with ``weight_factor`` x the median's data, and so about as many local
        steps, reaches it)."""
        if not self.weight_factor:
            return declared, None, False
        weights = self.history.weights if self._reference else self.weights
        if not weights:
            return declared, None, False
        median = statistics.median_low(weights)
        cap = self.weight_factor * median
        where = "last round's accepted replies" if self._reference else "this round's first replies"
        weight, reasons, over = declared, [], declared > cap
        if over:
            weight = cap
            reasons.append(f"weight {declared:g} clipped to weight_factor={self.weight_factor:g} x the lower median "
                           f"weight of {where} ({median:g}) = {cap:g}")
        ref = self._norm_reference()
        influence = self.weight_factor * cap * ref  # weight_factor**2 typical replies' weight x norm
        if self.norm_factor and ref > 0 and norm > 0 and weight * norm > influence:  # (norm guard off: no bound)
            limited = influence / norm
            reasons.append(f"weight {weight:g} x update norm {norm:.4g} limited to weight_factor**2 = "
                           f"{self.weight_factor ** 2:g} x the median weight x the median norm of {where} "
                           f"({median:g} x {ref:.4g}): counted as {limited:.4g}")
            weight = limited
        if not reasons:
            return declared, None, False
        return weight, "; ".join(reasons) + " (weight_factor=0 trusts declared weights)", over

    def accept(self, norm: float, weight: float) -> None:
        self.accepted_norms.append(norm)
        self.accepted_weights.append(weight)

    def close(self) -> None:
        """End of round: the accepted norms and weights are the next round's reference; a round
        that accepted too few to be a reference clears it (the next one holds a quorum again)."""
        if len(self.accepted_norms) >= self.warmup:
            self.history.norms, self.history.weights = list(self.accepted_norms), list(self.accepted_weights)
        elif not self.accepted_norms:
            self.history.clear()


# -- upload size -----------------------------------------------------------------------------------
UPLOAD_SLACK = 1.25  # x the configured upload's size (or bound), plus UPLOAD_SLACK_BYTES
UPLOAD_SLACK_BYTES = 1024


def upload_bound(spec: str, layout: fedcomp.Layout) -> tuple[int, int]:
    """(payload bytes a reply of upload ``spec`` may have on ``layout``, a dense payload's bytes).

    The first is the larger of the codec's size on a random update (one encode, once per spec
    and layout) and its computed size where it is known without data (with fixed-width indices
    where Rice-coded ones depend on the data: their bits are at most k (log2(n/k) + 2) for any
    positions); where the count kept depends on the data (threshold, DGC) the dense size. Both
    with ``UPLOAD_SLACK``."""
    dense = int(fedcomp.build_codec("none()").size_bytes(layout) * UPLOAD_SLACK) + UPLOAD_SLACK_BYTES
    spec = fedcomp.build_codec(spec).spec  # canonical: every argument written out
    sizes = []
    for candidate in (spec, spec.replace("index='rice'", "index='fixed'")):
        try:
            sizes.append(fedcomp.build_codec(candidate).size_bytes(layout))
        except (ValueError, fedcomp.FedcompError, AttributeError, TypeError):
            continue
    if not sizes:  # the count kept depends on the data
        return dense, dense
    try:
        g = torch.Generator().manual_seed(0)
        update = {t.name: torch.randn(t.shape, generator=g).to(t.torch_dtype) if t.is_float
                  else torch.zeros(t.shape, dtype=t.torch_dtype) for t in layout.tensors}
        sizes.append(len(fedcomp.build_codec(spec).encode(update).payload))
    except Exception:  # noqa: BLE001 - a bound, not a decision: the computed size stands
        pass
    limit = int(max(sizes) * UPLOAD_SLACK) + UPLOAD_SLACK_BYTES  # (a sketch of a tiny model outweighs it dense)
    return limit, max(dense, limit)


# -- metrics -------------------------------------------------------------------------------------
def _metric_value(name: str, value):
    if isinstance(value, bool):
        raise ReplyRejected(f"metric {name!r} is a bool ({value}); metrics are numbers or lists of numbers")
    if isinstance(value, numbers.Integral):
        if abs(int(value)) > MAX_METRIC_VALUE:
            raise ReplyRejected(f"metric {name!r} = {value} is outside +-2**53")
        return ("scalar",)
    if isinstance(value, numbers.Real):
        if not math.isfinite(float(value)):
            raise ReplyRejected(f"metric {name!r} is {value}; metrics must be finite numbers")
        return ("scalar",)
    if isinstance(value, list):
        if len(value) > MAX_METRIC_LIST:
            raise ReplyRejected(f"metric {name!r} is a list of {len(value)} values; at most {MAX_METRIC_LIST}")
        for v in value:
            _metric_value(name, v)
        return ("list", len(value))
    raise ReplyRejected(f"metric {name!r} is a {type(value).__name__}; metrics are numbers or lists of numbers")


def check_metrics(content, weight_key: str) -> tuple[str, dict, tuple]:
    """(record name, metrics, schema) of a reply's one MetricRecord; :class:`ReplyRejected` naming
    what is wrong otherwise (no or several MetricRecords, the weight key missing or not a number,
    a name or value outside what Flower's metric aggregation can add). ``schema``: the record's
    name and each metric's kind, compared across a round's replies."""
    records = list(content.metric_records.items())
    holders = [name for name, record in records if weight_key in record]
    if not holders:
        raise ReplyRejected(f"reply has no metric {weight_key!r} to weight its update by")
    if len(holders) > 1:
        raise ReplyRejected(f"metric {weight_key!r} appears in {len(holders)} MetricRecords {holders}: it must be "
                            f"in exactly one")
    if len(records) != 1:
        raise ReplyRejected(f"reply has {len(records)} MetricRecords {[n for n, _ in records]}; Flower's strategies "
                            f"aggregate exactly one (holding {weight_key!r})")
    name, record = records[0]
    if len(record) > MAX_METRICS:
        raise ReplyRejected(f"reply has {len(record)} metrics; at most {MAX_METRICS}")
    kinds = []
    for key, value in record.items():
        if not isinstance(key, str) or not key or len(key) > MAX_METRIC_NAME:
            raise ReplyRejected(f"metric name {str(key)[:40]!r} is invalid: a non-empty string of at most "
                                f"{MAX_METRIC_NAME} characters")
        if key == weight_key:  # its value is check_weight's (finite, > 0, at most the cap)
            if isinstance(value, list):
                raise ReplyRejected(f"metric {weight_key!r} must be a number, got a list")
            kinds.append((key, ("scalar",)))
            continue
        kinds.append((key, _metric_value(key, value)))
    return name, dict(record.items()), (name, tuple(sorted(kinds)))


def majority_schema(schemas: list[tuple]) -> tuple | None:
    """The schema most replies share (ties: the first seen of the most frequent); None for none."""
    if not schemas:
        return None
    counts: dict[tuple, int] = {}
    for s in schemas:
        counts[s] = counts.get(s, 0) + 1
    return max(counts, key=lambda s: counts[s])


def describe_schema(schema: tuple) -> str:
    name, kinds = schema
    return f"{name!r}: " + ", ".join(f"{k} ({'number' if kind == ('scalar',) else f'list of {kind[1]}'})"
                                     for k, kind in kinds)


# -- model state that is not a weight -------------------------------------------------------------
@dataclass
class StateGuard:
    """Per-reply checks of what an update does to running statistics and integer buffers.

    Built once per layout: the flat offsets of the ``running_var`` tensors and the integer buffers."""

    layout: fedcomp.Layout
    offsets: dict[str, tuple[int, int]]  # float tensors: (offset in the flat buffer, numel)
    max_integer_step: int = MAX_INTEGER_STEP

    def __post_init__(self) -> None:
        self.variances = [(name, *self.offsets[name]) for name in self.layout.names
                          if name.endswith("running_var") and name in self.offsets]
        self.counters = {t.name for t in self.layout.tensors if not t.is_float and classify(t) == COUNTER}

    @property
    def active(self) -> bool:
        return bool(self.variances) or len(self.offsets) < len(self.layout.tensors)

    def check(self, update, base: dict[str, torch.Tensor]) -> None:
        """Raise :class:`ReplyRejected` when ``base + update`` has a negative running variance, a
        counter that goes down, or an integer buffer that moves by more than ``max_integer_step``."""
        for name, t in getattr(update, "ints", {}).items():
            if not t.numel():
                continue
            step = t.to(torch.int64) if not t.is_floating_point() else t
            low, high = int(step.min()), int(step.max())
            if max(-low, high) > self.max_integer_step:
                raise ReplyRejected(f"update moves the integer buffer {name!r} by {high if high > -low else low}; at "
                                    f"most +-{self.max_integer_step} per round")
            if name in self.counters and name.endswith("num_batches_tracked") and low < 0:
                raise ReplyRejected(f"update moves the counter {name!r} back by {-low}; counters only count up")
        if not self.variances:
            return
        for start, idx, vals in update.pieces():
            n = vals.numel()
            for name, a, numel in self.variances:
                ref = base[name].reshape(-1)
                if idx is None:
                    lo, hi = max(start, a), min(start + n, a + numel)
                    if lo >= hi:
                        continue
                    new = ref[lo - a:hi - a].double() + vals.reshape(-1)[lo - start:hi - start].double()
                else:
                    pos = idx.to(torch.int64) + start
                    mask = (pos >= a) & (pos < a + numel)
                    if not bool(mask.any()):
                        continue
                    new = ref[pos[mask] - a].double() + vals.reshape(-1)[mask].double()
                if bool((new < 0).any()):
                    raise ReplyRejected(f"update makes the running variance {name!r} negative (min "
                                        f"{float(new.min()):.4g}); a variance is >= 0")


def check_exact(exact: torch.Tensor, specs, base: dict[str, torch.Tensor],
                max_integer_step: int = MAX_INTEGER_STEP) -> None:
    """:class:`StateGuard`'s checks for a FetchSGD upload's exact entries (``exact``: one flat
    float64 vector of ``specs`` in order, :meth:`fedcomp.server_feedback.ServerFeedback.decode`'s last
    value): running variances stay >= 0, counters do not go down, integer buffers move by at most
    ``max_integer_step``. Raises :class:`ReplyRejected`."""
    offset = 0
    for spec in specs:
        v = exact[offset:offset + spec.numel]
        offset += spec.numel
        if not v.numel():
            continue
        if not spec.is_float:
            low, high = float(v.min()), float(v.max())
            if max(-low, high) > max_integer_step:
                raise ReplyRejected(f"update moves the integer buffer {spec.name!r} by {high if high > -low else low:.0f}; "
                                    f"at most +-{max_integer_step} per round")
            if spec.name.endswith("num_batches_tracked") and low < 0:
                raise ReplyRejected(f"update moves the counter {spec.name!r} back by {-low:.0f}; counters only count up")
        elif spec.name.endswith("running_var"):
            new = base[spec.name].reshape(-1).double() + v
            if bool((new < 0).any()):
                raise ReplyRejected(f"update makes the running variance {spec.name!r} negative (min "
                                    f"{float(new.min()):.4g}); a variance is >= 0")


__all__ = ["GuardHistory", "RoundGuard", "ReplyRejected", "StateGuard", "check_metrics", "majority_schema",
           "upload_bound", "check_exact", "MAX_INTEGER_STEP"]
