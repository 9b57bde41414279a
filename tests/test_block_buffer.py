"""The buffer a block is written in: the bytes read back are the bytes written, holes
read as zeros, and a full block is handed on without a copy, page-aligned for O_DIRECT."""

from __future__ import annotations

import itertools
import os
import random

import pytest

from fusestate.localio import ALIGN, address_of
from fusestate.vfs.block_buffer import BlockBuffer

BLOCK = 4 << 20
MiB = 1 << 20


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
    # Reaching the block's end does not make it full: three ranges were never written.
    assert len(buf) == BLOCK and not buf.full


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


@pytest.mark.parametrize("order", [(3, 0, 1, 2), (3, 1, 0, 2), (1, 3, 2, 0), (0, 2, 3, 1)])
def test_a_block_whose_end_comes_first_is_full_only_once_the_rest_has_come(order: tuple[int, ...]) -> None:
    """The kernel's writes of a block can arrive out of order: a block sealed as soon as its
    last byte came would be sealed again by every write that filled it in."""
    chunks = [os.urandom(MiB) for _ in range(4)]
    buf = BlockBuffer(BLOCK)
    for n, i in enumerate(order, 1):
        assert not buf.full
        buf.write(i * MiB, chunks[i])
        assert buf.full == (n == len(order)), (order, n)
    assert buf.view() == b"".join(chunks)


@pytest.mark.parametrize("seed", range(20))
def test_full_means_every_byte_was_written(seed: int) -> None:
    """Writes of random ranges in random order, overlapping: full exactly when they cover the block."""
    rng = random.Random(seed)
    size = 64 << 10
    buf = BlockBuffer(size)
    model = bytearray(size)
    written = bytearray(size)  # 1 where a write has been
    cuts = sorted(rng.sample(range(1, size), rng.randint(1, 12)))
    pieces = list(itertools.pairwise([0, *cuts, size]))
    pieces += [(a, min(size, a + rng.randint(1, 9000))) for a in rng.sample(range(size), 5)]  # overlaps
    rng.shuffle(pieces)
    for start, end in pieces:
        data = rng.randbytes(end - start)
        buf.write(start, data)
        model[start:end] = data
        written[start:end] = b"\x01" * (end - start)
        assert buf.full == all(written)
        assert buf.view() == model[:len(buf)]
    assert buf.full


def test_existing_content_counts_as_written() -> None:
    content = os.urandom(BLOCK)
    assert BlockBuffer(BLOCK, content).full
    buf = BlockBuffer(BLOCK, content[:MiB])  # a file's old tail
    buf.write(3 * MiB, content[3 * MiB:])
    assert not buf.full
    buf.write(MiB, content[MiB:3 * MiB])
    assert buf.full and buf.view() == content


def test_zeros_a_resize_adds_count_as_written() -> None:
    """A truncate's zeros are meant: nothing more is to come for them. Holes a write left
    before stay until written, and a cut drops those past it."""
    buf = BlockBuffer(BLOCK, b"a" * MiB)
    buf.resize(BLOCK)
    assert buf.full and buf.view() == b"a" * MiB + bytes(BLOCK - MiB)

    buf = BlockBuffer(BLOCK, b"a" * MiB)
    buf.write(2 * MiB, b"b" * MiB)  # [1, 2) MiB still to come
    buf.resize(BLOCK)
    assert not buf.full
    buf.write(MiB, b"c" * MiB)
    assert buf.full and buf.view() == b"a" * MiB + b"c" * MiB + b"b" * MiB + bytes(MiB)

    buf = BlockBuffer(BLOCK, b"a" * MiB)
    buf.write(2 * MiB, b"b" * MiB)
    buf.resize(MiB + 10)            # cuts into the hole: [1 MiB, 1 MiB + 10) still to come
    buf.resize(BLOCK)
    assert not buf.full
    buf.write(MiB, b"c" * 10)
    assert buf.full
    buf.resize(MiB // 2)            # a cut before every hole leaves none
    buf.write(3 * MiB, b"d" * MiB)
    assert not buf.full
    buf.write(MiB // 2, b"e" * (2 * MiB + MiB // 2))
    assert buf.full
