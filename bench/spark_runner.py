"""The Spark scenarios' runner: the state pipeline on local disk and on fusestate, one setup after another.

``bench/run --scenario spark`` and ``--scenario spark-restart`` run this as a subprocess
(``python -m bench.spark_runner``), one call per repetition and state size, so a hung JVM
or mount dies with its process group. Three setups run the same pipeline
(fusestate/spark/pipeline.py) over the same input:

- ``local``: state and checkpoint on local disk, changelog checkpointing on (the baseline);
- ``fusestate``: state and ``file://`` checkpoint on a fusestate mount (file:// bucket);
- ``fusestate+shim``: the same with the ``fusestate://`` checkpoint (hard-link commits and loads);
- with ``--s3-endpoint`` (the shaped S3 endpoint of ``bench/endpoints.py``):
  ``fusestate+shim@s3``, the same on a bucket of that endpoint, and the honest baseline for an
  object store, ``local+download`` (``-parallel``): state on local disk, its checkpoint in a
  bucket of the endpoint, downloaded by the fresh node before the query restarts, file by file
  as Spark's state store copies them (or all at once, a generous bound); and ``s3a``, what most
  jobs run today: state on local disk, the checkpoint at ``s3a://`` in a bucket of the endpoint
  through Hadoop's S3A connector (bench/s3a.py fetches it), so Spark itself uploads every commit
  and downloads what a restarted query loads.

For each: records/s and state commit latency over ``--batches`` micro-batches. Then the restart:
for fusestate the daemon is killed and its cache dir wiped (a fresh node, mounted with
``--takeover``), and the query restarts from its checkpoint for one more micro-batch: the time
from the restart to the end of that batch, the state store load and the bytes the fresh node
fetched. Local disk restarts from its local checkpoint (no network at all: a lower bound);
``s3a`` restarts with its local state dir removed (a fresh node) and loads through S3A.
Before every restart the page cache is dropped (as root), since a fresh node starts with none.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

from bench.common import FUSESTATE, RESULTS_DIR
from bench.read_breakdown import breakdown, state_files
from bench.systems import drop_all_caches
from fusestate.spark.config import CHANGELOG_KEY, scratch_options
from fusestate.spark.pipeline import SPARK_LOG_NAME, root_cause

# With the shim a state store's load links the files its RocksDB reads, and the daemon fetches
# exactly those (page fill); cache warming would fetch the checkpoint's older versions and
# changelogs first (docs/spark.md).
SHIM_MOUNT_OPTIONS = ("--prefetch", "off")
SHAPED_SUFFIX = "@s3"  # a fusestate setup on --s3-endpoint's bucket instead of a file:// one
S3A = "s3a"           # local disk, the checkpoint on --s3-endpoint through Hadoop's S3A connector


def fs(*args: str) -> str:
    return subprocess.run([FUSESTATE, *args], check=True, capture_output=True, text=True).stdout


def pipeline(label: str, state_dir: Path, output: Path, input_dir: Path, batches: int, common: list[str],
             *extra: str) -> dict:
    t0 = time.time()
    proc = subprocess.run([FUSESTATE, "spark-pipeline", "--state-dir", str(state_dir), "--output", str(output),
                           "--input", str(input_dir), "--batches", str(batches), "--json", *common, *extra],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        # The work dir goes away with the run: keep the whole output, and Spark's log from the
        # output dir, where results are kept.
        log = RESULTS_DIR / f"spark-failed-{time.strftime('%Y%m%d-%H%M%S')}-{label.replace('+', '-').replace(' ', '-')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        spark_log = output / SPARK_LOG_NAME
        log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr + "\n--- Spark's log ---\n"
                       + (spark_log.read_text(errors="replace") if spark_log.exists() else ""))
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"{label}: pipeline exited {proc.returncode}: "
                         f"{(root_cause(proc.stderr) or 'no output')[:300]} (output in {log})")
    report = next(json.loads(line) for line in reversed(proc.stdout.splitlines()) if line.startswith('{"event": "report"'))
    report["wall_s"] = round(time.time() - t0, 2)
    return report


def status(mnt: Path) -> dict:
    """The daemon's numbers, in-process over its control socket (no CLI process per call)."""
    from fusestate.daemon.control import fetch_status

    return fetch_status(str(mnt))


# What a restart's fetches are made of, sampled once a second while it runs (status --json paths).
FETCH_PARTS = {"bucket_bytes": ("remote", "bytes_in"), "warmup_bytes": ("warmup", "fetched_bytes"),
               "page_fill_bytes": ("page_fill", "bytes"), "page_fill_pending": ("page_fill", "pending_bytes"),
               "whole_fetches": ("remote", "full_fetches"), "range_reads": ("remote", "range_reads"),
               "prefetches": ("remote", "prefetches"), "page_fill_files": ("page_fill", "files"),
               "page_fill_skipped": ("page_fill", "skipped"), "fuse_bytes_read": ("fuse", "bytes_read")}


def fetch_parts(st: dict) -> dict:
    ops = st.get("fuse", {}).get("operation_counts", {})
    return {**{name: st.get(a, {}).get(b, 0) for name, (a, b) in FETCH_PARTS.items()},
            "fuse_reads": ops.get("read", 0), "fuse_links": ops.get("link", 0)}


SAMPLE_SECONDS = 0.5


def fetched_by(timeline: list[dict], t: float) -> Optional[int]:
    """Bytes fetched from the bucket by ``t`` seconds into a timeline (the last sample at or
    before it: at most ``SAMPLE_SECONDS`` early)."""
    before = [s["bucket_bytes"] for s in timeline if s["t"] <= t]
    return before[-1] if before else None


class FetchSampler:
    """The mount's fetch counters twice a second, from its start to its end, in a thread."""

    def __init__(self, mnt: Path) -> None:
        import threading

        self.mnt, self.samples, self._stop = mnt, [], threading.Event()
        self.t0 = time.time()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            try:
                self.samples.append({"t": round(time.time() - self.t0, 2), **fetch_parts(status(self.mnt))})
            except Exception:  # noqa: BLE001 - a missed sample is no failure
                pass

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.samples


def lose_node(mnt: Path, cache: Path, *, kill: bool = True, wipe: bool = True) -> None:
    """What a lost node leaves: the daemon gone (SIGKILLed unless ``kill`` is off), its mount
    detached, its cache dir wiped (unless ``wipe`` is off: the same node, back); the bucket
    holds what the daemon had shipped."""
    stop_daemon(status(mnt)["pid"], mnt, kill=kill)
    if wipe:
        shutil.rmtree(cache, ignore_errors=True)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def steady(report: dict) -> dict:
    """Numbers over the batches after the first (the first one pays JVM warm-up)."""
    bs = report["batches"][1:] or report["batches"]
    rows = sum(b["rows"] for b in bs)
    secs = sum(b["duration_ms"] for b in bs) / 1000
    commits = sorted(b["state_commit_ms"] for b in bs)
    return {"records_per_second": round(rows / secs, 1) if secs else None,
            "batch_ms_median": sorted(b["duration_ms"] for b in bs)[len(bs) // 2],
            "state_commit_ms_median": commits[len(commits) // 2], "state_commit_ms_max": commits[-1],
            "rocksdb_bytes_copied": sum(b["rocksdb"].get("rocksdbBytesCopied", 0) for b in report["batches"]),
            "batches": [{k: b.get(k) for k in ("batch", "rows", "duration_ms", "state_commit_ms", "operators")}
                        for b in report["batches"]]}


def mount_bucket(url: str, mnt: Path, cache: Path, *options: str, scratch: bool = True) -> None:
    """Spark's local dirs stay on the node, as deployed, unless ``scratch`` is off."""
    fs("mount", url, str(mnt), "--cache-dir", str(cache),
       *(scratch_options() if scratch else []), *options)


def mount(url: str, mnt: Path, cache: Path, args, *more: str, shim: bool = False) -> None:
    endpoint = ["--endpoint-url", args.s3_endpoint] if url.startswith("s3://") else []
    mount_bucket(url, mnt, cache, "--cache-size", args.cache_size, "--metrics-addr", "off",
                 "--durability", args.durability, *endpoint, *(SHIM_MOUNT_OPTIONS if shim else ()),
                 *shlex.split(args.mount_options), *more,
                 scratch=not args.no_scratch)


def s3(args):
    """The fsspec file system of ``--s3-endpoint`` (moto's test credentials)."""
    import fsspec

    return fsspec.filesystem("s3", key="testing", secret="testing", skip_instance_cache=True,
                             client_kwargs={"endpoint_url": args.s3_endpoint, "region_name": "us-east-1"})


BUCKETS: list[str] = []  # made by this run on --s3-endpoint, emptied after each setup


def empty_buckets(args) -> None:
    """The endpoint keeps every object until the scenario ends (moto spools them to its disk): at
    8 GB of state a setup leaves tens of GB (every version's SSTs, changelogs), so go."""
    while BUCKETS:
        bucket = BUCKETS.pop()
        try:
            s3(args).rm(bucket, recursive=True)
        except Exception as exc:  # noqa: BLE001 - a bucket left behind costs disk, not the result
            print(f"could not empty bucket {bucket}: {exc}", file=sys.stderr)


def new_bucket(args, name: str) -> str:
    import boto3

    bucket = f"{name.replace('+', '-')}-{uuid.uuid4().hex[:8]}"
    BUCKETS.append(bucket)
    boto3.client("s3", endpoint_url=args.s3_endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


def download(args, remote: str, local: Path, parallel: bool) -> float:
    """What a fresh node does before Spark can load a checkpoint from an object store: fetch
    it. One file after another, as the RocksDB state store copies its files; or all at once
    (fsspec's concurrent get), a generous bound. Seconds taken."""
    fs3 = s3(args)
    t = time.time()
    if parallel:
        fs3.get(remote + "/", str(local) + "/", recursive=True)
    else:
        for path in sorted(fs3.find(remote)):
            target = local / os.path.relpath(path, remote)
            target.parent.mkdir(parents=True, exist_ok=True)
            fs3.get_file(path, str(target))
    return round(time.time() - t, 2)


def stop_daemon(pid: int, mnt: Path, *, kill: bool = True) -> None:
    """Lose the node (SIGKILL: nothing is flushed on the way out) or unmount cleanly; wait
    for the daemon to exit, then detach whatever mount it left."""
    fs("umount", str(mnt)) if not kill else os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
            time.sleep(0.1)
        except ProcessLookupError:
            break
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def unmount(mnt: Path) -> None:
    subprocess.run([FUSESTATE, "umount", str(mnt)], capture_output=True)
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


# A setup's variants (``fusestate+shim@s3:whole``): the pipeline's own options, and the restart's
# mount options. ``trace`` restarts with no page fill at all and records every read
# (bench/read_breakdown.py): what the restart reads, by purpose.
VARIANTS: dict[str, tuple[list[str], list[str]]] = {
    "": ([], []),
    "no-snapshot-fill": (["--snapshot-fill", "off"], []),
    "whole": ([], ["--prefetch-links", "whole"]),
    "tails": ([], ["--prefetch-links", "tails"]),
    "trace": (["--snapshot-fill", "off"], ["--prefetch-links", "off"]),
    "same-node": ([], []),
    # The state store's own settings: every commit a snapshot (no changelog to replay at a load),
    # and no read of each key before its write (Spark's count of the state's rows, which a
    # replayed changelog pays one point lookup per entry for).
    "no-changelog": (["--no-changelog"], []),
    "changelog": (["--changelog"], []),
    "untracked": (["--conf", "spark.sql.streaming.stateStore.rocksdb.trackTotalNumberOfRows=false"], []),
}
TRACE = "trace"
SAME_NODE = "same-node"  # the daemon killed and mounted again over its own cache dir: the node came back


def run_setup(label: str, work: Path, input_dir: Path, args, common: list[str]) -> dict:
    """``label`` is a setup's name, optionally with a variant after a colon (``VARIANTS``):
    ``fusestate+shim@s3:whole`` restarts with today's whole-file page fill, to compare within
    one call."""
    name, _, variant = label.partition(":")
    variants = variant.split("+") if variant else []  # several at once: ``:trace+no-changelog``
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown setup variant {unknown[0]!r} (known: {', '.join(v for v in VARIANTS if v)})")
    d = work / label.replace(":", "-")
    d.mkdir()
    out = d / "out"
    local_state = name.startswith("local") or name == S3A  # the state on local disk, no mount
    extra = ["--local"] if local_state else []
    remote = None
    if name == S3A:
        from bench.s3a import connector_jars, jars_argument

        remote = f"{new_bucket(args, 'checkpoint')}/pipeline"
        extra += ["--checkpoint", f"s3a://{remote}", "--s3a-endpoint", args.s3_endpoint,
                  "--s3a-jars", jars_argument(connector_jars())]
    if name.startswith("fusestate+shim"):
        extra.append("--use-shim")
    extra += [a for v in variants for a in VARIANTS[v][0]]
    restart_mount = [a for v in variants for a in VARIANTS[v][1]]
    if TRACE in variants:
        restart_mount += ["--read-trace", str(d / "trace.jsonl")]
    if args.no_changelog and not local_state:
        extra.append("--no-changelog")
    mnt = cache = None
    if not local_state:
        mnt, cache = d / "mnt", d / "cache"
        if name.endswith(SHAPED_SUFFIX):
            url = f"s3://{new_bucket(args, 'fusestate')}/volume"
        else:
            (d / "bucket").mkdir()
            url = f"file://{d / 'bucket'}"
        mnt.mkdir()
        mount(url, mnt, cache, args, shim="+shim" in name)
    state = (mnt / "job") if mnt else d / "state"
    try:
        first = pipeline(f"{name} first run", state, out, input_dir, args.batches, common, *extra)
        result = {"first_run": {"wall_s": first["wall_s"], **steady(first),
                                "state_rows": first["summary"]["state_rows_last"]},
                  "changelog": first.get("state_store_conf", {}).get(CHANGELOG_KEY) == "true"}
        ckpt = (mnt or d / "state") / ("job" if mnt else "") / "checkpoints" / "pipeline"
        result["checkpoint_bytes"] = s3(args).du(remote) if remote else du(ckpt)
        page_cache_dropped = drop_all_caches()
        if mnt:
            st = status(mnt)
            result["first_run"]["fusestate"] = {k: st["writeback"][k] for k in ("uploaded_bytes", "uploaded_blocks")}
            result["first_run"]["fusestate"]["fuse_bytes_written"] = st["fuse"]["bytes_written"]
            # Lose the node: kill the daemon, wipe its cache, take the volume over on a "fresh node".
            lose_node(mnt, cache, kill=not args.clean_umount, wipe=SAME_NODE not in variants)
            t = time.time()
            mount(url, mnt, cache, args, "--takeover", *restart_mount, shim="+shim" in name)
            result["fresh_mount_s"] = round(time.time() - t, 2)
        download_s = 0.0
        if name == S3A:
            # A fresh node: nothing of the state on its disk; Spark's state store loads from S3A.
            shutil.rmtree(state)
        if name.startswith("local+download"):
            # The checkpoint was in an object store all along (its upload is not timed); the
            # fresh node has nothing of the state, and fetches the checkpoint before Spark starts.
            remote = f"{new_bucket(args, 'checkpoint')}/pipeline"
            s3(args).put(str(ckpt) + "/", remote + "/", recursive=True)
            shutil.rmtree(state)
            drop_all_caches()
            download_s = download(args, remote, ckpt, parallel=name.endswith("parallel"))
            result["download_s"] = download_s
        sampler = FetchSampler(mnt) if mnt else None
        t = time.time()
        restart_extra = ["--last-batch-events", str(args.restart_events)] if args.restart_events else []
        again = pipeline(f"{name} restart", state, out, input_dir, args.batches + 1, common, *extra, *restart_extra)
        b = again["batches"][0] if again["batches"] else {}
        result["restart"] = {
            "to_first_batch_done_s": round(download_s + again["first_batch_done_s"], 2)
            if again["first_batch_done_s"] else None,
            "download_s": download_s,
            "jvm_and_session_s": again["session_start_s"],
            "session_start_parts_s": again.get("session_start_parts_s"),
            "query_start_to_first_batch_done_s": round(again["first_batch_done_s"] - again["query_start_s"], 2)
            if again["first_batch_done_s"] else None,
            "first_batch_ms": b.get("duration_ms"),
            "rocksdb_load_ms": b.get("rocksdb", {}).get("rocksdbLoadLatencyMs"),
            "rocksdb_load_from_snapshot_ms": b.get("rocksdb", {}).get("rocksdbLoadFromSnapshotLatencyMs"),
            "shim": again.get("shim"),
            "snapshot_fill": again.get("snapshot_fill"),
            "page_cache_dropped": page_cache_dropped,
            "batch": b,  # the whole record: Spark's phase durations and RocksDB's commit breakdown
        }
        if mnt:
            assert sampler is not None
            result["restart"]["fetch_timeline"] = sampler.stop()
            st = status(mnt)
            result["restart"]["fetch_parts"] = fetch_parts(st)
            result["restart"]["fetched_bytes"] = st["remote"]["bytes_in"]
            result["restart"]["restored_metadata_bytes"] = st["metadata"]["restored_bytes"]
            if again["first_batch_done_s"]:
                done = again["started_at"] + again["first_batch_done_s"]
                began = done - (b.get("duration_ms") or 0) / 1000
                result["restart"]["fetched_before_first_batch_done"] = fetched_by(
                    result["restart"]["fetch_timeline"], done - sampler.t0)
                if TRACE in variants:
                    result["restart"]["breakdown"] = breakdown(d / "trace.jsonl", state_files(state), began, done)
        return result
    finally:
        if mnt:
            unmount(mnt)
        if args.s3_endpoint and not args.keep:
            empty_buckets(args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=200_000)
    p.add_argument("--key-skew", type=float, default=0.0, metavar="S",
                   help="the pipeline's --key-skew: once every key has state, Zipf(S) keys (default 0: uniform)")
    p.add_argument("--payload-bytes", type=int, default=1024)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--events-per-batch", type=int, default=None)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--driver-memory", default="2g")
    p.add_argument("--cache-size", default="20G")
    p.add_argument("--setups", default="local,fusestate,fusestate+shim",
                   help="comma-separated: local, fusestate, fusestate+shim; with --s3-endpoint also "
                        "fusestate+shim@s3 and the object-store baselines s3a (the checkpoint through Hadoop's "
                        "S3A connector), local+download and local+download-parallel; a fusestate setup may "
                        "name a variant after a colon: :no-snapshot-fill (restart with --snapshot-fill off), "
                        ":whole or :tails (restart with --prefetch-links whole or tails), :trace (no page fill, "
                        "every read recorded: the restart's breakdown by purpose), :same-node (the daemon killed "
                        "and mounted again over its own cache dir), :no-changelog or :changelog, :untracked "
                        "(Spark's row count off); several joined by +, e.g. :trace+no-changelog")
    p.add_argument("--s3-endpoint", default=None, metavar="URL",
                   help="an S3 endpoint (the shaped one) for the @s3 and +download setups")
    p.add_argument("--no-changelog", action="store_true", help="fusestate setups: changelog checkpointing off")
    p.add_argument("--restart-events", type=int, default=None,
                   help="events in the batch after the restart (default: a full batch)")
    p.add_argument("--min-deltas-for-snapshot", type=int, default=None,
                   help="with changelog checkpointing, a snapshot every this many versions, every setup "
                        "(default: the setup helper's, 1 with the shim and 10 without)")
    p.add_argument("--state-compression", default=None,
                   help="state store RocksDB compression, e.g. none (default: Spark's lz4)")
    p.add_argument("--block-size-kb", type=int, default=None,
                   help="state store RocksDB block size, every setup (default: 64 on fusestate, Spark's 4 on local disk)")
    p.add_argument("--durability", choices=["remote", "local"], default="remote",
                   help="fusestate setups: when fsync returns (default remote: in the bucket)")
    p.add_argument("--no-scratch", action="store_true",
                   help="mount without --scratch 'blockmgr-*' (shuffle files then go to the bucket too)")
    p.add_argument("--mount-options", default="", metavar="OPTIONS",
                   help="more 'fusestate mount' options for the fusestate setups, one string, "
                        "e.g. --mount-options='--whole-blocks always'")
    p.add_argument("--clean-umount", action="store_true", help="unmount cleanly instead of killing the daemon")
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir, removed)")
    p.add_argument("--keep", action="store_true",
                   help="keep each setup's state, bucket and cache under --work (default: removed once measured)")
    p.add_argument("--output", default=None, help="JSON result path (default bench/results/spark-<time>.json)")
    args = p.parse_args()
    needs_s3 = [s for s in (label.partition(":")[0] for label in args.setups.split(","))
                if s.endswith(SHAPED_SUFFIX) or s.startswith("local+download") or s == S3A]
    if needs_s3 and not args.s3_endpoint:
        p.error(f"setups {', '.join(needs_s3)} need --s3-endpoint")
    if args.s3_endpoint:
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")

    work = Path(args.work or tempfile.mkdtemp(prefix="spark-bench-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    common = ["--keys", str(args.keys), "--payload-bytes", str(args.payload_bytes), "--partitions", str(args.partitions),
              "--driver-memory", args.driver_memory]
    if args.events_per_batch:
        common += ["--events-per-batch", str(args.events_per_batch)]
    if args.key_skew:
        common += ["--key-skew", str(args.key_skew)]
    if args.state_compression:
        common += ["--state-compression", args.state_compression]
    if args.min_deltas_for_snapshot:
        common += ["--min-deltas-for-snapshot", str(args.min_deltas_for_snapshot)]
    if args.block_size_kb:
        common += ["--block-size-kb", str(args.block_size_kb)]
    input_dir = work / "input"
    results = {"params": vars(args), "raw_state_bytes": args.keys * args.payload_bytes, "setups": {}}
    try:
        for name in args.setups.split(","):
            print(f"== {name}", file=sys.stderr, flush=True)
            results["setups"][name] = run_setup(name, work, input_dir, args, common)
            print(json.dumps(results["setups"][name]), file=sys.stderr, flush=True)
            if not args.keep:  # 8 GB of state is 20-40 GB on disk per setup: one setup's at a time
                shutil.rmtree(work / name.replace(":", "-"), ignore_errors=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    path = Path(args.output) if args.output else RESULTS_DIR / f"spark-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    print(f"written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
