"""Bytes a Flower message's content costs on the wire, computed from the records themselves.

Flower 1.39 sends a message's content as a tree of objects (``RecordDict`` -> records ->
arrays -> array chunks of at most 5 MiB), each one ``"<Type> <child ids> <body length>\\0"``
followed by its body, and sends each distinct object once. :func:`message_bytes` computes that
size from what Flower's public record API exposes (a record is a mapping; an array has
``data``, ``dtype``, ``shape``, ``stype``) without importing Flower, so the client mod, the
strategy wrapper and the simulations count bytes with one function; ``tests/test_msgsize.py``
pins it to Flower's own serialization.

Bodies: ``RecordDict`` and ``ArrayRecord`` are JSON maps of names to child ids (64 hex
characters), an ``Array`` is JSON metadata (dtype, shape, stype, chunk indices), a chunk is raw
bytes, ``ConfigRecord``/``MetricRecord`` are protobuf messages (sized here field by field).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from fedcomp.wire import crc32

# Flower reads the same variable once, at import (flwr.common.constant)
CHUNK = int(os.getenv("FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", "5242880"))
_ID = 64  # SHA-256 hex digest: every child id in a header
_INT64_MAX = 2**63 - 1


def _varint(n: int) -> int:
    """Bytes of a protobuf varint."""
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _zigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63) if n >= -(2**63) else (n << 1) ^ -1


def _field(tag_bytes: int, length: int) -> int:
    """A length-delimited field: tag, length, body."""
    return tag_bytes + _varint(length) + length


def _object(cls: str, children: int, body: int) -> int:
    """Header ``"<cls> <ids joined by ','> <body length>"``, a NUL, the body."""
    ids = children * (_ID + 1) - 1 if children else 0
    return len(cls) + 1 + ids + 1 + len(str(body)) + 1 + body


def _scalar(value: Any, config: bool) -> tuple[int, tuple]:
    """(protobuf bytes of a RecordValue message holding ``value``, an identity key)."""
    if config and isinstance(value, bool):
        return 2, ("bool", value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value > _INT64_MAX:
            return 1 + _varint(value), ("uint", value)
        return 1 + _varint(_zigzag(value) & (2**64 - 1)), ("sint", value)
    if isinstance(value, float):
        return 9, ("double", value)
    if config and isinstance(value, str):
        n = len(value.encode("utf-8"))
        return _field(1, n), ("str", value)
    if config and isinstance(value, (bytes, bytearray, memoryview)):
        n = len(value) if not isinstance(value, memoryview) else value.nbytes
        return _field(1, n), ("bytes", bytes(value) if not isinstance(value, bytes) else value)
    raise TypeError(f"value of type {type(value).__name__} cannot be sized as a Flower record value")


def _list(values: list, config: bool) -> tuple[int, tuple]:
    """A list value: the first type (Flower's order: bool, int, float, str, bytes) all items share."""
    kinds = ((bool, int, float, str, bytes) if config else (float, int))
    for kind in kinds:
        if all(isinstance(v, kind) for v in values):
            break
    else:
        raise TypeError("list with mixed value types cannot be sized as a Flower record value")
    if kind is bool:
        packed = len(values)
    elif kind is int:
        if any(v > _INT64_MAX for v in values):
            packed = sum(_varint(v) for v in values)
        else:
            packed = sum(_varint(_zigzag(v) & (2**64 - 1)) for v in values)
    elif kind is float:
        packed = 8 * len(values)
    else:  # str / bytes: repeated, not packed
        lengths = [len(v.encode("utf-8")) if kind is str else len(v) for v in values]
        inner = sum(_field(1, n) for n in lengths)
        return _field(2, inner), (kind.__name__, tuple(values))
    inner = _field(1, packed) if values else 0
    return _field(2, inner), (kind.__name__, tuple(values))  # list fields are numbered 21-26: 2-byte tags


def _values_record(record: Mapping, config: bool) -> tuple[int, tuple]:
    """Body bytes of a ConfigRecord / MetricRecord (``items`` of key + value) and its identity."""
    body, key = 0, []
    for k, v in record.items():
        size, ident = _list(v, config) if isinstance(v, list) else _scalar(v, config)
        klen = len(k.encode("utf-8"))
        item = (_field(1, klen) if klen else 0) + _field(1, size)
        body += _field(1, item)
        key.append((k, ident))
    return body, tuple(key)


class _Counter:
    """Sizes objects once each, as Flower sends each distinct object once."""

    def __init__(self) -> None:
        self.seen: set = set()
        self.chunks: dict[tuple[int, int], list[memoryview]] = {}
        self.total = 0

    def add(self, ident, nbytes: int) -> None:
        if ident not in self.seen:
            self.seen.add(ident)
            self.total += nbytes

    def _chunk(self, piece: memoryview) -> tuple:
        """Identity of a chunk: length and CRC, confirmed by content (zero chunks repeat)."""
        key = (piece.nbytes, crc32(piece))  # zlib's CRC (ISA-L's where installed: ~4x faster)
        bucket = self.chunks.setdefault(key, [])
        for i, other in enumerate(bucket):
            if other == piece:
                return key + (i,)
        bucket.append(piece)
        self.add(("chunk",) + key + (len(bucket) - 1,), _object("ArrayChunk", 0, piece.nbytes))
        return key + (len(bucket) - 1,)

    def array(self, arr) -> tuple:
        view = memoryview(arr.data).cast("B")
        ids = [self._chunk(view[i:i + CHUNK]) for i in range(0, view.nbytes, CHUNK)]
        order = list(dict.fromkeys(ids))
        meta = json.dumps({"dtype": arr.dtype, "shape": arr.shape, "stype": arr.stype,
                           "arraychunk_ids": [order.index(i) for i in ids]})
        ident = ("array", meta, tuple(order))
        self.add(ident, _object("Array", len(order), len(meta.encode("utf-8"))))
        return ident

    def record(self, record) -> tuple:
        cls = type(record).__qualname__
        if cls == "ArrayRecord":
            idents = {name: self.array(arr) for name, arr in record.items()}
            body = len(json.dumps({name: "0" * _ID for name in record}).encode("utf-8"))
            ident = (cls, tuple(idents.items()))
            self.add(ident, _object(cls, len(set(idents.values())), body))
            return ident
        if cls not in ("ConfigRecord", "MetricRecord"):
            raise TypeError(f"cannot size a {cls}: expected ArrayRecord, ConfigRecord or MetricRecord")
        body, key = _values_record(record, cls == "ConfigRecord")
        ident = (cls, key)
        self.add(ident, _object(cls, 0, body))
        return ident


def message_bytes(content) -> int:
    """Bytes Flower transmits for ``content`` (a ``RecordDict``, or one record) and everything in it.

    Equal to the sum of the deflated sizes of the distinct objects of Flower's object tree
    (what Flower 1.39 pushes and pulls), from the records' public attributes only.
    """
    counter = _Counter()
    if type(content).__qualname__ != "RecordDict":
        counter.record(content)
        return counter.total
    children = {name: counter.record(rec) for name, rec in content.items()}
    body = len(json.dumps({name: "0" * _ID for name in content}).encode("utf-8"))
    counter.total += _object("RecordDict", len(set(children.values())), body)
    return counter.total
