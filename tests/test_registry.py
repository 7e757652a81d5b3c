"""A new codec is one class plus its registration: tested, fuzzed and budgetable with no other edit.

The codec (tests/_extra_codec.py) is registered by a fixture and unregistered afterwards; each
test runs it through the same registry-driven functions the suites use: ``example_specs`` and
:func:`contract.check_contract` (tests/test_codecs.py), ``fuzz.all_specs``/``build_targets``/
``mutate``/``check`` (tests/test_fuzz.py, the atheris harness), and ``fedcomp.budget``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

import fedcomp
from _extra_codec import Uniform
from contract import check_contract, contract_model
from fedcomp.base import REGISTRY, Knob, Quantizer, example_specs, register, unregister
from fedcomp.budget import BudgetTooSmall, check_budgetable, fit_budget, fit_update
from fedcomp.simulations import fuzz

NAME = Uniform.name


@pytest.fixture
def extra_codec():
    register(Uniform)
    try:
        yield Uniform
    finally:
        unregister(NAME)


def test_registration_alone_makes_a_spec_name(extra_codec):
    codec = fedcomp.build_codec(f"{NAME}(bits=5)")
    assert codec.spec == f"{NAME}(bits=5)" and NAME in fedcomp.available_codecs()
    assert f"{NAME}()" in example_specs() and f"topk(ratio=0.1)+{NAME}()" in example_specs()


@pytest.mark.parametrize("form", ["{}()", "topk(ratio=0.1)+{}()"])
def test_contract_suite_picks_it_up(extra_codec, form):
    spec = form.format(NAME)
    assert spec in example_specs()  # what test_codecs.test_registry_contract parametrizes over
    check_contract(spec)


def test_contract_catches_a_broken_codec():
    """The contract is not vacuous: a codec whose size_bytes lies fails it."""

    class Liar(Uniform):
        name = "liar-test"

        def nbytes(self, count: int) -> int:
            return super().nbytes(count) + 1

    register(Liar)
    try:
        with pytest.raises(AssertionError, match="size_bytes"):
            check_contract("liar-test()")
    finally:
        unregister("liar-test")


class _RandomDraw:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi) if hi > lo else lo

    def bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)


def test_fuzz_targets_pick_it_up(extra_codec):
    specs = [s for s in fuzz.all_specs() if NAME in s]
    assert specs == list(example_specs([NAME]))
    outcomes = set()
    for target in fuzz.build_targets(tuple(specs)):
        assert fuzz.check(target, target.payload) == "ok"
        for seed in range(150):
            outcomes.add(fuzz.check(target, fuzz.mutate(target.payload, _RandomDraw(seed))))
    assert outcomes == {"ok", "rejected"}  # mutations both reach a decode and get refused


def test_budget_controller_picks_it_up(extra_codec):
    check_budgetable(f"{NAME}()")
    update = {k: v for k, v in contract_model().items()}
    layout = fedcomp.Layout.of(update)
    sizes = {b: fedcomp.build_codec(f"{NAME}(bits={b})").size_bytes(layout) for b in range(2, 9)}
    for bits in range(2, 9):  # the declared levels knob: the highest bits that fit wins
        fit = fit_update(f"{NAME}()", update, sizes[bits], nonce=3)
        assert fit.spec == f"{NAME}(bits={bits})" and fit.message_bytes == sizes[bits]
    with pytest.raises(BudgetTooSmall):
        fit_budget(f"{NAME}()", layout, sizes[2] - 1)
    # after a reducer without a fine knob it would move too; after topk (fine ratio) only topk moves
    assert fit_budget(f"topk(ratio=0.5,index='fixed')+{NAME}(bits=3)", layout, 900).spec.endswith(f"{NAME}(bits=3)")


def test_unregister_undoes_it(extra_codec):
    unregister(NAME)
    assert NAME not in REGISTRY and not any(NAME in s for s in fuzz.all_specs() + example_specs())
    with pytest.raises(fedcomp.SpecError, match="unknown codec"):
        fedcomp.build_codec(f"{NAME}()")
    register(Uniform)  # the fixture unregisters again


def test_nothing_leaked_from_other_tests():
    assert NAME not in REGISTRY and "liar-test" not in REGISTRY


def test_registration_refuses_clashes_and_bad_declarations():
    class Clash(Uniform):
        name = "topk"

    with pytest.raises(fedcomp.SpecError, match="already registered"):
        register(Clash)
    assert REGISTRY["topk"] is not Clash

    class BadKnob(Quantizer):
        name = "badknob-test"
        budget_knobs = (Knob("levels", "levels"),)

        @dataclass(frozen=True)
        class Config:
            bits: int = 4

    with pytest.raises(fedcomp.SpecError, match="not a field"):
        register(BadKnob)
    with pytest.raises(fedcomp.SpecError, match="scale"):
        Knob("bits", "logarithmic")
    assert "badknob-test" not in REGISTRY


def test_reloading_a_codec_module_re_registers_it(extra_codec):
    import importlib

    import _extra_codec

    fresh = importlib.reload(_extra_codec).Uniform
    assert fresh is not Uniform
    register(fresh)  # the same module and class name: a reload, not a clash
    assert REGISTRY[NAME] is fresh
    check_contract(f"{NAME}(bits=4)")
