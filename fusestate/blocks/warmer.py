"""Background cache warming after a mount: the blocks a restarted job is about to read.

A fresh node has an empty cache, and a restarted RocksDB reads much of its state soon after
it opens it (point lookups spread over every file, eviction scans, resumed compactions).
Fetching whole blocks in the background, in parallel, while the job is still starting, is
several times faster than fetching them one request at a time later. The mount is ready
before any of this: warming never delays it. A small read of a block being warmed takes
its range from the bucket instead of waiting for the 4 MiB; a larger read waits for that
one fetch. The fetching, hashing and writing run in low-priority threads of the warmer's
own (see background), so the restarting job's JVM gets the cores and the disk first.

Order: files modified most recently first (the live state), each file's blocks in order.
``recent`` stops at half the disk cache, so a volume much larger than the cache is not
churned through it; ``all`` stops at 90% of it.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass

import trio

from fusestate.blocks.background import BackgroundThreads
from fusestate.blocks.store import BlockStore
from fusestate.blocks.ledger import BlockLedger

log = logging.getLogger(__name__)


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
    def __init__(self, blocks: BlockStore, meta: BlockLedger, *, mode: str, disk_cache_bytes: int,
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
        self._threads = BackgroundThreads(concurrency, "warmup")

    async def run(self) -> None:
        """Warm the newest files' blocks, in order, up to the budget."""
        started = time.monotonic()
        self.stats.state = "running"
        candidates = await self.meta.blocks_by_recency(self.budget)
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
            self._threads.close()
            self.stats.seconds = round(time.monotonic() - started, 3)
        self.stats.state = "stopped" if self._disk_full else "done"
        log.info("cache warmup %s: %d blocks (%d bytes) fetched, %d already local, %d skipped as deleted, "
                 "in %.1f s", self.stats.state, self.stats.blocks, self.stats.bytes, self.stats.already_local,
                 self.stats.skipped, self.stats.seconds)

    async def _one(self, key: str, size: int, limiter: trio.CapacityLimiter, token: object) -> None:
        try:
            info = await self.meta.object_info(key)
            if info is None or info.refcount <= 0:
                # Its files were deleted after the list was made: nobody will read it.
                self.stats.skipped += 1
                return
            if await self.blocks.ensure_cached(key, self._threads.run):
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
