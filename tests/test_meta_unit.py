"""The SQLite metadata engine on its own: upgrades of older databases, the journal."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

import pytest

import stat

import trio

from fusestate.errors import FsError
from fusestate.meta.embedded import journal
from fusestate.meta.engine import ROOT_INODE, Inode, NewNode
from fusestate.meta.postgres.lookup_cache import LookupCache
from fusestate.meta.postgres.engine import PostgresEngine
from fusestate.meta.embedded.engine import SQLiteEngine


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


class _NoBlocks:
    """The uploader as the shipper sees it, for metadata that references no block."""

    def pin(self, keys: list[str]) -> None:
        pass

    def unpin(self, keys: list[str]) -> None:
        pass

    async def wait_uploaded(self, keys: list[str]) -> None:
        assert not keys


def test_segments_in_flight_are_acknowledged_in_order_and_fail_together(tmp_path: Path) -> None:
    """Two fsyncs, two segments uploading at once. The first one's upload fails after the
    second's has landed: both fsyncs fail (a restore would stop at the gap before the
    second), nothing counts as shipped, and the next segment starts again after what is in
    the bucket. A restore then has every name, with the orphan segment left aside."""
    import fsspec

    from fusestate.meta.embedded.restore import restore_metadata
    from fusestate.meta.embedded.shipper import JournalShipper, ShipFailed
    from fusestate.remote.store import RemoteError, RemoteStore

    remote = RemoteStore(fsspec.filesystem("file"), str(tmp_path / "bucket"), retries=1, backoff_initial=0.01)
    real_aput = remote.aput
    calls: list[str] = []

    async def aput(key: str, data: bytes) -> None:
        calls.append(key)
        if len(calls) == 2:
            await trio.sleep(0.3)  # the first segment: slow, then failing
            raise RemoteError(f"put {key}: injected")
        await real_aput(key, data)

    remote.aput = aput  # type: ignore[method-assign]
    outcomes: dict[str, str] = {}

    async def body() -> None:
        engine = SQLiteEngine(str(tmp_path / "meta.db"))
        shipper = JournalShipper(engine, remote, _NoBlocks(), epoch=1, interval=60)  # type: ignore[arg-type]

        async def fsync(name: bytes) -> None:
            await engine.create(ROOT_INODE, name, _file(0))
            try:
                await shipper.wait_shipped()
                outcomes[name.decode()] = "ok"
            except ShipFailed:
                outcomes[name.decode()] = "failed"

        async with trio.open_nursery() as nursery:
            await nursery.start(shipper.run)
            await engine.create(ROOT_INODE, b"base", _file(0))
            await shipper.wait_shipped()                  # one segment in the bucket
            nursery.start_soon(fsync, b"first")
            await trio.sleep(0.05)                        # its segment is uploading (slowly)
            nursery.start_soon(fsync, b"second")
            await trio.sleep(0.5)
            assert outcomes == {"first": "failed", "second": "failed"}, outcomes
            assert len(calls) == 3 and shipper.stats.failures == 1, calls  # the second's landed
            shipped = shipper.shipped_seq
            await trio.sleep(1.2)                         # past the retry pause
            await fsync(b"third")
            assert outcomes["third"] == "ok" and shipper.shipped_seq > shipped
            shipper.stopped = True
            shipper._wakeup.set()
        engine.close()

    trio.run(body)
    restored = restore_metadata(remote, str(tmp_path / "restored.db"), {1: 0})
    db = sqlite3.connect(tmp_path / "restored.db")
    names = sorted(row[0].decode() for row in db.execute("SELECT name FROM entries"))
    db.close()
    assert names == ["base", "first", "second", "third"], names
    assert restored.segments == 2, restored  # base, then the retry that covers the rest


def test_restore_takes_the_longer_of_two_segments_that_start_at_one_point() -> None:
    """A segment uploaded, then not acknowledged (its fence check failed), is uploaded again
    with what came since: both start at the same sequence."""
    seg = journal.segment_key
    segments = journal.parse_segments([seg(1, 1, 4), seg(1, 5, 7), seg(1, 5, 9), seg(1, 8, 9), seg(1, 10, 12)])
    _, chain = journal.History({1: 0}).restore_plan([], segments)
    assert [(s.first, s.last) for s in chain] == [(1, 4), (5, 9), (10, 12)]


def test_restore_stops_before_a_segment_whose_new_blocks_never_landed(tmp_path: Path) -> None:
    """A segment uploads together with the blocks it is the first to reference; a writer
    that died in between left the segment without them. Restore applies the journal up to
    the segment before, and all of it once the blocks are there."""
    import fsspec

    from fusestate.blocks.keys import object_name
    from fusestate.meta.embedded.restore import restore_metadata
    from fusestate.remote.store import RemoteStore

    remote = RemoteStore(fsspec.filesystem("file"), str(tmp_path / "bucket"), retries=1, backoff_initial=0.01)

    async def write_journal() -> list[journal.Change]:
        engine = SQLiteEngine(str(tmp_path / "meta.db"))
        await engine.create(ROOT_INODE, b"old", _file(0))
        node = await engine.create(ROOT_INODE, b"new", _file(0))
        await engine.commit_blocks(node.id, {0: ("k" * 64, 5)}, 5, 1)
        changes = engine.journal_tail(0)
        engine.close()
        return changes

    changes = trio.run(write_journal)
    split = next(c.seq for c in changes if c.image and c.table == "entries" and bytes.fromhex(c.image[2]) == b"new")
    first, second = [c for c in changes if c.seq < split], [c for c in changes if c.seq >= split]
    remote.put(journal.segment_key(1, 1, split - 1), journal.encode_segment(first))
    remote.put(journal.segment_key(1, split, second[-1].seq),
               journal.encode_segment(second, journal.SegmentHeader(split - 1, ("k" * 64,))))

    def names() -> list[str]:
        restore_metadata(remote, str(tmp_path / "restored.db"), {1: 0})
        db = sqlite3.connect(tmp_path / "restored.db")
        try:
            return sorted(row[0].decode() for row in db.execute("SELECT name FROM entries"))
        finally:
            db.close()

    assert names() == ["old"]
    remote.put(object_name("k" * 64), b"12345")
    assert names() == ["new", "old"]


def test_a_durable_commit_after_a_failover_does_not_vouch_for_commits_before_it() -> None:
    """Async commits on timeline 1, then a durable one on timeline 2 (the standby promoted):
    EIO once, as a lost writeback is reported; commits on one timeline are covered quietly."""
    engine = PostgresEngine.__new__(PostgresEngine)
    engine._async_commits, engine._durable_through, engine._timelines = 0, 0, []
    for _ in range(3):
        engine._committed_async(1)
    engine._made_durable(engine._async_commits, 1)  # same timeline: covered
    engine._committed_async(1)
    engine._committed_async(2)
    with pytest.raises(FsError) as lost:
        engine._made_durable(engine._async_commits, 2)
    assert lost.value.errno == errno.EIO and "timeline 1 to 2" in str(lost.value)
    engine._committed_async(2)
    engine._made_durable(engine._async_commits, 2)  # reported once; the new timeline is fine
    assert engine._timelines == [(5, 2)]


# --- the shared engine's lookup cache ----------------------------------------------------

def _inode(ino: int, size: int = 0, mode: int = stat.S_IFREG | 0o644) -> Inode:
    return Inode(id=ino, mode=mode, uid=0, gid=0, size=size, nlink=1,
                 atime_ns=0, mtime_ns=0, ctime_ns=0)


def test_lookup_cache_keeps_no_answer_of_a_read_that_a_change_overtook() -> None:
    cache = LookupCache()
    since = cache.generation
    cache.changed_elsewhere([(1, b"f")], [])  # another node's change arrives while the read is out
    cache.fill(since, 1, b"f", _inode(5))  # the read's answer, older than the change
    assert cache.lookup(1, b"f") is None
    cache.fill(cache.generation, 1, b"f", _inode(5))
    assert cache.lookup(1, b"f") == _inode(5)


def test_lookup_cache_drops_names_and_inodes_apart() -> None:
    cache = LookupCache()
    cache.fill(cache.generation, 1, b"a", _inode(5))
    cache.fill(cache.generation, 1, b"b", _inode(5))  # a hard link: one inode, two names
    cache.changed_elsewhere([], [5])  # the inode changed: both names need its attributes again
    assert cache.lookup(1, b"a") is None and cache.lookup(1, b"b") is None
    cache.fill(cache.generation, 1, b"a", _inode(5, size=10))
    assert cache.lookup(1, b"b") == _inode(5, size=10)  # the name was kept
    cache.changed_elsewhere([(1, b"a")], [])
    assert cache.lookup(1, b"a") is None and cache.lookup(1, b"b") is not None
    assert cache.dropped_elsewhere == 2


def test_lookup_cache_own_writes_replace_only_what_it_holds() -> None:
    """A row this node committed replaces the cached one; an inode not held stays out (it may
    have been dropped by a later change from elsewhere); a deleted one and a renamed name go."""
    cache = LookupCache()
    cache.fill(cache.generation, 1, b"a", _inode(5))
    cache.wrote({5: _inode(5, size=7), 6: _inode(6)})
    assert cache.lookup(1, b"a") == _inode(5, size=7) and cache.node(6) is None
    since = cache.generation
    cache.wrote({}, [(1, b"a")])
    cache.fill(since, 1, b"a", _inode(5))  # a lookup sent before this node's rename
    assert cache.lookup(1, b"a") is None
    cache.fill(cache.generation, 1, b"a", _inode(5))
    cache.wrote({5: None})
    assert cache.lookup(1, b"a") is None


def test_lookup_cache_is_bounded_oldest_first() -> None:
    cache = LookupCache(max_entries=3)
    for i in range(5):
        cache.fill(cache.generation, 1, b"f%d" % i, _inode(10 + i))
    assert len(cache) == 3 and cache.lookup(1, b"f0") is None and cache.lookup(1, b"f4") is not None
    cache.clear()
    assert len(cache) == 0 and cache.lookup(1, b"f4") is None


def test_lookup_cache_keeps_no_directory() -> None:
    """A directory's attributes change with every create and unlink in it, which is not
    announced to the other nodes: a directory is always asked for."""
    cache = LookupCache()
    cache.fill(cache.generation, 1, b"d", _inode(5, mode=stat.S_IFDIR | 0o755))
    assert cache.lookup(1, b"d") is None and cache.node(5) is None
