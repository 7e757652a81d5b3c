"""Encode fuzzing: arbitrary updates through every codec, checked against the codec contract.

For each spec and each drawn update (:mod:`fedcomp.simulations.layouts`): encode does not
raise, the payload decodes to exactly what the encoder reported, its size is what
``size_bytes`` promised, the compiled loops and the torch path write the same bytes, and the
server's accumulator averages it to the decoded values.

    python -m fedcomp.simulations.encode_fuzz --updates 10000 --layout quickstart-cnn
    python -m fedcomp.simulations.encode_fuzz --updates 200          # drawn layouts

Prints one line per spec (updates, failures, the first failure's reason) and exits 1 on any
failure. ``tests/test_layouts_property.py`` runs :func:`check_update` under hypothesis.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from contextlib import contextmanager

import torch

import fedcomp
from fedcomp.aggregate import Accumulator
from fedcomp.base import example_specs
from fedcomp.simulations.layouts import FIXED, random_update, values

# every registered stage with its defaults (example_specs), then scopes, index codings, entropy
# coding, the regimes' defaults and a policy
EXTRA_SPECS = (
    "topk(ratio=0.01)+qsgd(bits=4)",
    "topk(ratio=0.01,scope=tensor)+qsgd(bits=4)",
    "topk(ratio=0.05,index=fixed)+kbit(bits=2)",
    "threshold(ratio=0.01,scope=tensor)+fp16()",
    "threshold(tau=0.01,mode=signed)",
    "randomk(ratio=0.05,scope=tensor)",
    "randomk(ratio=0.1,rescale=false)+qsgd(bits=2)",
    "dgc(ratio=0.001,warmup=2)+qsgd(bits=4)",
    "dgc(ratio=0.05,index=fixed,clip=1.0)",
    "sketch(rows=1,cols=0,ratio=0.02)+qsgd(bits=4)",
    "sketch(rows=3,cols=64,ratio=0.1)",
    "powersgd(rank=1,min_compression=0)",
    "kbit(bits=4,stochastic=true,coding=ans)",
    "qsgd(bits=2,bucket=17,coding=ans)",
    "topk(ratio=0.02)+qsgd(bits=4,coding=ans)",
    "sign(block=7)",
    "numel<100: fp16(); topk(ratio=0.01)+qsgd(bits=4)",
)


POOL = 64  # updates drawn per spec for a fixed layout


def all_specs() -> tuple[str, ...]:
    return example_specs() + EXTRA_SPECS


@contextmanager
def kernels(mode: str):
    """``FEDCOMP_KERNELS=mode`` for the block ("1": compiled loops, "0": the torch path)."""
    old = os.environ.get("FEDCOMP_KERNELS")
    os.environ["FEDCOMP_KERNELS"] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ["FEDCOMP_KERNELS"]
        else:
            os.environ["FEDCOMP_KERNELS"] = old


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def check_encode(codec, update: dict[str, torch.Tensor], nonce: int, rnd: int) -> None:
    """Encode only: no exception, and the size ``size_bytes`` promised."""
    enc = codec.encode(update, nonce=nonce, round=rnd, state={})
    layout = fedcomp.Layout.of(update)
    try:
        size = codec.size_bytes(layout, enc.kept, enc.index_bytes, **({"round": rnd} if ";" in codec.spec else {}))
    except ValueError:  # a policy rule whose size depends on the data
        size = len(enc.payload)
    assert size == len(enc.payload), f"{codec.spec}: size_bytes {size} != payload {len(enc.payload)}"


def check_update(spec: str, update: dict[str, torch.Tensor], nonce: int, rnd: int,
                 modes: tuple[str, ...] = ("1", "0"), aggregate: bool = True) -> None:
    """Raise AssertionError (or the encoder's own exception) where ``spec`` breaks the contract
    on ``update``; see the module docstring."""
    codec = fedcomp.build_codec(spec)
    layout = fedcomp.Layout.of(update)
    policy = ";" in spec
    payloads = {}
    for mode in modes:
        where = (f"{spec} (FEDCOMP_KERNELS={mode}, nonce={nonce}, round={rnd}, layout "
                 f"{[(s.name, s.shape, str(s.torch_dtype).removeprefix('torch.')) for s in layout.tensors][:8]})")
        with kernels(mode):
            enc = codec.encode(update, nonce=nonce, round=rnd, state={})
            dec = codec.decode(enc.payload, layout, round=rnd)
        assert list(dec) == list(update) == list(enc.decoded), where
        for name, t in update.items():
            d = dec[name]
            assert d.shape == t.shape and d.dtype == t.dtype, f"{where}: {name} came back {tuple(d.shape)} {d.dtype}"
            assert torch.equal(_bits(d), _bits(enc.decoded[name])), f"{where}: {name}: decode != Encoded.decoded"
            if not t.is_floating_point():
                assert torch.equal(_bits(d), _bits(t)), f"{where}: {name} ({t.dtype}) not exact"
            elif bool(torch.isfinite(t).all()):
                assert bool(torch.isfinite(d).all()), f"{where}: {name} decoded to inf / NaN"
        try:
            size = codec.size_bytes(layout, enc.kept, enc.index_bytes, **({"round": rnd} if policy else {}))
        except ValueError:  # a policy rule whose size depends on the data
            size = len(enc.payload)
        assert size == len(enc.payload), f"{where}: size_bytes {size} != payload {len(enc.payload)}"
        payloads[mode] = enc.payload
        if aggregate and not policy:  # two replies through the server's decode + add: their weighted mean
            with kernels(mode):
                acc = Accumulator(codec, layout)
                acc.add(enc.payload, 3.0, round=rnd)
                acc.add(enc.payload, 1.0, round=rnd)
                mean = acc.mean()
            for s in layout.tensors:
                d, m = dec[s.name], mean[s.name]
                ok = torch.allclose(m.double(), d.double(), rtol=1e-3, atol=1e-30) if s.is_float else torch.equal(m, d)
                assert ok, f"{where}: {s.name}: the accumulator's mean is not the decoded update"
    if len(payloads) == 2:
        assert len(set(payloads.values())) == 1, f"{spec}: the compiled loops and the torch path wrote different bytes"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=200, help="updates per spec")
    ap.add_argument("--layout", choices=sorted(FIXED), help="a fixed model's layout (default: drawn layouts)")
    ap.add_argument("--spec", action="append", help="spec(s) to check (default: every registered codec's)")
    ap.add_argument("--kernels", choices=("both", "1", "0"), default="both")
    ap.add_argument("--no-aggregate", action="store_true", help="skip the accumulator check (faster)")
    ap.add_argument("--encode-only", action="store_true",
                    help="only encode and check the size (as a client does; with --kernels 1 or 0)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    modes = ("1", "0") if args.kernels == "both" else (args.kernels,)
    failed = 0
    t0 = time.perf_counter()
    for spec in args.spec or all_specs():
        rng = random.Random(f"{args.seed}:{spec}")
        codec = fedcomp.build_codec(spec)
        fails, first, pool = 0, "", []
        for i in range(args.updates):
            if args.layout:  # a pool of updates (drawing one costs more than many encodes); every
                # encode still gets its own nonce and round, which seed the codecs' random draws
                if len(pool) < POOL:
                    pool.append({name: values(shape, dtype, "normal", 0.01, rng.randrange(2**31))
                                 for name, (shape, dtype) in FIXED[args.layout].items()})
                update = pool[i % POOL]
            else:
                update = random_update(rng)
            try:
                if args.encode_only:
                    with kernels(modes[0]):
                        check_encode(codec, update, nonce=rng.randrange(2**63), rnd=i % 7)
                else:
                    check_update(spec, update, nonce=rng.randrange(2**63), rnd=i % 4, modes=modes,
                                 aggregate=not args.no_aggregate)
            except Exception as exc:  # noqa: BLE001 (counted and reported)
                fails += 1
                first = first or f"{type(exc).__name__}: {str(exc)[:300]}"
        failed += fails
        print(f"{spec:55s} {args.updates:6d} updates  {fails:4d} failed  {first}", flush=True)
    print(f"{'FAILED' if failed else 'ok'}: {failed} failures, {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
