"""One volume, many nodes: two daemons, each with its own cache dir, mount one volume
read-write at once with their metadata on a real PostgreSQL server."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shlex
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

import psycopg
import pytest

from conftest import BIN, Bucket, Mount, assert_one_line_error, fusestate, wait_for
from fusestate.harness.postgres import LocalPostgres

SESSION_TIMEOUT = 3.0


def shared_pair(make_mount, bucket: Bucket, pg_url: str, *more: str) -> tuple[Mount, Mount]:
    opts = ["--meta", pg_url, "--metrics-addr", "off", "--session-timeout", str(SESSION_TIMEOUT), *more]
    a = make_mount(bucket, name="node-a", cache="cache-a", extra=opts).mount()
    b = make_mount(bucket, name="node-b", cache="cache-b", extra=opts).mount()
    return a, b


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def overwrite_synced(path: Path, data: bytes) -> None:
    """Write ``data`` over the file's first bytes, in place, and fsync."""
    with open(path, "r+b") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def test_fsynced_on_one_node_reads_whole_on_the_other(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    a, b = shared_pair(make_mount, file_bucket, pg_url)
    data = os.urandom(9 << 20)  # three blocks, the last one short
    write_synced(a.path / "state.sst", data)
    assert (b.path / "state.sst").read_bytes() == data
    # A new version written on B and renamed over the name (Spark's and RocksDB's way) is
    # what an open on A finds once A's cached name expires (--attr-timeout, 1 s here).
    newer = os.urandom(5 << 20)
    (b.path / "state.sst.tmp").write_bytes(newer)
    os.rename(b.path / "state.sst.tmp", b.path / "state.sst")
    time.sleep(1.2)
    assert (a.path / "state.sst").read_bytes() == newer
    st = b.status()
    assert st["metadata"]["engine"] == "postgresql"
    assert len(st["sessions"]) == 2 and sum(s["this"] for s in st["sessions"]) == 1


def test_a_reopened_file_keeps_its_cached_pages_until_another_node_changes_it(make_mount, file_bucket: Bucket,
                                                                             pg_url: str) -> None:
    """Close-to-open without rereading what did not change: B's second open of an
    unchanged file reads from B's page cache; once A rewrote bytes in place (same size),
    B's next open reads the new bytes."""
    a, b = shared_pair(make_mount, file_bucket, pg_url)
    old = os.urandom(2 << 20)
    write_synced(a.path / "f", old)
    assert (b.path / "f").read_bytes() == old
    read_before = b.status()["fuse"]["bytes_read"]
    assert (b.path / "f").read_bytes() == old
    assert b.status()["fuse"]["bytes_read"] == read_before  # from the page cache
    new = os.urandom(4096)
    overwrite_synced(a.path / "f", new)
    assert (b.path / "f").read_bytes() == new + old[4096:]
    assert b.status()["fuse"]["bytes_read"] > read_before


@pytest.mark.parametrize("new_size", [53, 300_000])
def test_a_file_another_node_rewrote_is_seen_at_its_new_size_where_the_kernel_knew_it(
        make_mount, file_bucket: Bucket, pg_url: str, new_size: int) -> None:
    """B's kernel holds the file (B read it), with the kernel's writeback cache, which
    trusts its own size of a file it holds. A rewrites it shorter or longer and closes it:
    within the visibility bound B's stat and a new open show the new size and bytes (B's
    kernel is made to drop its names of the file, so the next lookup brings the new size)."""
    a, b = shared_pair(make_mount, file_bucket, pg_url)
    (a.path / "f").write_bytes(b"x" * 3000)
    time.sleep(0.6)
    assert (b.path / "f").read_bytes() == b"x" * 3000
    new = os.urandom(new_size)
    fd = os.open(a.path / "f", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, new)
    finally:
        os.close(fd)
    wait_for(lambda: os.stat(b.path / "f").st_size == new_size, timeout=2, what="B to see the new size")
    assert (b.path / "f").read_bytes() == new


def test_a_file_linked_in_from_another_node_is_read_from_the_page_cache(make_mount, file_bucket: Bucket,
                                                                        pg_url: str) -> None:
    """A state store loaded on B links A's files into B's working dir: B puts them into its
    page cache in the background, and RocksDB's reads then never reach B's daemon. A link
    on the node that wrote the file fetches nothing: its pages and blocks are there."""
    a, b = shared_pair(make_mount, file_bucket, pg_url)
    (a.path / "checkpoint").mkdir()
    (a.path / "work").mkdir()
    data = os.urandom(9 << 20)  # three blocks, the last one short
    write_synced(a.path / "checkpoint" / "1.sst", data)

    os.link(b.path / "checkpoint" / "1.sst", b.path / "work" / "1.sst")
    os.link(b.path / "checkpoint" / "1.sst", b.path / "work" / "1.sst.again")  # one fill per file
    wait_for(lambda: b.status()["page_fill"]["files"] == 1, what="B to fill its page cache")
    before = b.status()["fuse"]["bytes_read"]
    assert (b.path / "work" / "1.sst").read_bytes() == data
    # From the page cache; the kernel may have reclaimed a few pages since (these VMs page
    # out memory they see unused), and those few are read through the daemon.
    assert b.status()["fuse"]["bytes_read"] - before < len(data) / 10
    fill = b.status()["page_fill"]
    assert fill["bytes"] == len(data) and fill["pending_bytes"] == 0 and fill["stopped"] == fill["failures"] == 0
    os.link(a.path / "checkpoint" / "1.sst", a.path / "work" / "1.sst.a")
    assert a.status()["page_fill"]["bytes"] == 0 and a.status()["page_fill"]["skipped"] == 1


def slow_node(make_mount, bucket: Bucket, pg_url: str) -> Mount:
    """Node B whose every block fetch from the bucket takes half a second: a fill of a file
    of a few blocks is still running a second after its link."""
    opts = ["--meta", pg_url, "--metrics-addr", "off", "--session-timeout", str(SESSION_TIMEOUT)]
    return make_mount(bucket, name="node-b", cache="cache-b", extra=opts).mount(
        env={"FUSESTATE_FAULTS": "pause=0.5,ops=get,under=blocks/"})


def test_a_write_on_the_node_filling_the_page_cache_is_not_overwritten(make_mount, file_bucket: Bucket,
                                                                       pg_url: str) -> None:
    """The kernel copies a fill's data over any page, so the fill stops before an open for
    writing is answered: what B writes right after its link is what B and A read back."""
    a = make_mount(file_bucket, name="node-a", cache="cache-a",
                   extra=["--meta", pg_url, "--metrics-addr", "off"]).mount()
    b = slow_node(make_mount, file_bucket, pg_url)
    data = bytearray(os.urandom(24 << 20))  # six blocks: three rounds of fetches, 1.5 s
    write_synced(a.path / "f", bytes(data))
    os.link(b.path / "f", b.path / "g")
    mark = b"written on B after the link" * 100
    with open(b.path / "g", "r+b") as f:
        f.write(mark)
        f.seek(20 << 20)
        f.write(mark)
        f.flush()
        os.fsync(f.fileno())
    data[:len(mark)] = mark
    data[20 << 20:(20 << 20) + len(mark)] = mark
    assert b.status()["page_fill"]["stopped"] == 1
    assert (b.path / "g").read_bytes() == bytes(data)
    time.sleep(1.2)  # A's cached attributes expire (--attr-timeout 1 s on a shared volume)
    assert (a.path / "f").read_bytes() == bytes(data)


def test_a_fill_never_outlives_a_change_made_on_another_node(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    """A rewrites the file while B is still filling its page cache with the old bytes: B's
    next open finds the new content, stops the fill first, and reads what A wrote."""
    a = make_mount(file_bucket, name="node-a", cache="cache-a",
                   extra=["--meta", pg_url, "--metrics-addr", "off"]).mount()
    b = slow_node(make_mount, file_bucket, pg_url)
    old = os.urandom(24 << 20)
    write_synced(a.path / "f", old)
    os.link(b.path / "f", b.path / "g")
    new = os.urandom(4096)
    overwrite_synced(a.path / "f", new)
    assert (b.path / "g").read_bytes() == new + old[4096:]
    assert b.status()["page_fill"]["stopped"] == 1


def test_a_node_answers_lookups_from_memory_and_drops_what_another_node_changed(make_mount, file_bucket: Bucket,
                                                                               pg_url: str) -> None:
    """With the kernel's cache off (--attr-timeout 0) every stat reaches the daemon: B answers
    a name it knows from memory, and a chmod, a link, a rename and an unlink on A show on
    B's next stat once the database's notification is in (0.5 s at the latest). (A file's
    size is the kernel's own on B: semantics.md, a file rewritten in place.)"""
    a, b = shared_pair(make_mount, file_bucket, pg_url, "--attr-timeout", "0")
    wait_for(lambda: b.status()["session"]["changes_followed"] == 1, 10, "B following the changes")
    (a.path / "f").write_bytes(b"x" * 100)
    os.stat(b.path / "f")  # asked of the database once, then kept
    hits = b.status()["session"]["lookup_cache_hits"]
    for _ in range(20):
        os.stat(b.path / "f")
    # Most from memory: on a loaded machine an answer of the listening session may come
    # late (over 0.5 s), and the lookups meanwhile ask the database, as they must.
    assert b.status()["session"]["lookup_cache_hits"] >= hits + 10
    assert re.search(r"lookup cache +following other nodes' changes; \d+ hits", fusestate("status", str(b.path)).stdout)
    os.chmod(a.path / "f", 0o600)
    wait_for(lambda: stat.S_IMODE(os.stat(b.path / "f").st_mode) == 0o600, 2, "the chmod seen on B")
    os.link(a.path / "f", a.path / "h")
    wait_for(lambda: os.stat(b.path / "f").st_nlink == 2, 2, "the new link seen on B")
    os.rename(a.path / "f", a.path / "g")
    wait_for(lambda: not (b.path / "f").exists(), 2, "the rename seen on B")
    assert os.stat(b.path / "g").st_size == 100
    os.unlink(a.path / "g")
    wait_for(lambda: not (b.path / "g").exists(), 2, "the unlink seen on B")
    assert b.status()["session"]["lookup_cache_dropped"] >= 3


def test_a_node_that_missed_change_notifications_forgets_what_it_knew(make_mount, file_bucket: Bucket,
                                                                     pg_url: str) -> None:
    """The listening connections are cut, and A renames a file B knows while none listens:
    B asks the database until it listens again, and starts again from an empty memory."""
    a, b = shared_pair(make_mount, file_bucket, pg_url, "--attr-timeout", "0")
    wait_for(lambda: b.status()["session"]["changes_followed"] == 1, 10, "B following the changes")
    (a.path / "f").write_bytes(b"x")
    os.stat(b.path / "f")
    os.stat(b.path / "f")
    with psycopg.connect(pg_url, autocommit=True) as conn:
        listeners = [r[0] for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE '%changes'")]
        assert len(listeners) == 2  # one per node
        for pid in listeners:
            conn.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        os.rename(a.path / "f", a.path / "g")  # announced to no node
    wait_for(lambda: not (b.path / "f").exists(), 2, "B asking the database")
    wait_for(lambda: b.status()["session"]["changes_followed"] == 1, 10, "B listening again")
    assert not (b.path / "f").exists() and (b.path / "g").exists()
    os.unlink(a.path / "g")
    wait_for(lambda: not (b.path / "g").exists(), 2, "the unlink seen on B")


def test_namespace_changes_from_both_nodes_at_once(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    """Creates, links, renames and unlinks in one directory from two nodes at once: every
    name each node made is there exactly once, nothing else is."""
    a, b = shared_pair(make_mount, file_bucket, pg_url)
    (a.path / "shared").mkdir()
    errors: list[BaseException] = []

    def churn(m: Mount, tag: str) -> None:
        try:
            d = m.path / "shared"
            for i in range(40):
                (d / f"{tag}-{i}.tmp").write_bytes(f"{tag}{i}".encode())
                os.link(d / f"{tag}-{i}.tmp", d / f"{tag}-{i}.link")
                os.rename(d / f"{tag}-{i}.tmp", d / f"{tag}-{i}")
                os.unlink(d / f"{tag}-{i}.link")
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(m, tag)) for m, tag in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    expected = sorted(f"{tag}-{i}" for tag in "ab" for i in range(40))
    for m in (a, b):
        assert sorted(os.listdir(m.path / "shared")) == expected
    assert (b.path / "shared" / "a-7").read_bytes() == b"a7"
    assert os.stat(a.path / "shared" / "b-3").st_nlink == 1


def test_no_replace_rename_has_one_winner(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    """Spark's commit protocol: two nodes rename onto one name without overwrite; one wins."""
    from test_posix import renameat2, RENAME_NOREPLACE

    a, b = shared_pair(make_mount, file_bucket, pg_url)
    (a.path / "from-a").write_bytes(b"a")
    (b.path / "from-b").write_bytes(b"b")
    outcomes = []
    for m, name in ((a, "from-a"), (b, "from-b")):
        try:
            renameat2(m.path / name, m.path / "commits-7", RENAME_NOREPLACE)
            outcomes.append("won")
        except FileExistsError:
            outcomes.append("lost")
    assert outcomes == ["won", "lost"]
    assert (b.path / "commits-7").read_bytes() == b"a"


def test_open_unlinked_file_stays_readable_where_it_is_open(make_mount, file_bucket: Bucket,
                                                           pg_url: str) -> None:
    a, b = shared_pair(make_mount, file_bucket, pg_url)
    data = os.urandom(6 << 20)
    write_synced(a.path / "old.sst", data)
    with open(a.path / "old.sst", "rb") as f:
        os.unlink(b.path / "old.sst")
        time.sleep(1.2)  # A's cached name expires (--attr-timeout)
        assert not (a.path / "old.sst").exists()
        assert f.read() == data  # its blocks live while node A holds it open
    assert os.listdir(b.path) == []


def test_holds_of_closed_files_go_in_batches_and_an_unlinked_file_goes_with_them(make_mount, file_bucket: Bucket,
                                                                                 pg_url: str) -> None:
    """A node lets go of the files it closed a moment later, many in one transaction; a
    reopen meanwhile keeps its hold (an unlink on another node cannot delete the file under
    it), and a file unlinked elsewhere goes, blocks and all, once its last holder let go."""
    a, b = shared_pair(make_mount, file_bucket, pg_url)
    files = {f"f{i}": os.urandom(100_000 + i) for i in range(20)}
    for name, data in files.items():
        write_synced(a.path / name, data)
    total = sum(len(d) for d in files.values())
    wait_for(lambda: b.status()["used_bytes"] >= total, timeout=10, what="B's counters to show A's files")
    with open(a.path / "f0", "rb") as held:  # closed a moment ago, opened again
        for name in files:
            os.unlink(b.path / name)
        time.sleep(1.2)
        assert held.read() == files["f0"]
    # Every file has gone from the volume once node A let go of them (f0 after its close).
    wait_for(lambda: a.status()["files"] == 1 and b.status()["used_bytes"] == 0, timeout=10,
             what="the unlinked files deleted")
    assert os.listdir(a.path) == []


def test_a_lost_node_is_cleaned_up_and_its_fsynced_files_survive(make_mount, file_bucket: Bucket,
                                                                 pg_url: str) -> None:
    a, b = shared_pair(make_mount, file_bucket, pg_url)
    synced = os.urandom(5 << 20)
    write_synced(a.path / "synced.sst", synced)
    held = a.path / "held.sst"
    write_synced(held, os.urandom(1 << 20))
    f = open(held, "rb")  # noqa: SIM115 - held open while the node dies
    try:
        os.unlink(b.path / "held.sst")  # open on A: kept for A
        a.kill()
        a.wipe_cache()
    finally:
        with contextlib.suppress(OSError):
            f.close()  # its mount is dead: ENOTCONN
    assert (b.path / "synced.sst").read_bytes() == synced
    deadline = time.monotonic() + 10 * SESSION_TIMEOUT
    while len(b.status()["sessions"]) > 1:
        assert time.monotonic() < deadline, "the dead node's session was never cleaned up"
        time.sleep(0.5)
    (b.path / "after.txt").write_bytes(b"the volume goes on")
    assert sorted(os.listdir(b.path)) == ["after.txt", "synced.sst"]
    assert b.status()["files"] == 3  # root, synced.sst, after.txt: the held file went with A
    assert shared_fsck(file_bucket, pg_url) == []


def shared_fsck(bucket: Bucket, pg_url: str) -> list[str]:
    """``fusestate fsck --meta``: what it finds wrong (missing or corrupt blocks, problems in the tables)."""
    proc = fusestate("fsck", bucket.url, "--meta", pg_url, "--json", check=False)
    report = json.loads(proc.stdout)
    assert report["engine"].startswith("postgresql://")
    found = report["missing"] + report["corrupt"] + report["problems"]
    assert (proc.returncode == 0) == (not found), proc.stdout
    return found


def test_gc_racing_uploads_of_the_same_bytes_deletes_nothing_referenced(make_mount, file_bucket: Bucket,
                                                                         pg_url: str) -> None:
    """Both nodes keep writing, fsyncing and deleting files of the same few contents (so the
    same blocks become unreferenced and referenced again), while ``fusestate gc --grace 0``
    runs over and over: every file left reads back whole on a node with an empty cache."""
    a, b = shared_pair(make_mount, file_bucket, pg_url, "--block-size", "64K")
    contents = [random.Random(i).randbytes(200_000) for i in range(5)]
    stop = threading.Event()
    errors: list[BaseException] = []
    kept: dict[str, bytes] = {}
    deleted = 0

    def churn(m: Mount, tag: str, offset: int) -> None:
        # Each node holds at most two of the five contents at a time (the one it writes and
        # the one before it), so at any moment at least one is unreferenced (garbage), and
        # soon written again by one node or the other.
        try:
            previous = None
            n = 0
            while not stop.is_set() or previous is None:
                which = (n + offset) % len(contents)
                path = m.path / f"{tag}-{n}-{which}"
                write_synced(path, contents[which])
                if previous is not None:
                    previous.unlink()
                previous, n = path, n + 1
            kept[previous.name] = previous.read_bytes()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    # The collections run from a shell started before the writers open any file: a process
    # started from this one while they write would inherit their open files, and its exec
    # would close them, a FUSE flush that waits for their fsync (seconds, when the collector
    # just took their bytes and the node puts them again).
    gc_command = " ".join(shlex.quote(arg) for arg in (str(BIN / "fusestate"), "gc", file_bucket.url,
                                                       "--meta", pg_url, "--grace", "0"))
    collector = subprocess.Popen(["bash", "-c", f"while read -r _; do {gc_command} 2>&1; echo '-- done'; done"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert collector.stdin is not None and collector.stdout is not None

    def collect() -> str:
        collector.stdin.write("\n")
        collector.stdin.flush()
        return "".join(iter(collector.stdout.readline, "-- done\n"))

    threads = [threading.Thread(target=churn, args=(m, tag, i)) for i, (m, tag) in enumerate(((a, "a"), (b, "b")))]
    for t in threads:
        t.start()
    try:
        # Five collections at least; more while none found garbage yet (on a loaded machine
        # the first ones can all come before the writers have let go of a content: with the
        # default test run's two workers, 60 s once went by without any).
        runs, deadline = 0, time.monotonic() + 150
        while runs < 5 or (deleted == 0 and time.monotonic() < deadline):
            out = collect()
            found = re.search(r"deleted (\d+) unreferenced", out)
            assert found, out
            deleted += int(found.group(1))
            runs += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
        collector.stdin.close()
        collector.wait(timeout=60)
    assert not errors, errors
    assert deleted > 0, "gc never found anything to delete: the race was not exercised"
    assert len(kept) == 2
    a.umount()
    b.umount()
    a.wipe_cache()
    a.mount()
    for name, data in kept.items():
        assert (a.path / name).read_bytes() == contents[int(name.rsplit("-", 1)[1])]
    assert shared_fsck(file_bucket, pg_url) == []


def test_mount_refuses_a_volume_on_another_engine(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    shared = make_mount(file_bucket, name="shared", cache="c1", extra=["--meta", pg_url, "--metrics-addr", "off"])
    shared.mount()
    shared.umount()
    plain = make_mount(file_bucket, name="plain", cache="c2", extra=["--metrics-addr", "off"])
    assert_one_line_error(plain.try_mount(), "postgresql://127.0.0.1:", "--meta")


def test_unreachable_database_is_one_clear_line(make_mount, file_bucket: Bucket, tmp_path: Path) -> None:
    from bench.systems import free_port

    url = f"postgresql://postgres@127.0.0.1:{free_port()}/fs"
    m = make_mount(file_bucket, extra=["--meta", url, "--metrics-addr", "off"])
    assert_one_line_error(m.try_mount(), "metadata database", "127.0.0.1")


def test_bad_meta_url_is_one_clear_line(make_mount, file_bucket: Bucket) -> None:
    m = make_mount(file_bucket, extra=["--meta", "mysql://u:secret@h/db"])
    line = assert_one_line_error(m.try_mount(), "--meta")
    assert "secret" not in line


def test_database_restart_under_a_live_mount(make_mount, file_bucket: Bucket, pg_url: str,
                                             postgres_server) -> None:
    """Operations wait while the database restarts, then go on; nothing is lost."""
    a, b = shared_pair(make_mount, file_bucket, pg_url)
    write_synced(a.path / "before", b"1")
    restarter = postgres_server.restart_soon(0.05)
    write_synced(a.path / "during", b"2")  # waits for the server if it lands in the gap
    assert restarter.wait(timeout=60) == 0
    write_synced(b.path / "after", b"3")
    assert sorted(os.listdir(a.path)) == ["after", "before", "during"]
    assert (b.path / "during").read_bytes() == b"2"
    pytest.importorskip("psycopg")
    fusestate("status", str(a.path))


def test_each_node_reports_where_the_volumes_files_are_warm(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    """A file is warm on the node that wrote it and on a node that read it, nowhere else:
    `fusestate status --warm` and the fusestate_warm_bytes metric say so per directory."""
    import urllib.request

    opts = ["--meta", pg_url, "--session-timeout", str(SESSION_TIMEOUT), "--block-size", "64K"]
    a = make_mount(file_bucket, name="node-a", cache="cache-a", extra=[*opts, "--metrics-addr", "127.0.0.1:0"]).mount()
    b = make_mount(file_bucket, name="node-b", cache="cache-b", extra=[*opts, "--metrics-addr", "off"]).mount()
    for d in ("p1", "p2"):
        (a.path / d).mkdir()
        write_synced(a.path / d / "f", os.urandom(200_000))
    assert (b.path / "p2" / "f").read_bytes() == (a.path / "p2" / "f").read_bytes()

    def warm(m: Mount, *path: str) -> dict[str, dict]:
        proc = fusestate("status", str(m.path), "--warm", *path, "--json")
        assert proc.returncode == 0, proc.stderr
        return {d["path"]: d for d in json.loads(proc.stdout)["dirs"]}

    on_a, on_b = warm(a), warm(b)
    assert on_a["/p1"]["warm_bytes"] == on_a["/p2"]["warm_bytes"] == 200_000
    assert on_b["/p2"]["warm_bytes"] == 200_000 and on_b["/p2"]["warm_files"] == 1
    assert on_b["/p1"]["warm_bytes"] == 0 and on_b["/p1"]["files"] == 1
    assert set(warm(b, "p2")) == {"/p2"}
    text = fusestate("status", str(b.path), "--warm").stdout
    assert "/p2" in text and "100%" in text and "warm on this node" in text
    addr = a.status()["metrics_addr"]
    scrape = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    assert 'fusestate_warm_bytes{dir="/p1"} 200000.0' in scrape

    def probe(path: Path, share: bytes = b"") -> int:
        """0 when the node holds ``share`` of the bytes under ``path``, else the errno."""
        try:
            os.setxattr(path, "user.fusestate.warm", share)
            return 0
        except OSError as exc:
            return exc.errno or -1

    # The same answer through the mount, as a Spark executor asks it (user.fusestate.warm).
    assert probe(a.path / "p1") == probe(b.path / "p2") == probe(b.path / "p2" / "f") == 0
    assert probe(b.path / "p1") == probe(b.path / "p1" / "f") == errno.ENODATA
    assert probe(b.path, b"0.5") == 0 and probe(b.path, b"0.6") == errno.ENODATA
    assert probe(b.path, b"1.5") == probe(b.path, b"most") == errno.EINVAL
    (b.path / "empty").mkdir()
    assert probe(b.path / "empty") == errno.ENODATA


def test_fsync_makes_namespace_changes_survive_a_database_crash(make_mount, file_bucket: Bucket, pg_url: str,
                                                                postgres_server) -> None:
    """Namespace operations commit without waiting for the database's WAL flush; fsync waits
    for it. Files created and fsynced right before the server crashes (immediate stop, its
    unflushed WAL buffers gone) are all there after it restarts."""
    m = make_mount(file_bucket, extra=["--meta", pg_url, "--metrics-addr", "off"]).mount()
    (m.path / "d").mkdir()
    names = [f"f{i:02d}" for i in range(12)]
    for name in names:
        write_synced(m.path / "d" / name, name.encode() * 100)
    postgres_server.stop("immediate")
    postgres_server.start()
    assert sorted(os.listdir(m.path / "d")) == names
    for name in names:
        assert (m.path / "d" / name).read_bytes() == name.encode() * 100
    m.umount()


def test_each_session_is_kept_for_its_own_timeout(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    """A node mounted with a short --session-timeout never cleans up a live node mounted
    with the default one, which beats less often: each session carries its own timeout."""
    a = make_mount(file_bucket, name="node-a", cache="cache-a",
                   extra=["--meta", pg_url, "--metrics-addr", "off"]).mount()
    b = make_mount(file_bucket, name="node-b", cache="cache-b",
                   extra=["--meta", pg_url, "--metrics-addr", "off", "--session-timeout", "1"]).mount()
    time.sleep(3)  # B cleans up every 1/3 s; A beats every 10 s
    write_synced(a.path / "f", b"still a live session")
    assert (b.path / "f").read_bytes() == b"still a live session"
    assert "cleaned up" not in (b.cache_dir / "fusestate.log").read_text()
    assert len(b.status()["sessions"]) == 2


# Holds a file open on a node while that node's daemon is paused: written, not closed, as a
# Spark executor holds its state store's files. Its own process, because a close of any
# descriptor on the paused node's mount (the test's own subprocesses close inherited ones
# as they start) waits for that daemon. Each line on stdin: "fsync" writes more through
# the handle and fsyncs, "close" closes it; it answers "ok" or the errno.
HOLDER = """
import os, sys
f = open(sys.argv[1], "wb")
f.write(b"written under the old session" * 1000)
print("written", flush=True)
for command in sys.stdin:
    try:
        if command.strip() == "fsync":
            f.write(b"more")
            f.flush()
            os.fsync(f.fileno())
        else:
            f.close()
        print("ok", flush=True)
    except OSError as exc:
        print(exc.errno, flush=True)
"""


def status_of(m: Mount, *flags: str) -> subprocess.CompletedProcess:
    """``fusestate status`` of a mount, its exit code not checked."""
    return fusestate("status", str(m.path), *flags, check=False)


def session_lost_metric(addr: str) -> float:
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    (value,) = [float(line.split()[1]) for line in text.splitlines() if line.startswith("fusestate_session_lost ")]
    return value


def test_a_node_whose_session_was_cleaned_up_says_so_and_a_restart_serves_the_volume(make_mount, file_bucket: Bucket,
                                                                                      pg_url: str) -> None:
    """Node A is paused past its --session-timeout while a process holds a file written on
    it but not closed; B cleans A's session up and writes a newer version of that file.
    Resumed, A publishes nothing: `fusestate status` puts the lost session first and exits
    1 (the Helm chart's liveness probe runs exactly that), status --json and the metric say
    so, writes and the old handle's fsync fail with EIO. Then what the kubelet does when the
    probe fails: the preStop `fusestate umount` is refused (the file is still open), SIGTERM
    makes the daemon drop what it cannot publish, detach the mount and exit. Mounted again,
    A serves the volume with every file B wrote and nothing of its unpublished data; the
    old handle fails still."""
    opts = ["--meta", pg_url, "--session-timeout", str(SESSION_TIMEOUT)]
    a = make_mount(file_bucket, name="node-a", cache="cache-a", extra=[*opts, "--metrics-addr", "127.0.0.1:0"]).mount()
    b = make_mount(file_bucket, name="node-b", cache="cache-b", extra=[*opts, "--metrics-addr", "off"]).mount()
    files = {"from-a": os.urandom(300_000), "from-b": os.urandom(200_000)}
    write_synced(a.path / "from-a", files["from-a"])
    write_synced(b.path / "from-b", files["from-b"])
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(a.path / "held")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def through_old_handle(command: str) -> str:
        holder.stdin.write(command + "\n")
        holder.stdin.flush()
        return holder.stdout.readline().strip()

    try:
        assert holder.stdout.readline() == "written\n"
        before = json.loads(status_of(a, "--json").stdout)
        assert before["session"]["state"] == "live" and before["session"]["lost"] == 0
        assert session_lost_metric(before["metrics_addr"]) == 0
        assert status_of(a).returncode == 0

        os.kill(a.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: len(b.status()["sessions"]) == 1, timeout=10 * SESSION_TIMEOUT,
                     what="B to clean up the paused node's session")
            files["held"] = os.urandom(100_000)  # newer than what A still holds for this file
            write_synced(b.path / "held", files["held"])
            files["from-b-meanwhile"] = os.urandom(50_000)
            write_synced(b.path / "from-b-meanwhile", files["from-b-meanwhile"])
        finally:
            os.kill(a.pid, signal.SIGCONT)

        wait_for(lambda: status_of(a).returncode != 0, timeout=10 * SESSION_TIMEOUT, what="A to learn it was cleaned up")
        text = status_of(a)
        assert text.returncode == 1, text
        assert text.stdout.splitlines()[0].startswith("SESSION LOST:") and "fusestate umount" in text.stdout
        assert re.search(r"^session +\d+, lost;", text.stdout, re.M), text.stdout
        js = status_of(a, "--json")
        assert js.returncode == 1
        lost = json.loads(js.stdout)
        assert lost["session"]["state"] == "lost" and lost["session"]["lost"] == 1
        assert session_lost_metric(lost["metrics_addr"]) == 1
        log = (a.cache_dir / "fusestate.log").read_text()
        assert "was cleaned up by the other nodes" in log and f"fusestate umount {a.path}" in log

        with pytest.raises(OSError) as refused:
            (a.path / "late").write_bytes(b"never published")
        assert refused.value.errno == errno.EIO
        assert through_old_handle("fsync") == str(errno.EIO)

        # The liveness probe failed: the kubelet runs preStop, then sends SIGTERM.
        assert_one_line_error(fusestate("umount", str(a.path), check=False), "busy")
        pid = a.pid
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), timeout=60, what="the daemon to exit")
        assert not os.path.ismount(a.path)
        assert "dropped" in (a.cache_dir / "fusestate.log").read_text()
        assert through_old_handle("close") == str(errno.ENOTCONN)  # a handle of the old mount stays dead
    finally:
        holder.kill()
        holder.wait()

    a.mount()  # the same cache dir, a new session
    assert status_of(a).returncode == 0 and a.status()["session"]["state"] == "live"
    assert len(b.status()["sessions"]) == 2
    for m in (a, b):
        assert sorted(os.listdir(m.path)) == sorted(files), m
        for name, data in files.items():
            assert (m.path / name).read_bytes() == data, (m, name)
    write_synced(a.path / "after", b"the node is back")
    assert (b.path / "after").read_bytes() == b"the node is back"
    assert shared_fsck(file_bucket, pg_url) == []


def test_bytes_collected_while_a_node_uploads_them_again_are_put_again(make_mount, file_bucket: Bucket,
                                                                        pg_url: str) -> None:
    """Uploads are not registered with the database: when ``fusestate gc`` deletes a block
    whose bytes a node is writing again at that moment, the node's commit is refused and
    it puts the bytes again. The file then reads whole on a node with an empty cache."""
    a, b = shared_pair(make_mount, file_bucket, pg_url, "--block-size", "64K")
    data = random.Random(7).randbytes(64 * 1024)
    write_synced(a.path / "old", data)
    (a.path / "old").unlink()
    out = fusestate("gc", file_bucket.url, "--meta", pg_url, "--grace", "0").stdout
    assert re.search(r"deleted 1 unreferenced", out), out
    write_synced(a.path / "new", data)  # within the collection's margin: refused once at least
    assert a.status()["writeback"]["put_again"] >= 1
    a.umount()
    assert (b.path / "new").read_bytes() == data
    assert shared_fsck(file_bucket, pg_url) == []


def inline_rows(pg_url: str) -> int:
    """Blocks whose bytes the database keeps (``--inline-max``)."""
    import psycopg

    with psycopg.connect(pg_url) as conn:
        return conn.execute("SELECT count(*) FROM objects WHERE key LIKE 'db-%' AND data IS NOT NULL").fetchone()[0]


def test_a_small_file_keeps_its_bytes_in_the_database(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    """A file of at most ``--inline-max`` bytes is closed without an upload: the other node
    reads it from the database, so does a node with an empty cache; grown past the limit
    it moves to the bucket, and back when it shrinks; fsck and gc know where it is."""
    a, b = shared_pair(make_mount, file_bucket, pg_url)
    small = os.urandom(3000)
    (a.path / "offsets").write_bytes(small)
    write_synced(a.path / "commit", b"v1\n{}\n")  # the commit pattern: fsync, rename, fsync dir
    os.rename(a.path / "commit", a.path / "0")
    assert file_bucket.block_objects() == set()
    assert inline_rows(pg_url) == 2
    assert (b.path / "offsets").read_bytes() == small
    assert (b.path / "0").read_bytes() == b"v1\n{}\n"

    grown = os.urandom(100_000)  # a new version renamed over the name, as Spark writes them
    (b.path / "offsets.tmp").write_bytes(grown)
    os.rename(b.path / "offsets.tmp", b.path / "offsets")
    assert len(file_bucket.block_objects()) == 1
    time.sleep(1.2)  # A's cached name expires (--attr-timeout 1 s with --meta)
    assert (a.path / "offsets").read_bytes() == grown
    with open(a.path / "offsets", "r+b") as f:
        f.truncate(2000)  # back under the limit: its block goes to the database
    assert inline_rows(pg_url) == 3
    assert (a.path / "offsets").read_bytes() == grown[:2000]

    a.umount()
    b.umount()
    a.wipe_cache()
    a.mount()
    b.mount("--inline-max", "0")  # off: a small file is a block in the bucket like any other
    assert (a.path / "offsets").read_bytes() == grown[:2000]
    assert (b.path / "offsets").read_bytes() == grown[:2000]
    assert (a.path / "0").read_bytes() == b"v1\n{}\n"
    assert shared_fsck(file_bucket, pg_url) == []
    import psycopg

    with psycopg.connect(pg_url) as conn:  # bytes that no longer match their key: fsck says so
        conn.execute("UPDATE objects SET data = 'x' || data WHERE starts_with(key, 'db-') AND data = %s",
                     (b"v1\n{}\n",))
    assert any("other bytes" in problem for problem in shared_fsck(file_bucket, pg_url))
    with psycopg.connect(pg_url) as conn:
        conn.execute("UPDATE objects SET data = substr(data, 2) WHERE starts_with(key, 'db-') AND data = %s",
                     (b"xv1\n{}\n",))

    (b.path / "plain").write_bytes(small)
    assert len(file_bucket.block_objects()) == 2
    assert (b.path / "plain").read_bytes() == small
    for name in ("offsets", "0", "plain"):
        (a.path / name).unlink()
    out = fusestate("gc", file_bucket.url, "--meta", pg_url, "--grace", "0").stdout
    assert re.search(r"deleted [1-9]\d* unreferenced", out), out
    assert file_bucket.block_objects() == set()
    assert inline_rows(pg_url) == 0
    assert shared_fsck(file_bucket, pg_url) == []


def inode_row(pg_url: str, ino: int) -> Optional[tuple]:
    """The inode's (nlink, size) in the volume's database, or None once it is deleted."""
    import psycopg

    with psycopg.connect(pg_url) as conn:
        return conn.execute("SELECT nlink, size FROM inodes WHERE id = %s", (ino,)).fetchone()


def test_a_crash_of_the_database_deletes_no_file_a_node_holds_open(make_mount, file_bucket: Bucket, pg_url: str,
                                                                   postgres_server) -> None:
    """The holds of open files are not WAL-logged: a crash of the server empties them. A file
    open on A and unlinked on B right after the restart keeps its inode until A lets go, and
    one nobody holds goes too, once every node has registered its holds again."""
    opts = ["--meta", pg_url, "--metrics-addr", "off", "--session-timeout", "30"]  # a heartbeat every 10 s
    a = make_mount(file_bucket, name="node-a", cache="cache-a", extra=opts).mount()
    b = make_mount(file_bucket, name="node-b", cache="cache-b", extra=opts).mount()
    data = os.urandom(3 << 20)
    write_synced(a.path / "held.sst", data)
    write_synced(a.path / "loose.sst", os.urandom(100_000))
    held, loose = (os.stat(a.path / name).st_ino for name in ("held.sst", "loose.sst"))
    with open(a.path / "held.sst", "rb") as f:
        postgres_server.stop("immediate")
        postgres_server.start()
        os.unlink(b.path / "held.sst")  # before A's next heartbeat registers its holds again
        os.unlink(b.path / "loose.sst")
        assert inode_row(pg_url, held) == (0, len(data))
        assert f.read() == data
    wait_for(lambda: inode_row(pg_url, held) is None and inode_row(pg_url, loose) is None, timeout=60,
             what="both files deleted once the holds are whole again")
    assert os.listdir(a.path) == []
    a.umount()
    b.umount()
    assert shared_fsck(file_bucket, pg_url) == []


def metric(addr: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    (value,) = [float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")]
    return value


WRITE_AND_FSYNC = """
import errno, os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)
os.write(fd, b"state")
print("wrote", flush=True)
try:
    os.fsync(fd)
    print("ok", flush=True)
except OSError as exc:
    print(errno.errorcode[exc.errno], flush=True)
os.close(fd)
"""


def test_an_fsync_held_for_a_missing_synchronous_standby_fails_after_the_budget_and_says_why(
        own_server: LocalPostgres, make_mount, file_bucket: Bucket) -> None:
    """A primary that names a synchronous standby it does not have (a standby promoted after
    a failover keeps the old primary's ``synchronous_standby_names``) holds every durable
    commit without end, while it takes connections. An fsync then waits, and the process
    that called it cannot be stopped. Here it fails with EIO once it has waited
    --meta-outage-budget; meanwhile the status, a metric and the log say why; once the
    setting is cleared, fsync works again and nothing is lost."""
    url = own_server.create_database("standby")
    m = make_mount(file_bucket, extra=["--meta", url, "--metrics-addr", "127.0.0.1:0",
                                       "--meta-outage-budget", "8"]).mount()
    addr = m.status()["metrics_addr"]

    def standby_names(value: str) -> None:
        with psycopg.connect(own_server.url(), autocommit=True) as admin:
            admin.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{value}'")
            admin.execute("SELECT pg_reload_conf()")

    standby_names("*")
    try:
        # In a process of its own: a process forked here (fusestate status) while this one
        # had the file open would close it, and wait for the daemon's answer to that.
        writer = subprocess.Popen([sys.executable, "-c", WRITE_AND_FSYNC, str(m.path / "f")],
                                  stdout=subprocess.PIPE, text=True)
        wait_for(lambda: m.status()["session"]["standby_wait_seconds"] > 0, timeout=20,
                 what="the status to show the held commit")
        said = status_of(m).stdout
        assert "WAITING FOR A SYNCHRONOUS STANDBY" in said and "synchronous_standby_names = '*'" in said, said
        assert metric(addr, "fusestate_meta_standby_wait_seconds") > 0
        out, _ = writer.communicate(timeout=60)
        assert out.split() == ["wrote", "EIO"]
        assert metric(addr, "fusestate_meta_standby_waits_failed_total") >= 1
        log = (m.cache_dir / "fusestate.log").read_text()
        assert "waiting for a synchronous standby" in log and "Traceback" not in log
    finally:
        standby_names("")
    fd = os.open(m.path / "f", os.O_RDWR)
    try:
        os.fsync(fd)
        assert os.pread(fd, 100, 0) == b"state"
    finally:
        os.close(fd)
    m.umount()
    m.mount()
    assert (m.path / "f").read_bytes() == b"state"
