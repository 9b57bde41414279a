"""The front ends: which one serves a mount and why, and that the native one serves a real
mount (the conformance files run on both: conftest.BOTH_FRONTENDS)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import Mount, assert_one_line_error, is_mounted, native_front_end_missing

from fusestate.errors import UserError
from fusestate.fuse import frontend


def test_auto_picks_pyfuse3_and_names_pick_their_own() -> None:
    assert frontend.choose("auto").name == "pyfuse3"
    assert frontend.choose("pyfuse3").name == "pyfuse3"
    if not native_front_end_missing():
        assert frontend.choose("native").name == "native"
    with pytest.raises(UserError, match="bad --frontend"):
        frontend.choose("libfuse2")


@pytest.mark.parametrize("release, expected", [
    ("6.18.44-fc-v657", (6, 18)), ("6.9.0", (6, 9)), ("5.15.0-91-generic", (5, 15)), ("6.10rc1", (6, 10)),
    ("weird", (0, 0)),
])
def test_kernel_versions_are_read_from_the_release(release: str, expected: tuple[int, int]) -> None:
    assert frontend.kernel_version(release) == expected


def test_passthrough_needs_kernel_6_9() -> None:
    assert "6.8" in (frontend.passthrough_available("6.8.12") or "")
    if os.geteuid() == 0 and not native_front_end_missing():
        assert frontend.passthrough_available("6.18.1") is None


def test_status_names_the_front_end_and_why(mnt: Mount, frontend: str) -> None:
    fuse = mnt.status()["fuse"]
    assert fuse["frontend"] == frontend
    assert frontend in fuse["frontend_reason"]
    assert fuse["writeback_cache"] is True


def test_a_file_written_on_one_front_end_reads_back_on_the_other(mnt: Mount, frontend: str) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    (mnt.path / "d").mkdir()
    (mnt.path / "d" / "f").write_bytes(data)
    names = [f"n{i:03d}" for i in range(300)]  # more than one listing reply
    for n in names:
        (mnt.path / "d" / n).write_bytes(n.encode())
    mnt.umount()
    other = "pyfuse3" if frontend == "native" else "native"
    if other == "native" and native_front_end_missing():
        pytest.skip(native_front_end_missing())
    mnt.mount(env={"FUSESTATE_FRONTEND": other})
    assert mnt.status()["fuse"]["frontend"] == other
    assert (mnt.path / "d" / "f").read_bytes() == data
    assert sorted(os.listdir(mnt.path / "d")) == sorted(names + ["f"])
    assert all((mnt.path / "d" / n).read_bytes() == n.encode() for n in names[::37])


def test_a_native_front_end_that_cannot_run_is_one_clear_error(make_mount, file_bucket, tmp_path: Path) -> None:
    """Without the extension, --frontend native fails the mount with one line (nothing mounted)."""
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "shadow"))
    shadow = tmp_path / "shadow" / "fusestate_kernel"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    from conftest import fusestate as run

    mnt = make_mount(file_bucket)
    mnt.path.mkdir(parents=True, exist_ok=True)
    proc = run(*mnt.mount_args("--frontend", "native"), check=False, env=env)
    assert proc.returncode != 0
    assert_one_line_error(proc, "--frontend native cannot run", "hidden for the test")
    assert not is_mounted(mnt.path)
