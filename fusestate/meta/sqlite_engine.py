"""SQLite metadata engine: one database file on the local disk.

WAL mode with ``synchronous=NORMAL`` keeps each metadata operation to tens of
microseconds; ``sync()`` fsyncs the WAL when a caller needs durability.
Hot inodes are kept in memory (write-through), so getattr on open files never
touches SQLite.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import stat
import time
from collections import OrderedDict
from typing import Iterator, Optional

from fusestate.meta.engine import ROOT_INODE, DirEntry, Inode, ObjectInfo
from fusestate.meta.journal import JOURNAL_SCHEMA, Change

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS inodes (
    id INTEGER PRIMARY KEY,
    mode INTEGER NOT NULL, uid INTEGER NOT NULL, gid INTEGER NOT NULL,
    size INTEGER NOT NULL DEFAULT 0, nlink INTEGER NOT NULL DEFAULT 0,
    atime_ns INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
    rdev INTEGER NOT NULL DEFAULT 0, symlink_target BLOB, scratch INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    parent INTEGER NOT NULL, name BLOB NOT NULL, inode INTEGER NOT NULL,
    UNIQUE (parent, name)
);
CREATE INDEX IF NOT EXISTS entries_by_inode ON entries (inode);
CREATE TABLE IF NOT EXISTS blocks (
    inode INTEGER NOT NULL, idx INTEGER NOT NULL, key TEXT NOT NULL, size INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (inode, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_by_key ON blocks (key);
CREATE TABLE IF NOT EXISTS objects (
    key TEXT PRIMARY KEY, size INTEGER NOT NULL, refcount INTEGER NOT NULL,
    uploaded INTEGER NOT NULL DEFAULT 0, unreferenced_since REAL, unreferenced_seq INTEGER
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_INODE_COLUMNS = "id, mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, rdev, symlink_target, scratch"


_S_IFMT = 0o170000  # the file type bits of st_mode


def _drop_scratch(db: sqlite3.Connection) -> None:
    """Remove scratch inodes, their names and block maps from a copy shipped to the bucket."""
    for table, column in (("entries", "inode"), ("blocks", "inode"), ("inodes", "id")):
        db.execute(f"DELETE FROM {table} WHERE {column} IN (SELECT id FROM inodes WHERE scratch = 1)")


class SQLiteEngine:
    """The default metadata engine."""

    def __init__(self, path: str, inode_cache_size: int = 100_000) -> None:
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=OFF")
        self._db.executescript(_SCHEMA)
        self._migrate()
        self._db.executescript(JOURNAL_SCHEMA)
        self._depth = 0
        self._cache: OrderedDict[int, Inode] = OrderedDict()
        self._cache_size = inode_cache_size
        if self.get_setting("schema_version") is None:
            self.set_setting("schema_version", str(SCHEMA_VERSION))
        if not self._db.execute("SELECT 1 FROM inodes WHERE id=?", (ROOT_INODE,)).fetchone():
            now = time.time_ns()
            self._db.execute(
                "INSERT INTO inodes (id, mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns)"
                " VALUES (?, ?, 0, 0, 0, 2, ?, ?, ?)",
                (ROOT_INODE, stat.S_IFDIR | 0o755, now, now, now),
            )
        # statfs and every metrics scrape read these: keep them as counters, not table scans.
        self._inodes: int = self._db.execute("SELECT COUNT(*) FROM inodes").fetchone()[0]
        self._used: int = self._db.execute(
            "SELECT COALESCE(SUM(size), 0) FROM objects WHERE refcount > 0").fetchone()[0]
        self._counters_at_begin = (self._inodes, self._used)

    def _migrate(self) -> None:
        """Bring a database written by an older release up to this schema."""
        added = {"inodes": [("scratch", "INTEGER NOT NULL DEFAULT 0")],
                 "blocks": [("size", "INTEGER NOT NULL DEFAULT 0")],
                 "objects": [("unreferenced_seq", "INTEGER")]}
        for table, columns in added.items():
            present = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for name, decl in columns:
                if name not in present:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")

    # --- transactions -----------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Group several changes into one atomic commit (nestable)."""
        if self._depth == 0:
            self._db.execute("BEGIN IMMEDIATE")
            self._counters_at_begin = (self._inodes, self._used)
        self._depth += 1
        try:
            yield
        except BaseException:
            self._depth -= 1
            if self._depth == 0:
                self._db.execute("ROLLBACK")
                self._cache.clear()
                self._inodes, self._used = self._counters_at_begin
            raise
        else:
            self._depth -= 1
            if self._depth == 0:
                self._db.execute("COMMIT")

    def sync(self) -> None:
        wal = self.path + "-wal"
        for name in (wal, self.path):
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def backup_to(self, path: str) -> None:
        target = sqlite3.connect(path)
        try:
            self._db.backup(target)
        finally:
            target.close()

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()

    # --- journal ------------------------------------------------------------
    def journal_last_seq(self) -> int:
        row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name='journal'").fetchone()
        return row[0] if row else 0

    def journal_tail(self, after_seq: int, limit: int = 1_000_000) -> list[Change]:
        rows = self._db.execute(
            "SELECT seq, tbl, op, rowkey, image FROM journal WHERE seq>? ORDER BY seq LIMIT ?", (after_seq, limit)
        ).fetchall()
        return [Change(seq, tbl, op, rowkey, json.loads(image) if image else None)
                for seq, tbl, op, rowkey, image in rows]

    def journal_pending(self, after_seq: int) -> int:
        return self._db.execute("SELECT COUNT(*) FROM journal WHERE seq>?", (after_seq,)).fetchone()[0]

    def journal_trim(self, upto_seq: int) -> None:
        self._db.execute("DELETE FROM journal WHERE seq<=?", (upto_seq,))

    def journal_continue_from(self, seq: int) -> None:
        """Make the next journal entry follow ``seq`` (after a restore)."""
        self._db.execute("DELETE FROM sqlite_sequence WHERE name='journal'")
        self._db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('journal', ?)", (seq,))

    def snapshot_copy(self, path: str) -> int:
        """A compact, consistent copy of the metadata; returns the journal sequence it covers.

        Uses its own connection, so it can run in a worker thread.
        """
        source = sqlite3.connect(self.path)
        target = sqlite3.connect(path, isolation_level=None)
        try:
            source.backup(target)
            row = target.execute("SELECT seq FROM sqlite_sequence WHERE name='journal'").fetchone()
            seq = row[0] if row else 0
            target.execute("DELETE FROM journal")
            _drop_scratch(target)
            target.execute("VACUUM")
            return seq
        finally:
            target.close()
            source.close()

    # --- settings ---------------------------------------------------------
    def get_setting(self, key: str) -> Optional[str]:
        row = self._db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_setting(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?, ?)", (key, value))

    # --- inodes -----------------------------------------------------------
    def get_inode(self, inode: int) -> Inode:
        node = self._cache.get(inode)
        if node is not None:
            self._cache.move_to_end(inode)
            return node
        row = self._db.execute(f"SELECT {_INODE_COLUMNS} FROM inodes WHERE id=?", (inode,)).fetchone()
        if row is None:
            raise KeyError(inode)
        node = Inode(*row[:-1], scratch=bool(row[-1]))
        self._remember(node)
        return node

    def _remember(self, node: Inode) -> None:
        self._cache[node.id] = node
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def create_inode(self, mode: int, uid: int, gid: int, rdev: int = 0,
                     symlink_target: Optional[bytes] = None, scratch: bool = False) -> Inode:
        now = time.time_ns()
        size = len(symlink_target) if symlink_target is not None else 0
        cur = self._db.execute(
            "INSERT INTO inodes (mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, rdev, symlink_target,"
            " scratch) VALUES (?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?)",
            (mode, uid, gid, size, now, now, now, rdev, symlink_target, int(scratch)),
        )
        node = Inode(cur.lastrowid, mode, uid, gid, size, 0, now, now, now, rdev, symlink_target, scratch)
        self._inodes += 1
        self._remember(node)
        return node

    def update_inode(self, node: Inode) -> None:
        self._db.execute(
            "UPDATE inodes SET mode=?, uid=?, gid=?, size=?, nlink=?, atime_ns=?, mtime_ns=?, ctime_ns=?"
            " WHERE id=?",
            (node.mode, node.uid, node.gid, node.size, node.nlink,
             node.atime_ns, node.mtime_ns, node.ctime_ns, node.id),
        )
        self._remember(node)

    def delete_inode(self, inode: int) -> list[str]:
        with self.transaction():
            freed = self.truncate_blocks(inode, 0)
            self._inodes -= self._db.execute("DELETE FROM inodes WHERE id=?", (inode,)).rowcount
        self._cache.pop(inode, None)
        return freed

    def purge_scratch(self) -> list[str]:
        freed: list[str] = []
        with self.transaction():
            # Scratch roots (scratch dirs named in a normal dir) counted in their parent's nlink.
            for parent, subdirs in self._db.execute(
                    "SELECT e.parent, COUNT(*) FROM entries e JOIN inodes c ON c.id = e.inode"
                    " JOIN inodes p ON p.id = e.parent WHERE c.scratch = 1 AND p.scratch = 0"
                    " AND (c.mode & ?) = ? GROUP BY e.parent", (_S_IFMT, stat.S_IFDIR)).fetchall():
                node = self.get_inode(parent)
                node.nlink -= subdirs
                self.update_inode(node)
            self._db.execute("DELETE FROM entries WHERE inode IN (SELECT id FROM inodes WHERE scratch = 1)")
            for (ino,) in self._db.execute("SELECT id FROM inodes WHERE scratch = 1").fetchall():
                freed += self.truncate_blocks(ino, 0)
                self._cache.pop(ino, None)
            self._inodes -= self._db.execute("DELETE FROM inodes WHERE scratch = 1").rowcount
        return freed

    def orphaned_inodes(self) -> list[int]:
        return [r[0] for r in self._db.execute("SELECT id FROM inodes WHERE nlink=0")]

    def count_inodes(self) -> int:
        return self._inodes

    def used_bytes(self) -> int:
        return self._used

    # --- entries ----------------------------------------------------------
    def lookup(self, parent: int, name: bytes) -> Optional[int]:
        row = self._db.execute("SELECT inode FROM entries WHERE parent=? AND name=?", (parent, name)).fetchone()
        return row[0] if row else None

    def add_entry(self, parent: int, name: bytes, inode: int) -> None:
        self._db.execute("INSERT INTO entries (parent, name, inode) VALUES (?, ?, ?)", (parent, name, inode))

    def remove_entry(self, parent: int, name: bytes) -> None:
        self._db.execute("DELETE FROM entries WHERE parent=? AND name=?", (parent, name))

    def replace_entry(self, parent: int, name: bytes, inode: int) -> None:
        self._db.execute("UPDATE entries SET inode=? WHERE parent=? AND name=?", (inode, parent, name))

    def list_entries(self, parent: int, after_id: int) -> Iterator[DirEntry]:
        rows = self._db.execute(
            "SELECT id, name, inode FROM entries WHERE parent=? AND id>? ORDER BY id", (parent, after_id)
        ).fetchall()
        return (DirEntry(*r) for r in rows)

    def has_entries(self, parent: int) -> bool:
        return self._db.execute("SELECT 1 FROM entries WHERE parent=? LIMIT 1", (parent,)).fetchone() is not None

    def parent_of(self, directory: int) -> int:
        if directory == ROOT_INODE:
            return ROOT_INODE
        row = self._db.execute("SELECT parent FROM entries WHERE inode=? LIMIT 1", (directory,)).fetchone()
        return row[0] if row else ROOT_INODE

    # --- block maps and objects ------------------------------------------
    def block_map(self, inode: int) -> dict[int, str]:
        return dict(self._db.execute("SELECT idx, key FROM blocks WHERE inode=?", (inode,)))

    def get_block(self, inode: int, index: int) -> Optional[str]:
        row = self._db.execute("SELECT key FROM blocks WHERE inode=? AND idx=?", (inode, index)).fetchone()
        return row[0] if row else None

    def _incref(self, key: str, size: int) -> None:
        refcount, stored_size = self._db.execute(
            "INSERT INTO objects (key, size, refcount) VALUES (?, ?, 1)"
            " ON CONFLICT(key) DO UPDATE SET refcount=refcount+1, unreferenced_since=NULL"
            " RETURNING refcount, size",
            (key, size),
        ).fetchall()[0]
        if refcount == 1:
            self._used += stored_size

    def _decref(self, key: str, freed: list[str]) -> None:
        rows = self._db.execute("UPDATE objects SET refcount=refcount-1 WHERE key=? RETURNING refcount, size",
                                (key,)).fetchall()
        row = rows[0] if rows else None
        if row and row[0] == 0:
            self._used -= row[1]
        if row and row[0] <= 0:
            self._db.execute("UPDATE objects SET unreferenced_since=?, unreferenced_seq=? WHERE key=?",
                             (time.time(), self.journal_last_seq(), key))
            freed.append(key)

    def set_block(self, inode: int, index: int, key: Optional[str], size: int) -> list[str]:
        freed: list[str] = []
        with self.transaction():
            old = self.get_block(inode, index)
            if old == key:
                return freed
            if key is not None:
                self._incref(key, size)
                self._db.execute("INSERT OR REPLACE INTO blocks (inode, idx, key, size) VALUES (?, ?, ?, ?)",
                                 (inode, index, key, size))
            else:
                self._db.execute("DELETE FROM blocks WHERE inode=? AND idx=?", (inode, index))
            if old is not None:
                self._decref(old, freed)
        return freed

    def truncate_blocks(self, inode: int, first_removed: int) -> list[str]:
        freed: list[str] = []
        with self.transaction():
            rows = self._db.execute("SELECT key FROM blocks WHERE inode=? AND idx>=?",
                                    (inode, first_removed)).fetchall()
            self._db.execute("DELETE FROM blocks WHERE inode=? AND idx>=?", (inode, first_removed))
            for (key,) in rows:
                self._decref(key, freed)
        return freed

    def get_object(self, key: str) -> Optional[ObjectInfo]:
        row = self._db.execute("SELECT key, size, refcount, uploaded FROM objects WHERE key=?", (key,)).fetchone()
        return ObjectInfo(row[0], row[1], row[2], bool(row[3])) if row else None

    def blocks_by_recency(self, budget: Optional[int] = None) -> list[tuple[str, int]]:
        """Uses its own connection (it sorts every block), so it can run in a worker thread."""
        db = sqlite3.connect(self.path)
        try:
            rows = db.execute(
                "SELECT b.key, o.size FROM blocks b JOIN inodes i ON i.id = b.inode JOIN objects o ON o.key = b.key"
                " WHERE o.refcount > 0 AND i.scratch = 0 ORDER BY i.mtime_ns DESC, b.inode, b.idx")
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
        finally:
            db.close()

    def mark_uploaded(self, key: str) -> None:
        self._db.execute("UPDATE objects SET uploaded=1 WHERE key=?", (key,))

    def pending_objects(self) -> list[ObjectInfo]:
        rows = self._db.execute("SELECT key, size, refcount, uploaded FROM objects WHERE uploaded=0").fetchall()
        return [ObjectInfo(r[0], r[1], r[2], bool(r[3])) for r in rows]

    def collectable_objects(self, older_than: float, covered_seq: int) -> list[str]:
        """Uploaded objects unreferenced since before ``older_than`` by a change at or
        before ``covered_seq`` (so no restore point still needs them)."""
        return [r[0] for r in self._db.execute(
            "SELECT key FROM objects WHERE refcount<=0 AND uploaded=1 AND unreferenced_since<=?"
            " AND unreferenced_seq<=?", (older_than, covered_seq))]

    def forget_objects(self, keys: list[str]) -> None:
        with self.transaction():
            self._db.executemany("DELETE FROM objects WHERE key=? AND refcount<=0", [(k,) for k in keys])
