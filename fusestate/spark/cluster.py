"""A Spark standalone cluster on one machine whose workers are separate nodes on one shared volume.

This is the deployment fusestate is for, made small enough for a test or a benchmark: a
master, workers and a driver, where every worker and the driver is a "node" of its own
(:mod:`fusestate.spark.node`: its own mount and PID namespaces, its own fusestate daemon,
cache dir and runtime dir) and every node mounts the same volume at the same path. A
shared volume's namespace lives in PostgreSQL (``--meta``), so what one node commits, the
others see. Each node has its own loopback address (127.0.0.2, 127.0.0.3, ...), so Spark
sees separate hosts, and its own ``SPARK_LOCAL_DIRS`` inside the volume
(``<mountpoint>/nodes/<node>/spark-local``): a state store's working files are on the
volume, so the shim links them into the checkpoint and back.

Losing a node (:meth:`Node.kill`) kills its namespace's first process: every process of
the node dies at once, its daemon too, and :meth:`Node.wipe_cache` removes what it had
cached, as a replaced machine would come back.

    fusestate spark-cluster --workers 2 --batches 8 --lose-worker-after 3

runs the reference pipeline on such a cluster (see :func:`run`), on a ``file://`` bucket
and a PostgreSQL server it starts unless ``--bucket`` and ``--meta`` name others.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

from fusestate.errors import UserError
from fusestate.spark.arguments import DEFAULT_MOUNTPOINT

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
    from fusestate.meta.local_postgres import free_port

    return free_port(host)


def _tail(path: Path, lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    return ""


class Node:
    """A process tree in its own mount and PID namespaces, with its own fusestate mount."""

    def __init__(self, name: str, host: str, root: Path, mountpoint: str,
                 mount_args: Optional[list[str]], local_dir: str) -> None:
        self.name = name
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
        return dict(os.environ, FUSESTATE_RUNTIME_DIR=str(self.runtime_dir), SPARK_LOCAL_IP=self.host,
                    SPARK_LOCAL_DIRS=self.local_dir, PYSPARK_PYTHON=sys.executable,
                    PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOG_DIR=str(self.work_dir))

    def start(self, command: list[str], env: Optional[dict[str, str]] = None,
              timeout: float = START_TIMEOUT) -> None:
        """Start the node (mount, then ``command``) and wait until the command runs."""
        ready = self.root / "ready"
        ready.unlink(missing_ok=True)
        init = [sys.executable, "-m", "fusestate.spark.node", "--name", self.name, "--mountpoint", self.mountpoint,
                "--local-dir", self.local_dir, "--ready", str(ready)]
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

    ``volume_url=None`` is the baseline a benchmark compares with: no mounts, every node's
    local dir on local disk, and the checkpoint in a plain directory that all nodes share
    (a favourable stand-in for HDFS or an object store connector)."""

    def __init__(self, root: str | os.PathLike, volume_url: Optional[str], meta_url: Optional[str], *,
                 mountpoint: str = DEFAULT_MOUNTPOINT, mount_options: Sequence[str] = (),
                 worker_cores: int = 1, worker_memory: str = "1g", session_timeout: float = 10.0) -> None:
        self.root = Path(root).resolve()
        self.volume_url = volume_url
        self.meta_url = meta_url
        self.mountpoint = mountpoint
        self.mount_options = ["--meta", meta_url or "", "--session-timeout", str(session_timeout), *mount_options]
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

    def alive_workers(self) -> list[str]:
        state = self.master_state() or {}
        return sorted(w["host"] for w in state.get("workers", []) if w.get("state") == "ALIVE")

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
        """Where a query's checkpoint goes: on the volume through the shim, or (baseline) in a
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


# --- the command ---------------------------------------------------------------------------

CLUSTER_CONF = [
    # Spark prefers the executor that had a state store loaded; 0 s lets a partition move to a
    # free executor at once, which is what a lost node forces anyway.
    "spark.locality.wait=0s",
    "spark.executor.memory=1g",
]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start a cluster, run the pipeline on it (optionally losing a worker), print a summary."""
    root = Path(args.root or tempfile.mkdtemp(prefix="fusestate-cluster-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    output = Path(args.output).resolve() if args.output else root / "output"
    server = None
    try:
        meta = args.meta
        if meta is None:
            from fusestate.meta.local_postgres import LocalPostgres

            print("== starting a PostgreSQL server for the volume's metadata", flush=True)
            server = LocalPostgres()
            meta = server.create_database("fusestate")
        bucket = args.bucket
        if bucket is None:
            (root / "bucket").mkdir(exist_ok=True)
            bucket = f"file://{root / 'bucket'}"
        query = f"q{uuid.uuid4().hex[:8]}"
        with Cluster(root, bucket, meta, mountpoint=args.mountpoint) as cluster:
            print(f"== starting a Spark master and {args.workers} worker nodes on {bucket} at {args.mountpoint}",
                  flush=True)
            cluster.start(args.workers)
            report = root / "report.json"
            pipeline = ["--output", str(output), "--report", str(report), "--checkpoint", cluster.checkpoint(query),
                        "--batches", str(args.batches), "--keys", str(args.keys),
                        "--partitions", str(args.partitions), *[a for c in CLUSTER_CONF for a in ("--conf", c)]]
            print(f"== the pipeline, driver on its own node; logs under {root}/nodes", flush=True)
            driver = cluster.start_driver(pipeline)
            lost = None
            if args.lose_worker_after is not None:
                done = output / f"batch-{args.lose_worker_after:06d}" / "_SUCCESS"
                while not done.exists() and driver.alive():
                    time.sleep(0.2)
                if driver.alive():
                    lost = cluster.workers[-1]
                    lost.kill()
                    lost.wipe_cache()
                    print(f"== lost {lost.name} ({lost.host}) after batch {args.lose_worker_after}", flush=True)
            code = driver.wait()
            if code != 0:
                raise ClusterError(f"the pipeline failed (exit status {code}): {_tail(driver.log)}")
            result = json.loads(report.read_text())
        print_summary(result, lost.name if lost else None)
        return result
    finally:
        if server is not None:
            server.close()
        if not args.keep and args.root is None:
            shutil.rmtree(root, ignore_errors=True)


def print_summary(report: dict[str, Any], lost: Optional[str]) -> None:
    s = report["summary"]
    print("== cluster summary")
    print(f"batches           {s.get('batches', 0)} ({s.get('rows', 0):,} rows), "
          f"{s.get('records_per_second') or 0:,.0f} records/s")
    print(f"state files       {s.get('rocksdb_files_copied', 0):,} linked by the shim on loads and commits")
    if lost:
        print(f"lost node         {lost}: its partitions moved to the remaining workers")
