"""A shared volume whose database is highly available: libpq multi-host URLs in every
command that takes --meta, and mounts that follow the primary through a failover."""

from __future__ import annotations

import errno
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import pytest

from conftest import Bucket, Mount, assert_one_line_error, fusestate, wait_for
from fusestate.harness.ha import LocalHA
from fusestate.harness.postgres import free_port


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def multi_host(pg_url: str) -> str:
    """``pg_url`` behind a first server that is down: libpq skips it."""
    user, rest = pg_url.split("://", 1)[1].split("@", 1)
    server, database = rest.split("/", 1)
    return (f"postgresql://{user}@127.0.0.1:{free_port()},{server}/{database}"
            "?target_session_attrs=read-write&connect_timeout=2")


def test_every_command_takes_a_multi_host_url(make_mount, file_bucket: Bucket, pg_url: str,
                                              postgres_server) -> None:
    """mount, status, fsck and gc with ``postgresql://h1:p1,h2:p2/db?target_session_attrs=read-write``
    (the first server down), and --meta-outage-budget; a volume made through one server
    is mounted through a list that names it."""
    url = multi_host(pg_url)
    opts = ["--meta", url, "--metrics-addr", "off", "--meta-outage-budget", "20"]
    a = make_mount(file_bucket, name="node-a", cache="cache-a", extra=opts).mount()
    write_synced(a.path / "f", b"x" * 100_000)
    assert fusestate("status", str(a.path)).returncode == 0
    a.umount()
    b = make_mount(file_bucket, name="node-b", cache="cache-b",
                   extra=["--meta", pg_url, "--metrics-addr", "off"]).mount()
    assert (b.path / "f").read_bytes() == b"x" * 100_000
    report = json.loads(fusestate("fsck", file_bucket.url, "--meta", url, "--json").stdout)
    assert report["healthy"] and report["referenced"] == 1, report
    assert report["engine"].startswith("postgresql://127.0.0.1:")
    assert "unreferenced" in fusestate("gc", file_bucket.url, "--meta", url, "--dry-run").stdout
    b.umount()
    other = multi_host(postgres_server.create_database("other" + os.urandom(4).hex()))
    refused = make_mount(file_bucket, name="node-c", cache="cache-c", extra=["--meta", other, "--metrics-addr", "off"])
    assert_one_line_error(refused.try_mount(), "keeps its metadata in postgresql://127.0.0.1:")
    bad = make_mount(file_bucket, name="node-d", cache="cache-d",
                     extra=["--meta", pg_url, "--meta-outage-budget", "0"])
    assert_one_line_error(bad.try_mount(), "--meta-outage-budget")


# --- a primary and a synchronous standby under Patroni --------------------------------------

@pytest.fixture
def ha(tmp_path: Path) -> Iterator[LocalHA]:
    """Patroni, a three-member etcd cluster and two PostgreSQL servers on loopback
    addresses. Ask for it before make_mount: it must outlive the mounts."""
    cluster = LocalHA()
    try:
        yield cluster
    finally:
        cluster.close()


@dataclass
class Writer:
    """A node writing files the way RocksDB and Spark commit them (write a temporary
    file, fsync, rename, fsync the directory) in a thread, until told to stop. A file
    is acknowledged once the directory's fsync returned."""

    root: Path
    name: str
    acked: dict[str, bytes] = field(default_factory=dict)
    ops: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each commit
    error: Optional[BaseException] = None
    step: str = ""
    lost_names: list[str] = field(default_factory=list)  # names no fsync vouched for: there or not
    failed_fsyncs: int = 0  # fsyncs that answered EIO across the failover
    stop: threading.Event = field(default_factory=threading.Event)
    thread: Optional[threading.Thread] = None

    def start(self) -> "Writer":
        (self.root / self.name).mkdir()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        directory = self.root / self.name
        n = 0
        try:
            while not self.stop.is_set():
                data = os.urandom(random.randint(1, 300_000))
                started = time.monotonic()
                self.step = f"write and fsync {n:05d}.tmp"
                try:
                    write_synced(directory / f"{n:05d}.tmp", data)
                except OSError as exc:
                    if exc.errno != errno.EIO:
                        raise
                    # The daemon's commits just before the failover may not have reached
                    # the new primary: fsync says so, and the file was not acknowledged.
                    self.failed_fsyncs += 1
                    n += 1
                    continue
                self.step = f"rename {n:05d}.tmp"
                try:
                    os.rename(directory / f"{n:05d}.tmp", directory / f"{n:05d}.sst")
                except FileNotFoundError:
                    # Its create, not yet covered by an fsync of the directory, was lost
                    # with the primary (fsync of a file does not make its name durable).
                    self.lost_names.append(f"{n:05d}.sst")
                    n += 1
                    continue
                self.step = "fsync the directory"
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(fd)
                except OSError as exc:
                    if exc.errno != errno.EIO:
                        raise
                    self.failed_fsyncs += 1  # as above: its name may or may not be there
                    self.lost_names.append(f"{n:05d}.sst")
                    n += 1
                    continue
                finally:
                    os.close(fd)
                self.ops.append((started, time.monotonic()))
                self.acked[f"{n:05d}.sst"] = data
                n += 1
                time.sleep(0.02)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            exc.add_note(f"at {time.strftime('%H:%M:%S')}, {self.step}")
            try:
                exc.add_note(f"the directory then: {sorted(os.listdir(directory))[-4:]}")
            except OSError as again:
                exc.add_note(f"the directory then: {again!r}")

    def wait_for_more(self, count: int, timeout: float = 120) -> None:
        target = len(self.acked) + count
        wait_for(lambda: len(self.acked) >= target or self.error is not None, timeout,
                 f"{self.name} to commit {count} more files")
        assert self.error is None, f"{self.name}: {self.error!r} {getattr(self.error, '__notes__', '')}"

    def finish(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=180)
        assert not self.thread.is_alive(), f"{self.name} is stuck"
        assert self.error is None, f"{self.name}: {self.error!r} {getattr(self.error, '__notes__', '')}"

    def stall_after(self, moment: float) -> float:
        """Seconds from ``moment`` to the end of the first commit that began after it:
        how long this node went without a file operation completing."""
        return min(end for start, end in self.ops if start >= moment) - moment

    def longest(self) -> float:
        return max(end - start for start, end in self.ops)


class AcknowledgedLost(AssertionError):
    """A file whose directory's fsync returned is not there after the failover."""


def check_whole_everywhere(writers: list[Writer], mounts: list[Mount]) -> None:
    """Every acknowledged file is there, whole, on every node; nothing else is."""
    for m in mounts:
        for w in writers:
            names = sorted(n for n in os.listdir(m.path / w.name) if n.endswith(".sst") and n not in w.lost_names)
            if set(w.acked) - set(names):
                raise AcknowledgedLost(f"{w.name} on {m.path.name}: missing {sorted(set(w.acked) - set(names))[:5]}")
            assert names == sorted(w.acked), f"{w.name} on {m.path.name}: unexpected {sorted(set(names) - set(w.acked))[:5]}"
            for name, data in w.acked.items():
                assert (m.path / w.name / name).read_bytes() == data, f"{w.name}/{name} on {m.path.name}"


def failover_while_writing(ha: LocalHA, make_mount, bucket: Bucket, lose: str) -> None:
    """Two nodes commit files; the primary's machine is lost (``kill``) or frozen
    (``freeze``); the synchronous standby is promoted; both nodes go on; every
    acknowledged file reads back whole on both; fsck is clean; the old primary rejoins
    as the synchronous standby."""
    url = ha.create_database("vol")
    # A session outlives the failover (about ttl + a few seconds here): see docs/deploy.md.
    opts = ["--meta", url, "--metrics-addr", "off", "--session-timeout", "60", "--meta-outage-budget", "90"]
    a = make_mount(bucket, name="node-a", cache="cache-a", extra=opts).mount()
    b = make_mount(bucket, name="node-b", cache="cache-b", extra=opts).mount()
    writers = [Writer(a.path, "a").start(), Writer(b.path, "b").start()]
    for w in writers:
        w.wait_for_more(10)  # before
    old = ha.primary()
    assert old is not None
    lost_at = time.monotonic()
    getattr(ha, lose)(old)
    new = ha.wait_primary(timeout=90, other_than=old)
    promoted_after = time.monotonic() - lost_at
    for w in writers:
        w.wait_for_more(10)  # during and after
    stalls = [round(w.stall_after(lost_at), 1) for w in writers]
    # The old primary comes back and rejoins as the synchronous standby.
    (ha.start if lose == "kill" else ha.thaw)(old)
    ha.wait_healthy(timeout=120)
    assert ha.primary() is new
    assert {s["name"]: s["role"] for s in ha.cluster()}[old.name] == "sync_standby"
    for w in writers:
        w.wait_for_more(5)  # with the old primary back as the standby
        w.finish()
    check_whole_everywhere(writers, [a, b])
    report = json.loads(fusestate("fsck", bucket.url, "--meta", url, "--json").stdout)
    assert report["healthy"] and not report["problems"], report
    # Blocks in the bucket: every file's but the empty ones and those of at most --inline-max
    # bytes (4 KiB), whose bytes the database keeps.
    assert report["referenced"] >= sum(len(w.acked) for w in writers) - sum(
        1 for w in writers for d in w.acked.values() if len(d) <= 4096)
    print(f"{lose}: standby promoted after {promoted_after:.1f} s; first commit after the loss "
          f"on each node: {stalls} s; longest commit: {[round(w.longest(), 1) for w in writers]} s; "
          f"files: {[len(w.acked) for w in writers]}; creates lost: {[w.lost_names for w in writers]}")
    a.umount()
    b.umount()


def test_mounts_follow_the_primary_when_its_machine_is_lost(ha: LocalHA, make_mount, file_bucket: Bucket) -> None:
    failover_while_writing(ha, make_mount, file_bucket, "kill")


@pytest.mark.slow
def test_mounts_follow_the_primary_when_it_freezes(ha: LocalHA, make_mount, file_bucket: Bucket) -> None:
    """SIGSTOP of the primary's PostgreSQL processes (postmaster and children: each child
    has a session of its own): its connections hang rather than fail, until the pool finds
    the server no longer answers; its Patroni stops renewing the leader key, and once
    thawed, finds the standby promoted and rejoins as its standby."""
    failover_while_writing(ha, make_mount, file_bucket, "freeze_server")


def test_an_fsync_returns_only_once_the_synchronous_standby_has_it(ha: LocalHA, make_mount,
                                                                  file_bucket: Bucket) -> None:
    """fsync and fsyncdir wait for a commit made with synchronous_commit on, which with a
    synchronous standby returns once the standby has flushed it: with the standby's
    server frozen, an fsync waits (a namespace change, committed without that wait, does
    not), and returns when the standby is back."""
    url = ha.create_database("vol")
    m = make_mount(file_bucket, extra=["--meta", url, "--metrics-addr", "off"]).mount()
    write_synced(m.path / "before", b"1")
    standby = next(x for x in ha.members if x is not ha.primary())
    ha.freeze_server(standby)
    try:
        started = time.monotonic()
        (m.path / "made-meanwhile").mkdir()
        assert time.monotonic() - started < 2
        done = threading.Event()
        threading.Thread(target=lambda: (write_synced(m.path / "during", b"2"), done.set()), daemon=True).start()
        assert not done.wait(5), "fsync returned while the synchronous standby could not have the commit"
    finally:
        ha.thaw(standby)
    assert done.wait(30)
    assert sorted(os.listdir(m.path)) == ["before", "during", "made-meanwhile"]
    m.umount()


@pytest.mark.slow
def test_a_spark_query_goes_on_through_a_failover_of_the_database(tmp_path: Path) -> None:
    """`fusestate spark-cluster --meta-ha --fail-over-after 2`: two workers and a driver on
    one shared volume whose database loses its primary after batch 2; the query goes on,
    and every batch is in its output once."""
    from fusestate.spark.pipeline import read_output

    output = tmp_path / "output"
    proc = fusestate("spark-cluster", "--meta-ha", "--fail-over-after", "2", "--batches", "5", "--workers", "2",
                     "--root", str(tmp_path / "cluster"), "--output", str(output), "--json", timeout=1200)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [b["batch"] for b in report["batches"]] == [0, 1, 2, 3, 4]
    assert sorted(read_output(output)) == [0, 1, 2, 3, 4]
    fault = report["cluster"]["faults"][0]
    assert fault["kind"] == "fail-over" and fault["injected"] and fault["back_after_s"] is not None, fault
