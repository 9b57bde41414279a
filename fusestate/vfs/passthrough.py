"""FUSE passthrough: files whose bytes the kernel reads and writes in a local file.

With the native front end on a kernel that allows it (Linux 6.9+, CAP_SYS_ADMIN), an open
can be answered with a *backing file*: the kernel then serves the file's reads, writes and
mmap from that file, and none of them reaches the daemon. Which opens get one:

| the file | its backing file |
|---|---|
| a scratch file of this node | its scratch file (``scratch/<inode>``) |
| a volume file opened for writing | ``backing/<inode>``, filled from its blocks if it has content |
| a volume file opened for reading while it has one | the same file |
| a volume file opened for reading after it was written here | the backing file its writer left, if its content is still the file's |

Every other open goes through the daemon as before. The kernel allows one backing file per
inode, and no mix of passthrough and daemon-served opens of one inode: an open of a file
that already has daemon-served handles is served by the daemon too.

A volume file's bytes reach its blocks when it is *sealed*: at the close of a writing
handle, at fsync and at the last release, each block of the backing file is hashed, the
changed ones are stored (staged; put in the bucket before the commit on a shared volume, and
by an fsync that waits for the bucket) and committed with the file's size and mtime, as the
block path commits them; while a writer keeps the file open, the blocks its size has passed
are sealed ahead every 0.1 s. fsync durability, the journal's order and close-to-open
visibility on a shared volume are therefore the block path's. After
the file's last handle the backing file is kept for the next reader (RocksDB reads the SSTs
it wrote: compactions, lookups) while the file's size and blocks are what it holds, within a
quarter of the read cache's size, oldest dropped first. A daemon killed before a seal loses
what was not fsynced, as it does on the block path; the next mount starts without backing
files.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Optional

import trio

from fusestate.blocks.scratch_files import ScratchFiles
from fusestate.vfs.errors import FsError, commit_error
from fusestate.vfs.open_file import OpenFile, content_version
from fusestate.vfs.tasks import each_at_once

if TYPE_CHECKING:
    from fusestate.vfs.filesystem import FileSystem, Handle


log = logging.getLogger(__name__)

# Blocks of one file sealed at once: each is read from its backing file, hashed and stored
# (staged, or put in the bucket) in worker threads, which a seal of several blocks keeps busy
# together instead of one after the other.
SEAL_BLOCKS_AT_ONCE = 4

# How often the whole blocks of files still being written through passthrough are sealed
# (``seal_ahead_loop``): often enough that an SST's fsync finds all but its last block done.
SEAL_AHEAD_INTERVAL = 0.1

# Free space on the cache disk (beyond the metadata's reserve and twice --max-dirty) below
# which new files are written through the daemon: the kernel writes a passthrough file's
# bytes to the disk without asking, so they must fit.
PASSTHROUGH_DISK_ROOM = 1 << 30


class PassthroughStats:
    """What passthrough did, for status and the metrics."""

    def __init__(self) -> None:
        self.opens = 0             # opens answered with a backing file
        self.refused = 0           # backing files the kernel refused (the open went through the daemon)
        self.seals = 0             # backing files sealed into blocks
        self.sealed_bytes = 0      # bytes of changed blocks those seals stored (staged or put)
        self.filled_bytes = 0      # bytes copied from blocks into backing files (an open for writing of a file with content)
        self.retained_hits = 0     # reads served from a backing file a writer left
        self.sealed_ahead = 0      # seals of whole blocks while a writer was still writing the file


class PassthroughFiles:
    """FileSystem's part for FUSE passthrough (a mixin: it works on FileSystem's state)."""

    passthrough: bool = False  # set once the kernel agreed to passthrough for this mount
    # Whether the cache disk's filesystem gives every write after an fstat a new ctime
    # (multigrain timestamps): then a backing file whose size and times are those of its last
    # seal is not hashed again (the close after an fsync). Probed at start.
    fine_ctime: bool = False
    backing: ScratchFiles
    passthrough_stats: PassthroughStats

    def _local_store(self: "FileSystem", f: OpenFile) -> Optional[ScratchFiles]:
        """The plain local file that holds ``f``'s bytes, if any (scratch or backing)."""
        if f.node.scratch:
            return self.scratch
        if f.backed:
            return self.backing
        return None

    async def passthrough_open(self: "FileSystem", fh: int) -> Optional[int]:
        """A descriptor of the file the kernel may serve this open from, or None: the open
        goes through the daemon. Call right after the open, before replying to it."""
        if not self.passthrough:
            return None
        h = self._handle(fh)
        f = h.file
        if not f.node.is_reg or f.handles - f.passthrough_handles > 1:
            return None  # the daemon serves other opens of it: the kernel allows no mix
        writing = h.flags & os.O_ACCMODE != os.O_RDONLY
        if not (f.node.scratch or f.backed or writing or self._take_retained(f)):
            return None  # read-only, without a local copy: the block path
        if writing and not f.backed and not self._room_for_passthrough():
            return None  # through the daemon: its writers wait for room (a scratch file's get ENOSPC)
        # Counted before anything awaits: an open of the same file meanwhile sees this one.
        h.passthrough = True
        f.passthrough_handles += 1
        try:
            if not (f.node.scratch or f.backed):
                await self._back(f)
            store = self._local_store(f)
            assert store is not None
            fd = store.fd(f.inode)
        except (OSError, FsError) as exc:
            h.passthrough = False
            f.passthrough_handles -= 1
            log.warning("inode %d: no backing file (%s); its open goes through the daemon", f.inode, exc)
            return None
        if writing:
            h.passthrough_writes = True
            f.passthrough_writers += 1
            if not f.node.scratch:
                f.unsealed = True
        self._pages_stale.add(f.inode)  # the kernel's own pages of the inode miss these writes
        self.passthrough_stats.opens += 1
        return fd

    def passthrough_files(self: "FileSystem") -> int:
        """Files open with a backing file now."""
        return sum(1 for f in self._files.values() if f.passthrough_handles)

    def unsealed_passthrough_bytes(self: "FileSystem") -> int:
        """Bytes of volume files open for passthrough writing: not in blocks yet (an upper
        bound: sealed blocks of them count too)."""
        total = 0
        for f in self._files.values():
            if f.backed and f.unsealed:
                self._refresh_from_local(f)  # the kernel's writes since
                total += f.node.size
        return total

    def _room_for_passthrough(self: "FileSystem") -> bool:
        """Whether a new passthrough writer may start: the kernel writes its bytes to the
        cache disk unchecked, so the disk must have room beyond the reserve, and the bytes
        of open passthrough writers not in blocks yet must be under ``--max-dirty``. Past
        either, files are written through the daemon, whose writers wait for room (a
        scratch file's writes fail with ENOSPC before the reserve, as on the block path)."""
        unsealed = self.unsealed_passthrough_bytes()
        if unsealed >= self.uploader.max_dirty:
            return False
        try:
            free = os.statvfs(self.backing.directory)
        except OSError:
            return False
        room = free.f_bavail * free.f_frsize - self.backing.reserve
        return room >= PASSTHROUGH_DISK_ROOM + 2 * self.uploader.max_dirty + unsealed

    def passthrough_refused(self: "FileSystem", fh: int) -> None:
        """The kernel did not take the backing file: this handle goes through the daemon,
        which serves it from the same local file."""
        h = self._handles.get(fh)
        if h is None or not h.passthrough:
            return
        self._passthrough_closed(h)
        self.passthrough_stats.refused += 1
        self.passthrough_stats.opens -= 1

    def _passthrough_closed(self: "FileSystem", h: "Handle") -> None:
        f = h.file
        if h.passthrough:
            h.passthrough = False
            f.passthrough_handles -= 1
        if h.passthrough_writes:
            h.passthrough_writes = False
            f.passthrough_writers -= 1

    async def _back(self: "FileSystem", f: OpenFile) -> None:
        """Give a volume file a backing file holding its current bytes."""
        async with f.lock:
            if f.backed:
                return
            await self._flush_dirty_locked(f)
            size, bs = f.node.size, self.block_size
            self.backing.truncate(f.inode, 0)
            for index in sorted(i for i in f.keys if i * bs < size):  # holes stay holes
                nbytes = min(bs, size - index * bs)
                data = await self._read_block(f, index, 0, nbytes, sequential=True)
                await trio.to_thread.run_sync(self.backing.write, f.inode, index * bs, data)
                self.passthrough_stats.filled_bytes += nbytes
            self.backing.truncate(f.inode, size)
            f.backed = True

    async def _flush_dirty_locked(self: "FileSystem", f: OpenFile) -> None:
        """Seal and store the block path's dirty blocks of ``f`` (its lock held)."""
        for index in list(f.dirty):
            self._seal(f, index)
        await f.idle.wait()
        if f.error is not None:
            error, f.error = f.error, None
            raise error

    def _refresh_from_local(self: "FileSystem", f: OpenFile) -> None:
        """Take the size and times the kernel's passthrough writes gave the local file."""
        store = self._local_store(f)
        if store is None or not (f.passthrough_writers or f.unsealed):
            return
        st = store.stat(f.inode)
        if st is None:
            return
        seen = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if seen == f.local_stat:
            return  # nothing written since: the file's own times stand (a utime set them)
        f.local_stat = seen
        f.node.size = st.st_size
        f.node.mtime_ns = max(f.node.mtime_ns, st.st_mtime_ns)
        f.node.ctime_ns = max(f.node.ctime_ns, st.st_ctime_ns)
        f.attrs_dirty = True

    async def _seal_backing(self: "FileSystem", f: OpenFile, *, whole_blocks: bool = False) -> None:
        """Bring a backed volume file's blocks up to its backing file: hash every block,
        stage and commit the changed ones with the size (durably while an fsync waits).
        ``whole_blocks``: only the blocks the file's size has passed, while its writer is
        still open (``seal_ahead_loop``); the file stays unsealed."""
        async with f.lock:
            if not f.unsealed:
                return
            self._refresh_from_local(f)
            stamp = f.local_stat  # taken before the blocks are read: a write meanwhile changes it
            if whole_blocks:
                if stamp is None or stamp == f.sealed_ahead_stamp:
                    return  # nothing written since the last look
            elif self.fine_ctime and stamp is not None and stamp == f.sealed_stamp and not f.attrs_dirty:
                f.unsealed = f.passthrough_writers > 0  # nothing written since the last seal (an fsync's)
                return
            size, bs = f.node.size, self.block_size
            count = size // bs if whole_blocks else -(-size // bs)
            if not whole_blocks and any(index >= count for index in f.keys):
                node, freed = await self.meta.truncate(f.inode, size, time.time_ns())
                for index in [i for i in f.keys if i >= count]:
                    del f.keys[index]
                await self.blocks.release(freed.keys)
            changed: dict[int, Optional[tuple[str, int]]] = {}
            inline: dict[str, bytes] = {}
            staged: list[tuple[str, int]] = []
            expected: list[tuple[str, int]] = []  # shared engines: uploaded before the commit
            uploads_began: list[float] = []  # when each of those uploads began
            put: list[str] = []  # an fsync's blocks put in the bucket before the commit
            put_now = self._puts_for_fsync(f)
            try:
                # Sealing ahead takes only blocks with no hole left: one whose writes come out
                # of order is sealed once the last of them has come, as on the block path.
                find = self.backing.filled_blocks if whole_blocks else self.backing.data_blocks
                with_data = await trio.to_thread.run_sync(find, f.inode, bs)

                async def seal_block(index: int) -> None:
                    nbytes = min(bs, size - index * bs)
                    if index not in with_data:  # all hole now
                        changed[index] = None
                        return
                    data, key = await trio.to_thread.run_sync(self._read_local_block, self.backing, f.inode,
                                                              index * bs, nbytes, False)
                    if key == f.keys.get(index):
                        return
                    if key is None:
                        changed[index] = None
                        return
                    if self._keeps_inline(f, index, data):
                        key = self.blocks.seal_inline(data)
                        assert key is not None
                        inline[key] = bytes(data)
                    elif put_now and await self.blocks.put_for_fsync(data, key):
                        put.append(key)
                    elif self.meta.shared:
                        key, began = await self.blocks.seal_uploaded(data, key)
                        uploads_began.append(began)
                        expected.append((key, nbytes))
                        staged.append((key, nbytes))
                    else:
                        key = await self.blocks.seal(data, key=key)
                        assert key is not None
                        staged.append((key, nbytes))
                    changed[index] = (key, nbytes)
                    self.passthrough_stats.sealed_bytes += nbytes

                candidates = with_data if whole_blocks else with_data | set(f.keys)
                await each_at_once(seal_block, sorted(i for i in candidates if i < count), SEAL_BLOCKS_AT_ONCE)
                began: Optional[float] = min(uploads_began) if uploads_began else None
                if inline:
                    began = time.monotonic() if began is None else began
                if changed or f.attrs_dirty:
                    freed = await self._commit_backing(f, changed, inline, size, began)
                    expected = []
                    await self.blocks.release(freed.keys)
            except BaseException as exc:
                await self._abandon_sealed([key for key, _ in expected])
                translated = commit_error(exc)
                if translated is exc:
                    raise
                raise translated from exc
            for index, block in changed.items():
                if block is None:
                    f.keys.pop(index, None)
                else:
                    f.keys[index] = block[0]
            for key in put:
                await self.blocks.committed_uploaded(key)
            for key, nbytes in staged:
                await self.blocks.committed(key, nbytes)
            f.attrs_dirty = False
            if whole_blocks:
                f.sealed_ahead_stamp = stamp
                self.passthrough_stats.sealed_ahead += 1
                return
            f.unsealed = f.passthrough_writers > 0  # a writer still open may write more
            f.sealed_stamp = stamp
            self.passthrough_stats.seals += 1

    async def seal_ahead_loop(self: "FileSystem") -> None:
        """Seal the whole blocks of files that passthrough writers are still writing, every
        ``SEAL_AHEAD_INTERVAL`` seconds, as the block path seals a block once it is full:
        the kernel writes a backing file without telling the daemon, so a file's first
        seal (RocksDB's fsync of an SST, a state store's commit) would otherwise store
        every block of it while the caller waits. That seal still reads and hashes every
        block, but stores only those written since (the last, and any rewritten)."""
        while True:
            await trio.sleep(SEAL_AHEAD_INTERVAL)
            if not self.passthrough:
                continue
            for f in list(self._files.values()):
                if not (f.backed and f.unsealed and f.passthrough_writers) or f.lock.locked():
                    continue
                self._refresh_from_local(f)  # one fstat: the size the kernel's writes left
                if f.node.size // self.block_size <= len(f.keys) or f.local_stat == f.sealed_ahead_stamp:
                    continue  # no whole block it has no key for, or nothing written since the last look
                try:
                    await self._seal_backing(f, whole_blocks=True)
                except FsError as exc:  # the seal at the close or fsync tries again, and reports it
                    log.warning("inode %d: sealing ahead of its writer failed: %s", f.inode, exc.strerror)

    async def _commit_backing(self: "FileSystem", f: OpenFile, changed: dict[int, Optional[tuple[str, int]]],
                              inline: dict[str, bytes], size: int, began: Optional[float]):
        mtime = f.node.mtime_ns

        async def commit(uploads_began: Optional[float]):
            return await self.meta.commit_blocks(f.inode, changed, size, mtime, durable=f.syncing > 0,
                                                 uploads_began=uploads_began, inline=inline or None)

        async def put_all_again() -> float:
            return await self._put_again_from(self.backing, f.inode, changed, direct=False, skip=inline)

        async with f.commit_lock:
            return await self._commit_putting_again(commit, put_all_again, began)

    def _drop_backing(self: "FileSystem", f: OpenFile) -> None:
        """The file's last handle is gone and its blocks hold its bytes: its backing file is
        kept for the next reader, within ``retain_bytes``, oldest dropped first."""
        if not f.backed or f.unsealed:
            return
        f.backed = False
        if f.node.nlink == 0 or f.node.size > self.retain_bytes:
            self.backing.remove(f.inode)
            return
        self._retained.pop(f.inode, None)
        self._retained[f.inode] = (content_version(f.node.size, f.keys), f.node.size)
        total = sum(size for _, size in self._retained.values())
        while total > self.retain_bytes:
            ino, (_, size) = self._retained.popitem(last=False)
            self.backing.remove(ino)
            total -= size

    def _take_retained(self: "FileSystem", f: OpenFile) -> bool:
        """Give ``f`` the backing file its last writer left, if it holds the file's content."""
        kept = self._retained.pop(f.inode, None)
        if kept is None:
            return False
        if kept[0] != content_version(f.node.size, f.keys) or f.dirty or f.sealing:
            self.backing.remove(f.inode)  # the file changed since (elsewhere, or by the block path)
            return False
        f.backed = True
        self.passthrough_stats.retained_hits += 1
        return True

    def retained_bytes(self: "FileSystem") -> int:
        return sum(size for _, size in self._retained.values())
