"""Whole volumes end to end: crashes, node loss, the journal prefix, lazy restore, the lease,
RocksDB checkpoints, gc and fsck, on real mounts against real buckets.

What a user checks is what these tests check: the files they fsynced, what
``fusestate fsck`` and ``fusestate gc`` say, whether a second mount is let in.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from conftest import (Bucket, Mount, assert_one_line_error, block_key, block_keys, digest, fusestate, is_mounted, new_bucket,
                      resident_bytes, wait_for)

MiB = 1 << 20
GiB = 1 << 30
BLOCK = 4 * MiB


# --- helpers -------------------------------------------------------------------------------

def rand(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)








def write_file(path: Path, data: bytes, fsync: bool = False) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def endpoint_args(bucket: Bucket) -> list[str]:
    return ["--endpoint-url", bucket.endpoint] if bucket.endpoint else []


def fsck(bucket: Bucket, *flags: str) -> tuple[int, dict]:
    """``fusestate fsck URL --json``: exit code and report."""
    proc = fusestate("fsck", bucket.url, *endpoint_args(bucket), "--json", *flags, check=False, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def assert_healthy(bucket: Bucket, *flags: str) -> dict:
    code, report = fsck(bucket, *flags)
    assert report["missing"] == [], report
    assert report["corrupt"] == [], report
    assert report["broken_restore_points"] == [], report
    assert report["healthy"] and code == 0, report
    return report


def delete_block(bucket: Bucket, key: str) -> None:
    """Remove one block object behind the volume's back."""
    fs = bucket.filesystem()
    fs.rm_file(f"{bucket.root()}/blocks/{key[:2]}/{key}")
    assert key not in bucket.block_objects()


def assert_refused_naming(proc: subprocess.CompletedProcess, mount: Mount, holder: str) -> str:
    """A second read-write mount is refused: non-zero exit, one line that names the holder."""
    line = assert_one_line_error(proc, holder, "--takeover")
    assert not is_mounted(mount.path)
    return line


def check_durable(m: Mount, durable: dict[str, str]) -> None:
    """Every file whose fsync returned has exactly the bytes it had then."""
    wrong = {name: "missing" for name in durable if not (m.path / name).is_file()}
    wrong.update({name: "changed" for name in durable if name not in wrong and digest(m.path / name) != durable[name]})
    assert not wrong, f"{len(wrong)} of {len(durable)} fsynced files lost or changed: {sorted(wrong.items())[:10]}"


# --- a writer that keeps going until its daemon is killed ------------------------------------

# Runs as its own process: every operation goes through a directory fd opened on the mount,
# so once the daemon is gone nothing lands in the directory under the mountpoint. Each
# successful fsync is logged (to local disk) before the next operation, as is every
# rename or delete of such a file before it is issued.
WRITER = r'''
import errno, hashlib, json, os, random, sys, time
root, log_path, tag, seed, duration, mode, on_eio = sys.argv[1:8]
seed, duration, churn = int(seed), float(duration), mode == "churn"
rng = random.Random(seed)
MiB = 1 << 20
SIZES = [0, 1, 4095, 100_000, 4 * MiB - 1, 4 * MiB, 4 * MiB + 1, 9 * MiB + 3]
if churn:  # many small files: many metadata changes, few blocks in flight
    SIZES = [0, 1, 4095, 100_000, 300_000, 1_000_000, 4 * MiB + 1]
log = open(log_path, "a")
def note(**entry):
    log.write(json.dumps(entry) + "\n")
    log.flush()
rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
names, stats, i = [], {"written": 0, "fsynced": 0, "deleted": 0, "renamed": 0, "eio": 0}, 0
end = "finished"
for d in range(4):
    try:
        os.mkdir(f"d{d}", dir_fd=rootfd)
    except FileExistsError:
        pass
note(op="ready", tag=tag)
deadline = time.monotonic() + duration
while time.monotonic() < deadline:
    i += 1
    try:
        r = rng.random()
        if churn and names and r < 0.15:
            name = names.pop(rng.randrange(len(names)))
            note(op="forget", name=name)
            os.unlink(name, dir_fd=rootfd)
            stats["deleted"] += 1
            continue
        if churn and names and r < 0.3:
            name = names.pop(rng.randrange(len(names)))
            new = f"d{rng.randrange(4)}/{tag}-r{i:05d}"
            note(op="forget", name=name)
            os.rename(name, new, src_dir_fd=rootfd, dst_dir_fd=rootfd)
            names.append(new)
            stats["renamed"] += 1
            continue
        name = f"d{rng.randrange(4)}/{tag}-f{i:05d}"
        size = rng.choice(SIZES) if churn or rng.random() < 0.7 else rng.randrange(10 * MiB)
        data = rng.randbytes(size)
        sync = rng.random() < (0.15 if churn else 0.5)  # under faults each fsync takes seconds
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=rootfd)
        names.append(name)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            stats["written"] += 1
            if sync:
                os.fsync(fd)
                note(op="durable", name=name, sha=hashlib.sha256(data).hexdigest(), size=size)
                stats["fsynced"] += 1
        finally:
            os.close(fd)
    except OSError as exc:
        try:
            os.fstatvfs(rootfd)
            alive = True
        except OSError:
            alive = False
        if not alive:
            end = f"interrupted ({errno.errorcode.get(exc.errno, exc.errno)})"
            break
        if on_eio == "tolerate" and exc.errno == errno.EIO:
            stats["eio"] += 1  # the bucket failed past the retry budget; the mount lives on
            continue
        raise
print(json.dumps(dict(stats, end=end)))
'''


def start_writer(m: Mount, log: Path, tag: str, seed: int, duration: float, mode: str,
                 faults: bool) -> subprocess.Popen:
    """``mode`` plain: new files, half of them fsynced; churn: also renames and deletes."""
    return subprocess.Popen([sys.executable, "-c", WRITER, str(m.path), str(log), tag, str(seed), str(duration),
                             mode, "tolerate" if faults else "fail"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def durable_files(log: Path) -> dict[str, str]:
    """Files whose last fsync returned and that were not renamed or deleted afterwards."""
    durable: dict[str, str] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if entry["op"] == "durable":
            durable[entry["name"]] = entry["sha"]
        elif entry["op"] == "forget":
            durable.pop(entry["name"], None)
    return durable


def write_until_killed(m: Mount, log: Path, tag: str, seed: int, kill_after: tuple[float, float],
                       modes: tuple[str, ...] = ("plain",), faults: bool = False) -> list[dict]:
    """Run writers (one per mode), SIGKILL the daemon after a seeded random delay while they
    write; return their summaries."""
    tags = [f"{tag}{mode[0]}" for mode in modes]
    procs = [start_writer(m, log, t, seed * 10 + i, 120, mode, faults) for i, (t, mode) in enumerate(zip(tags, modes))]
    try:
        wait_for(lambda: log.exists() and all(f'"tag": "{t}"' in log.read_text() for t in tags), timeout=30,
                 what="the writers to start")
        time.sleep(random.Random(seed).uniform(*kill_after))
        m.kill()
        results = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    summaries = []
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["end"].startswith("interrupted"), summary  # the kill came while it was writing
        summaries.append(summary)
    return summaries


# --- 1. crash: every fsynced file survives a SIGKILL ------------------------------------------

@pytest.mark.parametrize("durability", ["local", "remote"])
# One seed by default; more kill points with -m slow.
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_sigkill_keeps_every_fsynced_file(make_mount, file_bucket: Bucket, tmp_path: Path,
                                          durability: str, seed: int) -> None:
    m: Mount = make_mount(file_bucket, extra=["--durability", durability]).mount()
    log = tmp_path / "writer.jsonl"
    summary = write_until_killed(m, log, "w", seed, kill_after=(1.0, 3.0))
    durable = durable_files(log)
    assert durable, summary

    # Right after the crash the bucket already holds a consistent prefix of the history.
    assert_healthy(file_bucket, "--quick", "--all-restore-points")

    m.mount()  # same cache dir: staged blocks and local metadata are picked up
    check_durable(m, durable)
    m.umount()
    assert_healthy(file_bucket)


# --- 2. node loss: the cache dir is gone too ------------------------------------------------

def _node_loss(make_mount, bucket: Bucket, tmp_path: Path, seed: int) -> None:
    m: Mount = make_mount(bucket).mount()  # --durability remote is the default
    before = m.status()["lease"]
    log = tmp_path / "writer.jsonl"
    summary = write_until_killed(m, log, "w", seed, kill_after=(1.5, 3.5))
    durable = durable_files(log)
    assert durable, summary
    m.wipe_cache()  # the node is gone: only the bucket is left

    # The dead holder's lease has not expired: a plain mount is refused, naming it.
    assert_refused_naming(m.try_mount(), m, before["holder"])
    m.mount("--takeover")
    after = m.status()["lease"]
    assert after["epoch"] > before["epoch"] and after["holder"] != before["holder"], (before, after)
    assert m.status()["metadata"]["restored_bytes"] > 0
    check_durable(m, durable)
    m.umount()
    assert_healthy(bucket)


# file:// by default: nothing above the remote store knows the backend, and the store's calls
# a node loss makes on S3 and GCS are made by test_one_writer_at_a_time and test_backends too.
@pytest.mark.parametrize("backend", ["file", pytest.param("s3", marks=pytest.mark.slow),
                                     pytest.param("gs", marks=pytest.mark.slow)])
def test_node_loss_keeps_every_fsynced_file(make_mount, tmp_path: Path, request: pytest.FixtureRequest,
                                            backend: str) -> None:
    _node_loss(make_mount, new_bucket(backend, tmp_path, request), tmp_path, seed=11)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [21, 22, 23, 24])
@pytest.mark.parametrize("backend", ["file", "s3", "gs"])
def test_node_loss_more_seeds(make_mount, tmp_path: Path, request: pytest.FixtureRequest,
                              backend: str, seed: int) -> None:
    _node_loss(make_mount, new_bucket(backend, tmp_path, request), tmp_path, seed)


# --- 3. the bucket holds a consistent prefix, even under a failing bucket ----------------------

def _prefix_under_faults(make_mount, bucket: Bucket, tmp_path: Path, seed: int, sessions: int,
                         kill_after: tuple[float, float], error_rate: float) -> None:
    # Uploads of blocks, journal segments and leases fail at error_rate (then are retried with
    # backoff, about a second each), after up to 50 ms: they finish out of order and late.
    faults = {"FUSESTATE_FAULTS": f"error_rate={error_rate},delay=0.05,ops=put,seed={seed}"}
    m: Mount = make_mount(bucket, extra=["--journal-interval", "0.2", "--upload-delay", "0.2"])
    log = tmp_path / "writer.jsonl"
    summaries = []
    for session in range(sessions):
        m.mount(env=faults)
        summaries += write_until_killed(m, log, f"s{session}", seed * 100 + session, kill_after,
                                        modes=("churn", "plain"), faults=True)
    assert sum(s["deleted"] + s["renamed"] for s in summaries) > 0, summaries
    durable = durable_files(log)  # fsynced, then neither renamed nor deleted
    assert durable, summaries

    # Every restore point (the snapshot and each journal segment after it) references only
    # blocks that are in the bucket.
    report = assert_healthy(bucket, "--quick", "--all-restore-points")
    assert report["restore_points"] >= 3, report
    print(f"prefix under faults: {report['restore_points']} restore points checked, "
          f"{len(durable)} files durable, writers: {summaries}")

    # A new node restores all of it (no faults now).
    shutil.copy(m.cache_dir / "fusestate.log", tmp_path / "faulty-sessions.log")
    m.wipe_cache()
    m.mount("--takeover")
    check_durable(m, durable)
    biggest = max((p for p in m.path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    assert biggest.stat().st_size > 0
    victim = sorted(block_keys(biggest.read_bytes()))[0]  # referenced by the newest restore point
    m.umount()
    report = assert_healthy(bucket, "--all-restore-points")

    # The check can fail: one referenced block gone by hand is reported, with the restore points.
    delete_block(bucket, victim)
    code, broken = fsck(bucket, "--quick", "--all-restore-points")
    assert code == 1 and not broken["healthy"], broken
    assert broken["missing"] == [victim], broken
    assert broken["broken_restore_points"], broken


def test_bucket_holds_a_consistent_prefix_under_faults(make_mount, file_bucket: Bucket, tmp_path: Path) -> None:
    _prefix_under_faults(make_mount, file_bucket, tmp_path, seed=7, sessions=2, kill_after=(6.0, 9.0),
                         error_rate=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [31, 32, 33])
def test_bucket_holds_a_consistent_prefix_under_faults_longer(make_mount, file_bucket: Bucket, tmp_path: Path,
                                                              seed: int) -> None:
    _prefix_under_faults(make_mount, file_bucket, tmp_path, seed=seed, sessions=4, kill_after=(8.0, 15.0),
                         error_rate=0.3)


# --- 4. lazy restore: a fresh node fetches metadata, not data -----------------------------------

def _lazy_volume(make_mount, tmp_path: Path, size: int, record: Callable[[str, object], None]) -> dict:
    """A volume of one ``size``-byte file made of one repeated 4 MiB block (plus a short tail);
    mounted on an empty cache dir: what did the mount fetch, how long until it answered?"""
    label = f"{size / GiB:g}GiB"
    path = tmp_path / f"bucket-{label}"
    path.mkdir()
    bucket = Bucket("file", f"file://{path}")
    block = rand(BLOCK, 40)
    tail = rand(12345, 41)
    build = make_mount(bucket, name=f"build-{label}", cache=f"build-cache-{label}").mount()
    with open(build.path / "big", "wb") as f:
        for _ in range(size // BLOCK):
            f.write(block)
        f.write(tail)
    build.umount()
    assert bucket.block_objects() == {block_key(block), block_key(tail)}  # dedup: two objects for all of it

    fresh = make_mount(bucket, name=f"mnt-{label}", cache=f"cache-{label}")
    started = time.monotonic()
    fresh.mount()
    ready = time.monotonic() - started
    st = fresh.status()
    restored, bytes_in = st["metadata"]["restored_bytes"], st["remote"]["bytes_in"]
    total = size + len(tail)
    # Metadata only: a tiny fraction of the data, less than one block.
    assert 0 < restored <= bytes_in < min(total // 1000, BLOCK), st["metadata"]
    assert st["remote"]["full_fetches"] == 0 and st["remote"]["range_reads"] == 0, st["remote"]

    # The data is there on demand.
    assert (fresh.path / "big").stat().st_size == total
    fd = os.open(fresh.path / "big", os.O_RDONLY)
    try:
        for offset, length in ((0, 4096), (MiB + 7, 65536), (BLOCK - 3, 10), (size // 2 + 12345, 100_000),
                               (size - BLOCK, BLOCK), (size - 100, 100 + len(tail))):
            expected = b"".join(block if i < size // BLOCK else tail
                                for i in range(offset // BLOCK, (offset + length - 1) // BLOCK + 1))
            start = offset - (offset // BLOCK) * BLOCK
            assert os.pread(fd, length, offset) == expected[start:start + length], (offset, length)
    finally:
        os.close(fd)
    fetched = fresh.status()["remote"]["bytes_in"] - bytes_in
    assert fetched < 3 * BLOCK, fetched  # the one block (and the tail), not the file
    fresh.umount()

    result = {"size": total, "restored_bytes": restored, "bytes_in_at_ready": bytes_in,
              "time_to_ready_s": round(ready, 3), "bytes_fetched_by_reads": fetched}
    record(f"lazy_restore_{label}", result)
    print(f"lazy restore {label}: {json.dumps(result)}")
    return result


def _lazy_restore(make_mount, tmp_path: Path, record_property, big: int) -> None:
    small = _lazy_volume(make_mount, tmp_path, GiB // 2, record_property)
    large = _lazy_volume(make_mount, tmp_path, big, record_property)
    # More data means more block-map rows, but nowhere near proportionally more bytes at mount.
    assert large["bytes_in_at_ready"] < small["bytes_in_at_ready"] * (big / (GiB // 2)), (small, large)


def test_lazy_restore_fetches_metadata_only(make_mount, tmp_path: Path, record_property) -> None:
    _lazy_restore(make_mount, tmp_path, record_property, 2 * GiB)


@pytest.mark.slow
def test_lazy_restore_fetches_metadata_only_8g(make_mount, tmp_path: Path, record_property) -> None:
    _lazy_restore(make_mount, tmp_path, record_property, 8 * GiB)


def _warm_volume(make_mount, tmp_path: Path, old_blocks: int = 8, new_blocks: int = 4,
                 tag: str = "warm") -> tuple[Bucket, bytes, bytes]:
    """A volume with an older file and a newer one (8 and 4 blocks), every block distinct."""
    path = tmp_path / f"bucket-{tag}"
    path.mkdir()
    bucket = Bucket("file", f"file://{path}")
    old, new = rand(old_blocks * BLOCK, 50), rand(new_blocks * BLOCK, 51)
    build = make_mount(bucket, name=f"build-{tag}", cache=f"build-cache-{tag}").mount()
    (build.path / "old").write_bytes(old)
    os.utime(build.path / "old", (time.time() - 3600, time.time() - 3600))
    (build.path / "new").write_bytes(new)
    build.umount()
    return bucket, old, new


def _settled_warmup(m: Mount, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = m.status()
        if st["warmup"]["state"] in ("done", "failed"):
            return st
        assert time.monotonic() < deadline, st["warmup"]
        time.sleep(0.1)


def test_warmup_after_mount_fetches_newest_files_first_within_budget(make_mount, tmp_path: Path) -> None:
    """A fresh node warms its cache in the background: the newest file first, then as much of
    the older one as half the disk cache allows, and reads of warmed blocks fetch nothing."""
    bucket, old, new = _warm_volume(make_mount, tmp_path)
    # 64 MiB cache: 16 MiB for dirty data, a 48 MiB read cache, so a 24 MiB (6-block) budget.
    # No readahead of our own: the reads below must touch only the blocks they name.
    m = make_mount(bucket, name="mnt-warm", cache="cache-warm").mount("--cache-size", "64M", "--prefetch", "recent",
                                                                      "--readahead", "0")
    st = _settled_warmup(m)
    warm = st["warmup"]
    assert warm["state"] == "done" and warm["mode"] == "recent" and warm["budget_bytes"] == 24 * MiB, warm
    assert warm["fetched_blocks"] == 6 and warm["fetched_bytes"] == 6 * BLOCK and warm["failures"] == 0, warm
    assert st["cache"]["memory_bytes"] == 0  # warming keeps blocks on disk, not in the memory cache
    entries = list((m.cache_dir / "blocks").rglob("*.val"))
    assert len(entries) >= 6 and resident_bytes(entries) < BLOCK  # ...and not in the page cache either
    before = st["remote"]["bytes_in"]
    assert (m.path / "new").read_bytes() == new
    fd = os.open(m.path / "old", os.O_RDONLY)
    try:  # the old file's first two blocks, clear of the kernel's readahead into the third
        assert os.pread(fd, BLOCK, 0) == old[:BLOCK]
        assert os.pread(fd, BLOCK // 2, BLOCK + 12345) == old[BLOCK + 12345:BLOCK + 12345 + BLOCK // 2]
    finally:
        os.close(fd)
    assert m.status()["remote"]["bytes_in"] == before  # all of it was warm
    with open(m.path / "old", "rb") as f:
        f.seek(7 * BLOCK)
        assert f.read() == old[7 * BLOCK:]
    assert m.status()["remote"]["bytes_in"] > before  # past the budget: on demand
    m.umount()


def test_warmup_modes_all_and_off(make_mount, tmp_path: Path) -> None:
    bucket, old, new = _warm_volume(make_mount, tmp_path)
    # 128 MiB cache: a 96 MiB read cache, of which 'all' warms up to 90%, so the whole 48 MiB volume.
    m = make_mount(bucket, name="mnt-all", cache="cache-all").mount("--cache-size", "128M", "--prefetch")
    warm = _settled_warmup(m)["warmup"]
    assert warm["mode"] == "all" and warm["fetched_blocks"] == 12, warm
    before = m.status()["remote"]["bytes_in"]
    assert (m.path / "old").read_bytes() == old and (m.path / "new").read_bytes() == new
    assert m.status()["remote"]["bytes_in"] == before
    m.umount()

    off = make_mount(bucket, name="mnt-off", cache="cache-off").mount("--prefetch", "off")
    time.sleep(1)
    st = off.status()
    assert st["warmup"]["mode"] == "off" and st["warmup"]["fetched_bytes"] == 0, st["warmup"]
    assert st["remote"]["full_fetches"] == 0 and st["remote"]["bytes_in"] < BLOCK, st["remote"]
    off.umount()


def test_warmup_skips_blocks_deleted_after_the_mount(make_mount, tmp_path: Path) -> None:
    """A restarted job that clears a killed run's scratch files right after the mount: warming
    fetches none of their blocks it has not started yet, and still warms the rest."""
    # "new" is the killed run's scratch: the newest file, first in line.
    bucket, state, _ = _warm_volume(make_mount, tmp_path, old_blocks=4, new_blocks=24, tag="skip")
    # Every fetch waits up to a second, so warming the 28 blocks four at a time takes seconds.
    slow = {"FUSESTATE_FAULTS": "delay=1.0,ops=get,seed=3"}
    m = make_mount(bucket, name="mnt-skip", cache="cache-skip").mount("--cache-size", "512M", "--prefetch",
                                                                      env=slow)
    (m.path / "new").unlink()
    warm = _settled_warmup(m, timeout=120)["warmup"]
    assert warm["state"] == "done" and warm["failures"] == 0, warm
    assert warm["skipped_deleted_blocks"] >= 8, warm
    assert warm["fetched_blocks"] + warm["skipped_deleted_blocks"] == 28, warm
    before = m.status()["remote"]["bytes_in"]
    assert (m.path / "old").read_bytes() == state
    assert m.status()["remote"]["bytes_in"] == before  # the live file was warmed all the same
    m.umount()


# --- 5. the lease: one writer, read-only readers, takeover, fencing -----------------------------

def _one_writer(make_mount, bucket: Bucket) -> None:
    writer: Mount = make_mount(bucket, name="writer", cache="writer-cache").mount()
    files = {f"f{i}": rand(100_000 * i + 1, 50 + i) for i in range(3)}
    for name, data in files.items():
        write_file(writer.path / name, data, fsync=True)
    write_file(writer.path / "unsynced", b"x" * 1000)  # may or may not be shipped yet: not checked
    holder = writer.status()["lease"]["holder"]

    second = make_mount(bucket, name="second", cache="second-cache")
    assert_refused_naming(second.try_mount(), second, holder)

    reader = make_mount(bucket, name="reader", cache="reader-cache").mount("--read-only")
    assert reader.status()["lease"]["state"] == "read-only"
    for name, data in files.items():
        assert (reader.path / name).read_bytes() == data, name
    with pytest.raises(OSError) as exc:
        write_file(reader.path / "nope", b"x")
    assert exc.value.errno == errno.EROFS
    reader.umount()
    lease = writer.status()["lease"]
    assert (lease["holder"], lease["state"]) == (holder, "held"), lease  # readers take no lease

    # A clean unmount lets the next node in at once.
    writer.umount()
    second.mount()
    for name, data in files.items():
        assert (second.path / name).read_bytes() == data, name
    second.umount()


@pytest.mark.parametrize("backend", ["file", "s3", "gs"])
def test_one_writer_at_a_time(make_mount, tmp_path: Path, request: pytest.FixtureRequest, backend: str) -> None:
    _one_writer(make_mount, new_bucket(backend, tmp_path, request))


LATE_WRITER = r'''
import json, os, sys
root = sys.argv[1]
result = {}
try:
    fd = os.open(os.path.join(root, "late"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"written by a holder that was fenced off" * 1000)
        os.fsync(fd)
        result["late_fsync"] = "ok"
    finally:
        os.close(fd)
except OSError as exc:
    result["late_fsync"] = exc.strerror
try:
    os.unlink(os.path.join(root, "a0"))
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    result["late_unlink"] = "ok"
except OSError as exc:
    result["late_unlink"] = exc.strerror
print(json.dumps(result))
'''


def _takeover_and_fencing(make_mount, bucket: Bucket, record_property) -> None:
    a: Mount = make_mount(bucket, name="a", cache="a-cache").mount()
    files = {f"a{i}": rand(300_000 * i + 7, 60 + i) for i in range(3)}
    for name, data in files.items():
        write_file(a.path / name, data, fsync=True)
    lease_a = a.status()["lease"]

    # The holder dies; its lease is still fresh, so only --takeover gets in.
    a.kill()
    b: Mount = make_mount(bucket, name="b", cache="b-cache")
    assert_refused_naming(b.try_mount(), b, lease_a["holder"])
    b.mount("--takeover")
    lease_b = b.status()["lease"]
    assert lease_b["epoch"] > lease_a["epoch"] and lease_b["state"] == "held", (lease_a, lease_b)
    for name, data in files.items():
        assert (b.path / name).read_bytes() == data, name
    files["b0"] = rand(5 * MiB + 3, 70)
    write_file(b.path / "b0", files["b0"], fsync=True)

    # B hangs (SIGSTOP), C takes over; then B wakes up and writes as if nothing happened.
    c: Mount = make_mount(bucket, name="c", cache="c-cache")
    b_pid = b.pid
    assert b_pid
    os.kill(b_pid, signal.SIGSTOP)
    try:
        c.mount("--takeover")
        lease_c = c.status()["lease"]
        assert lease_c["epoch"] > lease_b["epoch"], (lease_b, lease_c)
        for name, data in files.items():
            assert (c.path / name).read_bytes() == data, name
        files["c0"] = rand(2 * MiB + 11, 71)
        write_file(c.path / "c0", files["c0"], fsync=True)

        os.kill(b_pid, signal.SIGCONT)
        late = subprocess.run([sys.executable, "-c", LATE_WRITER, str(b.path)], capture_output=True,
                              text=True, timeout=120)
        assert late.returncode == 0, late.stderr
        outcome = json.loads(late.stdout)
        seen = fusestate("status", "--json", str(b.path), check=False)
        late_state = json.loads(seen.stdout)["lease"]["state"]
        # A fenced holder says so: a probe on `fusestate status` restarts it.
        assert (late_state, seen.returncode) in (("held", 0), ("lost", 1)), (late_state, seen.returncode)
        if late_state == "lost":
            assert fusestate("status", str(b.path), check=False).stdout.startswith("LEASE LOST")
    finally:
        with_suppress_lookup(lambda: os.kill(b_pid, signal.SIGCONT))
        b.kill()
    late_segments = [k for k in _meta_keys(bucket) if k.startswith(f"meta/journal/{lease_b['epoch']:08d}-")]
    record_property("fencing", {"late": outcome, "old_holder_state": late_state,
                                "old_epoch_segments": len(late_segments)})
    print(f"fencing: late writes {outcome}, old holder's lease state {late_state!r}, "
          f"{len(late_segments)} journal segments of its epoch in the bucket")

    c.umount()
    fresh: Mount = make_mount(bucket, name="fresh", cache="fresh-cache").mount()
    assert fresh.status()["metadata"]["restored_bytes"] > 0
    present = sorted(p.name for p in fresh.path.iterdir())
    assert present == sorted(files), present  # no "late"; "a0" not deleted
    for name, data in files.items():
        assert (fresh.path / name).read_bytes() == data, name
    fresh.umount()
    assert_healthy(bucket)


def with_suppress_lookup(fn: Callable[[], None]) -> None:
    try:
        fn()
    except ProcessLookupError:
        pass


def _meta_keys(bucket: Bucket) -> list[str]:
    fs = bucket.filesystem()
    root = bucket.root().lstrip("/")
    return [p.lstrip("/")[len(root) + 1:] for p in fs.find(bucket.root() + "/meta")]


def test_a_released_lease_stays_released_when_a_renewal_comes_late(tmp_path: Path) -> None:
    """The heartbeat keeps renewing while an unmount flushes; a renewal landing after the
    release once held the volume for another TTL, and the next mount was refused."""
    import fsspec

    from fusestate.daemon.lease import Lease, read_leases
    from fusestate.remote.store import RemoteStore

    remote = RemoteStore(fsspec.filesystem("file"), str(tmp_path / "bucket"), retries=1, backoff_initial=0.01)
    lease = Lease(remote, "node-a:1", ttl=30)
    lease.acquire(0, False, None)
    lease.renew()
    lease.release()
    lease.renew()  # the heartbeat, late
    (record,) = read_leases(remote)
    assert record.expires_at == 0.0
    nxt = Lease(remote, "node-b:2", ttl=30)
    assert nxt.acquire(0, False, record).epoch == 2  # no "volume is held by" refusal


def test_a_fence_check_vouches_for_a_short_while(tmp_path: Path) -> None:
    """A check that found no newer epoch lets the holder acknowledge what lands within
    FENCE_GRACE of it; after a takeover nothing is vouched for, and a new holder that
    restores first writes its lease without knowing where its journal continues."""
    import fsspec

    from fusestate.daemon.lease import FENCE_GRACE, Lease, epoch_starts, read_leases
    from fusestate.remote.store import RemoteStore

    remote = RemoteStore(fsspec.filesystem("file"), str(tmp_path / "bucket"), retries=1, backoff_initial=0.01)
    old = Lease(remote, "node-a:1", ttl=30)
    old.acquire(0, False, None)
    assert not old.vouches_for(time.monotonic())  # never checked yet
    sent = time.monotonic()
    assert not old.superseded()
    assert old.vouches_for(sent + FENCE_GRACE * 0.9) and not old.vouches_for(sent + FENCE_GRACE * 1.1)

    new = Lease(remote, "node-b:2", ttl=30)
    previous = read_leases(remote)[-1]
    assert Lease.may_still_write(previous)  # not released: the new holder waits before it restores
    new.acquire(None, True, previous)
    assert epoch_starts(read_leases(remote)) == {1: 0}  # restoring: epoch 2 limits nothing yet
    assert old.superseded() and not old.vouches_for(time.monotonic())
    new.settle(17)
    assert epoch_starts(read_leases(remote)) == {1: 0, 2: 17}


def test_fsyncs_in_a_row_ask_the_bucket_about_the_lease_a_few_times_only(make_mount, file_bucket: Bucket) -> None:
    """Each fsync ships a journal segment; a check for a newer epoch after each one would
    add a round trip to every fsync. The mount keeps a recent check instead."""
    m: Mount = make_mount(file_bucket).mount()
    write_file(m.path / "warm", b"x", fsync=True)
    before = m.status()
    started = time.monotonic()
    for i in range(40):
        write_file(m.path / f"f{i}", rand(1000 + i, i), fsync=True)
    elapsed = time.monotonic() - started
    after = m.status()
    segments = after["metadata"]["segments_shipped"] - before["metadata"]["segments_shipped"]
    checks = sum(after["remote"]["requests"].get("head", {}).values()) - \
        sum(before["remote"]["requests"].get("head", {}).values())
    print(f"{segments} segments shipped, {checks} lease checks in {elapsed:.1f} s")
    assert segments >= 40
    assert checks <= elapsed / 0.5 + 3, (segments, checks, elapsed)  # the mount's own, every FENCE_GRACE / 3
    m.umount()


def test_takeover_fences_off_the_old_holder(make_mount, file_bucket: Bucket, record_property) -> None:
    _takeover_and_fencing(make_mount, file_bucket, record_property)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_takeover_fences_off_the_old_holder_remote(make_mount, tmp_path: Path, request: pytest.FixtureRequest,
                                                   record_property, backend: str) -> None:
    _takeover_and_fencing(make_mount, new_bucket(backend, tmp_path, request), record_property)


# --- 6. RocksDB: a checkpoint survives the loss of the node -----------------------------------

def test_rocksdb_checkpoint_survives_node_loss(make_mount, file_bucket: Bucket) -> None:
    rocksdict = pytest.importorskip("rocksdict")
    # Nothing leaves the node unless RocksDB fsyncs it: uploads and journal shipping wait.
    m: Mount = make_mount(file_bucket, extra=["--upload-delay", "60", "--journal-interval", "60"]).mount()
    rng = random.Random(8)
    expected = {f"key-{i:06d}".encode(): rng.randbytes(rng.randint(20, 400)) for i in range(20_000)}
    db = rocksdict.Rdict(str(m.path / "db"))
    try:
        for k, v in expected.items():
            db[k] = v
        rocksdict.Checkpoint(db).create_checkpoint(str(m.path / "ckpt"))
    finally:
        db.close()

    m.kill()
    m.wipe_cache()
    m.mount("--takeover")
    ckpt = rocksdict.Rdict(str(m.path / "ckpt"), access_type=rocksdict.AccessType.read_only())
    try:
        wrong = [k for k, v in expected.items() if ckpt.get(k) != v]
        assert not wrong, f"{len(wrong)} keys wrong, e.g. {wrong[:5]}"
        assert sum(1 for _ in ckpt.keys()) == len(expected)
    finally:
        ckpt.close()
    m.umount()


# --- 7. gc deletes exactly what no restore point references; fsck notices what is missing -----

def _objects_after_gc(bucket: Bucket, *flags: str) -> tuple[str, set[str]]:
    proc = fusestate("gc", bucket.url, *endpoint_args(bucket), *flags)
    return proc.stdout.strip(), bucket.block_objects()


def test_gc_deletes_exactly_the_unreferenced_blocks(make_mount, file_bucket: Bucket) -> None:
    m: Mount = make_mount(file_bucket).mount()
    keep = {"keep_a": rand(3 * BLOCK + 1000, 80), "keep_b": rand(BLOCK, 81)}
    gone = {"del_a": rand(2 * BLOCK + 500, 82),
            "del_b": keep["keep_a"][:BLOCK] + rand(BLOCK, 83),  # its first block is keep_a's
            "del_c": rand(100_000, 84)}
    for name, data in {**keep, **gone}.items():
        write_file(m.path / name, data, fsync=True)  # in the bucket before anything is deleted
    kept_keys = set().union(*(block_keys(d) for d in keep.values()))
    garbage = set().union(*(block_keys(d) for d in gone.values())) - kept_keys
    assert len(garbage) == 5 and len(kept_keys) == 5
    m.umount()  # snapshot 1: everything referenced
    everything = file_bucket.block_objects()
    assert everything == kept_keys | garbage

    m.mount()
    for name in gone:
        os.unlink(m.path / name)
    m.umount()  # snapshot 2; snapshot 1 is still kept and references the deleted files
    out, objects = _objects_after_gc(file_bucket, "--grace", "0")
    assert objects == everything, out
    assert out.startswith("deleted 0 "), out

    m.mount()  # snapshot 3 on the way out: snapshot 1 falls out of the kept ones
    refused = fusestate("gc", file_bucket.url, "--grace", "0", check=False)
    assert refused.returncode != 0 and "mounted by" in refused.stderr, refused
    m.umount()
    assert file_bucket.block_objects() == everything

    out, objects = _objects_after_gc(file_bucket, "--grace", "0", "--dry-run")
    assert objects == everything
    assert out.startswith(f"would delete {len(garbage)} "), out
    out, objects = _objects_after_gc(file_bucket, "--grace", "3600")
    assert objects == everything and f"kept {len(garbage)} younger" in out, out
    out, objects = _objects_after_gc(file_bucket, "--grace", "0")
    assert out.startswith(f"deleted {len(garbage)} "), out
    assert everything - objects == garbage
    assert objects == kept_keys

    report = assert_healthy(file_bucket)
    assert report["referenced"] == len(kept_keys) and report["unreferenced"] == []
    m.wipe_cache()
    m.mount()
    for name, data in keep.items():
        assert (m.path / name).read_bytes() == data, name
    assert sorted(p.name for p in m.path.iterdir()) == sorted(keep)
    m.umount()

    victim = block_key(keep["keep_b"])
    delete_block(file_bucket, victim)
    proc = fusestate("fsck", file_bucket.url, check=False)
    assert proc.returncode == 1, proc
    assert f"MISSING  {victim}" in proc.stdout.splitlines(), proc.stdout
    assert "volume is DAMAGED" in proc.stdout
