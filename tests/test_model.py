"""Random operation sequences on the mount and on a local directory must agree.

A Hypothesis state machine applies the same file operations to a fusestate
mount and to a plain local directory, and compares results: contents,
sizes, listings, link counts and the errno of every failing operation. The
volume uses 64 KiB blocks so that small writes still cross block boundaries.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import shutil
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

from conftest import ENGINES, Bucket, Mount

BS = 64 * 1024

# Paths the machine works on; any of them may end up a file, a directory or missing.
PATHS = ["a", "b", "c", "d", "d/a", "d/b", "d/e", "d/e/a", "e", "e/a"]
paths = st.sampled_from(PATHS)
offsets = st.one_of(
    st.sampled_from([0, 1, BS - 1, BS, BS + 1, 2 * BS - 3, 2 * BS, 3 * BS + 5]),
    st.integers(0, 4 * BS),
)
lengths = st.one_of(st.integers(0, 64), st.integers(0, 2 * BS + 100))
seeds = st.integers(0, 2**32 - 1)


def payload(seed: int, length: int) -> bytes:
    return random.Random(seed).randbytes(length)


@contextlib.contextmanager
def module_mount(base: Path, extra: list[str]) -> Iterator[Mount]:
    """A fusestate mount that outlives one test; always unmounted in the end."""
    bucket_dir = base / "bucket"
    bucket_dir.mkdir(parents=True)
    m = Mount(Bucket("file", f"file://{bucket_dir}"), base / "mnt", base / "cache", list(extra))
    try:
        m.mount()
        yield m
    finally:
        m.cleanup()


@pytest.fixture(scope="module", params=[*ENGINES, "postgresql-scratch"])
def model_mnt(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Mount]:
    """One mount per metadata engine for the whole module (PostgreSQL: a fresh database).
    ``postgresql-scratch``: every example's directory is a scratch dir (``ex-*``), whose
    contents a shared volume keeps in the node's memory (``meta.node_local``)."""
    extra = ["--block-size", "64K"]
    if request.param == "postgresql-scratch":
        extra += ["--scratch", "ex-*"]
    if request.param.startswith("postgresql"):
        server = request.getfixturevalue("postgres_server")
        extra += ["--meta", server.create_database(f"model{uuid.uuid4().hex[:12]}")]
    with module_mount(tmp_path_factory.mktemp("model"), extra) as m:
        yield m


def clear_dir(root: Path) -> None:
    for name in os.listdir(root):
        p = root / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def summary(value: Any) -> Any:
    """Bytes as length and digest, so a mismatch report stays readable."""
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes sha256:{hashlib.sha256(value).hexdigest()[:16]}>"
    if isinstance(value, tuple):
        return tuple(summary(v) for v in value)
    return value


def outcome(fn: Callable[[Path], Any], root: Path) -> tuple[str, Any]:
    try:
        return "ok", summary(fn(root))
    except OSError as exc:
        return "err", errno.errorcode.get(exc.errno, exc.errno)


def read_all(fd: int) -> bytes:
    parts = []
    pos = 0
    while True:
        chunk = os.pread(fd, 1 << 20, pos)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        pos += len(chunk)


def make_machine(mount_root: Path) -> type[RuleBasedStateMachine]:
    class FileOps(RuleBasedStateMachine):
        """The mount (fs) against a local directory (ref)."""

        def __init__(self) -> None:
            super().__init__()
            self.fs = mount_root / f"ex-{uuid.uuid4().hex[:8]}"
            self.fs.mkdir()
            self.ref = Path(tempfile.mkdtemp(prefix="fusestate-model-"))
            self.handles: list[tuple[int, int, str]] = []  # (fs fd, ref fd, path)

        @initialize(seed=seeds, big=st.booleans())
        def populate(self, seed: int, big: bool) -> None:
            """Start from a small tree so most operations hit something."""
            files = {"a": payload(seed, BS + 100 if big else 300), "d/a": payload(seed + 1, 5000),
                     "d/e/a": payload(seed + 2, 2 * BS + 1 if big else 10)}
            for root in (self.fs, self.ref):
                os.makedirs(root / "d" / "e")
                for name, data in files.items():
                    (root / name).write_bytes(data)

        def both(self, fn: Callable[[Path], Any]) -> Any:
            got = outcome(fn, self.fs)
            want = outcome(fn, self.ref)
            assert got == want, f"mount gave {got!r}, local gave {want!r}"
            return got

        # --- whole-path operations -------------------------------------------------
        @rule(path=paths, seed=seeds, length=lengths)
        def create(self, path: str, seed: int, length: int) -> None:
            data = payload(seed, length)

            def op(root: Path) -> None:
                fd = os.open(root / path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)

            self.both(op)

        @rule(path=paths, offset=offsets, seed=seeds, length=lengths)
        def write_at(self, path: str, offset: int, seed: int, length: int) -> None:
            data = payload(seed, length)

            def op(root: Path) -> int:
                fd = os.open(root / path, os.O_WRONLY)
                try:
                    return os.pwrite(fd, data, offset)
                finally:
                    os.close(fd)

            self.both(op)

        @rule(path=paths, seed=seeds, length=lengths)
        def append(self, path: str, seed: int, length: int) -> None:
            data = payload(seed, length)

            def op(root: Path) -> int:
                fd = os.open(root / path, os.O_WRONLY | os.O_APPEND)
                try:
                    os.lseek(fd, 0, os.SEEK_SET)
                    return os.write(fd, data)
                finally:
                    os.close(fd)

            self.both(op)

        @rule(path=paths, size=offsets)
        def truncate(self, path: str, size: int) -> None:
            self.both(lambda root: os.truncate(root / path, size))

        @rule(path=paths, uncached=st.booleans())
        def read(self, path: str, uncached: bool) -> None:
            def op(root: Path) -> bytes:
                fd = os.open(root / path, os.O_RDONLY)
                try:
                    if uncached:  # what the daemon holds, not the page cache
                        os.fsync(fd)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    return read_all(fd)
                finally:
                    os.close(fd)

            self.both(op)

        @rule(path=paths)
        def fsync(self, path: str) -> None:
            def op(root: Path) -> None:
                fd = os.open(root / path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

            self.both(op)

        @rule(src=paths, dst=paths)
        def rename(self, src: str, dst: str) -> None:
            self.both(lambda root: os.rename(root / src, root / dst))

        @rule(path=paths)
        def unlink(self, path: str) -> None:
            self.both(lambda root: os.unlink(root / path))

        @rule(path=paths)
        def mkdir(self, path: str) -> None:
            self.both(lambda root: os.mkdir(root / path, 0o755))

        @rule(path=paths)
        def rmdir(self, path: str) -> None:
            self.both(lambda root: os.rmdir(root / path))

        @rule(src=paths, dst=paths)
        def link(self, src: str, dst: str) -> None:
            self.both(lambda root: os.link(root / src, root / dst))

        # --- operations through open file descriptors ------------------------------
        @rule(path=paths)
        def open_handle(self, path: str) -> None:
            if len(self.handles) >= 4:
                return
            got = outcome(lambda root: os.open(root / path, os.O_RDWR), self.fs)
            want = outcome(lambda root: os.open(root / path, os.O_RDWR), self.ref)
            if got[0] == "ok" and want[0] == "ok":
                self.handles.append((got[1], want[1], path))
                return
            for kind, fd in (got, want):
                if kind == "ok":
                    os.close(fd)
            assert got == want, f"open: mount gave {got!r}, local gave {want!r}"

        def _handle(self, i: int) -> tuple[int, int, str]:
            return self.handles[i % len(self.handles)]

        def both_fd(self, i: int, fn: Callable[[int], Any]) -> Any:
            fs_fd, ref_fd, _ = self._handle(i)
            got = outcome(lambda _: fn(fs_fd), self.fs)
            want = outcome(lambda _: fn(ref_fd), self.ref)
            assert got == want, f"mount gave {got!r}, local gave {want!r}"

        @rule(i=st.integers(0, 3), offset=offsets, seed=seeds, length=lengths)
        def fd_write(self, i: int, offset: int, seed: int, length: int) -> None:
            if self.handles:
                data = payload(seed, length)
                self.both_fd(i, lambda fd: os.pwrite(fd, data, offset))

        @rule(i=st.integers(0, 3), uncached=st.booleans())
        def fd_read(self, i: int, uncached: bool) -> None:
            def op(fd: int) -> tuple[int, bytes]:
                if uncached:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                return os.fstat(fd).st_size, read_all(fd)

            if self.handles:
                self.both_fd(i, op)

        @rule(i=st.integers(0, 3), size=offsets)
        def fd_truncate(self, i: int, size: int) -> None:
            if self.handles:
                self.both_fd(i, lambda fd: os.ftruncate(fd, size))

        @rule(i=st.integers(0, 3))
        def fd_fsync(self, i: int) -> None:
            if self.handles:
                self.both_fd(i, os.fsync)

        @rule(i=st.integers(0, 3))
        def fd_close(self, i: int) -> None:
            if self.handles:
                fs_fd, ref_fd, _ = self.handles.pop(i % len(self.handles))
                os.close(fs_fd)
                os.close(ref_fd)

        # --- the trees agree after every step ---------------------------------------
        @staticmethod
        def tree(root: Path) -> dict[str, tuple]:
            out: dict[str, tuple] = {}
            for dirpath, dirnames, filenames in os.walk(root):
                for name in dirnames + filenames:
                    p = Path(dirpath) / name
                    s = os.lstat(p)
                    rel = str(p.relative_to(root))
                    if stat.S_ISREG(s.st_mode):
                        with open(p, "rb") as f:
                            out[rel] = ("file", s.st_size, s.st_nlink, summary(f.read()))
                    else:
                        out[rel] = ("dir", s.st_nlink, sorted(os.listdir(p)))
            out["."] = ("dir", os.stat(root).st_nlink, sorted(os.listdir(root)))
            return out

        @invariant()
        def trees_agree(self) -> None:
            got, want = self.tree(self.fs), self.tree(self.ref)
            if got != want:
                diff = {k: (got.get(k, "missing"), want.get(k, "missing"))
                        for k in set(got) | set(want) if got.get(k) != want.get(k)}
                raise AssertionError(f"trees differ (mount, local): {diff}")

        def teardown(self) -> None:
            for fs_fd, ref_fd, _ in self.handles:
                with contextlib.suppress(OSError):
                    os.close(fs_fd)
                with contextlib.suppress(OSError):
                    os.close(ref_fd)
            self.handles.clear()
            shutil.rmtree(self.ref, ignore_errors=True)
            with contextlib.suppress(OSError):
                shutil.rmtree(self.fs)

    return FileOps


def test_random_operations_match_local_fs(model_mnt: Mount) -> None:
    clear_dir(model_mnt.path)
    machine = make_machine(model_mnt.path)
    try:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=25, stateful_step_count=30, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ))
    finally:
        with contextlib.suppress(OSError):
            clear_dir(model_mnt.path)
    # the volume stays usable and consistent across a remount
    model_mnt.umount()
    model_mnt.mount()
    assert os.listdir(model_mnt.path) == []
