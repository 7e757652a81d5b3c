"""Server-scale benchmark: decode + aggregate N client replies of a 10M-parameter model.

For each codec the parent process encodes a few distinct client updates of a synthetic
10M-parameter model (random normal, fp32, four weight matrices, biases and an int64 counter)
and writes N replies (copies cycling over them) to a file. For each N a fresh child process
reads the N payloads into memory (as a server holds the messages it received), resets the
kernel's peak-RSS mark (``/proc/self/clear_refs``), streams every payload through
:class:`fedcomp.aggregate.Accumulator` and takes the weighted mean, then reports:

* peak RSS during aggregation above the RSS before the payloads were read, minus the payloads'
  own bytes, in dense model copies (target: <= 3, flat in N);
* seconds per client.

With ``--naive`` it also runs decode-all-then-average (every dense update held until the end)
for the smallest N, for contrast.

    python -m fedcomp.simulations.bench_server                       # 50/100/200 clients, 10M parameters
    python -m fedcomp.simulations.bench_server --params 200000 --clients 4 8 --json out.json   # tiny
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import struct
import subprocess
import sys
import tempfile
import time

DEFAULT_CODECS = (
    "topk(ratio=0.01)+qsgd(bits=4)",
    "dgc(ratio=0.001)+qsgd(bits=4)",
    "kbit(bits=4)",
    "powersgd(rank=2)",
)


def model_shapes(params: int) -> dict[str, tuple[int, ...]]:
    """Four weight matrices and their biases, about ``params`` parameters in all."""
    # widths h, h, h/2: h*h*... chosen so that 2h^2 + h^2/2 + h^2/4 ~ params
    h = max(8, int(math.sqrt(params / 2.75)))
    shapes = {
        "l1.weight": (h, h), "l1.bias": (h,),
        "l2.weight": (h, h), "l2.bias": (h,),
        "l3.weight": (h // 2, h), "l3.bias": (h // 2,),
        "l4.weight": (h // 4, h), "l4.bias": (h // 4,),
    }
    return shapes


def _make_update(shapes, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {name: torch.randn(shape, generator=g) * (0.01 if name.endswith("weight") else 0.001)
           for name, shape in shapes.items()}
    out["steps"] = torch.tensor([seed], dtype=torch.int64)
    return out


def _rss_kb(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read())
    return int(m.group(1)) if m else 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux)
        return True
    except OSError:
        return False


def child(path: str, spec: str, params: int, naive: bool) -> dict:
    """Runs in a fresh process: read the payloads, then aggregate them and measure."""
    import gc

    import torch

    import fedcomp
    from fedcomp.aggregate import Accumulator

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    shapes = model_shapes(params)
    layout = fedcomp.Layout.of(_make_update(shapes, 0))
    codec = fedcomp.build_codec(spec)
    gc.collect()
    rss_before = _rss_kb("VmRSS")
    payloads = []
    with open(path, "rb") as f:
        while head := f.read(4):
            (n,) = struct.unpack("<I", head)
            payloads.append(f.read(n))
    payload_bytes = sum(len(p) for p in payloads)
    gc.collect()
    exact_peak = _reset_peak()
    t0 = time.perf_counter()
    if naive:  # decode everything, then average (what a non-streaming server does)
        decoded = [codec.decode(p, layout) for p in payloads]
        mean = {n: sum(d[n].float() for d in decoded) / len(decoded) for n in layout.names}
    else:
        acc = Accumulator(codec, layout)
        for i, p in enumerate(payloads):
            acc.add(p, 1.0 + (i % 3))
        mean = acc.mean()
    elapsed = time.perf_counter() - t0
    peak = _rss_kb("VmHWM") if exact_peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dense = layout.dense_bytes()
    extra = peak * 1024 - rss_before * 1024 - payload_bytes
    assert all(bool(torch.isfinite(t.float()).all()) for t in mean.values())
    return {
        "codec": spec, "clients": len(payloads), "naive": naive, "params": layout.numel,
        "dense_bytes": dense, "payload_bytes": payload_bytes,
        "peak_above_base_bytes": peak * 1024 - rss_before * 1024,
        "working_bytes": extra, "working_dense_copies": extra / dense,
        "seconds": elapsed, "seconds_per_client": elapsed / len(payloads), "exact_peak": exact_peak,
    }


def run(codecs, clients, params, distinct, naive) -> list[dict]:
    import torch

    import fedcomp

    shapes = model_shapes(params)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_server_") as tmp:
        for spec in codecs:
            codec = fedcomp.build_codec(spec)
            base = []
            for i in range(distinct):
                enc = codec.encode(_make_update(shapes, i + 1), nonce=i + 1, round=5, state={})
                base.append(enc.payload)
            counts = sorted(set(clients))
            runs = [(n, False) for n in counts] + ([(counts[0], True)] if naive else [])
            for n, is_naive in runs:
                path = os.path.join(tmp, f"payloads_{n}.bin")
                with open(path, "wb") as f:
                    for i in range(n):
                        p = base[i % len(base)]
                        f.write(struct.pack("<I", len(p)) + p)
                out = subprocess.run(
                    [sys.executable, "-m", "fedcomp.simulations.bench_server", "--child", path, "--spec", spec,
                     "--params", str(params)] + (["--naive"] if is_naive else []),
                    capture_output=True, text=True, check=False,
                )
                if out.returncode != 0:
                    raise RuntimeError(f"child for {spec} x {n} failed:\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{spec:34s} {'naive' if is_naive else 'stream':6s} clients {n:4d} | payloads "
                      f"{row['payload_bytes'] / 1e6:8.1f} MB | working memory {row['working_bytes'] / 1e6:8.1f} MB = "
                      f"{row['working_dense_copies']:5.2f} dense copies | {row['seconds_per_client'] * 1e3:7.1f} ms/client",
                      flush=True)
        del torch
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", nargs="+", default=list(DEFAULT_CODECS))
    ap.add_argument("--clients", nargs="+", type=int, default=[50, 100, 200])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--distinct", type=int, default=4, help="distinct client updates encoded (replies cycle over them)")
    ap.add_argument("--naive", action="store_true", help="also run decode-all-then-average at the smallest N")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.spec, args.params, args.naive)))
        return
    shapes = model_shapes(args.params)
    total = sum(math.prod(s) for s in shapes.values()) + 1
    print(f"model: {total:,} parameters ({total * 4 / 1e6:.1f} MB dense fp32); target: working memory <= 3 dense "
          f"copies besides the payloads, flat in the number of clients", flush=True)
    rows = run(args.codecs, args.clients, args.params, args.distinct, args.naive)
    worst = max(r["working_dense_copies"] for r in rows if not r["naive"])
    print(f"worst streaming working memory: {worst:.2f} dense copies (target <= 3): {'met' if worst <= 3 else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
