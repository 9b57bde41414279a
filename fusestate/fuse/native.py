"""The native front end: the kernel connection in Rust (``fusestate_kernel``, built on fuser),
the answers from the same :class:`FuseOperations` the pyfuse3 front end serves.

fuser reads each request in a thread of its own and queues it; an eventfd wakes this trio
loop, which takes the queued requests as tuples and answers each in a task of its own. What
this front end has that pyfuse3 (libfuse 3.14) lacks is FUSE passthrough: an open answered
with a backing file has its reads and writes served by the kernel from that file.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import pyfuse3
import trio

from fusestate.fuse.adapter import FuseOperations

log = logging.getLogger(__name__)

Request = tuple[tuple[int, int, int, int], str, tuple[Any, ...]]


@dataclass(frozen=True)
class Context:
    """The caller of a request (pyfuse3.RequestContext's fields)."""
    uid: int
    gid: int
    pid: int
    umask: int = 0


@dataclass(frozen=True)
class SetattrFields:
    """Which attributes a setattr changes (pyfuse3.SetattrFields' fields)."""
    update_mode: bool
    update_uid: bool
    update_gid: bool
    update_size: bool
    update_atime: bool
    update_mtime: bool
    update_ctime: bool = False


def _setattr_request(mode: Optional[int], uid: Optional[int], gid: Optional[int], size: Optional[int],
                     atime_ns: Optional[int], mtime_ns: Optional[int]) -> tuple[pyfuse3.EntryAttributes, SetattrFields]:
    attr = pyfuse3.EntryAttributes()
    if mode is not None:
        attr.st_mode = mode
    if uid is not None:
        attr.st_uid = uid
    if gid is not None:
        attr.st_gid = gid
    if size is not None:
        attr.st_size = size
    if atime_ns is not None:
        attr.st_atime_ns = atime_ns
    if mtime_ns is not None:
        attr.st_mtime_ns = mtime_ns
    fields = SetattrFields(mode is not None, uid is not None, gid is not None, size is not None,
                           atime_ns is not None, mtime_ns is not None)
    return attr, fields


class NativeFrontEnd:
    """Mounts with ``fusestate_kernel.Session`` and answers its requests on this trio loop."""

    def __init__(self, ops: FuseOperations, *, writeback_cache: bool = True, passthrough: bool = False) -> None:
        self.name = "passthrough" if passthrough else "native"
        self.ops = ops
        self.writeback_cache = writeback_cache
        self.passthrough = passthrough
        self.session: Any = None
        self.passthrough_agreed = False
        self._serving: Optional[trio.CancelScope] = None
        self._handlers: dict[str, Callable[..., Awaitable[None]]] = {
            name[len("_op_"):]: getattr(self, name) for name in dir(self) if name.startswith("_op_")}

    # --- the session ----------------------------------------------------------------
    def mount(self, mountpoint: str, options: set[str]) -> None:
        import fusestate_kernel

        self.session = fusestate_kernel.Session(mountpoint, sorted(options), writeback_cache=self.writeback_cache,
                                                passthrough=self.passthrough)
        self.ops.invalidate_entry = self.session.invalidate_entry
        self.passthrough_agreed = bool(self.session.agreed()["passthrough"])
        fs = self.ops.fs
        fs.passthrough = self.passthrough_agreed
        if self.passthrough_agreed:
            # Backing files kept for their next reader take a quarter of the read cache's room.
            fs.retain_bytes = fs.blocks.disk.lend(fs.blocks.disk.limit // 4)

    def agreed(self) -> dict[str, Any]:
        """What the kernel agreed to at INIT, and the backing files registered with it now."""
        if self.session is None:
            return {}
        _, _, backing_files = self.session.passthrough_stats()
        return {**self.session.agreed(), "backing_files_registered": backing_files}

    def notify_store(self, inode: int, offset: int, data: bytes) -> None:
        self.session.notify_store(inode, offset, data)

    async def serve(self) -> None:
        """Answer requests until the file system is unmounted (or :meth:`terminate`)."""
        fd = self.session.event_fd
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as self._serving:
                while True:
                    await trio.lowlevel.wait_readable(fd)
                    batch = self.session.take()
                    if batch is None:
                        break
                    for request in batch:
                        nursery.start_soon(self._answer, request)

    def terminate(self) -> None:
        """Stop taking requests (a forced unmount: the kernel has let go of the mount)."""
        if self._serving is not None:
            self._serving.cancel()
        if self.session is not None:
            self.session.abandon()

    def close(self) -> None:
        if self.session is not None:
            self.session.close()

    async def _answer(self, request: Request) -> None:
        (rid, uid, gid, pid), op, args = request
        try:
            await self._handlers[op](rid, Context(uid, gid, pid), *args)
        except pyfuse3.FUSEError as exc:
            self._error(rid, exc.errno)
        except Exception:  # noqa: BLE001 - the kernel gets EIO, the log the cause
            log.exception("internal error answering %s", op)
            self._error(rid, errno.EIO)

    def _error(self, rid: int, err: int) -> None:
        try:
            self.session.reply_error(rid, err)
        except KeyError:  # answered already (the error came after the reply), or no reply due
            pass

    # --- one handler per request ----------------------------------------------------
    async def _op_lookup(self, rid: int, ctx: Context, parent: int, name: bytes) -> None:
        self.session.reply_entry(rid, await self.ops.lookup(parent, name, ctx))

    async def _op_forget(self, rid: int, ctx: Context, items: list[tuple[int, int]]) -> None:
        await self.ops.forget(items)

    async def _op_getattr(self, rid: int, ctx: Context, inode: int) -> None:
        self.session.reply_attr(rid, await self.ops.getattr(inode, ctx))

    async def _op_setattr(self, rid: int, ctx: Context, inode: int, fh: Optional[int], mode: Optional[int],
                          uid: Optional[int], gid: Optional[int], size: Optional[int], atime_ns: Optional[int],
                          mtime_ns: Optional[int]) -> None:
        attr, fields = _setattr_request(mode, uid, gid, size, atime_ns, mtime_ns)
        self.session.reply_attr(rid, await self.ops.setattr(inode, attr, fields, fh, ctx))

    async def _op_readlink(self, rid: int, ctx: Context, inode: int) -> None:
        self.session.reply_data(rid, await self.ops.readlink(inode, ctx))

    async def _op_mknod(self, rid: int, ctx: Context, parent: int, name: bytes, mode: int, rdev: int) -> None:
        self.session.reply_entry(rid, await self.ops.mknod(parent, name, mode, rdev, ctx))

    async def _op_mkdir(self, rid: int, ctx: Context, parent: int, name: bytes, mode: int) -> None:
        self.session.reply_entry(rid, await self.ops.mkdir(parent, name, mode, ctx))

    async def _op_unlink(self, rid: int, ctx: Context, parent: int, name: bytes) -> None:
        await self.ops.unlink(parent, name, ctx)
        self.session.reply_ok(rid)

    async def _op_rmdir(self, rid: int, ctx: Context, parent: int, name: bytes) -> None:
        await self.ops.rmdir(parent, name, ctx)
        self.session.reply_ok(rid)

    async def _op_symlink(self, rid: int, ctx: Context, parent: int, name: bytes, target: bytes) -> None:
        self.session.reply_entry(rid, await self.ops.symlink(parent, name, target, ctx))

    async def _op_rename(self, rid: int, ctx: Context, parent: int, name: bytes, new_parent: int,
                         new_name: bytes, flags: int) -> None:
        await self.ops.rename(parent, name, new_parent, new_name, flags, ctx)
        self.session.reply_ok(rid)

    async def _op_link(self, rid: int, ctx: Context, inode: int, new_parent: int, new_name: bytes) -> None:
        self.session.reply_entry(rid, await self.ops.link(inode, new_parent, new_name, ctx))

    async def _op_open(self, rid: int, ctx: Context, inode: int, flags: int) -> None:
        fi = await self.ops.open(inode, flags, ctx)
        backing = await self.ops.backing_fd(fi.fh) if self.passthrough_agreed else None
        if not self.session.reply_open(rid, inode, fi.fh, fi.keep_cache, fi.direct_io, backing) and backing is not None:
            self.ops.fs.passthrough_refused(fi.fh)

    async def _op_create(self, rid: int, ctx: Context, parent: int, name: bytes, mode: int, flags: int) -> None:
        fi, attrs = await self.ops.create(parent, name, mode, flags, ctx)
        backing = await self.ops.backing_fd(fi.fh) if self.passthrough_agreed else None
        if not self.session.reply_create(rid, attrs, fi.fh, fi.keep_cache, fi.direct_io, backing) and backing is not None:
            self.ops.fs.passthrough_refused(fi.fh)

    async def _op_read(self, rid: int, ctx: Context, fh: int, offset: int, size: int) -> None:
        self.session.reply_data(rid, await self.ops.read(fh, offset, size))

    async def _op_write(self, rid: int, ctx: Context, fh: int, offset: int, data: bytes) -> None:
        self.session.reply_write(rid, await self.ops.write(fh, offset, data))

    async def _op_flush(self, rid: int, ctx: Context, fh: int) -> None:
        await self.ops.flush(fh)
        self.session.reply_ok(rid)

    async def _op_release(self, rid: int, ctx: Context, inode: int, fh: int) -> None:
        await self.ops.release(fh)
        self.session.reply_ok(rid)

    async def _op_fsync(self, rid: int, ctx: Context, fh: int, datasync: bool) -> None:
        await self.ops.fsync(fh, datasync)
        self.session.reply_ok(rid)

    async def _op_opendir(self, rid: int, ctx: Context, inode: int) -> None:
        self.session.reply_open(rid, inode, await self.ops.opendir(inode, ctx))

    async def _op_readdirplus(self, rid: int, ctx: Context, fh: int, offset: int) -> None:
        session = self.session
        await self.ops.list_into(fh, offset, lambda name, attrs, next_id: session.dir_add(rid, name, attrs, next_id))
        session.reply_dir(rid)

    async def _op_releasedir(self, rid: int, ctx: Context, fh: int) -> None:
        await self.ops.releasedir(fh)
        self.session.reply_ok(rid)

    async def _op_fsyncdir(self, rid: int, ctx: Context, fh: int, datasync: bool) -> None:
        await self.ops.fsyncdir(fh, datasync)
        self.session.reply_ok(rid)

    async def _op_statfs(self, rid: int, ctx: Context) -> None:
        s = await self.ops.statfs(ctx)
        self.session.reply_statfs(rid, s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize,
                                  s.f_namemax, s.f_frsize)

    async def _op_setxattr(self, rid: int, ctx: Context, inode: int, name: bytes, value: bytes) -> None:
        await self.ops.setxattr(inode, name, value, ctx)
        self.session.reply_ok(rid)

    async def _op_getxattr(self, rid: int, ctx: Context, inode: int, name: bytes, size: int) -> None:
        value = await self.ops.getxattr(inode, name, ctx)
        self._xattr_reply(rid, value, size)

    async def _op_listxattr(self, rid: int, ctx: Context, inode: int, size: int) -> None:
        names = await self.ops.listxattr(inode, ctx)
        self._xattr_reply(rid, b"".join(n + b"\0" for n in names), size)

    async def _op_removexattr(self, rid: int, ctx: Context, inode: int, name: bytes) -> None:
        await self.ops.removexattr(inode, name, ctx)
        self.session.reply_ok(rid)

    def _xattr_reply(self, rid: int, value: bytes, size: int) -> None:
        """The size the caller must provide (a request of size 0), the value, or ERANGE."""
        if size == 0:
            self.session.reply_xattr_size(rid, len(value))
        elif len(value) > size:
            self.session.reply_error(rid, errno.ERANGE)
        else:
            self.session.reply_data(rid, value)
