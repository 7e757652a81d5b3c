"""Closed-loop compression: the strength controller's policy and the link estimator's fit."""

from __future__ import annotations

import random

import pytest

from fedcomp.adapt import AdaptError, LinkEstimator, StrengthController


def _controller(**kw) -> StrengthController:
    args = dict(lowest=100, highest=10_000, start=1_000)
    args.update(kw)
    return StrengthController(**args)


def test_tightens_while_on_track_and_stays_in_bounds():
    c = _controller()
    budgets = [c.update(r, 0.5 + 0.02 * r) for r in range(1, 30)]  # steady progress
    assert budgets[0] == 1_000  # one round of progress is not yet a trend
    assert budgets[1] == 700  # patience 2: tighten by 0.7
    assert min(budgets) == 100 and budgets[-1] == 100  # clamped at the lowest budget
    assert all(b >= 100 for b in budgets)


def test_relaxes_on_a_drop_and_waits_before_tightening_again():
    c = _controller(cooldown=3)
    for r, s in enumerate([0.5, 0.6, 0.7, 0.8], 1):
        c.update(r, s)
    tight = c.current()
    assert tight < 1_000
    relaxed = c.update(5, 0.7)  # accuracy dropped by 10 points
    assert relaxed == pytest.approx(tight * 1.6, abs=2)
    # progress resumes at once, but the cooldown holds the budget for 3 rounds
    after = [c.update(r, 0.8 + 0.05 * (r - 5)) for r in range(6, 10)]
    assert after[:3] == [relaxed] * 3
    assert after[3] < relaxed
    assert [h["decision"] for h in c.history][4] == "relax"


def test_relaxes_on_a_stall_but_not_past_the_highest():
    c = _controller(start=8_000, patience=2)
    c.update(1, 0.9)
    b = [c.update(r, 0.9) for r in range(2, 8)]  # flat signal: stalled
    assert b[0] == 8_000 and b[1] == 10_000  # relaxed after 2 stalled rounds, clamped
    assert b[-1] == 10_000
    assert c.history[-1]["decision"] == "hold"


def test_noise_within_tolerance_never_tightens():
    rng = random.Random(0)
    c = _controller(tolerance=0.01, patience=3)
    c.update(0, 0.9)
    for r in range(1, 200):
        c.update(r, 0.9 + rng.uniform(-0.004, 0.004))
    assert not any(h["decision"] == "tighten" for h in c.history)


@pytest.mark.parametrize("kw", [dict(lowest=0), dict(start=50), dict(start=20_000), dict(tighten=1.0),
                                dict(relax=0.5), dict(patience=0), dict(tolerance=float("nan")), dict(highest=True)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(AdaptError):
        _controller(**kw)


def test_bad_signal_is_refused():
    with pytest.raises(AdaptError, match="signal"):
        _controller().update(1, float("nan"))


def test_link_estimate_recovers_bandwidth_and_latency():
    est = LinkEstimator()
    kbps, latency = 2_000.0, 0.08
    for nbytes in (10_000, 40_000, 5_000, 80_000, 20_000):
        est.observe(7, "up", nbytes, latency + nbytes * 8 / (kbps * 1000))
    got_kbps, got_latency = est.estimate(7, "up")
    assert got_kbps == pytest.approx(kbps, rel=1e-6)
    assert got_latency == pytest.approx(latency, rel=1e-6)
    assert est.estimate(7, "down") is None and est.estimate(8, "up") is None


def test_link_estimate_with_equal_sizes_charges_time_to_bandwidth():
    est = LinkEstimator()
    for _ in range(4):
        est.observe(1, "down", 50_000, 0.5)
    kbps, latency = est.estimate(1, "down")
    assert latency == 0.0 and kbps == pytest.approx(800.0)


def test_link_estimate_forgets_old_transfers():
    est = LinkEstimator(window=3)
    for _ in range(3):
        est.observe(1, "up", 1_000, 1.0)  # 8 kbps
    for _ in range(3):
        est.observe(1, "up", 1_000, 0.1)  # then 80 kbps
    assert est.estimate(1, "up")[0] == pytest.approx(80.0)


@pytest.mark.parametrize("args", [(1, "sideways", 10, 1.0), (1, "up", 0, 1.0), (1, "up", 10, 0.0),
                                  (1, "up", 10, float("inf"))])
def test_bad_observations_are_refused(args):
    with pytest.raises(AdaptError):
        LinkEstimator().observe(*args)
