"""A PySpark Structured Streaming job with its RocksDB state on a fusestate mount.

The job reads a deterministic, pre-generated event stream (one CSV file per micro-batch),
drops duplicate events with a watermark, and keeps per-key aggregates whose state holds a
payload of ``--payload-bytes`` per key: the state grows to about ``keys x payload-bytes``
(hex text; RocksDB compresses it to roughly half). Each micro-batch's updated rows are
written by ``foreachBatch`` to ``<output>/batch-<id>`` (overwritten when a batch is re-run
after a restart), so two runs can be compared batch for batch.

    fusestate spark-pipeline --state-dir /mnt/state/job --output /data/out --batches 8 --keys 20000
    fusestate spark-pipeline --local --state-dir /var/tmp/job --output /data/out-local ...

It prints a row per completed micro-batch (records/s, state commit, state files linked or
copied) and a short summary that names the report file (default ``<output>/report.json``):
every batch's metrics, records/s, batch durations, the state store's commit and load
metrics, and fusestate's status (cache, write-back, remote traffic) before and after the
run. ``--json`` prints that detail instead, for scripts: one JSON line per batch
(``{"event": "batch", ...}``), then the report (``{"event": "report", ...}``). Spark's own
output (its log at WARN, the JVM's start-up lines) goes to ``<output>/spark.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from fusestate.errors import UserError
from fusestate.spark.config import CHANGELOG_KEY, missing_scratch, state_conf
from fusestate.spark.mount_loss import Daemon, daemon_of, executor_mount_lost, own_mount_lost, wait_for_mount
from fusestate.spark.preflight import check_executors, check_shared_checkpoint
from fusestate.spark.snapshot_fill import SnapshotFill, fill_latest_snapshot

EPOCH_MS = 1_700_000_000_000          # event time of the first event
BATCH_SPAN_MS = 60_000                # event time covered by one input file
WATERMARK = "30 seconds"
LATE_MS = 5 * 60_000                  # late events are this much behind: dropped by the watermark
INPUT_MTIME = 1_700_000_000           # file times, one second apart: the file source's order
SCHEMA = "event_id LONG, key STRING, ts_ms LONG, value LONG"
REPORT_NAME = "report.json"           # in the output dir, unless --report says otherwise
SPARK_LOG_NAME = "spark.log"          # in the output dir: the JVM's stdout and stderr


class PipelineError(UserError):
    """Spark did not start, or the query failed: one line that names Spark's log, where the
    JVM's trace is."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=1)


# --- the event stream ----------------------------------------------------------------------

KEY_STRIDE = 2_654_435_761             # a prime: event g updates key (g * KEY_STRIDE) % keys


def key_of(g: int, keys: int, key_skew: float = 0.0) -> str:
    """The key of global event ``g``: a permutation of the key space, so that consecutive
    events (and a small batch) hit keys scattered over the whole state, as real traffic does.

    With ``key_skew`` S > 0 the events after the first ``keys`` (which give every key its
    state, in the same order as without) pick a key by rank from Zipf(S): real streams
    concentrate on a few hot keys. Rank r is the key event r wrote first, so the hot keys
    are scattered over the key space, as they are over a hash-partitioned state.
    """
    if key_skew and g >= keys:
        return f"k{(zipf_rank(_unit(g), keys, key_skew) * KEY_STRIDE) % keys:09d}"
    return f"k{(g * KEY_STRIDE) % keys:09d}"


def _unit(g: int) -> float:
    """A uniform number in (0, 1) drawn from ``g`` alone (SplitMix64's finalizer): the same
    for an event in every run and process, with no random generator state to keep in step."""
    z = (g + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return ((z >> 11) + 0.5) / 2**53


def zipf_rank(u: float, keys: int, skew: float) -> int:
    """The rank (0 = hottest) where the cumulative distribution reaches ``u``: a bounded
    Zipf(``skew``) over ``keys`` ranks, taken in its continuous form (density x^-skew on
    [1, keys + 1)), whose CDF inverts in closed form, so a key costs no table of ``keys`` weights.

    expm1 and log1p keep the inverse accurate for a skew near 1, where (keys + 1)^(1 - skew) - 1
    vanishes; at exactly 1 the CDF is logarithmic.
    """
    span = math.log(keys + 1)
    if skew == 1:
        x = math.exp(u * span)
    else:
        a = 1.0 - skew
        x = math.exp(math.log1p(u * math.expm1(a * span)) / a)
    return min(keys - 1, max(0, int(x) - 1))


def check_key_skew(key_skew: float) -> float:
    """--key-skew as a float, refused in one line unless it is a finite number >= 0."""
    if not math.isfinite(key_skew) or key_skew < 0:
        raise UserError(f"--key-skew {key_skew}: expected a number >= 0 (0: uniform keys; 1.1: a Zipf skew "
                        f"where a few keys take most updates)")
    return float(key_skew)


def events_for_batch(b: int, keys: int, events_per_batch: int,
                     count: Optional[int] = None, *, key_skew: float = 0.0) -> list[tuple[int, str, int, int]]:
    """The events of input file ``b``: a pure function of its arguments.

    File ``b`` holds events ``b * events_per_batch`` onwards (``count`` of them, default
    ``events_per_batch``). Every key is visited once in the first ``keys`` events, so after
    ``keys / events_per_batch`` files every key has state; after that once per ``keys``
    events again, or with ``key_skew`` mostly a few hot keys (``key_of``). Every tenth event
    is sent twice; the first event of a file repeats the last one of the previous file (both
    dropped by deduplication), and one event per file is late by five minutes of event time
    (dropped by the watermark).
    """
    count = events_per_batch if count is None else count
    rows: list[tuple[int, str, int, int]] = []
    base = EPOCH_MS + b * BATCH_SPAN_MS
    if b > 0:
        g = b * events_per_batch - 1
        rows.append((g, key_of(g, keys, key_skew),
                     base - BATCH_SPAN_MS + (events_per_batch - 1) * BATCH_SPAN_MS // events_per_batch,
                     (g * 31 + 7) % 1000))
    for j in range(count):
        g = b * events_per_batch + j
        row = (g, key_of(g, keys, key_skew), base + j * BATCH_SPAN_MS // count, (g * 31 + 7) % 1000)
        rows.append(row)
        if j % 10 == 9:
            rows.append(row)
    if b > 0:
        g = 10**12 + b
        rows.append((g, key_of(g, keys, key_skew), base - LATE_MS, 1))
    return rows


def generate_input(input_dir: Path, batches: int, keys: int, events_per_batch: int,
                   last_batch_events: Optional[int] = None, *, key_skew: float = 0.0) -> int:
    """Write the input files that are missing or were made with other parameters; rows in all.

    ``last_batch_events`` makes the last file smaller (a restart after a big state was built).
    Files already there for the same parameters are kept, so a restarted run does not pay
    for the generation again.
    """
    key_skew = check_key_skew(key_skew)
    input_dir.mkdir(parents=True, exist_ok=True)
    manifest = input_dir / "_params.json"
    shape = {"keys": keys, "events_per_batch": events_per_batch, "key_skew": key_skew, "format": 2}
    known: dict[str, int] = {}
    if manifest.exists():
        # A manifest from before --key-skew describes uniform keys, which are still made the same.
        old = {"key_skew": 0.0, **json.loads(manifest.read_text())}
        if {k: old.get(k) for k in shape} == shape:
            known = old.get("files", {})
    total = 0
    for b in range(batches):
        count = last_batch_events if (last_batch_events and b == batches - 1) else events_per_batch
        total += count + count // 10 + (2 if b > 0 else 0)  # len(events_for_batch(...))
        name = f"events-{b:06d}.csv"
        path = input_dir / name
        if known.get(name) == count and path.exists():
            continue
        rows = events_for_batch(b, keys, events_per_batch, count, key_skew=key_skew)
        tmp = input_dir / f".tmp-{name}"
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows(rows)
        os.utime(tmp, (INPUT_MTIME + b, INPUT_MTIME + b))
        os.rename(tmp, path)
        known[name] = count
    wanted = {f"events-{b:06d}.csv" for b in range(batches)}
    for stale in input_dir.glob("events-*.csv"):  # from a run with more batches: not this stream
        if stale.name not in wanted:
            stale.unlink()
    known = {name: count for name, count in known.items() if name in wanted}
    manifest.write_text(json.dumps({**shape, "files": known}))
    return total


# --- the query -----------------------------------------------------------------------------

def session_settings(conf: dict[str, str], jars: list[str], driver_memory: str, master: str) -> dict[str, str]:
    """The session's Spark settings: the state layout's (``conf``) win over the pipeline's own."""
    settings = {"spark.master": master, "spark.app.name": "fusestate-state-pipeline",
                "spark.driver.memory": driver_memory,
                "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                "spark.sql.streaming.noDataMicroBatches.enabled": "false",
                "spark.sql.streaming.numRecentProgressUpdates": "100000",
                "spark.sql.adaptive.enabled": "false"}
    settings.update((k, v) for k, v in conf.items() if k != "spark.sql.streaming.checkpointLocation")
    if jars:
        settings["spark.jars"] = ",".join(jars)
    return settings


def build_session(settings: dict[str, str], log: Path):
    """Start the JVM with its stdout and stderr appended to ``log``, and a session on it.

    Spark's log (at WARN: PySpark's default, kept by ``setLogLevel``) and the JVM's start-up
    lines then stay out of the terminal, which keeps the pipeline's own rows and summary.
    """
    os.environ["SPARK_LOCAL_DIRS"] = settings["spark.local.dir"]   # wins over spark.local.dir if set elsewhere
    from pyspark import SparkConf, SparkContext
    from pyspark.errors import PySparkRuntimeError
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession

    spark_conf = SparkConf().setAll(list(settings.items()))
    with open(log, "ab") as out:
        try:
            gateway = launch_gateway(spark_conf, popen_kwargs={"stdout": out, "stderr": subprocess.STDOUT})
        except PySparkRuntimeError as exc:
            said = " | ".join(_message_lines(_tail_text(log))[-3:])  # the JVM's or launcher's last words
            raise PipelineError(f"Spark did not start: {said or exc} (Spark's log: {log})") from None
    SparkContext(conf=spark_conf, gateway=gateway)
    spark = SparkSession.builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def _tail_text(path: Path, size: int = 256 * 1024) -> str:
    """The end of a log file (a JVM's trace is at its end), or '' when it cannot be read."""
    with contextlib.suppress(OSError):
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    return ""


def _message_lines(text: str) -> list[str]:
    """A trace's or log's lines without stack frames and blank lines."""
    lines = [ln.strip() for ln in text.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith(("at ", "..."))]


def root_cause(text: str) -> str:
    """The innermost exception in a JVM or Python trace: what a one-line error should name."""
    lines = _message_lines(text)
    causes = [ln for ln in lines if ln.startswith("Caused by:")]
    if causes:
        return causes[-1][len("Caused by:"):].strip()
    errors = [ln for ln in lines if "Exception" in ln or "Error" in ln]
    return errors[-1] if errors else (lines[-1] if lines else "")


LOG_ENTRY = re.compile(r"\d\d/\d\d/\d\d \d\d:\d\d:\d\d ")  # how each entry of Spark's log starts


def logged_trace(log_text: str) -> str:
    """The trace Spark logged for the failed query ("Query ... terminated with error", then
    the trace up to the next log entry); '' when there is none."""
    _, found, rest = log_text.rpartition("terminated with error")
    if not found:
        return ""
    trace = []
    for line in rest.splitlines()[1:]:
        if LOG_ENTRY.match(line):
            break
        trace.append(line)
    return "\n".join(trace)


def logged_cause(log_text: str) -> str:
    """The root cause in the trace Spark logged for the failed query; '' when there is none.

    The Python exception names only the innermost message ("no.such.Provider"); the
    trace names the exception too ("java.lang.ClassNotFoundException: no.such.Provider")."""
    return root_cause(logged_trace(log_text))


def query_failure(query, log: Path, mount: Optional[str] = None, daemon: Optional[Daemon] = None) -> Optional[str]:
    """Wait for the query to end; why it failed, in one line, or None when it completed.

    A mount that died is named first (this node's, else an executor's, from the trace), not
    only the exception Spark got on whatever file it touched on it."""
    from pyspark.errors import StreamingQueryException

    try:
        query.awaitTermination()
        failure = query.exception()
    except StreamingQueryException as exc:
        failure = exc
    if failure is None:
        return None
    text = _tail_text(log)
    cause = logged_cause(text) or (str(failure).strip().splitlines() or [""])[0]
    lost = own_mount_lost(mount, daemon) or executor_mount_lost(f"{logged_trace(text)}\n{failure}", mount)
    return f"{lost} ({cause[:300]})" if lost else cause[:500]


def build_query(spark, input_dir: Path, payload_bytes: int):
    from pyspark.sql import functions as F

    raw = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
           .option("header", "false").csv(str(input_dir) + "/events-*.csv"))
    events = raw.withColumn("ts", F.timestamp_millis("ts_ms"))
    deduped = events.withWatermark("ts", WATERMARK).dropDuplicates(["event_id", "ts"])
    pieces = math.ceil(payload_bytes / 64)
    if pieces:
        payload = F.substring(F.concat(*[F.sha2(F.concat_ws(":", "key", "value", F.lit(i)), 256)
                                         for i in range(pieces)]), 1, payload_bytes)
    else:
        payload = F.lit("")
    agg = (deduped.withColumn("payload", payload).groupBy("key")
           .agg(F.count(F.lit(1)).alias("events"), F.sum("value").alias("value_sum"),
                F.max("value").alias("value_max"), F.max("payload").alias("payload")))
    return agg.select("key", "events", "value_sum", "value_max",
                      F.substring(F.sha2("payload", 256), 1, 16).alias("payload_digest"),
                      F.length("payload").alias("payload_len"))


def stop_session(spark, timeout: float = 120.0) -> None:
    """Stop the session and wait until its JVM has exited.

    ``spark.stop()`` leaves the JVM running until this Python process ends, and its
    shutdown hooks then delete Spark's local dirs, which live on the mount: an unmount
    right after the pipeline returned found the mount busy.
    """
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    spark.stop()
    if proc is None:
        return
    with contextlib.suppress(Exception):
        gateway.shutdown()
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # Spark's gateway server exits when its stdin closes
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    SparkContext._gateway = None
    SparkContext._jvm = None


def _shim_counters(spark) -> Optional[dict]:
    """How many state store copies the shim turned into hard links (local mode: one JVM)."""
    try:
        cls = spark.sparkContext._jvm.io.fusestate.hadoop.FusestateFileSystem
        return {"linked": int(cls.linkedCount()), "copied": int(cls.copiedCount()), "synced": int(cls.syncedCount())}
    except Exception as exc:  # noqa: BLE001 - a cluster's executors are other JVMs
        return {"error": str(exc)[:200]}


def batch_writer(output: Path):
    # One part file per state partition, not coalesce(1): coalescing is a narrow
    # dependency, so it would pull the stateful operators into the writer's single task
    # and run every state store of the aggregation one after the other.
    def write(df, batch_id: int) -> None:
        (df.write.mode("overwrite").option("header", "true")
         .csv(f"file://{output}/batch-{batch_id:06d}"))
    return write


# --- reporting -----------------------------------------------------------------------------

def fusestate_status(path: Optional[str]) -> Optional[dict]:
    """The mount's numbers, or None when there is no mount or its daemon does not answer."""
    if not path:
        return None
    from fusestate.daemon.control import fetch_status

    try:
        return fetch_status(path)
    except (UserError, OSError, ValueError):
        return None


class SnapshotFillRequest:
    """The restart's latest snapshot asked for in a thread, beside the JVM's start: finding it
    reads each store's snapshot zip through the mount (a fetch each on a fresh node)."""

    def __init__(self, checkpoint: Path, mount: str) -> None:
        import threading

        self._found: dict[str, Any] = {}
        self._fill: Optional[SnapshotFill] = None
        self._thread = threading.Thread(target=self._run, args=(checkpoint, mount), daemon=True)
        self._thread.start()

    def _run(self, checkpoint: Path, mount: str) -> None:
        try:
            self._fill = fill_latest_snapshot(checkpoint, mount)
            self._found = self._fill.as_dict()
        except Exception as exc:  # noqa: BLE001 - a head start only: the restart works without it
            self._found = {"error": str(exc)}

    def until_first_batch(self, show: Callable[[dict], None]) -> Callable[[dict], None]:
        """``show``, which also lets the held files go once a batch completed: its loads have
        linked them (and a job that runs on must not keep files maintenance deletes)."""
        def shown(rec: dict) -> None:
            self.result()
            show(rec)
        return shown

    def result(self) -> Optional[dict[str, Any]]:
        """What was found and queued; the files held open until now are let go."""
        self._thread.join(timeout=30)
        if self._fill is not None:
            self._fill.release()
        return self._found or None


class _NoFill:
    def result(self) -> None:
        return None

    def until_first_batch(self, show: Callable[[dict], None]) -> Callable[[dict], None]:
        return show


def start_snapshot_fill(layout, enabled: bool):
    """On a mount, with a checkpoint that has committed batches: a restart (one node: on a
    cluster the executors load the stores on their own nodes)."""
    if not enabled or layout.mount is None or layout.checkpoint_dir is None \
            or not (layout.checkpoint_dir / "commits").is_dir():
        return _NoFill()
    return SnapshotFillRequest(layout.checkpoint_dir, layout.mount)


def batch_record(p: dict) -> dict:
    ops = p.get("stateOperators") or []
    custom: dict[str, float] = {}
    for op in ops:
        for k, v in (op.get("customMetrics") or {}).items():
            custom[k] = custom.get(k, 0) + v
    dur = p.get("durationMs") or {}
    return {
        "batch": p["batchId"], "timestamp": p["timestamp"], "rows": p.get("numInputRows", 0),
        "rows_per_second": p.get("processedRowsPerSecond", 0.0),
        "duration_ms": dur.get("triggerExecution", 0), "commit_ms": dur.get("commitOffsets", 0),
        "add_batch_ms": dur.get("addBatch", 0),
        "state_rows": sum(op.get("numRowsTotal", 0) for op in ops),
        "state_memory_bytes": sum(op.get("memoryUsedBytes", 0) for op in ops),
        "state_commit_ms": sum(op.get("commitTimeMs", 0) for op in ops),
        # per stateful operator: where its time went (updates include reading the state,
        # removals are the watermark's eviction)
        "operators": [{"name": op.get("operatorName"), "rows_total": op.get("numRowsTotal", 0),
                       "rows_updated": op.get("numRowsUpdated", 0), "rows_removed": op.get("numRowsRemoved", 0),
                       "updates_ms": op.get("allUpdatesTimeMs", 0), "removals_ms": op.get("allRemovalsTimeMs", 0),
                       "commit_ms": op.get("commitTimeMs", 0)} for op in ops],
        "rocksdb": custom,
    }


def summarize(batches: list[dict]) -> dict:
    if not batches:
        return {"batches": 0}
    rows = sum(b["rows"] for b in batches)
    wall = sum(b["duration_ms"] for b in batches) / 1000
    durs = sorted(b["duration_ms"] for b in batches)
    def metric(name: str) -> list[float]:
        return [b["rocksdb"].get(name, 0) for b in batches]
    return {
        "batches": len(batches), "rows": rows,
        "records_per_second": round(rows / wall, 1) if wall else None,
        "batch_ms_median": durs[len(durs) // 2], "batch_ms_max": durs[-1],
        "state_commit_ms_total": sum(b["state_commit_ms"] for b in batches),
        "rocksdb_commit_checkpoint_ms_total": sum(metric("rocksdbCommitCheckpointLatency")),
        "rocksdb_commit_file_sync_ms_total": sum(metric("rocksdbCommitFileSyncLatencyMs")),
        "rocksdb_commit_flush_ms_total": sum(metric("rocksdbCommitFlushLatency")),
        "rocksdb_load_ms_total": sum(metric("rocksdbLoadLatencyMs")) if any(metric("rocksdbLoadLatencyMs")) else None,
        "rocksdb_files_copied": sum(metric("rocksdbFilesCopied")),
        "rocksdb_bytes_copied": sum(metric("rocksdbBytesCopied")),
        "state_rows_last": batches[-1]["state_rows"],
        "rocksdb_sst_bytes_last": batches[-1]["rocksdb"].get("rocksdbSstFileSize"),  # summed over the stores
    }


# --- the terminal --------------------------------------------------------------------------

class BatchLines:
    """Each completed batch as it comes: a JSON line for scripts (``--json``), else an
    aligned row a person reads while the query runs."""

    def __init__(self, as_json: bool, use_shim: bool) -> None:
        self.as_json = as_json
        # With the shim, the state store's copies are hard links (the summary has the exact count).
        self.files = "files linked" if use_shim else "files copied"
        self.shown = 0

    def __call__(self, rec: dict) -> None:
        if self.as_json:
            print(json.dumps({"event": "batch", **rec}), flush=True)
            return
        if not self.shown:
            print(progress_header(self.files))
        self.shown += 1
        print(progress_row(rec), flush=True)


def progress_header(files: str) -> str:
    return f"{'batch':>5}  {'rows':>9}  {'records/s':>9}  {'duration':>9}  {'state commit':>12}  {files:>12}"


def progress_row(rec: dict) -> str:
    """One batch: the state store's file copies are summed over its operators and partitions."""
    files = int(rec["rocksdb"].get("rocksdbFilesCopied", 0))
    return (f"{rec['batch']:>5}  {rec['rows']:>9,}  {rec['rows_per_second']:>9,.0f}  {rec['duration_ms']:>6,} ms  "
            f"{rec['state_commit_ms']:>9,} ms  {files:>12,}")


def aligned(rows: list[tuple[str, str]]) -> list[str]:
    """A summary's rows with their values in one column, as ``fusestate status`` prints them."""
    width = max((len(key) for key, _ in rows), default=0)
    return [f"{key:<{width}}  {value}" for key, value in rows]


def run_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """Records/s and state commits: the rows the pipeline's and the cluster's summaries share."""
    s = report["summary"]
    commits = sorted(b["state_commit_ms"] for b in report["batches"])
    return [("records/s", f"{s['records_per_second'] or 0:,.0f} over {s['batches']} batches ({s['rows']:,} rows), "
                          f"median batch {s['batch_ms_median']:,} ms"),
            ("state commit", f"median {commits[len(commits) // 2]:,} ms, max {commits[-1]:,} ms")]


def file_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """Where the detail is: the report file and Spark's log."""
    rows = []
    if report.get("report_file"):
        rows.append(("report", f"{report['report_file']} (every batch's metrics)"))
    if report.get("spark_log"):
        rows.append(("Spark's log", report["spark_log"]))
    return rows


def changelog_note(report: dict[str, Any]) -> str:
    """Why no state file was linked or copied, when changelog checkpointing is on: commits
    write changelogs, and SSTs reach the checkpoint only with a snapshot."""
    conf = report.get("state_store_conf", {})
    if conf.get(CHANGELOG_KEY) != "true":
        return ""
    every = conf.get("spark.sql.streaming.stateStore.minDeltasForSnapshot", "?")
    return f" (changelog checkpointing: state files reach the checkpoint with a snapshot, every {every} versions)"


def shim_row(report: dict[str, Any]) -> tuple[str, str]:
    shim = report["shim"]
    line = f"{shim['linked']} state files linked, {shim['copied']} copied"
    return ("shim", line + (changelog_note(report) if not shim["linked"] and not shim["copied"] else ""))


def mount_rows(before: Optional[dict], after: Optional[dict]) -> list[tuple[str, str]]:
    """What the run cost the mount: bucket traffic and the block cache's hit ratio."""
    if not before or not after:
        return []
    # A daemon that died and was restarted (the query resumed) counts from zero.
    same = before.get("pid") == after.get("pid")

    def grew(section: str, key: str) -> int:
        return after[section].get(key, 0) - (before[section].get(key, 0) if same else 0)

    uploaded, fetched = grew("writeback", "uploaded_bytes"), grew("remote", "bytes_in")
    reads = {k: grew("cache", k) for k in ("reads_from_memory", "reads_from_disk", "reads_from_bucket")}
    hits = reads["reads_from_memory"] + reads["reads_from_disk"]
    lookups = hits + reads["reads_from_bucket"]
    ratio = f"{hits / lookups:.2f}" if lookups else "n/a"
    # A rerun over the same input writes the same blocks: content addressing stores them once.
    dedup = grew("writeback", "deduplicated_bytes")
    return [("bucket", f"{uploaded / 2**20:,.1f} MiB uploaded, {fetched / 2**20:,.1f} MiB fetched"
                       + (f", {dedup / 2**20:,.1f} MiB written that the volume already had" if dedup else "")
                       + ("" if same else " (since its daemon was restarted)")),
            ("cache hit ratio", f"{ratio} ({hits:,} of {lookups:,} block reads from memory or disk)")]


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The few numbers a person looks at after a run, and where the rest is."""
    if not report["summary"].get("batches"):
        return ["== summary: no batch ran (nothing new in the input)", *aligned(file_rows(report))]
    rows = run_rows(report)
    if report.get("shim"):
        rows.append(shim_row(report))
    rows += mount_rows(report.get("fusestate_before"), report.get("fusestate_after"))
    return ["== summary", *aligned(rows + file_rows(report))]


# --- the command ---------------------------------------------------------------------------

def watch(query, show: Callable[[dict], None], t0: float) -> list[dict]:
    """Every batch's record, shown as soon as the query has completed it, until the query ends."""
    batches: list[dict] = []
    while True:
        active = query.isActive
        for p in query.recentProgress[len(batches):]:
            rec = batch_record(p)
            rec["seen_at"] = round(time.time() - t0, 3)
            batches.append(rec)
            show(rec)
        if not active:
            return batches
        time.sleep(0.2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.time()
    key_skew = check_key_skew(args.key_skew)
    state_dir = Path(args.state_dir).resolve()
    # Every setting is checked (mount alive, shim jar, checkpoint scheme) before anything is
    # created or the JVM starts: a wrong one fails here in one line, not inside the query.
    layout = state_conf(state_dir, query="pipeline", use_shim=args.use_shim, checkpoint=args.checkpoint,
                        local=args.local, shim_jar_path=args.shim_jar,
                        changelog=args.changelog, min_deltas_for_snapshot=args.min_deltas_for_snapshot,
                        shuffle_partitions=args.partitions, compression=args.state_compression,
                        block_size_kb=args.block_size_kb, s3a_endpoint=args.s3a_endpoint,
                        s3a_region=args.s3a_region,
                        s3a_jars=[j for j in (args.s3a_jars or "").split(",") if j], create=not args.print_conf)
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--conf {item}: expected KEY=VALUE")
        layout.conf[key.strip()] = value
    if args.print_conf:
        print(layout.spark_defaults(), flush=True)
        return {"event": "conf", "conf": layout.conf}
    mount = layout.mount
    output = Path(args.output).resolve()
    report_path = Path(args.report).resolve() if args.report else output / REPORT_NAME
    spark_log = output / SPARK_LOG_NAME
    input_dir = Path(args.input).resolve() if args.input else output.with_name(output.name + ".input")
    events_per_batch = args.events_per_batch or max(1000, args.keys // 2)
    rows = generate_input(input_dir, args.batches, args.keys, events_per_batch, args.last_batch_events,
                          key_skew=key_skew)
    output.mkdir(parents=True, exist_ok=True)
    t_setup = time.time()
    stale = layout.remove_stale_local_dirs()  # a killed run's working dirs and shuffle files
    t_stale = time.time()
    status_before = fusestate_status(mount)
    on_cluster = args.master.startswith("spark://")
    if on_cluster and not args.local:
        check_shared_checkpoint(layout, status_before)
    missing = missing_scratch(status_before.get("scratch_dirs", [])) if status_before is not None else []
    if missing:
        options = " ".join(f"--scratch '{pattern}'" for pattern in missing)
        print(f"note: {mount} was mounted without {options}: Spark's local files (shuffle, RocksDB's working "
              "files) will be uploaded as they are written, not only what the checkpoint links",
              file=sys.stderr, flush=True)
    t_status = time.time()
    if not args.json:
        print(f"starting Spark ({args.master}); its log goes to {spark_log}", flush=True)
    settings = session_settings(layout.conf, layout.jars, args.driver_memory, args.master)
    show = BatchLines(args.json, args.use_shim)
    batches: list[dict] = []
    restarts: list[dict] = []
    t_session = t_started = 0.0
    daemon = daemon_of(mount) if mount else None
    snapshot_fill = start_snapshot_fill(layout, args.snapshot_fill == "on" and not on_cluster)
    while True:
        spark = build_session(settings, spark_log)
        t_session = t_session or time.time()
        lost: Optional[str] = None
        try:
            if on_cluster and not args.local:
                check_executors(spark, layout, args.expect_executors)
            query = (build_query(spark, input_dir, args.payload_bytes).writeStream
                     .outputMode("update").foreachBatch(batch_writer(output))
                     .option("checkpointLocation", layout.checkpoint_uri)
                     .queryName("fusestate_state_pipeline").trigger(availableNow=True).start())
            t_started = t_started or time.time()
            batches += watch(query, snapshot_fill.until_first_batch(show), t0)
            failure = query_failure(query, spark_log, mount, daemon)
            lost = own_mount_lost(mount, daemon) if failure is not None else None
            if failure is not None and (lost is None or len(restarts) >= MAX_RESTARTS or not args.wait_for_remount):
                raise PipelineError(f"the query failed: {failure} (Spark's log: {spark_log})")
            shim = _shim_counters(spark) if args.use_shim and failure is None else None
        finally:
            stop_session(spark, timeout=30.0 if lost else 120.0)
        if lost is None:
            break
        restarts.append(resume_after_remount(mount, lost, args.wait_for_remount, batches, args.json, spark_log))
        daemon = daemon_of(mount) if mount else None
        layout.remove_stale_local_dirs()
    t_end = time.time()
    status_after = fusestate_status(mount)
    report = {
        "event": "report", "started_at": round(t0, 3), "state_dir": str(state_dir), "mount": mount,
        "use_shim": args.use_shim,
        "checkpoint": layout.checkpoint_uri, "keys": args.keys, "key_skew": key_skew,
        "payload_bytes": args.payload_bytes,
        "state_store_conf": {k: v for k, v in layout.conf.items() if k.startswith("spark.sql.streaming.stateStore.")},
        "batches_in_input": args.batches, "input_rows": rows,
        "stale_local_dirs_removed": len(stale),
        "session_start_s": round(t_session - t0, 3), "query_start_s": round(t_started - t0, 3),
        # where the session start goes: input and layout, clearing a killed run's dirs, the
        # status call, the JVM and session
        "session_start_parts_s": {"input_and_layout": round(t_setup - t0, 3), "stale_dirs": round(t_stale - t_setup, 3),
                                  "status": round(t_status - t_stale, 3), "jvm": round(t_session - t_status, 3)},
        "snapshot_fill": snapshot_fill.result(),
        "first_batch_done_s": batches[0]["seen_at"] if batches else None,
        "total_s": round(t_end - t0, 3),
        "summary": summarize(batches), "shim": shim, "batches": batches, "restarts": restarts,
        "fusestate_before": status_before, "fusestate_after": status_after,
        "report_file": str(report_path), "spark_log": str(spark_log),
    }
    write_report(report_path, report)
    print(json.dumps(report) if args.json else "\n".join(summary_lines(report)), flush=True)
    return report


MAX_RESTARTS = 5  # resumptions after a lost mount, per run: a mount that keeps dying stops the run


def resume_after_remount(mount: Optional[str], lost: str, wait: float, batches: list[dict], as_json: bool,
                         spark_log: Path) -> dict[str, Any]:
    """Say why the query stopped, wait for the mount to come back, and what to record of it;
    the query then resumes from its checkpoint (the last committed batch)."""
    assert mount is not None
    last = batches[-1]["batch"] if batches else None
    note = f"the query stopped: {lost}; waiting up to {wait:.0f} s for the mount to come back"
    print(f"fusestate: {note}", file=sys.stderr, flush=True)
    started = time.time()
    if not wait_for_mount(mount, wait):
        raise PipelineError(f"the query failed: {lost}, and it did not come back within {wait:.0f} s "
                            f"(Spark's log: {spark_log})")
    record = {"cause": lost, "after_batch": last, "waited_s": round(time.time() - started, 1)}
    if as_json:
        print(json.dumps({"event": "restart", **record}), flush=True)
    else:
        print(f"the mount is back after {record['waited_s']:.1f} s: resuming the query from its checkpoint",
              flush=True)
    return record


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Whole or not at all: a reader never sees half a report (a rename replaces the old one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)


def read_output(output: str | os.PathLike) -> dict[int, list[tuple[str, ...]]]:
    """The output of a run: batch id -> its rows, sorted (for row-for-row comparisons)."""
    result: dict[int, list[tuple[str, ...]]] = {}
    for d in sorted(Path(output).glob("batch-*")):
        rows: list[tuple[str, ...]] = []
        for part in sorted(d.glob("part-*.csv")):
            with open(part, newline="") as f:
                r = csv.reader(f)
                next(r, None)
                rows.extend(tuple(x) for x in r)
        result[int(d.name.split("-")[1])] = sorted(rows)
    return result


def final_view(output: str | os.PathLike) -> dict[str, tuple[str, ...]]:
    """The aggregates as of the last batch: key -> its row in the newest batch that updated it.

    Equal for any two runs over the same input, wherever their batch boundaries fell: a query
    killed between planning a batch in its source log and recording it in its offset log plans
    the files of both in one batch when it restarts, as Spark does.
    """
    view: dict[str, tuple[str, ...]] = {}
    for _, rows in sorted(read_output(output).items()):
        for row in rows:
            view[row[0]] = row
    return view
