"""Connections to the shared metadata database.

A whole transaction runs as one call (``fn(cursor)``), written as blocking code; on the
event loop it runs in a greenlet that waits for the database on the loop itself
(:mod:`fusestate.meta.postgres.loop_io`), so a FUSE operation costs no thread hop. A read of one
statement (a lookup, a stat) needs no transaction and no greenlet: ``query`` sends it on an
idle connection from the calling task and awaits the answer there, at about half the CPU. Round trips
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

A primary with standbys behind a failover tool (Patroni, pg_auto_failover, an operator's
read-write service) is followed as libpq follows it: a multi-host URL
(``postgresql://h1:5432,h2:5432/db?target_session_attrs=read-write``) tries its servers in
turn (psycopg makes one attempt per host, each within the connect timeout) and keeps the
first that accepts writes. On top of that the pool

- tries every server of such a URL at once and keeps the first that takes writes, so a
  reconnect reaches a promoted standby as soon as it is promoted, not after the old
  primary's connect timeout (without ``target_session_attrs``, it tries them in the URL's
  order, the server it just lost last);
- closes its idle connections when one of them finds the server gone: they lead there too;
- refuses a server on an older timeline than one it has already written to (an old
  primary that came back from a freeze and has not yet been demoted), and drops its
  connections to the older timeline when it meets a newer one, so its transactions never
  go to two primaries;
- breaks the connection of a transaction that has waited :data:`STALL_PROBE_AFTER`
  seconds on a server that no longer answers a new connection within
  :data:`PROBE_TIMEOUT` (a frozen or cut-off server keeps its sockets open, so nothing
  else would ever end the wait); a transaction that is merely slow (a lock, a large scan) on
  a server that answers goes on;
- asks a server that answers which of those transactions wait for a synchronous standby to
  confirm their commit (``wait_event = 'SyncRep'``: a promoted standby that kept
  ``synchronous_standby_names`` and has no standby of its own holds every durable commit
  without end). It says so in the log, the status and a metric while it lasts, and breaks
  such a wait once it has lasted the outage budget: the commit stands on that server, and
  the caller (an fsync) gets EIO instead of waiting in the kernel without end.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import os
import queue
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar, Union

import psycopg
import trio
from psycopg.conninfo import conninfo_to_dict

from fusestate.config import redact_url
from fusestate.errors import FsError, UserError
from fusestate.meta.postgres.loop_io import LoopConnection, await_, on_loop, run_on_loop
from fusestate.meta.postgres.pipeline import Pipeline, never_prepare

log = logging.getLogger(__name__)

T = TypeVar("T")
# A statement's arguments, or a function of the connection that gives them for each attempt.
Arguments = Union[Sequence[Any], Callable[[psycopg.Connection], Sequence[Any]]]

IDLE, INTRANS, INERROR = (psycopg.pq.TransactionStatus.IDLE, psycopg.pq.TransactionStatus.INTRANS,
                          psycopg.pq.TransactionStatus.INERROR)
# Serialization failure, deadlock, unique race; and a prepared statement the connection
# lost (``pipeline`` prepares afresh on the next try).
RETRIED_SQLSTATES = {"40001", "40P01", "23505", "26000"}
MAX_CONFLICT_TRIES = 50
CONNECT_TIMEOUT = 5  # seconds per server, unless the URL has a connect_timeout of its own
APPLICATION_NAME = "fusestate"  # unless the URL names one
# "cannot execute ... in a read-only transaction": the server is (now) a standby.
READ_ONLY_SQLSTATE = "25006"
STALL_PROBE_AFTER = 2.0  # seconds a transaction waits before its server is asked whether it is alive
PROBE_TIMEOUT = 2        # seconds a new connection may take to prove the server alive (libpq's minimum)
PROBE_AGAIN_AFTER = 5.0  # seconds before a server that answered is asked again about the same wait
# Seconds after the last sight of a commit held for a synchronous standby that the wait counts as over.
STANDBY_WAIT_FORGOTTEN = 2 * PROBE_AGAIN_AFTER + STALL_PROBE_AFTER
RETRY_REFUSED = 0.5      # seconds (jittered) before a server that refused is asked again during a reconnect
# The timeline of a primary; 0 for a standby (a plain URL may reach one).
TIMELINE_QUERY = ("SELECT CASE WHEN pg_is_in_recovery() THEN 0"
                  " ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int END")
# Of the given server processes, those that wait for a synchronous standby to confirm a commit,
# or for a lock one such holds (a process waiting for the standby keeps its row locks); and the
# server's synchronous_standby_names.
_HELD_FOR_STANDBY = ("SELECT array(SELECT a.pid FROM pg_stat_activity a WHERE a.pid = ANY(%s) AND"
                     " (a.wait_event = 'SyncRep' OR EXISTS (SELECT 1 FROM pg_stat_activity b"
                     " WHERE b.pid = ANY(pg_blocking_pids(a.pid)) AND b.wait_event = 'SyncRep'))),"
                     " current_setting('synchronous_standby_names')")
# A connection's metadata session, which the change feed's triggers name (``PgPool.tag``).
SESSION_SETTING = "fusestate.session"
# At each connect: the timeline, and the session the connection's changes are announced as.
_OPEN_QUERY = f"SELECT ({TIMELINE_QUERY}), set_config('{SESSION_SETTING}', %s, false)"
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


class StandbyUnconfirmed(FsError):
    """A durable commit the server held, waiting for a synchronous standby, past the budget
    (an answer, logged in one line: no traceback)."""

    def __init__(self, server: tuple[str, str], seconds: float, names: str) -> None:
        super().__init__(errno.EIO, f"metadata database server {server[0]}:{server[1]} held a transaction "
                                    f"{seconds:.0f} s waiting for a synchronous standby to confirm a commit "
                                    f"(synchronous_standby_names = '{names}'); it may stand on that server, "
                                    f"unconfirmed by any standby")


class DatabaseUnavailable(OSError):
    def __init__(self, url: str, seconds: float, cause: Exception) -> None:
        super().__init__(errno.EIO, f"metadata database {redact(url)} unreachable for {seconds:.0f} s: {cause}")


@dataclass
class _Busy:
    """A transaction in flight: its connection, since when, on which server."""

    conn: psycopg.Connection
    since: float
    server: tuple[str, str]


class PgPool:
    """A bounded set of connections; ``run`` executes one transaction on the event loop."""

    def __init__(self, url: str, size: int = 8, outage_budget: float = 60.0, prepare: bool = True) -> None:
        self.url = url
        self.prepare = prepare  # False behind a pooler in transaction mode
        self.redacted = redact(url)
        self.size = size
        self.outage_budget = outage_budget
        # Idle connections, the most recently used last (a deque: its append and pop are
        # atomic, for threads and the loop alike, and cost no lock).
        self._idle: collections.deque[psycopg.Connection] = collections.deque()
        self._limiter = trio.CapacityLimiter(size)
        self._outage_logged = False
        self.retries = 0
        self.reconnects = 0
        self.stalls_broken = 0  # connections broken because their server stopped answering
        # Durable commits held by a server waiting for a synchronous standby (``_watch``):
        # since when (monotonic; None: none seen lately), when last seen, and the server's
        # synchronous_standby_names; and the waits broken past the budget.
        self.standby_wait_since: Optional[float] = None
        self._standby_wait_seen = 0.0
        self.standby_names = ""
        self.standby_waits_failed = 0
        # When (monotonic) the database answered again after an outage (None: never lost):
        # the other nodes' heartbeats were held up as long as this node's were.
        self.back_since: Optional[float] = None
        self._gave_up = False  # an outage outlasted the budget: the next success ends it
        params = conninfo_to_dict(url)
        self._connect_params: dict[str, Any] = {} if params.get("connect_timeout") else {
            "connect_timeout": CONNECT_TIMEOUT}
        if not params.get("application_name"):
            self._connect_params["application_name"] = APPLICATION_NAME  # what pg_stat_activity shows
        self._servers = _server_list(params)
        # Servers of which only one may answer (the primary): tried all at once.
        self._parallel = len(self._servers) > 1 and str(params.get("target_session_attrs") or "") in (
            "read-write", "primary")
        self._connect_deadline = (int(float(params.get("connect_timeout") or CONNECT_TIMEOUT)) + STALL_PROBE_AFTER
                                  + PROBE_TIMEOUT + 2)
        self.timeline = 0  # the newest timeline written to (0: none yet, or a single server's)
        self._busy: dict[int, _Busy] = {}
        self._busy_lock = threading.Lock()
        self._connecting = threading.Lock()
        self._watchdog: Optional[threading.Thread] = None
        self._closing = threading.Event()
        # The metadata session these connections work for, set on each as it connects
        # (``change_feed.SESSION_SETTING``): the triggers name it in their notifications, so
        # this node knows its own changes. Empty until the session is registered, and behind
        # a pooler in transaction mode (a server connection serves every node there).
        self.tag = ""

    @property
    def open_connections(self) -> int:
        """Connections held: idle ones and those a transaction is using."""
        with self._busy_lock:
            return len(self._idle) + len(self._busy)

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

    async def query(self, sql: str, args: Arguments = ()) -> list[tuple]:
        """The rows of one statement on its own (autocommit: a read, or a server-side
        operation that is its own transaction).

        The hot path of a lookup, a stat and each namespace operation: the calling task
        sends the statement on an idle connection and awaits the answer itself, with no
        greenlet and no cursor, about half the daemon's CPU of a call through :meth:`run`.
        Whatever is not plain (no idle connection, an outage being ridden out, a lost
        connection, a conflict) runs as :meth:`run` does, with its retries; a refusal of
        the statement (an ``FS`` SQLSTATE) is raised as there. ``args`` may be a function
        of the connection that gives the arguments of each attempt (a retry may have to
        say that it is one)."""
        try:
            self._limiter.acquire_nowait()
        except trio.WouldBlock:  # every connection busy: wait for one as run() does
            return await self.run(_query_in_pipeline, sql, args, explicit=True)
        try:
            conn = None if self._gave_up else self._take_idle()
            if conn is not None:
                try:
                    with self._watched(conn), Pipeline(conn) as pipe:
                        slot = pipe.queue(sql, args(conn) if callable(args) else args, rows=True)
                        await pipe.aread()
                    self._give(conn)
                    return slot.rows  # type: ignore[union-attr, return-value]
                except psycopg.Error as exc:
                    if (exc.sqlstate or "").startswith(REFUSED_CLASS):
                        raise self._refused(conn, exc) from None
                    lost = conn.closed or isinstance(exc, psycopg.OperationalError)
                    if lost:
                        self._check_standby_wait(conn)
                        self._discard(conn)
                    else:
                        self._give(conn)
                    if not lost and exc.sqlstate not in RETRIED_SQLSTATES:
                        raise
                except BaseException:
                    self._discard(conn)  # cancelled half-way: its answer may still come
                    raise
            # The slot held: run() here would wait for a second one.
            return await run_on_loop(functools.partial(self.run_sync, _query_in_pipeline, sql, args,
                                                       explicit=True))
        finally:
            self._limiter.release()

    def _take_idle(self) -> Optional[psycopg.Connection]:
        """An idle connection on the current timeline; None if none is."""
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                return None
            if not conn.closed and getattr(conn, "timeline", 0) >= self.timeline and self._tagged(conn):
                return conn
            self._discard(conn)

    def run_sync(self, fn: Callable[..., T], *args: Any, explicit: bool = False) -> T:
        """The same, blocking: from a thread, before the event loop starts, or (through
        :meth:`run`) in a greenlet whose waits the loop serves."""
        conflicts = 0
        outage_started: Optional[float] = None
        while True:
            conn: Optional[psycopg.Connection] = None
            try:
                conn = self._take()
                with self._watched(conn):
                    if explicit:
                        with conn.cursor() as cur:
                            result = fn(cur, *args)
                            if conn.info.transaction_status != IDLE:
                                cur.execute("COMMIT")
                    else:
                        with conn.transaction(), conn.cursor() as cur:
                            result = fn(cur, *args)
                self._give(conn)
                if outage_started is not None or self._gave_up:
                    log.warning("metadata database %s is back (%s)", self.redacted,
                                _where(getattr(conn, "server", None), self.timeline))
                    self._outage_logged = False
                    self._gave_up = False
                    self.back_since = time.monotonic()
                return result
            except psycopg.OperationalError as exc:
                if exc.sqlstate in RETRIED_SQLSTATES:
                    conflicts = self._conflict(conn, conflicts)
                    continue
                if (exc.sqlstate or "").startswith(REFUSED_CLASS):
                    raise self._refused(conn, exc) from None
                self._check_standby_wait(conn)
                # The server went away (restart, network, failover): a new connection, a new try.
                outage_started = self._outage(conn, exc, outage_started)
            except psycopg.Error as exc:
                if exc.sqlstate in RETRIED_SQLSTATES:
                    conflicts = self._conflict(conn, conflicts)
                    continue
                if (exc.sqlstate or "").startswith(REFUSED_CLASS):
                    raise self._refused(conn, exc) from None
                if exc.sqlstate == READ_ONLY_SQLSTATE:
                    # A standby now (behind a proxy or a plain URL): the primary is elsewhere.
                    outage_started = self._outage(conn, exc, outage_started)
                    continue
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

    def _check_standby_wait(self, conn: Optional[psycopg.Connection]) -> None:
        """A connection the watchdog broke because its commit waited for a synchronous
        standby past the budget: EIO, not a retry (which would wait again)."""
        broken = getattr(conn, "standby_wait", None)
        if broken is not None:
            self._discard(conn)
            raise StandbyUnconfirmed(*broken)

    def _outage(self, conn: Optional[psycopg.Connection], exc: psycopg.Error, started: Optional[float]) -> float:
        """The server this connection led to is gone: drop it and every idle connection
        (they lead there too), try that server last from now on, and wait a little before
        the next try; past the outage budget, give up. Returns when the outage started."""
        if conn is not None:
            self._demote(getattr(conn, "server", None))
        self._discard(conn)
        self.close_idle()
        now = time.monotonic()
        started = started or now
        if now - started > self.outage_budget:
            self._gave_up = True
            raise DatabaseUnavailable(self.url, now - started, exc) from exc
        if not self._outage_logged:
            log.warning("metadata database %s unreachable (%s); retrying", self.redacted,
                        str(exc).strip().splitlines()[0] if str(exc).strip() else exc)
            self._outage_logged = True
        _pause(min(1.0, 0.05 * 2 ** min(6, int(now - started))))
        return started

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

    # --- connections ----------------------------------------------------------------------
    def _take(self) -> psycopg.Connection:
        conn = self._take_idle()
        if conn is not None:
            return conn
        self.reconnects += 1
        conn = await_(lambda: trio.to_thread.run_sync(self._connect)) if on_loop() else self._connect()
        return conn

    def _connect(self) -> psycopg.Connection:
        """A new connection (blocking: a worker thread's job on the loop) to a server that
        takes it, on no older timeline than this pool has written to. Several servers
        that must take writes are tried at once, and the first to answer wins: a promoted
        standby is reached at once, not after a frozen server's connect timeout."""
        if self._parallel:
            with self._connecting:  # one search at a time: the others then find the primary at once
                return self._connect_to_first()
        conn = self._open(self._order())
        if conn.timeline < self.timeline:  # type: ignore[attr-defined]
            self._discard(conn)
            self._demote(conn.server)  # type: ignore[attr-defined]
            raise psycopg.OperationalError(
                f"{_where(conn.server, conn.timeline)} is on an older timeline than "  # type: ignore[attr-defined]
                f"{self.timeline}: a former primary not yet demoted")
        return self._accept(conn)

    def _open(self, where: dict[str, str]) -> psycopg.Connection:
        """Connect (to the servers ``where`` names, or the URL's) and read the timeline."""
        # No automatic preparing by psycopg: it deallocates every prepared statement of
        # the connection after a ROLLBACK, those of ``pipeline`` too, which prepares its own.
        conn = LoopConnection.connect(self.url, autocommit=True, prepare_threshold=None,
                                      **self._connect_params, **where)
        conn.server = _server_of(conn)  # type: ignore[attr-defined]
        if not self.prepare:
            never_prepare(conn)
        try:
            tag = self._own_tag
            with self._watched(conn):
                conn.timeline = int(conn.execute(_OPEN_QUERY, (tag,)).fetchone()[0])  # type: ignore[attr-defined]
            conn.tag = tag  # type: ignore[attr-defined]
            conn.pid = conn.info.backend_pid  # type: ignore[attr-defined]  # its server process (_watch)
        except BaseException:
            self._discard(conn)
            raise
        return conn

    def _accept(self, conn: psycopg.Connection) -> psycopg.Connection:
        timeline = conn.timeline  # type: ignore[attr-defined]
        if timeline > self.timeline:
            if self.timeline:
                log.warning("metadata database %s: now on %s (was timeline %d)", self.redacted,
                            _where(conn.server, timeline), self.timeline)  # type: ignore[attr-defined]
            self.timeline = timeline  # connections to older timelines are dropped as they come back
        return conn

    def _connect_to_first(self) -> psycopg.Connection:
        """One attempt per server at once; the first connection on a current timeline wins,
        the others are closed as they come. While an attempt hangs (a frozen server, until
        its connect timeout), a server that refused is asked again every
        :data:`RETRY_REFUSED` seconds: a standby being promoted is taken the moment it is."""
        answers: queue.Queue[tuple[tuple[str, str], Optional[psycopg.Connection], str]] = queue.Queue()

        def attempt(server: tuple[str, str]) -> None:
            try:
                answers.put((server, self._open({"host": server[0], "port": server[1]}), ""))
            except psycopg.Error as exc:
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                answers.put((server, None, f"{server[0]}:{server[1]}: {reason}"))

        def launch(server: tuple[str, str]) -> None:
            pending.add(server)
            threading.Thread(target=attempt, args=(server,), name="pgpool-connect", daemon=True).start()

        deadline = time.monotonic() + self._connect_deadline
        pending: set[tuple[str, str]] = set()
        again: dict[tuple[str, str], float] = {}  # refused servers: when to ask again
        failures: dict[tuple[str, str], str] = {}
        chosen: Optional[psycopg.Connection] = None
        for server in self._servers:
            launch(server)
        while pending and chosen is None:
            now = time.monotonic()
            for server, when in list(again.items()):
                if when <= now:
                    del again[server]
                    launch(server)
            wait = min([deadline, *again.values()]) - now
            if now >= deadline:
                break
            try:
                server, conn, failure = answers.get(timeout=max(0.01, wait))
            except queue.Empty:
                continue
            pending.discard(server)
            if conn is None:
                failures[server] = failure
                if pending:  # another attempt still hangs: this server may be promoted meanwhile
                    again[server] = time.monotonic() + RETRY_REFUSED * random.uniform(0.5, 1.5)
            elif conn.timeline < self.timeline:  # type: ignore[attr-defined]
                failures[server] = (f"{_where(server, conn.timeline)} is on an older timeline than "  # type: ignore[attr-defined]
                                    f"{self.timeline}: a former primary not yet demoted")
                self._discard(conn)
                if pending:
                    again[server] = time.monotonic() + RETRY_REFUSED * random.uniform(0.5, 1.5)
            else:
                chosen = conn
        if pending:
            threading.Thread(target=_close_answers, args=(answers, len(pending)), name="pgpool-connect",
                             daemon=True).start()
        if chosen is None:
            raise psycopg.OperationalError("no server takes writes: " + ("; ".join(failures.values())
                                                                         or "none answered"))
        return self._accept(chosen)

    def _order(self) -> dict[str, str]:
        """Connection parameters that list the URL's servers in the pool's current order."""
        if len(self._servers) < 2:
            return {}
        hosts, ports = zip(*self._servers)
        return {"host": ",".join(hosts), "port": ",".join(ports)}

    def _demote(self, server: Optional[tuple[str, str]]) -> None:
        """Try ``server`` last from now on."""
        if server in self._servers and len(self._servers) > 1:
            self._servers = [s for s in self._servers if s != server] + [server]

    def _give(self, conn: psycopg.Connection) -> None:
        if not conn.closed and conn.info.transaction_status in (INTRANS, INERROR):
            try:
                with self._watched(conn):
                    conn.execute("ROLLBACK")  # what an explicit transaction left open when it failed
            except psycopg.Error:
                pass
        if (conn.closed or conn.info.transaction_status != IDLE or getattr(conn, "timeline", 0) < self.timeline
                or not self._tagged(conn)):
            self._discard(conn)
        else:
            self._idle.append(conn)

    @property
    def _own_tag(self) -> str:
        """What this pool's connections name: its session, none behind a transaction pooler."""
        return self.tag if self.prepare else ""

    def _tagged(self, conn: psycopg.Connection) -> bool:
        """Whether ``conn`` names this pool's session in its changes' notifications."""
        return getattr(conn, "tag", "") == self._own_tag

    def _discard(self, conn: Optional[psycopg.Connection]) -> None:
        if conn is not None:
            _close_quietly(conn)

    def dedicated_connection(self) -> psycopg.Connection:
        """A connection of its own, outside the pool and its limit (blocking), to the server
        the pool's connections reach: for a session that only listens."""
        return self._connect()

    def close_idle(self) -> None:
        while True:
            try:
                self._discard(self._idle.pop())
            except IndexError:
                return

    def close(self) -> None:
        self._closing.set()
        self.close_idle()

    # --- servers that stop answering ------------------------------------------------------
    def _watched(self, conn: psycopg.Connection) -> "_Watched":
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="pgpool-watchdog", daemon=True)
            self._watchdog.start()
        return _Watched(self, conn)

    def _watch(self) -> None:
        """Every second: a transaction waiting longer than STALL_PROBE_AFTER on a server
        that no longer takes a new connection has its connection broken (its socket shut
        down), so it fails as a lost connection and is retried elsewhere. On a server that
        answers, the transactions that wait for a synchronous standby are found
        (``_standby_waits``)."""
        answered: dict[tuple[str, str], float] = {}  # server -> when it last proved alive
        while not self._closing.wait(1.0):
            now = time.monotonic()
            with self._busy_lock:
                stalled = [b for b in self._busy.values() if now - b.since > STALL_PROBE_AFTER]
            self._standby_wait_over(now)
            for server in {b.server for b in stalled}:
                if not server[0] or now - answered.get(server, -PROBE_AGAIN_AFTER) < PROBE_AGAIN_AFTER:
                    continue
                waiting = [b for b in stalled if b.server == server]
                alive, held, names = self._probe(server, {getattr(b.conn, "pid", 0) for b in waiting})
                if alive:
                    answered[server] = time.monotonic()
                    self._standby_waits(server, [b for b in waiting if getattr(b.conn, "pid", 0) in held], names)
                    continue
                log.warning("metadata database server %s:%s does not answer; breaking the connections "
                            "that wait on it", *server)
                with self._busy_lock:
                    for busy in waiting:
                        if self._busy.get(id(busy.conn)) is busy:
                            _shut_down(busy.conn)
                            self.stalls_broken += 1

    def _probe(self, server: tuple[str, str], pids: set[int]) -> tuple[bool, set[int], str]:
        """Whether ``server`` takes a new connection (any answer, a refusal included, which
        carries a SQLSTATE, proves the server runs; a timeout or a closed port does not);
        and, when it does, which of ``pids`` (its processes) wait for a synchronous standby,
        with its ``synchronous_standby_names``."""
        try:
            with self._short_connection(server) as conn:
                try:
                    row = conn.execute(_HELD_FOR_STANDBY, (sorted(pids),)).fetchone()
                except psycopg.Error:
                    return True, set(), ""  # it took the connection: alive
                return True, set(row[0]), row[1]
        except psycopg.Error as exc:
            return exc.sqlstate is not None, set(), ""

    @contextlib.contextmanager
    def _short_connection(self, server: tuple[str, str]) -> Iterator[psycopg.Connection]:
        """A connection of the watchdog's own to ``server``, made and used within
        PROBE_TIMEOUT each (a server that stops meanwhile has its socket shut down)."""
        conn = psycopg.connect(self.url, host=server[0], port=server[1], connect_timeout=PROBE_TIMEOUT,
                               target_session_attrs="any", autocommit=True)
        timer = threading.Timer(PROBE_TIMEOUT, _shut_down, (conn,))
        timer.start()
        try:
            yield conn
        finally:
            timer.cancel()
            _close_quietly(conn)

    def _standby_waits(self, server: tuple[str, str], held: list[_Busy], names: str) -> None:
        """``held``: transactions ``server`` holds for a synchronous standby. Said once in the
        log when it starts; each broken once it has waited the outage budget."""
        if not held:
            return
        now = time.monotonic()
        if self.standby_wait_since is None:
            self.standby_wait_since = min(b.since for b in held)
            log.warning("metadata database server %s:%s holds this node's durable commits (fsync) waiting "
                        "for a synchronous standby to confirm them (synchronous_standby_names = '%s'); they "
                        "fail with EIO after %.0f s. A primary without a standby of its own must not name one "
                        "(a promoted standby keeps the setting): see the deployment guide", server[0],
                        server[1], names, self.outage_budget)
        self._standby_wait_seen, self.standby_names = now, names
        with self._busy_lock:
            expired = [b for b in held if now - b.since > self.outage_budget and self._busy.get(id(b.conn)) is b]
            for busy in expired:
                busy.conn.standby_wait = (server, now - busy.since, names)  # type: ignore[attr-defined]
                self.standby_waits_failed += 1
        if expired:
            # Ended on the server, not only here: a process that waits for the standby
            # keeps its transaction's row locks, and the next commit of the same rows
            # would wait on them.
            self._terminate(server, [getattr(b.conn, "pid", 0) for b in expired])
            with self._busy_lock:
                for busy in expired:
                    if self._busy.get(id(busy.conn)) is busy:
                        _shut_down(busy.conn)

    def _terminate(self, server: tuple[str, str], pids: list[int]) -> None:
        """End the server processes ``pids`` (this pool's own connections'), within PROBE_TIMEOUT."""
        try:
            with self._short_connection(server) as conn:
                conn.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))
        except psycopg.Error as exc:
            log.warning("could not end the database's processes waiting for a synchronous standby: %s", exc)

    def _standby_wait_over(self, now: float) -> None:
        if self.standby_wait_since is not None and now - self._standby_wait_seen > STANDBY_WAIT_FORGOTTEN:
            log.warning("metadata database: no durable commit of this node waits for a synchronous standby any more")
            self.standby_wait_since = None

    @property
    def standby_wait_seconds(self) -> float:
        """How long durable commits have been held for a synchronous standby (0: not now)."""
        since = self.standby_wait_since
        return 0.0 if since is None else round(time.monotonic() - since, 1)


class _Watched:
    """The span of one transaction on a connection, as the watchdog sees it."""

    def __init__(self, pool: PgPool, conn: psycopg.Connection) -> None:
        self.pool, self.busy = pool, _Busy(conn, time.monotonic(), getattr(conn, "server", None) or ("", ""))

    def __enter__(self) -> None:
        with self.pool._busy_lock:
            self.pool._busy[id(self.busy.conn)] = self.busy

    def __exit__(self, *exc: object) -> None:
        with self.pool._busy_lock:
            self.pool._busy.pop(id(self.busy.conn), None)


def _query_in_pipeline(cur: psycopg.Cursor, sql: str, args: Arguments) -> list[tuple]:
    """:meth:`PgPool.query`'s statement as a transaction function of :meth:`PgPool.run`."""
    with Pipeline(cur.connection) as pipe:
        return pipe.query(sql, args(cur.connection) if callable(args) else args)


def timeline_of(cur: psycopg.Cursor) -> int:
    """The timeline of the server a transaction runs on (in ``fn(cur)`` of :meth:`PgPool.run`):
    it goes up by one at each promotion of a standby. A durable commit on a newer timeline
    than this node's commits since its last durable one cannot vouch for them: they may
    have been lost with the old primary."""
    return int(getattr(cur.connection, "timeline", 0))


def _server_list(params: dict[str, Any]) -> list[tuple[str, str]]:
    """The (host, port) pairs a URL names, in its order; empty where the pool should pass
    the URL as it is (a single server, or addresses given as hostaddr)."""
    if params.get("hostaddr"):
        return []
    hosts = str(params.get("host") or "").split(",")
    ports = str(params.get("port") or "").split(",")
    if len(ports) == 1:
        ports *= len(hosts)
    return list(zip(hosts, ports)) if len(hosts) > 1 and len(ports) == len(hosts) else []


def _server_of(conn: psycopg.Connection) -> Optional[tuple[str, str]]:
    try:
        return conn.info.host, str(conn.info.port)
    except psycopg.Error:
        return None


def _where(server: Optional[tuple[str, str]], timeline: int) -> str:
    place = f"{server[0]}:{server[1]}" if server else "the server"
    return f"{place}, timeline {timeline}" if timeline else place


def _close_answers(answers: "queue.Queue[tuple[tuple[str, str], Optional[psycopg.Connection], str]]",
                   count: int) -> None:
    """Close the connections of attempts that answered after another had won."""
    for _ in range(count):
        _server, conn, _failure = answers.get()
        if conn is not None:
            _close_quietly(conn)


def _shut_down(conn: psycopg.Connection) -> None:
    """End the connection's TCP stream under whoever waits on it: the wait wakes, libpq
    reads the end of the stream and fails the transaction as a lost connection."""
    try:
        fd = conn.pgconn.socket
    except psycopg.Error:
        return  # libpq already let go of it
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close_quietly(conn: psycopg.Connection) -> None:
    try:
        conn.close()
    except psycopg.Error:
        pass
