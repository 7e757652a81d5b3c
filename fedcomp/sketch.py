"""Count sketch (Charikar et al. 2002) as a reducer, and the sketch-space arithmetic FetchSGD needs.

A segment x of n elements becomes a table S of ``rows`` x ``cols`` cells:
S[r, h_r(j)] += s_r(j) x_j, with hashes h_r and signs s_r drawn from ``seed`` (shared by every
client and the server, so no hash tables travel). Sketches are linear: S(a) + S(b) = S(a + b),
so a server can sum clients' tables without decoding them. Decoding ("unsketching") estimates
x_j = median_r s_r(j) S[r, h_r(j)] and keeps the k = ceil(ratio * n) largest estimates (the
heavy hitters); with cols >= 8k and a few rows, every estimate is within O(||tail_k(x)|| / sqrt(k)).
Upload compression is n / (rows * cols).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedcomp.base import Knob, Reducer, Segment, StageContext, register
from fedcomp.wire import Reader, Writer


@register
class CountSketch(Reducer):
    """Count sketch of the whole update (one global segment); decodes to its top-k heavy hitters."""

    name = "sketch"
    linear = True
    budget_knobs = (Knob("cols", "count"),)  # 1 .. the float elements, rows cells per step

    @dataclass(frozen=True)
    class Config:
        rows: int = 5  # hash rows (independent estimates, combined by median)
        cols: int = 1000  # cells per row; upload compression n / (rows * cols)
        ratio: float = 0.005  # fraction of elements recovered as heavy hitters when decoding
        seed: int = 0  # seeds hashes and signs; must be the same on every client and the server

    def validate(self) -> None:
        if not 1 <= self.config.rows <= 64:
            self.fail("rows", "an integer from 1 to 64")
        if not 1 <= self.config.cols <= 2**28:
            self.fail("cols", "a positive integer up to 2**28")
        if not 0 < self.config.ratio <= 1:
            self.fail("ratio", "a fraction in (0, 1]")
        if not 0 <= self.config.seed < 2**32:  # seeds torch.Generator via seed * 1_000_003 + n (< 2**63)
            self.fail("seed", "an integer in [0, 2**32)")
        self._hashes: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    # -- hashing ----------------------------------------------------------------------------
    def _hash(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat cell index rows x n, sign rows x n) for a segment of n elements, cached."""
        key = (n, str(device))
        if key not in self._hashes:
            gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + n)
            rows, cols = self.config.rows, self.config.cols
            buckets = torch.randint(0, cols, (rows, n), generator=gen)
            cells = buckets + (torch.arange(rows) * cols)[:, None]
            signs = torch.randint(0, 2, (rows, n), generator=gen, dtype=torch.int8) * 2 - 1
            self._hashes.clear()  # one layout at a time: bounded memory
            self._hashes[key] = (cells.to(device), signs.to(device=device, dtype=torch.float32))
        return self._hashes[key]

    def sketch(self, x: torch.Tensor) -> torch.Tensor:
        """The table (rows * cols, flattened) of a 1-D vector."""
        cells, signs = self._hash(x.numel(), x.device)
        table = torch.zeros(self.config.rows * self.config.cols, device=x.device)
        return table.index_add_(0, cells.reshape(-1), (signs * x).reshape(-1))

    def estimate(self, table: torch.Tensor, n: int) -> torch.Tensor:
        """Median-of-rows estimate of every element."""
        cells, signs = self._hash(n, table.device)
        return (signs * table[cells]).median(dim=0).values

    def heavy_hitters(self, table: torch.Tensor, n: int, k: int | None = None) -> torch.Tensor:
        """Dense vector holding the k largest estimates (others zero)."""
        k = self.kept(n) if k is None else k
        est = self.estimate(table, n)
        idx = torch.topk(est.abs(), k, sorted=False).indices
        y = torch.zeros(n, device=table.device)
        y[idx] = est[idx]
        return y

    def kept(self, n: int) -> int:
        return min(n, max(1, math.ceil(round(self.config.ratio * n, 6)))) if n else 0

    # -- reducer ----------------------------------------------------------------------------
    def count(self, seg: Segment) -> int | None:
        return self.config.rows * self.config.cols

    def side_nbytes(self, seg: Segment, count: int) -> int | None:
        return 0

    def reduce(self, x: torch.Tensor, seg: Segment, out: Writer, ctx: StageContext):
        return self.sketch(x), None, 0

    def read(self, src: Reader, seg: Segment, ctx: StageContext, device: torch.device):
        return None

    def value_count(self, aux, seg: Segment) -> int:
        return self.config.rows * self.config.cols

    def expand(self, values: torch.Tensor, aux, seg: Segment) -> torch.Tensor:
        return self.heavy_hitters(values, seg.numel)
