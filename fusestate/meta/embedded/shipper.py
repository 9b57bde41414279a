"""Ships the metadata journal and snapshots to the bucket, in order.

Group commit: every fsync that needs the bucket asks for a ship and waits; one
segment carries all that asked since the last one started. A segment is
acknowledged only once every block its (compacted) changes reference is in the
bucket too: blocks not yet there upload alongside the segment, pinned so a delete
in the meantime cannot drop them, and the segment names them (``SegmentHeader``)
for a restore to check if the writer died before both landed.

Segments are pipelined: up to ``MAX_IN_FLIGHT`` upload at once, each covering the
journal after the one started before it, and they are acknowledged in order. An
fsync that arrives while a segment uploads starts the next one at once instead of
waiting for it, so on an object store it costs one upload, not one and a half. A
segment that fails fails every later one in flight (restore stops at a gap), and
the next starts again after the last acknowledged one.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

import trio

from fusestate.blocks.uploader import UploadFailed, Uploader
from fusestate.meta.embedded import journal
from fusestate.meta.embedded.engine import SQLiteEngine
from fusestate.remote.store import RemoteError, RemoteStore

log = logging.getLogger(__name__)

SHIPPED_SEQ = "shipped_seq"
SNAPSHOTS_KEPT = 2
MAX_IN_FLIGHT = 4         # journal segments uploading at once
SNAPSHOT_SEGMENTS = 1000  # a snapshot after this many segments: a restore reads every one after it
RETRY_AFTER = 1.0         # seconds between a failed segment and the next attempt


class ShipFailed(IOError):
    pass


class Fence(Protocol):
    """What the shipper asks the lease (``fusestate.daemon.lease.Lease``)."""

    def vouches_for(self, landed_at: float) -> bool: ...

    def superseded(self) -> bool: ...


@dataclass(eq=False)
class _Flight:
    """One segment on its way: the journal range it covers and the blocks it waits for."""

    first: int
    end: int
    changes: list[journal.Change]
    needed: list[str]
    after: Optional["_Flight"]  # the segment before it, acknowledged first
    generation: int             # flights after a failure start a new one
    done: trio.Event = field(default_factory=trio.Event)
    error: Optional[str] = None


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
        self._segments_since_snapshot = 0
        self._snapshotting = False
        self._snapshot_lock = trio.Lock()
        self._wakeup = trio.Event()
        self._shipped = trio.Event()
        self._slots = trio.Semaphore(MAX_IN_FLIGHT)
        self._next_first = self.shipped_seq + 1   # where the next segment starts
        self._last_flight: Optional[_Flight] = None
        self._generation = 0
        self._retry_at = 0.0
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
        failures = self.stats.failures  # only a failure from now on can concern this target
        while self.shipped_seq < target:
            if self.stopped:
                raise ShipFailed("the volume lease was lost; metadata is no longer shipped")
            shipped = self._shipped
            self._wakeup.set()
            await shipped.wait()
            if self.shipped_seq < target and self.stats.failures > failures and self._error is not None:
                raise ShipFailed(self._error)

    # --- the loop -----------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while not self.stopped:
                with trio.move_on_after(self.interval):
                    await self._wakeup.wait()
                self._wakeup = trio.Event()
                await trio.sleep(max(0.0, self._retry_at - time.monotonic()))
                await self._slots.acquire()
                flight = self._start_flight()
                if flight is None:
                    self._slots.release()
                    self._signal_shipped()
                else:
                    nursery.start_soon(self._fly_in_slot, flight)
                if self._snapshot_due():
                    self._snapshotting = True
                    nursery.start_soon(self._snapshot_in_background)

    async def ship(self) -> None:
        """Ship the journal tail now and wait until it and every segment before it are in
        the bucket (no-op when nothing is new)."""
        flight = self._start_flight()
        if flight is None:
            last = self._last_flight  # nothing new: wait for the newest one in flight, if any
            if last is not None:
                await last.done.wait()
                if last.error is not None:
                    raise ShipFailed(last.error)
            return
        await self._fly(flight)
        if flight.error is not None:
            raise ShipFailed(flight.error)

    def _start_flight(self) -> Optional[_Flight]:
        """The next segment: the journal after the last one started. Read, compact and pin
        without awaiting, so the pinned blocks are exactly the ones its row images reference."""
        end = self.meta.journal_last_seq()
        if end < self._next_first or self.stopped:
            return None
        changes = [c for c in journal.compact(self.meta.journal_tail(self._next_first - 1)) if c.seq <= end]
        needed = []
        for change in changes:
            key = change.block_key()
            if key is not None:
                info = self.meta.object_row(key)
                if info is None or not info.uploaded:
                    needed.append(key)
        self.uploader.pin(needed)
        flight = _Flight(self._next_first, end, changes, needed, self._last_flight, self._generation)
        self._next_first = end + 1
        self._last_flight = flight
        return flight

    async def _fly_in_slot(self, flight: _Flight) -> None:
        try:
            await self._fly(flight)
        finally:
            self._slots.release()

    async def _fly(self, flight: _Flight) -> None:
        """Upload one segment, then acknowledge it after the one before it."""
        try:
            await self._upload_and_acknowledge(flight)
        finally:
            if not flight.done.is_set():  # cancelled (the daemon is stopping): nothing after it is shipped
                flight.error = flight.error or "shipping was cancelled"
                flight.done.set()

    async def _upload_and_acknowledge(self, flight: _Flight) -> None:
        size = 0
        times: dict[str, float] = {}
        header = journal.SegmentHeader(self.shipped_seq, tuple(flight.needed))

        async def blocks() -> None:
            await self.uploader.wait_uploaded(flight.needed)
            times["blocks"] = time.monotonic()

        async def segment() -> None:
            nonlocal size
            data = await trio.to_thread.run_sync(journal.encode_segment, flight.changes, header)
            size = len(data)
            await self.remote.aput(journal.segment_key(self.epoch, flight.first, flight.end), data)
            times["put"] = time.monotonic()

        try:
            started = time.monotonic()
            async with trio.open_nursery() as nursery:  # the segment and its new blocks upload together
                nursery.start_soon(blocks)
                nursery.start_soon(segment)
            landed = max(times.values())
            fenced = await self._fenced_off(landed)
            done = time.monotonic()
            waited, put = times["blocks"] - started, times["put"] - started
            self._account(len(flight.needed), waited, put, done - landed)
            log.debug("shipped %d changes: %d blocks in %.0f ms, segment put in %.0f ms, fence check %.0f ms",
                      len(flight.changes), len(flight.needed), waited * 1e3, put * 1e3, (done - landed) * 1e3)
            if fenced:
                # A newer epoch exists: this segment will be ignored on restore, so
                # nothing it carries may be acknowledged as durable.
                self.stopped = True
                raise ShipFailed("the volume was taken over by another holder; this mount is fenced off")
        except* (ShipFailed, RemoteError, UploadFailed, OSError) as group:
            flight.error = "; ".join(str(exc) for exc in group.exceptions)
        finally:
            self.uploader.unpin(flight.needed)
        if flight.after is not None:
            await flight.after.done.wait()
            if flight.error is None and flight.after.error is not None:
                flight.error = flight.after.error  # it follows a segment that is not in the bucket
        if flight.error is None and flight.first != self.shipped_seq + 1:
            flight.error = "a journal segment before it was not shipped"
        if flight.error is None:
            self._acknowledge(flight, size)
        elif flight.generation == self._generation:
            # The first failure: later segments in flight fail with it; start again after
            # what is in the bucket.
            self._generation += 1
            self._next_first = self.shipped_seq + 1
            self._last_flight = None
            self._retry_at = time.monotonic() + RETRY_AFTER
            self.stats.failures += 1
            self._error = flight.error
            log.error("shipping metadata failed, will retry: %s", flight.error)
        flight.done.set()
        self._signal_shipped()

    def _acknowledge(self, flight: _Flight, size: int) -> None:
        self.shipped_seq = flight.end
        with self.meta.transaction():
            self.meta.set_setting(SHIPPED_SEQ, str(flight.end))
            self.meta.journal_trim(flight.end)
        self.stats.segments_shipped += 1
        self.stats.entries_shipped += len(flight.changes)
        self.stats.bytes_shipped += size
        self.stats.last_ship_time = time.time()
        self._segments_since_snapshot += 1
        self._error = None

    async def _snapshot_in_background(self) -> None:
        try:
            await self.snapshot()
        except (ShipFailed, RemoteError, UploadFailed, OSError) as exc:
            log.error("shipping a metadata snapshot failed, will retry: %s", exc)
            self._last_snapshot = time.monotonic() - self.snapshot_interval + 60.0  # again in a minute
        finally:
            self._snapshotting = False

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
        if self._snapshotting or self.shipped_seq <= self.snapshot_seq:
            return False
        if self.shipped_seq - self.snapshot_seq >= self.snapshot_entries:
            return True
        if self._segments_since_snapshot >= SNAPSHOT_SEGMENTS:
            return True
        return time.monotonic() - self._last_snapshot >= self.snapshot_interval

    async def snapshot(self) -> str:
        """Ship a compacted copy of all metadata and drop the segments it covers."""
        async with self._snapshot_lock:  # the loop's, and the one a clean unmount ships
            return await self._snapshot()

    async def _snapshot(self) -> str:
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
        self._segments_since_snapshot = 0
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
