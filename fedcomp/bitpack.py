"""Bit packing and index coding, in torch so they run on the tensor's device.

* ``pack_bits`` / ``unpack_bits``: unsigned integers of a fixed width (1..62 bits), MSB first.
* ``rice_encode`` / ``rice_decode``: sorted distinct indices as Golomb-Rice coded gaps. The
  unary quotients and the r-bit remainders go to two separate streams, so both directions are
  vectorised (no per-element Python loop). The cost is ``k (r + 1) + sum(gap >> r)`` bits, the
  same as interleaved Rice coding; r is chosen per message to minimise it. For gaps that are
  roughly geometric (top-k of a dense update) this lands within about 1% of log2 C(n, k).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedcomp.errors import DecodeError


def packed_bytes(count: int, bits: int) -> int:
    """Bytes that ``count`` values of ``bits`` bits occupy once packed."""
    return (count * bits + 7) // 8


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers < 2**bits into a uint8 tensor (on the values' device)."""
    values = values.reshape(-1)
    count = values.numel()
    if count == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    if bits == 1 and values.device.type == "cpu":  # numpy's packbits: MSB first, the same bytes
        v = values if values.dtype in (torch.bool, torch.uint8) else values.to(torch.uint8)
        return torch.from_numpy(np.packbits(v.contiguous().numpy().view(np.uint8)))
    if 8 % bits == 0:  # 1, 2, 4, 8 bits: several values per byte, no bit matrix
        per = 8 // bits
        v = values.to(torch.uint8)
        pad = (-count) % per
        if pad:
            v = torch.cat([v, v.new_zeros(pad)])
        v = v.view(-1, per)
        shifts = torch.arange(8 - bits, -1, -bits, device=v.device, dtype=torch.uint8)
        return (v << shifts).sum(dim=1, dtype=torch.uint8) if per > 1 else v.reshape(-1)
    shifts = torch.arange(bits - 1, -1, -1, device=values.device, dtype=torch.int64)
    bitmat = ((values.to(torch.int64).unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    return pack_bits(bitmat, 1)


def unpack_bits(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` values, as int64."""
    if data.numel() != packed_bytes(count, bits):
        raise DecodeError(f"bit stream holds {data.numel()} bytes, {count} values of {bits} bits need {packed_bytes(count, bits)}")
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(8 - bits, -1, -bits, device=data.device, dtype=torch.uint8)
        mask = (1 << bits) - 1
        v = ((data.unsqueeze(1) >> shifts) & mask).reshape(-1)[:count]
        return v.to(torch.int64)
    flat = unpack_bits(data, packed_bytes(count, bits) * 8, 1)[: count * bits].view(count, bits)
    weights = (1 << torch.arange(bits - 1, -1, -1, device=data.device, dtype=torch.int64))
    return (flat * weights).sum(dim=1)


def unpack_codes(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """:func:`unpack_bits` for quantizer codes of at most 8 bits, as uint8 (a quarter of the
    memory of int64 codes; widths that do not divide 8 go through :func:`unpack_bits`)."""
    if bits > 8:
        raise ValueError(f"unpack_codes takes 1..8 bits, got {bits}")
    if 8 % bits:
        return unpack_bits(data, count, bits).to(torch.uint8)
    if data.numel() != packed_bytes(count, bits):
        raise DecodeError(f"bit stream holds {data.numel()} bytes, {count} values of {bits} bits need {packed_bytes(count, bits)}")
    if bits == 8:
        return data[:count].clone()
    per = 8 // bits
    shifts = torch.arange(8 - bits, -1, -bits, device=data.device, dtype=torch.uint8)
    return ((data.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count]


def unpack_flags(data: torch.Tensor, count: int) -> torch.Tensor:
    """1-bit codes as a bool tensor (:func:`unpack_bits` with 1 bit, without int64 codes)."""
    if data.numel() != packed_bytes(count, 1):
        raise DecodeError(f"bit stream holds {data.numel()} bytes, {count} flags need {packed_bytes(count, 1)}")
    if data.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(data.numpy(), count=count).view(np.bool_))
    return unpack_bits(data, count, 1).bool()


def fixed_index_bits(n: int) -> int:
    """Bits per index for plain fixed-width index coding over n positions."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1


def rice_cost_bits(gaps: torch.Tensor, r: int) -> int:
    return int(gaps.numel() * (r + 1) + (gaps >> r).sum().item())


def _gaps(indices: torch.Tensor) -> torch.Tensor:
    return torch.diff(indices, prepend=indices.new_full((1,), -1)) - 1


def choose_rice_parameter(indices: torch.Tensor, n: int) -> int:
    """The Rice parameter that minimises the coded size of these sorted indices."""
    k = indices.numel()
    if k == 0:
        return 0
    gaps = _gaps(indices)
    guess = max(0, round(math.log2(max(1.0, (n / k) * math.log(2)))))
    candidates = range(max(0, guess - 2), min(40, guess + 3))
    return min(candidates, key=lambda r: rice_cost_bits(gaps, r))


def rice_encode(indices: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Code sorted distinct int64 indices; returns (unary stream, remainder stream)."""
    gaps = _gaps(indices)
    q = gaps >> r
    total = int(q.sum().item()) + q.numel()
    bits = torch.ones(total + (-total) % 8, dtype=torch.uint8, device=indices.device)
    bits[torch.cumsum(q + 1, 0) - 1] = 0  # each quotient: q ones, then a terminating zero
    unary = pack_bits(bits, 1)
    rem = pack_bits(gaps & ((1 << r) - 1), r) if r else torch.empty(0, dtype=torch.uint8, device=indices.device)
    return unary, rem


def rice_decode(unary: torch.Tensor, rem: torch.Tensor, k: int, r: int, n: int) -> torch.Tensor:
    """Inverse of :func:`rice_encode`; validates that exactly k indices, all < n, come out.
    CPU streams go through one compiled pass where numba is loaded (the same indices; a
    malformed stream is re-read here for its error)."""
    if unary.device.type == "cpu" and rem.device.type == "cpu" and 0 <= r < 63 \
            and rem.numel() == (packed_bytes(k, r) if r else 0):
        from fedcomp import kernels

        kern = kernels.get()
        if kern is not None:
            out = np.empty(k, dtype=np.int64)
            if kern.rice_decode(unary.numpy(), rem.numpy() if r else np.zeros(1, np.uint8), k, r, n, out):
                return torch.from_numpy(out)
    bits = unpack_bits(unary, unary.numel() * 8, 1)
    zeros = torch.nonzero(bits == 0).reshape(-1)
    if zeros.numel() != k:
        raise DecodeError(f"index stream codes {zeros.numel()} indices, header says {k}")
    if k and zeros[-1] < bits.numel() - 8:
        raise DecodeError("index stream has trailing bytes")
    q = torch.diff(zeros, prepend=zeros.new_full((1,), -1)) - 1
    if k and int(q.max()) > (n >> r):
        raise DecodeError(f"index gap out of range for {n} positions")
    remainders = unpack_bits(rem, k, r) if r else torch.zeros(k, dtype=torch.int64, device=unary.device)
    gaps = (q << r) + remainders + 1
    if k and int(gaps.max()) > n:  # (each gap at most n: k of them cannot wrap int64's sum)
        raise DecodeError(f"index gap out of range for {n} positions")
    indices = torch.cumsum(gaps, 0) - 1
    if k and int(indices[-1]) >= n:
        raise DecodeError(f"index {int(indices[-1])} out of range for {n} positions")
    return indices
