"""Rebuild a volume's metadata from the bucket: the newest valid snapshot plus the journal after it.

Only metadata moves; blocks stay in the bucket until something reads them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

from fusestate.blocks.keys import object_name
from fusestate.meta.embedded import journal
from fusestate.meta.embedded.engine import SQLiteEngine
from fusestate.remote.store import RemoteStore

log = logging.getLogger(__name__)

FETCH_PARALLEL = 16  # segments fetched at once


@dataclass(frozen=True)
class RestoreResult:
    seq: int                  # last journal sequence applied
    snapshot: Optional[str]
    segments: int
    bytes_fetched: int


RestorePointCheck = Callable[[sqlite3.Connection, int], None]


def restore_metadata(remote: RemoteStore, path: str, epochs: dict[int, int],
                     check_each: Optional[RestorePointCheck] = None) -> RestoreResult:
    """Write the volume's latest consistent metadata to ``path`` (replacing it).

    ``check_each(db, seq)`` is called at every restore point on the way (fsck).
    """
    for suffix in ("", "-wal", "-shm", ".restore", ".restore-wal", ".restore-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + suffix)
    keys = remote.list("meta/")
    history = journal.History(epochs)
    base, chain = history.restore_plan(journal.parse_snapshots(keys), journal.parse_segments(keys))
    tmp = path + ".restore"
    fetched = 0
    if base is not None:
        data = remote.get(base.key)
        fetched += len(data)
        with open(tmp, "wb") as f:
            f.write(data)
    SQLiteEngine(tmp).close()  # creates the schema (and the root) if there was no snapshot
    seq = base.seq if base else 0
    segments = _fetch_segments(remote, chain)
    fetched += sum(size for size, _, _ in segments)
    applied = _landed_whole(remote, chain, [header for _, header, _ in segments])
    db = sqlite3.connect(tmp, isolation_level=None)
    try:
        db.execute("BEGIN")
        if check_each is not None:
            check_each(db, seq)
        for seg, (_, _, changes) in zip(chain[:applied], segments):
            journal.apply_changes(db, changes)
            seq = seg.last
            if check_each is not None:
                check_each(db, seq)
        journal.recount_links(db)
        journal.rebuild_objects(db)
        db.execute("DELETE FROM journal")
        db.execute("DELETE FROM sqlite_sequence WHERE name='journal'")
        db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('journal', ?)", (seq,))
        for key, value in (("shipped_seq", seq), ("snapshot_seq", base.seq if base else 0),
                           ("oldest_snapshot_seq", base.seq if base else 0)):
            db.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?, ?)", (key, str(value)))
        db.execute("COMMIT")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.replace(tmp + suffix, path + suffix)
    os.replace(tmp, path)
    log.info("restored metadata: snapshot %s + %d journal segments up to seq %d (%d bytes)",
             base.key if base else None, applied, seq, fetched)
    return RestoreResult(seq, base.key if base else None, applied, fetched)


def _fetch_segments(remote: RemoteStore, chain: list[journal.Segment]
                    ) -> list[tuple[int, journal.SegmentHeader, list[journal.Change]]]:
    """Every segment of the chain, fetched in parallel (each is a round trip to the bucket)."""
    def fetch(seg: journal.Segment) -> tuple[int, journal.SegmentHeader, list[journal.Change]]:
        data = remote.get(seg.key)
        return (len(data), *journal.decode_segment_with_header(data))

    with ThreadPoolExecutor(max_workers=FETCH_PARALLEL) as pool:
        return list(pool.map(fetch, chain))


def _landed_whole(remote: RemoteStore, chain: list[journal.Segment], headers: list[journal.SegmentHeader]) -> int:
    """How many segments of the chain to apply: up to the first one whose writer died before
    the blocks uploaded alongside it landed (only segments after the newest acknowledgement
    any of them records can be such). Their blocks are asked for all at once."""
    acked = max((header.acked_through for header in headers), default=0)
    unsure = [(i, key) for i, (seg, header) in enumerate(zip(chain, headers)) if seg.last > acked
              for key in header.unconfirmed]
    if not unsure:  # the usual case: the last segment was acknowledged
        return len(chain)
    with ThreadPoolExecutor(max_workers=FETCH_PARALLEL) as pool:
        landed = list(pool.map(lambda item: remote.object_exists(object_name(item[1])), unsure))
    missing = sorted(i for (i, _), there in zip(unsure, landed) if not there)
    if missing:
        first = missing[0]
        log.warning("journal segment %d of %d references %d blocks that never reached the bucket "
                    "(its writer died before acknowledging it): restoring up to the one before",
                    first + 1, len(chain), missing.count(first))
        return first
    return len(chain)
