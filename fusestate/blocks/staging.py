"""The staging area: sealed blocks on local disk until they are in the bucket.

Files are named by their key and written with temp-file + rename, so a crash
never leaves a torn block under a real name. They survive a daemon crash and
are uploaded by the next mount.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading

from fusestate.blocks.keys import BlockData
from fusestate.localio import has_room, read_file, read_range, require_room, write_file


class Staging:
    """Blocking file operations; call them from worker threads."""

    def __init__(self, directory: str, reserve: int = 0) -> None:
        self.directory = directory
        # Free space on the disk that staging never takes: the metadata (SQLite) must always
        # be able to write, so reaching it counts as a full disk.
        self.reserve = reserve
        # Held from a writer's check for room until its block's room is allocated on disk.
        self._room_lock = threading.Lock()
        os.makedirs(directory, exist_ok=True)

    def has_room(self, nbytes: int) -> bool:
        return has_room(self.directory, nbytes, self.reserve)

    def _take_room(self, fd: int, nbytes: int) -> None:
        """Allocate a block's room in its file before writing it, or refuse with ENOSPC.

        The check and the allocation happen under one lock, and the disk shows an allocation
        at once: concurrent writers can neither all see the same room (and overshoot the
        reserve) nor count a finished write twice (and refuse a write that fits)."""
        if not self.reserve or not nbytes:
            return
        with self._room_lock:
            require_room(self.directory, nbytes, self.reserve)
            os.posix_fallocate(fd, 0, nbytes)

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key)

    def write(self, key: str, data: BlockData, fsync: bool = False) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                self._take_room(f.fileno(), len(data))
                # Not kept in the page cache: the upload reads it once, from disk.
                write_file(f, data, fsync=fsync, keep_cached=False, direct=True)
            os.replace(tmp, self.path(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read(self, key: str) -> BlockData | None:
        try:
            return read_file(self.path(key))
        except FileNotFoundError:
            return None

    def read_range(self, key: str, start: int, end: int) -> bytes | None:
        try:
            return read_range(self.path(key), start, end)
        except FileNotFoundError:
            return None

    def fsync(self, keys: list[str]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(self.path(key), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def keys(self) -> list[str]:
        """Staged keys; leftover temp files from a crash are removed."""
        found = []
        for name in os.listdir(self.directory):
            if name.startswith(".tmp-"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))
            else:
                found.append(name)
        return found
