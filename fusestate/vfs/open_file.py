"""In-memory state of a regular file that is open or has unsealed data.

A block being written lives in ``dirty`` (a :class:`BlockBuffer`). When it fills,
or on flush, it is *sealed*: its final bytes move to ``sealing`` while they are
hashed and staged, then the block map points at the new object. Generations
per block index make sure an older seal never overwrites a newer one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import trio

from fusestate.blocks.keys import BlockData
from fusestate.meta.engine import Inode
from fusestate.vfs.block_buffer import BlockBuffer
from fusestate.vfs.errors import FsError


def content_version(size: int, keys: dict[int, str]) -> int:
    """Content-addressed blocks and the size say all about a file's bytes."""
    return hash((size, tuple(sorted(keys.items()))))


@dataclass
class Sealing:
    data: BlockData  # frozen: no one writes to it any more
    generation: int


@dataclass
class OpenFile:
    node: Inode
    keys: dict[int, str]                       # block index -> object key (committed)
    handles: int = 0
    writers: int = 0                           # handles open for writing
    dirty: dict[int, BlockBuffer] = field(default_factory=dict)
    dirty_since: dict[int, float] = field(default_factory=dict)
    sealing: dict[int, Sealing] = field(default_factory=dict)
    generations: dict[int, int] = field(default_factory=dict)
    lock: trio.Lock = field(default_factory=trio.Lock)
    in_flight: int = 0
    idle: trio.Event = field(default_factory=trio.Event)
    error: Optional[FsError] = None            # a seal that failed; reported by flush/fsync
    out_of_space: bool = False                 # a seal found the cache disk full: writes check for room first
    attrs_dirty: bool = False                  # size/mtime changed in memory since last persisted
    held: bool = False                         # the engine knows this node holds it open
    hold_lock: trio.Lock = field(default_factory=trio.Lock)  # one open_file/close_file at a time
    opening: int = 0                           # opens waiting for the hold: not to be let go
    users: int = 0                             # tasks working on it without a handle (a truncate by path)
    page_cache_valid: bool = True              # shared engines: the kernel's cached pages hold this content
    commit_lock: trio.Lock = field(default_factory=trio.Lock)  # one block-map commit at a time
    syncing: int = 0                           # fsyncs in progress: their commits are durable in place
    # FUSE passthrough (vfs/passthrough.py): the file's bytes are in a local backing file the
    # kernel reads and writes itself; its blocks are behind it until it is sealed again.
    backed: bool = False
    passthrough_handles: int = 0               # handles the kernel serves from the backing file
    passthrough_writers: int = 0               # ... of them open for writing
    unsealed: bool = False                     # a passthrough writer may have changed it since the last seal
    local_stat: Optional[tuple[int, int, int]] = None  # the local file's size, mtime, ctime when last looked at
    sealed_stamp: Optional[tuple[int, int, int]] = None  # ... when its last seal began
    sealed_ahead_stamp: Optional[tuple[int, int, int]] = None  # ... when its last seal of whole blocks began

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def inode(self) -> int:
        return self.node.id

    @property
    def busy(self) -> bool:
        return bool(self.handles or self.opening or self.users or self.dirty or self.sealing or self.in_flight
                    or self.unsealed)

    def next_generation(self, index: int) -> int:
        gen = self.generations.get(index, 0) + 1
        self.generations[index] = gen
        return gen

    def is_current(self, index: int, generation: int) -> bool:
        return self.generations.get(index) == generation

    def seal_started(self) -> None:
        if self.in_flight == 0:
            self.idle = trio.Event()
        self.in_flight += 1

    def seal_finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    def mark_dirty(self, index: int, buf: BlockBuffer) -> None:
        self.dirty[index] = buf
        self.dirty_since.setdefault(index, time.monotonic())

    def take_dirty(self, index: int) -> BlockBuffer:
        self.dirty_since.pop(index, None)
        return self.dirty.pop(index)

    def cached_bytes(self, index: int) -> Optional[memoryview | bytes]:
        """Uncommitted content of a block, newest first (copy what you keep: a dirty
        block's view changes with the next write)."""
        buf = self.dirty.get(index)
        if buf is not None:
            return buf.view()
        sealing = self.sealing.get(index)
        return sealing.data if sealing is not None else None
