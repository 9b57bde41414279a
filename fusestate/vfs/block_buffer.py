"""The buffer of a block being written.

FUSE writes arrive up to 1 MiB at a time. Growing a ``bytearray`` by each of them made
the allocator move the block three times on its way to 4 MiB: twice as many bytes copied
on the event loop as the writes themselves brought. A buffer for a large write is
allocated once at the block's full size instead; small writes (a log, a small file)
start small and double, so a thousand small open files do not pin 4 MiB each.

The block's bytes start on a page boundary, so a full block goes to the staging area
with ``O_DIRECT`` straight from here, with no copy into an aligned buffer.

Writes of one block do not always arrive in order (the kernel's writeback chunks do
not start on block boundaries, and concurrent writers interleave), so the buffer
remembers the ranges below its length that no write has filled yet: a block is full,
and sealed, only once it has none. Sealed on reaching its end with a gap still to come,
it would be sealed again by every write that fills the gap: each time a hash, a staging
write and, on a shared engine, an upload.
"""

from __future__ import annotations

from fusestate.blocks.keys import BlockData
from fusestate.localio import ALIGN, aligned_bytes

SMALL_START = 64 << 10        # the first buffer of a block written in small pieces
WHOLE_BLOCK_FRACTION = 16     # a write reaching past block_size / 16 gets the whole block at once


class BlockBuffer:
    """A block's bytes in a buffer that only ever grows by replacement, never in place,
    so a view handed out (a read of dirty data) can never see it move."""

    __slots__ = ("block_size", "length", "_buf", "_holes")

    def __init__(self, block_size: int, initial: BlockData = b"") -> None:
        self.block_size = block_size
        self.length = 0
        self._buf = memoryview(bytearray())  # page-aligned once it holds anything
        # Ranges [start, end) below length that read as zeros because no write reached them
        # yet, in order and disjoint: one per write that skipped ahead, usually none.
        self._holes: list[tuple[int, int]] = []
        if initial:
            self.write(0, initial)

    def __len__(self) -> int:
        return self.length

    @property
    def full(self) -> bool:
        """Every byte of the block written: nothing more is expected before it is sealed."""
        return self.length == self.block_size and not self._holes

    def view(self) -> memoryview:
        """The block's bytes as they are now (valid until the next write)."""
        return self._buf[:self.length]

    def write(self, start: int, data: BlockData) -> None:
        end = start + len(data)
        if end > self.block_size:
            raise ValueError(f"write to [{start}, {end}) past a block of {self.block_size} bytes")
        self._reserve(end)
        if start > self.length:  # skipped ahead: zeros until the bytes in between come
            self._buf[self.length:start] = bytes(start - self.length)
            self._holes.append((self.length, start))
        elif self._holes and start < self.length:
            self._fill(start, end)
        self._buf[start:end] = data
        self.length = max(self.length, end)

    def resize(self, length: int) -> None:
        """Cut the block at ``length``, or extend it with zeros to there (a truncate, the
        file's end: zeros meant as such, so not a hole)."""
        if length > self.length:
            self._reserve(length)
            self._buf[self.length:length] = bytes(length - self.length)
        elif self._holes and self._holes[-1][1] > length:
            self._holes = [(a, min(b, length)) for a, b in self._holes if a < length]
        self.length = length

    def _fill(self, start: int, end: int) -> None:
        """[start, end) is written: take it out of the holes."""
        holes: list[tuple[int, int]] = []
        for a, b in self._holes:
            if b <= start or a >= end:
                holes.append((a, b))
                continue
            if a < start:
                holes.append((a, start))
            if end < b:
                holes.append((end, b))
        self._holes = holes

    def seal(self) -> memoryview | bytes:
        """The final bytes, for the block store to keep. A block using less than half of
        its buffer (a file's small tail) is copied out, so the memory cache does not hold
        a whole block's buffer for it."""
        if self.length * 2 < len(self._buf):
            return bytes(self.view())
        return self.view()

    def _reserve(self, needed: int) -> None:
        if needed <= len(self._buf):
            return
        if needed * WHOLE_BLOCK_FRACTION > self.block_size:
            capacity = self.block_size
        else:
            capacity = min(self.block_size, max(needed, 2 * len(self._buf), SMALL_START))
        buf = aligned_bytes(-(-capacity // ALIGN) * ALIGN)
        buf[:self.length] = self.view()
        self._buf = buf
