"""What the block layer asks of the metadata: its ledger of block objects.

The block layer sits below the metadata engines. It is typed against this protocol, which
every engine satisfies (``fusestate.meta.engine.MetaEngine`` extends it), and imports
nothing of ``fusestate.meta``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol


@dataclass(frozen=True)
class ObjectInfo:
    """A content-addressed block object known to this volume."""

    key: str
    size: int
    refcount: int
    uploaded: bool


class BlockLedger(Protocol):
    """Which block objects the volume has, how many references each, which are uploaded."""

    shared: bool  # many nodes mount the volume at once: caches expire, blocks are
                  # committed only once they are in the bucket

    async def block_data(self, key: str) -> Optional[bytes]:
        """The bytes of a block the database keeps (committed with ``inline``); None if it
        keeps none under that key."""
        ...

    async def object_info(self, key: str) -> Optional[ObjectInfo]: ...

    async def mark_uploaded(self, key: str) -> None: ...

    async def forget_objects(self, keys: list[str]) -> None:
        """Drop unreferenced objects from the ledger (discarded before upload, or deleted by gc)."""
        ...

    async def pending_objects(self) -> list[ObjectInfo]:
        """Objects not yet uploaded (crash recovery of the staging area)."""
        ...

    async def blocks_by_recency(self, budget: Optional[int] = None) -> list[tuple[str, int]]:
        """Distinct (key, size) of file blocks: most recently modified files first, each
        file's blocks in order, stopping before ``budget`` bytes (cache warming)."""
        ...

    async def begin_upload(self, key: str, size: int) -> Optional[bool]:
        """Shared engines: register this node's upload of a block so the collector leaves it
        alone until its commit. True: in the bucket already; False: upload it; None: being
        deleted by the collector right now, ask again shortly."""
        ...

    async def end_upload(self, key: str) -> None:
        """An upload whose commit will not come (the block was superseded)."""
        ...
