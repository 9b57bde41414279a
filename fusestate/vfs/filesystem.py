"""The POSIX file system: namespace, attributes, reads and write-back writes.

Everything here runs on the trio event loop. Metadata calls are short local
SQLite operations; hashing, staging and remote I/O go through the block store,
which sends them to worker threads. No FUSE types appear here, so the whole
file system can be driven (and tested) without a mount.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import stat
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator, Optional, Sequence

import trio

from fusestate.blocks.keys import BlockData
from fusestate.blocks.store import BlockReadError, BlockStore
from fusestate.blocks.uploader import UploadFailed, Uploader
from fusestate.meta.engine import ROOT_INODE, DirEntry, Inode, MetadataEngine
from fusestate.vfs.block_buffer import BlockBuffer
from fusestate.vfs.errors import FsError, enoent
from fusestate.vfs.open_file import OpenFile, Sealing

log = logging.getLogger(__name__)

NAME_MAX = 255
REMOTE_CAPACITY = 1 << 50  # what statfs reports: the bucket has no practical limit
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
DIRTY_EXPIRE_SECONDS = 5.0
SEALING_LIMIT_BLOCKS = 16  # blocks being hashed and staged at once, beyond which writers wait


@dataclass(frozen=True)
class RequestContext:
    uid: int = 0
    gid: int = 0
    pid: int = 0


SCAN_STREAMS = 8


@dataclass
class Handle:
    file: OpenFile
    flags: int
    # Where this handle's recent reads ended. A read starting at one of them continues a
    # scan; several, because the kernel's readahead requests (RocksDB asks for them with
    # readahead(2)) arrive interleaved with the reader's own.
    read_ends: deque[int] = field(default_factory=lambda: deque([0], maxlen=SCAN_STREAMS))


@dataclass(frozen=True)
class StatFs:
    block_size: int
    blocks: int
    blocks_free: int
    files: int
    files_free: int
    name_max: int = NAME_MAX


class FileSystem:
    def __init__(self, meta: MetadataEngine, blocks: BlockStore, uploader: Uploader, *,
                 block_size: int, durability: str = "remote", readahead_blocks: int = 2,
                 read_only: bool = False, scratch_dirs: Sequence[str] = ()) -> None:
        self.meta = meta
        self.blocks = blocks
        self.uploader = uploader
        self.block_size = block_size
        self.durability = durability
        self.readahead_blocks = readahead_blocks
        self.read_only = read_only
        # Name patterns of directories made scratch when created (see Inode.scratch).
        self.scratch_dirs = tuple(scratch_dirs)
        self._files: dict[int, OpenFile] = {}
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._lookups: dict[int, int] = {}
        self._nursery: Optional[trio.Nursery] = None
        # Blocks being sealed hold their bytes in memory until staged: writers wait past a bound.
        self._sealing_bytes = 0
        self._sealed = trio.Event()
        # Set by the daemon: waits until the metadata journal is in the bucket.
        self.ship_metadata: Optional[Callable[[], Awaitable[None]]] = None
        uploader.memory_dirty_bytes = self.memory_dirty_bytes

    # --- lifecycle -------------------------------------------------------------
    def start(self, nursery: trio.Nursery) -> None:
        """Start background sealing; purge inodes orphaned by a crash."""
        self._nursery = nursery
        if not self.read_only:
            # Scratch data belonged to processes the last mount served: gone, like a tmpfs.
            self.blocks.release(self.meta.purge_scratch())
        for ino in self.meta.orphaned_inodes():
            if ino != ROOT_INODE:
                self.blocks.release(self.meta.delete_inode(ino))
        nursery.start_soon(self._expire_dirty_loop)

    async def flush_all(self) -> None:
        """Seal every dirty block of every file and persist all inodes."""
        for f in list(self._files.values()):
            await self._flush_file(f)

    def memory_dirty_bytes(self) -> int:
        total = 0
        for f in self._files.values():
            total += sum(len(b) for b in f.dirty.values())
            total += sum(len(s.data) for s in f.sealing.values())
        return total

    @property
    def open_files(self) -> int:
        return len(self._files)

    # --- helpers ---------------------------------------------------------------
    def _node(self, ino: int) -> Inode:
        f = self._files.get(ino)
        if f is not None:
            return f.node
        try:
            return self.meta.get_inode(ino)
        except KeyError:
            raise enoent() from None

    def _check_writable(self) -> None:
        if self.read_only:
            raise FsError(errno.EROFS)

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        if not name or b"/" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL)

    def _dir(self, ino: int) -> Inode:
        node = self._node(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    def _touch(self, node: Inode, mtime: bool = True) -> None:
        now = time.time_ns()
        node.ctime_ns = now
        if mtime:
            node.mtime_ns = now
        self.meta.update_inode(node)

    def _remember(self, ino: int) -> None:
        self._lookups[ino] = self._lookups.get(ino, 0) + 1

    def _file(self, node: Inode) -> OpenFile:
        f = self._files.get(node.id)
        if f is None:
            f = OpenFile(node=node, keys=self.meta.block_map(node.id))
            self._files[node.id] = f
        return f

    def _maybe_delete(self, ino: int) -> None:
        """Remove an inode once no name, no open handle and no kernel reference is left."""
        if ino == ROOT_INODE or self._lookups.get(ino, 0) > 0:
            return
        f = self._files.get(ino)
        if f is not None and f.handles > 0:
            return
        try:
            node = self._node(ino)
        except FsError:
            return
        if node.nlink > 0:
            return
        if f is not None:
            self._drop_file_state(f)
        self.blocks.release(self.meta.delete_inode(ino))

    def _drop_file_state(self, f: OpenFile) -> None:
        """Forget unsealed data of a deleted file: it never reaches staging or the bucket."""
        for index in list(f.dirty):
            f.take_dirty(index)
        for index in list(f.sealing):
            f.next_generation(index)
        f.sealing.clear()
        self._files.pop(f.inode, None)

    # --- namespace ---------------------------------------------------------------
    def lookup(self, parent: int, name: bytes) -> Inode:
        self._dir(parent)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)  # not ENOENT: no such name can exist
        if name == b".":
            ino = parent
        elif name == b"..":
            ino = self.meta.parent_of(parent)
        else:
            found = self.meta.lookup(parent, name)
            if found is None:
                raise enoent()
            ino = found
        node = self._node(ino)
        self._remember(ino)
        return node

    def forget(self, items: list[tuple[int, int]]) -> None:
        for ino, count in items:
            left = self._lookups.get(ino, 0) - count
            if left > 0:
                self._lookups[ino] = left
            else:
                self._lookups.pop(ino, None)
                self._maybe_delete(ino)

    def remember_lookup(self, ino: int) -> None:
        """The kernel took a reference without a lookup (readdirplus)."""
        self._remember(ino)

    def getattr(self, ino: int) -> Inode:
        return self._node(ino)

    def _new_node(self, parent: Inode, name: bytes, mode: int, ctx: RequestContext,
                  symlink_target: Optional[bytes] = None, rdev: int = 0) -> Inode:
        self._check_writable()
        self._check_name(name)
        if not parent.is_dir:
            raise FsError(errno.ENOTDIR)
        if parent.nlink == 0:
            raise enoent()
        if self.meta.lookup(parent.id, name) is not None:
            raise FsError(errno.EEXIST)
        gid = ctx.gid
        if parent.mode & stat.S_ISGID:
            gid = parent.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        scratch = parent.scratch or (stat.S_ISDIR(mode) and self._is_scratch_name(name))
        with self.meta.transaction():
            node = self.meta.create_inode(mode, ctx.uid, gid, rdev, symlink_target, scratch=scratch)
            node.nlink = 2 if stat.S_ISDIR(mode) else 1
            self.meta.update_inode(node)
            self.meta.add_entry(parent.id, name, node.id)
            if stat.S_ISDIR(mode):
                parent.nlink += 1
            self._touch(parent)
        self._remember(node.id)
        return node

    def _is_scratch_name(self, name: bytes) -> bool:
        text = os.fsdecode(name)
        return any(fnmatch.fnmatchcase(text, pattern) for pattern in self.scratch_dirs)

    @staticmethod
    def _check_scratch_move(node: Inode, new_parent: Inode) -> None:
        """Nothing crosses between scratch and the volume (EXDEV, as between two file
        systems: mv then copies), except a whole scratch dir, which stays scratch."""
        if node.scratch != new_parent.scratch and not (node.scratch and node.is_dir):
            raise FsError(errno.EXDEV, "scratch and the rest of the volume are separate")

    def mkdir(self, parent: int, name: bytes, mode: int, ctx: RequestContext) -> Inode:
        return self._new_node(self._node(parent), name, stat.S_IFDIR | (mode & 0o7777), ctx)

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: RequestContext) -> Inode:
        kind = stat.S_IFMT(mode) or stat.S_IFREG
        if kind not in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK):
            raise FsError(errno.EPERM, "device nodes are not supported")
        return self._new_node(self._node(parent), name, kind | (mode & 0o7777), ctx, rdev=rdev)

    def symlink(self, parent: int, name: bytes, target: bytes, ctx: RequestContext) -> Inode:
        return self._new_node(self._node(parent), name, stat.S_IFLNK | 0o777, ctx, symlink_target=target)

    def readlink(self, ino: int) -> bytes:
        node = self._node(ino)
        if not node.is_symlink or node.symlink_target is None:
            raise FsError(errno.EINVAL)
        return node.symlink_target

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        self._check_writable()
        node = self._node(ino)
        if node.is_dir:
            raise FsError(errno.EPERM)
        if node.nlink == 0:
            raise enoent()
        parent = self._dir(new_parent)
        self._check_name(new_name)
        self._check_scratch_move(node, parent)
        if self.meta.lookup(new_parent, new_name) is not None:
            raise FsError(errno.EEXIST)
        with self.meta.transaction():
            self.meta.add_entry(new_parent, new_name, ino)
            node.nlink += 1
            self._touch(node, mtime=False)
            self._touch(parent)
        self._remember(ino)
        return node

    def unlink(self, parent: int, name: bytes) -> None:
        self._check_writable()
        parent_node = self._dir(parent)
        ino = self.meta.lookup(parent, name)
        if ino is None:
            raise enoent()
        node = self._node(ino)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        with self.meta.transaction():
            self.meta.remove_entry(parent, name)
            node.nlink -= 1
            self._touch(node, mtime=False)
            self._touch(parent_node)
        self._maybe_delete(ino)

    def rmdir(self, parent: int, name: bytes) -> None:
        self._check_writable()
        parent_node = self._dir(parent)
        if name == b".":
            raise FsError(errno.EINVAL)
        ino = self.meta.lookup(parent, name)
        if ino is None:
            raise enoent()
        node = self._node(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if self.meta.has_entries(ino):
            raise FsError(errno.ENOTEMPTY)
        with self.meta.transaction():
            self.meta.remove_entry(parent, name)
            node.nlink = 0
            self._touch(node, mtime=False)
            parent_node.nlink -= 1
            self._touch(parent_node)
        self._maybe_delete(ino)

    def _is_ancestor(self, ancestor: int, ino: int) -> bool:
        while True:
            if ino == ancestor:
                return True
            if ino == ROOT_INODE:
                return False
            ino = self.meta.parent_of(ino)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0) -> None:
        """Atomic rename: one metadata transaction, no data moved."""
        self._check_writable()
        self._check_name(new_name)
        src_dir = self._dir(old_parent)
        dst_dir = self._dir(new_parent)
        ino = self.meta.lookup(old_parent, old_name)
        if ino is None:
            raise enoent()
        node = self._node(ino)
        self._check_scratch_move(node, dst_dir)
        target = self.meta.lookup(new_parent, new_name)
        if flags & RENAME_NOREPLACE and target is not None:
            raise FsError(errno.EEXIST)
        if flags & RENAME_EXCHANGE:
            if target is None:
                raise enoent()
            self._check_scratch_move(self._node(target), src_dir)
            self._exchange(src_dir, old_name, node, dst_dir, new_name, self._node(target))
            return
        if target == ino:
            return
        if node.is_dir and self._is_ancestor(ino, new_parent):
            raise FsError(errno.EINVAL)
        target_node = self._node(target) if target is not None else None
        if target_node is not None:
            if node.is_dir and not target_node.is_dir:
                raise FsError(errno.ENOTDIR)
            if not node.is_dir and target_node.is_dir:
                raise FsError(errno.EISDIR)
            if target_node.is_dir and self.meta.has_entries(target_node.id):
                raise FsError(errno.ENOTEMPTY)
        with self.meta.transaction():
            self.meta.remove_entry(old_parent, old_name)
            if target_node is not None:
                self.meta.replace_entry(new_parent, new_name, ino)
                if target_node.is_dir:
                    target_node.nlink = 0
                    dst_dir.nlink -= 1
                else:
                    target_node.nlink -= 1
                self._touch(target_node, mtime=False)
            else:
                self.meta.add_entry(new_parent, new_name, ino)
            if node.is_dir and old_parent != new_parent:
                src_dir.nlink -= 1
                dst_dir.nlink += 1
            self._touch(node, mtime=False)
            self._touch(src_dir)
            if dst_dir is not src_dir:
                self._touch(dst_dir)
        if target_node is not None:
            self._maybe_delete(target_node.id)

    def _exchange(self, src_dir: Inode, old_name: bytes, a: Inode,
                  dst_dir: Inode, new_name: bytes, b: Inode) -> None:
        if src_dir.id != dst_dir.id:
            if a.is_dir and self._is_ancestor(a.id, dst_dir.id):
                raise FsError(errno.EINVAL)
            if b.is_dir and self._is_ancestor(b.id, src_dir.id):
                raise FsError(errno.EINVAL)
        with self.meta.transaction():
            self.meta.replace_entry(src_dir.id, old_name, b.id)
            self.meta.replace_entry(dst_dir.id, new_name, a.id)
            if src_dir.id != dst_dir.id and a.is_dir != b.is_dir:
                delta = 1 if a.is_dir else -1
                src_dir.nlink -= delta
                dst_dir.nlink += delta
            for n in (a, b, src_dir, dst_dir):
                self._touch(n, mtime=n.is_dir)

    def readdir(self, ino: int, after_id: int) -> Iterator[tuple[DirEntry, Inode]]:
        self._dir(ino)
        for entry in self.meta.list_entries(ino, after_id):
            yield entry, self._node(entry.inode)

    # --- attributes --------------------------------------------------------------
    async def setattr(self, ino: int, *, mode: Optional[int] = None, uid: Optional[int] = None,
                      gid: Optional[int] = None, size: Optional[int] = None,
                      atime_ns: Optional[int] = None, mtime_ns: Optional[int] = None) -> Inode:
        self._check_writable()
        node = self._node(ino)
        if size is not None:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            if not node.is_reg:
                raise FsError(errno.EINVAL)
            await self.truncate(node, size)
        if mode is not None:
            node.mode = stat.S_IFMT(node.mode) | (mode & 0o7777)
        if uid is not None:
            node.uid = uid
        if gid is not None:
            node.gid = gid
        if atime_ns is not None:
            node.atime_ns = atime_ns
        if mtime_ns is not None:
            node.mtime_ns = mtime_ns
        node.ctime_ns = time.time_ns()
        self.meta.update_inode(node)
        return node

    async def truncate(self, node: Inode, size: int) -> None:
        if size < 0:
            raise FsError(errno.EINVAL)
        f = self._file(node)
        try:
            async with f.lock:
                old_size = f.node.size
                self._truncate_locked(f, size)  # lowers f.node.size already
                if size % self.block_size and size < old_size:
                    index = size // self.block_size
                    buf = await self._dirty_block(f, index)
                    buf.resize(size % self.block_size)
                f.node.size = size
                self._touch(f.node)
            if f.handles == 0:
                await self._flush_file(f)
        finally:
            if not f.busy:
                self._files.pop(node.id, None)

    def _truncate_locked(self, f: OpenFile, size: int) -> None:
        first_removed = -(-size // self.block_size)
        for index in [i for i in f.dirty if i >= first_removed]:
            f.take_dirty(index)
        for index in [i for i in f.sealing if i >= first_removed]:
            f.next_generation(index)
            del f.sealing[index]
        for index in [i for i in f.keys if i >= first_removed]:
            del f.keys[index]
            f.next_generation(index)
        with self.meta.transaction():
            freed = self.meta.truncate_blocks(f.inode, first_removed)
            f.node.size = min(f.node.size, size)
            self.meta.update_inode(f.node)
        self.blocks.release(freed)

    # --- open files ----------------------------------------------------------------
    async def open(self, ino: int, flags: int) -> int:
        node = self._node(ino)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if writing or flags & os.O_TRUNC:
            self._check_writable()
        f = self._file(node)
        f.handles += 1
        if flags & os.O_TRUNC and node.size > 0:
            try:
                await self.truncate(node, 0)
            except BaseException:
                f.handles -= 1
                raise
        return self._new_handle(f, flags)

    def _new_handle(self, f: OpenFile, flags: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = Handle(f, flags)
        return fh

    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     ctx: RequestContext) -> tuple[int, Inode]:
        node = self._new_node(self._node(parent), name, stat.S_IFREG | (mode & 0o7777), ctx)
        f = self._file(node)
        f.handles += 1
        return self._new_handle(f, flags), node

    def _handle(self, fh: int) -> Handle:
        h = self._handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        h = self._handle(fh)
        f = h.file
        end = min(offset + size, f.node.size)
        if offset >= end:
            return b""
        bs = self.block_size
        parts: list[bytes] = []
        pos = offset
        # A read that continues a recent one (or starts the file) is part of a scan:
        # its blocks are worth loading whole. Others are point reads: only their range.
        sequential = offset in h.read_ends
        while pos < end:
            index, start = divmod(pos, bs)
            stop = min(bs, end - index * bs)
            parts.append(await self._read_block(f, index, start, stop, sequential))
            pos = index * bs + stop
        if self.readahead_blocks and sequential:
            self._readahead(f, end)
        if end not in h.read_ends:
            h.read_ends.append(end)
        return b"".join(parts)

    async def _read_block(self, f: OpenFile, index: int, start: int, stop: int, sequential: bool) -> bytes:
        cached = f.cached_bytes(index)
        if cached is not None:
            chunk = bytes(cached[start:stop])
        else:
            key = f.keys.get(index)
            if key is None:
                return bytes(stop - start)
            try:
                chunk = await self.blocks.read(key, start, stop, whole=sequential)
            except BlockReadError as exc:
                log.error("read of inode %d block %d failed: %s", f.inode, index, exc)
                raise FsError(errno.EIO) from exc
        if len(chunk) < stop - start:
            chunk += bytes(stop - start - len(chunk))
        return chunk

    def _readahead(self, f: OpenFile, end: int) -> None:
        first = end // self.block_size + 1
        last = min(first + self.readahead_blocks, -(-f.node.size // self.block_size))
        keys = [f.keys[i] for i in range(first, last) if i in f.keys and i not in f.dirty]
        if keys:
            self.blocks.prefetch(keys)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        h = self._handle(fh)
        if h.flags & os.O_ACCMODE == os.O_RDONLY:
            raise FsError(errno.EBADF)
        self._check_writable()
        f = h.file
        if f.out_of_space:
            # A block of this file found the cache disk full: fail as a full disk does until
            # there is room again, rather than pile more data up in memory.
            if not await self.blocks.has_room():
                raise FsError(errno.ENOSPC, "cache disk full")
            f.out_of_space = False
        await self._wait_for_sealing(len(data))
        await self.uploader.wait_for_room(len(data))
        bs = self.block_size
        async with f.lock:
            if f.node.nlink == 0 and f.handles == 0:
                raise FsError(errno.EBADF)
            view = memoryview(data)
            pos = offset
            while view:
                index, start = divmod(pos, bs)
                n = min(len(view), bs - start)
                buf = await self._dirty_block(f, index)
                buf.write(start, view[:n])
                pos += n
                view = view[n:]
                if pos > f.node.size:
                    f.node.size = pos
                if buf.full:
                    self._seal(f, index)
            now = time.time_ns()
            f.node.mtime_ns = f.node.ctime_ns = now
            f.attrs_dirty = True
        return len(data)

    async def _dirty_block(self, f: OpenFile, index: int) -> BlockBuffer:
        """The writable buffer of a block, loaded with its current content."""
        buf = f.dirty.get(index)
        if buf is not None:
            return buf
        base = f.cached_bytes(index)  # a sealing block: frozen, so no await may change it
        if base is None:
            key = f.keys.get(index)
            base = b""
            if key is not None:
                try:
                    base = await self.blocks.read(key, 0, self.block_size)
                except BlockReadError as exc:
                    raise FsError(errno.EIO) from exc
        # Whatever lies past the end of the file is not part of it.
        valid = max(0, min(self.block_size, f.node.size - index * self.block_size))
        buf = BlockBuffer(self.block_size, memoryview(base)[:valid])
        f.mark_dirty(index, buf)
        return buf

    async def _wait_for_sealing(self, nbytes: int) -> None:
        """Backpressure on sealing: its blocks count against no other bound until they are
        staged (scratch blocks never are), and a full cache disk fails them only once hashed."""
        limit = SEALING_LIMIT_BLOCKS * self.block_size
        while self._sealing_bytes and self._sealing_bytes + nbytes > limit:
            await self._sealed.wait()

    def _seal(self, f: OpenFile, index: int) -> None:
        """Freeze a dirty block and store it in the background."""
        # The dirty buffer itself becomes the sealed block: nothing writes to it once taken
        # (a later write to this block starts from a copy). Copying it into a new bytes
        # object cost ~3 ms per 4 MiB on the event loop, mostly page faults.
        buf = f.take_dirty(index)
        buf.resize(max(0, min(self.block_size, f.node.size - index * self.block_size)))
        data = buf.seal()
        generation = f.next_generation(index)
        f.sealing[index] = Sealing(data, generation)
        f.seal_started()
        self._sealing_bytes += len(data)
        assert self._nursery is not None, "FileSystem.start() was not called"
        self._nursery.start_soon(self._store_sealed, f, index, generation, data)

    async def _store_sealed(self, f: OpenFile, index: int, generation: int, data: BlockData) -> None:
        size = len(data)
        try:
            try:
                key = await self.blocks.seal(data) if data else None
                # No await from here on: the commit is atomic with respect to other tasks.
                if not f.is_current(index, generation) or self._files.get(f.inode) is not f:
                    self.blocks.abandon(key)  # superseded by a newer write or truncate
                    return
                with self.meta.transaction():
                    freed = self.meta.set_block(f.inode, index, key, len(data))
                    self.meta.update_inode(f.node)
            except Exception as exc:  # noqa: BLE001 - never take the daemon down; fsync reports it
                f.error = self._seal_error(f, index, exc, quiet=f.out_of_space)
                f.out_of_space = f.error.errno == errno.ENOSPC
                if f.is_current(index, generation) and index not in f.dirty:
                    f.mark_dirty(index, BlockBuffer(self.block_size, data))  # keep it; a later flush retries
                    f.sealing.pop(index, None)
                return
            if key is None:
                f.keys.pop(index, None)
            else:
                f.keys[index] = key
            del f.sealing[index]
            self.blocks.committed(key, len(data), upload=not f.node.scratch)
            self.blocks.release(freed)
        finally:
            f.seal_finished()
            self._sealing_bytes -= size
            self._sealed.set()
            self._sealed = trio.Event()

    @staticmethod
    def _seal_error(f: OpenFile, index: int, exc: Exception, quiet: bool = False) -> FsError:
        """What flush and fsync report for a block that could not be stored (write, too, for
        a full disk). ``quiet``: the file already found the disk full, and said so."""
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            if not quiet:
                log.warning("block %d of inode %d stays in memory, its writes fail: %s",
                            index, f.inode, exc.strerror)
            return FsError(errno.ENOSPC, exc.strerror or "")
        log.error("could not store block %d of inode %d", index, f.inode, exc_info=exc)
        return FsError(errno.EIO, str(exc))

    async def _flush_file(self, f: OpenFile) -> None:
        async with f.lock:
            for index in list(f.dirty):
                self._seal(f, index)
        await f.idle.wait()
        if f.attrs_dirty and self._files.get(f.inode) is f:
            f.attrs_dirty = False
            self.meta.update_inode(f.node)
        if f.error is not None:
            error, f.error = f.error, None
            raise error

    async def flush(self, fh: int) -> None:
        f = self._handle(fh).file
        if f.node.nlink == 0:
            return  # unlinked: its data is going away anyway
        await self._flush_file(f)

    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is None:
            return
        f = h.file
        f.handles -= 1
        if f.handles > 0:
            return
        if f.node.nlink == 0:
            self._maybe_delete(f.inode)
            return
        if f.dirty or f.sealing:
            await self._flush_file(f)
        if not f.busy and self._files.get(f.inode) is f:
            del self._files[f.inode]

    async def fsync(self, fh: int, datasync: bool = False) -> None:
        f = self._handle(fh).file
        await self._flush_file(f)
        if f.node.scratch:
            return  # on the cache disk, and gone at the next mount whatever is synced
        keys = [k for k in f.keys.values() if self.uploader.is_pending(k)]
        try:
            if self.durability == "remote":
                await self.uploader.wait_uploaded(keys)
            else:
                await self.uploader.sync_staged(keys)
        except UploadFailed as exc:
            raise FsError(errno.EIO, str(exc)) from exc
        await self.sync_metadata()

    async def sync_metadata(self) -> None:
        """Metadata durable as the durability mode says: local disk, or the bucket too."""
        await trio.to_thread.run_sync(self.meta.sync)
        if self.durability == "remote" and self.ship_metadata is not None:
            try:
                await self.ship_metadata()
            except OSError as exc:
                raise FsError(errno.EIO, str(exc)) from exc

    async def fsyncdir(self, ino: int) -> None:
        if not self._dir(ino).scratch:
            await self.sync_metadata()

    async def _expire_dirty_loop(self) -> None:
        """Seal blocks that stayed dirty too long, so data reaches staging (and the bucket)."""
        while True:
            await trio.sleep(1.0)
            deadline = time.monotonic() - DIRTY_EXPIRE_SECONDS
            for f in list(self._files.values()):
                old = [i for i, t in f.dirty_since.items() if t < deadline]
                if old and not f.lock.locked():
                    async with f.lock:
                        for index in old:
                            if index in f.dirty:
                                self._seal(f, index)

    # --- whole-file helpers (warmup) ---------------------------------------------
    def file_keys(self, ino: int) -> list[str]:
        f = self._files.get(ino)
        keys = f.keys if f is not None else self.meta.block_map(ino)
        return list(keys.values())

    # --- statfs ------------------------------------------------------------------
    def statfs(self) -> StatFs:
        bs = self.block_size
        used = self.meta.used_bytes()
        total = REMOTE_CAPACITY // bs
        free = max(0, total - -(-used // bs))
        inodes = self.meta.count_inodes()
        return StatFs(block_size=bs, blocks=total, blocks_free=free,
                      files=inodes + (1 << 32), files_free=1 << 32)
