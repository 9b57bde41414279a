"""The buffer a block is written in: the bytes read back are the bytes written, holes
read as zeros, and a full block is handed on without a copy, page-aligned for O_DIRECT."""

from __future__ import annotations

import os

import pytest

from fusestate.localio import ALIGN, address_of
from fusestate.vfs.block_buffer import BlockBuffer

BLOCK = 4 << 20


def test_writes_in_any_order_read_back_with_holes_as_zeros() -> None:
    buf = BlockBuffer(BLOCK)
    model = bytearray()
    for start, length in [(100, 10), (0, 50), (5_000, 3), (4_000, 2_000), (BLOCK - 7, 7)]:
        data = os.urandom(length)
        buf.write(start, data)
        if len(model) < start:
            model.extend(bytes(start - len(model)))
        model[start:start + length] = data
        assert buf.view() == model
    assert buf.full and len(buf) == BLOCK


def test_resize_cuts_and_extends_with_zeros() -> None:
    buf = BlockBuffer(BLOCK, b"x" * 1000)
    buf.resize(10)
    buf.resize(20)
    assert bytes(buf.view()) == b"x" * 10 + bytes(10)
    buf.write(15, b"yy")
    assert bytes(buf.view()) == b"x" * 10 + bytes(5) + b"yy" + bytes(3)


def test_a_write_past_the_block_is_refused() -> None:
    buf = BlockBuffer(BLOCK)
    with pytest.raises(ValueError):
        buf.write(BLOCK - 1, b"ab")
    assert len(buf) == 0


def test_a_view_handed_out_keeps_its_bytes_when_the_buffer_grows() -> None:
    buf = BlockBuffer(BLOCK, b"a" * 100)  # small: starts in a small buffer
    before = buf.view()
    buf.write(100, b"b" * (1 << 20))      # grows by replacement
    assert bytes(before) == b"a" * 100
    assert bytes(buf.view()[:101]) == b"a" * 100 + b"b"


def test_large_writes_fill_one_buffer_that_starts_on_a_page() -> None:
    buf = BlockBuffer(BLOCK)
    chunks = [os.urandom(1 << 20) for _ in range(4)]
    buf.write(0, chunks[0])
    first = address_of(buf.view())
    for i, chunk in enumerate(chunks[1:], 1):
        buf.write(i << 20, chunk)
    sealed = buf.seal()
    assert isinstance(sealed, memoryview) and sealed == b"".join(chunks)
    assert address_of(sealed) == first, "the 1 MiB writes moved the block"
    assert first % ALIGN == 0


def test_a_small_tail_is_copied_out_of_its_buffer_when_sealed() -> None:
    buf = BlockBuffer(BLOCK, os.urandom(1 << 20))  # a whole-block buffer for 1 MiB
    buf.resize(1000)
    sealed = buf.seal()
    assert isinstance(sealed, bytes) and len(sealed) == 1000
