"""A restarting query's latest state snapshot, put into the page cache while the JVM starts.

A RocksDB state store loaded on a fresh node links (with the shim) or copies the files of its
latest snapshot out of the checkpoint, and its first batch then reads most of them. The daemon
fills linked files into the kernel's page cache, but only once each store loads, 10-25 s into a
restart. The files are known long before: the checkpoint names the last committed batch
(``commits/N``), each store's snapshots are ``<version>.zip`` files whose ``metadata`` entry
lists the SSTs they reference (``SSTs/<dfsSstFileName>``), and the changelogs after the
snapshot are replayed. Only those: older snapshots' SSTs and changelogs stay in the bucket.

The files are looked up through the mount (so the kernel knows their inodes) and handed to the
daemon by inode over its control socket; the daemon fills them in the background, the same way
as a link's (``--prefetch-links``), and a link that comes later finds them filled. The kernel
stores pages only into inodes it still has, and under memory pressure it forgets a file nothing
holds: a 4 GB restart lost two thirds of its fill that way (each such fill stops at its first
block, and the load's links fetched the files again). So the caller holds each file open, read
only, until the loads have linked them (``SnapshotFill.release``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from fusestate.daemon.control import request
from fusestate.daemon.paths import control_socket
from fusestate.errors import UserError

_VERSION = re.compile(r"^(\d+)\.(zip|changelog)$")
_BATCH = re.compile(r"^\d+$")
STORE_DEPTH = 3  # state/<operator>/<partition>[/<store name>]


@dataclass
class SnapshotFill:
    """What was asked for: files and bytes found, and what the daemon queued."""
    stores: int = 0
    files: int = 0
    bytes: int = 0
    queued: int = 0
    queued_bytes: int = 0
    seconds: float = 0.0
    paths: list[str] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # open file descriptors: the kernel keeps the inodes

    def as_dict(self) -> dict:
        doc = asdict(self)
        doc.pop("paths")
        doc["held"] = len(self.held)
        return doc

    def release(self) -> None:
        """Close the files held open: once the loads have linked them (their RocksDB holds them)."""
        while self.held:
            with contextlib.suppress(OSError):
                os.close(self.held.pop())


def committed_version(checkpoint: Path) -> Optional[int]:
    """The state version a restart loads: the last committed batch's, ``N + 1``; None
    before the first commit."""
    try:
        batches = [int(n) for n in os.listdir(checkpoint / "commits") if _BATCH.match(n)]
    except FileNotFoundError:
        return None
    return max(batches) + 1 if batches else None


def _store_dirs(state: Path) -> list[Path]:
    """Directories under ``state`` holding a store's versions (``N.zip``, ``N.changelog``),
    operator by operator, partition by partition."""
    found: list[Path] = []

    def walk(d: Path, depth: int) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: (not e.name.isdigit(), int(e.name) if e.name.isdigit() else 0, e.name))
        except (FileNotFoundError, NotADirectoryError):
            return
        if any(_VERSION.match(e.name) for e in entries):
            found.append(d)
        if depth < STORE_DEPTH:
            for e in entries:
                if e.is_dir(follow_symlinks=False) and not e.name.startswith(("_", ".")) and e.name != "SSTs" \
                        and e.name != "logs":
                    walk(Path(e.path), depth + 1)

    walk(state, 0)
    return found


def _snapshot_files(store: Path, snapshot: int) -> list[Path]:
    """The SST and log files ``<snapshot>.zip`` references, from its ``metadata`` entry."""
    with zipfile.ZipFile(store / f"{snapshot}.zip") as z:
        text = z.read("metadata").decode()
    meta = json.loads(text[text.index("{"):])  # a version line ("v1") comes first
    files = [store / "SSTs" / f["dfsSstFileName"] for f in meta.get("sstFiles", [])]
    files += [store / "logs" / f["dfsLogFileName"] for f in meta.get("logFiles", [])]
    return files


def latest_snapshot_files(checkpoint: str | os.PathLike) -> tuple[int, list[Path]]:
    """Every file a restart's state store loads: per store, the latest snapshot at or below
    the committed version (its zip and the files it references) and the changelogs after it.
    Returns the number of stores and the paths, store by store."""
    checkpoint = Path(checkpoint)
    version = committed_version(checkpoint)
    if version is None:
        return 0, []
    stores = _store_dirs(checkpoint / "state")
    paths: list[Path] = []
    for store in stores:
        versions: dict[str, set[int]] = {"zip": set(), "changelog": set()}
        for name in os.listdir(store):
            m = _VERSION.match(name)
            if m and int(m.group(1)) <= version:
                versions[m.group(2)].add(int(m.group(1)))
        snapshot = max(versions["zip"], default=0)
        if snapshot:
            try:
                paths.append(store / f"{snapshot}.zip")
                paths += _snapshot_files(store, snapshot)
            except (OSError, KeyError, ValueError, zipfile.BadZipFile):
                pass  # one unreadable zip: the load reports it; the rest is still worth filling
        paths += [store / f"{v}.changelog" for v in sorted(versions["changelog"]) if v > snapshot]
    return len(stores), paths


def fill_latest_snapshot(checkpoint: str | os.PathLike, mount: str, *,
                         runtime: Optional[str] = None) -> SnapshotFill:
    """Ask ``mount``'s daemon to put the restart's latest snapshot (``latest_snapshot_files``)
    into the page cache. Returns at once; the daemon fills in the background. Call it before
    the Spark session starts, with the checkpoint's local path on the mount, and ``release()``
    the result once the query's first batch has run."""
    started = time.monotonic()
    result = SnapshotFill()
    result.stores, paths = latest_snapshot_files(checkpoint)
    inodes: list[int] = []
    for path in paths:
        try:
            st = os.stat(path)  # the lookup that lets the daemon hand its pages to the kernel
        except FileNotFoundError:
            continue  # deleted by maintenance since the listing
        inodes.append(st.st_ino)
        result.files += 1
        result.bytes += st.st_size
        result.paths.append(str(path))
    if inodes:
        reply = request(control_socket(os.path.abspath(mount), runtime), {"command": "fill", "inodes": inodes})
        if not reply.get("ok"):
            raise UserError(f"filling the page cache: {reply.get('error')}")
        result.queued, result.queued_bytes = reply["queued"], reply["queued_bytes"]
    # Opened after the request: the daemon does not fill a file that is open here.
    for path in result.paths:
        with contextlib.suppress(OSError):
            result.held.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
    result.seconds = round(time.monotonic() - started, 3)
    return result
