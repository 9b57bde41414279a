"""A fresh-node restart of a fusestate+shim Spark state on a moto S3 bucket (and on ``file://``).

``spark_bench.py`` uses ``file://`` buckets, where a cold read costs well under a millisecond.
Here the same pipeline builds its state on a bucket of a moto S3 server (Python, on the
same cores) or on a ``file://`` bucket, the daemon is killed, the cache dir wiped, the
page cache dropped, and the volume is mounted again with ``--takeover`` plus the restart
mount options given, to restart the query into a 5,000-event batch. One JSON line per
bucket kind on stdout.

    .venv/bin/python bench/spark_restart_s3.py --keys 500000 --batches 5 --kinds s3,file \\
        -- --prefetch off --whole-blocks never
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.spark_bench import drop_page_cache, fs, lose_node, pipeline, status, unmount  # noqa: E402
from bench.systems import Moto  # noqa: E402
from fusestate.spark.config import SHUFFLE_SCRATCH  # noqa: E402

FLAGS = ["--use-shim", "--no-changelog", "--state-compression", "none"]


def restart_once(kind: str, work: Path, moto: Moto, args: argparse.Namespace) -> dict:
    d = work / kind
    mnt, cache = d / "mnt", d / "cache"
    mnt.mkdir(parents=True)
    if kind == "s3":
        url, more = f"s3://{moto.create_bucket('spark')}/vol", ["--endpoint-url", moto.endpoint]
    else:
        (d / "bucket").mkdir()
        url, more = f"file://{d / 'bucket'}", []
    opts = ["--cache-dir", str(cache), "--cache-size", "20G", "--metrics-addr", "off", "--scratch", SHUFFLE_SCRATCH, *more]
    common = ["--keys", str(args.keys), "--payload-bytes", str(args.payload_bytes), "--partitions", "4",
              "--driver-memory", "2g", "--events-per-batch", str(args.events_per_batch), *FLAGS]
    fs("mount", url, str(mnt), *opts)
    t = time.time()
    first = pipeline(f"{kind} first run", mnt / "job", d / "out", work / "input", args.batches, common)
    build_s = time.time() - t
    lose_node(mnt, cache)
    drop_page_cache()
    t = time.time()
    fs("mount", url, str(mnt), *opts, "--takeover", *args.restart_options)
    mount_s = time.time() - t
    try:
        again = pipeline(f"{kind} restart", mnt / "job", d / "out", work / "input", args.batches + 1, common,
                         "--last-batch-events", "5000")
        st = status(mnt)
    finally:
        unmount(mnt)
        shutil.rmtree(d, ignore_errors=True)
    b = again["batches"][0]
    return {"bucket": kind, "restart_mount_options": args.restart_options, "keys": args.keys,
            "state_gb": args.keys * args.payload_bytes / 1e9, "build_s": round(build_s, 1),
            "records_per_s": first["summary"]["records_per_second"], "fresh_mount_s": round(mount_s, 2),
            "restart_s": again["first_batch_done_s"], "jvm_s": again["session_start_s"],
            "first_batch_ms": b["duration_ms"], "load_ms": b["rocksdb"].get("rocksdbLoadLatencyMs"),
            "state_commit_ms": b["state_commit_ms"], "cache_misses": b["rocksdb"].get("rocksdbReadBlockCacheMissCount"),
            "fetched_bytes": st["remote"]["bytes_in"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=500_000)
    p.add_argument("--payload-bytes", type=int, default=4096)
    p.add_argument("--events-per-batch", type=int, default=125_000)
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--kinds", default="s3,file", help="bucket kinds, in order: s3 (moto), file")
    p.add_argument("restart_options", nargs="*", help="'fusestate mount' options for the restart's mount, after --")
    args = p.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    work = Path(tempfile.mkdtemp(prefix="spark-restart-s3-", dir="/var/tmp"))
    try:
        with Moto(work / "moto") as moto:
            for kind in args.kinds.split(","):
                print(json.dumps(restart_once(kind, work, moto, args)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
