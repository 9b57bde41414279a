"""The POSIX operations as SQL transactions, shared by the SQL engines.

Each function here is one whole operation run inside one transaction that its engine
opened (``Tx``): it reads what it checks and writes what it changes in that same
transaction, so a check can never be overtaken by another node. SQL is written once,
with ``?`` placeholders and statements both SQLite and PostgreSQL accept; an engine's
``Tx`` supplies what differs (placeholders, row locks, who holds a file open).

Which error each operation answers, and in what order, is ``posix``'s (the scratch
namespace keeps the same rules with the same functions). Rows are locked in increasing inode order (``Tx.lock``) before they are changed: two
operations on the same inodes queue instead of deadlocking. Names are read before the
locks are taken and read again after; a name that moved in between restarts the
operation (``Restart``).
"""

from __future__ import annotations

import errno
import stat
from collections import Counter
from typing import Callable, Iterable, Optional, Protocol, Sequence

from fusestate.errors import FsError
from fusestate.meta import posix
from fusestate.meta.engine import (RENAME_EXCHANGE, ROOT_INODE, AttrChange, DirEntry, Freed, Inode, NewNode,
                                   ObjectInfo)

INODE_COLUMNS = "id, mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, rdev, symlink_target, scratch"
INODE_ROW = f"SELECT {INODE_COLUMNS} FROM inodes WHERE id=?"  # one inode's row, unlocked
JOINED_INODE_COLUMNS = ", ".join("i." + c for c in INODE_COLUMNS.split(", "))  # inodes aliased as i
_S_IFMT = 0o170000  # the file type bits of st_mode
_NEW_INODE_COLUMNS = "mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, rdev, symlink_target, scratch"
_NEW_INODE_VALUES = ", ".join("?" * len(_NEW_INODE_COLUMNS.split(", ")))


class Restart(Exception):
    """What an operation read changed before it could lock it: run it again."""


class Holds(Protocol):
    """Which files some node holds open (their data outlives their last name)."""

    def add(self, tx: "Tx", ino: int) -> None: ...
    def remove(self, tx: "Tx", ino: int) -> None: ...
    def held(self, tx: "Tx", ino: int) -> bool: ...


class Tx(Protocol):
    """One open transaction of an engine."""

    now_ns: int
    block_size: int
    holds: Holds
    # Counter deltas the engine applies when the transaction commits.
    inodes_delta: int
    used_delta: int
    # True where blocks are committed only once they are in the bucket (shared engines).
    commits_uploaded: bool
    # What a scratch directory made in this transaction records as its owner (Inode.scratch).
    scratch_owner: int

    def one(self, sql: str, args: tuple = ()) -> Optional[tuple]: ...
    def all(self, sql: str, args: tuple = ()) -> list[tuple]: ...
    def exec(self, sql: str, args: tuple = ()) -> None:
        """A statement whose result nobody reads: an engine may queue it and send it with
        the next statement whose rows are read (errors surface there, or at commit)."""
        ...
    def later(self, sql: str, args: tuple = ()) -> Callable[[], list[tuple]]:
        """A statement whose rows are wanted, but not yet: an engine may queue it and send
        it with the next statement whose rows are read. Calling the result gives its rows."""
        ...
    def lock(self, inodes: Iterable[int]) -> None:
        """Lock these inodes' rows. An engine may only queue the lock: it is taken, in
        order, before the next statement whose rows are read."""
        ...
    def inode_row(self, ino: int) -> Optional[tuple]:
        """The inode's ``INODE_COLUMNS`` (an engine may answer from the rows it locked)."""
        ...
    def changed(self, ino: int) -> None:
        """An inode's row was updated or deleted (an engine that caches attributes drops it)."""
        ...
    def saved(self, node: Inode) -> None:
        """The inode's row now holds ``node`` (an engine may remember it once committed)."""
        ...
    def lock_moves(self) -> None:
        """Serialize directory moves between parents with each other: the check that a
        directory is not moved under itself walks ancestors it does not lock, so two such
        moves at once could otherwise make a cycle (Linux's VFS keeps one rename lock for
        the same reason). Taken before any inode lock."""
        ...
    def new_inode_id(self) -> Optional[int]:
        """The number for a new inode, or None to let the database choose one. Never a
        number the kernel may still remember for another file (FUSE's generation stays 0),
        so never one freed earlier in this mount."""
        ...
    def unreferenced_mark(self) -> int:
        """The engine's position in its history when a block loses its last reference
        (SQLite: the journal sequence; gc keeps the block while a restore point needs it)."""
        ...


def inode_of_row(row: tuple) -> Inode:
    *cols, scratch = row
    target = cols[10]
    return Inode(*cols[:10], symlink_target=bytes(target) if target is not None else None, scratch=int(scratch))


def get(tx: Tx, ino: int) -> Inode:
    return found(tx.inode_row(ino))


def found(row: Optional[tuple]) -> Inode:
    """The inode of an ``INODE_ROW`` row; ENOENT for none."""
    if row is None:
        raise FsError(errno.ENOENT)
    return inode_of_row(row)


def _maybe(tx: Tx, ino: int) -> Optional[Inode]:
    row = tx.inode_row(ino)
    return inode_of_row(row) if row is not None else None


def _directory(tx: Tx, ino: int) -> Inode:
    return posix.directory(_maybe(tx, ino))


_ENTRY = "SELECT inode FROM entries WHERE parent=? AND name=?"


def _entry(tx: Tx, parent: int, name: bytes) -> Optional[int]:
    row = tx.one(_ENTRY, (parent, name))
    return row[0] if row else None


def _entries(tx: Tx, *names: tuple[int, bytes]) -> list[Optional[int]]:
    """Several names' inodes, asked at once (one round trip)."""
    pending = [tx.later(_ENTRY, name) for name in names]
    return [rows[0][0] if rows else None for rows in (p() for p in pending)]


def _save(tx: Tx, node: Inode) -> None:
    tx.changed(node.id)
    tx.saved(node)
    tx.exec("UPDATE inodes SET mode=?, uid=?, gid=?, size=?, nlink=?, atime_ns=?, mtime_ns=?, ctime_ns=?"
            " WHERE id=?", (node.mode, node.uid, node.gid, node.size, node.nlink,
                            node.atime_ns, node.mtime_ns, node.ctime_ns, node.id))


def _touch(tx: Tx, node: Inode, mtime: bool = True) -> None:
    node.ctime_ns = tx.now_ns
    if mtime:
        node.mtime_ns = tx.now_ns


def _has_entries(tx: Tx, ino: int) -> bool:
    return tx.one("SELECT 1 FROM entries WHERE parent=? LIMIT 1", (ino,)) is not None


def _not_empty(tx: Tx, directory: Inode) -> bool:
    """Whether a directory may not be removed: it has entries, or it is another node's
    scratch directory, whose entries live on that node (``meta.scratch``) until its
    session ends and takes the directory with it."""
    return bool(directory.scratch and directory.scratch != tx.scratch_owner) or _has_entries(tx, directory.id)


def _check_scratch_move(tx: Tx, node: Inode, new_parent: Inode) -> None:
    """A scratch file gets no name outside its scratch (EXDEV, as between two file systems:
    mv then copies, and a link promotes the file first, see ``promote``), nor in another
    node's, except a whole scratch dir moved into the volume, which stays scratch. A file of
    the volume may get names in this node's scratch dirs (a state store loaded into its
    node-local working dir links its checkpoint's files there); they go with the dir."""
    if node.scratch == new_parent.scratch:
        return
    if node.scratch and node.is_dir and not new_parent.scratch:
        return
    if not node.scratch and not node.is_dir and new_parent.scratch == tx.scratch_owner:
        return
    raise FsError(errno.EXDEV, "scratch and the rest of the volume are separate")


# --- namespace -----------------------------------------------------------------------

def parent_of(tx: Tx, ino: int) -> int:
    if ino == ROOT_INODE:
        return ROOT_INODE
    row = tx.one("SELECT parent FROM entries WHERE inode=? LIMIT 1", (ino,))
    return row[0] if row else ROOT_INODE


# One statement, whether the name is there or not (half of Spark's lookups are for names
# not made yet): the parent's mode comes along to tell ENOENT from ENOTDIR. Arguments:
# (name, parent); its answer goes to ``looked_up``.
LOOKUP = (f"SELECT p.mode, {JOINED_INODE_COLUMNS} FROM inodes p"
          " LEFT JOIN entries e ON e.parent = p.id AND e.name = ?"
          " LEFT JOIN inodes i ON i.id = e.inode WHERE p.id = ?")


def looked_up(row: Optional[tuple]) -> Inode:
    """The inode ``LOOKUP`` found, or the error its row tells."""
    if row is None:
        raise FsError(errno.ENOENT)
    if row[1] is not None:
        return inode_of_row(row[1:])
    if row[0] & _S_IFMT != stat.S_IFDIR:
        raise FsError(errno.ENOTDIR)
    raise FsError(errno.ENOENT)


def lookup(tx: Tx, parent: int, name: bytes) -> Inode:
    """``.``, ``..`` and names too long; a plain name is the one statement ``LOOKUP``."""
    if posix.plain_name(name):
        return looked_up(tx.one(LOOKUP, (name, parent)))
    posix.check_lookup_name(name)
    _directory(tx, parent)
    if name == b".":
        return get(tx, parent)
    return get(tx, parent_of(tx, parent))


def create(tx: Tx, parent_id: int, name: bytes, new: NewNode, hold: bool = False) -> Inode:
    posix.check_name(name)
    tx.lock([parent_id])
    existing = _entry(tx, parent_id, name)  # asked with the lock (one round trip)
    parent = posix.live_directory(_maybe(tx, parent_id))
    posix.check_free(existing is not None)
    if parent.scratch and parent.scratch != tx.scratch_owner:
        # Its files' bytes would be on this node, its names go with the other one.
        raise FsError(errno.EIO, "a scratch directory of another node")
    scratch = parent.scratch or (tx.scratch_owner if stat.S_ISDIR(new.mode) and new.scratch_name else 0)
    node = posix.new_inode(parent, new, tx.now_ns, scratch)
    columns = (node.mode, node.uid, node.gid, node.size, node.nlink, node.atime_ns, node.mtime_ns, node.ctime_ns,
               node.rdev, node.symlink_target, node.scratch)
    chosen = tx.new_inode_id()
    if chosen is None:
        row = tx.one(f"INSERT INTO inodes ({_NEW_INODE_COLUMNS}) VALUES ({_NEW_INODE_VALUES}) RETURNING id", columns)
    else:
        row = tx.one(f"INSERT INTO inodes (id, {_NEW_INODE_COLUMNS}) VALUES (?, {_NEW_INODE_VALUES}) RETURNING id",
                     (chosen, *columns))
    assert row is not None
    node.id = row[0]
    tx.exec("INSERT INTO entries (parent, name, inode) VALUES (?, ?, ?)", (parent_id, name, node.id))
    tx.inodes_delta += 1
    if node.is_dir:
        parent.nlink += 1
    _touch(tx, parent)
    _save(tx, parent)
    if hold:
        tx.holds.add(tx, node.id)
    return node


def adopt(tx: Tx, node: Inode) -> None:
    """An inode made on one node alone (``meta.scratch``) becomes a row under the number
    it had there, with no name yet and held by this node, as a scratch file of its own: so
    that ``promote`` can commit its blocks and a link then name it."""
    columns = (node.mode, node.uid, node.gid, 0, 0, node.atime_ns, node.mtime_ns, node.ctime_ns, node.rdev,
               node.symlink_target, tx.scratch_owner)
    tx.exec(f"INSERT INTO inodes (id, {_NEW_INODE_COLUMNS}) VALUES (?, {_NEW_INODE_VALUES})", (node.id, *columns))
    tx.inodes_delta += 1
    tx.holds.add(tx, node.id)


def link(tx: Tx, ino: int, parent_id: int, name: bytes, held: bool = False) -> Inode:
    """``held``: the caller holds the file, which may have no name in the database (made a
    row by ``adopt``, or named only in the node's scratch dirs); a file with no name is
    otherwise one that was deleted."""
    posix.check_name(name)
    tx.lock([ino, parent_id])
    existing = _entry(tx, parent_id, name)  # with the lock; checked last, as create does
    node = get(tx, ino)
    posix.check_linkable(node.is_dir, node.nlink, held)
    parent = posix.live_directory(_maybe(tx, parent_id))
    _check_scratch_move(tx, node, parent)
    posix.check_free(existing is not None)
    tx.exec("INSERT INTO entries (parent, name, inode) VALUES (?, ?, ?)", (parent_id, name, ino))
    node.nlink += 1
    _touch(tx, node, mtime=False)
    _touch(tx, parent)
    _save(tx, node)
    _save(tx, parent)
    return node


def _locked_child(tx: Tx, parent_id: int, name: bytes) -> tuple[Inode, Inode]:
    """A directory and its child named ``name``, both locked; ENOENT if there is none."""
    posix.check_lookup_name(name)
    child = _entry(tx, parent_id, name)
    if child is None:
        _directory(tx, parent_id)
        posix.check_found(False)
    tx.lock([parent_id, child])
    if _entry(tx, parent_id, name) != child:
        raise Restart()
    return _directory(tx, parent_id), get(tx, child)


def unlink(tx: Tx, parent_id: int, name: bytes) -> Freed:
    parent, node = _locked_child(tx, parent_id, name)
    posix.check_unlinkable(node.is_dir)
    tx.exec("DELETE FROM entries WHERE parent=? AND name=?", (parent_id, name))
    node.nlink -= 1
    _touch(tx, node, mtime=False)
    _touch(tx, parent)
    _save(tx, node)
    _save(tx, parent)
    freed = _drop_if_unused(tx, node)
    freed.unlinked = node
    return freed


def rmdir(tx: Tx, parent_id: int, name: bytes) -> Freed:
    posix.check_rmdir_name(name)
    parent, node = _locked_child(tx, parent_id, name)
    posix.check_removable(node.is_dir, node.is_dir and not _not_empty(tx, node))
    tx.exec("DELETE FROM entries WHERE parent=? AND name=?", (parent_id, name))
    node.nlink = 0
    parent.nlink -= 1
    _touch(tx, parent)
    _save(tx, parent)
    _touch(tx, node, mtime=False)
    _save(tx, node)
    freed = _drop_if_unused(tx, node)
    freed.unlinked = node
    return freed


def _is_dir(tx: Tx, ino: int) -> bool:
    row = tx.one("SELECT mode FROM inodes WHERE id=?", (ino,))  # the type never changes: no lock needed
    return row is not None and stat.S_ISDIR(row[0])


def _is_ancestor(tx: Tx, ancestor: int, ino: int) -> bool:
    while True:
        if ino == ancestor:
            return True
        if ino == ROOT_INODE:
            return False
        ino = parent_of(tx, ino)


def rename(tx: Tx, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes, flags: int) -> Freed:
    posix.check_rename_names(src_name, dst_name)
    names = (src_parent, src_name), (dst_parent, dst_name)
    ino, target = _entries(tx, *names)
    if ino is None:
        _directory(tx, src_parent)
        _directory(tx, dst_parent)
        posix.check_found(False)
    if src_parent != dst_parent and any(_is_dir(tx, i) for i in (ino, target) if i is not None):
        tx.lock_moves()
    tx.lock({src_parent, dst_parent, ino} | ({target} if target is not None else set()))
    if _entries(tx, *names) != [ino, target]:
        raise Restart()
    src_dir = _directory(tx, src_parent)
    dst_dir = src_dir if dst_parent == src_parent else posix.live_directory(_maybe(tx, dst_parent))
    node = get(tx, ino)
    _check_scratch_move(tx, node, dst_dir)
    posix.check_rename_target(flags, target is not None)
    if flags & RENAME_EXCHANGE:
        assert target is not None
        other = get(tx, target)
        _check_scratch_move(tx, other, src_dir)
        _exchange(tx, src_dir, src_name, node, dst_dir, dst_name, other)
        return Freed()
    if target == ino:
        return Freed()  # two names of one file: POSIX says do nothing
    posix.check_not_into_itself(node.is_dir and _is_ancestor(tx, ino, dst_parent))
    replaced = get(tx, target) if target is not None else None
    if replaced is not None:
        posix.check_replace(node.is_dir, replaced.is_dir, not replaced.is_dir or not _not_empty(tx, replaced))
    tx.exec("DELETE FROM entries WHERE parent=? AND name=?", (src_parent, src_name))
    if replaced is not None:
        tx.exec("UPDATE entries SET inode=? WHERE parent=? AND name=?", (ino, dst_parent, dst_name))
        if replaced.is_dir:
            replaced.nlink = 0
            dst_dir.nlink -= 1
        else:
            replaced.nlink -= 1
        _touch(tx, replaced, mtime=False)
        _save(tx, replaced)
    else:
        tx.exec("INSERT INTO entries (parent, name, inode) VALUES (?, ?, ?)", (dst_parent, dst_name, ino))
    if node.is_dir and src_parent != dst_parent:
        src_dir.nlink -= 1
        dst_dir.nlink += 1
    _touch(tx, node, mtime=False)
    _save(tx, node)
    for d in {src_dir.id: src_dir, dst_dir.id: dst_dir}.values():
        _touch(tx, d)
        _save(tx, d)
    freed = _drop_if_unused(tx, replaced) if replaced is not None else Freed()
    freed.unlinked = replaced
    return freed


def _exchange(tx: Tx, src_dir: Inode, src_name: bytes, a: Inode, dst_dir: Inode, dst_name: bytes, b: Inode) -> None:
    posix.check_not_into_itself(src_dir.id != dst_dir.id and (
        (a.is_dir and _is_ancestor(tx, a.id, dst_dir.id)) or (b.is_dir and _is_ancestor(tx, b.id, src_dir.id))))
    tx.exec("UPDATE entries SET inode=? WHERE parent=? AND name=?", (b.id, src_dir.id, src_name))
    tx.exec("UPDATE entries SET inode=? WHERE parent=? AND name=?", (a.id, dst_dir.id, dst_name))
    if src_dir.id != dst_dir.id and a.is_dir != b.is_dir:
        delta = 1 if a.is_dir else -1
        src_dir.nlink -= delta
        dst_dir.nlink += delta
    for n in {x.id: x for x in (a, b, src_dir, dst_dir)}.values():
        _touch(tx, n, mtime=n.is_dir)
        _save(tx, n)


def setattr(tx: Tx, ino: int, change: AttrChange) -> Inode:
    tx.lock([ino])
    node = get(tx, ino)
    change.apply(node, tx.now_ns)
    _save(tx, node)
    return node


def readdir(tx: Tx, ino: int, after_id: int, limit: int) -> list[tuple[DirEntry, Inode]]:
    _directory(tx, ino)
    rows = tx.all(f"SELECT e.id, e.name, {JOINED_INODE_COLUMNS}"
                  " FROM entries e JOIN inodes i ON i.id = e.inode WHERE e.parent=? AND e.id>?"
                  " ORDER BY e.id LIMIT ?", (ino, after_id, limit))
    return [_listed_entry(r) for r in rows]


def _listed_entry(row: Sequence) -> tuple[DirEntry, Inode]:
    """An entry of a listing: its id and name, then its inode's ``INODE_COLUMNS``."""
    return DirEntry(row[0], bytes(row[1]), row[2]), inode_of_row(row[2:])


def listing(rows: Sequence[Sequence]) -> list[tuple[DirEntry, Inode]]:
    """The entries of a listing whose rows begin with the directory's mode (one row with
    no entry when the page is empty), or the error that mode tells."""
    if not rows:
        raise FsError(errno.ENOENT)
    if rows[0][0] & _S_IFMT != stat.S_IFDIR:
        raise FsError(errno.ENOTDIR)
    return [_listed_entry(r[1:]) for r in rows if r[1] is not None]


# --- file data -----------------------------------------------------------------------

def block_map(tx: Tx, ino: int) -> dict[int, str]:
    return {idx: key for idx, key in tx.all("SELECT idx, key FROM blocks WHERE inode=?", (ino,))}


def open_file(tx: Tx, ino: int) -> tuple[Inode, dict[int, str]]:
    row = tx.later(INODE_ROW, (ino,))  # with the block map
    tx.holds.add(tx, ino)
    blocks = block_map(tx, ino)
    found = row()
    if not found:
        raise FsError(errno.ENOENT)  # the hold goes with the rolled-back transaction
    return inode_of_row(found[0]), blocks


def close_file(tx: Tx, ino: int) -> Freed:
    tx.lock([ino])
    tx.holds.remove(tx, ino)
    row = tx.inode_row(ino)  # locked: what the lock read is current
    if row is None:
        return Freed()
    return _drop_if_unused(tx, inode_of_row(row))


def commit_blocks(tx: Tx, ino: int, blocks: dict[int, Optional[tuple[str, int]]], size: int,
                  mtime_ns: int) -> Freed:
    tx.lock([ino])
    # Every index's current block asked at once, with the lock (one round trip).
    current = {index: tx.later("SELECT key FROM blocks WHERE inode=? AND idx=?", (ino, index))
               for index in sorted(blocks)}
    node = get(tx, ino)
    freed = Freed()
    added: list[tuple[str, int]] = []
    dropped: list[str] = []
    for index, rows in current.items():
        found = rows()
        old = found[0][0] if found else None
        new = blocks[index]
        if new is not None and new[0] == old:
            continue
        if new is not None:
            key, nbytes = new
            added.append(new)
            tx.exec("INSERT INTO blocks (inode, idx, key, size) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (inode, idx) DO UPDATE SET key=excluded.key, size=excluded.size",
                    (ino, index, key, nbytes))
        elif old is not None:
            tx.exec("DELETE FROM blocks WHERE inode=? AND idx=?", (ino, index))
        if old is not None:
            dropped.append(old)
    # A scratch file's blocks never leave its node: never recorded as in the bucket, so
    # another node writing the same bytes uploads them.
    _count_references(tx, added, dropped, freed, uploaded=tx.commits_uploaded and not node.scratch)
    node.size = size
    node.mtime_ns = mtime_ns
    node.ctime_ns = max(node.ctime_ns, mtime_ns)
    _save(tx, node)
    return freed


def promote(tx: Tx, ino: int, blocks: dict[int, Optional[tuple[str, int]]], size: int, mtime_ns: int) -> Freed:
    """A scratch file of this node becomes a file of the volume, with the blocks its bytes
    were sealed into (uploaded already on a shared volume): one transaction, so no other
    node ever sees it without its data."""
    tx.lock([ino])
    node = get(tx, ino)
    if node.scratch != tx.scratch_owner or not node.is_reg:
        raise FsError(errno.EXDEV, "not a scratch file of this node")
    tx.exec("UPDATE inodes SET scratch=0 WHERE id=?", (ino,))
    tx.changed(ino)
    return commit_blocks(tx, ino, blocks, size, mtime_ns)


def truncate(tx: Tx, ino: int, size: int, mtime_ns: int) -> tuple[Inode, Freed]:
    tx.lock([ino])
    node = get(tx, ino)
    freed = Freed()
    _drop_blocks(tx, ino, -(-size // tx.block_size), freed)
    node.size = size
    node.mtime_ns = mtime_ns
    node.ctime_ns = max(node.ctime_ns, mtime_ns)
    _save(tx, node)
    return node, freed


def _drop_blocks(tx: Tx, ino: int, first_removed: int, freed: Freed) -> None:
    rows = tx.all("DELETE FROM blocks WHERE inode=? AND idx>=? RETURNING key", (ino, first_removed))
    _count_references(tx, [], [key for (key,) in rows], freed)


def _drop_if_unused(tx: Tx, node: Inode) -> Freed:
    """Remove an inode that has no name left, unless some node holds it open."""
    freed = Freed()
    if node.nlink > 0 or node.id == ROOT_INODE or tx.holds.held(tx, node.id):
        return freed
    _delete_inode(tx, node.id, freed)
    return freed


def _delete_inode(tx: Tx, ino: int, freed: Freed) -> None:
    tx.changed(ino)
    deleted = tx.later("DELETE FROM inodes WHERE id=? RETURNING id", (ino,))  # sent with the blocks'
    _drop_blocks(tx, ino, 0, freed)
    tx.inodes_delta -= len(deleted())
    freed.deleted_inode = ino


def drop_orphans(tx: Tx, inodes: Iterable[int]) -> Freed:
    """Delete these nameless inodes (left by a node that held them open and went away)."""
    freed = Freed()
    for ino in inodes:
        if ino != ROOT_INODE:
            _delete_inode(tx, ino, freed)
    freed.deleted_inode = None
    return freed


def purge_scratch(tx: Tx, owner: int) -> Freed:
    """Remove the scratch inodes of one owner and their names: they belonged to the
    processes of a mount that ended (this node's last one, or a node that was lost)."""
    freed = Freed()
    # Names that files of the volume have in those dirs go with the dirs: such a file stays
    # while it has other names, or while a node holds it open.
    named = tx.all("DELETE FROM entries WHERE parent IN (SELECT id FROM inodes WHERE scratch = ?)"
                   " AND (SELECT scratch FROM inodes WHERE id = entries.inode) = 0 RETURNING inode", (owner,))
    for ino, names in sorted(Counter(ino for (ino,) in named).items()):
        tx.lock([ino])
        node = get(tx, ino)
        node.nlink = max(0, node.nlink - names)
        _save(tx, node)
        if node.nlink == 0 and not tx.holds.held(tx, ino):
            _delete_inode(tx, ino, freed)
    # Scratch roots (scratch dirs named in a normal dir) are counted in their parent's nlink.
    for parent, subdirs in tx.all(
            "SELECT e.parent, COUNT(*) FROM entries e JOIN inodes c ON c.id = e.inode"
            " JOIN inodes p ON p.id = e.parent WHERE c.scratch = ? AND p.scratch <> ?"
            " AND (c.mode & ?) = ? GROUP BY e.parent", (owner, owner, _S_IFMT, stat.S_IFDIR)):
        tx.changed(parent)
        tx.exec("UPDATE inodes SET nlink = nlink - ? WHERE id=?", (subdirs, parent))
    tx.exec("DELETE FROM entries WHERE inode IN (SELECT id FROM inodes WHERE scratch = ?)", (owner,))
    for (ino,) in tx.all("SELECT id FROM inodes WHERE scratch = ?", (owner,)):
        _delete_inode(tx, ino, freed)
    freed.deleted_inode = None
    return freed


# --- objects ---------------------------------------------------------------------------

_INCREF = ("INSERT INTO objects (key, size, refcount, uploaded) VALUES (?, ?, 1, ?)"
           " ON CONFLICT (key) DO UPDATE SET refcount=objects.refcount+1, unreferenced_since=NULL,"
           " uploaded=CASE WHEN excluded.uploaded=1 THEN 1 ELSE objects.uploaded END"
           " RETURNING refcount, size")
# The old refcount in the CASEs: a block whose last reference goes is marked unreferenced.
_DECREF = ("UPDATE objects SET refcount=refcount-1,"
           " unreferenced_since=CASE WHEN refcount<=1 THEN ? ELSE unreferenced_since END,"
           " unreferenced_seq=CASE WHEN refcount<=1 THEN ? ELSE unreferenced_seq END"
           " WHERE key=? RETURNING refcount, size")


def _count_references(tx: Tx, added: list[tuple[str, int]], dropped: list[str], freed: Freed,
                      uploaded: bool = False) -> None:
    """Count the references a change adds (blocks, with their sizes) and drops, all in one
    round trip: added first, so a block that only moves within the change never reaches zero."""
    increfs = [tx.later(_INCREF, (key, size, int(uploaded))) for key, size in added]
    decrefs = []
    if dropped:
        since, mark = tx.now_ns / 1e9, tx.unreferenced_mark()
        decrefs = [(key, tx.later(_DECREF, (since, mark, key))) for key in dropped]
    for rows in increfs:
        refcount, size = rows()[0]
        if refcount == 1:
            tx.used_delta += size
    for key, rows in decrefs:
        found = rows()
        if not found:
            continue
        refcount, size = found[0]
        if refcount == 0:
            tx.used_delta -= size
        if refcount <= 0:
            freed.keys.append(key)


def object_info(tx: Tx, key: str) -> Optional[ObjectInfo]:
    row = tx.one("SELECT key, size, refcount, uploaded FROM objects WHERE key=?", (key,))
    return ObjectInfo(row[0], row[1], row[2], bool(row[3])) if row else None


def pending_objects(tx: Tx) -> list[ObjectInfo]:
    return [ObjectInfo(r[0], r[1], r[2], bool(r[3]))
            for r in tx.all("SELECT key, size, refcount, uploaded FROM objects WHERE uploaded=0")]


def forget_objects(tx: Tx, keys: list[str]) -> None:
    for key in keys:
        tx.exec("DELETE FROM objects WHERE key=? AND refcount<=0", (key,))


def collectable_objects(tx: Tx, older_than: float, covered_seq: int) -> list[str]:
    """Uploaded objects unreferenced since before ``older_than`` by a change at or before
    ``covered_seq`` (so no restore point still needs them)."""
    return [r[0] for r in tx.all(
        "SELECT key FROM objects WHERE refcount<=0 AND uploaded=1 AND unreferenced_since<=?"
        " AND unreferenced_seq<=?", (older_than, covered_seq))]


def blocks_by_recency(tx: Tx, budget: Optional[int]) -> list[tuple[str, int]]:
    rows = tx.all("SELECT b.key, o.size FROM blocks b JOIN inodes i ON i.id = b.inode"
                  " JOIN objects o ON o.key = b.key WHERE o.refcount > 0 AND i.scratch = 0"
                  " ORDER BY i.mtime_ns DESC, b.inode, b.idx")
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    total = 0
    for key, size in rows:
        if key in seen:
            continue
        if budget is not None and total + size > budget:
            break
        seen.add(key)
        out.append((key, size))
        total += size
    return out


# --- fsck ----------------------------------------------------------------------------------

def consistency_problems(tx: Tx, limit: int = 20) -> list[str]:
    """What ``fusestate fsck`` reports about the tables themselves: names that point
    nowhere, link counts that disagree with the names, reference counts that disagree
    with the block maps. Each check names at most ``limit`` rows."""
    problems: list[str] = []
    for (parent, name, ino) in tx.all(
            "SELECT e.parent, e.name, e.inode FROM entries e LEFT JOIN inodes i ON i.id = e.inode"
            f" WHERE i.id IS NULL LIMIT {limit}"):
        problems.append(f"entry {bytes(name)!r} in directory {parent} names inode {ino}, which does not exist")
    for (parent, name) in tx.all(
            "SELECT e.parent, e.name FROM entries e LEFT JOIN inodes d ON d.id = e.parent"
            f" WHERE d.id IS NULL LIMIT {limit}"):
        problems.append(f"entry {bytes(name)!r} is in directory {parent}, which does not exist")
    for (ino, nlink, names) in tx.all(
            "SELECT i.id, i.nlink, COUNT(e.id) FROM inodes i LEFT JOIN entries e ON e.inode = i.id"
            f" WHERE (i.mode & {_S_IFMT}) <> {stat.S_IFDIR} GROUP BY i.id, i.nlink"
            f" HAVING i.nlink <> COUNT(e.id) LIMIT {limit}"):
        problems.append(f"inode {ino} has {nlink} links but {names} names")
    for (ino, nlink, subdirs) in tx.all(
            "SELECT d.id, d.nlink, COUNT(c.id) FROM inodes d LEFT JOIN entries e ON e.parent = d.id"
            f" LEFT JOIN inodes c ON c.id = e.inode AND (c.mode & {_S_IFMT}) = {stat.S_IFDIR}"
            f" WHERE (d.mode & {_S_IFMT}) = {stat.S_IFDIR} AND d.nlink > 0 GROUP BY d.id, d.nlink"
            f" HAVING d.nlink <> 2 + COUNT(c.id) LIMIT {limit}"):
        problems.append(f"directory {ino} has {nlink} links but {subdirs} subdirectories")
    for (key, refcount, uses) in tx.all(
            "SELECT o.key, o.refcount, COUNT(b.key) FROM objects o LEFT JOIN blocks b ON b.key = o.key"
            f" GROUP BY o.key, o.refcount HAVING o.refcount <> COUNT(b.key) LIMIT {limit}"):
        problems.append(f"block {key[:16]} has refcount {refcount} but {uses} uses")
    for (key,) in tx.all("SELECT DISTINCT b.key FROM blocks b LEFT JOIN objects o ON o.key = b.key"
                         f" WHERE o.key IS NULL LIMIT {limit}"):
        problems.append(f"block {key[:16]} is used by a file but not recorded")
    return problems


def referenced_keys(tx: Tx) -> set[str]:
    """The blocks the bucket must hold: every file's but a scratch file's (on its node only)."""
    return {row[0] for row in tx.all("SELECT DISTINCT b.key FROM blocks b JOIN inodes i ON i.id = b.inode"
                                     " WHERE i.scratch = 0")}
