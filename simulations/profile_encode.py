"""Where an encode's time goes on a many-tensor model: torch ops, kernel launches and host copies.

On a GPU a dense quantizer's encode of the ResNet-50 layout (161 tensors) is bound by the host:
each tensor costs a few dozen small torch ops, each one kernel launch, and copies to the host
(the payload is host bytes). This script times ``Codec.encode`` on the ResNet-50-shaped layout and
on one tensor of the same size, and counts with ``torch.profiler`` what the layout's encode
launches: aten ops, CUDA kernel launches, host-device copies and synchronizations (CUDA only),
and the device's own busy time (CUDA kernels' total). The CPU run counts the ops alone (the
fused loops of :mod:`fedcomp.kernels` are one call per run of segments).

    python -m fedcomp.simulations.profile_encode                       # CUDA if present, else CPU
    python -m fedcomp.simulations.profile_encode --device cpu --codecs 'sign()' --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import fedcomp
from fedcomp import kernels
from fedcomp.simulations.bench_codecs import _sync, resnet50_shapes

CODECS = ("none()", "kbit(bits=4)", "qsgd(bits=4)", "sign()", "terngrad()", "topk(ratio=0.001)+qsgd(bits=4)")
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
_COPIES = ("cudaMemcpyAsync", "cudaMemcpy")
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _time(fn, device: torch.device, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def profile(spec: str, tensors: dict[str, torch.Tensor], one: dict[str, torch.Tensor], device: torch.device,
            repeats: int = 3) -> dict:
    """One row: encode seconds (layout, one tensor; best of ``repeats``) and the layout encode's counts."""
    codec = fedcomp.build_codec(spec)
    for x in (tensors, one):
        codec.encode(x, nonce=1, round=1)  # warm-up: lazy initialisation, numba's compile
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        codec.encode(tensors, nonce=1, round=1)
        _sync(device)
    events = prof.key_averages()

    def count(names) -> int:
        return sum(e.count for e in events if e.key in names)
    device_us = sum(e.self_device_time_total for e in events) if device.type == "cuda" else None
    return {
        "codec": spec, "device": str(device), "tensors": len(tensors), "numel": sum(t.numel() for t in tensors.values()),
        "layout_encode_s": _time(lambda: codec.encode(tensors, nonce=1, round=1), device, repeats),
        "one_tensor_encode_s": _time(lambda: codec.encode(one, nonce=1, round=1), device, repeats),
        "aten_ops": sum(e.count for e in events if e.key.startswith("aten::")),
        "kernel_launches": count(_LAUNCHES), "host_copies": count(_COPIES), "syncs": count(_SYNCS),
        "device_busy_s": None if device_us is None else device_us * 1e-6,
        "cpu_kernels": device.type == "cpu" and kernels.for_encode() is not None,  # fused loops (else torch ops)
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--codecs", nargs="+", default=list(CODECS))
    ap.add_argument("--scale", type=float, default=1.0,
                    help="the ResNet-50 layout's shapes with every dimension above 8 scaled by this (tests: 0.1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    shapes = [(n, tuple(d if d <= 8 else max(1, round(d * args.scale)) for d in s)) for n, s in resnet50_shapes()]
    tensors = {n: (torch.randn(s, generator=g) * 0.01).to(device) for n, s in shapes}
    numel = sum(t.numel() for t in tensors.values())
    one = {"w": (torch.randn(numel, generator=g) * 0.01).to(device)}
    if device.type == "cpu" and kernels.mode() != "0":
        kernels.get()  # a server or a warm worker: the encoders' fused loops (FEDCOMP_KERNELS=0: torch ops)
    print(f"torch {torch.__version__}, {device}; ResNet-50 layout x{args.scale:g}: {len(tensors)} tensors, "
          f"{numel:,} elements; best of {args.repeats}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| codec | layout encode | one tensor | aten ops | kernel launches | host copies | syncs | device busy |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for spec in args.codecs:
        r = profile(spec, tensors, one, device, args.repeats)
        rows.append(r)
        busy = "" if r["device_busy_s"] is None else f"{r['device_busy_s'] * 1e3:.1f} ms"
        print(f"| `{spec}` | {r['layout_encode_s'] * 1e3:.1f} ms | {r['one_tensor_encode_s'] * 1e3:.1f} ms | "
              f"{r['aten_ops']} | {r['kernel_launches']} | {r['host_copies']} | {r['syncs']} | {busy} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
