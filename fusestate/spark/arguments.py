"""The command lines of ``fusestate spark-pipeline`` and ``fusestate spark-cluster``.

Kept apart from the jobs themselves so that building the ``fusestate`` parser loads
neither of them: only the command that runs imports its job.
"""

from __future__ import annotations

import argparse

DEFAULT_MOUNTPOINT = "/mnt/state"
KEY_SKEW_HELP = ("once every key has state, events pick keys from a Zipf distribution of this exponent, "
                 "e.g. 1.1: a few hot keys take most updates, as in real streams (default %(default)s: every key "
                 "updated in turn)")


def pipeline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", required=True,
                   help="directory for spark.local.dir and the default checkpoint (on a fusestate mount, unless --local)")
    p.add_argument("--output", required=True,
                   help="directory of the per-batch output (batch-<id>/part-*.csv), the report and Spark's log")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint directory: a path, file:// or fusestate:// (default <state-dir>/checkpoints/<query>); "
                        "with --local also s3a://bucket/prefix, through Hadoop's S3A connector")
    p.add_argument("--input", default=None, help="input files (default <output>.input); generated when missing")
    p.add_argument("--batches", type=int, default=8, help="input files, one per micro-batch (default %(default)s)")
    p.add_argument("--keys", type=int, default=10_000, help="distinct keys in the aggregation state (default %(default)s)")
    p.add_argument("--key-skew", type=float, default=0.0, metavar="S", help=KEY_SKEW_HELP)
    p.add_argument("--payload-bytes", type=int, default=256, help="payload kept in state per key (default %(default)s)")
    p.add_argument("--events-per-batch", type=int, default=None, help="events per file (default: keys/2, at least 1000)")
    p.add_argument("--last-batch-events", type=int, default=None,
                   help="events in the last file only (e.g. a small batch after a restart)")
    p.add_argument("--state-compression", default=None,
                   help="RocksDB compression of the state store (Spark's default: lz4; 'none' keeps "
                        "the on-disk state as large as the raw state)")
    p.add_argument("--block-size-kb", type=int, default=None,
                   help="RocksDB block size of the state store (default: 64 on a fusestate mount, Spark's 4 otherwise)")
    p.add_argument("--partitions", type=int, default=4, help="shuffle partitions = state stores per operator (default %(default)s)")
    p.add_argument("--local", action="store_true", help="baseline: state on local disk, no fusestate mount required")
    p.add_argument("--s3a-endpoint", default=None, metavar="URL",
                   help="with --local and an s3a:// --checkpoint: the S3-compatible endpoint (default: AWS); "
                        "credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    p.add_argument("--s3a-region", default=None, help="with an s3a:// checkpoint: the endpoint's region")
    p.add_argument("--s3a-jars", default=None, metavar="JAR[,JAR...]",
                   help="with an s3a:// checkpoint: the S3A connector's jars on this machine (hadoop-aws, the AWS "
                        "SDK bundle; default: Spark fetches hadoop-aws matching its Hadoop from Maven Central)")
    p.add_argument("--print-conf", action="store_true",
                   help="print the Spark settings this command would use, as spark-defaults.conf lines, and exit "
                        "(nothing is created and Spark does not start)")
    p.add_argument("--use-shim", action="store_true", help="checkpoint via the fusestate:// Hadoop file system (hard-link commits)")
    p.add_argument("--shim-jar", default=None,
                   help="the fusestate:// shim's jar, if built elsewhere (default: the one installed with fusestate)")
    p.add_argument("--changelog", action=argparse.BooleanOptionalAction, default=None,
                   help="RocksDB changelog checkpointing (default: off with --use-shim, where every commit is a "
                        "snapshot the shim links and a restart replays nothing; on without it, where a snapshot "
                        "is a copy)")
    p.add_argument("--min-deltas-for-snapshot", type=int, default=None,
                   help="with changelog checkpointing: a snapshot every this many versions (default 1 with "
                        "--use-shim, where a snapshot costs links, else 10)")
    p.add_argument("--snapshot-fill", choices=("on", "off"), default="on",
                   help="on a mount, a restart asks the daemon to put each state store's latest snapshot into "
                        "the page cache while the JVM starts (default %(default)s)")
    p.add_argument("--driver-memory", default="1g", help="JVM heap (default %(default)s)")
    p.add_argument("--master", default="local[2]",
                   help="local[N], or a cluster's spark://HOST:PORT (default %(default)s): then every executor's "
                        "node must mount the same shared volume at the same path, which is checked before the query")
    p.add_argument("--expect-executors", type=int, default=1,
                   help="on a cluster: executors to wait for, and check, before the query starts (default %(default)s)")
    p.add_argument("--wait-for-remount", type=float, default=0, metavar="SECONDS",
                   help="when the query stops because this node's fusestate mount died: wait this long for the "
                        "mount to answer again (a supervisor restarting its daemon), then resume the query from "
                        "its checkpoint (default %(default)s: stop)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="another Spark setting (repeatable); it wins over the ones the state layout makes")
    report_arguments(p, "every batch's metrics and the run's numbers")


def cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="worker nodes (default %(default)s)")
    p.add_argument("--bucket", default=None,
                   help="the shared volume's bucket URL (default: a new file:// bucket under --root)")
    p.add_argument("--meta", default=None,
                   help="the shared volume's PostgreSQL URL (default: start a PostgreSQL server under --root)")
    p.add_argument("--root", default=None,
                   help="where nodes keep their caches, runtime dirs and logs (default: a new temporary dir)")
    p.add_argument("--mountpoint", default=DEFAULT_MOUNTPOINT, help="every node's mountpoint (default %(default)s)")
    p.add_argument("--output", default=None,
                   help="the pipeline's output, its report and the driver's Spark log (default <root>/output when "
                        "--root or --keep is given, else a new directory that stays after the run)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--keys", type=int, default=20_000)
    p.add_argument("--key-skew", type=float, default=0.0, metavar="S", help=KEY_SKEW_HELP)
    p.add_argument("--partitions", type=int, default=4, help="state stores per operator (default %(default)s)")
    p.add_argument("--changelog", action="store_true",
                   help="RocksDB changelog checkpointing on, a snapshot every 10 versions (default: off, Spark's "
                        "default: every commit is a snapshot, which the shim links into the checkpoint)")
    p.add_argument("--lose-worker-after", type=int, default=None, metavar="BATCH",
                   help="kill the last worker node (its JVMs and fusestate daemon) and wipe its cache once "
                        "this batch has completed; the query goes on without it")
    p.add_argument("--kill-daemon-after", type=int, default=None, metavar="BATCH",
                   help="SIGKILL one node's fusestate daemon alone once this batch has completed; the node "
                        "stays: a worker's leaves the cluster at once and rejoins once mounted again, the "
                        "driver's resumes its query from the checkpoint once mounted again")
    p.add_argument("--kill-daemon-of", default=None, metavar="NODE",
                   help="whose daemon --kill-daemon-after kills: a worker (worker1, worker2, ...; default the "
                        "last) or the driver (driver)")
    p.add_argument("--restart-after", type=int, default=None, metavar="BATCH",
                   help="stop the query once this batch has completed (its driver ends) and run the rest on a "
                        "new driver node, the workers and their caches kept: a job restarted on the nodes it "
                        "ran on; the summary says what the restart's first batch fetched")
    p.add_argument("--meta-ha", action="store_true",
                   help="keep the volume's metadata in a highly available PostgreSQL the run starts (Patroni, three "
                        "etcd members, a primary and a synchronous standby on 127.0.0.x) instead of one server")
    p.add_argument("--fail-over-after", type=int, default=None, metavar="BATCH",
                   help="with --meta-ha: lose the database's primary (its Patroni and server, SIGKILL) once this "
                        "batch has completed; the standby is promoted, the nodes follow it, and the old primary "
                        "rejoins as its standby")
    p.add_argument("--keep", action="store_true", help="keep --root (logs, caches) after the run")
    report_arguments(p, "the pipeline's report, with the cluster's workers and lost node")


def report_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """Where the machine-readable detail goes: a report file always, stdout with --json."""
    p.add_argument("--report", default=None, metavar="FILE",
                   help=f"the report, as JSON: {what} (default <output>/report.json)")
    p.add_argument("--json", action="store_true",
                   help="for scripts: one JSON line per batch, then the report as the last line, instead of "
                        "progress rows and a summary")
