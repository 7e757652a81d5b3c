"""Wire format: a fixed header, a codec-defined body, a CRC32 trailer.

::

    offset size field
    0      2    magic b"FC"
    2      1    format version (1)
    3      1    flags (reserved, 0)
    4      8    layout fingerprint (Layout.fingerprint)
    12     4    codec fingerprint (CRC32 of the canonical spec)
    16     8    nonce (u64, seeds random-k indices and stochastic rounding)
    24     ...  body: per segment, the selector's index stream then the value stream
    -4     4    CRC32 of all preceding bytes

No names, shapes or pickles travel. The body is written as device tensors and copied to
the host once (``Writer.getvalue``); decoding reads through ``Reader``, which checks every
length before it slices.

Copies: where the payload's size is known before encoding (dense codecs: ``Writer(size=...)``),
the final ``bytes`` is allocated first (in huge pages where large; a large payload of the same size
that nothing refers to any more is written again, :func:`_reused`) and the quantizers write their
codes into it (:meth:`Writer.empty`): no body byte is copied. Otherwise an encode copies each body
part once, into the final ``bytes`` (on CUDA: once to pinned host memory, then once into the
bytes). A decode reads the payload in place (no slice of it is copied) and copies only the
values it hands out. The CRC32 is ISA-L's (``isal``, about 4x
zlib's speed, the same checksum) where installed, zlib's otherwise.
"""

from __future__ import annotations

import ctypes
import math
import os
import struct
import sys
import threading
import warnings
import zlib

import numpy as np
import torch

from fedcomp.errors import DecodeError

try:  # ISA-L's CRC32: the same polynomial and result as zlib.crc32, about 4x faster on large bodies
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a declared dependency; zlib is the fallback
    from zlib import crc32

MAGIC = b"FC"
VERSION = 1
HEADER = struct.Struct("<2sBB8sIQ")
HEADER_BYTES = HEADER.size  # 24
TRAILER_BYTES = 4
OVERHEAD_BYTES = HEADER_BYTES + TRAILER_BYTES
_U32 = struct.Struct("<I")


HUGE = 4 << 20  # payloads of this many bytes or more are built in huge pages (_fresh_bytes)
_PAGE = 2 << 20  # the size of a huge page (x86-64, arm64 with 4 kB base pages)


def _bytes_api():
    """(new uninitialised bytes of n, its data address, madvise) from CPython's C API, or None."""
    if sys.implementation.name != "cpython" or not sys.platform.startswith("linux"):
        return None
    try:
        new = ctypes.pythonapi.PyBytes_FromStringAndSize
        new.restype, new.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
        address = ctypes.pythonapi.PyBytes_AsString
        address.restype, address.argtypes = ctypes.c_void_p, (ctypes.py_object,)
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.restype, madvise.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (AttributeError, OSError):  # pragma: no cover - another libc or interpreter: plain join
        return None
    return new, address, madvise


_BYTES_API = _bytes_api()
_MADV_HUGEPAGE = 14


class _Hold:
    """Exposes memory at an address to numpy, keeping the object that owns it alive (numpy keeps
    this as its array's base, so every view of the array keeps the owner)."""

    def __init__(self, owner: object, address: int, n: int) -> None:
        self.owner = owner
        self.__array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (address, False), "version": 3}


def _hash_slot(api) -> bool:
    """Whether a bytes object's cached hash sits just before its data (CPython's ``ob_shash``,
    read here from one probe object): :func:`_reused` then clears it. False where it does not
    (another layout, a free-threaded build): payloads are then never reused."""
    if api is None or not getattr(sys, "_is_gil_enabled", lambda: True)():
        return False
    new, address, _ = api
    probe = new(None, 16)
    ctypes.memmove(address(probe), b"fedcomp-hashslot", 16)
    slot = ctypes.c_ssize_t.from_address(address(probe) - 8)
    if slot.value != -1:  # not hashed yet
        return False
    h = hash(probe)  # caches it there
    return slot.value == h


def _spare_count() -> int:
    raw = os.environ.get("FEDCOMP_SPARE_PAYLOADS") or "2"  # unset or empty: the default
    try:
        count = int(raw)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"FEDCOMP_SPARE_PAYLOADS={raw!r}: expected a count of payloads, 0 or more (0: none kept)")
    return count


_SPARES: list[bytes] = []  # the large payloads made last (at most _spare_count()), to be reused
_SPARES_LOCK = threading.Lock()
_HASH_SLOT = _hash_slot(_BYTES_API)


def _reused(n: int) -> bytes | None:
    """A payload of n bytes this process made before and that nothing refers to any more (its
    only reference is :data:`_SPARES`'), its cached hash cleared; None where there is none.

    Why: fresh memory costs the kernel's zeroing of every page on first touch. A 100 MB payload
    into fresh huge pages measured ~3.4 read passes of the update, the page faults alone ~2.2
    (2026-11-26), against ``y.copy_(x)``'s ~2 into reused memory. A process that encodes round
    after round (a simulation's workers, a server's broadcasts) writes its next payload of the
    same size into the last one's memory. Sound because nothing can see the object: no Python
    reference is left (a memoryview, numpy or torch view of it holds one), and the one state a
    bytes keeps, its hash, is reset. The cost: up to ``FEDCOMP_SPARE_PAYLOADS`` (default 2)
    payloads of 4 MB or more stay allocated after their last use; 0 keeps none."""
    if not _HASH_SLOT:
        return None
    with _SPARES_LOCK:
        for i in range(len(_SPARES)):
            # two references: the list's and getrefcount's argument
            if len(_SPARES[i]) == n and sys.getrefcount(_SPARES[i]) == 2:
                data = _SPARES.pop(i)
                _SPARES.append(data)
                ctypes.c_ssize_t.from_address(_BYTES_API[1](data) - 8).value = -1
                return data
    return None


def _keep(data: bytes, count: int) -> None:
    """Keep ``data`` among the last ``count`` payloads made (0: keep none, drop those kept)."""
    with _SPARES_LOCK:
        _SPARES.append(data)
        del _SPARES[:max(0, len(_SPARES) - count)]


def release_spares() -> None:
    """Drop the payloads kept for reuse (:func:`_reused`), so their memory returns to the system
    once nothing else holds them."""
    with _SPARES_LOCK:
        _SPARES.clear()


def _fresh_bytes(n: int) -> tuple[bytes, np.ndarray] | None:
    """A ``bytes`` of n uninitialised bytes nobody else refers to and a writable numpy view of
    them (the view keeps the bytes alive), its memory advised to huge pages; None where that is
    not available. A spare payload of n bytes is reused (:func:`_reused`).

    Why: the first write to fresh memory faults every 4 kB page. A 100 MB payload built by
    ``b"".join`` measured 13.5-14.4 read passes of the update, ~3.1-3.4 in huge pages (2026-11-23,
    ``y.copy_(x)`` into reused memory 1.9-2.2). Filling a bytes object made by
    ``PyBytes_FromStringAndSize(NULL, n)`` before anything else sees it is what CPython's C API
    documents for such an object; Linux's default THP mode ("madvise") then backs it with 2 MB
    pages, as numpy does for its own large buffers. Nothing writes to it after :class:`Writer`
    returns it, until every reference to it is gone."""
    if _BYTES_API is None:
        return None
    new, address, madvise = _BYTES_API
    count = _spare_count() if _HASH_SLOT else 0
    data = _reused(n) if count else None
    if data is not None:
        return data, np.asarray(_Hold(data, address(data), n))
    data = new(None, n)
    start = address(data)
    lo, hi = -(-start // _PAGE) * _PAGE, (start + n) // _PAGE * _PAGE
    if hi > lo:
        madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a refusal leaves 4 kB pages
    if _HASH_SLOT:
        _keep(data, count)
    return data, np.asarray(_Hold(data, start, n))


def join(views: list) -> bytes:
    """``b"".join(views)`` (views: bytes-like), in huge pages where the result is large."""
    n = sum(len(v) for v in views)
    made = _fresh_bytes(n) if n >= HUGE else None
    if made is None:
        return b"".join(views)
    data, out = made
    offset = 0
    for v in views:
        m = len(v)
        if m:
            out[offset:offset + m] = np.frombuffer(v, dtype=np.uint8)
        offset += m
    return data


MMAPPED = 32 << 20  # glibc's largest mmap threshold: malloc maps every buffer this large afresh
_ARENA = threading.local()  # .state: [one fresh uint8 CPU tensor, its next free offset, dtype] inside arena()


class arena:
    """A scope (``with arena(nbytes):``) in which this thread's result buffers of ``dtype`` (fp32
    by default) from :func:`output_empty`, :func:`output_zeros` and :func:`output_like` are carved,
    one after another (64-byte aligned), out of one fresh zeroed allocation of ``nbytes`` (huge
    pages where large; a request that no longer fits, or of another dtype, gets a buffer of its
    own, as does an empty one; scratch from :func:`host_empty` / :func:`host_zeros` never comes
    from it). Nothing is carved twice, so a carved buffer is zero until written. A scope of under
    MMAPPED bytes, or one whose allocation the system refuses, carves nothing and hides an outer
    scope (``arena(0)`` does so on purpose). The buffers are views of one storage: it lives while
    any of them does (the untouched rest is address space, not memory), and ``torch.save`` or
    ``copy.deepcopy`` of one of them alone takes the whole storage, as for any view (``clone()``
    one to keep it alone).

    Why: a dense decode of a many-tensor model makes a buffer per tensor, and glibc returns such
    buffers to the system when they are freed and maps them afresh the next time (a first write
    faults every 4 kB page): the ResNet-50 layout's 161 tensors (25.6M fp32) decoded at 9-11 read
    passes of the update, its bytes copied at ~4 GB/s (2026-11-26)."""

    def __init__(self, nbytes: int, dtype: torch.dtype = torch.float32) -> None:
        self.nbytes, self.dtype = nbytes, dtype

    @classmethod
    def fp32(cls, counts) -> "arena":
        """An arena with room for fp32 results of these element counts, each at an aligned address."""
        return cls(sum(4 * n + 64 for n in counts))

    def __enter__(self) -> "arena":
        self._outer = getattr(_ARENA, "state", None)
        _ARENA.state = None
        if self.nbytes >= MMAPPED:
            try:
                buf = torch.from_numpy(np.zeros(self.nbytes + 64, dtype=np.uint8))
            except MemoryError:  # address space the system will not promise: each buffer on its own
                pass
            else:
                _ARENA.state = [buf, -buf.data_ptr() % 64, self.dtype]  # offset of the next carve (aligned)
        return self

    def __exit__(self, *exc) -> None:
        _ARENA.state = self._outer


def _carve(nbytes: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``nbytes`` of the current :class:`arena` as a flat ``dtype`` tensor, or None (no arena,
    no room, another dtype than the arena's, nothing asked: an empty tensor keeps no storage alive)."""
    state = getattr(_ARENA, "state", None)
    if state is None or dtype != state[2] or nbytes == 0:
        return None
    buf, at, _ = state
    if at + nbytes > buf.numel():
        return None
    end = at + nbytes
    state[1] = end + (-(buf.data_ptr() + end)) % 64  # the next one at an aligned address
    return buf[at:end].view(dtype)


def carving(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this thread has an open :class:`arena` of ``dtype``."""
    state = getattr(_ARENA, "state", None)
    return state is not None and state[2] == dtype


def output_empty(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fresh flat CPU buffer of n values for a result the caller hands back: carved out of the
    open :class:`arena` where there is one of ``dtype`` with room, else
    ``host_empty(n, dtype, MMAPPED)``."""
    carved = _carve(n * dtype.itemsize, dtype)
    return carved if carved is not None else host_empty(n, dtype, MMAPPED)


def output_zeros(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`output_empty`, zero: carved (a carve is zero until written) or :func:`host_zeros`."""
    carved = _carve(n * dtype.itemsize, dtype)
    return carved if carved is not None else host_zeros(n, dtype)


def host_empty(shape, dtype: torch.dtype, at_least: int | None = None) -> torch.Tensor:
    """A fresh CPU buffer from numpy, which asks Linux for huge pages (madvise) for buffers of
    4 MB or more (``at_least`` bytes, HUGE by default; smaller ones from torch's allocator). Why:
    the first write into fresh memory faults every 4 kB page; 25 MB into a fresh torch tensor
    measured ~16 ms on this project's machine (more than 2 read passes of x), into numpy's ~2 ms.
    Buffers that are made and freed again and again (decoded tensors, applied steps) ask for
    ``at_least=MMAPPED``: below it glibc's malloc comes to serve them from memory it reuses (its
    mmap threshold adapts to the sizes freed), which no fresh buffer beats (2026-11-26: decode
    of the ResNet-50 layout at 4 MB 4.1-7.0 read passes, at 32 MB 2.9-4.4)."""
    n = math.prod(shape) if isinstance(shape, tuple) else shape
    if n * dtype.itemsize < (HUGE if at_least is None else at_least):  # torch's allocator is quicker
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.empty(n * dtype.itemsize, dtype=np.uint8)).view(dtype).view(shape)


def output_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh contiguous buffer of ``t``'s shape and device (``dtype``: t's by default) for an
    elementwise result: on the CPU carved out of an open :class:`arena`, or from numpy in huge
    pages where it is MMAPPED bytes or more (:func:`output_empty`). Why: ``a - b`` of 25M fp32 into
    fresh torch memory measured 13.3 read passes, 4.4 into this."""
    dtype = t.dtype if dtype is None else dtype
    if t.device.type != "cpu":
        return torch.empty(t.shape, dtype=dtype, device=t.device)
    return output_empty(t.numel(), dtype).view(t.shape)


def host_zeros(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero CPU buffer of n values; from numpy (calloc: fresh pages are zero already, nothing
    is written until used) where it is MMAPPED bytes or more, else torch's. Why: ``torch.zeros``
    of 100 MB writes every byte of freshly mapped memory (4 kB page faults, then the zeros): a
    sparse decode at 25M (k values into zeros) took ~10 read passes, ~2.2 from numpy's."""
    if n * dtype.itemsize < MMAPPED or dtype.is_complex:
        return torch.zeros(n, dtype=dtype)
    return torch.from_numpy(np.zeros(n * dtype.itemsize, dtype=np.uint8)).view(dtype)


def _host_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, without a copy."""
    return memoryview(t.numpy()).cast("B") if t.numel() else memoryview(b"")


class Writer:
    """Collects body parts (uint8 tensors or bytes, on any device) and produces the final bytes.

    Parts stay where they are (a tensor part is a view of the caller's data where possible) until
    :meth:`getvalue` joins them, with the header and the CRC, into one ``bytes``: each body byte is
    copied once. On CUDA, :meth:`flush` (called by the codec after each segment) starts copying
    what was written so far into pinned host memory on a side stream, so the copy of one segment
    overlaps the encoding of the next; ``getvalue`` waits for the copies. On the CPU the same calls
    produce the same bytes.
    """

    def __init__(self, device: torch.device | str = "cpu", size: int | None = None, head: bytes | None = None) -> None:
        self.device = torch.device(device)
        self.parts: list[torch.Tensor | bytes] = []  # not yet flushed (uint8 tensors or bytes)
        self.host: list[torch.Tensor | bytes] = []  # flushed (CPU tensors, pinned on CUDA, or bytes)
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # ``size``: the whole payload's bytes, where the caller knows them; on the CPU a large
        # payload is then allocated up front, and :meth:`empty` hands out its body in order
        self._payload = _fresh_bytes(size) if size is not None and size >= HUGE and self.device.type == "cpu" else None
        self._cursor = HEADER_BYTES
        # ``head``: the header getvalue() will be given, where the caller knows it; then the
        # payload's CRC can be taken as its body is written (crc_before / checksummed)
        self._head = head
        self._crc: tuple[int, int] | None = None  # (n, CRC32 of the payload's first n bytes)
        if self._payload is not None and head is not None and len(head) == HEADER_BYTES:
            self._payload[1][:HEADER_BYTES] = np.frombuffer(head, dtype=np.uint8)
            self._crc = (HEADER_BYTES, crc32(head))

    def empty(self, shape, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        """A buffer for the next body part, which the caller fills and then appends with
        :meth:`tensor`. Where the writer was told the payload's size, it is the payload's own
        memory at the place the part goes, so the part is written once and never copied; the
        places are handed out in the order of the calls, so parts must be appended in that order
        (out of order they are still right, copied into a fresh payload). Otherwise (and on
        CUDA, or for a tensor on another ``device`` than the writer's) a fresh buffer."""
        device = self.device if device is None else torch.device(device)
        n = math.prod(shape) if isinstance(shape, tuple) else shape
        size = dtype.itemsize
        if self._payload is not None and device.type == "cpu" and n:
            at, self._cursor = self._cursor, self._cursor + n * size
            if at % size == 0 and self._cursor <= len(self._payload[0]) - TRAILER_BYTES:
                return torch.from_numpy(self._payload[1][at:self._cursor]).view(dtype).view(shape)
            # misaligned for dtype (after a part of odd length): a fresh buffer, copied to its place
        if device.type != "cpu" or n == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        return host_empty(shape, dtype)

    def crc_before(self, place: torch.Tensor) -> int | None:
        """The CRC32 of the payload up to ``place`` (a buffer :meth:`empty` handed out), where
        everything before it is checksummed already (:meth:`checksummed`); else None. A caller
        that fills ``place`` can continue it over the bytes it writes, while they are in cache,
        instead of the writer reading the whole payload again at the end."""
        if self._crc is None or self._payload is None or place.device.type != "cpu":
            return None
        n, crc = self._crc
        return crc if place.data_ptr() == self._payload[1].ctypes.data + n else None

    def checksummed(self, place: torch.Tensor, crc: int) -> None:
        """Record that the payload up to the end of ``place`` (filled, never written again) has
        CRC32 ``crc`` (continued from :meth:`crc_before`)."""
        if self.crc_before(place) is not None:
            self._crc = (place.data_ptr() + place.numel() - self._payload[1].ctypes.data, int(crc))

    @property
    def nbytes(self) -> int:
        """Body bytes written so far."""
        return sum(len(p) if isinstance(p, bytes) else p.numel() for p in (*self.host, *self.parts))

    def flush(self) -> None:
        """Move what was written so far towards the host (non-blocking on CUDA)."""
        if not self.parts:
            return
        parts, self.parts = self.parts, []
        if self._copy_stream is None:
            self.host += parts
            return
        device_parts = [p for p in parts if not isinstance(p, bytes) and p.device.type == "cuda"]
        if not device_parts:
            self.host += parts
            return
        host = [p if isinstance(p, bytes) or p.device.type != "cuda" else None for p in parts]
        chunk = torch.cat(device_parts) if len(device_parts) > 1 else device_parts[0]
        pinned = torch.empty(chunk.numel(), dtype=torch.uint8, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the chunk is written
        with torch.cuda.stream(self._copy_stream):
            pinned.copy_(chunk, non_blocking=True)
        chunk.record_stream(self._copy_stream)  # keep its memory until the copy is done
        offset = 0
        for i, p in enumerate(parts):  # the pinned chunk, cut back into the parts, in order
            if host[i] is None:
                host[i] = pinned[offset:offset + p.numel()]
                offset += p.numel()
        self.host += host

    def body(self) -> bytes:
        """The body written so far (CPU writers), as one ``bytes``."""
        return b"".join(p if isinstance(p, bytes) else _host_view(p.cpu()) for p in (*self.host, *self.parts))

    def raw(self, data: bytes) -> None:
        self.parts.append(bytes(data))

    def u32(self, value: int) -> None:
        self.parts.append(_U32.pack(value))

    def u8(self, value: int) -> None:
        self.parts.append(struct.pack("<B", value))

    def tensor(self, t: torch.Tensor) -> None:
        """Append a tensor's raw little-endian bytes (any dtype); a CPU tensor is not copied here."""
        if t.dtype == torch.uint8 and t.dim() == 1 and t.device.type == "cpu" and t.is_contiguous():
            if t.numel():  # the common case, quickly (a CPU writer's own buffers)
                self.parts.append(t.detach())
            return
        t = t.detach()
        if t.numel() == 0:
            return
        if t.dtype == torch.bool:  # the bytes 0/1, whatever a bool built by a view holds
            t = t.to(torch.uint8)
        if t.device.type == "cpu" or self._copy_stream is not None:
            self.parts.append(t.contiguous().reshape(-1).view(torch.uint8))
        else:  # a writer for another device than the tensor's: bring it over
            self.parts.append(t.contiguous().reshape(-1).view(torch.uint8).to(self.device))

    def getvalue(self, layout_fp: bytes, codec_fp: int, nonce: int, version: int = VERSION) -> bytes:
        head = header(layout_fp, codec_fp, nonce, version)
        self.flush()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        if self._payload is not None and (done := self._place(head)) is not None:
            return done
        views = [head] + [p if isinstance(p, bytes) else _host_view(p.cpu()) for p in self.host]
        crc = 0
        for v in views:
            crc = crc32(v, crc)
        views.append(_U32.pack(crc))
        return join(views)


    def _place(self, head: bytes) -> bytes | None:
        """The payload allocated up front, with every part at its place (the parts handed out by
        :meth:`empty` are there already), or None where the parts do not fit it exactly."""
        data, buf = self._payload
        self._payload = None  # the payload is handed out once
        base, end = buf.ctypes.data, buf.ctypes.data + buf.shape[0]
        offset, copies = HEADER_BYTES, []
        for p in self.host:
            n = len(p) if isinstance(p, bytes) else p.numel()
            at = None if isinstance(p, bytes) or p.device.type != "cpu" else p.data_ptr()
            if at != base + offset:
                if at is not None and base <= at < end:
                    return None  # a handed-out part away from its place
                copies.append((offset, p))
            offset += n
        if offset != buf.shape[0] - TRAILER_BYTES:
            return None
        buf[:HEADER_BYTES] = np.frombuffer(head, dtype=np.uint8)
        for at, p in copies:
            v = np.frombuffer(p if isinstance(p, bytes) else _host_view(p.cpu()), dtype=np.uint8)
            buf[at:at + v.shape[0]] = v
        # the CRC taken while the body was written, where the header is the one announced and no
        # part was copied into the checksummed bytes; the rest of the payload is read here
        done, crc = (0, 0) if self._crc is None or head != self._head or any(at < self._crc[0] for at, _ in copies) \
            else self._crc
        buf[-TRAILER_BYTES:] = np.frombuffer(_U32.pack(crc32(buf[done:-TRAILER_BYTES], crc)), dtype=np.uint8)
        return data


CHECKSUM_MISMATCH = "payload checksum mismatch: truncated or corrupted in transit"


def header(layout_fp: bytes, codec_fp: int, nonce: int, version: int = VERSION) -> bytes:
    """A payload's first HEADER_BYTES bytes."""
    return HEADER.pack(MAGIC, version, 0, layout_fp, codec_fp, nonce)


def open_payload(
    data: bytes, layout_fp: bytes, codec_fp: int, versions: tuple[int, ...] = (VERSION,), *, check_crc: bool = True
) -> tuple["Reader", int]:
    """Check magic, version, CRC and fingerprints; return a reader over the body and the nonce.

    The reader's :attr:`Reader.version` is the payload's format version (one of ``versions``).
    ``check_crc=False`` leaves the CRC to the caller, who checksums the bytes as it reads them
    (:func:`crc32` for the parts it does not read: the header, the tail) and must refuse the
    payload (:data:`CHECKSUM_MISMATCH`) before anything it read is used
    (:meth:`fedcomp.Codec.read_run` with ``sq_chunk``).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"payload must be bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B")
    if len(view) < OVERHEAD_BYTES:
        raise DecodeError(f"payload of {len(view)} bytes is shorter than the {OVERHEAD_BYTES}-byte header")
    magic, version, flags, lfp, cfp, nonce = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise DecodeError(f"not a fedcomp payload (magic {magic!r}, expected {MAGIC!r})")
    if version not in versions:
        if cfp != codec_fp:  # formats differ per codec (randomk writes 2): the codec is the news
            raise DecodeError(f"payload was encoded by another codec (fingerprint {cfp:#010x}, expected "
                              f"{codec_fp:#010x}; format version {version})")
        readable = ", ".join(str(v) for v in versions)
        raise DecodeError(f"payload format version {version}, this decoder reads version {readable}")
    (crc,) = _U32.unpack_from(view, len(view) - 4)
    if check_crc and crc32(view[:-4]) != crc:
        raise DecodeError(CHECKSUM_MISMATCH)
    if flags != 0:
        raise DecodeError(f"unknown payload flags {flags:#x}")
    if lfp != layout_fp:
        raise DecodeError(
            f"payload was encoded for another model layout (fingerprint {lfp.hex()}, expected {layout_fp.hex()})"
        )
    if cfp != codec_fp:
        raise DecodeError(f"payload was encoded by another codec (fingerprint {cfp:#010x}, expected {codec_fp:#010x})")
    reader = Reader(view[HEADER_BYTES:-4])
    reader.version = version
    return reader, nonce


class Reader:
    """Bounds-checked reads over a payload body (read in place: slices are views, not copies)."""

    version: int = VERSION  # the payload's format version (set by open_payload)

    def __init__(self, body: bytes | bytearray | memoryview) -> None:
        if len(body):
            with warnings.catch_warnings():  # the body may be read-only: nothing ever writes to it
                warnings.simplefilter("ignore", UserWarning)
                self.buf = torch.frombuffer(body, dtype=torch.uint8)
        else:
            self.buf = torch.empty(0, dtype=torch.uint8)
        self._body = body  # keeps the memory alive
        self.pos = 0

    @property
    def remaining(self) -> int:
        return self.buf.numel() - self.pos

    def take(self, n: int) -> torch.Tensor:
        """The next n bytes, as a read-only view (copy before writing to it)."""
        if n < 0 or n > self.remaining:
            raise DecodeError(f"payload truncated: needs {n} more bytes at offset {self.pos}, has {self.remaining}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return _U32.unpack(self.take(4).numpy().tobytes())[0]

    def u8(self) -> int:
        return int(self.take(1)[0])

    def tensor(self, count: int, dtype: torch.dtype, *, output: bool = False) -> torch.Tensor:
        """Read ``count`` values of ``dtype`` (a copy, safe to modify; ``output``: the caller hands
        it back as a result, carved out of an open :class:`arena` where there is one)."""
        size = torch.empty(0, dtype=dtype).element_size()
        part = self.take(count * size)
        out = output_empty(count, dtype) if output else host_empty(count, dtype, MMAPPED)  # huge pages where large
        raw = out.view(torch.uint8) if count else torch.empty(0, dtype=torch.uint8)
        raw.copy_(part)
        if dtype == torch.bool and bool((raw > 1).any()):  # a bool is the byte 0 or 1, never its raw value
            raise DecodeError(f"bool tensor of {count} values holds bytes other than 0 and 1")
        return out

    def finish(self) -> None:
        if self.remaining:
            raise DecodeError(f"payload has {self.remaining} unexpected trailing bytes")


# -- replies bound to the message the server sent ------------------------------------------------
# A server issues a random token with each message it sends (``REPLY_TOKEN`` in the download
# record); the client's reply carries ``REPLY_TAG``, a keyed hash of that token and of the
# payload's header and CRC trailer (the trailer checksums the body, which every decode checks).
# A payload replayed from another round or node, or with its nonce rewritten and its CRC
# recomputed, no longer matches the token the server issued for this (node, round): dropped.
# The payload's bytes are unchanged (every format stays decodable; no copy, one hash of 36 bytes).
REPLY_TOKEN = "reply-token"  # download record: the server's token for this message (int, 63 bits)
REPLY_TAG = "reply-tag"  # upload record: REPLY_TAG_BYTES bytes, reply_tag(payload, token)
REPLY_TAG_BYTES = 8
TOKEN_BITS = 63  # a Flower ConfigRecord int is a signed 64-bit integer


def reply_tag(payload: bytes, token: int) -> bytes:
    """The tag binding ``payload`` to the server-issued ``token``: BLAKE2b (8 bytes) keyed by the
    token, over the payload's header (magic, version, flags, fingerprints, nonce) and its CRC32
    trailer. Raises :class:`DecodeError` for a payload too short to have both, or a token that
    is not a non-negative integer below 2**63."""
    import hashlib

    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 1 << TOKEN_BITS:
        raise DecodeError(f"reply token {token!r} is invalid: an integer in [0, 2**{TOKEN_BITS})")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise DecodeError(f"payload must be bytes, got {type(payload).__name__}")
    view = memoryview(payload).cast("B")
    h = hashlib.blake2b(key=token.to_bytes(8, "little"), digest_size=REPLY_TAG_BYTES, person=b"fedcomp-reply")
    if len(view) < OVERHEAD_BYTES:  # not a payload (a budget's size probe): all of it
        h.update(view)
    else:
        h.update(view[:HEADER_BYTES])
        h.update(view[-TRAILER_BYTES:])
    return h.digest()


def check_reply_tag(payload: bytes, tag, token: int) -> None:
    """Raise :class:`DecodeError` unless ``tag`` is :func:`reply_tag` of ``payload`` and ``token``."""
    import hmac

    if tag is None:
        raise DecodeError(f"reply has no {REPLY_TAG!r}, but the server issued a reply token: a client of an "
                          f"older fedcomp, or a reply built without the server's message")
    if not isinstance(tag, bytes) or len(tag) != REPLY_TAG_BYTES:
        raise DecodeError(f"{REPLY_TAG!r} must be {REPLY_TAG_BYTES} bytes, got {type(tag).__name__} "
                          f"of length {len(tag) if isinstance(tag, (bytes, str, list)) else '?'}")
    if not hmac.compare_digest(reply_tag(payload, token), tag):
        raise DecodeError(f"{REPLY_TAG!r} does not match the token the server issued with this message: the payload "
                          f"was made for another message (replayed, or its header or checksum rewritten)")
