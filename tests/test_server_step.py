"""FetchSGD's server step through the compiled passes (CountSketch.top_dense, zero_cells) against the
torch path: the same delta, the same momentum and error tables, ties broken the same way (magnitude,
then the lowest position), for any number of threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcomp import kernels
from fedcomp.codecs import sketch as sketch_mod
from fedcomp.codecs.sketch import CountSketch
from fedcomp.fetchsgd import sketch_step

pytestmark = pytest.mark.skipif(kernels.get() is None, reason="compiled loops unavailable (numba)")


def _reference_top(cs: CountSketch, table: torch.Tensor, n: int, k: int):
    """The definition: every estimate (torch ops), ordered by magnitude descending then position."""
    est = cs.estimate(table, n)
    order = sorted(range(n), key=lambda j: (-abs(float(est[j])), j))[:k]
    idx = torch.tensor(sorted(order), dtype=torch.int64)
    return idx, est[idx]


def _torch_step(cs, momentum, error, summed, rho, n):
    """sketch_step as the torch path computes it (what the compiled passes must reproduce)."""
    momentum.mul_(rho).add_(summed)
    error.add_(momentum)
    idx, val = cs._top_entries(error, n, cs.kept(n), 2)
    delta = torch.zeros(n)
    delta[idx] = val
    applied = cs.sketch(delta) != 0
    momentum[applied] = 0
    error[applied] = 0
    return delta


def _table(cs, n, seed, kind):
    g = torch.Generator().manual_seed(seed)
    cells = cs.cells(n)
    if kind == "normal":
        return torch.randn(cells, generator=g)
    if kind == "levels":  # few distinct magnitudes: many ties, across cells and threads
        return (torch.randint(-3, 4, (cells,), generator=g) * 0.25).float()
    if kind == "sparse":  # mostly zero cells: the k-th is a zero, ties by the thousand
        t = torch.zeros(cells)
        t[torch.randint(0, cells, (max(1, cells // 50),), generator=g)] = torch.randn(max(1, cells // 50), generator=g)
        return t
    if kind == "zero":
        return torch.zeros(cells)
    raise AssertionError(kind)


@pytest.fixture(params=[1, 2, 3], ids=["1-thread", "2-threads", "3-threads"])
def threads(request, monkeypatch):
    """Elements cut among this many threads, whatever the size (THREAD_MIN lowered)."""
    monkeypatch.setattr(sketch_mod, "THREAD_MIN", 64)
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("n", [997, 4_099, 65_537, 300_007])  # primes: ragged thread spans and blocks
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("kind", ["normal", "levels", "sparse", "zero"])
def test_top_dense_is_the_torch_paths_top_k(n, rows, kind, threads):
    cols = 0 if rows == 1 else max(7, n // 40)
    cs = CountSketch(CountSketch.Config(rows=rows, cols=cols, ratio=0.02, seed=n % 5))
    table = _table(cs, n, n + rows, kind)
    k = cs.kept(n)
    fast = cs.top_dense(table, n, k, load=True)
    assert fast is not None
    pos, y = fast
    idx, val = cs._top_entries(table, n, k, 2)
    assert torch.equal(pos, idx)
    assert torch.equal(y[pos], val)
    dense = torch.zeros(n)
    dense[idx] = val
    assert torch.equal(y, dense)
    assert torch.equal(cs.heavy_hitters(table, n, load=True), dense)
    got_idx, got_val = cs.top_entries(table, n, load=True)
    assert torch.equal(got_idx, idx) and torch.equal(got_val, val)


@pytest.mark.parametrize("n,rows,k", [(1_009, 1, 1), (1_009, 1, 500), (1_009, 1, 1_008), (2_003, 5, 37),
                                      (2_003, 2, 1_000), (2_003, 4, 3)])
def test_against_the_definition(n, rows, k, threads):
    """Few elements, every estimate ranked in plain Python; even row counts take the lower median."""
    cs = CountSketch(CountSketch.Config(rows=rows, cols=0 if rows == 1 else 101, ratio=0.02))
    table = _table(cs, n, k, "levels")
    pos, y = cs.top_dense(table, n, k, load=True)
    idx, val = _reference_top(cs, table, n, k)
    assert torch.equal(pos, idx) and torch.equal(y[pos], val)
    assert int((y != 0).sum()) <= k


@pytest.mark.parametrize("n", [4_099, 300_007, 1_000_003])
@pytest.mark.parametrize("rows", [1, 5])
def test_step_same_delta_and_tables(n, rows, threads):
    cs = CountSketch(CountSketch.Config(rows=rows, cols=0 if rows == 1 else max(7, n // 40), ratio=0.02))
    g = torch.Generator().manual_seed(n)
    m1, e1 = torch.randn(cs.cells(n), generator=g), torch.randn(cs.cells(n), generator=g)
    m2, e2 = m1.clone(), e1.clone()
    for rnd in range(3):  # rounds: what one leaves in the tables, the next ranks
        s = torch.randn(cs.cells(n), generator=g) * (rnd + 1)
        d1 = _torch_step(cs, m1, e1, s, 0.9, n)
        d2 = sketch_step(cs, m2, e2, s, 0.9, n)
        assert torch.equal(d1, d2) and torch.equal(m1, m2) and torch.equal(e1, e2)
        assert int((d2 != 0).sum()) == cs.kept(n)


def test_cells_cancelling_in_the_delta_stay_unzeroed():
    """Two kept coordinates of one cell whose signed values cancel leave that cell as the torch path
    leaves it (sketch(delta) != 0 decides, not 'a kept coordinate hashes here')."""
    n = 2_000
    cs = CountSketch(CountSketch.Config(rows=2, cols=50, ratio=0.5))
    table = torch.randn(cs.cells(n), generator=torch.Generator().manual_seed(0))
    a, b = table.clone(), table.clone()
    ma, mb = torch.zeros_like(a), torch.zeros_like(b)
    pos, y = cs.top_dense(a, n, load=True)
    cs.zero_cells(pos, y, ma, a)
    applied = cs.sketch(y) != 0
    mb[applied] = 0
    b[applied] = 0
    assert torch.equal(a, b) and torch.equal(ma, mb)


def test_nan_estimates_take_the_torch_path():
    n = 10_000
    cs = CountSketch(CountSketch.Config(rows=1, cols=0, ratio=0.02))
    table = torch.randn(cs.cells(n))
    table[3] = float("nan")
    assert cs.top_dense(table, n, load=True) is None
    cs5 = CountSketch(CountSketch.Config(rows=5, cols=100, ratio=0.02))
    t5 = torch.randn(cs5.cells(n))
    t5[7] = float("nan")
    assert cs5.top_dense(t5, n, load=True) is None
    y = cs.heavy_hitters(table, n, load=True)  # the torch path's answer (topk's choice among NaN)
    assert y.numel() == n


def test_without_compiled_loops_the_torch_path_runs(monkeypatch):
    n = 50_000
    cs = CountSketch(CountSketch.Config(rows=1, cols=0, ratio=0.02))
    g = torch.Generator().manual_seed(1)
    s = torch.randn(cs.cells(n), generator=g)
    m1, e1 = torch.zeros(cs.cells(n)), torch.randn(cs.cells(n), generator=g)
    m2, e2 = m1.clone(), e1.clone()
    fast = sketch_step(cs, m1, e1, s, 0.5, n)
    monkeypatch.setenv("FEDCOMP_KERNELS", "0")
    assert cs.top_dense(e2, n, load=True) is None
    slow = sketch_step(cs, m2, e2, s, 0.5, n)
    assert torch.equal(fast, slow) and torch.equal(m1, m2) and torch.equal(e1, e2)


def test_sketch_entries_is_the_sketch_of_the_dense_vector():
    n = 100_003
    for rows in (1, 3):
        cs = CountSketch(CountSketch.Config(rows=rows, cols=997, ratio=0.01))
        g = torch.Generator().manual_seed(rows)
        pos = torch.randperm(n, generator=g)[:5_000].sort().values
        vals = torch.randn(5_000, generator=g)
        vals[::7] = 0.0
        vals[1::11] = -0.0
        dense = torch.zeros(n)
        dense[pos] = vals
        assert torch.equal(cs.sketch_entries(pos, vals, n), cs.sketch(dense))


def test_cell_counts_are_the_hashes_histogram():
    n = 123_457
    cs = CountSketch(CountSketch.Config(rows=1, cols=0, ratio=0.02, seed=3))
    k_ = kernels.get()
    keys = np.array(cs._row_keys(n), dtype=np.uint32).reshape(-1, 2)
    counts = cs._cell_counts(k_, n, keys[0, 0], keys[0, 1], cs.cols(n), [(0, n // 3), (n // 3, n)])
    cells = torch.cat([c[0] for _, _, c, _ in cs._hash_chunks(n, torch.device("cpu"))])
    assert np.array_equal(counts, np.bincount(cells.numpy(), minlength=cs.cols(n)))


@pytest.mark.parametrize("spec", ["sketch()", "sketch(rows=5, cols=3000, ratio=0.02)+qsgd(bits=4)"])
def test_server_feedback_rounds_same_with_and_without_compiled_loops(spec, monkeypatch):
    """ServerFeedback's step and step_broadcast (the dropped part sketched from its nonzeros): the same
    steps, payloads and tables as the torch path, round after round."""
    import fedcomp
    from fedcomp.server_feedback import ServerFeedback

    g = torch.Generator().manual_seed(5)
    model = {"w": torch.zeros(301, 173), "b": torch.zeros(173), "h": torch.zeros(64, dtype=torch.float16)}
    layout = fedcomp.Layout.of(model)
    codec = fedcomp.build_codec(spec)
    down = fedcomp.build_codec("topk(ratio=0.02)+kbit(bits=4,stochastic=true)")
    uploads = [[codec.encode({k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in model.items()},
                             nonce=r * 10 + i, round=r).payload for i in range(3)] for r in range(3)]
    runs = []
    for env in ("auto", "0"):
        monkeypatch.setenv("FEDCOMP_KERNELS", env)
        fb = ServerFeedback(codec, layout, momentum=0.9)
        got = []
        for r, ups in enumerate(uploads):
            for i, p in enumerate(ups):
                fb.add(p, weight=1 + i)
            if r == 1:
                got.append((fb.step(), b""))
            else:
                got.append(fb.step_broadcast(down, nonce=r, round=r))
        runs.append((got, [t.clone() for t in fb._error], [t.clone() for t in fb._velocity]))
    (a, ea, va), (b, eb, vb) = runs
    for (sa, pa), (sb, pb) in zip(a, b):
        assert pa == pb
        assert list(sa) == list(sb) == list(layout.names)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(x, y) for x, y in zip(ea + va, eb + vb))


def test_accumulator_mean_release_same_bits_and_ends_the_round():
    import fedcomp
    from fedcomp.aggregate import Accumulator

    g = torch.Generator().manual_seed(2)
    model = {"w": torch.zeros(300, 70), "b": torch.zeros(70), "h": torch.zeros(9, dtype=torch.float16),
             "n": torch.zeros(1, dtype=torch.int64)}
    layout = fedcomp.Layout.of(model)
    codec = fedcomp.build_codec("kbit(bits=4)")
    payloads = [codec.encode({k: (torch.randn(v.shape, generator=g) * 3).to(v.dtype) if v.is_floating_point()
                              else v + i for k, v in model.items()}, nonce=i + 1).payload for i in range(4)]
    accs = [Accumulator(codec, layout) for _ in range(2)]
    for acc in accs:
        for i, p in enumerate(payloads):
            acc.add(p, 1.0 + i)
    kept, released = accs[0].mean(), accs[1].mean(release=True)
    assert list(kept) == list(released) == list(layout.names)
    for name in layout.names:
        ref = (accs[0].sum()[name] / accs[0].total_weight)
        ref = ref.to(kept[name].dtype) if kept[name].is_floating_point() else torch.round(ref).to(kept[name].dtype)
        assert torch.equal(kept[name], ref) and torch.equal(released[name], ref)
    assert torch.equal(accs[0].mean()["w"], kept["w"])  # the sums stay
    with pytest.raises(Exception, match="reset"):
        accs[1].mean()
