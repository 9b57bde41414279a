"""pyfuse3 operations over the vfs.

Thin on purpose: convert arguments and attributes, map vfs errors to FUSE
errors, and decide kernel caching (writeback cache on, page cache kept).
Every request stays on the trio loop; slow work is sent elsewhere by the vfs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

import pyfuse3

from fusestate.fuse.kernel_names import MAX_INODES, KernelNames
from fusestate.fuse.page_fill import PageFill
from fusestate.read_trace import ReadTrace
from fusestate.meta.engine import Inode
from fusestate.vfs import FileSystem, FsError, RequestContext

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

ST_BLKSIZE = 128 * 1024
# The extended attribute whose setting asks for a fill (see setxattr), and how many names one
# request may carry (the kernel's 64 KiB value limit holds about this many SST names).
FILL_XATTR = b"user.fusestate.fill"
FILL_NAMES_MAX = 4096
# The extended attribute whose setting asks whether this node holds a directory's files (see
# setxattr); its value is the share of their bytes that must be local, 0.5 when empty.
WARM_XATTR = b"user.fusestate.warm"
WARM_SHARE_DEFAULT = 0.5


def _translate_errors(fn: F) -> F:
    """Map vfs errors to FUSE errors, and count and time the operation."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: "FuseOperations", *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await fn(self, *args, **kwargs)
        except FsError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except pyfuse3.FUSEError:
            raise
        except Exception:
            log.exception("internal error in %s", name)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            self.counters[name] = self.counters.get(name, 0) + 1
            if self.op_observer is not None:
                self.op_observer(name, time.perf_counter() - started)

    return wrapper  # type: ignore[return-value]


def _invalidate_entry(parent: int, name: bytes) -> None:
    """Have the kernel drop its entry ``parent/name`` (from a thread of pyfuse3's: never
    waiting on a request this loop answers)."""
    pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)


def _ctx(ctx: Optional[pyfuse3.RequestContext]) -> RequestContext:
    if ctx is None:
        return RequestContext()
    return RequestContext(uid=ctx.uid, gid=ctx.gid, pid=ctx.pid)


class FuseOperations(pyfuse3.Operations):
    # Without the writeback cache every small write is a round trip (RocksDB at 0.07x).
    enable_writeback_cache = True
    supports_dot_lookup = True

    def __init__(self, fs: FileSystem, attr_timeout: float = 10.0) -> None:
        super().__init__()
        self.fs = fs
        self.attr_timeout = attr_timeout
        self.counters: dict[str, int] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        # Latency hook (metrics): called with the operation name and seconds.
        self.op_observer: Optional[Callable[[str, float], None]] = None
        # Fills the page cache with files linked here (--prefetch-links); None: off.
        self.page_fill: Optional[PageFill] = None
        # (warm bytes, bytes) of the files under an inode: set by the mount, for WARM_XATTR
        self.warm_share: Optional[Callable[[int], Awaitable[tuple[int, int]]]] = None
        self.trace: Optional[ReadTrace] = None  # --read-trace
        # How to have the kernel drop an entry: the front end serving this mount says.
        self.invalidate_entry: Callable[[int, bytes], None] = _invalidate_entry
        # The kernel's names of each inode, dropped when another node changes the file.
        self.kernel_names = KernelNames(lambda parent, name: self.invalidate_entry(parent, name),
                                        max_inodes=MAX_INODES if fs.meta.shared else 0)
        changes = getattr(fs.meta, "changes", None) if fs.meta.shared else None
        if changes is not None:
            changes.inode_listeners.append(self.kernel_names.changed_elsewhere)

    def _entry(self, parent: int, name: bytes, node: Inode) -> pyfuse3.EntryAttributes:
        """``node``'s attributes as the kernel's new entry ``parent/name`` (call it only for
        a reply the kernel takes: it counts a lookup)."""
        if node.is_reg:
            self.kernel_names.handed(node.id, parent, name, node.size)
        return self._attrs(node)

    def _attrs(self, node: Inode) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.id
        a.generation = 0
        a.entry_timeout = self.attr_timeout
        a.attr_timeout = self.attr_timeout
        a.st_mode = node.mode
        a.st_nlink = node.nlink
        a.st_uid = node.uid
        a.st_gid = node.gid
        a.st_rdev = node.rdev
        a.st_size = node.size
        a.st_blksize = ST_BLKSIZE
        a.st_blocks = -(-node.size // 512)
        a.st_atime_ns = node.atime_ns
        a.st_mtime_ns = node.mtime_ns
        a.st_ctime_ns = node.ctime_ns
        return a

    # --- namespace ---------------------------------------------------------
    @_translate_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            return self._entry(parent_inode, name, await self.fs.lookup(parent_inode, name))
        except FsError as exc:
            if exc.errno == errno.ENOENT:
                a = pyfuse3.EntryAttributes()  # cached negative entry
                a.st_ino = 0
                a.entry_timeout = self.attr_timeout
                return a
            raise

    @_translate_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(await self.fs.getattr(inode))

    @_translate_errors
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: Optional[int], ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if fields.update_size and self.page_fill is not None:
            await self.page_fill.stop(inode)
        node = await self.fs.setattr(
            inode,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        self.kernel_names.sized(inode, node.size)
        return self._attrs(node)

    @_translate_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.fs.readlink(inode)

    @_translate_errors
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(parent_inode, name, await self.fs.mknod(parent_inode, name, mode, rdev, _ctx(ctx)))

    @_translate_errors
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(await self.fs.mkdir(parent_inode, name, mode, _ctx(ctx)))

    @_translate_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.unlink(parent_inode, name)

    @_translate_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.rmdir(parent_inode, name)

    @_translate_errors
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attrs(await self.fs.symlink(parent_inode, name, target, _ctx(ctx)))

    @_translate_errors
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: pyfuse3.RequestContext) -> None:
        await self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_translate_errors
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = await self.fs.link(inode, new_parent_inode, new_name)
        if self.page_fill is not None:
            try:
                await self.page_fill.linked(node)
            except Exception as exc:  # noqa: BLE001 - the link is made: a fill never fails it
                log.warning("not filling the page cache with inode %d: %s", node.id, exc)
        return self._entry(new_parent_inode, new_name, node)

    # --- files -------------------------------------------------------------
    @_translate_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        fh = await self.fs.open(inode, flags)
        if flags & os.O_TRUNC:
            self.kernel_names.sized(inode, 0)  # the kernel truncates its own view
        # A truncating open drops the cached pages; otherwise they stay while they hold the
        # file's content (on a shared volume another node may have changed it).
        keep = not flags & os.O_TRUNC and self.fs.keeps_page_cache(fh)
        if self.page_fill is not None and (not keep or flags & os.O_ACCMODE != os.O_RDONLY):
            await self.page_fill.stop(inode)  # its pages are about to hold other content
        if not keep:
            self.fs.dropped_page_cache(inode)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    async def backing_fd(self, fh: int) -> Optional[int]:
        """A file the kernel may serve this open from itself (FUSE passthrough: the native
        front end, where the kernel agreed), or None."""
        try:
            return await self.fs.passthrough_open(fh)
        except Exception:  # noqa: BLE001 - the open stands; the daemon serves it
            log.exception("no backing file for handle %d", fh)
            return None

    @_translate_errors
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        fh, node = await self.fs.create(parent_inode, name, mode, flags, _ctx(ctx))
        return pyfuse3.FileInfo(fh=fh, keep_cache=True), self._entry(parent_inode, name, node)

    @_translate_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        data = await self.fs.read(fh, off, size)
        self.bytes_read += len(data)
        if self.trace is not None:
            self.trace.event("read", ino=self.fs.inode_of(fh), off=off, n=len(data))
        return data

    @_translate_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        written = await self.fs.write(fh, off, buf)
        self.bytes_written += written
        if self.kernel_names.enabled:  # a shared volume only: no work per write elsewhere
            self.kernel_names.sized(*self.fs.file_size(fh))
        return written

    @_translate_errors
    async def flush(self, fh: int) -> None:
        await self.fs.flush(fh)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        self.kernel_names.forgotten(inode_list)
        self.fs.forget([ino for ino, _ in inode_list])

    @_translate_errors
    async def release(self, fh: int) -> None:
        await self.fs.release(fh)

    @_translate_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.fs.fsync(fh, datasync)

    # --- directories -------------------------------------------------------
    @_translate_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return await self.fs.opendir(inode)

    @_translate_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        await self.list_into(fh, start_id, functools.partial(pyfuse3.readdir_reply, token))

    async def list_into(self, fh: int, start_id: int,
                        add: Callable[[bytes, pyfuse3.EntryAttributes, int], bool]) -> None:
        """Hand a directory's entries after ``start_id`` to the kernel's reply through ``add``
        (False: the reply is full, that entry not in it), with their attributes (readdirplus)."""
        parent = self.fs.directory_of(fh)
        for entry, node in await self.fs.readdir(fh, start_id):
            if not add(entry.name, self._attrs(node), entry.entry_id):
                break
            if node.is_reg:  # the kernel took the entry: one lookup more
                self.kernel_names.handed(node.id, parent, entry.name, node.size)

    async def releasedir(self, fh: int) -> None:
        self.fs.releasedir(fh)

    @_translate_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.fs.fsyncdir(fh)

    @_translate_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = self.fs.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = s.block_size
        out.f_frsize = s.block_size
        out.f_blocks = s.blocks
        out.f_bfree = s.blocks_free
        out.f_bavail = s.blocks_free
        out.f_files = s.files
        out.f_ffree = s.files_free
        out.f_favail = s.files_free
        out.f_namemax = s.name_max
        return out

    # --- extended attributes: none stored; one name is a request -------------
    @_translate_errors
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        """``user.fusestate.fill`` asks for files to be put into the page cache: on a file, that
        file; on a directory, the entries its value names (NUL-separated). Nothing is stored.
        Through the mount, so it reaches this daemon from any process that sees the volume, at
        any path and as any user the kernel lets set the attribute (write access), where the
        control socket is this daemon's user's only. The caller has looked the files up (the
        kernel must know an inode to take its pages) and opens them only after asking (a file
        open here is not filled)."""
        if name == WARM_XATTR:
            await self._warm_probe(inode, value)
            return
        if name != FILL_XATTR:
            raise pyfuse3.FUSEError(errno.ENOTSUP)
        node = await self.fs.getattr(inode)
        targets: list[Inode] = []
        if node.is_dir:
            names = [n for n in value.split(b"\0") if n]
            for child in names[:FILL_NAMES_MAX]:
                with contextlib.suppress(FsError):  # gone since the caller listed it: nothing to fill
                    targets.append(await self.fs.lookup(inode, child))
        elif node.is_reg:
            targets = [node]
        else:
            raise pyfuse3.FUSEError(errno.EINVAL)
        if self.page_fill is not None:
            await self.page_fill.requested_all(targets)

    async def _warm_probe(self, inode: int, value: bytes) -> None:
        """``user.fusestate.warm`` asks whether this node holds the files under a directory (or
        a file): it succeeds when at least the share ``value`` (0.5 when empty) of their bytes
        has its blocks here, and fails with ENODATA when not, or when there are no bytes. A
        question, not a setting: nothing is stored. The answer is the error code because this
        daemon answers no getxattr (see below), and the mount reaches it from any process on
        the node (a Spark executor asks it which state stores to prefer: docs/spark.md)."""
        if self.warm_share is None:
            raise pyfuse3.FUSEError(errno.ENOTSUP)
        try:
            share = float(value.decode() or WARM_SHARE_DEFAULT)
        except (UnicodeDecodeError, ValueError):
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        if not 0.0 <= share <= 1.0:
            raise pyfuse3.FUSEError(errno.EINVAL)
        warm, total = await self.warm_share(inode)
        if total == 0 or warm < share * total:
            raise pyfuse3.FUSEError(errno.ENODATA)

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        # ENOSYS, not ENODATA: the kernel then stops sending getxattr for good (callers
        # see EOPNOTSUPP). Otherwise every write(2) costs a round trip to this daemon,
        # the security.capability check that precedes each write (RocksDB WAL at 0.1x).
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        return []

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
