"""Every number a running daemon reports, defined once.

``fusestate status --json`` and the Prometheus metrics are two views of the table below
(:func:`status_numbers` and :mod:`fusestate.daemon.metrics`), so they cannot drift apart:
each entry names its place in the status document, its metric family, its type and help
text, and how to read it from the daemon's components. docs/metrics.md documents the
families; the tests check the document, the table and a live scrape against each other.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:
    from fusestate.blocks.caches import DiskCache, MemoryCache
    from fusestate.blocks.store import BlockStore
    from fusestate.blocks.uploader import Uploader
    from fusestate.blocks.warmer import CacheWarmer
    from fusestate.config import MountConfig
    from fusestate.daemon.lease import Lease
    from fusestate.daemon.locality import Locality
    from fusestate.fuse.adapter import FuseOperations
    from fusestate.meta.engine import MetaEngine
    from fusestate.meta.embedded.shipper import JournalShipper
    from fusestate.remote.store import RemoteStore

COUNTER = "counter"
GAUGE = "gauge"


class Components(Protocol):
    """What the table reads: the running daemon's parts (``Daemon`` has them all)."""

    cfg: "MountConfig"
    meta: "MetaEngine"
    memory: "MemoryCache"
    disk: "DiskCache"
    blocks: "BlockStore"
    uploader: "Uploader"
    warmer: "CacheWarmer"
    remote: "RemoteStore"
    ops: "FuseOperations"
    shipper: Optional["JournalShipper"]
    lease: Optional["Lease"]
    last_locality: Optional["Locality"]
    gc_deleted: int
    started_at: float
    restored_bytes: int
    open_files: int


@dataclass(frozen=True)
class Stat:
    """One number (or one labelled family read as a dict) in both views.

    ``status`` is its dotted path in ``status --json``. ``labels`` are the fixed labels of
    this one sample (the memory tier of a per-tier family); ``by`` names the labels of a
    family whose ``read`` returns ``{label value (a tuple for several labels): number}``,
    shown in the status document as a dict nested by label. ``when`` leaves the stat out of
    both views where it does not apply (no journal on a shared volume)."""

    status: str
    metric: str
    kind: str
    doc: str
    read: Callable[[Components], Any]
    labels: dict[str, str] = field(default_factory=dict)
    by: tuple[str, ...] = ()
    when: Optional[Callable[[Components], bool]] = None

    def applies(self, d: Components) -> bool:
        return self.when is None or self.when(d)


def _per_tier(key: str, metric: str, kind: str, doc: str, read: Callable[[Any], Any]) -> list[Stat]:
    """A cache family with a sample per tier: ``cache.memory_<key>`` and ``cache.disk_<key>``."""
    return [Stat(f"cache.{tier}_{key}", metric, kind, doc, (lambda d, t=tier: read(getattr(d, t))),
                 labels={"tier": tier}) for tier in ("memory", "disk")]


def _remote_requests(d: Components) -> dict[tuple[str, str], int]:
    requests, failures = dict(d.remote.stats.requests), dict(d.remote.stats.failures)  # atomic copies
    samples: dict[tuple[str, str], int] = {}
    for op, count in sorted(requests.items()):
        samples[(op, "ok")] = count - failures.get(op, 0)
        samples[(op, "error")] = failures.get(op, 0)
    return samples


def _warm_dirs(d: Components, what: str) -> dict[str, int]:
    found = d.last_locality
    return {wd.path: getattr(wd, what) for wd in (found.dirs if found else []) if wd.warm_bytes}


def _fill_stat(d: Components, attr: str) -> int:
    fill = d.ops.page_fill
    return getattr(fill.stats, attr) if fill is not None else 0


def _has_journal(d: Components) -> bool:
    return d.shipper is not None  # a shared volume's metadata is in its database


def _lease_held(d: Components) -> int:
    lease = d.lease
    return 1 if lease and lease.record and not lease.lost else 0


def _is_shared(d: Components) -> bool:
    return d.meta.shared  # a shared volume's mounts are sessions in its database


def _journal_age(d: Components) -> float:
    assert d.shipper is not None
    age = d.shipper.last_ship_age()
    return age if age is not None else time.time() - d.started_at


STATS: list[Stat] = [
    # --- the volume
    Stat("files", "fusestate_files", GAUGE, "Inodes in the volume", lambda d: d.meta.stats().inodes),
    Stat("used_bytes", "fusestate_used_bytes", GAUGE, "Bytes of distinct blocks the volume references",
         lambda d: d.meta.stats().used_bytes),
    Stat("open_files", "fusestate_open_files", GAUGE, "Files open through this mount", lambda d: d.open_files),
    # --- caches
    *_per_tier("hits", "fusestate_cache_hits_total", COUNTER, "Block cache hits", lambda c: c.stats.hits),
    *_per_tier("misses", "fusestate_cache_misses_total", COUNTER, "Block cache misses", lambda c: c.stats.misses),
    *_per_tier("hit_bytes", "fusestate_cache_hit_bytes_total", COUNTER, "Bytes served by cache hits",
               lambda c: c.stats.hit_bytes),
    *_per_tier("miss_bytes", "fusestate_cache_miss_bytes_total", COUNTER, "Bytes loaded into the tier after a miss",
               lambda c: c.stats.miss_bytes),
    *_per_tier("evictions", "fusestate_cache_evictions_total", COUNTER, "Entries evicted to stay within the limit",
               lambda c: c.stats.evictions),
    *_per_tier("corrupt", "fusestate_cache_corrupt_entries_total", COUNTER, "Entries that failed their hash check",
               lambda c: c.stats.corrupt),
    *_per_tier("entries", "fusestate_cache_entries", GAUGE, "Blocks held", len),
    *_per_tier("bytes", "fusestate_cache_bytes", GAUGE, "Bytes held", lambda c: c.used),
    *_per_tier("limit", "fusestate_cache_limit_bytes", GAUGE, "Size limit", lambda c: c.limit),
    *[Stat(f"cache.reads_from_{source}", "fusestate_block_reads_total", COUNTER,
           "Block reads of the file system by where they were served from (readahead and warming not counted)",
           (lambda d, s=source: getattr(d.blocks.stats, f"reads_from_{s}")), labels={"source": source})
      for source in ("memory", "disk", "bucket")],
    Stat("cache.scratch_files", "fusestate_scratch_files", GAUGE,
         "Scratch files (--scratch) of this mount, kept on the cache disk only", lambda d: d.fs.scratch.files),
    Stat("cache.scratch_bytes", "fusestate_scratch_bytes", GAUGE, "Bytes of scratch files (--scratch) on the cache disk",
         lambda d: d.fs.scratch.bytes),
    Stat("cache.promoted_files", "fusestate_promoted_files_total", COUNTER,
         "Scratch files linked into the volume, which uploaded their bytes then", lambda d: d.fs.promoted_files),
    Stat("cache.promoted_bytes", "fusestate_promoted_bytes_total", COUNTER, "Bytes of the promoted scratch files",
         lambda d: d.fs.promoted_bytes),
    Stat("cache.stored_ahead_blocks", "fusestate_scratch_stored_ahead_blocks_total", COUNTER,
         "Blocks of scratch files (--store-ahead) stored while written, before a link into the volume",
         lambda d: d.fs.scratch_ahead.stored_blocks),
    Stat("cache.stored_ahead_used", "fusestate_scratch_stored_ahead_used_blocks_total", COUNTER,
         "Blocks stored ahead that a promotion found matching its file", lambda d: d.fs.scratch_ahead.used_blocks),
    Stat("cache.stored_ahead_abandoned", "fusestate_scratch_stored_ahead_abandoned_blocks_total", COUNTER,
         "Blocks stored ahead and let go: the file was deleted or written again, or the mount ended",
         lambda d: d.fs.scratch_ahead.abandoned_blocks),
    Stat("cache.unread_promotions", "fusestate_promotions_unread_total", COUNTER,
         "Promotions that read nothing: every block of the file stored ahead and checked since its last write",
         lambda d: d.fs.scratch_ahead.unread_promotions),
    Stat("cache.disk_full_failures", "fusestate_cache_disk_full_total", COUNTER,
         "Blocks refused with ENOSPC: the cache disk was full and neither eviction nor uploads could make room",
         lambda d: d.blocks.disk_full_failures + d.fs.scratch.disk_full_failures),
    Stat("cache.cache_dir_free_bytes", "fusestate_cache_dir_free_bytes", GAUGE, "Free space on the cache dir's disk",
         lambda d: shutil.disk_usage(d.cfg.cache_dir).free),
    # --- write-back
    Stat("writeback.dirty_bytes", "fusestate_dirty_bytes", GAUGE, "Data not yet in the bucket (memory and staging)",
         lambda d: d.uploader.dirty_bytes()),
    Stat("writeback.max_dirty", "fusestate_dirty_limit_bytes", GAUGE, "Bound on dirty data (--max-dirty)",
         lambda d: d.uploader.max_dirty),
    Stat("writeback.staged_blocks", "fusestate_staged_blocks", GAUGE, "Sealed blocks waiting in staging",
         lambda d: d.uploader.staged_blocks),
    Stat("writeback.staged_bytes", "fusestate_staged_bytes", GAUGE, "Bytes waiting in staging",
         lambda d: d.uploader.staged_bytes),
    Stat("writeback.oldest_staged_seconds", "fusestate_staged_oldest_age_seconds", GAUGE,
         "Age of the oldest staged block", lambda d: round(d.uploader.oldest_staged_age(), 1)),
    Stat("writeback.upload_queue", "fusestate_upload_queue_length", GAUGE, "Staged blocks not being uploaded yet",
         lambda d: d.uploader.queue_length),
    Stat("writeback.uploaded_blocks", "fusestate_uploaded_blocks_total", COUNTER, "Blocks uploaded",
         lambda d: d.uploader.stats.uploaded_blocks),
    Stat("writeback.uploaded_bytes", "fusestate_uploaded_bytes_total", COUNTER, "Bytes uploaded in blocks",
         lambda d: d.uploader.stats.uploaded_bytes),
    Stat("writeback.dedup_skipped", "fusestate_upload_dedup_skipped_total", COUNTER,
         "Uploads skipped: the block was in the bucket", lambda d: d.uploader.stats.dedup_skipped),
    Stat("writeback.deduplicated_blocks", "fusestate_deduplicated_blocks_total", COUNTER,
         "Sealed blocks the volume already had: neither staged nor uploaded", lambda d: d.blocks.deduplicated_blocks),
    Stat("writeback.deduplicated_bytes", "fusestate_deduplicated_bytes_total", COUNTER,
         "Bytes of sealed blocks the volume already had", lambda d: d.blocks.deduplicated_bytes),
    Stat("writeback.put_again", "fusestate_blocks_put_again_total", COUNTER,
         "Blocks put in the bucket again: the collector deleted them while they were uploaded",
         lambda d: d.blocks.put_again_blocks),
    Stat("writeback.discarded_blocks", "fusestate_discarded_blocks_total", COUNTER,
         "Blocks freed before upload, never uploaded", lambda d: d.uploader.stats.discarded_blocks),
    Stat("writeback.upload_failures", "fusestate_upload_failures_total", COUNTER,
         "Uploads that failed their retry budget", lambda d: d.uploader.stats.upload_failures),
    Stat("writeback.backpressure_waits", "fusestate_backpressure_waits_total", COUNTER,
         "Writes that waited for uploads", lambda d: d.uploader.stats.backpressure_waits),
    Stat("writeback.backpressure_seconds", "fusestate_backpressure_wait_seconds_total", COUNTER,
         "Time writers spent waiting for uploads", lambda d: round(d.uploader.stats.backpressure_seconds, 3)),
    # --- the bucket
    Stat("remote.requests", "fusestate_remote_requests_total", COUNTER, "Remote store requests (attempts)",
         _remote_requests, by=("op", "outcome")),
    Stat("remote.retries", "fusestate_remote_retries_total", COUNTER, "Remote requests retried after an error",
         lambda d: d.remote.stats.retries),
    Stat("remote.bytes_in", "fusestate_remote_received_bytes_total", COUNTER, "Bytes read from the bucket",
         lambda d: d.remote.stats.bytes_in),
    Stat("remote.bytes_out", "fusestate_remote_sent_bytes_total", COUNTER, "Bytes written to the bucket",
         lambda d: d.remote.stats.bytes_out),
    *[Stat(f"remote.{key}", "fusestate_block_fetches_total", COUNTER,
           "Blocks or ranges of blocks fetched from the bucket: whole blocks and range reads for "
           "readers, prefetches ahead of them", (lambda d, a=attr: getattr(d.blocks.stats, a)), labels={"kind": kind})
      for key, kind, attr in (("full_fetches", "whole", "remote_full_fetches"),
                              ("range_reads", "range", "remote_range_reads"),
                              ("prefetches", "prefetch", "prefetches"))],
    # --- cache warming after the mount
    Stat("warmup.running", "fusestate_warmup_running", GAUGE, "1 while cache warming after the mount runs",
         lambda d: int(d.warmer.stats.state == "running")),
    Stat("warmup.budget_bytes", "fusestate_warmup_budget_bytes", GAUGE, "Bytes cache warming may fetch",
         lambda d: d.warmer.budget),
    Stat("warmup.fetched_bytes", "fusestate_warmup_fetched_bytes_total", COUNTER,
         "Bytes fetched by cache warming after the mount", lambda d: d.warmer.stats.bytes),
    *[Stat(f"warmup.{key}", "fusestate_warmup_blocks_total", COUNTER,
           "Blocks cache warming went through, by what it did with them",
           (lambda d, a=attr: getattr(d.warmer.stats, a)), labels={"outcome": outcome})
      for key, outcome, attr in (("fetched_blocks", "fetched", "blocks"),
                                 ("already_local_blocks", "already_local", "already_local"),
                                 ("skipped_deleted_blocks", "deleted", "skipped"),
                                 ("failures", "failed", "failures"))],
    Stat("warmup.seconds", "fusestate_warmup_seconds", GAUGE, "Time cache warming has taken",
         lambda d: d.warmer.stats.seconds),
    # --- files linked here, put into the kernel's page cache (--prefetch-links)
    Stat("page_fill.bytes", "fusestate_page_fill_bytes_total", COUNTER,
         "Bytes of files linked on this node handed to the kernel's page cache", lambda d: _fill_stat(d, "bytes")),
    *[Stat(f"page_fill.{key}", "fusestate_page_fill_files_total", COUNTER,
           "Files linked on this node whose blocks it did not hold, by what filling the page cache did with them",
           (lambda d, a=key: _fill_stat(d, a)), labels={"outcome": outcome})
      for key, outcome in (("files", "filled"), ("skipped", "skipped"), ("stopped", "stopped"),
                           ("failures", "failed"))],
    *[Stat(f"page_fill.{key}", "fusestate_page_fill_part_bytes_total", COUNTER,
           "Bytes handed to the page cache by part: what an open reads first (RocksDB tables' tails, other "
           "files whole), and tables' data blocks filled in the background",
           (lambda d, a=key: _fill_stat(d, a)), labels={"part": part})
      for key, part in (("first_bytes", "first"), ("body_bytes", "data_blocks"))],
    Stat("page_fill.tables", "fusestate_page_fill_tables_total", COUNTER,
         "RocksDB tables whose index, filters and footer were filled before their data blocks",
         lambda d: _fill_stat(d, "tables")),
    Stat("page_fill.tail_bytes", "fusestate_page_fill_tail_bytes_total", COUNTER,
         "Bytes of those tables' tails (index, filters, footer)", lambda d: _fill_stat(d, "tail_bytes")),
    Stat("page_fill.requested", "fusestate_page_fill_requested_files_total", COUNTER,
         "Files queued for the page cache by name before any link (a restart's latest snapshot)",
         lambda d: _fill_stat(d, "requested")),
    Stat("page_fill.requested_bytes", "fusestate_page_fill_requested_bytes_total", COUNTER,
         "Bytes of the files queued by name before any link", lambda d: _fill_stat(d, "requested_bytes")),
    Stat("page_fill.pending_bytes", "fusestate_page_fill_pending_bytes", GAUGE,
         "Bytes of linked files waiting to be put into the page cache, or being put",
         lambda d: d.ops.page_fill.pending_bytes if d.ops.page_fill else 0),
    Stat("page_fill.budget_bytes", "fusestate_page_fill_budget_bytes", GAUGE,
         "Bytes of files that may be queued for the page cache at once (--page-fill-budget)",
         lambda d: d.ops.page_fill.budget if d.ops.page_fill else 0),
    # --- metadata
    Stat("metadata.journal_pending", "fusestate_journal_entries_pending", GAUGE, "Journal entries not yet in the bucket",
         lambda d: 0 if d.cfg.read_only else d.shipper.pending_entries(), when=_has_journal),  # type: ignore[union-attr]
    Stat("metadata.entries_shipped", "fusestate_journal_entries_shipped_total", COUNTER,
         "Journal entries shipped (after compaction)", lambda d: d.shipper.stats.entries_shipped,  # type: ignore[union-attr]
         when=_has_journal),
    Stat("metadata.segments_shipped", "fusestate_journal_segments_shipped_total", COUNTER, "Journal segments shipped",
         lambda d: d.shipper.stats.segments_shipped, when=_has_journal),  # type: ignore[union-attr]
    Stat("metadata.shipped_seq", "fusestate_journal_shipped_seq", GAUGE, "Last journal sequence in the bucket",
         lambda d: d.shipper.shipped_seq, when=_has_journal),  # type: ignore[union-attr]
    Stat("metadata.last_ship_age_seconds", "fusestate_journal_last_ship_age_seconds", GAUGE,
         "Seconds since the last journal shipment", _journal_age, when=_has_journal),
    Stat("metadata.ship_failures", "fusestate_journal_ship_failures_total", COUNTER, "Journal shipments that failed",
         lambda d: d.shipper.stats.failures, when=_has_journal),  # type: ignore[union-attr]
    *[Stat(f"metadata.ship_{part}_seconds", "fusestate_journal_ship_seconds_total", COUNTER,
           "Time journal shipments spent, by part: waiting for the blocks a segment references, its upload, "
           "the fence check after it", (lambda d, a=attr: getattr(d.shipper.stats, a)),  # type: ignore[union-attr]
           labels={"part": part}, when=_has_journal)
      for part, attr in (("upload_wait", "upload_wait_seconds"), ("put", "put_seconds"),
                         ("fence", "fence_seconds"))],
    Stat("metadata.ship_blocks_waited", "fusestate_journal_ship_blocks_waited_total", COUNTER,
         "Blocks a journal shipment had to wait for (not yet in the bucket when it started)",
         lambda d: d.shipper.stats.blocks_waited, when=_has_journal),  # type: ignore[union-attr]
    Stat("metadata.snapshots_shipped", "fusestate_snapshots_shipped_total", COUNTER, "Metadata snapshots shipped",
         lambda d: d.shipper.stats.snapshots_shipped, when=_has_journal),  # type: ignore[union-attr]
    Stat("metadata.restored_bytes", "fusestate_metadata_restored_bytes", GAUGE,
         "Bytes of metadata fetched from the bucket to restore the volume at the mount", lambda d: d.restored_bytes),
    Stat("metadata.gc_deleted_blocks", "fusestate_gc_deleted_blocks_total", COUNTER,
         "Blocks deleted by garbage collection", lambda d: d.gc_deleted),
    Stat("lease.epoch", "fusestate_lease_epoch", GAUGE, "Epoch of this mount's lease",
         lambda d: d.lease.record.epoch if d.lease and d.lease.record else 0),
    Stat("lease.held", "fusestate_lease_held", GAUGE, "1 while this mount holds the volume's lease", _lease_held),
    Stat("session.lost", "fusestate_session_lost", GAUGE,
         "1 once the other nodes cleaned up this mount's session on the shared volume's database: it publishes "
         "nothing more until mounted again", lambda d: int(d.meta.lost), when=_is_shared),  # type: ignore[attr-defined]
    Stat("session.connections", "fusestate_meta_connections", GAUGE,
         "Connections this mount holds to the shared volume's database (--meta-connections at most, and one that "
         "listens for the other nodes' changes with --lookup-cache on)",
         lambda d: d.meta.open_connections, when=_is_shared),  # type: ignore[attr-defined]
    Stat("session.reconnects", "fusestate_meta_connects_total", COUNTER,
         "Connections made to the shared volume's database (the first ones, and again after a restart or failover)",
         lambda d: d.meta.pool.reconnects, when=_is_shared),  # type: ignore[attr-defined]
    Stat("session.lookup_cache_hits", "fusestate_lookup_cache_hits_total", COUNTER,
         "Lookups and attribute requests answered from this node's memory, without the database (--lookup-cache)",
         lambda d: d.meta.lookups.hits, when=_is_shared),  # type: ignore[attr-defined]
    Stat("session.lookup_cache_misses", "fusestate_lookup_cache_misses_total", COUNTER,
         "Lookups of names this node's memory did not hold, asked of the database",
         lambda d: d.meta.lookups.misses, when=_is_shared),  # type: ignore[attr-defined]
    Stat("session.lookup_cache_dropped", "fusestate_lookup_cache_dropped_total", COUNTER,
         "Names and inodes dropped from this node's memory because another node changed them",
         lambda d: d.meta.lookups.dropped_elsewhere, when=_is_shared),  # type: ignore[attr-defined]
    Stat("session.changes_followed", "fusestate_meta_changes_followed", GAUGE,
         "1 while this node receives the other nodes' changes from the database in time (the lookup cache "
         "answers), 0 while every lookup asks the database",
         lambda d: int(d.meta.changes is not None and d.meta.changes.fresh()), when=_is_shared),  # type: ignore[attr-defined]
    Stat("session.timeline", "fusestate_meta_timeline", GAUGE,
         "The database's timeline this mount writes to: it goes up by one at each failover to a standby",
         lambda d: d.meta.pool.timeline, when=_is_shared),  # type: ignore[attr-defined]
    Stat("session.stalls_broken", "fusestate_meta_stalls_broken_total", COUNTER,
         "Connections broken because their database server stopped answering (frozen or cut off)",
         lambda d: d.meta.pool.stalls_broken, when=_is_shared),  # type: ignore[attr-defined]
    Stat("session.standby_wait_seconds", "fusestate_meta_standby_wait_seconds", GAUGE,
         "How long the database server has held this node's durable commits (fsync) waiting for a synchronous "
         "standby to confirm them; 0 while none waits",
         lambda d: d.meta.pool.standby_wait_seconds, when=_is_shared),  # type: ignore[attr-defined]
    Stat("session.standby_waits_failed", "fusestate_meta_standby_waits_failed_total", COUNTER,
         "Durable commits (fsync) failed with EIO after waiting --meta-outage-budget for a synchronous standby",
         lambda d: d.meta.pool.standby_waits_failed, when=_is_shared),  # type: ignore[attr-defined]
    # --- where the volume's state is warm (refreshed every few minutes and by status --warm)
    Stat("locality.warm_bytes", "fusestate_warm_bytes", GAUGE, "Bytes of a directory's files whose blocks this node holds",
         lambda d: _warm_dirs(d, "warm_bytes"), by=("dir",)),
    Stat("locality.warm_files", "fusestate_warm_files", GAUGE, "Files of a directory with blocks this node holds",
         lambda d: _warm_dirs(d, "warm_files"), by=("dir",)),
    # --- FUSE
    Stat("fuse.operation_counts", "fusestate_fuse_operations_total", COUNTER, "FUSE operations handled",
         lambda d: dict(sorted(d.ops.counters.items())), by=("op",)),
    Stat("fuse.bytes_read", "fusestate_fuse_read_bytes_total", COUNTER, "Bytes returned by FUSE reads",
         lambda d: d.ops.bytes_read),
    Stat("fuse.bytes_written", "fusestate_fuse_written_bytes_total", COUNTER, "Bytes accepted by FUSE writes",
         lambda d: d.ops.bytes_written),
    # --- FUSE passthrough (the passthrough front end): bytes the kernel serves from local files
    Stat("passthrough.opens", "fusestate_passthrough_opens_total", COUNTER,
         "Opens answered with a backing file: the kernel serves their reads and writes itself",
         lambda d: d.fs.passthrough_stats.opens),
    Stat("passthrough.refused", "fusestate_passthrough_refused_total", COUNTER,
         "Backing files the kernel refused: those opens went through the daemon", lambda d: d.fs.passthrough_stats.refused),
    Stat("passthrough.open_files", "fusestate_passthrough_open_files", GAUGE,
         "Files open with a backing file now", lambda d: d.fs.passthrough_files()),
    Stat("passthrough.unsealed_bytes", "fusestate_passthrough_unsealed_bytes", GAUGE,
         "Bytes of files open for passthrough writing, not in blocks yet (an upper bound)",
         lambda d: d.fs.unsealed_passthrough_bytes()),
    Stat("passthrough.backing_bytes", "fusestate_passthrough_backing_bytes", GAUGE,
         "Bytes of volume files' backing files on the cache disk", lambda d: d.fs.backing.bytes),
    Stat("passthrough.retained_bytes", "fusestate_passthrough_retained_bytes", GAUGE,
         "Bytes of backing files kept after their file's last close, for its next reader",
         lambda d: d.fs.retained_bytes()),
    Stat("passthrough.retained_hits", "fusestate_passthrough_retained_hits_total", COUNTER,
         "Opens for reading served from a backing file a writer left", lambda d: d.fs.passthrough_stats.retained_hits),
    Stat("passthrough.seals", "fusestate_passthrough_seals_total", COUNTER,
         "Backing files sealed into blocks (at close, fsync, the last release)", lambda d: d.fs.passthrough_stats.seals),
    Stat("passthrough.sealed_ahead", "fusestate_passthrough_sealed_ahead_total", COUNTER,
         "Seals of a file's whole blocks while its passthrough writer was still writing it",
         lambda d: d.fs.passthrough_stats.sealed_ahead),
    Stat("passthrough.sealed_bytes", "fusestate_passthrough_sealed_bytes_total", COUNTER,
         "Bytes of the changed blocks those seals stored: what the kernel wrote without the daemon",
         lambda d: d.fs.passthrough_stats.sealed_bytes),
    Stat("passthrough.filled_bytes", "fusestate_passthrough_filled_bytes_total", COUNTER,
         "Bytes copied from blocks into backing files (a file with content opened for writing)",
         lambda d: d.fs.passthrough_stats.filled_bytes),
]


def status_numbers(d: Components) -> dict[str, Any]:
    """The table as the status document: sections of numbers, labelled families as nested dicts."""
    doc: dict[str, Any] = {}
    for stat in STATS:
        if not stat.applies(d):
            continue
        *sections, key = stat.status.split(".")
        place = doc
        for section in sections:
            place = place.setdefault(section, {})
        place[key] = _nested(stat.read(d)) if stat.by else stat.read(d)
    return doc


def _nested(samples: dict[Any, Any]) -> dict[str, Any]:
    """``{(op, outcome): n}`` as ``{op: {outcome: n}}``; one-label families stay flat."""
    out: dict[str, Any] = {}
    for labels, value in samples.items():
        if not isinstance(labels, tuple):
            out[labels] = value
            continue
        place = out
        for label in labels[:-1]:
            place = place.setdefault(label, {})
        place[labels[-1]] = value
    return out
