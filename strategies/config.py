"""``CompressionConfig``: everything ``CompressedStrategy`` can be told, checked once, frozen.

``CompressedStrategy(inner, upload=..., download=...)`` builds one from its keyword arguments;
``CompressedStrategy(inner, config=CompressionConfig(...))`` takes one as is. Every field is
validated in ``__post_init__`` (a :class:`fedcomp.SpecError` naming the value and what is allowed),
so a bad configuration fails at construction, before any round.
"""

from __future__ import annotations

import dataclasses
import math

import fedcomp
from fedcomp import links
from fedcomp.broadcast import parse_thresholds, parse_tiers
from fedcomp.budget import FALLBACKS, check_budgetable

AGGREGATIONS = ("auto", "decode", "sketch")


def _number(name: str, value, lo: float, hi: float = math.inf, *, lo_open: bool = False, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (lo < value if lo_open else lo <= value) and value < hi):
        raise fedcomp.SpecError(f"{name}={value!r} is invalid: {allowed}")
    return float(value)


def _linear_reducer(codec) -> bool:
    """Uploads the server can sum while compressed: a linear reducer (``sketch``), any quantizer
    after it (the server dequantizes each table before summing)."""
    return codec.reducer is not None and bool(codec.reducer.linear)


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """Transport settings of a compressed run (see :class:`CompressedStrategy` for the long form)."""

    upload: str = "topk(ratio=0.01)+qsgd(bits=4)"  # codec spec of the clients' updates
    download: str = "none()"  # codec spec of broadcasts, or tiers separated by '|' (tier 0 first)
    error_feedback: bool = True  # clients keep what compression dropped and send it later
    seed: int = 0  # run seed: with round and node it seeds random-k and stochastic rounding
    aggregation: str = "auto"  # 'auto' (sketch for linear codecs, else decode), 'decode' or 'sketch' (FetchSGD)
    server_momentum: float = 0.0  # FetchSGD's rho (aggregation 'sketch')
    delta: float = 0.0  # delta coding of uploads against the client's previous update (0: off)
    max_update_norm: float = 0.0  # absolute bound on an update's L2 norm (0: off)
    norm_factor: float = 10.0  # drop updates longer than this x the round's median norm (0: off)
    norm_warmup: int = 3  # norms needed before the relative guard decides (earlier replies wait)
    max_weight: float = 0.0  # cap on a reply's weight (its example count; 0: only the hard limit 2**53)
    max_failed_rounds: int = 3  # stop the run after this many consecutive rounds with no usable reply
    download_tier_kbps: str = ""  # downlink kbps thresholds between tiers, ascending
    download_max_stale: int = 10  # steps a client may miss before it gets the full reference
    link_profile: str = links.NONE  # simulation links: preset, 'mixed', a table path, or 'none'
    round_deadline_s: float = 0.0  # round deadline in seconds (0: none); sets byte budgets
    budget_fallback: str = "skip"  # below the coarsest setting: 'skip' or 'coarsest'
    streaming: bool = True  # decode replies as they arrive
    compress_evaluate: bool = True  # evaluate broadcasts through the tiers' references (capable clients)
    exact_statistics: bool = True  # BatchNorm running statistics travel exact (fedcomp.tensor_kinds)

    def __post_init__(self) -> None:
        codec = fedcomp.build_codec(self.upload)  # SpecError on a bad spec
        if self.aggregation not in AGGREGATIONS:
            raise fedcomp.SpecError(
                f"aggregation={self.aggregation!r} is invalid: one of {AGGREGATIONS} ('auto': sketch space for "
                f"linear codecs such as sketch(...), decoded otherwise)")
        agg = self.resolved_aggregation
        if agg == "sketch" and not _linear_reducer(codec):
            raise fedcomp.SpecError(
                f"aggregation='sketch' needs an upload codec whose reducer is linear, such as "
                f"'sketch(rows=1, cols=16000, ratio=0.01)+qsgd(bits=4)', got {self.upload!r}")
        for name in ("error_feedback", "streaming", "compress_evaluate", "exact_statistics"):
            if not isinstance(getattr(self, name), bool):
                raise fedcomp.SpecError(f"{name}={getattr(self, name)!r} is invalid: True or False")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise fedcomp.SpecError(f"seed={self.seed!r} is invalid: an integer")
        _number("server_momentum", self.server_momentum, 0, 1, allowed="it must be in [0, 1)")
        _number("delta", self.delta, 0, 1.0000001, allowed="delta must be in [0, 1] (0 turns delta coding off)")
        if self.delta > 1:
            raise fedcomp.SpecError(f"delta={self.delta!r} is invalid: delta must be in [0, 1] (0 turns delta coding off)")
        if self.delta and agg == "sketch":
            raise fedcomp.SpecError("delta coding needs per-client decoding; it does not combine with aggregation='sketch'")
        _number("max_update_norm", self.max_update_norm, 0,
                allowed="it must be a finite float >= 0 (0 turns the bound off)")
        _number("norm_factor", self.norm_factor, 0,
                allowed="a finite float >= 0: drop updates longer than norm_factor x the round's median (0: off)")
        if self.norm_factor and self.norm_factor < 1:
            raise fedcomp.SpecError(f"norm_factor={self.norm_factor!r} is invalid: 0 (off) or >= 1 (the median "
                                    f"update itself must pass)")
        for name, low in (("norm_warmup", 1), ("max_failed_rounds", 1), ("download_max_stale", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise fedcomp.SpecError(f"{name}={v!r} is invalid: it must be a positive integer")
        _number("max_weight", self.max_weight, 0, allowed="a finite float >= 0 (0: no cap below 2**53)")
        tiers = parse_tiers(self.download)
        parse_thresholds(self.download_tier_kbps, len(tiers))
        links.check_profile(self.link_profile)
        _number("round_deadline_s", self.round_deadline_s, 0, allowed="seconds >= 0 (0: no deadline)")
        if self.budget_fallback not in FALLBACKS:
            raise fedcomp.SpecError(f"budget_fallback={self.budget_fallback!r} is invalid: one of {FALLBACKS}")
        if self.link_profile != links.NONE and agg == "sketch":
            raise fedcomp.SpecError(
                "budgets give clients sketches of different cols, which cannot be summed in sketch space: "
                "use aggregation='decode' with link_profile, or link_profile='none'")
        if self.round_deadline_s > 0:
            check_budgetable(self.upload)  # every client with a link gets a budget: the codec needs a free parameter

    @property
    def resolved_aggregation(self) -> str:
        """'sketch' or 'decode' ('auto' resolved by the upload codec's linearity)."""
        if self.aggregation != "auto":
            return self.aggregation
        return "sketch" if _linear_reducer(fedcomp.build_codec(self.upload)) else "decode"

    @property
    def client_error_feedback(self) -> bool:
        """What clients are told: FetchSGD clients are stateless (the error lives on the server)."""
        return False if self.resolved_aggregation == "sketch" else self.error_feedback
