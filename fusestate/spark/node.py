"""One "node" of a cluster on one machine: the first process of its own mount and PID namespaces.

:mod:`fusestate.spark.cluster` starts it as
``unshare --mount --propagation private --pid --mount-proc --kill-child -- python -m fusestate.spark.node ...``.
Inside, it mounts the shared volume at the node's mountpoint (every node uses the same path,
each with its own daemon, cache dir and runtime dir), makes the node's Spark local dir
inside the volume, runs one command (a Spark worker, or a driver) and waits for it.

It supervises the daemon as systemd or a pod's kubelet would. When the daemon dies alone,
its mount answers ENOTCONN while the node lives on. With ``--when-daemon-dies restart``
(a worker) the node kills every other process of its namespace at once, so the executors
exit and Spark treats them as lost, as it does a lost machine, instead of letting them take
tasks that all fail on the dead mount; then it detaches the dead mount, mounts the volume
again and starts the command again: a worker that registers with the master anew. With
``remount`` (a driver) it only mounts again and leaves the command to notice, since the
pipeline restarts its query itself once the mount is back (``--wait-for-remount``).

Stopping it (SIGTERM) stops the command, then unmounts. Killing it (SIGKILL) is losing the
node: as the namespace's first process its death takes every process of the node with it,
the fusestate daemon included, at once, as a machine that loses power would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from fusestate.namespaces import drop_copies_of_fuse_mounts

STOP_TIMEOUT = 60.0
REMOUNT_BACKOFF = (1.0, 2.0, 5.0, 10.0)  # seconds between attempts to mount again; the last repeats


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fusestate.spark.node")
    p.add_argument("--name", required=True)
    p.add_argument("--mountpoint", required=True)
    p.add_argument("--local-dir", required=True, help="the node's SPARK_LOCAL_DIRS, made before the command starts")
    p.add_argument("--ready", required=True, help="file written once the mount is up and the command started")
    p.add_argument("--when-daemon-dies", choices=("restart", "remount"), default="restart",
                   help="restart: kill the node's processes, mount again, start the command again (a worker); "
                        "remount: mount again and leave the command running (a driver that resumes by itself)")
    p.add_argument("--mount", nargs=argparse.REMAINDER, default=None,
                   help="the rest of 'fusestate mount' after its mountpoint: URL and options (absent: no mount)")
    p.add_argument("--command", nargs=argparse.REMAINDER, required=True)
    # --mount's options precede --command: split by hand, since both take the rest.
    argv = list(argv)
    mount: Optional[list[str]] = None
    if "--command" not in argv:
        p.error("--command is required")
    cut = argv.index("--command")
    head, command = argv[:cut], argv[cut + 1:]
    if "--mount" in head:
        m = head.index("--mount")
        head, mount = head[:m], head[m + 1:]
    args = p.parse_args(head + ["--command", *command])
    args.mount = mount
    args.command = command
    return args


def _fusestate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fusestate", *args], capture_output=True, text=True)


def say(name: str, text: str) -> None:
    """A line of the node's own in its log, among its command's."""
    print(f"node {name}: {text}", flush=True)


class NodeMount:
    """The node's fusestate mount and the daemon that serves it."""

    def __init__(self, name: str, mountpoint: str, args: list[str]) -> None:
        self.name = name
        self.mountpoint = mountpoint
        self.url, self.options = args[0], args[1:]
        self.daemon: Optional[int] = None  # its pid, as this namespace sees it

    def mount(self) -> Optional[str]:
        """Mount; the reason in one line when it failed."""
        proc = _fusestate("mount", self.url, self.mountpoint, *self.options)
        if proc.returncode != 0:
            return (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        self.daemon = _daemon_pid(self.mountpoint)
        return None

    def remount(self, stopping: Callable[[], bool]) -> bool:
        """Detach the dead mount and mount the volume again, retrying until it works or the
        node stops; whether it is mounted."""
        subprocess.run(["fusermount3", "-u", "-z", self.mountpoint], capture_output=True)
        for attempt in range(10**6):
            if stopping():
                return False
            reason = self.mount()
            if reason is None:
                return True
            pause = REMOUNT_BACKOFF[min(attempt, len(REMOUNT_BACKOFF) - 1)]
            say(self.name, f"mounting {self.url} at {self.mountpoint} again failed ({reason}); retrying in {pause:.0f} s")
            _sleep_unless(stopping, pause)
        return False

    def unmount(self) -> None:
        _unmount(self.mountpoint)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    drop_copies_of_fuse_mounts()  # its first process: this is the node's namespace
    ready = Path(args.ready)
    stopping = False
    child: Optional[subprocess.Popen] = None

    def stop(signum, frame) -> None:  # noqa: ARG001 - signal handler
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    os.makedirs(args.mountpoint, exist_ok=True)
    mount = NodeMount(args.name, args.mountpoint, args.mount) if args.mount is not None else None
    if mount is not None:
        reason = mount.mount()
        if reason is not None:
            _announce(ready, f"error: node {args.name}: mounting {mount.url} at {args.mountpoint} failed: {reason}")
            return 1
    code = 1
    try:
        Path(args.local_dir).mkdir(parents=True, exist_ok=True)
        while not stopping:
            if child is None:
                child = subprocess.Popen(args.command)
                if not ready.exists():
                    _announce(ready, "ok")
            code, died = _wait(child, lambda: stopping, mount.daemon if mount else None)
            if died is None or mount is None:
                break
            say(args.name, f"the fusestate daemon serving {args.mountpoint} (pid {mount.daemon}) died ({died}); "
                           "its mount answers 'Transport endpoint is not connected'")
            if args.when_daemon_dies == "restart":
                killed = _kill_the_rest()
                child = None
                say(args.name, f"stopped the node's {killed} other processes at once (its Spark executors among "
                               "them: Spark moves their tasks and state stores elsewhere)")
            started = time.monotonic()
            if not mount.remount(lambda: stopping):
                break
            Path(args.local_dir).mkdir(parents=True, exist_ok=True)
            say(args.name, f"mounted {mount.url} at {args.mountpoint} again after {time.monotonic() - started:.1f} s "
                           f"(daemon pid {mount.daemon})" + ("; starting the command again" if child is None else ""))
    finally:
        if mount is not None:
            mount.unmount()
    return code


def _announce(ready: Path, text: str) -> None:
    """Write the ready file whole or not at all: the harness reads it as soon as it exists."""
    tmp = ready.with_name(ready.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, ready)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _wait(child: subprocess.Popen, stopping: Callable[[], bool],
          daemon: Optional[int]) -> tuple[int, Optional[str]]:
    """Wait for the command to end or the daemon to die, reaping the orphans a namespace's
    first process inherits (the daemon is one: its ``fusestate mount`` has exited). The
    command's exit code, and how the daemon died if it did."""
    deadline: Optional[float] = None
    while True:
        with contextlib.suppress(ChildProcessError):
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                if pid == child.pid:
                    child.returncode = os.waitstatus_to_exitcode(status)
                elif pid == daemon and not stopping():
                    return child.returncode if child.returncode is not None else 1, _describe(status)
        if child.poll() is not None:
            return child.returncode, None
        if daemon is not None and not stopping() and not os.path.exists(f"/proc/{daemon}"):
            return 1, "gone"  # not reaped here: it was not this process's child after all
        if stopping() and deadline is None:
            deadline = time.monotonic() + STOP_TIMEOUT
        if deadline is not None and time.monotonic() > deadline:
            child.kill()
        time.sleep(0.1)


def _kill_the_rest(timeout: float = 30.0) -> int:
    """SIGKILL every process of the namespace but this one (its first), and reap them: a node
    whose mount died leaves the cluster at once, as a lost machine does."""
    own = os.getpid()
    victims = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != own]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
    return len(victims)


def _sleep_unless(stopping: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not stopping() and time.monotonic() < deadline:
        time.sleep(0.1)


def _unmount(mountpoint: str) -> None:
    daemon = _daemon_pid(mountpoint)
    for _ in range(30 if daemon is not None else 0):  # none answers: a dead mount, detached below
        if _fusestate("umount", mountpoint).returncode == 0:
            break
        time.sleep(1)  # a process of the node may still hold a file for a moment
    else:
        subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True)
    if daemon is not None:
        _wait_for(daemon)


def _daemon_pid(mountpoint: str) -> Optional[int]:
    proc = _fusestate("status", "--json", mountpoint)
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return int(json.loads(proc.stdout)["pid"])
    return None


def _wait_for(pid: int, timeout: float = STOP_TIMEOUT) -> None:
    """Wait for the daemon (the namespace's first process inherited it): its unmount returns
    before it has ended its metadata session, and this process leaving would kill it on the
    spot (the other nodes would then clean its session up only after the session timeout,
    as for a lost node)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # not ours after all: watch it instead
            if not os.path.exists(f"/proc/{pid}"):
                return
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
