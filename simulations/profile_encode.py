"""Where an encode's time goes on a many-tensor model: torch ops, kernel launches and host copies.

On a GPU a dense quantizer's encode of the ResNet-50 layout (161 tensors) is bound by the host:
each tensor costs a few dozen small torch ops, each one kernel launch, and copies to the host
(the payload is host bytes). This script times ``Codec.encode`` on the ResNet-50-shaped layout and
on one tensor of the same size, and counts with ``torch.profiler`` what the layout's encode
launches: aten ops, CUDA kernel launches, host-device copies and synchronizations (CUDA only),
and the device's own busy time (CUDA kernels' total). The CPU run counts the ops alone (the
fused loops of :mod:`fedcomp.kernels` are one call per run of segments; ``FEDCOMP_KERNELS=0``:
the torch path a CUDA client runs, op for op).

Whether the counts grow with the number of tensors: the same layout with every tensor cut in two
along its first dimension (twice the tensors, the same elements) is counted too, and the slope
(ops of 2N tensors - ops of N) / N is printed per codec, beside the ops of one tensor of the same
size. On the CPU "sync points" counts the ops that wait for a GPU's results there (``item``,
``nonzero``, a copy to the host...): the syncs a CUDA run would make.

    python -m fedcomp.simulations.profile_encode                       # CUDA if present, else CPU
    FEDCOMP_KERNELS=0 python -m fedcomp.simulations.profile_encode --device cpu --scale 0.25 --repeats 1
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

CODECS = ("none()", "kbit(bits=4)", "qsgd(bits=4)", "sign()", "terngrad()", "topk(ratio=0.001)+qsgd(bits=4)",
          "topk(ratio=0.01)+qsgd(bits=4)", "topk(ratio=0.01)+kbit(bits=4)", "powersgd()", "sketch()", "randomk()",
          "dgc()", "threshold()", "twobit()", "fp16()")
# ops that make a GPU's host wait (a scalar or a data-dependent size read back; a copy to the host)
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal",
            "aten::unique_dim", "aten::_unique2", "aten::masked_select")
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


def split(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor cut in two along its first dimension (one of a single row or 0-d stays whole):
    about twice the tensors, the same elements and kinds of shape."""
    out = {}
    for name, t in tensors.items():
        if t.dim() and t.shape[0] > 1:
            h = t.shape[0] // 2
            out[name + ".a"], out[name + ".b"] = t[:h].clone(), t[h:].clone()
        else:
            out[name] = t
    return out


def counts(codec, tensors: dict[str, torch.Tensor], device: torch.device) -> dict:
    """One encode's aten ops, sync points (:data:`SYNC_OPS`) and, on CUDA, kernel launches,
    host-device copies, synchronizations and the device's busy time (``torch.profiler``).
    Deterministic for a given update and codec (no timing): what the tests bound."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    state: dict = {}
    codec.encode(tensors, nonce=1, round=1, state=state)  # warm-up: lazy initialisation, numba's compile, caches
    with torch.profiler.profile(activities=activities) as prof:
        codec.encode(tensors, nonce=1, round=1, state=state)
        _sync(device)
    events = prof.key_averages()

    def count(names) -> int:
        return sum(e.count for e in events if e.key in names)
    device_us = sum(e.self_device_time_total for e in events) if device.type == "cuda" else None
    return {"aten_ops": sum(e.count for e in events if e.key.startswith("aten::")), "sync_points": count(SYNC_OPS),
            "kernel_launches": count(_LAUNCHES), "host_copies": count(_COPIES), "syncs": count(_SYNCS),
            "device_busy_s": None if device_us is None else device_us * 1e-6}


def profile(spec: str, tensors: dict[str, torch.Tensor], one: dict[str, torch.Tensor], device: torch.device,
            repeats: int = 3, doubled: dict[str, torch.Tensor] | None = None) -> dict:
    """One row: encode seconds (layout, one tensor; best of ``repeats``), the layout encode's
    counts, and with ``doubled`` (:func:`split` of the layout) the counts' slope per tensor."""
    codec = fedcomp.build_codec(spec)
    row = {"codec": spec, "device": str(device), "tensors": len(tensors), "numel": sum(t.numel() for t in tensors.values())}
    row.update(counts(codec, tensors, device))
    row["one_tensor"] = counts(codec, one, device)
    if doubled is not None:
        row["doubled"] = {"tensors": len(doubled), **counts(codec, doubled, device)}
        extra = len(doubled) - len(tensors)
        row["ops_per_tensor"] = (row["doubled"]["aten_ops"] - row["aten_ops"]) / extra
        row["syncs_per_tensor"] = (row["doubled"]["sync_points"] + row["doubled"]["syncs"]
                                   - row["sync_points"] - row["syncs"]) / extra
        row["launches_per_tensor"] = (row["doubled"]["kernel_launches"] - row["kernel_launches"]) / extra
    row.update({
        "layout_encode_s": _time(lambda: codec.encode(tensors, nonce=1, round=1, state={}), device, repeats),
        "one_tensor_encode_s": _time(lambda: codec.encode(one, nonce=1, round=1, state={}), device, repeats),
        "cpu_kernels": device.type == "cpu" and kernels.for_encode() is not None,  # fused loops (else torch ops)
    })
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--codecs", nargs="+", default=list(CODECS))
    ap.add_argument("--scale", type=float, default=1.0,
                    help="the ResNet-50 layout's shapes with every dimension above 8 scaled by this (tests: 0.1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-slope", action="store_true", help="skip the layout of twice the tensors")
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
    print(f"torch {torch.__version__}, {device}, FEDCOMP_KERNELS={kernels.mode()}; "
          f"ResNet-50 layout x{args.scale:g}: {len(tensors)} tensors, "
          f"{numel:,} elements; best of {args.repeats}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    doubled = None if args.no_slope else split(tensors)
    print("| codec | layout encode | one tensor | aten ops (1 / N / 2N tensors) | ops per tensor | sync points "
          "(1 / N / 2N) | kernel launches (N / 2N) | host copies | syncs (N / 2N) | device busy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for spec in args.codecs:
        r = profile(spec, tensors, one, device, args.repeats, doubled)
        rows.append(r)
        busy = "" if r["device_busy_s"] is None else f"{r['device_busy_s'] * 1e3:.1f} ms"
        d = r.get("doubled", {})
        print(f"| `{spec}` | {r['layout_encode_s'] * 1e3:.1f} ms | {r['one_tensor_encode_s'] * 1e3:.1f} ms | "
              f"{r['one_tensor']['aten_ops']} / {r['aten_ops']} / {d.get('aten_ops', '')} | "
              f"{r.get('ops_per_tensor', float('nan')):.1f} | "
              f"{r['one_tensor']['sync_points']} / {r['sync_points']} / {d.get('sync_points', '')} | "
              f"{r['kernel_launches']} / {d.get('kernel_launches', '')} | {r['host_copies']} | "
              f"{r['syncs']} / {d.get('syncs', '')} | {busy} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
