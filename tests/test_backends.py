"""The same data tests on file://, S3 (moto server) and GCS (fake-gcs-server)."""

from __future__ import annotations

import hashlib
import os

from conftest import Bucket, Mount


def _write_random(path, size: int, seed: int) -> str:
    data = hashlib.sha256(str(seed).encode()).digest() * (size // 32) + b"x" * (size % 32)
    data = bytes(b ^ (i & 0xFF) for i, b in enumerate(data[:4096])) + data[4096:]
    with open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def _digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_data_round_trip_through_bucket(any_bucket: Bucket, make_mount) -> None:
    m: Mount = make_mount(any_bucket).mount()
    sums = {}
    sizes = {"empty": 0, "small": 1000, "one_block": 4 << 20, "multi": (9 << 20) + 123}
    for i, (name, size) in enumerate(sizes.items()):
        sums[name] = _write_random(m.path / name, size, i)
    with open(m.path / "sparse", "wb") as f:
        f.seek(10 << 20)
        f.write(b"end")
    fd = os.open(m.path / "multi", os.O_RDWR)
    os.pwrite(fd, b"overwritten", 5 << 20)
    os.fsync(fd)
    os.close(fd)
    expected_multi = _digest(m.path / "multi")
    m.umount()
    assert len(any_bucket.block_objects()) >= 4

    m.wipe_cache()  # a fresh node: only the bucket remains
    m.mount()
    for name in ("empty", "small", "one_block"):
        assert _digest(m.path / name) == sums[name]
    assert _digest(m.path / "multi") == expected_multi
    with open(m.path / "sparse", "rb") as f:
        data = f.read()
    assert len(data) == (10 << 20) + 3 and data[-3:] == b"end" and data[:-3].count(0) == 10 << 20
    st = m.status()
    assert st["remote"]["bytes_in"] > 0
