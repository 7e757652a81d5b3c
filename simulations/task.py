"""The default federated task: scikit-learn digits, Dirichlet partitions, MLPs.

Everything here runs offline: the digits data set ships with scikit-learn, and
the non-IID split is made by flwr-datasets' ``DirichletPartitioner`` applied to
an in-memory Hugging Face ``datasets.Dataset`` (nothing is downloaded).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

__all__ = [
    "MODELS",
    "NUM_CLASSES",
    "NUM_FEATURES",
    "build_model",
    "evaluate",
    "load_digits_split",
    "partition",
    "train",
]

NUM_FEATURES = 64
NUM_CLASSES = 10

#: Names accepted by :func:`build_model`.
MODELS: tuple[str, ...] = ("mlp", "mlp-large")

_HIDDEN: dict[str, tuple[int, ...]] = {
    "mlp": (512, 384),
    "mlp-large": (1024, 1024, 1024),
}

# Minimum partition sizes tried in turn; the Dirichlet partitioner gives up
# after 10 resamplings, which many-partition / small-alpha settings can hit.
_MIN_SIZE_LADDER: tuple[int, ...] = (10, 5, 2, 1)


# --------------------------------------------------------------------------- data


def load_digits_split(
    seed: int = 0, test_fraction: float = 0.2
) -> tuple[TensorDataset, TensorDataset]:
    """Load scikit-learn's digits and split them into train and test sets.

    Parameters
    ----------
    seed : int, default 0
        Seed of the stratified split.
    test_fraction : float, default 0.2
        Fraction of the 1797 samples held out for testing (in ``(0, 1)``).

    Returns
    -------
    train, test : torch.utils.data.TensorDataset
        Each holds ``(x, y)``: ``x`` float32 of shape ``(n, 64)`` scaled to
        ``[0, 1]``, ``y`` int64 labels in ``0..9``. With the defaults the
        train set has 1437 samples and the test set 360.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, stratify=y, random_state=seed
    )
    return (
        TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr)),
        TensorDataset(torch.from_numpy(x_te), torch.from_numpy(y_te)),
    )


@functools.lru_cache(maxsize=32)
def _partition_indices(
    labels: tuple[int, ...],
    num_partitions: int,
    alpha: float,
    seed: int,
    min_partition_size: int | None,
) -> tuple[np.ndarray, ...]:
    """Indices of every partition (cached; a pure function of its arguments)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    table = Dataset.from_dict(
        {"idx": np.arange(len(labels), dtype=np.int64), "label": list(labels)}
    )
    ladder = _MIN_SIZE_LADDER if min_partition_size is None else (min_partition_size,)
    error: ValueError | None = None
    for min_size in ladder:
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=alpha,
            min_partition_size=min_size,
            self_balancing=False,
            shuffle=True,
            seed=seed,
        )
        partitioner.dataset = table
        try:
            with warnings.catch_warnings():
                # One warning per resampling attempt; the ladder handles failure.
                warnings.simplefilter("ignore", UserWarning)
                parts = tuple(
                    np.asarray(partitioner.load_partition(pid)["idx"], dtype=np.int64)
                    for pid in range(num_partitions)
                )
        except ValueError as exc:  # "max number of attempts (10) was reached"
            error = exc
            continue
        for part in parts:
            part.setflags(write=False)
        return parts
    raise ValueError(
        f"could not split {len(labels)} samples into {num_partitions} Dirichlet "
        f"partitions (alpha={alpha}, seed={seed}) with min_partition_size in "
        f"{ladder}: {error}"
    )


def partition(
    train: TensorDataset,
    num_partitions: int,
    partition_id: int,
    alpha: float,
    seed: int,
    *,
    min_partition_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one non-IID (Dirichlet over labels) partition of ``train``.

    The split is made by ``flwr_datasets.partitioner.DirichletPartitioner``
    (``partition_by="label"``, ``self_balancing=False``, ``shuffle=True``) on an
    in-memory ``datasets.Dataset``. The partitions are disjoint, cover
    ``train`` exactly, and are deterministic for equal arguments; the index
    assignment is cached per labels, ``num_partitions``, ``alpha`` and ``seed``.

    Parameters
    ----------
    train : TensorDataset
        ``(x, y)`` as returned by :func:`load_digits_split`.
    num_partitions : int
        Number of partitions (clients), ``1 <= num_partitions <= len(train)``.
    partition_id : int
        Which partition to return, ``0 <= partition_id < num_partitions``.
    alpha : float
        Dirichlet concentration; smaller is more heterogeneous (e.g. 0.1).
    seed : int
        Seed of the Dirichlet sampling and the within-partition shuffle.
    min_partition_size : int or None, default None
        Smallest acceptable partition. ``None`` tries 10, then 5, 2 and 1,
        since the partitioner gives up after 10 resamplings (which happens with
        many partitions and a small ``alpha``, e.g. 50 partitions at 0.1).

    Returns
    -------
    x, y : torch.Tensor
        Features ``(n_k, 64)`` float32 and labels ``(n_k,)`` int64.
    """
    x, y = train.tensors
    if not 1 <= num_partitions <= len(y):
        raise ValueError(
            f"num_partitions must be in [1, {len(y)}], got {num_partitions!r}"
        )
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition_id must be in [0, {num_partitions}), got {partition_id!r}"
        )
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha!r}")
    labels = tuple(int(v) for v in y.tolist())
    parts = _partition_indices(
        labels, int(num_partitions), float(alpha), int(seed), min_partition_size
    )
    idx = torch.from_numpy(parts[partition_id].copy())
    return x[idx], y[idx]


# ------------------------------------------------------------------------- models


def build_model(name: str, seed: int) -> nn.Module:
    """Build a freshly initialised classifier for the digits task.

    Parameters
    ----------
    name : str
        ``"mlp"``: 64-512-384-10 with ReLU (234,122 parameters).
        ``"mlp-large"``: 64-1024-1024-1024-10 with ReLU (2,176,010 parameters).
    seed : int
        Seed of the initialisation. Uses a forked RNG, so the global torch RNG
        state is left untouched.

    Returns
    -------
    torch.nn.Module
        The model, on the CPU, in training mode.

    Raises
    ------
    ValueError
        If ``name`` is not one of :data:`MODELS`.
    """
    if name not in _HIDDEN:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    widths = (NUM_FEATURES, *_HIDDEN[name])
    layers: list[nn.Module] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], NUM_CLASSES))
    return nn.Sequential(*layers)


# ---------------------------------------------------------------- train / evaluate


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    device: torch.device | str,
) -> float:
    """Train ``model`` in place with plain SGD (no momentum, no weight decay).

    Parameters
    ----------
    model : torch.nn.Module
        Moved to ``device`` in place.
    x, y : torch.Tensor
        Features ``(n, 64)`` and int64 labels ``(n,)``; ``n >= 1``.
    epochs : int
        Passes over the data, ``>= 1``.
    lr : float
        Learning rate, ``> 0``.
    batch_size : int
        Minibatch size, ``>= 1``; the last batch of an epoch may be smaller.
    seed : int
        Seeds a private generator for the per-epoch shuffles.
    device : torch.device or str
        Where to train.

    Returns
    -------
    float
        Mean cross-entropy (per sample) over the last epoch.
    """
    if epochs < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(
            f"need epochs >= 1, batch_size >= 1, lr > 0; got "
            f"epochs={epochs!r}, batch_size={batch_size!r}, lr={lr!r}"
        )
    n = len(y)
    if n == 0 or len(x) != n:
        raise ValueError(f"need matching, non-empty x and y; got {len(x)} and {n}")
    device = torch.device(device)
    model.to(device)
    model.train()
    x, y = x.to(device), y.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros((), device=device)
    for _ in range(epochs):
        total.zero_()
        order = torch.randperm(n, generator=gen).to(device)
        for start in range(0, n, batch_size):
            batch = order[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(batch)
    return float(total) / n


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device | str,
    batch_size: int = 1024,
) -> tuple[float, float]:
    """Evaluate ``model`` (moved to ``device`` in place) on ``(x, y)``.

    Parameters
    ----------
    model : torch.nn.Module
    x, y : torch.Tensor
        Features ``(n, 64)`` and int64 labels ``(n,)``; ``n >= 1``.
    device : torch.device or str
    batch_size : int, default 1024
        Evaluation batch size (only bounds memory).

    Returns
    -------
    loss, accuracy : float
        Mean cross-entropy and the fraction classified correctly, in ``[0, 1]``.
    """
    n = len(y)
    if n == 0 or len(x) != n:
        raise ValueError(f"need matching, non-empty x and y; got {len(x)} and {n}")
    device = torch.device(device)
    model.to(device)
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, n, batch_size):
        xb = x[start : start + batch_size].to(device)
        yb = y[start : start + batch_size].to(device)
        logits = model(xb)
        loss_sum += nn.functional.cross_entropy(logits, yb, reduction="sum")
        correct += (logits.argmax(dim=1) == yb).sum()
    return float(loss_sum) / n, int(correct) / n

