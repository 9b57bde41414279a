"""The buffer of a block being written.

FUSE writes arrive up to 1 MiB at a time. Growing a ``bytearray`` by each of them made
the allocator move the block three times on its way to 4 MiB: twice as many bytes copied
on the event loop as the writes themselves brought. A buffer for a large write is
allocated once at the block's full size instead; small writes (a log, a small file)
start small and double, so a thousand small open files do not pin 4 MiB each.

The block's bytes start on a page boundary, so a full block goes to the staging area
with ``O_DIRECT`` straight from here, with no copy into an aligned buffer.
"""

from __future__ import annotations

from fusestate.localio import ALIGN, address_of

SMALL_START = 64 << 10        # the first buffer of a block written in small pieces
WHOLE_BLOCK_FRACTION = 16     # a write reaching past block_size / 16 gets the whole block at once


class BlockBuffer:
    """A block's bytes in a buffer that only ever grows by replacement, never in place,
    so a view handed out (a read of dirty data) can never see it move."""

    __slots__ = ("block_size", "length", "_raw", "_offset", "_capacity")

    def __init__(self, block_size: int, initial: bytes | bytearray | memoryview = b"") -> None:
        self.block_size = block_size
        self.length = 0
        self._raw = bytearray()
        self._offset = 0
        self._capacity = 0
        if initial:
            self.write(0, initial)

    def __len__(self) -> int:
        return self.length

    @property
    def full(self) -> bool:
        return self.length == self.block_size

    def view(self) -> memoryview:
        """The block's bytes as they are now (valid until the next write)."""
        return memoryview(self._raw)[self._offset:self._offset + self.length]

    def write(self, start: int, data: bytes | bytearray | memoryview) -> None:
        end = start + len(data)
        if end > self.block_size:
            raise ValueError(f"write to [{start}, {end}) past a block of {self.block_size} bytes")
        self._reserve(end)
        base = self._offset
        if start > self.length:  # a hole inside the block reads as zeros
            self._raw[base + self.length:base + start] = bytes(start - self.length)
        self._raw[base + start:base + end] = data
        self.length = max(self.length, end)

    def resize(self, length: int) -> None:
        """Cut the block at ``length``, or extend it with zeros to there."""
        if length > self.length:
            self._reserve(length)
            self._raw[self._offset + self.length:self._offset + length] = bytes(length - self.length)
        self.length = length

    def seal(self) -> memoryview | bytes:
        """The final bytes, for the block store to keep. A block using less than half of
        its buffer (a file's small tail) is copied out, so the memory cache does not hold
        a whole block's buffer for it."""
        if self.length * 2 < self._capacity:
            return bytes(self.view())
        return self.view()

    def _reserve(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        if needed * WHOLE_BLOCK_FRACTION > self.block_size:
            capacity = self.block_size
        else:
            capacity = min(self.block_size, max(needed, 2 * self._capacity, SMALL_START))
        capacity = -(-capacity // ALIGN) * ALIGN
        raw = bytearray(capacity + ALIGN)
        offset = -address_of(raw) % ALIGN
        raw[offset:offset + self.length] = self.view()
        self._raw, self._offset, self._capacity = raw, offset, capacity
