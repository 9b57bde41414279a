"""The block store: seal blocks into content-addressed objects, and read them back.

Reads are served from memory, then the staging area or the disk cache, then the
bucket. A small read takes only its range from local disk or, for a block that is
nowhere local, from the bucket, even while that block is being fetched whole: a point
lookup waits for what it reads, not for 4 MiB queued behind other fetches. A second
small read of such a block soon after the first also fetches the whole block into the
disk cache, in low-priority background threads. "Soon" is measured in blocks: the last
ones read by range are remembered, a quarter as many as the disk cache holds (a 2Q-style
ghost list), so a state many times the cache, read at random, is not churned through it
4 MiB at a time. Larger reads, and small reads that are part of a sequential scan (the
vfs says so), load or fetch the whole block, verify its hash and keep it in both caches.

All that whole-block fetching is done only while it pays: while a range read from the
bucket costs several times one from local disk (``read_costs``). A bucket as fast as the
cache disk (a ``file://`` bucket on a like disk) is read by range at every size, like a
local file, and its blocks are not copied to this node.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterator, Optional

import trio

from fusestate.blocks.background import BackgroundThreads
from fusestate.blocks.caches import DiskCache, KeySet, MemoryCache
from fusestate.blocks.keys import BlockData, inline_key, is_inline, is_zero, key_matches, object_name, seal_digest
from fusestate.blocks.read_costs import ReadCosts
from fusestate.blocks.staging import Staging
from fusestate.blocks.uploader import Uploader
from fusestate.blocks.ledger import BlockLedger
from fusestate.remote.store import RemoteError, RemoteStore

log = logging.getLogger(__name__)

RANGE_READ_MEMORY_SHARE = 4  # remember 1/4 as many range-read blocks as the disk cache holds
HANDED_OVER = 16  # blocks a page fill fetched, kept a moment for readers that waited on the same fetch
# Blocks this small are hashed on the event loop (tens of microseconds): a thread hop costs more.
HASH_ON_LOOP_BYTES = 64 * 1024
# On a shared engine every block a write seals goes from memory to the bucket before its
# commit (``upload_before_commit``): no staging file, no uploader queue. Blocks this small are
# then always kept in the disk cache, and put at once (a close or fsync waits for them);
# larger ones take one of --upload-concurrency slots and are kept on disk, from a
# low-priority thread, only while whole blocks may pay (``keeps_written``).
DIRECT_PUT_BYTES = 256 * 1024
# Blocks put from memory that may wait at once for the disk cache (``_keep_on_disk``): past it a
# written block is not kept, rather than hold its bytes in memory for a cache write.
KEEP_BEHIND_BLOCKS = 8
# Background fetches (a page fill's data blocks) wait until no small read has waited for the
# bucket for this long: a point lookup follows the one before it within milliseconds, so a gap
# this long means the lookups are done for now, not between two of them.
READERS_QUIET_SECONDS = 0.25


@dataclass
class _Put:
    """A block being put from memory; a seal of the same bytes meanwhile waits for it."""

    done: trio.Event
    began: Optional[float] = None  # set once it is in the bucket


@contextlib.contextmanager
def _in_flight(table: dict[str, trio.Event], key: str) -> Iterator[None]:
    """Mark ``key`` in progress in ``table`` (one load, fetch or staging write per block at a
    time); whoever waits on its event looks again once this block is done."""
    done = table[key] = trio.Event()
    try:
        yield
    finally:
        del table[key]
        done.set()


@dataclass(frozen=True)
class SealedBlock:
    """A block of a local file stored for a commit to come (a scratch file's promotion, or
    ahead of it): hand its key to ``committed`` after that commit, or to ``abandon`` when no
    commit will come."""

    key: str
    nbytes: int
    began: Optional[float] = None  # shared engines: when its upload began (``commit_blocks(uploads_began=...)``)


class BlockReadError(IOError):
    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


@dataclass
class ReadStats:
    remote_full_fetches: int = 0
    remote_range_reads: int = 0
    prefetches: int = 0
    # Where the reads of the vfs were served from (readahead, prefetch and warming not counted).
    reads_from_memory: int = 0
    reads_from_disk: int = 0
    reads_from_bucket: int = 0


class BlockStore:
    def __init__(self, meta: BlockLedger, remote: RemoteStore, staging: Staging,
                 memory: MemoryCache, disk: DiskCache, uploader: Uploader, *,
                 block_size: int, local_io: trio.CapacityLimiter,
                 prefetch_concurrency: int = 4, whole_blocks: str = "auto") -> None:
        self.meta = meta
        self.remote = remote
        self.staging = staging
        self.memory = memory
        self.disk = disk
        self.uploader = uploader
        self.block_size = block_size
        self.stats = ReadStats()
        self._local_io = local_io
        self._fetching: dict[str, trio.Event] = {}
        self._bucket_reads_in_threads = 0  # range reads from the bucket waiting for a worker thread
        self._loading: dict[str, trio.Event] = {}  # whole-block loads from local disk
        # Cold blocks read once by a range read (the ghost list).
        self._range_read_blocks = KeySet(max(1, disk.limit // block_size // RANGE_READ_MEMORY_SHARE))
        # Blocks of files a page fill puts into the kernel's page cache (fusestate.fuse.page_fill), and
        # the last ones it fetched: each block crosses the network once, whether a reader, readahead
        # or the fill asks first (the fill takes a reader's copy, a reader waits for the fill's).
        self._filling: collections.Counter[str] = collections.Counter()
        self._handed_over: collections.OrderedDict[str, BlockData] = collections.OrderedDict()
        self.read_costs = ReadCosts(whole_blocks)
        self._prefetch_limiter = trio.CapacityLimiter(prefetch_concurrency)
        self._background = BackgroundThreads(prefetch_concurrency, "refetch")
        self._nursery: Optional[trio.Nursery] = None
        self._staging_inflight: dict[str, trio.Event] = {}  # keys being written to staging
        # Shared engines: blocks being put from memory, the slots large ones take, and how many
        # written blocks wait to be kept in the disk cache.
        self._putting: dict[str, _Put] = {}
        # Seals that staged a block and have not committed it yet (``committed``) or let it go
        # (``abandon``), per key: a staging file stays while any of them may still commit it.
        self._staged_uncommitted: collections.Counter[str] = collections.Counter()
        self._put_slots = trio.CapacityLimiter(max(1, uploader.concurrency))
        self._keeping = 0
        self._keep_threads = BackgroundThreads(1, "keep")
        # Shared engines: how many seals on this node wait to commit each uploaded block.
        self._awaiting_commit: collections.Counter[str] = collections.Counter()
        self._waiting_for_room = 0  # staging writes waiting for a full cache disk to make room
        # Blocks refused because the cache disk was full and nothing could make room.
        self.disk_full_failures = 0
        self.put_again_blocks = 0  # collected from the bucket while uploaded, put again before the commit
        # Sealed blocks whose bytes the volume already had: neither staged nor uploaded.
        self.deduplicated_blocks = 0
        self.deduplicated_bytes = 0
        # Latency hook (metrics): called with the source ("local", "remote", "range") and seconds.
        self.read_observer: Optional[Callable[[str, float], None]] = None
        # Small reads waiting for the bucket now, and when the last one stopped (``readers_quiet``).
        self._reader_waits = 0
        self._reader_waits_ended = -math.inf
        self._reader_waits_changed = trio.Event()

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def close(self) -> None:
        self._background.close()
        self._keep_threads.close()

    # --- write side --------------------------------------------------------
    async def seal(self, data: BlockData, direct: bool = False, key: Optional[str] = None) -> Optional[str]:
        """Store a block's final bytes; returns its key (None for an all-zero hole).

        The caller must reference the key in the metadata (set_block) without
        awaiting in between, so the object cannot be discarded under it. Raises
        OSError(ENOSPC) when the cache disk is full and nothing will free it.
        ``direct``: the caller passes the bytes to ``upload_before_commit`` (a shared
        engine), which puts the block from memory: it is not staged. ``key``: the
        caller hashed the bytes already (``seal_digest``), so they are not hashed again.
        """
        if key is None:
            if len(data) <= HASH_ON_LOOP_BYTES:
                key = seal_digest(data)
            else:
                key = await trio.to_thread.run_sync(seal_digest, data, limiter=self._local_io)
            if key is None:
                return None
        self.memory.put(key, data)
        if self.meta.shared:
            # Staged whatever the volume holds: the upload puts it (the same bytes, the same
            # key), and its commit finds out whether the collector took them meanwhile.
            while key in self._staging_inflight:
                await self._staging_inflight[key].wait()
            if self.uploader.is_pending(key) or (direct and key in self._putting):
                self.deduplicated_blocks += 1  # its commit waits for that upload
                self.deduplicated_bytes += len(data)
                return key
            if direct:
                return key
            with _in_flight(self._staging_inflight, key):
                await self._write_staging(key, data)
            return key
        while await self.meta.object_info(key) is None:
            writing = self._staging_inflight.get(key)
            if writing is None:
                break
            await writing.wait()  # the same bytes are being staged: wait, then look again
        else:
            self.deduplicated_blocks += 1  # dedup: the volume has these bytes already
            self.deduplicated_bytes += len(data)
            return key
        with _in_flight(self._staging_inflight, key):
            await self._write_staging(key, data)
        self._staged_uncommitted[key] += 1
        return key

    async def put_for_fsync(self, data: BlockData, key: str) -> bool:
        """A block an fsync waits for (the embedded engine, ``--durability remote``): put it
        in the bucket from memory now, before its commit references it, instead of staging
        it for the journal's shipment to upload (True). The fsync then waits for one write
        of the bytes instead of three (staging, the upload's read of it, the bucket), and a
        crash before the commit leaves an object no metadata names, which ``fusestate gc``
        deletes. False when the volume holds or is staging these bytes already: the caller
        seals them (``seal``), which finds them, and for a small block (a RocksDB MANIFEST's
        append), whose staging costs little and whose upload the shipment does beside
        others. After the commit: ``committed_uploaded``."""
        assert not self.meta.shared
        if len(data) <= DIRECT_PUT_BYTES or key in self._staging_inflight or self.uploader.is_pending(key):
            return False
        if await self.meta.object_info(key) is not None:
            return False
        self.memory.put(key, data)
        await self._put_from_memory(key, data)
        return True

    async def seal_for_fsync(self, data: BlockData) -> tuple[Optional[str], bool]:
        """``seal`` for a block an fsync waits for: put in the bucket now if it is large and
        new (``put_for_fsync``; True), else staged or found. Returns its key (None: a hole)."""
        key = await trio.to_thread.run_sync(seal_digest, data, limiter=self._local_io)
        if key is None:
            return None, False
        if await self.put_for_fsync(data, key):
            return key, True
        return await self.seal(data, key=key), False

    async def seal_uploaded(self, data: BlockData, key: str) -> tuple[str, float]:
        """A shared engine's seal of a local file's block (a passthrough seal, a promotion):
        from memory to the bucket before the commit, not staged, as the block path's. Returns
        the key and when its upload began; then ``committed`` or ``abandon`` it."""
        sealed = await self.seal(data, direct=True, key=key)
        assert sealed is not None
        return sealed, await self.upload_before_commit(sealed, data)

    async def seal_for_commit(self, data: BlockData, key: str) -> SealedBlock:
        """Store a local file's block whose commit comes later (``SealedBlock``). A shared engine puts it
        in the bucket from memory, as ``seal_uploaded`` does for a promotion, and it waits
        for ``committed`` or ``abandon``; the embedded engine stages it, and
        ``abandon`` drops the staging file, so nothing of a block never committed reaches
        the bucket."""
        if self.meta.shared:
            key, began = await self.seal_uploaded(data, key)
            return SealedBlock(key, len(data), began)
        sealed = await self.seal(data, key=key)
        assert sealed is not None
        return SealedBlock(sealed, len(data))

    async def committed_uploaded(self, key: str) -> None:
        """A block put by ``put_for_fsync`` is referenced by the metadata now: in the bucket."""
        await self.meta.mark_uploaded(key)

    def seal_inline(self, data: BlockData) -> Optional[str]:
        """A small file's block whose bytes its commit hands to the database (a shared
        engine's ``inline_max``): named, kept in memory, neither staged nor uploaded.
        None for an all-zero block (a hole)."""
        if is_zero(data):
            return None
        key = inline_key(data)
        self.memory.put(key, data)
        return key

    async def _write_staging(self, key: str, data: BlockData) -> None:
        while True:
            try:
                await trio.to_thread.run_sync(self.staging.write, key, data, limiter=self._local_io)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # A full cache disk: free read cache and wait for uploads while either
                # can make room; when neither can (scratch files or other programs fill
                # the disk), fail the write instead of waiting forever.
                freed = await trio.to_thread.run_sync(self.disk.evict, 16 * self.block_size)
                # Other blocks being staged right now hold part of the disk; once staged they
                # are uploaded and become evictable, unless they too wait for room like this one.
                others_staging = len(self._staging_inflight) - 1 - self._waiting_for_room
                if not freed and not self.uploader.staged_blocks and others_staging <= 0:
                    self.disk_full_failures += 1
                    raise OSError(errno.ENOSPC, "cache disk full: no read cache to evict, nothing to upload") from exc
                log.warning("cache disk full while staging a block; evicting and waiting for uploads")
                self.uploader.expedite_all()
                self._waiting_for_room += 1
                try:
                    await trio.sleep(0.5)
                finally:
                    self._waiting_for_room -= 1

    async def has_room(self) -> bool:
        """Whether a block could be staged now or soon: free space above the reserve, read
        cache to evict, or uploads that will move staged blocks out."""
        if self.uploader.staged_blocks:
            return True
        if await trio.to_thread.run_sync(len, self.disk, limiter=self._local_io):
            return True
        return await trio.to_thread.run_sync(self.staging.has_room, self.block_size, limiter=self._local_io)

    async def upload_before_commit(self, key: str, data: BlockData) -> float:
        """A shared engine commits a block only once it is in the bucket: put it from memory
        (one sealed ``direct``; a block staged for another commit goes through the
        uploader's queue) and wait. Then ``committed`` or ``abandon`` the key. Returns when
        (monotonic) its upload began, for the commit (``commit_blocks(uploads_began=...)``).
        A failed upload (``RemoteError`` after the remote's retry budget) leaves the bytes
        with the caller: nothing of them is kept."""
        self.expect_commit(key)
        if self.uploader.is_pending(key):
            return await self.upload_expected([(key, len(data))])
        try:
            return await self._put_from_memory(key, data)
        except BaseException:
            await self._stop_awaiting(key)
            raise

    async def _put_from_memory(self, key: str, data: BlockData) -> float:
        """Put a sealed block from memory, once however many seals of the same bytes wait
        for it; returns when the upload they share began."""
        while (other := self._putting.get(key)) is not None:
            await other.done.wait()
            if other.began is not None:
                return other.began
            # that upload failed: this seal tries its own
        put = self._putting[key] = _Put(trio.Event())
        small = len(data) <= DIRECT_PUT_BYTES  # a close or fsync waits for it: no queue
        try:
            async with contextlib.nullcontext() if small else self._put_slots:
                put.began = await self._put_registered(key, data)
        finally:
            del self._putting[key]
            put.done.set()
        if self._nursery is not None:  # for reads once the memory cache lets it go; off the commit's path
            if small:
                self._nursery.start_soon(self._keep_on_disk, key, data)
            elif self._keeping < KEEP_BEHIND_BLOCKS and self.keeps_written():
                self._keeping += 1
                self._nursery.start_soon(self._keep_written, key, data)
        return put.began

    async def _put_registered(self, key: str, data: BlockData) -> float:
        """Put a block as the uploader puts a staged one for a shared engine
        (``Uploader.put_shared``); returns when its PUT began (now, if none was needed)."""
        began = time.monotonic()

        async def put() -> None:
            nonlocal began
            began = await self._put_now(key, data)

        await self.uploader.put_shared(key, len(data), put)
        return began

    def keeps_written(self) -> bool:
        """Whether a large block written here is also kept in the disk cache: while fetching
        whole blocks from the bucket pays (``read_costs``, once the node's reads have timed
        the bucket), and until then unless the bucket is a local directory. A bucket as fast
        as the cache disk serves reads as well as the cache would, and a copy there would be
        a second disk write of every byte for nothing."""
        if self.read_costs.mode == "auto" and not self.read_costs.bucket_timed():
            return not self.remote.is_local
        return self.read_costs.whole_blocks_pay()

    async def _keep_on_disk(self, key: str, data: BlockData) -> None:
        with contextlib.suppress(OSError):  # a full cache disk must not fail anything: it is in the bucket
            await trio.to_thread.run_sync(self.disk.put, key, data, limiter=self._local_io)

    async def _keep_written(self, key: str, data: BlockData) -> None:
        """Keep a large written block in the disk cache from a low-priority thread (nice 10,
        the idle I/O class): the writes and reads someone waits for go first. At most
        ``KEEP_BEHIND_BLOCKS`` wait; past that a block is not kept."""
        try:
            with contextlib.suppress(OSError):
                await self._keep_threads.run(functools.partial(self.disk.put, key, data))
        finally:
            self._keeping -= 1

    async def put_again(self, key: str, data: BlockData) -> float:
        """Put a block's bytes in the bucket again, now: the collector deleted them while
        they were uploaded (a shared engine refused the commit). Returns when it began."""
        began = await self._put_now(key, data)
        self.put_again_blocks += 1
        return began

    async def _put_now(self, key: str, data: BlockData) -> float:
        """Put a block's bytes from memory; returns when (monotonic) the PUT began."""
        began = time.monotonic()
        await self.remote.aput(object_name(key), data, direct=True)
        return began

    def expect_commit(self, key: str) -> None:
        """A sealed key that a commit will reference (shared engines): from now on it is
        this node's until ``committed`` or ``abandon``. Call it right after ``seal``."""
        self._awaiting_commit[key] += 1

    async def upload_expected(self, blocks: list[tuple[str, int]]) -> float:
        """Upload blocks held by ``expect_commit``, all at once; on failure they are let go.
        Returns when (monotonic) the first of their uploads began."""
        began = time.monotonic()
        try:
            for key, size in blocks:
                self.uploader.add(key, size)
                began = min(began, self.uploader.queued_at(key))
            await self.uploader.wait_uploaded([key for key, _ in blocks])
            return began
        except BaseException:
            for key, _ in blocks:
                await self._stop_awaiting(key)
            raise

    async def _stop_awaiting(self, key: str) -> None:
        """The last seal of these bytes on this node that was to commit them will not: the
        engine records the uploaded block as unreferenced, for the collector."""
        self._awaiting_commit[key] -= 1
        if self._awaiting_commit[key] <= 0:
            del self._awaiting_commit[key]
            with trio.CancelScope(shield=True):
                await self.meta.end_upload(key)

    async def committed(self, key: Optional[str], size: int) -> None:
        """A sealed key is now referenced by the metadata: queue it if it is new."""
        if key is None or is_inline(key):
            return
        if self.meta.shared:
            self._awaiting_commit[key] -= 1  # committed: the engine ended its upload registration
            if self._awaiting_commit[key] <= 0:
                del self._awaiting_commit[key]
            return
        info = await self.meta.object_info(key)
        staged = self._uncount_staged(key)
        # Staged by this seal but uploaded already (an fsync put the same bytes meanwhile):
        # queued all the same, and the uploader, finding it in the bucket, only moves the
        # staging file to the read cache.
        if info is not None and (not info.uploaded or staged):
            self.uploader.add(key, size)

    def _uncount_staged(self, key: str) -> bool:
        """One seal that staged ``key`` is done with it; whether one had."""
        if self._staged_uncommitted.get(key, 0) <= 0:
            return False
        self._staged_uncommitted[key] -= 1
        if self._staged_uncommitted[key] == 0:
            del self._staged_uncommitted[key]
        return True

    def _staged(self, key: str) -> bool:
        """Whether the block's bytes are in staging (so, maybe nowhere else)."""
        return self.uploader.is_pending(key)

    def _maybe_local(self, key: str) -> bool:
        """Whether the block may be on this node (staged, or perhaps in the disk cache);
        cheap, on the event loop. A no counts a disk-tier miss, as the lookup it saves would."""
        if self._staged(key) or not self.disk.known_absent(key):
            return True
        self.disk.stats.misses += 1
        return False

    async def abandon(self, key: Optional[str]) -> None:
        """A sealed key that will not be referenced after all: drop its staging file."""
        if key and self._uncount_staged(key) and self._staged_uncommitted[key] > 0:
            return  # another seal of these bytes may still commit them
        if key and is_inline(key):
            return  # never left memory
        if key and self.meta.shared:
            await self._stop_awaiting(key)  # uploaded already: the collector deletes it in time
            return
        if not key or key in self._staging_inflight or self.uploader.is_pending(key):
            return  # these bytes are staged for something else too
        if self.meta.shared or await self.meta.object_info(key) is None:
            self.staging.remove(key)

    async def release(self, keys: list[str]) -> None:
        """Objects whose refcount fell to zero: drop them if they never left staging."""
        if self.meta.shared:
            return  # in the bucket: the collector deletes them once no node needs them
        unqueued: list[str] = []  # left by a crash before recovery
        for key in keys:
            info = await self.meta.object_info(key)
            if info is None or info.refcount > 0 or info.uploaded:
                continue  # uploaded ones wait for the garbage collector
            if key in self._staging_inflight:
                continue
            if self.uploader.is_pending(key):
                if not self.meta.shared:  # shared: a volume file's commit of these bytes waits for it
                    await self.uploader.discard(key)
            else:
                unqueued.append(key)
        if unqueued:
            await self.meta.forget_objects(unqueued)  # one transaction: a mount's purge frees many
            for key in unqueued:
                self.staging.remove(key)

    # --- read side ---------------------------------------------------------
    async def read(self, key: str, start: int, end: int, whole: bool = False) -> bytes:
        """Bytes [start, end) of an object (shorter if the object is shorter). ``whole``: the
        caller is scanning, so load the whole block even for a small read."""
        data = self.memory.get(key)
        if data is not None:
            self.stats.reads_from_memory += 1
            return bytes(data[start:end])
        if is_inline(key):
            return bytes((await self._from_database(key))[start:end])
        started = time.perf_counter()
        small = (end - start) * 4 < self.block_size and not whole
        maybe_local = self._maybe_local(key)
        if small and maybe_local and not self._staged(key) and self.read_costs.bucket_beats_local():
            maybe_local = False  # a quick file:// bucket: one pread on the loop, no thread, no SQLite
        if small and maybe_local:
            chunk = await trio.to_thread.run_sync(self._read_local_range, key, start, end,
                                                  limiter=self._local_io)
            if chunk is not None:
                self._observe("local", started)
                return chunk
        elif maybe_local:
            data = await self._load_local(key)
            if data is not None:
                self._observe("local", started)
                return bytes(data[start:end])
        # Only a small read counts as a reader waiting (``readers_busy``): a point lookup waits for
        # its round trip, while a scan (a compaction) wants bytes, as the background does.
        with self._reader_waiting() if small else contextlib.nullcontext():
            return await self._read_from_bucket(key, start, end, small, started)

    async def _read_from_bucket(self, key: str, start: int, end: int, small: bool, started: float) -> bytes:
        if self.read_costs.whole_blocks_pay():
            if not small:
                data = await self.fetch(key)
                self._observe("remote", started)
                return bytes(data[start:end])
            # Small cold read: answer from a range read. Only a block read again while still
            # remembered is fetched whole in the background: scattered point lookups (RocksDB
            # on a fresh node) then cost what they read, not 4 MiB each.
            if self._range_read_blocks.take(key):
                self.prefetch([key], to_disk=True)
            else:
                self._range_read_blocks.add(key)
        chunk = self._get_range_on_loop(key, start, end)
        if chunk is None:
            self._bucket_reads_in_threads += 1
            try:
                chunk = await self.remote.run(self._get_range_sync, key, start, end)
            except (RemoteError, FileNotFoundError) as exc:
                raise BlockReadError(f"block {key[:16]}: {exc}") from exc
            finally:
                self._bucket_reads_in_threads -= 1
        self.stats.remote_range_reads += 1
        self._observe("range", started)
        return chunk

    @contextlib.contextmanager
    def _reader_waiting(self) -> Iterator[None]:
        self._reader_waits += 1
        try:
            yield
        finally:
            self._reader_waits -= 1
            self._reader_waits_ended = trio.current_time()
            self._reader_waits_changed.set()
            self._reader_waits_changed = trio.Event()

    def readers_busy(self, quiet: float = READERS_QUIET_SECONDS) -> bool:
        """Whether a small read (a point lookup) waits for the bucket now, or did less than
        ``quiet`` seconds ago."""
        return bool(self._reader_waits) or trio.current_time() - self._reader_waits_ended < quiet

    async def readers_quiet(self, quiet: float = READERS_QUIET_SECONDS) -> None:
        """Return once no small read has waited for the bucket for ``quiet`` seconds: background
        fetches call it before each block, so they never hold a bucket connection, a worker
        thread or a core that a reader could use."""
        while True:
            if self._reader_waits:
                await self._reader_waits_changed.wait()
                continue
            left = self._reader_waits_ended + quiet - trio.current_time()
            if left <= 0:
                return
            await trio.sleep(left)

    def _get_range_on_loop(self, key: str, start: int, end: int) -> Optional[bytes]:
        """A small range read from a ``file://`` bucket whose small reads are quick, made on
        the event loop while no other bucket read waits in a worker thread: a thread hop
        costs about as much as a read from a fast disk, and the loop is blocked only that
        long. None: read in a thread (a slow or remote bucket, a large read).

        (A read that only the page cache would answer, ``RWF_NOWAIT``, does not tell a
        cold page apart cheaply: on ext4 it starts the disk read and waits for it.)"""
        if (self._bucket_reads_in_threads or (end - start) * 4 >= self.block_size
                or not self.read_costs.bucket_is_quick()):
            return None
        started = time.perf_counter()
        chunk = self.remote.get_range_now(object_name(key), start, end)
        if chunk is not None:
            self.read_costs.bucket(time.perf_counter() - started)
        return chunk

    def _observe(self, source: str, started: float) -> None:
        if source == "local":
            self.stats.reads_from_disk += 1
        else:
            self.stats.reads_from_bucket += 1
        if self.read_observer is not None:
            self.read_observer(source, time.perf_counter() - started)

    async def _load_local(self, key: str) -> Optional[BlockData]:
        """The whole block from staging or the disk cache into memory; one load per key at
        a time (a scan's reads and its readahead want the same blocks at the same moment).
        None, without a worker thread, for a block certainly not on this node."""
        if not self._maybe_local(key):
            return None
        while (loading := self._loading.get(key)) is not None:
            await loading.wait()
            data = self.memory.get(key)
            if data is not None:
                return data
        with _in_flight(self._loading, key):
            data = await trio.to_thread.run_sync(self._load_local_sync, key, limiter=self._local_io)
        if data is not None:
            self.memory.stats.miss_bytes += len(data)
            self.memory.put(key, data)
        return data

    def _read_local_range(self, key: str, start: int, end: int) -> Optional[bytes]:
        started = time.perf_counter()
        chunk = self.staging.read_range(key, start, end) if self._staged(key) else None
        if chunk is None:
            chunk = self.disk.get_range(key, start, end)
        if chunk is not None:
            self.read_costs.local(time.perf_counter() - started)
        return chunk

    def _get_range_sync(self, key: str, start: int, end: int) -> bytes:
        started = time.perf_counter()
        chunk = self.remote.get_range(object_name(key), start, end)
        if (end - start) * 4 < self.block_size:  # the costs compared are those of small reads
            self.read_costs.bucket(time.perf_counter() - started)
        return chunk

    def _load_local_sync(self, key: str) -> Optional[BlockData]:
        if self._staged(key):
            data = self.staging.read(key)
            if data is not None:
                return data
        return self.disk.get(key)

    async def _from_database(self, key: str, keep: bool = True) -> BlockData:
        """A block the database keeps (``seal_inline``); ``keep``: in the memory cache."""
        data = await self.meta.block_data(key)
        if data is None:
            raise BlockReadError(f"block {key[:20]} is not in the database")
        if keep:
            self.memory.put(key, data)
        return data

    async def fetch(self, key: str) -> BlockData:
        """The whole block, verified, from the bucket (one fetch per key at a time)."""
        if is_inline(key):
            return self.memory.get(key) or await self._from_database(key)
        while key in self._fetching:
            await self._fetching[key].wait()
            data = self.memory.get(key) or self._handed_over.get(key)
            if data is None:
                data = await self._load_local(key)  # warming keeps what it fetches on disk only
            if data is not None:
                return data
        with _in_flight(self._fetching, key):
            data = await self.remote.run(self._fetch_verified_sync, key)
            self.memory.stats.miss_bytes += len(data)
            self.disk.stats.miss_bytes += len(data)
            self.memory.put(key, data)
            try:
                await trio.to_thread.run_sync(self.disk.put, key, data, limiter=self._local_io)
            except OSError as exc:  # a full or failing cache disk must not fail the read
                log.warning("could not keep block %s in the disk cache: %s", key[:16], exc)
            return data

    def will_fill(self, keys: list[str]) -> None:
        """A page fill will bring these blocks to the kernel: until ``filled``, cache warming
        leaves them to it."""
        self._filling.update(keys)

    def filled(self, keys: list[str]) -> None:
        """The fill of these blocks is over (done, stopped or failed)."""
        self._filling.subtract(keys)
        for key in keys:
            if self._filling[key] <= 0:
                del self._filling[key]

    async def fetch_for_fill(self, key: str,
                             run: Optional[Callable[[Callable[[], BlockData]], Awaitable[BlockData]]] = None
                             ) -> BlockData:
        """The whole block for a page fill: from memory or this node's disk when they hold it,
        else from the bucket, once: a reader's fetch of it in flight is waited for, and a
        reader that waits for this one gets its bytes (kept in neither cache: the kernel's
        page cache is the copy). ``run`` runs the blocking fetch (default: a remote-store
        thread; a background fill passes its own lower-priority threads)."""
        if is_inline(key):
            return await self._from_database(key, keep=False)
        while True:
            data = self.memory.get(key) or self._handed_over.get(key)
            if data is not None:
                return data
            if key not in self._fetching:
                break
            await self._fetching[key].wait()
        if self.holds(key):
            data = await self._load_local(key)
            if data is not None:
                return data
        with _in_flight(self._fetching, key):
            data = await (run or self.remote.run)(functools.partial(self._fetch_verified_sync, key))
            self._handed_over[key] = data
            while len(self._handed_over) > HANDED_OVER:
                self._handed_over.popitem(last=False)
        return data

    def holds(self, key: str) -> bool:
        """Whether this node may have the block locally (memory, staging, disk cache)."""
        return key in self.memory or self._staged(key) or not self.disk.known_absent(key)

    def _fetch_verified_sync(self, key: str) -> BlockData:
        """Blocking: the whole block from the bucket, hashed in the same thread."""
        for _ in range(3):
            try:
                data = self.remote.get_block(object_name(key))
            except FileNotFoundError:
                raise BlockReadError(f"block {key[:16]} is missing from the bucket") from None
            except RemoteError as exc:
                raise BlockReadError(str(exc)) from exc
            self.stats.remote_full_fetches += 1
            if key_matches(key, data):
                return data
            log.error("block %s from the bucket failed its hash check; fetching again", key[:16])
        raise BlockReadError(f"block {key[:16]}: hash mismatch")

    # --- prefetch ------------------------------------------------------------
    def prefetch(self, keys: list[str], to_disk: bool = False) -> None:
        """Fetch blocks in the background: into both caches for a reader about to want them
        (readahead), or, with ``to_disk``, into the disk cache only, in the low-priority
        threads (a block that range reads keep coming back to; they go on by range). Never
        from a bucket as fast as local disk: there every read is a range read."""
        if self._nursery is None or not self.read_costs.whole_blocks_pay():
            return
        for key in keys:
            if key in self.memory or key in self._fetching or key in self._loading or is_inline(key):
                continue
            self._nursery.start_soon(self._prefetch_one, key, to_disk)

    async def _prefetch_one(self, key: str, to_disk: bool) -> None:
        async with self._prefetch_limiter:
            try:
                if to_disk:
                    fetched = await self.ensure_cached(key, self._background.run)
                elif key in self.memory or key in self._fetching or await self._load_local(key) is not None:
                    fetched = False  # a reader got there first, or it was on this node
                else:
                    await self.fetch(key)
                    fetched = True
                if fetched:
                    self.stats.prefetches += 1
            except Exception as exc:  # noqa: BLE001 - a background fetch must never stop the daemon
                log.warning("prefetch of block %s failed: %s", key[:16], exc)

    def _fetch_to_disk_sync(self, key: str) -> int:
        data = self._fetch_verified_sync(key)
        self.disk.stats.miss_bytes += len(data)
        # Warming and the warmup command fill the disk tier only, not the page cache too:
        # a GiB of warmed blocks would grow it (see localio) for reads that may never come.
        self.disk.put(key, data, on_disk_only=True)
        return len(data)

    async def ensure_cached(self, key: str,
                            run: Optional[Callable[[Callable[[], int]], Awaitable[int]]] = None) -> bool:
        """Make sure a block is on local disk, fetching it into the disk cache only (the
        warmup command, cache warming); True if it had to be fetched. ``run`` runs the
        blocking fetch (default: a remote-store thread; cache warming passes its own
        lower-priority threads). Reads of the block meanwhile wait for it."""
        if is_inline(key):
            return False  # the database keeps it: a read costs one query, not a download
        if key in self._filling:
            return False  # a page fill brings it to this node's page cache
        while True:
            while key in self._fetching:
                await self._fetching[key].wait()
            if self._staged(key):
                return False
            if await trio.to_thread.run_sync(self.disk.__contains__, key, limiter=self._local_io):
                return False
            if key not in self._fetching:  # a reader may have started fetching it meanwhile
                break
        with _in_flight(self._fetching, key):
            await (run or self.remote.run)(functools.partial(self._fetch_to_disk_sync, key))
        return True
