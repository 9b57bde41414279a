"""The metadata engine interface.

The vfs talks only to this interface, so a different engine (a shared database
for a namespace used by many nodes) can replace SQLite without touching it.
Every method is synchronous and fast (local disk); callers run them on the
event loop.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import Iterator, Optional, Protocol

ROOT_INODE = 1


@dataclass
class Inode:
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
    # Node-local: never uploaded, never in the metadata shipped to the bucket, gone at the
    # next mount (Spark's shuffle files). Set at creation, never changed.
    scratch: bool = False

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
    entry_id: int
    name: bytes
    inode: int


@dataclass(frozen=True)
class ObjectInfo:
    """A content-addressed block object known to this volume."""

    key: str
    size: int
    refcount: int
    uploaded: bool


class MetadataEngine(Protocol):
    """Inodes, entries, block maps and object refcounts, kept consistent together."""

    # --- inodes -----------------------------------------------------------
    def get_inode(self, inode: int) -> Inode: ...
    def create_inode(self, mode: int, uid: int, gid: int, rdev: int = 0,
                     symlink_target: Optional[bytes] = None, scratch: bool = False) -> Inode: ...
    def update_inode(self, node: Inode) -> None: ...
    def delete_inode(self, inode: int) -> list[str]:
        """Remove an inode and its block map; returns object keys whose refcount fell to 0."""
        ...
    def orphaned_inodes(self) -> list[int]: ...
    def purge_scratch(self) -> list[str]:
        """Remove every scratch inode and its names; returns object keys whose refcount fell to 0."""
        ...
    def count_inodes(self) -> int: ...
    def used_bytes(self) -> int: ...

    # --- directory entries ------------------------------------------------
    def lookup(self, parent: int, name: bytes) -> Optional[int]: ...
    def add_entry(self, parent: int, name: bytes, inode: int) -> None: ...
    def remove_entry(self, parent: int, name: bytes) -> None: ...
    def replace_entry(self, parent: int, name: bytes, inode: int) -> None: ...
    def list_entries(self, parent: int, after_id: int) -> Iterator[DirEntry]: ...
    def has_entries(self, parent: int) -> bool: ...
    def parent_of(self, directory: int) -> int: ...

    # --- block maps and objects ------------------------------------------
    def block_map(self, inode: int) -> dict[int, str]: ...
    def get_block(self, inode: int, index: int) -> Optional[str]: ...
    def set_block(self, inode: int, index: int, key: Optional[str], size: int) -> list[str]:
        """Point a block at an object (or a hole); returns keys whose refcount fell to 0."""
        ...
    def truncate_blocks(self, inode: int, first_removed: int) -> list[str]: ...
    def get_object(self, key: str) -> Optional[ObjectInfo]: ...
    def blocks_by_recency(self, budget: Optional[int] = None) -> list[tuple[str, int]]:
        """Distinct (key, size) of file blocks: most recently modified files first, each
        file's blocks in order, stopping before ``budget`` bytes."""
        ...
    def mark_uploaded(self, key: str) -> None: ...
    def pending_objects(self) -> list[ObjectInfo]: ...
    def collectable_objects(self, older_than: float, covered_seq: int) -> list[str]: ...
    def forget_objects(self, keys: list[str]) -> None: ...

    # --- housekeeping -----------------------------------------------------
    def get_setting(self, key: str) -> Optional[str]: ...
    def set_setting(self, key: str, value: str) -> None: ...
    def transaction(self): ...
    def sync(self) -> None:
        """Make every committed change durable on local disk."""
        ...
    def backup_to(self, path: str) -> None: ...
    def close(self) -> None: ...
