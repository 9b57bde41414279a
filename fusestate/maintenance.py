"""Volume checks and cleanup: ``fusestate fsck URL`` and ``fusestate gc URL``.

For a volume of the embedded engine both rebuild the metadata from the bucket in a
temporary directory, exactly as a fresh node would, and compare it with the blocks in the
bucket (offline: its one daemon collects garbage itself). For a shared volume both read
the database, and gc takes part in the collection protocol the daemons follow, so it
may run while every node has the volume mounted.
"""

from __future__ import annotations

import datetime
import logging
import os
import sqlite3
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from fusestate.blocks.keys import BLOCK_PREFIX, is_inline, key_matches, key_of_object, object_name
from fusestate.daemon import volume
from fusestate.daemon.lease import epoch_starts, read_leases
from fusestate.errors import UserError
import trio

from fusestate.meta import operations
from fusestate.meta.embedded import journal
from fusestate.meta.embedded.restore import restore_metadata
from fusestate.meta.embedded.engine import ReadOnlyTx
from fusestate.remote import RemoteStore, open_bucket

log = logging.getLogger(__name__)


@dataclass
class FsckReport:
    referenced: int = 0
    stored: int = 0
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    unreferenced: list[str] = field(default_factory=list)
    restore_points: int = 0
    broken_restore_points: list[int] = field(default_factory=list)
    seq: int = 0
    problems: list[str] = field(default_factory=list)   # inconsistencies in the metadata tables
    engine: str = "sqlite"

    @property
    def healthy(self) -> bool:
        return not (self.missing or self.corrupt or self.broken_restore_points or self.problems)


def open_volume(url: str, endpoint_url: Optional[str], meta_url: Optional[str]) -> tuple[RemoteStore, volume.VolumeInfo]:
    """The volume's bucket and record; refused in one line if ``meta_url`` names another
    engine than the volume's (none for the embedded one)."""
    if meta_url:
        from fusestate.meta.postgres.pool import check_connect  # psycopg: only shared volumes load it

        check_connect(meta_url)
    fs, location = open_bucket(url, endpoint_url)
    remote = RemoteStore(fs, location.root)
    return remote, volume.load_or_create(remote, None, create=False, meta_url=meta_url)


def _shared_engine(meta_url: str, info: volume.VolumeInfo, label: str) -> Any:
    from fusestate.meta.postgres.engine import PostgresEngine

    # Unprepared: a maintenance command runs few statements, and so works behind any pooler.
    return PostgresEngine(meta_url, info.block_size, mountpoint=label, pool_size=2, prepare=False)


def _referenced(db: sqlite3.Connection) -> set[str]:
    return {row[0] for row in db.execute("SELECT DISTINCT key FROM blocks")}


def stored_blocks(remote: RemoteStore) -> dict[str, float]:
    """Every block object in the bucket with its modification time (seconds since the epoch)."""
    base = remote.path(BLOCK_PREFIX).rstrip("/")
    try:
        found = remote.fs.find(base, detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    for path, info in found.items():
        name = path.rsplit("/", 1)[-1]
        if name.startswith(".tmp-"):
            continue
        out[key_of_object(name)] = _mtime(info)
    return out


def _mtime(info: dict[str, Any]) -> float:
    for field_name in ("mtime", "LastModified", "updated", "timeCreated", "created"):
        value = info.get(field_name)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, str):
            return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return 0.0


def fsck(url: str, endpoint_url: Optional[str] = None, verify: bool = True,
         all_restore_points: bool = False, meta_url: Optional[str] = None) -> FsckReport:
    remote, info = open_volume(url, endpoint_url, meta_url)
    stored = stored_blocks(remote)
    report = FsckReport(stored=len(stored), engine=info.meta)
    if meta_url:
        engine = _shared_engine(meta_url, info, "fusestate fsck")
        try:
            referenced = trio.run(engine.referenced)
            report.problems = trio.run(engine.check)
        finally:
            engine.close()
        _compare(remote, report, referenced, stored, verify)
        return report
    epochs = epoch_starts(read_leases(remote))

    def check_point(db: sqlite3.Connection, seq: int) -> None:
        report.restore_points += 1
        if any(key not in stored for key in _referenced(db)):
            report.broken_restore_points.append(seq)

    with tempfile.TemporaryDirectory(prefix="fusestate-fsck-") as tmp:
        path = os.path.join(tmp, "meta.db")
        result = restore_metadata(remote, path, epochs, check_point if all_restore_points else None)
        report.seq = result.seq
        db = sqlite3.connect(path)
        try:
            referenced = _referenced(db)
            report.problems = operations.consistency_problems(ReadOnlyTx(db))
        finally:
            db.close()
    _compare(remote, report, referenced, stored, verify)
    return report


def _compare(remote: RemoteStore, report: FsckReport, referenced: set[str], stored: dict[str, float],
             verify: bool) -> None:
    """Blocks the metadata references against those in the bucket; ``verify`` hashes them.
    Inline blocks live in the database, not the bucket: not compared."""
    referenced = {k for k in referenced if not is_inline(k)}
    report.referenced = len(referenced)
    report.missing = sorted(k for k in referenced if k not in stored)
    report.unreferenced = sorted(k for k in stored if k not in referenced)
    if verify:
        present = [k for k in referenced if k in stored]
        with ThreadPoolExecutor(max_workers=8) as pool:
            for key, ok in zip(present, pool.map(lambda k: key_matches(k, remote.get(object_name(k))), present)):
                if not ok:
                    report.corrupt.append(key)


@dataclass
class GcReport:
    deleted: list[str] = field(default_factory=list)
    kept_young: int = 0
    referenced: int = 0


def gc(url: str, endpoint_url: Optional[str] = None, grace: float = 3600.0,
       dry_run: bool = False, force: bool = False, meta_url: Optional[str] = None) -> GcReport:
    """Delete blocks that no restore point of the volume can reference, once older than ``grace``."""
    remote, info = open_volume(url, endpoint_url, meta_url)
    if meta_url:
        return _gc_shared(remote, _shared_engine(meta_url, info, "fusestate gc"), grace, dry_run)
    leases = read_leases(remote)
    if leases and leases[-1].expires_at > time.time() and not force:
        raise UserError(f"the volume is mounted by {leases[-1].describe()}; its daemon collects garbage "
                        "itself (use --force to run anyway)")
    epochs = epoch_starts(leases)
    keys = remote.list("meta/")
    referenced: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="fusestate-gc-") as tmp:
        # Every restore point counts: the current state, each kept snapshot, every journal segment.
        path = os.path.join(tmp, "meta.db")
        restore_metadata(remote, path, epochs, lambda db, seq: referenced.update(_referenced(db)))
        for snap in journal.parse_snapshots(keys):
            snap_path = os.path.join(tmp, "snap.db")
            with open(snap_path, "wb") as f:
                f.write(remote.get(snap.key))
            db = sqlite3.connect(snap_path)
            try:
                referenced |= _referenced(db)
            finally:
                db.close()
            os.unlink(snap_path)
        for seg in journal.parse_segments(keys):
            referenced |= {c.block_key() for c in journal.decode_segment(remote.get(seg.key)) if c.block_key()}
    report = GcReport(referenced=len(referenced))
    cutoff = time.time() - grace
    for key, mtime in stored_blocks(remote).items():
        if key in referenced:
            continue
        if mtime > cutoff:
            report.kept_young += 1
            continue
        report.deleted.append(key)
    if not dry_run:
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda k: remote.delete(object_name(k)), report.deleted))
    return report


def _gc_shared(remote: RemoteStore, engine: Any, grace: float, dry_run: bool) -> GcReport:
    """The daemons' collection, run once by hand: blocks unreferenced for longer than
    ``grace``, and blocks in the bucket the database does not know (an upload whose node
    died before it could record it), each claimed in the database before it is deleted,
    so an upload of the same bytes meanwhile waits rather than loses them."""
    report = GcReport()
    cutoff = time.time() - grace

    async def collect() -> None:
        await engine.start()
        referenced = await engine.referenced()
        report.referenced = len(referenced)
        stored = stored_blocks(remote)
        report.kept_young = sum(1 for k, mtime in stored.items() if mtime > cutoff and k not in referenced)
        old = [key for key, mtime in stored.items() if mtime <= cutoff]
        if dry_run:
            report.deleted = sorted(set(await engine.collectable_objects(cutoff, 0)) | set(await engine.unknown(old)))
            return
        claimed = await engine.claim_garbage(cutoff, 0) + await engine.sweep_unknown(old)
        with ThreadPoolExecutor(max_workers=8) as pool:
            in_bucket = [k for k in claimed if not is_inline(k)]  # inline blocks: their rows only
            await trio.to_thread.run_sync(lambda: list(pool.map(lambda k: remote.delete(object_name(k)), in_bucket)))
        await engine.garbage_deleted(claimed)
        report.deleted = sorted(claimed)

    try:
        trio.run(collect)
    finally:
        engine.close()
    return report
