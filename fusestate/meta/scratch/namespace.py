"""A shared volume's scratch directories, their contents kept in this node's memory.

A scratch directory (``--scratch``) belongs to the node that made it: its files' bytes are
plain files in that node's cache dir, no other node can open them, and they go when its
mount ends. Kept as rows of the database, each operation of a RocksDB working dir (a
table's create, its fsync and close, the links of a checkpoint, the deletes after a
compaction) would be a transaction on the server while the executor waits. So only the
scratch directory itself is a row (the other nodes see it, empty, and its session's end
removes it); what is made inside it lives in this process: inodes, names and attributes,
answered from memory. A directory's entries are kept in the order of their ids, which a
listing continues after (``_add_entry``). The POSIX rules, and which error each breach
answers, are those of the engines: ``meta.posix`` holds them for both.

Crossing the edge keeps POSIX's meaning:

- a file of the volume linked or renamed into a scratch dir (a state store loaded from its
  checkpoint) gets a name here; this node holds the file, as an open file, while such a
  name exists, so no other node's delete takes its data away;
- a scratch file linked or renamed out (a checkpoint's commit) is promoted: its inode
  becomes a row, with the number it had here (numbers are reserved from the database's
  sequence, so they are never anyone else's), its blocks are committed, and the link or
  rename goes to the database;
- a directory does not cross: EXDEV, as between file systems.

Everything else goes to the engine underneath, which this wraps (``inner``).
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import trio

from fusestate.meta import posix
from fusestate.meta.engine import (RENAME_EXCHANGE, AttrChange, DirEntry, EngineStats, Freed, FsError, Inode,
                                   MetaEngine, NewNode)

ID_BATCH = 1024  # inode numbers reserved from the database at a time


@dataclass
class _Dir:
    """A directory whose entries live here: a local directory, or a scratch root (a row of
    the database whose contents are this node's)."""

    parent: int
    entries: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # name -> (entry id, inode)
    subdirs: int = 0


def _copy(node: Inode) -> Inode:
    return dataclasses.replace(node)


class NodeLocalNames:
    """The vfs's engine on a shared volume with scratch directories (see the module)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._nodes: dict[int, Inode] = {}     # inodes made here
        self._dirs: dict[int, _Dir] = {}       # their directories, and the scratch roots
        self._roots: dict[int, Inode] = {}     # scratch roots: their attributes as last seen
        self._root_names: dict[int, tuple[int, bytes]] = {}  # root -> (parent, name) as made or moved here
        self._opened: set[int] = set()         # inodes made here that the vfs holds open
        self._foreign: dict[int, int] = {}     # files of the volume named here: how many names
        # Files of the volume the vfs holds open: with the names above, what this node's hold
        # in the database stands for; it goes when neither is left.
        self._vfs_open: set[int] = set()
        self._unnamed: set[int] = set()        # promoted here, no name in the database yet
        self._entry_ids = itertools.count(1)
        self._ids: list[int] = []
        self._reserving = trio.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # everything about blocks, objects and sessions

    # --- bookkeeping -------------------------------------------------------------------
    async def _new_id(self) -> int:
        if not self._ids:
            async with self._reserving:
                if not self._ids:
                    self._ids = list(reversed(await self.inner.reserve_inode_ids(ID_BATCH)))
        return self._ids.pop()

    def _noted(self, node: Inode, parent: Optional[int] = None, name: Optional[bytes] = None) -> Inode:
        """An inode the database answered with, counting what is here: a file's names here
        in its link count; a scratch root of this node remembered (its entries live here),
        with its subdirectories here in its link count."""
        node.nlink += self._foreign.get(node.id, 0)
        if node.is_dir and node.scratch and node.scratch == self.inner.scratch_owner:
            if node.id not in self._dirs:
                self._dirs[node.id] = _Dir(parent or 0)
            seen = self._roots.get(node.id)
            if seen is not None:  # changed here since: its times are this node's
                node.mtime_ns = max(node.mtime_ns, seen.mtime_ns)
                node.ctime_ns = max(node.ctime_ns, seen.ctime_ns)
            self._roots[node.id] = _copy(node)
            if parent is not None and name is not None:
                self._root_names[node.id] = (parent, name)
            node.nlink += self._dirs[node.id].subdirs
        return node

    def _touch(self, ino: int, now: int) -> None:
        node = self._nodes.get(ino) or self._roots.get(ino)
        if node is not None:
            node.mtime_ns = node.ctime_ns = now

    def _dir_attrs(self, ino: int) -> Inode:
        node = self._nodes.get(ino) or self._roots.get(ino)
        assert node is not None, ino
        return node

    def _here(self, ino: int) -> Optional[_Dir]:
        """The entries of a directory kept here; None for a directory of the database's.
        ENOTDIR for a file made here."""
        d = self._dirs.get(ino)
        if d is None and ino in self._nodes:
            posix.directory(self._nodes[ino])
        return d

    def _add_entry(self, parent: int, name: bytes, ino: int) -> None:
        """``name`` names ``ino``: a new name gets an id above every other, so a directory's
        entries stay in the order of their ids, which listings continue after; a name renamed
        over keeps its id and place, as a row of the database's ``entries`` does."""
        entries = self._dirs[parent].entries
        old = entries.get(name)
        entries[name] = (old[0] if old is not None else next(self._entry_ids), ino)

    async def _database_directory(self, ino: int) -> None:
        """The rules of the directory a name leaves this node for, before the EXDEV a file
        made here answers there (the vfs promotes it, then asks again)."""
        posix.live_directory(await self.inner.getattr(ino))

    def _root_of(self, ino: int) -> int:
        while ino in self._nodes:
            ino = self._dirs[ino].parent
        return ino

    def _is_ancestor(self, ancestor: int, ino: int) -> bool:
        while True:
            if ino == ancestor:
                return True
            if ino not in self._nodes:
                return False
            ino = self._dirs[ino].parent

    async def _hold_foreign(self, ino: int) -> Inode:
        """A file of the volume gets a name here: held by this node while it has one."""
        names = self._foreign.get(ino, 0)
        held = bool(names) or ino in self._vfs_open
        node = await self.inner.getattr(ino) if held else (await self.inner.open_file(ino))[0]
        try:
            posix.check_linkable(node.is_dir, node.nlink, held=bool(names))
        except FsError:
            if not held and not self._foreign.get(ino) and ino not in self._vfs_open:
                await self.inner.close_file(ino)
            raise
        self._foreign[ino] = self._foreign.get(ino, 0) + 1
        node.nlink += self._foreign[ino]
        return node

    async def _inner_link(self, ino: int, parent: int, name: bytes) -> Inode:
        """A name in the database. A file this node holds through its names here may have
        none there (promoted here, or its names elsewhere removed): ``link_held``."""
        if ino not in self._unnamed and not self._foreign.get(ino):
            return await self.inner.link(ino, parent, name)
        node = await self.inner.link_held(ino, parent, name)
        self._unnamed.discard(ino)
        return node

    async def _drop_foreign(self, ino: int) -> Freed:
        """One of this node's names of a file of the volume went."""
        left = self._foreign[ino] - 1
        if left:
            self._foreign[ino] = left
            return Freed()
        del self._foreign[ino]
        if ino in self._vfs_open:
            return Freed()
        return await self.inner.close_file(ino)

    async def _drop_name(self, ino: int, now: int) -> Freed:
        """A name of ``ino`` went from a directory here (the entry is gone already)."""
        node = self._nodes.get(ino)
        if node is None:
            return await self._drop_foreign(ino)
        if node.is_dir:
            parent = self._dirs.pop(ino).parent
            self._dirs[parent].subdirs -= 1
            if parent in self._nodes:
                self._nodes[parent].nlink -= 1
            node.nlink = 0
        else:
            node.nlink -= 1
        node.ctime_ns = now
        if node.nlink == 0 and ino not in self._opened:
            del self._nodes[ino]
            return Freed(deleted_inode=ino, unlinked=_copy(node))
        return Freed(unlinked=_copy(node))

    def _check_root_removable(self, parent: int, name: bytes) -> None:
        """A scratch root's row may not go while entries live here."""
        for root, where in self._root_names.items():
            if where == (parent, name) and self._dirs[root].entries:
                raise FsError(errno.ENOTEMPTY)

    def _forget_root(self, freed: Freed) -> None:
        root = freed.deleted_inode
        if root is not None and root in self._roots:
            del self._roots[root]
            self._dirs.pop(root, None)
            self._root_names.pop(root, None)

    # --- namespace ---------------------------------------------------------------------
    async def getattr(self, ino: int) -> Inode:
        node = self._nodes.get(ino)
        if node is not None:
            return _copy(node)
        return self._noted(await self.inner.getattr(ino))

    async def lookup(self, parent: int, name: bytes) -> Inode:
        posix.check_lookup_name(name)
        d = self._here(parent)
        if d is None:
            return self._noted(await self.inner.lookup(parent, name), parent, name)
        if name == b".":
            return await self.getattr(parent)
        if name == b"..":
            return await self.getattr(d.parent if parent in self._nodes else await self.inner.parent_of(parent))
        entry = d.entries.get(name)
        posix.check_found(entry is not None)
        return await self.getattr(entry[1])

    async def create(self, parent: int, name: bytes, node: NewNode, hold: bool = False) -> Inode:
        posix.check_name(name)
        d = self._here(parent)
        if d is None:
            made = self._noted(await self.inner.create(parent, name, node, hold), parent, name)
            if hold:
                self._vfs_open.add(made.id)
            return made
        if getattr(self.inner, "lost", False):
            raise FsError(errno.EIO, "this mount's metadata session ended")
        at = posix.live_directory(self._dir_attrs(parent))
        posix.check_free(name in d.entries)
        ino = await self._new_id()
        # Made, or the directory removed, while a batch of numbers was reserved.
        at = posix.live_directory(self._dir_attrs(parent) if parent in self._dirs else None)
        posix.check_free(name in d.entries)
        made = posix.new_inode(at, node, time.time_ns(), self.inner.scratch_owner, ino)
        self._nodes[ino] = made
        self._add_entry(parent, name, ino)
        if made.is_dir:
            self._dirs[ino] = _Dir(parent)
            d.subdirs += 1
            if parent in self._nodes:
                self._nodes[parent].nlink += 1
        self._touch(parent, made.ctime_ns)
        if hold:
            self._opened.add(ino)
        return _copy(made)

    async def link(self, ino: int, parent: int, name: bytes) -> Inode:
        posix.check_name(name)
        node = self._nodes.get(ino)
        if node is not None:
            posix.check_linkable(node.is_dir, node.nlink)
        d = self._here(parent)
        if d is None:
            if node is None:
                return self._noted(await self._inner_link(ino, parent, name))
            await self._database_directory(parent)
            raise FsError(errno.EXDEV, "a scratch file is promoted before it is named in the volume")
        if node is not None:
            posix.live_directory(self._dir_attrs(parent))
            posix.check_free(name in d.entries)
            node.nlink += 1
            node.ctime_ns = time.time_ns()
            answer = _copy(node)
        else:
            answer = await self._hold_foreign(ino)  # the file's own rules, asked of the database
            try:  # the directory's, as it is after that wait
                posix.live_directory(self._dir_attrs(parent) if parent in self._dirs else None)
                posix.check_free(name in d.entries)
            except FsError:
                await self._drop_foreign(ino)
                raise
        self._add_entry(parent, name, ino)
        self._touch(parent, time.time_ns())
        return answer

    async def unlink(self, parent: int, name: bytes) -> Freed:
        posix.check_lookup_name(name)
        d = self._here(parent)
        if d is None:
            return await self.inner.unlink(parent, name)
        entry = d.entries.get(name)
        posix.check_found(entry is not None)
        ino = entry[1]
        posix.check_unlinkable(ino in self._dirs)  # only a directory made here is one
        del d.entries[name]
        now = time.time_ns()
        self._touch(parent, now)
        return await self._drop_name(ino, now)

    async def rmdir(self, parent: int, name: bytes) -> Freed:
        posix.check_rmdir_name(name)
        posix.check_lookup_name(name)
        d = self._here(parent)
        if d is None:
            self._check_root_removable(parent, name)
            freed = await self.inner.rmdir(parent, name)
            self._forget_root(freed)
            return freed
        entry = d.entries.get(name)
        posix.check_found(entry is not None)
        ino = entry[1]
        sub = self._dirs.get(ino)
        posix.check_removable(sub is not None, sub is None or not sub.entries)
        del d.entries[name]
        now = time.time_ns()
        self._touch(parent, now)
        return await self._drop_name(ino, now)

    async def rename(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                     flags: int = 0) -> Freed:
        posix.check_rename_names(src_name, dst_name)
        here_src, here_dst = self._here(src_parent) is not None, self._here(dst_parent) is not None
        if here_src and here_dst:
            return await self._rename_here(src_parent, src_name, dst_parent, dst_name, flags)
        if here_dst:
            return await self._rename_in(src_parent, src_name, dst_parent, dst_name, flags)
        if here_src:
            return await self._rename_out(src_parent, src_name, dst_parent, dst_name, flags)
        if not flags & RENAME_EXCHANGE:
            self._check_root_removable(dst_parent, dst_name)
        freed = await self.inner.rename(src_parent, src_name, dst_parent, dst_name, flags)
        self._forget_root(freed)
        for root, where in list(self._root_names.items()):
            if where == (src_parent, src_name):
                self._root_names[root] = (dst_parent, dst_name)
            elif flags & RENAME_EXCHANGE and where == (dst_parent, dst_name):
                self._root_names[root] = (src_parent, src_name)
        return freed

    async def _rename_here(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                           flags: int) -> Freed:
        sd, dd = self._dirs[src_parent], self._dirs[dst_parent]
        src = sd.entries.get(src_name)
        posix.check_found(src is not None)
        dst = dd.entries.get(dst_name)
        posix.check_rename_target(flags, dst is not None)
        a = src[1]
        a_dir = a in self._dirs
        now = time.time_ns()
        if flags & RENAME_EXCHANGE:
            b = dst[1]
            b_dir = b in self._dirs
            posix.check_not_into_itself(src_parent != dst_parent and (
                (a_dir and self._is_ancestor(a, dst_parent)) or (b_dir and self._is_ancestor(b, src_parent))))
            sd.entries[src_name] = (src[0], b)
            dd.entries[dst_name] = (dst[0], a)
            if src_parent != dst_parent:
                for ino, old, new in ((a, src_parent, dst_parent), (b, dst_parent, src_parent)):
                    if ino in self._dirs:
                        self._move_dir(ino, old, new)
            for ino in {a, b, src_parent, dst_parent}:
                if ino in self._nodes:
                    self._nodes[ino].ctime_ns = now
            self._touch(src_parent, now)
            self._touch(dst_parent, now)
            return Freed()
        if dst is not None and dst[1] == a:
            return Freed()  # two names of one file: nothing happens
        posix.check_not_into_itself(a_dir and self._is_ancestor(a, dst_parent))
        if dst is not None:
            replaced = self._dirs.get(dst[1])
            posix.check_replace(a_dir, replaced is not None, replaced is None or not replaced.entries)
        del sd.entries[src_name]
        self._add_entry(dst_parent, dst_name, a)
        if a_dir and src_parent != dst_parent:
            self._move_dir(a, src_parent, dst_parent)
        if a in self._nodes:
            self._nodes[a].ctime_ns = now
        self._touch(src_parent, now)
        self._touch(dst_parent, now)
        return await self._drop_name(dst[1], now) if dst is not None else Freed()

    def _move_dir(self, ino: int, old: int, new: int) -> None:
        self._dirs[ino].parent = new
        self._dirs[old].subdirs -= 1
        self._dirs[new].subdirs += 1
        if old in self._nodes:
            self._nodes[old].nlink -= 1
        if new in self._nodes:
            self._nodes[new].nlink += 1

    async def _rename_in(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                         flags: int) -> Freed:
        """A file of the volume renamed into a scratch dir: its name goes from the database,
        and this node holds the file under its new name."""
        src = await self.inner.lookup(src_parent, src_name)
        if src.is_dir or flags & RENAME_EXCHANGE:
            raise FsError(errno.EXDEV, "a directory, or an exchange, between scratch and the volume")
        dd = self._dirs[dst_parent]
        dst = dd.entries.get(dst_name)
        posix.check_rename_target(flags, dst is not None)
        if dst is not None:
            if dst[1] == src.id:
                return Freed()
            posix.check_replace(False, dst[1] in self._dirs, True)
        await self._hold_foreign(src.id)
        try:
            freed = await self.inner.unlink(src_parent, src_name)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._drop_foreign(src.id)
            raise
        now = time.time_ns()
        dst = dd.entries.get(dst_name)  # as it is now
        self._add_entry(dst_parent, dst_name, src.id)
        self._touch(dst_parent, now)
        if dst is not None:
            replaced = await self._drop_name(dst[1], now)
            return Freed(keys=freed.keys + replaced.keys, deleted_inode=replaced.deleted_inode,
                         unlinked=replaced.unlinked)
        return Freed(keys=freed.keys)

    async def _rename_out(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                          flags: int) -> Freed:
        """A name here renamed into the volume: a scratch file is promoted first (EXDEV
        tells the vfs to), a directory does not move (EXDEV stands); a file of the volume is
        linked into this scratch dir's root under a passing name, which the database then
        renames over the target, so the target is replaced at once."""
        sd = self._dirs[src_parent]
        src = sd.entries.get(src_name)
        posix.check_found(src is not None)
        ino = src[1]
        if ino in self._nodes or flags & RENAME_EXCHANGE:
            await self._database_directory(dst_parent)
            raise FsError(errno.EXDEV, "a scratch file is promoted before it is moved into the volume")
        root = self._root_of(src_parent)
        passing = b".fusestate-rename-%d-%d" % (ino, next(self._entry_ids))
        await self._inner_link(ino, root, passing)
        try:
            freed = await self.inner.rename(root, passing, dst_parent, dst_name, flags)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.inner.unlink(root, passing)
            raise
        now = time.time_ns()
        if sd.entries.get(src_name) == src:
            del sd.entries[src_name]
            self._touch(src_parent, now)
            dropped = await self._drop_foreign(ino)
            freed.keys += dropped.keys
        return freed

    async def setattr(self, ino: int, change: AttrChange) -> Inode:
        node = self._nodes.get(ino)
        if node is None:
            return self._noted(await self.inner.setattr(ino, change))
        change.apply(node, time.time_ns())
        return _copy(node)

    async def readdir(self, ino: int, after_id: int, limit: int = 1000) -> list[tuple[DirEntry, Inode]]:
        d = self._here(ino)
        if d is None:
            return [(entry, self._noted(node, ino, entry.name))
                    for entry, node in await self.inner.readdir(ino, after_id, limit)]
        out: list[tuple[DirEntry, Inode]] = []
        for name, (entry_id, child) in list(d.entries.items()):  # in id order (``_add_entry``)
            if entry_id > after_id:
                try:
                    out.append((DirEntry(entry_id, name, child), await self.getattr(child)))
                except FsError:
                    continue  # a file of the volume gone meanwhile
                if len(out) >= limit:
                    break
        return out

    async def parent_of(self, ino: int) -> int:
        if ino in self._nodes:
            return self._dirs[ino].parent
        return await self.inner.parent_of(ino)

    # --- file data -----------------------------------------------------------------------
    async def open_file(self, ino: int) -> tuple[Inode, dict[int, str]]:
        node = self._nodes.get(ino)
        if node is not None:
            self._opened.add(ino)
            return _copy(node), {}
        if self._foreign.get(ino) or ino in self._vfs_open:
            answer = await self.inner.read_file(ino)
        else:
            answer = await self.inner.open_file(ino)
        self._vfs_open.add(ino)
        return answer

    async def read_file(self, ino: int) -> tuple[Inode, dict[int, str]]:
        node = self._nodes.get(ino)
        if node is not None:
            return _copy(node), {}
        return await self.inner.read_file(ino)

    def _close_here(self, ino: int) -> Optional[Freed]:
        """A close this node answers itself; None: the database's."""
        node = self._nodes.get(ino)
        if node is not None:
            self._opened.discard(ino)
            if node.nlink == 0:
                del self._nodes[ino]
                return Freed(deleted_inode=ino)
            return Freed()
        self._vfs_open.discard(ino)
        return Freed() if self._foreign.get(ino) else None

    async def close_file(self, ino: int) -> Freed:
        here = self._close_here(ino)
        return here if here is not None else await self.inner.close_file(ino)

    async def close_files(self, inodes: Sequence[int]) -> list[Freed]:
        answers = {ino: self._close_here(ino) for ino in inodes}
        rest = [ino for ino, freed in answers.items() if freed is None]
        if rest:
            answers.update(zip(rest, await self.inner.close_files(rest)))
        return [answers[ino] or Freed() for ino in inodes]

    async def commit_blocks(self, ino: int, blocks: dict[int, Optional[tuple[str, int]]],
                            size: int, mtime_ns: int, durable: bool = False,
                            uploads_began: Optional[float] = None,
                            inline: Optional[dict[str, bytes]] = None) -> Freed:
        node = self._nodes.get(ino)
        if node is None:
            return await self.inner.commit_blocks(ino, blocks, size, mtime_ns, durable=durable,
                                                  uploads_began=uploads_began, inline=inline)
        if blocks:
            raise FsError(errno.EIO, "blocks for a scratch file")  # its bytes are never blocks
        node.size, node.mtime_ns = size, mtime_ns
        node.ctime_ns = max(node.ctime_ns, mtime_ns)
        return Freed()

    async def truncate(self, ino: int, size: int, mtime_ns: int) -> tuple[Inode, Freed]:
        node = self._nodes.get(ino)
        if node is None:
            return await self.inner.truncate(ino, size, mtime_ns)
        node.size = size
        node.mtime_ns = node.ctime_ns = mtime_ns
        return _copy(node), Freed()

    async def block_map(self, ino: int) -> dict[int, str]:
        if ino in self._nodes:
            return {}
        return await self.inner.block_map(ino)

    async def promote(self, ino: int, blocks: dict[int, Optional[tuple[str, int]]],
                      size: int, mtime_ns: int, uploads_began: Optional[float] = None) -> Freed:
        """A scratch file made here becomes a row (held by this node, with no name yet) and
        is promoted there; its names here then name a file of the volume."""
        node = self._nodes.get(ino)
        if node is None:
            return await self.inner.promote(ino, blocks, size, mtime_ns, uploads_began=uploads_began)
        if not node.is_reg:
            raise FsError(errno.EXDEV)
        await self.inner.adopt_scratch(node)
        try:
            freed = await self.inner.promote(ino, blocks, size, mtime_ns, uploads_began=uploads_began)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.inner.close_file(ino)  # the row goes again: the file stays here
            raise
        del self._nodes[ino]
        self._unnamed.add(ino)
        if node.nlink:
            self._foreign[ino] = node.nlink
        if ino in self._opened:
            self._opened.discard(ino)
            self._vfs_open.add(ino)
        if not node.nlink and ino not in self._vfs_open:
            freed.keys += (await self.inner.close_file(ino)).keys
        return freed

    # --- the rest ------------------------------------------------------------------------
    async def start(self) -> Freed:
        for table in (self._nodes, self._dirs, self._roots, self._root_names, self._opened, self._foreign):
            table.clear()
        self._vfs_open.clear()
        self._unnamed.clear()
        return await self.inner.start()

    def stats(self) -> EngineStats:
        counts = self.inner.stats()
        return EngineStats(inodes=counts.inodes + len(self._nodes), used_bytes=counts.used_bytes)

    def kept_here(self, ino: int) -> bool:
        """Whether ``ino`` is a directory whose entries live here (nothing to sync)."""
        return ino in self._dirs


def node_local(inner: MetaEngine) -> MetaEngine:
    """``inner`` with its scratch directories' contents kept on this node, where that pays:
    a shared engine (the embedded one answers from local disk already)."""
    if not inner.shared:
        return inner
    return NodeLocalNames(inner)  # type: ignore[return-value]
