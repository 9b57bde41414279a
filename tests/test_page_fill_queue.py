"""The page fill's queue: a request larger than the budget waits instead of being cut short,
and what a lazy fill brings first (RocksDB tables' tails) and when the rest follows.

One piece alone (``PageFill``), with a file system and a block store reduced to what the
queue asks of them, so the order of events is the test's: which fills run, which wait, and
what a write to a waiting file stops. The end-to-end proof (a mount, a snapshot filled into
the page cache) is in test_snapshot_fill.py.
"""

from __future__ import annotations

import collections
import os
import stat
from pathlib import Path
from typing import Callable

import pytest
import trio
import trio.testing

from fusestate import sst
from fusestate.fuse.page_fill import PageFill
from fusestate.meta.engine import Inode

BS = 1 << 20


def node(ino: int, size: int = BS) -> Inode:
    return Inode(id=ino, mode=stat.S_IFREG | 0o644, uid=0, gid=0, size=size, nlink=1,
                 atime_ns=0, mtime_ns=0, ctime_ns=0)


class Ledger:
    """What the fill tells a block store of the blocks it takes on: nothing held here."""

    def holds(self, key: str) -> bool:
        return False

    def will_fill(self, keys: list[str]) -> None:
        pass

    def filled(self, keys: list[str]) -> None:
        pass


class Blocks(Ledger):
    """Each block's fetch waits until the test lets it through (``release``): the test, not
    the scheduler, decides which fill ends first."""

    def __init__(self) -> None:
        self.gates: dict[str, trio.Event] = {}
        self.started: list[str] = []  # the order the fetches began in
        self.fetched: list[str] = []

    def gate(self, key: str) -> trio.Event:
        return self.gates.setdefault(key, trio.Event())

    def release(self, *inodes: int) -> None:
        for ino in inodes:
            self.gate(f"block-{ino}").set()

    async def read(self, key: str, start: int, end: int) -> bytes:
        return bytes(end - start)  # no RocksDB table: each file is filled whole

    def readers_busy(self) -> bool:
        return False

    async def fetch_for_fill(self, key: str, run=None) -> bytes:
        self.started.append(key)
        await self.gate(key).wait()
        self.fetched.append(key)
        return b"x" * BS


class Meta:
    async def block_map(self, ino: int) -> dict[int, str]:
        return {0: f"block-{ino}"}


class FileSystem:
    block_size = BS

    def __init__(self) -> None:
        self.blocks = Blocks()
        self.meta = Meta()

    def unknown_to_page_cache(self, ino: int) -> bool:
        return True

    def remember_page_cache(self, ino: int, size: int, keys: dict[int, str]) -> None:
        pass


def run(body, mode: str = "whole") -> None:
    async def main() -> None:
        fs = FileSystem()
        stored: list[int] = []
        fill = PageFill(fs, lambda ino, offset, data: stored.append(ino), budget=2 * BS,  # type: ignore[arg-type]
                        mode=mode)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill.run)
            await body(fill, fs, stored)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def settle(fill: PageFill) -> None:
    with trio.fail_after(5):
        while fill.pending_bytes:
            await trio.sleep(0.01)


async def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition``, then for every task to block: what was to start has started."""
    with trio.fail_after(5):
        while not condition():
            await trio.sleep(0.01)
    await trio.testing.wait_all_tasks_blocked()


def test_a_request_over_the_budget_waits_and_is_filled_in_order() -> None:
    async def body(fill: PageFill, fs: FileSystem, stored: list[int]) -> None:
        queued, queued_bytes = await fill.requested_all([node(i) for i in range(1, 6)])
        # Two fit the budget, two more wait (twice the budget in all), the fifth is skipped.
        assert (queued, queued_bytes) == (4, 4 * BS)
        assert (fill.queued_bytes, fill.pending_bytes) == (2 * BS, 4 * BS)
        assert fill.stats.skipped == 1 and fill.stats.requested == 4
        # A link (not a request) over the budget is skipped, as before.
        assert not await fill.linked(node(9))
        blocks = fs.blocks
        await until(lambda: len(blocks.started) == 2)
        assert sorted(blocks.started) == ["block-1", "block-2"]
        # The second ends first: the first that waits takes its place, the other still waits.
        blocks.release(2)
        await until(lambda: stored == [2] and len(blocks.started) == 3)
        assert blocks.started[2] == "block-3"
        blocks.release(1)
        await until(lambda: len(blocks.started) == 4)
        assert blocks.started[3] == "block-4" and sorted(stored) == [1, 2]
        blocks.release(3, 4)
        await settle(fill)
        assert sorted(stored) == [1, 2, 3, 4] and fill.stats.files == 4

    run(body)


def test_a_waiting_fill_stops_at_once_before_other_content() -> None:
    """An open for writing stops the fill of its file: one that waits never runs, and the
    stop does not wait for the fills before it."""
    async def body(fill: PageFill, fs: FileSystem, stored: list[int]) -> None:
        await fill.requested_all([node(i) for i in range(1, 5)])
        with trio.fail_after(1):  # the fills before it are held at their gates
            await fill.stop(3)
        assert fill.stats.stopped == 1 and not fill.filling(3)
        assert fill.pending_bytes == 3 * BS
        fs.blocks.release(1, 2, 3, 4)
        await settle(fill)
        assert sorted(stored) == [1, 2, 4] and fs.blocks.started[-1] == "block-4"
        assert "block-3" not in fs.blocks.started
        # Stopped, it can be asked for again (a later link of the file's new content).
        assert await fill.linked(node(3))
        await settle(fill)
        assert stored[-1] == 3

    run(body)


class TableBlocks(Ledger):
    """Blocks holding real files' bytes; records what the fill asked for and in what order,
    and lets the test say whether readers wait for the bucket."""

    def __init__(self, files: dict[int, bytes], block_size: int) -> None:
        self.data = {f"{ino}-{i}": content[i * block_size:(i + 1) * block_size]
                     for ino, content in files.items() for i in range((len(content) + block_size - 1) // block_size)}
        self.events: list[tuple[str, str]] = []  # ("read" | "fetch" | "background", key)
        self.busy = False
        self.quiet = trio.Event()
        self.in_flight = 0  # background fetches
        self.most_in_flight = {True: 0, False: 0}  # the most at once, while readers were busy and not
        self.files_in_flight: collections.Counter[str] = collections.Counter()  # background fetches by file
        self.most_files_in_flight = 0

    async def read(self, key: str, start: int, end: int) -> bytes:
        self.events.append(("read", key))
        return self.data[key][start:end]

    def readers_busy(self) -> bool:
        return self.busy

    async def readers_quiet(self) -> None:
        await self.quiet.wait()

    async def fetch_for_fill(self, key: str, run=None) -> bytes:
        self.events.append(("background" if run is not None else "fetch", key))
        ino = key.split("-")[0]
        if run is not None:
            self.in_flight += 1
            self.most_in_flight[self.busy] = max(self.most_in_flight[self.busy], self.in_flight)
            self.files_in_flight[ino] += 1
            self.most_files_in_flight = max(self.most_files_in_flight, len(+self.files_in_flight))
        await trio.sleep(0.02)
        if run is not None:
            self.in_flight -= 1
            self.files_in_flight[ino] -= 1
        return self.data[key]


def table_fs(files: dict[int, bytes], bs: int) -> tuple[FileSystem, "TableBlocks"]:
    """A file system of ``bs``-byte blocks holding ``files`` (inode -> bytes), block i of inode
    n keyed ``n-i``."""
    fs = FileSystem()
    fs.block_size = bs
    blocks = fs.blocks = TableBlocks(files, bs)  # type: ignore[assignment]

    class Meta:
        async def block_map(self, ino: int) -> dict[int, str]:
            return {i: f"{ino}-{i}" for i in range((len(files[ino]) + bs - 1) // bs)}

    fs.meta = Meta()  # type: ignore[assignment]
    return fs, blocks


def test_lazy_fills_every_tables_tail_first_and_its_data_blocks_only_while_readers_are_quiet(
        rocksdb_tables: list[Path]) -> None:
    """Two RocksDB tables and a file that is not one: the tables' tails (index, filters,
    footer) go to the page cache before any of their data blocks, the other file whole at
    once; the data blocks follow in the background, one at a time while readers wait for the
    bucket, several once they are quiet; in the end the page cache holds every byte."""
    bs = 128 * 1024
    files = {1: rocksdb_tables[0].read_bytes(), 2: rocksdb_tables[1].read_bytes(), 3: os.urandom(bs + 1000)}
    ends = {ino: sst.data_end_of_file(str(t)) for ino, t in ((1, rocksdb_tables[0]), (2, rocksdb_tables[1]))}

    async def main() -> None:
        fs, blocks = table_fs(files, bs)
        pages: dict[int, bytearray] = {ino: bytearray(len(c)) for ino, c in files.items()}
        stores: list[tuple[int, int]] = []

        def store(ino: int, offset: int, data: memoryview) -> None:
            stores.append((ino, offset))
            pages[ino][offset:offset + len(data)] = data

        fill = PageFill(fs, store, budget=64 << 20, mode="lazy")  # type: ignore[arg-type]
        blocks.busy = True  # readers wait for the bucket
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill.run)
            await fill.requested_all([node(ino, len(c)) for ino, c in files.items()])
            await until(lambda: fill.stats.tables == 2 and fill.stats.files == 1
                        and sum(kind == "background" for kind, _ in blocks.events) >= 3)
            for ino in (1, 2):
                tail = ends[ino] // 4096 * 4096
                assert (ino, tail) in stores
                assert pages[ino][tail:] == files[ino][tail:]
            assert pages[3] == files[3] and all(k.startswith("3-") for kind, k in blocks.events if kind == "fetch")
            first_background = next(i for i, (kind, _) in enumerate(blocks.events) if kind == "background")
            assert all(kind != "read" for kind, _ in blocks.events[first_background:])
            blocks.busy = False
            blocks.quiet.set()
            await settle(fill)
            nursery.cancel_scope.cancel()
        assert blocks.most_in_flight == {True: 1, False: 8}, blocks.most_in_flight
        assert all(pages[ino] == files[ino] for ino in files)
        assert fill.stats.files == 3 and fill.stats.failures == 0
        assert fill.stats.tail_bytes == sum(len(files[i]) - ends[i] // 4096 * 4096 for i in (1, 2))
        assert fill.stats.first_bytes == fill.stats.tail_bytes + len(files[3])
        assert fill.stats.bytes == fill.stats.first_bytes + fill.stats.body_bytes

    trio.run(main)


def test_tails_fills_only_what_an_open_reads(rocksdb_tables: list[Path]) -> None:
    bs = 256 * 1024
    content = rocksdb_tables[0].read_bytes()
    end = sst.data_end_of_file(str(rocksdb_tables[0]))

    async def main() -> None:
        fs, blocks = table_fs({1: content}, bs)
        stored: list[tuple[int, int]] = []
        fill = PageFill(fs, lambda ino, offset, data: stored.append((offset, len(data))),  # type: ignore[arg-type]
                        budget=64 << 20, mode="tails")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill.run)
            await fill.requested_all([node(1, len(content))])
            await settle(fill)
            nursery.cancel_scope.cancel()
        tail = end // 4096 * 4096
        assert stored == [(tail, len(content) - tail)]
        assert not any(kind in ("fetch", "background") for kind, _ in blocks.events)
        assert fill.stats.files == 0 and fill.stats.tables == 1

    trio.run(main)


def test_lazy_starts_every_first_part_at_once_and_bounds_the_data_blocks_by_the_budget(
        rocksdb_tables: list[Path]) -> None:
    """Three tables requested with a budget of 1.6 of them (a request may queue twice the
    budget): all three tails at once, then one table's data blocks at a time, as two would be
    more than the budget."""
    bs = 256 * 1024
    tables = rocksdb_tables[:3]
    files = {ino: t.read_bytes() for ino, t in enumerate(tables, start=1)}

    async def main() -> None:
        fs, blocks = table_fs(files, bs)
        budget = int(1.6 * max(len(c) for c in files.values()))
        fill = PageFill(fs, lambda ino, offset, data: None, budget=budget, mode="lazy")  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill.run)
            queued, _ = await fill.requested_all([node(ino, len(c)) for ino, c in files.items()])
            assert queued == 3 and fill.pending_bytes == sum(len(c) for c in files.values())
            await settle(fill)
            nursery.cancel_scope.cancel()
        assert fill.stats.files == 3 and fill.stats.tables == 3 and fill.stats.failures == 0
        assert blocks.most_files_in_flight == 1
        kinds = [kind for kind, _ in blocks.events]
        assert max(i for i, k in enumerate(kinds) if k == "read") < kinds.index("background")  # tails first

    trio.run(main)
