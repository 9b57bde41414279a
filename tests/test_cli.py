"""The command line: bad input is one clear line, never a traceback; nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import Bucket, Mount, assert_one_line_error, free_port, fusestate, is_mounted, proc_stat

MiB = 1 << 20


# --- helpers -------------------------------------------------------------------------

def mounts_under(root: Path) -> list[str]:
    prefix = os.path.realpath(root) + "/"
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(prefix)]


def daemons_under(root: Path) -> list[int]:
    """Live fusestate processes whose command line names a path under ``root``."""
    needle = os.path.realpath(root).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            state = proc_stat(int(entry))[0]
        except OSError:
            continue
        if state != "Z" and b"fusestate" in cmdline and needle in cmdline:
            found.append(int(entry))
    return found


def assert_nothing_left(root: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while daemons_under(root) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mounts_under(root) == []
    assert daemons_under(root) == []


def mount_cmd(url: str, mountpoint: Path, cache: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return fusestate("mount", url, str(mountpoint), "--cache-dir", str(cache), "--cache-size", "1G",
                     *extra, check=False, timeout=timeout)


@pytest.fixture
def mp(tmp_path: Path) -> Path:
    path = tmp_path / "mp"
    path.mkdir()
    return path


# --- bad URLs and buckets ----------------------------------------------------------------

@pytest.mark.parametrize("url, fragment", [
    ("ftp://x/y", "unsupported bucket URL"),
    ("s3://", "no bucket name"),
    ("gs://", "no bucket name"),
])
def test_bad_url(tmp_path: Path, mp: Path, url: str, fragment: str) -> None:
    assert_one_line_error(mount_cmd(url, mp, tmp_path / "cache"), fragment)
    assert_nothing_left(tmp_path)


def test_missing_file_bucket(tmp_path: Path, mp: Path) -> None:
    missing = tmp_path / "no-such-bucket"
    assert_one_line_error(mount_cmd(f"file://{missing}", mp, tmp_path / "cache"), str(missing), "does not exist")
    assert_nothing_left(tmp_path)


def test_missing_s3_bucket(tmp_path: Path, mp: Path, s3_endpoint: str) -> None:
    proc = mount_cmd("s3://no-such-bucket-here/vol", mp, tmp_path / "cache", "--endpoint-url", s3_endpoint)
    assert_one_line_error(proc, "no-such-bucket-here")
    assert_nothing_left(tmp_path)


def test_missing_gcs_bucket(tmp_path: Path, mp: Path, gcs_endpoint: str) -> None:
    started = time.monotonic()
    proc = mount_cmd("gs://no-such-bucket-here/vol", mp, tmp_path / "cache", "--endpoint-url", gcs_endpoint)
    assert_one_line_error(proc, "no-such-bucket-here")
    assert time.monotonic() - started < 60
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("scheme", ["s3", pytest.param("gs", marks=pytest.mark.slow)])
def test_unreachable_endpoint(tmp_path: Path, mp: Path, scheme: str) -> None:
    port = free_port()  # bound and released: nothing listens there
    started = time.monotonic()
    proc = mount_cmd(f"{scheme}://bkt/vol", mp, tmp_path / "cache", "--endpoint-url", f"http://127.0.0.1:{port}",
                     timeout=120)
    elapsed = time.monotonic() - started
    assert_one_line_error(proc, "bkt")
    assert elapsed < 60, f"took {elapsed:.0f} s to give up"
    assert_nothing_left(tmp_path)


# --- mountpoints ----------------------------------------------------------------------------

def test_missing_mountpoint(tmp_path: Path, file_bucket: Bucket) -> None:
    proc = mount_cmd(file_bucket.url, tmp_path / "nope", tmp_path / "cache")
    assert_one_line_error(proc, "does not exist")
    assert_nothing_left(tmp_path)


def test_mountpoint_is_a_file(tmp_path: Path, file_bucket: Bucket) -> None:
    target = tmp_path / "plain"
    target.write_bytes(b"x")
    assert_one_line_error(mount_cmd(file_bucket.url, target, tmp_path / "cache"), "not a directory")
    assert_nothing_left(tmp_path)


def test_runtime_dir_too_long_for_a_socket_is_one_line(tmp_path: Path, mp: Path, file_bucket: Bucket) -> None:
    runtime = tmp_path / ("r" * 100)
    proc = fusestate("mount", file_bucket.url, str(mp), "--cache-dir", str(tmp_path / "cache"), check=False,
                     env=dict(os.environ, FUSESTATE_RUNTIME_DIR=str(runtime)))
    assert_one_line_error(proc, "FUSESTATE_RUNTIME_DIR", "unix socket")
    assert_nothing_left(tmp_path)


def test_busy_mountpoint(tmp_path: Path, make_mount, file_bucket: Bucket) -> None:
    m: Mount = make_mount(file_bucket).mount()
    (m.path / "keep").write_bytes(b"keep me")
    other = tmp_path / "bucket2"
    other.mkdir()
    proc = mount_cmd(f"file://{other}", m.path, tmp_path / "cache2")
    assert_one_line_error(proc, "busy")
    assert (m.path / "keep").read_bytes() == b"keep me"
    assert m.status()["pid"] == m.pid
    m.umount()
    assert_nothing_left(tmp_path)


def test_bad_fuse_option(tmp_path: Path, mp: Path, file_bucket: Bucket) -> None:
    proc = mount_cmd(file_bucket.url, mp, tmp_path / "cache", "-o", "no_such_fuse_option")
    assert_one_line_error(proc, "cannot mount on", str(mp))
    assert_nothing_left(tmp_path)


# --- cache dir and sizes --------------------------------------------------------------------

def test_unusable_cache_dir(tmp_path: Path, mp: Path, file_bucket: Bucket) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    assert_one_line_error(mount_cmd(file_bucket.url, mp, plain / "cache"), "cache dir", "not usable")
    assert_nothing_left(tmp_path)


def test_cache_dir_in_use(tmp_path: Path, make_mount, file_bucket: Bucket) -> None:
    m: Mount = make_mount(file_bucket).mount()
    second = tmp_path / "mp2"
    second.mkdir()
    proc = mount_cmd(file_bucket.url, second, m.cache_dir)
    assert_one_line_error(proc, "in use")
    assert not is_mounted(second)
    assert m.status()["pid"] == m.pid
    m.umount()
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("option", ["--cache-size", "--kernel-readahead"])
def test_bad_size(tmp_path: Path, mp: Path, file_bucket: Bucket, option: str) -> None:
    proc = fusestate("mount", file_bucket.url, str(mp), "--cache-dir", str(tmp_path / "cache"),
                     option, "lots", check=False)
    assert_one_line_error(proc, option, "lots")
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("option, value", [("--scratch", "a/b"), ("--scratch", "*"), ("--store-ahead", ""),
                                           ("--store-ahead", "db/*.sst")])
def test_bad_name_pattern(tmp_path: Path, mp: Path, file_bucket: Bucket, option: str, value: str) -> None:
    proc = fusestate("mount", file_bucket.url, str(mp), "--cache-dir", str(tmp_path / "cache"),
                     option, value, check=False)
    assert_one_line_error(proc, f"bad {option}", "pattern")
    assert_nothing_left(tmp_path)


def test_cache_size_below_max_dirty(tmp_path: Path, mp: Path, file_bucket: Bucket) -> None:
    proc = fusestate("mount", file_bucket.url, str(mp), "--cache-dir", str(tmp_path / "cache"),
                     "--cache-size", "100M", "--max-dirty", "200M", check=False)
    assert_one_line_error(proc, "--cache-size", "--max-dirty")
    assert_nothing_left(tmp_path)


def test_a_volume_keeps_its_block_size_unless_a_flag_conflicts(tmp_path: Path, make_mount,
                                                               file_bucket: Bucket) -> None:
    """A volume made with --block-size 64K mounts again without the flag (its own size wins);
    only an explicit, different --block-size is refused, in one line, with nothing lost."""
    m: Mount = make_mount(file_bucket, extra=["--block-size", "64K"]).mount()
    payload = os.urandom(300 * 1024)
    (m.path / "data").write_bytes(payload)
    m.umount()

    m.extra = []
    m.mount()
    assert m.status()["block_size"] == 64 * 1024
    assert (m.path / "data").read_bytes() == payload
    m.umount()

    assert_one_line_error(m.try_mount("--block-size", "4M"), "65536-byte blocks", "--block-size")
    assert not is_mounted(m.path)
    m.mount("--block-size", "64K")
    assert (m.path / "data").read_bytes() == payload
    m.umount()
    assert_nothing_left(tmp_path)


# --- umount and status --------------------------------------------------------------------

@pytest.mark.parametrize("command", ["umount", "status"])
def test_not_a_fusestate_mount(tmp_path: Path, command: str) -> None:
    assert_one_line_error(fusestate(command, str(tmp_path), check=False), "not a fusestate mount")
    assert_nothing_left(tmp_path)


def test_umount_busy_mountpoint(tmp_path: Path, make_mount, file_bucket: Bucket) -> None:
    m: Mount = make_mount(file_bucket).mount()
    payload = os.urandom(5 * MiB)
    (m.path / "data").write_bytes(payload)
    squatter = subprocess.Popen(["sleep", "300"], cwd=m.path)
    try:
        proc = fusestate("umount", str(m.path), check=False)
        assert_one_line_error(proc, "busy")
        assert is_mounted(m.path)
        assert m.status()["pid"] == m.pid
        assert (m.path / "data").read_bytes() == payload
    finally:
        squatter.kill()
        squatter.wait()
    m.umount()
    assert_nothing_left(tmp_path)
    m.wipe_cache()
    m.mount()
    assert (m.path / "data").read_bytes() == payload
    m.umount()
    assert_nothing_left(tmp_path)


# --- the happy paths -------------------------------------------------------------------------

def test_version_and_help() -> None:
    proc = fusestate("--version")
    assert proc.stdout.startswith("fusestate ")
    proc = fusestate("mount", "--help")
    assert "--cache-dir" in proc.stdout and "--durability" in proc.stdout
    assert proc.stderr == ""


def test_warmup_fills_the_cache(tmp_path: Path, make_mount, file_bucket: Bucket) -> None:
    m: Mount = make_mount(file_bucket).mount()
    payload = os.urandom(10 * MiB + 77)
    (m.path / "dir").mkdir()
    (m.path / "dir" / "big").write_bytes(payload)
    m.umount()
    m.wipe_cache()
    m.mount()

    proc = fusestate("warmup", str(m.path / "dir" / "big"))
    assert "1 files warm, 3 blocks fetched" in proc.stdout, proc.stdout
    before = m.status()["remote"]["bytes_in"]
    assert before >= len(payload)
    with open(m.path / "dir" / "big", "rb") as f:
        assert f.read() == payload
    after = m.status()
    assert after["remote"]["bytes_in"] == before
    assert after["remote"]["range_reads"] == 0
    m.umount()
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("backend,expected", [("file", "off"), ("s3", "recent"), ("gs", "recent")])
def test_prefetch_auto_warms_object_stores_only(tmp_path: Path, make_mount, request, backend: str,
                                                 expected: str) -> None:
    """The default: a bucket that is a local directory is as fast to read as the cache, so
    nothing is warmed; an object store gets the newest files warmed in the background."""
    from conftest import new_bucket

    bucket = new_bucket(backend, tmp_path, request)
    m = make_mount(bucket).mount("--prefetch", "auto")
    assert m.status()["warmup"]["mode"] == expected
    m.umount()


def test_every_mount_option_is_documented() -> None:
    """docs/configuration.md's table names every option `fusestate mount` accepts."""
    import argparse

    from fusestate.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = [o for a in sub.choices["mount"]._actions for o in a.option_strings if o.startswith("--")]
    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    assert "--kernel-readahead" in options
    assert [o for o in options if o != "--help" and f"`{o}" not in doc] == []
