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
"""

from __future__ import annotations

import struct
import zlib

import torch

from fedcomp.errors import DecodeError

MAGIC = b"FC"
VERSION = 1
HEADER = struct.Struct("<2sBB8sIQ")
HEADER_BYTES = HEADER.size  # 24
TRAILER_BYTES = 4
OVERHEAD_BYTES = HEADER_BYTES + TRAILER_BYTES


class Writer:
    """Collects body parts (uint8 tensors, on any device) and produces the final bytes.

    On CUDA, :meth:`flush` (called by the codec after each segment) starts copying what was
    written so far into pinned host memory on a side stream, so the copy of one segment overlaps
    the encoding of the next; ``getvalue`` waits for the copies. On the CPU the same calls run in
    order and produce the same bytes.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.parts: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []  # flushed chunks (pinned host memory on CUDA)
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def flush(self) -> None:
        """Move what was written so far towards the host (non-blocking on CUDA)."""
        if not self.parts:
            return
        chunk = torch.cat(self.parts) if len(self.parts) > 1 else self.parts[0]
        self.parts = []
        if self._copy_stream is None:
            self.host.append(chunk.cpu())
            return
        host = torch.empty(chunk.numel(), dtype=torch.uint8, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the chunk is written
        with torch.cuda.stream(self._copy_stream):
            host.copy_(chunk, non_blocking=True)
        chunk.record_stream(self._copy_stream)  # keep its memory until the copy is done
        self.host.append(host)

    def raw(self, data: bytes) -> None:
        self.parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))

    def u32(self, value: int) -> None:
        self.raw(struct.pack("<I", value))

    def u8(self, value: int) -> None:
        self.raw(struct.pack("<B", value))

    def tensor(self, t: torch.Tensor) -> None:
        """Append a tensor's raw little-endian bytes (any dtype)."""
        t = t.detach()
        if t.dtype == torch.bool:  # the bytes 0/1, whatever a bool built by a view holds
            t = t.to(torch.uint8)
        self.parts.append(t.contiguous().reshape(-1).view(torch.uint8).to(self.device))

    def getvalue(self, layout_fp: bytes, codec_fp: int, nonce: int) -> bytes:
        head = HEADER.pack(MAGIC, VERSION, 0, layout_fp, codec_fp, nonce)
        self.flush()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        body = b"".join(h.numpy().tobytes() for h in self.host)
        data = head + body
        return data + struct.pack("<I", zlib.crc32(data))


def open_payload(data: bytes, layout_fp: bytes, codec_fp: int) -> tuple["Reader", int]:
    """Check magic, version, CRC and fingerprints; return a reader over the body and the nonce."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"payload must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < OVERHEAD_BYTES:
        raise DecodeError(f"payload of {len(data)} bytes is shorter than the {OVERHEAD_BYTES}-byte header")
    magic, version, flags, lfp, cfp, nonce = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise DecodeError(f"not a fedcomp payload (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise DecodeError(f"payload format version {version}, this decoder reads version {VERSION}")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if zlib.crc32(data[:-4]) != crc:
        raise DecodeError("payload checksum mismatch: truncated or corrupted in transit")
    if flags != 0:
        raise DecodeError(f"unknown payload flags {flags:#x}")
    if lfp != layout_fp:
        raise DecodeError(
            f"payload was encoded for another model layout (fingerprint {lfp.hex()}, expected {layout_fp.hex()})"
        )
    if cfp != codec_fp:
        raise DecodeError(f"payload was encoded by another codec (fingerprint {cfp:#010x}, expected {codec_fp:#010x})")
    return Reader(data[HEADER_BYTES:-4]), nonce


class Reader:
    """Bounds-checked reads over a payload body."""

    def __init__(self, body: bytes) -> None:
        self.buf = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)
        self.pos = 0

    @property
    def remaining(self) -> int:
        return self.buf.numel() - self.pos

    def take(self, n: int) -> torch.Tensor:
        if n < 0 or n > self.remaining:
            raise DecodeError(f"payload truncated: needs {n} more bytes at offset {self.pos}, has {self.remaining}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4).numpy().tobytes())[0]

    def u8(self) -> int:
        return int(self.take(1)[0])

    def tensor(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """Read ``count`` values of ``dtype`` (a copy, safe to modify)."""
        size = torch.empty(0, dtype=dtype).element_size()
        raw = self.take(count * size).clone()
        if dtype == torch.bool and bool((raw > 1).any()):  # a bool is the byte 0 or 1, never its raw value
            raise DecodeError(f"bool tensor of {count} values holds bytes other than 0 and 1")
        return raw.view(dtype)

    def finish(self) -> None:
        if self.remaining:
            raise DecodeError(f"payload has {self.remaining} unexpected trailing bytes")
