"""Content addressing: a block's object key is the BLAKE3 hash of its bytes.

Every byte RocksDB writes through the mount is hashed once when its block is sealed, and
every block fetched is hashed again to check it: with SHA-256 that was the daemon's
largest single CPU cost (1.8 GB/s per core here), and BLAKE3 hashes a 4 MiB block almost
five times faster (8.5 GB/s). Blocks stored before that change keep their SHA-256
names: a key is checked against both (a collision across the two is as unlikely as one
within either), so old volumes read as they did; only their old blocks no longer dedup
against new writes of the same bytes.
"""

from __future__ import annotations

import hashlib

from blake3 import blake3

BLOCK_PREFIX = "blocks/"
# A small file's only block kept in the shared database's row of the block, not in the
# bucket (``--inline-max``): its key is its hash behind this prefix, so bytes in the
# database and the same bytes in the bucket never share a name.
INLINE_PREFIX = "db-"

# A block's bytes as the block store passes them around: a sealed block is a view of
# the buffer it was written in (fusestate.vfs.block_buffer), never copied on its way.
BlockData = bytes | bytearray | memoryview


def block_key(data: BlockData) -> str:
    """The name a new block is stored under."""
    return blake3(data).hexdigest()


def key_matches(key: str, data: BlockData) -> bool:
    """Whether ``data`` is the block named ``key`` (a BLAKE3 name, or a SHA-256 one from
    before BLAKE3)."""
    if key.startswith(INLINE_PREFIX):
        return inline_key(data) == key
    return block_key(data) == key or hashlib.sha256(data).hexdigest() == key


def inline_key(data: BlockData) -> str:
    """The name of a block whose bytes the database keeps."""
    return INLINE_PREFIX + block_key(data)


def is_inline(key: str) -> bool:
    """Whether the block's bytes are in the database, never in the bucket."""
    return key.startswith(INLINE_PREFIX)


def object_name(key: str) -> str:
    """Where a block lives in the bucket; two hex digits of fan-out keep listings small."""
    return f"{BLOCK_PREFIX}{key[:2]}/{key}"


def key_of_object(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def is_zero(data: BlockData) -> bool:
    # Most blocks are decided by their first or last byte; the rest by one memcmp against
    # zeros (bytes.count() would hold the GIL for about 1.4 ms per 4 MiB block).
    if not data:
        return True
    if data[0] or data[-1]:
        return False
    if isinstance(data, memoryview):
        data = data.tobytes()  # a memoryview compares byte by byte, 10x slower than memcmp
    return data == bytes(len(data))


def seal_digest(data: BlockData) -> str | None:
    """Key for a block about to be stored, or None for an all-zero block (kept as a hole)."""
    if is_zero(data):
        return None
    return block_key(data)
