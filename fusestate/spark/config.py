"""Spark configuration for "keep this query's state on this fusestate mount".

One function, :func:`state_conf`, turns a directory (on a fusestate mount, or on local disk for a
baseline) into the settings a Structured Streaming query needs:

- ``spark.local.dir`` under the directory: the RocksDB state store's working directory (and
  shuffle files) live there, so RocksDB writes land in fusestate's write-back cache;
- a checkpoint location under the directory: ``fusestate:///...`` when the Hadoop shim is used
  (commits and loads become hard links inside the mount), ``file:///...`` otherwise (commits
  copy the SST files, and content addressing keeps the copy from uploading anything new);
- the RocksDB state store provider and changelog checkpointing;
- for the local-disk baseline of an object store (``local=True`` and an ``s3a://`` checkpoint),
  Hadoop's S3A connector and its endpoint (:mod:`fusestate.spark.s3a`);
- on a fusestate mount, 64 KiB RocksDB blocks instead of Spark's 4 KiB (see
  :data:`MOUNT_BLOCK_SIZE_KB`).

Settings that cannot work are refused with :class:`SparkSetupError` before the session starts
(:func:`check_state_conf` does the same for settings a job builds itself): a directory on no
mount or on a mount whose daemon has died, a missing shim jar, a checkpoint scheme other than
``file://`` and ``fusestate://`` (``s3a://`` only for the local-disk baseline, with the
connector), a ``fusestate://`` checkpoint without the shim registered, or the shim's checkpoint
on another mount than ``spark.local.dir``.

A checkpoint location must be visible to the driver and to every executor that may run the
query's tasks. With one fusestate volume per node that means a single-node query (local mode,
or one executor host), or every node mounting the same volume, which fusestate allows for one
writer only. See docs/spark.md.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence
from urllib.parse import urlsplit

from fusestate.errors import UserError
from fusestate.spark import s3a, shim

SHIM_SCHEME, SHIM_FS_CLASS, SHIM_AFS_CLASS = shim.SCHEME, shim.FS_CLASS, shim.AFS_CLASS
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
ROCKSDB_PREFIX = "spark.sql.streaming.stateStore.rocksdb."
CHANGELOG_KEY = ROCKSDB_PREFIX + "changelogCheckpointing.enabled"
# What Spark names the dirs it makes in spark.local.dir (Utils.createTempDir, DiskBlockManager).
SHUFFLE_PREFIX = "blockmgr-"
SPARK_LOCAL_PREFIXES = ("spark-", SHUFFLE_PREFIX)
# The mount options that keep Spark's local dirs on the node (--scratch): its shuffle dirs
# (blockmgr-<uuid>) and the dirs of its temporary files (spark-<uuid>), which hold the state
# stores' RocksDB working dirs. A working dir's SSTs reach the volume when the shim's commit
# links them into the checkpoint (the link uploads them); the ones compaction deletes before
# a commit never leave the node. The checkpoint's files linked back into a working dir on
# load stay files of the volume.
SHUFFLE_SCRATCH = SHUFFLE_PREFIX + "*"
WORKING_DIR_SCRATCH = "spark-*-*-*-*-*"  # spark- and a UUID: no name a user picks by chance
LOCAL_DIR_SCRATCH = (SHUFFLE_SCRATCH, WORKING_DIR_SCRATCH)


def missing_scratch(scratch_dirs: list[str]) -> list[str]:
    """The patterns of :data:`LOCAL_DIR_SCRATCH` whose dirs a mount's ``--scratch`` patterns
    leave in the volume."""
    names = {SHUFFLE_SCRATCH: SHUFFLE_PREFIX + str(uuid.UUID(int=0)), WORKING_DIR_SCRATCH: f"spark-{uuid.UUID(int=0)}"}
    return [pattern for pattern, name in names.items()
            if not any(fnmatch.fnmatchcase(name, p) for p in scratch_dirs)]


def scratch_options() -> list[str]:
    """``--scratch`` options for a mount that holds Spark's local dirs."""
    return [option for pattern in LOCAL_DIR_SCRATCH for option in ("--scratch", pattern)]


# RocksDB opens every SST with POSIX_FADV_RANDOM, which turns off the kernel's readahead: a scan
# (the deduplication store's eviction pass, a compaction) then reaches the daemon as one FUSE
# request per RocksDB block. Each request costs tens of microseconds in the daemon, whatever its
# size, so on a mount 64 KiB blocks scan about 4x faster than Spark's 4 KiB (docs/spark.md has
# the numbers).
MOUNT_BLOCK_SIZE_KB = 64

# Snapshots with the shim. A restart or a store loaded on another node reads the latest snapshot
# in the checkpoint and replays every changelog after it; with no snapshot there it replays the
# whole history, reading more than the state itself (a 1 GB state's 3 changelog versions are
# 1.47 GB) before the first record. Through the shim a snapshot costs links, not uploads of the
# state, so with it the helper takes one every version and lets the maintenance task link it
# into the checkpoint every second; a commit still only writes its changelog. Without the shim
# (local disk, file:// copies, s3a://) a snapshot copies the state's new files: Spark's
# defaults of the helper stay.
SHIM_MIN_DELTAS_FOR_SNAPSHOT, MIN_DELTAS_FOR_SNAPSHOT = 1, 10
SHIM_MAINTENANCE_INTERVAL, MAINTENANCE_INTERVAL = "1s", "30s"


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


class SparkSetupError(UserError):
    """A setting that would fail only once the query runs (deep in a JVM trace), or would
    quietly copy every state file the shim exists to link: refused before the session starts."""


def shim_jar() -> Path:
    """The shim jar installed with fusestate (package data: no build at run time)."""
    jar = shim.installed_jar()
    if not jar.is_file():
        raise SparkSetupError(f"the fusestate:// shim jar {jar} is missing from this installation: reinstall "
                              f"fusestate (in a source tree: bash spark/shim/build.sh)")
    return jar


def live_fusestate_mount(path: str | os.PathLike) -> Optional[str]:
    """The fusestate mount holding ``path``, checked to answer; None when it is on none.

    A daemon that died leaves its mount in /proc/self/mounts, and every use of it fails with
    ENOTCONN: Spark would report that from inside the query, far from the cause. statfs is
    asked because the kernel answers it from no cache (a stat may come from cached attributes)."""
    mountpoint = is_fusestate_mount(path)
    if mountpoint is not None:
        try:
            os.statvfs(mountpoint)
        except OSError as exc:
            raise SparkSetupError(
                f"the fusestate mount {mountpoint} (holding {path}) does not answer ({exc.strerror}): its daemon "
                f"has exited; detach it with 'fusermount3 -u -z {mountpoint}' and mount the volume again") from None
    return mountpoint


def checkpoint_path(location: str | os.PathLike) -> tuple[str, Path]:
    """A checkpoint location as (scheme, local path): a plain path or a ``file://`` URI is
    ``file``, a ``fusestate://`` URI is the shim's; any other scheme is not on a mount."""
    text = os.fspath(location)
    if "://" not in text:
        return "file", Path(text).resolve()
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in ("file", SHIM_SCHEME):
        raise SparkSetupError(
            f"checkpoint location {text}: the scheme {parts.scheme}:// does not keep the state on a fusestate "
            f"mount; use a path on the mount (or file://) for plain copies, or {SHIM_SCHEME}:// with the shim "
            f"for hard-link commits")
    if parts.netloc:
        raise SparkSetupError(f"checkpoint location {text}: expected {scheme}:///absolute/path (no host part)")
    return scheme, Path(parts.path).resolve()


def check_state_conf(conf: Mapping[str, str], *, on_mount: bool = True) -> None:
    """Refuse Spark settings that put a query's state somewhere other than intended.

    ``on_mount``: the state must be on a live fusestate mount (False for a local-disk
    baseline, where only the checkpoint's scheme and the shim are checked). Works on any
    settings dict, so a job that builds its own can call it before creating its session.
    """
    location = conf.get("spark.sql.streaming.checkpointLocation")
    local_dir = conf.get("spark.local.dir")
    if not on_mount and s3a.is_s3a(location):
        # The object-store baseline: the state on local disk, the checkpoint through S3A.
        problem = s3a.missing_connector(dict(conf))
        if problem:
            raise SparkSetupError(f"checkpoint location {location}: {problem}")
        return
    scheme, ckpt = checkpoint_path(location) if location else ("file", None)
    if scheme == SHIM_SCHEME:
        if conf.get(f"spark.hadoop.fs.{SHIM_SCHEME}.impl") != SHIM_FS_CLASS:
            raise SparkSetupError(
                f"checkpoint location {location} uses {SHIM_SCHEME}:// but the shim is not registered "
                f"(spark.hadoop.fs.{SHIM_SCHEME}.impl = {SHIM_FS_CLASS}): build the settings with "
                f"state_conf(..., use_shim=True), or --use-shim")
        # spark.jars is a comma-separated list of URIs, a class path is colon-separated.
        jars = [j.strip().removeprefix("file://") for j in conf.get("spark.jars", "").split(",")]
        jars += [j.strip() for j in conf.get("spark.driver.extraClassPath", "").split(os.pathsep)]
        jars = [j for j in jars if j.endswith(".jar") and "://" not in j]
        if not jars:
            raise SparkSetupError(f"the {SHIM_SCHEME}:// shim is registered but no jar is on spark.jars or "
                                  f"spark.driver.extraClassPath: add {shim.installed_jar()}")
        for jar in jars:
            if not Path(jar).is_file():
                raise SparkSetupError(f"the shim jar {jar} does not exist (the installed one is {shim.installed_jar()})")
    if not on_mount:
        return
    local_mount = live_fusestate_mount(local_dir) if local_dir else None
    if local_dir and local_mount is None:
        raise SparkSetupError(f"spark.local.dir {local_dir} is not on a fusestate mount: the state store's "
                              f"working files would stay on local disk")
    ckpt_mount = live_fusestate_mount(ckpt) if ckpt else None
    if ckpt is not None and ckpt_mount is None:
        raise SparkSetupError(f"checkpoint location {location} is not on a fusestate mount")
    if scheme == SHIM_SCHEME and local_mount != ckpt_mount:
        raise SparkSetupError(
            f"checkpoint location {location} is on {ckpt_mount}, spark.local.dir {local_dir} on {local_mount}: "
            f"the shim links state files only within one mount, and would copy every one of them")


@dataclass
class StateLayout:
    """Where a query's state lives, and the Spark settings that put it there."""

    state_dir: Path
    local_dir: Path
    checkpoint_dir: Optional[Path]  # None: in an object store (s3a://), not a local path
    checkpoint_uri: str
    mount: Optional[str] = None  # the fusestate mount holding state_dir (None: local disk)
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

        A scratch dir (``--scratch``) of a shared volume that another mount made (this node's
        daemon before it died and was mounted again) keeps its contents in that mount's
        memory: the database refuses its removal (ENOTEMPTY) until that mount's session is
        cleaned up, which removes it. Such a dir is left to that.
        """
        removed = []
        for entry in sorted(self.local_dir.iterdir()):
            if entry.is_dir() and not entry.is_symlink() and entry.name.startswith(SPARK_LOCAL_PREFIXES):
                try:
                    shutil.rmtree(entry)
                except OSError as exc:
                    if exc.errno != errno.ENOTEMPTY or not entry.is_dir() or any(entry.iterdir()):
                        raise
                    continue  # another mount's scratch dir: its session's end removes it
                removed.append(entry)
        return removed

    def spark_defaults(self) -> str:
        """The settings as ``spark-defaults.conf`` lines, the checkpoint location among them, for a
        job that starts its own session (spark-submit's ``--conf KEY=VALUE`` take the same)."""
        width = max(map(len, self.conf), default=0)
        return "\n".join(f"{key:<{width}}  {value}" for key, value in self.conf.items())


def state_conf(state_dir: str | os.PathLike, *, query: str = "query", use_shim: bool = False,
               checkpoint: Optional[str | os.PathLike] = None, local: bool = False,
               shim_jar_path: Optional[str | os.PathLike] = None,
               changelog: Optional[bool] = None, min_deltas_for_snapshot: Optional[int] = None,
               maintenance_interval: Optional[str] = None, shuffle_partitions: int = 4,
               compression: Optional[str] = None, block_size_kb: Optional[int] = None,
               s3a_endpoint: Optional[str] = None, s3a_region: Optional[str] = None,
               s3a_credentials: Optional[tuple[str, str]] = None, s3a_jars: Sequence[str | os.PathLike] = (),
               create: bool = True) -> StateLayout:
    """Spark settings that keep a streaming query's state under ``state_dir``, on a live
    fusestate mount (``local=True``: on local disk, for a baseline).

    ``checkpoint`` overrides the checkpoint directory (default ``<state_dir>/checkpoints/<query>``):
    a path, ``file://`` or ``fusestate://``. ``changelog`` (RocksDB changelog checkpointing) defaults
    to off with the shim, where every commit is a snapshot the shim links (a restart then loads it
    and replays nothing), and on without it, where a snapshot is a copy. With changelog
    checkpointing, ``min_deltas_for_snapshot`` and ``maintenance_interval`` default to a snapshot
    every version linked every second with the shim, else every 10 versions and every 30 s (see
    :data:`SHIM_MIN_DELTAS_FOR_SNAPSHOT`). ``use_shim`` registers the ``fusestate://`` Hadoop
    file system (the jar installed with fusestate; ``shim_jar_path`` for another copy) and names the
    checkpoint with that scheme; it needs the checkpoint and ``spark.local.dir`` on one mount.
    With ``local=True`` the checkpoint may be ``s3a://bucket/prefix``, what most jobs run today:
    ``s3a_endpoint`` (an S3-compatible endpoint's URL), ``s3a_region``, ``s3a_credentials``
    (access key, secret key) and ``s3a_jars`` (the connector's jars; default: Spark fetches
    them) set up Hadoop's S3A connector (:func:`fusestate.spark.s3a.s3a_conf`).
    Settings that cannot work raise :class:`SparkSetupError` before anything is created;
    ``create=False`` creates nothing at all (to print the settings).
    """
    state_dir = Path(state_dir).resolve()
    local_dir = state_dir / "spark-local"
    mountpoint = is_fusestate_mount(state_dir)
    if local and use_shim:
        raise SparkSetupError("the fusestate:// shim needs the state on a fusestate mount, not on local disk")
    if local and mountpoint:
        raise SparkSetupError(f"{state_dir} is on the fusestate mount {mountpoint}, not on local disk")
    if not local and mountpoint is None:
        raise SparkSetupError(f"{state_dir} is not on a fusestate mount: mount the volume first "
                              f"(fusestate mount URL MOUNTPOINT), or use local disk for a baseline (--local)")
    on_s3a = local and s3a.is_s3a(checkpoint)
    if on_s3a:
        checkpoint_dir, uri = None, os.fspath(checkpoint).rstrip("/")  # type: ignore[arg-type]
    else:
        if s3a_endpoint or s3a_region or s3a_jars or s3a_credentials:
            raise SparkSetupError("the S3A settings are for an s3a:// checkpoint of the local-disk baseline "
                                  "(--local --checkpoint s3a://bucket/prefix)")
        scheme, checkpoint_dir = (checkpoint_path(checkpoint) if checkpoint
                                  else ("file", state_dir / "checkpoints" / query))
        if scheme == SHIM_SCHEME and not use_shim:
            raise SparkSetupError(f"checkpoint location {checkpoint} needs the shim: use_shim=True (--use-shim)")
        uri = f"{SHIM_SCHEME if use_shim else 'file'}://{checkpoint_dir}"
    if changelog is None:
        changelog = not use_shim
    if min_deltas_for_snapshot is None:
        min_deltas_for_snapshot = SHIM_MIN_DELTAS_FOR_SNAPSHOT if use_shim else MIN_DELTAS_FOR_SNAPSHOT
    if maintenance_interval is None:
        maintenance_interval = SHIM_MAINTENANCE_INTERVAL if use_shim else MAINTENANCE_INTERVAL
    conf = {
        "spark.local.dir": str(local_dir),
        "spark.sql.streaming.checkpointLocation": uri,
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
        CHANGELOG_KEY: "true" if changelog else "false",
        "spark.sql.streaming.stateStore.minDeltasForSnapshot": str(min_deltas_for_snapshot),
        "spark.sql.streaming.stateStore.maintenanceInterval": maintenance_interval,
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
    }
    if compression:
        conf[ROCKSDB_PREFIX + "compression"] = compression
    if block_size_kb is None and not local:
        block_size_kb = MOUNT_BLOCK_SIZE_KB
    if block_size_kb is not None:
        if block_size_kb <= 0:
            raise ValueError(f"block_size_kb must be positive, not {block_size_kb}")
        conf[ROCKSDB_PREFIX + "blockSizeKB"] = str(block_size_kb)
    if on_s3a:
        key, secret = s3a_credentials or (None, None)
        conf.update(s3a.s3a_conf(s3a_endpoint, region=s3a_region, access_key=key, secret_key=secret,
                                 jars=s3a_jars))
    jars: list[str] = []
    if use_shim:
        jar = str(Path(shim_jar_path).resolve()) if shim_jar_path else str(shim_jar())
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
        # An executor whose mount died exits at once, and Spark moves its work elsewhere,
        # rather than failing every task it is given until the job aborts; a lost executor's
        # state stores are filled into the page cache of the executors left; a restarted
        # query's state stores start on the nodes whose caches hold them.
        conf["spark.plugins"] = shim.PLUGINS
        conf["spark.sql.streaming.streamingQueryListeners"] = shim.AFFINITY_LISTENER_CLASS
    check_state_conf(conf, on_mount=not local)
    for d in ([local_dir] + ([checkpoint_dir.parent] if checkpoint_dir else [])) if create else []:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SparkSetupError(f"cannot create {d}: {exc.strerror}") from None
    return StateLayout(state_dir, local_dir, checkpoint_dir, uri, mountpoint, conf, jars)
