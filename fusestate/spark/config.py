"""Spark configuration for "keep this query's state on this fusestate mount".

One function, :func:`state_conf`, turns a directory (on a fusestate mount, or on local disk for a
baseline) into the settings a Structured Streaming query needs:

- ``spark.local.dir`` under the directory: the RocksDB state store's working directory (and
  shuffle files) live there, so RocksDB writes land in fusestate's write-back cache;
- a checkpoint location under the directory: ``fusestate:///...`` when the Hadoop shim is used
  (commits and loads become hard links inside the mount), ``file:///...`` otherwise (commits
  copy the SST files, and content addressing keeps the copy from uploading anything new);
- the RocksDB state store provider and changelog checkpointing;
- on a fusestate mount, 64 KiB RocksDB blocks instead of Spark's 4 KiB (see
  :data:`MOUNT_BLOCK_SIZE_KB`).

A checkpoint location must be visible to the driver and to every executor that may run the
query's tasks. With one fusestate volume per node that means a single-node query (local mode,
or one executor host), or every node mounting the same volume, which fusestate allows for one
writer only. See docs/spark.md.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent.parent
SHIM_DIR = ROOT / "spark" / "shim"
SHIM_JAR = SHIM_DIR / "build" / "fusestate-hadoop-shim.jar"
SHIM_SCHEME = "fusestate"
SHIM_FS_CLASS = "io.fusestate.hadoop.FusestateFileSystem"
SHIM_AFS_CLASS = "io.fusestate.hadoop.FusestateFs"
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
ROCKSDB_PREFIX = "spark.sql.streaming.stateStore.rocksdb."
# What Spark names the dirs it makes in spark.local.dir (Utils.createTempDir, DiskBlockManager).
SHUFFLE_PREFIX = "blockmgr-"
SPARK_LOCAL_PREFIXES = ("spark-", SHUFFLE_PREFIX)
# The mount option that keeps Spark's shuffle dirs on the node (never uploaded). The state
# store's working dirs are under spark-*: they must stay part of the volume, since the
# shim's checkpoint links share their SSTs.
SHUFFLE_SCRATCH = SHUFFLE_PREFIX + "*"


def shuffle_is_scratch(scratch_dirs: list[str]) -> bool:
    """Whether a mount's ``--scratch`` patterns cover the shuffle dirs Spark makes
    (``blockmgr-<uuid>``)."""
    name = SHUFFLE_PREFIX + str(uuid.UUID(int=0))
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in scratch_dirs)

# RocksDB opens every SST with POSIX_FADV_RANDOM, which turns off the kernel's readahead: a scan
# (the deduplication store's eviction pass, a compaction) then reaches the daemon as one FUSE
# request per RocksDB block. Each request costs tens of microseconds in the daemon, whatever its
# size, so on a mount 64 KiB blocks scan about 4x faster than Spark's 4 KiB (docs/spark.md has
# the numbers).
MOUNT_BLOCK_SIZE_KB = 64


def is_fusestate_mount(path: str | os.PathLike) -> Optional[str]:
    """The fusestate mountpoint holding ``path``, or None (longest prefix in /proc/self/mounts)."""
    real = os.path.realpath(path)
    best, best_type = None, None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mp = parts[1].replace("\\040", " ")
                if real == mp or mp == "/" or real.startswith(mp.rstrip("/") + "/"):
                    if best is None or len(mp) >= len(best):
                        best, best_type = mp, parts[2]
    except OSError:
        return None
    return best if best_type and best_type.startswith("fuse.fusestate") else None


def shim_jar(build: bool = True) -> Path:
    """The shim jar, built with ``spark/shim/build.sh`` when missing (and ``build``)."""
    if not SHIM_JAR.exists() and build:
        import subprocess
        import sys

        subprocess.run(["bash", str(SHIM_DIR / "build.sh")], check=True, capture_output=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    if not SHIM_JAR.exists():
        raise FileNotFoundError(f"{SHIM_JAR} is missing: run spark/shim/build.sh")
    return SHIM_JAR


@dataclass
class StateLayout:
    """Where a query's state lives, and the Spark settings that put it there."""

    state_dir: Path
    local_dir: Path
    checkpoint_dir: Path
    checkpoint_uri: str
    conf: dict[str, str] = field(default_factory=dict)
    jars: list[str] = field(default_factory=list)

    def remove_stale_local_dirs(self) -> list[Path]:
        """Delete the local dirs a killed Spark JVM left in ``spark.local.dir``; the removed paths.

        Spark deletes its ``spark-*`` (state store working dirs) and ``blockmgr-*`` (shuffle
        files) dirs when its JVM exits, but a killed JVM leaves them. On a mount they are part
        of the volume: they follow it to the next node, and cache warming fetches them first
        (they are its newest files). A restarted query needs none of it: its state is loaded
        from the checkpoint. Call this before the session starts, and only when no other Spark
        process uses this state dir.
        """
        removed = []
        for entry in sorted(self.local_dir.iterdir()):
            if entry.is_dir() and not entry.is_symlink() and entry.name.startswith(SPARK_LOCAL_PREFIXES):
                shutil.rmtree(entry)
                removed.append(entry)
        return removed


def state_conf(state_dir: str | os.PathLike, *, query: str = "query", use_shim: bool = False,
               checkpoint: Optional[str | os.PathLike] = None,
               changelog: bool = True, min_deltas_for_snapshot: int = 10,
               maintenance_interval: str = "30s", shuffle_partitions: int = 4,
               compression: Optional[str] = None, block_size_kb: Optional[int] = None) -> StateLayout:
    """Spark settings that keep a streaming query's state under ``state_dir``.

    ``checkpoint`` overrides the checkpoint directory (default ``<state_dir>/checkpoints/<query>``).
    ``use_shim`` registers the ``fusestate://`` Hadoop file system (spark/shim) and names the
    checkpoint with that scheme; it needs the checkpoint and ``spark.local.dir`` on one mount.
    """
    state_dir = Path(state_dir).resolve()
    local_dir = state_dir / "spark-local"
    checkpoint_dir = Path(checkpoint).resolve() if checkpoint else state_dir / "checkpoints" / query
    local_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
    scheme = SHIM_SCHEME if use_shim else "file"
    uri = f"{scheme}://{checkpoint_dir}"
    conf = {
        "spark.local.dir": str(local_dir),
        "spark.sql.streaming.checkpointLocation": uri,
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
        ROCKSDB_PREFIX + "changelogCheckpointing.enabled": "true" if changelog else "false",
        "spark.sql.streaming.stateStore.minDeltasForSnapshot": str(min_deltas_for_snapshot),
        "spark.sql.streaming.stateStore.maintenanceInterval": maintenance_interval,
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
    }
    if compression:
        conf[ROCKSDB_PREFIX + "compression"] = compression
    if block_size_kb is None and is_fusestate_mount(state_dir):
        block_size_kb = MOUNT_BLOCK_SIZE_KB
    if block_size_kb is not None:
        if block_size_kb <= 0:
            raise ValueError(f"block_size_kb must be positive, not {block_size_kb}")
        conf[ROCKSDB_PREFIX + "blockSizeKB"] = str(block_size_kb)
    jars: list[str] = []
    if use_shim:
        jar = str(shim_jar())
        jars.append(jar)
        conf.update({
            # Hadoop resolves file system classes through the JVM's class path, so the jar goes
            # there as well as on spark.jars.
            "spark.driver.extraClassPath": jar,
            "spark.executor.extraClassPath": jar,
            f"spark.hadoop.fs.{SHIM_SCHEME}.impl": SHIM_FS_CLASS,
            f"spark.hadoop.fs.AbstractFileSystem.{SHIM_SCHEME}.impl": SHIM_AFS_CLASS,
            f"spark.hadoop.fs.{SHIM_SCHEME}.impl.disable.cache": "false",
        })
    return StateLayout(state_dir, local_dir, checkpoint_dir, uri, conf, jars)
