"""scripts/test.sh, the README's test command: at its end it detaches the mounts its own
tests left behind, and no other mount on the machine (a node's fusestate sidecar, another
run's mounts)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from conftest import ROOT, Bucket, is_mounted, wait_for

# Two test files, so that each of the run's two xdist workers takes one (--dist loadfile). Each mounts
# a volume under its own tmp_path and leaves it mounted, the way a test whose teardown failed
# does; the second also leaves one inside a mount namespace of its own, the way a cluster
# node outliving its test does. They note what they left in $LEFTOVERS.
LEAVE_A_MOUNT = '''
import os, shlex, subprocess, sys, time, uuid
from pathlib import Path

FUSESTATE = str(Path(sys.executable).parent / "fusestate")

def mount_args(tmp_path):
    (tmp_path / "bucket").mkdir()
    return [FUSESTATE, "mount", f"file://{tmp_path}/bucket", str(tmp_path / "mnt"),
            "--cache-dir", str(tmp_path / "cache"), "--metrics-addr", "off"]

def note(kind, text):
    Path(os.environ["LEFTOVERS"], f"{kind}-{uuid.uuid4().hex}").write_text(text)
'''

LEAVE_IN_HOST = LEAVE_A_MOUNT + '''
def test_leaves_a_mount(tmp_path):
    (tmp_path / "mnt").mkdir()
    subprocess.run(mount_args(tmp_path), check=True)
    note("host", str(tmp_path / "mnt"))
'''

LEAVE_IN_NAMESPACE = LEAVE_IN_HOST.replace("test_leaves_a_mount", "test_leaves_another_mount") + '''
# The namespace starts with a copy of every mount on the machine, and an unmount of any of
# them waits for its copies: drop the copies of FUSE mounts first (in this namespace only).
DROP_COPIES = r"""awk '$3 ~ /^fuse/ {print $2}' /proc/self/mounts | while read -r m; do umount -l "$(printf '%b' "$m")"; done"""

def test_leaves_a_mount_in_a_namespace(tmp_path):
    (tmp_path / "mnt").mkdir()
    ready = tmp_path / "ready"
    script = f"{DROP_COPIES}; {shlex.join(mount_args(tmp_path))} && touch {shlex.quote(str(ready))} && exec sleep 600"
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
                             "--", "sh", "-c", script], start_new_session=True)
    note("namespace", f"{proc.pid} {tmp_path / 'mnt'}")
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the namespace's mount failed"
        time.sleep(0.05)
    assert not os.path.ismount(tmp_path / "mnt")  # seen inside the namespace only
'''


def _namespace_mounts(pid: int) -> list[str]:
    """Mountpoints as the mount namespace of ``pid`` sees them."""
    with open(f"/proc/{pid}/mounts") as f:
        return [line.split()[1] for line in f]


def test_run_detaches_its_own_mounts_and_no_other(tmp_path: Path, make_mount, file_bucket: Bucket) -> None:
    outside = make_mount(file_bucket).mount()  # a mount the run did not make: it must keep working
    (outside.path / "before").write_bytes(b"written before the run")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_a.py").write_text(LEAVE_IN_HOST)
    (suite / "test_b.py").write_text(LEAVE_IN_NAMESPACE)
    leftovers = tmp_path / "leftovers"
    leftovers.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # a run of its own
    env.update(LEFTOVERS=str(leftovers), FUSESTATE_TEST_WORKERS="2")
    host: list[str] = []
    namespaces: list[tuple[int, str]] = []
    try:
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), str(suite)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        for note in sorted(leftovers.iterdir()):
            if note.name.startswith("host-"):
                host.append(note.read_text())
            else:
                pid, path = note.read_text().split(" ", 1)
                namespaces.append((int(pid), path))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "3 passed" in proc.stdout, proc.stdout

        # The mount made outside the run still answers, with its files.
        assert is_mounted(outside.path)
        assert (outside.path / "before").read_bytes() == b"written before the run"
        (outside.path / "after").write_bytes(b"written after the run")
        assert (outside.path / "after").read_bytes() == b"written after the run"
        assert sorted(os.listdir(outside.path)) == ["after", "before"]

        # What the run left is gone: each xdist worker's, and the one in the namespace it made.
        workers = {part for path in host for part in Path(path).parts if part.startswith("popen-gw")}
        assert workers == {"popen-gw0", "popen-gw1"}, host
        assert not [path for path in host if is_mounted(Path(path))]
        assert all(f"detached {path} (fuse.fusestate)" in proc.stderr for path in host), proc.stderr
        assert len(namespaces) == 1, namespaces
        pid, path = namespaces[0]
        assert path not in _namespace_mounts(pid)
        _end_namespaces(namespaces)
        outside.umount()
    finally:
        for path in host:
            if is_mounted(Path(path)):
                subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True)
        _end_namespaces(namespaces)


def _end_namespaces(namespaces: list[tuple[int, str]]) -> None:
    """Kill each namespace's unshare: with --kill-child, every process in it goes too."""
    for pid, _ in namespaces:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), timeout=30, what="the namespace's end")


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True
