"""Server-side error feedback (FetchSGD accumulation for any linear codec) and seeded-chain downloads."""

from __future__ import annotations

import pytest
import torch

import fedcomp
from fedcomp.server_feedback import DownloadPlan, ServerFeedback, plan_download


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 50, generator=g), "b": torch.randn(50, generator=g),
            "steps": torch.tensor([3], dtype=torch.int64)}


def _sparse(n_hot: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """An update with ``n_hot`` large coordinates in w, zero elsewhere."""
    g = torch.Generator().manual_seed(seed)
    w = torch.zeros(40 * 50)
    idx = torch.randperm(w.numel(), generator=g)[:n_hot]
    w[idx] = torch.randn(n_hot, generator=g).sign() * (1 + torch.rand(n_hot, generator=g))
    return {"w": w.view(40, 50), "b": torch.zeros(50), "steps": torch.tensor([0], dtype=torch.int64)}


def test_recovers_a_sparse_sum_exactly_with_an_unquantized_sketch():
    codec = fedcomp.build_codec("sketch(rows=5,cols=400,ratio=0.005)")
    layout = fedcomp.Layout.of(_model())
    fb = ServerFeedback(codec, layout)
    u = _sparse(10)
    for w in (10, 30):  # two clients with the same sparse update: the weighted mean is that update
        fb.add(codec.encode(u).payload, w)
    step = fb.step()
    assert torch.allclose(step["w"], u["w"], atol=1e-5)
    assert torch.equal(step["b"], torch.zeros(50))
    assert step["steps"].dtype == torch.int64 and int(step["steps"]) == 0


def test_step_is_the_weighted_mean_of_the_round():
    codec = fedcomp.build_codec("sketch(rows=5,cols=600,ratio=0.01)")
    layout = fedcomp.Layout.of(_model())
    fb = ServerFeedback(codec, layout)
    a, b = _sparse(6, seed=4), _sparse(6, seed=5)
    fb.add(codec.encode(a).payload, 1)
    fb.add(codec.encode(b).payload, 3)
    assert fb.count == 2 and fb.weight == 4
    assert torch.allclose(fb.step()["w"], (a["w"] + 3 * b["w"]) / 4, atol=1e-5)
    assert fb.count == 0 and fb.weight == 0


def test_what_a_round_leaves_out_is_applied_later():
    codec = fedcomp.build_codec("sketch(rows=5,cols=400,ratio=0.002)")  # k = 5 of 2550: half the hot coordinates
    layout = fedcomp.Layout.of(_model())
    fb = ServerFeedback(codec, layout)
    u = _sparse(10, seed=1)
    fb.add(codec.encode(u).payload, 1.0)
    first = fb.step()
    assert int((first["w"] != 0).sum()) == 5
    second = fb.step()  # no new upload: the error left in the server's table is applied
    assert torch.allclose(first["w"] + second["w"], u["w"], atol=1e-5)
    assert not torch.any(fb.step()["w"])  # nothing left


def test_quantized_sketch_tables_sum_after_dequantization():
    codec = fedcomp.build_codec("sketch(rows=3,cols=600,ratio=0.004)+qsgd(bits=8)")
    assert not codec.linear  # the wrapper's aggregation='sketch' refuses it; server feedback takes it
    layout = fedcomp.Layout.of(_model())
    fb = ServerFeedback(codec, layout)
    u = _sparse(8, seed=2)
    fb.add(codec.encode(u, nonce=1).payload, 1.0)
    step = fb.step()
    hot = u["w"] != 0
    assert torch.equal(step["w"] != 0, hot)
    assert torch.allclose(step["w"][hot], u["w"][hot], rtol=0.05)


def test_momentum_keeps_pushing_where_it_was_not_applied():
    codec = fedcomp.build_codec("sketch(rows=5,cols=400,ratio=0.0004)")  # k = 1
    layout = fedcomp.Layout.of(_model())
    u = _sparse(3, seed=3)
    plain, heavy = ServerFeedback(codec, layout), ServerFeedback(codec, layout, momentum=0.9)
    for fb in (plain, heavy):
        fb.add(codec.encode(u).payload, 1.0)
        fb.step()
    plain_next, heavy_next = plain.step(), heavy.step()  # no new uploads
    nz = heavy_next["w"] != 0
    assert torch.equal(nz, plain_next["w"] != 0)
    # the second-largest coordinate: error 1x with plain, error + 0.9 momentum (1.9x) with momentum
    assert torch.allclose(heavy_next["w"][nz], 1.9 * plain_next["w"][nz], rtol=1e-4)


def test_memory_is_two_tables_and_nothing_per_client():
    codec = fedcomp.build_codec("sketch(rows=2,cols=300)")
    fb = ServerFeedback(codec, fedcomp.Layout.of(_model()))
    assert fb.nbytes == 2 * 4 * 2 * 300
    for i in range(5):
        fb.add(codec.encode(_sparse(4, seed=i)).payload, 0.2)
    fb.step()
    assert fb.nbytes == 2 * 4 * 2 * 300


@pytest.mark.parametrize("spec", ["topk(ratio=0.01)+qsgd(bits=4)", "kbit(bits=8)", "powersgd(rank=1)"])
def test_refuses_a_codec_that_is_not_linear(spec):
    with pytest.raises(fedcomp.SpecError, match="linear upload codec"):
        ServerFeedback(fedcomp.build_codec(spec), fedcomp.Layout.of(_model()))


@pytest.mark.parametrize("momentum", [-0.1, 1.0])
def test_refuses_momentum_outside_unit_interval(momentum):
    with pytest.raises(fedcomp.SpecError, match="momentum"):
        ServerFeedback(fedcomp.build_codec("sketch()"), fedcomp.Layout.of(_model()), momentum=momentum)


def test_bad_uploads_add_nothing():
    codec = fedcomp.build_codec("sketch(rows=1,cols=100)")
    layout = fedcomp.Layout.of(_model())
    fb = ServerFeedback(codec, layout)
    good = codec.encode(_sparse(3)).payload
    with pytest.raises(fedcomp.DecodeError):
        fb.add(good[:-3], 1.0)
    bad = _sparse(3)
    bad["w"][0, 0] = float("nan")
    with pytest.raises(fedcomp.DecodeError, match="NaN"):
        fb.add(codec.encode(bad).payload, 1.0)
    with pytest.raises(fedcomp.FedcompError, match="weight"):
        fb.add(good, float("inf"))
    assert fb.count == 0 and not torch.any(fb.step()["w"])


def test_chain_from_the_seeded_model_on_first_contact():
    steps = [0] + [100] * 30
    plan = plan_download(0, steps, 12, full_bytes=5000, overhead=10)
    assert plan == DownloadPlan("chain", 1, 12, 1210)


def test_full_model_when_the_chain_costs_more_or_nothing_is_held():
    steps = [0] + [100] * 30
    assert plan_download(0, steps, 30, full_bytes=2500).mode == "full"  # 3000 bytes of steps
    assert plan_download(None, steps, 3, full_bytes=2500) == DownloadPlan("full", 3, 3, 2500)
    assert plan_download(20, steps, 30, full_bytes=2500).nbytes == 1000


def test_max_stale_bounds_the_chain_as_the_wrapper_does_today():
    steps = [0] + [10] * 30
    assert plan_download(19, steps, 30, full_bytes=10_000, max_stale=10).mode == "full"
    assert plan_download(20, steps, 30, full_bytes=10_000, max_stale=10).mode == "chain"


@pytest.mark.parametrize("held, now", [(5, 3), (-1, 3), (0, 40)])
def test_plan_refuses_impossible_versions(held, now):
    with pytest.raises(fedcomp.FedcompError):
        plan_download(held, [0] * 31, now, full_bytes=100)


def test_broadcast_step_applies_exactly_its_payload_and_keeps_what_it_dropped():
    codec = fedcomp.build_codec("sketch(rows=5,cols=800,ratio=0.004)")  # k = 10: every hot coordinate
    broadcast = fedcomp.build_codec("topk(ratio=0.004)+kbit(bits=2)")  # coarse: drops a lot of each value
    layout = fedcomp.Layout.of(_model())
    fb = ServerFeedback(codec, layout)
    u = _sparse(10, seed=6)
    fb.add(codec.encode(u).payload, 1.0)
    sent, payload = fb.step_broadcast(broadcast, nonce=3, round=1)
    assert all(torch.equal(sent[k], v) for k, v in broadcast.decode(payload, layout, round=1).items())
    first_error = float((sent["w"] - u["w"]).norm())
    assert first_error > 0.05 * float(u["w"].norm())  # 2 bits lose a visible part
    total = sent["w"].clone()
    for r in range(2, 8):  # no new uploads: the dropped part comes back through the error table
        more, _ = fb.step_broadcast(broadcast, nonce=3, round=r)
        total += more["w"]
    assert float((total - u["w"]).norm()) < 0.25 * first_error


def test_broadcast_step_before_any_upload_sends_zeros():
    codec = fedcomp.build_codec("sketch(rows=1,cols=100)")
    layout = fedcomp.Layout.of(_model())
    sent, payload = ServerFeedback(codec, layout).step_broadcast(fedcomp.build_codec("topk(ratio=0.01)+kbit(bits=4)"))
    assert not torch.any(sent["w"]) and len(payload) > 0


def test_policy_upload_sketches_weights_and_averages_the_rest_exactly():
    """exact_state_policy(sketch) as the wrapper sends it for a BatchNorm model: statistics are
    the weighted mean of the clients' deltas, the counter their rounded mean, weights heavy hitters."""
    from fedcomp.tensor_kinds import exact_state_policy

    base = {"w": torch.zeros(3000), "bn.running_var": torch.zeros(8), "bn.num_batches_tracked": torch.tensor(0)}
    layout = fedcomp.Layout.of(base)
    codec = fedcomp.build_codec(exact_state_policy("sketch(rows=5,cols=600,ratio=0.0003)", layout))
    fb = ServerFeedback(codec, layout)
    assert fb.nbytes == 2 * 4 * 3000  # tables (5 x 600) for the weights only
    updates = []
    for i, weight in ((1, 1.0), (2, 3.0)):
        u = {"w": torch.zeros(3000), "bn.running_var": torch.full((8,), 0.1 * i), "bn.num_batches_tracked": torch.tensor(i)}
        u["w"][7] = 5.0 * i
        updates.append((u, weight))
        fb.add(codec.encode(u).payload, weight)
    step = fb.step()
    assert torch.allclose(step["bn.running_var"], torch.full((8,), (0.1 + 3 * 0.2) / 4))
    assert int(step["bn.num_batches_tracked"]) == 2  # round((1 + 3 * 2) / 4) = round(1.75)
    assert step["w"].nonzero().flatten().tolist() == [7]
    assert abs(float(step["w"][7]) - (5.0 + 3 * 10.0) / 4) < 1e-4


@pytest.mark.parametrize("spec", ["round<3: none(); sketch()", "numel<10: sketch(); sketch()", "numel<10: none(); topk()"])
def test_refuses_policies_it_cannot_split(spec):
    layout = fedcomp.Layout.of({"w": torch.zeros(300), "b": torch.zeros(5)})
    with pytest.raises(fedcomp.SpecError, match="round conditions|linear reducer"):
        ServerFeedback(fedcomp.build_codec(spec), layout)
