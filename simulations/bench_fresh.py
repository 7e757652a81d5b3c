"""Fresh memory around the codecs: the client's and the server's steps that allocate large tensors.

A buffer of 32 MB or more (``fedcomp.wire.MMAPPED``) is mapped afresh by malloc every time, and
each of its 4 kB pages faults on first touch; ``fedcomp.wire`` gives such buffers from numpy in
huge pages (``host_empty``, ``output_like``) or from calloc (``host_zeros``). This script times
each step both ways in one process, alternating, as multiples of one read pass ``x.sum()`` of the
update (medians; 1 thread), with the old way restored by raising the threshold out of reach:

* ``decode``: ``Codec.decode`` of one payload (a client applying a compressed download, the
  server re-reading its own broadcast);
* ``apply``: ``apply_step`` of an fp32 step, and of a float64 mean (the server's new model);
* ``round``: a server round, 10 replies added and ``apply_mean`` (its float64 sums are allocated
  at the first reply), per reply;
* ``client``: trained - received, then the error-feedback encode (update + residual, the new
  residual), per update.

    python -m fedcomp.simulations.bench_fresh                       # 25M elements, one tensor
    python -m fedcomp.simulations.bench_fresh --n 1000000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager

import torch

import fedcomp
from fedcomp import kernels, wire
from fedcomp.aggregate import Accumulator, apply_step
from fedcomp.feedback import compress

DECODE = ("none()", "fp16()", "kbit(bits=4)", "sign()", "topk(ratio=0.01)+qsgd(bits=4)", "randomk()")
ROUND = ("kbit(bits=4)", "topk(ratio=0.01)+qsgd(bits=4)")
CLIENT = ("kbit(bits=4)", "topk(ratio=0.01)+qsgd(bits=4)")


@contextmanager
def fresh(on: bool):
    """The fresh-buffer helpers on (as shipped) or off (every buffer from torch, as before)."""
    saved = wire.MMAPPED
    limit = saved if on else 1 << 62
    holders = _holders()
    for module in holders:
        module.MMAPPED = limit
    try:
        yield
    finally:
        for module in holders:
            module.MMAPPED = saved


def _holders() -> list:
    """The fedcomp modules that read the threshold (``wire.MMAPPED`` and its imported copies)."""
    return [m for name, m in list(sys.modules.items())
            if name.startswith("fedcomp") and m is not None and isinstance(getattr(m, "MMAPPED", None), int)]


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pair(name: str, fn, read: float, repeats: int, per: int = 1) -> dict:
    """``fn`` timed off and on, alternating, in read passes (divided by ``per``)."""
    off, on = [], []
    for _ in range(repeats):
        for flag, out in ((False, off), (True, on)):
            with fresh(flag):
                fn()  # the allocator's state after a call of its own kind
                out.append(_median(fn, 1) / per / read)
    row = {"step": name, "torch_x": statistics.median(off), "fresh_x": statistics.median(on)}
    print(f"| {name:52s} | {row['torch_x']:8.1f}x | {row['fresh_x']:8.1f}x |", flush=True)
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=25_000_000, help="elements of the update (one fp32 tensor)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kernels.get()  # the server's compiled loops, as a ServerApp has them
    g = torch.Generator().manual_seed(0)
    x = {"w": torch.randn(args.n, generator=g)}
    layout = fedcomp.Layout.of(x)
    read = min(_median(lambda: float(x["w"].sum()), 7) for _ in range(2))
    print(f"torch {torch.__version__}, 1 thread, {args.n:,} fp32 elements, medians of {args.repeats} alternating "
          f"pairs; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; unit: one read pass x.sum()")
    print(f"| {'step':52s} | {'torch':>9s} | {'fresh':>9s} |\n|{'-' * 54}|{'-' * 11}|{'-' * 11}|")
    rows = []
    for spec in DECODE:
        codec = fedcomp.build_codec(spec)
        payload = codec.encode(x, nonce=1).payload
        rows.append(_pair(f"decode {spec}", lambda: codec.decode(payload, layout), read, args.repeats))
    step32 = {"w": torch.randn(args.n, generator=g)}
    step64 = {"w": torch.randn(args.n, generator=g, dtype=torch.float64)}
    rows.append(_pair("apply_step, fp32 step", lambda: apply_step(x, step32), read, args.repeats))
    rows.append(_pair("apply_step, float64 mean", lambda: apply_step(x, step64), read, args.repeats))
    for spec in ROUND:
        codec = fedcomp.build_codec(spec)
        payloads = [codec.encode(x, nonce=i).payload for i in range(10)]
        acc = Accumulator(codec, layout)

        def server_round():
            for p in payloads:
                acc.add(p, 1.0)
            acc.apply_mean(x)
            acc.reset()
        rows.append(_pair(f"round of 10 replies + apply_mean, {spec}", server_round, read, args.repeats, per=10))
    received = {"w": torch.randn(args.n, generator=g)}
    residual = {"w": torch.randn(args.n, generator=g) * 0.1}
    for spec in CLIENT:
        codec = fedcomp.build_codec(spec)

        def client():
            delta = {"w": torch.sub(x["w"], received["w"], out=wire.output_like(x["w"]))}
            compress(codec, delta, residual, nonce=1)
        rows.append(_pair(f"client delta + error-feedback encode, {spec}", client, read, args.repeats))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, "read_s": read, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
