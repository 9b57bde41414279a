"""One writer per volume: a lease with an epoch, kept in the bucket.

Each read-write mount creates ``lease/<epoch>.json`` for a new epoch with a
create-only write (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, an
exclusive link on file://), so two nodes can never own the same epoch. The
holder renews its own file by heartbeat. A mount is refused while another
holder's lease is fresh, unless ``--takeover`` says that holder is gone.
A holder that finds a newer epoch has been fenced off and stops writing.

Each lease also records ``starts_after``: the journal sequence the new epoch
continued from. Journal segments of an older epoch past that point were
written late by a fenced holder; restore ignores them.

Fencing without a request per fsync. A holder acknowledges a journal segment only
if no newer epoch existed when it was in the bucket: it asks (one request) after
the segment's upload, unless a check sent less than ``FENCE_GRACE`` seconds
before the upload finished found none. That is safe because a new holder writes
its lease first (``starts_after`` still unknown), waits ``TAKEOVER_WAIT`` (more
than the grace), and only then reads the journal to restore: a segment the old
holder acknowledged without asking was in the bucket before that read, so the new
epoch continues after it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional

from fusestate.errors import UserError
from fusestate.remote.store import RemoteStore

log = logging.getLogger(__name__)

LEASE_PREFIX = "lease/"
DEFAULT_TTL = 30.0
FENCE_GRACE = 1.5    # seconds a fence check that found no newer epoch vouches for
TAKEOVER_WAIT = 3.0  # a new holder's wait between its lease and reading the journal


class LeaseLost(Exception):
    """A newer epoch exists: another holder took the volume over."""


@dataclass
class LeaseRecord:
    epoch: int
    holder: str
    host: str
    pid: int
    starts_after: Optional[int]  # None while the new holder restores (it has written nothing yet)
    expires_at: float

    @property
    def key(self) -> str:
        return lease_key(self.epoch)

    def describe(self) -> str:
        return f"{self.holder} (host {self.host}, pid {self.pid}, epoch {self.epoch})"

    def encode(self) -> bytes:
        return json.dumps(asdict(self), indent=2).encode()


def lease_key(epoch: int) -> str:
    return f"{LEASE_PREFIX}{epoch:08d}.json"


def read_leases(remote: RemoteStore) -> list[LeaseRecord]:
    """Every lease ever taken on the volume, oldest epoch first."""
    records = []
    for key in remote.list(LEASE_PREFIX):
        if not key.endswith(".json"):
            continue
        try:
            records.append(LeaseRecord(**json.loads(remote.get(key))))
        except (ValueError, TypeError, FileNotFoundError) as exc:
            log.warning("ignoring unreadable lease %s: %s", key, exc)
    return sorted(records, key=lambda r: r.epoch)


def epoch_starts(records: list[LeaseRecord]) -> dict[int, int]:
    """Where each epoch continued the journal; an epoch still restoring has written nothing."""
    return {r.epoch: r.starts_after for r in records if r.starts_after is not None}


class Lease:
    def __init__(self, remote: RemoteStore, holder: str, ttl: float = DEFAULT_TTL) -> None:
        self.remote = remote
        self.holder = holder
        self.ttl = ttl
        self.record: Optional[LeaseRecord] = None
        self.lost = False
        self.released = False
        # Monotonic send time of the newest check that found no newer epoch (see FENCE_GRACE).
        self.clear_since = float("-inf")
        # Renewals run in worker threads while the unmount releases the lease: one at a
        # time, and none after the release (a late renewal would hold the volume for a TTL).
        self._lock = threading.Lock()

    @staticmethod
    def make_holder_id() -> str:
        return f"{socket.gethostname()}:{os.urandom(4).hex()}"

    def current(self) -> Optional[LeaseRecord]:
        leases = read_leases(self.remote)
        return leases[-1] if leases else None

    def acquire(self, starts_after: Optional[int], takeover: bool, previous: Optional[LeaseRecord]) -> LeaseRecord:
        """Take a new epoch; refuse while another holder's lease is fresh. ``starts_after``
        None: the journal is read after this (``settle`` records where it continues)."""
        now = time.time()
        if previous is not None and previous.holder != self.holder and previous.expires_at > now and not takeover:
            raise UserError(
                f"volume is held by {previous.describe()}; its lease expires in "
                f"{previous.expires_at - now:.0f} s. Use --takeover if that holder is gone, "
                "or --read-only to mount it read-only"
            )
        epoch = (previous.epoch if previous else 0) + 1
        record = LeaseRecord(epoch=epoch, holder=self.holder, host=socket.gethostname(), pid=os.getpid(),
                             starts_after=starts_after, expires_at=now + self.ttl)
        if not self.remote.put_if_absent(record.key, record.encode()):
            raise UserError("another node took the volume at the same moment; try again")
        if previous is not None and previous.holder != self.holder and previous.expires_at > now:
            log.warning("took the volume over from %s (new epoch %d)", previous.describe(), epoch)
        self.record = record
        return record

    def settle(self, starts_after: int) -> None:
        """Record where this epoch continues the journal, once restored."""
        assert self.record is not None
        with self._lock:
            self.record.starts_after = starts_after
            self.remote.put(self.record.key, self.record.encode())

    @staticmethod
    def may_still_write(previous: Optional[LeaseRecord]) -> bool:
        """Whether the previous holder may still be shipping: it did not let go cleanly, or
        it never restored (then the one before it may still be)."""
        return previous is not None and (previous.expires_at > 0 or previous.starts_after is None)

    def renew(self) -> None:
        """Heartbeat: extend our lease, or find out we were fenced off."""
        assert self.record is not None
        with self._lock:
            if self.released:
                return
            sent = time.monotonic()
            newest = self.current()
            if newest is not None and newest.epoch > self.record.epoch:
                self.lost = True
                raise LeaseLost(f"the volume was taken over by {newest.describe()}")
            self.clear_since = max(self.clear_since, sent)
            self.record.expires_at = time.time() + self.ttl
            self.remote.put(self.record.key, self.record.encode())

    def superseded(self) -> bool:
        """True once a newer epoch exists (one request): checked before acknowledging an fsync."""
        assert self.record is not None
        if self.lost:
            return True
        sent = time.monotonic()
        if self.remote.object_exists(lease_key(self.record.epoch + 1)):
            self.lost = True
        else:
            self.clear_since = max(self.clear_since, sent)
        return self.lost

    def vouches_for(self, landed_at: float) -> bool:
        """Whether a write that was in the bucket at monotonic time ``landed_at`` can be
        acknowledged without another check (see FENCE_GRACE)."""
        return not self.lost and landed_at - self.clear_since < FENCE_GRACE

    def release(self) -> None:
        """Let the next mount in at once (clean unmount)."""
        with self._lock:
            if self.record is None or self.lost or self.released:
                return
            self.released = True
            newest = self.current()
            if newest is not None and newest.epoch > self.record.epoch:
                return
            self.record.expires_at = 0.0
            self.remote.put(self.record.key, self.record.encode())
