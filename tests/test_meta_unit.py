"""The SQLite metadata engine on its own: upgrades of older databases, the journal."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fusestate.meta import journal
from fusestate.meta.sqlite_engine import SQLiteEngine


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
    engine = SQLiteEngine(str(path))
    node = engine.create_inode(0o100644, 0, 0)
    assert engine.set_block(node.id, 0, "new", 5) == []
    assert engine.block_map(7) == {0: "old"}  # old rows kept
    assert engine.journal_tail(0)[-1].image == [node.id, 0, "new", 5]
    engine.close()


def test_journal_compaction_keeps_the_last_image_of_each_row(tmp_path: Path) -> None:
    engine = SQLiteEngine(str(tmp_path / "meta.db"))
    node = engine.create_inode(0o100644, 0, 0)
    engine.add_entry(1, b"a", node.id)
    engine.set_block(node.id, 0, "k1", 10)
    engine.set_block(node.id, 0, "k2", 10)
    engine.remove_entry(1, b"a")
    changes = journal.compact(engine.journal_tail(0))
    blocks = [c for c in changes if c.table == "blocks"]
    assert [c.block_key() for c in blocks] == ["k2"]
    entries = [c for c in changes if c.table == "entries"]
    assert [c.op for c in entries] == ["del"]
    decoded = journal.decode_segment(journal.encode_segment(changes))
    assert decoded == changes
    engine.close()


def test_file_and_byte_counters_match_the_tables(tmp_path: Path) -> None:
    """statfs and the metrics read counters; they must equal a full scan after any mix of
    creates, shared blocks, overwrites, deletes and a rolled-back transaction."""
    import random
    import stat as st

    db = SQLiteEngine(str(tmp_path / "meta.db"))

    def scan() -> tuple[int, int]:
        files = db._db.execute("SELECT COUNT(*) FROM inodes").fetchone()[0]
        used = db._db.execute("SELECT COALESCE(SUM(size), 0) FROM objects WHERE refcount > 0").fetchone()[0]
        return files, used

    rng = random.Random(7)
    inodes = []
    for step in range(400):
        action = rng.random()
        if action < 0.3 or not inodes:
            inodes.append(db.create_inode(st.S_IFREG | 0o644, 0, 0).id)
        elif action < 0.8:
            db.set_block(rng.choice(inodes), rng.randrange(4), f"k{rng.randrange(30)}", 100 + step % 7)
        elif action < 0.9:
            db.delete_inode(inodes.pop(rng.randrange(len(inodes))))
        else:
            with pytest.raises(RuntimeError), db.transaction():
                db.create_inode(st.S_IFREG | 0o644, 0, 0)
                db.set_block(rng.choice(inodes), 0, f"k{rng.randrange(30)}", 100)
                raise RuntimeError("roll back")
        assert (db.count_inodes(), db.used_bytes()) == scan(), step
    expected = scan()
    db.close()
    reopened = SQLiteEngine(str(tmp_path / "meta.db"))
    assert (reopened.count_inodes(), reopened.used_bytes()) == expected == (len(inodes) + 1, expected[1])
