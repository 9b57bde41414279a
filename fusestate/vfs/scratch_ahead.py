"""Storing a scratch file's blocks before its promotion, so a commit's links find them done.

A scratch file reaches the volume when it is linked out of its scratch directory: the
shim links a RocksDB state store's SSTs into the checkpoint at every commit. The
promotion (``FileSystem._promote``) must then have every block of the file stored (on a
shared volume, in the bucket) before it commits, and the state store's commit waits for
it. Most of those bytes were written well before the link: a compaction's output, or a
flush's SST whose writer closed just before. So this node stores them as they come:

| when | what is stored |
|---|---|
| every 0.1 s while the file is being written (by the kernel through passthrough, or by the daemon) | the blocks with no hole left that the file's size has passed |
| once its last writer closes it | every block read and hashed again: those stored are checked, the rest (the partial last one) stored, and the file's size and times noted |

Only files whose names match ``--store-ahead`` (``*.sst`` by default) are stored ahead:
most scratch bytes (Spark's shuffle files) are never linked out, and must not be uploaded.

A promotion that finds the file's size and times as that last pass noted (on a cache disk
whose every write gives the file a new ctime, ``FileSystem.fine_ctime``) takes the stored
blocks as they are: it reads nothing. Otherwise it reads and hashes every block, takes the
stored block where the hashes match, stores the others and lets the stale ones go. The
blocks stored ahead of a file that is deleted, truncated away or never linked are let go
too (``BlockStore.abandon``). On a shared volume, where a block must be in the bucket
before a commit names it, the blocks are put there at once, as a promotion puts them: an
abandoned one becomes an unreferenced row the collector deletes in time, and a promotion's
commit passes the age of the oldest upload, so bytes collected since are put again. The embedded
engine stages them, and an abandoned one's staging file is dropped: nothing of a file
never linked out reaches its bucket. What a crash leaves, the next mount's recovery (and
the collector) removes, as for any block sealed and not committed.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import trio

from fusestate.blocks.store import SealedBlock
from fusestate.vfs.passthrough import SEAL_BLOCKS_AT_ONCE
from fusestate.vfs.tasks import each_at_once

if TYPE_CHECKING:
    from fusestate.meta.engine import Inode
    from fusestate.vfs.filesystem import FileSystem
    from fusestate.vfs.open_file import OpenFile

log = logging.getLogger(__name__)

# How often the loop looks at scratch files being written.
SCRATCH_AHEAD_INTERVAL = 0.1
# Blocks of one file stored at once by the loop: as many as a promotion's, which waits for
# the loop's pass over the file it links (the flush's table, closed just before the link).
SCRATCH_AHEAD_BLOCKS_AT_ONCE = SEAL_BLOCKS_AT_ONCE


@dataclass
class _Ahead:
    """One scratch file's blocks stored ahead. Whoever takes it out of ``_ahead`` (a
    promotion, a deletion) waits for ``busy`` and then owns its blocks."""

    blocks: dict[int, SealedBlock] = field(default_factory=dict)
    stamp: Optional[tuple[int, int, int]] = None  # the file's size and times when last looked at
    # ... when a pass after its writers closed found every block of it stored (none written
    # during that pass): the blocks are the file's while its size and times are these.
    checked: Optional[tuple[int, int, int]] = None
    busy: Optional[trio.Event] = None             # the loop is storing blocks of it now


class ScratchAheadStats:
    """What storing ahead did, for status and the metrics."""

    def __init__(self) -> None:
        self.stored_blocks = 0     # blocks stored ahead of a promotion
        self.stored_bytes = 0
        self.used_blocks = 0       # ... that a promotion found matching the file
        self.abandoned_blocks = 0  # ... let go: the file was deleted, or the block written again
        self.unread_promotions = 0  # promotions that took every block stored and checked, reading nothing


class ScratchSealAhead:
    """FileSystem's part for storing scratch files ahead (a mixin on FileSystem's state)."""

    store_ahead: tuple[str, ...]  # name globs of the scratch files stored ahead (--store-ahead)
    _ahead: dict[int, _Ahead]
    _ahead_eligible: set[int]  # this node's scratch files whose names match them
    _ahead_written: set[int]   # scratch files the daemon wrote since the loop last looked
    _ahead_closed: set[int]    # scratch files whose last writer closed since
    _ahead_ended: bool         # the mount ends: nothing more is stored ahead
    scratch_ahead: ScratchAheadStats

    def _init_scratch_ahead(self, store_ahead: Sequence[str]) -> None:
        self.store_ahead = tuple(store_ahead)
        self._ahead = {}
        self._ahead_eligible = set()
        self._ahead_written = set()
        self._ahead_closed = set()
        self._ahead_ended = False  # the mount ends: nothing more is stored ahead
        self.scratch_ahead = ScratchAheadStats()

    def _own_scratch(self: "FileSystem", f: "OpenFile") -> bool:
        return f.node.is_reg and bool(f.node.scratch) and f.node.scratch == self.meta.scratch_owner

    def scratch_created(self: "FileSystem", node: "Inode", name: bytes) -> None:
        """A file was created: if it is a scratch file named as ``--store-ahead`` says, its
        blocks are stored ahead."""
        if node.scratch and node.is_reg and self.store_ahead:
            text = name.decode("utf-8", "surrogateescape")
            if any(fnmatch.fnmatchcase(text, pattern) for pattern in self.store_ahead):
                self._ahead_eligible.add(node.id)

    def scratch_written(self: "FileSystem", f: "OpenFile") -> None:
        """The daemon wrote ``f``'s scratch file (the block path): the loop looks at it."""
        if f.inode in self._ahead_eligible:
            self._ahead_written.add(f.inode)

    def scratch_writer_closed(self: "FileSystem", f: "OpenFile") -> None:
        """A handle that could write ``f`` closed; once none is left, the loop checks every
        block of it and stores the rest."""
        if f.inode in self._ahead_eligible and self._own_scratch(f) and f.node.nlink > 0 and f.writers == 0:
            self._ahead_closed.add(f.inode)

    async def scratch_ahead_loop(self: "FileSystem") -> None:
        """Every ``SCRATCH_AHEAD_INTERVAL`` seconds, store the new whole blocks of scratch
        files being written, and every block of those whose writers closed."""
        while not self._ahead_ended:
            await trio.sleep(SCRATCH_AHEAD_INTERVAL)
            if self._ahead_ended:
                return
            writing = {f.inode for f in self._files.values()
                       if f.passthrough_writers and f.inode in self._ahead_eligible and self._own_scratch(f)}
            writing |= self._ahead_written
            closed, self._ahead_closed = self._ahead_closed, set()
            self._ahead_written = set()
            for ino in sorted(writing | closed):
                if self._ahead_ended:
                    return
                try:
                    if not await self._store_ahead(ino, whole_blocks_only=ino not in closed):
                        (self._ahead_closed if ino in closed else self._ahead_written).add(ino)  # next time
                except Exception as exc:  # noqa: BLE001 - the promotion stores what is missing, and reports it
                    log.warning("inode %d: storing a scratch file's blocks ahead of its link failed: %s", ino, exc)

    async def _store_ahead(self: "FileSystem", ino: int, whole_blocks_only: bool) -> bool:
        """Store the blocks of scratch file ``ino`` that have none stored ahead; with
        ``whole_blocks_only`` False (its writers closed), check the stored ones too. False
        when it cannot be looked at now (a promotion or a write holds it): try again later."""
        f = self._files.get(ino)
        if f is not None and not self._own_scratch(f):
            return True  # promoted meanwhile
        if f is not None and f.lock.locked():
            return False  # a promotion (or a truncate) is at it: look again next time
        st = self.scratch.stat(ino)
        if st is None:
            self._ahead_eligible.discard(ino)
            return True  # promoted or deleted meanwhile
        entry = self._ahead.setdefault(ino, _Ahead())
        stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if entry.busy is not None:
            return False
        if stamp == (entry.stamp if whole_blocks_only else entry.checked):
            return True  # nothing written since the last look (or since the last check)
        entry.busy = busy = trio.Event()
        try:
            entry.stamp, entry.checked = stamp, None
            size, bs = st.st_size, self.block_size
            find = self.scratch.filled_blocks if whole_blocks_only else self.scratch.data_blocks
            with_data = await trio.to_thread.run_sync(find, ino, bs)
            last = size // bs if whole_blocks_only else -(-size // bs)
            if whole_blocks_only:
                todo = sorted(i for i in with_data if i < last and i not in entry.blocks)
            else:  # every block the file has: the stored ones are checked
                stale = [entry.blocks.pop(i) for i in list(entry.blocks) if i >= last or i not in with_data]
                await self.abandon_ahead(stale)
                todo = sorted(i for i in with_data if i < last)
            direct = not self.passthrough  # as the promotion reads it (see _promote_locked)

            async def store(index: int) -> None:
                nbytes = min(bs, size - index * bs)
                data, key = await trio.to_thread.run_sync(self._read_local_block, self.scratch, ino, index * bs,
                                                          nbytes, direct)
                stored = entry.blocks.get(index)
                if stored is not None and (stored.key, stored.nbytes) == (key, nbytes):
                    return  # checked: still the file's
                if stored is not None:
                    del entry.blocks[index]
                    await self.abandon_ahead([stored])
                if key is None:
                    return  # all zeros: a hole in the volume, nothing to store
                entry.blocks[index] = await self.blocks.seal_for_commit(data, key)
                self.scratch_ahead.stored_blocks += 1
                self.scratch_ahead.stored_bytes += nbytes

            await each_at_once(store, todo, SCRATCH_AHEAD_BLOCKS_AT_ONCE)
            if not whole_blocks_only and self.fine_ctime and self._scratch_stamp(ino) == stamp:
                entry.checked = stamp  # nothing written while it was read: the blocks are the file's
        finally:
            entry.busy = None
            busy.set()
        return True

    def _scratch_stamp(self: "FileSystem", ino: int) -> Optional[tuple[int, int, int]]:
        """A scratch file's size, mtime and ctime now (None: it is gone)."""
        st = self.scratch.stat(ino)
        return None if st is None else (st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    async def take_sealed_ahead(self: "FileSystem", ino: int, size: int) -> tuple[dict[int, SealedBlock], bool]:
        """The blocks stored ahead of ``ino``'s promotion, now the caller's (it holds the
        file's lock: nothing writes the file meanwhile), and whether they are known to be
        the file's whole content at ``size`` bytes (checked since its last write): then the
        promotion need not read the file."""
        self._ahead_eligible.discard(ino)
        entry = self._ahead.pop(ino, None)
        if entry is None:
            return {}, False
        if entry.busy is not None:
            await entry.busy.wait()
        checked = entry.checked is not None and entry.checked[0] == size and self._scratch_stamp(ino) == entry.checked
        return entry.blocks, checked

    async def abandon_ahead(self: "FileSystem", blocks: list[SealedBlock]) -> None:
        """Let go of blocks stored ahead that no commit will reference."""
        await self._abandon_sealed([sealed.key for sealed in blocks])
        self.scratch_ahead.abandoned_blocks += len(blocks)

    def drop_sealed_ahead(self: "FileSystem", ino: int) -> None:
        """Scratch file ``ino`` was deleted: let go of what was stored ahead of it."""
        self._ahead_eligible.discard(ino)
        self._ahead_written.discard(ino)
        self._ahead_closed.discard(ino)
        entry = self._ahead.pop(ino, None)
        if entry is None or self._nursery is None:
            return

        self._nursery.start_soon(self._let_go_ahead, entry)

    async def _let_go_ahead(self: "FileSystem", entry: _Ahead) -> None:
        """Let go of a file's blocks stored ahead, once the loop's pass over it (if any) ends."""
        if entry.busy is not None:
            await entry.busy.wait()
        await self.abandon_ahead(list(entry.blocks.values()))

    async def abandon_all_sealed_ahead(self: "FileSystem") -> None:
        """The mount ends: no promotion will come for what was stored ahead (the closes of
        the unmount's releases store nothing more)."""
        self._ahead_ended = True
        while self._ahead:
            await self._let_go_ahead(self._ahead.pop(next(iter(self._ahead))))
