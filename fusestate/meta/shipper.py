"""Ships the metadata journal and snapshots to the bucket, in order.

Group commit: every fsync that needs the bucket asks for a ship and waits; one
segment carries all of them. A segment is uploaded only after every block its
(compacted) changes reference is in the bucket; those blocks are pinned so a
delete in the meantime cannot drop them before upload.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Protocol

import trio

from fusestate.blocks.uploader import UploadFailed, Uploader
from fusestate.meta import journal
from fusestate.meta.sqlite_engine import SQLiteEngine
from fusestate.remote.store import RemoteError, RemoteStore

log = logging.getLogger(__name__)

SHIPPED_SEQ = "shipped_seq"
SNAPSHOTS_KEPT = 2


class ShipFailed(IOError):
    pass


class Fence(Protocol):
    """What the shipper asks the lease (``fusestate.daemon.lease.Lease``)."""

    def vouches_for(self, landed_at: float) -> bool: ...

    def superseded(self) -> bool: ...


@dataclass
class ShipperStats:
    segments_shipped: int = 0
    entries_shipped: int = 0
    bytes_shipped: int = 0
    snapshots_shipped: int = 0
    failures: int = 0
    last_ship_time: float = 0.0
    # Where a ship's time goes: waiting for the blocks it references, its PUT, the fence check.
    blocks_waited: int = 0
    upload_wait_seconds: float = 0.0
    put_seconds: float = 0.0
    fence_seconds: float = 0.0


class JournalShipper:
    def __init__(self, meta: SQLiteEngine, remote: RemoteStore, uploader: Uploader, epoch: int, *,
                 interval: float = 2.0, snapshot_interval: float = 600.0,
                 snapshot_entries: int = 200_000) -> None:
        self.meta = meta
        self.remote = remote
        self.uploader = uploader
        self.epoch = epoch
        self.interval = interval
        self.snapshot_interval = snapshot_interval
        self.snapshot_entries = snapshot_entries
        self.stats = ShipperStats()
        self.shipped_seq = int(meta.get_setting(SHIPPED_SEQ) or 0)
        self.snapshot_seq = int(meta.get_setting("snapshot_seq") or 0)
        # Blocks freed after the oldest kept snapshot may still be needed to restore it.
        self.oldest_snapshot_seq = int(meta.get_setting("oldest_snapshot_seq") or 0)
        self._last_snapshot = time.monotonic()
        self._wakeup = trio.Event()
        self._shipped = trio.Event()
        self._lock = trio.Lock()
        self._error: Optional[str] = None
        self.stopped = False
        # Set by the daemon: the volume's lease, which says whether another holder took the
        # volume over (fencing) before a segment may be acknowledged.
        self.fence: Optional[Fence] = None
        self.last_request = float("-inf")  # monotonic time of the last fsync that waited for a ship

    # --- state for status/metrics ------------------------------------------------
    def pending_entries(self) -> int:
        return self.meta.journal_pending(self.shipped_seq)

    def last_ship_age(self) -> Optional[float]:
        return time.time() - self.stats.last_ship_time if self.stats.last_ship_time else None

    # --- waiting ------------------------------------------------------------------
    async def wait_shipped(self, seq: Optional[int] = None) -> None:
        """Return once the journal up to ``seq`` (default: now) is in the bucket."""
        target = self.meta.journal_last_seq() if seq is None else seq
        self.last_request = time.monotonic()
        while self.shipped_seq < target:
            if self.stopped:
                raise ShipFailed("the volume lease was lost; metadata is no longer shipped")
            shipped = self._shipped
            self._wakeup.set()
            await shipped.wait()
            if self.shipped_seq < target and self._error is not None:
                raise ShipFailed(self._error)

    # --- the loop -----------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while not self.stopped:
            with trio.move_on_after(self.interval):
                await self._wakeup.wait()
            self._wakeup = trio.Event()
            try:
                await self.ship()
                if self._snapshot_due():
                    await self.snapshot()
            except (ShipFailed, RemoteError, UploadFailed, OSError) as exc:
                self.stats.failures += 1
                self._error = str(exc)
                log.error("shipping metadata failed, will retry: %s", exc)
                self._signal_shipped()
                await trio.sleep(min(self.interval, 1.0))

    async def _fenced_off(self, landed_at: float) -> bool:
        """Whether a newer epoch existed when the segment landed: asked of the bucket unless
        a recent check vouches for that moment."""
        if self.fence is None or self.fence.vouches_for(landed_at):
            return False
        return await self.remote.run(self.fence.superseded)

    def _account(self, blocks: int, waited: float, put: float, fence: float) -> None:
        self.stats.blocks_waited += blocks
        self.stats.upload_wait_seconds += waited
        self.stats.put_seconds += put
        self.stats.fence_seconds += fence

    def _signal_shipped(self) -> None:
        self._shipped.set()
        self._shipped = trio.Event()

    def _snapshot_due(self) -> bool:
        if self.shipped_seq <= self.snapshot_seq:
            return False
        if self.shipped_seq - self.snapshot_seq >= self.snapshot_entries:
            return True
        return time.monotonic() - self._last_snapshot >= self.snapshot_interval

    async def ship(self) -> None:
        """Ship the journal tail as one segment (no-op when nothing is new)."""
        async with self._lock:
            # Read, compact and pin without awaiting: the pinned blocks are exactly
            # the ones the segment's final row images reference.
            end = self.meta.journal_last_seq()
            if end <= self.shipped_seq or self.stopped:
                self._signal_shipped()
                return
            changes = journal.compact(self.meta.journal_tail(self.shipped_seq))
            changes = [c for c in changes if c.seq <= end]
            needed = []
            for change in changes:
                key = change.block_key()
                if key is not None:
                    info = self.meta.object_row(key)
                    if info is None or not info.uploaded:
                        needed.append(key)
            self.uploader.pin(needed)
            try:
                started = time.monotonic()
                await self.uploader.wait_uploaded(needed)
                waited = time.monotonic()
                first = self.shipped_seq + 1
                data = await trio.to_thread.run_sync(journal.encode_segment, changes)
                await self.remote.aput(journal.segment_key(self.epoch, first, end), data)
                put = time.monotonic()
                fenced = await self._fenced_off(put)
                done = time.monotonic()
                self._account(len(needed), waited - started, put - waited, done - put)
                log.debug("shipped %d changes: waited %.0f ms for %d blocks, put %.0f ms, fence check %.0f ms",
                          len(changes), (waited - started) * 1e3, len(needed), (put - waited) * 1e3,
                          (done - put) * 1e3)
                if fenced:
                    # A newer epoch exists: this segment will be ignored on restore, so
                    # nothing it carries may be acknowledged as durable.
                    self.stopped = True
                    raise ShipFailed("the volume was taken over by another holder; this mount is fenced off")
            finally:
                self.uploader.unpin(needed)
            self.shipped_seq = end
            with self.meta.transaction():
                self.meta.set_setting(SHIPPED_SEQ, str(end))
                self.meta.journal_trim(end)
            self.stats.segments_shipped += 1
            self.stats.entries_shipped += len(changes)
            self.stats.bytes_shipped += len(data)
            self.stats.last_ship_time = time.time()
            self._error = None
            self._signal_shipped()

    async def snapshot(self) -> str:
        """Ship a compacted copy of all metadata and drop the segments it covers."""
        fd, path = tempfile.mkstemp(dir=os.path.dirname(self.meta.path), suffix=".snapshot")
        os.close(fd)
        try:
            seq = await trio.to_thread.run_sync(self.meta.snapshot_copy, path)
            await self.wait_shipped(seq)  # every block it references is then in the bucket
            with open(path, "rb") as f:
                data = f.read()
            key = journal.snapshot_key(self.epoch, seq)
            await self.remote.aput(key, data)
        finally:
            os.unlink(path)
        self.snapshot_seq = seq
        self.meta.set_setting("snapshot_seq", str(seq))
        self._last_snapshot = time.monotonic()
        self.stats.snapshots_shipped += 1
        self.oldest_snapshot_seq = await self.remote.run(self._prune, seq)
        self.meta.set_setting("oldest_snapshot_seq", str(self.oldest_snapshot_seq))
        log.info("metadata snapshot %s shipped", key)
        return key

    def _prune(self, seq: int) -> int:
        """Keep the newest snapshots; remove segments every kept snapshot covers."""
        snapshots = journal.parse_snapshots(self.remote.list(journal.SNAPSHOT_PREFIX.rsplit("/", 1)[0] + "/"))
        kept = snapshots[-SNAPSHOTS_KEPT:]
        for old in snapshots[:-SNAPSHOTS_KEPT]:
            self.remote.delete(old.key)
        oldest_kept = kept[0].seq if kept else seq
        for seg in journal.parse_segments(self.remote.list(journal.JOURNAL_PREFIX)):
            if seg.last <= oldest_kept:
                self.remote.delete(seg.key)
        return oldest_kept
