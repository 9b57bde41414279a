"""A remote that behaves like one: the shaped S3 endpoint (bench/endpoints.py), and a
fusestate volume on it.

The endpoint is moto in a network namespace of its own behind a veth pair: every answer
starts a time to first byte late, a connection streams at one S3 connection's rate, and
``tc`` caps the link at a node's bandwidth. The checks here are lower bounds (nothing can
arrive sooner than the shaping allows), never speed goals: those live in bench/.
"""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from bench.common import Shape
from bench.endpoints import ShapedMoto
from conftest import Bucket, Mount

MiB = 1 << 20
SHAPE = Shape(latency_ms=40.0, connection_mbps=40.0, node_mbps=60.0)


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShapedMoto]:
    with ShapedMoto(tmp_path_factory.mktemp("shaped"), SHAPE) as endpoint:
        yield endpoint


def timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def test_the_endpoint_is_shaped(shaped: ShapedMoto) -> None:
    client = shaped.client()
    bucket = shaped.create_bucket("shape")
    payload = os.urandom(8 * MiB)
    client.put_object(Bucket=bucket, Key="small", Body=b"x" * 1000)
    client.put_object(Bucket=bucket, Key="big", Body=payload)

    small = min(timed(lambda: client.get_object(Bucket=bucket, Key="small")["Body"].read()) for _ in range(3))
    assert small >= SHAPE.latency_ms / 1e3, small

    got: list[bytes] = []
    one = timed(lambda: got.append(client.get_object(Bucket=bucket, Key="big")["Body"].read()))
    assert got == [payload]
    assert len(payload) / one <= SHAPE.connection_mbps * 1e6 * 1.05, one  # one connection's rate at most

    with ThreadPoolExecutor(4) as pool:
        four = timed(lambda: list(pool.map(lambda _: client.get_object(Bucket=bucket, Key="big")["Body"].read(),
                                           range(4))))
    assert 4 * len(payload) / four <= SHAPE.node_mbps * 1e6 * 1.1, four  # the node's link caps them all

    # The endpoint lives in its own namespace, reached over the harness's veth pair only.
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert shaped.netns in namespaces
    assert not shaped.endpoint.startswith("http://127.")


def test_a_volume_on_the_shaped_endpoint(shaped: ShapedMoto, make_mount, tmp_path: Path) -> None:
    """Bytes survive the trip, and the daemon sees the latency: a small read from the bucket
    costs far more than one from its disk, so cold reads bring whole blocks (--whole-blocks auto)."""
    bucket = shaped.create_bucket("volume")
    m: Mount = make_mount(Bucket("s3", f"s3://{bucket}/volume", shaped.endpoint))
    m.mount()
    data = os.urandom(24 * MiB + 123)
    with open(m.path / "state.sst", "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    m.umount()
    m.wipe_cache()
    m.mount()
    with open(m.path / "state.sst", "rb") as f:
        for offset in (0, 5 * MiB, 9 * MiB + 4096, 13 * MiB, 17 * MiB, 21 * MiB):
            f.seek(offset)
            assert f.read(4096) == data[offset:offset + 4096]
    assert (m.path / "state.sst").read_bytes() == data
    small = m.status()["remote"]["small_read_ms"]
    assert small["bucket"] >= SHAPE.latency_ms, small
    assert small["whole_blocks"] is True, small
    m.umount()


def test_no_namespace_is_left_behind(tmp_path: Path) -> None:
    with ShapedMoto(tmp_path / "e", Shape(latency_ms=1)) as endpoint:
        name = endpoint.netns
        assert name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert endpoint.host_dev not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
