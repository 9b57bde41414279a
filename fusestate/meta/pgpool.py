"""Connections to the shared metadata database.

A whole transaction runs as one call (``fn(cursor)``), written as blocking code; on the
event loop it runs in a greenlet that waits for the database on the loop itself
(:mod:`fusestate.meta.loop_io`), so a FUSE operation costs no thread hop. Round trips
are what a namespace operation costs (about 0.1 ms each, even on the same machine), so a
caller may run without ``conn.transaction()`` (``explicit=True``): reads then run one
statement per round trip with no BEGIN and COMMIT of their own, and writes send BEGIN
together with their first statement; the pool ends whatever transaction is left open. A
bounded set of connections is reused. A transaction that meets a serialization failure,
a deadlock or a unique-key race is run again whole; a connection lost because the server
restarted is made again, and the transaction retried, for up to ``outage_budget``
seconds. New connections are made in a worker thread: connecting to a server that does
not answer may take ``CONNECT_TIMEOUT`` seconds, which the loop must not wait out.

Credentials follow libpq (``PGPASSWORD``, ``~/.pgpass``, ``PGSSLMODE``); a password in
the URL works but is never printed (``redact``).
"""

from __future__ import annotations

import errno
import functools
import logging
import queue
import random
import time
from typing import Any, Callable, Optional, TypeVar

import psycopg
import trio

from fusestate.config import redact_url
from fusestate.errors import FsError, UserError
from fusestate.meta.loop_io import LoopConnection, await_, on_loop, run_on_loop

log = logging.getLogger(__name__)

T = TypeVar("T")

IDLE, INTRANS, INERROR = (psycopg.pq.TransactionStatus.IDLE, psycopg.pq.TransactionStatus.INTRANS,
                          psycopg.pq.TransactionStatus.INERROR)
# Serialization failure, deadlock, unique race; and a prepared statement the connection
# lost (``pgpipeline`` prepares afresh on the next try).
RETRIED_SQLSTATES = {"40001", "40P01", "23505", "26000"}
MAX_CONFLICT_TRIES = 50
CONNECT_TIMEOUT = 5
# Server-side operations refuse with SQLSTATE 'FS' + a three-digit errno (FS002: ENOENT),
# or a code of the engine's own (FSLST: the session is gone). Without this, psycopg
# would raise them as OperationalError, which the pool takes for a lost connection.
REFUSED_CLASS = "FS"


class RefusedByServer(FsError):
    """A POSIX error a server-side operation raised: the transaction rolled back whole."""

    def __init__(self, sqlstate: str, detail: str) -> None:
        code = int(sqlstate[2:]) if sqlstate[2:].isdigit() else errno.EIO
        super().__init__(code, detail)
        self.sqlstate = sqlstate


redact = redact_url


def check_connect(url: str) -> None:
    """Raise a one-line UserError when the database cannot be used (mount time)."""
    try:
        psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT).close()
    except psycopg.Error as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot reach the metadata database {redact(url)}: {reason}") from None


def _pause(seconds: float) -> None:
    """Sleep without holding up the event loop when running on it."""
    if on_loop():
        await_(lambda: trio.sleep(seconds))
    else:
        time.sleep(seconds)


class DatabaseUnavailable(OSError):
    def __init__(self, url: str, seconds: float, cause: Exception) -> None:
        super().__init__(errno.EIO, f"metadata database {redact(url)} unreachable for {seconds:.0f} s: {cause}")


class PgPool:
    """A bounded set of connections; ``run`` executes one transaction on the event loop."""

    def __init__(self, url: str, size: int = 8, outage_budget: float = 60.0) -> None:
        self.url = url
        self.redacted = redact(url)
        self.size = size
        self.outage_budget = outage_budget
        self._idle: queue.LifoQueue[psycopg.Connection] = queue.LifoQueue()
        self._limiter = trio.CapacityLimiter(size)
        self._outage_logged = False
        self.retries = 0
        self.reconnects = 0

    async def run(self, fn: Callable[..., T], *args: Any, explicit: bool = False) -> T:
        """``fn(cursor, *args)`` in one transaction, its waits on the event loop.
        ``explicit``: on an autocommit connection, where ``fn`` sends its own BEGIN (or
        none, for reads at READ COMMITTED, where each statement sees its own snapshot
        anyway); a transaction it leaves open is committed, or rolled back if ``fn``
        raised."""
        try:  # a free connection slot is the common case: take it without a scheduling round
            self._limiter.acquire_nowait()
        except trio.WouldBlock:
            await self._limiter.acquire()
        try:
            return await run_on_loop(functools.partial(self.run_sync, fn, *args, explicit=explicit))
        finally:
            self._limiter.release()

    def run_sync(self, fn: Callable[..., T], *args: Any, explicit: bool = False) -> T:
        """The same, blocking: from a thread, before the event loop starts, or (through
        :meth:`run`) in a greenlet whose waits the loop serves."""
        conflicts = 0
        outage_started: Optional[float] = None
        while True:
            conn: Optional[psycopg.Connection] = None
            try:
                conn = self._take()
                if explicit:
                    with conn.cursor() as cur:
                        result = fn(cur, *args)
                        if conn.info.transaction_status != IDLE:
                            cur.execute("COMMIT")
                else:
                    with conn.transaction(), conn.cursor() as cur:
                        result = fn(cur, *args)
                self._give(conn)
                if outage_started is not None:
                    log.warning("metadata database %s is back", self.redacted)
                    self._outage_logged = False
                return result
            except psycopg.OperationalError as exc:
                if exc.sqlstate in RETRIED_SQLSTATES:
                    conflicts = self._conflict(conn, conflicts)
                    continue
                if (exc.sqlstate or "").startswith(REFUSED_CLASS):
                    raise self._refused(conn, exc) from None
                # The server went away (restart, network): a new connection, a new try.
                self._discard(conn)
                now = time.monotonic()
                outage_started = outage_started or now
                if now - outage_started > self.outage_budget:
                    raise DatabaseUnavailable(self.url, now - outage_started, exc) from exc
                if not self._outage_logged:
                    log.warning("metadata database %s unreachable (%s); retrying", self.redacted,
                                str(exc).strip().splitlines()[0] if str(exc).strip() else exc)
                    self._outage_logged = True
                _pause(min(1.0, 0.05 * 2 ** min(6, int(now - outage_started))))
            except psycopg.Error as exc:
                if exc.sqlstate in RETRIED_SQLSTATES:
                    conflicts = self._conflict(conn, conflicts)
                    continue
                if (exc.sqlstate or "").startswith(REFUSED_CLASS):
                    raise self._refused(conn, exc) from None
                if conn is not None and conn.closed:
                    self._discard(conn)
                elif conn is not None:
                    self._give(conn)
                raise
            except BaseException:
                if conn is not None:
                    if conn.closed:
                        self._discard(conn)
                    else:
                        self._give(conn)
                raise

    def _refused(self, conn: Optional[psycopg.Connection], exc: psycopg.Error) -> RefusedByServer:
        """A refusal of the operation, not of the connection: the connection is reused."""
        if conn is not None:
            self._give(conn)
        return RefusedByServer(exc.sqlstate or "", exc.diag.message_primary or "")

    def _conflict(self, conn: Optional[psycopg.Connection], tries: int) -> int:
        """Another transaction won a race: back off a little (jittered) and run again."""
        if conn is not None:
            self._give(conn)
        tries += 1
        self.retries += 1
        if tries >= MAX_CONFLICT_TRIES:
            raise OSError(errno.EIO, f"metadata transaction still conflicting after {tries} tries")
        _pause(random.uniform(0, min(0.05, 0.001 * 2 ** tries)))
        return tries

    def _take(self) -> psycopg.Connection:
        try:
            conn = self._idle.get_nowait()
            if not conn.closed:
                return conn
        except queue.Empty:
            pass
        self.reconnects += 1
        # No automatic preparing by psycopg: it deallocates every prepared statement of
        # the connection after a ROLLBACK, those of ``pgpipeline`` too, which prepares its own.
        connect = functools.partial(LoopConnection.connect, self.url, connect_timeout=CONNECT_TIMEOUT,
                                    autocommit=True, prepare_threshold=None)
        if on_loop():
            return await_(lambda: trio.to_thread.run_sync(connect))
        return connect()

    def _give(self, conn: psycopg.Connection) -> None:
        if not conn.closed and conn.info.transaction_status in (INTRANS, INERROR):
            try:
                conn.execute("ROLLBACK")  # what an explicit transaction left open when it failed
            except psycopg.Error:
                pass
        if conn.closed or conn.info.transaction_status != IDLE:
            self._discard(conn)
        else:
            self._idle.put(conn)

    @staticmethod
    def _discard(conn: Optional[psycopg.Connection]) -> None:
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass

    def close(self) -> None:
        while True:
            try:
                self._discard(self._idle.get_nowait())
            except queue.Empty:
                return
