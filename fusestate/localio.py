"""Local file writes sized for the page cache, and written back as they go.

On the kernels we run on, one multi-MiB ``write()`` into a new file costs about ten
times the CPU of the same bytes written in pieces of 1 MiB or less (measured: 4 MiB
writes ~350 MB/s of system time, 1 MiB writes ~3 GB/s). Every block the daemon
stages or caches goes through here.

Left alone, the kernel lets gigabytes of such writes sit dirty in the page cache, and
then any fsync on the cache disk (RocksDB's, SQLite's, the staging area's) can wait
behind them for seconds. :func:`start_writeback` starts writing a finished block out at
once, asynchronously, as RocksDB's ``bytes_per_sync`` does.
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


SYNC_FILE_RANGE_WRITE = 2
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


def write_file(f: BinaryIO, data: bytes | bytearray | memoryview, fsync: bool = False) -> None:
    """Write a whole block file: in page-cache-sized pieces, then written back (and
    fsynced, if asked) before it is closed."""
    write_all(f, data)
    f.flush()
    if fsync:
        os.fsync(f.fileno())
    else:
        start_writeback(f.fileno())
