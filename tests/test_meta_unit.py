"""The SQLite metadata engine on its own: upgrades of older databases, the journal."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

import stat

import trio

from fusestate.errors import FsError
from fusestate.meta import journal
from fusestate.meta.engine import ROOT_INODE, NewNode
from fusestate.meta.sqlite_engine import SQLiteEngine


def _file(n: int) -> NewNode:
    return NewNode(stat.S_IFREG | 0o644, 0, 0)


def test_database_of_an_older_release_is_upgraded(tmp_path: Path) -> None:
    path = tmp_path / "meta.db"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE blocks (inode INTEGER NOT NULL, idx INTEGER NOT NULL, key TEXT NOT NULL,"
        " PRIMARY KEY (inode, idx)) WITHOUT ROWID;"
        "CREATE TABLE objects (key TEXT PRIMARY KEY, size INTEGER NOT NULL, refcount INTEGER NOT NULL,"
        " uploaded INTEGER NOT NULL DEFAULT 0, unreferenced_since REAL) WITHOUT ROWID;"
        "INSERT INTO blocks VALUES (7, 0, 'old');"
    )
    db.close()

    async def body() -> None:
        engine = SQLiteEngine(str(path))
        node = await engine.create(ROOT_INODE, b"f", _file(0))
        assert (await engine.commit_blocks(node.id, {0: ("new", 5)}, 5, 1)).keys == []
        assert await engine.block_map(7) == {0: "old"}  # old rows kept
        assert [c.image for c in engine.journal_tail(0) if c.table == "blocks"][-1] == [node.id, 0, "new", 5]
        engine.close()

    trio.run(body)


def test_journal_compaction_keeps_the_last_image_of_each_row(tmp_path: Path) -> None:
    async def body() -> None:
        engine = SQLiteEngine(str(tmp_path / "meta.db"))
        node = await engine.create(ROOT_INODE, b"a", _file(0))
        await engine.commit_blocks(node.id, {0: ("k1", 10)}, 10, 1)
        await engine.commit_blocks(node.id, {0: ("k2", 10)}, 10, 2)
        await engine.rename(ROOT_INODE, b"a", ROOT_INODE, b"b")
        changes = journal.compact(engine.journal_tail(0))
        blocks = [c for c in changes if c.table == "blocks"]
        assert [c.block_key() for c in blocks] == ["k2"]
        entries = [c for c in changes if c.table == "entries"]
        assert sorted(c.op for c in entries) == ["del", "put"]  # the old name gone, the new one made
        decoded = journal.decode_segment(journal.encode_segment(changes))
        assert decoded == changes
        engine.close()

    trio.run(body)


def test_file_and_byte_counters_match_the_tables(tmp_path: Path) -> None:
    """statfs and the metrics read counters; they must equal a full scan after any mix of
    creates, shared blocks, overwrites, deletes and a failed operation."""
    import random

    async def body() -> None:
        db = SQLiteEngine(str(tmp_path / "meta.db"))

        def scan() -> tuple[int, int]:
            files = db._db.execute("SELECT COUNT(*) FROM inodes").fetchone()[0]
            used = db._db.execute("SELECT COALESCE(SUM(size), 0) FROM objects WHERE refcount > 0").fetchone()[0]
            return files, used

        rng = random.Random(7)
        names: list[bytes] = []
        for step in range(400):
            action = rng.random()
            if action < 0.3 or not names:
                names.append(f"f{step}".encode())
                await db.create(ROOT_INODE, names[-1], _file(step))
            elif action < 0.8:
                node = await db.lookup(ROOT_INODE, rng.choice(names))
                await db.commit_blocks(node.id, {rng.randrange(4): (f"k{rng.randrange(30)}", 100 + step % 7)},
                                       400, step)
            elif action < 0.9:
                await db.unlink(ROOT_INODE, names.pop(rng.randrange(len(names))))
            else:
                with pytest.raises(FsError):  # EEXIST: rolled back whole
                    await db.create(ROOT_INODE, rng.choice(names), _file(step))
            stats = db.stats()
            assert (stats.inodes, stats.used_bytes) == scan(), step
        expected = scan()
        db.close()
        reopened = SQLiteEngine(str(tmp_path / "meta.db"))
        stats = reopened.stats()
        assert (stats.inodes, stats.used_bytes) == expected == (len(names) + 1, expected[1])
        reopened.close()

    trio.run(body)
