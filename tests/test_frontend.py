"""The front ends: which one serves a mount and why; the native ones serve real mounts, and
with passthrough the kernel serves written files' bytes itself (the conformance files run on
pyfuse3 and passthrough: conftest.BOTH_FRONTENDS)."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (ENGINES, Mount, assert_one_line_error, engine_args, is_mounted, native_front_end_missing,
                      wait_for)

from fusestate.errors import UserError
from fusestate.fuse import frontend as frontends

MiB = 1 << 20


def test_auto_picks_pyfuse3_and_names_pick_their_own() -> None:
    assert frontends.choose("auto").name == "pyfuse3"
    assert frontends.choose("pyfuse3").name == "pyfuse3"
    if not native_front_end_missing():
        assert frontends.choose("native") == frontends.Choice("native", "chosen with --frontend native")
    if frontends.passthrough_available() is None:
        assert frontends.choose("passthrough").passthrough
    with pytest.raises(UserError, match="bad --frontend"):
        frontends.choose("libfuse2")


@pytest.mark.parametrize("release, expected", [
    ("6.18.44-fc-v657", (6, 18)), ("6.9.0", (6, 9)), ("5.15.0-91-generic", (5, 15)), ("6.10rc1", (6, 10)),
    ("weird", (0, 0)),
])
def test_kernel_versions_are_read_from_the_release(release: str, expected: tuple[int, int]) -> None:
    assert frontends.kernel_version(release) == expected


def test_passthrough_needs_kernel_6_9() -> None:
    assert "6.8" in (frontends.passthrough_available("6.8.12") or "")
    if os.geteuid() == 0 and not native_front_end_missing():
        assert frontends.passthrough_available("6.18.1") is None


@pytest.mark.parametrize("frontend", ["pyfuse3", "native", "passthrough"], indirect=True)
def test_status_names_the_front_end_and_why(mnt: Mount, frontend: str) -> None:
    fuse = mnt.status()["fuse"]
    assert fuse["frontend"] == frontend
    assert frontend in fuse["frontend_reason"]
    # The kernel takes passthrough or the writeback cache, never both.
    assert fuse["passthrough"] is (frontend == "passthrough")
    assert fuse["writeback_cache"] is (frontend != "passthrough")


@pytest.mark.parametrize("frontend, other", [("pyfuse3", "passthrough"), ("passthrough", "native"),
                                             ("native", "pyfuse3")], indirect=["frontend"])
def test_a_volume_written_on_one_front_end_reads_back_on_another(mnt: Mount, frontend: str, other: str) -> None:
    if other != "pyfuse3" and native_front_end_missing():
        pytest.skip(native_front_end_missing())
    data = os.urandom(3 * 1024 * 1024 + 17)
    (mnt.path / "d").mkdir()
    (mnt.path / "d" / "f").write_bytes(data)
    names = [f"n{i:03d}" for i in range(300)]  # more than one listing reply
    for n in names:
        (mnt.path / "d" / n).write_bytes(n.encode())
    mnt.umount()
    mnt.wipe_cache()  # every byte read back comes from the bucket
    mnt.mount(env={"FUSESTATE_FRONTEND": other})
    assert mnt.status()["fuse"]["frontend"] == other
    assert (mnt.path / "d" / "f").read_bytes() == data
    assert sorted(os.listdir(mnt.path / "d")) == sorted(names + ["f"])
    assert all((mnt.path / "d" / n).read_bytes() == n.encode() for n in names[::37])


def _passthrough_mount(make_mount, file_bucket, *extra: str) -> Mount:
    if missing := frontends.passthrough_available():
        pytest.skip(missing)
    return make_mount(file_bucket, extra=["--frontend", "passthrough", *extra]).mount()


@pytest.mark.parametrize("engine", ENGINES)
def test_passthrough_writes_never_reach_the_daemon_and_land_in_the_bucket(make_mount, file_bucket, engine: str,
                                                                          request: pytest.FixtureRequest) -> None:
    m = _passthrough_mount(make_mount, file_bucket, *engine_args(engine, request))
    data = os.urandom(9 * MiB + 5)
    with open(m.path / "sst", "wb") as f:
        for start in range(0, len(data), 4096):  # small writes: one round trip each without passthrough
            f.write(data[start:start + 4096])
        f.flush()
        os.fsync(f.fileno())
        assert os.fstat(f.fileno()).st_size == len(data)
    with open(m.path / "sst", "r+b") as f:  # a rewrite in place of an existing file
        f.seek(5 * MiB)
        f.write(b"patched")
    expected = data[:5 * MiB] + b"patched" + data[5 * MiB + 7:]
    assert (m.path / "sst").read_bytes() == expected
    st = m.status()
    assert st["fuse"]["bytes_written"] == 0 and st["fuse"]["bytes_read"] == 0, st["fuse"]
    assert st["passthrough"]["opens"] >= 3 and st["passthrough"]["refused"] == 0, st["passthrough"]
    assert st["passthrough"]["sealed_bytes"] >= len(data), st["passthrough"]
    m.umount()
    m.wipe_cache()
    m.mount("--frontend", "pyfuse3")
    assert (m.path / "sst").read_bytes() == expected
    assert m.status()["metadata"]["engine"] == ("sqlite" if engine == "sqlite" else "postgresql")
    assert not any((m.cache_dir / "backing").iterdir())


@pytest.mark.parametrize("front", ["pyfuse3", "passthrough"])
def test_what_an_fsync_returned_for_is_in_the_bucket_when_the_node_is_lost(make_mount, file_bucket, front: str) -> None:
    """The embedded engine with --durability remote: an fsync puts a file's large blocks in
    the bucket itself (those it seals: a passthrough file's changed ones, the block path's
    last) and stages the small ones; a second file of the same bytes finds them there. The
    daemon killed right after the fsyncs, its cache disk lost: a fresh node reads every
    fsynced byte back."""
    if front == "passthrough":
        m = _passthrough_mount(make_mount, file_bucket)
    else:
        m = make_mount(file_bucket, extra=["--frontend", front]).mount()
    sst = os.urandom(9 * MiB + 5)  # two whole blocks and a tail, each put by the fsync
    manifest = os.urandom(300)  # staged, and uploaded by the journal's shipment
    for name, data in (("000012.sst", sst), ("MANIFEST-000001", manifest), ("copy.sst", sst)):
        with open(m.path / name, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
    m.kill()  # well within the journal's interval (2 s): only the fsyncs shipped it
    m.wipe_cache()
    m.mount("--frontend", "pyfuse3", "--takeover")
    assert (m.path / "000012.sst").read_bytes() == sst
    assert (m.path / "copy.sst").read_bytes() == sst
    assert (m.path / "MANIFEST-000001").read_bytes() == manifest


# Writes a file, says so, waits for a line, rewrites 36 bytes at offset 100, fsyncs, says so.
# A process of its own: a `fusestate status` started from a process that holds the file open
# would inherit the descriptor, and its exec would close it (a FUSE flush, which seals).
WRITER = """
import os, random, sys
data = random.Random(7).randbytes(9 * 2**20 + 5)
with open(sys.argv[1], "wb") as f:
    f.write(data)
    f.flush()
    print("written", flush=True)
    sys.stdin.readline()
    f.seek(100)
    f.write(b"rewritten after its block was sealed")
    f.flush()
    os.fsync(f.fileno())
print("synced", flush=True)
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_a_passthrough_writer_s_whole_blocks_are_sealed_before_its_fsync(make_mount, file_bucket, engine: str,
                                                                         request: pytest.FixtureRequest) -> None:
    """While a passthrough writer keeps its file open, the daemon seals the blocks the file's
    size has passed, so the fsync stores only the rest; a block rewritten after it was sealed
    ahead is stored again by the fsync, and a fresh node reads the file's last content."""
    m = _passthrough_mount(make_mount, file_bucket, *engine_args(engine, request))
    data = bytearray(random.Random(7).randbytes(9 * MiB + 5))  # two whole blocks and a tail
    data[100:136] = b"rewritten after its block was sealed"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(m.path / "000042.sst")], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert writer.stdin is not None and writer.stdout is not None
    try:
        assert writer.stdout.readline() == "written\n"
        wait_for(lambda: m.status()["passthrough"]["sealed_ahead"] >= 1, what="the whole blocks sealed ahead")
        st = m.status()["passthrough"]
        assert (st["sealed_bytes"], st["seals"]) == (8 * MiB, 0), st  # the whole blocks only; the file not sealed
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.stdout.readline() == "synced\n"
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait()
    st = m.status()["passthrough"]
    assert st["sealed_bytes"] == 8 * MiB + 4 * MiB + (len(data) - 8 * MiB), st  # the rewritten block and the tail
    m.umount()
    m.wipe_cache()
    m.mount("--frontend", "pyfuse3")
    assert (m.path / "000042.sst").read_bytes() == data


def test_passthrough_keeps_sparse_files_sparse(make_mount, file_bucket) -> None:
    m = _passthrough_mount(make_mount, file_bucket)
    far = 1 << 40
    with open(m.path / "huge", "wb") as f:
        f.seek(far)
        f.write(b"x")
        f.flush()
        os.fsync(f.fileno())
    st = m.status()
    assert st["passthrough"]["sealed_bytes"] < 8 * MiB, st["passthrough"]  # the hole was never read
    m.umount()
    m.mount("--frontend", "pyfuse3")
    with open(m.path / "huge", "rb") as f:
        f.seek(far - 3)
        assert f.read() == b"\0\0\0x"


def test_a_second_writer_past_max_dirty_goes_through_the_daemon_and_waits(make_mount, file_bucket) -> None:
    """--max-dirty on the passthrough front end: while the open passthrough writers hold more
    unsealed bytes than it, a new writer is served by the daemon, whose writers wait for room."""
    m = _passthrough_mount(make_mount, file_bucket, "--max-dirty", "16M", "--cache-size", "1G")
    first = os.urandom(24 * MiB)
    chunk = os.urandom(MiB)
    expected = hashlib.sha256()
    with open(m.path / "first", "wb") as a:
        a.write(first)
        a.flush()
        with open(m.path / "second", "wb") as b:
            for i in range(64):
                piece = bytes([i]) + chunk[1:]
                b.write(piece)
                expected.update(piece)
    st = m.status()
    assert st["passthrough"]["opens"] == 1, st["passthrough"]
    assert st["fuse"]["bytes_written"] == 64 * MiB
    assert st["writeback"]["backpressure_waits"] > 0 and st["writeback"]["upload_failures"] == 0
    m.umount()
    m.wipe_cache()
    m.mount("--frontend", "pyfuse3")
    assert (m.path / "first").read_bytes() == first
    assert hashlib.sha256((m.path / "second").read_bytes()).hexdigest() == expected.hexdigest()


def test_mmap_writes_through_passthrough_reach_the_bucket(make_mount, file_bucket) -> None:
    import mmap

    m = _passthrough_mount(make_mount, file_bucket)
    with open(m.path / "mapped", "w+b") as f:
        f.truncate(2 * MiB)
        with mmap.mmap(f.fileno(), 2 * MiB) as mm:
            mm[MiB:MiB + 5] = b"hello"
            mm.flush()
    m.umount()
    m.wipe_cache()
    m.mount("--frontend", "pyfuse3")
    data = (m.path / "mapped").read_bytes()
    assert len(data) == 2 * MiB and data[MiB:MiB + 5] == b"hello" and data.count(0) == 2 * MiB - 5


@pytest.mark.parametrize("name", ["native", "passthrough"])
def test_a_native_front_end_that_cannot_run_is_one_clear_error(make_mount, file_bucket, tmp_path: Path,
                                                               name: str) -> None:
    """Without the extension, --frontend native fails the mount with one line (nothing mounted)."""
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "shadow"))
    shadow = tmp_path / "shadow" / "fusestate_kernel"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    from conftest import fusestate as run

    mnt = make_mount(file_bucket)
    mnt.path.mkdir(parents=True, exist_ok=True)
    proc = run(*mnt.mount_args("--frontend", name), check=False, env=env)
    assert proc.returncode != 0
    assert_one_line_error(proc, f"--frontend {name} cannot run", "hidden for the test")
    assert not is_mounted(mnt.path)
