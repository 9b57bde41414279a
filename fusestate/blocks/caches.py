"""Read caches: a memory LRU and a size-bounded disk cache that verifies what it returns."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import diskcache
from diskcache.core import MODE_BINARY, UNKNOWN

from fusestate.blocks.keys import BlockData, key_matches
from fusestate.localio import read_whole, write_file

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    miss_bytes: int = 0
    evictions: int = 0
    corrupt: int = 0


class MemoryCache:
    """LRU of immutable block bytes, bounded by total size. Used only on the event loop."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.used = 0
        self.stats = TierStats()
        self._items: OrderedDict[str, BlockData] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str) -> Optional[BlockData]:
        data = self._items.get(key)
        if data is None:
            self.stats.misses += 1
            return None
        self._items.move_to_end(key)
        self.stats.hits += 1
        self.stats.hit_bytes += len(data)
        return data

    def put(self, key: str, data: BlockData) -> None:
        """Keep a block; the caller hands it over and never writes to it again."""
        if len(data) > self.limit:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.used -= len(old)
        self._items[key] = data
        self.used += len(data)
        while self.used > self.limit:
            _, evicted = self._items.popitem(last=False)
            self.used -= len(evicted)
            self.stats.evictions += 1


class _Adopt:
    """A value for DiskCache: an existing file to take over by hard link, not by copy."""

    def __init__(self, path: str) -> None:
        self.path = path


class _BlockDisk(diskcache.Disk):
    """diskcache storage for blocks: adopts a block file already written elsewhere on
    the cache disk by hard link, without copying its bytes.

    A sealed block is already on the cache disk in the staging area; linking it into
    the cache saves writing 4 MiB again for every uploaded block. A fetched block is
    written beside the cache first, outside diskcache's lock, then adopted the same way.
    """

    def store(self, value, read, key=UNKNOWN):  # type: ignore[no-untyped-def]
        if not isinstance(value, _Adopt):
            return super().store(value, read, key=key)

        def create(path: str) -> None:
            os.link(value.path, path)

        filename, full_path = self.filename(key, value)
        try:
            self._create(full_path, create)
        except OSError as exc:
            if not isinstance(value, _Adopt) or exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK,
                                                                   errno.ENOTSUP):
                raise
            with open(value.path, "rb") as f:  # another filesystem: copy after all
                return super().store(f, True, key=key)
        return os.path.getsize(full_path), MODE_BINARY, filename, None

    @staticmethod
    def _create(full_path: str, create: Callable[[str], None]) -> None:
        """diskcache removes directories it empties on eviction, possibly between our
        mkdir and our create: try again, as diskcache's own writer does."""
        directory = os.path.dirname(full_path)
        for attempt in range(10):
            with contextlib.suppress(OSError):
                os.makedirs(directory)
            try:
                create(full_path)
                return
            except FileNotFoundError:
                if attempt == 9:
                    raise


KEY_MEMORY = 65536  # keys remembered as known good (about 8 MB at most)


class KeySet:
    """A bounded LRU set of keys, safe to share between the event loop and worker threads."""

    def __init__(self, limit: int) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            if len(self._keys) > self._limit:
                self._keys.popitem(last=False)

    def discard(self, key: str) -> None:
        self.take(key)

    def take(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""
        with self._lock:
            if key not in self._keys:
                return False
            del self._keys[key]
            return True

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._keys


class DiskCache:
    """Blocks on local disk (diskcache), LRU-evicted at a size limit.

    An entry is re-hashed the first time this process reads it: a corrupt entry is
    dropped and reported as a miss, so the caller fetches it again. Entries this
    process wrote or has verified are trusted after that: a small read costs a small
    ``pread`` instead of loading and hashing 4 MiB, and a whole-block read is not hashed
    again. Every insert goes through this object, so it also knows which keys are
    certainly not here (never stored, or just missed): ``known_absent`` lets the event
    loop skip a worker-thread hop for them. Methods other than ``known_absent`` block:
    call them from worker threads.

    Every diskcache call holds one lock, and no block's bytes are read or written under
    it: an LRU lookup is a SQLite write transaction, and threads that meet one in SQLite
    itself sleep in its busy handler for milliseconds at a time.
    """

    def __init__(self, directory: str, limit_bytes: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self._incoming = os.path.join(directory, "incoming")
        shutil.rmtree(self._incoming, ignore_errors=True)  # left by a crash mid-put
        os.makedirs(self._incoming)
        self._lock = threading.Lock()
        self._cache = diskcache.Cache(
            directory,
            size_limit=limit_bytes,
            eviction_policy="least-recently-used",
            disk=_BlockDisk,
            cull_limit=16,
            disk_min_file_size=0,
            statistics=False,
        )
        self.limit = limit_bytes
        self.stats = TierStats()
        self._trusted = KeySet(KEY_MEMORY)
        self.lent = 0  # bytes of the limit lent to another user of the cache disk (passthrough's kept files)
        # Every key the index may hold: a superset, since entries that diskcache culls to
        # make room stay in it until a read misses them. A key not in it is certainly not
        # here (never stored, or missed and not stored since), so a fresh node's first read
        # of each block goes straight to the bucket instead of taking a worker thread and an
        # SQLite transaction to learn that.
        self._maybe_present: set[str] = set(self._cache.iterkeys())
        self._rebuild_present_at = self._present_bound()

    def lend(self, nbytes: int) -> int:
        """Give ``nbytes`` of the limit to another user of the cache disk (the backing files
        passthrough keeps for their readers): the cache shrinks by as much. Returns the bytes
        lent."""
        nbytes = max(0, min(nbytes, self.limit))
        self.limit -= nbytes
        self.lent += nbytes
        with self._lock:
            self._cache.reset("size_limit", self.limit)
        return nbytes

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock; diskcache's SQLite errors (a full disk above all) become OSErrors,
        which every caller already handles as a failing cache disk."""
        with self._lock:
            try:
                yield
            except sqlite3.Error as exc:
                full = "full" in str(exc)
                raise OSError(errno.ENOSPC if full else errno.EIO, f"disk cache index: {exc}") from exc

    def known_absent(self, key: str) -> bool:
        """True when this block is certainly not here: never stored, or missed and not
        stored since (cheap; any thread)."""
        return key not in self._maybe_present

    def _missed(self, key: str) -> None:
        self._trusted.discard(key)
        self._maybe_present.discard(key)
        self.stats.misses += 1

    def _present_bound(self) -> int:
        return 2 * len(self._maybe_present) + 1024

    def _note_stored(self, key: str) -> None:
        """Under the lock: a key just stored. Culled keys pile up in the superset of present
        keys; past twice what it held last time, it is read again from the index."""
        self._maybe_present.add(key)
        if len(self._maybe_present) > self._rebuild_present_at:
            self._maybe_present = set(self._cache.iterkeys())
            self._rebuild_present_at = self._present_bound()

    def get_range(self, key: str, start: int, end: int) -> Optional[bytes]:
        """Bytes [start, end) of a cached block, or None on a miss."""
        if key not in self._trusted:
            data = self.get(key)
            return None if data is None else bytes(data[start:end])
        with self._locked():
            handle = self._cache.get(key, default=None, read=True)  # also refreshes its LRU position
            if handle is None:
                self._missed(key)
                return None
        with handle:
            handle.seek(start)
            chunk = handle.read(max(0, end - start))
        self.stats.hits += 1
        self.stats.hit_bytes += len(chunk)
        return chunk

    def get(self, key: str) -> Optional[BlockData]:
        with self._locked():
            handle = self._cache.get(key, default=None, read=True)
            if handle is None:
                self._missed(key)
                return None
        with handle:  # an eviction meanwhile unlinks the file; this open handle still reads it
            data = read_whole(handle.fileno())
        if key not in self._trusted and not key_matches(key, data):
            log.error("disk cache entry %s is corrupt; dropping it and fetching again", key[:16])
            self.stats.corrupt += 1
            with self._locked():
                # A good copy may have been stored while this thread hashed the bad one (the
                # fetch another reader started on finding it corrupt): keep that one.
                stored_meanwhile = key in self._trusted
                if not stored_meanwhile:
                    self._cache.delete(key)
                    self._missed(key)
            return self.get(key) if stored_meanwhile else None
        self._trusted.add(key)
        self.stats.hits += 1
        self.stats.hit_bytes += len(data)
        return data

    def __contains__(self, key: str) -> bool:
        with self._locked():
            return key in self._cache

    def put(self, key: str, data: BlockData, on_disk_only: bool = False) -> None:
        """Keep a verified block (its bytes hash to ``key``), never in the page cache: the
        memory cache has it. ``on_disk_only`` (a prefetch into the disk tier, from a
        thread in the idle I/O class) writes through the page cache and drops the pages,
        since direct I/O would wait behind every other reader of the disk."""
        path = os.path.join(self._incoming, f"{key}.{threading.get_ident()}")
        try:
            with open(path, "xb") as f:
                write_file(f, data, keep_cached=False, direct=not on_disk_only)
            self.adopt(key, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def adopt(self, key: str, path: str) -> None:
        """Take over the file at ``path`` (a hard link; the caller may then unlink it), a
        sealed block whose key was computed from these very bytes."""
        with self._locked():
            before = len(self._cache)
            self._cache.set(key, _Adopt(path))
            evicted = before + 1 - len(self._cache)
            # Under the same lock as the insert: a reader that missed, or found a corrupt
            # copy, decides under it too, so it cannot mark this good entry absent or drop it.
            self._note_stored(key)
            self._trusted.add(key)
        if evicted > 0:
            self.stats.evictions += evicted

    def evict(self, nbytes: int) -> int:
        """Make room on a full disk: cull least-recently-used entries; returns bytes freed."""
        with self._locked():
            before = self._cache.volume()
            self._cache.reset("size_limit", max(0, before - nbytes))
            self._cache.cull()
            self._cache.reset("size_limit", self.limit)
            return max(0, before - self._cache.volume())

    @property
    def used(self) -> int:
        with self._locked():
            return self._cache.volume()

    def __len__(self) -> int:
        with self._locked():
            return len(self._cache)

    def close(self) -> None:
        with self._locked():
            self._cache.close()
