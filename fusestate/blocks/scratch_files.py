"""Scratch files (``--scratch``) kept as plain files on the cache disk, one per inode.

A scratch file never leaves its node, so nothing needs its bytes in blocks: no hashing, no
block buffers, no staging, no block map in the metadata. Its writes go straight to a
backing file and its reads come back from it; the metadata keeps only its name, size and
times. This is most of what Spark writes (shuffle files, and the RocksDB working dirs
whose files reach the volume only when a commit links them out). A scratch file linked
out of its scratch dir is *promoted*: its bytes are read back, sealed into blocks and
uploaded, and it becomes a file of the volume (``FileSystem.link``). RocksDB's tables have
their blocks stored ahead of that link (``vfs/scratch_ahead.py``), the file itself staying here.

The page-aligned part of a write (all of it but a file's last partial page: the kernel's
writeback sends whole pages) goes to disk with ``O_DIRECT`` from a reused aligned buffer.
The mounted file's own pages already hold these bytes; a second copy in page-cache memory
would cost the daemon more CPU than everything else it does for the write (see
:mod:`fusestate.localio`). Writes, FUSE reads and truncates are short system calls made on
the event loop (a direct write of a MiB takes under a millisecond, less than handing it
to a thread costs); a promotion reads its blocks back in worker threads
(:meth:`ScratchFiles.read_block`).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections import OrderedDict
from typing import Iterator, NamedTuple, Optional

from fusestate import localio

OPEN_FILES = 256  # backing files kept open (Spark's shuffle has many files open at once)
ALIGN = localio.ALIGN


class _Fds(NamedTuple):
    buffered: int
    direct: Optional[int]  # None where the filesystem has no O_DIRECT


class ScratchFiles:
    def __init__(self, directory: str, reserve: int = 0) -> None:
        self.directory = directory
        # Free space on the cache disk that scratch files never take (the metadata must
        # always be able to write): reaching it is a full disk, as for staging.
        self.reserve = reserve
        self._fds: OrderedDict[int, _Fds] = OrderedDict()
        self._sizes: dict[int, int] = {}  # inode -> bytes its backing file may hold
        self.disk_full_failures = 0

    def clear(self) -> None:
        """Drop every backing file: the engine forgets the scratch files of the last mount."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        os.makedirs(self.directory, exist_ok=True)
        self._sizes.clear()

    def close(self) -> None:
        for fds in self._fds.values():
            _close(fds)
        self._fds.clear()

    def _path(self, ino: int) -> str:
        return os.path.join(self.directory, str(ino))

    def _open(self, ino: int, create: bool) -> Optional[_Fds]:
        fds = self._fds.get(ino)
        if fds is not None:
            self._fds.move_to_end(ino)
            return fds
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self._path(ino), flags | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            if create:
                raise
            return None
        try:
            fds = _Fds(fd, localio.open_direct(self._path(ino), os.O_RDWR))
        except BaseException:
            os.close(fd)
            raise
        self._fds[ino] = fds
        if len(self._fds) > OPEN_FILES:
            _close(self._fds.popitem(last=False)[1])
        return fds

    def fd(self, ino: int) -> int:
        """A descriptor of the file's backing file (made if missing), for FUSE passthrough:
        the kernel takes its own reference when it registers it."""
        fds = self._open(ino, create=True)
        assert fds is not None
        self._sizes.setdefault(ino, 0)
        return fds.buffered

    def stat(self, ino: int) -> Optional[os.stat_result]:
        """The backing file's size and times as the kernel's passthrough writes left them;
        None if it has none."""
        try:
            st = os.stat(self._path(ino))
        except FileNotFoundError:
            return None
        self._sizes[ino] = max(self._sizes.get(ino, 0), st.st_size)
        return st

    def adopt(self, ino: int, other: "ScratchFiles") -> None:
        """Take ``ino``'s backing file over from another store (same disk: a rename)."""
        other._close_fds(ino)
        size = other._sizes.pop(ino, 0)
        self._close_fds(ino)
        os.replace(other._path(ino), self._path(ino))
        self._sizes[ino] = size

    def _close_fds(self, ino: int) -> None:
        fds = self._fds.pop(ino, None)
        if fds is not None:
            _close(fds)

    def write(self, ino: int, offset: int, data: bytes | memoryview) -> None:
        end = offset + len(data)
        if self.reserve and end > self._sizes.get(ino, 0):
            try:
                localio.require_room(self.directory, len(data), self.reserve)
            except OSError:
                self.disk_full_failures += 1
                raise
        fds = self._open(ino, create=True)
        assert fds is not None
        view = memoryview(data)
        start, stop = -(-offset // ALIGN) * ALIGN, end // ALIGN * ALIGN  # the whole pages
        if fds.direct is not None and stop > start:
            localio.pwrite_all(fds.buffered, view[:start - offset], offset)
            localio.pwrite_aligned(fds.direct, view[start - offset:stop - offset], start)
            localio.pwrite_all(fds.buffered, view[stop - offset:], stop)
        else:
            localio.pwrite_all(fds.buffered, view, offset)
        if end > self._sizes.get(ino, 0):
            self._sizes[ino] = end

    def read(self, ino: int, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset``: a hole, or a range past what was written (the file
        was extended by a truncate), reads as zeros."""
        fds = self._open(ino, create=False)
        return _padded(os.pread(fds.buffered, size, offset) if fds is not None else b"", size)

    def read_block(self, ino: int, offset: int, size: int, direct: bool = True) -> bytes | memoryview:
        """``read`` for a worker thread, of a range no one reads again (a promotion's block,
        at a page-aligned offset): through a descriptor of its own, with ``O_DIRECT`` where
        the filesystem allows it, so it neither waits on the event loop nor fills page-cache
        memory. The file must not change meanwhile (the caller holds the file's lock).
        ``direct=False`` reads through the page cache (a file the kernel just wrote: its
        pages are dirty, and a direct read would wait for them to reach the disk first)."""
        if not direct:
            with open(self._path(ino), "rb", buffering=0) as f:
                return _padded(os.pread(f.fileno(), size, offset), size)
        direct_fd = localio.open_direct(self._path(ino), os.O_RDONLY)
        if direct_fd is None:
            with open(self._path(ino), "rb", buffering=0) as f:
                return _padded(os.pread(f.fileno(), size, offset), size)
        try:
            return _padded(localio.pread_aligned(direct_fd, offset, size), size)
        finally:
            os.close(direct_fd)

    def fine_ctime(self, tries: int = 200) -> bool:
        """Whether every write after an fstat changes the file's ctime here (the kernel's
        multigrain timestamps), tried on a file of this directory's filesystem."""
        probe = os.path.join(self.directory, ".ctime-probe")
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            for i in range(tries):
                os.pwrite(fd, b"a", i)
                before = os.fstat(fd).st_ctime_ns
                os.pwrite(fd, b"b", i)
                if os.fstat(fd).st_ctime_ns == before:
                    return False
            return True
        finally:
            os.close(fd)
            os.unlink(probe)

    def data_blocks(self, ino: int, block_size: int) -> set[int]:
        """The indexes of the blocks that hold any data (not all hole): a sparse file's
        holes are never read (SEEK_DATA / SEEK_HOLE)."""
        out: set[int] = set()
        for start, end in self._data_extents(ino):
            out.update(range(start // block_size, (end - 1) // block_size + 1))
        return out

    def filled_blocks(self, ino: int, block_size: int) -> set[int]:
        """The indexes of the blocks with no hole at all: every byte of them written (a block
        whose writes came out of order is not, until the last of them has)."""
        out: set[int] = set()
        for start, end in self._data_extents(ino):
            out.update(range(-(-start // block_size), end // block_size))
        return out

    def _data_extents(self, ino: int) -> Iterator[tuple[int, int]]:
        """The file's ranges of data, ``[start, end)``, between its holes."""
        fd = os.open(self._path(ino), os.O_RDONLY | os.O_CLOEXEC)
        try:
            pos = 0
            while True:
                try:
                    start = os.lseek(fd, pos, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # no data past pos
                        return
                    raise
                end = os.lseek(fd, start, os.SEEK_HOLE)
                yield start, end
                pos = end
        finally:
            os.close(fd)

    def truncate(self, ino: int, size: int) -> None:
        fds = self._open(ino, create=size > 0)
        if fds is not None:
            os.ftruncate(fds.buffered, size)
            self._sizes[ino] = size

    def remove(self, ino: int) -> None:
        """The file is deleted, or promoted to the volume: its backing file goes."""
        fds = self._fds.pop(ino, None)
        if fds is not None:
            _close(fds)
        if self._sizes.pop(ino, None) is not None or fds is not None:
            try:
                os.unlink(self._path(ino))
            except FileNotFoundError:
                pass

    @property
    def files(self) -> int:
        return len(self._sizes)

    @property
    def bytes(self) -> int:
        """Apparent size of the backing files (holes count): an upper bound of their disk use."""
        return sum(self._sizes.values())


def _padded(data: bytes | memoryview, size: int) -> bytes | memoryview:
    return data if len(data) == size else bytes(data) + bytes(size - len(data))


def _close(fds: _Fds) -> None:
    os.close(fds.buffered)
    if fds.direct is not None:
        os.close(fds.direct)
