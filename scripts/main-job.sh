#!/usr/bin/env bash
# The main job: mount the embedded default bucket, run a RocksDB state workload and the
# PySpark state pipeline (RocksDB state store, fusestate:// checkpoint) on it.
#   BUCKET_URL   bucket to mount (default: a file:// bucket under /var/lib/fusestate)
#   MOUNTPOINT   where to mount it (default /mnt/fusestate)
#   NUM          RocksDB keys to write (default 1000000)
#   CLUSTER=1    instead: the pipeline on a Spark cluster of two worker nodes and a driver
#                node, each with its own fusestate daemon on one shared volume (a new
#                file:// bucket and a PostgreSQL server the job starts); one worker node is
#                lost after batch 2 and the query goes on without it
# The pipeline prints a row per batch and ends with a summary; its report (every batch's
# metrics, as JSON) and Spark's log go to the output dir the summary names.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

if [ "${CLUSTER:-0}" = 1 ]; then
    CLUSTER_BUCKET=/var/lib/fusestate/cluster-bucket
    CLUSTER_OUTPUT=/tmp/fusestate-main-job-cluster-output
    rm -rf "$CLUSTER_BUCKET" "$CLUSTER_OUTPUT" "$CLUSTER_OUTPUT.input" && mkdir -p "$CLUSTER_BUCKET"
    exec .venv/bin/fusestate spark-cluster --bucket "file://$CLUSTER_BUCKET" --output "$CLUSTER_OUTPUT" \
        --workers 2 --batches "${BATCHES:-6}" --keys "${KEYS:-20000}" --lose-worker-after 2
fi

BUCKET_DIR=/var/lib/fusestate/default-bucket
BUCKET_URL=${BUCKET_URL:-file://$BUCKET_DIR}
MOUNTPOINT=${MOUNTPOINT:-/mnt/fusestate}
CACHE_DIR=${CACHE_DIR:-/var/cache/fusestate/default}
NUM=${NUM:-1000000}
FS=.venv/bin/fusestate

mkdir -p "$BUCKET_DIR" "$MOUNTPOINT"
$FS mount "$BUCKET_URL" "$MOUNTPOINT" --cache-dir "$CACHE_DIR" --cache-size 20G --scratch 'blockmgr-*' --scratch 'spark-*-*-*-*-*'
unmount() {
    # After an interrupted run, the Spark JVM may still hold files on the mount for a moment.
    for _ in $(seq 10); do
        $FS umount "$MOUNTPOINT" 2>/dev/null && return 0
        sleep 1
    done
    $FS umount "$MOUNTPOINT" || fusermount3 -u -z "$MOUNTPOINT"
}
trap unmount EXIT

DB="$MOUNTPOINT/rocksdb-state"
rm -rf "$DB" "$MOUNTPOINT/checkpoint"
echo "== RocksDB state workload on $MOUNTPOINT ($BUCKET_URL)"
db_bench --db="$DB" --benchmarks=fillrandom,readrandom,overwrite --num="$NUM" \
    --value_size=256 --disable_wal=1 --compression_type=none 2>&1 | grep -E "^(fillrandom|readrandom|overwrite) "
echo "== checkpoint (hard links: metadata only)"
ldb --db="$DB" checkpoint --checkpoint_dir="$MOUNTPOINT/checkpoint"
ls -l "$MOUNTPOINT/checkpoint" | head -5
echo "== fusestate status"
$FS status "$MOUNTPOINT"
# Changelog checkpointing off: every commit is a snapshot whose state files the shim links.
echo "== PySpark state pipeline (RocksDB state store on the mount, hard-link commits)"
rm -rf "$MOUNTPOINT/spark-job" /tmp/fusestate-main-job-output /tmp/fusestate-main-job-output.input
$FS spark-pipeline --state-dir "$MOUNTPOINT/spark-job" --output /tmp/fusestate-main-job-output \
    --batches "${BATCHES:-6}" --keys "${KEYS:-20000}" --use-shim
