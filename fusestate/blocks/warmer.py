"""Background cache warming after a mount: the blocks a restarted job is about to read.

A fresh node has an empty cache, and a restarted RocksDB reads much of its state soon after
it opens it (point lookups spread over every file, eviction scans, resumed compactions).
Fetching whole blocks in the background, in parallel, while the job is still starting, is
several times faster than fetching them one request at a time later. The mount is ready
before any of this: warming never delays it, and a read of a block being warmed waits for
that one fetch. The fetching, hashing and writing run in the warmer's own threads at a
lower CPU priority (nice 10) and in the idle I/O class, so the restarting job's JVM gets
the cores and the disk first.

Order: files modified most recently first (the live state), each file's blocks in order.
``recent`` stops at half the disk cache, so a volume much larger than the cache is not
churned through it; ``all`` stops at 90% of it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import trio

from fusestate.blocks.store import BlockStore
from fusestate.meta.engine import MetadataEngine
from fusestate.localio import libc

log = logging.getLogger(__name__)

WARM_NICE = 10  # warming runs while the restarted job's JVM starts: let the job have the CPU first
# ioprio_set(2): the idle I/O class, so the JVM's own reads (jars, after a fresh boot) go first.
SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(os.uname().machine)
IOPRIO_WHO_PROCESS, IOPRIO_CLASS_IDLE, IOPRIO_CLASS_SHIFT = 1, 3, 13


def _lower_priority() -> None:
    """Runs in each warming thread: on Linux a thread's nice value and I/O class are its own."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, tid, WARM_NICE)
    if SYS_IOPRIO_SET is not None and libc is not None:
        libc.syscall(SYS_IOPRIO_SET, IOPRIO_WHO_PROCESS, tid, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT)


@dataclass
class WarmupStats:
    state: str = "idle"         # idle | running | done | stopped (cache disk full) | failed
    blocks: int = 0             # fetched from the bucket
    bytes: int = 0
    already_local: int = 0      # found in the disk cache or the staging area
    skipped: int = 0            # deleted since the mount (a restarted job clearing its scratch)
    failures: int = 0
    seconds: float = 0.0


class CacheWarmer:
    def __init__(self, blocks: BlockStore, meta: MetadataEngine, *, mode: str, disk_cache_bytes: int,
                 concurrency: int = 4) -> None:
        self.blocks = blocks
        self.meta = meta
        self.mode = mode
        # Warming past the disk cache would evict what it just fetched: 'all' stops short of
        # its size (diskcache counts its own index in it too).
        self.budget = {"off": 0, "recent": disk_cache_bytes // 2}.get(mode, disk_cache_bytes * 9 // 10)
        self.concurrency = concurrency
        self.stats = WarmupStats()
        self._disk_full = False
        # Threads of its own: their lower priority must not leak into the shared worker threads.
        self._threads = ThreadPoolExecutor(concurrency, thread_name_prefix="warmup", initializer=_lower_priority)

    async def run(self) -> None:
        """Warm the newest files' blocks, in order, up to the budget."""
        started = time.monotonic()
        self.stats.state = "running"
        candidates = await trio.to_thread.run_sync(self.meta.blocks_by_recency, self.budget)
        limiter = trio.CapacityLimiter(self.concurrency)
        try:
            async with trio.open_nursery() as nursery:
                for key, size in candidates:
                    if self._disk_full:
                        break
                    token = object()
                    await limiter.acquire_on_behalf_of(token)  # keeps the order, bounds the tasks
                    nursery.start_soon(self._one, key, size, limiter, token)
        except Exception:
            self.stats.state = "failed"
            raise
        finally:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self.stats.seconds = round(time.monotonic() - started, 3)
        self.stats.state = "stopped" if self._disk_full else "done"
        log.info("cache warmup %s: %d blocks (%d bytes) fetched, %d already local, %d skipped as deleted, "
                 "in %.1f s", self.stats.state, self.stats.blocks, self.stats.bytes, self.stats.already_local,
                 self.stats.skipped, self.stats.seconds)

    async def _run(self, fn: Callable[[], int]) -> int:
        """Run ``fn`` in one of the warmer's low-priority threads; the loop is woken when it
        is done (no second thread parked on the result)."""
        finished = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: object) -> None:
            with contextlib.suppress(trio.RunFinishedError):  # the daemon stopped meanwhile
                token.run_sync_soon(finished.set)

        future = self._threads.submit(fn)
        future.add_done_callback(wake)
        await finished.wait()
        return future.result()

    async def _one(self, key: str, size: int, limiter: trio.CapacityLimiter, token: object) -> None:
        try:
            info = self.meta.get_object(key)
            if info is None or info.refcount <= 0:
                # Its files were deleted after the list was made: nobody will read it.
                self.stats.skipped += 1
                return
            if await self.blocks.ensure_cached(key, self._run):
                self.stats.blocks += 1
                self.stats.bytes += size
            else:
                self.stats.already_local += 1
        except (OSError, RuntimeError) as exc:  # a background fetch must never stop the daemon
            self.stats.failures += 1
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                if not self._disk_full:
                    log.warning("cache disk full: cache warming stops here (%s)", exc)
                self._disk_full = True  # the cache disk is for the job's own writes now
            else:
                log.warning("warmup of block %s failed: %s", key[:16], exc)
        finally:
            limiter.release_on_behalf_of(token)
