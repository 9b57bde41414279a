"""The POSIX suite, run inside a scratch directory of a shared volume.

There every name, inode and attribute lives in the node's memory (``meta.scratch.namespace``), not in
the database: the suite's checks of one directory tree (creates, truncates, links, renames,
link counts, modes and times, open-unlinked files, locks) must come out as on the rest of the
volume. A scratch dir is gone after a remount by design, so a test's remount is skipped here
(what it checks before and after still holds); the checks that read the daemon's counters,
kill it or look at the bucket are not run.
"""

from __future__ import annotations

import inspect
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest
import test_posix
from conftest import Bucket, Mount, native_front_end_missing

# About what a remount keeps, or what only a file of the volume has (its inode number kept).
NOT_IN_SCRATCH = {"test_readdir_after_remount", "test_tree_survives_remount", "test_freed_inode_numbers_are_not_reused"}


class ScratchDir(SimpleNamespace):
    """What the suite's tests use of a mount: its path, and a remount, here a no-op."""

    def umount(self) -> None:
        pass

    def mount(self) -> None:
        pass

    def wipe_cache(self) -> None:
        pass


def _cases() -> list[str]:
    """The suite's tests that take only the mount and use only its path."""
    out = []
    for name, fn in vars(test_posix).items():
        if not name.startswith("test_") or name in NOT_IN_SCRATCH or not callable(fn):
            continue
        if list(inspect.signature(fn).parameters) != ["mnt"]:
            continue
        source = inspect.getsource(fn)
        if any(f"mnt.{attr}" in source for attr in ("status", "umount", "mount(", "kill", "cache_dir", "bucket")):
            continue
        out.append(name)
    return out


@pytest.fixture(scope="module", params=["pyfuse3", "passthrough"])
def shared_scratch_mount(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                         postgres_server) -> Iterator[Mount]:
    """One mount on each front end."""
    if request.param == "passthrough" and (missing := native_front_end_missing()):
        pytest.skip(missing)
    base = tmp_path_factory.mktemp("scratch-posix")
    (base / "bucket").mkdir()
    url = postgres_server.create_database(f"posix{uuid.uuid4().hex[:12]}")
    m = Mount(Bucket("file", f"file://{base / 'bucket'}"), base / "mnt", base / "cache",
              ["--meta", url, "--scratch", "posix-*", "--metrics-addr", "off"])
    try:
        yield m.mount(env={"FUSESTATE_FRONTEND": request.param})
    finally:
        m.cleanup()


@pytest.fixture
def scratch_dir(shared_scratch_mount: Mount) -> Iterator[ScratchDir]:
    path: Path = shared_scratch_mount.path / f"posix-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield ScratchDir(path=path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("case", _cases())
def test_posix_in_a_scratch_dir(case: str, scratch_dir: ScratchDir) -> None:
    getattr(test_posix, case)(scratch_dir)


def test_the_suite_runs_here() -> None:
    """Most of the suite applies: a refactoring that drops it here fails this."""
    assert len(_cases()) >= 50
