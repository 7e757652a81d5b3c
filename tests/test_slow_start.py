"""FetchSGD's warm-up (ServerFeedback ``warmup``, :class:`fedcomp.server_feedback.Warmup`): the
heavy hitters' share and step size per round, the default left alone, the coupled download
carrying exactly the step, and clear errors for bad values."""

from __future__ import annotations

import math

import pytest
import torch

import fedcomp
from fedcomp.codecs.dgc import warmup_fraction
from fedcomp.errors import SpecError
from fedcomp.server_feedback import ServerFeedback, Warmup
from fedcomp.simulations.slow_start import settings_of, split_name

SKETCH = "sketch(rows=1,cols=1500,ratio=0.01)"


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 50, generator=g), "b": torch.randn(50, generator=g),
            "steps": torch.tensor([3], dtype=torch.int64)}


def _dense(seed: int) -> dict[str, torch.Tensor]:
    """A diffuse update (every coordinate nonzero), as early cross-device rounds send."""
    g = torch.Generator().manual_seed(100 + seed)
    return {"w": torch.randn(40, 50, generator=g), "b": torch.randn(50, generator=g),
            "steps": torch.tensor([0], dtype=torch.int64)}


def _feedback(warmup=None, spec: str = SKETCH) -> tuple:
    codec = fedcomp.build_codec(spec)
    layout = fedcomp.Layout.of(_model())
    return codec, ServerFeedback(codec, layout, momentum=0.5, warmup=warmup)


def _feed(codec, fb, seed: int) -> None:
    for c in range(3):
        fb.add(codec.encode(_dense(10 * seed + c)).payload, 1 + c)


def _nonzero(step: dict) -> int:
    return sum(int((v != 0).sum()) for v in step.values() if v.is_floating_point())


def warmup_share(ratio, start, rounds, t):
    return Warmup(share=start, rounds=rounds).share_at(ratio, t)


def test_share_falls_geometrically_from_start_to_the_ratio():
    ratio, start, rounds = 0.007, 0.05, 10
    shares = [warmup_share(ratio, start, rounds, t) for t in range(1, rounds + 3)]
    assert shares[0] == start
    assert all(a > b for a, b in zip(shares[:rounds], shares[1:rounds]))  # strictly falling over the warm-up
    assert shares[rounds:] == [ratio, ratio]  # round rounds + 1 on: the codec's ratio
    assert math.isclose(shares[1], start * (ratio / start) ** (1 / rounds))
    assert warmup_share(ratio, start, rounds, 0) == ratio  # round unknown: no warm-up
    assert warmup_share(ratio, 0.005, rounds, 1) == ratio  # a start below the ratio: no warm-up
    assert warmup_share(ratio, start, 0, 1) == ratio  # no rounds: no warm-up
    # the DGC download's schedule, so a dgc(warmup=, start=) download keeps the same count
    assert all(warmup_share(ratio, start, rounds, t) == warmup_fraction(ratio, rounds, t, start) for t in range(15))
    assert Warmup(scale=4.0, rounds=10).share_at(ratio, 1) == ratio  # no share: the ratio


def test_scale_falls_geometrically_to_one():
    w = Warmup(scale=8.0, rounds=3, scale_rounds=20)
    scales = [w.scale_at(t) for t in range(0, 23)]
    assert scales[0] == 1.0 and scales[1] == 8.0  # round 0 (unknown): none
    assert all(a > b for a, b in zip(scales[1:21], scales[2:21]))
    assert scales[21:] == [1.0, 1.0]
    assert math.isclose(scales[2], 8.0 * (1 / 8.0) ** (1 / 20))
    assert Warmup(scale=8.0, rounds=5).scale_at(6) == 1.0  # scale_rounds None: rounds
    assert Warmup(scale=8.0, rounds=5).scale_at(5) > 1.0
    assert Warmup(share=0.1, rounds=5).scale_at(1) == 1.0  # no scale: 1


def test_kept_per_round_follows_the_schedule():
    codec, fb = _feedback(Warmup(share=0.2, rounds=4))
    n = 2050  # w and b: one global segment
    assert fb.share(1) == 0.2 and fb.kept(1, n) == math.ceil(0.2 * n)
    ks = [fb.kept(t, n) for t in range(1, 6)]
    assert ks[:4] == [math.ceil(round(warmup_share(0.01, 0.2, 4, t) * n, 6)) for t in range(1, 5)]
    assert ks[4] is None  # past the warm-up: the reducer's own count (the default path)
    assert fb.kept(0, n) is None
    _, off = _feedback()
    assert off.warmup is None and off.share(1) == 0.01 and off.kept(1, n) is None


def test_warm_step_applies_the_larger_share_then_the_ratio():
    codec, fb = _feedback(Warmup(share=0.2, rounds=4))
    n, counts = 2050, []
    for t in range(1, 7):
        _feed(codec, fb, t)
        counts.append(_nonzero(fb.step(round=t)))
    assert counts[0] == math.ceil(0.2 * n)
    assert counts[0] > counts[1] > counts[2] > counts[3]
    assert counts[4] == counts[5] == math.ceil(0.01 * n)


def test_off_or_finished_warmup_leaves_the_step_unchanged():
    codec, ref = _feedback()
    _, off = _feedback(None)
    _, done = _feedback(Warmup(share=0.2, scale=5.0, rounds=3, scale_rounds=8))  # rounds 10.. are past it
    _, low = _feedback(Warmup(share=0.005, rounds=5))  # a share below the ratio: never more than the ratio
    for t in range(10, 14):
        for fb in (ref, off, done, low):
            _feed(codec, fb, t)
        want = ref.step(round=t)
        for fb in (off, done, low):
            got = fb.step(round=t)
            assert all(torch.equal(want[k], got[k]) for k in want)
    # and the step without a round (the wrapper's uncoupled call) is the codec's ratio
    _, fresh = _feedback()
    _, warm = _feedback(Warmup(share=0.2, scale=5.0, rounds=3))
    _feed(codec, fresh, 20)
    _feed(codec, warm, 20)
    want, got = fresh.step(), warm.step()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_warmup_is_settable_after_construction():
    codec, fb = _feedback()
    fb.warmup = Warmup(share=0.2, rounds=4)
    assert fb.warmup == Warmup(share=0.2, rounds=4)
    _feed(codec, fb, 1)
    assert _nonzero(fb.step(round=1)) == math.ceil(0.2 * 2050)
    fb.warmup = None
    _feed(codec, fb, 2)
    assert _nonzero(fb.step(round=1)) == math.ceil(0.01 * 2050)


def test_coupled_dgc_download_sends_exactly_the_warm_step():
    """A dgc download with the same schedule keeps every applied coordinate: the broadcast is the
    step (the error table gets nothing back), where a topk of the ratio would cut it."""
    codec, coupled = _feedback(Warmup(share=0.2, scale=3.0, rounds=4))
    _, plain = _feedback(Warmup(share=0.2, scale=3.0, rounds=4))
    dgc = fedcomp.build_codec("dgc(ratio=0.01,momentum=0.0,warmup=4,start=0.2,sample=1.0)")
    topk = fedcomp.build_codec("topk(ratio=0.01)")
    for t in range(1, 7):
        _feed(codec, coupled, t)
        _feed(codec, plain, t)
        sent, payload = coupled.step_broadcast(dgc, nonce=t, round=t)
        want = plain.step(round=t)
        assert all(torch.allclose(sent[k].float(), want[k].float(), atol=1e-6) for k in want)
        decoded = dgc.decode(payload, fedcomp.Layout.of(_model()), round=t)
        assert all(torch.equal(decoded[k], sent[k]) for k in sent)
    _, cut = _feedback(Warmup(share=0.2, rounds=4))
    _feed(codec, cut, 1)
    sent, _ = cut.step_broadcast(topk, round=1)
    assert _nonzero(sent) == math.ceil(0.01 * 2050)


def test_scaled_step_is_the_step_of_the_scaled_mean():
    """The scale multiplies the round's mean table (a server step size): the step of clients
    sending ``u`` with scale c is the step of clients sending ``c u``; exact entries are not scaled."""
    codec = fedcomp.build_codec(SKETCH)
    layout = fedcomp.Layout.of(_model())
    warm = ServerFeedback(codec, layout, momentum=0.5, warmup=Warmup(scale=4.0, rounds=2, rescale=False))
    ref = ServerFeedback(codec, layout, momentum=0.5)
    for t in (1, 2, 3):
        factor = warm.scale(t)
        for c in range(3):
            u = _dense(10 * t + c)
            warm.add(codec.encode(u).payload, 1 + c)
            values = ref.decode(codec.encode(u).payload)
            ref.add_values([v * factor for v in values[:-1]] + values[-1:], 1 + c)
        got, want = warm.step(round=t), ref.step(round=t)
        assert all(torch.allclose(got[k].float(), want[k].float(), rtol=1e-5, atol=1e-6) for k in want)
    assert warm.scale(1) == 4.0 and warm.scale(3) == 1.0


@pytest.mark.parametrize("rescale", [True, False])
def test_tables_fall_with_the_scale(rescale):
    """With ``rescale`` what waits in the tables is applied at the current scale: after the
    warm-up the steps are the unscaled run's; without it, they keep the scale it arrived with."""
    codec = fedcomp.build_codec(SKETCH)
    layout = fedcomp.Layout.of(_model())
    warm = ServerFeedback(codec, layout, momentum=0.5, warmup=Warmup(scale=4.0, rounds=2, rescale=rescale))
    ref = ServerFeedback(codec, layout, momentum=0.5)
    for fb in (warm, ref):
        _feed(codec, fb, 1)
    first, want = warm.step(round=1), ref.step(round=1)
    assert all(torch.allclose(first[k].float(), 4 * want[k].float(), rtol=1e-6) for k in ("w", "b"))
    for t in (3, 4):  # past the warm-up (round 2 skipped: the tables' scale is tracked, not assumed)
        got, want = warm.step(round=t), ref.step(round=t)
        assert _nonzero(want) > 0
        assert all(torch.allclose(got[k].float(), (1 if rescale else 4) * want[k].float(), rtol=1e-5, atol=1e-7)
                   for k in ("w", "b"))


@pytest.mark.parametrize("kwargs, named, allowed", [
    ({"share": 0}, "share=0", "None (off) or a share in (0, 1]"),
    ({"share": 1.5}, "share=1.5", "None (off) or a share in (0, 1]"),
    ({"share": float("nan")}, "share=nan", "a share in (0, 1]"),
    ({"share": True}, "share=True", "a share in (0, 1]"),
    ({"share": "0.1"}, "share='0.1'", "a share in (0, 1]"),
    ({"scale": 0.5}, "scale=0.5", "a factor in [1, 100] (1: off)"),
    ({"scale": float("inf")}, "scale=inf", "a factor in [1, 100]"),
    ({"scale": 1000.0}, "scale=1000.0", "a factor in [1, 100]"),
    ({"rounds": -1}, "rounds=-1", "an int >= 0"),
    ({"rounds": 2.5}, "rounds=2.5", "an int >= 0"),
    ({"rounds": True}, "rounds=True", "an int >= 0"),
    ({"scale_rounds": -3}, "scale_rounds=-3", "an int >= 0 (None: rounds)"),
    ({"rescale": 1}, "rescale=1", "True or False"),
])
def test_bad_warmup_raises_naming_the_value(kwargs, named, allowed):
    with pytest.raises(SpecError) as info:
        Warmup(**kwargs)
    assert named in str(info.value) and allowed in str(info.value)


@pytest.mark.parametrize("bad", [(0.05, 10), 0.05, "share=0.05", {"share": 0.05}])
def test_warmup_must_be_a_warmup(bad):
    codec = fedcomp.build_codec(SKETCH)
    with pytest.raises(SpecError, match="a Warmup") as info:
        ServerFeedback(codec, fedcomp.Layout.of(_model()), warmup=bad)
    assert f"warmup={bad!r}" in str(info.value)
    fb = ServerFeedback(codec, fedcomp.Layout.of(_model()))
    with pytest.raises(SpecError):
        fb.warmup = bad
    assert fb.warmup is None  # a rejected value leaves the feedback as it was


def test_study_names():
    assert split_name("s0.007-m0.5-w0.05x10") == ("s0.007-m0.5", Warmup(share=0.05, rounds=10), None)
    assert split_name("s0.007-m0.5") == ("s0.007-m0.5", None, None)
    assert split_name("s0.007-m0.5-w0.03x10-l8x20-M0.9x5") == (
        "s0.007-m0.5", Warmup(share=0.03, scale=8.0, rounds=10, scale_rounds=20, rescale=False), {"M": (0.9, 5)})
    assert split_name("s0.007-m0.5-L8x20") == ("s0.007-m0.5", Warmup(scale=8.0, scale_rounds=20), None)
    with pytest.raises(ValueError, match="one of them"):
        split_name("s0.007-m0.5-L8x20-l8x20")
    upload, settings, warmup, _ = settings_of("s0.007-m0.5-w0.05x10", 10_000)
    assert warmup == Warmup(share=0.05, rounds=10) and settings["coupled_download"]
    assert settings["server_momentum"] == 0.5
    assert settings["download"].startswith("dgc(ratio=0.007,momentum=0.0,warmup=10,start=0.05,sample=1.0)+kbit(bits=4")
    # a step size alone keeps the topk download (the same count per step)
    assert settings_of("s0.007-m0.5-l8x20", 10_000)[1]["download"].startswith("topk(ratio=0.007)")
    assert settings_of("s0.007-m0.5", 10_000)[2:] == (None, None)
    with pytest.raises(ValueError, match="needs a sketch run"):
        settings_of("dense-l8x20", 10_000)
