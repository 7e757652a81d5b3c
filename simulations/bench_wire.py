"""Wire efficiency: bytes per message and bits per kept element against the information limit.

For each codec, one message of an n-element fp32 update (default n = 1M, random normal, so the
kept positions are spread as in a dense gradient), prints:

* bytes per message (fedcomp payload: 28 bytes of header and CRC included);
* index bits per kept element, headers included (the selector's k, Rice parameter and stream
  length fields), against the bound log2 C(n, k) / k (bits to name a k-subset of n positions);
* value bits per kept element, against the empirical entropy of the quantized symbols (what an
  ideal entropy coder of those symbols would spend, per-block scales excluded: they are counted
  in the "value bits" column, not in the entropy), and the whole payload in bits per kept element.

The symbols are read back from the payload's code stream (the last bytes before the CRC for the
one-tensor layouts used here).

    python -m fedcomp.simulations.bench_wire                  # n = 1M, k = 1000 (0.1%) and 1%
    python -m fedcomp.simulations.bench_wire --n 100000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import fedcomp
from fedcomp.bitpack import packed_bytes, unpack_codes
from fedcomp.wire import OVERHEAD_BYTES

CODECS = (
    "topk(ratio={r})",
    "topk(ratio={r},index='fixed')",
    "topk(ratio={r})+qsgd(bits=4)",
    "topk(ratio={r})+qsgd(bits=4,coding='ans')",
    "topk(ratio={r})+qsgd(bits=2)",
    "topk(ratio={r})+kbit(bits=4)",
    "topk(ratio={r})+sign()",
    "topk(ratio={r})+twobit(threshold=0.001)",
    "dgc(ratio={r})+qsgd(bits=4)",
    "threshold(ratio={r})",
    "randomk(ratio={r})+qsgd(bits=4)",
)
DENSE = ("none()", "fp16()", "kbit(bits=8)", "kbit(bits=4)", "qsgd(bits=4)", "sign()", "twobit(threshold=0.01)", "terngrad()")


def log2_binomial(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def entropy_bits(symbols: torch.Tensor) -> float:
    """Empirical entropy (bits per symbol) of a tensor of small non-negative integers."""
    if symbols.numel() == 0:
        return 0.0
    counts = torch.bincount(symbols.to(torch.int64)).double()
    p = counts[counts > 0] / symbols.numel()
    return float(-(p * p.log2()).sum())


def _symbols(codec, payload: bytes, kept: int) -> torch.Tensor | None:
    """The quantizer's codes, where they are a packed stream of fixed width at the payload's end."""
    q = codec.quantizer
    bits = {"qsgd": getattr(q.config, "bits", 0), "kbit": getattr(q.config, "bits", 0), "sign": 1,
            "twobit": 2, "terngrad": 2, "fixed-sign": 1}.get(q.name)
    if not bits or not kept:
        return None
    nbytes = packed_bytes(kept, bits)
    raw = torch.frombuffer(bytearray(payload[len(payload) - 4 - nbytes:len(payload) - 4]), dtype=torch.uint8)
    return unpack_codes(raw, kept, bits)


def measure(spec: str, x: torch.Tensor) -> dict:
    codec = fedcomp.build_codec(spec)
    tensors = {"w": x}
    enc = codec.encode(tensors, nonce=3, round=1)
    n = x.numel()
    k = enc.kept[0]
    side = enc.index_bytes[0]
    value_bytes = len(enc.payload) - OVERHEAD_BYTES - side
    row = {
        "codec": spec, "n": n, "kept": k, "payload_bytes": len(enc.payload),
        "index_bits_per_kept": 8 * side / k if k else 0.0,
        "index_bound_bits": log2_binomial(n, k) / k if 0 < k < n else 0.0,
        "value_bits_per_kept": 8 * value_bytes / k if k else 0.0,
        "payload_bits_per_kept": 8 * len(enc.payload) / k if k else 0.0,
        "symbol_entropy_bits": None,
    }
    if getattr(codec.quantizer.config, "coding", "packed") == "ans":  # the symbols of the packed twin
        twin = fedcomp.build_codec(spec.replace(",coding='ans'", ""))
        sym = _symbols(twin, twin.encode(tensors, nonce=3, round=1).payload, k)
    else:
        sym = _symbols(codec, enc.payload, k)
    if sym is not None:
        row["symbol_entropy_bits"] = entropy_bits(sym)
        # the information limit of the whole message: positions (log2 C(n, k)) + values (entropy)
        bound = log2_binomial(n, k) + k * row["symbol_entropy_bits"] if 0 < k < n else k * row["symbol_entropy_bits"]
        row["message_over_bound"] = 8 * len(enc.payload) / bound - 1 if bound else None
    if row["index_bound_bits"] and codec.reducer is not None and side:
        row["index_over_bound"] = row["index_bits_per_kept"] / row["index_bound_bits"] - 1
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.001, 0.01])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    x = torch.randn(args.n, generator=torch.Generator().manual_seed(0)) * 0.01
    rows = []
    print(f"n = {args.n:,} fp32 elements ({4 * args.n:,} B dense)")
    print(f"{'codec':42s} {'bytes':>9s} {'kept':>7s} {'idx b/kept':>10s} {'bound':>7s} {'over':>6s} "
          f"{'val b/kept':>10s} {'entropy':>8s} {'all b/kept':>10s} {'msg/bound':>9s}")
    specs = [s.format(r=r) for r in args.ratios for s in CODECS] + list(DENSE)
    for spec in specs:
        row = measure(spec, x)
        rows.append(row)
        over = f"{100 * row['index_over_bound']:5.1f}%" if "index_over_bound" in row else "     -"
        ent = f"{row['symbol_entropy_bits']:8.2f}" if row["symbol_entropy_bits"] is not None else "       -"
        bound = f"{row['index_bound_bits']:7.2f}" if row["index_bound_bits"] else "      -"
        ratio = "        -" if row.get("message_over_bound") is None else f"{1 + row['message_over_bound']:8.3f}x"
        print(f"{spec:42s} {row['payload_bytes']:9,d} {row['kept']:7d} {row['index_bits_per_kept']:10.2f} {bound} {over} "
              f"{row['value_bits_per_kept']:10.2f} {ent} {row['payload_bits_per_kept']:10.2f} {ratio}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
