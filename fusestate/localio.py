"""Local file writes sized for the page cache.

On the kernels we run on, one multi-MiB ``write()`` into a new file costs about ten
times the CPU of the same bytes written in pieces of 1 MiB or less (measured: 4 MiB
writes ~350 MB/s of system time, 1 MiB writes ~3 GB/s). Every block the daemon
stages or caches goes through here.
"""

from __future__ import annotations

from typing import BinaryIO

CHUNK = 1 << 20


def write_all(f: BinaryIO, data: bytes | bytearray | memoryview) -> int:
    """Write ``data`` to an unbuffered-or-flushed binary file in page-cache-friendly pieces."""
    view = memoryview(data)
    for start in range(0, len(view), CHUNK):
        f.write(view[start:start + CHUNK])
    return len(view)
