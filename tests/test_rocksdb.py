"""RocksDB on a real mount: db_bench, ldb checkpoints (hard links), rocksdict, WAL off.

These drive the real RocksDB tools (Debian's rocksdb-tools: db_bench, ldb) and
rocksdict against a mounted file:// volume, then check what RocksDB itself
reads back after an unmount, and what reached the bucket.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from conftest import Bucket, Mount

DB_BENCH = shutil.which("db_bench")
LDB = shutil.which("ldb")

pytestmark = pytest.mark.skipif(not (DB_BENCH and LDB), reason="rocksdb-tools (db_bench, ldb) not installed")

# Footer magic of a block-based table (SST) file, little-endian fixed64 at its very end.
SST_MAGIC = struct.pack("<Q", 0x88E241B785F4CFF7)
SMALL_FILES = ("CURRENT", "MANIFEST-", "OPTIONS-")


def run(*cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def db_bench(db: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run(DB_BENCH, f"--db={db}", "--seed=42", "--threads=1", *args, timeout=timeout)


def scan_digest(db: Path) -> tuple[int, str]:
    """Number of keys and a digest of every key and value, as RocksDB reads them."""
    out = run(LDB, f"--db={db}", "scan", "--hex").stdout
    lines = [line for line in out.splitlines() if line.strip()]
    return len(lines), hashlib.sha256("\n".join(lines).encode()).hexdigest()


def check_consistency(db: Path) -> None:
    assert "OK" in run(LDB, f"--db={db}", "checkconsistency").stdout


def remount(mnt: Mount, wipe_cache: bool = False) -> None:
    mnt.umount()
    if wipe_cache:
        mnt.wipe_cache()  # a fresh node: only the bucket is left
    mnt.mount()


def test_db_bench_fill_read_overwrite(mnt: Mount, tmp_path: Path) -> None:
    args = ["--benchmarks=fillrandom,readrandom,overwrite", "--num=20000", "--value_size=400",
            "--use_existing_db=0"]
    db_bench(mnt.path / "db", *args)
    # The same deterministic run on local disk is the reference for every key and value.
    reference = tmp_path / "reference"
    db_bench(reference, *args)
    expected = scan_digest(reference)
    assert expected[0] > 10_000

    remount(mnt)
    check_consistency(mnt.path / "db")
    assert scan_digest(mnt.path / "db") == expected
    # Open it once more for writing: WAL replay, flush and compaction all on the mount.
    db_bench(mnt.path / "db", "--benchmarks=readrandom,overwrite,compact", "--num=5000",
             "--value_size=400", "--use_existing_db=1")
    check_consistency(mnt.path / "db")


def test_db_bench_without_wal(mnt: Mount, tmp_path: Path) -> None:
    """Spark's RocksDB state store writes with the WAL off and relies on flush at commit."""
    args = ["--benchmarks=fillrandom,readrandom,overwrite", "--num=20000", "--value_size=400",
            "--use_existing_db=0", "--disable_wal=1", "--write_buffer_size=2097152"]
    db_bench(mnt.path / "db", *args)
    reference = tmp_path / "reference"
    db_bench(reference, *args)
    expected = scan_digest(reference)

    remount(mnt, wipe_cache=True)
    assert not any(p.name.endswith(".log") and p.stat().st_size for p in (mnt.path / "db").iterdir())
    check_consistency(mnt.path / "db")
    assert scan_digest(mnt.path / "db") == expected


def _sst_files(directory: Path) -> dict[str, os.stat_result]:
    return {p.name: p.stat() for p in directory.iterdir() if p.name.endswith(".sst")}


def _object_bytes(bucket: Bucket, names: set[str]) -> dict[str, bytes]:
    root = Path(bucket.root())
    return {n: (root / "blocks" / n[:2] / n).read_bytes() for n in names}


def test_ldb_checkpoint_hard_links_upload_no_data(mnt: Mount, file_bucket: Bucket) -> None:
    db = mnt.path / "db"
    # Several small SSTs, everything flushed (WAL off) and compacted, so reopening the DB
    # for the checkpoint has nothing to replay, flush or compact.
    db_bench(db, "--benchmarks=fillrandom,compact", "--num=50000", "--value_size=400",
             "--use_existing_db=0", "--disable_wal=1", "--write_buffer_size=2097152",
             "--target_file_size_base=1048576", "--compression_type=none")
    remount(mnt)  # every block is in the bucket now
    live = _sst_files(db)
    assert len(live) >= 5, sorted(live)
    sst_bytes = sum(st.st_size for st in live.values())
    assert sst_bytes > 10 << 20
    assert all(st.st_nlink == 1 for st in live.values())
    files_before = mnt.status()["files"]
    before = file_bucket.block_objects()

    ckpt = mnt.path / "ckpt"
    run(LDB, f"--db={db}", "checkpoint", f"--checkpoint_dir={ckpt}")

    # Every SST of the checkpoint is the live file under a second name, not a copy.
    linked = _sst_files(ckpt)
    assert linked, sorted(p.name for p in ckpt.iterdir())
    live_now = _sst_files(db)
    for name, st in linked.items():
        assert name in live_now, name
        assert st.st_ino == live_now[name].st_ino, name
        assert st.st_nlink == 2, (name, st.st_nlink)
        assert live_now[name].st_nlink == 2, name
    # A copied file would be a new inode (blocks deduplicate, inodes do not): only the
    # checkpoint directory and its copied small files are new.
    others = [p.name for p in ckpt.iterdir() if not p.name.endswith(".sst")]
    assert all(n.startswith(SMALL_FILES) for n in others), others
    new_inodes = mnt.status()["files"] - files_before
    assert new_inodes <= 1 + len(others) + 3, (new_inodes, others)  # + reopen's MANIFEST, OPTIONS, LOG

    mnt.umount()  # flush everything, upload everything
    new = file_bucket.block_objects() - before
    contents = _object_bytes(file_bucket, new)
    new_bytes = sum(len(b) for b in contents.values())
    assert not [n for n, b in contents.items() if b.endswith(SST_MAGIC)], "SST data was uploaded again"
    # What is new is the reopen's MANIFEST, OPTIONS, CURRENT and LOG: a few small files.
    assert len(new) <= 4, {n: len(b) for n, b in contents.items()}
    assert new_bytes < sst_bytes // 50, (new_bytes, sst_bytes)

    mnt.mount()
    check_consistency(ckpt)
    assert scan_digest(ckpt) == scan_digest(db)


def test_rocksdict_checkpoint_survives_a_fresh_node(mnt: Mount) -> None:
    rocksdict = pytest.importorskip("rocksdict")
    rng = random.Random(7)
    expected = {f"key-{i:06d}".encode(): rng.randbytes(rng.randint(50, 400)) for i in range(50_000)}
    db = rocksdict.Rdict(str(mnt.path / "db"))
    try:
        for k, v in expected.items():
            db[k] = v
        rocksdict.Checkpoint(db).create_checkpoint(str(mnt.path / "ckpt"))
    finally:
        db.close()
    assert any(p.name.endswith(".sst") for p in (mnt.path / "ckpt").iterdir())

    remount(mnt, wipe_cache=True)
    ckpt = rocksdict.Rdict(str(mnt.path / "ckpt"), access_type=rocksdict.AccessType.read_only())
    try:
        assert all(ckpt[k] == v for k, v in expected.items())
        assert sum(1 for _ in ckpt.keys()) == len(expected)
    finally:
        ckpt.close()
