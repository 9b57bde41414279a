"""The reference pipeline on a Spark standalone cluster whose workers are separate nodes, each
with its own fusestate daemon mounting one shared volume (fusestate.spark.cluster).

Every cluster here forces what a real one does now and then: 4 state partitions on 2
single-core executors with ``spark.locality.wait=0s``, so a partition's state store moves
between nodes from batch to batch, and a maintenance thread that snapshots every second, so
one node uploads a snapshot into a partition's directory while another loads it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import Bucket

pytest.importorskip("pyspark")
if shutil.which("java") is None:
    pytest.skip("no java on this machine", allow_module_level=True)

from fusestate.spark.cluster import Cluster, DriverBatches, Node, placed_stores, summary_lines  # noqa: E402
from fusestate.spark.pipeline import SPARK_LOG_NAME, final_view, read_output  # noqa: E402

BATCHES = 6
SIZE = ["--keys", "4000", "--payload-bytes", "256", "--events-per-batch", "1000"]
# State stores move between nodes, and snapshots are uploaded while others load them.
CONF = ["spark.locality.wait=0s", "spark.sql.streaming.stateStore.maintenanceInterval=1s",
        "spark.sql.streaming.stateStore.minDeltasForSnapshot=2", "spark.executor.memory=768m"]
PIPELINE_TIMEOUT = 420


def pipeline_args(output: Path, report: Path, checkpoint: str, batches: int = BATCHES) -> list[str]:
    args = ["--output", str(output), "--report", str(report), "--checkpoint", checkpoint,
            "--batches", str(batches), "--partitions", "4", "--driver-memory", "768m", *SIZE]
    for c in CONF:
        args += ["--conf", c]
    return args


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same pipeline in local mode with its state on local disk: the expected output."""
    root = tmp_path_factory.mktemp("local-reference")
    out = root / "out"
    proc = subprocess.run([sys.executable, "-m", "fusestate", "spark-pipeline", "--local", "--state-dir",
                           str(root / "state"), "--output", str(out), "--batches", str(BATCHES),
                           "--partitions", "4", "--driver-memory", "768m", *SIZE],
                          capture_output=True, text=True, timeout=PIPELINE_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture
def cluster(tmp_path: Path, file_bucket: Bucket, pg_url: str):
    with Cluster(tmp_path / "cluster", file_bucket.url, pg_url, mountpoint=str(tmp_path / "state"),
                 worker_memory="1g", session_timeout=5.0) as c:
        yield c


def tail(node: Node, lines: int = 30) -> str:
    return "\n".join(node.log.read_text(errors="replace").splitlines()[-lines:])


def wait_for_batch(output: Path, batch: int, driver: Node, timeout: float = PIPELINE_TIMEOUT) -> None:
    done = output / f"batch-{batch:06d}" / "_SUCCESS"
    deadline = time.monotonic() + timeout
    while not done.exists():
        assert driver.alive(), f"the driver ended before batch {batch}:\n{tail(driver)}"
        assert time.monotonic() < deadline, f"batch {batch} did not complete:\n{tail(driver)}"
        time.sleep(0.2)


def finish(driver: Node) -> None:
    code = driver.wait(PIPELINE_TIMEOUT)
    assert code == 0, f"the pipeline failed:\n{tail(driver)}"


def counter(status: dict, key: str) -> float:
    return status["remote"][key]


# The fault-free cluster: -m slow. The default selection runs the same cluster with a worker's
# daemon killed (test_a_worker_daemon_killed_alone_does_not_fail_the_query), which checks the same.
@pytest.mark.slow
def test_pipeline_on_a_two_worker_cluster_equals_local_mode(cluster: Cluster, local_reference: Path,
                                                            tmp_path: Path) -> None:
    cluster.start(workers=2)
    out, report = tmp_path / "out", tmp_path / "report.json"
    driver = cluster.start_driver(pipeline_args(out, report, cluster.checkpoint("q")))
    # Each node's shuffle files stay on it (--scratch 'blockmgr-*'), as on a local disk.
    shuffle_kept_on_node = False
    while driver.alive() and not shuffle_kept_on_node:
        shuffle_kept_on_node = any(w.status()["cache"]["scratch_bytes"] > 0 for w in cluster.workers)
        time.sleep(0.2)
    finish(driver)
    assert shuffle_kept_on_node
    assert read_output(out) == read_output(local_reference)  # batch for batch
    result = json.loads(report.read_text())
    s = result["summary"]
    # Snapshots and loads went through the shim on the volume: every state file Spark
    # "copied" between a working dir and the checkpoint was a hard link made by a worker.
    assert s["rocksdb_files_copied"] > 0
    links = [w.status()["fuse"]["operation_counts"].get("link", 0) for w in cluster.workers]
    assert sum(links) >= s["rocksdb_files_copied"], links
    # Both nodes ran state stores.
    assert all(w.status()["fuse"]["bytes_written"] > 0 for w in cluster.workers)


def test_a_query_restarted_on_the_same_nodes_reads_its_state_from_their_caches(cluster: Cluster,
                                                                              tmp_path: Path) -> None:
    """Stop the query after batch 1 and start it again on a new driver node, the two workers and
    their caches kept (a job restarted on the nodes it ran on). Spark's first batch of a new
    run has no record of where a state store was: its tasks go where the batch's shuffle
    input is (here one input file, so one node) or wherever a slot is free. The shim's
    StoreAffinity starts each store on the node whose cache holds its next load instead. So
    the workers fetch less than half of one store's share of the state before that batch is
    done, where stores put by Spark alone (those the other node built) read theirs whole."""
    cluster.start(workers=2)
    out, report = tmp_path / "out", tmp_path / "report.json"
    checkpoint = cluster.checkpoint("q")
    size = ["--payload-bytes", "2048"]
    # The module's 0 s locality wait spreads the stores over both nodes while the state is
    # built; the restart has Spark's own (3 s): a task waits for the node it is placed on
    # rather than moving to whichever executor is free first.
    conf = ["--conf", "spark.locality.wait=3s"]
    finish(cluster.start_driver([*pipeline_args(out, report, checkpoint, batches=2), *size]))
    stores = 2 * 4  # two stateful operators, 4 partitions each
    state = json.loads(report.read_text())["summary"]["rocksdb_sst_bytes_last"]
    before = {w.name: counter(w.status(), "bytes_in") for w in cluster.workers}
    driver = cluster.start_driver([*pipeline_args(out, report, checkpoint, batches=4), *size, *conf])
    wait_for_batch(out, 2, driver)
    fetched = {w.name: counter(w.status(), "bytes_in") - before[w.name] for w in cluster.workers}
    finish(driver)
    assert placed_stores(out / SPARK_LOG_NAME) == (stores, stores), tail(driver)
    assert state > 1_000_000
    assert sum(fetched.values()) < state / stores / 2, (fetched, state)


def rejoined(cluster: Cluster, node: Node, known: set[str], timeout: float = 180) -> bool:
    """Whether the master lists a new ALIVE worker on the node's address within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(w["host"] == node.host and w["state"] == "ALIVE" and w["id"] not in known
               for w in cluster.worker_records()):
            return True
        time.sleep(0.5)
    return False


def test_a_worker_daemon_killed_alone_does_not_fail_the_query(cluster: Cluster, local_reference: Path,
                                                              tmp_path: Path) -> None:
    """SIGKILL one worker node's fusestate daemon alone after batch 2 (an OOM kill, a crash):
    the node's supervisor stops its executors at once, so Spark moves their tasks and state
    stores to the other worker as for a lost node, and the query finishes with the output of a
    fault-free run; the survivor loads the stores by links; the node mounts again and rejoins."""
    cluster.start(workers=2)
    out, report = tmp_path / "out", tmp_path / "report.json"
    driver = cluster.start_driver(pipeline_args(out, report, cluster.checkpoint("q")))
    # Each node's shuffle files stay on it (--scratch 'blockmgr-*'), as on a local disk.
    shuffle_kept_on_node = False
    while driver.alive() and not shuffle_kept_on_node and not (out / "batch-000002" / "_SUCCESS").exists():
        shuffle_kept_on_node = any(w.status()["cache"]["scratch_bytes"] > 0 for w in cluster.workers)
        time.sleep(0.2)
    wait_for_batch(out, 2, driver)
    survivor, hit = cluster.workers
    before, old_daemon = survivor.status(), hit.status()["pid"]
    known = {w["id"] for w in cluster.worker_records()}
    hit.kill_daemon()
    finish(driver)
    after = survivor.status()
    assert shuffle_kept_on_node
    assert read_output(out) == read_output(local_reference)  # batch for batch
    result = json.loads(report.read_text())
    post = [b for b in result["batches"] if b["batch"] > 2]
    loaded = sum(b["rocksdb"].get("rocksdbNumLoadedFromDfs", 0) for b in post)
    files = sum(b["rocksdb"].get("rocksdbFilesCopied", 0) for b in post)
    assert loaded > 0 and files > 0, post
    # Every state file Spark copied after the kill was a hard link: the survivor's daemon, and
    # the rejoined node's new one, made at least as many links as Spark counted copies.
    links = after["fuse"]["operation_counts"].get("link", 0) - before["fuse"]["operation_counts"].get("link", 0)
    assert rejoined(cluster, hit, known), tail(hit)
    again = hit.status()
    assert again["pid"] != old_daemon
    assert links + again["fuse"]["operation_counts"].get("link", 0) >= files, (links, files)
    # As soon as Spark noticed the lost executor, the survivor's executor asked its daemon to
    # fill the stores the lost one held (the shim's LossFill plugin), before their tasks came.
    assert after["page_fill"]["requested"] > before["page_fill"]["requested"], after["page_fill"]
    lines = hit.log.read_text()
    assert "died (killed by SIGKILL)" in lines and "stopped the node's" in lines and "mounted" in lines


@pytest.mark.slow
def test_the_driver_daemon_killed_alone_and_the_query_resumed(cluster: Cluster, local_reference: Path,
                                                             tmp_path: Path) -> None:
    """SIGKILL the driver node's daemon alone after batch 2: the query stops with one line that
    names the mount and the node, the node mounts again, and the pipeline resumes the query
    from the last committed batch: every batch in the output once, the end result as in a
    fault-free run."""
    cluster.start(workers=2)
    out, report = tmp_path / "out", tmp_path / "report.json"
    driver = cluster.start_driver([*pipeline_args(out, report, cluster.checkpoint("q")), "--json",
                                   "--wait-for-remount", "180"])
    batches = DriverBatches(driver.log)
    deadline = time.monotonic() + PIPELINE_TIMEOUT
    while not any(b["batch"] == 2 for b in batches.new()):  # batch 2 committed and reported
        assert driver.alive() and time.monotonic() < deadline, tail(driver)
        time.sleep(0.2)
    driver.kill_daemon()
    finish(driver)
    result = json.loads(report.read_text())
    (restart,) = result["restarts"]
    assert restart["after_batch"] == 2
    assert f"the fusestate mount {cluster.mountpoint} on this node (driver1) died" in restart["cause"]
    (line,) = [ln for ln in driver.log.read_text().splitlines() if ln.startswith("fusestate: ")]
    assert line.startswith(f"fusestate: the query stopped: {restart['cause']}")
    # Resumed after batch 2, not from 0: every batch once in the report and in the output.
    ids = [b["batch"] for b in result["batches"]]
    assert ids == list(range(len(ids))) and ids[-1] >= BATCHES - 2, ids
    output = read_output(out)
    assert sorted(output) == ids
    expected = read_output(local_reference)
    assert all(output[b] == expected[b] for b in range(3))
    assert final_view(out) == final_view(local_reference)
    assert "mounted" in driver.log.read_text() and "again after" in driver.log.read_text()


@pytest.mark.slow
def test_losing_a_worker_node_mid_stream(cluster: Cluster, local_reference: Path, tmp_path: Path) -> None:
    """Kill one worker node (its JVMs and its fusestate daemon at once) and wipe its cache:
    the query goes on with the other worker, no batch lost or doubled, and the lost node's
    state stores are loaded on the survivor by links and blocks read on demand."""
    cluster.start(workers=2)
    out, report = tmp_path / "out", tmp_path / "report.json"
    driver = cluster.start_driver(pipeline_args(out, report, cluster.checkpoint("q"), batches=BATCHES + 2))
    wait_for_batch(out, 2, driver)
    survivor, lost = cluster.workers
    before = survivor.status()
    lost.kill()
    lost.wipe_cache()
    finish(driver)
    after = survivor.status()
    expected = read_output(local_reference)
    got = read_output(out)
    assert sorted(got) == list(range(BATCHES + 2))
    assert {b: got[b] for b in expected} == expected
    result = json.loads(report.read_text())
    post = [b for b in result["batches"] if b["batch"] > 2]
    loaded_files = sum(b["rocksdb"].get("rocksdbFilesCopied", 0) for b in post)
    loaded_bytes = sum(b["rocksdb"].get("rocksdbBytesCopied", 0) for b in post)
    fetched = after["remote"]["bytes_in"] - before["remote"]["bytes_in"]
    filled = after["page_fill"]["bytes"] - before["page_fill"]["bytes"]
    assert loaded_files > 0 and loaded_bytes > 0
    # The loads were links: besides putting the linked files into its page cache in the
    # background (--prefetch-links), the survivor read from the bucket only what its
    # queries touched before that.
    assert filled > 0 and after["page_fill"]["files"] > before["page_fill"]["files"]
    assert fetched - filled < loaded_bytes / 2, (fetched, filled, loaded_bytes)
    links = after["fuse"]["operation_counts"].get("link", 0) - before["fuse"]["operation_counts"].get("link", 0)
    assert links >= loaded_files


@pytest.mark.slow
def test_driver_node_lost_and_the_query_restarted_on_another_node(cluster: Cluster, local_reference: Path,
                                                                  tmp_path: Path) -> None:
    cluster.start(workers=2)
    out, report = tmp_path / "out", tmp_path / "report.json"
    checkpoint = cluster.checkpoint("q")
    first = cluster.start_driver(pipeline_args(out, tmp_path / "first.json", checkpoint))
    wait_for_batch(out, 2, first)
    first.kill()
    first.wipe_cache()
    second = cluster.start_driver(pipeline_args(out, report, checkpoint), name="driver2")
    finish(second)
    result = json.loads(report.read_text())
    resumed = [b["batch"] for b in result["batches"]]
    assert resumed and 3 <= resumed[0] <= 4, resumed  # from the last committed batch on, not from 0
    assert final_view(out) == final_view(local_reference)


def driver_error(cluster: Cluster, tmp_path: Path, name: str, mount_args: Optional[list[str]] = None) -> str:
    driver = cluster.start_driver(pipeline_args(tmp_path / name, tmp_path / f"{name}.json", cluster.checkpoint(name)),
                                  name=name, mount_args=mount_args)
    code = driver.wait(PIPELINE_TIMEOUT)
    assert code != 0, f"the pipeline ran on a bad setup:\n{tail(driver)}"
    errors = [line for line in driver.log.read_text().splitlines() if line.startswith("fusestate: ")]
    assert len(errors) == 1, tail(driver)
    assert not (tmp_path / name).exists() or not list((tmp_path / name).glob("batch-*"))
    return errors[0]


# Three drivers on a cluster: -m slow. The default selection checks the same verdicts on this
# node in test_preflight_names_what_is_wrong_with_a_node, and a good cluster's probes in
# test_pipeline_on_a_two_worker_cluster_equals_local_mode.
@pytest.mark.slow
def test_bad_cluster_setups_are_one_line_before_the_query(cluster: Cluster, tmp_path: Path,
                                                           file_bucket: Bucket, postgres_server) -> None:
    cluster.start_master()
    cluster.add_worker()
    bare = cluster.add_worker(mount=False)
    cluster.wait_for_workers(2)
    line = driver_error(cluster, tmp_path, "no-mount")
    assert f"the executor on {bare.host} has no fusestate mount holding the checkpoint" in line
    bare.stop()
    cluster.workers.remove(bare)

    other_bucket = tmp_path / "other-bucket"
    other_bucket.mkdir()
    stranger = cluster.add_worker(volume_url=f"file://{other_bucket}",
                                  meta_url=postgres_server.create_database("other"))
    cluster.wait_for_workers(2)
    line = driver_error(cluster, tmp_path, "other-volume")
    assert f"the executor on {stranger.host} mounts another volume" in line

    # The driver's checkpoint on a volume that only one node can mount (an embedded engine).
    own = tmp_path / "own-bucket"
    own.mkdir()
    line = driver_error(cluster, tmp_path, "own-volume", mount_args=[f"file://{own}", "--metrics-addr", "off"])
    assert "a volume only this node can mount (metadata engine sqlite)" in line


def test_preflight_names_what_is_wrong_with_a_node(make_mount, file_bucket: Bucket, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks before a cluster's query, on real mounts of this node: the driver's of its own
    volume, and the probe each executor runs where its node has no mount at the checkpoint's
    path, another volume there, or its Spark local dir off the volume."""
    from fusestate.spark.config import SparkSetupError, state_conf
    from fusestate.spark.preflight import _probe_factory, check_shared_checkpoint, executor_problem

    m = make_mount(file_bucket).mount()
    layout = state_conf(m.path / "job")
    assert layout.checkpoint_dir is not None
    with pytest.raises(SparkSetupError, match=r"a volume only this node can mount \(metadata engine sqlite\)"):
        check_shared_checkpoint(layout, m.status())
    marker = layout.checkpoint_dir.parent / ".fusestate-probe-test"
    marker.write_text("written by the driver\n")
    monkeypatch.setenv("SPARK_LOCAL_IP", "node7")
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(layout.local_dir))

    def problem(root: Path) -> Optional[str]:
        """The verdict on a node that has ``root`` where the driver has its mount."""
        probe = _probe_factory(str(root / layout.checkpoint_dir.relative_to(m.path)),
                               str(root / marker.relative_to(m.path)))
        return executor_problem(probe(0), layout.checkpoint_uri)

    assert problem(m.path) is None  # the driver's volume
    plain = tmp_path / "plain"
    (plain / layout.checkpoint_dir.relative_to(m.path)).mkdir(parents=True)
    assert "the executor on node7 has no fusestate mount holding the checkpoint" in problem(plain)
    (tmp_path / "other-bucket").mkdir()
    other = make_mount(Bucket("file", f"file://{tmp_path / 'other-bucket'}"), name="other", cache="other-cache")
    other.mount()
    (other.path / layout.checkpoint_dir.relative_to(m.path)).mkdir(parents=True)
    assert f"the executor on node7 mounts another volume at {other.path}" in problem(other.path)
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path))
    assert f"the executor on node7 has its Spark local dir {tmp_path} on" in problem(m.path)


def test_driver_batches_are_read_from_its_log_as_they_come(tmp_path: Path) -> None:
    """``fusestate spark-cluster`` shows the driver's batches from its node's log: each once,
    whole lines only, among the node's own lines."""
    log = tmp_path / "node.log"
    batches = DriverBatches(log)
    assert batches.new() == []  # the node has not started yet
    log.write_text('node driver1: mounted\n{"event": "batch", "batch": 0}\n{"event": "bat')
    assert batches.new() == [{"event": "batch", "batch": 0}]
    with open(log, "a") as f:
        f.write('ch", "batch": 1}\n{"event": "report", "batches": []}\n')
    assert batches.new() == [{"event": "batch", "batch": 1}]
    assert batches.new() == []


def test_cluster_summary_shows_what_the_nodes_did() -> None:
    """The summary shows what the product did across nodes: state files linked, where a lost
    node's state stores went and what that fetched, a killed daemon's node coming back, and
    each node's bucket traffic; then where the detail is."""
    mib = 2**20

    def node(up: int, down: int, fill: int = 0, asked: int = 0) -> dict:
        return {"links": 0, "uploaded_bytes": up * mib, "fetched_bytes": down * mib, "page_fill_bytes": fill * mib,
                "asked_fill_bytes": asked * mib, "daemons": 1}

    nodes = {"driver1": node(0, 0), "worker1": node(12, 3, 2, 1), "worker2": node(10, 1)}
    lost = {"kind": "lose-node", "node": "worker2", "after_batch": 0, "injected": True, "back_after_s": None,
            "nodes_before": {"worker1": node(4, 1, 0), "worker2": node(5, 1)}}
    report = {"summary": {"batches": 2, "rows": 2000, "records_per_second": 800.0, "batch_ms_median": 1200,
                          "rocksdb_files_copied": 40, "rocksdb_bytes_copied": 12 * mib},
              "batches": [{"batch": 0, "state_commit_ms": 300, "rocksdb": {"rocksdbNumLoadedFromDfs": 4}},
                          {"batch": 1, "state_commit_ms": 500, "rocksdb": {"rocksdbNumLoadedFromDfs": 3}}],
              "cluster": {"lost_worker": "worker2", "lost_after_batch": 0, "faults": [lost], "nodes": nodes},
              "report_file": "/out/report.json", "spark_log": "/out/spark.log"}
    lines = summary_lines(report)
    assert lines[0] == "== cluster summary"
    assert "state files   40 linked by the shim on loads and commits (12.0 MiB that no node copied)" in lines
    assert ("lost node     worker2 after batch 0: its partitions moved to the remaining workers; after it 3 state "
            "stores loaded from the checkpoint by links; worker1 fetched 2.0 MiB from the bucket and filled 2.0 MiB "
            "into the page cache, 1.0 MiB of the lost stores' files asked for at the loss") in lines
    assert ("bucket        22.0 MiB uploaded, 4.0 MiB fetched (driver1 0.0 MiB up, 0.0 MiB down, worker1 12.0 MiB up, "
            "3.0 MiB down, worker2 10.0 MiB up, 1.0 MiB down)") in lines
    assert lines[-2:] == ["report        /out/report.json (every batch's metrics)", "Spark's log   /out/spark.log"]
    # A worker's daemon killed alone: its node comes back; the driver's: the query resumes.
    killed = dict(lost, kind="kill-daemon", back_after_s=9.5)
    report["cluster"] = {"lost_worker": None, "faults": [killed], "nodes": nodes}
    (row,) = [ln for ln in summary_lines(report) if ln.startswith("killed daemon")]
    assert row.startswith("killed daemon  worker2's after batch 0: its executors exited at once; after it 3 state "
                          "stores loaded from the checkpoint by links; worker1 fetched")
    assert row.endswith("; the node served again 9.5 s later")
    report["cluster"]["faults"] = [dict(killed, node="driver1", back_after_s=20.0)]
    assert ("killed daemon  driver1's after batch 0: the query stopped, naming the mount; the query resumed from its "
            "checkpoint 20.0 s later") in summary_lines(report)
    # None linked, since the commits wrote changelogs: the row says so, not just "0".
    changelog = dict(report, summary=dict(report["summary"], rocksdb_files_copied=0), state_store_conf={
        "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
        "spark.sql.streaming.stateStore.minDeltasForSnapshot": "10"})
    assert "state files    0 linked by the shim on loads and commits (changelog checkpointing: state files " \
           "reach the checkpoint with a snapshot, every 10 versions)" in summary_lines(changelog)


def test_a_restart_row_says_where_the_stores_started_and_what_that_fetched(tmp_path: Path) -> None:
    """--restart-after: the summary's restart row, from the run's record and the line the shim's
    StoreAffinity writes to the new driver's log (the last such line: the query's last start)."""
    log = tmp_path / "driver2.log"
    log.write_text("x\nfusestate: 3 of 8 state stores of query 1f-2e start on a node that holds them (2 of 2 "
                   "executors answered in 250 ms)\nfusestate: 7 of 8 state stores of query 1f-2e start on a node "
                   "that holds them (2 of 2 executors answered in 260 ms)\n")
    assert placed_stores(log) == (7, 8)
    assert placed_stores(tmp_path / "none.log") is None
    restart = {"after_batch": 3, "first_batch_s": 21.04, "fetched_before_first_batch": {"worker1": 2**20,
                                                                                        "worker2": 0},
               "stores_placed": 7, "stores": 8}
    report = {"summary": {"batches": 1, "rows": 10, "records_per_second": 1.0, "batch_ms_median": 10,
                          "rocksdb_files_copied": 1, "rocksdb_bytes_copied": 0},
              "batches": [{"batch": 4, "state_commit_ms": 3, "rocksdb": {}}],
              "cluster": {"faults": [], "nodes": {}, "restart": restart}}
    assert ("restart       after batch 3 on a new driver, the same workers: its first batch done 21.0 s later; 7 of "
            "8 state stores started on a node that held them; fetched before it: 1.0 MiB (worker1 1.0 MiB, worker2 "
            "0.0 MiB)") in summary_lines(report)
    # The restart needs a batch after it.
    import argparse

    from fusestate.spark.cluster import ClusterError, planned_faults
    with pytest.raises(ClusterError, match="--restart-after 7: the batches are 0 to 7"):
        planned_faults(argparse.Namespace(restart_after=7, batches=8))


def test_traffic_adds_up_a_restarted_daemon_to_the_dead_one() -> None:
    """A node's numbers over a run: its first daemon's growth since the run began, plus all of
    every daemon that replaced it (a daemon's counters start at zero)."""
    from fusestate.spark.cluster import Traffic

    class Fake:
        def __init__(self, name: str) -> None:
            self.name, self.answer = name, None

        def status(self) -> dict:
            if self.answer is None:
                raise OSError("no daemon answers")
            return self.answer

    def status(pid: int, up: int, links: int) -> dict:
        return {"pid": pid, "writeback": {"uploaded_bytes": up}, "remote": {"bytes_in": 0},
                "page_fill": {"bytes": 0}, "fuse": {"operation_counts": {"link": links}}}

    node = Fake("worker2")
    traffic = Traffic()
    node.answer = status(7, 100, 1)
    traffic.sample([node])  # the run begins
    node.answer = status(7, 250, 5)
    traffic.sample([node])  # just before its daemon is killed
    node.answer = None
    traffic.sample([node])  # dead: nothing to add
    node.answer = status(9, 40, 2)  # the new daemon, counting from its own start
    traffic.sample([node])
    assert traffic.totals() == {"worker2": {"links": 4 + 2, "uploaded_bytes": 150 + 40, "fetched_bytes": 0,
                                            "page_fill_bytes": 0, "asked_fill_bytes": 0, "daemons": 2}}


def test_a_node_holds_up_no_unmount_of_the_machine(make_mount, file_bucket: Bucket, tmp_path: Path) -> None:
    """A node's mount namespace starts with a copy of every mount of the machine; it drops
    its copies of FUSE mounts, so a mount made outside unmounts at once while the node runs."""
    outside = make_mount(file_bucket).mount()
    (outside.path / "f").write_bytes(b"x")
    ready = tmp_path / "ready"
    node = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--pid", "--mount-proc",
                             "--kill-child", "--", sys.executable, "-m", "fusestate.spark.node", "--name", "n",
                             "--mountpoint", str(tmp_path / "node-mnt"), "--local-dir", str(tmp_path / "local"),
                             "--ready", str(ready), "--command", "sleep", "120"], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.read_text().strip() == "ok"
        started = time.monotonic()
        outside.umount()  # waits for the daemon to end: held up while any copy of the mount lives
        assert time.monotonic() - started < 30
    finally:
        node.kill()
        node.wait(timeout=30)


def test_a_stopped_node_ends_its_metadata_session(file_bucket: Bucket, pg_url: str, tmp_path: Path) -> None:
    """A node stopped cleanly (SIGTERM) unmounts and waits for its daemon to end its session:
    none is left in the database for the other nodes to clean up after a timeout."""
    import psycopg

    ready = tmp_path / "ready"
    node = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--pid", "--mount-proc",
                             "--kill-child", "--", sys.executable, "-m", "fusestate.spark.node", "--name", "n",
                             "--mountpoint", str(tmp_path / "node-mnt"), "--local-dir", str(tmp_path / "local"),
                             "--ready", str(ready), "--mount", file_bucket.url, "--cache-dir", str(tmp_path / "cache"),
                             "--meta", pg_url, "--metrics-addr", "off", "--command", "sleep", "120"],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.read_text().strip() == "ok"
        with psycopg.connect(pg_url) as db:
            assert db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] == 1
        first = int(Path(f"/proc/{node.pid}/task/{node.pid}/children").read_text().split()[0])
        os.kill(first, signal.SIGTERM)  # the node's own process: how the harness stops a node
        node.wait(timeout=90)
        with psycopg.connect(pg_url) as db:
            assert db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] == 0
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(timeout=30)
