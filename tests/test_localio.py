"""Block files written and copied past the page cache, and the fallback where a
filesystem refuses ``O_DIRECT``: the bytes on disk are the bytes given, at every length."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fusestate import localio
from conftest import resident_bytes

# Around the 4 KiB alignment, a whole 4 MiB block, and a length past the reusable buffer.
LENGTHS = [0, 1, 4095, 4096, 4097, 12_345, 4 << 20, (4 << 20) - 1, 5_000_001]


@pytest.fixture(params=["direct", "refused"])
def direct(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param == "refused":  # as on a filesystem without O_DIRECT: fcntl says EINVAL
        monkeypatch.setattr(localio, "_set_direct", lambda fd, on: not on)
        real_open = os.open

        def open_without_direct(path, flags, *args):  # type: ignore[no-untyped-def]
            if flags & os.O_DIRECT:
                raise OSError(22, "Invalid argument")
            return real_open(path, flags, *args)
        monkeypatch.setattr(localio.os, "open", open_without_direct)
    return request.param == "direct"


@pytest.mark.parametrize("length", LENGTHS)
def test_block_files_hold_exactly_their_bytes(tmp_path: Path, direct: bool, length: int) -> None:
    data = os.urandom(length)
    written = tmp_path / "written"
    with open(written, "wb") as f:
        localio.write_file(f, data, keep_cached=False, direct=True)
    assert written.read_bytes() == data

    with open(tmp_path / "copy", "wb") as out:
        copied = localio.copy_direct(str(written), out.fileno())
    if direct:
        assert copied == length
        assert (tmp_path / "copy").read_bytes() == data
    else:
        assert copied is None and (tmp_path / "copy").stat().st_size == 0

    fd = os.open(written, os.O_RDONLY)
    try:
        assert localio.read_whole(fd) == data
    finally:
        os.close(fd)


def test_a_block_written_or_read_past_the_page_cache_is_not_resident(tmp_path: Path) -> None:
    path = tmp_path / "block"
    data = os.urandom(4 << 20)
    with open(path, "wb") as f:
        localio.write_file(f, data, keep_cached=False, direct=True)
    assert resident_bytes([path]) == 0
    fd = os.open(path, os.O_RDONLY)
    try:
        assert localio.read_whole(fd) == data
    finally:
        os.close(fd)
    assert resident_bytes([path]) == 0


def test_an_aligned_block_is_written_from_its_own_buffer(tmp_path: Path, direct: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A full block from a BlockBuffer needs no copy into the aligned buffer; anything
    else still gets one."""
    from fusestate.vfs.block_buffer import BlockBuffer
    buf = BlockBuffer(4 << 20, os.urandom(4 << 20))
    copies: list[int] = []
    real = localio._aligned_buffer
    monkeypatch.setattr(localio, "_aligned_buffer", lambda size: copies.append(size) or real(size))
    for name, data in [("aligned", buf.seal()), ("unaligned", buf.seal()[1:])]:
        with open(tmp_path / name, "wb") as f:
            localio.write_file(f, data, keep_cached=False, direct=True)
        assert (tmp_path / name).read_bytes() == data
    assert copies == [(4 << 20) - 1], "only the unaligned block went through a copy"


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_open_files_read_ranges_and_keep_a_bounded_number_open(tmp_path: Path) -> None:
    files = localio.OpenFiles(limit=2)
    contents = {}
    for i in range(4):
        path = tmp_path / f"o{i}"
        contents[str(path)] = os.urandom(10_000)
        path.write_bytes(contents[str(path)])
    before = _open_descriptors()
    for path, data in contents.items():
        assert files.read(path, 100, 4196) == data[100:4196]
        assert files.read(path, 9_990, 20_000) == data[9_990:]  # past the end: what is there
        assert files.read(path, 20_000, 20_010) == b""
    assert _open_descriptors() == before + 2  # the two most recent stay open, the others were closed
    with pytest.raises(FileNotFoundError):
        files.read(str(tmp_path / "missing"), 0, 10)
    files.close()
    assert _open_descriptors() == before


def test_open_files_forget_a_replaced_file_and_close_a_dropped_one_after_its_read(tmp_path: Path) -> None:
    files = localio.OpenFiles(limit=1)
    path = tmp_path / "o"
    path.write_bytes(b"old bytes")
    assert files.read(str(path), 0, 3) == b"old"
    (tmp_path / "new").write_bytes(b"new bytes")
    os.replace(tmp_path / "new", path)
    assert files.read(str(path), 0, 3) == b"old"  # the open descriptor still reads the file it opened
    files.forget(str(path))
    assert files.read(str(path), 0, 3) == b"new"

    held = files._acquire(str(path))  # a read in progress in another thread
    files.forget(str(path))           # ... while the file is dropped from the table
    os.fstat(held.fd)                 # still open for that read
    files._release(held)
    with pytest.raises(OSError):
        os.fstat(held.fd)             # closed by its last user
