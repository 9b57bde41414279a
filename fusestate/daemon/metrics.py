"""Prometheus metrics: gauges and counters read from the daemon at scrape time,
histograms observed where the work happens.

Reading the components' own counters at scrape time keeps the hot paths free of
metric updates; only latencies need observing as they occur. The counters and gauges
are the stats table of :mod:`fusestate.daemon.stats`, the same numbers ``status --json``
shows. Labels are bounded: cache tier, remote operation and outcome, FUSE operation, read
source, and the volume's directories that hold warm state.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Iterable, Optional

import trio
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fusestate.config import DEFAULT_METRICS_PORT, METRICS_PORTS, parse_metrics_addr
from fusestate.daemon.stats import COUNTER, STATS, Components
from fusestate.errors import UserError

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


def listen(addr: Optional[str], registry: CollectorRegistry) -> Optional[tuple[str, int]]:
    """Serve /metrics from a thread, before the mount: the address served, or None for 'off'.

    An address given with --metrics-addr must be free, or the mount fails saying so: a node
    whose metrics vanish goes unnoticed. Without one, see :func:`_listen_by_default`."""
    if addr == "off":
        return None
    if addr is None:
        return _listen_by_default(registry)
    try:
        bound = _serve(*parse_metrics_addr(addr), registry)
    except OSError as exc:
        raise UserError(f"--metrics-addr {addr} cannot be served: {exc.strerror or exc} (another fusestate "
                        "mount on this host?); give this mount another HOST:PORT, or --metrics-addr off") from None
    log.info("metrics on http://%s:%d/metrics", *bound)
    return bound


def _listen_by_default(registry: CollectorRegistry) -> tuple[str, int]:
    """127.0.0.1 on the first free port of the default range, so that the mounts of one
    node each have theirs, where a scrape configuration can list them; past the range, a
    port of the kernel's choosing (logged, and in `fusestate status`)."""
    ports = range(DEFAULT_METRICS_PORT, DEFAULT_METRICS_PORT + METRICS_PORTS)
    for port in ports:
        with contextlib.suppress(OSError):
            bound = _serve("127.0.0.1", port, registry)
            log.info("metrics on http://%s:%d/metrics%s", *bound,
                     " (the ports before it were taken: other fusestate mounts?)" if port != ports[0] else "")
            return bound
    try:
        bound = _serve("127.0.0.1", 0, registry)
    except OSError as exc:
        raise UserError(f"cannot serve metrics on 127.0.0.1: {exc.strerror or exc}; give --metrics-addr "
                        "HOST:PORT, or --metrics-addr off") from None
    log.warning("metrics on http://%s:%d/metrics, where no scrape configuration looks: ports %d-%d of 127.0.0.1 "
                "are all taken; give this mount a --metrics-addr of its own", *bound, ports[0], ports[-1])
    return bound


def _serve(host: str, port: int, registry: CollectorRegistry) -> tuple[str, int]:
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[:2]
    return bound[0], bound[1]


def serve_stats(source: Components, registry: CollectorRegistry) -> None:
    """From now on a scrape reads the daemon's numbers (on its trio loop)."""
    registry.register(StatsCollector(source, trio.lowlevel.current_trio_token()))
