"""Server optimizers (FedAdam, FedYogi, FedAdagrad) on compressed, accumulated updates.

FedAdam's step is ``eta * m / (sqrt(v) + tau)`` per coordinate: it keeps the direction of the
round's mean update and normalizes its size away. Compressed uploads with error feedback (client
top-k residuals, FetchSGD's server-side error table) deliver a coordinate's update in bursts: held
back for ``K`` rounds, then sent at once, ``K`` times as large. Given such a burst, Flower's FedAdam
moves that coordinate by about what one round moves it (the size is normalized away) where the
uncompressed run moved it ``K`` times: rarely sent coordinates fall behind, and the run is slow
(the studies: docs, Results, "Server optimizers").

:class:`SparseServerOptimizer` keeps the optimizer's per-coordinate scale honest instead. A
coordinate delivered once every ``K`` rounds with ``K x g`` has a mean square of ``K g^2`` per
round, ``K`` times the uncompressed one; multiplied by the coordinate's arrival rate ``p = 1/K``
(an average of "sent this round" over rounds, with the second moment's decay) it is ``g^2`` again.
So the second moment is fed ``p * d^2`` instead of ``d^2`` (Adam, Yogi and Adagrad update it as
they do), and the step is linear in the delivered update ``d``: ``eta * d / (sqrt(v) + tau)``.
A burst of ``K`` rounds then moves the model by ``K`` rounds' worth, as the uncompressed
optimizer would; with dense updates (``p = 1``) and momentum it is the inner strategy's own rule.

Two places use it:

* decoded uploads (cross-silo: each client's top-k with its residual): the replies' weighted mean
  minus the global model is ``d`` (:func:`optimizer_model`; :class:`OptimizerOnUpdates` as an inner
  strategy). ``momentum=True`` steps along ``m``, the moving average of ``d`` with the inner
  strategy's ``beta_1`` (Flower's rule exactly on dense updates), ``momentum=False`` along ``d``:
  on sparse uploads the moving average spreads each burst over the next rounds on top of the delay
  the residual already adds, and lost to ``d`` in the study (docs, Results, "Server optimizers");
* :class:`OptimizerFeedback`, FetchSGD's server step (:class:`fedcomp.server_feedback.ServerFeedback`)
  with the optimizer after the unsketch: the heavy hitters of the error table are ``d`` and the
  step is applied where they are, so it stays as sparse as the heavy hitters (the coupled
  download sends exactly it; what its quantizer drops goes back into the error table, in the
  table's units). FetchSGD's ``server_momentum`` is the momentum here.

Running statistics and counters (BatchNorm) take the clients' mean, not an optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedYogi, Strategy

from fedcomp.errors import SpecError
from fedcomp.layout import Layout
from fedcomp.server_feedback import ServerFeedback, _to_dtype
from fedcomp.strategies.part import Part
from fedcomp.tensor_kinds import WEIGHT, split_kinds

VARIANTS = ("adam", "yogi", "adagrad")
SERVER_OPTIMIZERS = (FedAdam, FedYogi, FedAdagrad)


def variant_of(strategy: Strategy) -> str | None:
    """``'adam'``, ``'yogi'`` or ``'adagrad'`` for Flower's FedAdam, FedYogi, FedAdagrad (and
    subclasses), None for other strategies."""
    for cls, name in ((FedYogi, "yogi"), (FedAdagrad, "adagrad"), (FedAdam, "adam")):
        if isinstance(strategy, cls):
            return name
    return None


class SparseServerOptimizer:
    """FedAdam / FedYogi / FedAdagrad's server rule for updates that arrive in bursts (module docstring).

    Parameters
    ----------
    eta, beta_1, beta_2, tau : float
        The inner strategy's settings (Flower's names): server learning rate, momentum, second
        moment decay (Adam, Yogi), and the adaptivity floor.
    variant : str
        ``'adam'``, ``'yogi'`` or ``'adagrad'``: how the second moment is updated.
    momentum : bool (default: True)
        Step along the moving average of the updates (``beta_1``), a dense step; False: along the
        update itself, zero wherever the update is zero.
    """

    def __init__(self, *, eta: float, beta_1: float, beta_2: float, tau: float, variant: str = "adam",
                 momentum: bool = True) -> None:
        if variant not in VARIANTS:
            raise SpecError(f"variant={variant!r} is invalid: one of {VARIANTS}")
        for name, value, lo, hi in (("eta", eta, 0, math.inf), ("beta_1", beta_1, 0, 1), ("beta_2", beta_2, 0, 1),
                                    ("tau", tau, 0, math.inf)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value < hi:
                raise SpecError(f"{name}={value!r} is invalid: a float in [{lo}, {hi})")
        if eta == 0 or tau == 0:
            raise SpecError(f"eta={eta!r} and tau={tau!r} must be > 0")
        self.eta, self.beta_1, self.beta_2, self.tau = float(eta), float(beta_1), float(beta_2), float(tau)
        self.variant = variant
        self.momentum = bool(momentum)
        # the arrival rate's decay: the second moment's (Adagrad has none: a long average)
        self.rate_decay = self.beta_2 if variant != "adagrad" and self.beta_2 > 0 else 0.99
        self.t = 0  # steps taken
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.p: dict[str, torch.Tensor] = {}  # arrival rate, not bias-corrected

    @classmethod
    def of(cls, strategy: Strategy, *, momentum: bool = True) -> "SparseServerOptimizer":
        """The optimizer of a Flower FedAdam, FedYogi or FedAdagrad, with its settings."""
        variant = variant_of(strategy)
        if variant is None:
            raise SpecError(f"{type(strategy).__name__} has no server optimizer: FedAdam, FedYogi or FedAdagrad "
                            f"(or a subclass) is needed")
        return cls(eta=strategy.eta, beta_1=strategy.beta_1, beta_2=strategy.beta_2, tau=strategy.tau,
                   variant=variant, momentum=momentum)

    def scale(self, update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Advance the second moment and the arrival rate by one round's update ``d`` (float tensors)
        and return this round's per-coordinate factor, as Flower writes it: Adam
        ``eta * sqrt(1 - beta_2^(t+1)) / (sqrt(v) + tau)``, Yogi and Adagrad ``eta / (sqrt(v) + tau)``
        (``t``: the steps taken, this one included)."""
        self.t += 1
        lr = self.eta * math.sqrt(1 - self.beta_2 ** (self.t + 1)) if self.variant == "adam" else self.eta
        out = {}
        for name, d in update.items():
            d = d.detach().to(torch.float64)
            if name not in self.v:
                self.v[name] = torch.zeros_like(d)
                self.p[name] = torch.zeros_like(d)
            v, p = self.v[name], self.p[name]
            p.mul_(self.rate_decay).add_((d != 0).to(torch.float64), alpha=1 - self.rate_decay)
            rate = p / (1 - self.rate_decay ** self.t)  # bias-corrected arrival rate, in [0, 1]
            g2 = rate * d * d  # a burst of K rounds' worth once every K rounds: K^2 g^2 x 1/K per round
            if self.variant == "adam":
                v.mul_(self.beta_2).add_(g2, alpha=1 - self.beta_2)
            elif self.variant == "yogi":
                v.sub_((1 - self.beta_2) * g2 * torch.sign(v - g2))
            else:
                v.add_(g2)
            out[name] = lr / (v.clamp_min(0).sqrt() + self.tau)
        return out

    def step(self, update: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model change (float64) for one round's update ``d`` (tensor name -> tensor, float
        tensors only): the factor of :meth:`scale` times the moving average ``m`` of the updates
        (Adam: divided by ``1 - beta_1^(t+1)``, as Flower does), or times ``d`` itself without
        momentum (then zero wherever ``d`` is). With every coordinate sent every round this is
        Flower's step."""
        scale = self.scale(update)
        if not (self.momentum and self.beta_1 > 0):
            return {name: scale[name] * d.detach().to(torch.float64) for name, d in update.items()}
        correction = 1 - self.beta_1 ** (self.t + 1) if self.variant == "adam" else 1.0
        out = {}
        for name, d in update.items():
            m = self.m.setdefault(name, torch.zeros_like(scale[name]))
            m.mul_(self.beta_1).add_(d.detach().to(torch.float64), alpha=1 - self.beta_1)
            out[name] = scale[name] * m / correction
        return out


def optimizer_model(optimizer: SparseServerOptimizer, current: Mapping[str, torch.Tensor],
                    mean: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The new global model from the global model ``current`` and the clients' weighted mean model
    ``mean``: weights take ``optimizer``'s step on ``mean - current``, running statistics and
    counters (:func:`fedcomp.tensor_kinds.split_kinds`) the mean, in the model's dtypes."""
    if set(mean) != set(current):
        raise SpecError(f"the replies' arrays {sorted(mean)} are not the model's {sorted(current)}")
    weights = set(split_kinds(dict(current))[WEIGHT])
    update = {k: mean[k].to(torch.float64) - current[k].to(torch.float64)
              for k in current if k in weights and current[k].is_floating_point()}
    step = optimizer.step(update)
    out = {}
    for k, v in current.items():
        if k in step:
            out[k] = (v.to(torch.float64) + step[k]).to(v.dtype)
        elif v.is_floating_point():
            out[k] = mean[k].to(v.dtype)
        else:
            out[k] = torch.round(mean[k].to(torch.float64)).to(v.dtype)
    return out


class OptimizerOnUpdates(Strategy):
    """A FedAdam / FedYogi / FedAdagrad whose server step is :class:`SparseServerOptimizer`'s on the
    replies' weighted mean update (module docstring). Everything else (sampling, configuration,
    evaluation, metrics, settings) is the inner strategy's.

    ``CompressedStrategy(OptimizerOnUpdates(FedAdam(...)), upload="topk(ratio=0.01)+qsgd(bits=4)")``
    hands it the decoded replies (it is not a plain weighted mean: the wrapper collects them).
    """

    def __init__(self, inner: Strategy, *, momentum: bool = True) -> None:
        self.inner = inner
        self.optimizer = SparseServerOptimizer.of(inner, momentum=momentum)
        self._current: dict[str, torch.Tensor] | None = None

    def __getattr__(self, name: str):  # fraction_train, weighted_by_key, arrayrecord_key...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid) -> Iterable[Message]:
        self._current = {k: v.detach().clone() for k, v in arrays.to_torch_state_dict().items()}
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None,
                                                                                      MetricRecord | None]:
        if self._current is None:
            raise SpecError("aggregate_train before configure_train: the global model is not known")
        mean, metrics = FedAvg.aggregate_train(self.inner, server_round, replies)  # the weighted mean, no step
        if mean is None:
            return mean, metrics
        return ArrayRecord(self.apply(mean.to_torch_state_dict())), metrics

    def apply(self, mean: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new global model from the clients' mean model (:func:`optimizer_model`)."""
        return optimizer_model(self.optimizer, self._current, mean)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid):
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)


class OptimizerFeedback(ServerFeedback):
    """FetchSGD's server step with a server optimizer after the unsketch (module docstring): the
    heavy hitters ``d`` of the error table are applied as ``eta * d / (sqrt(v) + tau)``, where they
    are; what a coupled download drops goes back into the table divided by the factor it was
    applied with. ``momentum``: FetchSGD's rho (in sketch space)."""

    def __init__(self, codec, layout: Layout, momentum: float, optimizer: SparseServerOptimizer) -> None:
        super().__init__(codec, layout, momentum)
        if optimizer.momentum and optimizer.beta_1 > 0:
            raise SpecError("in sketch space the step must stay where the heavy hitters are: an optimizer with "
                            "momentum=False (FetchSGD's server_momentum is the momentum there)")
        self.optimizer = optimizer

    def _step(self, broadcast, nonce: int, round: int):
        if self._error is None and self._sum is None:
            return super()._step(broadcast, nonce, round)
        # the parent computes FetchSGD's step and, with a broadcast, feeds back what it dropped; here the
        # step is rescaled between the two, so the parent runs without the broadcast and this one feeds back
        out, _ = super()._step(None, nonce, round)
        sketched = [self._sketch_layout.tensors[i] for _, group in self._segments for i in group]
        names = {t.name for t in sketched}
        heavy = {t.name: out[t.name].to(torch.float64) for t in sketched}
        factor = self.optimizer.scale(heavy)
        step = {name: heavy[name] * factor[name] for name in heavy}
        out = {t.name: (_to_dtype(step[t.name].float(), t.torch_dtype) if t.name in names else out[t.name])
               for t in self.layout.tensors}
        if broadcast is None:
            return out, None
        sent, payload = self._broadcast(broadcast, out, nonce, round)
        reducer, cells = self.reducer, self.cells_of(broadcast)
        for j, (seg, group) in enumerate(self._segments):  # the download's loss, back in the table's units
            if cells is not None:  # ... per cell (ServerFeedback._step)
                names_j = [self._sketch_layout.tensors[i].name for i in group]
                want = torch.cat([step[n].reshape(-1) for n in names_j])
                per = torch.cat([factor[n].reshape(-1) for n in names_j])
                diff = (want - self.flat_sent(sent, group).to(torch.float64)) / per
                self._error[j].add_(cells.cell_mean(diff.float(), want != 0))
                continue
            positions, values, offset = [], [], 0
            for i in group:
                spec = self._sketch_layout.tensors[i]
                diff = ((step[spec.name] - sent[spec.name].to(torch.float64)) / factor[spec.name]).reshape(-1)
                nz = torch.nonzero(diff).squeeze(1)
                positions.append(nz + offset)
                values.append(diff[nz].float())
                offset += spec.numel
            self._error[j].add_(reducer.sketch_entries(torch.cat(positions), torch.cat(values), seg.numel))
        return sent, payload


class OptimizerSketchPart(Part):
    """``CompressedStrategy(FedAdam(...), upload="sketch(...)", aggregation="sketch", parts=[OptimizerSketchPart()])``:
    the wrapper's FetchSGD step becomes :class:`OptimizerFeedback` with the inner strategy's
    optimizer (its settings, no momentum: ``server_momentum`` is FetchSGD's). It replaces the
    feedback the aggregation part built for the layout, so it must run after it (parts passed to
    the wrapper do)."""

    def on_layout(self, layout: Layout) -> None:
        host = self.host
        if host.aggregation != "sketch":
            raise SpecError(f"OptimizerSketchPart needs aggregation='sketch', got {host.aggregation!r}")
        optimizer = SparseServerOptimizer.of(host.inner, momentum=False)
        host._aggregate.feedback = OptimizerFeedback(host.upload, layout, host.config.momentum, optimizer)
