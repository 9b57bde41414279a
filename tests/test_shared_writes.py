"""The write path of a shared volume: a written block goes from memory to the bucket before
its commit, and nothing of it is staged on the cache disk, also while the bucket fails."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

from conftest import Bucket, Mount, wait_for

MiB = 1 << 20
OPTS = ["--metrics-addr", "off", "--session-timeout", "3"]


def staged(m: Mount) -> list[str]:
    """Block files in the node's staging area (temp files included: a block being staged)."""
    staging = m.cache_dir / "staging"
    return sorted(os.listdir(staging)) if staging.exists() else []


def bucket_blocks(bucket: Bucket) -> set[str]:
    root = Path(bucket.url.removeprefix("file://")) / "blocks"
    return {p.name for p in root.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")}


def fsync_in_thread(path: Path, data: bytes) -> tuple[threading.Thread, list[Optional[BaseException]]]:
    outcome: list[Optional[BaseException]] = []

    def run() -> None:
        try:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, outcome


def test_a_large_file_goes_to_the_bucket_from_memory(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    """Uploads slowed to a second each: while the fsync waits for them, the node's staging
    area holds nothing, and once it returns a second node reads the file from the bucket.
    The full blocks are not kept in the writer's disk cache either (a file:// bucket)."""
    a = make_mount(file_bucket, name="node-a", cache="cache-a", extra=["--meta", pg_url, *OPTS]).mount(
        env={"FUSESTATE_FAULTS": "pause=1.0,ops=put,under=blocks/"})
    b = make_mount(file_bucket, name="node-b", cache="cache-b", extra=["--meta", pg_url, *OPTS]).mount()
    data = os.urandom(14 * MiB + 12345)  # three full blocks and a tail
    t, outcome = fsync_in_thread(a.path / "big.sst", data)
    seen: set[str] = set()
    while t.is_alive():
        seen.update(staged(a))
        time.sleep(0.05)
    t.join()
    assert outcome == [None]
    assert not seen, f"blocks staged on the cache disk: {seen}"
    assert len(bucket_blocks(file_bucket)) == 4
    assert a.status()["writeback"]["uploaded_blocks"] == 4
    assert (b.path / "big.sst").read_bytes() == data
    # A file:// bucket is as quick as the cache disk: the full blocks are not copied there.
    time.sleep(0.5)
    copies = [p.name for p in a.cache_dir.rglob("*") if p.is_file() and p.stat().st_size >= 4 * MiB]
    assert not copies, copies


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """The bucket's blocks directory refuses writes (EROFS, which the remote store retries,
    as it does a bucket that is down) until the block ends."""
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@pytest.mark.slow  # two retry budgets of the remote store: about 30 s
def test_a_failing_bucket_fails_fsync_and_loses_nothing(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    """Every upload fails through its whole retry budget: the fsync fails with EIO, nothing is
    staged meanwhile (the blocks wait in memory). Once the bucket is back, an fsync of the
    same file succeeds (Linux reports a failed writeback once, so at most one more EIO
    first), and a second node, and the first after a restart on an empty cache, read the
    bytes intact."""
    a = make_mount(file_bucket, name="node-a", cache="cache-a", extra=["--meta", pg_url, *OPTS]).mount()
    blocks = Path(file_bucket.url.removeprefix("file://")) / "blocks"
    blocks.mkdir(parents=True, exist_ok=True)
    data = os.urandom(8 * MiB + 4321)
    fd = os.open(a.path / "state.sst", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with read_only(blocks):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            with pytest.raises(OSError) as failed:
                os.fsync(fd)
            assert failed.value.errno == errno.EIO
            assert not staged(a)
            assert a.status()["remote"]["retries"] > 0
        for attempt in range(3):
            try:
                os.fsync(fd)
                break
            except OSError as exc:
                assert exc.errno == errno.EIO and attempt == 0, exc
    finally:
        os.close(fd)
    assert not staged(a)
    b = make_mount(file_bucket, name="node-b", cache="cache-b", extra=["--meta", pg_url, *OPTS]).mount()
    assert (b.path / "state.sst").read_bytes() == data
    a.umount()
    a.wipe_cache()
    a.mount()
    assert (a.path / "state.sst").read_bytes() == data
    wait_for(lambda: not staged(a), timeout=5, what="an empty staging area")


# Writes a file of the given MiB of urandom in 1 MiB writes, then fsyncs it. A process of its
# own: a thread of the test's would share the open file with every `fusestate status` child,
# whose closing of inherited descriptors flushes the file and waits for the stalled writeback.
_WRITER = """
import errno, os, sys
path, mib = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
for _ in range(mib):
    os.write(fd, os.urandom(1 << 20))
    print("wrote", flush=True)
for attempt in range(3):  # the failed uploads are reported once (EIO), then the retry succeeds
    try:
        os.fsync(fd)
        break
    except OSError as exc:
        if exc.errno != errno.EIO or attempt:
            raise
os.close(fd)
print("synced", flush=True)
"""


@pytest.mark.slow  # one retry budget of the remote store and more: about 40 s
def test_writers_wait_for_a_failing_bucket_instead_of_filling_memory(make_mount, file_bucket: Bucket,
                                                                     pg_url: str) -> None:
    """While every upload fails, a writer past --max-dirty waits while the blocks are retried
    (a failed block is dirty again and sealed again within the 5 s expiry): the node's memory
    holds about --max-dirty and no more (nothing is staged on a shared volume, so memory is
    all there is). Once the bucket is back, the writer goes on and a second node reads the
    file it wrote."""
    a = make_mount(file_bucket, name="node-a", cache="cache-a",
                   extra=["--meta", pg_url, "--max-dirty", "16M", *OPTS]).mount()
    blocks = Path(file_bucket.url.removeprefix("file://")) / "blocks"
    blocks.mkdir(parents=True, exist_ok=True)
    mib = 160
    most = 0
    with read_only(blocks):
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(a.path / "big.sst"), str(mib)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30  # past the first failed uploads and the 5 s expiry after them
            while time.monotonic() < deadline:
                most = max(most, a.status()["writeback"]["dirty_bytes"])
                time.sleep(0.2)
            assert writer.poll() is None, "the writer never waited"
            assert not staged(a)
        except BaseException:
            writer.kill()
            raise
    bound = 16 * MiB + 16 * 4 * MiB  # --max-dirty, and the blocks being sealed at most
    assert most <= bound, f"{most / MiB:.0f} MiB dirty in memory with --max-dirty 16M"
    out, _ = writer.communicate(timeout=180)
    assert writer.returncode == 0 and out.split()[-1] == "synced"
    b = make_mount(file_bucket, name="node-b", cache="cache-b", extra=["--meta", pg_url, *OPTS]).mount()
    assert os.path.getsize(b.path / "big.sst") == mib * MiB
    assert (b.path / "big.sst").read_bytes() == (a.path / "big.sst").read_bytes()
