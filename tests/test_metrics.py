"""Metrics: the Prometheus endpoint against docs/metrics.md and `fusestate status --json`,
the numbers moving with a workload, `fusestate status` and `stats` on the command line,
and a real Prometheus server scraping a daemon."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import BIN, ROOT, Bucket, Mount, assert_one_line_error, free_port, fusestate, stop_process

MiB = 1 << 20
METRICS_DOC = ROOT / "docs" / "metrics.md"
# A port of the kernel's choosing; the daemon reports it as status()["metrics_addr"].
MOUNT_FLAGS = ["--metrics-addr", "127.0.0.1:0", "--upload-delay", "0", "--journal-interval", "0.5"]
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


# --- helpers -------------------------------------------------------------------------

def documented_metrics() -> dict[str, str]:
    """name -> type, from the first two columns of the table in docs/metrics.md."""
    found = {}
    for line in METRICS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"`fusestate_[a-z0-9_]+`", cells[0]):
            found[cells[0].strip("`")] = cells[1]
    assert len(found) >= 30, f"could not read the metric table of {METRICS_DOC}"
    return found


@dataclass
class Scrape:
    """One scrape of /metrics: families by exposed name, samples by (name, labels)."""

    families: dict[str, str]  # exposed name (counters with _total, histograms without suffix) -> type
    samples: dict[tuple[str, frozenset], float]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.samples)

    def label_values(self, name: str, label: str) -> set[str]:
        return {dict(ls)[label] for n, ls in self.samples if n == name and label in dict(ls)}


def parse_exposition(text: str) -> Scrape:
    families: dict[str, str] = {}
    samples: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("fusestate_"):
            continue
        # The parser drops a counter's _total from the family name; its samples keep it.
        exposed = family.name + "_total" if family.type == "counter" else family.name
        families[exposed] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return Scrape(families, samples)


def metrics_url(m: Mount) -> str:
    addr = m.status()["metrics_addr"]
    assert addr and not addr.endswith(":0"), addr
    return f"http://{addr}/metrics"


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers.get_content_type() == "text/plain"
        return parse_exposition(reply.read().decode())


def base_name(sample_name: str, families: dict[str, str]) -> str:
    """A sample's metric: a histogram's _bucket, _sum and _count belong to the histogram."""
    if sample_name in families:
        return sample_name
    for suffix in HISTOGRAM_SUFFIXES:
        base = sample_name[: -len(suffix)]
        if sample_name.endswith(suffix) and families.get(base) == "histogram":
            return base
    return sample_name


def drop_page_cache(path: Path) -> None:
    """Make the next read of ``path`` reach the daemon instead of the kernel's page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_through(path: Path) -> bytes:
    drop_page_cache(path)
    return path.read_bytes()


def write_file(path: Path, data: bytes) -> None:
    """Write and fsync: with the default durability, fsync returns once the blocks are uploaded."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def wait_quiet(m: Mount, timeout: float = 30) -> dict:
    """Everything written is in the bucket: nothing staged, dirty or pending in the journal."""
    def quiet() -> Optional[dict]:
        s = m.status()
        wb, meta = s["writeback"], s["metadata"]
        done = wb["staged_blocks"] == 0 and wb["dirty_bytes"] == 0 and meta["journal_pending"] == 0
        return s if done else None

    return wait_until(quiet, timeout, f"{m.path} to upload and ship everything")


def mount_with_metrics(make_mount, bucket: Bucket) -> tuple[Mount, str]:
    m: Mount = make_mount(bucket, extra=MOUNT_FLAGS).mount()
    return m, metrics_url(m)


# --- 1. the endpoint and the documentation agree ---------------------------------------

# Metrics of a shared volume's mount only (--meta): its session in the database.
SHARED_ONLY = {"fusestate_session_lost", "fusestate_meta_connections", "fusestate_meta_connects_total",
               "fusestate_meta_timeline", "fusestate_meta_stalls_broken_total", "fusestate_lookup_cache_hits_total",
               "fusestate_lookup_cache_misses_total", "fusestate_lookup_cache_dropped_total",
               "fusestate_meta_changes_followed", "fusestate_meta_standby_wait_seconds",
               "fusestate_meta_standby_waits_failed_total"}


def test_every_documented_metric_is_exposed_and_nothing_else(make_mount, file_bucket: Bucket) -> None:
    documented = documented_metrics()
    m: Mount = make_mount(file_bucket, extra=MOUNT_FLAGS).mount()
    data = os.urandom(5 * MiB + 123)
    (m.path / "dir").mkdir()
    write_file(m.path / "dir" / "data", data)
    m.umount()  # a fresh daemon: the next read misses the memory cache
    m.mount()
    url = metrics_url(m)
    assert os.listdir(m.path / "dir") == ["data"]
    assert read_through(m.path / "dir" / "data") == data
    wait_quiet(m)

    s = scrape(url)
    exposed = {base_name(name, s.families) for name, _ in s.samples} | set(s.families)
    undocumented = sorted(exposed - set(documented))
    assert not undocumented, f"exposed but not in {METRICS_DOC.name}: {undocumented}"
    missing = sorted(name for name in documented if name not in s.families and name not in SHARED_ONLY)
    assert not missing, f"documented but not exposed: {missing}"
    for name, kind in documented.items():
        if name in SHARED_ONLY:
            continue  # test_a_shared_volume_serves_its_metrics
        assert s.families[name] == kind, f"{name} is a {s.families[name]}, documented as a {kind}"
        sample = name + "_count" if kind == "histogram" else name
        assert s.has(sample), f"{name} has no samples after a workload"
    # Labels stay bounded: the documented label values, no paths or inode numbers.
    assert s.label_values("fusestate_cache_hits_total", "tier") == {"memory", "disk"}
    assert s.label_values("fusestate_remote_requests_total", "outcome") == {"ok", "error"}
    assert s.label_values("fusestate_remote_requests_total", "op") <= {
        "get", "get_range", "put", "head", "delete", "list"}
    assert s.label_values("fusestate_block_read_seconds_count", "source") <= {"local", "remote", "range"}
    m.umount()


# --- 2. status --json and the metrics report the same numbers ----------------------------

# Numbers that move by themselves between a status call and a scrape.
VOLATILE = {"cache.cache_dir_free_bytes", "writeback.oldest_staged_seconds", "metadata.last_ship_age_seconds",
            "warmup.seconds"}
# Numbers of `status` that describe the mount rather than count anything: not metrics.
STATUS_ONLY = {"pid", "uptime_seconds", "block_size", "fuse.operations", "fuse.kernel_readahead"}


def leaves(doc: dict, prefix: str = "") -> dict[str, object]:
    """A nested status document as {dotted path: leaf}."""
    out: dict[str, object] = {}
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(leaves(value, path + "."))
        else:
            out[path] = value
    return out


def compared_numbers(st: dict) -> dict[str, float]:
    """The numbers `status --json` shares with the metrics, keyed by status path (a
    labelled family's samples by path and label values)."""
    from fusestate.daemon.stats import STATS

    flat = leaves(st)
    numbers: dict[str, float] = {}
    for stat in STATS:
        if stat.status in VOLATILE:
            continue
        if stat.by:
            numbers.update({k: v for k, v in flat.items() if k.startswith(stat.status + ".")})  # type: ignore[misc]
        elif stat.status in flat:
            numbers[stat.status] = flat[stat.status]  # type: ignore[assignment]
    return numbers


def metric_numbers(s: Scrape) -> dict[str, float]:
    """The same numbers read from a scrape, through the stats table's names and labels."""
    from fusestate.daemon.stats import STATS

    numbers: dict[str, float] = {}
    for stat in STATS:
        if stat.status in VOLATILE:
            continue
        if stat.by:
            for (name, labels), value in s.samples.items():
                if name == stat.metric:
                    numbers[".".join([stat.status, *(dict(labels)[k] for k in stat.by)])] = value
        elif s.has(stat.metric):
            numbers[stat.status] = s.value(stat.metric, **stat.labels)
    return numbers


def test_status_json_matches_the_metrics(make_mount, file_bucket: Bucket) -> None:
    m, _ = mount_with_metrics(make_mount, file_bucket)
    cold = os.urandom(6 * MiB + 4321)
    write_file(m.path / "cold", cold)
    m.umount()
    m.wipe_cache()
    m.mount()
    url = metrics_url(m)
    assert read_through(m.path / "cold") == cold  # from the bucket
    assert read_through(m.path / "cold") == cold  # from the memory cache
    new = os.urandom(3 * MiB + 99)
    write_file(m.path / "new", new)
    write_file(m.path / "again", new)  # the same bytes: stored once
    (m.path / "small").write_bytes(b"x" * 1000)
    wait_quiet(m)

    # Background work (lease heartbeats, journal ticks) can move a number between the two
    # reads: compare only when status is the same before and after the scrape.
    for _ in range(10):
        before = compared_numbers(m.status())
        scraped = scrape(url)
        after = compared_numbers(m.status())
        if before == after:
            break
    else:
        pytest.fail("the daemon never stood still for a status / scrape / status round")
    assert metric_numbers(scraped) == before
    # The workload is in the numbers being compared, not only zeros on both sides.
    assert before["writeback.uploaded_blocks"] >= 2 and before["writeback.uploaded_bytes"] >= 3 * MiB
    assert before["writeback.staged_blocks"] == 0 and before["writeback.dirty_bytes"] == 0
    assert before["cache.disk_misses"] >= 2 and before["cache.memory_hits"] >= 2
    assert before["remote.bytes_in"] >= len(cold) and before["remote.bytes_out"] >= 3 * MiB
    assert before["metadata.shipped_seq"] > 0 and before["lease.epoch"] >= 2 and before["lease.held"] == 1
    assert before["remote.requests.put.ok"] >= 3 and before["remote.full_fetches"] >= 2
    # The cold file's second block may be read ahead into memory before the kernel asks.
    assert before["cache.reads_from_bucket"] >= 1 and before["cache.reads_from_memory"] >= 2
    assert before["fuse.bytes_read"] >= 2 * len(cold) and before["fuse.bytes_written"] >= 3 * MiB
    assert before["writeback.deduplicated_blocks"] == 1 and before["writeback.deduplicated_bytes"] == len(new)
    assert before["files"] == 5  # the root and four files
    # Every number status reports is a metric too, except the few that describe the mount.
    numeric = {k for k, v in leaves(after).items() if isinstance(v, (int, float)) and not isinstance(v, bool)
               and not k.startswith("remote.small_read_ms.")}  # the read-cost estimate: a setting it derives
    assert numeric - set(before) - VOLATILE - STATUS_ONLY == set()
    m.umount()


# --- 3. a workload moves the metrics the way a user expects -----------------------------

def test_workload_moves_the_metrics(make_mount, file_bucket: Bucket) -> None:
    m: Mount = make_mount(file_bucket, extra=MOUNT_FLAGS).mount()
    old = os.urandom(5 * MiB + 11)
    # Closed, not fsynced: both blocks staged, and in the disk cache once the unmount uploads
    # them (an fsync puts a last block over 256 KiB from memory instead, and a file:// bucket
    # is not copied to the disk cache).
    (m.path / "old").write_bytes(old)
    m.umount()
    m.mount()  # a new daemon: "old" is in the disk cache, not in memory
    url = metrics_url(m)
    start = scrape(url)
    assert start.value("fusestate_lease_held") == 1
    assert start.value("fusestate_uploaded_bytes_total") == 0
    assert start.value("fusestate_cache_hits_total") == 0

    data = os.urandom(9 * MiB + 7)
    (m.path / "d").mkdir()
    write_file(m.path / "d" / "f", data)
    os.stat(m.path / "d" / "f")
    assert os.listdir(m.path / "d") == ["f"]
    wait_quiet(m)
    assert read_through(m.path / "old") == old
    first = scrape(url)
    assert read_through(m.path / "old") == old
    assert read_through(m.path / "d" / "f") == data
    second = scrape(url)

    def grew(name: str, **labels: str) -> float:
        return second.value(name, **labels) - start.value(name, **labels)

    def step(name: str, before: Scrape, after: Scrape, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    for op in ("lookup", "getattr", "mkdir", "create", "write", "fsync", "flush", "release", "open", "read",
               "opendir", "readdir"):
        assert grew("fusestate_fuse_operations_total", op=op) > 0, op
        assert grew("fusestate_fuse_operation_seconds_count", op=op) > 0, op
    # The first read of "old" came from the disk cache (two blocks, one of them perhaps by
    # readahead), the re-read from memory.
    assert step("fusestate_cache_hits_total", start, first, tier="disk") >= 2
    assert step("fusestate_cache_hit_bytes_total", start, first, tier="disk") >= len(old)
    assert step("fusestate_cache_misses_total", start, first, tier="memory") >= 1
    assert step("fusestate_cache_miss_bytes_total", start, first, tier="memory") >= len(old)
    assert step("fusestate_block_read_seconds_count", start, first, source="local") >= 1
    assert step("fusestate_cache_hits_total", first, second, tier="memory") >= 2 + 3
    assert step("fusestate_cache_hit_bytes_total", first, second, tier="memory") >= len(old) + len(data)
    assert grew("fusestate_remote_received_bytes_total") == 0  # nothing came from the bucket
    assert second.value("fusestate_cache_entries", tier="memory") >= 5
    assert second.value("fusestate_cache_bytes", tier="memory") >= len(old) + len(data)
    assert grew("fusestate_fuse_written_bytes_total") >= len(data)
    assert grew("fusestate_fuse_read_bytes_total") >= 2 * len(old) + len(data)
    # Writes reach the bucket.
    assert grew("fusestate_uploaded_bytes_total") >= len(data)
    assert grew("fusestate_uploaded_blocks_total") >= 3
    assert grew("fusestate_remote_sent_bytes_total") >= len(data)
    assert grew("fusestate_remote_requests_total", op="put", outcome="ok") >= 3
    assert grew("fusestate_remote_requests_total", outcome="error") == 0
    assert grew("fusestate_remote_request_seconds_count", op="put") >= 3
    assert second.value("fusestate_remote_request_seconds_sum") > 0
    assert second.value("fusestate_upload_failures_total") == 0
    assert second.value("fusestate_dirty_bytes") == 0 and second.value("fusestate_staged_blocks") == 0
    # Metadata reaches the bucket.
    assert second.value("fusestate_journal_segments_shipped_total") > 0
    assert second.value("fusestate_journal_entries_shipped_total") > 0
    assert second.value("fusestate_journal_shipped_seq") > start.value("fusestate_journal_shipped_seq")
    assert second.value("fusestate_lease_held") == 1
    assert second.value("fusestate_lease_epoch") > start.value("fusestate_lease_epoch") - 1 >= 1  # 2nd mount
    assert second.value("fusestate_files") == 4  # the root, old, d and f
    assert second.value("fusestate_used_bytes") >= len(old) + len(data)
    # Histograms: counts, a sum, and a +Inf bucket equal to the count.
    for name in ("fusestate_block_read_seconds", "fusestate_remote_request_seconds",
                 "fusestate_fuse_operation_seconds"):
        count = second.value(name + "_count")
        assert count > 0, name
        assert second.value(name + "_bucket", le="+Inf") == count, name
    m.umount()


# --- 4. the command line --------------------------------------------------------------------

STATS_ROWS = ["fuse ops/s", "read / written", "cache hit ratio", "uploaded", "bucket in / out", "dirty",
              "staged / queue", "journal pending", "backpressure"]


def test_status_of_a_path_that_is_not_a_mount(tmp_path: Path) -> None:
    for args in (["status"], ["status", "--json"], ["stats", "--count", "1"]):
        proc = fusestate(*args, str(tmp_path), check=False)
        assert proc.returncode != 0, proc
        assert proc.stdout == ""
        assert "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert lines == [f"fusestate: {tmp_path} is not a fusestate mount"], proc.stderr


def test_stats_prints_tables(make_mount, file_bucket: Bucket) -> None:
    m, _ = mount_with_metrics(make_mount, file_bucket)
    write_file(m.path / "f", os.urandom(MiB))
    proc = fusestate("stats", "--count", "2", "--interval", "0.5", str(m.path), timeout=60)
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert "\033" not in proc.stdout  # no screen clearing when not on a terminal
    header = f"fusestate {m.path}  ({file_bucket.url})"
    starts = [i for i, line in enumerate(lines) if line == header]
    assert len(starts) == 2, proc.stdout
    tables = [lines[starts[0] + 1:starts[1]], lines[starts[1] + 1:]]
    for table in tables:
        assert [re.split(r"\s{2,}", line, maxsplit=1)[0] for line in table] == STATS_ROWS, proc.stdout
        assert all(len(re.split(r"\s{2,}", line, maxsplit=1)) == 2 for line in table), proc.stdout
    # The human status output has its rows too.
    text = fusestate("status", str(m.path)).stdout
    assert [line.split("  ")[0] for line in text.splitlines()] == [
        "volume", "files / used", "memory cache", "disk cache", "dirty", "staged", "uploaded", "scratch", "remote",
        "metrics"]
    assert f"http://{m.status()['metrics_addr']}/metrics" in text
    m.umount()


# --- 5. a real Prometheus scrapes the daemon -----------------------------------------------

@dataclass
class Prometheus:
    url: str
    log: Path

    def query(self, expr: str) -> list[dict]:
        qs = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{qs}", timeout=5) as reply:
            doc = json.load(reply)
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def value(self, expr: str) -> Optional[float]:
        """The query's single value, or None while Prometheus has no sample."""
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def diagnosis(self) -> str:
        """The scrape targets' health and the end of the server's log, for a failure message."""
        with contextlib.suppress(OSError, ValueError), \
                urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=5) as reply:
            targets = [{k: t.get(k) for k in ("scrapeUrl", "health", "lastError")}
                       for t in json.load(reply)["data"]["activeTargets"]]
            return f"targets: {targets}\nlog: {self.log.read_text()[-2000:]}"
        return f"log: {self.log.read_text()[-2000:]}"


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[Callable[[str], Prometheus]]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not installed (Debian package prometheus)")
    procs: list[subprocess.Popen] = []

    def start(target: str) -> Prometheus:
        root = tmp_path / "prometheus"
        root.mkdir()
        config = root / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: fusestate\n    static_configs:\n"
            f"      - targets: ['{target}']\n")
        port = free_port()
        log = root / "prometheus.log"
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=root))
        server = Prometheus(f"http://127.0.0.1:{port}", log)

        def ready() -> bool:
            if procs[-1].poll() is not None:
                raise AssertionError(f"prometheus exited {procs[-1].returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as r:
                return r.status == 200
            return False

        wait_until(ready, 30, "prometheus to be ready")
        return server

    try:
        yield start
    finally:
        for proc in procs:
            stop_process(proc)


@pytest.mark.prometheus
def test_prometheus_scrapes_the_daemon(make_mount, file_bucket: Bucket, prometheus_server) -> None:
    m, url = mount_with_metrics(make_mount, file_bucket)
    prom = prometheus_server(urllib.parse.urlsplit(url).netloc)

    def scraped(expr: str, at_least: float) -> Callable[[], bool]:
        def check() -> bool:
            value = prom.value(expr)
            return value is not None and value >= at_least
        return check

    try:
        wait_until(scraped('up{job="fusestate"}', 1), 30, f"prometheus to scrape {url}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{prom.diagnosis()}") from None
    data = os.urandom(6 * MiB)
    write_file(m.path / "f", data)
    wait_quiet(m)
    assert read_through(m.path / "f") == data
    assert read_through(m.path / "f") == data
    now = scrape(url)
    hits = now.value("fusestate_cache_hits_total", tier="memory")
    writes = now.value("fusestate_fuse_operations_total", op="write")
    reads = now.value("fusestate_fuse_operations_total", op="read")
    assert hits >= 2 and writes > 0 and reads > 0

    expected = {
        "fusestate_uploaded_bytes_total": len(data),
        'fusestate_cache_hits_total{tier="memory"}': hits,
        'fusestate_fuse_operations_total{op="write"}': writes,
        'fusestate_fuse_operations_total{op="read"}': reads,
        "fusestate_journal_segments_shipped_total": 1,
        "fusestate_lease_held": 1,
    }
    deadline = time.monotonic() + 30
    seen: dict[str, Optional[float]] = {}
    while True:
        seen = {expr: prom.value(expr) for expr in expected}
        if all(seen[e] is not None and seen[e] >= v for e, v in expected.items()):
            break
        assert time.monotonic() < deadline, \
            f"prometheus has {seen}, expected at least {expected}\n{prom.diagnosis()}"
        time.sleep(0.5)
    # Prometheus saw the counter move, not only its final value.
    assert prom.value("increase(fusestate_uploaded_bytes_total[1m])") > 0
    m.umount()


def test_a_shared_volume_serves_its_metrics(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    """A shared volume ships no journal: its scrape has no journal metrics, and still answers
    (it failed with HTTP 500 when the collector asked for a journal that does not exist)."""
    m = make_mount(file_bucket, extra=["--meta", pg_url, "--metrics-addr", "127.0.0.1:0"]).mount()
    (m.path / "f").write_bytes(b"x" * 5000)
    got = scrape(metrics_url(m))
    assert got.value("fusestate_fuse_operations_total", op="create") >= 1
    assert not got.has("fusestate_journal_entries_pending")
    assert {name for name in SHARED_ONLY if got.has(name)} == SHARED_ONLY
    assert got.value("fusestate_session_lost") == 0  # a lost session: tests/test_shared.py
    assert 1 <= got.value("fusestate_meta_connections") <= 9 and got.value("fusestate_meta_timeline") == 1
    m.umount()


# --- 6. every mount of a node serves its metrics where a scrape finds it ----------------------

DEFAULT_PORTS = range(9567, 9577)  # docs/metrics.md: without --metrics-addr, the first free one

# Holds ports of 127.0.0.1 (listening, as a daemon would) until its stdin closes.
HOLD_PORTS = """
import socket, sys
held = []
for port in map(int, sys.argv[1:]):
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    held.append(s)
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def network() -> Iterator[list[str]]:
    """A network namespace of the test's own, its loopback up: the default metrics ports
    in it are free whatever other daemons on this machine hold. The command prefix that
    runs a program in it (the mounts stay in the machine's mount namespace)."""
    name = f"fst-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield ["nsenter", f"--net=/run/netns/{name}"]
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def mount_in(network: list[str], m: Mount, *more: str) -> subprocess.CompletedProcess:
    """``fusestate mount`` run in the network namespace: its daemon serves metrics there."""
    m.path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([*network, str(BIN / "fusestate"), *m.mount_args(*more)], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode == 0:
        m.pid = m.status()["pid"]
    return proc


def scrape_in(network: list[str], addr: str) -> Scrape:
    fetch = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
    out = subprocess.run([*network, sys.executable, "-c", fetch, f"http://{addr}/metrics"], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return parse_exposition(out)


def second_volume(tmp_path: Path) -> Bucket:
    path = tmp_path / "bucket-2"
    path.mkdir()
    return Bucket("file", f"file://{path}")


def test_two_mounts_on_one_node_each_serve_their_metrics(make_mount, file_bucket: Bucket, tmp_path: Path,
                                                          network: list[str]) -> None:
    """Without --metrics-addr the first mount of a node serves 127.0.0.1:9567 and the second
    the next port; each scrape is its own mount's, and `fusestate status` and the log say
    where."""
    a = make_mount(file_bucket, name="a", cache="cache-a")
    b = make_mount(second_volume(tmp_path), name="b", cache="cache-b")
    for m in (a, b):
        proc = mount_in(network, m)
        assert proc.returncode == 0, proc.stderr
    addrs = [m.status()["metrics_addr"] for m in (a, b)]
    assert addrs == [f"127.0.0.1:{DEFAULT_PORTS[0]}", f"127.0.0.1:{DEFAULT_PORTS[1]}"]
    (a.path / "f").write_bytes(b"x" * 5000)
    written = [scrape_in(network, addr).value("fusestate_fuse_written_bytes_total") for addr in addrs]
    assert written[0] >= 5000 and written[1] == 0  # each exporter is its own mount's
    for m, addr in zip((a, b), addrs):
        assert re.search(rf"^metrics +http://{re.escape(addr)}/metrics$", fusestate("status", str(m.path)).stdout, re.M)
        assert f"metrics on http://{addr}/metrics" in (m.cache_dir / "fusestate.log").read_text()
    assert "the ports before it were taken" in (b.cache_dir / "fusestate.log").read_text()


def test_a_taken_metrics_port_fails_a_mount_that_names_it(make_mount, file_bucket: Bucket, tmp_path: Path,
                                                          network: list[str]) -> None:
    """A --metrics-addr given and taken fails the mount with one line; with every port of
    the default range taken, a mount without --metrics-addr serves on a port of the
    kernel's choosing, says so in its log, and status shows it."""
    holder = subprocess.Popen([*network, sys.executable, "-c", HOLD_PORTS, *map(str, DEFAULT_PORTS)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"
        named = make_mount(file_bucket, name="named", cache="cache-named")
        addr = f"127.0.0.1:{DEFAULT_PORTS[0]}"
        assert_one_line_error(mount_in(network, named, "--metrics-addr", addr),
                              f"--metrics-addr {addr}", "Address already in use", "--metrics-addr off")
        assert not os.path.ismount(named.path)
        assert_one_line_error(mount_in(network, named, "--metrics-addr", "nowhere"), "bad --metrics-addr 'nowhere'")

        m = make_mount(second_volume(tmp_path), name="past-the-range", cache="cache-past")
        proc = mount_in(network, m)
        assert proc.returncode == 0, proc.stderr
        served = m.status()["metrics_addr"]
        assert served.startswith("127.0.0.1:") and int(served.rsplit(":", 1)[1]) not in DEFAULT_PORTS
        assert scrape_in(network, served).has("fusestate_files")
        log = (m.cache_dir / "fusestate.log").read_text()
        assert f"metrics on http://{served}/metrics, where no scrape configuration looks" in log
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
