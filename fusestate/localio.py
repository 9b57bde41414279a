"""Local block files: written in page-cache-sized pieces, written back as they go, and
out of the page cache once nobody will read them from there.

Every block the daemon stages or caches goes through here.

Left alone, the kernel lets gigabytes of such writes sit dirty in the page cache, and
then any fsync on the cache disk (RocksDB's, SQLite's, the staging area's) can wait
behind them for seconds. :func:`start_writeback` starts writing a finished block out at
once, asynchronously, as RocksDB's ``bytes_per_sync`` does.

A block the application wrote is already in the kernel's page cache once, as the mounted
file's pages. Its staging file and its ``file://`` bucket object would be a second and a
third copy, and a page cache that grows costs far more than one that reuses its pages:
on our VMs, writing 1 GiB into new page-cache memory costs about 3 s of system time,
against 0.5 s when freed pages are reused. :func:`drop_cached` and :func:`release` hand
such copies back once they are on disk.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import BinaryIO, Optional

CHUNK = 1 << 20


def write_all(f: BinaryIO, data: bytes | bytearray | memoryview) -> int:
    """Write ``data`` to an unbuffered-or-flushed binary file in page-cache-friendly pieces."""
    view = memoryview(data)
    for start in range(0, len(view), CHUNK):
        f.write(view[start:start + CHUNK])
    return len(view)


SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2
SYNC_FILE_RANGE_WAIT_AFTER = 4
# The C library, for the Linux calls Python's os module lacks (sync_file_range, syncfs,
# ioprio_set); None where it cannot be loaded.
libc: Optional[ctypes.CDLL]
try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
except OSError:
    libc = None
_sync_file_range = getattr(libc, "sync_file_range", None)  # not Linux: the kernel's own writeback will do
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to disk without waiting for them."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)


def write_file(f: BinaryIO, data: bytes | bytearray | memoryview, fsync: bool = False,
               keep_cached: bool = True) -> None:
    """Write a whole block file: in page-cache-sized pieces, then written back (and
    fsynced, if asked) before it is closed; ``keep_cached=False`` waits for the write-back
    and drops the file's pages (a block for the disk tier only)."""
    write_all(f, data)
    f.flush()
    fd = f.fileno()
    if fsync:
        os.fsync(fd)
    elif keep_cached:
        start_writeback(fd)
    else:
        _wait_written_back(fd)
    if not keep_cached:
        drop_cached(fd)


def _wait_written_back(fd: int) -> None:
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER)


def drop_cached(fd: int) -> None:
    """Let the kernel drop the file's clean pages (dirty ones stay until written back)."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


def release(path: str) -> None:
    """Write a block file written earlier back, waiting for it, and drop its pages from
    the page cache: the file stays on disk, its memory is reused for the next block."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        _wait_written_back(fd)
        drop_cached(fd)
    finally:
        os.close(fd)
