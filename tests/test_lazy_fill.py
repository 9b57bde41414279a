"""A lazy page fill on a real mount: RocksDB tables' tails first, data blocks later, readers first.

Real tables (written by db_bench) on a volume in moto, linked on a fresh node, as a Spark
state store's load links its checkpoint's files: what an open of each table reads (index,
filters, footer) reaches the page cache before any data block, every byte in the end; a read
of a data block meanwhile is answered by a range read of its own, not queued behind the
background's whole-block fetches. ``--read-trace`` records it all.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import ENGINES, engine_args, fusestate, mostly_resident, new_bucket, resident_bytes, wait_for

from fusestate import sst

PAGE = 4096


@pytest.fixture(params=ENGINES)
def engine(request) -> list[str]:
    """The mount options of each metadata engine: the fill works on either."""
    return engine_args(request.param, request)


def put_files(m, tables: list[Path], other: bytes) -> list[Path]:
    """The tables and one other file on the volume, then the node lost (a fresh cache)."""
    m.mount()
    src = m.path / "checkpoint"
    src.mkdir()
    for table in tables:
        shutil.copyfile(table, src / table.name)
    (src / "1.changelog").write_bytes(other)
    m.umount()
    m.wipe_cache()
    m.mount()
    return [src / t.name for t in tables] + [src / "1.changelog"]


def link_all(m, files: list[Path]) -> list[Path]:
    work = m.path / "work"
    work.mkdir()
    linked = []
    for f in files:
        os.link(f, work / f.name)
        linked.append(work / f.name)
    return linked


def trace_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tails_first_then_every_byte(make_mount, tmp_path: Path, request, rocksdb_tables: list[Path],
                                     engine: list[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    m = make_mount(new_bucket("s3", tmp_path, request),
                   extra=[*engine, "--block-size", "256K", "--read-trace", str(trace)])
    other = os.urandom(300_000)
    files = put_files(m, rocksdb_tables[:2], other)
    inos = {f.stat().st_ino: f for f in files}
    linked = link_all(m, files)
    wait_for(lambda: m.status()["page_fill"]["pending_bytes"] == 0, what="the fill to finish")
    fill = m.status()["page_fill"]
    tails = {t.name: sst.data_end_of_file(str(t)) // PAGE * PAGE for t in rocksdb_tables[:2]}
    sizes = {t.name: t.stat().st_size for t in rocksdb_tables[:2]}
    assert fill["tables"] == 2 and fill["files"] == 3 and fill["failures"] == fill["stopped"] == 0, fill
    assert fill["tail_bytes"] == sum(sizes[n] - tails[n] for n in tails)
    assert fill["first_bytes"] == fill["tail_bytes"] + len(other)
    assert fill["body_bytes"] == sum(tails.values())  # the data blocks, up to each tail: nothing stored twice
    row = next(line for line in fusestate("status", str(m.path)).stdout.splitlines() if line.startswith("page fill"))
    assert row.split(None, 2)[2].startswith("lazy: ") and "2 tables' tails" in row and row.endswith("0 bytes pending"), row
    total = sum(-(-f.stat().st_size // PAGE) * PAGE for f in linked)  # whole pages
    assert mostly_resident(linked, total), (resident_bytes(linked), total)
    for path, table in zip(linked, rocksdb_tables[:2]):
        assert path.read_bytes() == table.read_bytes()
    assert linked[2].read_bytes() == other

    fills = [e for e in trace_lines(trace) if e["e"] == "fill"]
    firsts = [e for e in fills if e["part"] == "first"]
    datas = [e for e in fills if e["part"] == "data"]
    assert datas and max(e["t"] for e in firsts) <= min(e["t"] for e in datas)
    for ino, f in inos.items():
        mine = [e for e in firsts if e["ino"] == ino]
        if f.name in tails:  # a table: its tail alone, first
            assert [(e["off"], e["n"]) for e in mine] == [(tails[f.name], sizes[f.name] - tails[f.name])]
        else:  # the other file: whole, in the first part
            assert sum(e["n"] for e in mine) == len(other) and not any(e["ino"] == ino for e in datas)


def test_a_read_is_not_queued_behind_the_background(make_mount, tmp_path: Path, request,
                                                    rocksdb_tables: list[Path], engine: list[str]) -> None:
    """Whole-block fetches from the bucket take 4 s each here (injected); range reads do not.
    A table's tail arrives by range reads; its data block is then fetched in the background,
    and a point read of that block meanwhile is answered at once by a range read of its own."""
    m = make_mount(new_bucket("s3", tmp_path, request), extra=engine)
    table = rocksdb_tables[0]
    files = put_files(m, [table], b"x")
    m.umount()
    m.mount(env={"FUSESTATE_FAULTS": "pause=4,ops=get,under=blocks/"})
    [linked, _] = link_all(m, files)
    wait_for(lambda: m.status()["page_fill"]["tables"] == 1, what="the table's tail")
    assert m.status()["page_fill"]["body_bytes"] == 0
    end = sst.data_end_of_file(str(table))
    offset = end // 2 // PAGE * PAGE
    fd = os.open(linked, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as RocksDB does: no readahead
        assert os.pread(fd, PAGE, offset) == table.read_bytes()[offset:offset + PAGE]
    finally:
        os.close(fd)
    fill = m.status()["page_fill"]
    assert fill["body_bytes"] == 0 and fill["pending_bytes"] > 0, fill  # the background is still fetching
    wait_for(lambda: m.status()["page_fill"]["pending_bytes"] == 0, timeout=60, what="the data blocks")
    assert m.status()["page_fill"]["files"] == 2
    assert linked.read_bytes() == table.read_bytes()


@pytest.mark.parametrize("mode", ["tails", "off"])
def test_other_modes(make_mount, tmp_path: Path, request, rocksdb_tables: list[Path], mode: str) -> None:
    """``tails``: only what an open reads reaches the page cache; ``off``: nothing. Reads are
    right either way."""
    m = make_mount(new_bucket("s3", tmp_path, request), extra=["--prefetch-links", mode])
    table = rocksdb_tables[0]
    files = put_files(m, [table], os.urandom(10_000))
    [linked, _] = link_all(m, files)
    if mode == "tails":
        wait_for(lambda: m.status()["page_fill"]["pending_bytes"] == 0, what="the fill")
        fill = m.status()["page_fill"]
        tail = table.stat().st_size - sst.data_end_of_file(str(table)) // PAGE * PAGE
        assert fill["tables"] == 1 and fill["tail_bytes"] == tail and fill["body_bytes"] == 0, fill
        assert resident_bytes([linked]) == -(-tail // PAGE) * PAGE
    else:
        assert m.status()["page_fill"]["bytes"] == 0
        assert resident_bytes([linked]) == 0
    assert linked.read_bytes() == table.read_bytes()
