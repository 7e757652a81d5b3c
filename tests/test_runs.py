"""Every segment of an update in one compiled call (``quantizers.write_run``): the bytes of the
one-by-one writes, on layouts of many small tensors and a few large ones (written in steps),
with segments the kernels refuse (not finite, all zeros) written the one-by-one way in place."""

from __future__ import annotations

import pytest
import torch

import fedcomp
from fedcomp import codec as codec_module, kernels, quantizers

pytestmark = pytest.mark.skipif(kernels.get() is None, reason="numba not installed")

SPECS = ["kbit(bits=4)", "kbit(bits=8)", "kbit(bits=3,block=100)", "kbit(bits=2,block=0)",
         "kbit(bits=5,stochastic=true)", "kbit(bits=4,block=33,stochastic=true)", "qsgd(bits=4)", "qsgd(bits=8,bucket=0)",
         "qsgd(bits=3,bucket=100)", "sign()", "sign(block=100)", "sign(scale='rms')", "sign(block=3000,scale='rms')",
         "twobit(threshold=0.5)", "fp16()", "bf16()", "none()"]


def _update(special: str = "") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    t = {f"bn{i}.weight": torch.randn(n, generator=g) for i, n in enumerate([64, 3, 1, 257, 9])}
    t["conv.weight"] = torch.randn(16, 3, 7, 7, generator=g)
    t["big"] = torch.randn(5003, generator=g)  # several steps (the test sets 1000 elements a step)
    t["huge"] = torch.randn(70000, generator=g) * 1e3  # several parts of a sign scale; beyond fp16's range
    t["half"] = torch.randn(40, generator=g).half()
    t["steps"] = torch.tensor(11)
    t["zeros"] = torch.zeros(70)
    if special == "inf":
        t["conv.weight"][1, 2, 3, 4] = float("inf")
    if special == "nan":
        t["big"][4000] = float("nan")  # in a later step
    return t


@pytest.mark.parametrize("special", ["", "inf", "nan"])
@pytest.mark.parametrize("spec", SPECS)
def test_a_run_writes_the_bytes_of_one_by_one_writes(spec, special, monkeypatch):
    monkeypatch.setattr(quantizers, "_ENCODE_CHUNK", 1000)
    monkeypatch.setenv("FEDCOMP_KERNELS", "1")
    codec, update = fedcomp.build_codec(spec), _update(special)
    calls = []
    real = quantizers.write_run
    monkeypatch.setattr(codec_module, "write_run", lambda *a: calls.append(len(a[1])) or real(*a))
    run = codec.encode(update, nonce=9, round=2).payload
    assert calls == [len(update) - 1]  # every float tensor in one call
    monkeypatch.setattr(codec_module, "runs", lambda q, k: False)
    assert codec.encode(update, nonce=9, round=2).payload == run
    monkeypatch.setenv("FEDCOMP_KERNELS", "0")  # the torch path: the same bytes again
    assert codec.encode(update, nonce=9, round=2).payload == run
