"""The numba loops behind :mod:`fedcomp.kernels` (imported only through ``kernels.get()``).

Conventions: ``codes`` are uint8 codes of a run of elements starting at a block boundary (index
0 = the first element of block 0 of the parameter arrays passed); a kernel handles elements
[i0, i1) of that run and writes output element ``i - i0``. ``s`` is a float64 slice of the running
sum, ``w`` the weight; ``out`` an fp32 buffer. fp32 arithmetic is written operation by operation
as the torch path does it (no fast-math: each product and sum is rounded, nothing contracted).

One module per domain: `core`, `dequant`, `encode`, `hashing`, `unsketch`, `blocksums`, `write_runs`,
`read_runs`; this package re-exports every kernel, as `fedcomp.kernels.get()` hands them out.
"""

from __future__ import annotations

from fedcomp._kernels.dequant import (  # noqa: F401
    HALF_PART,
    SQ_PART,
    add_f32,
    add_half,
    add_rounded,
    candidates,
    count_codes2,
    half_sq,
    kbit,
    kbit_sq,
    lowrank,
    lowrank_sq,
    lut_u16,
    qsgd,
    qsgd_sq,
    rounded_sq,
    sign,
    sumsq,
    to_half,
    unpack,
)
from fedcomp._kernels.encode import (  # noqa: F401
    kbit_codes,
    pack,
    qsgd_codes,
    table2,
    twobit_codes,
    uniforms,
    uniforms16,
)
from fedcomp._kernels.hashing import (  # noqa: F401
    add_at,
    add_at_runs,
    ascending,
    cells_expand,
    cells_sums,
    rice_decode,
    sketch_add,
    smallest_exact,
    smallest_hashes,
    stratum_positions,
)
from fedcomp._kernels.unsketch import (  # noqa: F401
    BINS,
    cell_counts,
    cells_hist,
    cells_mark,
    estimate_hist,
    keep_cells,
    keep_top,
    merge_ties,
    refine_hist,
    sketch_values_at,
    zero_where,
)
from fedcomp._kernels.blocksums import (  # noqa: F401
    BLOCK_KBIT,
    BLOCK_QSGD,
    BLOCK_SIGN,
    NO_GUESS,
    SIGN_TILE,
    sign_stats,
    tern_codes,
    tern_packed,
    tern_stats,
    tern_stats_run,
)
from fedcomp._kernels.write_runs import (  # noqa: F401
    COPY_PART,
    STREAM_BYTES,
    block_run,
    crc32_combine,
    half_run,
    half_run_crc,
    raw_run_crc,
    sign_run,
    stream_keys,
    twobit_run,
)
from fedcomp._kernels.read_runs import (  # noqa: F401
    block_add_runs,
    block_sq_run,
    block_values_run,
    gather,
    raw_add_runs,
    raw_crc_sq_run,
    raw_sq_run,
    raw_values_run,
    sign_sq_run,
    tern_run,
    ternary_add_runs,
    ternary_bad_run,
    ternary_sq_run,
    ternary_values_run,
)
from fedcomp._kernels.core import _WIDTH, _vector_width

for _kernel in (kbit_codes, qsgd_codes, tern_codes, uniforms):  # the compute-bound encoders: 16 lanes
    _vector_width(_kernel, _WIDTH)
