"""One "node" of a cluster on one machine: the first process of its own mount and PID namespaces.

:mod:`fusestate.spark.cluster` starts it as
``unshare --mount --propagation private --pid --mount-proc --kill-child -- python -m fusestate.spark.node ...``.
Inside, it mounts the shared volume at the node's mountpoint (every node uses the same path,
each with its own daemon, cache dir and runtime dir), makes the node's Spark local dir
inside the volume, runs one command (a Spark worker, or a driver) and waits for it.

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
from typing import Optional, Sequence

from fusestate.namespaces import drop_copies_of_fuse_mounts

STOP_TIMEOUT = 60.0


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fusestate.spark.node")
    p.add_argument("--name", required=True)
    p.add_argument("--mountpoint", required=True)
    p.add_argument("--local-dir", required=True, help="the node's SPARK_LOCAL_DIRS, made before the command starts")
    p.add_argument("--ready", required=True, help="file written once the mount is up and the command started")
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
    if args.mount is not None:
        proc = _fusestate("mount", args.mount[0], args.mountpoint, *args.mount[1:])
        if proc.returncode != 0:
            reason = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            _announce(ready, f"error: node {args.name}: mounting {args.mount[0]} at {args.mountpoint} failed: {reason}")
            return 1
    code = 1
    try:
        Path(args.local_dir).mkdir(parents=True, exist_ok=True)
        if not stopping:
            child = subprocess.Popen(args.command)
            _announce(ready, "ok")
            code = _wait(child, lambda: stopping)
    finally:
        if args.mount is not None:
            _unmount(args.mountpoint)
    return code


def _announce(ready: Path, text: str) -> None:
    """Write the ready file whole or not at all: the harness reads it as soon as it exists."""
    tmp = ready.with_name(ready.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, ready)


def _wait(child: subprocess.Popen, stopping) -> int:
    """Wait for the command, reaping the orphans a namespace's first process inherits."""
    deadline: Optional[float] = None
    while True:
        with contextlib.suppress(ChildProcessError):
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                if pid == child.pid:
                    child.returncode = os.waitstatus_to_exitcode(status)
        if child.poll() is not None:
            return child.returncode
        if stopping() and deadline is None:
            deadline = time.monotonic() + STOP_TIMEOUT
        if deadline is not None and time.monotonic() > deadline:
            child.kill()
        time.sleep(0.2)


def _unmount(mountpoint: str) -> None:
    daemon = _daemon_pid(mountpoint)
    for _ in range(30):
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
