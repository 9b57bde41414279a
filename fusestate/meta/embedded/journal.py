"""The metadata journal: every row change, numbered, shipped to the bucket in order.

SQLite triggers append one journal row per change of ``inodes``, ``entries`` and
``blocks`` (the object table is derived and rebuilt on restore). The shipper
turns the unshipped tail into a segment, compacted to the last state of each row,
and uploads it only after every block that state references is in the bucket, so
the bucket always holds a consistent prefix of the history.

Segment names carry the writer's epoch and the sequence range they cover::

    meta/journal/<epoch:08d>-<first:016d>-<last:016d>.jsonl.gz
    meta/snapshot-<epoch:08d>-<seq:016d>.db
    meta/epochs/<epoch:08d>.json        {"epoch": E, "starts_after": seq}

A new epoch (takeover) records the sequence it continued from; segments or
snapshots of an older epoch that go past that point were written late by a
fenced-off holder and are ignored on restore.
"""

from __future__ import annotations

import gzip
import json
import re
import sqlite3
import stat
from dataclasses import dataclass
from typing import Any, Iterable, Optional

JOURNAL_PREFIX = "meta/journal/"
SNAPSHOT_PREFIX = "meta/snapshot-"
EPOCH_PREFIX = "meta/epochs/"

_SEGMENT_RE = re.compile(r"meta/journal/(\d{8})-(\d{16})-(\d{16})\.jsonl\.gz$")
_SNAPSHOT_RE = re.compile(r"meta/snapshot-(\d{8})-(\d{16})\.db$")

# Row images as JSON arrays; BLOB columns travel as hex.
_INODE_IMAGE = ("json_array(NEW.id, NEW.mode, NEW.uid, NEW.gid, NEW.size, NEW.nlink, NEW.atime_ns,"
                " NEW.mtime_ns, NEW.ctime_ns, NEW.rdev,"
                " CASE WHEN NEW.symlink_target IS NULL THEN NULL ELSE hex(NEW.symlink_target) END)")
_ENTRY_IMAGE = "json_array(NEW.id, NEW.parent, hex(NEW.name), NEW.inode)"
_BLOCK_IMAGE = "json_array(NEW.inode, NEW.idx, NEW.key, NEW.size)"

# Scratch inodes (node-local, see Inode.scratch) never enter the journal: their inode and
# block rows are skipped, and a name that points at one, or is in one (a file of the volume
# linked into a scratch dir), is journaled as deleted (a rename can move a scratch dir onto
# a name that was shipped). Replaying the delete of a row that
# never shipped deletes nothing.
_NOT_SCRATCH = "(SELECT scratch FROM inodes WHERE id = {}) IS NOT 1"
_SHIPPED_ENTRY = f"{_NOT_SCRATCH.format('NEW.inode')} AND {_NOT_SCRATCH.format('NEW.parent')}"
_ENTRY_CHANGE = (f"VALUES ('entries', CASE WHEN {_SHIPPED_ENTRY} THEN 'put' ELSE 'del' END,"
                 f" NEW.id, CASE WHEN {_SHIPPED_ENTRY} THEN {_ENTRY_IMAGE} END)")

_TRIGGERS = [
    ("j_inodes_ins", "AFTER INSERT ON inodes", "NEW.scratch = 0",
     f"VALUES ('inodes', 'put', NEW.id, {_INODE_IMAGE})"),
    ("j_inodes_upd", "AFTER UPDATE ON inodes", "NEW.scratch = 0",
     f"VALUES ('inodes', 'put', NEW.id, {_INODE_IMAGE})"),
    ("j_inodes_del", "AFTER DELETE ON inodes", None, "VALUES ('inodes', 'del', OLD.id, NULL)"),
    ("j_entries_ins", "AFTER INSERT ON entries", None, _ENTRY_CHANGE),
    ("j_entries_upd", "AFTER UPDATE ON entries", None, _ENTRY_CHANGE),
    ("j_entries_del", "AFTER DELETE ON entries", None, "VALUES ('entries', 'del', OLD.id, NULL)"),
    ("j_blocks_ins", "AFTER INSERT ON blocks", _NOT_SCRATCH.format("NEW.inode"),
     f"VALUES ('blocks', 'put', NEW.inode || ':' || NEW.idx, {_BLOCK_IMAGE})"),
    ("j_blocks_upd", "AFTER UPDATE ON blocks", _NOT_SCRATCH.format("NEW.inode"),
     f"VALUES ('blocks', 'put', NEW.inode || ':' || NEW.idx, {_BLOCK_IMAGE})"),
    ("j_blocks_del", "AFTER DELETE ON blocks", None,
     "VALUES ('blocks', 'del', OLD.inode || ':' || OLD.idx, NULL)"),
]

# Triggers are dropped and made again at every open, so a database written by an older
# release gets the current ones.
JOURNAL_SCHEMA = """
CREATE TABLE IF NOT EXISTS journal (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    tbl TEXT NOT NULL, op TEXT NOT NULL, rowkey TEXT NOT NULL, image TEXT
);
""" + "".join(
    f"DROP TRIGGER IF EXISTS {name};\nCREATE TRIGGER {name} {event}{f' WHEN {when}' if when else ''} BEGIN\n"
    f"    INSERT INTO journal (tbl, op, rowkey, image) {values}; END;\n"
    for name, event, when, values in _TRIGGERS)


@dataclass(frozen=True)
class Change:
    seq: int
    table: str
    op: str
    rowkey: str
    image: Optional[list[Any]]

    def to_json(self) -> str:
        return json.dumps([self.seq, self.table, self.op, self.rowkey, self.image], separators=(",", ":"))

    @staticmethod
    def from_json(line: str) -> "Change":
        seq, table, op, rowkey, image = json.loads(line)
        return Change(seq, table, op, rowkey, image)

    def block_key(self) -> Optional[str]:
        """The object a block-map put references."""
        if self.table == "blocks" and self.op == "put" and self.image:
            return self.image[2]
        return None


def compact(changes: Iterable[Change]) -> list[Change]:
    """The last change of each row, in the order those last changes happened."""
    last: dict[tuple[str, str], Change] = {}
    for change in changes:
        last.pop((change.table, change.rowkey), None)
        last[(change.table, change.rowkey)] = change
    return list(last.values())


@dataclass(frozen=True)
class SegmentHeader:
    """What a segment says about the blocks it references.

    A segment is uploaded while the blocks it references that were not yet in the bucket
    (``unconfirmed``) upload alongside it, and acknowledged once both are there. If the
    writer died in between, the segment is in the bucket and a block may not be: restore
    checks the unconfirmed blocks of every segment after ``acked_through`` (the newest
    sequence acknowledged when the segment started, after which nothing is known)."""

    acked_through: int = 0
    unconfirmed: tuple[str, ...] = ()


def encode_segment(changes: list[Change], header: SegmentHeader = SegmentHeader()) -> bytes:
    head = json.dumps({"acked_through": header.acked_through, "unconfirmed": list(header.unconfirmed)},
                      separators=(",", ":"))
    return gzip.compress("\n".join([head, *(c.to_json() for c in changes)]).encode() + b"\n", compresslevel=5)


def decode_segment_with_header(data: bytes) -> tuple[SegmentHeader, list[Change]]:
    header, changes = SegmentHeader(), []
    for line in gzip.decompress(data).decode().splitlines():
        if line.startswith("{"):
            fields = json.loads(line)
            header = SegmentHeader(int(fields.get("acked_through", 0)), tuple(fields.get("unconfirmed", ())))
        elif line:
            changes.append(Change.from_json(line))
    return header, changes


def decode_segment(data: bytes) -> list[Change]:
    return decode_segment_with_header(data)[1]


def segment_key(epoch: int, first: int, last: int) -> str:
    return f"{JOURNAL_PREFIX}{epoch:08d}-{first:016d}-{last:016d}.jsonl.gz"


def snapshot_key(epoch: int, seq: int) -> str:
    return f"{SNAPSHOT_PREFIX}{epoch:08d}-{seq:016d}.db"


def epoch_key(epoch: int) -> str:
    return f"{EPOCH_PREFIX}{epoch:08d}.json"


@dataclass(frozen=True)
class Segment:
    key: str
    epoch: int
    first: int
    last: int


@dataclass(frozen=True)
class Snapshot:
    key: str
    epoch: int
    seq: int


def parse_segments(keys: Iterable[str]) -> list[Segment]:
    out = []
    for key in keys:
        m = _SEGMENT_RE.search(key)
        if m:
            out.append(Segment(key, int(m.group(1)), int(m.group(2)), int(m.group(3))))
    return sorted(out, key=lambda s: (s.first, s.epoch))


def parse_snapshots(keys: Iterable[str]) -> list[Snapshot]:
    out = []
    for key in keys:
        m = _SNAPSHOT_RE.search(key)
        if m:
            out.append(Snapshot(key, int(m.group(1)), int(m.group(2))))
    return sorted(out, key=lambda s: (s.seq, s.epoch))


class History:
    """Which snapshots and segments belong to the volume's valid history."""

    def __init__(self, epochs: dict[int, int]) -> None:
        self.epochs = epochs  # epoch -> sequence it continued from

    def limit(self, epoch: int) -> Optional[int]:
        """The last sequence an epoch may have written before the next took over."""
        later = [starts for e, starts in self.epochs.items() if e > epoch]
        return min(later) if later else None

    def valid(self, epoch: int, last_seq: int) -> bool:
        limit = self.limit(epoch)
        return limit is None or last_seq <= limit

    def restore_plan(self, snapshots: list[Snapshot], segments: list[Segment]) -> tuple[Optional[Snapshot], list[Segment]]:
        """The newest valid snapshot and the contiguous valid segments after it."""
        base = None
        for snap in snapshots:
            if self.valid(snap.epoch, snap.seq):
                base = snap
        seq = base.seq if base else 0
        chain: list[Segment] = []
        # A segment uploaded again after a failed acknowledgement starts where the first
        # attempt did and reaches further: of two that start at one point, the longer wins.
        for seg in sorted(segments, key=lambda s: (s.first, -s.last, s.epoch)):
            if not self.valid(seg.epoch, seg.last) or seg.last <= seq:
                continue
            if seg.first != seq + 1:
                if seg.first > seq + 1:
                    break  # a gap: stop at the last consistent point
                continue
            chain.append(seg)
            seq = seg.last
        return base, chain


_INODE_COLS = "id, mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, rdev, symlink_target"


def apply_changes(db: sqlite3.Connection, changes: Iterable[Change]) -> None:
    """Replay changes into a metadata database (restore)."""
    for c in changes:
        if c.table == "inodes":
            if c.op == "put":
                img = list(c.image or [])
                img[10] = bytes.fromhex(img[10]) if img[10] is not None else None
                db.execute(f"INSERT OR REPLACE INTO inodes ({_INODE_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)", img)
            else:
                db.execute("DELETE FROM inodes WHERE id=?", (int(c.rowkey),))
        elif c.table == "entries":
            if c.op == "put":
                eid, parent, name, inode = c.image or []
                db.execute("INSERT OR REPLACE INTO entries (id, parent, name, inode) VALUES (?,?,?,?)",
                           (eid, parent, bytes.fromhex(name), inode))
            else:
                db.execute("DELETE FROM entries WHERE id=?", (int(c.rowkey),))
        elif c.table == "blocks":
            inode, idx = (int(x) for x in c.rowkey.split(":"))
            if c.op == "put":
                _, _, key, size = c.image or []
                db.execute("INSERT OR REPLACE INTO blocks (inode, idx, key, size) VALUES (?,?,?,?)",
                           (inode, idx, key, size))
            else:
                db.execute("DELETE FROM blocks WHERE inode=? AND idx=?", (inode, idx))


def recount_links(db: sqlite3.Connection) -> None:
    """Link counts from the names restored. Scratch names are never shipped but were
    counted on the node that made them, and that count was: a scratch dir in its parent's
    nlink, a file of the volume also named in a scratch dir (a state store's working dir
    links its checkpoint's files) in its own. A file left with no name is an orphan the
    next mount drops."""
    is_dir = f"& {0o170000}) = {stat.S_IFDIR}"  # (st_mode & S_IFMT) = S_IFDIR
    db.execute("UPDATE inodes SET nlink = 2 + (SELECT COUNT(*) FROM entries e JOIN inodes c ON c.id = e.inode"
               f" WHERE e.parent = inodes.id AND (c.mode {is_dir}) WHERE (mode {is_dir} AND nlink > 0")
    db.execute("UPDATE inodes SET nlink = (SELECT COUNT(*) FROM entries e WHERE e.inode = inodes.id)"
               f" WHERE NOT (mode {is_dir} AND nlink > 0")


def rebuild_objects(db: sqlite3.Connection) -> None:
    """Object refcounts from the block maps; everything restored is in the bucket."""
    db.execute("DELETE FROM objects")
    db.execute("INSERT INTO objects (key, size, refcount, uploaded)"
               " SELECT key, MAX(size), COUNT(*), 1 FROM blocks GROUP BY key")
