"""Closed-loop compression: the strength controller's policy, `auto` specs, the link estimator and measured budgets."""

from __future__ import annotations

import random

import pytest
import torch

from fedcomp import links
from fedcomp.adapt import AdaptError, AdaptSettings, AutoStrength, LinkEstimator, MeasuredBudgets, StrengthController, is_auto
from fedcomp.layout import Layout


def _controller(**kw) -> StrengthController:
    args = dict(lowest=100, highest=10_000, start=1_000, window=2, cooldown=1)
    args.update(kw)
    return StrengthController(**args)


def _feed(c: StrengthController, signals, first: int = 1) -> list[int]:
    return [c.update(r, s) for r, s in enumerate(signals, first)]


def test_tightens_once_per_window_of_progress_and_stays_in_bounds():
    c = _controller()
    budgets = _feed(c, [0.5 + 0.02 * r for r in range(1, 40)])  # steady progress
    assert budgets[:3] == [1_000] * 3  # the first window is the reference
    assert budgets[3] == 700  # second window beat the first by 4 points: tighten by 0.7
    assert budgets[4] == 700  # decisions only at window ends
    assert min(budgets) == 100 and budgets[-1] == 100  # clamped at the lowest budget
    assert all(b >= 100 for b in budgets)
    assert {h["decision"] for h in c.history} == {"hold", "tighten"}


def test_relaxes_on_a_drop_and_waits_a_window_before_tightening():
    c = _controller()
    _feed(c, [0.5, 0.5, 0.6, 0.6])  # reference window, then progress: tighten
    assert c.current() == 700
    assert _feed(c, [0.5, 0.5], 5)[-1] == 1120  # dropped 10 points: relax by 1.6
    assert c.history[-1]["decision"] == "relax"
    assert _feed(c, [0.7, 0.7], 7)[-1] == 1120  # progress, but within the cooldown: hold
    assert _feed(c, [0.8, 0.8], 9)[-1] == 784  # progress after the cooldown: tighten


def test_a_stall_probes_reverts_when_it_bought_nothing_and_backs_off():
    c = _controller(start=500)
    decisions = []
    for r in range(1, 31):
        c.update(r, 0.9)  # a flat signal: converged
        decisions.append((c.history[-1]["decision"], c.current()))
    moves = [(r, d, b) for r, (d, b) in enumerate(decisions, 1) if d != "hold"]
    # probe at the end of window 2, revert a window later; then probes wait 2, 4, ... stalled windows
    assert moves[:4] == [(4, "relax", 800), (6, "revert", 500), (10, "relax", 800), (12, "revert", 500)]
    assert moves[4][:2] == (20, "relax")
    assert max(b for _, b in decisions) == 800  # a converged run never drifts to the weakest compression


def test_without_revert_a_stall_relax_is_kept_and_probes_still_back_off():
    c = _controller(start=500, revert=False)
    moves = []
    for r in range(1, 31):
        c.update(r, 0.9)
        if c.history[-1]["decision"] != "hold":
            moves.append((r, c.history[-1]["decision"], c.current()))
    assert moves == [(4, "relax", 800), (10, "relax", 1280), (20, "relax", 2048)]


def test_a_probe_that_helps_is_kept():
    c = _controller(start=500)
    _feed(c, [0.8, 0.8, 0.8, 0.8])  # stalled: probe
    assert c.current() == 800
    _feed(c, [0.85, 0.85], 5)  # the probe lifted accuracy: no revert (and no tightening in the cooldown)
    assert c.current() == 800 and c.history[-1]["decision"] == "hold"


def test_noise_within_tolerance_never_tightens():
    rng = random.Random(0)
    c = _controller(tolerance=0.01, window=5)
    _feed(c, [0.9 + rng.uniform(-0.004, 0.004) for _ in range(200)])
    assert not any(h["decision"] == "tighten" for h in c.history)


@pytest.mark.parametrize("kw", [dict(lowest=0), dict(start=50), dict(start=20_000), dict(tighten=1.0),
                                dict(relax=0.5), dict(window=0), dict(cooldown=-1), dict(tolerance=float("nan")),
                                dict(highest=True)])
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


# -- `auto` in an upload spec ------------------------------------------------------------------------


_LAYOUT = Layout.of({"w": torch.zeros(64, 128), "b": torch.zeros(128), "steps": torch.zeros((), dtype=torch.int64)})


def test_is_auto():
    assert is_auto("topk(ratio=auto)+qsgd(bits=4)")
    assert not is_auto("topk(ratio=0.01)+qsgd(bits=4)")
    assert not is_auto("round<3: none(); topk(ratio=0.01)")  # a policy is not adaptive


def test_auto_ratio_follows_the_controller_within_the_reductions():
    a = AutoStrength("topk(ratio=auto)+qsgd(bits=4)", _LAYOUT, AdaptSettings(min_reduction=10, max_reduction=200,
                                                                             start_reduction=200, window=1))
    dense = 4 * (64 * 128 + 128)
    assert a.dense_bytes >= dense
    assert a.controller.lowest == a.dense_bytes // 200 and a.controller.highest == a.dense_bytes // 10
    first = a.spec(1)
    assert first.startswith("topk(ratio=") and "qsgd(bits=4" in first
    ratio1 = a.history[-1]["ratio"]
    a.observe(1, {"accuracy": 0.5, "loss": 1.0})
    a.spec(2)
    a.observe(2, {"accuracy": 0.5})  # stalled: a probe relaxes the budget
    a.spec(3)
    ratio3 = a.history[-1]["ratio"]
    assert ratio3 > ratio1
    assert [h["decision"] for h in a.history[:2]] == ["hold", "relax"]
    assert a.history[0]["signal"] == 0.5 and a.history[0]["budget"] == a.controller.lowest


def test_the_floor_rises_to_a_share_of_the_messages_fixed_bytes():
    settings = AdaptSettings(min_reduction=10, max_reduction=400, start_reduction=400, window=1, fixed_share=0.5)
    a = AutoStrength("topk(ratio=auto)+qsgd(bits=4)", _LAYOUT, settings)
    low = a.controller.lowest
    assert low == a.dense_bytes // 400 and a.fixed_bytes is None
    a.spec(1)
    payload = a._fits[low].message_bytes
    a.observe_message(1, payload + 4 * low)  # the message carries 4x the floor besides its payload
    assert a.fixed_bytes == 4 * low and a.history[-1]["fixed_bytes"] == 4 * low
    assert a.controller.lowest == 2 * low  # half of the fixed part: above dense / max_reduction
    assert a.controller.current() == 2 * low  # a budget under the new floor is raised to it
    a.observe(1, {"accuracy": 0.5})
    assert a.history[-1]["budget"] == low  # round 1 ran at the old floor; round 2 gets the new one
    assert a.spec(2) != a.history[0]["spec"] and a.history[-1]["budget"] == 2 * low
    a.observe_message(2, a._fits[2 * low].message_bytes + 10**9)  # the smallest fixed part seen counts
    assert a.fixed_bytes == 4 * low and a.history[-1]["fixed_bytes"] > 10**8 and a.controller.lowest == 2 * low
    a.observe_message(2, a._fits[2 * low].message_bytes + 10)  # a small fixed part: dense / max_reduction rules
    assert a.controller.lowest == low and a.controller.current() == 2 * low  # the budget itself is not lowered
    b = AutoStrength("topk(ratio=auto)+qsgd(bits=4)", _LAYOUT, settings)
    b.spec(1)
    b.observe_message(1, 10**9)  # never above the highest budget
    assert b.controller.lowest == b.controller.highest == b.controller.current()


def test_fixed_share_zero_keeps_the_reduction_floor_and_bad_observations_are_refused():
    a = AutoStrength("topk(ratio=auto)+qsgd(bits=4)", _LAYOUT, AdaptSettings(min_reduction=10, max_reduction=400,
                                                                             start_reduction=400, fixed_share=0))
    low = a.controller.lowest
    with pytest.raises(AdaptError, match="round 1 has no spec"):
        a.observe_message(1, 10_000)
    a.spec(1)
    a.observe_message(1, 10**6)
    assert a.controller.lowest == low
    with pytest.raises(AdaptError, match="message_bytes"):
        a.observe_message(1, 0)


def test_auto_signal_falls_back_to_minus_loss_and_needs_one():
    a = AutoStrength("kbit(bits=auto)", _LAYOUT, AdaptSettings(min_reduction=2, max_reduction=16, start_reduction=4))
    assert "kbit(bits=" in a.spec(1)
    a.observe(1, {"loss": 2.0})
    assert a.controller.history[-1]["signal"] == -2.0
    with pytest.raises(AdaptError, match="accuracy"):
        a.observe(2, {"f1": 0.3})


@pytest.mark.parametrize("spec, match", [
    ("topk(ratio=auto)+qsgd(bits=auto)", "exactly one"),
    ("topk(ratio=0.01)+qsgd(bits=4)", "exactly one"),
    ("topk(ratio=0.01)+qsgd(bits=auto)", "topk.ratio"),  # the reducer's ratio moves, not the quantizer's bits
])
def test_auto_in_the_wrong_place_is_refused(spec, match):
    with pytest.raises(AdaptError, match=match):
        AutoStrength(spec, _LAYOUT)


def test_bad_adapt_settings_are_refused():
    with pytest.raises(AdaptError, match="start_reduction"):
        AdaptSettings(min_reduction=10, max_reduction=100, start_reduction=1000)
    with pytest.raises(AdaptError, match="reduction"):
        AdaptSettings(min_reduction=0.5)
    with pytest.raises(AdaptError, match="fixed_share"):
        AdaptSettings(fixed_share=-1)


# -- measured links -----------------------------------------------------------------------------------


def test_latency_fit_is_kept_when_sizes_stop_differing():
    est = LinkEstimator(window=4)
    kbps, latency = 200.0, 0.3
    for nbytes in (4_000, 16_000, 64_000, 50_000, 50_000, 50_000, 50_000):  # the last window has no spread
        est.observe(1, "up", nbytes, latency + nbytes * 8 / (kbps * 1000))
    got_kbps, got_latency = est.estimate(1, "up")
    assert got_latency == pytest.approx(latency, rel=1e-6) and got_kbps == pytest.approx(kbps, rel=1e-6)
    assert est.uncertainty(1, "up") == pytest.approx(0, abs=1e-9)
    assert est.uncertainty(1, "down") is None


def test_wire_timed_transfers_give_the_links_rate_and_the_rest_as_latency():
    """Transfers of one size (dense broadcasts: no fit possible) whose calls took 0.6 s besides their
    bytes at 200 Mbit/s (the ends' work): the calls alone read 139 Mbit/s; with the wire times the
    rate is the link's and the 0.6 s is latency, so a transfer's time is still predicted whole."""
    kbps, nbytes, ends = 200_000.0, 34_000_000, 0.6
    wire = nbytes * 8 / (kbps * 1000)
    calls_only, timed = LinkEstimator(), LinkEstimator()
    for _ in range(3):
        calls_only.observe(1, "down", nbytes, wire + ends)
        timed.observe(1, "down", nbytes, wire + ends, wire_s=wire)
    assert calls_only.estimate(1, "down")[0] == pytest.approx(kbps * wire / (wire + ends), rel=1e-6)
    assert not calls_only.fitted(1, "down")
    got_kbps, got_latency = timed.estimate(1, "down")
    assert got_kbps == pytest.approx(kbps, rel=1e-6) and got_latency == pytest.approx(ends, rel=1e-6)
    assert timed.fitted(1, "down") and timed.uncertainty(1, "down") == pytest.approx(0, abs=1e-9)
    # small transfers the counters could not time keep their own remainder in the latency's mean
    timed.observe(1, "down", 1_000, 0.05)
    assert timed.estimate(1, "down")[0] == pytest.approx(kbps, rel=1e-6)
    assert timed.estimate(1, "down")[1] == pytest.approx((3 * ends + 0.05 - 1_000 * 8 / (kbps * 1000)) / 4, rel=1e-6)
    with pytest.raises(AdaptError, match="wire_s"):
        timed.observe(1, "down", 1_000, 0.05, wire_s=0.0)


def test_slow_start_grows_from_replies_in_time_before_their_push_is_timed():
    mb = MeasuredBudgets(40.0)
    assert mb.budget(3, 1, download_bytes=10**6, compute_s=1.0) == 4096  # first contact
    assert mb.link(3).byte_cap == 4096
    mb.observe_arrival(3, 4000)  # round 1's reply arrived in time; its push is timed with round 2's
    assert mb.budget(3, 2, download_bytes=10**6, compute_s=1.0) == 16_000
    assert mb.link(3).byte_cap == 16_000
    mb.observe(3, up_bytes=4000, up_s=0.05, down_bytes=10**6, down_s=1.0)  # the timing, one round late
    mb.observe_arrival(3, 16_000)
    assert mb._growth_cap(3) == 64_000 and mb.link(3).byte_cap == 64_000


def test_measured_budgets_converge_to_the_declared_links_and_meet_the_deadline():
    deadline, down_bytes, compute = 12.0, 937_000, 1.0
    hidden = {n: links.with_deadline(links.PRESETS[p], deadline) for n, p in enumerate(("3g-edge", "4g"))}
    mb = MeasuredBudgets(deadline)
    rng = random.Random(1)
    for rnd in range(1, 9):
        for node, link in hidden.items():
            largest = 937_000  # the dense reply: no budget above it is used
            declared = min(largest, links.upload_budget(link, down_bytes, compute))
            budget = min(largest, mb.budget(node, rnd, download_bytes=down_bytes, compute_s=compute, declared=declared))
            mb.history[-1].update(budget=budget, error=budget / declared - 1)
            assert link.download_s(down_bytes) + compute + link.upload_s(budget) <= deadline  # never late
            noise = lambda: 1 + 0.02 * rng.gauss(0, 1)  # noqa: E731  measuring a transfer's time
            mb.observe(node, up_bytes=budget, up_s=link.upload_s(budget) * noise(),
                       down_bytes=down_bytes, down_s=link.download_s(down_bytes) * noise())
    first = [h for h in mb.history if h["round"] == 1]
    assert all(h["budget"] == 4096 for h in first)  # nothing measured yet: the first probe
    assert [h["budget"] for h in mb.history if h["node"] == 0][1] <= 4 * 4096  # slow start
    late = [h for h in mb.history if h["round"] >= 5]
    assert all(abs(h["error"]) <= 0.10 for h in late), [(h["node"], h["round"], h["error"]) for h in late]


@pytest.mark.parametrize("kw", [dict(deadline_s=0), dict(z=-1), dict(growth=1.0), dict(first=0), dict(prior=float("inf"))])
def test_bad_measured_budget_settings_are_refused(kw):
    with pytest.raises(AdaptError):
        MeasuredBudgets(**{"deadline_s": 10.0, **kw})
