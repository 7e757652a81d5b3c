"""The ``char-transformer`` model of the character tasks: its size, causality, seeding, that it
learns, the task's per-model budgets, and its state through fedcomp's default codecs (an uneven
layout: vocabulary 98, width 132, MLP 499)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcomp.simulations import datasets, models, task
from fedcomp.simulations.encode_fuzz import check_update
from fedcomp.strategies import config

VOCAB = len(datasets.VOCAB)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread is faster than two on a shared 2-core machine; restored afterwards."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def model():
    return task.build_model("char-transformer", 0, "stdlib-chars")


def test_size_layers_and_uneven_layout(model):
    assert task.check_task_model("stdlib-chars", "char-transformer") is None
    assert task.TASKS["stdlib-chars"].models[0] == "char-lstm"  # still the suggested one
    assert models.count_parameters(model) == 1_052_389 >= 1_000_000
    kinds = {type(m) for m in model.modules()}
    assert {torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.Linear} <= kinds
    shapes = [tuple(t.shape) for t in model.state_dict().values()]
    assert any(any(d % 16 for d in s) for s in shapes) and any(d % 2 for s in shapes for d in s)
    assert all(t.is_floating_point() for t in model.state_dict().values())


def test_output_shape_and_first_loss(model):
    x = torch.randint(0, VOCAB, (3, task.SEQ_LEN))
    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert tuple(logits.shape) == (3, task.SEQ_LEN, VOCAB)
    # the read-out starts at zero: uniform prediction, loss log(vocab)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x.reshape(-1))
    assert float(loss) == pytest.approx(np.log(VOCAB), abs=1e-5)
    with pytest.raises(ValueError, match="at most 80 positions"):
        model(torch.zeros(1, task.SEQ_LEN + 1, dtype=torch.int64))


def test_causal(model):
    """Position t depends on inputs 0..t only: changing input t changes no output before t, and
    does change outputs at t and after (once the read-out is not zero)."""
    m = task.build_model("char-transformer", 0, "stdlib-chars")
    torch.nn.init.normal_(m.head.weight, std=1.0, generator=torch.Generator().manual_seed(1))
    m.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (2, task.SEQ_LEN), generator=g)
    with torch.no_grad():
        base = m(x)
        for t in (0, 17, 40, task.SEQ_LEN - 1):
            y = x.clone()
            y[:, t] = (y[:, t] + 1) % VOCAB
            out = m(y)
            assert torch.allclose(out[:, :t], base[:, :t], rtol=0, atol=1e-6), f"output before {t} moved"
            assert not torch.allclose(out[:, t:], base[:, t:]), f"output from {t} on did not move"
        # a shorter window gives the same outputs as the longer one's prefix
        assert torch.allclose(m(x[:, :33]), base[:, :33], atol=1e-5)


def test_deterministic_from_the_seed_and_rng_untouched():
    state = torch.random.get_rng_state()
    a, b, c = (task.build_model("char-transformer", s, "stdlib-chars") for s in (1, 1, 2))
    assert torch.equal(state, torch.random.get_rng_state())
    flat = torch.nn.utils.parameters_to_vector
    assert torch.equal(flat(a.parameters()), flat(b.parameters()))
    assert not torch.equal(flat(a.parameters()), flat(c.parameters()))


def test_trains_on_a_tiny_batch():
    x, y = task.load_test("stdlib-chars", 0)
    x, y = x[:16], y[:16]
    m = task.build_model("char-transformer", 0, "stdlib-chars")
    loss0, _ = task.evaluate(m, x, y, "cpu")
    for epoch in range(10):  # 4.58 -> about 3.7 (torch 2.13 CPU)
        task.train(m, x, y, epochs=1, lr=5.0, batch_size=16, seed=epoch, device="cpu")
    loss, acc = task.evaluate(m, x, y, "cpu")
    assert loss < loss0 - 0.5 and 0.0 <= acc <= 1.0


def test_local_and_eval_budgets_touch_the_transformer_only():
    """``local_examples`` windows per local epoch, ``eval_examples`` evenly spaced test windows; a
    model without the attributes (char-lstm) trains and scores on everything, as before."""
    x, y = task.load_partition("stdlib-chars", 0, 10, 0.5, 0)
    assert len(x) > models.CharTransformer.local_examples
    seen = []

    class Spy(torch.nn.Module):
        local_examples = 5
        eval_examples = 7

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(VOCAB))

        def forward(self, xb):
            seen.append(len(xb))
            return self.w.expand(*xb.shape, VOCAB)

    task.train(Spy(), x, y, epochs=2, lr=0.1, batch_size=2, seed=0, device="cpu")
    assert seen == [2, 2, 1] * 2
    seen.clear()
    task.evaluate(Spy(), x, y, "cpu")
    assert seen == [7]
    seen.clear()
    plain = Spy()
    del Spy.local_examples, Spy.eval_examples
    task.train(plain, x[:9], y[:9], epochs=1, lr=0.1, batch_size=4, seed=0, device="cpu")
    task.evaluate(plain, x[:9], y[:9], "cpu")
    assert seen == [4, 4, 1, 9]


@pytest.mark.parametrize("spec", [
    config.SILO_UPLOAD,
    config.DENSE_UPLOAD,
    config.cross_device_upload(1_052_389),
    config.cross_device_upload(1_052_389, config.ROBUST_SKETCH_RATIO),
    config.coupled_download(),
])
def test_state_through_the_default_codecs(model, spec):
    """Every float tensor of the state, as an update, through each default upload / download codec:
    encode, decode to what the encoder reported, promised size, both kernel paths, the accumulator."""
    g = torch.Generator().manual_seed(7)
    update = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in model.state_dict().items()}
    check_update(spec, update, nonce=123, rnd=2)
