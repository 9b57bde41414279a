"""Checks of a cluster before a query starts: is the checkpoint one directory every node sees?

On a cluster, the driver writes the checkpoint's logs and every executor commits and loads
state stores in it, each through its own node's fusestate mount. A node whose mount is
missing, or mounts another volume, would write state where no other node looks; Spark
reports that, if at all, deep inside a later batch. These checks turn it into one line
before the query starts:

- the driver's checkpoint is on a shared volume (a PostgreSQL metadata engine), since a
  volume only one node mounts cannot be seen by executors on other nodes;
- every executor sees, at the checkpoint's path, a fusestate mount holding a marker file
  the driver just wrote (a missing mount or another volume does not), and its Spark local
  dir is on that mount too (else the shim copies every state file instead of linking).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from fusestate.spark.config import SparkSetupError, StateLayout

EXECUTOR_WAIT = 90.0
PROBE_ROUNDS = 5


def check_shared_checkpoint(layout: StateLayout, status: Optional[dict[str, Any]]) -> None:
    """The driver's side: a cluster's checkpoint must be on a volume other nodes can mount."""
    if status is None:
        return
    engine = status.get("metadata", {}).get("engine")
    if engine != "postgresql":
        raise SparkSetupError(
            f"checkpoint location {layout.checkpoint_uri} is on {layout.mount}, a volume only this node can "
            f"mount (metadata engine {engine}): executors on other nodes would not see it; mount one shared "
            f"volume on every node (fusestate mount URL {layout.mount} --meta postgresql://...)")


def _probe_factory(checkpoint_dir: str, marker: str):
    """The executor-side probe, built as a closure so that it is shipped by value: an
    executor needs only Python's standard library to run it."""

    def probe(_: Any) -> tuple:
        import os as _os
        import socket
        import time as _time

        _time.sleep(0.3)  # long enough for the scheduler to spread the probes over every executor

        def mount_of(path: str) -> tuple[str, str]:
            best, kind = "", ""
            real = _os.path.realpath(path)
            with open("/proc/self/mounts") as f:
                for line in f:
                    parts = line.split()
                    mp = parts[1].replace("\\040", " ")
                    if (real == mp or mp == "/" or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
                        best, kind = mp, parts[2]
            return best, kind

        host = _os.environ.get("SPARK_LOCAL_IP") or socket.gethostname()
        local = (_os.environ.get("SPARK_LOCAL_DIRS") or "").split(",")[0]
        ckpt_mount, ckpt_kind = mount_of(checkpoint_dir)
        local_mount, local_kind = mount_of(local) if local else ("", "")
        try:
            _os.statvfs(ckpt_mount)
            alive = True
        except OSError:
            alive = False
        return (host, ckpt_mount, ckpt_kind, alive, _os.path.exists(marker), local, local_mount, local_kind)

    return probe


def executor_problem(result: tuple, checkpoint_uri: str) -> Optional[str]:
    """What is wrong with one executor's node, in one line (None: nothing)."""
    host, ckpt_mount, ckpt_kind, alive, sees_marker, local, local_mount, local_kind = result
    where = f"the executor on {host}"
    if not ckpt_kind.startswith("fuse.fusestate"):
        return (f"{where} has no fusestate mount holding the checkpoint {checkpoint_uri} (that path is on "
                f"{ckpt_mount or '?'}, {ckpt_kind or 'unknown'}): mount the shared volume on that node at the "
                f"same path as on the driver")
    if not alive:
        return f"{where}: its fusestate mount {ckpt_mount} does not answer (its daemon has exited)"
    if not sees_marker:
        return (f"{where} mounts another volume at {ckpt_mount}: it does not see the checkpoint the driver "
                f"writes; mount the same bucket and --meta database on every node")
    if local and (local_mount != ckpt_mount or not local_kind.startswith("fuse.fusestate")):
        return (f"{where} has its Spark local dir {local} on {local_mount} ({local_kind}), not on the volume "
                f"at {ckpt_mount}: the shim would copy every state file instead of linking it; set that "
                f"node's SPARK_LOCAL_DIRS inside the volume")
    return None


def executor_count(spark) -> int:
    """Executors registered with the driver (the driver's own block manager not counted)."""
    return int(spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()) - 1


def check_executors(spark, layout: StateLayout, expect: int = 1) -> int:
    """Run the probe on every executor; raise :class:`SparkSetupError` with the first problem.

    Waits for ``expect`` executors to register. Returns how many executors were checked."""
    deadline = time.monotonic() + EXECUTOR_WAIT
    while executor_count(spark) < expect:
        if time.monotonic() > deadline:
            raise SparkSetupError(f"{executor_count(spark)} of {expect} executors registered with the driver "
                                  f"after {EXECUTOR_WAIT:.0f} s: are the workers up, with cores and memory free?")
        time.sleep(0.25)
    marker = Path(layout.checkpoint_dir).parent / f".fusestate-probe-{uuid.uuid4().hex[:12]}"
    marker.write_text("written by the driver to check that every executor sees this volume\n")
    try:
        fd = os.open(marker, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        executors = executor_count(spark)
        probe = _probe_factory(str(layout.checkpoint_dir), str(marker))
        seen: dict[str, tuple] = {}
        for _ in range(PROBE_ROUNDS):
            tasks = 3 * executors
            for result in spark.sparkContext.parallelize(range(tasks), tasks).map(probe).collect():
                seen[result[0]] = result
            if len(seen) >= executors:
                break
        for host in sorted(seen):
            problem = executor_problem(seen[host], layout.checkpoint_uri)
            if problem:
                raise SparkSetupError(problem)
        return len(seen)
    finally:
        marker.unlink(missing_ok=True)
