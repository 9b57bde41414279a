"""Prometheus metrics: gauges and counters read from the daemon at scrape time,
histograms observed where the work happens.

Reading the components' own counters at scrape time keeps the hot paths free of
metric updates; only latencies need observing as they occur. Labels are bounded:
cache tier, remote operation and outcome, FUSE operation, read source.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Optional

import trio
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from fusestate.daemon.mount import Daemon

log = logging.getLogger(__name__)

disable_created_metrics()  # no *_created series: every exported name is documented

LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histograms:
    """The latency histograms, with a cheap per-label observe function for each."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.block_read = Histogram("fusestate_block_read_seconds",
                                    "Time to read from a block, by where it came from",
                                    ["source"], registry=registry, buckets=LATENCY_BUCKETS)
        self.remote = Histogram("fusestate_remote_request_seconds",
                                "Remote store request latency (each attempt), by operation",
                                ["op"], registry=registry, buckets=LATENCY_BUCKETS)
        self.fuse = Histogram("fusestate_fuse_operation_seconds",
                              "FUSE operation latency inside the daemon, by operation",
                              ["op"], registry=registry, buckets=LATENCY_BUCKETS)

    @staticmethod
    def observer(histogram: Histogram) -> Callable[[str, float], None]:
        children: dict[str, object] = {}
        lock = threading.Lock()

        def observe(label: str, seconds: float) -> None:
            child = children.get(label)
            if child is None:
                with lock:
                    child = children.setdefault(label, histogram.labels(label))
            child.observe(seconds)  # type: ignore[attr-defined]

        return observe


def _counter(name: str, doc: str, value: float, labels: Optional[dict[str, str]] = None) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels) if labels else None)
    family.add_metric(list(labels.values()) if labels else [], value)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class DaemonCollector(Collector):
    """Reads every counter and gauge from the running daemon when scraped."""

    def __init__(self, daemon: "Daemon", trio_token: trio.lowlevel.TrioToken) -> None:
        self.daemon = daemon
        self.trio_token = trio_token

    def collect(self) -> Iterable[Metric]:
        # Read the daemon's state on its own event loop, never concurrently with it.
        try:
            return trio.from_thread.run_sync(self._collect_all, trio_token=self.trio_token)
        except trio.RunFinishedError:
            return []

    def _collect_all(self) -> list[Metric]:
        return list(self._families())

    def _families(self) -> Iterable[Metric]:
        d = self.daemon
        yield from self._cache(d)
        yield from self._writeback(d)
        yield from self._remote(d)
        yield from self._metadata(d)
        yield from self._locality(d)
        yield from self._fuse(d)
        yield _gauge("fusestate_files", "Inodes in the volume", d.meta.stats().inodes)
        yield _gauge("fusestate_used_bytes", "Bytes of distinct blocks the volume references", d.meta.stats().used_bytes)
        yield _gauge("fusestate_cache_dir_free_bytes", "Free space on the cache dir's disk",
                     shutil.disk_usage(d.cfg.cache_dir).free)

    @staticmethod
    def _per_tier(name: str, doc: str, kind: type, values: dict[str, float]) -> Metric:
        family = kind(name, doc, labels=["tier"])
        for tier, value in values.items():
            family.add_metric([tier], value)
        return family

    def _cache(self, d: "Daemon") -> Iterable[Metric]:
        mem, disk = d.memory, d.disk
        tiers = {"memory": mem.stats, "disk": disk.stats}
        c, g = CounterMetricFamily, GaugeMetricFamily
        yield self._per_tier("fusestate_cache_hits_total", "Block cache hits", c,
                             {t: s.hits for t, s in tiers.items()})
        yield self._per_tier("fusestate_cache_misses_total", "Block cache misses", c,
                             {t: s.misses for t, s in tiers.items()})
        yield self._per_tier("fusestate_cache_hit_bytes_total", "Bytes served by cache hits", c,
                             {t: s.hit_bytes for t, s in tiers.items()})
        yield self._per_tier("fusestate_cache_miss_bytes_total", "Bytes loaded into the tier after a miss", c,
                             {t: s.miss_bytes for t, s in tiers.items()})
        yield self._per_tier("fusestate_cache_evictions_total", "Entries evicted to stay within the limit", c,
                             {t: s.evictions for t, s in tiers.items()})
        yield self._per_tier("fusestate_cache_corrupt_entries_total", "Entries that failed their hash check", c,
                             {t: s.corrupt for t, s in tiers.items()})
        yield self._per_tier("fusestate_cache_entries", "Blocks held", g, {"memory": len(mem), "disk": len(disk)})
        yield self._per_tier("fusestate_cache_bytes", "Bytes held", g, {"memory": mem.used, "disk": disk.used})
        yield self._per_tier("fusestate_cache_limit_bytes", "Size limit", g,
                             {"memory": mem.limit, "disk": disk.limit})

    def _writeback(self, d: "Daemon") -> Iterable[Metric]:
        up, st = d.uploader, d.uploader.stats
        yield _gauge("fusestate_dirty_bytes", "Data not yet in the bucket (memory and staging)", up.dirty_bytes())
        yield _gauge("fusestate_dirty_limit_bytes", "Bound on dirty data (--max-dirty)", up.max_dirty)
        yield _gauge("fusestate_staged_blocks", "Sealed blocks waiting in staging", up.staged_blocks)
        yield _gauge("fusestate_staged_bytes", "Bytes waiting in staging", up.staged_bytes)
        yield _gauge("fusestate_staged_oldest_age_seconds", "Age of the oldest staged block", up.oldest_staged_age())
        yield _gauge("fusestate_scratch_blocks", "Blocks of scratch files (--scratch), kept on the cache disk only",
                     d.blocks.scratch_blocks)
        yield _gauge("fusestate_scratch_bytes", "Bytes of scratch files (--scratch) on the cache disk",
                     d.blocks.scratch_bytes)
        yield _counter("fusestate_cache_disk_full_total", "Blocks refused with ENOSPC: the cache disk was full "
                       "and neither eviction nor uploads could make room", d.blocks.disk_full_failures)
        yield _gauge("fusestate_upload_queue_length", "Staged blocks not being uploaded yet", up.queue_length)
        yield _counter("fusestate_uploaded_blocks_total", "Blocks uploaded", st.uploaded_blocks)
        yield _counter("fusestate_uploaded_bytes_total", "Bytes uploaded in blocks", st.uploaded_bytes)
        yield _counter("fusestate_upload_dedup_skipped_total", "Uploads skipped: the block was in the bucket",
                       st.dedup_skipped)
        yield _counter("fusestate_deduplicated_blocks_total", "Sealed blocks the volume already had: "
                       "neither staged nor uploaded", d.blocks.deduplicated_blocks)
        yield _counter("fusestate_deduplicated_bytes_total", "Bytes of sealed blocks the volume already had",
                       d.blocks.deduplicated_bytes)
        yield _counter("fusestate_discarded_blocks_total", "Blocks freed before upload, never uploaded",
                       st.discarded_blocks)
        yield _counter("fusestate_upload_failures_total", "Uploads that failed their retry budget",
                       st.upload_failures)
        yield _counter("fusestate_backpressure_waits_total", "Writes that waited for uploads",
                       st.backpressure_waits)
        yield _counter("fusestate_backpressure_wait_seconds_total", "Time writers spent waiting for uploads",
                       st.backpressure_seconds)

    def _remote(self, d: "Daemon") -> Iterable[Metric]:
        rs = d.remote.stats
        family = CounterMetricFamily("fusestate_remote_requests_total", "Remote store requests (attempts)",
                                     labels=["op", "outcome"])
        requests, failures = dict(rs.requests), dict(rs.failures)  # atomic copies: threads update them
        for op, count in sorted(requests.items()):
            failed = failures.get(op, 0)
            family.add_metric([op, "ok"], count - failed)
            family.add_metric([op, "error"], failed)
        yield family
        yield _counter("fusestate_remote_retries_total", "Remote requests retried after an error", rs.retries)
        yield _counter("fusestate_remote_received_bytes_total", "Bytes read from the bucket", rs.bytes_in)
        yield _counter("fusestate_remote_sent_bytes_total", "Bytes written to the bucket", rs.bytes_out)
        ws = d.warmer.stats
        yield _counter("fusestate_warmup_fetched_bytes_total", "Bytes fetched by cache warming after the mount",
                       ws.bytes)
        yield _gauge("fusestate_warmup_running", "1 while cache warming after the mount runs",
                     1 if ws.state == "running" else 0)

    def _metadata(self, d: "Daemon") -> Iterable[Metric]:
        sh = d.shipper
        if sh is not None:  # a shared volume's metadata is in its database: no journal to ship
            yield from self._journal(d, sh)
        yield _counter("fusestate_gc_deleted_blocks_total", "Blocks deleted by garbage collection", d.gc_deleted)
        lease = d.lease
        yield _gauge("fusestate_lease_epoch", "Epoch of this mount's lease",
                     lease.record.epoch if lease and lease.record else 0)
        yield _gauge("fusestate_lease_held", "1 while this mount holds the volume's lease",
                     1 if lease and lease.record and not lease.lost else 0)

    def _journal(self, d: "Daemon", sh) -> Iterable[Metric]:
        read_only = d.cfg.read_only
        yield _gauge("fusestate_journal_entries_pending", "Journal entries not yet in the bucket",
                     0 if read_only else sh.pending_entries())
        yield _counter("fusestate_journal_entries_shipped_total", "Journal entries shipped (after compaction)",
                       sh.stats.entries_shipped)
        yield _counter("fusestate_journal_segments_shipped_total", "Journal segments shipped",
                       sh.stats.segments_shipped)
        yield _gauge("fusestate_journal_shipped_seq", "Last journal sequence in the bucket", sh.shipped_seq)
        age = sh.last_ship_age()
        yield _gauge("fusestate_journal_last_ship_age_seconds", "Seconds since the last journal shipment",
                     age if age is not None else time.time() - d.started_at)
        yield _counter("fusestate_journal_ship_failures_total", "Journal shipments that failed", sh.stats.failures)
        yield _counter("fusestate_snapshots_shipped_total", "Metadata snapshots shipped", sh.stats.snapshots_shipped)

    def _locality(self, d: "Daemon") -> Iterable[Metric]:
        found = d.last_locality
        warm_bytes = GaugeMetricFamily("fusestate_warm_bytes",
                                       "Bytes of a directory's files whose blocks this node holds", labels=["dir"])
        warm_files = GaugeMetricFamily("fusestate_warm_files",
                                       "Files of a directory with blocks this node holds", labels=["dir"])
        for wd in (found.dirs if found else []):
            if wd.warm_bytes:
                warm_bytes.add_metric([wd.path], wd.warm_bytes)
                warm_files.add_metric([wd.path], wd.warm_files)
        yield warm_bytes
        yield warm_files

    def _fuse(self, d: "Daemon") -> Iterable[Metric]:
        ops = d.ops
        family = CounterMetricFamily("fusestate_fuse_operations_total", "FUSE operations handled", labels=["op"])
        for op, count in sorted(ops.counters.items()):
            family.add_metric([op], count)
        yield family
        yield _counter("fusestate_fuse_read_bytes_total", "Bytes returned by FUSE reads", ops.bytes_read)
        yield _counter("fusestate_fuse_written_bytes_total", "Bytes accepted by FUSE writes", ops.bytes_written)


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host or "127.0.0.1", int(port)


def start_exporter(daemon: "Daemon", addr: str, registry: CollectorRegistry) -> Optional[tuple[str, int]]:
    """Serve /metrics from a thread; a busy port costs the metrics, never the mount."""
    registry.register(DaemonCollector(daemon, trio.lowlevel.current_trio_token()))
    host, port = parse_addr(addr)
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.warning("metrics exporter could not listen on %s: %s; running without metrics", addr, exc)
        return None
    bound = server.server_address[:2]
    log.info("metrics on http://%s:%d/metrics", bound[0], bound[1])
    return bound[0], bound[1]
