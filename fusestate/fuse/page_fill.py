"""Files linked in on this node, put into the kernel's page cache before they are read.

A Spark state store that moves to this node (its executor was lost elsewhere, or the job
restarts on a fresh node) is loaded by hard-linking its files out of the checkpoint:
metadata only. Its RocksDB then reads most of those files within seconds: every table's
index and filters, the keys the batch touches, a compaction of what it loaded. Through the
mount that is one FUSE request per 4 KiB to 1 MiB, each answered by this process while the
batch waits: tens of thousands of requests for a few GB. A local disk that had just copied
the files would answer the same reads from the page cache.

So a regular file linked here whose blocks this node does not hold is fetched whole in
the background, a few blocks at a time, verified, and handed to the kernel with
``notify_store``; its reads then never reach the daemon. The daemon's own caches do not
keep these blocks (the page cache is the copy); pages the kernel drops later are read as
any cold read is.

A restart can start sooner: the files a state store will link are known before the load, as
soon as the job knows its checkpoint (the latest snapshot's files, fusestate.spark.snapshot_fill).
The job looks them up through the mount, so the kernel has their inodes, and asks for them over
the control socket or the fill attribute (``requested``); they are filled the same way while the
JVM starts, and the links that come later find them filled. A request larger than the budget
is not cut short: what does not fit waits, in order, and is queued as earlier fills finish
(up to twice the budget in all; the kernel holds filled pages, not this process). In the lazy
order the budget bounds the data blocks being filled: every file's first part goes at once.

What comes first (``--prefetch-links``). A restarting state store opens every table it
loads, which reads each table's tail (index, filters, footer: fusestate.sst), and its first
batch then reads one data block per key it touches. So by default (``lazy``) each linked file
is filled in two parts: first, all at once over the files, what an open reads (a table's
tail; the whole of any other file, such as a snapshot's zip or a changelog the load replays);
then, in the order the files came, the data blocks, in low-priority threads, and only while
no point lookup of this node waits for the bucket (``BlockStore.readers_quiet``; one block may
go on beside such reads; a scan, such as a compaction, wants bytes as the fill does and is not
waited for). ``tails`` stops after the first part; ``whole`` fills each file from its
start, a few files at a time, as soon as it is linked.

The kernel copies what it is given over the pages it has, dirty ones included, so a fill
must never meet other content: a file open here, or (on a shared volume) cached here
before, is not filled; and before an open for writing, a truncate, or an open that finds
the content changed by another node is answered, the file's fill is stopped and its last
store waited for.
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import trio

from fusestate import sst
from fusestate.blocks.background import BackgroundThreads
from fusestate.blocks.keys import BlockData
from fusestate.blocks.store import BlockReadError
from fusestate.meta.engine import Inode
from fusestate.read_trace import ReadTrace
from fusestate.vfs import FileSystem
from fusestate.vfs.filesystem import content_version

log = logging.getLogger(__name__)

# Blocks fetched at once, over all the files being filled: on a bucket 30 ms away 4 blocks in
# flight fetched 140 MB/s, 8 about twice that (the node's 300 MB/s, less its own CPU), 16 no more.
CONCURRENCY = 8
# Files filled at once. A state store's SSTs are tens of MB (a few blocks each): a limit per file
# left connections idle at each file's last blocks; the blocks of these files share the
# CONCURRENCY slots in the order they were queued, so the first file still comes first.
FILES_AT_ONCE = 4
# Files whose first part (a table's tail) is fetched at once: each is two or three small range
# reads one after the other, so many files in flight hide the bucket's time to first byte.
TAILS_AT_ONCE = 16
PAGE = 4096
FILL_MODES = ("lazy", "tails", "whole")
BUDGET_SHARE = 4         # files queued or being filled: at most this share of the memory
REQUEST_SHARE = 2        # a request's files queued, being filled or waiting: at most this many budgets
FILLED_MEMORY = 100_000  # files remembered as filled, so a later link of one does not fill it again


def default_budget() -> int:
    """Bytes of linked files that may wait to be filled: a quarter of the memory, at most 8 GiB."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = 4 << 30
    return min(memory // BUDGET_SHARE, 8 << 30)


@dataclass
class PageFillStats:
    files: int = 0        # filled to the end
    bytes: int = 0        # handed to the kernel
    skipped: int = 0      # linked, not filled: held here already, open or cached here, or over the budget
                          # (a requested file waits instead, up to twice the budget)
    stopped: int = 0      # stopped midway by a change to the file (a write, a truncate, another node's)
    failures: int = 0     # a block could not be fetched, or the kernel refused it
    requested: int = 0    # files asked for by name before any link (a restart's latest snapshot)
    requested_bytes: int = 0
    tables: int = 0       # RocksDB tables whose tail (index, filters, footer) was filled first
    tail_bytes: int = 0   # bytes of those tails
    first_bytes: int = 0  # bytes filled in the first part: tails, and the other files whole
    body_bytes: int = 0   # tables' data blocks, filled in the background


@dataclass(eq=False)  # one per queued file: compared and hashed as itself
class _Fill:
    node: Inode
    keys: dict[int, str]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    stored: int = 0


class PageFill:
    def __init__(self, fs: FileSystem, store: Callable[[int, int, memoryview], None], *,
                 budget: Optional[int] = None, concurrency: int = CONCURRENCY, mode: str = "lazy") -> None:
        if mode not in FILL_MODES:
            raise ValueError(f"page fill mode {mode!r}")
        self.mode = mode
        self.fs = fs
        self.blocks = fs.blocks
        self._store = store
        self.budget = default_budget() if budget is None else budget
        self.stats = PageFillStats()
        self.queued_bytes = 0  # queued or being filled: what the budget bounds
        self._waiting: deque[_Fill] = deque()  # requested over the budget: queued as fills finish
        self._waiting_bytes = 0
        self._fills: dict[int, _Fill] = {}
        self._send, self._receive = trio.open_memory_channel[_Fill](math.inf)
        self._disabled = False
        self._slots = trio.CapacityLimiter(concurrency)  # blocks in flight, over all files
        self._tail_slots = trio.CapacityLimiter(TAILS_AT_ONCE)
        self._body_slots = trio.CapacityLimiter(concurrency)  # background blocks in flight
        self._body_threads = BackgroundThreads(concurrency, "fill")
        self._beside_readers = False  # a background block is being fetched while readers wait
        self._firsts_pending = 0  # files whose first part is queued or being filled
        self._firsts_done = trio.Event()  # set (and replaced) whenever that count drops to 0
        self._body_bytes = 0  # data blocks of the files whose background part is going on
        self._bodies_changed = trio.Event()  # set (and replaced) when one ends
        self.trace: Optional[ReadTrace] = None  # --read-trace
        # Files filled to the end, with the content filled: a link of one later fetches nothing.
        self._filled: OrderedDict[int, int] = OrderedDict()

    @property
    def pending_bytes(self) -> int:
        """Bytes of files queued, being filled, or (requested) waiting for the budget."""
        return self.queued_bytes + self._waiting_bytes

    async def requested(self, node: Inode) -> bool:
        """``node`` was named by a job about to link it (and looked up, so the kernel knows
        its inode): queue its fill now, or after the fills before it if the budget is spent.
        True if queued or waiting."""
        queued = await self.linked(node, may_wait=True)
        if queued:
            self.stats.requested += 1
            self.stats.requested_bytes += node.size
        return queued

    async def requested_all(self, nodes: list[Inode]) -> tuple[int, int]:
        """``requested`` for each of ``nodes``: the files and bytes queued."""
        queued = queued_bytes = 0
        for node in nodes:
            if await self.requested(node):
                queued, queued_bytes = queued + 1, queued_bytes + node.size
        return queued, queued_bytes

    async def linked(self, node: Inode, *, may_wait: bool = False) -> bool:
        """A name for ``node`` was just made here: queue its fill if it is worth one (True
        if queued). ``may_wait``: over the budget, wait for the fills before it to finish
        rather than skip it.

        Called before the link is answered, so that the content the fill will store is
        remembered (as the page cache's) before any open of the new name can come."""
        if self._disabled or not node.is_reg or node.size == 0 or node.scratch or node.id in self._fills:
            return False
        if not self.fs.unknown_to_page_cache(node.id) or not self._has_room(node.size, may_wait):
            self.stats.skipped += 1
            return False
        keys = await self.fs.meta.block_map(node.id)
        if node.id in self._fills:
            return False  # another link of the same file, answered meanwhile, queued it
        if self._filled.get(node.id) == content_version(node.size, keys):
            self.stats.skipped += 1  # filled already (asked for before this link): the page cache has it
            return False
        if not keys or any(self.blocks.holds(k) for k in keys.values()) or not self.fs.unknown_to_page_cache(node.id):
            self.stats.skipped += 1  # written or read here: the page cache has it, or reads are local
            return False
        self.fs.remember_page_cache(node.id, node.size, keys)
        fill = self._fills[node.id] = _Fill(node, keys)
        self.blocks.will_fill(list(keys.values()))
        if may_wait and self.mode == "whole" and self.queued_bytes + node.size > self.budget:
            self._waiting.append(fill)
            self._waiting_bytes += node.size
        else:
            self._queue(fill)
        return True

    def _has_room(self, size: int, may_wait: bool) -> bool:
        if self.queued_bytes + size <= self.budget:
            return True
        return may_wait and size <= self.budget and self.pending_bytes + size <= REQUEST_SHARE * self.budget

    def _queue(self, fill: _Fill) -> None:
        self.queued_bytes += fill.node.size
        self._send.send_nowait(fill)

    def _queue_waiting(self) -> None:
        """Queue the fills that wait, in order, while the budget has room."""
        while self._waiting and self.queued_bytes + self._waiting[0].node.size <= self.budget:
            fill = self._waiting.popleft()
            self._waiting_bytes -= fill.node.size
            self._queue(fill)

    async def stop(self, ino: int) -> None:
        """Before the kernel's pages of ``ino`` may hold other content: no store after this."""
        fill = self._fills.get(ino)
        if fill is None:
            return
        if fill in self._waiting:  # never started: nothing to wait for
            self._waiting.remove(fill)
            self._waiting_bytes -= fill.node.size
            self._end(fill)
            self.stats.stopped += 1
            return
        fill.scope.cancel()
        await fill.done.wait()

    def _end(self, fill: _Fill) -> None:
        self.blocks.filled(list(fill.keys.values()))
        if self._fills.get(fill.node.id) is fill:
            del self._fills[fill.node.id]
        fill.done.set()

    def filling(self, ino: int) -> bool:
        return ino in self._fills

    async def run(self) -> None:
        """Fill the queued files in the order they were linked: a few at a time from their
        start (``whole``), or each one's first part at once and the rest in that order."""
        files = trio.CapacityLimiter(FILES_AT_ONCE)
        try:
            async with trio.open_nursery() as nursery:
                async for fill in self._receive:
                    if self.mode == "whole":
                        await files.acquire_on_behalf_of(fill)
                        nursery.start_soon(self._run_one, fill, files)
                    else:
                        nursery.start_soon(self._run_one, fill, None)
        finally:
            self._body_threads.close()

    async def _run_one(self, fill: _Fill, files: Optional[trio.CapacityLimiter]) -> None:
        try:
            try:
                with fill.scope:
                    if self.mode == "whole":
                        await self._fill(fill, sorted(fill.keys.items()))
                    else:
                        await self._fill_in_two(fill)
                if fill.scope.cancelled_caught:
                    self.stats.stopped += 1
            except Exception as exc:  # noqa: BLE001 - a fill is an optimisation: never end the mount
                self.stats.failures += 1
                log.warning("filling the page cache with inode %d failed: %s", fill.node.id, exc)
            finally:
                self.queued_bytes -= fill.node.size
                self._end(fill)
                self._queue_waiting()
        finally:
            if files is not None:
                files.release_on_behalf_of(fill)

    async def _fill_in_two(self, fill: _Fill) -> None:
        """A table's tail now, its data blocks in the background (``lazy``) or never (``tails``);
        any other file whole, now."""
        self._firsts_pending += 1
        try:
            async with self._tail_slots:
                data_end = await self._data_end(fill)
                if data_end is None:
                    await self._fill(fill, sorted(fill.keys.items()), first=True)
                    return
                tail_start = data_end // PAGE * PAGE
                tail = await self._read(fill, tail_start, fill.node.size)
                await self._store_chunk(fill.node.id, tail_start, memoryview(tail))
                fill.stored += len(tail)
                self.stats.bytes += len(tail)
                self.stats.tables += 1
                self.stats.tail_bytes += len(tail)
                self.stats.first_bytes += len(tail)
        finally:
            self._firsts_pending -= 1
            if not self._firsts_pending:
                self._firsts_done.set()
                self._firsts_done = trio.Event()
        if self.mode == "lazy":
            bs = self.fs.block_size
            body = [(i, k) for i, k in sorted(fill.keys.items()) if i * bs < tail_start]
            # The budget bounds the data blocks being filled; every first part goes at once.
            while self._body_bytes and self._body_bytes + tail_start > self.budget:
                await self._bodies_changed.wait()
            self._body_bytes += tail_start
            try:
                await self._fill(fill, body, background=True, end=tail_start)
            finally:
                self._body_bytes -= tail_start
                self._bodies_changed.set()
                self._bodies_changed = trio.Event()

    async def _data_end(self, fill: _Fill) -> Optional[int]:
        """Where the file's data blocks end, if it is a RocksDB table (None: it is not)."""
        return await sst.run_steps_async(sst.data_end_steps(fill.node.size), functools.partial(self._read, fill))

    async def _read(self, fill: _Fill, offset: int, length: int) -> bytes:
        """Bytes of the file as linked (its block map then), through the block store's read
        path: a range read per block for a small part."""
        bs, end = self.fs.block_size, min(offset + length, fill.node.size)
        parts = []
        while offset < end:
            index, within = divmod(offset, bs)
            take = min(end - offset, bs - within)
            key = fill.keys.get(index)
            part = await self.blocks.read(key, within, within + take) if key else b""
            parts.append(part.ljust(take, b"\0"))  # a hole, or a block shorter than the file says
            offset += take
        return b"".join(parts)

    async def _store_chunk(self, ino: int, start: int, chunk: memoryview, part: str = "first") -> None:
        # In a thread: the kernel may wait for a page that a read in flight has locked, and
        # that read is answered on this loop.
        try:
            await trio.to_thread.run_sync(self._store, ino, start, chunk)
        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                self._disabled = True
                log.warning("the kernel cannot take data into its page cache; linked files are not filled")
            raise
        if self.trace is not None:
            self.trace.event("fill", ino=ino, off=start, n=len(chunk), part=part)

    async def _background_turn(self) -> bool:
        """Before a background block: wait while any file's first part is pending, and while
        point lookups wait for the bucket, unless no other background block is going beside
        them. True: this block goes beside them."""
        while self._firsts_pending:
            await self._firsts_done.wait()
        while self.blocks.readers_busy():
            if not self._beside_readers:
                self._beside_readers = True
                return True
            await self.blocks.readers_quiet()
        return False

    async def _fill(self, fill: _Fill, blocks: list[tuple[int, str]], *, background: bool = False,
                    first: bool = False, end: Optional[int] = None) -> None:
        """Fill these blocks of the file, up to ``end`` (default: the file's end);
        ``background``: in low-priority threads, yielding to readers; ``first``: counted as a
        first part."""
        ino, size, bs = fill.node.id, fill.node.size, self.fs.block_size
        end = size if end is None else min(end, size)
        part = "data" if background else "first" if first else "whole"
        failed = False

        async def fetch(key: str) -> BlockData:
            if not background:
                return await self.blocks.fetch_for_fill(key)
            beside = await self._background_turn()
            try:
                return await self.blocks.fetch_for_fill(key, self._body_threads.run)
            finally:
                if beside:
                    self._beside_readers = False

        async def one(index: int, key: str) -> None:
            nonlocal failed
            async with self._body_slots if background else self._slots:
                if failed:
                    return
                try:
                    data = await fetch(key)
                except BlockReadError as exc:  # removed meanwhile, most likely: nothing to fill
                    log.debug("filling inode %d: block %d: %s", ino, index, exc)
                    failed = True
                    return
                start = index * bs
                # A view, not a copy: the kernel copies it into its pages anyway.
                chunk = memoryview(data)[:max(0, min(len(data), end - start))]
                if not chunk:
                    return
                try:
                    await self._store_chunk(ino, start, chunk, part)
                except OSError as exc:
                    failed = True
                    if exc.errno not in (errno.ENOSYS, errno.ENOENT):  # ENOENT: the kernel forgot the inode
                        log.warning("filling inode %d: %s", ino, exc)
                    return
                fill.stored += len(chunk)
                self.stats.bytes += len(chunk)
                if background:
                    self.stats.body_bytes += len(chunk)
                elif first:
                    self.stats.first_bytes += len(chunk)

        async with trio.open_nursery() as nursery:
            for index, key in blocks:
                nursery.start_soon(one, index, key)
        if failed:
            self.stats.failures += 1
        else:
            self.stats.files += 1
            self._filled.pop(ino, None)
            self._filled[ino] = content_version(size, fill.keys)
            while len(self._filled) > FILLED_MEMORY:
                self._filled.popitem(last=False)
