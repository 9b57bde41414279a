"""Scratch directories (``--scratch PATTERN``): node-local data inside the mount.

Spark keeps its shuffle files under ``spark.local.dir`` next to the state store's working
dirs, so they land on the mount too; they are worthless after the JVM that wrote them is
gone. What a user checks: such files read back while mounted, nothing of them reaches the
bucket, an fsync elsewhere does not wait for them, and they are gone after the next mount,
on the same node or a fresh one, while everything else is intact.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import trio

from conftest import Bucket, Mount, assert_one_line_error, block_keys, digest, engine_args, fusestate, sha, wait_for
from fusestate.blocks.scratch_files import ScratchFiles
from fusestate.fuse import frontend as frontends
from fusestate.meta.embedded import journal
from fusestate.meta.engine import ROOT_INODE, NewNode
from fusestate.meta.embedded.engine import SQLiteEngine

MiB = 1 << 20
SCRATCH = ["--scratch", "blockmgr-*"]


def rand(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def write(path: Path, data: bytes, fsync: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def read_cold(path: Path) -> bytes:
    """The file's bytes as the daemon serves them (the kernel's page cache dropped first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
    finally:
        os.close(fd)


def settle(m: Mount) -> dict:
    """Status once nothing is waiting for upload (the volume's own data is in the bucket)."""
    os.sync()
    fd = os.open(m.path, os.O_RDONLY)
    try:
        os.fsync(fd)  # fsyncdir: ships the journal, after every block it references
    finally:
        os.close(fd)
    return m.status()


def spark_like_tree(m: Mount) -> tuple[bytes, bytes]:
    """A state file and a shuffle file, as a Spark executor leaves them under its local dir."""
    state, shuffle = rand(6 * MiB + 123, 1), rand(9 * MiB + 5, 2)
    write(m.path / "job" / "state" / "000012.sst", state)
    tmp = m.path / "job" / "blockmgr-5f1c" / "0c" / "temp_shuffle_1"
    write(tmp, shuffle)
    os.rename(tmp, tmp.with_name("shuffle_0_1_0.data"))  # inside scratch: an ordinary rename
    return state, shuffle


def test_scratch_data_reads_back_and_never_reaches_the_bucket(make_mount, file_bucket: Bucket) -> None:
    m: Mount = make_mount(file_bucket, extra=[*SCRATCH, "--memory-cache-size", "4M"]).mount()
    assert m.status()["scratch_dirs"] == ["blockmgr-*"]
    state, shuffle = spark_like_tree(m)
    shuffle_file = m.path / "job" / "blockmgr-5f1c" / "0c" / "shuffle_0_1_0.data"
    st = settle(m)
    assert (st["cache"]["scratch_files"], st["cache"]["scratch_bytes"]) == (1, len(shuffle))
    assert read_cold(shuffle_file) == shuffle
    assert file_bucket.block_objects() == block_keys(state)
    assert st["writeback"]["uploaded_bytes"] == len(state)
    assert st["writeback"]["staged_blocks"] == 0  # scratch files are outside the write-back queue
    assert (m.cache_dir / "scratch").is_dir() and st["cache"]["promoted_files"] == 0

    # A file of the volume may be named in a scratch dir too; the name goes with the dir.
    os.link(m.path / "job" / "state" / "000012.sst", shuffle_file.with_name("linked.sst"))
    assert os.stat(m.path / "job" / "state" / "000012.sst").st_nlink == 2
    # A whole scratch dir may move, and stays scratch.
    os.rename(m.path / "job" / "blockmgr-5f1c", m.path / "job" / "blockmgr-moved")
    assert read_cold(m.path / "job" / "blockmgr-moved" / "0c" / "shuffle_0_1_0.data") == shuffle
    assert os.stat(m.path / "job").st_nlink == 4  # ., .., state, blockmgr-moved

    scratch_copy = m.path / "job" / "blockmgr-moved" / "copy"
    scratch_copy.write_bytes(shuffle)
    assert m.status()["cache"]["scratch_bytes"] == 2 * len(shuffle)
    os.truncate(scratch_copy, 5)
    assert scratch_copy.read_bytes() == shuffle[:5]
    os.unlink(scratch_copy)
    os.unlink(m.path / "job" / "blockmgr-moved" / "0c" / "shuffle_0_1_0.data")
    wait_for(lambda: m.status()["cache"]["scratch_files"] == 0,  # once the kernel forgets the inodes
             what="the deleted scratch files' backing files to go")
    assert not os.listdir(m.cache_dir / "scratch")

    m.umount()  # flushes everything: still nothing of the shuffle file
    assert file_bucket.block_objects() == block_keys(state)
    assert not block_keys(shuffle) & file_bucket.block_objects()
    code = fusestate("fsck", file_bucket.url, check=False)
    assert code.returncode == 0, code.stdout + code.stderr

    # The same node again: scratch is emptied at the mount, the rest is as it was.
    m.mount()
    assert sorted(os.listdir(m.path / "job")) == ["state"]
    assert os.stat(m.path / "job").st_nlink == 3
    assert digest(m.path / "job" / "state" / "000012.sst") == sha(state)
    assert os.stat(m.path / "job" / "state" / "000012.sst").st_nlink == 1  # its scratch name went
    m.umount()

    # A fresh node (empty cache dir): the volume never had the scratch dir.
    m.wipe_cache()
    m.mount()
    assert sorted(os.listdir(m.path / "job")) == ["state"]
    assert os.stat(m.path / "job").st_nlink == 3
    assert (m.path / "job" / "state" / "000012.sst").read_bytes() == state


def test_fsync_does_not_wait_for_scratch_and_a_crash_leaves_none(make_mount, file_bucket: Bucket) -> None:
    """Slow uploads: an fsync of a state file waits for its own blocks, not for the much
    larger shuffle data written before it; after SIGKILL the shuffle data is dropped, not
    uploaded, and the fsynced state is there."""
    m: Mount = make_mount(file_bucket, extra=SCRATCH).mount(env={"FUSESTATE_FAULTS": "delay=0.3,ops=put"})
    shuffle = rand(24 * MiB, 3)
    write(m.path / "blockmgr-1" / "shuffle_0_0_0.data", shuffle, fsync=False)
    state = rand(4 * MiB + 7, 4)
    write(m.path / "000007.sst", state)  # fsync: two blocks at 0.3 s each, not eight
    st = m.status()
    assert st["writeback"]["uploaded_bytes"] == len(state)
    assert not block_keys(shuffle) & file_bucket.block_objects()
    m.kill()

    m.mount()
    assert os.listdir(m.path) == ["000007.sst"]
    assert (m.path / "000007.sst").read_bytes() == state
    st = settle(m)
    assert st["writeback"]["staged_blocks"] == 0
    assert not block_keys(shuffle) & file_bucket.block_objects()
    m.umount()


FILL_UNTIL_FULL = """
import errno, os, sys
path, total = sys.argv[1], int(sys.argv[2])
written, failed = 0, None
try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while written < total:
            written += os.write(fd, os.urandom(1 << 20))  # distinct blocks: no dedup
        os.fsync(fd)
    finally:
        os.close(fd)
except OSError as exc:
    failed = exc.errno
print(written, failed)
"""


def rss(pid: int) -> int:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024


def test_scratch_filling_the_cache_disk_fails_with_enospc(make_mount, file_bucket: Bucket,
                                                          small_cache_disk: Path) -> None:
    """Scratch data leaves the cache disk only when it is deleted, so a shuffle larger than
    the disk gets ENOSPC, as on a full local disk, instead of waiting forever for room or
    piling up in the daemon's memory; the metadata keeps its room, the state is intact, and
    once the scratch file is deleted the volume takes data again."""
    m: Mount = make_mount(file_bucket, cache="small-disk/cache", extra=SCRATCH).mount("--memory-cache-size", "16M")
    state = rand(4 * MiB + 3, 5)
    write(m.path / "000009.sst", state)
    pid = m.status()["pid"]
    rss_before = rss(pid)
    shuffle = m.path / "blockmgr-1" / "shuffle_0_0_0.data"
    shuffle.parent.mkdir()
    proc = subprocess.run([sys.executable, "-c", FILL_UNTIL_FULL, str(shuffle), str(512 * MiB)],
                          capture_output=True, text=True, timeout=120)  # 8x the disk
    written, failed = proc.stdout.split()
    # With the kernel's write-back cache the error may come from a write or from the fsync.
    assert failed == str(errno.ENOSPC), (proc.stdout, proc.stderr)
    # What could not be stored was refused, not kept: sealing is bounded (once 1.4 GiB here).
    assert rss(pid) - rss_before < 160 * MiB
    assert shutil.disk_usage(small_cache_disk).free >= 8 * MiB  # the metadata's room is left
    st = m.status()
    assert st["cache"]["scratch_bytes"] > 16 * MiB and st["cache"]["disk_full_failures"] > 0, st["cache"]
    assert "cache disk full" in (m.cache_dir / "fusestate.log").read_text()
    assert read_cold(m.path / "000009.sst") == state

    shuffle.unlink()
    wait_for(lambda: m.status()["cache"]["scratch_bytes"] == 0, what="the scratch file to be freed")
    more = rand(16 * MiB, 6)
    write(m.path / "000010.sst", more)
    assert read_cold(m.path / "000010.sst") == more
    m.umount()


def test_scratch_on_a_shared_volume_stays_on_the_node_that_wrote_it(make_mount, file_bucket: Bucket,
                                                                    pg_url: str) -> None:
    """Every node of a shared volume has its own scratch dirs: the others see each one,
    empty, and can neither add to it nor remove it; what is inside (names and bytes) is on
    the node that made it, and goes when that node unmounts. The same bytes in a normal
    file still reach the bucket for it."""
    opts = [*SCRATCH, "--meta", pg_url, "--metrics-addr", "off", "--session-timeout", "3"]
    a = make_mount(file_bucket, name="node-a", cache="cache-a", extra=opts).mount()
    b = make_mount(file_bucket, name="node-b", cache="cache-b", extra=opts).mount()
    state, shuffle = spark_like_tree(a)
    shuffle_file = Path("job") / "blockmgr-5f1c" / "0c" / "shuffle_0_1_0.data"
    spill = rand(2 * MiB + 3, 4)
    write(a.path / "job" / "blockmgr-5f1c" / "0d" / "temp_shuffle_2", spill)
    assert read_cold(a.path / shuffle_file) == shuffle
    assert a.status()["cache"]["scratch_bytes"] == len(shuffle) + len(spill)
    assert file_bucket.block_objects() == block_keys(state)  # the state file's fsync waited for them

    assert os.listdir(b.path / "job" / "blockmgr-5f1c") == []
    assert not (b.path / shuffle_file).exists()
    with pytest.raises(OSError) as exc:
        (b.path / "job" / "blockmgr-5f1c" / "from-b").write_bytes(b"x")
    assert exc.value.errno == errno.EIO
    with pytest.raises(OSError) as exc:
        os.rmdir(b.path / "job" / "blockmgr-5f1c")
    assert exc.value.errno == errno.ENOTEMPTY
    assert (b.path / "job" / "state" / "000012.sst").read_bytes() == state
    write(a.path / "job" / "state" / "copy.sst", shuffle)  # bytes A held as scratch only
    assert (b.path / "job" / "state" / "copy.sst").read_bytes() == shuffle
    assert read_cold(a.path / shuffle_file) == shuffle
    os.unlink(a.path / "job" / "blockmgr-5f1c" / "0d" / "temp_shuffle_2")
    wait_for(lambda: a.status()["cache"]["scratch_bytes"] == len(shuffle),  # once the close's hold goes
             what="the deleted spill's bytes to go")
    assert sorted(os.listdir(a.cache_dir / "scratch")) == [str(os.stat(a.path / shuffle_file).st_ino)]
    mine = rand(MiB + 7, 3)
    write(b.path / "job" / "blockmgr-b" / "f", mine)
    assert read_cold(b.path / "job" / "blockmgr-b" / "f") == mine
    assert os.listdir(a.path / "job" / "blockmgr-b") == []
    fsck = fusestate("fsck", file_bucket.url, "--meta", pg_url, check=False)  # scratch blocks are not missing
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr

    a.umount()  # its session ends: its scratch names go
    wait_for(lambda: sorted(os.listdir(b.path / "job")) == ["blockmgr-b", "state"],
             what="node A's scratch dir to go with its session")
    wait_for(lambda: os.stat(b.path / "job").st_nlink == 4, what="the parent's link count")
    assert read_cold(b.path / "job" / "blockmgr-b" / "f") == mine
    assert not block_keys(mine) & file_bucket.block_objects()
    b.umount()
    a.mount()  # a node's scratch dirs go with it
    assert sorted(os.listdir(a.path / "job")) == ["state"]
    assert (a.path / "job" / "state" / "copy.sst").read_bytes() == shuffle
    a.umount()
    fsck = fusestate("fsck", file_bucket.url, "--meta", pg_url, check=False)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def test_bad_scratch_pattern_is_refused(make_mount, file_bucket: Bucket) -> None:
    m: Mount = make_mount(file_bucket, extra=["--scratch", "a/b"])
    assert_one_line_error(m.try_mount(), "--scratch", "a/b")


def test_snapshot_and_restore_leave_scratch_out(tmp_path: Path) -> None:
    """The metadata snapshot shipped to the bucket has no scratch rows, and a restore counts
    a directory's links from the names it really has."""
    async def body() -> None:
        engine = SQLiteEngine(str(tmp_path / "meta.db"))
        d = await engine.create(ROOT_INODE, b"blockmgr-1", NewNode(stat.S_IFDIR | 0o755, 0, 0, scratch_name=True))
        f = await engine.create(d.id, b"shuffle.data", NewNode(stat.S_IFREG | 0o644, 0, 0))
        assert d.scratch and f.scratch
        await engine.commit_blocks(f.id, {0: ("k-scratch", 10)}, 10, 1)
        shipped = journal.compact(engine.journal_tail(0))
        assert all(c.op == "del" for c in shipped if c.table != "inodes" or c.rowkey != "1"), shipped
        engine.snapshot_copy(str(tmp_path / "snap.db"))
        db = sqlite3.connect(tmp_path / "snap.db")
        assert db.execute("SELECT COUNT(*) FROM inodes WHERE scratch = 1").fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM blocks").fetchone()[0] == 0
        assert db.execute("SELECT nlink FROM inodes WHERE id = 1").fetchone()[0] == 3  # as shipped
        journal.recount_links(db)
        assert db.execute("SELECT nlink FROM inodes WHERE id = 1").fetchone()[0] == 2
        db.close()
        engine.close()
        engine = SQLiteEngine(str(tmp_path / "meta.db"))  # the next mount purges scratch
        assert (await engine.start()).keys == ["k-scratch"]
        assert (await engine.getattr(ROOT_INODE)).nlink == 2 and engine.stats().inodes == 1
        engine.close()

    trio.run(body)


def test_a_scratch_file_linked_into_the_volume_is_promoted(make_mount, file_bucket: Bucket) -> None:
    """A RocksDB working dir kept as scratch: its SSTs stay on the node until a commit links
    one into the checkpoint, which uploads it then. Promoted files read back the same under
    both names, keep taking writes, and are part of the volume on a fresh node; what was
    never linked out never reaches the bucket."""
    m: Mount = make_mount(file_bucket, extra=SCRATCH).mount()
    work = m.path / "blockmgr-w" / "workingDir"
    committed, compacted_away = rand(9 * MiB + 11, 7), rand(5 * MiB, 8)
    write(work / "000012.sst", committed)
    write(work / "000011.sst", compacted_away)
    write(work / "CURRENT.tmp", b"MANIFEST-000005\n")
    (m.path / "ckpt").mkdir()
    os.link(work / "000012.sst", m.path / "ckpt" / "000012.sst")
    os.rename(work / "CURRENT.tmp", m.path / "ckpt" / "CURRENT")  # a rename out promotes too
    os.unlink(work / "000011.sst")
    st = settle(m)
    assert (st["cache"]["promoted_files"], st["cache"]["promoted_bytes"]) == (2, len(committed) + 16)
    assert st["cache"]["scratch_files"] == 0
    assert file_bucket.block_objects() == block_keys(committed) | block_keys(b"MANIFEST-000005\n")
    assert os.stat(work / "000012.sst").st_nlink == 2
    assert read_cold(m.path / "ckpt" / "000012.sst") == committed
    with open(work / "000012.sst", "ab") as f:  # still the same file under its scratch name
        f.write(b"tail")
    assert read_cold(m.path / "ckpt" / "000012.sst") == committed + b"tail"
    m.umount()

    m.wipe_cache()  # a fresh node
    m.mount()
    assert sorted(os.listdir(m.path)) == ["ckpt"]
    assert read_cold(m.path / "ckpt" / "000012.sst") == committed + b"tail"
    assert (m.path / "ckpt" / "CURRENT").read_bytes() == b"MANIFEST-000005\n"
    assert os.stat(m.path / "ckpt" / "000012.sst").st_nlink == 1
    os.unlink(m.path / "ckpt" / "000012.sst")
    m.umount()
    fsck = fusestate("fsck", file_bucket.url, check=False)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    assert not block_keys(compacted_away) & file_bucket.block_objects()


@pytest.mark.parametrize("engine, front", [("sqlite", "pyfuse3"), ("postgresql", "passthrough")])
def test_a_scratch_table_is_stored_while_written_and_its_link_takes_those_blocks(
        make_mount, file_bucket: Bucket, engine: str, front: str, request: pytest.FixtureRequest) -> None:
    """RocksDB's tables in a scratch working dir (``--store-ahead '*.sst'``, the default) have
    their blocks stored as they are written and once closed, so a commit's link finds them
    stored. A table changed after its writer closed is checked again once closed again: its
    changed block stored again, and the link then reads nothing of it. A table deleted
    without a link, or left when the mount ends, is let go, and on the embedded engine never
    reaches the bucket. Files of other names are not stored ahead."""
    if front == "passthrough" and (missing := frontends.passthrough_available()):
        pytest.skip(missing)
    m: Mount = make_mount(file_bucket, extra=[*SCRATCH, "--frontend", front, *engine_args(engine, request)]).mount()
    work = m.path / "blockmgr-w" / "db"
    linked, dropped, left = rand(9 * MiB + 11, 21), rand(5 * MiB, 22), rand(4 * MiB + 3, 23)
    write(work / "000012.sst", linked)   # two whole blocks and a tail
    write(work / "000011.sst", dropped)  # a whole block and a tail
    write(work / "000013.sst", left)     # a whole block and a tail
    write(work / "LOG", rand(5 * MiB, 24))
    wait_for(lambda: m.status()["cache"]["stored_ahead_blocks"] >= 7, what="the tables' blocks stored ahead")
    assert m.status()["cache"]["stored_ahead_blocks"] == 7  # not the LOG's
    with open(work / "000012.sst", "r+b") as f:  # opened again and changed before its link
        f.seek(100)
        f.write(b"changed")
    expected = linked[:100] + b"changed" + linked[107:]
    wait_for(lambda: m.status()["cache"]["stored_ahead_blocks"] == 8, what="the changed block stored again")
    (m.path / "ckpt").mkdir()
    os.link(work / "000012.sst", m.path / "ckpt" / "000012.sst")
    os.unlink(work / "000011.sst")
    wait_for(lambda: m.status()["cache"]["stored_ahead_abandoned"] == 3,
             what="the changed block's old bytes and the deleted table's let go")
    st = settle(m)["cache"]
    assert (st["stored_ahead_used"], st["promoted_files"]) == (3, 1), st
    # Checked after its last write: the link took the stored blocks without reading the file
    # (where the cache disk gives every write a new ctime, as ext4 on Linux 6.13+ does).
    assert st["unread_promotions"] == int(ScratchFiles(str(m.cache_dir)).fine_ctime()), st
    if engine == "sqlite":
        assert file_bucket.block_objects() == block_keys(expected)
    else:
        assert block_keys(expected) <= file_bucket.block_objects()
    m.umount()
    m.wipe_cache()  # a fresh node
    m.mount()
    assert read_cold(m.path / "ckpt" / "000012.sst") == expected
    assert os.listdir(m.path) == ["ckpt"]
    m.umount()
    if engine == "sqlite":  # what the last mount left stored ahead was let go at its end
        assert file_bucket.block_objects() == block_keys(expected)
    fsck = fusestate("fsck", file_bucket.url, *engine_args(engine, request), check=False)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def test_promotion_and_loads_on_a_shared_volume(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    """Node A links an SST out of its scratch working dir into the checkpoint: node B reads
    it at once, and loads it by linking it into its own scratch dir. Each scratch name goes
    with its node's session; the file lives while any name is left."""
    opts = [*SCRATCH, "--meta", pg_url, "--metrics-addr", "off", "--session-timeout", "3"]
    a = make_mount(file_bucket, name="node-a", cache="cache-a", extra=opts).mount()
    b = make_mount(file_bucket, name="node-b", cache="cache-b", extra=opts).mount()
    sst = rand(6 * MiB + 5, 9)
    write(a.path / "blockmgr-a" / "000020.sst", sst)
    (a.path / "ckpt").mkdir()
    os.link(a.path / "blockmgr-a" / "000020.sst", a.path / "ckpt" / "000020.sst")
    assert block_keys(sst) <= file_bucket.block_objects()  # uploaded before the link returned
    assert read_cold(b.path / "ckpt" / "000020.sst") == sst
    (b.path / "blockmgr-b").mkdir()
    os.link(b.path / "ckpt" / "000020.sst", b.path / "blockmgr-b" / "000020.sst")
    assert read_cold(b.path / "blockmgr-b" / "000020.sst") == sst
    with pytest.raises(OSError) as exc:  # not into another node's scratch
        os.link(b.path / "ckpt" / "000020.sst", b.path / "blockmgr-a" / "x.sst")
    assert exc.value.errno == errno.EXDEV

    a.umount()
    wait_for(lambda: "blockmgr-a" not in os.listdir(b.path), what="node A's scratch dir to go with its session")
    wait_for(lambda: os.stat(b.path / "ckpt" / "000020.sst").st_nlink == 2, what="A's scratch name to go")
    os.unlink(b.path / "ckpt" / "000020.sst")
    assert read_cold(b.path / "blockmgr-b" / "000020.sst") == sst  # its last name is B's
    b.umount()
    a.mount()
    assert sorted(os.listdir(a.path)) == ["ckpt"] and not os.listdir(a.path / "ckpt")
    a.umount()
    fsck = fusestate("fsck", file_bucket.url, "--meta", pg_url, check=False)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def reads(path: Path) -> Optional[bytes]:
    """``read_cold``, or None while another node's cached name still points at a removed file."""
    try:
        return read_cold(path)
    except FileNotFoundError:
        return None


def test_renames_across_a_shared_scratch_dir_keep_files_whole(make_mount, file_bucket: Bucket, pg_url: str) -> None:
    """A scratch dir's contents live on its node (not in the database): a file renamed out of
    it becomes a file of the volume the other node reads, replacing what was there at once; a
    file of the volume renamed into it leaves the volume, and this node keeps its data, even
    once no name of it is left in the database; a directory does not cross (EXDEV)."""
    opts = [*SCRATCH, "--meta", pg_url, "--metrics-addr", "off"]
    a = make_mount(file_bucket, name="node-a", cache="cache-a", extra=opts).mount()
    b = make_mount(file_bucket, name="node-b", cache="cache-b", extra=opts).mount()
    work, out = a.path / "blockmgr-a", a.path / "out"
    out.mkdir()
    old, new = rand(MiB + 1, 11), rand(2 * MiB + 3, 12)
    write(out / "f", old)
    write(work / "tmp" / "f", new)
    assert read_cold(b.path / "out" / "f") == old
    os.rename(work / "tmp" / "f", out / "f")  # promoted, then renamed over the old one
    assert os.listdir(work / "tmp") == []
    wait_for(lambda: reads(b.path / "out" / "f") == new, timeout=10,  # B's kernel's name: --attr-timeout
             what="B to see the file renamed over the old one")
    assert block_keys(new) <= file_bucket.block_objects()
    assert a.status()["cache"]["promoted_files"] == 1

    os.rename(out / "f", work / "g")  # into the scratch dir: out of the volume
    wait_for(lambda: not (b.path / "out" / "f").exists(), timeout=10, what="B to see the name go")
    assert os.listdir(b.path / "blockmgr-a") == []
    os.link(work / "g", work / "h")
    assert os.stat(work / "g").st_nlink == 2
    assert read_cold(work / "h") == new
    os.unlink(work / "g")
    assert read_cold(work / "h") == new  # held by A while its scratch names last
    with pytest.raises(OSError) as exc:
        os.rename(work / "tmp", out / "tmp")
    assert exc.value.errno == errno.EXDEV
    os.rename(work / "h", out / "back")  # and out again: a file of the volume all along
    assert read_cold(b.path / "out" / "back") == new
    a.umount()
    b.umount()
    fsck = fusestate("fsck", file_bucket.url, "--meta", pg_url, check=False)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
