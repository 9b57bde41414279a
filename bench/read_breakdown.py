"""What a restart read of its state, by RocksDB's purpose, against what the node fetched.

The spark-restart scenario's ``fusestate+shim@s3:trace`` setup restarts with no page fill at
all and ``--read-trace`` (fusestate/read_trace.py): every page RocksDB and Spark read reaches
the daemon once (the page cache was dropped; later reads of it do not), and every bucket read
is recorded. Each read of a table (``.sst``) is told apart by where it falls
(fusestate/sst.py): at or after the end of the data blocks it is what opening the table reads
(index, filters, properties, footer); before it, a data block, read by a scan (a read of
64 KiB or more, or one that starts where the last read of the same file ended: a compaction or
an iteration reading block after block) or else by a point lookup.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fusestate import sst

PAGE = 4096
SCAN_BYTES = 64 * 1024
PURPOSES = {
    "open": "tables: index, filters, footer (what an open reads)",
    "point": "tables: data blocks, point reads (< 64 KiB, not after the last read)",
    "scan": "tables: data blocks, scans (>= 64 KiB or sequential: compaction or iteration)",
    "changelog": "changelogs (replayed by the load)",
    "zip": "snapshot zips (MANIFEST, OPTIONS, metadata)",
    "other": "other files",
}
PHASES = ("before_batch", "batch")  # before the first batch began; while it ran


def kind_of(name: str) -> str:
    return {".sst": "table", ".changelog": "changelog", ".zip": "zip"}.get(os.path.splitext(name)[1], "other")


def operator_of(path: str) -> str:
    """The stateful operator a checkpoint file belongs to (``.../state/<operator>/...``); ""
    for a path outside the checkpoint's state (a load's working dir links the same files)."""
    parts = Path(path).parts
    return parts[parts.index("state") + 1] if "state" in parts[:-1] else ""


def state_files(root: Path) -> dict[int, dict[str, Any]]:
    """Every regular file under ``root`` by inode: kind, size and, for tables, where their data
    blocks end (read through the mount, after the restart was measured)."""
    files: dict[int, dict[str, Any]] = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if st.st_ino in files:
                files[st.st_ino]["operator"] = files[st.st_ino]["operator"] or operator_of(path)
                continue
            if not os.path.isfile(path):
                continue
            info: dict[str, Any] = {"kind": kind_of(name), "size": st.st_size, "operator": operator_of(path)}
            if info["kind"] == "table":
                info["data_end"] = sst.data_end_of_file(path)
            files[st.st_ino] = info
    return files


def purpose(info: dict[str, Any], off: int, n: int, sequential: bool = False) -> str:
    """What a read of ``n`` bytes at ``off`` was for; ``sequential``: it starts where the last
    read of the file ended (the first block of a scan counts as a point read)."""
    if info["kind"] != "table":
        return info["kind"]
    end = info.get("data_end")
    if end is None:
        return "other"
    if off >= end // PAGE * PAGE:
        return "open"
    return "scan" if n >= SCAN_BYTES or sequential else "point"


def breakdown(trace: Path, files: dict[int, dict[str, Any]], batch_start: float, batch_done: float) -> dict[str, Any]:
    """Bytes read (and distinct bytes) by purpose and bytes fetched, before the first batch
    and while it ran; ``batch_start`` and ``batch_done`` are wall-clock seconds."""
    reads = {p: {ph: {"bytes": 0, "reads": 0} for ph in PHASES} for p in PURPOSES}
    fetched = {ph: {"whole_blocks": 0, "ranges": 0} for ph in PHASES}
    touched: dict[tuple[int, str], set[int]] = {}
    sizes: dict[str, int] = {}  # the batch's table reads by size
    read_end: dict[int, int] = {}  # where the last read of each file ended
    for line in trace.read_text().splitlines():
        e = json.loads(line)
        if e["t"] > batch_done:
            continue
        phase = "before_batch" if e["t"] < batch_start else "batch"
        if e["e"] == "read":
            info = files.get(e["ino"])
            if info is None:
                continue  # a file removed since (the job's own scratch)
            sequential = read_end.get(e["ino"]) == e["off"] and e["off"] > 0
            read_end[e["ino"]] = e["off"] + e["n"]
            p = purpose(info, e["off"], e["n"], sequential)
            if phase == "batch" and info["kind"] == "table":
                size = f"<= {1 << max(12, (e['n'] - 1).bit_length())}"  # the power of two at or above, from 4 KiB
                sizes[size] = sizes.get(size, 0) + 1
            reads[p][phase]["bytes"] += e["n"]
            reads[p][phase]["reads"] += 1
            pages = touched.setdefault((e["ino"], p), set())
            pages.update(range(e["off"] // PAGE, -(-(e["off"] + e["n"]) // PAGE)))
        elif e["e"] in ("get", "get_range"):
            fetched[phase]["whole_blocks" if e["e"] == "get" else "ranges"] += e["n"]
    distinct = {p: sum(len(pages) for (_, q), pages in touched.items() if q == p) * PAGE for p in PURPOSES}
    by_operator: dict[str, dict[str, int]] = {"scan": {}, "point": {}}
    for (ino, p), pages in touched.items():
        if p in by_operator:
            op = files[ino]["operator"] or "?"
            by_operator[p][op] = by_operator[p].get(op, 0) + len(pages) * PAGE
    tables_read = {ino for (ino, p) in touched if p in ("open", "point", "scan")}
    tables = [files[i] for i in tables_read]
    return {
        "reads": reads, "distinct_bytes": distinct, "fetched": fetched, "scan_bytes_by_operator": by_operator["scan"],
        "point_bytes_by_operator": by_operator["point"], "read_sizes": sizes,
        "tables_read": len(tables_read), "tables_bytes": sum(t["size"] for t in tables),
        "tables_data_bytes": sum(t.get("data_end") or 0 for t in tables),
        "tables_tail_bytes": sum(t["size"] - (t.get("data_end") or t["size"]) for t in tables),
        "batch_s": round(batch_done - batch_start, 2),
    }
