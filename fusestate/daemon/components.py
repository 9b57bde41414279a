"""The layers below FUSE wired together once: the daemon and the tests build them here.

Everything a mount serves, from the metadata engine and the bucket up to the vfs, is
made by :func:`build` from a few settings, so a test drives exactly what a mount runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import trio

from fusestate.blocks.caches import DiskCache, MemoryCache
from fusestate.blocks.scratch_files import ScratchFiles
from fusestate.blocks.staging import Staging
from fusestate.blocks.store import BlockStore
from fusestate.blocks.uploader import Uploader
from fusestate.blocks.warmer import CacheWarmer
from fusestate.daemon.paths import CacheLayout
from fusestate.meta.engine import MetaEngine
from fusestate.meta.scratch.namespace import node_local
from fusestate.remote.store import RemoteStore
from fusestate.vfs import FileSystem

LOCAL_IO_THREADS = 8  # hashing, staging and cache reads at once


@dataclass(frozen=True)
class Settings:
    """What the layers need to know; the daemon fills it from ``MountConfig``."""

    block_size: int
    read_cache_size: int
    memory_cache_size: int
    max_dirty: int
    durability: str = "remote"
    upload_delay: float = 1.0
    upload_concurrency: int = 8
    readahead_blocks: int = 2
    whole_blocks: str = "auto"
    prefetch: str = "off"
    read_only: bool = False
    scratch_dirs: Sequence[str] = ()
    store_ahead: Sequence[str] = ()  # name globs of scratch files stored ahead of their link (--store-ahead)
    staging_reserve: int = 0       # free space staging leaves on the cache disk (for the metadata)


@dataclass
class Components:
    meta: MetaEngine
    remote: RemoteStore
    memory: MemoryCache
    disk: DiskCache
    staging: Staging
    uploader: Uploader
    blocks: BlockStore
    warmer: CacheWarmer
    fs: FileSystem

    async def start(self, nursery: trio.Nursery) -> int:
        """Start every background task; returns how many staged blocks a crash left to upload."""
        self.blocks.start(nursery)
        await nursery.start(self.meta.run)
        await self.fs.start(nursery)
        await nursery.start(self.uploader.run)
        return await self.uploader.recover()

    def close(self) -> None:
        for close in (self.blocks.close, self.disk.close, self.meta.close, self.fs.scratch.close,
                      self.fs.backing.close):
            with contextlib.suppress(Exception):
                close()


def build(meta: MetaEngine, remote: RemoteStore, layout: CacheLayout, settings: Settings) -> Components:
    s = settings
    local_io = trio.CapacityLimiter(LOCAL_IO_THREADS)
    memory = MemoryCache(s.memory_cache_size)
    disk = DiskCache(layout.read_cache, s.read_cache_size)
    staging = Staging(layout.staging, reserve=s.staging_reserve)
    uploader = Uploader(meta, remote, staging, disk, max_dirty=s.max_dirty, upload_delay=s.upload_delay,
                        concurrency=s.upload_concurrency, local_io=local_io)
    blocks = BlockStore(meta, remote, staging, memory, disk, uploader, block_size=s.block_size,
                        local_io=local_io, whole_blocks=s.whole_blocks)
    warmer = CacheWarmer(blocks, meta, mode=s.prefetch, disk_cache_bytes=s.read_cache_size)
    fs = FileSystem(node_local(meta) if s.scratch_dirs else meta, blocks, uploader, block_size=s.block_size,
                    durability=s.durability, readahead_blocks=s.readahead_blocks, read_only=s.read_only,
                    scratch_dirs=s.scratch_dirs, store_ahead=s.store_ahead,
                    scratch_files=ScratchFiles(layout.scratch, reserve=s.staging_reserve),
                    backing_files=ScratchFiles(layout.backing, reserve=s.staging_reserve))
    return Components(meta, remote, memory, disk, staging, uploader, blocks, warmer, fs)
