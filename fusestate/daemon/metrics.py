"""Prometheus metrics: gauges and counters read from the daemon at scrape time,
histograms observed where the work happens.

Reading the components' own counters at scrape time keeps the hot paths free of
metric updates; only latencies need observing as they occur. The counters and gauges
are the stats table of :mod:`fusestate.daemon.stats`, the same numbers ``status --json``
shows. Labels are bounded: cache tier, remote operation and outcome, FUSE operation, read
source, and the volume's directories that hold warm state.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, Optional

import trio
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fusestate.daemon.stats import COUNTER, STATS, Components

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


class StatsCollector(Collector):
    """Every counter and gauge of the stats table, read from the daemon when scraped."""

    def __init__(self, source: Components, trio_token: trio.lowlevel.TrioToken) -> None:
        self.source = source
        self.trio_token = trio_token

    def collect(self) -> Iterable[Metric]:
        # Read the daemon's state on its own event loop, never concurrently with it.
        try:
            return trio.from_thread.run_sync(self._families, trio_token=self.trio_token)
        except trio.RunFinishedError:
            return []

    def _families(self) -> list[Metric]:
        return families(self.source)


def families(source: Components) -> list[Metric]:
    """The stats table as metric families, one per name, samples in table order."""
    found: dict[str, Metric] = {}
    for stat in STATS:
        if not stat.applies(source):
            continue  # no family at all: a shared volume has no journal to report on
        family = found.get(stat.metric)
        if family is None:
            kind = CounterMetricFamily if stat.kind == COUNTER else GaugeMetricFamily
            family = found[stat.metric] = kind(stat.metric, stat.doc, labels=list(stat.by or stat.labels))
        value = stat.read(source)
        if stat.by:
            for labels, number in value.items():
                family.add_metric(list(labels) if isinstance(labels, tuple) else [labels], number)
        else:
            family.add_metric(list(stat.labels.values()), value)
    return list(found.values())


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host or "127.0.0.1", int(port)


def start_exporter(source: Components, addr: str, registry: CollectorRegistry) -> Optional[tuple[str, int]]:
    """Serve /metrics from a thread; a busy port costs the metrics, never the mount."""
    registry.register(StatsCollector(source, trio.lowlevel.current_trio_token()))
    host, port = parse_addr(addr)
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.warning("metrics exporter could not listen on %s: %s; running without metrics", addr, exc)
        return None
    bound = server.server_address[:2]
    log.info("metrics on http://%s:%d/metrics", bound[0], bound[1])
    return bound[0], bound[1]
