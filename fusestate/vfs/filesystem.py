"""The POSIX file system: namespace, attributes, reads and write-back writes.

Everything here runs on the trio event loop. Namespace operations go whole to the
metadata engine, which checks the POSIX rules inside its own transaction; this layer
keeps what only this node knows: open files, their unsealed blocks and the size and
mtime they have reached. Hashing, staging and remote I/O go through the block store,
which sends them to worker threads. No FUSE types appear here, so the whole file system
can be driven (and tested) without a mount.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import logging
import os
import stat
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Collection, Optional, Sequence

import trio

from fusestate.blocks.keys import BlockData, is_inline, seal_digest
from fusestate.blocks.scratch_files import ScratchFiles
from fusestate.blocks.store import BlockReadError, BlockStore, SealedBlock
from fusestate.blocks.uploader import UploadFailed, Uploader
from fusestate.meta.engine import (NAME_MAX, RENAME_EXCHANGE, RENAME_NOREPLACE, AttrChange, DirEntry, Freed, Inode,
                                   MetaEngine, NewNode)
from fusestate.vfs.block_buffer import BlockBuffer
from fusestate.vfs.dir_listing import DirListing
from fusestate.vfs.errors import FsError, commit_error, from_os_error
from fusestate.vfs.open_file import OpenFile, Sealing, content_version
from fusestate.vfs.passthrough import SEAL_BLOCKS_AT_ONCE, PassthroughFiles, PassthroughStats
from fusestate.vfs.scratch_ahead import ScratchSealAhead
from fusestate.vfs.tasks import each_at_once

log = logging.getLogger(__name__)

__all__ = ["FileSystem", "RequestContext", "StatFs", "RENAME_NOREPLACE", "RENAME_EXCHANGE"]

REMOTE_CAPACITY = 1 << 50  # what statfs reports: the bucket has no practical limit
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
    passthrough: bool = False          # the kernel serves it from the file's backing file
    passthrough_writes: bool = False   # ... and it may write


CACHED_CONTENT_MAX = 100_000  # files whose cached content a shared mount remembers
HOLD_RELEASE_DELAY = 0.1  # seconds a closed file's hold waits to go with others (shared engines)
# A shared engine refused a commit because the collector deleted the block while it was
# uploaded: wait this long (past the deletion in progress), put it again, up to this often.
PUT_AGAIN_AFTER = 4.0  # longer than the engine's margin (meta.postgres.functions.COLLECTED_MARGIN)
PUT_AGAIN_TRIES = 20
DELETED_REMEMBERED_MAX = 10_000  # deleted files whose last attributes answer the kernel's late SETATTR


@dataclass(frozen=True)
class StatFs:
    block_size: int
    blocks: int
    blocks_free: int
    files: int
    files_free: int
    name_max: int = NAME_MAX


class FileSystem(PassthroughFiles, ScratchSealAhead):
    def __init__(self, meta: MetaEngine, blocks: BlockStore, uploader: Uploader, *,
                 block_size: int, durability: str = "remote", readahead_blocks: int = 2,
                 read_only: bool = False, scratch_dirs: Sequence[str] = (), store_ahead: Sequence[str] = (),
                 scratch_files: ScratchFiles, backing_files: Optional[ScratchFiles] = None) -> None:
        self.meta = meta
        self.blocks = blocks
        self.uploader = uploader
        self.block_size = block_size
        self.durability = durability
        self.readahead_blocks = readahead_blocks
        self.read_only = read_only
        # Name patterns of directories made scratch when created (see Inode.scratch).
        self.scratch_dirs = tuple(scratch_dirs)
        # This node's scratch files' bytes, one plain file each (never in blocks).
        self.scratch = scratch_files
        self.promoted_files = 0  # scratch files linked into the volume (see link)
        self._init_scratch_ahead(store_ahead)  # their blocks stored before the link (vfs/scratch_ahead.py)
        # FUSE passthrough (vfs/passthrough.py): volume files' backing files, and the inodes
        # whose kernel pages (of daemon-served opens) miss what passthrough wrote since.
        self.backing = backing_files or ScratchFiles(os.path.join(os.path.dirname(scratch_files.directory), "backing"))
        self.passthrough_stats = PassthroughStats()
        self._pages_stale: set[int] = set()
        # Backing files kept after their file's last close, for its next reader (inode ->
        # the content they hold), and the bytes they may take (components.build sets it).
        self._retained: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.retain_bytes = 0
        self.promoted_bytes = 0
        self._files: dict[int, OpenFile] = {}
        # Shared engines: the content (size and block map) this node's page cache holds of
        # each file it has had open, so an open that finds the same content keeps the cache.
        self._cached_content: dict[int, int] = {}
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        # Open directory handles, and the last attributes of directories removed while open:
        # fstat and readdir on their handles still answer.
        self._dir_handles: dict[int, DirListing] = {}
        self._removed_dirs: dict[int, Inode] = {}
        # The last attributes of files deleted here, until the kernel forgets them: its
        # writeback cache still sends their mtime (SETATTR) after the unlink.
        self._deleted: OrderedDict[int, Inode] = OrderedDict()
        # Shared engines: files closed here whose holds go to the database together, a
        # moment later (``_release_holds_loop``): a hold a file still has a name for frees
        # nothing, and an open meanwhile takes it back without a write. Those whose batch is
        # being committed, with the event that says it is done.
        self._holds_to_release: set[int] = set()
        self._holds_releasing: dict[int, trio.Event] = {}
        self._nursery: Optional[trio.Nursery] = None
        # Blocks being sealed hold their bytes in memory until staged: writers wait past a bound.
        self._sealing_bytes = 0
        self._sealed = trio.Event()
        # Writers wait for room one at a time, in the order they came (see _wait_for_room).
        self._room_queue = trio.Lock()
        # Set by the daemon: waits until the metadata journal is in the bucket.
        self.ship_metadata: Optional[Callable[[], Awaitable[None]]] = None
        uploader.memory_dirty_bytes = self.memory_dirty_bytes
        uploader.memory_in_flight = lambda: self._sealing_bytes > 0

    # --- lifecycle -------------------------------------------------------------
    async def start(self, nursery: trio.Nursery) -> None:
        """Start background sealing; release what the engine dropped from the last mount
        (scratch files, files unlinked while open when the node went down)."""
        self._nursery = nursery
        if not self.read_only:
            self.scratch.clear()  # the engine's start forgets the scratch files they belonged to
            self.backing.clear()  # what was sealed is in the blocks; what was not is lost, as unsynced data is
            self._retained.clear()
            self.fine_ctime = self.backing.fine_ctime()
        await self.blocks.release((await self.meta.start()).keys)
        nursery.start_soon(self._expire_dirty_loop)
        if not self.read_only:
            nursery.start_soon(self.seal_ahead_loop)
            if self.store_ahead and self.scratch_dirs:
                nursery.start_soon(self.scratch_ahead_loop)
        if self.meta.shared and not self.read_only:
            nursery.start_soon(self._release_holds_loop)

    async def flush_all(self) -> None:
        """Seal every dirty block of every file and persist all inodes."""
        for f in list(self._files.values()):
            await self._flush_file(f)
        await self.release_holds()

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
    async def _node(self, ino: int) -> Inode:
        """An inode's attributes: this node's own view of a file it has open (its size and
        mtime may be ahead of the metadata), else the engine's."""
        f = self._files.get(ino)
        if f is not None:
            self._refresh_from_local(f)
            return f.node
        removed = self._removed_dirs.get(ino)
        if removed is not None:
            return removed
        return await self.meta.getattr(ino)

    def _local(self, node: Inode) -> Inode:
        f = self._files.get(node.id)
        if f is None:
            return node
        self._refresh_from_local(f)
        return f.node

    def _adopt(self, node: Inode) -> Inode:
        """Take the engine's new attributes into an open file's view, keeping its own size
        and mtime (data not committed yet)."""
        f = self._files.get(node.id)
        if f is None:
            return node
        mine = f.node
        mine.mode, mine.uid, mine.gid, mine.nlink = node.mode, node.uid, node.gid, node.nlink
        mine.atime_ns, mine.ctime_ns = node.atime_ns, max(mine.ctime_ns, node.ctime_ns)
        return mine

    def _check_writable(self) -> None:
        if self.read_only:
            raise FsError(errno.EROFS)

    async def _settle(self, freed: Freed) -> None:
        """After an operation dropped names: an open file learns its link count, a deleted
        file's unsealed data is forgotten, and freed blocks go to the block layer."""
        if freed.unlinked is not None:
            self._adopt(freed.unlinked)
            if freed.unlinked.id == freed.deleted_inode and self._dir_open(freed.unlinked.id):
                self._removed_dirs[freed.unlinked.id] = freed.unlinked
        if freed.deleted_inode is not None:
            f = self._files.get(freed.deleted_inode)
            if freed.unlinked is not None and freed.unlinked.id == freed.deleted_inode:
                self._remember_deleted(freed.unlinked)
            elif f is not None:
                self._remember_deleted(f.node)
            if f is not None:
                self._drop_file_state(f)
            self.scratch.remove(freed.deleted_inode)
            self.drop_sealed_ahead(freed.deleted_inode)
            self.backing.remove(freed.deleted_inode)
            self._retained.pop(freed.deleted_inode, None)
            self._pages_stale.discard(freed.deleted_inode)
        await self.blocks.release(freed.keys)

    def _remember_deleted(self, node: Inode) -> None:
        self._deleted[node.id] = node
        while len(self._deleted) > DELETED_REMEMBERED_MAX:
            self._deleted.popitem(last=False)

    def forget(self, inodes: Sequence[int]) -> None:
        """The kernel let go of these inodes: nothing will ask for a deleted one again."""
        for ino in inodes:
            self._deleted.pop(ino, None)

    def _drop_file_state(self, f: OpenFile) -> None:
        """Forget unsealed data of a deleted file: it never reaches staging or the bucket."""
        for index in list(f.dirty):
            f.take_dirty(index)
        for index in list(f.sealing):
            f.next_generation(index)
        f.sealing.clear()
        f.unsealed = False
        self._files.pop(f.inode, None)

    def _is_scratch_name(self, name: bytes) -> bool:
        text = os.fsdecode(name)
        return any(fnmatch.fnmatchcase(text, pattern) for pattern in self.scratch_dirs)

    # --- namespace ---------------------------------------------------------------
    async def lookup(self, parent: int, name: bytes) -> Inode:
        return self._local(await self.meta.lookup(parent, name))

    async def getattr(self, ino: int) -> Inode:
        return await self._node(ino)

    async def _create(self, parent: int, name: bytes, mode: int, ctx: RequestContext, *, rdev: int = 0,
                      symlink_target: Optional[bytes] = None, hold: bool = False) -> Inode:
        self._check_writable()
        new = NewNode(mode, ctx.uid, ctx.gid, rdev=rdev, symlink_target=symlink_target,
                      scratch_name=stat.S_ISDIR(mode) and self._is_scratch_name(name))
        return await self.meta.create(parent, name, new, hold=hold)

    async def mkdir(self, parent: int, name: bytes, mode: int, ctx: RequestContext) -> Inode:
        return await self._create(parent, name, stat.S_IFDIR | (mode & 0o7777), ctx)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: RequestContext) -> Inode:
        """Every inode type: device nodes are kept as metadata (the mount is nodev, so they
        never open as devices)."""
        kind = stat.S_IFMT(mode) or stat.S_IFREG
        if kind not in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            raise FsError(errno.EINVAL)
        if kind not in (stat.S_IFCHR, stat.S_IFBLK):
            rdev = 0
        return await self._create(parent, name, kind | (mode & 0o7777), ctx, rdev=rdev)

    async def symlink(self, parent: int, name: bytes, target: bytes, ctx: RequestContext) -> Inode:
        return await self._create(parent, name, stat.S_IFLNK | 0o777, ctx, symlink_target=target)

    async def readlink(self, ino: int) -> bytes:
        node = await self._node(ino)
        if not node.is_symlink or node.symlink_target is None:
            raise FsError(errno.EINVAL)
        return node.symlink_target

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        """A scratch file of this node linked into the volume is promoted first (its bytes
        sealed and, on a shared volume, uploaded): how a state store's commit links the
        SSTs RocksDB wrote in its node-local working dir into the checkpoint."""
        self._check_writable()
        try:
            return self._adopt(await self.meta.link(ino, new_parent, new_name))
        except FsError as exc:
            if exc.errno != errno.EXDEV or not await self._promote(ino):
                raise
        return self._adopt(await self.meta.link(ino, new_parent, new_name))

    async def unlink(self, parent: int, name: bytes) -> None:
        self._check_writable()
        await self._settle(await self.meta.unlink(parent, name))

    async def rmdir(self, parent: int, name: bytes) -> None:
        self._check_writable()
        await self._settle(await self.meta.rmdir(parent, name))

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                     flags: int = 0) -> None:
        """Atomic rename: one metadata operation, no data moved."""
        self._check_writable()
        try:
            freed = await self.meta.rename(old_parent, old_name, new_parent, new_name, flags)
        except FsError as exc:
            # A scratch file renamed into the volume: promoted, as a link out would be.
            if exc.errno != errno.EXDEV or flags & RENAME_EXCHANGE:
                raise
            if not await self._promote((await self.meta.lookup(old_parent, old_name)).id):
                raise
            freed = await self.meta.rename(old_parent, old_name, new_parent, new_name, flags)
        await self._settle(freed)

    async def opendir(self, ino: int) -> int:
        await self._check_dir(ino)
        fh = self._next_fh
        self._next_fh += 1
        self._dir_handles[fh] = DirListing(ino)
        return fh

    async def _check_dir(self, ino: int) -> Optional[Inode]:
        """ENOTDIR unless ``ino`` is a directory; its attributes where they cost nothing. The
        kernel sends OPENDIR and FSYNCDIR only for inodes it knows are directories, and an
        inode never changes type: on a shared engine, where reading attributes is a round
        trip to the database, it is not asked again."""
        if self.meta.shared:
            return None
        node = await self._node(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    def releasedir(self, fh: int) -> None:
        ino = self._dir_handles.pop(fh).ino
        if not self._dir_open(ino):
            self._removed_dirs.pop(ino, None)

    def _dir_open(self, ino: int) -> bool:
        return any(listing.ino == ino for listing in self._dir_handles.values())

    def file_size(self, fh: int) -> tuple[int, int]:
        """The inode open as ``fh`` and its size here."""
        f = self._handle(fh).file
        return f.inode, f.node.size

    def directory_of(self, fh: int) -> int:
        """The inode of the directory open as ``fh``."""
        return self._dir_handles[fh].ino

    async def readdir(self, fh: int, after_id: int) -> list[tuple[DirEntry, Inode]]:
        listing = self._dir_handles[fh]
        if listing.ino in self._removed_dirs:
            return []
        return [(entry, self._local(node)) for entry, node in await listing.after(after_id, self.meta.readdir)]

    # --- attributes --------------------------------------------------------------
    async def setattr(self, ino: int, *, mode: Optional[int] = None, uid: Optional[int] = None,
                      gid: Optional[int] = None, size: Optional[int] = None,
                      atime_ns: Optional[int] = None, mtime_ns: Optional[int] = None) -> Inode:
        self._check_writable()
        if mtime_ns is not None and (mode, uid, gid, size, atime_ns) == (None,) * 5:
            node = await self._written_back_mtime(ino, mtime_ns)
            if node is not None:
                return node
        if size is not None:
            node = await self._node(ino)
            if node.is_dir:
                raise FsError(errno.EISDIR)
            if not node.is_reg:
                raise FsError(errno.EINVAL)
            await self.truncate(node, size)
        f = self._files.get(ino)
        if f is not None and (atime_ns is not None or mtime_ns is not None):
            self._refresh_from_local(f)  # passthrough writes before these times are older than them
        change = AttrChange(mode=mode, uid=uid, gid=gid, atime_ns=atime_ns, mtime_ns=mtime_ns)
        if change == AttrChange() and size is not None:
            return await self._node(ino)
        node = self._adopt(await self.meta.setattr(ino, change))
        if mtime_ns is not None:
            node.mtime_ns = mtime_ns
        return node

    async def _written_back_mtime(self, ino: int, mtime_ns: int) -> Optional[Inode]:
        """An mtime alone is what the kernel's writeback cache sends after a write, a link or
        an unlink. For a file open here it goes with the file's next commit, as its data
        does; one the metadata holds already changes nothing (the operation that changed
        the file set its ctime). Either way no metadata transaction now; None: store it."""
        f = self._files.get(ino)
        if f is not None and f.node.is_reg:
            if f.node.mtime_ns != mtime_ns:
                f.node.mtime_ns, f.node.ctime_ns = mtime_ns, max(f.node.ctime_ns, time.time_ns())
                f.attrs_dirty = True
            return f.node
        dead = self._deleted.get(ino)
        if dead is not None:  # deleted here since: nothing left to store it in
            dead.mtime_ns = mtime_ns
            return dead
        node = await self._node(ino)
        return node if node.mtime_ns == mtime_ns else None

    async def truncate(self, node: Inode, size: int) -> None:
        if size < 0:
            raise FsError(errno.EINVAL)
        f = await self._file(node)
        # Busy while it works: a close of the last handle finishing meanwhile would forget
        # the file, and the new size would be committed for a file no longer known here.
        f.users += 1
        try:
            async with f.lock:
                old_size = f.node.size
                await self._truncate_locked(f, size)  # lowers f.node.size already
                if size % self.block_size and size < old_size and self._local_store(f) is None:
                    index = size // self.block_size
                    buf = await self._dirty_block(f, index)
                    buf.resize(size % self.block_size)
                f.node.size = size
                f.attrs_dirty = True
                if f.backed:
                    f.unsealed = True  # its last block is shorter now
            if f.handles == 0:
                await self._flush_file(f)
        finally:
            f.users -= 1
            if not f.busy and self._files.get(node.id) is f:
                self._files.pop(node.id, None)

    async def _truncate_locked(self, f: OpenFile, size: int) -> None:
        store = self._local_store(f)
        if store is not None:
            try:
                store.truncate(f.inode, size)
            except OSError as exc:
                raise from_os_error(exc) from exc
        first_removed = -(-size // self.block_size)
        for index in [i for i in f.dirty if i >= first_removed]:
            f.take_dirty(index)
        for index in [i for i in f.sealing if i >= first_removed]:
            f.next_generation(index)
            del f.sealing[index]
        for index in [i for i in f.keys if i >= first_removed]:
            del f.keys[index]
            f.next_generation(index)
        now = time.time_ns()
        node, freed = await self.meta.truncate(f.inode, min(f.node.size, size), now)
        f.node.size = node.size
        f.node.mtime_ns = f.node.ctime_ns = now
        await self.blocks.release(freed.keys)

    # --- open files ----------------------------------------------------------------
    async def _file(self, node: Inode) -> OpenFile:
        """This node's state of a file, made from its block map if there is none yet."""
        f = self._files.get(node.id)
        if f is None:
            keys = await self.meta.block_map(node.id)
            f = self._files.get(node.id)  # another task may have made it meanwhile
            if f is None:
                f = self._files[node.id] = OpenFile(node=node, keys=keys)
        return f

    async def _promote(self, ino: int) -> bool:
        """Make this node's scratch file a file of the volume: its bytes sealed into blocks
        (on a shared volume uploaded before the commit) and the block map committed with
        the change. False if it is no scratch file of this node: the EXDEV stands."""
        node = await self._node(ino)
        if not node.is_reg or not node.scratch or node.scratch != self.meta.scratch_owner:
            return False
        f = await self._file(node)
        f.users += 1
        try:
            async with f.lock:
                if f.node.scratch:
                    await self._promote_locked(f)
        finally:
            f.users -= 1
            if not f.busy and self._files.get(ino) is f:
                self._files.pop(ino, None)
        return True

    async def _promote_locked(self, f: OpenFile) -> None:
        size, bs = f.node.size, self.block_size
        blocks: dict[int, Optional[tuple[str, int]]] = {}
        sealed: list[tuple[str, int]] = []  # held for the commit: committed after it, let go if it fails
        uploads_began: list[float] = []
        # With passthrough the kernel wrote the file through its page cache: read it from
        # there (a direct read would first wait for those pages to reach the disk).
        direct = not self.passthrough
        # Blocks stored while the file was written (vfs/scratch_ahead.py): each is taken if
        # the file still holds its bytes; the ones taken are committed with the rest. When
        # they were checked since the file's last write, the file is not read at all.
        ahead, checked = await self.take_sealed_ahead(f.inode, size)
        taken: list[int] = []

        def hold(index: int, stored: SealedBlock) -> None:
            """The block is stored: the commit names it (and must know when its upload began)."""
            if stored.began is not None:
                uploads_began.append(stored.began)
            sealed.append((stored.key, stored.nbytes))
            blocks[index] = (stored.key, stored.nbytes)

        def take(index: int, stored: SealedBlock) -> None:
            del ahead[index]
            taken.append(index)
            hold(index, stored)

        async def seal_block(index: int) -> None:
            nbytes = min(bs, size - index * bs)
            stored = ahead.get(index)
            if checked:  # a block with none stored is all zeros, or a hole
                if stored is not None:
                    take(index, stored)
                else:
                    blocks[index] = None
                return
            data, key = await trio.to_thread.run_sync(self._read_local_block, self.scratch, f.inode, index * bs,
                                                      nbytes, direct)
            if stored is not None and (stored.key, stored.nbytes) == (key, nbytes):
                take(index, stored)
            elif key is None:
                blocks[index] = None  # all zeros: a hole
            else:  # staged; on a shared volume put from memory into the bucket
                hold(index, await self.blocks.seal_for_commit(data, key))

        try:
            try:
                await each_at_once(seal_block, range(-(-size // bs)), SEAL_BLOCKS_AT_ONCE)
            finally:
                await self.abandon_ahead(list(ahead.values()))  # written again since, or past the end
            began: Optional[float] = min(uploads_began) if uploads_began else None

            async def promote(uploads_began: Optional[float]) -> Freed:
                return await self.meta.promote(f.inode, blocks, size, f.node.mtime_ns, uploads_began=uploads_began)

            async def put_all_again() -> float:
                return await self._put_again_from(self.scratch, f.inode, blocks, direct=not self.passthrough)

            freed = await self._commit_putting_again(promote, put_all_again, began)
        except BaseException as exc:
            await self._abandon_sealed([key for key, _ in sealed])
            translated = commit_error(exc)
            if translated is exc:
                raise
            raise translated from exc
        f.node.scratch = 0
        f.keys = {index: b[0] for index, b in blocks.items() if b is not None}
        f.attrs_dirty = False
        if f.passthrough_handles:  # the kernel goes on with the same file: now a volume file's backing file
            self.backing.adopt(f.inode, self.scratch)
            f.backed = True
            f.unsealed = f.passthrough_writers > 0
        else:
            self.scratch.remove(f.inode)
        self._remember_content(f)  # the kernel's pages hold these bytes
        for key, nbytes in sealed:
            await self.blocks.committed(key, nbytes)
        self.scratch_ahead.used_blocks += len(taken)
        self.scratch_ahead.unread_promotions += checked
        await self.blocks.release(freed.keys)
        self.promoted_files += 1
        self.promoted_bytes += size

    @staticmethod
    def _read_local_block(store: ScratchFiles, ino: int, offset: int, nbytes: int,
                          direct: bool) -> tuple[BlockData, Optional[str]]:
        """A block of a local file (scratch or backing) and its key (None: all zeros), in one
        worker thread."""
        data = store.read_block(ino, offset, nbytes, direct)
        return data, seal_digest(data)

    async def _put_again_from(self, store: ScratchFiles, ino: int, blocks: dict[int, Optional[tuple[str, int]]],
                              direct: bool, skip: Collection[str] = ()) -> float:
        """Put a local file's sealed blocks in the bucket again (the collector took them while
        they were uploaded); returns when the puts began. ``skip``: keys not in the bucket
        (inline blocks, whose commit carries them)."""
        again = time.monotonic()
        for index, block in blocks.items():
            if block is not None and block[0] not in skip:
                data = await trio.to_thread.run_sync(store.read_block, ino, index * self.block_size, block[1], direct)
                await self.blocks.put_again(block[0], data)
        return again

    async def _abandon_sealed(self, keys: list[str]) -> None:
        """Let go of blocks sealed for a commit that will not happen (shielded: on the way out)."""
        with trio.CancelScope(shield=True):
            for key in keys:
                with contextlib.suppress(Exception):
                    await self.blocks.abandon(key)

    async def _held_file(self, ino: int) -> OpenFile:
        """A file this node holds open: on the first open, fresh attributes and block map
        from the engine (close-to-open), and the engine keeps its data while it is held.

        An open may come while the last close of the same file is releasing the hold (the
        kernel sends RELEASE asynchronously): the two go through the file's ``hold_lock`` in
        turn, and ``opening`` keeps the close from forgetting the file meanwhile, else the
        engine would drop the hold this open needs and delete an unlinked file under it."""
        f = self._files.get(ino)
        if f is None:
            if await self._take_back_hold(ino):  # held still: only the fresh attributes to read
                node, keys = await self.meta.read_file(ino)
            else:
                node, keys = await self.meta.open_file(ino)
            f = self._files.get(ino)
            if f is None:
                f = self._files[ino] = OpenFile(node=node, keys=keys)
                f.page_cache_valid = self._cached_content.get(ino) == content_version(node.size, keys)
                f.held = True
                return f
        f.opening += 1
        try:
            async with f.hold_lock:
                if not f.held:
                    if not await self._take_back_hold(ino):
                        await self.meta.open_file(ino)
                    f.held = True
        finally:
            f.opening -= 1
        self._files.setdefault(ino, f)
        return f

    def keeps_page_cache(self, fh: int) -> bool:
        """Whether the kernel may keep the file's cached pages for this open: always on a
        volume of one node (every write passes through this mount); on a shared volume
        when the file's content is what it was when this node last had it open."""
        h = self._handle(fh)
        if h.file.inode in self._pages_stale and not h.passthrough:
            return False
        return not self.meta.shared or h.file.page_cache_valid or bool(h.file.node.scratch)

    def dropped_page_cache(self, ino: int) -> None:
        """An open told the kernel to drop its pages of ``ino``: none of them is stale now."""
        self._pages_stale.discard(ino)

    def _remember_content(self, f: OpenFile) -> None:
        self.remember_page_cache(f.inode, f.node.size, f.keys)

    def remember_page_cache(self, ino: int, size: int, keys: dict[int, str]) -> None:
        """The kernel's cached pages of ``ino`` hold this content (or nothing): its next open
        keeps them if the engine still has it."""
        if not self.meta.shared:
            return
        if len(self._cached_content) >= CACHED_CONTENT_MAX:
            del self._cached_content[next(iter(self._cached_content))]  # the oldest
        self._cached_content.pop(ino, None)
        self._cached_content[ino] = content_version(size, keys)

    def unknown_to_page_cache(self, ino: int) -> bool:
        """Whether the kernel can hold no pages of ``ino`` but ones of its current content:
        not open here, and (on a shared volume, where another node may change it) never
        cached here with content since remembered."""
        return ino not in self._files and ino not in self._cached_content

    async def open(self, ino: int, flags: int) -> int:
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if writing or flags & os.O_TRUNC:
            self._check_writable()
        # The first open of a file brings its attributes (close-to-open): no read of them before.
        f = await self._held_file(ino)
        f.handles += 1
        try:
            if f.node.is_dir:
                raise FsError(errno.EISDIR)
            if f.node.scratch and f.node.scratch != self.meta.scratch_owner:
                # Its blocks are on the node that made it, and nowhere else.
                log.warning("inode %d is a scratch file of another node (--scratch): it cannot be opened here",
                            ino)
                raise FsError(errno.EIO, "a scratch file of another node")
            if flags & os.O_TRUNC and f.node.size > 0:
                await self.truncate(f.node, 0)
        except BaseException:
            f.handles -= 1
            await self._let_go(f)
            raise
        return self._new_handle(f, flags)

    def _new_handle(self, f: OpenFile, flags: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = Handle(f, flags)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            f.writers += 1
        return fh

    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     ctx: RequestContext) -> tuple[int, Inode]:
        node = await self._create(parent, name, stat.S_IFREG | (mode & 0o7777), ctx, hold=True)
        f = self._files[node.id] = OpenFile(node=node, keys={}, held=True)
        f.handles += 1
        self.scratch_created(node, name)
        return self._new_handle(f, flags), node

    def _handle(self, fh: int) -> Handle:
        h = self._handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    def inode_of(self, fh: int) -> int:
        return self._handle(fh).file.inode

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        h = self._handle(fh)
        f = h.file
        end = min(offset + size, f.node.size)
        if offset >= end:
            return b""
        store = self._local_store(f)
        if store is not None:
            return store.read(f.inode, offset, end - offset)
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
        store = self._local_store(f)
        if store is not None:
            written = await self._write_local(f, store, offset, data)
            if written is not None:
                return written
        if f.out_of_space:
            # A block of this file found the cache disk full: fail as a full disk does until
            # there is room again, rather than pile more data up in memory.
            if not await self.blocks.has_room():
                raise FsError(errno.ENOSPC, "cache disk full")
            f.out_of_space = False
        await self._wait_for_room(len(data))
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

    async def _write_local(self, f: OpenFile, store: ScratchFiles, offset: int, data: bytes) -> Optional[int]:
        """A write to a file whose bytes are in a local file (this node's scratch file, or a
        backing file). None: it moved (a promotion) while this write waited: write it again."""
        async with f.lock:  # not while a promotion or a seal reads the file
            if f.node.nlink == 0 and f.handles == 0:
                raise FsError(errno.EBADF)
            if self._local_store(f) is not store:
                return None
            if f.backed:
                f.unsealed = True
            try:
                store.write(f.inode, offset, data)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not f.out_of_space:
                    log.warning("local file of inode %d: cache disk full, its writes fail: %s", f.inode, exc.strerror)
                f.out_of_space = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                raise from_os_error(exc) from exc
            f.out_of_space = False
            if offset + len(data) > f.node.size:
                f.node.size = offset + len(data)
            f.node.mtime_ns = f.node.ctime_ns = time.time_ns()
            f.attrs_dirty = True
        if store is self.scratch:
            self.scratch_written(f)
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

    async def _wait_for_room(self, nbytes: int) -> None:
        """Backpressure: on the blocks being sealed, then on dirty data (the uploader's).

        Writers get through in the order they came: a trio Lock hands itself to its longest
        waiter, and only the holder waits for room. Woken all at once by one Event they
        resumed in any order, and the kernel's writes of a block reached it out of order.
        An uncontended write passes without a checkpoint."""
        try:
            self._room_queue.acquire_nowait()
        except trio.WouldBlock:
            await self._room_queue.acquire()
        try:
            await self._wait_for_sealing(nbytes)
            await self.uploader.wait_for_room(nbytes)
        finally:
            self._room_queue.release()

    async def _wait_for_sealing(self, nbytes: int) -> None:
        """Sealing blocks count against no other bound until they are staged, and a full
        cache disk fails them only once hashed."""
        limit = SEALING_LIMIT_BLOCKS * self.block_size
        while self._sealing_bytes and self._sealing_bytes + nbytes > limit:
            await self._sealed.wait()

    def _sealing_done(self, size: int) -> None:
        self._sealing_bytes -= size
        self._sealed.set()
        self._sealed = trio.Event()

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
        staged = False  # released from the sealing bound (once, here or in the finally)
        awaiting_commit = False  # shared engines: uploaded, and registered for a commit
        inline = self._keeps_inline(f, index, data)
        put = False  # put in the bucket by this seal, for an fsync that waits (``_puts_for_fsync``)
        try:
            try:
                if inline:
                    key = self.blocks.seal_inline(data)
                elif data and self._puts_for_fsync(f):
                    key, put = await self.blocks.seal_for_fsync(data)
                else:
                    key = await self.blocks.seal(data, direct=True) if data else None
                # Staged (or a hole, or inline): the sealing bound is about memory being
                # hashed and staged. A shared engine puts the block from memory, so it stays
                # counted until its upload ends: a writer faster than the uploads waits for
                # them rather than grow the daemon's memory.
                uploads = key is not None and self.meta.shared and not inline
                if not uploads:
                    staged = True
                    self._sealing_done(size)
                began: Optional[float] = None
                if inline:
                    began = time.monotonic()  # its commit carries the bytes
                elif uploads:
                    assert key is not None
                    began = await self.blocks.upload_before_commit(key, data)
                    awaiting_commit = True
                    staged = True
                    self._sealing_done(size)
                # One commit of this file at a time, so the generation checked is still the
                # newest when the block map changes (an older seal never overwrites a newer).
                async with f.commit_lock:
                    if not f.is_current(index, generation) or self._files.get(f.inode) is not f:
                        awaiting_commit = False  # superseded by a newer write or truncate
                        await self.blocks.abandon(key)
                        return
                    try:
                        size_mtime = (f.node.size, f.node.mtime_ns)
                        freed = await self._commit_block(f, index, key, data, size_mtime, began)
                        awaiting_commit = False
                        if (f.node.size, f.node.mtime_ns) == size_mtime:
                            f.attrs_dirty = False  # recorded with the block: no commit of its own
                    except FsError as exc:
                        if exc.errno != errno.ENOENT:
                            raise
                        awaiting_commit = False
                        await self.blocks.abandon(key)  # the file is gone
                        return
            except Exception as exc:  # noqa: BLE001 - never take the daemon down; fsync reports it
                if awaiting_commit:
                    with contextlib.suppress(Exception):
                        await self.blocks.abandon(key)  # a retry seals and uploads these bytes again
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
            if f.is_current(index, generation):
                # A newer seal of this block, started while this one committed, keeps its own.
                f.sealing.pop(index, None)
            if put:
                assert key is not None
                await self.blocks.committed_uploaded(key)
            else:
                await self.blocks.committed(key, len(data))
            await self.blocks.release(freed.keys)
        finally:
            f.seal_finished()
            if not staged:
                self._sealing_done(size)
            self.uploader.room_changed()  # f.sealing let go of the block (or it is dirty again)

    def _puts_for_fsync(self, f: OpenFile) -> bool:
        """Whether ``f``'s seals put its large blocks in the bucket themselves: an fsync waits
        for them on the embedded engine with ``--durability remote``, where staging them
        first would only add two disk writes to its wait (``BlockStore.put_for_fsync``)."""
        return f.syncing > 0 and self.durability == "remote" and not self.meta.shared and self.ship_metadata is not None

    def _keeps_inline(self, f: OpenFile, index: int, data: BlockData) -> bool:
        """Whether a sealed block goes to the database with its commit, not to the bucket:
        the only block of a file no larger than the engine's ``inline_max``."""
        limit = self.meta.inline_max
        return index == 0 and 0 < len(data) <= limit and f.node.size <= limit and not f.node.scratch

    async def _commit_block(self, f: OpenFile, index: int, key: Optional[str], data: BlockData,
                            size_mtime: tuple[int, int], began: Optional[float]) -> Freed:
        """Commit one sealed block (durably while an fsync of the file waits for it)."""
        inline = {key: bytes(data)} if key is not None and is_inline(key) else None

        async def commit(uploads_began: Optional[float]) -> Freed:
            return await self.meta.commit_blocks(f.inode, {index: (key, len(data)) if key else None}, *size_mtime,
                                                 durable=f.syncing > 0, uploads_began=uploads_began, inline=inline)

        async def put_again() -> float:
            assert key is not None  # a hole is never refused
            if inline:
                return time.monotonic()  # the commit carries the bytes again
            return await self.blocks.put_again(key, data)

        return await self._commit_putting_again(commit, put_again, began)

    @staticmethod
    async def _commit_putting_again(commit: Callable[[Optional[float]], Awaitable[Freed]],
                                    put_again: Callable[[], Awaitable[float]], began: Optional[float]) -> Freed:
        """``commit(began)``; while a shared engine answers EAGAIN (the collector deleted
        some of these bytes from the bucket while they were uploaded), wait past the
        deletion in progress, put them again and commit again."""
        for attempt in range(PUT_AGAIN_TRIES + 1):
            try:
                return await commit(began)
            except FsError as exc:
                if exc.errno != errno.EAGAIN or attempt == PUT_AGAIN_TRIES:
                    raise
            log.info("blocks were collected while they were uploaded: putting them again")
            await trio.sleep(PUT_AGAIN_AFTER)
            began = await put_again()
        raise AssertionError("unreachable")

    @staticmethod
    def _seal_error(f: OpenFile, index: int, exc: Exception, quiet: bool = False) -> FsError:
        """What flush and fsync report for a block that could not be stored (write, too, for
        a full disk). ``quiet``: the file already found the disk full, and said so."""
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            if not quiet:
                log.warning("block %d of inode %d stays in memory, its writes fail: %s",
                            index, f.inode, exc.strerror)
            return FsError(errno.ENOSPC, exc.strerror or "")
        if isinstance(exc, FsError):  # an answer of the engine (a lost session): no traceback to show
            log.error("could not store block %d of inode %d: %s", index, f.inode, exc.strerror)
        else:
            log.error("could not store block %d of inode %d", index, f.inode, exc_info=exc)
        return FsError(errno.EIO, str(exc))

    async def _flush_file(self, f: OpenFile) -> None:
        if f.unsealed:
            await self._seal_backing(f)
        else:
            self._refresh_from_local(f)
        if not (f.dirty or f.in_flight or f.attrs_dirty or f.error):
            return  # nothing written since: the common close (and every close of a dup'd fd)
        async with f.lock:
            for index in list(f.dirty):
                self._seal(f, index)
        await f.idle.wait()
        if f.attrs_dirty and self._files.get(f.inode) is f:
            f.attrs_dirty = False
            try:
                async with f.commit_lock:
                    await self.meta.commit_blocks(f.inode, {}, f.node.size, f.node.mtime_ns,
                                                  durable=f.syncing > 0)
            except FsError as exc:
                if exc.errno != errno.ENOENT:  # deleted meanwhile: nothing left to record
                    raise
        if f.error is not None:
            error, f.error = f.error, None
            raise error

    async def flush(self, fh: int) -> None:
        h = self._handle(fh)
        f = h.file
        if f.node.nlink == 0:
            return  # unlinked: its data is going away anyway
        if f.unsealed and not (h.passthrough_writes or h.flags & os.O_ACCMODE != os.O_RDONLY):
            return  # a reader's close: the writers' closes seal
        await self._flush_file(f)

    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is None:
            return
        f = h.file
        f.handles -= 1
        if h.flags & os.O_ACCMODE != os.O_RDONLY:
            f.writers -= 1
            self.scratch_writer_closed(f)
        self._passthrough_closed(h)
        if f.handles > 0:
            return
        try:
            if f.node.nlink > 0 and (f.dirty or f.sealing or f.attrs_dirty or f.unsealed
                                     or f.passthrough_writers or f.node.scratch):
                await self._flush_file(f)
        finally:
            await self._let_go(f)

    async def _let_go(self, f: OpenFile) -> None:
        """The last handle closed: the engine may now delete an unlinked file's data."""
        if f.handles > 0:
            return
        async with f.hold_lock:
            if f.handles > 0 or f.opening:
                return  # opened again while this close waited
            if f.held:
                f.held = False
                self._remember_content(f)
                if self.meta.shared and f.node.nlink > 0 and self._nursery is not None:
                    self._holds_to_release.add(f.inode)
                else:  # an unlinked file's data goes with its last holder: now
                    await self._settle(await self.meta.close_file(f.inode))
        if not f.busy and self._files.get(f.inode) is f:
            del self._files[f.inode]
            self._drop_backing(f)

    async def _take_back_hold(self, ino: int) -> bool:
        """Whether this node's hold of ``ino`` is still in the database, waiting to be
        released: it is kept, and the release is off. One being released right now is
        waited for (an open must not register its hold before that delete)."""
        if ino in self._holds_to_release:
            self._holds_to_release.discard(ino)
            return True
        releasing = self._holds_releasing.get(ino)
        if releasing is not None:
            await releasing.wait()
        return False

    async def release_holds(self) -> None:
        """Release the holds of files closed since the last batch, in one transaction."""
        if not self._holds_to_release:
            return
        if getattr(self.meta, "lost", False):  # the clean-up of its session dropped them all
            self._holds_to_release.clear()
            return
        batch = sorted(self._holds_to_release)
        self._holds_to_release.clear()
        done = trio.Event()
        for ino in batch:
            self._holds_releasing[ino] = done
        try:
            for freed in await self.meta.close_files(batch):
                await self._settle(freed)
        finally:
            for ino in batch:
                self._holds_releasing.pop(ino, None)
            done.set()

    async def _release_holds_loop(self) -> None:
        while True:
            await trio.sleep(HOLD_RELEASE_DELAY)
            try:
                await self.release_holds()
            except Exception as exc:  # noqa: BLE001 - the holds stay until the session ends: no data at risk
                log.warning("could not release the holds of closed files: %s", exc)

    async def fsync(self, fh: int, datasync: bool = False) -> None:
        f = self._handle(fh).file
        f.syncing += 1  # the file's last commits are made durable in place
        try:
            await self._flush_file(f)
        finally:
            f.syncing -= 1
        if f.node.scratch:
            return  # on the cache disk, and gone at the next mount whatever is synced
        keys = [k for k in f.keys.values() if self.uploader.is_pending(k)]
        try:
            if self.durability == "local":
                await self.uploader.sync_staged(keys)
            elif self.ship_metadata is None:  # a shared engine commits uploaded blocks only
                await self.uploader.wait_uploaded(keys)
            # else the journal segment that carries the block map uploads them alongside it
        except UploadFailed as exc:
            raise FsError(errno.EIO, str(exc)) from exc
        await self.sync_metadata()

    async def sync_metadata(self) -> None:
        """Metadata durable as the durability mode says: local disk, or the bucket too."""
        await self.meta.sync()
        if self.durability == "remote" and self.ship_metadata is not None:
            try:
                await self.ship_metadata()
            except OSError as exc:
                raise FsError(errno.EIO, str(exc)) from exc

    async def fsyncdir(self, fh: int) -> None:
        ino = self._dir_handles[fh].ino
        kept_here = getattr(self.meta, "kept_here", None)
        if kept_here is not None and kept_here(ino):
            return  # its entries are in this node's memory (meta.scratch.namespace): gone at the unmount anyway
        node = await self._check_dir(ino)
        if node is None or not node.scratch:  # shared: asking would cost what syncing does
            await self.sync_metadata()

    async def _expire_dirty_loop(self) -> None:
        """Seal blocks that stayed dirty too long, so data reaches staging (and the bucket)."""
        while True:
            await trio.sleep(1.0)
            deadline = time.monotonic() - DIRTY_EXPIRE_SECONDS
            for f in list(self._files.values()):
                if f.unsealed and not f.handles and not f.lock.locked():
                    await self._retry_seal(f)
                old = [i for i, t in f.dirty_since.items() if t < deadline]
                if old and not f.lock.locked():
                    async with f.lock:
                        for index in old:
                            if index in f.dirty:
                                self._seal(f, index)

    async def _retry_seal(self, f: OpenFile) -> None:
        """A closed file whose seal failed (a full disk, the bucket away): try again."""
        try:
            await self._seal_backing(f)
        except FsError as exc:
            log.warning("inode %d: its backing file is still not in blocks: %s", f.inode, exc.strerror)
            return
        if not f.busy and self._files.get(f.inode) is f:
            del self._files[f.inode]
            self._drop_backing(f)

    # --- whole-file helpers (warmup) ---------------------------------------------
    async def file_keys(self, ino: int) -> list[str]:
        f = self._files.get(ino)
        keys = f.keys if f is not None else await self.meta.block_map(ino)
        return list(keys.values())

    # --- statfs ------------------------------------------------------------------
    def statfs(self) -> StatFs:
        bs = self.block_size
        counts = self.meta.stats()
        used = counts.used_bytes
        total = REMOTE_CAPACITY // bs
        free = max(0, total - -(-used // bs))
        inodes = counts.inodes
        return StatFs(block_size=bs, blocks=total, blocks_free=free,
                      files=inodes + (1 << 32), files_free=1 << 32)
