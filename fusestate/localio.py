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
against 0.5 s when freed pages are reused. Such copies are handed back once they are
on disk (:func:`drop_cached`), by whoever wrote or read them.

Better still, a block that nobody reads from the page cache never goes through it:
:func:`write_file` with ``direct=True`` (staging) and :func:`copy_direct` (`file://` uploads) use ``O_DIRECT``
where the filesystem allows it, so the disk reads and writes the block straight from
our buffer. While Spark ran its 2 GB state through a mount, the kernel's copies into
page-cache memory were a third of the daemon's CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import BinaryIO, Optional

CHUNK = 1 << 20


def read_range(path: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a local file (shorter at its end): one ``pread``, no file object."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, max(0, end - start), start)
    finally:
        os.close(fd)


@dataclass
class _OpenFile:
    fd: int
    users: int = 0
    dropped: bool = False  # out of the table: the last user closes it


class OpenFiles:
    """Read-only descriptors of immutable files (``file://`` bucket objects), kept open in
    a bounded LRU so that a small read costs one ``pread``: no path lookup, no open and
    close. Shared by the event loop and worker threads; a descriptor dropped from the
    table while a read uses it is closed by that read."""

    def __init__(self, limit: int = 128) -> None:
        self._limit = limit
        self._files: OrderedDict[str, _OpenFile] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file (shorter at its end): one ``pread``."""
        f = self._acquire(path)
        try:
            return os.pread(f.fd, max(0, end - start), start)
        finally:
            self._release(f)

    def _acquire(self, path: str) -> _OpenFile:
        with self._lock:
            f = self._files.get(path)
            if f is not None:
                self._files.move_to_end(path)
                f.users += 1
                return f
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        opened = _OpenFile(fd, users=1)
        evicted: list[_OpenFile] = []
        with self._lock:
            f = self._files.get(path)
            if f is not None:  # another thread opened it meanwhile: use that one
                f.users += 1
            else:
                f = self._files[path] = opened
                while len(self._files) > self._limit:
                    evicted.append(self._files.popitem(last=False)[1])
        if f is not opened:
            os.close(fd)
        for old in evicted:
            self._drop(old)
        return f

    def _release(self, f: _OpenFile) -> None:
        with self._lock:
            f.users -= 1
            close = f.dropped and f.users == 0
        if close:
            os.close(f.fd)

    def _drop(self, f: _OpenFile) -> None:
        with self._lock:
            f.dropped = True
            close = f.users == 0
        if close:
            os.close(f.fd)

    def forget(self, path: str) -> None:
        """The file was removed or replaced: close its descriptor (once no read uses it)."""
        with self._lock:
            f = self._files.pop(path, None)
        if f is not None:
            self._drop(f)

    def close(self) -> None:
        with self._lock:
            files = list(self._files.values())
            self._files.clear()
        for f in files:
            self._drop(f)


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
               keep_cached: bool = True, direct: bool = False) -> None:
    """Write a whole block file: in page-cache-sized pieces, then written back (and
    fsynced, if asked) before it is closed; ``keep_cached=False`` waits for the write-back
    and drops the file's pages (a block for the disk tier only).

    ``direct=True``: written with ``O_DIRECT`` where the filesystem allows it (never in
    the page cache). Only for a writer at normal I/O priority: direct I/O is issued by
    the writing thread itself, so a writer in the idle I/O class (cache warming) would
    wait for every other reader of the disk, where buffered writes leave the kernel's
    flusher threads to write the pages."""
    f.flush()
    if direct and f.tell() == 0 and _write_direct(f.fileno(), data):
        if fsync:
            os.fsync(f.fileno())
        return
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


ALIGN = 4096  # O_DIRECT wants buffer, offset and length aligned to the device's blocks
_buffers = threading.local()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _aligned_buffer(size: int) -> mmap.mmap:
    """This thread's page-aligned buffer of at least ``size`` bytes (reused: blocks are
    written one at a time per worker thread)."""
    buf: Optional[mmap.mmap] = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < size:
        buf = mmap.mmap(-1, max(_aligned(size), 4 << 20))
        _buffers.buf = buf
    return buf


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for an open file; False where the filesystem refuses."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    return True


def address_of(data: bytearray | memoryview) -> int:
    """Where a writable buffer's bytes start in memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(data))


def aligned_bytes(size: int) -> memoryview:
    """A new zeroed buffer of ``size`` bytes starting on a page, as a writable view: heap
    memory (unlike :func:`_aligned_buffer`'s reused mmap), freed with its last view."""
    raw = bytearray(size + ALIGN)
    offset = -address_of(raw) % ALIGN
    return memoryview(raw)[offset:offset + size]


def _read_into(fd: int, view: memoryview, size: int, offset: int = 0) -> int:
    """Read ``size`` bytes of a file from ``offset`` into ``view``; how many there were."""
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _is_aligned(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``O_DIRECT`` can write ``data`` as it is: a whole number of pages that
    starts on a page (a full block from a :class:`~fusestate.vfs.block_buffer.BlockBuffer`)."""
    if not data or len(data) % ALIGN:
        return False
    try:
        return address_of(data) % ALIGN == 0
    except TypeError:  # read-only (bytes): its address is not ours to take
        return False


def _write_direct(fd: int, data: bytes | bytearray | memoryview) -> bool:
    """Write ``data`` as the whole content of an empty file, bypassing the page cache;
    False (nothing written) where ``O_DIRECT`` is not available. Written straight from
    ``data`` where it is aligned, else from a copy in an aligned buffer."""
    n = len(data)
    if _is_aligned(data):
        return _write_buffer_direct(fd, data, n)
    buf = _aligned_buffer(n)
    buf[:n] = data
    return _write_buffer_direct(fd, buf, n)


def _write_buffer_direct(fd: int, buf: mmap.mmap | bytearray | memoryview, n: int) -> bool:
    """Write the first ``n`` bytes of an aligned buffer to an empty file with ``O_DIRECT``.
    The last piece is padded to the alignment and the file cut back to ``n``."""
    if not _set_direct(fd, True):
        return False
    padded = _aligned(n)
    try:
        if padded != n:
            buf[n:padded] = bytes(padded - n)
        with memoryview(buf) as view:
            done = 0
            while done < padded:
                done += os.pwrite(fd, view[done:padded], done)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        os.ftruncate(fd, 0)  # the device wants another alignment: the caller writes through the page cache
        return False
    finally:
        _set_direct(fd, False)
    if padded != n:
        os.ftruncate(fd, n)
    return True


def has_room(directory: str, nbytes: int, reserve: int) -> bool:
    """Whether ``nbytes`` more fit on ``directory``'s disk with ``reserve`` bytes left free."""
    return shutil.disk_usage(directory).free - nbytes >= reserve


def require_room(directory: str, nbytes: int, reserve: int) -> None:
    """ENOSPC unless ``has_room``: the space the metadata must always be able to write in
    counts as full."""
    if not has_room(directory, nbytes, reserve):
        raise OSError(errno.ENOSPC, "cache disk full (the space kept free for the metadata reached)")


def open_direct(path: str, flags: int) -> Optional[int]:
    """A second descriptor of ``path`` with ``O_DIRECT``; None where the filesystem refuses it."""
    try:
        return os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (a write may take less than it is given)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def pwrite_aligned(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write ``data`` (a whole number of pages, at a page-aligned offset) through an
    ``O_DIRECT`` descriptor, from a copy in this thread's reused aligned buffer: the disk
    takes the bytes from memory that is already ours, no page-cache memory is filled."""
    n = len(data)
    buf = _aligned_buffer(min(n, 4 << 20))
    with memoryview(buf) as view:
        for done in range(0, n, len(buf)):
            piece = min(n - done, len(buf))
            view[:piece] = data[done:done + piece]
            pwrite_all(fd, view[:piece], offset + done)


def pread_aligned(fd: int, offset: int, size: int) -> memoryview:
    """Up to ``size`` bytes from a page-aligned ``offset`` through an ``O_DIRECT``
    descriptor, into a new aligned buffer (shorter at the end of the file)."""
    view = aligned_bytes(_aligned(size))
    return view[:_read_into(fd, view, size, offset)]


def read_whole(fd: int) -> bytes | memoryview:
    """The whole content of an open block file. Read with ``O_DIRECT`` into a page-aligned
    buffer where the filesystem allows it: the disk puts the bytes straight into it, with
    no page-cache copy to allocate, fill and copy out (the memory cache keeps what is
    read again). Through the page cache otherwise."""
    size = os.fstat(fd).st_size
    if size and _set_direct(fd, True):
        try:
            view = aligned_bytes(_aligned(size))
            return view[:_read_into(fd, view, size)]
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        finally:
            _set_direct(fd, False)
    parts = []
    got = 0
    while chunk := os.pread(fd, max(CHUNK, size - got), got):
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_file(path: str) -> bytes | memoryview:
    """A whole block file, as :func:`read_whole` reads it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return read_whole(fd)
    finally:
        os.close(fd)


def copy_direct(src_path: str, out_fd: int) -> Optional[int]:
    """Copy a whole block file into an empty file, neither side passing through the page
    cache; None (nothing copied) where ``O_DIRECT`` is not available on either side."""
    try:
        src = os.open(src_path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise
    try:
        size = os.fstat(src).st_size
        buf = _aligned_buffer(size)
        with memoryview(buf) as view:
            got = _read_into(src, view, size)
        if got < size:
            raise OSError(errno.EIO, f"{src_path} ended at {got} of {size} bytes")
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise
    finally:
        os.close(src)
    return size if _write_buffer_direct(out_fd, buf, size) else None


def _wait_written_back(fd: int) -> None:
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER)


def drop_cached(fd: int) -> None:
    """Let the kernel drop the file's clean pages (dirty ones stay until written back)."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass

