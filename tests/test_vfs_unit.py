"""The vfs without a mount: POSIX rules and block bookkeeping, driven directly.

Uses an in-memory fsspec bucket so each test runs in milliseconds; the real
proof that features work lives in the mount tests.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import time
import uuid
from pathlib import Path
from typing import Awaitable, Callable

import fsspec
import pytest
import trio

from fusestate.blocks.caches import DiskCache, MemoryCache
from fusestate.blocks.keys import block_key, key_matches, object_name
from fusestate.blocks.staging import Staging
from fusestate.blocks.store import BlockReadError, BlockStore
from fusestate.blocks.uploader import Uploader
from fusestate.daemon import components
from fusestate.daemon.paths import CacheLayout
from fusestate.meta.engine import ROOT_INODE, DirEntry
from fusestate.meta.embedded.engine import SQLiteEngine
from fusestate.remote.store import RemoteStore
from fusestate.vfs import FileSystem, FsError, RequestContext
from fusestate.vfs.dir_listing import PAGE_SECONDS, DirListing

BS = 64 * 1024
CTX = RequestContext(uid=0, gid=0)


def run_fs(tmp_path: Path, body: Callable[[FileSystem, RemoteStore], Awaitable[None]], **kw) -> None:
    """Run ``body`` against the layers a mount builds (``components.build``), on a memory bucket."""
    async def main() -> None:
        if kw.get("file_bucket"):
            remote = RemoteStore(fsspec.filesystem("file"), str(tmp_path / "bucket"), retries=2, backoff_initial=0.01)
        else:
            remote = RemoteStore(fsspec.filesystem("memory"), f"/vol-{uuid.uuid4().hex}", retries=2,
                                 backoff_initial=0.01)
        meta = SQLiteEngine(str(tmp_path / "meta.db"), block_size=BS)
        parts = components.build(meta, remote, CacheLayout(str(tmp_path)), components.Settings(
            block_size=BS, read_cache_size=64 << 20, memory_cache_size=16 << 20,
            max_dirty=kw.get("max_dirty", 8 << 20), upload_delay=kw.get("upload_delay", 0.0),
            upload_concurrency=2, readahead_blocks=kw.get("readahead_blocks", 2)))
        try:
            async with trio.open_nursery() as nursery:
                await parts.start(nursery)
                await body(parts.fs, remote)
                nursery.cancel_scope.cancel()
        finally:
            parts.close()

    trio.run(main)


async def write_file(fs: FileSystem, name: bytes, data: bytes, parent: int = ROOT_INODE) -> int:
    fh, node = await fs.create(parent, name, 0o644, os.O_WRONLY, CTX)
    await fs.write(fh, 0, data)
    await fs.flush(fh)
    await fs.release(fh)
    return node.id


async def read_file(fs: FileSystem, ino: int) -> bytes:
    fh = await fs.open(ino, os.O_RDONLY)
    data = await fs.read(fh, 0, 1 << 30)
    await fs.release(fh)
    return data


def test_blocks_are_content_addressed_and_deduplicated(tmp_path: Path) -> None:
    data = os.urandom(3 * BS + 100)

    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        a = await write_file(fs, b"a", data)
        await fs.uploader.drain()
        uploaded = fs.uploader.stats.uploaded_blocks
        assert uploaded == 4
        keys = [block_key(data[i:i + BS]) for i in range(0, len(data), BS)]
        for key in keys:
            assert remote.get(object_name(key))  # stored under its own hash
        b = await write_file(fs, b"b", data)
        await fs.uploader.drain()
        assert fs.uploader.stats.uploaded_blocks == uploaded  # a copy uploads nothing
        assert await read_file(fs, a) == data == await read_file(fs, b)
        assert (await fs.meta.object_info(keys[0])).refcount == 2

    run_fs(tmp_path, body)


def test_zero_blocks_are_holes_and_truncate_trims(tmp_path: Path) -> None:
    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        ino = await write_file(fs, b"z", bytes(2 * BS) + b"tail")
        assert sorted((await fs.meta.block_map(ino))) == [2]  # the zero blocks cost nothing
        node = await fs.setattr(ino, size=BS + 10)
        assert node.size == BS + 10
        assert await read_file(fs, ino) == bytes(BS + 10)
        await fs.setattr(ino, size=3 * BS)
        assert await read_file(fs, ino) == bytes(3 * BS)

    run_fs(tmp_path, body)


def test_short_lived_file_never_reaches_the_bucket(tmp_path: Path) -> None:
    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        ino = await write_file(fs, b"tmp", os.urandom(2 * BS))
        await fs.unlink(ROOT_INODE, b"tmp")
        await trio.sleep(0.1)
        assert fs.uploader.stats.uploaded_blocks == 0
        assert fs.uploader.stats.discarded_blocks == 2
        assert remote.list("blocks/") == []

    run_fs(tmp_path, body, upload_delay=5.0)


def test_namespace_rules(tmp_path: Path) -> None:
    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        d = await fs.mkdir(ROOT_INODE, b"d", 0o755, CTX)
        assert (await fs.getattr(ROOT_INODE)).nlink == 3
        f = await write_file(fs, b"f", b"x", parent=d.id)
        with pytest.raises(FsError) as e:
            await fs.rmdir(ROOT_INODE, b"d")
        assert e.value.errno == errno.ENOTEMPTY
        await fs.link(f, ROOT_INODE, b"hard")
        assert (await fs.getattr(f)).nlink == 2
        with pytest.raises(FsError) as e:
            await fs.rename(ROOT_INODE, b"d", d.id, b"inside")
        assert e.value.errno == errno.EINVAL
        await fs.rename(d.id, b"f", ROOT_INODE, b"hard")  # same inode: nothing happens
        assert (await fs.getattr(f)).nlink == 2
        await fs.unlink(d.id, b"f")
        await fs.rmdir(ROOT_INODE, b"d")
        assert (await fs.getattr(ROOT_INODE)).nlink == 2
        assert stat.S_ISREG((await fs.lookup(ROOT_INODE, b"hard")).mode)

    run_fs(tmp_path, body)


def test_a_listing_read_in_pieces_asks_the_metadata_once_per_page(monkeypatch) -> None:
    """The kernel's pieces after the first are cut from the page held; a short page ends the
    listing; a rewind, or a page older than PAGE_SECONDS, is read again."""
    entries = [(DirEntry(i, b"f%d" % i, 100 + i), None) for i in range(1, 2501)]
    asked: list[int] = []

    async def read_page(ino: int, after_id: int, limit: int) -> list:
        asked.append(after_id)
        return [e for e in entries if e[0].entry_id > after_id][:limit]

    async def read_all(listing: DirListing, piece: int = 300) -> list[int]:
        got, after = [], 0
        while rest := (await listing.after(after, read_page))[:piece]:
            got += [entry.entry_id for entry, _ in rest]
            after = got[-1]
        return got

    async def main() -> None:
        listing = DirListing(1)
        assert await read_all(listing) == list(range(1, 2501))
        assert asked == [0, 1000, 2000]  # pages of PAGE; the empty piece after the last: none
        assert await read_all(listing) == list(range(1, 2501))  # a rewind reads from 0 again
        assert asked == [0, 1000, 2000] * 2
        asked.clear()
        now = time.monotonic()
        monkeypatch.setattr(time, "monotonic", lambda: now + PAGE_SECONDS + 1)
        await listing.after(2000, read_page)
        assert asked == [2000]

    trio.run(main)


def test_unlinked_open_file_stays_readable(tmp_path: Path) -> None:
    data = os.urandom(BS + 5)

    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        ino = await write_file(fs, b"f", data)
        fh = await fs.open(ino, os.O_RDONLY)
        await fs.unlink(ROOT_INODE, b"f")
        assert await fs.read(fh, 0, 1 << 20) == data
        assert (await fs.getattr(ino)).nlink == 0
        await fs.release(fh)  # the last holder: the data goes with it
        with pytest.raises(FsError) as e:
            await fs.getattr(ino)
        assert e.value.errno == errno.ENOENT

    run_fs(tmp_path, body)


def test_an_open_racing_the_last_close_keeps_the_file(tmp_path: Path) -> None:
    """The kernel sends RELEASE asynchronously: an open of the same file may arrive while
    the last close is releasing the engine's hold. The open must end up holding the file,
    so that after an unlink its data stays readable (it was deleted under the open handle,
    and getattr answered ENOENT, when the close forgot the file after the open took it)."""
    data = os.urandom(BS + 5)

    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        ino = await write_file(fs, b"f", data)
        fh1 = await fs.open(ino, os.O_RDONLY)
        closing, release_close = trio.Event(), trio.Event()
        real_close = fs.meta.close_file

        async def slow_close(i: int):
            closing.set()
            await release_close.wait()
            return await real_close(i)

        fs.meta.close_file = slow_close  # type: ignore[method-assign]
        opened: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fs.release, fh1)
            await closing.wait()

            async def reopen() -> None:
                opened.append(await fs.open(ino, os.O_RDONLY))

            nursery.start_soon(reopen)
            await trio.sleep(0.05)
            release_close.set()
        fs.meta.close_file = real_close  # type: ignore[method-assign]
        await fs.unlink(ROOT_INODE, b"f")
        assert (await fs.getattr(ino)).nlink == 0
        assert await fs.read(opened[0], 0, 1 << 20) == data
        await fs.release(opened[0])
        with pytest.raises(FsError) as e:
            await fs.getattr(ino)
        assert e.value.errno == errno.ENOENT

    run_fs(tmp_path, body)


def test_identical_blocks_sealed_at_once_all_reach_the_bucket(tmp_path: Path) -> None:
    """Many files with the same bytes, written, deleted and rewritten concurrently (RocksDB
    instances creating identical files): no staged block may vanish before its upload."""
    data = os.urandom(2 * BS)

    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        async def churn(i: int) -> None:
            for round_ in range(5):
                name = f"f{i}-{round_}".encode()
                await write_file(fs, name, data)
                if round_ % 2:
                    await fs.unlink(ROOT_INODE, name)
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(churn, i)
        await fs.uploader.drain()
        assert fs.uploader.stats.upload_failures == 0
        ino = (await fs.lookup(ROOT_INODE, b"f3-4")).id
        assert await read_file(fs, ino) == data
        for key in (block_key(data[:BS]), block_key(data[BS:])):
            assert remote.get(object_name(key))

    run_fs(tmp_path, body, upload_delay=0.0)


def test_a_block_sealed_again_while_its_last_seal_commits(tmp_path: Path) -> None:
    """A small file flushed, written and flushed again while the first flush's commit is
    still with the metadata (a slow shared database): the first seal must leave the
    second's sealing entry alone, and the newest bytes win."""
    first, second = os.urandom(1000), os.urandom(1000)

    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        commit = fs.meta.commit_blocks
        calls = 0

        async def slow_first_commit(*args, **kw):
            nonlocal calls
            calls += 1
            if calls == 1:
                await trio.sleep(0.3)
            return await commit(*args, **kw)

        fs.meta.commit_blocks = slow_first_commit
        fh, node = await fs.create(ROOT_INODE, b"f", 0o644, os.O_RDWR, CTX)
        await fs.write(fh, 0, first)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fs.flush, fh)
            await trio.sleep(0.1)  # the first seal is committing now
            await fs.write(fh, 0, second)
            await fs.flush(fh)
        assert calls >= 2
        assert await fs.read(fh, 0, 4096) == second
        await fs.release(fh)
        assert await read_file(fs, node.id) == second

    run_fs(tmp_path, body)


def test_disk_cache_survives_eviction_racing_inserts(tmp_path: Path) -> None:
    """Eviction deletes emptied directories while other threads insert: no insert may fail
    (a failing insert behind a background fetch once stopped the daemon)."""
    import concurrent.futures

    cache = DiskCache(str(tmp_path / "cache"), limit_bytes=64 * 1024)
    staged = tmp_path / "staged"
    staged.mkdir()

    def insert(i: int) -> None:
        data = os.urandom(8192)
        if i % 2:
            cache.put(block_key(data), data)
        else:
            path = staged / f"s{i}"
            path.write_bytes(data)
            cache.adopt(block_key(data), str(path))
            path.unlink()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(insert, range(2000)))
    assert cache.used <= 64 * 1024 + 64 * 1024  # bounded (diskcache culls after insert)
    assert cache.stats.evictions > 1000
    for key in list(cache._cache.iterkeys())[:20]:
        assert cache.get(key) is not None


def _flip_a_byte_of_the_entry(cache_dir: Path, data: bytes) -> None:
    """Corrupt the one entry a closed disk cache holds, as a bad disk would (byte 150)."""
    (value_file,) = cache_dir.rglob("*.val")
    with open(value_file, "r+b") as f:
        f.seek(150)
        f.write(bytes([data[150] ^ 0xFF]))


def test_disk_cache_verifies_an_earlier_process_entries_then_serves_ranges(tmp_path: Path) -> None:
    """A block this process stored is read by range without re-hashing 4 MiB; one left by an
    earlier process is verified on its first read, and a corrupt one is dropped as a miss."""
    data = os.urandom(1 << 20)
    key = block_key(data)
    cache = DiskCache(str(tmp_path / "cache"), 64 << 20)
    cache.put(key, data)
    assert cache.get_range(key, 100, 200) == data[100:200]
    assert cache.get_range(key, (1 << 20) - 10, (1 << 20) + 10) == data[-10:]
    cache.close()

    _flip_a_byte_of_the_entry(tmp_path / "cache", data)
    again = DiskCache(str(tmp_path / "cache"), 64 << 20)
    assert again.get_range(key, 100, 200) is None
    assert again.stats.corrupt == 1
    again.put(key, data)
    assert again.get_range(key, 100, 200) == data[100:200]
    again.close()


def test_a_good_copy_stored_while_a_corrupt_one_is_hashed_is_kept(tmp_path: Path, monkeypatch) -> None:
    """Two readers find the same corrupt entry; the first drops it and stores the good copy
    it fetched while the second is still hashing the bad bytes. The second must not drop
    the good copy (it once did: the next daemon fetched that block from the bucket again)."""
    import fusestate.blocks.caches as caches

    data = os.urandom(1 << 20)
    key = block_key(data)
    cache = DiskCache(str(tmp_path / "cache"), 64 << 20)
    cache.put(key, data)
    cache.close()
    _flip_a_byte_of_the_entry(tmp_path / "cache", data)

    again = DiskCache(str(tmp_path / "cache"), 64 << 20)
    real_matches = caches.key_matches

    def first_reader_refetches_meanwhile(k: str, b: bytes) -> bool:
        monkeypatch.setattr(caches, "key_matches", real_matches)
        again.put(key, data)  # what the other reader does after its own failed check
        return real_matches(k, b)

    monkeypatch.setattr(caches, "key_matches", first_reader_refetches_meanwhile)
    assert again.get(key) == data
    assert again.stats.corrupt == 1
    assert not again.known_absent(key)
    again.close()
    fresh = DiskCache(str(tmp_path / "cache"), 64 << 20)  # a new process verifies it again
    assert fresh.get(key) == data and fresh.stats.corrupt == 0
    fresh.close()


def test_blocks_named_by_sha256_before_blake3_still_verify(tmp_path: Path) -> None:
    """Volumes written before BLAKE3 name their blocks by SHA-256: such a block fetched from
    the bucket, or found in a cache dir an earlier daemon left, passes its check; bytes that
    are not the named block fail it either way."""
    data = os.urandom(BS)
    old_key = hashlib.sha256(data).hexdigest()
    assert block_key(data) != old_key
    assert key_matches(old_key, data) and key_matches(block_key(data), data)
    assert not key_matches(old_key, data[:-1] + bytes([data[-1] ^ 1]))

    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        remote.put(object_name(old_key), data)
        assert await fs.blocks.fetch(old_key) == data
        bad = os.urandom(BS)
        bad_key = hashlib.sha256(os.urandom(BS)).hexdigest()
        remote.put(object_name(bad_key), bad)
        with pytest.raises(BlockReadError):
            await fs.blocks.fetch(bad_key)

    run_fs(tmp_path, body)

    cache = DiskCache(str(tmp_path / "old-cache"), 64 << 20)
    cache.put(old_key, data)
    cache.close()
    again = DiskCache(str(tmp_path / "old-cache"), 64 << 20)
    assert again.get_range(old_key, 10, 20) == data[10:20]
    assert again.stats.corrupt == 0
    again.close()


def test_disk_cache_knows_what_it_holds_and_what_it_just_missed(tmp_path: Path) -> None:
    """The event loop skips the worker-thread lookup (an SQLite transaction) for a block that
    is certainly not here: one never stored (every first read on a fresh node), or one the
    cache just missed, until it is stored. Every insert goes through the cache object, and a
    reopened cache knows its entries from the index."""
    data = os.urandom(64 * 1024)
    key = block_key(data)
    cache = DiskCache(str(tmp_path / "cache"), 64 << 20)
    assert cache.known_absent(key)
    cache.put(key, data)
    assert not cache.known_absent(key)
    assert cache.get_range(key, 10, 20) == data[10:20]
    staged = tmp_path / "staged"
    other = os.urandom(64 * 1024)
    assert cache.known_absent(block_key(other)) and cache.stats.misses == 0
    staged.write_bytes(other)
    cache.adopt(block_key(other), str(staged))
    assert not cache.known_absent(block_key(other))
    cache.close()

    again = DiskCache(str(tmp_path / "cache"), 64 << 20)
    assert not again.known_absent(key) and not again.known_absent(block_key(other))
    assert again.get_range(key, 0, 10) == data[:10]
    # An entry removed behind the object's back (diskcache culling it) is maybe-present until
    # a read misses it; from then on it is known absent.
    again._cache.delete(block_key(other))
    assert not again.known_absent(block_key(other))
    assert again.get(block_key(other)) is None and again.known_absent(block_key(other))
    again.close()


def test_disk_cache_rebuilds_its_key_set_when_culled_keys_pile_up(tmp_path: Path) -> None:
    """Keys diskcache evicts stay in the set of maybe-present keys; the set is read again
    from the index once it doubles, so a long random workload cannot grow it without bound."""
    cache = DiskCache(str(tmp_path / "cache"), limit_bytes=256 * 1024)
    keys = []
    for _ in range(3000):
        data = os.urandom(8192)
        keys.append(block_key(data))
        cache.put(keys[-1], data)
    assert cache.stats.evictions > 2000
    assert len(cache._maybe_present) <= 2 * len(cache) + 1024 + 1
    held = set(cache._cache.iterkeys())
    assert held <= cache._maybe_present  # never a false "absent"
    assert all(not cache.known_absent(k) for k in held)
    cache.close()


def test_a_cold_point_read_on_a_fresh_node_goes_straight_to_the_bucket(tmp_path: Path) -> None:
    """A small read of a block that is nowhere local takes one range read from the bucket,
    with no disk cache lookup first (still counted as a disk cache miss)."""
    data = os.urandom(BS)

    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        key = block_key(data)
        remote.put(object_name(key), data)
        disk, lookups = fs.blocks.disk, []
        for name in ("get", "get_range"):
            real = getattr(disk, name)
            setattr(disk, name, lambda *args, _real=real, _name=name: lookups.append(_name) or _real(*args))
        assert await fs.blocks.read(key, 100, 200) == data[100:200]
        assert lookups == [] and disk.stats.misses == 1
        assert fs.blocks.stats.remote_range_reads == 1

    run_fs(tmp_path, body)


def _forget_memory(fs: FileSystem) -> None:
    fs.blocks.memory._items.clear()
    fs.blocks.memory.used = 0


def test_interleaved_scans_on_one_handle_load_whole_blocks(tmp_path: Path) -> None:
    """The kernel's readahead requests arrive interleaved with the reader's own: a read that
    continues any recent read of its handle is a scan and loads whole blocks into memory,
    where a point read takes only its range."""
    data = os.urandom(8 * BS)

    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        ino = await write_file(fs, b"f", data)
        await fs.uploader.drain()
        _forget_memory(fs)  # as after a restart: the blocks are in the disk cache only
        fh = await fs.open(ino, os.O_RDONLY)
        stats = fs.blocks.stats
        piece = 4096
        a, b = 0, 4 * BS + 3 * piece  # b starts as a point read, then continues its own stream
        for _ in range(40):
            assert await fs.read(fh, a, piece) == data[a:a + piece]
            assert await fs.read(fh, b, piece) == data[b:b + piece]
            a, b = a + piece, b + piece
        # One whole-block load per block each stream enters (3 + 3) and b's first, point read;
        # everything else from memory. (Tracking only the last read's end: about 66 disk reads.)
        assert stats.reads_from_disk <= 8 and stats.reads_from_memory >= 72, stats
        before = stats.reads_from_memory
        assert await fs.read(fh, 7 * BS + 5, 100) == data[7 * BS + 5:7 * BS + 105]  # a point read elsewhere
        assert stats.reads_from_memory == before  # its range only: not loaded into memory
        await fs.release(fh)

    run_fs(tmp_path, body, readahead_blocks=0)


def test_concurrent_reads_of_a_block_load_it_from_disk_once(tmp_path: Path) -> None:
    """A scan's reads and its readahead ask for the same block at the same moment."""
    data = os.urandom(BS)

    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        await write_file(fs, b"f", data)
        await fs.uploader.drain()
        key = block_key(data)
        _forget_memory(fs)  # in the disk cache only
        hits = fs.blocks.disk.stats.hits
        results: list[bytes] = []

        async def one() -> None:
            results.append(await fs.blocks.read(key, 0, BS, whole=True))

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(one)
        assert results == [data] * 8
        assert fs.blocks.disk.stats.hits - hits == 1

    run_fs(tmp_path, body)


def test_file_bucket_range_reads_clip_at_the_end_and_name_a_missing_object(tmp_path: Path) -> None:
    remote = RemoteStore(fsspec.filesystem("file"), str(tmp_path / "bucket"), retries=1)
    data = os.urandom(10_000)
    remote.put("blocks/ab/cd", data)
    assert remote.get_range("blocks/ab/cd", 100, 4196) == data[100:4196]
    assert remote.get_range("blocks/ab/cd", 9_990, 20_000) == data[9_990:]  # past the end: what is there
    assert remote.get_range("blocks/ab/cd", 20_000, 20_010) == b""
    assert remote.stats.bytes_in == 4096 + 10
    with pytest.raises(FileNotFoundError):
        remote.get_range("blocks/ab/missing", 0, 10)


def test_small_cold_reads_of_a_quick_file_bucket_take_no_worker_thread(tmp_path: Path) -> None:
    """Once a file:// bucket's small reads are timed quick, a small cold read is one pread
    on the event loop; the bytes are the same. So is a small read of a block in the disk
    cache, once the cache's reads are timed no cheaper. A large read, every read while another
    waits in a worker thread (concurrent readers go on in parallel there), and every read
    while faults are injected still take a thread."""
    import threading

    from fusestate.blocks.read_costs import MIN_BUCKET_SAMPLES

    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        blocks = [os.urandom(BS) for _ in range(MIN_BUCKET_SAMPLES + 4)]  # the first reads: one per block
        keys = []
        for data in blocks:
            key = block_key(data)
            remote.put(object_name(key), data)  # in the bucket only: every read of it is cold
            keys.append(key)
        threads: list[str] = []
        gate = threading.Event()
        gate.set()
        real_run = remote.run

        async def counting_run(fn, *args):  # type: ignore[no-untyped-def]
            threads.append(fn.__name__)

            def gated():  # type: ignore[no-untyped-def]
                gate.wait()
                return fn(*args)
            return await real_run(gated)
        remote.run = counting_run  # type: ignore[method-assign]
        store = fs.blocks

        async def small(i: int) -> None:
            k = i % len(keys)
            offset = (i * 4096) % (BS - 4096)
            assert await store.read(keys[k], offset, offset + 100) == blocks[k][offset:offset + 100]

        for i in range(MIN_BUCKET_SAMPLES):
            await small(i)
        assert len(threads) == MIN_BUCKET_SAMPLES  # timed in worker threads first
        assert store.read_costs.bucket_is_quick()
        threads.clear()
        requests = remote.stats.requests["get_range"]
        for i in range(20):
            await small(i)
        assert threads == [] and remote.stats.requests["get_range"] == requests + 20
        assert store.stats.remote_range_reads == MIN_BUCKET_SAMPLES + 20

        # A block in the disk cache as well: once the bucket's small reads are timed no dearer
        # than the cache's (a thread and an SQLite transaction each), they go to the bucket.
        await trio.to_thread.run_sync(store.disk.put, keys[3], blocks[3])
        hits = store.disk.stats.hits
        await small(3)  # the cache's reads not timed yet: read from the cache
        assert store.disk.stats.hits == hits + 1
        for _ in range(16):
            store.read_costs.local(0.001)
        threads.clear()
        await small(3)
        assert store.disk.stats.hits == hits + 1 and threads == []

        assert await store.read(keys[0], 0, BS // 2) == blocks[0][:BS // 2]  # a large read
        assert len(threads) == 1

        gate.clear()  # a read held in its thread: the next small read must not wait behind the loop
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.read, keys[1], 0, BS // 2)
                await trio.sleep(0.05)
                threads.clear()
                nursery.start_soon(small, 1)
                await trio.sleep(0.05)
                assert len(threads) == 1, threads
                gate.set()
        finally:
            gate.set()

        threads.clear()
        remote.on_call = lambda op, key: None  # a fault injector
        await small(2)
        assert len(threads) == 1

    run_fs(tmp_path, body, file_bucket=True)


def test_a_block_finding_the_disk_full_waits_for_blocks_still_being_staged(tmp_path: Path) -> None:
    """Two blocks staged at once on a disk with room for one: the second finds the disk
    full while the first is still being written, with nothing staged yet and no read
    cache to evict. It waits (the first will be uploaded and become evictable) instead of
    failing its file."""
    import threading
    import time

    async def body(fs: FileSystem, remote: RemoteStore) -> None:
        staging = fs.blocks.staging
        real_write = staging.write
        writing = threading.Semaphore(1)  # the disk: room for the block being written, no more
        refused = []

        def write(key: str, data, fsync: bool = False) -> None:  # type: ignore[no-untyped-def]
            if not writing.acquire(blocking=False):
                refused.append(key)
                raise OSError(errno.ENOSPC, "No space left on device")
            try:
                time.sleep(0.3)  # a slow disk: the other block arrives meanwhile
                real_write(key, data, fsync)
            finally:
                writing.release()
        staging.write = write

        first, second = os.urandom(BS), os.urandom(BS)
        inodes: dict[bytes, int] = {}

        async def writer(name: bytes, data: bytes) -> None:
            inodes[name] = await write_file(fs, name, data)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer, b"first", first)
            await trio.sleep(0.05)
            nursery.start_soon(writer, b"second", second)
        assert refused, "the second block never found the disk full: the test proves nothing"
        assert fs.blocks.disk_full_failures == 0
        assert await read_file(fs, inodes[b"first"]) == first
        assert await read_file(fs, inodes[b"second"]) == second

    run_fs(tmp_path, body, upload_delay=0.0)


def test_concurrent_staging_writes_never_eat_into_the_metadata_reserve(small_cache_disk: Path) -> None:
    """Worker threads stage blocks at the same moment on a disk with room for two above the
    reserve: two are written, the rest get ENOSPC, and the reserve is still free, instead
    of every thread seeing room and all of them writing."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    block = 4 << 20
    free = shutil.disk_usage(small_cache_disk).free
    staging = Staging(str(small_cache_disk / "staging"), reserve=free - 2 * block - block // 2)
    start = threading.Barrier(8)

    def stage(n: int) -> int:
        start.wait()
        try:
            staging.write(f"k{n}", os.urandom(block))
            return 0
        except OSError as exc:
            return exc.errno or -1

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(stage, range(8)))
    assert sorted(results) == [0, 0] + [errno.ENOSPC] * 6, results
    assert shutil.disk_usage(small_cache_disk).free >= staging.reserve
    assert len(staging.keys()) == 2
