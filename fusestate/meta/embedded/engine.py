"""The embedded metadata engine: one SQLite database on the node's local disk.

The default for a volume one node writes. Operations (``fusestate.meta.operations``)
run on the event loop: WAL mode with ``synchronous=NORMAL`` keeps each to tens of
microseconds, and ``sync()`` fsyncs the WAL when a caller needs durability. Its
durability beyond the node is its own strategy: triggers append every row change to a
journal that ``fusestate.meta.embedded.shipper`` ships to the bucket after the blocks it
references, with snapshots (``restore``) and a lease with fencing (``daemon.lease``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sqlite3
import stat
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

import trio

from fusestate.config import DEFAULT_BLOCK_SIZE
from fusestate.meta import operations as ops
from fusestate.meta.engine import (ROOT_INODE, AttrChange, DirEntry, EngineStats, Freed, Inode, NewNode,
                                   ObjectInfo)
from fusestate.meta.embedded.journal import JOURNAL_SCHEMA, Change

T = TypeVar("T")

SCHEMA_VERSION = 1
ATTR_CACHE_MAX = 100_000  # inodes whose attributes getattr answers without a query

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

_S_IFMT = 0o170000  # the file type bits of st_mode


def _drop_scratch(db: sqlite3.Connection) -> None:
    """Remove scratch inodes, their names and block maps from a copy shipped to the bucket."""
    # Volume files named in scratch dirs lose those names (one left with none is an orphan
    # the next mount drops).
    for ino, names in db.execute("SELECT inode, COUNT(*) FROM entries WHERE parent IN"
                                 " (SELECT id FROM inodes WHERE scratch = 1) GROUP BY inode").fetchall():
        db.execute("UPDATE inodes SET nlink = MAX(0, nlink - ?) WHERE id = ? AND scratch = 0", (names, ino))
    db.execute("DELETE FROM entries WHERE parent IN (SELECT id FROM inodes WHERE scratch = 1)")
    for table, column in (("entries", "inode"), ("blocks", "inode"), ("inodes", "id")):
        db.execute(f"DELETE FROM {table} WHERE {column} IN (SELECT id FROM inodes WHERE scratch = 1)")


class _LocalHolds:
    """One node: the files it holds open live in memory (a crash lets go of them all)."""

    def __init__(self) -> None:
        self.inodes: set[int] = set()

    def add(self, tx: ops.Tx, ino: int) -> None:
        self.inodes.add(ino)

    def remove(self, tx: ops.Tx, ino: int) -> None:
        self.inodes.discard(ino)

    def held(self, tx: ops.Tx, ino: int) -> bool:
        return ino in self.inodes


class _SQLiteTx:
    """A transaction on the engine's connection (BEGIN IMMEDIATE: one writer, nothing to lock)."""

    commits_uploaded = False
    scratch_owner = 1

    def __init__(self, engine: "SQLiteEngine") -> None:
        self._db = engine._db
        self._engine = engine
        self.now_ns = time.time_ns()
        self.block_size = engine.block_size
        self.holds = engine._holds
        self.inodes_delta = 0
        self.used_delta = 0

    def one(self, sql: str, args: tuple = ()) -> Optional[tuple]:
        return self._db.execute(sql, args).fetchone()

    def all(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self._db.execute(sql, args).fetchall()

    def exec(self, sql: str, args: tuple = ()) -> None:
        self._db.execute(sql, args)

    def later(self, sql: str, args: tuple = ()) -> Callable[[], list[tuple]]:
        rows = self._db.execute(sql, args).fetchall()
        return lambda: rows

    def lock(self, inodes: Iterable[int]) -> None:
        pass

    def new_inode_id(self) -> int:
        return self._engine.allocate_inode_id()

    def inode_row(self, ino: int) -> Optional[tuple]:
        return self.one(ops.INODE_ROW, (ino,))

    def lock_moves(self) -> None:
        pass

    def changed(self, ino: int) -> None:
        self._engine._attrs.pop(ino, None)

    def saved(self, node: Inode) -> None:
        pass  # getattr reads the row again (an exact cache of its own: ``_attrs``)

    def unreferenced_mark(self) -> int:
        return self._engine.journal_last_seq()


class SQLiteEngine:
    """The default metadata engine (see the module docstring)."""

    kind = "sqlite"
    shared = False
    inline_max = 0  # every block is staged and uploaded: the snapshots in the bucket hold no bytes
    scratch_owner = 1

    def __init__(self, path: str, block_size: int = DEFAULT_BLOCK_SIZE, read_only: bool = False) -> None:
        self.path = path
        self.block_size = block_size
        self.read_only = read_only
        self._holds = _LocalHolds()
        self._attrs: dict[int, Inode] = {}
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=OFF")
        self._db.executescript(_SCHEMA)
        self._migrate()
        self._db.executescript(JOURNAL_SCHEMA)
        self._depth = 0
        if self.get_setting("schema_version") is None:
            self.set_setting("schema_version", str(SCHEMA_VERSION))
        if not self._db.execute("SELECT 1 FROM inodes WHERE id=?", (ROOT_INODE,)).fetchone():
            now = time.time_ns()
            self._db.execute(
                "INSERT INTO inodes (id, mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns)"
                " VALUES (?, ?, 0, 0, 0, 2, ?, ?, ?)",
                (ROOT_INODE, stat.S_IFDIR | 0o755, now, now, now),
            )
        # SQLite's rowid would hand out the highest freed number again at once, while the
        # kernel may still hold the dead inode under it: numbers go up for the whole mount.
        # (A new mount starts a new FUSE connection, so the kernel remembers none of them.)
        self._next_inode: int = self._db.execute("SELECT MAX(id) FROM inodes").fetchone()[0] + 1
        # statfs and every metrics scrape read these: keep them as counters, not table scans.
        self._inodes: int = self._db.execute("SELECT COUNT(*) FROM inodes").fetchone()[0]
        self._used: int = self._db.execute(
            "SELECT COALESCE(SUM(size), 0) FROM objects WHERE refcount > 0").fetchone()[0]

    def allocate_inode_id(self) -> int:
        """A number no inode of this mount has had (see ``_next_inode``)."""
        ino = self._next_inode
        self._next_inode += 1
        return ino

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
        """Settings and journal bookkeeping of the shipper, committed together (nestable);
        operations open their own transactions."""
        if self._depth == 0:
            self._db.execute("BEGIN IMMEDIATE")
        self._depth += 1
        try:
            yield
        except BaseException:
            self._depth -= 1
            if self._depth == 0:
                self._db.execute("ROLLBACK")
            raise
        else:
            self._depth -= 1
            if self._depth == 0:
                self._db.execute("COMMIT")

    async def sync(self) -> None:
        await trio.to_thread.run_sync(self.sync_now)

    def sync_now(self) -> None:
        """fsync the database and its WAL."""
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

    # --- running an operation -----------------------------------------------
    def _run(self, operation: Callable[..., T], *args: Any) -> T:
        """One operation, one transaction, on the event loop (local disk, tens of microseconds)."""
        if self._depth:
            raise RuntimeError("an operation ran inside an open transaction")
        self._db.execute("BEGIN IMMEDIATE")
        tx = _SQLiteTx(self)
        try:
            result = operation(tx, *args)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        self._inodes += tx.inodes_delta
        self._used += tx.used_delta
        return result

    def _read(self, operation: Callable[..., T], *args: Any) -> T:
        """A read needs no transaction of its own (autocommit reads one consistent state)."""
        return operation(_SQLiteTx(self), *args)

    # --- namespace ----------------------------------------------------------
    async def getattr(self, ino: int) -> Inode:
        """From the attribute cache: this engine is the volume's one writer, and every
        operation drops the inodes it changes from the cache."""
        node = self._attrs.get(ino)
        if node is None:
            node = self._read(ops.get, ino)
            if len(self._attrs) >= ATTR_CACHE_MAX:
                del self._attrs[next(iter(self._attrs))]  # the oldest
            self._attrs[ino] = node
        return dataclasses.replace(node)

    async def lookup(self, parent: int, name: bytes) -> Inode:
        return self._read(ops.lookup, parent, name)

    async def create(self, parent: int, name: bytes, node: NewNode, hold: bool = False) -> Inode:
        return self._run(ops.create, parent, name, node, hold)

    async def link(self, ino: int, parent: int, name: bytes) -> Inode:
        return self._run(ops.link, ino, parent, name)

    async def unlink(self, parent: int, name: bytes) -> Freed:
        return self._run(ops.unlink, parent, name)

    async def rmdir(self, parent: int, name: bytes) -> Freed:
        return self._run(ops.rmdir, parent, name)

    async def rename(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                     flags: int = 0) -> Freed:
        return self._run(ops.rename, src_parent, src_name, dst_parent, dst_name, flags)

    async def setattr(self, ino: int, change: AttrChange) -> Inode:
        return self._run(ops.setattr, ino, change)

    async def readdir(self, ino: int, after_id: int, limit: int = 1000) -> list[tuple[DirEntry, Inode]]:
        return self._read(ops.readdir, ino, after_id, limit)

    async def parent_of(self, ino: int) -> int:
        return self._read(ops.parent_of, ino)

    # --- file data ------------------------------------------------------------
    async def open_file(self, ino: int) -> tuple[Inode, dict[int, str]]:
        return self._read(ops.open_file, ino)

    async def close_files(self, inodes: Sequence[int]) -> list[Freed]:
        return [await self.close_file(ino) for ino in sorted(inodes)]

    async def read_file(self, ino: int) -> tuple[Inode, dict[int, str]]:
        return self._read(lambda tx: (ops.get(tx, ino), ops.block_map(tx, ino)))

    async def close_file(self, ino: int) -> Freed:
        if ino not in self._holds.inodes:
            return Freed()
        row = self._db.execute("SELECT nlink FROM inodes WHERE id=?", (ino,)).fetchone()
        if row is None or row[0] > 0:
            self._holds.inodes.discard(ino)  # still named: no transaction needed to let go
            return Freed()
        return self._run(ops.close_file, ino)

    async def commit_blocks(self, ino: int, blocks: dict[int, Optional[tuple[str, int]]],
                            size: int, mtime_ns: int, durable: bool = False,
                            uploads_began: Optional[float] = None,
                            inline: Optional[dict[str, bytes]] = None) -> Freed:
        if inline:
            raise ValueError("the embedded engine keeps no block's bytes (inline_max = 0)")
        return self._run(ops.commit_blocks, ino, blocks, size, mtime_ns)

    async def promote(self, ino: int, blocks: dict[int, Optional[tuple[str, int]]],
                      size: int, mtime_ns: int, uploads_began: Optional[float] = None) -> Freed:
        return self._run(ops.promote, ino, blocks, size, mtime_ns)

    async def truncate(self, ino: int, size: int, mtime_ns: int) -> tuple[Inode, Freed]:
        return self._run(ops.truncate, ino, size, mtime_ns)

    async def block_data(self, key: str) -> Optional[bytes]:
        return None

    async def block_map(self, ino: int) -> dict[int, str]:
        return self._read(ops.block_map, ino)

    # --- objects ----------------------------------------------------------------
    async def object_info(self, key: str) -> Optional[ObjectInfo]:
        return self.object_row(key)

    def object_row(self, key: str) -> Optional[ObjectInfo]:
        """``object_info`` for the journal shipper, which must not yield between its reads."""
        return self._read(ops.object_info, key)

    async def mark_uploaded(self, key: str) -> None:
        self._db.execute("UPDATE objects SET uploaded=1 WHERE key=?", (key,))

    async def forget_objects(self, keys: list[str]) -> None:
        if keys:
            self._run(ops.forget_objects, keys)

    async def pending_objects(self) -> list[ObjectInfo]:
        return self._read(ops.pending_objects)

    async def blocks_by_recency(self, budget: Optional[int] = None) -> list[tuple[str, int]]:
        """Sorts every block: in a worker thread, on a connection of its own."""
        def scan() -> list[tuple[str, int]]:
            db = sqlite3.connect(self.path)
            try:
                return ops.blocks_by_recency(ReadOnlyTx(db), budget)
            finally:
                db.close()

        return await trio.to_thread.run_sync(scan)

    async def collectable_objects(self, older_than: float, covered_seq: int) -> list[str]:
        return self._read(ops.collectable_objects, older_than, covered_seq)

    async def begin_upload(self, key: str, size: int) -> Optional[bool]:
        return False  # blocks are committed before upload; the journal orders the bucket

    async def end_upload(self, key: str) -> None:
        pass

    async def claim_garbage(self, older_than: float, covered_seq: int) -> list[str]:
        keys = await self.collectable_objects(older_than, covered_seq)
        await self.forget_objects(keys)  # a new seal of these bytes now stages them again
        return keys

    async def garbage_deleted(self, keys: list[str]) -> None:
        pass

    async def garbage_kept(self, keys: list[str]) -> None:
        pass  # claiming forgot them: left in the bucket for `fusestate gc`

    # --- lifecycle --------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    async def start(self) -> Freed:
        self._attrs.clear()
        freed = Freed()
        if self.read_only:
            return freed
        scratch = self._run(ops.purge_scratch, self.scratch_owner)
        orphans = [r[0] for r in self._db.execute("SELECT id FROM inodes WHERE nlink=0 AND id<>?", (ROOT_INODE,))]
        dropped = self._run(ops.drop_orphans, orphans)
        freed.keys = scratch.keys + dropped.keys
        return freed

    def stats(self) -> EngineStats:
        return EngineStats(self._inodes, self._used)


class ReadOnlyTx(_SQLiteTx):
    """Reads on a connection of their own (a worker thread's)."""

    def __init__(self, db: sqlite3.Connection) -> None:  # noqa: super().__init__ needs an engine
        self._db = db
