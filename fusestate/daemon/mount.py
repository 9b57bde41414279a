"""Run one mount: check the inputs, wire the layers, serve FUSE, flush on the way out."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Any, Optional

import trio
from prometheus_client import CollectorRegistry

from fusestate.config import MountConfig, format_size
from fusestate.daemon import components, control, volume
from fusestate.daemon.allocator import keep_block_buffers_mapped
from fusestate.daemon.metrics import Histograms, listen, serve_stats
from fusestate.daemon.stats import status_numbers
from fusestate.daemon.lease import (FENCE_GRACE, TAKEOVER_WAIT, Lease, LeaseLost, LeaseRecord, epoch_starts,
                                    read_leases)
from fusestate.daemon.locality import REFRESH_SECONDS as LOCALITY_REFRESH_SECONDS, Locality, warm_dirs, warm_share
from fusestate.daemon.paths import CacheLayout, check_mountpoint, control_socket, prepare_cache_dir
from fusestate.errors import UserError
from fusestate.localio import libc
from fusestate.fuse import kernel
from fusestate.fuse import frontend
from fusestate.fuse.adapter import FuseOperations
from fusestate.fuse.page_fill import PageFill
from fusestate.read_trace import open_trace
from fusestate.blocks.keys import is_inline, object_name
from fusestate.meta.embedded.restore import restore_metadata
from fusestate.meta.embedded.shipper import JournalShipper
from fusestate.meta.engine import MetaEngine
from fusestate.meta.embedded.engine import SQLiteEngine
from fusestate.remote import RemoteStore, open_bucket

log = logging.getLogger(__name__)

FENCE_ACTIVE_SECONDS = 30.0  # keep checking the fence this long after the last fsync


def lock_cache_dir(layout: CacheLayout) -> int:
    fd = os.open(layout.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"cache dir {layout.root} is in use by another fusestate daemon") from None
    return fd


class Daemon:
    """One mounted volume and everything behind it."""

    def __init__(self, cfg: MountConfig, ready_fd: Optional[int] = None) -> None:
        self.cfg = cfg
        self.ready_fd = ready_fd
        self.started_at = time.time()
        self._finished: Optional[trio.Event] = None  # created inside trio.run
        self.gc_deleted = 0
        self.restored = None
        self.lease: Optional[Lease] = None
        self.kernel_readahead: Optional[int] = None  # bytes, once mounted (None: unknown)
        self._umount_requests = 0  # control requests still inside unmount()
        self.metrics_addr: Optional[tuple[str, int]] = None  # served, once prepared (None: off)
        self._dropped_logged = False  # the unpublished data of a lost session was reported

    # --- setup (before trio) ------------------------------------------------------
    def prepare(self) -> None:
        cfg = self.cfg
        self.frontend_choice = frontend.choose(cfg.frontend)  # before anything is opened: a bad choice changes nothing
        check_mountpoint(cfg.mountpoint)
        self.layout = prepare_cache_dir(cfg.cache_dir)
        self._lock_fd = lock_cache_dir(self.layout)
        self.registry = CollectorRegistry()
        # Before the bucket and the lease: a metrics port taken fails the mount with nothing else begun.
        self.metrics_addr = listen(cfg.metrics_addr, self.registry)
        usage = shutil.disk_usage(cfg.cache_dir)
        self.disk_reserve = metadata_reserve(usage.total)
        self._fit_cache_to_disk(usage.free)
        fs, location = open_bucket(cfg.url, cfg.endpoint_url, cfg.remote_timeout)
        self.location = location
        self.remote = RemoteStore(fs, location.root, retries=cfg.remote_retries,
                                  concurrency=max(16, cfg.upload_concurrency * 2))
        histograms = Histograms(self.registry)
        self.remote.stats.observer = Histograms.observer(histograms.remote)  # before the first request
        if cfg.meta_url:
            from fusestate.meta.postgres.pool import check_connect  # psycopg: only shared mounts load it

            check_connect(cfg.meta_url)
        self.volume = volume.load_or_create(self.remote, cfg.block_size, create=not cfg.read_only,
                                            meta_url=cfg.meta_url)
        cfg.block_size = self.volume.block_size  # an existing volume's own, whatever the flag left unset
        self.meta = self._open_metadata()
        assert cfg.max_dirty is not None
        self.parts = components.build(self.meta, self.remote, self.layout, components.Settings(
            block_size=self.volume.block_size, read_cache_size=cfg.read_cache_size,
            memory_cache_size=cfg.memory_cache_size, max_dirty=cfg.max_dirty, durability=cfg.durability,
            upload_delay=cfg.upload_delay, upload_concurrency=cfg.upload_concurrency,
            readahead_blocks=cfg.readahead_blocks, whole_blocks=cfg.whole_blocks, prefetch=cfg.prefetch,
            read_only=cfg.read_only, scratch_dirs=tuple(cfg.scratch_dirs),
            store_ahead=tuple(cfg.store_ahead), staging_reserve=self.disk_reserve))
        p = self.parts
        self.memory, self.disk, self.staging = p.memory, p.disk, p.staging
        self.uploader, self.blocks, self.warmer, self.fs = p.uploader, p.blocks, p.warmer, p.fs
        assert cfg.attr_timeout is not None
        self.ops = FuseOperations(self.fs, attr_timeout=cfg.attr_timeout)
        self.frontend = frontend.build(self.frontend_choice, self.ops)
        if cfg.prefetch_links != "off" and not cfg.read_only:
            self.ops.page_fill = PageFill(self.fs, self.frontend.notify_store, budget=cfg.page_fill_budget,
                                          mode=cfg.prefetch_links)
        # The embedded engine's own durability: its journal shipped to the bucket, fenced by the lease.
        self.shipper: Optional[JournalShipper] = None
        if isinstance(self.meta, SQLiteEngine):
            epoch = self.lease.record.epoch if self.lease and self.lease.record else 0
            self.shipper = JournalShipper(self.meta, self.remote, self.uploader, epoch,
                                          interval=cfg.journal_interval)
            if not cfg.read_only:
                self.fs.ship_metadata = self.shipper.wait_shipped
                self.shipper.fence = self.lease
        self.blocks.read_observer = Histograms.observer(histograms.block_read)
        self.trace = open_trace(cfg.read_trace)
        self.remote.trace = self.ops.trace = self.trace
        if self.ops.page_fill is not None:
            self.ops.page_fill.trace = self.trace
        self.ops.op_observer = Histograms.observer(histograms.fuse)
        self.ops.warm_share = self.warm_share
        self.last_locality: Optional[Locality] = None  # refreshed for the metrics

    def _open_metadata(self) -> MetaEngine:
        """The shared engine the volume names, or the embedded one: local metadata if this
        node was the volume's last writer, else restored from the bucket (taking the volume's
        lease, a new epoch, for a read-write mount)."""
        layout, cfg = self.layout, self.cfg
        if cfg.meta_url:
            from fusestate.meta.postgres.engine import PostgresEngine  # psycopg: only shared mounts load it

            return PostgresEngine(cfg.meta_url, self.volume.block_size, mountpoint=cfg.mountpoint,
                                  read_only=cfg.read_only, session_ttl=cfg.session_timeout,
                                  attr_cache_seconds=cfg.attr_timeout or 0.0,
                                  outage_budget=cfg.meta_outage_budget, pool_size=cfg.meta_connections,
                                  prepare=cfg.meta_pooler != "transaction", inline_max=cfg.inline_max,
                                  lookup_cache=cfg.lookup_cache == "on")
        known: dict[str, Any] = {}
        with contextlib.suppress(FileNotFoundError, ValueError), open(layout.volume_file) as f:
            known = json.load(f)
        if known.get("volume_id") not in (None, self.volume.volume_id):
            raise UserError(
                f"cache dir {layout.root} belongs to another volume ({known.get('url')}); "
                "use a separate --cache-dir per volume"
            )
        leases = read_leases(self.remote)
        current = leases[-1] if leases else None
        if cfg.read_only:
            path = os.path.join(layout.root, "meta-readonly.db")
            self.restored = restore_metadata(self.remote, path, epoch_starts(leases))
            self.lease = None
            return SQLiteEngine(path, block_size=self.volume.block_size, read_only=True)

        holder = known.get("holder") or Lease.make_holder_id()
        self.lease = Lease(self.remote, holder, ttl=cfg.lease_ttl)
        if current is not None and current.holder != holder and current.expires_at > time.time() \
                and not cfg.takeover:
            self.lease.acquire(0, False, current)  # raises the clear "held by" error
        ours = current is not None and known.get("epoch") == current.epoch and current.holder == holder
        if os.path.exists(layout.metadata) and (ours or (current is None and not leases)):
            meta = SQLiteEngine(layout.metadata, block_size=self.volume.block_size)
            self.restored = None
            record = self.lease.acquire(int(meta.get_setting("shipped_seq") or 0), cfg.takeover, current)
        else:
            if os.path.exists(layout.metadata):
                log.warning("local metadata in %s is older than the volume's (epoch %s); restoring from the bucket",
                            layout.root, current.epoch if current else "?")
            record = self.lease.acquire(None, cfg.takeover, current)
            try:
                meta = self._restore(current)
            except BaseException:
                with contextlib.suppress(Exception):
                    self.lease.release()  # nothing written: let the next attempt in at once
                raise
        with open(layout.volume_file, "w") as f:
            json.dump({"volume_id": self.volume.volume_id, "url": cfg.url, "holder": holder,
                       "epoch": record.epoch}, f)
        return meta

    def _restore(self, previous: Optional[LeaseRecord]) -> SQLiteEngine:
        """The volume's metadata from the bucket, read after this mount's lease is written
        (and, if the previous holder may still be shipping, after ``TAKEOVER_WAIT``): every
        segment that holder acknowledged is then in the bucket (see ``daemon.lease``)."""
        assert self.lease is not None
        if Lease.may_still_write(previous):
            time.sleep(TAKEOVER_WAIT)
        layout = self.layout
        self.restored = restore_metadata(self.remote, layout.metadata, epoch_starts(read_leases(self.remote)))
        # Blocks staged by older local metadata are not part of the restored history.
        shutil.rmtree(layout.staging, ignore_errors=True)
        meta = SQLiteEngine(layout.metadata, block_size=self.volume.block_size)
        self.lease.settle(int(meta.get_setting("shipped_seq") or 0))
        return meta

    def _fit_cache_to_disk(self, free: int) -> None:
        """Never let the cache fill its disk: the metadata (SQLite) must always be able to
        write, or a full disk would fail writes instead of making them wait for uploads."""
        reserve = self.disk_reserve
        owned = sum(_tree_bytes(d) for d in (self.layout.read_cache, self.layout.staging, self.layout.scratch))
        room = free + owned - reserve
        if room < self.cfg.cache_size:
            log.warning("--cache-size %s does not fit on the cache dir's disk (%s free, %s kept free for "
                        "metadata): using %s", format_size(self.cfg.cache_size), format_size(free),
                        format_size(reserve), format_size(max(room, 0)))
            self.cfg.fit_cache_size(room)

    # --- serving ------------------------------------------------------------------
    def fuse_options(self) -> set[str]:
        opts = {"default_permissions"}
        opts |= {f"fsname=fusestate:{self.location.bucket}", "subtype=fusestate", "default_permissions", "noatime",
                 "nodev"}  # device nodes are metadata: they never open as devices
        if self.cfg.allow_other:
            opts.add("allow_other")
        if self.cfg.read_only:
            opts.add("ro")
        if self.cfg.debug:
            opts.add("debug")
        opts.update(self.cfg.fuse_options)
        return opts

    async def serve(self) -> None:
        self._finished = trio.Event()
        async with trio.open_nursery() as nursery:
            requeued = await self.parts.start(nursery)
            if requeued:
                log.info("crash recovery: %d staged blocks queued for upload", requeued)
            if not self.cfg.read_only:
                if self.shipper is not None:
                    await nursery.start(self.shipper.run)
                    nursery.start_soon(self._heartbeat)
                    nursery.start_soon(self._keep_fence_checked)
                nursery.start_soon(self._collect_garbage_loop)
            if self.cfg.prefetch != "off":
                nursery.start_soon(self.warmer.run)
            if self.ops.page_fill is not None:
                nursery.start_soon(self.ops.page_fill.run)
            if self.metrics_addr is not None:
                serve_stats(self, self.registry)
                nursery.start_soon(self._refresh_locality)
            await nursery.start(control.serve, control_socket(self.cfg.mountpoint), self.handle_control)
            try:
                self.frontend.mount(self.cfg.mountpoint, self.fuse_options())
            except RuntimeError as exc:
                raise UserError(f"cannot mount on {self.cfg.mountpoint}: {exc}") from None
            log.info("front end: %s (%s)", self.frontend.name, self.frontend_choice.reason)
            nursery.start_soon(self._signals)
            nursery.start_soon(self._announce_ready)
            try:
                await self.frontend.serve()
            finally:
                self.frontend.close()
            log.info("unmounted; flushing dirty data")
            with trio.CancelScope(shield=True):
                await self._flush_everything()
                if not self.session_lost:
                    await self.fs.abandon_all_sealed_ahead()  # no link out of a scratch dir can come now
                await self._ship_snapshot()
                self._finished.set()
                # fusermount returns only once the kernel has dropped the mount's page cache,
                # which can take longer than our flush: wait for the umount request to return.
                with trio.move_on_after(30):
                    while self._umount_requests:
                        await trio.sleep(0.01)
                await trio.sleep(0.2)  # let the umount client read its answer
            nursery.cancel_scope.cancel()

    async def _announce_ready(self) -> None:
        # The stat goes through this loop's FUSE handlers and the sysfs write is file I/O:
        # both in a thread, before anything opens a file (each copies the window at open).
        self.kernel_readahead = await trio.to_thread.run_sync(self._tune_kernel)
        log.info("mounted %s on %s", self.cfg.url, self.cfg.mountpoint)
        if self.ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(self.ready_fd, b"ready\n")
                os.close(self.ready_fd)
            self.ready_fd = None
        notify_systemd("READY=1")

    def _tune_kernel(self) -> Optional[int]:
        """Set the mount's read-ahead window (``--kernel-readahead``); the window in force."""
        st_dev = os.stat(self.cfg.mountpoint).st_dev
        try:
            if self.cfg.kernel_readahead:
                return kernel.set_read_ahead(st_dev, self.cfg.kernel_readahead)
            return kernel.read_ahead_bytes(st_dev)
        except (OSError, ValueError) as exc:
            log.info("kernel read-ahead left as it is (%s): sequential reads arrive in 128 KiB requests", exc)
            return None

    @property
    def session_lost(self) -> bool:
        """The other nodes cleaned up this mount's session on a shared volume: whatever it
        still holds can never be published (see docs/semantics.md)."""
        return bool(getattr(self.meta, "lost", False))

    async def _flush_everything(self) -> None:
        if self.session_lost:
            self._drop_unpublished()
            return
        await self.fs.flush_all()
        await self.uploader.drain()
        await self.fs.sync_metadata()

    def _drop_unpublished(self) -> None:
        """Unmounting a mount whose session was lost: what it holds stays unpublished. Say how
        much, once; the next mount starts from the volume as the database has it."""
        if self._dropped_logged:
            return
        self._dropped_logged = True
        log.error("unmounting without publishing: this mount's metadata session was lost, so the %s written on "
                  "this node and not committed before that are dropped", format_size(self.uploader.dirty_bytes()))

    async def _ship_snapshot(self) -> None:
        """Final journal segment and snapshot, then let the next holder in at once."""
        if self.cfg.read_only or self.shipper is None or self.shipper.stopped:
            return
        try:
            await self.shipper.ship()
            await self.shipper.snapshot()
            await self.remote.run(self.lease.release)
        except Exception as exc:  # noqa: BLE001 - local metadata still has everything
            log.error("could not ship the final metadata: %s", exc)

    async def _heartbeat(self) -> None:
        """Renew the lease; a newer epoch means we were fenced off: stop writing."""
        assert self.lease is not None
        while True:
            await trio.sleep(self.lease.ttl / 3)
            try:
                await self.remote.run(self.lease.renew)
            except LeaseLost as exc:
                log.error("%s: this mount is now read-only and ships nothing more", exc)
                self.fs.read_only = True
                self.shipper.stopped = True
                return
            except Exception as exc:  # noqa: BLE001 - keep trying; the lease has slack
                log.warning("lease renewal failed: %s", exc)

    async def _keep_fence_checked(self) -> None:
        """While fsyncs come, check for a newer epoch often enough that the journal shipper
        can acknowledge a segment without a check of its own (``Lease.vouches_for``)."""
        assert self.lease is not None and self.shipper is not None
        while not self.shipper.stopped:
            await trio.sleep(FENCE_GRACE / 3)
            if time.monotonic() - self.shipper.last_request > FENCE_ACTIVE_SECONDS:
                continue
            try:
                await self.remote.run(self.lease.superseded)
            except Exception as exc:  # noqa: BLE001 - the shipper then checks itself
                log.debug("fence check failed: %s", exc)

    async def _collect_garbage_loop(self) -> None:
        while True:
            await trio.sleep(self.cfg.gc_interval)
            try:
                await self.collect_garbage()
            except Exception as exc:  # noqa: BLE001
                log.warning("garbage collection failed: %s", exc)

    async def collect_garbage(self) -> int:
        """Delete uploaded blocks that no kept snapshot or journal can reference any more."""
        if (self.shipper is not None and self.shipper.stopped) or self.session_lost:
            return 0
        covered = self.shipper.oldest_snapshot_seq if self.shipper is not None else 0
        keys = await self.meta.claim_garbage(time.time() - self.cfg.gc_grace, covered)
        if not keys:
            return 0
        deleting = self.uploader.deleting
        failed: list[str] = []

        async def delete(key: str) -> None:
            if is_inline(key):
                return  # in the database only: its row goes with garbage_deleted
            try:
                await self.remote.adelete(object_name(key))
            except Exception as exc:  # noqa: BLE001 - kept for the next round
                failed.append(key)
                log.warning("garbage collection could not delete block %s: %s", key[:16], exc)

        for key in keys:
            deleting[key] = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                for key in keys:
                    nursery.start_soon(delete, key)
        finally:
            for key in keys:
                deleting.pop(key).set()
        deleted = [k for k in keys if k not in failed]
        await self.meta.garbage_deleted(deleted)
        await self.meta.garbage_kept(failed)
        self.gc_deleted += len(deleted)
        log.info("garbage collection deleted %d blocks", len(deleted))
        return len(deleted)

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("received %s: flushing and unmounting", signal.Signals(signum).name)
                await self.unmount(force=True)

    async def unmount(self, force: bool = False) -> None:
        """Flush while still mounted, then unmount (lazily if forced and busy)."""
        notify_systemd("STOPPING=1")
        # Pages the kernel still holds for open files come to us now, while we can store them.
        await trio.to_thread.run_sync(_syncfs, self.cfg.mountpoint)
        await self._flush_everything()
        result = await trio.to_thread.run_sync(_fusermount, self.cfg.mountpoint, False)
        if result is not None and force:
            log.warning("mountpoint busy (%s); detaching it lazily", result)
            await trio.to_thread.run_sync(_fusermount, self.cfg.mountpoint, True)
            self.frontend.terminate()
        elif result is not None:
            raise UserError(f"cannot unmount {self.cfg.mountpoint}: {result}")

    async def handle_control(self, request: dict[str, Any]) -> dict[str, Any]:
        command = request.get("command")
        if command == "status":
            status = self.status()
            if self.meta.shared:
                status["sessions"] = await self._sessions()
            return {"ok": True, "status": status}
        if command == "umount":
            self._umount_requests += 1
            try:
                await self.unmount()
            finally:
                self._umount_requests -= 1
            assert self._finished is not None
            await self._finished.wait()
            return {"ok": True}
        if command == "gc":
            return {"ok": True, "deleted": await self.collect_garbage()}
        if command == "warm":
            path = str(request.get("path", ""))
            found = await self.locality(path)
            if not path.strip("/"):
                self.last_locality = found  # a walk of the whole volume: the metrics' too
            return {"ok": True, "warm": found.as_dict()}
        if command == "warmup":
            fetched = await self.warmup([int(i) for i in request.get("inodes", [])])
            return {"ok": True, "fetched": fetched}
        if command == "fill":
            return {"ok": True, **await self.fill_page_cache([int(i) for i in request.get("inodes", [])])}
        return {"ok": False, "error": f"unknown command {command!r}"}

    async def _sessions(self) -> list[dict[str, Any]]:
        """The shared volume's live mounts, this one marked."""
        try:
            found = await self.meta.sessions()  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - status must answer while the database is away
            return [{"error": str(exc)}]
        return [{"id": x.id, "host": x.host, "pid": x.pid, "mountpoint": x.mountpoint,
                 "heartbeat_age_seconds": round(x.heartbeat_age, 1), "this": x.id == self.meta.session_id}  # type: ignore[attr-defined]
                for x in found]

    def holds_block(self, key: str) -> bool:
        """Whether this node has the block without asking the bucket."""
        return key in self.memory or key in self.disk or os.path.exists(self.staging.path(key))

    async def locality(self, path: str = "", exact: bool = True) -> Locality:
        """Which files under ``path`` (relative to the mount) are warm on this node.
        ``exact=False`` asks only the caches' in-memory indexes (a block evicted lately may
        still count): no disk-cache lookup or stat per block, for the periodic refresh."""
        is_local = self.holds_block if exact else self.blocks.holds
        return await warm_dirs(self.meta, is_local, self.volume.block_size, path)

    async def warm_share(self, ino: int) -> tuple[int, int]:
        """The bytes under inode ``ino`` whose blocks this node holds, and their bytes in all.
        It answers a FUSE request (``user.fusestate.warm``), so it asks only the caches'
        in-memory indexes, as the metrics' refresh does: no disk-cache lookup on the loop."""
        return await warm_share(self.meta, self.blocks.holds, self.volume.block_size, ino)

    async def _refresh_locality(self) -> None:
        """Keep the metrics' view of warm directories at most REFRESH_SECONDS old."""
        while True:
            try:
                self.last_locality = await self.locality(exact=False)
            except Exception as exc:  # noqa: BLE001 - a metric must not end the mount
                log.warning("could not compute which files are warm here: %s", exc)
            await trio.sleep(LOCALITY_REFRESH_SECONDS)

    async def warmup(self, inodes: list[int]) -> int:
        fetched = 0
        keys = {k for ino in inodes for k in await self.fs.file_keys(ino)}
        async with trio.open_nursery() as nursery:
            limiter = trio.CapacityLimiter(8)

            async def one(key: str) -> None:
                nonlocal fetched
                async with limiter:
                    if await self.blocks.ensure_cached(key):
                        fetched += 1

            for key in keys:
                nursery.start_soon(one, key)
        return fetched

    async def fill_page_cache(self, inodes: list[int]) -> dict[str, int]:
        """Queue files a job is about to link into the kernel's page cache (--prefetch-links);
        the caller looked them up through the mount, so the kernel knows their inodes."""
        fill = self.ops.page_fill
        queued = queued_bytes = 0
        if fill is not None:
            nodes = []
            for ino in inodes:
                with contextlib.suppress(OSError):  # deleted since the caller looked it up: nothing to fill
                    nodes.append(await self.fs.getattr(ino))
            queued, queued_bytes = await fill.requested_all(nodes)
        return {"queued": queued, "queued_bytes": queued_bytes, "enabled": fill is not None}

    @property
    def restored_bytes(self) -> int:
        return self.restored.bytes_fetched if self.restored else 0

    @property
    def open_files(self) -> int:
        return self.fs.open_files

    def status(self) -> dict[str, Any]:
        """Every number of the stats table, and what this mount is and how it is set up."""
        doc = status_numbers(self)
        doc.update({
            "url": self.cfg.url, "mountpoint": self.cfg.mountpoint, "pid": os.getpid(),
            "uptime_seconds": round(time.time() - self.started_at, 1),
            "durability": self.cfg.durability, "scratch_dirs": list(self.cfg.scratch_dirs),
            "metrics_addr": f"{self.metrics_addr[0]}:{self.metrics_addr[1]}" if self.metrics_addr else None,
            "block_size": self.volume.block_size, "volume_id": self.volume.volume_id,
        })
        doc["fuse"].update({"operations": sum(self.ops.counters.values()), "kernel_readahead": self.kernel_readahead,
                            "frontend": self.frontend.name, "frontend_reason": self.frontend_choice.reason,
                            **self.frontend.agreed()})
        doc["metadata"]["engine"] = self.meta.kind
        doc["lease"].update({
            "holder": self.lease.holder if self.lease else None,
            "state": "read-only" if self.cfg.read_only else ("lost" if self.lease and self.lease.lost else "held"),
        })
        if "session" in doc:
            state = "read-only" if self.cfg.read_only else ("lost" if self.session_lost else "live")
            doc["session"].update({"id": self.meta.session_id, "state": state,  # type: ignore[attr-defined]
                                   "timeout_seconds": self.cfg.session_timeout,
                                   "standby_names": self.meta.pool.standby_names,  # type: ignore[attr-defined]
                                   "outage_budget_seconds": self.cfg.meta_outage_budget})
        doc["remote"]["small_read_ms"] = self.blocks.read_costs.summary()
        doc["warmup"].update({"mode": self.cfg.prefetch, "state": self.warmer.stats.state})
        doc["page_fill"]["mode"] = self.cfg.prefetch_links if self.ops.page_fill is not None else "off"
        return doc

    def close(self) -> None:
        if hasattr(self, "parts"):
            self.parts.close()
        else:
            with contextlib.suppress(Exception):
                self.meta.close()
        if hasattr(self, "remote"):
            self.remote.close()
        if getattr(self, "trace", None) is not None:
            self.trace.close()


CACHE_DISK_RESERVE_MIN = 16 << 20   # kept free on the cache dir's disk: 5% of it, within these bounds
CACHE_DISK_RESERVE_MAX = 1 << 30


def metadata_reserve(disk_total: int) -> int:
    """Free space the cache dir's disk keeps for the metadata: neither the cache nor staging takes it."""
    return max(CACHE_DISK_RESERVE_MIN, min(CACHE_DISK_RESERVE_MAX, disk_total // 20))


def _tree_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (what the cache already holds)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _syncfs(mountpoint: str) -> None:
    """Make the kernel write back its dirty pages of this mount (to this daemon)."""
    try:
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        log.warning("cannot open %s to sync it: %s", mountpoint, exc)
        return
    try:
        if libc is not None and libc.syncfs(fd) != 0:
            log.warning("syncfs of %s failed: %s", mountpoint, os.strerror(ctypes.get_errno()))
    finally:
        os.close(fd)


def _fusermount(mountpoint: str, lazy: bool) -> Optional[str]:
    """Unmount; returns None on success or the tool's complaint."""
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [mountpoint]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    text = (proc.stderr or proc.stdout).strip().splitlines()
    return text[-1] if text else f"fusermount3 exited {proc.returncode}"


def notify_systemd(state: str) -> None:
    """sd_notify without a dependency: one datagram to $NOTIFY_SOCKET."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(state.encode())


def run_foreground(cfg: MountConfig, ready_fd: Optional[int] = None) -> None:
    """Mount and serve until unmounted. Raises UserError for anything the user can fix."""
    keep_block_buffers_mapped()
    daemon = Daemon(cfg, ready_fd)
    try:
        daemon.prepare()
        try:
            trio.run(daemon.serve)
        except BaseExceptionGroup as group:
            # A UserError raised inside a nursery arrives wrapped; hand it on as itself.
            matched, rest = group.split(UserError)
            if matched is None or rest is not None:
                raise
            while isinstance(matched, BaseExceptionGroup):
                matched = matched.exceptions[0]
            raise matched from None
    finally:
        if hasattr(daemon, "meta"):
            daemon.close()

