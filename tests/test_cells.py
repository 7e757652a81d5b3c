"""``cells``: a one-row FetchSGD step downloaded as its heavy-hitter cells, on arbitrary layouts."""

from __future__ import annotations

import pytest
import torch
from flwr.serverapp.strategy import FedAdam

import fedcomp
from fedcomp.server_feedback import ServerFeedback
from fedcomp.strategies.config import CompressionConfig, coupled_download
from fedcomp.strategies.optimizer_sketch import OptimizerFeedback, SparseServerOptimizer

# sizes that are not multiples of anything: a conv kernel, odd matrices, a bias of 1, fp16 and an int
LAYOUTS = {
    "odd": lambda g: {"conv": torch.randn(6, 3, 5, 5, generator=g), "fc": torch.randn(37, 41, generator=g),
                      "b": torch.randn(1, generator=g), "steps": torch.tensor(3)},
    "half": lambda g: {"emb": torch.randn(101, 7, generator=g).half(), "out": torch.randn(13, generator=g)},
}


def _flat(m: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in m.values() if t.is_floating_point()])


def _unflat(x: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for name, t in like.items():
        if t.is_floating_point():
            out[name] = x[at:at + t.numel()].view(t.shape).to(t.dtype)
            at += t.numel()
        else:
            out[name] = torch.zeros_like(t)
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("cols", [0, 97])
def test_a_fetchsgd_step_travels_exactly_and_in_far_fewer_bytes(layout, cols):
    model = LAYOUTS[layout](torch.Generator().manual_seed(1))
    sketch = fedcomp.build_codec(f"sketch(rows=1,cols={cols},ratio=0.05)").reducer
    n = _flat(model).numel()
    table = torch.randn(sketch.cells(n), generator=torch.Generator().manual_seed(2))
    delta = sketch.heavy_hitters(table, n).to(torch.float16).float() if layout == "half" else sketch.heavy_hitters(table, n)
    step = _unflat(delta, model)
    cells = fedcomp.build_codec(f"cells(cols={cols})+none()")
    decoded = _flat(cells.decode(cells.encode(step).payload, fedcomp.Layout.of(model)))
    applied = delta != 0
    assert torch.equal(decoded[applied], delta[applied])  # every coordinate of the step, exactly
    # ... and the rest of a cell the step took in part (the last heavy cell) gets the cell's value
    extra = (decoded != 0) & ~applied
    assert int(extra.sum()) < int(applied.sum()) // 2
    topk = fedcomp.build_codec("topk(ratio=0.05)+none()")
    # one value a cell instead of one a coordinate (index bytes alike: gaps among fewer positions)
    assert sum(cells.encode(step).kept) < sum(topk.encode(step).kept) / 2


def test_any_vector_comes_back_projected_onto_the_cells():
    model = LAYOUTS["odd"](torch.Generator().manual_seed(3))
    codec = fedcomp.build_codec("cells(cols=50,seed=7)+none()")
    x = _flat(model)
    x[::3] = 0  # zeros do not count in a cell's mean
    y = _flat(codec.decode(codec.encode(_unflat(x, model)).payload, fedcomp.Layout.of(model)))
    cells = codec.reducer
    cell, sign = next(cells._chunks(x.numel(), x.device))[2:]
    for c in range(50):
        members = cell == c
        nz = members & (x != 0)
        if not nz.any():
            assert not y[members].any()
            continue
        w = float((sign[nz] * x[nz]).double().mean())
        assert torch.allclose(y[members], sign[members] * w, atol=1e-5)
    assert torch.allclose(cells.cell_mean(y, y != 0), cells.cell_mean(x), atol=1e-5)


def _server(codec_spec: str, model):
    codec = fedcomp.build_codec(codec_spec)
    layout = fedcomp.Layout.of(model)
    update = {k: (v * 0.01 if v.is_floating_point() else torch.zeros_like(v)) for k, v in model.items()}
    return codec, layout, update


def test_what_the_download_drops_waits_in_the_cells_own_units():
    model = LAYOUTS["odd"](torch.Generator().manual_seed(4))
    codec, layout, update = _server("sketch(rows=1,cols=120,ratio=0.1)", model)
    fb = ServerFeedback(codec, layout)
    fb.add(codec.encode(update).payload, 1.0)
    table = fb._sum[0].clone().float()  # the round's table: with momentum 0 the error is this table
    broadcast = fedcomp.build_codec("cells(cols=120)+kbit(bits=2,block=8,stochastic=true)")  # coarse
    assert fb.cells_of(broadcast) is broadcast.reducer
    sent, payload = fb.step_broadcast(broadcast, nonce=1, round=1)
    q = broadcast.reducer.cell_mean(_flat(sent))  # the value each sent cell's coordinates moved by
    kept = q != 0
    assert kept.any() and (kept.sum() < 120)
    error = fb._error[0]
    # a sent cell keeps exactly what its value missed; the others keep their whole value
    assert torch.allclose(error + q, table, atol=1e-5)
    assert float((error[kept]).abs().max()) > 0  # 2 bits do drop something
    total = _flat(sent)
    for r in range(2, 30):  # no new uploads: the cells that were sent get the rest of their value
        more, _ = fb.step_broadcast(broadcast, nonce=1, round=r)
        total += _flat(more)
    done = broadcast.reducer.cell_mean(total, total != 0)
    assert torch.allclose(done[kept], table[kept], atol=0.05 * float(table.abs().max()))


def test_cells_of_needs_the_sketchs_own_cells():
    model = LAYOUTS["odd"](torch.Generator().manual_seed(5))
    codec, layout, _ = _server("sketch(rows=1,cols=120,ratio=0.1)", model)
    fb = ServerFeedback(codec, layout)
    for other in ("cells(cols=121)+kbit()", "cells(cols=120,seed=1)+kbit()", "topk(ratio=0.1)+kbit()"):
        assert fb.cells_of(fedcomp.build_codec(other)) is None
    rows5 = ServerFeedback(fedcomp.build_codec("sketch(rows=5,cols=120)"), layout)
    assert rows5.cells_of(fedcomp.build_codec("cells(cols=120)+kbit()")) is None
    policy = fedcomp.build_codec("name~steps: none(); cells(cols=120)+kbit(bits=4,stochastic=true)")
    assert fb.cells_of(policy) is not None


def test_the_server_optimizer_step_travels_as_cells():
    model = LAYOUTS["odd"](torch.Generator().manual_seed(6))
    codec, layout, update = _server("sketch(rows=1,cols=120,ratio=0.1)", model)
    fb = OptimizerFeedback(codec, layout, 0.0, SparseServerOptimizer.of(FedAdam(), momentum=False))
    broadcast = fedcomp.build_codec("cells(cols=120)+kbit(bits=4,stochastic=true)")
    for r in range(1, 4):
        fb.add(codec.encode(update, nonce=r).payload, 1.0)
        sent, payload = fb.step_broadcast(broadcast, nonce=r, round=r)
        decoded = broadcast.decode(payload, layout, round=r)
        assert all(torch.equal(sent[k], decoded[k]) for k in sent)
        assert _flat(sent).abs().sum() > 0
        assert torch.isfinite(fb._error[0]).all()


def test_auto_writes_the_cells_for_a_one_row_sketch_only():
    one = fedcomp.build_codec("sketch(rows=1,cols=321,ratio=0.007,seed=4)+qsgd(bits=4)").reducer
    assert coupled_download(0.007, one) == "cells(cols=321,seed=4)+kbit(bits=4,stochastic=true)"
    five = fedcomp.build_codec("sketch(rows=5,cols=321,ratio=0.007)").reducer
    assert coupled_download(0.007, five) == "topk(ratio=0.007)+kbit(bits=4,stochastic=true)"
    resolved = CompressionConfig().resolve(partial=True, numel=10_000)
    assert resolved.download.startswith("cells(cols=680,seed=0)+kbit(bits=4")
    assert resolved.coupled_download and resolved.upload.startswith("sketch(rows=1,cols=680,")


@pytest.mark.parametrize("bad, allowed", [("cells(cols=-1)", "cols must be"), ("cells(seed=-2)", "seed must be"),
                                          ("cells(rows=1)", "no argument 'rows'")])
def test_bad_arguments_name_the_value(bad, allowed):
    with pytest.raises(fedcomp.SpecError, match=allowed):
        fedcomp.build_codec(bad)


@pytest.mark.parametrize("n", [1000, 300_001])
def test_compiled_loops_give_the_torch_paths_bytes_and_bits(n, monkeypatch):
    """The compiled encode and decode (a server's, a warm worker's) and the chunked torch ops (a
    fresh client, a GPU) give the same payload and the same decoded bits, -0.0 included."""
    from fedcomp import kernels

    sketch = fedcomp.build_codec("sketch(rows=1,cols=0,ratio=0.02,seed=5)").reducer
    table = torch.randn(sketch.cells(n), generator=torch.Generator().manual_seed(n))
    delta = sketch.heavy_hitters(table, n)
    delta[:50] += torch.randn(50, generator=torch.Generator().manual_seed(1))  # not constant per cell there
    step = {"w": delta}
    layout = fedcomp.Layout.of(step)
    codec = fedcomp.build_codec("cells(seed=5)+kbit(bits=4,stochastic=true)")
    kernels.get()
    fast = codec.encode(step, nonce=2).payload
    fast_out = codec.decode(fast, layout)["w"]
    monkeypatch.setattr(kernels, "for_encode", lambda: None)
    slow = codec.encode(step, nonce=2).payload
    slow_out = codec.decode(slow, layout)["w"]
    assert fast == slow
    assert torch.equal(fast_out.view(torch.int32), slow_out.view(torch.int32))


def test_cells_over_other_tensors_than_the_sketchs_are_not_its_cells():
    model = {"a": torch.randn(30, 7), "b": torch.randn(50), "c": torch.randn(11)}
    codec = fedcomp.build_codec("name~c: none(); sketch(rows=1,cols=40,ratio=0.1)")
    fb = ServerFeedback(codec, fedcomp.Layout.of(model))
    same = fedcomp.build_codec("name~c: none(); cells(cols=40)+kbit(bits=4,stochastic=true)")
    other = fedcomp.build_codec("name~b: none(); cells(cols=40)+kbit(bits=4,stochastic=true)")
    assert fb.cells_of(same) is not None and fb.cells_of(other) is None
