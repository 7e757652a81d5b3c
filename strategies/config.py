"""``CompressionConfig``: everything ``CompressedStrategy`` can be told, checked once, frozen.

``CompressedStrategy(inner, upload=..., download=...)`` builds one from its keyword arguments;
``CompressedStrategy(inner, config=CompressionConfig(...))`` takes one as is. Every field is
validated in ``__post_init__`` (a :class:`fedcomp.SpecError` naming the value and what is allowed),
so a bad configuration fails at construction, before any round.

Defaults picked from the regime (the studies behind them: docs, Results, "Accuracy"):
``upload="auto"`` and ``download="auto"`` (the defaults) resolve at the first training round,
when the number of connected nodes, the number sampled and the model's size are known
(:meth:`CompressionConfig.resolve`):

* every node in every round (cross-silo, e.g. ``fraction_train=1``): upload
  ``topk(ratio=0.02)+qsgd(bits=4)`` with client error feedback, download the aggregate's support
  at 4 bits (:func:`silo_download`: ``topk(ratio=0.02 x nodes)+kbit(bits=4,stochastic=true)``;
  ``none()`` for the server optimizers and FedAvgM, whose steps are dense);
* every node in every round, a model with recurrent layers (LSTM, GRU, RNN; averaging strategies,
  not the server optimizers): FetchSGD as below at a 0.1 share
  (:data:`RECURRENT_SKETCH_RATIO`) without server momentum, the coupled download;
* a fraction of the nodes per round (cross-device, ``fraction_train < 1``): upload
  ``sketch(rows=1, cols=ceil(0.068 n), ratio=0.007)+qsgd(bits=4)`` (n = float parameters) with
  server-side error feedback (``aggregation="sketch"``, clients stateless) and server momentum 0.5
  (``server_momentum="auto"``), download coupled to
  it (``coupled_download``): ``cells(cols=<the sketch's>)+kbit(bits=4,stochastic=true)``, the
  step's heavy-hitter cells (with one hash row every coordinate of a cell moves by the cell's
  value: one value a cell travels, about 1/15 of the coordinates'), the server applies exactly
  what it broadcasts. Client residuals go stale when a client is seen rarely; the
  server-side error table does not.

An explicit upload spec resolves at the same moment: in cross-device its codec takes its
cross-device defaults where the spec writes none of them (:func:`fedcomp.cross_device_spec`:
``topk()`` and ``dgc()`` keep a tenth, ``powersgd()`` rank 8, ``sign()`` the rms scale, ``randomk()``
a quarter, rescaled and without residual).

Link budgets (``link_profile``, ``round_deadline_s``) and ``delta`` need per-client decoding, so
with them ``"auto"`` resolves to the cross-silo specs in every regime. Models with running
statistics (BatchNorm) in cross-device get the same sketch with their statistics exact beside it
(averaged exactly, no momentum; docs: Results, Cross-device).

Robust strategies whose aggregate is translation equivariant (FedMedian, FedTrimmedAvg, Krum,
MultiKrum, Bulyan: ``robust_sketch``) aggregate in sketch space in every regime
(:mod:`fedcomp.strategies.robust_sketch`): upload ``sketch(rows=1, cols=ceil(0.068 n),
ratio=0.05)+qsgd(bits=4)``, the strategy's own aggregate over the clients' tables, FetchSGD's
server step with momentum 0.9, 0 for a model with recurrent layers (``server_momentum="auto"``), coupled download
``cells(cols=<the sketch's>)+kbit(bits=4,stochastic=true)`` (the Krum family: a 0.1 share, one client's table
a round, in every regime); in cross-device the others take the averaging strategies' share
and momentum, the Krum family momentum 0 (momentum carried the rounds an
attacker won into the next ones). Sparse updates would defeat them (each
client's own 1% of coordinates leaves coordinate-wise medians at zero and makes distances between
clients meaningless); aligned sketch tables do not.

Flower's server optimizers (FedAdam, FedYogi, FedAdagrad, exact types) take the averaging
strategies' uploads (in cross-device FedAdam gets the sketch with a 0.05 share, FedYogi and FedAdagrad
``qsgd(bits=4)``), with server momentum 0: the wrapper runs their step itself on the accumulated
update, its second moment corrected by each coordinate's arrival rate
(:mod:`fedcomp.strategies.optimizer_sketch`; Flower's rule normalizes a burst of ``K`` rounds down to
one round's step). QFedAvg (re-weights each client's update by its loss) and subclasses of the
optimizers (``sparse_averse``) get the dense ``qsgd(bits=4)`` upload in every regime.
"""

from __future__ import annotations

import dataclasses
import math

import fedcomp
from fedcomp import links
from fedcomp.broadcast import parse_thresholds, parse_tiers
from fedcomp.budget import FALLBACKS, check_budgetable
from fedcomp.policy import is_policy

AGGREGATIONS = ("auto", "decode", "sketch")
AUTO = "auto"
SILO_UPLOAD = "topk(ratio=0.02)+qsgd(bits=4)"  # every node every round: client error feedback holds (2%: docs, Results, Regimes)
SILO_DOWNLOAD = "none()"  # before the first round, and for the strategies silo_download leaves dense
SILO_DOWNLOAD_BITS = 4  # the silo broadcast's values: 4-bit, stochastic rounding, the server keeps the rest
DENSE_UPLOAD = "qsgd(bits=4)"  # sparse-averse strategies: dense, unbiased (module docstring)
SKETCH_COLS_PER_PARAM = 0.068  # cross-device sketch columns per float parameter (16000 for 234k)
SKETCH_RATIO = 0.007  # heavy hitters applied per round; the coupled download sends the same share (docstring)
SKETCH_SERVER_MOMENTUM = 0.5  # FetchSGD's rho for the auto cross-device sketch ('auto'; docs: Results, Cross-device)
SKETCH_WARMUP_ROUNDS = 20  # server_warmup: rounds over which FetchSGD's step size falls to 1 (docs: Results, Slow start)
DENSE_CROSS_DEVICE_OPTIMIZERS = ("yogi", "adagrad")  # the sketch cost them accuracy cross-device (docs: Results, Server optimizers)
OPTIMIZER_SKETCH_RATIO = 0.05  # FedAdam/FedYogi/FedAdagrad in cross-device: 0.02 lost points on char-lstm, smaller ones on digits (docs: Results, Regimes)
RECURRENT_SKETCH_RATIO = 0.1  # every node every round, a model with recurrent layers: FetchSGD at this share, momentum 0 (docs: Results, Regimes)
ROBUST_SKETCH_RATIO = 0.05  # robust strategies in sketch space, cross-silo: the heavy hitters' share (docs: Results, Robust)
SELECTING_SKETCH_RATIO = 0.1  # the Krum family's, every regime: one client's table a round (docs: Results, Robust, Regimes)
ROBUST_SERVER_MOMENTUM = 0.9  # their server momentum in sketch space ('auto'; docs: Results, Robust)
PLACEHOLDER_PARAMS = 234_122  # before the model is known (the project's MLP): only cols depend on it


def cross_device_upload(numel: int, ratio: float = SKETCH_RATIO) -> str:
    """The cross-device upload for a model of ``numel`` float parameters (``ratio``: the heavy
    hitters' share; :data:`ROBUST_SKETCH_RATIO` for robust strategies in sketch space)."""
    cols = max(16, math.ceil(SKETCH_COLS_PER_PARAM * numel))
    return f"sketch(rows=1,cols={cols},ratio={ratio})+qsgd(bits=4)"


def coupled_download(ratio: float = SKETCH_RATIO, sketch=None) -> str:
    """The coupled download for a sketch of heavy-hitter share ``ratio``, 4-bit values with
    stochastic rounding (nearest rounding can lock the coupled loop: docs, Results): for a one-row
    ``sketch`` (its reducer) the step's cells (``cells``: one value per heavy-hitter cell, about
    1/15 of the coordinates' bytes; docs, Results, Regimes), else the same share of coordinates."""
    if sketch is not None and getattr(sketch, "rows", None) == 1:
        return f"cells(cols={sketch.config.cols},seed={sketch.config.seed})+kbit(bits=4,stochastic=true)"
    return f"topk(ratio={ratio})+kbit(bits=4,stochastic=true)"


def silo_download(sampled: int | None, upload: str = SILO_UPLOAD) -> str:
    """The cross-silo broadcast when every node sends ``upload``'s top-k: the aggregate's support, at most
    ``sampled`` clients' shares of coordinates (``topk(ratio=sampled x share)``; from half of the
    coordinates on, all of them: ``kbit`` alone), 4-bit values with stochastic rounding; the tier's
    error feedback keeps what the rounding drops (the figures: docs, Results, Regimes). ``sampled``
    unknown: ``none()``."""
    share = getattr(getattr(fedcomp.build_codec(upload).reducer, "config", None), "ratio", None)
    if not sampled or not share:
        return SILO_DOWNLOAD
    ratio = round(sampled * share, 6)
    quantizer = f"kbit(bits={SILO_DOWNLOAD_BITS},stochastic=true)"
    return quantizer if ratio >= 0.5 else f"topk(ratio={ratio:g})+{quantizer}"  # half: positions cost more than they save


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

    upload: str = AUTO  # codec spec of the clients' updates; 'auto': from the regime (module docstring)
    download: str = AUTO  # codec spec of broadcasts, tiers separated by '|' (tier 0 first); 'auto': from the regime
    error_feedback: bool = True  # clients keep what compression dropped and send it later
    seed: int = 0  # run seed: with round and node it seeds random-k and stochastic rounding
    aggregation: str = "auto"  # 'auto' (sketch for linear codecs, else decode), 'decode' or 'sketch' (FetchSGD)
    server_momentum: float | str = AUTO  # FetchSGD's rho (aggregation 'sketch'); 'auto': 0.9 for robust
    # strategies in sketch space with the auto upload, else 0 (module docstring)
    server_warmup: float | str = AUTO  # FetchSGD's step size in round 1, falling to 1 over SKETCH_WARMUP_ROUNDS
    # (aggregation 'sketch', averaging strategies; 1: off); 'auto': 1, opt-in (docs: Results, Slow start)
    delta: float = 0.0  # delta coding of uploads against the client's previous update (0: off)
    max_update_norm: float = 0.0  # absolute bound on an update's L2 norm (0: off)
    norm_factor: float = 10.0  # drop updates longer than this x the round's median norm (0: off)
    norm_warmup: int = 3  # norms needed before the relative guard decides (earlier replies wait)
    max_weight: float = 0.0  # cap on a reply's weight (its example count; 0: only the hard limit 2**53)
    weight_factor: float = 2.0  # clip a weight to this x the median weight (guards.RoundGuard; 0: trust declared weights)
    max_failed_rounds: int = 3  # stop the run after this many consecutive rounds with no usable reply
    download_tier_kbps: str = ""  # downlink kbps thresholds between tiers, ascending
    download_max_stale: int = 0  # optional cap on catch-up chains in steps (0: none, bounded by bytes)
    seeded_init: bool = False  # every node builds the round-0 model from the seed (make_compression_mod)
    coupled_download: bool = False  # sketch aggregation: tier 0 broadcasts the server's step itself
    link_profile: str = links.NONE  # simulation links: preset, 'mixed', a table path, or 'none'
    round_deadline_s: float = 0.0  # round deadline in seconds (0: none); sets byte budgets
    budget_fallback: str = "skip"  # below the coarsest setting: 'skip' or 'coarsest'
    streaming: bool = True  # decode replies as they arrive
    compress_evaluate: bool = True  # evaluate broadcasts through the tiers' references (capable clients)
    exact_statistics: bool = True  # BatchNorm running statistics travel exact (fedcomp.tensor_kinds)

    def __post_init__(self) -> None:
        for name in ("upload", "download"):
            if not isinstance(getattr(self, name), str):
                raise fedcomp.SpecError(f"{name}={getattr(self, name)!r} is invalid: a codec spec string or 'auto'")
        if self.aggregation not in AGGREGATIONS:
            raise fedcomp.SpecError(
                f"aggregation={self.aggregation!r} is invalid: one of {AGGREGATIONS} ('auto': sketch space for "
                f"linear codecs such as sketch(...), decoded otherwise)")
        for name in ("error_feedback", "streaming", "compress_evaluate", "exact_statistics", "seeded_init",
                     "coupled_download"):
            if not isinstance(getattr(self, name), bool):
                raise fedcomp.SpecError(f"{name}={getattr(self, name)!r} is invalid: True or False")
        if self.upload == AUTO or self.download == AUTO:  # the rest is checked once resolved
            self.resolve(partial=False)
            self.resolve(partial=True)
            return
        codec = fedcomp.build_codec(self.upload)  # SpecError on a bad spec
        agg = self.resolved_aggregation
        if agg == "sketch" and not _linear_reducer(codec):
            raise fedcomp.SpecError(
                f"aggregation='sketch' needs an upload codec whose reducer is linear, such as "
                f"'sketch(rows=1, cols=16000, ratio=0.01)+qsgd(bits=4)', got {self.upload!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise fedcomp.SpecError(f"seed={self.seed!r} is invalid: an integer")
        if self.server_momentum != AUTO:
            _number("server_momentum", self.server_momentum, 0, 1, allowed="'auto' or a float in [0, 1)")
        if self.server_warmup != AUTO:
            _number("server_warmup", self.server_warmup, 1, 100.0000001,
                    allowed="'auto' or a factor in [1, 100]: FetchSGD's step size in round 1 (1: off)")
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
        for name, low in (("norm_warmup", 1), ("max_failed_rounds", 1), ("download_max_stale", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise fedcomp.SpecError(f"{name}={v!r} is invalid: it must be a positive integer")
        _number("max_weight", self.max_weight, 0, allowed="a finite float >= 0 (0: no cap below 2**53)")
        _number("weight_factor", self.weight_factor, 0,
                allowed="0 (trust declared weights) or a finite float >= 1: clip weights to weight_factor x the "
                        "median weight")
        if self.weight_factor and self.weight_factor < 1:
            raise fedcomp.SpecError(f"weight_factor={self.weight_factor!r} is invalid: 0 (trust declared weights) or "
                                    f">= 1 (the median weight itself must count in full)")
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
        if self.coupled_download and agg != "sketch":
            raise fedcomp.SpecError(
                f"coupled_download=True needs aggregation='sketch' (the server's step is what it broadcasts), "
                f"got upload {self.upload!r} aggregated {agg!r}")

    @property
    def auto(self) -> bool:
        """Whether the upload or download spec is still to be picked from the regime."""
        return AUTO in (self.upload, self.download)

    @property
    def regime_dependent(self) -> bool:
        """Whether the upload is an explicit spec that takes cross-device defaults (it writes none of a
        stage's :func:`fedcomp.cross_device_spec` set); resolved at the first training round, like ``"auto"``."""
        return (self.upload != AUTO and not is_policy(self.upload)
                and fedcomp.cross_device_spec(self.upload) != self.upload)

    def resolve(self, *, partial: bool, numel: int | None = None, sparse_averse: bool = False,
                robust_sketch: bool = False, support_nodes: int | None = None, recurrent: bool = False,
                robust_momentum: float = ROBUST_SERVER_MOMENTUM, robust_share: float = ROBUST_SKETCH_RATIO,
                server_optimizer: str | None = None) -> "CompressionConfig":
        """This config with ``"auto"`` specs replaced for the regime (module docstring).

        ``partial``: not every connected node is sampled each round (cross-device); ``numel``:
        the model's float parameters (sets the sketch's cols; None: a placeholder until the
        model is known); ``sparse_averse``: the inner strategy compares or re-weights each client's
        update or normalizes it per coordinate (robust aggregators, QFedAvg, FedAdam...);
        ``robust_sketch``: the inner strategy's aggregate can run over the clients' sketch tables
        (:func:`fedcomp.strategies.robust_sketch.robust_in_sketch_space`); ``robust_momentum``: its
        server momentum for ``server_momentum='auto'`` (:func:`~fedcomp.strategies.robust_sketch.robust_momentum`); ``robust_share``: its heavy
        hitters' share (:func:`~fedcomp.strategies.robust_sketch.robust_share`);
        ``recurrent``: the model has recurrent layers (LSTM, GRU, RNN): every node every round, the
        averaging strategies take FetchSGD at :data:`RECURRENT_SKETCH_RATIO` without server momentum
        (top-k 2% with client residuals lagged on an LSTM; docs, Results, Regimes);
        ``support_nodes``: the nodes whose top-k make up the cross-silo broadcast's support (the nodes
        sampled in the first training round, :func:`silo_download`; None: a dense broadcast, before
        that round and for strategies whose step is dense, FedAvgM); ``server_optimizer``: ``'adam'``, ``'yogi'`` or ``'adagrad'`` for Flower's FedAdam, FedYogi or
        FedAdagrad, whose step the wrapper runs on the accumulated update
        (:mod:`fedcomp.strategies.optimizer_sketch`): FetchSGD's server momentum stays 0 for them, and
        in cross-device FedYogi and FedAdagrad keep ``qsgd(bits=4)``. ``server_warmup='auto'`` is 1
        (off) in every regime: the warm-up is opt-in (docs: Results, Slow start).
        An explicit upload spec in cross-device takes its codec's cross-device defaults where it
        writes none of them (:func:`fedcomp.cross_device_spec`: ``topk()`` keeps a tenth);
        otherwise a config without ``"auto"`` comes back as is.
        """
        cross_device = partial and self.regime_dependent
        if not self.auto and not cross_device:
            if self.server_momentum != AUTO and self.server_warmup != AUTO:
                return self
            return dataclasses.replace(
                self, server_momentum=0.0 if self.server_momentum == AUTO else self.server_momentum,
                server_warmup=1.0 if self.server_warmup == AUTO else self.server_warmup)
        budgets = self.link_profile != links.NONE or self.round_deadline_s or self.delta
        recurrent_silo = recurrent and not partial and not server_optimizer  # FedAdam held with top-k there
        sketchable = ((self.aggregation == "sketch" or ((partial or recurrent_silo) and self.aggregation == AUTO))
                      and not budgets)  # BatchNorm statistics travel exact beside the sketch (Aggregation)
        fetchsgd_auto = False  # 'auto' resolved to FetchSGD for an averaging strategy: its server momentum
        robust = (self.upload == AUTO and robust_sketch and self.aggregation in (AUTO, "sketch")
                  and not budgets)  # statistics, as for the averaging strategies, exact beside the sketch
        if robust:  # the strategy's own aggregate over aligned sketch tables, in every regime
            upload = cross_device_upload(numel or PLACEHOLDER_PARAMS, robust_share)
        elif self.upload == AUTO and self.aggregation != "sketch" and (
                sparse_averse or (partial and server_optimizer in DENSE_CROSS_DEVICE_OPTIMIZERS)):
            upload = DENSE_UPLOAD
        elif self.upload == AUTO:
            share = (OPTIMIZER_SKETCH_RATIO if server_optimizer else RECURRENT_SKETCH_RATIO if recurrent_silo
                     else SKETCH_RATIO)
            upload = cross_device_upload(numel or PLACEHOLDER_PARAMS, share) if sketchable else SILO_UPLOAD
            fetchsgd_auto = sketchable and not server_optimizer
        else:
            upload = fedcomp.cross_device_spec(self.upload) if cross_device else self.upload
        codec = fedcomp.build_codec(upload)
        sketch = self.aggregation == "sketch" or (self.aggregation == AUTO and _linear_reducer(codec))
        coupled = self.coupled_download
        if self.download == AUTO:
            coupled = sketch and self.link_profile == links.NONE
            ratio = getattr(codec.reducer, "ratio", SKETCH_RATIO) if sketch else SKETCH_RATIO  # sketch's effective share
            if coupled:
                download = coupled_download(ratio, codec.reducer if sketch else None)
            elif upload == SILO_UPLOAD and self.upload == AUTO and not partial and not server_optimizer:
                download = silo_download(support_nodes, upload)  # the averaging strategies' top-k, every node
            else:
                download = SILO_DOWNLOAD
        else:
            download = self.download
        momentum = self.server_momentum
        if momentum == AUTO:
            momentum = (robust_momentum if robust else 0.0 if recurrent_silo
                        else SKETCH_SERVER_MOMENTUM if fetchsgd_auto else 0.0)
        warmup = 1.0 if self.server_warmup == AUTO else self.server_warmup  # opt-in (the class docstring)
        return dataclasses.replace(self, upload=upload, download=download, coupled_download=coupled,
                                   server_momentum=momentum, server_warmup=warmup)

    @property
    def warmup(self):
        """FetchSGD's warm-up (:class:`fedcomp.server_feedback.Warmup`), or None: ``server_warmup``
        above 1 (``'auto'`` before it is resolved: none)."""
        from fedcomp.server_feedback import Warmup

        scale = 1.0 if self.server_warmup == AUTO else float(self.server_warmup)
        return Warmup(scale=scale, rounds=SKETCH_WARMUP_ROUNDS) if scale > 1 else None

    @property
    def momentum(self) -> float:
        """FetchSGD's rho: ``server_momentum``, or 0 while it is ``'auto'`` and not resolved."""
        return 0.0 if self.server_momentum == AUTO else float(self.server_momentum)

    @property
    def resolved_aggregation(self) -> str:
        """'sketch' or 'decode' ('auto' resolved by the upload codec's linearity)."""
        if self.aggregation != "auto":
            return self.aggregation
        if self.upload == AUTO:
            raise fedcomp.FedcompError("upload='auto' is not resolved yet: call resolve() first")
        return "sketch" if _linear_reducer(fedcomp.build_codec(self.upload)) else "decode"

    @property
    def client_error_feedback(self) -> bool:
        """What clients are told: FetchSGD clients are stateless (the error lives on the server)."""
        return False if self.resolved_aggregation == "sketch" else self.error_feedback
