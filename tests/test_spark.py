"""A real PySpark Structured Streaming query (local[2]) with its RocksDB state on a real mount."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from bench.common import wait_port
from bench.s3a import ConnectorUnavailable, connector_jars, jars_argument
from bench.systems import free_port
from conftest import BIN, ROOT, Bucket, assert_one_line_error, block_key, make_s3_bucket, stop_process

pyspark = pytest.importorskip("pyspark")
if shutil.which("java") is None:
    pytest.skip("no java on this machine", allow_module_level=True)

from fusestate.spark.config import scratch_options, shim_jar  # noqa: E402
from fusestate.spark.pipeline import final_view, read_output, stop_session  # noqa: E402

# Small state: 2,000 keys x 256 bytes, 5 micro-batches of ~1,100 events.
SMALL = ["--batches", "5", "--keys", "2000", "--payload-bytes", "256"]
HEAP = ["--driver-memory", "512m"]
BLOCK = 4 << 20


def pipeline_cmd(state_dir: Path, output: Path, *extra: str) -> list[str]:
    """The ``fusestate spark-pipeline`` command line, with the tests' JVM heap."""
    return [str(BIN / "fusestate"), "spark-pipeline", "--state-dir", str(state_dir), "--output", str(output),
            *HEAP, *extra]


def pipeline(state_dir: Path, output: Path, input_dir: Path, *extra: str, timeout: float = 240,
             as_json: bool = False) -> dict:
    """Run the pipeline to completion in its own process; returns its report.

    Every run checks its terminal output: what a person sees by default, or with ``as_json``
    the stream for scripts (``--json``)."""
    proc = subprocess.run(pipeline_cmd(state_dir, output, "--input", str(input_dir), *extra,
                                       *(["--json"] if as_json else [])),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        (output.parent / f"{output.name}.spark-failure.log").write_text(proc.stderr)
        raise AssertionError(f"pipeline failed ({proc.returncode}): {proc.stderr[-2000:]}\n{proc.stdout[-2000:]}"
                             f"\n(Spark's log: {output / 'spark.log'})")
    return json_stream_report(proc.stdout) if as_json else terminal_report(proc)


def terminal_report(proc: subprocess.CompletedProcess) -> dict:
    """The default output is for a person: a row per batch and a summary that names the report
    file, no JSON record on stdout and no line of Spark's on stderr (it goes to Spark's log)."""
    lines = proc.stdout.splitlines()
    assert not [ln for ln in lines if ln.lstrip().startswith("{")], proc.stdout[-3000:]
    assert all(ln.startswith("note: ") for ln in proc.stderr.splitlines()), proc.stderr[-3000:]
    named = [ln.split()[1] for ln in lines if ln.startswith("report ")]
    assert named, f"the summary names no report file:\n{proc.stdout[-3000:]}"
    report = json.loads(Path(named[-1]).read_text())
    assert Path(report["spark_log"]).stat().st_size > 0 and report["spark_log"] in proc.stdout
    rows = [ln for ln in lines if re.match(r"\s*\d+\s+[\d,]+\s+[\d,]+\s+[\d,]+ ms", ln)]
    assert len(rows) == len(report["batches"]), proc.stdout[-3000:]
    return report


def json_stream_report(stdout: str) -> dict:
    """``--json``: every line is a JSON record, one per batch and then the report, which is
    also in the report file."""
    *batches, report = [json.loads(line) for line in stdout.splitlines()]
    assert {b["event"] for b in batches} <= {"batch"} and report["event"] == "report"
    assert [b["batch"] for b in batches] == [b["batch"] for b in report["batches"]]
    assert json.loads(Path(report["report_file"]).read_text()) == report
    return report


def settle(m, timeout: float = 60) -> dict:
    """Wait until every block and journal entry of the mount is in the bucket."""
    deadline = time.monotonic() + timeout
    while True:
        st = m.status()
        wb = st["writeback"]
        if wb["dirty_bytes"] == 0 and wb["staged_blocks"] == 0 and wb["upload_queue"] == 0 \
                and st["metadata"]["journal_pending"] == 0:
            return st
        assert time.monotonic() < deadline, f"uploads did not settle: {wb}"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The small pipeline on local disk, uninterrupted: the output every other run must match."""
    work = tmp_path_factory.mktemp("spark-baseline")
    report = pipeline(work / "state", work / "out", work / "input", "--local", *SMALL)
    out = read_output(work / "out")
    assert report["summary"]["batches"] == 5 and sorted(out) == list(range(5))
    assert sum(len(rows) for rows in out.values()) > 2000
    return {"output": out, "final": final_view(work / "out"), "report": report, "input": work / "input"}


def test_pipeline_on_mount_matches_local_disk(make_mount, file_bucket: Bucket, baseline, tmp_path: Path):
    m = make_mount(file_bucket).mount()
    report = pipeline(m.path / "job", tmp_path / "out", baseline["input"], *SMALL, as_json=True)
    assert read_output(tmp_path / "out") == baseline["output"]
    # One part file per state partition: the writer left the stateful stage at four tasks
    # (a coalesce(1) would run the aggregation's four state stores one after another).
    parts = {d.name: len(list(d.glob("part-*.csv"))) for d in (tmp_path / "out").glob("batch-*")}
    assert set(parts.values()) == {4}, parts
    assert report["mount"] == str(m.path)
    assert report["checkpoint"].startswith("file://")
    # On a mount the helper asks for 64 KiB RocksDB blocks; local disk keeps Spark's default.
    assert report["state_store_conf"]["spark.sql.streaming.stateStore.rocksdb.blockSizeKB"] == "64"
    assert "spark.sql.streaming.stateStore.rocksdb.blockSizeKB" not in baseline["report"]["state_store_conf"]
    summary = report["summary"]
    assert summary["batches"] == 5 and summary["records_per_second"] > 0
    # The state store's working dir and the checkpoint are on the mount, and it saw the writes.
    assert any((m.path / "job" / "checkpoints" / "pipeline" / "state").rglob("*.changelog"))
    after = report["fusestate_after"]
    assert after["fuse"]["bytes_written"] > report["fusestate_before"]["fuse"]["bytes_written"]
    # The JVM has exited when the pipeline returns: nothing holds a file on the mount and
    # Spark's shutdown hooks have deleted its local dirs, so an unmount now is not refused.
    assert _open_files_under(m.path) == []
    assert not list((m.path / "job" / "spark-local").glob("spark-*"))
    m.umount()


def test_stop_session_waits_for_the_jvm(tmp_path: Path) -> None:
    """``spark.stop()`` alone leaves the JVM running, with files open in ``spark.local.dir``,
    until Python exits; the pipeline's stop returns once it has exited and its shutdown
    hooks have deleted Spark's local dirs."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[1]").appName("stop-test")
             .config("spark.ui.enabled", "false").config("spark.local.dir", str(tmp_path))
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .getOrCreate())
    proc = SparkContext._gateway.proc
    assert spark.range(1000).count() == 1000
    assert list(tmp_path.glob("spark-*"))
    stop_session(spark)
    assert proc.poll() is not None
    assert not list(tmp_path.glob("spark-*"))


def _open_files_under(path: Path) -> list[str]:
    found = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith(str(path) + "/"):
                found.append(f"{fd}: {target}")
    return found


def _run_until_batches(cmd: list[str], k: int, timeout: float = 240) -> list[int]:
    """Start the pipeline, SIGKILL it (JVM included) once ``k`` micro-batches have completed."""
    err = open(Path(cmd[cmd.index("--output") + 1] + ".spark-stderr.log"), "w+")
    proc = subprocess.Popen([*cmd, "--json"], stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    done: list[int] = []
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith('{"event": "batch"'):
                done.append(json.loads(line)["batch"])
                if len(done) >= k:
                    break
            assert time.monotonic() < deadline, "pipeline too slow"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    err.seek(0)
    stderr = err.read()
    err.close()
    assert len(done) >= k, f"pipeline ended after {done} (exit {proc.returncode}): {stderr[-2000:]}"
    return done


@pytest.mark.slow  # the default selection resumes on a fresh node in test_shim_commit_survives_node_loss_at_once
def test_kill_spark_and_node_then_resume_on_fresh_node(make_mount, file_bucket: Bucket, baseline, tmp_path: Path):
    m = make_mount(file_bucket, extra=scratch_options()).mount()  # as deployed
    out = tmp_path / "out"
    cmd = pipeline_cmd(m.path / "job", out, "--input", str(baseline["input"]), *SMALL)
    done = _run_until_batches(cmd, 2)
    assert done[:2] == [0, 1]
    # The Spark process is gone (its files closed); let the mount ship what it has, then lose the node.
    local_dir = m.path / "job" / "spark-local"
    shuffle_dirs = list(local_dir.glob("blockmgr-*"))
    assert shuffle_dirs and any(p.is_file() for d in shuffle_dirs for p in d.rglob("*")), "no shuffle files"
    settle(m)
    m.kill()
    m.wipe_cache()
    assert not m.cache_dir.exists()
    m.mount("--takeover", "--prefetch", "recent")  # warming, as on an object store by default
    # The shuffle files and the state stores' working dirs stayed on the lost node (scratch):
    # the state comes from the checkpoint.
    assert not list(local_dir.glob("blockmgr-*")) and not list(local_dir.glob("spark-*"))
    report = pipeline(m.path / "job", out, baseline["input"], *SMALL)
    resumed = [b["batch"] for b in report["batches"]]
    assert resumed and resumed[0] >= 2, f"the query started over instead of resuming: {resumed}"
    assert sum(b["rows"] for b in report["batches"]) < baseline["report"]["input_rows"]
    # The batches completed before the kill are as in the uninterrupted run, and so is the end
    # result. (The batches after it may be cut differently: see final_view.)
    output = read_output(out)
    assert all(output[b] == baseline["output"][b] for b in done[:2])
    assert final_view(out) == baseline["final"]
    # A fresh node: the checkpoint's data came from the bucket, warmed in the background.
    after = report["fusestate_after"]
    assert after["remote"]["bytes_in"] > 0
    assert after["warmup"]["state"] == "done" and after["warmup"]["fetched_bytes"] > 0, after["warmup"]
    m.umount()


def test_a_killed_daemon_stops_the_query_in_one_line_and_it_resumes_once_mounted_again(
        make_mount, file_bucket: Bucket, baseline, tmp_path: Path, shim) -> None:
    """The daemon of the driver's mount dies mid-stream (SIGKILL) and a supervisor mounts the
    volume again: the pipeline says in one line which mount on which node died, waits for the
    mount (--wait-for-remount), and resumes the query from its checkpoint, every batch in the
    output once, the end result as in the uninterrupted run."""
    m = make_mount(file_bucket, extra=scratch_options()).mount()
    out, stdout, stderr = tmp_path / "out", tmp_path / "stdout", tmp_path / "stderr"
    cmd = pipeline_cmd(m.path / "job", out, "--input", str(baseline["input"]), *SMALL, "--use-shim",
                       "--wait-for-remount", "120", "--json")
    with open(stdout, "w") as o, open(stderr, "w") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, env=dict(os.environ, FUSESTATE_NODE_NAME="node7"),
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while '"batch": 1,' not in stdout.read_text():  # batch 1 committed and reported
            assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
            time.sleep(0.1)
        m.kill(detach=False)  # the daemon alone: the mount stays, answering ENOTCONN
        while "the query stopped" not in stderr.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
            time.sleep(0.2)
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], check=True)  # what a supervisor does
        m.mount()
        assert proc.wait(timeout=240) == 0, stderr.read_text()[-3000:]
    finally:
        stop_process(proc)
    (line,) = [ln for ln in stderr.read_text().splitlines() if not ln.startswith("note: ")]
    assert line.startswith(f"fusestate: the query stopped: the fusestate mount {m.path} on this node (node7) died")
    records = [json.loads(ln) for ln in stdout.read_text().splitlines()]
    (restart,) = [r for r in records if r["event"] == "restart"]
    report = records[-1]
    assert report["restarts"] == [{k: v for k, v in restart.items() if k != "event"}]
    assert restart["after_batch"] >= 1
    # Resumed from the last committed batch: every batch once, none started over.
    assert [b["batch"] for b in report["batches"]] == list(range(len(report["batches"])))
    output = read_output(out)
    assert sorted(output) == list(range(len(output)))
    assert all(output[b] == baseline["output"][b] for b in (0, 1))
    assert final_view(out) == baseline["final"]
    m.umount()


def test_a_dead_mount_is_named_with_its_node(make_mount, file_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one line for a query that failed on a dead mount: this node's (asked of the mount
    itself, also after a supervisor mounted it again), or an executor's (from Spark's trace)."""
    from fusestate.spark.mount_loss import daemon_of, executor_mount_lost, own_mount_lost

    monkeypatch.setenv("FUSESTATE_NODE_NAME", "node7")
    m = make_mount(file_bucket).mount()
    first = daemon_of(str(m.path))
    assert first is not None and own_mount_lost(str(m.path), first) is None
    m.kill(detach=False)
    assert own_mount_lost(str(m.path), first) == (f"the fusestate mount {m.path} on this node (node7) died "
                                                  "(Transport endpoint is not connected)")
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], check=True)
    m.mount()
    again = own_mount_lost(str(m.path), first)
    assert again is not None and again.startswith(f"the fusestate mount {m.path} on this node (node7) died")
    assert f"its daemon, pid {first[0]}, is gone; pid {m.status()['pid']} serves it again" in again
    trace = ("org.apache.spark.SparkException: Job aborted due to stage failure: Task 2 in stage 7.0 failed 4 "
             "times, most recent failure: Lost task 2.3 in stage 7.0 (TID 61) (127.0.0.3 executor 1): "
             f"java.nio.file.FileSystemException: {m.path}/nodes/worker2/spark-local/blockmgr-1/0e: "
             "Transport endpoint is not connected")
    assert executor_mount_lost(trace, str(m.path)) == (
        f"the fusestate mount {m.path} on executor 1's node (127.0.0.3) does not answer (Transport endpoint is "
        f"not connected, on {m.path}/nodes/worker2/spark-local/blockmgr-1/0e): its daemon died, and the executor "
        "went on taking tasks")
    assert executor_mount_lost("java.io.IOException: No space left on device", str(m.path)) is None
    m.umount()


def _log_ids(directory: Path) -> set[int]:
    return {int(p.name) for p in directory.iterdir() if p.name.isdigit()} if directory.exists() else set()


def test_shim_commit_survives_node_loss_at_once(make_mount, file_bucket: Bucket, baseline, tmp_path: Path, shim):
    """Every batch Spark has recorded as committed is in the bucket, with changelog checkpointing
    (the shim's other mode; the tests below run its default, a snapshot every commit): the node
    dies the moment the batch is reported, and on a fresh node the query resumes after it with
    that batch's state. The journal is not shipped on a timer here; only
    fsyncs ship it, and Spark itself never syncs its checkpoint files."""
    m = make_mount(file_bucket).mount("--journal-interval", "600")
    job, out = m.path / "job", tmp_path / "out"
    cmd = pipeline_cmd(job, out, "--input", str(baseline["input"]), "--use-shim", "--changelog", *SMALL)
    done = _run_until_batches(cmd, 2)
    commits = job / "checkpoints" / "pipeline" / "commits"
    recorded = _log_ids(commits)
    assert max(done) in recorded, (done, recorded)
    m.kill()
    m.wipe_cache()
    m.mount("--takeover")
    assert _log_ids(commits) >= recorded, "a commit Spark recorded was lost with the node"
    # The committed batches' state came along: the query resumes after them, and its
    # aggregates end as in the uninterrupted run (a lost changelog would miss its counts).
    report = pipeline(job, out, baseline["input"], "--use-shim", "--changelog", *SMALL)
    assert report["state_store_conf"]["spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"] == "true"
    resumed = [b["batch"] for b in report["batches"]]
    assert resumed and resumed[0] > max(recorded), (resumed, recorded)
    assert final_view(out) == baseline["final"]
    m.umount()


def _sst_blocks(paths: list[Path]) -> set[str]:
    """Content addresses (BLAKE3 of each 4 MiB block) of files, read through the mount."""
    keys: set[str] = set()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(BLOCK):
                if chunk.count(0) != len(chunk):
                    keys.add(block_key(chunk))
    return keys


def _checkpoint_ssts(job: Path) -> dict[str, Path]:
    return {str(p.relative_to(job)): p for p in (job / "checkpoints" / "pipeline" / "state").rglob("*.sst")}


@pytest.fixture(scope="module")
def shim() -> Path:
    return shim_jar()


SHIM_CHECK = """
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.permission.FsPermission;
import io.fusestate.hadoop.FusestateFileSystem;

public class ShimCheck {
    public static void main(String[] args) throws Exception {
        FusestateFileSystem fs = new FusestateFileSystem();
        fs.initialize(java.net.URI.create("fusestate:///"), new Configuration());
        fs.setPermission(new Path("fusestate://" + args[0]), new FsPermission((short) 0640));
        long fileLength = fs.getFileStatus(new Path("fusestate://" + args[0])).getLen();
        for (String a : args) {
            FileStatus s = fs.getFileLinkStatus(new Path("fusestate://" + a));
            FileStatus followed = fs.getFileStatus(new Path("fusestate://" + a));
            if (followed.isSymlink() || !followed.isDirectory() && followed.getLen() != fileLength) {
                throw new AssertionError("getFileStatus did not follow " + a);
            }
            System.out.println(s.getLen() + " " + s.isDirectory() + " " + s.isSymlink() + " "
                + Integer.toOctalString(s.getPermission().toShort()) + " " + s.getOwner() + " "
                + s.getModificationTime() + " " + (s.isSymlink() ? s.getSymlink().toUri().getPath() : "-"));
        }
        try {
            fs.getFileLinkStatus(new Path("fusestate://" + args[0] + ".missing"));
            System.out.println("no error");
        } catch (java.io.FileNotFoundException e) {
            System.out.println("FileNotFoundException");
        }
    }
}
"""


def test_shim_permissions_and_link_status_start_no_process(make_mount, file_bucket: Bucket, tmp_path: Path, shim):
    """Hadoop's local file system runs chmod(1), readlink(1) and ls(1) for these (no native
    library in PySpark); the shim answers them with system calls, as correctly."""
    m = make_mount(file_bucket).mount()
    f, d, link = m.path / "f", m.path / "d", m.path / "l"
    f.write_bytes(b"x" * 1234)
    d.mkdir()
    link.symlink_to("f")
    (tmp_path / "ShimCheck.java").write_text(SHIM_CHECK)
    classpath = f"{shim}:{Path(pyspark.__file__).parent / 'jars'}/*:{tmp_path}"
    subprocess.run(["javac", "-nowarn", "-d", str(tmp_path), "-cp", classpath, str(tmp_path / "ShimCheck.java")],
                   check=True, capture_output=True, timeout=120)
    trace = tmp_path / "execve.txt"
    proc = subprocess.run(["strace", "-f", "-qq", "-e", "trace=execve", "-o", str(trace),
                           "java", "-cp", classpath, "ShimCheck", str(f), str(d), str(link)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.stat(f).st_mode & 0o7777 == 0o640
    lines = proc.stdout.split("\n")
    for line, path in zip(lines, (f, d, link)):
        st = os.lstat(path)
        size, is_dir, is_link, mode, owner, mtime, target = line.split(" ")
        assert (int(size), is_dir, is_link) == (st.st_size, str(path == d).lower(), str(path == link).lower())
        assert int(mode, 8) == st.st_mode & 0o777 and owner == pwd.getpwuid(st.st_uid).pw_name and int(mtime) == st.st_mtime_ns // 1_000_000
        assert target == (str(f) if path == link else "-")
    assert lines[3] == "FileNotFoundException"
    spawned = [ln for ln in trace.read_text().splitlines()
               if "execve(" in ln and any(tool in ln for tool in ('/chmod"', '/readlink"', '/ls"', '/stat"'))]
    assert spawned == []
    m.umount()


WATCH_CHECK = """
import java.lang.reflect.Proxy;
import org.apache.spark.SparkConf;
import org.apache.spark.api.plugin.ExecutorPlugin;
import org.apache.spark.api.plugin.PluginContext;
import io.fusestate.hadoop.MountWatch;

public class WatchCheck {
    public static void main(String[] args) throws Exception {
        SparkConf conf = new SparkConf(false).set("spark.local.dir", args[0])
            .set("spark.fusestate.mountWatch.intervalMs", "100");
        PluginContext ctx = (PluginContext) Proxy.newProxyInstance(WatchCheck.class.getClassLoader(),
            new Class<?>[] {PluginContext.class},
            (proxy, method, a) -> {
                switch (method.getName()) {
                    case "conf": return conf;
                    case "executorID": return args[1];
                    // An executor's RPC environment has no address: Spark's hostname() fails there.
                    case "hostname": throw new NullPointerException("RpcEnv.address() is null");
                    default: return null;
                }
            });
        ExecutorPlugin plugin = new MountWatch().executorPlugin();
        plugin.init(ctx, java.util.Collections.emptyMap());
        System.out.println("watching");
        System.out.flush();
        Thread.sleep(120_000);
    }
}
"""


def test_an_executor_ends_at_once_when_its_mount_dies(make_mount, file_bucket: Bucket, tmp_path: Path, shim):
    """The shim's Spark plugin (spark.plugins, set by state_conf with the shim) on an executor
    whose local dir is on a mount: nothing while the mount answers; once its daemon is killed
    the JVM exits within a second, saying why, so that Spark treats the executor as lost. The
    driver (local mode's executor) is never ended."""
    from fusestate.spark.config import state_conf
    from fusestate.spark.shim import MOUNT_WATCH_CLASS

    m = make_mount(file_bucket).mount()
    local = m.path / "spark-local"
    local.mkdir()
    assert MOUNT_WATCH_CLASS in state_conf(m.path / "job", use_shim=True).conf["spark.plugins"].split(",")
    (tmp_path / "WatchCheck.java").write_text(WATCH_CHECK)
    classpath = f"{shim}:{Path(pyspark.__file__).parent / 'jars'}/*:{tmp_path}"
    subprocess.run(["javac", "-nowarn", "-d", str(tmp_path), "-cp", classpath, str(tmp_path / "WatchCheck.java")],
                   check=True, capture_output=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k != "SPARK_LOCAL_DIRS"}
    env["SPARK_LOCAL_IP"] = "127.0.0.7"  # a cluster's worker sets it for its executors
    watchers = {who: subprocess.Popen(["java", "-cp", classpath, "WatchCheck", str(local), who], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for who in ("7", "driver")}
    try:
        for proc in watchers.values():
            assert proc.stdout is not None and proc.stdout.readline().strip() == "watching"
        time.sleep(1)  # a live mount: nothing happens
        assert all(proc.poll() is None for proc in watchers.values())
        m.kill(detach=False)
        started = time.monotonic()
        executor = watchers["7"]
        assert executor.wait(timeout=30) == 75
        assert time.monotonic() - started < 2
        assert executor.stderr is not None
        # ENOTCONN once the connection is gone; ECONNABORTED for a request the kernel had
        # sent when the daemon died (which of the two the watch meets first is a race).
        said = executor.stderr.read()
        assert re.search(re.escape(f"fusestate: the fusestate mount {m.path} on 127.0.0.7, holding the local dirs of "
                                   "executor 7, does not answer (")
                         + r"(Transport endpoint is not connected|Software caused connection abort)\): its daemon died",
                         said), said
        time.sleep(1)
        assert watchers["driver"].poll() is None
    finally:
        for proc in watchers.values():
            stop_process(proc)


# Without the shim (a file:// checkpoint) is the heavier variant: slow-marked, the shim is the deployed path.
@pytest.mark.parametrize("use_shim", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["shim", "plain-file-scheme"])
def test_commit_uploads_no_new_sst_data(make_mount, file_bucket: Bucket, baseline, tmp_path: Path, use_shim, request):
    """Changelog checkpointing off: every commit flushes and copies new SSTs to the checkpoint.

    Run 2 batches, let uploads settle, then run the 3rd batch alone (a fresh executor that loads
    the state from the checkpoint, processes one batch and commits). The commit's SSTs must add
    no objects beyond the blocks RocksDB itself wrote: with the shim they are hard links, without
    it the copy's blocks have the hashes of the originals and are not uploaded again.
    """
    flags = ["--no-changelog", "--keys", "2000", "--payload-bytes", "256"] + (["--use-shim"] if use_shim else [])
    if use_shim:
        request.getfixturevalue("shim")
    m = make_mount(file_bucket).mount()
    job, out = m.path / "job", tmp_path / "out"
    pipeline(job, out, tmp_path / "input", "--batches", "2", *flags)
    st0 = settle(m)
    objs0 = file_bucket.block_objects()
    assert objs0, "nothing was uploaded by the first run"
    ssts0 = _checkpoint_ssts(job)

    report = pipeline(job, out, tmp_path / "input", "--batches", "3", *flags)
    st1 = settle(m)
    objs1 = file_bucket.block_objects()
    assert [b["batch"] for b in report["batches"]] == [2]
    copied = report["summary"]["rocksdb_bytes_copied"]
    assert report["summary"]["rocksdb_files_copied"] > 0 and copied > 0
    new_ssts = [p for k, p in _checkpoint_ssts(job).items() if k not in ssts0]
    assert new_ssts, "the commit wrote no SST to the checkpoint"
    assert _sst_blocks(new_ssts) <= objs1          # the commit's SSTs are in the bucket, each block once
    uploaded = st1["writeback"]["uploaded_bytes"] - st0["writeback"]["uploaded_bytes"]
    written = st1["fuse"]["bytes_written"] - st0["fuse"]["bytes_written"]
    if use_shim:
        assert report["shim"]["linked"] > 0 and report["shim"]["copied"] == 0, report["shim"]
        # No copy went through the mount: what was written is RocksDB's own files and Spark's.
        assert uploaded <= written
    else:
        # The copy wrote `copied` bytes through the mount; none of them was uploaded again.
        assert written >= copied
        assert uploaded <= written - copied, (uploaded, written, copied)
    m.umount()


@pytest.mark.slow
def test_shim_fresh_node_load_links_state(make_mount, file_bucket: Bucket, tmp_path: Path, shim):
    """A restarted query on a fresh cache dir loads its state by linking, not by copying it down."""
    flags = ["--no-changelog", "--keys", "20000", "--payload-bytes", "1024", "--events-per-batch", "2000",
             "--partitions", "2", "--use-shim"]
    m = make_mount(file_bucket).mount()
    job, out = m.path / "job", tmp_path / "out"
    pipeline(job, out, tmp_path / "input", "--batches", "10", *flags)
    m.umount()
    m.wipe_cache()
    m.mount()
    latest = _latest_state_bytes(job)
    before = m.status()["remote"]["bytes_in"]
    report = pipeline(job, out, tmp_path / "input", "--batches", "11", *flags)
    fetched = m.status()["remote"]["bytes_in"] - before
    assert [b["batch"] for b in report["batches"]] == [10]
    assert report["shim"]["copied"] == 0 and report["shim"]["linked"] > 0, report["shim"]
    assert report["shim"]["synced"] > 0, report["shim"]  # checkpoint renames were made durable
    # RocksDB did write the 64 KiB blocks the helper asked for (Spark's default is 4 KiB).
    largest = max(_checkpoint_ssts(job).values(), key=lambda p: p.stat().st_size)
    assert _mean_data_block_bytes(largest) > 32 * 1024, largest
    print(f"state {latest} bytes, fetched {fetched} bytes on load + 1 batch")
    # A copying load reads every SST in full before the first record. Linked, the SSTs are
    # fetched as RocksDB opens and reads them; at this size (SSTs smaller than one 4 MiB block)
    # opening one fetches it whole, so the saving is small here and grows with SST size.
    assert fetched < latest, (fetched, latest)
    # Before the JVM started, the pipeline asked for the latest snapshot of each store (2
    # operators x 2 partitions): the daemon queued files for the page cache by name, fewer
    # bytes than every retained version's SSTs.
    fill, requested = report["snapshot_fill"], m.status()["page_fill"]
    assert fill["stores"] == 4 and fill["queued"] > 0 and requested["requested"] == fill["queued"], (fill, requested)
    assert 0 < fill["bytes"] < latest, (fill, latest)
    m.umount()


def _mean_data_block_bytes(sst: Path) -> float:
    """From RocksDB's own sst_dump: the table's data bytes over its number of data blocks."""
    proc = subprocess.run(["sst_dump", f"--file={sst}", "--show_properties"], capture_output=True, text=True,
                          timeout=60, check=True)
    props = {}
    for line in proc.stdout.splitlines():
        name, sep, value = line.partition(": ")
        if sep:  # an empty value ("name: ") is a property too; strip after splitting
            props[name.strip()] = value.strip()
    return int(props["data block size"]) / int(props["# data blocks"])


def _latest_state_bytes(job: Path) -> int:
    return sum(p.stat().st_size for p in _checkpoint_ssts(job).values())


def test_input_stream_is_generated_once_and_follows_the_batch_count(tmp_path: Path) -> None:
    """A restart with a small last batch rewrites only that file; a run with fewer batches
    must not see files left by a longer one (they would change its state)."""
    from fusestate.spark.pipeline import events_for_batch, generate_input

    d = tmp_path / "input"
    rows = generate_input(d, 2, 1000, 300)
    assert rows == sum(len(events_for_batch(b, 1000, 300)) for b in range(2))
    first = (d / "events-000000.csv").stat().st_mtime_ns, (d / "events-000000.csv").stat().st_ino
    generate_input(d, 3, 1000, 300, last_batch_events=20)
    assert (d / "events-000000.csv").stat().st_ino == first[1]  # kept, not rewritten
    assert len((d / "events-000002.csv").read_text().splitlines()) == len(events_for_batch(2, 1000, 300, 20))
    generate_input(d, 2, 1000, 300)
    assert sorted(p.name for p in d.glob("events-*.csv")) == ["events-000000.csv", "events-000001.csv"]
    # Consecutive events hit keys spread over the key space, each key once per 1000 events.
    key_of_event = {row[0]: row[1] for b in range(4) for row in events_for_batch(b, 1000, 250)}
    assert len({key_of_event[g] for g in range(1000)}) == 1000 and key_of_event[1] != "k000000001"


def test_skewed_keys_give_every_key_state_then_concentrate_on_hot_keys() -> None:
    """--key-skew: the first ``keys`` events are the uniform stream's (every key gets its state
    once, in the same order); after them a few hot keys take most updates, the same ones in
    every run; skew 0 is the uniform stream exactly."""
    from collections import Counter

    from fusestate.spark.pipeline import KEY_STRIDE, events_for_batch, key_of

    keys = 100_000
    old = [f"k{(g * KEY_STRIDE) % keys:09d}" for g in range(2 * keys)]  # the stream before --key-skew
    assert [key_of(g, keys) for g in range(2 * keys)] == old
    assert [key_of(g, keys, 0.0) for g in range(2 * keys)] == old
    assert events_for_batch(3, 1000, 300, key_skew=0) == events_for_batch(3, 1000, 300)
    for skew in (1.1, 1.0, 0.5):
        assert [key_of(g, keys, skew) for g in range(keys)] == old[:keys]
    after = range(keys, keys + 5_000)
    uniform = Counter(key_of(g, keys) for g in after)
    skewed = Counter(key_of(g, keys, 1.1) for g in after)
    assert len(uniform) == 5_000 and len(skewed) < 2_500
    top = sum(n for _, n in skewed.most_common(keys // 100))  # the hottest 1% of the keys
    assert top > 0.6 * 5_000 and sum(n for _, n in uniform.most_common(keys // 100)) == 1_000
    # The hottest key is rank 0's, the key event 0 wrote; rank 1's is event 1's, far from it.
    assert [k for k, _ in skewed.most_common(2)] == [old[0], old[1]]
    assert [key_of(g, keys, 1.1) for g in after] == [key_of(g, keys, 1.1) for g in after]  # no hidden state
    # Exactly 1 (the logarithmic form) sits between its neighbours, and every key stays in range.
    hot = {skew: Counter(key_of(g, keys, skew) for g in after).most_common(1)[0][1] for skew in (0.99, 1.0, 1.01)}
    assert hot[0.99] <= hot[1.0] <= hot[1.01] and hot[1.0] > 100
    assert all(key_of(g, 7, s) < "k000000007" for s in (1.0, 1.1, 3.0, 40.0) for g in range(7, 2_000))
    # A file of the skewed stream: the uniform one's events (ids, times, values), other keys after ``keys``.
    rows, uniform_rows = events_for_batch(9, 1000, 300, key_skew=1.1), events_for_batch(9, 1000, 300)
    assert [(r[0], *r[2:]) for r in rows] == [(r[0], *r[2:]) for r in uniform_rows] and rows != uniform_rows


def test_key_skew_is_part_of_the_input_it_made_and_is_checked(tmp_path: Path) -> None:
    """Input made at one skew is not taken for another's (it is made again), input from before
    --key-skew counts as uniform, and a skew below 0 is one line before anything starts."""
    from fusestate.errors import UserError
    from fusestate.spark.pipeline import check_key_skew, events_for_batch, generate_input

    d = tmp_path / "input"
    generate_input(d, 4, 1000, 300)
    last = d / "events-000003.csv"
    uniform = last.read_text()
    generate_input(d, 4, 1000, 300, key_skew=1.1)
    skewed = last.read_text()
    assert skewed != uniform and json.loads((d / "_params.json").read_text())["key_skew"] == 1.1
    assert skewed.splitlines()[0].split(",")[1] == events_for_batch(3, 1000, 300, key_skew=1.1)[0][1]
    ino = last.stat().st_ino
    generate_input(d, 4, 1000, 300, key_skew=1.1)
    assert last.stat().st_ino == ino  # the same skew: kept
    generate_input(d, 4, 1000, 300)
    assert last.read_text() == uniform
    manifest = json.loads((d / "_params.json").read_text())
    del manifest["key_skew"]  # as written before --key-skew existed: uniform keys, still valid
    (d / "_params.json").write_text(json.dumps(manifest))
    ino = last.stat().st_ino
    generate_input(d, 4, 1000, 300)
    assert last.stat().st_ino == ino
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(UserError, match="--key-skew"):
            check_key_skew(bad)
        with pytest.raises(UserError):
            generate_input(tmp_path / "other", 2, 1000, 300, key_skew=bad)
    assert not (tmp_path / "other").exists()
    assert check_key_skew(0) == 0.0 and check_key_skew(1) == 1.0
    line = refused_pipeline(tmp_path / "state", tmp_path / "out", "--local", "--key-skew", "-1")
    assert "--key-skew -1" in line and ">= 0" in line
    proc = subprocess.run([str(BIN / "fusestate"), "spark-cluster", "--root", str(tmp_path / "cluster"),
                           "--key-skew", "-1"], capture_output=True, text=True, timeout=60)
    assert "--key-skew -1" in assert_one_line_error(proc)
    assert not (tmp_path / "cluster").exists()  # refused before any node, server or dir


def test_status_is_none_where_no_daemon_answers(tmp_path: Path) -> None:
    """The pipeline asks the daemon in-process; without a mount it reports no numbers rather
    than failing (the live case is the mounted runs above: fusestate_before/after)."""
    from fusestate.spark.pipeline import fusestate_status

    assert fusestate_status(None) is None
    assert fusestate_status(str(tmp_path)) is None  # a plain directory: no control socket


def test_summary_lines_report_what_a_person_checks() -> None:
    from fusestate.spark.pipeline import progress_header, progress_row, summary_lines

    status = {"writeback": {"uploaded_bytes": 0}, "remote": {"bytes_in": 0},
              "cache": {"reads_from_memory": 0, "reads_from_disk": 0, "reads_from_bucket": 0}}
    after = {"writeback": {"uploaded_bytes": 3 * 2**20}, "remote": {"bytes_in": 2**20},
             "cache": {"reads_from_memory": 90, "reads_from_disk": 5, "reads_from_bucket": 5}}
    report = {"summary": {"batches": 3, "rows": 3000, "records_per_second": 1500.0, "batch_ms_median": 700},
              "batches": [{"state_commit_ms": ms} for ms in (300, 100, 200)],
              "shim": {"linked": 4, "copied": 0}, "fusestate_before": status, "fusestate_after": after,
              "report_file": "/data/out/report.json", "spark_log": "/data/out/spark.log"}
    text = "\n".join(summary_lines(report))
    assert "1,500 over 3 batches" in text and "median 200 ms, max 300 ms" in text
    assert "4 state files linked" in text and "3.0 MiB uploaded, 1.0 MiB fetched" in text
    # One column of values, as `fusestate status` prints them; the last rows say where the rest is.
    assert "\ncache hit ratio  0.95" in text and "\nrecords/s        1,500" in text
    assert text.endswith("\nreport           /data/out/report.json (every batch's metrics)"
                         "\nSpark's log      /data/out/spark.log")
    assert "already had" not in text and "changelog" not in text
    # No file linked because the commits wrote changelogs: the line says so, not just "0".
    changelog = dict(report, shim={"linked": 0, "copied": 0}, state_store_conf={
        "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
        "spark.sql.streaming.stateStore.minDeltasForSnapshot": "10"})
    text = "\n".join(summary_lines(changelog))
    assert "0 state files linked, 0 copied (changelog checkpointing: state files reach the checkpoint " \
           "with a snapshot, every 10 versions)" in text
    # A rerun over the same input writes blocks the volume has: the line says why nothing went up.
    again = dict(after, writeback={"uploaded_bytes": 0, "deduplicated_bytes": 17 * 2**20})
    text = "\n".join(summary_lines(dict(report, fusestate_after=again)))
    assert "0.0 MiB uploaded, 1.0 MiB fetched, 17.0 MiB written that the volume already had" in text
    nothing = summary_lines({"summary": {"batches": 0}, "batches": [], "report_file": "/data/out/report.json"})
    assert "no batch ran" in nothing[0] and nothing[1].startswith("report  /data/out/report.json")
    # A row per batch, under a header whose columns it fills.
    row = progress_row({"batch": 12, "rows": 1100, "rows_per_second": 1234.5, "duration_ms": 2671,
                        "state_commit_ms": 845, "rocksdb": {"rocksdbFilesCopied": 16}})
    header = progress_header("files linked")
    assert row.split() == ["12", "1,100", "1,234", "2,671", "ms", "845", "ms", "16"]
    assert len(row) == len(header) and row.index("2,671 ms") + len("2,671 ms") == header.index("duration") + 8


def test_a_failed_query_is_named_by_the_root_cause_spark_logged() -> None:
    """Spark's log is a file, so the one-line error names the cause from the trace there:
    the innermost 'Caused by', else the exception the query terminated with."""
    from fusestate.spark.pipeline import logged_cause

    log = ("26/11/25 20:38:15 WARN NativeCodeLoader: Unable to load native-hadoop library\n"
           "26/11/25 20:38:42 ERROR MicroBatchExecution: Query q [id = 1] terminated with error\n"
           "org.apache.spark.SparkException: Job aborted due to stage failure\n"
           "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(DAGScheduler.scala:1)\n"
           "Caused by: java.io.IOException: No space left on device\n\t... 23 more\n"
           "26/11/25 20:38:43 WARN Shutdown: Caused by: not part of the trace\n")
    assert logged_cause(log) == "java.io.IOException: No space left on device"
    assert logged_cause("... Query q terminated with error\njava.lang.ClassNotFoundException: no.such.Provider\n"
                        "\tat java.base/java.lang.Class.forName(Class.java:467)\n") \
        == "java.lang.ClassNotFoundException: no.such.Provider"
    assert logged_cause(log.split("\n")[0]) == ""  # nothing logged for a query: the exception's message is used


def test_state_conf_block_size_follows_the_mount(tmp_path: Path) -> None:
    from fusestate.spark.config import ROCKSDB_PREFIX, state_conf

    key = ROCKSDB_PREFIX + "blockSizeKB"
    assert key not in state_conf(tmp_path / "local", local=True).conf  # local disk: Spark's default
    assert state_conf(tmp_path / "local", local=True, block_size_kb=16).conf[key] == "16"
    with pytest.raises(ValueError, match="block_size_kb"):
        state_conf(tmp_path / "local", local=True, block_size_kb=0)


def test_state_conf_snapshots_every_version_with_the_shim(make_mount, file_bucket: Bucket, tmp_path: Path,
                                                          shim) -> None:
    """With the shim a snapshot costs links: by default every commit is one (no changelog, so a
    restart loads the latest snapshot and replays nothing); with changelog checkpointing asked
    for, one every version, linked in every second. Without the shim Spark's copies keep
    changelog checkpointing and the helper's every 10 versions and 30 s."""
    from fusestate.spark.config import state_conf

    every, interval = "spark.sql.streaming.stateStore.minDeltasForSnapshot", "spark.sql.streaming.stateStore.maintenanceInterval"
    changelog = "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"
    m = make_mount(file_bucket).mount()
    assert state_conf(m.path / "job", use_shim=True).conf[changelog] == "false"
    assert state_conf(m.path / "plain").conf[changelog] == "true"
    assert state_conf(tmp_path / "local", local=True).conf[changelog] == "true"
    assert state_conf(m.path / "plain", changelog=False).conf[changelog] == "false"
    conf = state_conf(m.path / "job", use_shim=True, changelog=True).conf
    assert (conf[changelog], conf[every], conf[interval]) == ("true", "1", "1s")
    conf = state_conf(m.path / "plain").conf
    assert (conf[every], conf[interval]) == ("10", "30s")
    conf = state_conf(m.path / "job", use_shim=True, min_deltas_for_snapshot=5, maintenance_interval="10s").conf
    assert (conf[every], conf[interval]) == ("5", "10s")
    conf = state_conf(tmp_path / "local", local=True).conf
    assert (conf[every], conf[interval]) == ("10", "30s")


def test_stale_spark_local_dirs_are_removed_and_nothing_else(tmp_path: Path) -> None:
    """A killed JVM's working dirs and shuffle files go; what the user put there stays."""
    from fusestate.spark.config import state_conf

    layout = state_conf(tmp_path / "state", local=True)
    stale = [layout.local_dir / "spark-1b2c" / "StateStoreId(opId=0,partId=0)-x", layout.local_dir / "blockmgr-9f" / "0c"]
    for d in stale:
        d.mkdir(parents=True)
        (d / "000012.sst").write_bytes(b"s" * 100)
    mine = layout.local_dir / "notes"
    mine.mkdir()
    (layout.local_dir / "spark-defaults.conf").write_text("a file, not a dir Spark made\n")
    (layout.local_dir / "spark-link").symlink_to(mine)
    removed = layout.remove_stale_local_dirs()
    assert sorted(p.name for p in removed) == ["blockmgr-9f", "spark-1b2c"]
    assert sorted(p.name for p in layout.local_dir.iterdir()) == ["notes", "spark-defaults.conf", "spark-link"]
    assert layout.remove_stale_local_dirs() == []


def refused_pipeline(state_dir: Path, output: Path, *extra: str) -> str:
    """The pipeline refused at once: its one-line error (nothing generated, no JVM)."""
    proc = subprocess.run(pipeline_cmd(state_dir, output, *SMALL, *extra), capture_output=True, text=True, timeout=120)
    line = assert_one_line_error(proc)
    assert not output.exists() and not output.with_name(output.name + ".input").exists(), line
    return line


def test_bad_configuration_fails_before_the_query_starts(make_mount, file_bucket: Bucket, tmp_path: Path, shim):
    """Mount missing, shim jar missing, wrong scheme: one clear line, and nothing created."""
    m = make_mount(file_bucket).mount()
    plain = tmp_path / "plain"
    plain.mkdir()
    out = tmp_path / "out"

    # No mount where the state should go (a mountpoint that was never mounted, say).
    line = refused_pipeline(plain / "job", out)
    assert f"{plain / 'job'} is not on a fusestate mount" in line and "--local" in line
    assert not (plain / "job").exists()  # nothing written to the local disk under it
    line = refused_pipeline(m.path / "job", out, "--local")
    assert f"on the fusestate mount {m.path}, not on local disk" in line
    # The shim's jar is missing.
    line = refused_pipeline(m.path / "job", out, "--use-shim", "--shim-jar", str(tmp_path / "gone.jar"))
    assert f"the shim jar {tmp_path / 'gone.jar'} does not exist" in line and "the installed one is" in line
    # Checkpoint schemes that do not keep the state on the mount, or need the shim.
    line = refused_pipeline(m.path / "job", out, "--checkpoint", "s3a://bucket/checkpoints/q")
    assert "scheme s3a://" in line and "fusestate://" in line
    line = refused_pipeline(m.path / "job", out, "--checkpoint", f"fusestate://{m.path}/ckpt")
    assert "needs the shim" in line and "--use-shim" in line
    line = refused_pipeline(m.path / "job", out, "--checkpoint", "file://otherhost/ckpt")
    assert "no host part" in line
    # The shim's checkpoint off the mount: every state file would be copied, not linked.
    line = refused_pipeline(m.path / "job", out, "--use-shim", "--checkpoint", str(plain / "ckpt"))
    assert f"fusestate://{plain / 'ckpt'} is not on a fusestate mount" in line
    assert sorted(os.listdir(m.path)) == [] and sorted(os.listdir(plain)) == []

    # The mount's daemon died: the mount is still listed, but answers nothing.
    m.kill(detach=False)
    line = refused_pipeline(m.path / "job", out, "--use-shim")
    assert f"the fusestate mount {m.path}" in line and "does not answer (Transport endpoint is not connected)" in line
    assert f"fusermount3 -u -z {m.path}" in line


def test_check_state_conf_refuses_settings_a_job_built_itself(make_mount, file_bucket: Bucket, tmp_path: Path, shim):
    from fusestate.spark.config import SHIM_FS_CLASS, SparkSetupError, check_state_conf, state_conf

    m = make_mount(file_bucket).mount()
    good = state_conf(m.path / "job", use_shim=True).conf
    check_state_conf(good)  # what state_conf builds passes
    unregistered = {k: v for k, v in good.items() if not k.startswith("spark.hadoop.fs.")}
    with pytest.raises(SparkSetupError, match=f"shim is not registered .*{SHIM_FS_CLASS}"):
        check_state_conf(unregistered)
    with pytest.raises(SparkSetupError, match="no jar is on spark.jars"):
        check_state_conf({k: v for k, v in good.items() if "ClassPath" not in k})
    (tmp_path / "other-bucket").mkdir()
    other = make_mount(Bucket("file", f"file://{tmp_path / 'other-bucket'}"), name="other", cache="other-cache").mount()
    with pytest.raises(SparkSetupError, match=f"is on {other.path}, spark.local.dir .* on {m.path}"):
        check_state_conf(dict(good, **{"spark.sql.streaming.checkpointLocation": f"fusestate://{other.path}/ckpt"}))
    with pytest.raises(SparkSetupError, match="spark.local.dir .* is not on a fusestate mount"):
        check_state_conf(dict(good, **{"spark.local.dir": str(tmp_path)}))
    check_state_conf(dict(good, **{"spark.local.dir": str(tmp_path)}), on_mount=False)  # a baseline's


def test_s3a_baseline_settings_are_printed_and_checked(tmp_path: Path) -> None:
    """The object-store baseline's settings: what a user copies to reproduce it, and the
    mistakes refused before a session starts."""
    from fusestate.spark.config import SparkSetupError, state_conf
    from fusestate.spark.s3a import hadoop_version

    version = hadoop_version()
    assert (Path(pyspark.__file__).parent / "jars" / f"hadoop-client-api-{version}.jar").is_file()
    proc = subprocess.run(pipeline_cmd(tmp_path / "job", tmp_path / "out", "--local", "--checkpoint",
                                       "s3a://bucket/checkpoints/q", "--s3a-endpoint", "http://127.0.0.1:9000",
                                       "--print-conf"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = dict(line.split(None, 1) for line in proc.stdout.splitlines())
    assert printed["spark.sql.streaming.checkpointLocation"] == "s3a://bucket/checkpoints/q"
    assert printed["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert printed["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert printed["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false"
    assert printed["spark.hadoop.fs.s3a.endpoint.region"]  # SigV4 signs with one
    assert printed["spark.jars.packages"] == f"org.apache.hadoop:hadoop-aws:{version}"
    assert printed["spark.local.dir"] == str(tmp_path / "job" / "spark-local")
    assert list(tmp_path.iterdir()) == []  # printing creates nothing
    # Jars on this machine instead of a resolution at every start; a missing one is named.
    with pytest.raises(SparkSetupError, match="hadoop-aws-9.jar does not exist"):
        state_conf(tmp_path / "job", local=True, checkpoint="s3a://b/q", s3a_jars=[tmp_path / "hadoop-aws-9.jar"])
    with pytest.raises(SparkSetupError, match="for an s3a:// checkpoint"):
        state_conf(tmp_path / "job", local=True, s3a_endpoint="http://127.0.0.1:9000")


@pytest.fixture(scope="module")
def s3a_jars() -> list[Path]:
    """Hadoop's S3A connector, as the benchmark fetches it (cached after the first time). Only a
    machine that cannot reach Maven Central at all skips; any other failure fails."""
    try:
        return connector_jars()
    except ConnectorUnavailable as exc:
        if exc.offline:
            pytest.skip(f"Maven Central is not reachable from this machine: {exc}")
        pytest.fail(f"Hadoop's S3A connector could not be fetched: {exc}")


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto as the benchmark's endpoint serves it (bench/shaped_s3.py, unshaped): S3A's uploads
    of whole files need its single ``100 Continue``."""
    port = free_port()
    log = tmp_path_factory.mktemp("s3-server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(BIN / "python"), "-m", "bench.shaped_s3", "--host", "127.0.0.1", "--port",
                                 str(port), "--latency-ms", "0", "--connection-mbps", "1e6"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


# By default one S3A run (three JVMs in all would be the heaviest test of the default selection);
# the fresh node's load and fusestate's run beside it with -m slow.
@pytest.mark.parametrize("whole", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["first-node", "fresh-node-and-fusestate"])
def test_s3a_baseline_and_fusestate_on_one_endpoint(make_mount, baseline, tmp_path: Path, s3a_jars, s3_server,
                                                    whole: bool):
    """The benchmarks' object-store baseline does what Spark on S3A does, and ends where fusestate
    does: state on local disk, every commit a snapshot uploaded through S3A; a fresh node (no local
    state) loads it from the bucket; the output is local mode's, and fusestate+shim's on a bucket of
    the same endpoint."""
    import boto3

    three = ["--batches", "3", *SMALL[2:]]
    bucket = f"s3a-{os.getpid()}-{int(time.time())}"
    make_s3_bucket(s3_server, bucket)
    s3a = ["--local", "--no-changelog", "--checkpoint", f"s3a://{bucket}/job", "--s3a-endpoint", s3_server,
           "--s3a-jars", jars_argument(s3a_jars)]
    state, out = tmp_path / "state", tmp_path / "out"
    first = pipeline(state, out, tmp_path / "input", "--batches", "2", *SMALL[2:], *s3a)
    assert first["checkpoint"] == f"s3a://{bucket}/job"
    keys = {o["Key"] for o in boto3.client("s3", endpoint_url=s3_server).list_objects_v2(Bucket=bucket)["Contents"]}
    assert any(k.endswith(".sst") for k in keys) and any(k.endswith(".zip") for k in keys), sorted(keys)
    assert {"job/commits/0", "job/commits/1"} <= keys
    assert read_output(out) == {b: baseline["output"][b] for b in range(2)}
    if not whole:
        return
    shutil.rmtree(state)  # a fresh node
    again = pipeline(state, out, tmp_path / "input", *three, *s3a)
    assert [b["batch"] for b in again["batches"]] == [2]
    assert again["batches"][0]["rocksdb"]["rocksdbNumLoadedFromDfs"] > 0  # loaded from the bucket
    output = read_output(out)
    assert output == {b: baseline["output"][b] for b in range(3)}

    fused = Bucket("s3", f"s3://{bucket}/volume", s3_server)
    m = make_mount(fused, extra=scratch_options()).mount()
    report = pipeline(m.path / "job", tmp_path / "out-fusestate", tmp_path / "input", *three, "--use-shim")
    assert read_output(tmp_path / "out-fusestate") == output
    assert report["fusestate_after"]["writeback"]["uploaded_bytes"] > 0
    m.umount()


def test_the_installed_shim_jar_is_built_from_the_current_sources() -> None:
    """The jar ships as package data: an edit of the Java sources without a rebuild
    (bash spark/shim/build.sh) would ship the old classes."""
    from fusestate.spark.shim import installed_jar, jar_digest, source_digest

    assert jar_digest(installed_jar()) == source_digest(ROOT / "spark" / "shim")


def test_a_wheel_carries_the_shim_jar(tmp_path: Path) -> None:
    """Executors of a cluster get fusestate from a wheel (an image, a venv): the jar is in it."""
    import zipfile

    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("fusestate-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "fusestate/spark/jars/fusestate-hadoop-shim.jar" in z.namelist()


RENAME_RACE = """
import java.net.URI;
import java.nio.file.Files;
import java.nio.file.Paths;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FileAlreadyExistsException;
import org.apache.hadoop.fs.FileContext;
import org.apache.hadoop.fs.Options;
import org.apache.hadoop.fs.Path;

public class RenameRace {
    public static void main(String[] args) throws Exception {
        String dir = args[0], tag = args[1], barrier = args[3];
        int n = Integer.parseInt(args[2]);
        Configuration conf = new Configuration();
        conf.set("fs.fusestate.impl", "io.fusestate.hadoop.FusestateFileSystem");
        conf.set("fs.AbstractFileSystem.fusestate.impl", "io.fusestate.hadoop.FusestateFs");
        FileContext fc = FileContext.getFileContext(URI.create("fusestate:///"), conf);
        for (int i = 0; i < n; i++) {
            Files.write(Paths.get(dir, "." + tag + "-" + i + ".tmp"), tag.getBytes());
        }
        while (!Files.exists(Paths.get(barrier))) {
            Thread.sleep(1);
        }
        for (int i = 0; i < n; i++) {
            Path tmp = new Path("fusestate://" + dir + "/." + tag + "-" + i + ".tmp");
            try {
                fc.rename(tmp, new Path("fusestate://" + dir + "/" + i), Options.Rename.NONE);
                System.out.println(i + " won");
            } catch (FileAlreadyExistsException e) {
                System.out.println(i + " lost");
            }
        }
    }
}
"""


def test_shim_no_overwrite_rename_has_one_winner_across_nodes(make_mount, file_bucket: Bucket, pg_url: str,
                                                               tmp_path: Path, shim) -> None:
    """Spark writes offsets/N and commits/N by a rename that must fail when the target exists
    (two drivers on one checkpoint). Two nodes of a shared volume race for the same names
    through the shim's FileContext: every name has exactly one winner, whose bytes it holds."""
    from test_shared import shared_pair

    a, b = shared_pair(make_mount, file_bucket, pg_url)
    (a.path / "log").mkdir()
    (tmp_path / "RenameRace.java").write_text(RENAME_RACE)
    classpath = f"{shim}:{Path(pyspark.__file__).parent / 'jars'}/*:{tmp_path}"
    subprocess.run(["javac", "-nowarn", "-d", str(tmp_path), "-cp", classpath, str(tmp_path / "RenameRace.java")],
                   check=True, capture_output=True, timeout=120)
    n, barrier = 150, tmp_path / "go"
    racers = {tag: subprocess.Popen(["java", "-cp", classpath, "RenameRace", str(m.path / "log"), tag, str(n),
                                     str(barrier)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for tag, m in (("a", a), ("b", b))}
    deadline = time.monotonic() + 60
    while sum(1 for name in os.listdir(a.path / "log") if name.endswith(".tmp")) < 2 * n:
        assert time.monotonic() < deadline, "the racers did not write their files"
        time.sleep(0.1)
    barrier.touch()
    won: dict[str, set[int]] = {}
    for tag, proc in racers.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        won[tag] = {int(line.split()[0]) for line in out.splitlines() if line.endswith(" won")}
    assert won["a"] | won["b"] == set(range(n)) and not won["a"] & won["b"]
    for i in range(n):
        assert (b.path / "log" / str(i)).read_text() == ("a" if i in won["a"] else "b")
    assert 0 < len(won["a"]) < n, "the two nodes never raced for a name"
