"""A Spark standalone cluster on one machine whose workers are separate nodes on one shared volume.

This is the deployment fusestate is for, made small enough for a test or a benchmark: a
master, workers and a driver, where every worker and the driver is a "node" of its own
(:mod:`fusestate.spark.node`: its own mount and PID namespaces, its own fusestate daemon,
cache dir and runtime dir) and every node mounts the same volume at the same path. A
shared volume's namespace lives in PostgreSQL (``--meta``), so what one node commits, the
others see. Each node has its own loopback address (127.0.0.2, 127.0.0.3, ...), so Spark
sees separate hosts, and its own ``SPARK_LOCAL_DIRS`` inside the volume
(``<mountpoint>/nodes/<node>/spark-local``): a state store's working files are on the
volume, so the shim links them into the checkpoint and back. Every daemon mounts with
``--scratch 'blockmgr-*' --scratch 'spark-*-*-*-*-*'``: a node's shuffle files stay on it,
as on a local disk (other executors fetch them from its block manager, never through the
file system), and so do its state stores' working files until a commit links them into
the checkpoint (``fusestate.spark.config.LOCAL_DIR_SCRATCH``).

Losing a node (:meth:`Node.kill`) kills its namespace's first process: every process of
the node dies at once, its daemon too, and :meth:`Node.wipe_cache` removes what it had
cached, as a replaced machine would come back. Killing its daemon alone
(:meth:`Node.kill_daemon`, an OOM kill or a crash) leaves the node with a dead mount: the
node's supervisor (:mod:`fusestate.spark.node`) then stops a worker's processes at once, so
Spark treats its executors as lost, and mounts the volume again; the driver's pipeline stops
its query, naming the mount, and resumes it once the mount is back.

    fusestate spark-cluster --workers 2 --batches 8 --lose-worker-after 3
    fusestate spark-cluster --workers 2 --batches 8 --kill-daemon-after 2 [--kill-daemon-of driver]

runs the reference pipeline on such a cluster (see :func:`run`), on a ``file://`` bucket
and a PostgreSQL server it starts unless ``--bucket`` and ``--meta`` name others.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from fusestate.errors import UserError
from fusestate.spark.arguments import DEFAULT_MOUNTPOINT
from fusestate.spark.config import scratch_options
from fusestate.spark.pipeline import (REPORT_NAME, SPARK_LOG_NAME, BatchLines, aligned, changelog_note, check_key_skew,
                                      file_rows, run_rows, write_report)

MASTER_HOST = "127.0.0.1"
DRIVER_HOST = "127.0.0.1"
START_TIMEOUT = 120.0


class ClusterError(UserError):
    """The cluster could not be started, or a node of it failed."""


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def worker_host(index: int) -> str:
    """The loopback address of worker ``index`` (0-based): 127.0.0.2, 127.0.0.3, ..."""
    return f"127.0.0.{index + 2}"


def _free_port(host: str) -> int:
    from fusestate.harness.postgres import free_port

    return free_port(host)


def _tail(path: Path, lines: int = 5) -> str:
    """The last lines of a log, for a one-line error: without the pipeline's JSON records."""
    with contextlib.suppress(OSError):
        text = [ln for ln in path.read_text(errors="replace").strip().splitlines() if not ln.startswith("{")]
        return " | ".join(text[-lines:])
    return ""


class Node:
    """A process tree in its own mount and PID namespaces, with its own fusestate mount."""

    def __init__(self, name: str, host: str, root: Path, mountpoint: str,
                 mount_args: Optional[list[str]], local_dir: str, when_daemon_dies: str = "restart") -> None:
        self.name = name
        self.when_daemon_dies = when_daemon_dies  # see fusestate.spark.node
        self.host = host
        self.root = root
        self.mountpoint = mountpoint
        self.mount_args = mount_args  # URL and 'fusestate mount' options; None: no mount
        self.local_dir = local_dir    # the node's SPARK_LOCAL_DIRS
        self.proc: Optional[subprocess.Popen] = None
        # A control socket's path must fit in 108 bytes: the runtime dir is short, not under root.
        self.runtime_dir = Path(tempfile.mkdtemp(prefix=f"fusestate-{name}-"))
        for d in (self.cache_dir, self.work_dir):
            d.mkdir(parents=True, exist_ok=True)

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    @property
    def work_dir(self) -> Path:
        return self.root / "work"

    @property
    def log(self) -> Path:
        return self.root / "node.log"

    def env(self) -> dict[str, str]:
        return dict(os.environ, FUSESTATE_RUNTIME_DIR=str(self.runtime_dir), FUSESTATE_NODE_NAME=self.name,
                    SPARK_LOCAL_IP=self.host,
                    SPARK_LOCAL_DIRS=self.local_dir, PYSPARK_PYTHON=sys.executable,
                    PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOG_DIR=str(self.work_dir))

    def start(self, command: list[str], env: Optional[dict[str, str]] = None,
              timeout: float = START_TIMEOUT) -> None:
        """Start the node (mount, then ``command``) and wait until the command runs."""
        ready = self.root / "ready"
        ready.unlink(missing_ok=True)
        init = [sys.executable, "-m", "fusestate.spark.node", "--name", self.name, "--mountpoint", self.mountpoint,
                "--local-dir", self.local_dir, "--ready", str(ready), "--when-daemon-dies", self.when_daemon_dies]
        if self.mount_args is not None:
            init += ["--mount", *self.mount_args, "--cache-dir", str(self.cache_dir)]
        init += ["--command", *command]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--pid", "--mount-proc", "--kill-child", "--",
                 *init], env=env or self.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise ClusterError(f"node {self.name} did not start: {_tail(self.log)}")
            time.sleep(0.1)
        text = ready.read_text().strip()
        if text != "ok":
            self.wait(30)
            raise ClusterError(text.removeprefix("error: "))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _init_pid(self) -> Optional[int]:
        """The namespace's first process (the child of unshare), as this namespace sees it."""
        if not self.alive():
            return None
        with contextlib.suppress(OSError, ValueError):
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            return int(children[0]) if children else None
        return None

    def spawn(self, argv: Sequence[str], **popen: Any) -> subprocess.Popen:
        """``argv`` started inside the node's mount namespace (its mount as its own processes
        see it), with the node's environment."""
        pid = self._init_pid()
        if pid is None:
            raise ClusterError(f"node {self.name} is not running")
        return subprocess.Popen(["nsenter", "--target", str(pid), "--mount", "--", *argv], env=self.env(), **popen)

    def processes(self) -> list[int]:
        """Every process of the node, as the machine sees them (the namespace's first one first)."""
        found: list[int] = []
        todo = [self.proc.pid] if self.alive() else []
        while todo:
            pid = todo.pop(0)
            found.append(pid)
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{pid}/task"):
                    todo += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        return found[1:]  # not unshare itself

    def daemon_pid(self) -> Optional[int]:
        """The node's fusestate daemon, as the machine sees it."""
        for pid in self.processes():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"fusestate" in argv and b"mount" in argv and b"--foreground" in argv:
                    return pid
        return None

    def kill_daemon(self) -> int:
        """SIGKILL the node's fusestate daemon alone (an OOM kill, a crash): the node and its
        mount stay, the mount answering ENOTCONN until the node mounts again. Its pid."""
        pid = self.daemon_pid()
        if pid is None:
            raise ClusterError(f"node {self.name} has no fusestate daemon running")
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait(self, timeout: Optional[float] = None) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 90.0) -> None:
        """Stop the command, unmount, and wait for the node to end."""
        if not self.alive():
            return
        pid = self._init_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """Lose the node: every process in it dies at once, its fusestate daemon too."""
        if self.proc is None:
            return
        pid = self._init_pid()
        with contextlib.suppress(ProcessLookupError):
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            self.proc.kill()
        self.proc.wait()
        if pid is not None:  # the namespace is gone when its first process is
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    def wipe_cache(self) -> None:
        """Remove everything the node had on its own disk (its cache, staging and logs stay
        out of the volume), as a replacement machine would start."""
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.cache_dir.mkdir(parents=True)

    def remove_runtime_dir(self) -> None:
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        """The node's fusestate daemon's status (``fusestate status`` as JSON)."""
        from fusestate.daemon.control import fetch_status

        return fetch_status(self.mountpoint, runtime=str(self.runtime_dir))


class Cluster:
    """A master, worker nodes and driver nodes on one shared volume. Use as a context manager:
    every node is stopped and unmounted on exit, also after a failure.

    ``volume_url=None``: no mounts, every node's local dir on local disk, and the checkpoint
    in a plain directory that all nodes share (the benchmarks' baselines build on it:
    ``bench/baseline_cluster.py``)."""

    def __init__(self, root: str | os.PathLike, volume_url: Optional[str], meta_url: Optional[str], *,
                 mountpoint: str = DEFAULT_MOUNTPOINT, mount_options: Sequence[str] = (),
                 worker_cores: int = 1, worker_memory: str = "1g", session_timeout: float = 10.0) -> None:
        self.root = Path(root).resolve()
        self.volume_url = volume_url
        self.meta_url = meta_url
        self.mountpoint = mountpoint
        self.mount_options = ["--meta", meta_url or "", "--session-timeout", str(session_timeout),
                              *scratch_options(), *mount_options]
        self.worker_cores = worker_cores
        self.worker_memory = worker_memory
        self.master: Optional[subprocess.Popen] = None
        self.master_port = 0
        self.master_ui_port = 0
        self.workers: list[Node] = []
        self.drivers: list[Node] = []
        self.root.mkdir(parents=True, exist_ok=True)

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def master_url(self) -> str:
        return f"spark://{MASTER_HOST}:{self.master_port}"

    def mount_args(self, volume_url: Optional[str] = None, meta_url: Optional[str] = None,
                   metrics_host: Optional[str] = None) -> list[str]:
        opts = list(self.mount_options)
        if meta_url is not None:
            opts[opts.index("--meta") + 1] = meta_url
        addr = f"{metrics_host}:{_free_port(metrics_host)}" if metrics_host else "off"
        url = volume_url or self.volume_url
        assert url is not None
        return [url, *opts, "--metrics-addr", addr]

    def start(self, workers: int = 2) -> "Cluster":
        self.start_master()
        for _ in range(workers):
            self.add_worker()
        self.wait_for_workers(workers)
        return self

    def start_master(self) -> None:
        self.master_port, self.master_ui_port = _free_port(MASTER_HOST), _free_port(MASTER_HOST)
        log_dir = self.root / "master"
        log_dir.mkdir(exist_ok=True)
        env = dict(os.environ, SPARK_LOCAL_IP=MASTER_HOST, SPARK_LOG_DIR=str(log_dir), SPARK_DAEMON_MEMORY="512m")
        with open(log_dir / "master.log", "ab") as log:
            self.master = subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), "org.apache.spark.deploy.master.Master",
                 "--host", MASTER_HOST, "--port", str(self.master_port), "--webui-port", str(self.master_ui_port)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while self.master_state() is None:
            if self.master.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"the Spark master did not start: {_tail(log_dir / 'master.log')}")
            time.sleep(0.3)

    def master_state(self) -> Optional[dict[str, Any]]:
        """The master's view (workers, applications), from its web UI's JSON."""
        try:
            with urllib.request.urlopen(f"http://{MASTER_HOST}:{self.master_ui_port}/json/", timeout=5) as r:
                return json.load(r)
        except (OSError, ValueError):
            return None

    def worker_records(self) -> list[dict[str, Any]]:
        """The master's record of every worker it has seen (id, host, state)."""
        return list((self.master_state() or {}).get("workers", []))

    def alive_workers(self) -> list[str]:
        return sorted(w["host"] for w in self.worker_records() if w.get("state") == "ALIVE")

    def wait_for_workers(self, count: int, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while len(self.alive_workers()) < count:
            if time.monotonic() > deadline:
                raise ClusterError(f"{len(self.alive_workers())} of {count} Spark workers registered with the "
                                   f"master after {timeout:.0f} s; see the node logs under {self.root}/nodes")
            time.sleep(0.3)

    @property
    def shared_volume(self) -> bool:
        return self.volume_url is not None

    def checkpoint(self, query: str) -> str:
        """Where a query's checkpoint goes: on the volume through the shim, or (no volume) in a
        directory every node shares."""
        if self.shared_volume:
            return f"fusestate://{self.mountpoint}/checkpoints/{query}"
        return f"file://{self.root / 'checkpoints' / query}"

    def node(self, name: str, host: str, mount_args: Optional[list[str]]) -> Node:
        root = self.root / "nodes" / name
        local = f"{self.mountpoint}/nodes/{name}/spark-local" if self.shared_volume else str(root / "spark-local")
        return Node(name, host, root, self.mountpoint, mount_args, local)

    def add_worker(self, name: Optional[str] = None, *, mount: bool = True, volume_url: Optional[str] = None,
                   meta_url: Optional[str] = None) -> Node:
        """Start a worker node. ``mount=False`` or another volume make a misconfigured node."""
        index = len(self.workers)
        host = worker_host(index)
        node = self.node(name or f"worker{index + 1}", host,
                         self.mount_args(volume_url, meta_url, host) if mount and self.shared_volume else None)
        env = node.env()
        env["SPARK_DAEMON_MEMORY"] = "512m"
        node.start([str(spark_home() / "bin" / "spark-class"), "org.apache.spark.deploy.worker.Worker",
                    "--host", host, "--cores", str(self.worker_cores), "--memory", self.worker_memory,
                    "--work-dir", str(node.work_dir), "--webui-port", str(_free_port(host)), self.master_url],
                   env=env)
        self.workers.append(node)
        return node

    def start_driver(self, pipeline_args: Sequence[str], name: Optional[str] = None,
                     mount_args: Optional[list[str]] = None) -> Node:
        """Start the reference pipeline (``fusestate spark-pipeline`` arguments) on a driver
        node of its own; its ``--master`` is this cluster's. Wait with :meth:`Node.wait`.
        ``mount_args`` mount something else than the cluster's volume there."""
        name = name or f"driver{len(self.drivers) + 1}"
        if mount_args is None and self.shared_volume:
            mount_args = self.mount_args()
        node = self.node(name, DRIVER_HOST, mount_args)
        node.when_daemon_dies = "remount"  # the pipeline resumes its query once the mount is back
        state_dir = str(Path(node.local_dir).parent)
        args = ["--master", self.master_url, "--state-dir", state_dir,
                "--expect-executors", str(sum(1 for w in self.workers if w.alive()))]
        if self.shared_volume:
            args.append("--use-shim")
        else:
            args.append("--local")
        node.start([sys.executable, "-m", "fusestate", "spark-pipeline", *args, *pipeline_args])
        self.drivers.append(node)
        return node

    def close(self) -> None:
        for node in [*self.drivers, *self.workers]:
            with contextlib.suppress(Exception):
                node.stop()
            node.remove_runtime_dir()
        if self.master is not None and self.master.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.master.pid, signal.SIGTERM)
            try:
                self.master.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.master.pid, signal.SIGKILL)
                self.master.wait()


# --- what the daemons did --------------------------------------------------------------------

COUNTERS = {  # what the summary shows of each node's daemon: name -> (status section, key)
    "links": ("fuse", "operation_counts.link"), "uploaded_bytes": ("writeback", "uploaded_bytes"),
    "fetched_bytes": ("remote", "bytes_in"), "page_fill_bytes": ("page_fill", "bytes"),
    # files asked for by name: a lost executor's stores, by the shim's LossFill plugin
    "asked_fill_bytes": ("page_fill", "requested_bytes"),
}


def _counter(status: dict[str, Any], section: str, key: str) -> int:
    value: Any = status.get(section, {})
    for part in key.split("."):
        value = value.get(part, 0) if isinstance(value, dict) else 0
    return int(value or 0)


class Traffic:
    """Each node's daemon counters over a run, across the restarts of its daemon: a daemon's
    numbers count from its own start, so a restarted one adds its own to what the dead one
    had shown when last asked."""

    def __init__(self) -> None:
        self.first: dict[tuple[str, int], dict[str, int]] = {}  # (node, daemon pid) -> counters
        self.last: dict[tuple[str, int], dict[str, int]] = {}

    def sample(self, nodes: Sequence[Node]) -> None:
        for node in nodes:
            try:
                status = node.status()
            except Exception:  # noqa: BLE001 - a node without a live daemon has nothing to add
                continue
            key = (node.name, int(status.get("pid", 0)))
            counters = {name: _counter(status, *where) for name, where in COUNTERS.items()}
            if key not in self.first:
                # A node's first daemon counts from this sample, a restarted one from its start.
                known = any(name == node.name for name, _ in self.first)
                self.first[key] = counters if not known else {name: 0 for name in COUNTERS}
            self.last[key] = counters

    def totals(self) -> dict[str, dict[str, int]]:
        """Per node: each counter's growth since the first sample, every daemon of it summed."""
        out: dict[str, dict[str, int]] = {}
        for (node, pid), last in self.last.items():
            first = self.first[(node, pid)]
            mine = out.setdefault(node, {name: 0 for name in COUNTERS} | {"daemons": 0})
            mine["daemons"] += 1
            for name in COUNTERS:
                mine[name] += last[name] - first[name]
        return out


def difference(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """What each node's daemons did between two :meth:`Traffic.totals`."""
    return {node: {k: v - before.get(node, {}).get(k, 0) for k, v in counts.items()} for node, counts in after.items()}


# --- the command ---------------------------------------------------------------------------

CLUSTER_CONF = [
    # Spark prefers the executor that had a state store loaded; 0 s lets a partition move to a
    # free executor at once, which is what a lost node forces anyway.
    "spark.locality.wait=0s",
    "spark.executor.memory=1g",
]
# A restart (--restart-after) keeps Spark's own locality wait: each state store's first task
# waits up to 3 s for the node StoreAffinity placed it on.
RESTART_CONF = ["spark.locality.wait=3s", *CLUSTER_CONF[1:]]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start a cluster, run the pipeline on it (optionally losing a worker, or killing a node's
    daemon alone), show its batches as they complete and a summary; the report goes to a file,
    and to stdout with ``--json``."""
    check_key_skew(args.key_skew)  # here, not in the driver once the nodes have started
    faults = planned_faults(args)
    root = Path(args.root or tempfile.mkdtemp(prefix="fusestate-cluster-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    kept = args.keep or args.root is not None
    output = Path(args.output).resolve() if args.output else _default_output(root, kept)
    report_path = Path(args.report).resolve() if args.report else output / REPORT_NAME
    say = partial(print, file=sys.stderr if args.json else sys.stdout, flush=True)  # stdout: JSON only
    server = None
    try:
        meta = args.meta
        if meta is None and args.meta_ha:
            from fusestate.harness.ha import LocalHA

            say("== starting PostgreSQL with a synchronous standby under Patroni (etcd) for the volume's metadata")
            server = LocalHA()
            meta = server.create_database("fusestate")
            for fault in faults:
                fault.database = server
        elif meta is None:
            from fusestate.harness.postgres import LocalPostgres

            say("== starting a PostgreSQL server for the volume's metadata")
            server = LocalPostgres()
            meta = server.create_database("fusestate")
        bucket = args.bucket
        if bucket is None:
            (root / "bucket").mkdir(exist_ok=True)
            bucket = f"file://{root / 'bucket'}"
        query = f"q{uuid.uuid4().hex[:8]}"
        # A session must outlive a failover of the database (docs/deploy.md): 1.5 times it, at least.
        outlive = {"session_timeout": HA_SESSION_TIMEOUT} if args.meta_ha else {}
        with Cluster(root, bucket, meta, mountpoint=args.mountpoint, **outlive) as cluster:
            nodes = "1 worker node" if args.workers == 1 else f"{args.workers} worker nodes"
            say(f"== starting a Spark master and {nodes} on {bucket} at {args.mountpoint}")
            cluster.start(args.workers)
            def pipeline(batches: int, conf: Sequence[str] = CLUSTER_CONF) -> list[str]:
                return ["--output", str(output), "--report", str(report_path), "--json",
                        "--checkpoint", cluster.checkpoint(query),
                        "--batches", str(batches), "--keys", str(args.keys), "--key-skew", str(args.key_skew),
                        "--partitions", str(args.partitions), "--wait-for-remount", str(REMOUNT_WAIT),
                        "--changelog" if args.changelog else "--no-changelog",
                        *[a for c in conf for a in ("--conf", c)]]

            say(f"== the pipeline, driver on its own node; node logs under {root}/nodes"
                + ("" if kept else " (removed after the run unless --keep)"))
            first = args.batches if args.restart_after is None else args.restart_after + 1
            driver = cluster.start_driver(pipeline(first))
            traffic = Traffic()
            traffic.sample(cluster.workers + cluster.drivers)
            show = BatchLines(args.json, True)
            follow_driver(cluster, driver, faults, show, say, traffic)
            code = driver.wait()
            if code != 0:
                raise ClusterError(f"the pipeline failed (exit status {code}): {_tail(driver.log)}")
            restarted = None
            if args.restart_after is not None:
                say(f"== the query stopped after batch {args.restart_after}; it starts again on a new driver node, "
                    "the same workers")
                restarted = Restart(args.restart_after, traffic, cluster)
                driver = cluster.start_driver(pipeline(args.batches, RESTART_CONF))
                follow_driver(cluster, driver, faults, restarted.watching(show), say, traffic)
                code = driver.wait()
                if code != 0:
                    raise ClusterError(f"the restarted pipeline failed (exit status {code}): {_tail(driver.log)}")
                restarted.placed = placed_stores(output / SPARK_LOG_NAME)
            traffic.sample(cluster.workers + cluster.drivers)
        result = json.loads(report_path.read_text())
        lost = next((f for f in faults if f.kind == LOSE_NODE and f.done), None)
        result["cluster"] = {"workers": args.workers, "bucket": bucket, "mountpoint": args.mountpoint,
                             "lost_worker": lost.node if lost else None,
                             "lost_after_batch": lost.after if lost else None,
                             "faults": [f.record() for f in faults], "nodes": traffic.totals(),
                             "restart": restarted.record() if restarted else None,
                             "root": str(root) if kept else None}
        write_report(report_path, result)
        print(json.dumps(result) if args.json else "\n".join(summary_lines(result)), flush=True)
        return result
    finally:
        if server is not None:
            server.close()
        if not kept:
            shutil.rmtree(root, ignore_errors=True)


REMOUNT_WAIT = 300  # seconds the driver's pipeline waits for its mount to come back (--wait-for-remount)
LOSE_NODE = "lose-node"      # the node's every process at once, its cache wiped: a lost machine
KILL_DAEMON = "kill-daemon"  # the node's fusestate daemon alone (SIGKILL): the node stays
FAIL_OVER = "fail-over"      # the database's primary machine (--meta-ha): its standby is promoted
HA_SESSION_TIMEOUT = 30.0    # with --meta-ha: Patroni here fails over in 10-13 s


class Fault:
    """A fault the run injects once a batch has completed, and what came of it."""

    def __init__(self, kind: str, node: str, after: int) -> None:
        self.kind = kind
        self.node = node
        self.after = after
        self.done_at: Optional[float] = None  # time.monotonic() of the injection
        self.back_after_s: Optional[float] = None  # until the node served again (a killed daemon)
        self.survived_ids: set[str] = set()
        self.nodes_before: dict[str, dict[str, int]] = {}  # Traffic.totals() just before it
        self.database: Any = None  # FAIL_OVER: the LocalHA whose primary goes

    @property
    def done(self) -> bool:
        return self.done_at is not None

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "node": self.node, "after_batch": self.after, "injected": self.done,
                "back_after_s": self.back_after_s, "nodes_before": self.nodes_before}


class Restart:
    """A query stopped after a batch and started again on a new driver node, the workers kept:
    how long its first batch took and what the workers fetched until it was done."""

    def __init__(self, after: int, traffic: Traffic, cluster: "Cluster") -> None:
        self.after = after
        self.traffic = traffic
        self.workers = cluster.workers
        traffic.sample(self.workers)
        self.before = traffic.totals()
        self.started = time.monotonic()
        self.first_batch_s: Optional[float] = None
        self.fetched: dict[str, int] = {}
        self.placed: Optional[tuple[int, int]] = None  # state stores started where they were warm, of all

    def watching(self, show: Callable[[dict], None]) -> Callable[[dict], None]:
        """``show``, which also notes the first batch's end and what the workers fetched until it."""
        def seen(rec: dict) -> None:
            if self.first_batch_s is None:
                self.first_batch_s = round(time.monotonic() - self.started, 1)
                self.traffic.sample(self.workers)
                since = difference(self.traffic.totals(), self.before)
                self.fetched = {w.name: since.get(w.name, {}).get("fetched_bytes", 0) for w in self.workers}
            show(rec)
        return seen

    def record(self) -> dict[str, Any]:
        return {"after_batch": self.after, "first_batch_s": self.first_batch_s,
                "fetched_before_first_batch": self.fetched,
                "stores_placed": self.placed[0] if self.placed else None,
                "stores": self.placed[1] if self.placed else None}


def placed_stores(spark_log: Path) -> Optional[tuple[int, int]]:
    """How many of the restarted query's state stores the shim's StoreAffinity started on a
    node that held them, of how many: from the last line it wrote to the driver's Spark log."""
    found = None
    with contextlib.suppress(FileNotFoundError):
        for m in re.finditer(r"fusestate: (\d+) of (\d+) state stores of query \S+ start on a node",
                             spark_log.read_text(errors="replace")):
            found = (int(m.group(1)), int(m.group(2)))
    return found


def planned_faults(args: argparse.Namespace) -> list[Fault]:
    """The faults the command line asks for: a lost worker node, a node's daemon killed alone."""
    if args.restart_after is not None and not 0 <= args.restart_after < args.batches - 1:
        raise ClusterError(f"--restart-after {args.restart_after}: the batches are 0 to {args.batches - 1}, and "
                           "the restart needs one after it")
    faults = []
    if args.lose_worker_after is not None:
        faults.append(Fault(LOSE_NODE, f"worker{args.workers}", args.lose_worker_after))
    if args.kill_daemon_after is not None:
        name = args.kill_daemon_of or f"worker{args.workers}"
        if name == "driver":
            name = "driver1"
        known = {f"worker{i + 1}" for i in range(args.workers)} | {"driver1"}
        if name not in known:
            raise ClusterError(f"--kill-daemon-of {name}: no such node (the nodes are {', '.join(sorted(known))})")
        if any(f.kind == LOSE_NODE and f.node == name for f in faults):
            raise ClusterError(f"--kill-daemon-of {name}: that node is lost (--lose-worker-after): kill another's daemon")
        faults.append(Fault(KILL_DAEMON, name, args.kill_daemon_after))
    if args.fail_over_after is not None:
        if not args.meta_ha or args.meta:
            raise ClusterError("--fail-over-after needs --meta-ha (the database the run starts)")
        faults.append(Fault(FAIL_OVER, "database", args.fail_over_after))
    return faults


def _default_output(root: Path, kept: bool) -> Path:
    """The pipeline's output, report and Spark log: under a kept root, else a directory of
    their own that outlives the temporary root."""
    return root / "output" if kept else Path(tempfile.mkdtemp(prefix="fusestate-cluster-output-"))


class DriverBatches:
    """The batch records the driver's pipeline prints (``--json``) into its node's log, read as
    they come: whole lines only, each once. Its query's restarts (``{"event": "restart"}``)
    are kept in :attr:`restarts`."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.offset = 0
        self.restarts: list[dict[str, Any]] = []

    def new(self) -> list[dict[str, Any]]:
        with contextlib.suppress(FileNotFoundError), open(self.log, "rb") as f:
            f.seek(self.offset)
            data = f.read()
            whole = data[:data.rfind(b"\n") + 1]
            self.offset += len(whole)
            lines = whole.decode(errors="replace").splitlines()
            self.restarts += [json.loads(line) for line in lines if line.startswith('{"event": "restart"')]
            return [json.loads(line) for line in lines if line.startswith('{"event": "batch"')]
        return []


def follow_driver(cluster: "Cluster", driver: Node, faults: Sequence[Fault], show: Callable[[dict], None],
                  say: Callable[..., None], traffic: Optional[Traffic] = None) -> None:
    """Show each batch as the driver completes it; inject each fault once its batch has
    completed, and say when a node whose daemon was killed serves again."""
    batches = DriverBatches(driver.log)
    nodes = {n.name: n for n in [*cluster.workers, *cluster.drivers]}
    restarts_seen = 0
    while True:
        alive = driver.alive()
        for rec in batches.new():
            show({k: v for k, v in rec.items() if k != "event"})
            for fault in faults:
                if not fault.done and rec["batch"] >= fault.after and alive:
                    if traffic is not None:  # what the node's daemon did, before it goes
                        traffic.sample(list(nodes.values()))
                        fault.nodes_before = traffic.totals()
                    inject(cluster, nodes.get(fault.node), fault, say)  # type: ignore[arg-type]
        for restart in batches.restarts[restarts_seen:]:
            restarts_seen += 1
            say(f"== {driver.name}: {restart['cause']}; the query resumed from its checkpoint after "
                f"{restart['waited_s']:.1f} s")
            for fault in faults:
                if fault.kind == KILL_DAEMON and fault.node == driver.name and fault.back_after_s is None \
                        and fault.done_at is not None:
                    fault.back_after_s = round(time.monotonic() - fault.done_at, 1)
        for fault in faults:
            if fault.kind == KILL_DAEMON and fault.done and fault.back_after_s is None and fault.node != driver.name:
                node = nodes[fault.node]
                if rejoined(cluster, node, fault):
                    assert fault.done_at is not None
                    fault.back_after_s = round(time.monotonic() - fault.done_at, 1)
                    say(f"== {node.name} rejoined the cluster {fault.back_after_s:.1f} s after its daemon was killed "
                        "(mounted again, a new Spark worker)")
        if not alive:
            return
        time.sleep(0.2)


def inject(cluster: "Cluster", node: Node, fault: Fault, say: Callable[..., None]) -> None:
    if fault.kind == FAIL_OVER:
        fail_over(fault, say)
        return
    if fault.kind == LOSE_NODE:
        node.kill()
        node.wipe_cache()
        say(f"== lost {node.name} ({node.host}) after batch {fault.after}")
    else:
        fault.survived_ids = {w["id"] for w in cluster.worker_records() if w.get("state") == "ALIVE"}
        pid = node.kill_daemon()
        say(f"== killed the fusestate daemon of {node.name} ({node.host}, pid {pid}) after batch {fault.after}; "
            "the node stays")
    fault.done_at = time.monotonic()


def fail_over(fault: Fault, say: Callable[..., None]) -> None:
    """Lose the database's primary machine; once the standby is promoted, bring the old
    primary back as its standby (in the background: the query goes on meanwhile)."""
    ha = fault.database
    old = ha.primary()
    ha.kill(old)
    fault.done_at = time.monotonic()
    say(f"== lost the database's primary {old.name} ({old.address}) after batch {fault.after}")

    def rejoin() -> None:
        new = ha.wait_primary(timeout=120, other_than=old)
        assert fault.done_at is not None
        fault.back_after_s = round(time.monotonic() - fault.done_at, 1)
        say(f"== {new.name} ({new.address}) promoted {fault.back_after_s:.1f} s after; {old.name} rejoins as its standby")
        ha.start(old)

    threading.Thread(target=rejoin, name="fail-over", daemon=True).start()


def rejoined(cluster: "Cluster", node: Node, fault: Fault) -> bool:
    """Whether a worker node whose daemon was killed has a new Spark worker registered."""
    return any(w.get("host") == node.host and w.get("state") == "ALIVE" and w.get("id") not in fault.survived_ids
               for w in cluster.worker_records())


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The cluster's run at a glance: what the shim linked, where a lost node's state went and
    what that fetched, each node's bucket traffic; and where the detail is."""
    if not report["summary"].get("batches"):
        return ["== cluster summary: no batch ran", *aligned(file_rows(report))]
    rows = run_rows(report)
    s = report["summary"]
    files, moved = s.get("rocksdb_files_copied", 0), s.get("rocksdb_bytes_copied", 0)
    rows.append(("state files", f"{files:,} linked by the shim on loads and commits"
                                + (f" ({_mib(moved)} that no node copied)" if files else changelog_note(report))))
    cluster = report["cluster"]
    nodes = cluster.get("nodes", {})
    for fault in cluster.get("faults", []):
        if fault["injected"]:
            rows.append(fault_row(report, fault, nodes))
    if cluster.get("restart"):
        rows.append(restart_row(cluster["restart"]))
    if nodes:
        up = sum(n["uploaded_bytes"] for n in nodes.values())
        down = sum(n["fetched_bytes"] for n in nodes.values())
        each = ", ".join(f"{name} {_mib(n['uploaded_bytes'])} up, {_mib(n['fetched_bytes'])} down"
                         for name, n in sorted(nodes.items()))
        rows.append(("bucket", f"{_mib(up)} uploaded, {_mib(down)} fetched ({each})"))
    return ["== cluster summary", *aligned(rows + file_rows(report))]


def restart_row(restart: dict[str, Any]) -> tuple[str, str]:
    """What a restart on the same workers fetched before its first batch was done."""
    fetched = restart["fetched_before_first_batch"]
    each = ", ".join(f"{name} {_mib(n)}" for name, n in sorted(fetched.items()))
    placed = ("" if restart["stores"] is None else
              f"; {restart['stores_placed']} of {restart['stores']} state stores started on a node that held them")
    took = "" if restart["first_batch_s"] is None else f"its first batch done {restart['first_batch_s']:.1f} s later"
    return ("restart", f"after batch {restart['after_batch']} on a new driver, the same workers: {took}"
                       f"{placed}; fetched before it: {_mib(sum(fetched.values()))} ({each})")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def fault_row(report: dict[str, Any], fault: dict[str, Any], nodes: dict[str, dict[str, int]]) -> tuple[str, str]:
    """What a fault did: where the node's state stores went, by links, and what that fetched."""
    after = [b for b in report["batches"] if b["batch"] > fault["after_batch"]]
    loaded = sum(b["rocksdb"].get("rocksdbNumLoadedFromDfs", 0) for b in after)
    since = difference(nodes, fault.get("nodes_before") or {})
    others = sorted(n for n in since if n != fault["node"] and n.startswith("worker"))
    fetched = sum(since[n]["fetched_bytes"] for n in others)
    filled = sum(since[n]["page_fill_bytes"] for n in others)
    asked = sum(since[n]["asked_fill_bytes"] for n in others)
    moved = (f"after it {loaded:,} state stores loaded from the checkpoint by links"
             + (f"; {', '.join(others)} fetched {_mib(fetched)} from the bucket" if others else "")
             + (f" and filled {_mib(filled)} into the page cache" if others and filled else "")
             + (f", {_mib(asked)} of the lost stores' files asked for at the loss" if others and asked else ""))
    if fault["kind"] == FAIL_OVER:
        back = (f"its standby promoted {fault['back_after_s']:.1f} s later" if fault["back_after_s"] is not None
                else "no standby promoted before the query ended")
        return ("database", f"its primary lost after batch {fault['after_batch']}: {back}; the nodes followed it")
    if fault["kind"] == LOSE_NODE:
        return ("lost node", f"{fault['node']} after batch {fault['after_batch']}: its partitions moved to the "
                             f"remaining workers; {moved}")
    if fault["node"].startswith("driver"):
        back = (f"the query resumed from its checkpoint {fault['back_after_s']:.1f} s later"
                if fault["back_after_s"] is not None else "the query did not resume")
        return ("killed daemon", f"{fault['node']}'s after batch {fault['after_batch']}: the query stopped, "
                                 f"naming the mount; {back}")
    back = (f"the node served again {fault['back_after_s']:.1f} s later" if fault["back_after_s"] is not None
            else "the node did not serve again before the query ended")
    return ("killed daemon", f"{fault['node']}'s after batch {fault['after_batch']}: its executors exited at once; "
                             f"{moved}; {back}")
