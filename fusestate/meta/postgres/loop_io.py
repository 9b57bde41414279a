"""Database round trips on the trio loop, from code written as plain blocking calls.

A namespace operation is written once (``operations.py``) as ordinary functions that ask
the database and get rows back, for SQLite and PostgreSQL alike. Run in a worker thread,
each operation paid for two thread wake-ups on top of its round trips, about as much CPU
as the queries themselves on a small virtual machine. Here the operation runs in a
greenlet on the loop's own thread instead: where psycopg would block on its socket, the
greenlet hands control back to the trio task driving it, which waits for the socket with
trio and resumes the greenlet. The loop serves other FUSE requests meanwhile, as it did
while a worker thread waited.

psycopg lets a connection class decide how to wait for its socket (``Connection.wait``,
which its cursors, pipelines and transactions all go through); ``LoopConnection`` waits
as above when it runs in such a greenlet and as psycopg does anywhere else (a thread,
startup, shutdown).
"""

from __future__ import annotations

import select
from typing import Any, Awaitable, Callable, TypeVar

import greenlet
import psycopg
import trio
from psycopg.waiting import Ready, Wait

T = TypeVar("T")


class _LoopGreenlet(greenlet.greenlet):
    """A greenlet whose blocking points are awaited by the trio task that runs it."""


def on_loop() -> bool:
    """Whether the calling code runs under :func:`run_on_loop` (and may :func:`await_`)."""
    return isinstance(greenlet.getcurrent(), _LoopGreenlet)


def await_(thunk: Callable[[], Awaitable[T]]) -> T:
    """From code under :func:`run_on_loop`: have the driving task await ``thunk()``, and
    return its result (or raise its exception) here."""
    current = greenlet.getcurrent()
    if not isinstance(current, _LoopGreenlet):
        raise RuntimeError("await_() outside run_on_loop()")
    return current.parent.switch(thunk)


async def run_on_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking-style ``fn(*args)`` on this thread, awaiting whatever it waits for.

    Not cancellable once started, like a call in a worker thread: a transaction stopped
    half-way would leave its connection in an unknown state."""
    task = _LoopGreenlet(fn)
    with trio.CancelScope(shield=True):
        request = task.switch(*args)
        while not task.dead:
            try:
                value = await request()
            except BaseException as exc:  # delivered where fn waits, as a blocking call would raise it
                request = task.throw(exc)
            else:
                request = task.switch(value)
    return request


_READY = {(True, False): Ready.R, (False, True): Ready.W, (True, True): Ready.RW}


def _wait_socket(switch: Callable[[Callable[[], Awaitable[None]]], None], fd: int, wanted: Wait) -> Ready:
    """Wait until the socket is ready as psycopg asks; ``switch`` hands each wait to the
    driving task (:func:`await_`, with the greenlet looked up once per query)."""
    if wanted == Wait.R:
        switch(lambda: trio.lowlevel.wait_readable(fd))
        return Ready.R
    if wanted == Wait.W:
        switch(lambda: trio.lowlevel.wait_writable(fd))
        return Ready.W
    # Both (a pipeline sending its statements): whichever is ready now, else writable first.
    readable, writable, _ = select.select([fd], [fd], [], 0)
    if not readable and not writable:
        switch(lambda: trio.lowlevel.wait_writable(fd))
        return Ready.W
    return _READY[bool(readable), bool(writable)]


def wait_socket(fd: int, write: bool) -> None:
    """Wait until ``fd`` is readable (or writable): on the loop under :func:`run_on_loop`,
    else blocking the thread."""
    current = greenlet.getcurrent()
    if isinstance(current, _LoopGreenlet):
        wait = trio.lowlevel.wait_writable if write else trio.lowlevel.wait_readable
        current.parent.switch(lambda: wait(fd))
    elif write:
        select.select([], [fd], [])
    else:
        select.select([fd], [], [])


class LoopConnection(psycopg.Connection):
    """A psycopg connection that, under :func:`run_on_loop`, waits for its socket on the
    trio loop instead of blocking the thread."""

    def wait(self, gen: Any, interval: Any = 0.1, timeout: Any = None) -> Any:  # psycopg's hook
        task = greenlet.getcurrent()
        if not isinstance(task, _LoopGreenlet):
            return super().wait(gen, interval, timeout)
        switch, fd = task.parent.switch, self.pgconn.socket
        try:
            wanted = next(gen)
            while True:
                wanted = gen.send(_wait_socket(switch, fd, wanted))
        except StopIteration as done:
            return done.value
