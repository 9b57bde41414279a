"""A query that stopped because a fusestate mount died: the one line that says so, and the wait
for the mount to come back.

A daemon that dies leaves its mount listed, and every use of it fails with ENOTCONN
("Transport endpoint is not connected"). Spark reports that as an exception on whatever file
it touched first (a shuffle file under ``blockmgr-*``, an offset log entry), which names
neither the node nor the mount. These helpers turn it into a line that does.
"""

from __future__ import annotations

import os
import re
import socket
import time
from typing import Optional

from fusestate.spark.config import is_fusestate_mount

NOT_CONNECTED = "Transport endpoint is not connected"
NODE_NAME_ENV = "FUSESTATE_NODE_NAME"  # names this node in messages (the Kubernetes node, a cluster's node)

# "Lost task 0.3 in stage 3.0 (TID 40) (127.0.0.3 executor 1): java.nio.file.FileSystemException: ..."
LOST_TASK = re.compile(r"Lost task [\d.]+ in stage [\d.]+ \(TID \d+\) \((?P<host>[^\s()]+) executor (?P<executor>[^)]+)\)")
DEAD_PATH = re.compile(r"(?P<path>/[^\s:]*): " + re.escape(NOT_CONNECTED))


def node_name() -> str:
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


def unanswered(mountpoint: str) -> Optional[str]:
    """Why the mount does not answer (its daemon died), or None when it does. statfs, since
    the kernel answers it from no cache."""
    try:
        os.statvfs(mountpoint)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


Daemon = tuple[int, float]  # a daemon: its pid and when it started (a restarted container may reuse the pid)


def daemon_of(mountpoint: str) -> Optional[Daemon]:
    """The daemon serving the mount, or None when none answers."""
    from fusestate.daemon.control import fetch_status
    from fusestate.errors import UserError

    try:
        status = fetch_status(mountpoint)
        return int(status["pid"]), time.time() - float(status["uptime_seconds"])
    except (UserError, OSError, ValueError, KeyError, TypeError):
        return None


def same_daemon(a: Optional[Daemon], b: Optional[Daemon]) -> bool:
    return a is not None and b is not None and a[0] == b[0] and abs(a[1] - b[1]) < 5.0


def own_mount_lost(mountpoint: Optional[str], daemon: Optional[Daemon]) -> Optional[str]:
    """The line for a query that stopped because this node's mount died; None when it answers,
    served by the daemon that served it when the query started (``daemon``). A supervisor may
    have mounted the volume again by the time the query's failure is seen."""
    if not mountpoint:
        return None
    reason = unanswered(mountpoint)
    if reason is None:
        now = daemon_of(mountpoint)
        if daemon is None or same_daemon(now, daemon):
            return None
        reason = f"its daemon, pid {daemon[0]}, is gone" + (f"; pid {now[0]} serves it again" if now else "")
    return f"the fusestate mount {mountpoint} on this node ({node_name()}) died ({reason})"


def executor_mount_lost(trace: str, mountpoint: Optional[str]) -> Optional[str]:
    """The line for a query whose tasks failed on an executor's dead mount, from Spark's
    failure (its trace or message); None when the failure was something else."""
    dead = DEAD_PATH.search(trace)
    if dead is None:
        return None
    path = dead.group("path")
    where = "an executor's node"
    lost = LOST_TASK.findall(trace)
    if lost:
        host, executor = lost[-1]
        where = f"executor {executor}'s node ({host})"
    mount = mountpoint if mountpoint and (path == mountpoint or path.startswith(mountpoint.rstrip("/") + "/")) \
        else None
    what = f"the fusestate mount {mount}" if mount else "the fusestate mount"
    return (f"{what} on {where} does not answer ({NOT_CONNECTED}, on {path}): its daemon died, and the "
            "executor went on taking tasks")


def wait_for_mount(mountpoint: str, timeout: float, poll: float = 1.0) -> bool:
    """Wait until a fusestate mount is back at ``mountpoint`` and answers (a supervisor
    detached the dead one and mounted the volume again); whether it came within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        if is_fusestate_mount(mountpoint) == mountpoint and unanswered(mountpoint) is None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
