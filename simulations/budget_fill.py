"""How well the byte-budget controller fills budgets: per codec, random budgets on the mlp.

``python -m fedcomp.simulations.budget_fill [--budgets 15]`` prints, per spec, the smallest and largest
whole message (100 B overhead), the worst fill (message / budget) over log-uniform random budgets
between them, and the mean time per fit (fit_update, real encodes where sizes are data-dependent).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import fedcomp
from fedcomp.budget import fit_update, limits
from fedcomp.simulations import task

SPECS = [
    "topk(ratio=0.01)", "topk(ratio=0.01,index='fixed')+qsgd(bits=4)", "topk(ratio=0.01,scope='tensor')+qsgd(bits=4)",
    "randomk(ratio=0.1)", "threshold(ratio=0.01)", "dgc(ratio=0.01)", "kbit(bits=4)", "qsgd(bits=4)",
    "powersgd(rank=2)", "powersgd(rank=2)+kbit(bits=4)", "powersgd(rank=2)+qsgd(bits=4)", "sketch(rows=5,cols=1000)",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budgets", type=int, default=15)
    args = parser.parse_args()
    model = task.build_model("mlp", 0)
    gen = torch.Generator().manual_seed(0)
    update = {k: torch.randn(v.shape, generator=gen) * 0.01 for k, v in model.state_dict().items()}
    layout = fedcomp.Layout.of(update)
    rng = random.Random(0)
    for spec in SPECS:
        lo, hi = limits(spec, layout, overhead=100, measure=lambda c: len(c.encode(update, 1, round=5).payload))
        worst, t0 = 1.0, time.perf_counter()
        for _ in range(args.budgets):
            b = int(lo * (hi / lo) ** rng.random())
            fit = fit_update(spec, update, b, overhead=100, nonce=1, round=5)
            assert fit.message_bytes <= b
            worst = min(worst, fit.fill)
        ms = 1000 * (time.perf_counter() - t0) / args.budgets
        print(f"{spec:48s} {lo:>8d} B .. {hi:>8d} B  worst fill {worst:.4f}  {ms:5.0f} ms/fit")


if __name__ == "__main__":
    main()
