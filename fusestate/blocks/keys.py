"""Content addressing: a block's object key is the SHA-256 of its bytes."""

from __future__ import annotations

import hashlib

BLOCK_PREFIX = "blocks/"


def block_key(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def object_name(key: str) -> str:
    """Where a block lives in the bucket; two hex digits of fan-out keep listings small."""
    return f"{BLOCK_PREFIX}{key[:2]}/{key}"


def key_of_object(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def is_zero(data: bytes | bytearray) -> bool:
    # Most blocks are decided by their first or last byte; the rest by one memcmp against
    # zeros (bytes.count() would hold the GIL for about 1.4 ms per 4 MiB block).
    if not data:
        return True
    if data[0] or data[-1]:
        return False
    return data == bytes(len(data))


def seal_digest(data: bytes | bytearray) -> str | None:
    """Key for a block about to be stored, or None for an all-zero block (kept as a hole)."""
    if is_zero(data):
        return None
    return block_key(data)
