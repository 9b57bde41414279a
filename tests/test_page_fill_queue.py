"""The page fill's queue: a request larger than the budget waits instead of being cut short.

One piece alone (``PageFill``), with a file system and a block store reduced to what the
queue asks of them, so the order of events is the test's: which fills run, which wait, and
what a write to a waiting file stops. The end-to-end proof (a mount, a snapshot filled into
the page cache) is in test_snapshot_fill.py.
"""

from __future__ import annotations

import stat
from typing import Callable

import trio
import trio.testing

from fusestate.fuse.page_fill import PageFill
from fusestate.meta.engine import Inode

BS = 1 << 20


def node(ino: int, size: int = BS) -> Inode:
    return Inode(id=ino, mode=stat.S_IFREG | 0o644, uid=0, gid=0, size=size, nlink=1,
                 atime_ns=0, mtime_ns=0, ctime_ns=0)


class Blocks:
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

    def holds(self, key: str) -> bool:
        return False

    def will_fill(self, keys: list[str]) -> None:
        pass

    def filled(self, keys: list[str]) -> None:
        pass

    async def fetch_for_fill(self, key: str) -> bytes:
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


def run(body) -> None:
    async def main() -> None:
        fs = FileSystem()
        stored: list[int] = []
        fill = PageFill(fs, lambda ino, offset, data: stored.append(ino), budget=2 * BS)  # type: ignore[arg-type]
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
