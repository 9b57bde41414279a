"""Whether copying whole blocks from the bucket to this node pays, from what reads cost.

The block store fetches whole blocks (4 MiB by default) into its caches: for scans and
their readahead, and for blocks that point lookups keep coming back to, so later reads
are local. Each such fetch reads, hashes and writes the whole block. That pays when a
range read from the bucket costs many times one from local disk, as on S3 or GCS. It
does not when the bucket is a directory on a disk like the cache's own (a ``file://``
bucket): then a range read is as cheap as a cache read, and every whole block is disk
traffic and CPU on the node, taken from the reads it meant to speed up. So the store
times its small reads from both and asks this estimate.
"""

from __future__ import annotations

import collections
import logging
import statistics
from typing import Optional

log = logging.getLogger(__name__)

COST_RATIO = 4.0             # whole blocks pay when a bucket range read costs this many local ones
LOCAL_COST_FLOOR = 0.0005    # seconds: local reads faster than this count as this fast
MIN_BUCKET_SAMPLES = 16      # until then, fetch whole blocks (the safe choice for a remote bucket)
WINDOW = 64                  # recent reads whose median is the cost: one slow read moves nothing
RECHECK_EVERY = 8            # new samples between two workings-out of the verdict
QUICK_BUCKET_READ = 0.001    # seconds: a bucket whose small reads take less is read on the event loop


class ReadCosts:
    """Median service time of recent small reads (timed in their worker threads, so waiting
    for a thread does not count) from the bucket and from local disk.

    Worker threads append to the windows; a deque's append is atomic, and the median is
    taken over a copy. The verdict is asked on every cold read and readahead, and every
    cold read adds a sample, so it is worked out again only every few new samples (a
    count lost to a race only delays that by one)."""

    def __init__(self, mode: str = "auto", ratio: float = COST_RATIO, local_floor: float = LOCAL_COST_FLOOR,
                 min_bucket_samples: int = MIN_BUCKET_SAMPLES, window: int = WINDOW,
                 quick_bucket_read: float = QUICK_BUCKET_READ) -> None:
        self.mode = mode  # auto | always | never (--whole-blocks)
        self.ratio = ratio
        self.local_floor = local_floor
        self.min_bucket_samples = min_bucket_samples
        self.quick_bucket_read = quick_bucket_read
        self._bucket: collections.deque[float] = collections.deque(maxlen=window)
        self._local: collections.deque[float] = collections.deque(maxlen=window)
        self._samples = 0                      # appended so far, to both windows
        self._verdict_at = 0                   # ... when the verdict was last worked out
        self._verdict: Optional[bool] = None
        self._quick = False
        self._bucket_first = False

    def bucket(self, seconds: float) -> None:
        self._bucket.append(seconds)
        self._samples += 1

    def local(self, seconds: float) -> None:
        self._local.append(seconds)
        self._samples += 1

    @property
    def bucket_seconds(self) -> Optional[float]:
        return statistics.median(list(self._bucket)) if self._bucket else None

    @property
    def local_seconds(self) -> Optional[float]:
        return statistics.median(list(self._local)) if self._local else None

    def whole_blocks_pay(self) -> bool:
        """Whether cold reads should bring whole blocks to this node (else: range reads only)."""
        if self.mode != "auto":
            return self.mode == "always"
        if len(self._bucket) < self.min_bucket_samples:
            return True
        self._recheck()
        assert self._verdict is not None
        return self._verdict

    def bucket_timed(self) -> bool:
        """Whether enough small reads from the bucket are timed for a verdict."""
        return len(self._bucket) >= self.min_bucket_samples

    def bucket_is_quick(self) -> bool:
        """Whether a small read from the bucket (that is not in the page cache) is quick
        enough to make on the event loop itself, blocking it, rather than in a worker thread:
        a thread hop costs about as much as a read from a fast local disk. Only for a bucket
        whose reads are timed (``file://``), once enough of them are."""
        if len(self._bucket) < self.min_bucket_samples:
            return False
        self._recheck()
        return self._quick

    def bucket_beats_local(self) -> bool:
        """Whether a small read should go to the bucket even for a block in the disk cache:
        the bucket is quick (see ``bucket_is_quick``) and its small reads cost no more than
        the cache's, whose reads each take a worker thread and an SQLite transaction."""
        return self.bucket_is_quick() and self._bucket_first

    def _recheck(self) -> None:
        if self._verdict is None or self._samples - self._verdict_at >= RECHECK_EVERY:
            self._verdict_at = self._samples
            self._decide()

    def _decide(self) -> None:
        bucket = self.bucket_seconds or 0.0
        self._quick = bucket < self.quick_bucket_read
        self._bucket_first = self.local_seconds is not None and bucket <= self.local_seconds
        local = max(self.local_seconds or 0.0, self.local_floor)
        verdict = bucket >= self.ratio * local
        if verdict != self._verdict:
            log.info("a small read costs %.2f ms from the bucket against %.2f ms locally: %s",
                     bucket * 1e3, local * 1e3,
                     "cold reads fetch whole blocks" if verdict else "cold reads are range reads at any size")
        self._verdict = verdict

    def summary(self) -> dict[str, object]:
        """For ``fusestate status``: the two costs (ms) and what they decide."""
        def ms(seconds: Optional[float]) -> Optional[float]:
            return None if seconds is None else round(seconds * 1e3, 3)
        return {"bucket": ms(self.bucket_seconds), "local": ms(self.local_seconds),
                "bucket_samples": len(self._bucket), "whole_blocks": self.whole_blocks_pay(),
                "on_event_loop": self.bucket_is_quick()}
