"""The shared metadata engine: PostgreSQL, for one volume mounted read-write by many nodes.

Every operation of ``fusestate.meta.operations`` runs as one READ COMMITTED transaction
on a pooled connection, on the trio loop (``loop_io``: the loop serves other requests
while it waits for the database), its statements pipelined (``pipeline``), with the
inodes it changes locked in increasing id order, retried whole on a serialization
failure, a deadlock or a unique-key race. The hottest operations (create, the commit of
a file's blocks) run instead as one call of a function on the server (``functions``):
one round trip each.

Each mount is a *session*: a row with a heartbeat. A session holds the files its node
has open (``holds``, an UNLOGGED table that each node fills again after the server lost
it: ``heartbeat``), so a file unlinked on one node stays readable where it is open
and is deleted with its last holder. Its uploads are not registered: a commit of a block
the collector deleted while it was uploaded is refused, and the node puts it again
(``functions``; ``uploads`` holds only registrations of earlier releases).
Every publishing transaction checks that its own session is still alive: a node that
was declared dead and comes back cannot publish. The sessions of dead nodes are cleaned
up by the others. Counters for statfs are kept per session and lane (no hot row). A
create, link, rename, unlink or rmdir whose connection broke with its commit in flight is
run again without being applied twice (``_Attempts``).

Blocks are committed only once they are in the bucket (``shared = True``): the shared
metadata never points at a block another node cannot read, except a scratch file's
(``--scratch``): its inode records the session that made it, its blocks stay on that
node and are recorded as not uploaded, and its names go when that session ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import itertools
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Sequence, TypeVar

import trio

from fusestate.blocks.keys import INLINE_PREFIX, key_matches
from fusestate.config import DEFAULT_BLOCK_SIZE
from fusestate.errors import FsError
from fusestate.meta import operations as ops
from fusestate.meta import posix
from fusestate.meta.engine import (AttrChange, DirEntry, EngineStats, Freed, Inode, NewNode,
                                   ObjectInfo)
from fusestate.meta.postgres import functions as server
from fusestate.meta.postgres import schema
from fusestate.meta.postgres.change_feed import ChangeFeed
from fusestate.meta.postgres.lookup_cache import LookupCache, Name
from fusestate.meta.postgres.pipeline import Pipeline, Slot
from fusestate.meta.postgres.pool import PgPool, RefusedByServer, timeline_of

log = logging.getLogger(__name__)

T = TypeVar("T")

MOVE_LOCK = 0x66757366    # advisory lock id that serializes directory moves between parents
SESSION_TTL = 30.0         # seconds without a heartbeat before other nodes clean a session up
# How long an unmount tries to end its session while the database is unreachable: nothing
# but the session's own rows is at stake (the other nodes clean them up after SESSION_TTL).
CLOSE_OUTAGE_BUDGET = 5.0
RECENT_ROWS_MAX = 10_000  # rows of this node's own writes that getattr answers (attr_cache_seconds)
# A small file's block up to this many bytes is kept in the database, not the bucket
# (functions, "Inline blocks"): a PostgreSQL page holds a row of this size.
INLINE_MAX = 4096
INLINE_SEEN_MAX = 1024  # inline blocks an open brought along, kept until the block store asks

# A session's rows are made when it registers (``start``): an UPDATE writes one WAL record,
# the upsert it replaces two (a row lock, then the update). Lane 0 takes the counts of
# operations that hold no lane.
_ADD_COUNTERS = "UPDATE counters SET inodes = inodes + ?, used = used + ? WHERE session_id = ? AND lane = 0"
# What an operation that holds a lane writes instead: its counts and its number, in one
# update of a row no other transaction writes (see ``_Attempts``).
_MARK = "UPDATE counters SET inodes = inodes + ?, used = used + ?, op = ? WHERE session_id = ? AND lane = ?"
_DONE = "SELECT 1 FROM counters WHERE session_id = ? AND lane = ? AND op = ?"
# A lane's lock (_Attempts) or an inode's fence (functions.INODE_FENCE): (class, key).
_ADVISORY_LOCK = "SELECT pg_advisory_xact_lock(?::int, ?::int)"
# A transaction of its own that writes a WAL record (a commit without one does not wait for
# the flush): an update of a lane's row, which no other transaction writes meanwhile
# (``_Lanes``). With a server's synchronous_commit = off it waits all the same; a stronger
# setting (remote_apply) is kept.
_FLUSH_WAL = ("WITH mode AS (SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit')"
              " WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END, true))"
              " UPDATE counters SET op = op FROM mode WHERE session_id = ? AND lane = ? RETURNING 1")

_UNKNOWN = ("SELECT k FROM unnest(%s::text[]) AS k WHERE NOT EXISTS (SELECT 1 FROM objects WHERE key=k)"
            " AND NOT EXISTS (SELECT 1 FROM uploads WHERE key=k)")
# A page of a directory's listing in one statement: the directory's mode (ENOENT, ENOTDIR),
# then its entries after an id with their inodes (see ops.listing).
_READDIR = ("SELECT d.mode, page.* FROM inodes d LEFT JOIN LATERAL"
            f" (SELECT e.id AS entry_id, e.name, {ops.JOINED_INODE_COLUMNS} FROM"
            "  (SELECT id, name, inode FROM entries WHERE parent = d.id AND id > ? ORDER BY id LIMIT ?) e"
            "  JOIN inodes i ON i.id = e.inode ORDER BY e.id) page"
            " ON true WHERE d.id = ?")
_LOCK_INODES = f"SELECT {ops.INODE_COLUMNS} FROM inodes WHERE id = ANY(?) ORDER BY id FOR UPDATE"
_NOW = "extract(epoch from clock_timestamp())"  # the database's clock: one clock for every node
_SWEEP_DUE = "SELECT EXISTS (SELECT 1 FROM orphans_kept) AND fs_holds_trusted()"


class SessionLost(FsError):
    """This node's session was declared dead by the others: it may not publish any more."""

    def __init__(self) -> None:
        super().__init__(errno.EIO, "this mount's session on the metadata database expired; remount")


# What a node whose session was cleaned up logs once: what it means and what to do.
LOST_MESSAGE = ("metadata session %d was cleaned up by the other nodes (no heartbeat within its "
                "--session-timeout, %.0f s): this mount publishes nothing more (creates, opens, and closes "
                "and fsyncs of written files fail with EIO) and `fusestate status` exits 1. Unmount it "
                "(fusestate umount %s) and mount it again, or restart its service or pod")


@dataclass(frozen=True)
class SessionInfo:
    id: int
    host: str
    pid: int
    mountpoint: str
    started: float
    heartbeat_age: float


class _SessionHolds:
    def __init__(self, session: Callable[[], int]) -> None:
        self._session = session

    def add(self, tx: ops.Tx, ino: int) -> None:
        tx.exec("INSERT INTO holds (session_id, inode) VALUES (?, ?) ON CONFLICT DO NOTHING",
                (self._session(), ino))

    def remove(self, tx: ops.Tx, ino: int) -> None:
        tx.exec("DELETE FROM holds WHERE session_id=? AND inode=?", (self._session(), ino))

    def held(self, tx: ops.Tx, ino: int) -> bool:
        """Held by some node; or kept (and recorded for the sweep) while the holds cannot
        be trusted, after the server lost them (``fs_keep_orphan``). Asked after taking
        the file's fence (``INODE_FENCE``), so a close in flight is seen or sees this."""
        tx.exec(_ADVISORY_LOCK, (server.INODE_FENCE, server.inode_key(ino)))
        row = tx.one("SELECT EXISTS (SELECT 1 FROM holds WHERE inode=?) OR fs_keep_orphan(?)", (ino, ino))
        return bool(row and row[0])


class _Lanes:
    """A session's lanes, 1 to ``count``: each is held by one operation at a time, for all
    of that operation's attempts, so the lane's row in ``counters`` is written by no other
    transaction meanwhile. Lane 0 counts what operations that hold no lane add."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count, 0, -1))
        self._available = trio.Semaphore(count)

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[int]:
        try:  # a free lane is the common case: taken without a scheduling round
            self._available.acquire_nowait()
        except trio.WouldBlock:
            await self._available.acquire()
        lane = self._free.pop()
        try:
            yield lane
        finally:
            self._free.append(lane)
            self._available.release()


@dataclass
class _Attempts:
    """The attempts of one operation whose outcome may become unknown.

    The pool runs an operation again on a new connection when its connection breaks; if
    that happened after the commit was sent, the commit may or may not have happened.
    Such an operation holds a lane (``_Lanes``) and has a number (``op``, unique within
    the session); each attempt takes the lane's advisory lock first (``LANE_FENCE``) and
    writes the number into the lane's counters row in the same transaction (the row a
    create updates anyway, and an update that a namespace change pays for by taking no
    row lock on its session). An attempt after one that sent its commit takes the lock
    (so it waits for an earlier attempt the server is still running), then looks for the
    number: found, the earlier attempt committed, and its result is returned; not found,
    nothing of it happened, and the operation runs again. Other nodes never write a
    session's lanes, so what they did meanwhile cannot make the answer wrong."""

    lane: int
    op: int  # 0: a call that only needs to know whether it is a retry (``_call``)
    sent: bool = False  # an attempt sent its commit, and its answer never came
    retried: bool = False  # the last attempt came after one that was sent
    # What the last attempt that sent its commit would have returned, had the answer come:
    # the result, the counter deltas, the rows it wrote.
    done: Optional[tuple[Any, int, int, dict[int, Optional[Inode]]]] = None


class _PgTx:
    """One transaction on a connection, its statements in a :class:`Pipeline`: a statement
    whose result nobody reads (``exec``) is only queued, and goes to the server with the
    next one whose rows are read, or with COMMIT. A namespace operation then costs one
    round trip per query it reads, not one per statement."""

    commits_uploaded = True

    def __init__(self, pipe: Pipeline, engine: "PostgresEngine", now_ns: Optional[int] = None) -> None:
        self._pipe = pipe
        self.now_ns = time.time_ns() if now_ns is None else now_ns
        self.block_size = engine.block_size
        self.holds = engine._holds
        self.inodes_delta = 0
        self.used_delta = 0
        self.scratch_owner = engine.session_id
        self._locked: dict[int, tuple] = {}  # rows this transaction locked, until it changes them
        self.saved_rows: dict[int, Optional[Inode]] = {}  # what it left in rows it changed (None: deleted, unknown)
        self._lock_slots: list[Slot] = []  # locks queued, their rows not taken in yet

    def new_inode_id(self) -> None:
        return None  # BIGSERIAL: a sequence never hands a number out twice

    def one(self, sql: str, args: tuple = ()) -> Optional[tuple]:
        rows = self._pipe.query(sql, args)
        return rows[0] if rows else None

    def all(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self._pipe.query(sql, args)

    def exec(self, sql: str, args: tuple = ()) -> None:
        self._pipe.queue(sql, args)

    def later(self, sql: str, args: tuple = ()) -> Callable[[], list[tuple]]:
        slot = self._pipe.queue(sql, args, rows=True)
        assert slot is not None
        return functools.partial(self._pipe.rows, slot)

    def lock(self, inodes: Iterable[int]) -> None:
        # Only queued: the operation's next query (it reads a name again, or the rows)
        # takes the lock's answer in the same round trip. The rows come back whole.
        self._lock_slots.append(self._pipe.queue(_LOCK_INODES, (sorted(set(inodes)),), rows=True))

    def _take_locked(self) -> None:
        for slot in self._lock_slots:
            self._locked.update((row[0], row) for row in self._pipe.rows(slot))
        self._lock_slots.clear()

    def inode_row(self, ino: int) -> Optional[tuple]:
        if self._lock_slots:
            self._take_locked()
        row = self._locked.get(ino)
        return row if row is not None else self.one(ops.INODE_ROW, (ino,))

    def changed(self, ino: int) -> None:
        if self._lock_slots:
            self._take_locked()
        self._locked.pop(ino, None)
        self.saved_rows[ino] = None

    def saved(self, node: Inode) -> None:
        self.saved_rows[node.id] = dataclasses.replace(node)

    def lock_moves(self) -> None:
        self._pipe.queue("SELECT pg_advisory_xact_lock(?)", (MOVE_LOCK,))

    def unreferenced_mark(self) -> int:
        return 0


def _in_pipeline(engine: "PostgresEngine", operation: Callable[..., T], *args: Any) -> Callable[[Any], T]:
    """``operation(tx, *args)`` as a pool transaction function, its statements pipelined."""
    def run(cur: Any) -> T:
        with Pipeline(cur.connection) as pipe:
            return operation(_PgTx(pipe, engine), *args)
    return run


class PostgresEngine:
    """See the module docstring."""

    kind = "postgresql"
    shared = True

    def __init__(self, url: str, block_size: int = DEFAULT_BLOCK_SIZE, *, mountpoint: str = "",
                 read_only: bool = False, pool_size: int = 8, session_ttl: float = SESSION_TTL,
                 attr_cache_seconds: float = 0.0, outage_budget: float = 60.0, prepare: bool = True,
                 inline_max: int = INLINE_MAX, lookup_cache: bool = True) -> None:
        if not 0 <= inline_max <= INLINE_MAX * 2:
            raise ValueError(f"inline_max {inline_max}: expected 0 to {INLINE_MAX * 2} bytes")
        self.url = url
        self.inline_max = inline_max
        # The bytes of inline blocks an open brought with the block map, for the reads after it.
        self._inline_seen: dict[str, bytes] = {}
        self.block_size = block_size
        self.read_only = read_only
        self.mountpoint = mountpoint
        self.session_ttl = session_ttl
        self.pool = PgPool(url, size=pool_size, outage_budget=outage_budget, prepare=prepare)
        self._lanes = _Lanes(pool_size)
        self._ops = itertools.count(1)  # numbers of this session's operations (_Attempts)
        self.session_id = 0
        self.lost = False  # the other nodes cleaned up this session: nothing more may be published
        self._holds = _SessionHolds(lambda: self.session_id)
        # The files this node holds open, registered again after the server lost the holds
        # (holds_kept's since, as this node last registered them).
        self._held: set[int] = set()
        self._holds_since: Optional[float] = None
        self._stats = EngineStats(0, 0)
        self.sessions_cleaned = 0
        # Rows this node's own transactions just wrote, answered by getattr for this long:
        # the kernel asks for a directory's attributes again after every change in it, and
        # would itself have kept them this long (--attr-timeout) had the change not dropped
        # them. Another node's change shows after at most the same time, as it does through
        # the kernel's cache.
        self.attr_cache_seconds = attr_cache_seconds
        self._recent: dict[int, tuple[float, Inode]] = {}
        # Names and inodes answered here while the database's notifications of other nodes'
        # changes come in (``change_feed``); not behind a pooler in transaction mode, where a
        # session that listens does not keep its server connection.
        self.lookups = LookupCache()
        self.changes = ChangeFeed(self.pool, self.lookups) if lookup_cache and prepare else None
        # Commits that did not wait for the WAL flush, and how many of them a durable
        # commit has covered since: sync has nothing to do while the two are equal.
        self._async_commits = 0
        self._durable_through = 0
        # (number of the first async commit, the timeline it and those after it ran on):
        # a durable commit on a newer timeline (a failover) does not cover them.
        self._timelines: list[tuple[int, int]] = []
        self.pool.run_sync(schema.install)

    @property
    def open_connections(self) -> int:
        """The pool's connections, and the one that listens for other nodes' changes."""
        return self.pool.open_connections + int(self.changes is not None and self.changes.connected)

    # --- setup ----------------------------------------------------------------
    # --- running an operation -----------------------------------------------------
    @property
    def scratch_owner(self) -> int:
        return self.session_id

    async def _write(self, operation: Callable[..., T], *args: Any,
                     after: Optional[Callable[[ops.Tx], None]] = None, once: bool = False) -> T:
        """One namespace operation in one transaction that first checks this session is alive.

        It commits without waiting for the WAL flush (see :meth:`sync`): what POSIX makes
        durable only at fsync is durable only at fsync here too, and a create or rename does
        not wait for the database's disk. Transactions of the garbage collector, of uploads
        and of sessions keep the server's own setting: a deletion from the bucket must never
        follow a claim the database could still lose.

        ``once``: the operation would not do the same again (a link, a rename, an unlink):
        it holds a lane, so that a retry after a connection lost with the commit in flight
        finds out whether the commit happened (``_Attempts``). Every attempt keeps the
        operation's first time."""
        if self.read_only:
            raise FsError(errno.EROFS)
        now_ns = time.time_ns()
        if not once or not self.session_id:
            return await self._attempt(operation, args, after, None, now_ns)
        async with self._lanes.hold() as lane:
            return await self._attempt(operation, args, after, _Attempts(lane, next(self._ops)), now_ns)

    async def _attempt(self, operation: Callable[..., T], args: tuple, after: Optional[Callable[[ops.Tx], None]],
                       attempts: Optional[_Attempts], now_ns: int) -> T:
        while True:
            try:
                result, inodes, used = await self.pool.run(self._txn, operation, args, after, attempts, now_ns,
                                                           explicit=True)
            except ops.Restart:
                continue
            except RefusedByServer as exc:
                if exc.sqlstate == server.LOST_SQLSTATE:
                    raise self._lose() from None
                raise
            self._count(inodes, used)
            return result

    def _txn(self, cur: Any, operation: Callable[..., T], args: tuple, after: Optional[Callable[[ops.Tx], None]],
             attempts: Optional[_Attempts], now_ns: int) -> tuple[T, int, int]:
        # Pipelined: BEGIN, the session check and the commit mode go out with the
        # operation's first query, and its last writes with the counters and COMMIT. The
        # session is fenced as the server-side operations fence it (``functions``: an
        # advisory lock, no row lock and no WAL record); a session cleaned up meanwhile
        # fails the statement (FSLST), and the transaction with it.
        with Pipeline(cur.connection) as pipe:
            pipe.queue("BEGIN")
            pipe.queue(server.SESSION_CHECK, (self.session_id,))
            if attempts is not None and self._done_before(pipe, attempts):
                assert attempts.done is not None
                outcome = attempts.done  # committed by the attempt whose answer was lost
                pipe.queue("COMMIT")  # this one wrote nothing
            else:
                tx = _PgTx(pipe, self, now_ns)
                result = operation(tx, *args)
                if after is not None:
                    after(tx)
                if attempts is not None:
                    pipe.queue(_MARK, (tx.inodes_delta, tx.used_delta, attempts.op, self.session_id, attempts.lane))
                elif tx.inodes_delta or tx.used_delta:
                    pipe.queue(_ADD_COUNTERS, (tx.inodes_delta, tx.used_delta, self.session_id))
                pipe.queue("COMMIT")
                outcome = (result, tx.inodes_delta, tx.used_delta, tx.saved_rows)
                if attempts is not None:
                    attempts.sent, attempts.done = True, outcome
        result, inodes, used, rows = outcome
        self._remember(rows)
        self._committed_async(timeline_of(cur))
        return result, inodes, used

    def _committed_async(self, timeline: int) -> None:
        self._async_commits += 1
        if not self._timelines or self._timelines[-1][1] != timeline:
            self._timelines.append((self._async_commits, timeline))

    def _made_durable(self, covered: int, timeline: int) -> None:
        """A durable commit on ``timeline`` covered this node's async commits up to number
        ``covered``. Those of them that ran on an older timeline may not have reached the
        server that took over (a failover): EIO, once, as Linux reports a lost writeback."""
        uncovered_from = self._durable_through + 1
        lost = []
        for i, (first, on) in enumerate(self._timelines):
            last = self._timelines[i + 1][0] - 1 if i + 1 < len(self._timelines) else covered
            if on < timeline and first <= covered and last >= uncovered_from:
                lost.append(on)
        self._durable_through = max(self._durable_through, covered)
        while len(self._timelines) > 1 and self._timelines[1][0] <= self._durable_through + 1:
            self._timelines.pop(0)
        if lost:
            raise FsError(errno.EIO, f"the metadata database failed over (timeline {max(lost)} to {timeline}): "
                                     "changes this node committed just before may be lost")

    def _done_before(self, pipe: Pipeline, attempts: _Attempts) -> bool:
        """Take the operation's lane (waiting for an earlier attempt the server still runs);
        whether an earlier attempt committed, asked only after one sent its commit."""
        pipe.queue(_ADVISORY_LOCK, (server.LANE_FENCE, server.lane_key(self.session_id, attempts.lane)))
        return attempts.sent and bool(pipe.query(_DONE, (self.session_id, attempts.lane, attempts.op)))

    def _remember(self, rows: dict[int, Optional[Inode]]) -> None:
        """After a commit: the rows it wrote answer getattr for ``attr_cache_seconds``."""
        if not rows:
            return
        expires = time.monotonic() + self.attr_cache_seconds
        for ino, node in rows.items():
            self._recent.pop(ino, None)  # re-inserted last: the dict stays in expiry order
            if node is not None and self.attr_cache_seconds > 0:
                self._recent[ino] = (expires, node)
        while len(self._recent) > RECENT_ROWS_MAX:
            del self._recent[next(iter(self._recent))]
        self.lookups.wrote(rows)

    def _renamed(self, *names: Name) -> None:
        """This node changed what ``names`` point to (or may have: an outcome unknown)."""
        self.lookups.wrote({}, names)

    def _cached(self) -> Optional[LookupCache]:
        """The lookup cache, if it holds every change of the last ``MAX_LAG`` seconds."""
        return self.lookups if self.changes is not None and self.changes.fresh() else None

    async def _call(self, statement: str, args: tuple, attempts: Optional[_Attempts] = None,
                    changes: bool = True) -> list[tuple]:
        """One server-side operation (``functions``): one statement, one round trip, one
        transaction, committed without waiting for the WAL flush; its POSIX errors come back
        as :class:`RefusedByServer`. ``attempts``: records whether the last call was a retry after one that was sent;
        with a number (``op``), the statement's first arguments after the session are the
        lane, the number and that (``_Attempts``). ``changes`` False: the operation changes
        nothing a failover could lose (``sync`` has nothing of it to make durable)."""
        if self.read_only:
            raise FsError(errno.EROFS)
        timelines: list[int] = []

        def values(conn: Any) -> tuple:
            timelines.append(int(getattr(conn, "timeline", 0)))
            if attempts is None:
                return args
            attempts.retried, attempts.sent = attempts.sent, True
            if attempts.op:
                return (args[0], attempts.lane, attempts.op, attempts.retried, *args[1:])
            return args

        try:
            rows = await self.pool.query(statement, values)
        except RefusedByServer as exc:
            if exc.sqlstate == server.LOST_SQLSTATE:
                raise self._lose() from None
            raise
        if changes:
            self._committed_async(timelines[-1])
        return rows

    def _count(self, inodes: int, used: int) -> None:
        if inodes or used:
            self._stats = EngineStats(self._stats.inodes + inodes, self._stats.used_bytes + used)

    async def _read(self, operation: Callable[..., T], *args: Any) -> T:
        return await self.pool.run(_in_pipeline(self, operation, *args), explicit=True)

    # --- namespace ----------------------------------------------------------------
    async def getattr(self, ino: int) -> Inode:
        recent = self._recent.get(ino)
        if recent is not None:
            if recent[0] > time.monotonic():
                return dataclasses.replace(recent[1])
            del self._recent[ino]
        cache = self._cached()
        node = cache.node(ino) if cache is not None else None
        if node is not None:
            return node
        rows = await self.pool.query(ops.INODE_ROW, (ino,))
        return ops.found(rows[0] if rows else None)

    async def lookup(self, parent: int, name: bytes) -> Inode:
        if not posix.plain_name(name):
            return await self._read(ops.lookup, parent, name)
        cache = self._cached()
        node = cache.lookup(parent, name) if cache is not None else None
        if node is not None:
            return node
        since = self.lookups.generation
        rows = await self.pool.query(ops.LOOKUP, (name, parent))
        node = ops.looked_up(rows[0] if rows else None)
        self._recent.pop(node.id, None)  # fresher than what this node wrote last
        if self.changes is not None:
            self.lookups.fill(since, parent, name, node)
        return node

    async def _call_in_lane(self, statement: str, args: tuple) -> list[tuple]:
        """A server-side namespace operation holding one of the session's lanes, so that a
        retry after a lost answer finds what the first attempt did (``_Attempts``)."""
        async with self._lanes.hold() as lane:
            return await self._call(statement, args, attempts=_Attempts(lane, next(self._ops)))

    async def create(self, parent: int, name: bytes, node: NewNode, hold: bool = False) -> Inode:
        """One call of ``fs_create``, holding a lane: a retry after its answer was lost
        returns the inode the call made rather than EEXIST (``_Attempts``)."""
        posix.check_name(name)
        since = self.lookups.generation
        args = (self.session_id, parent, name, node.mode, node.uid, node.gid, node.rdev, node.symlink_target,
                node.scratch_name, hold, time.time_ns())
        if not self.session_id:  # no session yet: lane 0, and nothing to look for on a retry
            rows = await self._call(server.CREATE, (args[0], 0, 0, False, *args[1:]))
        else:
            rows = await self._call_in_lane(server.CREATE, args)
        self._count(1, 0)
        new = ops.inode_of_row(rows[0])
        if hold:
            self._held.add(new.id)
        changed = [ops.inode_of_row(row) for row in rows[1:]]  # none if a retry found the parent gone
        if self.changes is not None and new.nlink:  # nlink 0: a retry found it removed meanwhile
            self.lookups.fill(since, parent, name, new)
        self._remember({**{c.id: c for c in changed}, new.id: new})
        return dataclasses.replace(new)

    async def link(self, ino: int, parent: int, name: bytes) -> Inode:
        """One call of ``fs_link``, holding a lane (as ``create``): one round trip, where
        ``operations.link`` takes two (a RocksDB checkpoint is mostly links)."""
        if not self.session_id:
            return await self._write(ops.link, ino, parent, name, once=True)
        posix.check_name(name)
        rows = await self._call_in_lane(server.LINK, (self.session_id, ino, parent, name, time.time_ns()))
        # A retry finds what is there now: the file may be gone (another node removed it
        # since), and a row this node remembers of it with it.
        changed: dict[int, Optional[Inode]] = {ino: None, **{row[0]: ops.inode_of_row(row) for row in rows}}
        self._remember(changed)
        node = changed[ino]
        if node is None:
            raise FsError(errno.ENOENT)
        return dataclasses.replace(node)

    async def unlink(self, parent: int, name: bytes) -> Freed:
        try:
            return await self._unlink(parent, name)
        finally:
            self._renamed((parent, name))

    async def _unlink(self, parent: int, name: bytes) -> Freed:
        """One call of ``fs_unlink``, holding a lane (as ``create``)."""
        posix.check_lookup_name(name)  # the server would look for it: ENOENT
        if not self.session_id:
            return await self._write(ops.unlink, parent, name, once=True)
        rows = await self._call_in_lane(server.UNLINK, (self.session_id, parent, name, time.time_ns(), time.time()))
        *columns, freed, deleted, inodes, used = rows[0]
        self._count(inodes, used)
        changed = [ops.inode_of_row(tuple(row[:-4])) for row in rows[1:]]
        node = ops.inode_of_row(tuple(columns)) if columns[1] is not None else None  # None: a retry found it gone
        self._remember({**{c.id: c for c in changed}, columns[0]: None if deleted else node})
        return Freed(keys=list(freed), deleted_inode=columns[0] if deleted else None, unlinked=node)

    async def rmdir(self, parent: int, name: bytes) -> Freed:
        try:
            return await self._write(ops.rmdir, parent, name, once=True)
        finally:
            self._renamed((parent, name))

    async def rename(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                     flags: int = 0) -> Freed:
        try:
            return await self._rename(src_parent, src_name, dst_parent, dst_name, flags)
        finally:
            self._renamed((src_parent, src_name), (dst_parent, dst_name))

    async def _rename(self, src_parent: int, src_name: bytes, dst_parent: int, dst_name: bytes,
                      flags: int = 0) -> Freed:
        """A file's rename without flags: one call of ``fs_rename``, holding a lane (as
        ``create``); a directory's, or one with flags, ``operations.rename``."""
        posix.check_rename_names(src_name, dst_name)
        if flags or not self.session_id:
            return await self._write(ops.rename, src_parent, src_name, dst_parent, dst_name, flags, once=True)
        try:
            rows = await self._call_in_lane(server.RENAME, (self.session_id, src_parent, src_name, dst_parent,
                                                            dst_name, time.time_ns(), time.time()))
        except RefusedByServer as exc:
            if exc.sqlstate != server.RUN_GENERAL_SQLSTATE:
                raise
            return await self._write(ops.rename, src_parent, src_name, dst_parent, dst_name, flags, once=True)
        freed, changed = Freed(), {}
        for *columns, role, keys, deleted, inodes, used in rows:
            node = ops.inode_of_row(tuple(columns))
            changed[node.id] = node
            if role == 1:  # the file it replaced
                self._count(inodes, used)
                freed = Freed(keys=list(keys), deleted_inode=node.id if deleted else None, unlinked=node)
                if deleted:
                    changed[node.id] = None
        self._remember(changed)
        return freed

    async def setattr(self, ino: int, change: AttrChange) -> Inode:
        return await self._write(ops.setattr, ino, change)

    async def readdir(self, ino: int, after_id: int, limit: int = 1000) -> list[tuple[DirEntry, Inode]]:
        return ops.listing(await self.pool.query(_READDIR, (after_id, limit, ino)))

    async def parent_of(self, ino: int) -> int:
        return await self._read(ops.parent_of, ino)

    async def reserve_inode_ids(self, count: int) -> list[int]:
        """Numbers of the inode sequence no row will ever take: for inodes made on this node
        alone (``meta.scratch``), which may become rows under them."""
        rows = await self._write(lambda tx: tx.all(
            "SELECT nextval(pg_get_serial_sequence('inodes', 'id')) FROM generate_series(1, ?::int)", (count,)))
        return [row[0] for row in rows]

    async def adopt_scratch(self, node: Inode) -> None:
        """``operations.adopt``: a node-local inode becomes a row, held here, to be promoted."""
        await self._write(ops.adopt, node, once=True)
        self._held.add(node.id)

    async def link_held(self, ino: int, parent: int, name: bytes) -> Inode:
        """A name for a file this node holds, which may have none in the database (made a row
        by ``adopt_scratch``, or named only in this node's scratch dirs)."""
        return await self._write(ops.link, ino, parent, name, True, once=True)

    # --- file data ------------------------------------------------------------------
    async def read_file(self, ino: int) -> tuple[Inode, dict[int, str]]:
        self._recent.pop(ino, None)
        return await self._read(lambda tx: (ops.get(tx, ino), ops.block_map(tx, ino)))

    async def open_file(self, ino: int) -> tuple[Inode, dict[int, str]]:
        if self.read_only:
            return await self.read_file(ino)
        self._recent.pop(ino, None)  # close-to-open: the row as it is now, and nothing older after
        # Its only write is the hold, in an UNLOGGED table that every node fills again after
        # a failover: an open gives a later fsync nothing to make durable, and no EIO to report.
        (row,) = await self._call(server.OPEN, (self.session_id, ino), changes=False)
        self._held.add(ino)
        *columns, indexes, keys, data = row
        for key, block in zip(keys, data):
            if block is not None:
                self._inline_seen.pop(key, None)
                self._inline_seen[key] = bytes(block)
        while len(self._inline_seen) > INLINE_SEEN_MAX:
            del self._inline_seen[next(iter(self._inline_seen))]
        return ops.inode_of_row(tuple(columns)), dict(zip(indexes, keys))

    async def close_file(self, ino: int) -> Freed:
        if self.read_only:
            return Freed()
        freed = await self._write(_close_file, ino)
        self._held.discard(ino)
        return freed

    async def close_files(self, inodes: Sequence[int]) -> list[Freed]:
        if self.read_only or not inodes:
            return [Freed() for _ in inodes]
        freed = await self._write(lambda tx: [_close_file(tx, ino) for ino in sorted(inodes)])
        self._held.difference_update(inodes)
        return freed

    async def commit_blocks(self, ino: int, blocks: dict[int, Optional[tuple[str, int]]],
                            size: int, mtime_ns: int, durable: bool = False,
                            uploads_began: Optional[float] = None,
                            inline: Optional[dict[str, bytes]] = None) -> Freed:
        return await self._commit(ino, blocks, size, mtime_ns, promote=False, durable=durable,
                                  uploads_began=uploads_began, inline=inline)

    async def promote(self, ino: int, blocks: dict[int, Optional[tuple[str, int]]],
                      size: int, mtime_ns: int, uploads_began: Optional[float] = None) -> Freed:
        return await self._commit(ino, blocks, size, mtime_ns, promote=True, uploads_began=uploads_began)

    async def _commit(self, ino: int, blocks: dict[int, Optional[tuple[str, int]]], size: int, mtime_ns: int,
                      promote: bool, durable: bool = False, uploads_began: Optional[float] = None,
                      inline: Optional[dict[str, bytes]] = None) -> Freed:
        """The blocks, size and mtime in one call. EAGAIN: a block was collected while it
        was uploaded (``uploads_began``, monotonic; None: not known): put it again.

        Run again after a lost answer, a commit finds its blocks in place and changes
        nothing more; a promotion finds the file no longer scratch and refuses (EXDEV),
        which is its success when the file is this node's blocks as a file of the volume."""
        age = None if uploads_began is None else max(0.0, time.monotonic() - uploads_began)
        order = sorted(blocks)
        found = [blocks[i] for i in order]
        inline = inline or {}
        data = [inline.get(b[0]) if b else None for b in found]
        attempts = _Attempts(0, 0)
        try:
            # Committed without waiting for the WAL flush even for an fsync, which then waits
            # on its own (``_flush_wal``): a transaction that notifies (``change_feed``) holds
            # the server's lock on the notification queue until its commit ends, and would
            # hold it through its flush, one fsync of the whole cluster after another.
            (row,) = await self._call(server.COMMIT, (
                self.session_id, ino, order, [b[0] if b else None for b in found], [b[1] if b else 0 for b in found],
                size, mtime_ns, time.time(), promote, False, age, data), attempts=attempts)
        except RefusedByServer as exc:
            if not (promote and exc.errno == errno.EXDEV and attempts.retried):
                raise
            node, keys = await self.read_file(ino)
            if node.scratch or not node.is_reg or keys != {i: b[0] for i, b in blocks.items() if b is not None}:
                raise
            return Freed()  # promoted by the attempt whose answer was lost
        *columns, freed, used = row
        self._count(0, used)
        node = ops.inode_of_row(tuple(columns))
        self._remember({ino: node})
        if durable:
            await self._flush_wal()
        return Freed(keys=list(freed))

    async def truncate(self, ino: int, size: int, mtime_ns: int) -> tuple[Inode, Freed]:
        return await self._write(ops.truncate, ino, size, mtime_ns)

    async def block_map(self, ino: int) -> dict[int, str]:
        return await self._read(ops.block_map, ino)

    async def block_data(self, key: str) -> Optional[bytes]:
        seen = self._inline_seen.pop(key, None)
        if seen is not None:
            return seen
        row = await self._read(lambda tx: tx.one("SELECT data FROM objects WHERE key = ?", (key,)))
        return bytes(row[0]) if row is not None and row[0] is not None else None

    # --- objects: uploads and garbage collection ------------------------------------------
    async def object_info(self, key: str) -> Optional[ObjectInfo]:
        return await self._read(ops.object_info, key)

    async def begin_upload(self, key: str, size: int) -> Optional[bool]:
        """Always False (put the block): uploads are not registered. The commit that follows
        finds out whether the collector deleted these bytes meanwhile (EAGAIN: put them
        again, see ``functions``), which costs nothing when it did not, where a
        registration cost every block a transaction before its upload."""
        if self.lost:
            raise SessionLost()  # its commit could never come
        return False

    async def end_upload(self, key: str) -> None:
        """An upload whose commit will not come (the block was superseded): the block is
        recorded as unreferenced, so the collector deletes it in time. uploaded=0: the PUT
        may not have happened."""
        await self._write(lambda tx: tx.exec(
            "INSERT INTO objects (key, size, refcount, uploaded, unreferenced_since) VALUES (?, 0, 0, 0, ?)"
            " ON CONFLICT DO NOTHING", (key, tx.now_ns / 1e9)))

    async def mark_uploaded(self, key: str) -> None:
        pass  # a shared engine records a block when it is committed, after its upload

    async def forget_objects(self, keys: list[str]) -> None:
        """Scratch blocks nothing references any more: never in the bucket, so no row is
        needed. A row some upload of the same bytes marked as in the bucket stays, for
        the collector."""
        if keys:
            await self.pool.run(lambda cur: cur.execute(
                "DELETE FROM objects WHERE key = ANY(%s) AND refcount<=0 AND uploaded=0", (keys,)))

    async def pending_objects(self) -> list[ObjectInfo]:
        return []  # nothing is committed before it is uploaded

    async def blocks_by_recency(self, budget: Optional[int] = None) -> list[tuple[str, int]]:
        return await self._read(ops.blocks_by_recency, budget)

    async def collectable_objects(self, older_than: float, covered_seq: int) -> list[str]:
        return [r[0] for r in await self._read(lambda tx: tx.all(
            "SELECT key FROM objects WHERE refcount<=0 AND deleting=0 AND unreferenced_since<=?", (older_than,)))]

    async def claim_garbage(self, older_than: float, covered_seq: int) -> list[str]:
        """Mark unreferenced blocks for deletion: those no commit references since before
        ``older_than`` and no session is uploading. A marked block is deleted from the
        bucket, then forgotten (``garbage_deleted``); a commit of the same bytes meanwhile
        is refused, and its node puts them again (``functions``)."""
        def claim(cur: Any) -> list[str]:
            cur.execute("SELECT key FROM objects WHERE refcount<=0 AND deleting=0 AND unreferenced_since<=%s"
                        " ORDER BY key LIMIT 1000", (older_than,))
            claimed = []
            for (key,) in cur.fetchall():
                # Locked first, then checked with a fresh snapshot: an upload registered
                # before the lock is seen, one registered after waits for 'deleting' to go.
                cur.execute("SELECT refcount FROM objects WHERE key=%s AND deleting=0 FOR UPDATE", (key,))
                row = cur.fetchone()
                if row is None or row[0] > 0:
                    continue
                cur.execute("SELECT 1 FROM uploads WHERE key=%s LIMIT 1", (key,))
                if cur.fetchone() is not None:
                    continue
                cur.execute("UPDATE objects SET deleting=%s WHERE key=%s", (self.session_id, key))
                claimed.append(key)
            return claimed

        return await self.pool.run(claim)

    async def garbage_deleted(self, keys: list[str]) -> None:
        """Deleted from the bucket: the rows go, and each key is recorded as collected, so a
        commit of the same bytes uploaded before the deletion is refused (``functions``)."""
        def forget(cur: Any) -> None:
            cur.execute(f"WITH gone AS (DELETE FROM objects WHERE key = ANY(%s) AND deleting=%s RETURNING key)"
                        f" INSERT INTO collected (key, at) SELECT key, {_NOW} FROM gone"
                        f" ON CONFLICT (key) DO UPDATE SET at = excluded.at", (keys, self.session_id))
            cur.execute(f"DELETE FROM collected WHERE at < {_NOW} - %s", (server.COLLECTED_KEEP,))

        if keys:
            await self.pool.run(forget)

    async def unknown(self, keys: list[str]) -> list[str]:
        """The keys the database has no row and no upload registered for."""
        def find(cur: Any) -> list[str]:
            cur.execute(_UNKNOWN, (keys,))
            return [r[0] for r in cur.fetchall()]

        return await self.pool.run(find) if keys else []

    async def garbage_kept(self, keys: list[str]) -> None:
        if keys:
            await self.pool.run(lambda cur: cur.execute(
                "UPDATE objects SET deleting=0 WHERE key = ANY(%s) AND deleting=%s", (keys, self.session_id)))

    async def sweep_unknown(self, keys: list[str]) -> list[str]:
        """Claim blocks found in the bucket that the database knows nothing of (no row, no
        registration of an earlier release): left by a node that died between a PUT and its
        commit. Returns the keys to delete, then ``garbage_deleted``. The caller passes only
        blocks older than its grace period. A commit of the same bytes meanwhile finds the
        claim, or the collected key, and puts them again (``functions``); two sweeps
        claiming one key meet on its primary key, and the second runs again."""
        def claim(cur: Any) -> list[str]:
            cur.execute(_UNKNOWN, (keys,))
            unknown = [r[0] for r in cur.fetchall()]
            for key in unknown:
                cur.execute(f"INSERT INTO objects (key, size, refcount, uploaded, deleting, unreferenced_since)"
                            f" VALUES (%s, 0, 0, 1, %s, {_NOW})", (key, self.session_id))
            return unknown

        return await self.pool.run(claim) if keys else []

    # --- sessions -------------------------------------------------------------------------
    async def start(self) -> Freed:
        """Register this mount as a session; clean up sessions whose heartbeat stopped."""
        if not self.read_only:
            def register(cur: Any) -> tuple[int, float]:
                since = self._keep_holds(cur, 0)  # before the session's first heartbeat, which then trusts them
                cur.execute(f"INSERT INTO sessions (host, pid, mountpoint, started, heartbeat, timeout)"
                            f" VALUES (%s, %s, %s, {_NOW}, {_NOW}, %s) RETURNING id",
                            (socket.gethostname(), os.getpid(), self.mountpoint, self.session_ttl))
                session_id = cur.fetchone()[0]
                cur.execute("INSERT INTO counters (session_id, lane) SELECT %s, generate_series(0, %s)"
                            " ON CONFLICT DO NOTHING", (session_id, self._lanes.count))
                return session_id, since

            self.session_id, self._holds_since = await self.pool.run(register)
            self.pool.tag = str(self.session_id)  # connections made from now on say so (change_feed)
            log.info("metadata session %d on %s", self.session_id, self.pool.redacted)
        freed = await self.clean_dead_sessions()
        await self._refresh_stats()
        return freed

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the other nodes' changes; heartbeat, and clean up the sessions of nodes
        that stopped beating."""
        async with trio.open_nursery() as nursery:
            if self.changes is not None:
                nursery.start_soon(self.changes.run)
            task_status.started()
            if not self.read_only:
                await self._keep_session()

    async def _keep_session(self) -> None:
        while not self.lost:
            await trio.sleep(self.session_ttl / 3)
            try:
                await self.heartbeat()
                await self.clean_dead_sessions()
                await self.sweep_kept_orphans()
                await self._refresh_stats()
            except SessionLost:
                pass  # logged where it was found; nothing to keep up any more
            except Exception as exc:  # noqa: BLE001 - the database may be restarting: keep beating
                log.warning("metadata session upkeep failed: %s", exc)

    async def heartbeat(self) -> None:
        """The session's heartbeat; and, when the server has lost the holds since this node
        last registered them (a crash, a failover: the table is UNLOGGED), its holds again,
        in the same transaction, before the heartbeat that says so (``fs_holds_trusted``)."""
        def beat(cur: Any) -> Optional[float]:
            since = self._keep_holds(cur, self.session_id)
            cur.execute(f"UPDATE sessions SET heartbeat={_NOW} WHERE id=%s", (self.session_id,))
            return since if cur.rowcount == 1 else None

        since = await self.pool.run(beat)
        if since is None:
            raise self._lose()
        self._holds_since = since

    def _keep_holds(self, cur: Any, session: int) -> float:
        """holds_kept's since, made now if the server lost it with the holds (then every
        file without a name is a candidate for the sweep: the holds that kept it are gone);
        this node's holds registered again if it has not done so since then."""
        cur.execute("SELECT since FROM holds_kept")
        row = cur.fetchone()
        if row is None:
            cur.execute(f"INSERT INTO holds_kept (since) VALUES ({_NOW}) ON CONFLICT DO NOTHING")
            cur.execute("INSERT INTO orphans_kept (inode) SELECT id FROM inodes WHERE nlink = 0 ON CONFLICT DO NOTHING")
            cur.execute("SELECT since FROM holds_kept")
            row = cur.fetchone()
        since = float(row[0])
        if session and since != self._holds_since and self._held:
            cur.execute("INSERT INTO holds (session_id, inode) SELECT %s, unnest(%s::bigint[]) ON CONFLICT DO NOTHING",
                        (session, sorted(self._held)))
        return since

    async def sweep_kept_orphans(self) -> Freed:
        """Delete the files kept while the holds could not be trusted that still have no
        name and no holder, once they can be (a few hundred per heartbeat)."""
        def sweep(tx: ops.Tx) -> Freed:
            kept = tx.all("DELETE FROM orphans_kept WHERE inode IN (SELECT inode FROM orphans_kept LIMIT 500)"
                          " RETURNING inode")
            return _drop_nameless(tx, [ino for (ino,) in kept])

        if self.read_only:
            return Freed()
        # A read first: almost always there is nothing to sweep, and no write transaction is due.
        due = await self._read(lambda tx: tx.one(_SWEEP_DUE))
        if not (due and due[0]):
            return Freed()
        return await self._write(sweep)

    def _lose(self) -> SessionLost:
        """This session is gone from the database: mark it lost, say so once, and return the
        error to raise. Reads still answer; everything that would publish fails."""
        if not self.lost:
            self.lost = True
            self._held.clear()
            log.error(LOST_MESSAGE, self.session_id, self.session_ttl, self.mountpoint)
        return SessionLost()

    async def clean_dead_sessions(self) -> Freed:
        """The files held and the uploads registered by sessions whose heartbeat stopped
        longer than the timeout ago: let go of them, deleting files that have no name left.
        Each session's own timeout counts (nodes may be mounted with different ones).
        Also ended: upload registrations of sessions no longer there, which a node whose
        session was cleaned up made before it learnt so (the block then waits for the
        collector like any upload whose commit will not come)."""
        # After an outage (a failover, a restart), every node's heartbeats were held up as
        # long as this one's: a session is judged again only once this node has been back
        # for that session's whole timeout, time enough for its node to beat again.
        back = self.pool.back_since
        back_for = 1e12 if back is None else time.monotonic() - back

        def dead(cur: Any) -> list[tuple[int, Optional[float]]]:
            cur.execute(f"SELECT id, timeout FROM sessions WHERE heartbeat < {_NOW} - timeout AND id <> %s"
                        " AND timeout <= %s"
                        " UNION SELECT DISTINCT session_id, NULL::float8 FROM uploads u"
                        " WHERE NOT EXISTS (SELECT 1 FROM sessions s WHERE s.id = u.session_id)",
                        (self.session_id, back_for))
            return [(r[0], r[1]) for r in cur.fetchall()]

        freed = Freed()
        for session, timeout in await self.pool.run(dead):
            one = await self._write(_clean_session, session)
            freed.keys += one.keys
            if timeout is None:
                log.warning("released the upload registrations of ended metadata session %d", session)
                continue
            self.sessions_cleaned += 1
            self.lookups.clear()  # its scratch files' names went, unannounced to this node
            log.warning("cleaned up metadata session %d (no heartbeat for %.0f s): %d blocks freed",
                        session, timeout, len(one.keys))
        return freed

    async def check(self) -> list[str]:
        """What is inconsistent in the tables (``fusestate fsck``)."""
        return await self._read(shared_problems)

    async def referenced(self) -> set[str]:
        return await self._read(ops.referenced_keys)

    async def sessions(self) -> list[SessionInfo]:
        def listing(cur: Any) -> list[SessionInfo]:
            cur.execute(f"SELECT id, host, pid, mountpoint, started, {_NOW} - heartbeat FROM sessions ORDER BY id")
            return [SessionInfo(*row) for row in cur.fetchall()]

        return await self.pool.run(listing)

    async def _refresh_stats(self) -> None:
        def totals(cur: Any) -> EngineStats:
            cur.execute("SELECT COALESCE(SUM(inodes), 0), COALESCE(SUM(used), 0) FROM counters")
            inodes, used = cur.fetchone()
            return EngineStats(int(inodes), int(used))

        self._stats = await self.pool.run(totals)

    def stats(self) -> EngineStats:
        return self._stats

    async def sync(self) -> None:
        """Make every namespace change committed so far durable (fsync, fsyncdir).

        Namespace operations commit without waiting for the database's WAL flush
        (``fs_session`` sets ``synchronous_commit = off``): they are visible to every
        node when they return, and durable within the server's WAL writer delay, or at the next
        durable commit: one round trip (``_flush_wal``) whose commit waits until the WAL is
        flushed up to its commit record, which is after every commit before it, this node's
        and the others'. Nothing is sent when this node committed nothing since its last
        flush (an fsync's block commit is followed by its own): what it saw other nodes commit
        is theirs to make durable. EIO when some of this node's commits since the last durable one ran
        on a primary that has been replaced since (a failover): they may be lost."""
        if self._async_commits == self._durable_through:
            return  # nothing committed since the last flush (an fsync's block commit and its own)
        await self._flush_wal()

    async def _flush_wal(self) -> None:
        """Wait until the server's WAL is on disk up to now: a transaction that writes
        commits with a WAL record and waits for its flush, which covers every commit before
        it, this node's and the others'. It writes a row of its own lane: flushes of one
        node and of many wait for no lock and share the server's group commit."""
        covered = self._async_commits
        timelines: list[int] = []
        async with self._lanes.hold() as lane:
            def values(conn: Any) -> tuple:
                timelines.append(int(getattr(conn, "timeline", 0)))
                return (self.session_id, lane if self.session_id else 0)

            if not await self.pool.query(_FLUSH_WAL, values):  # no row: nothing written, nothing waited for
                raise self._lose() if self.session_id else FsError(errno.EIO, "no metadata session to flush with")
        self._made_durable(covered, timelines[-1])

    def close(self) -> None:
        if self.session_id and not self.lost and not self.read_only:
            self.pool.outage_budget = min(self.pool.outage_budget, CLOSE_OUTAGE_BUDGET)
            try:
                # A clean unmount: every file this node held is closed by now; let go of the rest.
                self.pool.run_sync(_in_pipeline(self, _end_session, self.session_id))
            except Exception as exc:  # noqa: BLE001 - the others clean it up after the timeout
                log.warning("could not end the metadata session: %s", exc)
        self.pool.close()


def _close_file(tx: ops.Tx, ino: int) -> Freed:
    """``operations.close_file`` without its row lock for a file that still has a name (the
    common close): the file's fence, the hold dropped, then the link count; a file with no
    name left is locked and deleted as there."""
    tx.exec(_ADVISORY_LOCK, (server.INODE_FENCE, server.inode_key(ino)))
    tx.holds.remove(tx, ino)
    row = tx.one("SELECT nlink FROM inodes WHERE id=?", (ino,))
    if row is None or row[0] > 0:
        return Freed()
    return ops.close_file(tx, ino)


def _clean_session(tx: ops.Tx, session: int) -> Freed:
    freed = Freed()
    held = [r[0] for r in tx.all("DELETE FROM holds WHERE session_id=? RETURNING inode", (session,))]
    _end_uploads(tx, "session_id=?", (session,))
    # Deletions it claimed may or may not have happened: the blocks are unreferenced still,
    # and maybe gone from the bucket, so the next upload of their bytes must not skip the
    # PUT, and a commit of an upload that began before now must put them again.
    tx.exec(f"INSERT INTO collected (key, at) SELECT key, {_NOW} FROM objects WHERE deleting=?"
            " ON CONFLICT (key) DO UPDATE SET at = excluded.at", (session,))
    tx.exec("UPDATE objects SET deleting=0, uploaded=0 WHERE deleting=?", (session,))
    # After every server-side operation of the session in flight (they hold the fence shared),
    # before any that would come: they then find no row (functions).
    tx.exec("SELECT pg_advisory_xact_lock(?::int, ?::int)", (server.SESSION_FENCE, session % 2147483647))
    tx.exec("DELETE FROM sessions WHERE id=?", (session,))
    # Its lanes' counts go into its row of lane 0: one row stays per ended session, as before lanes.
    tx.exec("WITH lanes AS (DELETE FROM counters WHERE session_id=? AND lane<>0 RETURNING inodes, used)"
            " UPDATE counters SET inodes = inodes + (SELECT COALESCE(SUM(inodes), 0) FROM lanes),"
            " used = used + (SELECT COALESCE(SUM(used), 0) FROM lanes) WHERE session_id=? AND lane=0",
            (session, session))
    # Its scratch files were readable nowhere else: their names go with it.
    freed.keys += ops.purge_scratch(tx, session).keys
    freed.keys += _drop_nameless(tx, held).keys
    return freed


def _drop_nameless(tx: ops.Tx, inodes: list[int]) -> Freed:
    """Delete those of these files that have no name left and that no node holds."""
    freed = Freed()
    for ino in sorted(inodes):
        tx.lock([ino])
        row = tx.one("SELECT nlink FROM inodes WHERE id=?", (ino,))
        if row is not None and row[0] == 0 and not tx.holds.held(tx, ino):
            freed.keys += ops.drop_orphans(tx, [ino]).keys
    return freed



def _end_session(tx: ops.Tx, session: int) -> Freed:
    """A clean unmount: its own clean-up, outside the transactions that count their changes
    (``_txn``), so it counts its own."""
    freed = _clean_session(tx, session)
    if tx.inodes_delta or tx.used_delta:
        tx.exec(_ADD_COUNTERS, (tx.inodes_delta, tx.used_delta, session))
    return freed


def _end_uploads(tx: ops.Tx, where: str, args: tuple) -> None:
    """Registered uploads whose commits will not come become unreferenced objects: the
    block may be in the bucket, and the collector deletes it once its grace has passed."""
    for key, size in tx.all(f"DELETE FROM uploads WHERE {where} RETURNING key, size", args):
        if tx.one("SELECT 1 FROM uploads WHERE key=?", (key,)) is None:
            # uploaded=0: the PUT may not have happened, so the next upload of these bytes
            # must not skip it.
            tx.exec("INSERT INTO objects (key, size, refcount, uploaded, unreferenced_since)"
                    " VALUES (?, ?, 0, 0, ?) ON CONFLICT DO NOTHING", (key, size, tx.now_ns / 1e9))


def shared_problems(tx: ops.Tx, limit: int = 20) -> list[str]:
    """Checks of the shared tables on top of ``operations.consistency_problems``: files
    without names that no live session holds, and the per-session counters."""
    problems = ops.consistency_problems(tx, limit)
    # Not while the holds cannot be trusted (the server lost them), nor the files then kept,
    # which the sweep deletes once they can be.
    for (ino,) in tx.all("SELECT i.id FROM inodes i WHERE i.nlink = 0 AND NOT EXISTS"
                         f" (SELECT 1 FROM holds h JOIN sessions s ON s.id = h.session_id WHERE h.inode = i.id)"
                         " AND NOT EXISTS (SELECT 1 FROM orphans_kept o WHERE o.inode = i.id)"
                         f" AND fs_holds_trusted() LIMIT {limit}"):
        problems.append(f"inode {ino} has no name and no node holds it open")
    row = tx.one("SELECT (SELECT COALESCE(SUM(inodes), 0) FROM counters), (SELECT COUNT(*) FROM inodes),"
                 " (SELECT COALESCE(SUM(used), 0) FROM counters),"
                 " (SELECT COALESCE(SUM(size), 0) FROM objects WHERE refcount > 0)")
    assert row is not None
    if int(row[0]) != int(row[1]):
        problems.append(f"the inode counters say {row[0]}, the table holds {row[1]}")
    if int(row[2]) != int(row[3]):
        problems.append(f"the usage counters say {row[2]} bytes, the blocks in use add up to {row[3]}")
    for key, data in tx.all(f"SELECT key, data FROM objects WHERE starts_with(key, '{INLINE_PREFIX}')"
                            " AND refcount > 0"):
        if data is None or not key_matches(key, bytes(data)):
            problems.append(f"inline block {key[:24]} has {'no bytes' if data is None else 'other bytes'}")
            if len(problems) >= limit:
                break
    return problems
