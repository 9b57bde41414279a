"""A block that a page fill and a reader want at the same moment crosses the network once.

A state store loaded on a fresh node is filled into the kernel's page cache (page_fill) while
its RocksDB already reads it: whichever asks first fetches the block, the other takes those
bytes. Drives the layers a mount builds, on a memory bucket whose fetches are slowed so the
two overlap.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import fsspec
import trio

from fusestate.blocks.caches import MemoryCache
from fusestate.blocks.keys import block_key, object_name
from fusestate.blocks.store import BlockStore
from fusestate.daemon import components
from fusestate.daemon.paths import CacheLayout
from fusestate.meta.embedded.engine import SQLiteEngine
from fusestate.remote.store import RemoteStore

BS = 64 * 1024


def run_blocks(tmp_path: Path, body) -> None:
    async def main() -> None:
        remote = RemoteStore(fsspec.filesystem("memory"), f"/vol-{uuid.uuid4().hex}", retries=2, backoff_initial=0.01)
        meta = SQLiteEngine(str(tmp_path / "meta.db"), block_size=BS)
        parts = components.build(meta, remote, CacheLayout(str(tmp_path)), components.Settings(
            block_size=BS, read_cache_size=64 << 20, memory_cache_size=16 << 20, max_dirty=8 << 20,
            upload_delay=0.0, upload_concurrency=2, whole_blocks="always"))
        try:
            async with trio.open_nursery() as nursery:
                await parts.start(nursery)
                await body(parts.blocks, remote)
                nursery.cancel_scope.cancel()
        finally:
            parts.close()

    trio.run(main)


def slow_fetches(blocks: BlockStore) -> None:
    """Each whole-block fetch takes 0.2 s in its thread, as from a bucket far away."""
    fetch = blocks._fetch_verified_sync

    def slow(key: str):
        time.sleep(0.2)
        return fetch(key)

    blocks._fetch_verified_sync = slow  # type: ignore[method-assign]


def a_block_in_the_bucket(remote: RemoteStore) -> tuple[str, bytes]:
    data = os.urandom(BS)
    key = block_key(data)
    remote.put(object_name(key), data)
    return key, data


def test_a_reader_takes_the_block_a_page_fill_is_fetching(tmp_path: Path) -> None:
    async def body(blocks: BlockStore, remote: RemoteStore) -> None:
        slow_fetches(blocks)
        key, data = a_block_in_the_bucket(remote)
        got: dict[str, bytes] = {}

        async def fill() -> None:
            got["fill"] = bytes(await blocks.fetch_for_fill(key))

        async def reader() -> None:
            await trio.sleep(0.05)  # the fill's fetch is in flight
            got["reader"] = await blocks.read(key, 0, BS)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fill)
            nursery.start_soon(reader)
        assert got == {"fill": data, "reader": data}
        assert blocks.stats.remote_full_fetches == 1

    run_blocks(tmp_path, body)


def test_a_page_fill_takes_the_block_a_reader_fetched(tmp_path: Path) -> None:
    async def body(blocks: BlockStore, remote: RemoteStore) -> None:
        slow_fetches(blocks)
        key, data = a_block_in_the_bucket(remote)
        got: dict[str, bytes] = {}

        async def reader() -> None:
            got["reader"] = await blocks.read(key, 0, BS)

        async def fill() -> None:
            await trio.sleep(0.05)  # the reader's fetch is in flight
            got["fill"] = bytes(await blocks.fetch_for_fill(key))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(fill)
        assert got == {"fill": data, "reader": data}
        assert blocks.stats.remote_full_fetches == 1
        blocks.memory = MemoryCache(16 << 20)  # the block left memory; the disk cache keeps it
        assert bytes(await blocks.fetch_for_fill(key)) == data
        assert blocks.stats.remote_full_fetches == 1

    run_blocks(tmp_path, body)


def test_cache_warming_leaves_blocks_being_filled_to_the_fill(tmp_path: Path) -> None:
    async def body(blocks: BlockStore, remote: RemoteStore) -> None:
        key, _ = a_block_in_the_bucket(remote)
        blocks.will_fill([key])
        assert not await blocks.ensure_cached(key)
        assert blocks.stats.remote_full_fetches == 0
        blocks.filled([key])
        assert await blocks.ensure_cached(key)
        assert blocks.stats.remote_full_fetches == 1

    run_blocks(tmp_path, body)
