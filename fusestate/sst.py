"""Where a RocksDB table file's data blocks end and its index, filters and footer begin.

A block-based table (RocksDB's ``.sst``) is its data blocks, then its meta blocks (filters,
index, properties, the meta index) and a fixed-size footer. Opening a table reads only the
part after the data blocks; a point lookup then reads one data block. So a node that brings a
table in from the bucket fetches that tail first and leaves the data blocks to be read on
demand (fusestate.fuse.page_fill).

The boundary is the table property ``rocksdb.data.size`` (the data blocks start at offset 0
and end there). It takes reading the footer, then the meta index it points to, then the
properties block the meta index names. :func:`data_end_steps` does that as a generator that
names each byte range it needs and is sent the bytes, so that the same parse serves a blocking
reader (:func:`data_end_of_file`) and the daemon's asynchronous one.

Formats: footers of format versions 0 (legacy magic) to 5, as written by RocksDB 5 to 9 and by
Spark's state store (its default ``formatVersion`` is 5). Anything else is not a table: the
result is None and the caller treats the file as plain bytes.
"""

from __future__ import annotations

import struct
from typing import Awaitable, Callable, Generator, NamedTuple, Optional

MAGIC = 0x88E241B785F4CFF7          # block-based table, footer with a checksum type and a version
LEGACY_MAGIC = 0xDB4775248B80FB57   # block-based table, format version 0
FOOTER_BYTES = 53                   # checksum type (1), two block handles padded to 40, version (4), magic (8)
LEGACY_FOOTER_BYTES = 48            # two block handles padded to 40, magic (8)
MAX_FORMAT_VERSION = 5
BLOCK_TRAILER = 5                   # compression type (1) and checksum (4) after each block
TAIL_GUESS = 16 * 1024              # the first read: the footer and, usually, the meta index and properties
DATA_SIZE = b"rocksdb.data.size"
PROPERTIES = b"rocksdb.properties"

# A step asks for (offset, length) and is sent the bytes read there.
Steps = Generator[tuple[int, int], bytes, Optional[int]]


class Handle(NamedTuple):
    offset: int
    size: int


class NotATable(ValueError):
    """The bytes are not a block-based table this module reads."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise NotATable("a varint runs past its block")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def parse_footer(tail: bytes) -> tuple[Handle, Handle]:
    """The meta index and index handles from bytes that end where the file ends."""
    if len(tail) < LEGACY_FOOTER_BYTES:
        raise NotATable("shorter than a footer")
    magic = struct.unpack_from("<Q", tail, len(tail) - 8)[0]
    if magic == LEGACY_MAGIC:
        pos = len(tail) - LEGACY_FOOTER_BYTES
    elif magic == MAGIC:
        if len(tail) < FOOTER_BYTES:
            raise NotATable("shorter than a footer")
        version = struct.unpack_from("<I", tail, len(tail) - 12)[0]
        if not 1 <= version <= MAX_FORMAT_VERSION:
            raise NotATable(f"table format version {version}")
        pos = len(tail) - FOOTER_BYTES + 1  # after the checksum type
    else:
        raise NotATable("no table magic number")
    meta_offset, pos = _varint(tail, pos)
    meta_size, pos = _varint(tail, pos)
    index_offset, pos = _varint(tail, pos)
    index_size, pos = _varint(tail, pos)
    return Handle(meta_offset, meta_size), Handle(index_offset, index_size)


def parse_block(block: bytes) -> dict[bytes, bytes]:
    """The entries of an uncompressed block (the meta index and properties blocks are
    written uncompressed): keys are prefix-compressed against the entry before."""
    if len(block) < 4:
        raise NotATable("block shorter than its restart count")
    restarts = struct.unpack_from("<I", block, len(block) - 4)[0] & 0x7FFFFFFF
    end = len(block) - 4 - 4 * restarts
    if end < 0:
        raise NotATable("restart array larger than its block")
    entries: dict[bytes, bytes] = {}
    key = b""
    pos = 0
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        value_len, pos = _varint(block, pos)
        if shared > len(key) or pos + unshared + value_len > end:
            raise NotATable("a block entry runs past its block")
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        entries[key] = block[pos:pos + value_len]
        pos += value_len
    return entries


def _handle(value: bytes) -> Handle:
    offset, pos = _varint(value, 0)
    size, _ = _varint(value, pos)
    return Handle(offset, size)


def data_end_steps(file_size: int) -> Steps:
    """Where the data blocks of a table of ``file_size`` bytes end: a generator that yields the
    byte ranges it needs and is sent their bytes; it returns the offset, or None for a file
    that is not a table this module reads."""
    if file_size < LEGACY_FOOTER_BYTES:
        return None
    start = max(0, file_size - TAIL_GUESS)
    tail = yield (start, file_size - start)

    def block_at(handle: Handle) -> Steps:
        if handle.offset + handle.size > file_size:
            raise NotATable("a block handle points past the end")
        if handle.offset >= start:
            return tail[handle.offset - start:handle.offset - start + handle.size]
        return (yield (handle.offset, handle.size))

    try:
        meta_handle, index_handle = parse_footer(tail)
        meta = parse_block((yield from block_at(meta_handle)))
        if PROPERTIES in meta:
            properties = parse_block((yield from block_at(_handle(meta[PROPERTIES]))))
            if DATA_SIZE in properties:
                end, _ = _varint(properties[DATA_SIZE], 0)
                if 0 < end <= file_size:
                    return end
        # No data size: the meta blocks begin at the lowest block the meta index or footer names.
        return min([index_handle.offset, meta_handle.offset] + [_handle(v).offset for v in meta.values()])
    except NotATable:
        return None


def run_steps(steps: Steps, read: Callable[[int, int], bytes]) -> Optional[int]:
    """Drive :func:`data_end_steps` with a blocking reader of (offset, length)."""
    try:
        want = next(steps)
        while True:
            want = steps.send(read(*want))
    except StopIteration as done:
        return done.value


async def run_steps_async(steps: Steps, read: Callable[[int, int], Awaitable[bytes]]) -> Optional[int]:
    """Drive :func:`data_end_steps` with an asynchronous reader of (offset, length)."""
    try:
        want = next(steps)
        while True:
            want = steps.send(await read(*want))
    except StopIteration as done:
        return done.value


def data_end_of_file(path: str) -> Optional[int]:
    """Where the data blocks of the table at ``path`` end (None: not a table)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)

        def read(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        return run_steps(data_end_steps(size), read)
