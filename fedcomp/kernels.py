"""Fused CPU loops for the server's decode + add path (numba), with the bits of the torch path.

Why: a dense reply is dequantized chunk by chunk and added into a float64 running sum. In eager
torch that is 6-10 passes per value (unpack, cast, scale, offset, cast to float64, multiply by
the weight, add), each over a fresh or chunk-sized temporary. One loop per chunk that reads the
codes, forms the fp32 value with the same fp32 operations in the same order, and adds
``w * float64(value)`` into the sum does one pass. Every value has the bits the torch path gives
it (fp32 products and sums rounded one by one: numba compiles without fast-math, so nothing is
contracted), and ``w * value`` is exact in float64 for integer weights below 2**29, so the sum has
the same bits too.

The client's encoders (kbit, qsgd, sign, twobit and terngrad codes) have loops of the same kind
(:func:`for_encode`), with the same payload bytes as their torch paths; stochastic rounding
generates its uniforms inside the loop from the segment's key (:mod:`fedcomp.uniforms`).

Used only for CPU tensors and only where numba is installed (:func:`get` returns None
otherwise, or when ``FEDCOMP_KERNELS=0``); every caller keeps its torch path, which CUDA tensors
always take. numba is imported on first use, never at ``import fedcomp``; compiled loops are
cached on disk (``cache=True``), so a fresh process loads them instead of compiling, but the
first call still costs over a second (see `for_encode`).
"""

from __future__ import annotations

import functools
import os
import threading

import numpy as np

_KERNELS: object | None = None
_TRIED = False


def mode() -> str:
    """``FEDCOMP_KERNELS``: "0" (never), "1" (always), anything else "auto" (the default)."""
    value = os.environ.get("FEDCOMP_KERNELS", "auto")
    return value if value in ("0", "1") else "auto"


def get():
    """The compiled kernels (a module-like namespace), imported on first use, or None (numba
    missing, or ``FEDCOMP_KERNELS=0``). The server's decode + add path asks here."""
    global _KERNELS, _TRIED
    if mode() == "0":
        return None
    if not _TRIED:
        _TRIED = True
        try:
            from fedcomp import _kernels as k
        except ImportError:  # numba is a declared dependency; without it the torch paths run
            k = None
        _KERNELS = k
    return _KERNELS


def for_encode():
    """The kernels for a client's encode: only where they are loaded already (a server, a warm
    simulation worker) or ``FEDCOMP_KERNELS=1``; None otherwise.

    Why not import them: Flower starts one ClientApp process per message, and a fresh process
    pays more than a second for ``import numba`` and the first kernel call, more than the loops
    save on one encode (see the docs' Results: performance). The bytes are the same either way."""
    m = mode()
    if m == "0":
        return None
    if m == "1" or _KERNELS is not None:
        return get()
    return None


_LOCAL = threading.local()


def scratch(n: int, dtype) -> np.ndarray:
    """A reused buffer of at least ``n`` elements of ``dtype`` (per thread; contents undefined).

    Why: on Linux a fresh multi-MB buffer is mapped anew and every 4 kB page faults on first touch,
    which can cost more than the loop that fills it."""
    key = np.dtype(dtype).char
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.shape[0] < n:
        buf = bufs[key] = np.empty(max(n, 1 << 20), dtype=dtype)
    return buf[:n]


@functools.cache
def crc32_function() -> int | None:
    """The address of ISA-L's ``crc32_gzip_refl`` (``uint32 f(uint32 crc, const uint8 *buf,
    uint64 len)``: zlib's ``crc32(buf, crc)``, as :mod:`fedcomp.wire` computes it), for compiled
    loops that checksum what they read (``fedcomp._kernels.raw_crc_sq_run``); None where ``isal``'s
    module does not export it (then callers checksum in a pass of their own). Checked once
    against zlib on a few lengths before it is used (once: the result is cached)."""
    import ctypes
    import zlib

    try:
        from isal import isal_zlib

        fn = ctypes.CDLL(isal_zlib.__file__).crc32_gzip_refl
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_uint32, (ctypes.c_uint32, ctypes.c_char_p, ctypes.c_uint64)
    data = bytes(range(256)) * 5
    for n in (0, 1, 7, 64, 1000, len(data) - 3):
        if fn(zlib.crc32(data[:3]), data[3:3 + n], n) != zlib.crc32(data[:3 + n]):
            return None
    return ctypes.cast(fn, ctypes.c_void_p).value


_POOL = None
_POOL_LOCK = threading.Lock()


def run_parallel(calls):
    """Run ``calls`` (zero-argument callables, each one compiled ``nogil`` loop over its own part
    of the data) on worker threads, the first on this one; their results in order.

    Why threads and not numba's ``parallel=True``: these loops release the GIL already, and a
    pool of plain threads needs no threading layer (TBB / OpenMP) and keeps ``cache=True``."""
    global _POOL
    calls = list(calls)
    if len(calls) <= 1:
        return [c() for c in calls]
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < len(calls) - 1:
            from concurrent.futures import ThreadPoolExecutor

            _POOL = ThreadPoolExecutor(max_workers=len(calls) - 1, thread_name_prefix="fedcomp-kernels")
        pool = _POOL
    futures = [pool.submit(c) for c in calls[1:]]
    first = calls[0]()
    return [first] + [f.result() for f in futures]
