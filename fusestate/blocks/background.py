"""Threads for fetches nobody is waiting on: cache warming after a mount, and whole blocks
that range reads keep coming back to.

They run at a lower CPU priority (nice 10) and in the idle I/O class, so the job's own
reads, a restarting JVM and the uploads get the cores and the disk first: on a fresh node
the foreground is a query waiting on point lookups, one at a time, while gigabytes arrive
beside it. Each pool has threads of its own, because on Linux a thread's nice value and
I/O class are its own and must not leak into the shared worker threads.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import trio

from fusestate.localio import libc

T = TypeVar("T")

BACKGROUND_NICE = 10
# ioprio_set(2): the idle I/O class.
SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(os.uname().machine)
IOPRIO_WHO_PROCESS, IOPRIO_CLASS_IDLE, IOPRIO_CLASS_SHIFT = 1, 3, 13


def _lower_priority() -> None:
    """Runs first in each thread of a background pool."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
    if SYS_IOPRIO_SET is not None and libc is not None:
        libc.syscall(SYS_IOPRIO_SET, IOPRIO_WHO_PROCESS, tid, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT)


class BackgroundThreads:
    """A small pool of low-priority threads that trio tasks can hand blocking work to."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=_lower_priority)

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the pool; the loop is woken when it is done (no second thread
        parked on the result, as trio's own to_thread would need)."""
        finished = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: object) -> None:
            with contextlib.suppress(trio.RunFinishedError):  # the daemon stopped meanwhile
                token.run_sync_soon(finished.set)

        future = self._pool.submit(fn)
        future.add_done_callback(wake)
        await finished.wait()
        return future.result()

    def close(self) -> None:
        """Drop queued work; a fetch already running finishes on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
