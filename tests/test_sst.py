"""Where a RocksDB table's data blocks end: the boundary a lazy page fill splits a table at.

Checked against RocksDB's own tools: tables written by db_bench, and ``sst_dump``'s account
of their data blocks.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from fusestate import sst


def dumped_data_size(table: Path) -> int:
    out = subprocess.run(["sst_dump", f"--file={table}", "--show_properties"], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return int(re.search(r"data block size: (\d+)", out).group(1))


def test_the_data_blocks_end_where_rocksdb_says(rocksdb_tables: list[Path]) -> None:
    for table in rocksdb_tables:
        end = sst.data_end_of_file(str(table))
        assert end == dumped_data_size(table), table
        # The rest is the index, the filters, the properties and the footer: a small tail.
        assert 0 < table.stat().st_size - end < table.stat().st_size // 10


def test_the_parse_reads_only_the_tail(rocksdb_tables: list[Path]) -> None:
    table = rocksdb_tables[0]
    size = table.stat().st_size
    data = table.read_bytes()
    asked: list[tuple[int, int]] = []

    def read(offset: int, length: int) -> bytes:
        asked.append((offset, length))
        return data[offset:offset + length]

    end = sst.run_steps(sst.data_end_steps(size), read)
    assert end == dumped_data_size(table)
    assert all(offset >= end for offset, _ in asked), asked
    assert sum(length for _, length in asked) <= 64 * 1024


def test_files_that_are_not_tables_have_no_boundary(rocksdb_tables: list[Path], tmp_path: Path) -> None:
    db = rocksdb_tables[0].parent
    for other in ("CURRENT", "IDENTITY"):
        assert sst.data_end_of_file(str(db / other)) is None
    noise = tmp_path / "noise"
    noise.write_bytes(os.urandom(100_000))
    assert sst.data_end_of_file(str(noise)) is None
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert sst.data_end_of_file(str(empty)) is None


def test_a_damaged_table_is_not_taken_for_one(rocksdb_tables: list[Path], tmp_path: Path) -> None:
    data = bytearray(rocksdb_tables[0].read_bytes())
    cut = tmp_path / "cut.sst"
    cut.write_bytes(bytes(data[: len(data) // 2]))  # the footer is gone
    assert sst.data_end_of_file(str(cut)) is None
    # The footer names a meta index past the end of the file.
    footer = data[-sst.FOOTER_BYTES:]
    bad = tmp_path / "bad.sst"
    bad.write_bytes(bytes(footer[:1]) + b"\xff" * 9 + b"\x01" + bytes(footer[11:]))
    assert sst.data_end_of_file(str(bad)) is None
