"""Write-back: sealed blocks wait in staging and are uploaded by a pool of workers.

A block is uploaded after ``upload_delay`` (so short-lived files never reach the
bucket), at once when someone waits for it (fsync, unmount) or when the dirty
bound is reached. Writers past the bound wait for uploads (backpressure); they
never fail. A block that fails its whole retry budget stays staged and is tried
again later: nothing is lost.
"""

from __future__ import annotations

import contextlib

import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

import trio

from fusestate.blocks.caches import DiskCache
from fusestate.blocks.keys import object_name
from fusestate.blocks.staging import Staging
from fusestate.blocks.ledger import BlockLedger
from fusestate.remote.store import RemoteError, RemoteStore

log = logging.getLogger(__name__)

RETRY_FAILED_AFTER = 15.0


@dataclass
class WritebackStats:
    uploaded_blocks: int = 0
    uploaded_bytes: int = 0
    dedup_skipped: int = 0
    discarded_blocks: int = 0
    upload_failures: int = 0
    backpressure_waits: int = 0
    backpressure_seconds: float = 0.0


@dataclass
class _Pending:
    size: int
    staged_at: float
    ready_at: float
    done: trio.Event = field(default_factory=trio.Event)
    error: Optional[str] = None
    uploading: bool = False
    synced: bool = False
    # Requeued by crash recovery: its upload may have finished before the crash.
    maybe_in_bucket: bool = False


class UploadFailed(IOError):
    pass


class Uploader:
    def __init__(self, meta: BlockLedger, remote: RemoteStore, staging: Staging,
                 disk_cache: DiskCache, *, max_dirty: int, upload_delay: float,
                 concurrency: int, local_io: trio.CapacityLimiter) -> None:
        self.meta = meta
        self.remote = remote
        self.staging = staging
        self.disk_cache = disk_cache
        self.max_dirty = max_dirty
        self.upload_delay = upload_delay
        self.concurrency = concurrency
        self.stats = WritebackStats()
        self._local_io = local_io
        self._pending: dict[str, _Pending] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._wakeup = trio.Event()
        self._room = trio.Event()
        self.staged_bytes = 0
        self.memory_dirty_bytes: Callable[[], int] = lambda: 0
        # Whether blocks are being sealed or put from memory (a shared engine): their end makes
        # room too, and says so with ``room_changed``.
        self.memory_in_flight: Callable[[], bool] = lambda: False
        self._pins: dict[str, int] = {}
        self.deleting: dict[str, trio.Event] = {}  # blocks the garbage collector is deleting

    # --- state ------------------------------------------------------------
    @property
    def staged_blocks(self) -> int:
        return len(self._pending)

    @property
    def queue_length(self) -> int:
        return sum(1 for p in self._pending.values() if not p.uploading)

    def oldest_staged_age(self) -> float:
        if not self._pending:
            return 0.0
        return time.monotonic() - min(p.staged_at for p in self._pending.values())

    def is_pending(self, key: str) -> bool:
        return key in self._pending

    def dirty_bytes(self) -> int:
        return self.staged_bytes + self.memory_dirty_bytes()

    # --- enqueue / discard -------------------------------------------------
    def add(self, key: str, size: int, synced: bool = False, maybe_in_bucket: bool = False) -> None:
        """A freshly staged block; upload it after the delay (or now under pressure)."""
        if key in self._pending:
            return
        now = time.monotonic()
        delay = 0.0 if self.dirty_bytes() + size > self.max_dirty else self.upload_delay
        self._pending[key] = _Pending(size=size, staged_at=now, ready_at=now + delay, synced=synced,
                                      maybe_in_bucket=maybe_in_bucket)
        self.staged_bytes += size
        self._push(key, now + delay)

    def queued_at(self, key: str) -> float:
        """When (monotonic) a block was queued: its upload began no earlier."""
        p = self._pending.get(key)
        return p.staged_at if p is not None else time.monotonic()

    def _push(self, key: str, ready_at: float) -> None:
        heapq.heappush(self._heap, (ready_at, next(self._seq), key))
        self._wakeup.set()

    def expedite(self, keys: list[str]) -> None:
        for key in keys:
            p = self._pending.get(key)
            if p is not None and not p.uploading and p.ready_at > time.monotonic():
                p.ready_at = 0.0
                self._push(key, 0.0)

    def expedite_all(self) -> None:
        self.expedite(list(self._pending))

    def pin(self, keys: list[str]) -> None:
        """Blocks a metadata journal segment references: upload them even if freed meanwhile."""
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: list[str]) -> None:
        for key in keys:
            left = self._pins.get(key, 0) - 1
            if left > 0:
                self._pins[key] = left
            else:
                self._pins.pop(key, None)

    async def discard(self, key: str) -> None:
        """A block no longer referenced before its upload: drop it, it never reaches the bucket."""
        p = self._pending.get(key)
        if p is None or p.uploading or key in self._pins:
            return  # uploading or pinned: it is uploaded, then left to the garbage collector
        if not self.meta.shared:
            await self.meta.forget_objects([key])
        self._drop(key, p)

    def _drop(self, key: str, p: _Pending) -> None:
        """Forget a block that never reaches the bucket. Unlinked on the loop (one short
        syscall) so a re-seal of the same bytes cannot race with the removal of the old file."""
        self.stats.discarded_blocks += 1
        self.staging.remove(key)
        self._finish(key, p)

    # --- waiting -----------------------------------------------------------
    async def wait_uploaded(self, keys: list[str]) -> None:
        """Return once every key is in the bucket; UploadFailed after the retry budget."""
        self.expedite(keys)
        for key in keys:
            p = self._pending.get(key)
            if p is None:
                continue
            await p.done.wait()
            if p.error is not None and key in self._pending:
                raise UploadFailed(p.error)

    async def sync_staged(self, keys: list[str]) -> None:
        """fsync the staging files of these keys (durability local)."""
        todo = [k for k in keys if k in self._pending and not self._pending[k].synced]
        await trio.to_thread.run_sync(self.staging.fsync, todo, limiter=self._local_io)
        for k in todo:
            if k in self._pending:
                self._pending[k].synced = True

    async def wait_for_room(self, nbytes: int) -> None:
        """Backpressure: block the writer while dirty data is past the bound."""
        if self.dirty_bytes() + nbytes <= self.max_dirty or self.dirty_bytes() == 0:
            return
        started = time.monotonic()
        self.stats.backpressure_waits += 1
        self.expedite_all()
        while self.dirty_bytes() + nbytes > self.max_dirty and (self.staged_bytes > 0 or self.memory_in_flight()):
            await self._room.wait()
        self.stats.backpressure_seconds += time.monotonic() - started

    def room_changed(self) -> None:
        """Dirty data went down (or may have): writers waiting for room look again."""
        self._room.set()
        self._room = trio.Event()

    async def drain(self) -> None:
        """Upload everything that is staged (unmount, SIGTERM)."""
        while self._pending:
            await self.wait_uploaded(list(self._pending))

    # --- recovery ----------------------------------------------------------
    async def recover(self) -> int:
        """After a crash: queue staged blocks the metadata still references, drop the rest."""
        keys = await trio.to_thread.run_sync(self.staging.keys)
        if self.meta.shared:
            # A shared engine commits only uploaded blocks: anything staged was never
            # committed (nor fsynced), so nobody needs it.
            for key in keys:
                await trio.to_thread.run_sync(self.staging.remove, key)
            return 0
        wanted = {o.key: o for o in await self.meta.pending_objects()}
        requeued = 0
        for key in keys:
            info = wanted.pop(key, None)
            if info is not None and info.refcount > 0:
                self.add(key, info.size, synced=True, maybe_in_bucket=True)
                self.expedite([key])
                requeued += 1
            else:
                await trio.to_thread.run_sync(self.staging.remove, key)
        lost = [o.key for o in wanted.values() if o.refcount > 0]
        if lost:
            log.error("%d staged blocks referenced by metadata are missing from the staging area", len(lost))
        await self.meta.forget_objects([o.key for o in wanted.values() if o.refcount <= 0])
        return requeued

    # --- workers -----------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(self.concurrency):
                nursery.start_soon(self._worker)
            task_status.started()

    async def _next_ready(self) -> str:
        while True:
            now = time.monotonic()
            while self._heap:
                ready_at, _, key = self._heap[0]
                p = self._pending.get(key)
                if p is None or p.uploading or ready_at != p.ready_at:
                    heapq.heappop(self._heap)  # stale entry
                    continue
                if ready_at > now:
                    break
                heapq.heappop(self._heap)
                p.uploading = True
                return key
            # Idle workers share one event: replacing it while others wait on it would
            # strand them (a worker waiting on an empty queue would never wake again).
            if self._wakeup.is_set():
                self._wakeup = trio.Event()
            timeout = self._heap[0][0] - now if self._heap else float("inf")
            with trio.move_on_after(timeout):
                await self._wakeup.wait()

    async def _worker(self) -> None:
        while True:
            key = await self._next_ready()
            await self._upload(key)

    async def _upload(self, key: str) -> None:
        p = self._pending[key]
        if self.meta.shared:
            await self._upload_shared(key, p)
            return
        try:
            info = await self.meta.object_info(key)
            if info is None or (info.refcount <= 0 and not info.uploaded and key not in self._pins):
                # Freed while queued: never upload it. Forget and unlink without awaiting,
                # so the same bytes sealed again right now start from a clean slate.
                if info is not None:
                    await self.meta.forget_objects([key])
                    self.staging.remove(key)
                self.stats.discarded_blocks += 1
                self._finish(key, p)
                return
            if not info.uploaded:
                name = object_name(key)
                if key in self.deleting:  # same bytes written again while being collected
                    await self.deleting[key].wait()
                # Only a block recovered after a crash can be in the bucket already; asking
                # for every block would cost each upload a round trip. A new block's PUT
                # rewrites the same bytes if they are there after all (content addressing).
                if p.maybe_in_bucket and await self.remote.aexists(name):
                    self.stats.dedup_skipped += 1
                else:
                    try:
                        await self.remote.aput_file(name, self.staging.path(key))
                    except FileNotFoundError:
                        raise UploadFailed(f"staged block {key[:16]} vanished from the staging area") from None
                    self.stats.uploaded_blocks += 1
                    self.stats.uploaded_bytes += p.size
                await self.meta.mark_uploaded(key)
            # In the bucket: the fsync or journal shipment waiting for it goes ahead while the
            # staging file becomes a disk cache entry (the block stays pending, so staged,
            # until then), as for a shared engine.
            p.error = None
            p.done.set()
            # Uploaded: the row stays (referenced, or waiting for the collector), so a
            # new seal of these bytes needs no staging file and this removal cannot race it.
            info = await self.meta.object_info(key)
            if info is not None and info.refcount > 0:
                await trio.to_thread.run_sync(self._move_to_cache, key, limiter=self._local_io)
            else:
                await trio.to_thread.run_sync(self.staging.remove, key, limiter=self._local_io)
        except (RemoteError, UploadFailed, OSError) as exc:
            self._failed(key, p, exc)
            return
        self._finish(key, p)

    async def put_shared(self, key: str, size: int, put: Callable[[], Awaitable[object]]) -> None:
        """A shared engine's upload of a block, however its bytes are put (``put``: from the
        staging file, or from memory): registered with the engine first (the collector leaves
        it alone until its commit), skipped if the engine says the bucket has these bytes."""
        while (in_bucket := await self.meta.begin_upload(key, size)) is None:
            await trio.sleep(0.2)  # the collector is deleting these bytes: wait, then put them back
        if in_bucket:
            self.stats.dedup_skipped += 1
            return
        await put()
        self.stats.uploaded_blocks += 1
        self.stats.uploaded_bytes += size

    async def _upload_shared(self, key: str, p: _Pending) -> None:
        """Upload for a shared engine: registered with the engine first (the collector leaves
        it alone until its commit), skipped if another node put the same bytes there."""
        if getattr(self.meta, "lost", False):
            self._drop(key, p)  # this node's session was cleaned up: no commit of it can come
            return
        async def put_staged() -> None:
            try:
                await self.remote.aput_file(object_name(key), self.staging.path(key))
            except FileNotFoundError:
                raise UploadFailed(f"staged block {key[:16]} vanished from the staging area") from None

        try:
            await self.put_shared(key, p.size, put_staged)
        except (RemoteError, UploadFailed, OSError) as exc:
            self._failed(key, p, exc)
            return
        # In the bucket: the commit waiting for it goes ahead while the staging file
        # becomes a disk cache entry (the block stays pending, so staged, until then).
        p.error = None
        p.done.set()
        with contextlib.suppress(OSError):
            await trio.to_thread.run_sync(self._move_to_cache, key, limiter=self._local_io)
        self._finish(key, p)

    def _failed(self, key: str, p: _Pending, exc: Exception) -> None:
        self.stats.upload_failures += 1
        log.error("upload of block %s failed, will retry: %s", key[:16], exc)
        p.error = str(exc)
        p.uploading = False
        old_done, p.done = p.done, trio.Event()
        old_done.set()
        p.ready_at = time.monotonic() + RETRY_FAILED_AFTER
        self._push(key, p.ready_at)

    def _finish(self, key: str, p: _Pending) -> None:
        del self._pending[key]
        self.staged_bytes -= p.size
        p.done.set()
        self.room_changed()

    def _move_to_cache(self, key: str) -> None:
        """Keep an uploaded block in the disk read cache: its staging file becomes the entry.

        It is not in the page cache: staging writes it past it and the upload's read drops
        what it brought in (see localio); the mounted file's own pages and the memory cache
        hold the bytes that are read again soon."""
        try:
            self.disk_cache.adopt(key, self.staging.path(key))
        except FileNotFoundError:
            return
        except OSError as exc:  # a full cache disk must not fail the upload
            log.warning("could not keep uploaded block %s in the disk cache: %s", key[:16], exc)
        self.staging.remove(key)
