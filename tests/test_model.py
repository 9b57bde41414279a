"""Random operation sequences on the mount and on a local directory must agree.

A Hypothesis state machine applies the same file operations to a fusestate
mount and to a plain local directory, and compares results: contents,
sizes, listings, link counts and the errno of every failing operation. The
volume uses 64 KiB blocks so that small writes still cross block boundaries.

It runs on each namespace implementation: the embedded engine, the PostgreSQL engine,
and a shared volume's scratch directories; and on two nodes of one shared volume, each
step from either node, a node's view compared only after the documented visibility bound
since the other node's last change. The default run generates a bounded number of
examples and reports a failure as found; ``-m slow`` runs many more and shrinks.
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
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
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


NAMESPACES = [*ENGINES, "postgresql-scratch"]
# A node sees another node's change within the lookup memory's bound (0.5 s, docs/semantics.md)
# plus its kernel's attribute timeout, which the two-node mounts set short.
TWO_NODE_ATTR_TIMEOUT = 0.1
TWO_NODE_BOUND = 0.5 + TWO_NODE_ATTR_TIMEOUT


def namespace_mount(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest,
                    kind: str) -> Iterator[Mount]:
    """One mount of a fresh volume on the ``kind`` namespace (PostgreSQL: a fresh database).
    ``postgresql-scratch``: every example's directory is a scratch dir (``ex-*``), whose
    contents a shared volume keeps in the node's memory (``meta.scratch.namespace``), and
    whose every file has its blocks stored ahead of a link (``--store-ahead '*'``)."""
    extra = ["--block-size", "64K"]
    if kind == "postgresql-scratch":
        extra += ["--scratch", "ex-*", "--store-ahead", "*"]
    if kind.startswith("postgresql"):
        server = request.getfixturevalue("postgres_server")
        extra += ["--meta", server.create_database(f"model{uuid.uuid4().hex[:12]}")]
    with module_mount(tmp_path_factory.mktemp("model"), extra) as m:
        yield m


@pytest.fixture(scope="module", params=NAMESPACES)
def model_mnt(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Mount]:
    yield from namespace_mount(tmp_path_factory, request, request.param)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[list[Mount]]:
    """Two mounts of one shared volume (one bucket, one database), as two nodes."""
    base = tmp_path_factory.mktemp("model2")
    (base / "bucket").mkdir()
    bucket = Bucket("file", f"file://{base / 'bucket'}")
    url = request.getfixturevalue("postgres_server").create_database(f"model{uuid.uuid4().hex[:12]}")
    extra = ["--block-size", "64K", "--meta", url, "--attr-timeout", str(TWO_NODE_ATTR_TIMEOUT)]
    nodes = [Mount(bucket, base / f"mnt-{n}", base / f"cache-{n}", list(extra)) for n in "ab"]
    try:
        for m in nodes:
            m.mount()
        yield nodes
    finally:
        for m in nodes:
            m.cleanup()


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


def make_machine(*mount_roots: Path) -> type[RuleBasedStateMachine]:
    """The state machine on the mounts ``mount_roots`` of one volume: one, or two nodes'."""
    nodes = st.integers(0, len(mount_roots) - 1)
    one_node = len(mount_roots) == 1

    class FileOps(RuleBasedStateMachine):
        """The mount (fs, the example's directory as the node of the last step sees it)
        against a local directory (ref). Open handles (the fd rules) only on one node: a
        file written through one is seen by another node after its close (close-to-open)."""

        def __init__(self) -> None:
            super().__init__()
            example = f"ex-{uuid.uuid4().hex[:8]}"
            self.roots = [root / example for root in mount_roots]
            self.roots[0].mkdir()
            self.node = 0
            self.changed_at = 0.0  # when the last step that may change something ended
            self.ref = Path(tempfile.mkdtemp(prefix="fusestate-model-"))
            self.handles: list[tuple[int, int, str]] = []  # (fs fd, ref fd, path)

        @property
        def fs(self) -> Path:
            return self.roots[self.node]

        def on(self, node: int) -> None:
            """The next step is node ``node``'s: if the last was another node's, wait until
            this one is bound to see it."""
            if node != self.node:
                time.sleep(max(0.0, self.changed_at + TWO_NODE_BOUND - time.monotonic()))
                self.node = node

        @initialize(seed=seeds, big=st.booleans())
        def populate(self, seed: int, big: bool) -> None:
            """Start from a small tree so most operations hit something."""
            files = {"a": payload(seed, BS + 100 if big else 300), "d/a": payload(seed + 1, 5000),
                     "d/e/a": payload(seed + 2, 2 * BS + 1 if big else 10)}
            for root in (self.fs, self.ref):
                os.makedirs(root / "d" / "e")
                for name, data in files.items():
                    (root / name).write_bytes(data)
            self.changed_at = time.monotonic()

        def both(self, fn: Callable[[Path], Any], node: int = 0) -> Any:
            self.on(node)
            got = outcome(fn, self.fs)
            want = outcome(fn, self.ref)
            self.changed_at = time.monotonic()
            assert got == want, f"mount gave {got!r}, local gave {want!r}"
            return got

        # --- whole-path operations -------------------------------------------------
        @rule(path=paths, seed=seeds, length=lengths, node=nodes)
        def create(self, path: str, seed: int, length: int, node: int) -> None:
            data = payload(seed, length)

            def op(root: Path) -> None:
                fd = os.open(root / path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)

            self.both(op, node)

        @rule(path=paths, offset=offsets, seed=seeds, length=lengths, node=nodes)
        def write_at(self, path: str, offset: int, seed: int, length: int, node: int) -> None:
            data = payload(seed, length)

            def op(root: Path) -> int:
                fd = os.open(root / path, os.O_WRONLY)
                try:
                    return os.pwrite(fd, data, offset)
                finally:
                    os.close(fd)

            self.both(op, node)

        @rule(path=paths, seed=seeds, length=lengths, node=nodes)
        def append(self, path: str, seed: int, length: int, node: int) -> None:
            data = payload(seed, length)

            def op(root: Path) -> int:
                fd = os.open(root / path, os.O_WRONLY | os.O_APPEND)
                try:
                    os.lseek(fd, 0, os.SEEK_SET)
                    return os.write(fd, data)
                finally:
                    os.close(fd)

            self.both(op, node)

        @rule(path=paths, size=offsets, node=nodes)
        def truncate(self, path: str, size: int, node: int) -> None:
            self.both(lambda root: os.truncate(root / path, size), node)

        @rule(path=paths, uncached=st.booleans(), node=nodes)
        def read(self, path: str, uncached: bool, node: int) -> None:
            def op(root: Path) -> bytes:
                fd = os.open(root / path, os.O_RDONLY)
                try:
                    if uncached:  # what the daemon holds, not the page cache
                        os.fsync(fd)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    return read_all(fd)
                finally:
                    os.close(fd)

            self.both(op, node)

        @rule(path=paths, node=nodes)
        def fsync(self, path: str, node: int) -> None:
            def op(root: Path) -> None:
                fd = os.open(root / path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

            self.both(op, node)

        @rule(src=paths, dst=paths, node=nodes)
        def rename(self, src: str, dst: str, node: int) -> None:
            self.both(lambda root: os.rename(root / src, root / dst), node)

        @rule(path=paths, node=nodes)
        def unlink(self, path: str, node: int) -> None:
            self.both(lambda root: os.unlink(root / path), node)

        @rule(path=paths, node=nodes)
        def mkdir(self, path: str, node: int) -> None:
            self.both(lambda root: os.mkdir(root / path, 0o755), node)

        @rule(path=paths, node=nodes)
        def rmdir(self, path: str, node: int) -> None:
            self.both(lambda root: os.rmdir(root / path), node)

        @rule(src=paths, dst=paths, node=nodes)
        def link(self, src: str, dst: str, node: int) -> None:
            self.both(lambda root: os.link(root / src, root / dst), node)

        # --- operations through open file descriptors ------------------------------
        @precondition(lambda self: one_node)
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
            self.changed_at = time.monotonic()
            assert got == want, f"mount gave {got!r}, local gave {want!r}"

        @precondition(lambda self: one_node)
        @rule(i=st.integers(0, 3), offset=offsets, seed=seeds, length=lengths)
        def fd_write(self, i: int, offset: int, seed: int, length: int) -> None:
            if self.handles:
                data = payload(seed, length)
                self.both_fd(i, lambda fd: os.pwrite(fd, data, offset))

        @precondition(lambda self: one_node)
        @rule(i=st.integers(0, 3), uncached=st.booleans())
        def fd_read(self, i: int, uncached: bool) -> None:
            def op(fd: int) -> tuple[int, bytes]:
                if uncached:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                return os.fstat(fd).st_size, read_all(fd)

            if self.handles:
                self.both_fd(i, op)

        @precondition(lambda self: one_node)
        @rule(i=st.integers(0, 3), size=offsets)
        def fd_truncate(self, i: int, size: int) -> None:
            if self.handles:
                self.both_fd(i, lambda fd: os.ftruncate(fd, size))

        @precondition(lambda self: one_node)
        @rule(i=st.integers(0, 3))
        def fd_fsync(self, i: int) -> None:
            if self.handles:
                self.both_fd(i, os.fsync)

        @precondition(lambda self: one_node)
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


# The default run: a bounded number of examples, a failure reported as generated (shrinking a
# sequence of mount operations can take minutes). The slow run: many more, shrunk.
FAST = settings(max_examples=25, stateful_step_count=30, deadline=None,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
THOROUGH = settings(max_examples=250, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TWO_NODES_FAST = settings(FAST, max_examples=6, stateful_step_count=20)
TWO_NODES_THOROUGH = settings(THOROUGH, max_examples=30)


def run_model(mounts: list[Mount], how: settings) -> None:
    """The state machine on ``mounts`` (one node's, or two nodes' of one volume); then the
    volume stays usable and consistent across a remount."""
    clear_dir(mounts[0].path)
    try:
        run_state_machine_as_test(make_machine(*(m.path for m in mounts)), settings=how)
    finally:
        with contextlib.suppress(OSError):
            clear_dir(mounts[0].path)
    for m in mounts:
        m.umount()
    for m in mounts:
        m.mount()
        assert os.listdir(m.path) == []


def test_random_operations_match_local_fs(model_mnt: Mount) -> None:
    run_model([model_mnt], FAST)


@pytest.mark.slow
def test_many_random_operations_match_local_fs(model_mnt: Mount) -> None:
    run_model([model_mnt], THOROUGH)


def test_random_operations_from_two_nodes_match_local_fs(two_nodes: list[Mount]) -> None:
    run_model(two_nodes, TWO_NODES_FAST)


@pytest.mark.slow
def test_many_random_operations_from_two_nodes_match_local_fs(two_nodes: list[Mount]) -> None:
    run_model(two_nodes, TWO_NODES_THOROUGH)


def test_a_file_renamed_over_a_name_with_later_names_lists_once(model_mnt: Mount) -> None:
    """A sequence a random run found: in a scratch dir of a shared volume, the listing after
    it never ended ('a' again and again)."""
    machine = make_machine(model_mnt.path)()
    try:
        machine.populate(seed=0, big=False)  # a (300 B), d/a (5000 B), d/e/a (10 B)
        machine.truncate(path="a", size=0, node=0)
        machine.truncate(path="a", size=0, node=0)
        machine.create(path="c", seed=0, length=0, node=0)
        machine.rename(src="d/a", dst="a", node=0)
        machine.trees_agree()
        assert sorted(os.listdir(machine.fs)) == ["a", "c", "d"]
    finally:
        machine.teardown()
