"""Scenario 4: what a RocksDB checkpoint and a copy of the state cost, in time and bytes uploaded.

On a mount, a RocksDB checkpoint is hard links plus a few small files, and fusestate
stores every block once under its hash: neither the checkpoint nor a ``cp -r`` of the
state should upload data. A local-disk setup must take the checkpoint and then upload the
files the bucket does not have yet (with fsspec, as Spark's state store does: SST files
once, the small files of each version every time) — the baseline ``local`` (to a
``file://`` bucket) and ``local-s3`` (to the moto bucket). For the copy, the baseline is
``cp -r`` on local disk followed by an upload of the copy.

Like Spark's state store, the database stays open (rocksdict, in this process, WAL off):
each repetition first writes a tenth as many new keys and flushes the memtable (untimed:
that is new state, uploaded by every setup), waits for uploads, then measures the
checkpoint of the open database and the copy. Bytes uploaded: fusestate's
``writeback.uploaded_bytes``; for the peers, the growth of their bucket.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from blake3 import blake3

from bench.common import Choices, Context, Metric, RunError, error_text, fmt_num, log, record, run_cmd, summarize
from bench.render import goal_row, grouped_bars, medians_note, ratio_table
from bench.systems import FusestateSystem, Moto, PeerSystem, System, moto_if_needed, open_systems

NAME = "checkpoint"
TITLE = "Checkpoint cost"
SUMMARY = "RocksDB checkpoint and a copy of the state: wall time and bytes uploaded, vs local + fsspec upload"
BUDGET = {"tiny": None, "quick": 100.0, "full": None}
SYSTEMS = ["local", "local-s3", "fusestate-file", "fusestate-s3", "rclone", "s3fs"]
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"num": 20_000, "timeout": 120},
    "quick": {"num": 200_000, "timeout": 300},
    "full": {"num": 500_000, "timeout": 1800},
}
METRICS = [
    Metric("checkpoint_s", "s", higher_is_better=False, label="checkpoint (+ upload for local)"),
    Metric("checkpoint_bytes", "B", higher_is_better=False, label="bytes uploaded by the checkpoint"),
    Metric("checkpoint_sst_bytes_uploaded", "B", higher_is_better=False,
           label="of which SST data (new objects holding SST blocks)"),
    Metric("copy_s", "s", higher_is_better=False, label="copy of the state (+ upload for local)"),
    Metric("copy_bytes", "B", higher_is_better=False, label="bytes uploaded by the copy"),
]


def fill(db: Path, num: int, timeout: float) -> None:
    run_cmd(["db_bench", f"--db={db}", "--benchmarks=fillrandom", f"--num={num}", "--value_size=400",
             "--key_size=16", "--compression_type=none", "--disable_wal=1", "--seed=1", "--use_existing_db=0"],
            timeout=timeout)


def open_db(db: Path) -> Any:
    """The state store's open database: raw bytes, no compression, WAL off (as Spark writes)."""
    import rocksdict

    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(False)
    opts.set_compression_type(rocksdict.DBCompressionType.none())
    handle = rocksdict.Rdict(str(db), opts)
    wo = rocksdict.WriteOptions()
    wo.disable_wal = True
    handle.set_write_options(wo)
    return handle


def new_state(handle: Any, n: int, timeout: float) -> None:
    """One batch of new state: ``n`` new keys, the memtable flushed to an SST (Spark's commit), and
    the compactions that started done — so they do not land in the measured checkpoint or copy."""
    for _ in range(n):
        handle[os.urandom(16)] = os.urandom(400)
    handle.flush()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = (handle.property_int_value("rocksdb.num-running-compactions") or 0) + \
            (handle.property_int_value("rocksdb.compaction-pending") or 0) + \
            (handle.property_int_value("rocksdb.num-running-flushes") or 0)
        if not busy:
            return
        time.sleep(0.1)
    raise RunError(f"RocksDB still compacting after {timeout:.0f} s")


def checkpoint(handle: Any, target: Path) -> None:
    import rocksdict

    rocksdict.Checkpoint(handle).create_checkpoint(str(target))


def dir_bytes(d: Path) -> tuple[int, int]:
    """(bytes in SST files, bytes in the other files) under ``d``."""
    sst = other = 0
    for f in d.rglob("*"):
        if f.is_file():
            if f.suffix == ".sst":
                sst += f.stat().st_size
            else:
                other += f.stat().st_size
    return sst, other


def sst_block_keys(d: Path, block_size: int) -> set[str]:
    """Object names fusestate would give the SST files' blocks: the BLAKE3 of each block."""
    keys = set()
    for f in d.glob("*.sst"):
        with open(f, "rb") as fh:
            while chunk := fh.read(block_size):
                keys.add(blake3(chunk).hexdigest())
    return keys


def block_objects(s: FusestateSystem) -> dict[str, int]:
    """The volume's block objects in the bucket: name -> size."""
    if s.url.startswith("file://"):
        root = Path(s.url[len("file://"):]) / "blocks"
        return {f.name: f.stat().st_size for f in root.rglob("*") if f.is_file()}
    bucket, _, prefix = s.url[len("s3://"):].partition("/")
    import boto3

    client = boto3.client("s3", endpoint_url=s.endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/blocks/"):
        out.update({o["Key"].rsplit("/", 1)[-1]: o["Size"] for o in page.get("Contents", [])})
    return out


class Uploader:
    """A local-disk setup's upload to its bucket: new SST files once, every other file per version."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs, self.root = fs, root.rstrip("/")
        self.have: set[str] = set()

    def upload_checkpoint(self, ckpt: Path, version: str) -> int:
        sent = 0
        for f in sorted(ckpt.iterdir()):
            if f.suffix == ".sst":
                if f.name in self.have:
                    continue
                target = f"{self.root}/sst/{f.name}"
                self.have.add(f.name)
            else:
                target = f"{self.root}/{version}/{f.name}"
            self.fs.put_file(str(f), target)
            sent += f.stat().st_size
        return sent

    def upload_tree(self, d: Path, prefix: str) -> int:
        sent = 0
        for f in sorted(p for p in d.rglob("*") if p.is_file()):
            self.fs.put_file(str(f), f"{self.root}/{prefix}/{f.relative_to(d)}")
            sent += f.stat().st_size
        return sent


def local_uploader(name: str, work: Path, moto: Optional[Moto]) -> Uploader:
    if name == "local-s3":
        if moto is None:
            raise RunError("no moto server")
        bucket = moto.create_bucket("local-upload")
        return Uploader(moto.fsspec(), f"{bucket}/state")
    import fsspec

    target = work / "local-bucket"
    target.mkdir(parents=True, exist_ok=True)
    return Uploader(fsspec.filesystem("file", auto_mkdir=True), str(target))


class Side:
    """One system of this scenario: where its database lives and how its uploads are counted."""

    def __init__(self, name: str, system: System, uploader: Optional[Uploader]) -> None:
        self.name, self.s, self.uploader = name, system, uploader
        self.db = system.path / "db"
        self.handle: Any = None
        self.error: Optional[str] = system.error

    def close(self) -> None:
        if self.handle is not None:
            try:
                self.handle.close()
            except Exception as exc:  # noqa: BLE001
                log(f"  {self.name}: closing the database failed: {exc}")
            self.handle = None

    def uploaded(self) -> Optional[int]:
        if isinstance(self.s, FusestateSystem):
            return self.s.status()["writeback"]["uploaded_bytes"]
        if isinstance(self.s, PeerSystem) and self.s.bucket:
            return self.s.moto.bucket_bytes(self.s.bucket)
        return None


def setup(side: Side, p: dict[str, Any]) -> None:
    """The state before the measured checkpoints: a filled database, its first checkpoint uploaded."""
    shutil.rmtree(side.db, ignore_errors=True)
    fill(side.db, p["num"], p["timeout"])
    side.handle = open_db(side.db)
    if side.uploader:
        ckpt = side.s.path / "ckpt-base"
        checkpoint(side.handle, ckpt)
        side.uploader.upload_checkpoint(ckpt, "base")
        shutil.rmtree(ckpt)
    side.s.settle()


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def one(side: Side, repeat: int, p: dict[str, Any]) -> dict[str, Any]:
    if side.error:
        return record(side.name, repeat, error=side.error)
    s = side.s
    metrics: dict[str, float] = {}
    extra: dict[str, Any] = {}
    errors: list[str] = []
    ckpt = s.path / f"ckpt-{repeat}"
    copy = s.path / f"copy-{repeat}"
    try:
        new_state(side.handle, max(1, p["num"] // 10), p["timeout"])
        s.settle()
    except Exception as exc:  # noqa: BLE001
        return record(side.name, repeat, error=f"new state: {error_text(exc)}")
    sst, other = dir_bytes(side.db)
    extra["state_sst_bytes"], extra["state_other_bytes"] = sst, other
    # The checkpoint.
    try:
        before = side.uploaded()
        objects = block_objects(s) if isinstance(s, FusestateSystem) else None
        t = time.monotonic()
        checkpoint(side.handle, ckpt)
        fsync_dir(ckpt)
        if side.uploader:
            metrics["checkpoint_bytes"] = side.uploader.upload_checkpoint(ckpt, f"v{repeat}")
        metrics["checkpoint_s"] = time.monotonic() - t
        extra["checkpoint_settle_s"] = round(s.settle(), 2)
        if before is not None:
            metrics["checkpoint_bytes"] = side.uploaded() - before
        c_sst, c_other = dir_bytes(ckpt)
        extra["checkpoint_sst_bytes"], extra["checkpoint_other_bytes"] = c_sst, c_other
        if objects is not None and isinstance(s, FusestateSystem):
            # Which of the objects the checkpoint uploaded hold SST data? (None, if it is links only.)
            new = {k: v for k, v in block_objects(s).items() if k not in objects}
            ssts = sst_block_keys(ckpt, s.status()["block_size"])
            extra["checkpoint_new_objects"] = len(new)
            metrics["checkpoint_sst_bytes_uploaded"] = sum(v for k, v in new.items() if k in ssts)
    except Exception as exc:  # noqa: BLE001
        errors.append(f"checkpoint: {error_text(exc)}")
    # A copy of the whole state.
    try:
        before = side.uploaded()
        t = time.monotonic()
        run_cmd(["cp", "-r", str(side.db), str(copy)], timeout=p["timeout"])
        if side.uploader:
            metrics["copy_bytes"] = side.uploader.upload_tree(copy, f"copy-{repeat}")
        else:
            s.settle()
        metrics["copy_s"] = time.monotonic() - t
        if before is not None:
            metrics["copy_bytes"] = side.uploaded() - before
    except Exception as exc:  # noqa: BLE001
        errors.append(f"copy: {error_text(exc)}")
    if errors:
        extra["diagnosis"] = s.diagnosis()
        if not s.usable():
            try:
                s.revive()
            except Exception as exc:  # noqa: BLE001
                side.error = f"unusable after a failure: {error_text(exc)}"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(copy, ignore_errors=True)
    try:
        s.settle()
    except Exception as exc:  # noqa: BLE001
        log(f"  {side.name}: settle failed: {exc}")
    error = "; ".join(errors) or None
    log(f"  checkpoint r{repeat + 1} {side.name:<15} "
        + " ".join(f"{k}={fmt_num(v, 'B' if k.endswith('bytes') else '')}" for k, v in metrics.items())
        + (f"  ERROR {error}" if error else ""))
    return record(side.name, repeat, metrics=metrics, error=error, **extra)


def choices(size: str) -> Choices:  # noqa: ARG001 - the same at every size
    """The systems ``--systems`` may name here, and those run without it."""
    return Choices(SYSTEMS, SYSTEMS)


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    names = ctx.chosen(choices(ctx.size))
    real = [n for n in names if n != "local-s3"]
    if "local-s3" in names and "local" not in real:
        real.insert(0, "local")
    runs: list[dict[str, Any]] = []
    with moto_if_needed(names, ctx.work) as moto, \
            open_systems(real, ctx.work, moto=moto, fusestate_extra=ctx.mount_options, shape=ctx.shape) as systems:
        sides: dict[str, Side] = {}
        for name in names:
            if name in ("local", "local-s3"):
                base = systems["local"]
                sys_ = System(name, ctx.work / name)
                sys_.path = base.path / name
                sys_.path.mkdir(parents=True, exist_ok=True)
                try:
                    uploader = local_uploader(name, ctx.work, moto)
                except Exception as exc:  # noqa: BLE001
                    uploader, sys_.error = None, error_text(exc)
                sides[name] = Side(name, sys_, uploader)
            else:
                sides[name] = Side(name, systems[name], None)
        for side in sides.values():
            if side.error:
                continue
            try:
                setup(side, p)
            except Exception as exc:  # noqa: BLE001
                side.error = f"setup: {error_text(exc)}"
                log(f"  {side.name}: {side.error}")
        try:
            for repeat in ctx.repetitions():
                for side in sides.values():
                    runs.append(one(side, repeat, p))
        finally:
            for side in sides.values():
                side.close()  # before the mounts go
        info = {n: s.info() for n, s in systems.items()}
    return {"params": p, "systems": names, "system_info": info,
            "summary": summarize(runs, METRICS, names, [""]), "runs": runs}


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:
    p, names, rows = doc["params"], doc["systems"], doc["summary"]
    state = [r.get("state_sst_bytes", 0) + r.get("state_other_bytes", 0) for r in doc["runs"] if r.get("state_sst_bytes")]
    parts = [f"A RocksDB database of {p['num']:,} keys × 400 bytes (no compression; up to "
             f"{fmt_num(max(state) if state else None, 'B')} on disk), held open as Spark's state store holds it "
             f"(rocksdict, WAL off). Before each repetition, untimed: a tenth as many new keys, memtable flushed, "
             f"compactions finished, uploads drained. *Checkpoint*: RocksDB's checkpoint of the open database (+ fsync "
             f"of its directory); `local` and `local-s3` then upload its new files with fsspec to a `file://` or S3 "
             f"bucket. *Copy*: `cp -r` of the database (+ the upload of the copy for the local baselines). "
             + medians_note(doc, "`local`", " (lower is better here)"),
             ratio_table(rows, names, show_variant=False)]
    by, images = {r["metric"]: r for r in rows}, []
    for kind, metrics, scale, ylabel in (("time", ("checkpoint_s", "copy_s"), 1.0, "seconds (log)"),
                                         ("bytes", ("checkpoint_bytes", "copy_bytes"), 1 << 20, "MiB uploaded (log)")):
        present = [m for m in metrics if m in by]
        if not present:
            continue
        series = {n: [(by[m]["systems"].get(n, {}).get("median") or 0) / scale
                      if by[m]["systems"].get(n, {}).get("median") is not None else None for m in present]
                  for n in names}
        errors = {n: ["error" in by[m]["systems"].get(n, {}) for m in present] for n in names}
        # Log scale: fusestate's kilobytes and milliseconds would not show beside the baselines' megabytes.
        title = f"Checkpoint and copy of the state: {ylabel.split(' (')[0]} (x = failed)"
        img = grouped_bars(img_dir / f"checkpoint-{kind}.png", [m.split("_")[0] for m in present], series,
                           ylabel=ylabel, title=title, errors=errors, log=True)
        images.append(f"![checkpoint {kind}]({img_rel}/{img.name})")
    return "\n\n".join(parts + [" ".join(images)] if images else parts)


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name in ("fusestate-file", "fusestate-s3"):
        mine = [r for r in doc["runs"] if r["system"] == name and "checkpoint_sst_bytes_uploaded" in r["metrics"]]
        if not mine:
            continue
        sst = max(r["metrics"]["checkpoint_sst_bytes_uploaded"] for r in mine)
        total = max(r["metrics"].get("checkpoint_bytes", 0) for r in mine)
        out.append(goal_row(f"RocksDB checkpoint on {name}: no data (SST) bytes uploaded",
                            f"{fmt_num(sst, 'B')} of SST data uploaded (at most {fmt_num(total, 'B')} in all: "
                            f"RocksDB's LOG, MANIFEST, CURRENT)", sst == 0))
    return out
