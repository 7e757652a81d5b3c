"""The codec contract over arbitrary layouts (hypothesis): for every registered codec, on the
compiled-loop and torch paths alike, encode never raises on a valid update, the payload decodes
to exactly what the encoder reported, its size is what ``size_bytes`` promised, both paths write
the same bytes, and the server's accumulator adds it up to the decoded values.

Layouts come from :mod:`fedcomp.simulations.layouts` (sizes that are not multiples of a block or
run width, 0-element and 0-d tensors, hundreds of tiny tensors, mixed dtypes, a large tensor
beside tiny ones, Flower's quickstart CNN, a ResNet block, a transformer block)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp
from fedcomp.simulations.encode_fuzz import all_specs, check_update
from fedcomp.simulations.layouts import FIXED, QUICKSTART_NET, draw_update, random_update, values

SPECS = all_specs()


class _HypothesisDraw:
    def __init__(self, data) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_contract_on_arbitrary_layouts(spec, data):
    update = draw_update(_HypothesisDraw(data))
    check_update(spec, update, nonce=data.draw(st.integers(0, 2**63 - 1)), rnd=data.draw(st.integers(0, 3)))


@pytest.mark.parametrize("model", sorted(FIXED))
@pytest.mark.parametrize("spec", SPECS)
def test_contract_on_fixed_models(spec, model):
    layout = FIXED[model]
    update = {name: values(shape, dtype, "normal", 0.01, i) for i, (name, (shape, dtype)) in enumerate(layout.items())}
    check_update(spec, update, nonce=12345, rnd=1)


def test_default_codec_on_the_quickstart_cnn_never_fails():
    """The encode that failed 15 of 300 times (runs of the top-k sample drawn twice)."""
    codec = fedcomp.build_codec("topk(ratio=0.01)+qsgd(bits=4)")
    layout = fedcomp.Layout.of({k: torch.zeros(s) for k, (s, _) in QUICKSTART_NET.items()})
    for i in range(300):
        g = torch.Generator().manual_seed(i)
        update = {k: torch.randn(s, generator=g) * 0.01 for k, (s, _) in QUICKSTART_NET.items()}
        enc = codec.encode(update, nonce=i, round=i, state={})
        assert codec.size_bytes(layout, enc.kept, enc.index_bytes) == len(enc.payload)


def test_random_updates_match_the_hypothesis_draws():
    """The fuzzers' draws (random.Random) cover the same kinds of layout."""
    rng = random.Random(3)
    seen = set()
    for _ in range(60):
        u = random_update(rng)
        seen.add(len(u) >= 100)
        seen.add(any(t.dim() == 0 for t in u.values()))
        seen.add(any(t.numel() == 0 for t in u.values()))
        seen.add(max(t.numel() for t in u.values()) > 25_600)
    assert seen == {True, False}


# -- the server's side over the same layouts: FetchSGD's step with its coupled download, tiers ----
from fedcomp.aggregate import apply_step  # noqa: E402
from fedcomp.broadcast import Tier, apply_plan, reference_crc  # noqa: E402
from fedcomp.server_feedback import ServerFeedback  # noqa: E402
from fedcomp.tensor_kinds import exact_state_policy  # noqa: E402

SERVER_SPECS = ("sketch(rows=1,cols=0,ratio=0.02)+qsgd(bits=4)", "sketch(rows=3,cols=64,ratio=0.1)")
TIER_SPECS = ("topk(ratio=0.02)+kbit(bits=4,stochastic=true)", "kbit(bits=8)", "powersgd(rank=1)", "none()")


@pytest.mark.parametrize("spec", SERVER_SPECS)
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_sketch_step_and_coupled_download_on_arbitrary_layouts(spec, data):
    draw = _HypothesisDraw(data)
    model = draw_update(draw)
    layout = fedcomp.Layout.of(model)
    upload = fedcomp.build_codec(exact_state_policy(spec, layout))
    download = fedcomp.build_codec(exact_state_policy("topk(ratio=0.02)+kbit(bits=4,stochastic=true)", layout))
    server = ServerFeedback(upload, layout, momentum=0.9)
    for rnd in (1, 2):
        for client in range(3):
            update = {n: (t * (client + 1) if t.is_floating_point() else t) for n, t in model.items()}
            server.add(upload.encode(update, nonce=client, round=rnd, state={}).payload, weight=1.0 + client)
        step, payload = server.step_broadcast(download, nonce=rnd, round=rnd)
        sent = download.decode(payload, layout, round=rnd)
        for name, t in step.items():
            assert t.shape == model[name].shape and t.dtype == model[name].dtype, name
            assert torch.equal(t, sent[name]), f"{spec}: {name}: the server applies other values than it sends"
            if t.is_floating_point():
                assert bool(torch.isfinite(t).all()), name


@pytest.mark.parametrize("spec", TIER_SPECS)
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_download_tier_chain_on_arbitrary_layouts(spec, data):
    draw = _HypothesisDraw(data)
    start = draw_update(draw)
    layout = fedcomp.Layout.of(start)
    tier = Tier(0, spec)
    tier.start(start)
    model, steps = dict(start), []
    for rnd in (1, 2, 3):
        noise = lambda t: torch.randn(t.shape, generator=torch.Generator().manual_seed(rnd)).to(t.dtype)  # noqa: E731
        model = {n: t + noise(t) * 0.01 if t.is_floating_point() else (t if t.dtype == torch.bool else t + 1)
                 for n, t in model.items()}
        steps.append(tier.step(model, rnd, seed=7))
    held = {n: t.clone() for n, t in start.items()}
    reference, info = apply_plan(held, (0, 0, reference_crc(held)), mode="chain", tier=0, spec=spec,
                                 payloads=[s.payload for s in steps], rounds=[1, 2, 3],
                                 base_crc=steps[0].base_crc, crc=steps[-1].crc, layout=layout)
    assert info == (0, 3, tier.crc) and reference_crc(reference) == reference_crc(tier.reference)
    assert apply_step(start, {n: torch.zeros_like(t) for n, t in start.items()}).keys() == start.keys()


def _chunk_constants():
    """Every module-level ``*CHUNK`` size of fedcomp (the chunked readers, encoders, sums, hashes)."""
    import sys

    for name, module in list(sys.modules.items()):
        if not name.startswith("fedcomp") or module is None or name == "fedcomp.msgsize":  # msgsize: Flower's
            continue
        for key, value in list(vars(module).items()):
            if key.endswith("CHUNK") and isinstance(value, int) and not isinstance(value, bool) and value >= 1024:
                yield module, key


@pytest.mark.parametrize("chunk", [2053])
def test_contract_with_chunks_that_split_every_tensor(monkeypatch, chunk):
    """Chunk sizes are powers of two, and so were the tested tensors: with prime chunk sizes every
    chunked loop splits the drawn tensors at odd places, and the contract still holds."""
    patched = [f"{m.__name__}.{k}" for m, k in _chunk_constants()]
    assert len(patched) >= 5, patched
    for module, key in _chunk_constants():
        monkeypatch.setattr(module, key, chunk)
    rng = random.Random(chunk)
    for spec in SPECS:
        update = random_update(rng)
        if max(t.numel() for t in update.values()) < 3 * chunk:  # at least one tensor across chunks
            update["big.w"] = values((4 * chunk + 5,), torch.float32, "normal", 0.01, chunk)
        check_update(spec, update, nonce=chunk, rnd=1)
