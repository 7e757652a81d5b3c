"""Server-scale benchmark: the ServerApp's aggregation of N replies of a 10M-parameter model.

For each codec the parent process encodes a few distinct client updates of a synthetic
10M-parameter model (random normal, fp32, four weight matrices, biases and an int64 counter)
and writes N replies (copies cycling over them) to a file. For each N a fresh child process
runs round 1 of :class:`fedcomp.strategies.CompressedStrategy` around FedAvg (what the
project's ServerApp runs): ``configure_train`` broadcasts to N nodes, the N replies are built
as real Flower Messages answering them (the records ``compression_mod`` sends, payloads held in
memory as a server holds the messages it received), the kernel's peak-RSS mark is reset
(``/proc/self/clear_refs``), and ``aggregate_train`` counts, checks (weights, replay, norm
guard), decodes and adds every reply (:mod:`fedcomp.aggregate`; FetchSGD for the sketch) and
returns the new model. Reported:

* working memory: peak RSS during ``aggregate_train`` above the RSS before it (payloads, the
  strategy's model and broadcast reference already held), in dense model copies (target:
  <= 3, flat in N);
* seconds per client.

With ``--naive`` it also runs decode-all-then-average (every dense update held until the end)
for the smallest N, for contrast.

    python -m fedcomp.simulations.bench_server                       # 50/100/200 clients, 10M parameters
    python -m fedcomp.simulations.bench_server --params 200000 --clients 4 8 --json out.json   # tiny
    python -m fedcomp.simulations.bench_server --quick                  # seconds: what tests/test_bench.py runs
    python -m fedcomp.simulations.bench_server --codecs 'kbit(bits=4)' --clients 50 200 --threads 1 --json kbit.json
    python -m fedcomp.simulations.bench_server --table topk.json kbit.json ...   # the README table from saved rows
    python -m fedcomp.simulations.bench_server --fetchsgd --params 25000000 --rows 1 5   # FetchSGD's server step

``--fetchsgd``: the once-a-round server step of FetchSGD (:meth:`ServerFeedback.step`: momentum, error,
unsketch + top-k, zeroing the applied cells) on a ``params``-element model, uploads
``sketch(rows=R, ratio=0.02)`` (automatic cols), timed best of ``--repeats`` with the compiled passes
(``CountSketch.top_dense``) and with the torch path (the same code with ``top_dense`` off), alternating
in one process, the same delta checked; plus the step's working memory (peak RSS above the RSS before
it, in dense copies; the returned delta is one).
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
    "qsgd(bits=4)",
    "powersgd(rank=2)",
    "sketch(rows=1,cols=200000,ratio=0.01)",
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


class _Nodes:
    """The part of a Flower Grid that ``configure_train`` uses: the connected node ids."""

    def __init__(self, n: int) -> None:
        self.ids = list(range(1, n + 1))

    def get_node_ids(self):
        return self.ids


def _strategy(spec: str, n: int):
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.strategies import CompressedStrategy

    inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)
    return CompressedStrategy(inner, upload=spec, download="none()", streaming=True)


def child(path: str, spec: str, params: int, naive: bool, threads: int = 2) -> dict:
    """Runs in a fresh process: a round of ``CompressedStrategy`` with N replies read from ``path``.

    The strategy broadcasts round 1 (configure_train), the N replies are built as the client mod
    sends them (real Flower Messages answering the broadcasts), then the peak-RSS mark is reset
    and ``aggregate_train`` counts, checks, decodes and adds every reply and returns the model.
    """
    import gc

    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    import fedcomp
    from fedcomp import protocol as P
    from fedcomp import wire

    torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1  # what a Flower process sets
    shapes = model_shapes(params)
    model = _make_update(shapes, 0)
    layout = fedcomp.Layout.of(model)
    payloads = []
    with open(path, "rb") as f:
        while head := f.read(4):
            (n,) = struct.unpack("<I", head)
            payloads.append(f.read(n))
    payload_bytes = sum(len(p) for p in payloads)
    # one small decode + add first: the process loads its compiled loops (fedcomp.kernels, numba),
    # a fixed one-time cost (~170 MB resident here, whatever the model's size), reported apart
    # (kernels_mb) instead of counted as per-round working memory
    rss_cold = _rss_kb("VmRSS")
    from fedcomp.aggregate import Accumulator

    small = {"w": torch.randn(4096)}
    warm = fedcomp.build_codec(spec)
    Accumulator(warm, fedcomp.Layout.of(small)).add(warm.encode(small, nonce=1, round=1).payload, 1.0)
    kernels_mb = (_rss_kb("VmRSS") - rss_cold) / 1024
    if naive:  # decode everything, then average (what a non-streaming server does)
        codec = fedcomp.build_codec(spec)
        gc.collect()
        rss_before = _rss_kb("VmRSS")
        exact_peak = _reset_peak()
        t0 = time.perf_counter()
        decoded = [codec.decode(p, layout) for p in payloads]
        mean = {n: sum(d[n].float() for d in decoded) / len(decoded) for n in layout.names}
        replies = []
    else:
        strategy = _strategy(spec, len(payloads))
        messages = list(strategy.configure_train(1, ArrayRecord(model), ConfigRecord({}), _Nodes(len(payloads))))
        crc = strategy.tiers[0].crc
        replies = []
        for i, (msg, p) in enumerate(zip(messages, payloads)):  # the records compression_mod sends
            token = int(msg.content.config_records[P.DOWNLOAD_RECORD][wire.REPLY_TOKEN])
            upload = ConfigRecord({P.PAYLOAD: p, P.ARRAYS_KEY: "arrays", P.DELTA_REF: 0, P.TIER: 0,
                                   P.REF_VERSION: 1, P.REF_CRC: crc, P.WANT_TIER: 0,
                                   wire.REPLY_TAG: wire.reply_tag(p, token)})
            reply = Message(RecordDict({P.UPLOAD_RECORD: upload,
                                        "metrics": MetricRecord({"num-examples": 1 + (i % 3), "train_loss": 0.5})}),
                            reply_to=msg)
            replies.append(reply)
        del messages, model
        gc.collect()
        rss_before = _rss_kb("VmRSS")
        exact_peak = _reset_peak()
        t0 = time.perf_counter()
        arrays, _ = strategy.aggregate_train(1, replies)
        stats = strategy.rounds[1]
        if stats.aggregated != len(payloads):
            raise RuntimeError(f"{stats.aggregated} of {len(payloads)} replies aggregated: "
                               f"{[c['status'] for c in stats.clients if c['status'] != 'ok'][:3]}")
        mean = arrays.to_torch_state_dict()
    elapsed = time.perf_counter() - t0
    peak = _rss_kb("VmHWM") if exact_peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dense = layout.dense_bytes()
    extra = peak * 1024 - rss_before * 1024
    if not all(bool(torch.isfinite(t.float()).all()) for t in mean.values()):
        raise RuntimeError("aggregate is not finite")
    return {
        "codec": spec, "clients": len(payloads), "naive": naive, "params": layout.numel,
        "dense_bytes": dense, "payload_bytes": payload_bytes,
        "peak_above_base_bytes": extra, "working_bytes": extra, "working_dense_copies": extra / dense,
        "seconds": elapsed, "seconds_per_client": elapsed / len(payloads), "exact_peak": exact_peak,
        "path": "decode-all" if naive else "CompressedStrategy.aggregate_train", "one_time_mb": kernels_mb,
    }


def run(codecs, clients, params, distinct, naive, threads: int = 2) -> list[dict]:
    import torch

    import fedcomp

    shapes = model_shapes(params)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_server_") as tmp:
        for spec in codecs:
            codec = fedcomp.build_codec(spec)
            base = []
            for i in range(distinct):
                enc = codec.encode(_make_update(shapes, i + 1), nonce=i + 1, round=1, state={})
                base.append(enc.payload)
            counts = sorted(set(clients))
            runs = [(n, False) for n in counts] + ([(counts[0], True)] if naive else [])
            for n, is_naive in runs:
                path = os.path.join(tmp, f"payloads_{n}.bin")
                with open(path, "wb") as f:
                    for i in range(n):
                        p = base[i % len(base)]
                        f.write(struct.pack("<I", len(p)) + p)
                # large blocks straight from (and back to) the kernel: RSS then follows live memory
                env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
                out = subprocess.run(
                    [sys.executable, "-m", "fedcomp.simulations.bench_server", "--child", path, "--spec", spec,
                     "--params", str(params), "--threads", str(threads)] + (["--naive"] if is_naive else []),
                    capture_output=True, text=True, check=False, env=env,
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


def fetchsgd(params: int, rows_list, ratio: float, repeats: int, threads: int, reference: bool = True) -> list[dict]:
    """Time ServerFeedback.step at ``params`` elements, compiled passes against the torch path (see
    the module docstring); returns one row per sketch row count."""
    import gc

    import torch

    import fedcomp
    from fedcomp import kernels
    from fedcomp.codecs.sketch import CountSketch
    from fedcomp.server_feedback import ServerFeedback

    torch.set_num_threads(max(1, threads))
    kernels.get()
    shapes = model_shapes(params)
    layout = fedcomp.Layout.of(_make_update(shapes, 0))
    dense = layout.dense_bytes()
    out = []
    for rows in rows_list:
        spec = f"sketch(rows={rows},ratio={ratio})"
        codec = fedcomp.build_codec(spec)
        encode_s = time.perf_counter()
        ups = [codec.encode(_make_update(shapes, i + 1), nonce=i + 1, round=1).payload for i in range(2)]
        encode_s = (time.perf_counter() - encode_s) / len(ups)
        fb_fast, fb_ref = ServerFeedback(codec, layout, momentum=0.9), ServerFeedback(codec, layout, momentum=0.9)
        values = [fb_fast.decode(p) for p in ups]
        fast_top = CountSketch.top_dense

        def step(fb, fast: bool, i: int):
            fb.add_values(values[i % len(values)], 1.0)
            if not fast:
                CountSketch.top_dense = lambda *a, **k: None  # the torch path (what ran before)
            try:
                gc.collect()
                rss = _rss_kb("VmRSS")
                exact = _reset_peak()
                t0, c0 = time.perf_counter(), time.process_time()
                delta = fb.step()
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                peak = _rss_kb("VmHWM") if exact else 0
            finally:
                CountSketch.top_dense = fast_top
            best_cpu[fast] = min(best_cpu.get(fast, math.inf), cpu)
            return delta, dt, (peak - rss) * 1024 / dense if exact else float("nan")

        best_cpu = {}
        first = step(fb_fast, True, 0)[1]  # the first fast step counts each cell's elements (cached)
        best_cpu.clear()
        if reference:
            step(fb_ref, False, 0)
        best = {"fast": math.inf, "torch": math.inf}
        mem = {"fast": 0.0, "torch": 0.0}
        same = True
        for i in range(1, repeats + 1):
            d_fast, t_fast, m_fast = step(fb_fast, True, i)
            best["fast"], mem["fast"] = min(best["fast"], t_fast), max(mem["fast"], m_fast)
            if reference:
                d_ref, t_ref, m_ref = step(fb_ref, False, i)
                best["torch"], mem["torch"] = min(best["torch"], t_ref), max(mem["torch"], m_ref)
                same &= all(torch.equal(d_fast[k], d_ref[k]) for k in d_fast)
            del d_fast
            d_ref = None
        reducer = codec.reducer
        row = {"spec": spec, "params": layout.numel, "cells": reducer.cells(layout.numel),
               "kept": reducer.kept(layout.numel), "threads": threads, "repeats": repeats,
               "step_s": best["fast"], "first_step_s": first, "step_cpu_s": best_cpu.get(True),
               "torch_step_cpu_s": best_cpu.get(False), "torch_step_s": best["torch"] if reference else None,
               "speedup": best["torch"] / best["fast"] if reference else None, "same_delta": same if reference else None,
               "step_working_dense_copies": mem["fast"], "torch_working_dense_copies": mem["torch"] if reference else None,
               "encode_s": encode_s}
        out.append(row)
        ref = (f" | torch path {row['torch_step_s'] * 1e3:8.1f} ms ({row['speedup']:.1f}x), same delta: {same}"
               if reference else "")
        cpu = (f" | CPU time (all threads) {row['step_cpu_s'] * 1e3:.0f} ms"
               + (f", torch path {row['torch_step_cpu_s'] * 1e3:.0f} ms" if reference else ""))
        print(f"{spec:30s} {layout.numel:,} elements, k {row['kept']:,}, {threads} threads | step "
              f"{row['step_s'] * 1e3:7.1f} ms (first {first * 1e3:.0f} ms){ref}{cpu} | working memory "
              f"{row['step_working_dense_copies']:.2f} dense copies"
              + (f" (torch path {row['torch_working_dense_copies']:.2f})" if reference else ""), flush=True)
    return out


def markdown(rows: list[dict]) -> str:
    """The README's server-scale table: working memory (dense copies) and ms per client per N."""
    counts = sorted({r["clients"] for r in rows if not r["naive"]})
    head = " | ".join(f"N = {n}" for n in counts)
    lines = [f"| upload | {head} | ms per client (N = {counts[0]} / {counts[-1]}) | target <= 3 copies, flat |",
             "|---" * (len(counts) + 3) + "|"]
    for spec in dict.fromkeys(r["codec"] for r in rows):
        by_n = {r["clients"]: r for r in rows if r["codec"] == spec and not r["naive"]}
        copies = [by_n[n]["working_dense_copies"] if n in by_n else None for n in counts]
        cells = " | ".join("not run" if c is None else f"{c:.2f}" for c in copies)
        ms = " / ".join(f"{by_n[n]['seconds_per_client'] * 1e3:.0f}" if n in by_n else "-" for n in (counts[0], counts[-1]))
        done = [c for c in copies if c is not None]
        flat = len(done) > 1 and max(done) - min(done) <= 0.1
        verdict = ("met" if done and max(done) <= 3 else "**missed**") + (", flat" if flat else "")
        lines.append(f"| `{spec}` | {cells} | {ms} | {verdict} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", nargs="+", default=list(DEFAULT_CODECS))
    ap.add_argument("--clients", nargs="+", type=int, default=[50, 100, 200])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--distinct", type=int, default=4, help="distinct client updates encoded (replies cycle over them)")
    ap.add_argument("--naive", action="store_true", help="also run decode-all-then-average at the smallest N")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each child (1 on a shared machine: "
                    "waiting threads of a busy machine inflate times)")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the README table of rows saved with --json, and stop")
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 and 4 clients, top-k only (smoke test)")
    ap.add_argument("--fetchsgd", action="store_true", help="time FetchSGD's server step (ServerFeedback.step) "
                    "instead, compiled passes against the torch path; --params (default here 25M), --rows, --ratio")
    ap.add_argument("--rows", nargs="+", type=int, default=[1], help="--fetchsgd: sketch rows")
    ap.add_argument("--ratio", type=float, default=0.02, help="--fetchsgd: heavy hitters' share")
    ap.add_argument("--repeats", type=int, default=5, help="--fetchsgd: timed steps per path (best is reported)")
    ap.add_argument("--no-reference", action="store_true", help="--fetchsgd: skip the torch path")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.spec, args.params, args.naive, args.threads)))
        return
    if args.table:
        print(markdown([r for path in args.table for r in json.load(open(path))]))
        return
    if args.fetchsgd:
        params = args.params if "--params" in (argv if argv is not None else sys.argv) else 25_000_000
        rows = fetchsgd(params, args.rows, args.ratio, args.repeats, args.threads, not args.no_reference)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if args.quick:
        args.params, args.clients, args.codecs, args.distinct = 50_000, [2, 4], ["topk(ratio=0.01)+qsgd(bits=4)"], 2
    shapes = model_shapes(args.params)
    total = sum(math.prod(s) for s in shapes.values()) + 1
    print(f"model: {total:,} parameters ({total * 4 / 1e6:.1f} MB dense fp32); target: working memory <= 3 dense "
          f"copies besides the payloads, flat in the number of clients", flush=True)
    rows = run(args.codecs, args.clients, args.params, args.distinct, args.naive, args.threads)
    worst = max(r["working_dense_copies"] for r in rows if not r["naive"])
    print(f"worst streaming working memory: {worst:.2f} dense copies (target <= 3): {'met' if worst <= 3 else 'NOT met'}")
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
