"""Tests of the default federated task (fedcomp.simulations.task) and result files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedcomp.simulations import results, task


@pytest.fixture(scope="module")
def split():
    return task.load_digits_split(seed=0)


def test_load_digits_split(split):
    train, test = split
    x, y = train.tensors
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.shape == (1437, 64) and len(test) == 360
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert set(y.tolist()) == set(range(10))


@pytest.mark.parametrize("num_partitions", [10, 20])
@pytest.mark.parametrize("alpha", [0.5, 0.1])
def test_partition_disjoint_cover_deterministic(split, num_partitions, alpha):
    train, _ = split
    x, y = train.tensors
    n = num_partitions
    parts = [task.partition(train, n, i, alpha, 7) for i in range(n)]
    assert all(len(py) > 0 for _, py in parts)
    assert sum(len(py) for _, py in parts) == len(train)
    # Disjoint and covering: every training row appears exactly once.
    rows = torch.cat([px for px, _ in parts])
    labels = torch.cat([py for _, py in parts])
    order_all = np.lexsort(np.column_stack([x.numpy(), y.numpy()]).T)
    order_parts = np.lexsort(np.column_stack([rows.numpy(), labels.numpy()]).T)
    assert torch.equal(x[order_all], rows[order_parts])
    assert torch.equal(y[order_all], labels[order_parts])
    # Deterministic, including after clearing the cache.
    task._partition_indices.cache_clear()
    again = task.partition(train, num_partitions, 3, alpha, 7)
    assert torch.equal(again[0], parts[3][0]) and torch.equal(again[1], parts[3][1])
    other_seed = task.partition(train, num_partitions, 3, alpha, 8)
    assert not torch.equal(other_seed[1], parts[3][1])


def test_partition_many_clients_small_alpha(split):
    train, _ = split
    sizes = [len(task.partition(train, 50, i, 0.1, 0)[1]) for i in range(50)]
    assert sum(sizes) == len(train) and min(sizes) >= 1


def test_partition_non_iid(split):
    train, _ = split
    dists = []
    for i in range(10):
        _, y = task.partition(train, 10, i, 0.1, 0)
        counts = np.bincount(y.numpy(), minlength=10)
        dists.append(counts / counts.sum())
    dists = np.array(dists)
    # With alpha=0.1 each client is dominated by a few labels ...
    assert np.median(dists.max(axis=1)) > 0.4
    # ... and clients differ: mean total-variation distance between pairs.
    tv = [0.5 * np.abs(dists[i] - dists[j]).sum() for i in range(10) for j in range(i)]
    assert np.mean(tv) > 0.5


def test_partition_bad_arguments(split):
    train, _ = split
    with pytest.raises(ValueError, match="partition_id"):
        task.partition(train, 10, 10, 0.5, 0)
    with pytest.raises(ValueError, match="alpha"):
        task.partition(train, 10, 0, 0.0, 0)


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_model_sizes_and_seeding():
    assert task.MODELS == ("mlp", "mlp-large", "mlp-xl")
    assert _num_params(task.build_model("mlp", 0)) == 234_122
    assert _num_params(task.build_model("mlp-large", 0)) == 2_176_010
    assert _num_params(task.build_model("mlp-xl", 0)) == 8_546_314
    state = torch.random.get_rng_state()
    a, b, c = (task.build_model("mlp", s) for s in (1, 1, 2))
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched
    flat = torch.nn.utils.parameters_to_vector
    pa, pb, pc = (flat(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="resnet-9000") as info:
        task.build_model("resnet-9000", 0)
    assert "mlp-large" in str(info.value)


def test_training_reaches_high_accuracy(split):
    train, test = split
    model = task.build_model("mlp", 0)
    _, acc0 = task.evaluate(model, *test.tensors, device="cpu")
    loss = task.train(
        model, *train.tensors, epochs=5, lr=0.1, batch_size=32, seed=0, device="cpu"
    )
    test_loss, acc = task.evaluate(model, *test.tensors, device="cpu")
    assert acc0 < 0.3
    assert acc > 0.8
    assert 0.0 < loss < 1.0 and 0.0 < test_loss < 1.0


def test_training_is_deterministic(split):
    train, _ = split
    x, y = task.partition(train, 10, 0, 0.5, 0)
    vecs = []
    for _ in range(2):
        model = task.build_model("mlp", 4)
        task.train(model, x, y, epochs=1, lr=0.05, batch_size=16, seed=9, device="cpu")
        vecs.append(torch.nn.utils.parameters_to_vector(model.parameters()))
    assert torch.equal(vecs[0], vecs[1])


def _rounds():
    return [
        {"round": r, "accuracy": 0.5 + 0.1 * r, "upload_bytes": 10**5 * 10**r}
        for r in range(1, 5)
    ]


def test_results_round_trip(tmp_path):
    config = {"codec": "topk", "ratio": 0.01, "alpha": 0.5, "seed": np.int64(3)}
    rounds = _rounds() + [{"round": 5, "accuracy": float("nan"), "upload_bytes": 0}]
    path = results.write_results(tmp_path / "nested" / "run", config, rounds)
    assert path == tmp_path / "nested" / "run" / "results.json"
    data = json.loads(path.read_text())
    assert data["config"] == {**config, "seed": 3}
    assert data["rounds"][:4] == _rounds()
    assert data["rounds"][4]["accuracy"] is None
    # Overwrite in place leaves no temporary files behind.
    results.write_results(path.parent, {}, [])
    assert json.loads(path.read_text()) == {"config": {}, "rounds": []}
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.json"]


def test_plots_are_png(tmp_path):
    single = results.plot_accuracy_vs_upload(_rounds(), tmp_path / "a" / "acc.png")
    assert single.read_bytes().startswith(b"\x89PNG")
    cheap = [
        {"accuracy": 0.6, "upload_bytes": 10},
        {"accuracy": 0.7, "upload_bytes": 0},
    ]
    multi = results.plot_runs({"dense": _rounds(), "topk": cheap}, tmp_path / "b.png")
    assert multi.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError):
        results.plot_runs({}, tmp_path / "c.png")


def test_partitions_are_cached_on_disk(tmp_path, monkeypatch):
    """A deployed ClientApp is a fresh process per message: its partition comes from disk, equal to
    what partition() builds, and is rebuilt when the file is unreadable."""
    monkeypatch.setenv("FEDCOMP_CACHE_DIR", str(tmp_path))
    x, y = task.load_partition("digits", 1, 4, 0.5, 0)
    ref_x, ref_y = task.partition(task._digits_split(0)[0], 4, 1, 0.5, 0)
    assert torch.equal(x, ref_x) and torch.equal(y, ref_y)
    files = list((tmp_path / "partitions").glob("digits-*-p1.npz"))
    assert len(files) == 1

    def boom(*args, **kwargs):
        raise AssertionError("partition() ran although the cache holds it")

    monkeypatch.setattr(task, "partition", boom)
    x2, y2 = task.load_partition("digits", 1, 4, 0.5, 0)
    assert torch.equal(x2, x) and torch.equal(y2, y) and x2.dtype == x.dtype
    files[0].write_bytes(b"not an npz")
    with pytest.raises(AssertionError, match="partition\\(\\) ran"):  # unreadable: rebuilt
        task.load_partition("digits", 1, 4, 0.5, 0)
