"""The page fill's queue: a request larger than the budget waits instead of being cut short.

One piece alone (``PageFill``), with a file system and a block store reduced to what the
queue asks of them, so the order of events is the test's: which fills run, which wait, and
what a write to a waiting file stops. The end-to-end proof (a mount, a snapshot filled into
the page cache) is in test_snapshot_fill.py.
"""

from __future__ import annotations

import stat
import trio

from fusestate.fuse.page_fill import PageFill
from fusestate.meta.engine import Inode

BS = 1 << 20


def node(ino: int, size: int = BS) -> Inode:
    return Inode(id=ino, mode=stat.S_IFREG | 0o644, uid=0, gid=0, size=size, nlink=1,
                 atime_ns=0, mtime_ns=0, ctime_ns=0)


class Blocks:
    """Fetches wait until the test lets them through (``release``)."""

    def __init__(self) -> None:
        self.gate = trio.Event()
        self.fetched: list[str] = []

    def holds(self, key: str) -> bool:
        return False

    def will_fill(self, keys: list[str]) -> None:
        pass

    def filled(self, keys: list[str]) -> None:
        pass

    async def fetch_for_fill(self, key: str) -> bytes:
        await self.gate.wait()
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


def test_a_request_over_the_budget_waits_and_is_filled_in_order() -> None:
    async def body(fill: PageFill, fs: FileSystem, stored: list[int]) -> None:
        queued, queued_bytes = await fill.requested_all([node(i) for i in range(1, 6)])
        # Two fit the budget, two more wait (twice the budget in all), the fifth is skipped.
        assert (queued, queued_bytes) == (4, 4 * BS)
        assert (fill.queued_bytes, fill.pending_bytes) == (2 * BS, 4 * BS)
        assert fill.stats.skipped == 1 and fill.stats.requested == 4
        # A link (not a request) over the budget is skipped, as before.
        assert not await fill.linked(node(9))
        fs.blocks.gate.set()
        await settle(fill)
        # The waiting ones after the ones queued first (which run side by side).
        assert sorted(stored[:2]) == [1, 2] and sorted(stored[2:]) == [3, 4] and fill.stats.files == 4

    run(body)


def test_a_waiting_fill_stops_at_once_before_other_content() -> None:
    """An open for writing stops the fill of its file: one that waits never runs, and the
    stop does not wait for the fills before it."""
    async def body(fill: PageFill, fs: FileSystem, stored: list[int]) -> None:
        await fill.requested_all([node(i) for i in range(1, 5)])
        with trio.fail_after(1):  # the fills before it are held at the gate
            await fill.stop(3)
        assert fill.stats.stopped == 1 and not fill.filling(3)
        assert fill.pending_bytes == 3 * BS
        fs.blocks.gate.set()
        await settle(fill)
        assert sorted(stored) == [1, 2, 4] and stored[-1] == 4 and "block-3" not in fs.blocks.fetched
        # Stopped, it can be asked for again (a later link of the file's new content).
        assert await fill.linked(node(3))
        await settle(fill)
        assert stored[-1] == 3

    run(body)
