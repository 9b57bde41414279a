"""One thin wrapper over fsspec: whole and range reads, puts, deletes, listing.

Every call is retried with exponential backoff; the async methods run the
blocking fsspec call in a worker thread under a concurrency limit, so the trio
event loop never waits on the network.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Optional, TypeVar

import fsspec
import tenacity
import trio

from fusestate.localio import OpenFiles, copy_direct, drop_cached, read_file, write_all, write_file
from fusestate.read_trace import ReadTrace
from fusestate.remote.faults import FaultInjector

log = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that retrying cannot fix.
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError)


class RemoteError(IOError):
    """A remote call failed after the whole retry budget."""


@dataclass
class RemoteStats:
    """Counters the metrics exporter and tests read."""

    requests: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    observer: Optional[Callable[[str, float], None]] = None  # latency hook (metrics)

    def record(self, op: str, seconds: float, ok: bool) -> None:
        if self.observer is not None:
            self.observer(op, seconds)
        self.requests[op] = self.requests.get(op, 0) + 1
        if not ok:
            self.failures[op] = self.failures.get(op, 0) + 1


class RemoteStore:
    """Objects under one root of an fsspec filesystem."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, retries: int = 6,
                 backoff_initial: float = 0.2, backoff_max: float = 10.0,
                 concurrency: int = 16) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.stats = RemoteStats()
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        self._is_local = "file" in protocols or "local" in protocols
        self._is_memory = "memory" in protocols
        # s3fs fetches a whole object with a HEAD first (``max_concurrency`` > 1: to split a large
        # one into ranges); a block is one GET. The HEAD was a second round trip per block and a
        # third of the client's CPU per GB fetched.
        self._whole_get: dict[str, int] = {"max_concurrency": 1} if "s3" in protocols else {}
        # file://: objects are immutable, so their descriptors stay open for range reads.
        self._open_files: Optional[OpenFiles] = OpenFiles() if self._is_local else None
        self._limiter = trio.CapacityLimiter(concurrency)
        self._retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(retries),
            wait=tenacity.wait_exponential_jitter(multiplier=backoff_initial, max=backoff_max),
            retry=tenacity.retry_if_not_exception_type(_PERMANENT),
            before_sleep=self._before_retry,
            reraise=True,
        )
        self.on_call: Optional[Callable[[str, str], None]] = FaultInjector.from_env()  # tests only
        self.trace: Optional[ReadTrace] = None  # --read-trace: each block read from the bucket

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    @property
    def is_local(self) -> bool:
        """A ``file://`` bucket: a directory of this machine, which until timed is taken to be
        as quick as the cache disk (an object store, to be remote)."""
        return self._is_local

    # --- synchronous API (worker threads and offline commands) -----------
    def _before_retry(self, state: tenacity.RetryCallState) -> None:
        self.stats.retries += 1
        exc = state.outcome.exception() if state.outcome else None
        log.warning("remote call failed (attempt %d), retrying: %s", state.attempt_number, exc)

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        def attempt() -> T:
            started = time.monotonic()
            ok = False
            try:
                if self.on_call is not None:
                    self.on_call(op, key)
                result = fn()
                ok = True
                return result
            except (FileNotFoundError, FileExistsError):
                ok = True  # an answer from the bucket, not a failure
                raise
            finally:
                self.stats.record(op, time.monotonic() - started, ok)

        try:
            return self._retrying(attempt)
        except _PERMANENT:
            raise
        except Exception as exc:  # noqa: BLE001
            raise RemoteError(f"{op} {key}: {exc}") from exc

    def get(self, key: str) -> bytes:
        data = self._call("get", key, lambda: self.fs.cat_file(self.path(key)))
        self.stats.bytes_in += len(data)
        return data

    def get_block(self, key: str) -> bytes | memoryview:
        """A whole block object; on file:// read past the page cache (``localio.read_file``):
        the block store keeps what it fetched in its own caches."""
        path = self.path(key)
        data = self._call("get", key, (lambda: read_file(path)) if self._is_local
                          else lambda: self.fs.cat_file(path, **self._whole_get))
        self.stats.bytes_in += len(data)
        if self.trace is not None:
            self.trace.event("get", n=len(data))
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if self._open_files is not None:  # a point lookup's read: one pread, without fsspec's file object
            files = self._open_files
            data = self._call("get_range", key, lambda: files.read(self.path(key), start, end))
        else:
            data = self._call("get_range", key, lambda: self.fs.cat_file(self.path(key), start=start, end=end))
        self.stats.bytes_in += len(data)
        if self.trace is not None:
            self.trace.event("get_range", n=len(data))
        return data

    def get_range_now(self, key: str, start: int, end: int) -> Optional[bytes]:
        """A range read made by the caller itself, on the event loop, without a worker
        thread or retries: ``file://`` only, where it is one ``pread`` (the caller judged
        the disk quick enough to block on). None where a worker thread must do the read
        after all: another backend, faults injected, or an error, which the thread's read
        meets again with its retries."""
        if self._open_files is None or self.on_call is not None:
            return None
        started = time.monotonic()
        try:
            data = self._open_files.read(self.path(key), start, end)
        except OSError:
            return None
        self.stats.record("get_range", time.monotonic() - started, True)
        self.stats.bytes_in += len(data)
        if self.trace is not None:
            self.trace.event("get_range", n=len(data))
        return data

    def put(self, key: str, data: bytes | bytearray | memoryview, direct: bool = False) -> None:
        """Write an object; atomic on every backend (temp file + rename on file://).
        ``direct``: a block, which on file:// goes past the page cache (``O_DIRECT``
        where the filesystem allows it, straight from a page-aligned buffer)."""
        if self._is_local:
            if direct:
                self._call("put", key, lambda: self._put_local(key, lambda f: _write_direct(f, data)))
            else:
                self._call("put", key, lambda: self._put_local(key, lambda f: write_all(f, data)))
        else:
            payload = data if isinstance(data, bytes) else bytes(data)  # fsspec's clients want bytes
            self._call("put", key, lambda: self.fs.pipe_file(self.path(key), payload))
        self.stats.bytes_out += len(data)

    def put_file(self, key: str, path: str) -> None:
        """Write an object from a local file, leaving none of it in the page cache. On
        file:// the bytes go disk to disk (O_DIRECT, else copy_file_range), never through Python."""
        def upload() -> int:
            data = bytes(read_file(path))  # past the page cache; fsspec's clients want bytes
            self.fs.pipe_file(self.path(key), data)
            return len(data)

        if self._is_local:
            size = self._call("put", key, lambda: self._put_local(key, lambda f: _copy_file(path, f)))
        else:
            size = self._call("put", key, upload)
        self.stats.bytes_out += size

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create an object only if it does not exist (S3 If-None-Match, GCS generation 0,
        an exclusive link on file://); False if it was already there."""
        try:
            if self._is_local:
                self._call("put", key, lambda: self._put_local(key, lambda f: write_all(f, data), exclusive=True))
            elif self._is_memory:
                if self.fs.exists(self.path(key)):
                    return False
                self._call("put", key, lambda: self.fs.pipe_file(self.path(key), data))
            else:
                self._call("put", key, lambda: self.fs.pipe_file(self.path(key), data, mode="create"))
        except FileExistsError:
            return False
        self.stats.bytes_out += len(data)
        return True

    def _put_local(self, key: str, fill: Callable[[BinaryIO], int], exclusive: bool = False) -> int:
        """Write a file:// object through a synced temp file; ``fill`` writes the bytes."""
        target = self.path(key)
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                size = fill(f)
                f.flush()
                os.fsync(f.fileno())
                drop_cached(f.fileno())  # read back only on a miss of every cache
            if exclusive:
                os.link(tmp, target)  # fails with FileExistsError if it exists
                os.unlink(tmp)
            else:
                os.replace(tmp, target)
        except BaseException:
            with_suppress_remove(tmp)
            raise
        if self._open_files is not None:
            self._open_files.forget(target)  # a descriptor of a replaced file reads the old one
        return size

    def exists(self, key: str) -> bool:
        return self._call("head", key, lambda: self.fs.exists(self.path(key)))

    def object_exists(self, key: str) -> bool:
        """Whether a non-empty object exists, in one request: a GET of its first byte.

        fsspec's ``exists`` on an object store asks again with a listing when the object
        is missing (it could be a "directory"): two round trips for every "no", which is
        the answer a fence check gets almost always."""
        if self._is_local or self._is_memory:
            return self.exists(key)
        try:
            self._call("head", key, lambda: self.fs.cat_file(self.path(key), start=0, end=1))
        except FileNotFoundError:
            return False
        return True

    def delete(self, key: str) -> None:
        if self._open_files is not None:
            self._open_files.forget(self.path(key))
        try:
            self._call("delete", key, lambda: self.fs.rm_file(self.path(key)))
        except FileNotFoundError:
            pass

    def list(self, prefix: str) -> list[str]:
        """Keys (relative to the root) of every object under ``prefix``."""
        base = self.path(prefix).rstrip("/")
        try:
            found = self._call("list", prefix, lambda: self.fs.find(base))
        except FileNotFoundError:
            return []
        root_len = len(self.root.lstrip("/")) + 1
        return sorted(p.lstrip("/")[root_len:] for p in found
                      if not os.path.basename(p).startswith(".tmp-"))

    def close(self) -> None:
        if self._open_files is not None:
            self._open_files.close()

    # --- async API (the event loop) --------------------------------------
    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def aput(self, key: str, data: bytes | bytearray | memoryview, direct: bool = False) -> None:
        await self.run(self.put, key, data, direct)

    async def aput_file(self, key: str, path: str) -> None:
        await self.run(self.put_file, key, path)

    async def aexists(self, key: str) -> bool:
        return await self.run(self.exists, key)

    async def adelete(self, key: str) -> None:
        await self.run(self.delete, key)


def _write_direct(out: BinaryIO, data: bytes | bytearray | memoryview) -> int:
    """Write a block into an empty file past the page cache where the filesystem allows
    it (the file is fsynced and its pages dropped after, either way)."""
    write_file(out, data, keep_cached=False, direct=True)
    return len(data)


def _copy_file(path: str, out: BinaryIO) -> int:
    """Copy a whole file into ``out``: from disk to disk where the filesystems allow
    ``O_DIRECT``, else inside the kernel, else with plain reads."""
    copied_direct = copy_direct(path, out.fileno())
    if copied_direct is not None:
        return copied_direct
    with open(path, "rb") as src:
        size = os.fstat(src.fileno()).st_size
        copied = 0
        try:
            while copied < size:
                n = os.copy_file_range(src.fileno(), out.fileno(), size - copied)
                if n == 0:
                    break
                copied += n
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP) or copied:
                raise
            shutil.copyfileobj(src, out, 1 << 20)
            copied = size
        drop_cached(src.fileno())
        return copied


def with_suppress_remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
