"""The metadata engine interface: whole POSIX operations, each one transaction.

The vfs asks the engine for operations (create, link, rename, "commit this file's new
block map and size"), never for rows, so an engine on a database shared by many nodes
can run each operation as one transaction, checked and retried as a whole, with one
round trip. Every operation is async: the embedded SQLite engine answers on the event
loop (local disk, tens of microseconds); the PostgreSQL engine runs its queries on the
event loop too, awaiting the database's answers there (``PgPool.query``, or a greenlet
through ``loop_io``), with worker threads only for making new connections, so the loop
serves other requests while it waits on the network.

Operations that drop the last reference to a block return the freed object keys; the
block layer decides what becomes of them (see ``fusestate.blocks``).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

if TYPE_CHECKING:
    import trio

from fusestate.blocks.ledger import BlockLedger, ObjectInfo
from fusestate.errors import FsError

ROOT_INODE = 1
NAME_MAX = 255
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

__all__ = ["ROOT_INODE", "NAME_MAX", "RENAME_NOREPLACE", "RENAME_EXCHANGE", "FsError", "Inode", "DirEntry",
           "ObjectInfo", "NewNode", "AttrChange", "Freed", "MetaEngine", "EngineStats"]


@dataclass
class Inode:
    """A snapshot of an inode's attributes. Engines hand out copies: changing one changes
    nothing until it goes back through an operation."""

    id: int
    mode: int
    uid: int
    gid: int
    size: int
    nlink: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    rdev: int = 0
    symlink_target: Optional[bytes] = None
    # Node-local (Spark's shuffle files): never uploaded, never in the metadata shipped to
    # the bucket, gone when the mount that made it ends. 0 for the rest of the volume, else
    # its owner: 1 on a single-writer volume, the session of the node on a shared one (no
    # other node can read it). Set at creation, never changed.
    scratch: int = 0

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)


@dataclass(frozen=True)
class DirEntry:
    entry_id: int      # readdir offset: entries come in increasing id order
    name: bytes
    inode: int


@dataclass(frozen=True)
class NewNode:
    """What to create: every inode type POSIX has (device nodes are metadata only)."""

    mode: int                               # type bits and permissions
    uid: int
    gid: int
    rdev: int = 0
    symlink_target: Optional[bytes] = None
    scratch_name: bool = False              # a directory whose name makes it scratch (--scratch)


@dataclass(frozen=True)
class AttrChange:
    """setattr: the fields to change (None leaves one as it is); ctime is always set."""

    mode: Optional[int] = None              # permission bits only; the type never changes
    uid: Optional[int] = None
    gid: Optional[int] = None
    atime_ns: Optional[int] = None
    mtime_ns: Optional[int] = None

    def apply(self, node: Inode, now_ns: int) -> None:
        """Change ``node`` as this says; its ctime becomes ``now_ns``."""
        if self.mode is not None:
            node.mode = stat.S_IFMT(node.mode) | (self.mode & 0o7777)
        if self.uid is not None:
            node.uid = self.uid
        if self.gid is not None:
            node.gid = self.gid
        if self.atime_ns is not None:
            node.atime_ns = self.atime_ns
        if self.mtime_ns is not None:
            node.mtime_ns = self.mtime_ns
        node.ctime_ns = now_ns


@dataclass
class Freed:
    """The result of an operation that may drop references: block keys whose last reference
    went, the inode that lost a name (as it is now: nlink 0 once it has none), and the inode
    removed for good (its data is gone) if one was."""

    keys: list[str] = field(default_factory=list)
    deleted_inode: Optional[int] = None
    unlinked: Optional[Inode] = None


@dataclass(frozen=True)
class EngineStats:
    inodes: int
    used_bytes: int   # bytes of distinct blocks the volume references


class MetaEngine(BlockLedger, Protocol):
    """Inodes, entries, block maps and object refcounts, kept consistent together; the
    block layer's ledger of objects (``BlockLedger``) among them.

    POSIX errors are raised as :class:`FsError` with the errno the caller returns.
    A file that loses its last name while some node holds it open (``open_file``) keeps
    its inode and blocks until the last holder calls ``close_file``.
    """

    kind: str          # "sqlite", "postgresql": recorded in the volume's record
    scratch_owner: int  # what this mount's scratch directories record as their owner (Inode.scratch)
    inline_max: int     # a small file's block up to this size may be committed ``inline`` (0: never)

    # --- namespace ----------------------------------------------------------
    async def getattr(self, ino: int) -> Inode: ...
    async def lookup(self, parent: int, name: bytes) -> Inode:
        """The child named ``name`` (``.`` and ``..`` included). ENOENT, ENOTDIR."""
        ...
    async def create(self, parent: int, name: bytes, node: NewNode, hold: bool = False) -> Inode:
        """Make a file, directory, symlink, fifo, socket or device node.
        EEXIST, ENOENT (parent gone), ENOTDIR. A directory's set-group-ID bit and group
        are inherited as POSIX says; a child of a scratch directory is scratch.
        ``hold``: the new file is open on this node at once (as ``open_file``)."""
        ...
    async def link(self, ino: int, parent: int, name: bytes) -> Inode:
        """EPERM for a directory, ENOENT for an inode without names, EEXIST, EXDEV
        between scratch and the volume."""
        ...
    async def unlink(self, parent: int, name: bytes) -> Freed:
        """EISDIR for a directory."""
        ...
    async def rmdir(self, parent: int, name: bytes) -> Freed:
        """ENOTDIR, ENOTEMPTY, EINVAL for ``.``."""
        ...
    async def rename(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                     flags: int = 0) -> Freed:
        """Atomic; ``flags`` RENAME_NOREPLACE (EEXIST) or RENAME_EXCHANGE (ENOENT when the
        target is missing). EINVAL moving a directory under itself, ENOTDIR/EISDIR/ENOTEMPTY
        replacing, EXDEV between scratch and the volume."""
        ...
    async def setattr(self, ino: int, change: AttrChange) -> Inode: ...
    async def readdir(self, ino: int, after_id: int, limit: int = 1000) -> list[tuple[DirEntry, Inode]]:
        """Entries with id greater than ``after_id``, in id order, with their attributes."""
        ...
    async def parent_of(self, ino: int) -> int: ...
    async def open_file(self, ino: int) -> tuple[Inode, dict[int, str]]:
        """Fresh attributes and block map (close-to-open), and mark the file held open by
        this node. Called once per file per node while any handle is open."""
        ...
    async def close_file(self, ino: int) -> Freed:
        """This node no longer holds the file; an unlinked file's data goes with its last holder."""
        ...
    async def close_files(self, inodes: Sequence[int]) -> list[Freed]:
        """``close_file`` of several files in one transaction (in increasing inode order)."""
        ...
    async def read_file(self, ino: int) -> tuple[Inode, dict[int, str]]:
        """Fresh attributes and block map of a file this node holds already (a read)."""
        ...
    async def commit_blocks(self, ino: int, blocks: dict[int, Optional[tuple[str, int]]],
                            size: int, mtime_ns: int, durable: bool = False,
                            uploads_began: Optional[float] = None,
                            inline: Optional[dict[str, bytes]] = None) -> Freed:
        """Point block indexes at objects (key, size), or at holes (None), and set the size
        and mtime, in one transaction. ENOENT if the inode is gone. ``durable``: an fsync
        waits for it, so an engine may make it (and what it committed before) durable
        now, and the ``sync`` that follows cheap. ``uploads_began``: when (monotonic) the
        uploads of these blocks began; a shared engine answers EAGAIN when the collector
        deleted one of them from the bucket since: put it again, then commit again.
        ``inline``: the bytes of blocks the database keeps itself (``inline_max``), by key."""
        ...
    async def promote(self, ino: int, blocks: dict[int, Optional[tuple[str, int]]],
                      size: int, mtime_ns: int, uploads_began: Optional[float] = None) -> Freed:
        """Make this node's scratch file a file of the volume with this block map (every
        block uploaded first on a shared engine), in one transaction. EXDEV if it is no
        scratch file of this node, ENOENT if it is gone."""
        ...
    async def truncate(self, ino: int, size: int, mtime_ns: int) -> tuple[Inode, Freed]:
        """Set the size and drop the blocks wholly past it (the caller rewrites a partial
        last block through ``commit_blocks``)."""
        ...
    async def block_map(self, ino: int) -> dict[int, str]: ...

    # --- objects: the block layer's ledger (BlockLedger), and the collector's part ----
    async def collectable_objects(self, older_than: float, covered_seq: int) -> list[str]: ...
    async def claim_garbage(self, older_than: float, covered_seq: int) -> list[str]:
        """Blocks the collector may delete from the bucket now: unreferenced since before
        ``older_than`` (and, for the journaled engine, by a change at or before
        ``covered_seq``, so no restore point needs them), with no upload registered."""
        ...
    async def garbage_deleted(self, keys: list[str]) -> None:
        """The claimed blocks are gone from the bucket."""
        ...
    async def garbage_kept(self, keys: list[str]) -> None:
        """The claimed blocks could not be deleted (the bucket failed): they stay unreferenced."""
        ...

    # --- lifecycle ------------------------------------------------------------
    async def run(self, task_status: "trio.TaskStatus" = ...) -> None:
        """Background upkeep for as long as the mount lives (a shared engine's heartbeat and
        the clean-up of dead sessions); reports started at once."""
        ...
    async def start(self) -> Freed:
        """Begin serving: drop what the last mount of this node left (scratch inodes, inodes
        that lost their last name while open); returns what that freed."""
        ...
    def stats(self) -> EngineStats:
        """Counters kept up to date by every operation (statfs, metrics): no table scans."""
        ...
    async def sync(self) -> None:
        """Make every committed change durable where this engine keeps it."""
        ...
    def close(self) -> None: ...
