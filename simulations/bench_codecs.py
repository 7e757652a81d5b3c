"""Encoder/decoder speed of every codec, as ratios to one streaming read pass over the same data.

Two layouts (default 25M fp32 elements as one 5000 x 5000 matrix, and a ResNet-50-shaped layout
of 161 tensors, 25.6M elements), one CPU thread by default. For each layout and codec, in one
process, the median of ``--repeats`` timings of

* ``read``: ``x.sum()`` over the same elements (the unit, re-measured beside every row);
* ``encode``: ``Codec.encode(tensors)`` (bytes out; ``Encoded.decoded`` is lazy and not built);
* ``decode``: ``Codec.decode(payload, layout)`` (dense tensors out);
* ``decode+acc``: per reply, :meth:`fedcomp.aggregate.Accumulator.add` of a batch of replies (8,
  the accumulator's default ``batch``: a server adds many per round) and the pass that adds them
  (:meth:`~fedcomp.aggregate.Accumulator.flush`), after one warm-up batch (a round allocates its
  sums once); ``acc x1`` adds one reply alone (``batch=1``).
  Sketches are summed the way the ServerApp does (:class:`fedcomp.server_feedback.ServerFeedback`,
  tables added per reply; its once-a-round heavy-hitter step is timed apart, ``step``).

Peers measured in the same process: ``y.copy_(x)`` (a copy into existing memory), the fp32
update added into a float64 running sum chunk by chunk (the memory traffic any decode + add pays),
``torch.topk(|x|, k)`` alone, a naive top-k + gather + 4-bit pack, and the torch DDP PowerSGD
hook's math for rank 2 (``matmul(M, Q, out=P)``, Gram-Schmidt, ``matmul(M.t(), P, out=Q)``, as
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` writes it). Top-k is also timed on
an update that is 99.9% zeros. A fresh Python process measures ``import fedcomp`` and the first
encode (cold start: Flower starts one ClientApp process per message).

Targets (issue 16): top-k 0.1% + 4-bit encode <= 5x (also 99.9%-zero); dense quantizers and sign
<= 3x; ``none()`` <= 2x; PowerSGD rank 2 <= the hook's math; decode+acc <= 3x.

    python -m fedcomp.simulations.bench_codecs                      # 25M + ResNet-50 layout, 1 thread
    python -m fedcomp.simulations.bench_codecs --quick              # 1M elements, 2 repeats: seconds
    python -m fedcomp.simulations.bench_codecs --sizes 100000 --repeats 2 --json out.json
    python -m fedcomp.simulations.bench_codecs --resnet --sizes 1000000 --dtype bf16   # a bf16 model
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

import fedcomp
from fedcomp.aggregate import Accumulator

# (spec, encode target as a multiple of a read pass, or None where the issue sets none)
CODECS: tuple[tuple[str, float | None], ...] = (
    ("none()", 2.0),
    ("fp16()", 3.0),
    ("bf16()", 3.0),
    ("sign()", 3.0),
    ("sign(scale='rms')", 3.0),
    ("twobit(threshold=0.001)", 3.0),
    ("kbit(bits=8)", 3.0),
    ("kbit(bits=4)", 3.0),
    ("qsgd(bits=4)", 3.0),
    ("kbit(bits=4,stochastic=true)", 3.0),
    ("terngrad()", 3.0),
    ("topk(ratio=0.001)+qsgd(bits=4)", 5.0),
    ("topk(ratio=0.01)+qsgd(bits=4)", None),
    ("topk(ratio=0.001,index='fixed')", None),
    ("threshold(ratio=0.001)", None),
    ("randomk(ratio=0.001)+qsgd(bits=4)", None),
    ("randomk()", None),
    ("topk(ratio=0.001)+qsgd(bits=4,coding='ans')", None),
    ("dgc(ratio=0.001)+qsgd(bits=4)", None),
    ("powersgd(rank=2)", None),  # target: <= the hook's math row
    ("sketch(rows=5,cols=20000,ratio=0.001)", None),
)
QUICK_CODECS = ("none()", "kbit(bits=4)", "sign()", "topk(ratio=0.001)+qsgd(bits=4)", "powersgd(rank=2)")
DECODE_TARGET = 3.0
ZERO_HEAVY = "topk(ratio=0.001)+qsgd(bits=4)"  # also timed on a 99.9%-zero update


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The 161 parameter tensors of torchvision's ResNet-50 (conv, BN weight/bias, fc), in order."""
    shapes = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for li, (width, nblocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(nblocks):
            p = f"layer{li}.{b}."
            convs = [(width, inplanes if b == 0 else 4 * width, 1, 1), (width, width, 3, 3), (4 * width, width, 1, 1)]
            for ci, shape in enumerate(convs, start=1):
                shapes += [(f"{p}conv{ci}.weight", shape), (f"{p}bn{ci}.weight", (shape[0],)), (f"{p}bn{ci}.bias", (shape[0],))]
            if b == 0:
                shapes += [(f"{p}downsample.0.weight", (4 * width, inplanes, 1, 1)),
                           (f"{p}downsample.1.weight", (4 * width,)), (f"{p}downsample.1.bias", (4 * width,))]
            inplanes = 4 * width
    return shapes + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _unit(flat: list[torch.Tensor], repeats: int, device: torch.device) -> float:
    return _median_time(lambda: sum(float(t.sum()) for t in flat), max(repeats, 5), device)


REPLIES = 8  # replies per batch in the decode+acc column (Accumulator's default batch)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # --dtype: the model's


def _adders(codec, layout, device: torch.device, payload: bytes):
    """(add a batch of REPLIES replies, add one reply alone, the once-a-round step or None): the
    path the ServerApp takes for this codec (linear sketches: ServerFeedback's table sum)."""
    if getattr(codec, "reducer", None) is not None and getattr(codec.reducer, "linear", False):
        from fedcomp.server_feedback import ServerFeedback

        fb = ServerFeedback(codec, layout)

        def add_batch():
            for _ in range(REPLIES):
                fb.add(payload, 1.0)

        def step():
            fb.step()
            fb.add(payload, 1.0)  # the next step has a round to take
        return add_batch, lambda: fb.add(payload, 1.0), step
    acc = Accumulator(codec, layout, device=device, batch=REPLIES)
    one = Accumulator(codec, layout, device=device, batch=1)

    def add_batch():
        for _ in range(REPLIES):
            acc.add(payload, 1.0)
        acc.flush()
    return add_batch, lambda: one.add(payload, 1.0), None


def _row(name, layout_name, device, size, read, t_enc, t_dec=None, t_acc=None, target=None, payload=None, kind="codec",
         t_acc1=None):
    row = {"layout": layout_name, "size": size, "device": str(device), "codec": name, "kind": kind, "read_s": read,
           "encode_s": t_enc, "encode_x": t_enc / read, "encode_target_x": target}
    if t_dec is not None:
        row.update(decode_s=t_dec, decode_x=t_dec / read, decode_acc_s=t_acc, decode_acc_x=t_acc / read,
                   decode_acc_target_x=DECODE_TARGET, payload_bytes=payload)
    if t_acc1 is not None:
        row.update(decode_acc1_s=t_acc1, decode_acc1_x=t_acc1 / read)
    return row


def _print(row: dict) -> None:
    target = row["encode_target_x"]
    mark = "" if target is None else ("ok" if row["encode_x"] <= target else f"MISSES {target:g}x")
    dec = (f"{row['decode_x']:8.1f}x | {row['decode_acc_x']:8.1f}x{'' if row['decode_acc_x'] <= DECODE_TARGET else '*'}"
           if "decode_x" in row else f"{'':>9} | {'':>10}")
    one = f"{row['decode_acc1_x']:6.1f}x" if "decode_acc1_x" in row else f"{'':7}"
    print(f"| {row['codec']:44s} | {row['encode_x']:7.1f}x | {dec:22s} | {one} | {row['encode_s'] * 1e3:10.1f} ms | "
          f"{mark:11s} |", flush=True)


def _hook_math(m: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> None:
    """torch's powerSGD_hook, rank-r math for one matrix: P = M Q, orthogonalize P, Q = M^T P."""
    torch.matmul(m, q, out=p)
    for i in range(p.shape[1]):  # torch's _orthogonalize_gram_schmidt
        col = p[:, i:i + 1]
        col.div_(torch.linalg.vector_norm(col) + 1e-8)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest.sub_(torch.sum(col * rest, dim=0) * col)
    torch.matmul(m.t(), p, out=q)


def _naive_topk_4bit(x: torch.Tensor, k: int) -> torch.Tensor:
    idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    v = x[idx]
    scale = v.abs().max()
    q = torch.clamp(torch.round(v / scale * 7) + 8, 0, 15).to(torch.uint8)
    q = torch.cat([q, q.new_zeros(k % 2)]).view(-1, 2)
    return (q[:, 0] << 4) | q[:, 1]


def peers(layout_name: str, x: torch.Tensor, device: torch.device, repeats: int) -> list[dict]:
    """Rows for the operations the issue compares against, on the 1-D view of x."""
    flat = x.reshape(-1)
    n, k = flat.numel(), max(1, math.ceil(flat.numel() * 0.001))
    y = torch.empty_like(flat)
    side = math.isqrt(n)
    m = flat[: side * side].view(side, side)
    g = torch.Generator().manual_seed(0)
    q0 = torch.randn(side, 2, generator=g).to(device)
    p = torch.empty(side, 2, device=device)
    total = torch.zeros(n, dtype=torch.float64, device=device)  # a server's float64 running sum

    def add_into_sum():  # the floor of any decode + add into it: read x, read and write the sum
        for i in range(0, n, 1 << 20):
            total[i:i + (1 << 20)].add_(flat[i:i + (1 << 20)])
    rows = []
    to_host = (("peer: x.cpu() (device to host: what a dense GPU encode must move)", lambda: flat.cpu()),) \
        if device.type == "cuda" else ()
    for name, fn in to_host + (
        ("peer: y.copy_(x)", lambda: y.copy_(flat)),
        ("peer: float64 sum += x (1M-element chunks)", add_into_sum),
        ("peer: torch.topk(|x|, k=0.1%) alone", lambda: torch.topk(flat.abs(), k, sorted=False)),
        ("peer: naive topk 0.1% + gather + 4-bit pack", lambda: _naive_topk_4bit(flat, k)),
        ("peer: torch PowerSGD hook math, rank 2", lambda: _hook_math(m, q0.clone(), p)),
    ):
        fn()
        read = _unit([flat], repeats, device)
        rows.append(_row(name, layout_name, device, n, read, _median_time(fn, repeats, device), kind="peer"))
        _print(rows[-1])
    return rows


def bench_layout(layout_name: str, tensors: dict[str, torch.Tensor], device: torch.device, repeats: int,
                 codecs=CODECS) -> list[dict]:
    layout = fedcomp.Layout.of(tensors)
    flat = [t.reshape(-1).float() for t in tensors.values()]  # the unit: a read pass of fp32 values
    size = layout.numel
    rows = []
    for spec, target in codecs:
        codec = fedcomp.build_codec(spec)
        enc = codec.encode(tensors, nonce=1, round=1)  # warm-up (and lazy initialisation)
        codec.decode(enc.payload, layout, device)
        add_batch, add_one, step = _adders(codec, layout, device, enc.payload)
        add_one()
        add_batch()  # warm-up: the sums are allocated once a round, not per reply
        read = _unit(flat, repeats, device)  # the unit beside every codec: the machine's load drifts
        t_enc = _median_time(lambda: codec.encode(tensors, nonce=1, round=1), repeats, device)
        t_dec = _median_time(lambda: codec.decode(enc.payload, layout, device), repeats, device)
        t_acc = _median_time(add_batch, repeats, device) / REPLIES
        t_acc1 = _median_time(add_one, repeats, device)
        read = min(read, _unit(flat, repeats, device))
        rows.append(_row(spec, layout_name, device, size, read, t_enc, t_dec, t_acc, target, len(enc.payload),
                         t_acc1=t_acc1))
        if step is not None:
            t_step = _median_time(step, repeats, device)
            rows[-1].update(round_step_s=t_step, round_step_x=t_step / read)
            print(f"|   {spec}: once a round, ServerFeedback.step (unsketch + top-k) {t_step / read:.1f}x")
        _print(rows[-1])
        if spec == ZERO_HEAVY:
            g = torch.Generator().manual_seed(1)
            sparse = {n: torch.where(torch.rand(t.shape, generator=g).to(device) < 0.001, t * 100, torch.zeros_like(t))
                      for n, t in tensors.items()}
            codec.encode(sparse, nonce=1)
            read = _unit(flat, repeats, device)
            t_enc = _median_time(lambda: codec.encode(sparse, nonce=1, round=1), repeats, device)
            zero = _row(spec + " on 99.9% zeros", layout_name, device, size, read, t_enc, target=target)
            rows[-1].update(zero_heavy_encode_s=t_enc, zero_heavy_encode_x=zero["encode_x"])
            _print(zero)
    return rows


def cold_start(spec: str = "topk(ratio=0.01)+qsgd(bits=4)", kernels: str = "auto") -> dict:
    """Seconds for ``import torch``, ``import fedcomp`` and the first encode of a 1M-element
    update, in a fresh Python process (the same fedcomp as this one), with ``FEDCOMP_KERNELS``
    set to ``kernels`` ("1": the encode loads numba's kernels, as a client forced to would)."""
    code = (
        "import time, json; t0 = time.perf_counter(); import torch; t1 = time.perf_counter();"
        "import fedcomp; t2 = time.perf_counter();"
        f"c = fedcomp.build_codec({spec!r}); x = {{'w': torch.randn(1000, 1000)}};"
        "e = fedcomp.compress(c, x)[0]; t3 = time.perf_counter();"
        "print(json.dumps({'import_torch_s': t1 - t0, 'import_fedcomp_s': t2 - t1, 'first_encode_s': t3 - t2}))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(fedcomp.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
               FEDCOMP_KERNELS=kernels)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["spec"] = spec
    result["kernels"] = kernels
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=int,
                    help="square-matrix layouts of about this many elements (default: 25M and the ResNet-50 layout)")
    ap.add_argument("--resnet", action="store_true", help="add the ResNet-50-shaped layout to --sizes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--codecs", nargs="+", help="specs to run (default: the built-in list)")
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--cuda-only", action="store_true", help="only the CUDA rows (an error without a CUDA device)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--peers", action="store_true", help="time the peers even with --codecs (default: without)")
    ap.add_argument("--cold", action="store_true", help="measure the cold start even with --codecs (default: without)")
    ap.add_argument("--quick", action="store_true", help="1M elements, a few codecs, 2 repeats, no ResNet layout")
    ap.add_argument("--json", help="write the codec rows here (peers and cold start under their own keys)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                    help="the model's dtype (fp16 / bf16: the server rounds each value to it; the unit stays an "
                         "fp32 read pass of the same elements)")
    ap.add_argument("--kernels", choices=("auto", "0", "1"), default=None,
                    help="FEDCOMP_KERNELS for this run: fused numba loops auto (default), off, or forced on")
    args = ap.parse_args(argv)
    resnet = args.resnet or args.sizes is None
    with_peers = args.peers or not args.codecs
    with_cold = args.cold or not args.codecs
    if args.quick:
        args.sizes, args.repeats, resnet = args.sizes or [1_000_000], 2, args.resnet
        args.codecs = args.codecs or list(QUICK_CODECS)
    args.sizes = args.sizes or [25_000_000]
    codecs = CODECS if not args.codecs else tuple((s, dict(CODECS).get(s)) for s in args.codecs)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernels is not None:
        os.environ["FEDCOMP_KERNELS"] = args.kernels
    from fedcomp import kernels

    loaded = kernels.get() is not None  # the server path's kernels; encodes use them once loaded
    if args.cuda_only and (args.cpu_only or not torch.cuda.is_available()):
        ap.error("--cuda-only needs a CUDA device torch can see, and excludes --cpu-only")
    devices = [] if args.cuda_only else [torch.device("cpu")]
    if torch.cuda.is_available() and not args.cpu_only:
        devices.append(torch.device("cuda"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); medians of {args.repeats} runs; "
          f"load average {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"fused kernels (numba) {'on' if loaded else 'off'} (FEDCOMP_KERNELS={kernels.mode()})")
    rows: list[dict] = []
    peer_rows: list[dict] = []
    dtype = DTYPES[args.dtype]
    for device in devices:
        layouts = []
        for size in args.sizes:
            side = int(math.isqrt(size))
            g = torch.Generator().manual_seed(0)
            layouts.append((f"{side * side:,} {args.dtype} ({side} x {side})",
                            {"w": (torch.randn(side, side, generator=g) * 0.01).to(device, dtype)}))
        if resnet:
            g = torch.Generator().manual_seed(0)
            layouts.append((f"ResNet-50 layout (161 tensors{'' if args.dtype == 'fp32' else ', ' + args.dtype})",
                            {n: (torch.randn(s, generator=g) * 0.01).to(device, dtype) for n, s in resnet50_shapes()}))
        for name, tensors in layouts:
            print(f"\n== {device} | {name} | unit: one read pass x.sum() ==")
            print(f"| {'operation':44s} |   encode |    decode | decode+acc | acc x1  |   encode time | target      |")
            print(f"|{'-' * 46}|---------:|----------:|-----------:|--------:|--------------:|-------------|")
            if with_peers:
                peer_rows += peers(name, torch.cat([t.reshape(-1).float() for t in tensors.values()]), device, args.repeats)
            rows += bench_layout(name, tensors, device, args.repeats, codecs)
    cold = None
    if with_cold:
        cold = cold_start()
        forced = cold_start("kbit(bits=4)", kernels="1")  # a dense encode: the kernels load
        print(f"\ncold start (fresh process): import torch {cold['import_torch_s']:.2f} s, import fedcomp "
              f"{cold['import_fedcomp_s']:.3f} s, first compress() of 1M elements {cold['first_encode_s']:.3f} s "
              f"({cold['spec']}); kbit(bits=4) with FEDCOMP_KERNELS=1, which loads numba's kernels: "
              f"{forced['first_encode_s']:.3f} s")
        cold["first_encode_kernels_s"] = forced["first_encode_s"]
    if args.json:
        extra = {"peers": peer_rows, "cold_start": cold}
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.splitext(args.json)[0] + ".extra.json", "w") as f:
            json.dump(extra, f, indent=1)


if __name__ == "__main__":
    main()
