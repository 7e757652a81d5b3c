"""Server working memory of `fedcomp.aggregate.Accumulator`, measured apart from `bench_server`.

For each codec the parent encodes N *distinct* client updates of a synthetic model (random normal,
``bench_server.model_shapes``; 10M parameters by default) and writes them to a file; for each
(codec, N, malloc setting) a fresh child process reads the N payloads, warms the compiled loops (one
small decode + add of the same codec), then measures a round the way a server runs it: per reply
``Accumulator.decode`` -> ``Update.norm`` -> ``Accumulator.add_update``, then
``Accumulator.apply_mean(reference)`` (what ``CompressedStrategy`` runs; ``--finish mean``: ``mean()``,
the float64 sums kept; ``release``: ``mean(release=True)``). Reported, in dense fp32 model copies:

* ``rss``: peak resident memory during the round (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``) minus the resident memory before it (payloads, reference and
  compiled loops already held);
* ``traced``: tracemalloc's peak of what numpy and Python allocated during the round (torch's own
  allocations are not traced: a lower bound on live memory, without the allocator's retention);
* ``rss`` includes what the C allocator keeps mapped after a free, ``traced`` does not.

``--malloc default`` runs the child with glibc's defaults (what a ServerApp process gets);
``--malloc bench`` with the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` settings of
``bench_server``'s children (large blocks straight from and back to the kernel), so the two
benchmarks' figures can be compared case by case.

    python -m fedcomp.simulations.bench_memory                                  # 10M, 50 and 200 replies
    python -m fedcomp.simulations.bench_memory --codecs 'kbit(bits=4)' --replies 50 200 --malloc default bench
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

from fedcomp.simulations.bench_server import _make_update, _reset_peak, _rss_kb, model_shapes

DEFAULT_CODECS = ("topk(ratio=0.01)+qsgd(bits=4)", "kbit(bits=4)")
MALLOC = {
    "default": {},
    "bench": {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"},
}


def child(path: str, spec: str, params: int, threads: int, finish: str = "apply_mean") -> dict:
    """A fresh process: one round of Accumulator over the payloads in ``path``."""
    import gc
    import time
    import tracemalloc

    import torch

    import fedcomp
    from fedcomp import kernels
    from fedcomp.aggregate import Accumulator

    torch.set_num_threads(max(1, threads))
    payloads = []
    with open(path, "rb") as f:
        while head := f.read(4):
            (n,) = struct.unpack("<I", head)
            payloads.append(f.read(n))
    shapes = model_shapes(params)
    reference = _make_update(shapes, 0)
    layout = fedcomp.Layout.of(reference)
    codec = fedcomp.build_codec(spec)
    kernels.get()
    small = {"w": torch.randn(4096)}
    warm = Accumulator(codec, fedcomp.Layout.of(small))
    for i in range(2):  # the compiled loops of this codec's decode, norm, add and mean
        u = warm.decode(codec.encode(small, nonce=1 + i, round=1).payload)
        u.norm()
        warm.add_update(u, 1.0)
    warm.apply_mean(small)
    del warm, u
    gc.collect()
    rss_before = _rss_kb("VmRSS")
    exact = _reset_peak()
    tracemalloc.start()
    t0 = time.perf_counter()
    acc = Accumulator(codec, layout)
    for i, p in enumerate(payloads):
        u = acc.decode(p, round=1)
        u.norm()
        acc.add_update(u, float(1 + i % 3))
        del u
    out = (acc.apply_mean(reference) if finish == "apply_mean" else acc.mean(release=True) if finish == "release"
           else acc.mean())
    elapsed = time.perf_counter() - t0
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    peak = _rss_kb("VmHWM") if exact else 0
    dense = layout.dense_bytes()
    if not all(bool(torch.isfinite(t.float()).all()) for t in out.values()):
        raise RuntimeError("mean is not finite")
    return {"codec": spec, "replies": len(payloads), "params": layout.numel, "dense_bytes": dense,
            "payload_bytes": sum(len(p) for p in payloads), "rss_above_base_bytes": (peak - rss_before) * 1024,
            "rss_dense_copies": (peak - rss_before) * 1024 / dense if exact else None,
            "traced_bytes": traced, "traced_dense_copies": traced / dense, "seconds": elapsed, "finish": finish,
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}


def run(codecs, replies, params, mallocs, threads, finishes=("apply_mean",), cache: str | None = None) -> list[dict]:
    import torch  # noqa: F401

    import fedcomp

    shapes = model_shapes(params)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        for spec in codecs:
            codec = fedcomp.build_codec(spec)
            most = max(replies)
            name = f"{''.join(c if c.isalnum() else '_' for c in spec)}_{params}_{most}.bin"
            path_all = os.path.join(cache or tmp, name)
            if not os.path.exists(path_all):
                with open(path_all + ".part", "wb") as f:  # distinct updates: no two replies share a payload
                    for i in range(most):
                        p = codec.encode(_make_update(shapes, 1000 + i), nonce=i + 1, round=1).payload
                        f.write(struct.pack("<I", len(p)) + p)
                os.replace(path_all + ".part", path_all)
            for n in sorted(set(replies)):
                path = os.path.join(tmp, f"p{n}.bin")
                with open(path_all, "rb") as src, open(path, "wb") as dst:
                    for _ in range(n):
                        (size,) = struct.unpack("<I", src.read(4))
                        dst.write(struct.pack("<I", size) + src.read(size))
                for mode, finish in [(m, f) for m in mallocs for f in finishes]:
                    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
                    env.update(MALLOC[mode])
                    out = subprocess.run([sys.executable, "-m", "fedcomp.simulations.bench_memory", "--child", path,
                                          "--spec", spec, "--params", str(params), "--threads", str(threads),
                                          "--finish", finish],
                                         capture_output=True, text=True, env=env, check=False)
                    if out.returncode != 0:
                        raise RuntimeError(f"child {spec} x {n} ({mode}) failed:\n{out.stderr[-3000:]}")
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                    row["malloc"] = mode
                    rows.append(row)
                    print(f"{spec:32s} replies {n:4d} malloc {mode:7s} {finish:10s} | rss {row['rss_dense_copies']:5.2f} dense copies"
                          f" | traced (numpy, Python) {row['traced_dense_copies']:5.2f} | payloads "
                          f"{row['payload_bytes'] / 1e6:7.1f} MB | {row['seconds']:.1f} s", flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", nargs="+", default=list(DEFAULT_CODECS))
    ap.add_argument("--replies", nargs="+", type=int, default=[50, 200])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--malloc", nargs="+", choices=sorted(MALLOC), default=["default", "bench"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--finish", nargs="+", choices=["apply_mean", "mean", "release"], default=["apply_mean", "mean"],
                    help="how the round ends: apply_mean(reference) (what CompressedStrategy runs), mean() (the sums "
                         "kept), or mean(release=True)")
    ap.add_argument("--cache", help="keep the encoded payloads in this folder (reused by later runs)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.spec, args.params, args.threads, args.finish[0])))
        return
    rows = run(args.codecs, args.replies, args.params, args.malloc, args.threads, args.finish, args.cache)
    worst = max(r["rss_dense_copies"] for r in rows)
    print(f"worst working memory (rss): {worst:.2f} dense copies (target <= 3): {'met' if worst <= 3 else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
