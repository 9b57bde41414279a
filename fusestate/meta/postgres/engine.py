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
run again without being applied twice (``Attempts``).

Blocks are committed only once they are in the bucket (``shared = True``): the shared
metadata never points at a block another node cannot read, except a scratch file's
(``--scratch``): its inode records the session that made it, its blocks stay on that
node and are recorded as not uploaded, and its names go when that session ends.

Here: the operations, a session's upkeep and durability. Beside it: a transaction and the
attempts of one operation (``transaction``), what ends with a session (``sessions``), the
block ledger and garbage collection (``collector``), fsck's checks (``check``).
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import os
import socket
import time
from typing import Any, Callable, Optional, Sequence, TypeVar

import trio

from fusestate.config import DEFAULT_BLOCK_SIZE
from fusestate.errors import FsError
from fusestate.meta import operations as ops
from fusestate.meta import posix
from fusestate.meta.engine import AttrChange, DirEntry, EngineStats, Freed, Inode, NewNode
from fusestate.meta.postgres import functions as server
from fusestate.meta.postgres import schema
from fusestate.meta.postgres.change_feed import ChangeFeed
from fusestate.meta.postgres.check import shared_problems
from fusestate.meta.postgres.collector import ObjectLedger
from fusestate.meta.postgres.lookup_cache import LookupCache, Name
from fusestate.meta.postgres.pipeline import Pipeline
from fusestate.meta.postgres.pool import PgPool, RefusedByServer, timeline_of
from fusestate.meta.postgres.sessions import (LOST_MESSAGE, SessionHolds, SessionInfo, SessionLost, clean_session,
                                              drop_nameless, end_session)
from fusestate.meta.postgres.transaction import (ADD_COUNTERS, ADVISORY_LOCK, NOW, Attempts, Lanes, PgTx,
                                                 in_pipeline)

log = logging.getLogger(__name__)

T = TypeVar("T")

SESSION_TTL = 30.0         # seconds without a heartbeat before other nodes clean a session up
# How long an unmount tries to end its session while the database is unreachable: nothing
# but the session's own rows is at stake (the other nodes clean them up after SESSION_TTL).
CLOSE_OUTAGE_BUDGET = 5.0
RECENT_ROWS_MAX = 10_000  # rows of this node's own writes that getattr answers (attr_cache_seconds)
# A small file's block up to this many bytes is kept in the database, not the bucket
# (functions, "Inline blocks"): a PostgreSQL page holds a row of this size.
INLINE_MAX = 4096
INLINE_SEEN_MAX = 1024  # inline blocks an open brought along, kept until the block store asks

# What an operation that holds a lane writes instead: its counts and its number, in one
# update of a row no other transaction writes (see ``Attempts``).
_MARK = "UPDATE counters SET inodes = inodes + ?, used = used + ?, op = ? WHERE session_id = ? AND lane = ?"
_DONE = "SELECT 1 FROM counters WHERE session_id = ? AND lane = ? AND op = ?"
# A transaction of its own that writes a WAL record (a commit without one does not wait for
# the flush): an update of a lane's row, which no other transaction writes meanwhile
# (``Lanes``). With a server's synchronous_commit = off it waits all the same; a stronger
# setting (remote_apply) is kept.
_FLUSH_WAL = ("WITH mode AS (SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit')"
              " WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END, true))"
              " UPDATE counters SET op = op FROM mode WHERE session_id = ? AND lane = ? RETURNING 1")

# A page of a directory's listing in one statement: the directory's mode (ENOENT, ENOTDIR),
# then its entries after an id with their inodes (see ops.listing).
_READDIR = ("SELECT d.mode, page.* FROM inodes d LEFT JOIN LATERAL"
            f" (SELECT e.id AS entry_id, e.name, {ops.JOINED_INODE_COLUMNS} FROM"
            "  (SELECT id, name, inode FROM entries WHERE parent = d.id AND id > ? ORDER BY id LIMIT ?) e"
            "  JOIN inodes i ON i.id = e.inode ORDER BY e.id) page"
            " ON true WHERE d.id = ?")
_SWEEP_DUE = "SELECT EXISTS (SELECT 1 FROM orphans_kept) AND fs_holds_trusted()"


class PostgresEngine(ObjectLedger):
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
        self._lanes = Lanes(pool_size)
        self._ops = itertools.count(1)  # numbers of this session's operations (Attempts)
        self.session_id = 0
        self.lost = False  # the other nodes cleaned up this session: nothing more may be published
        self._holds = SessionHolds(lambda: self.session_id)
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
        finds out whether the commit happened (``Attempts``). Every attempt keeps the
        operation's first time."""
        if self.read_only:
            raise FsError(errno.EROFS)
        now_ns = time.time_ns()
        if not once or not self.session_id:
            return await self._attempt(operation, args, after, None, now_ns)
        async with self._lanes.hold() as lane:
            return await self._attempt(operation, args, after, Attempts(lane, next(self._ops)), now_ns)

    async def _attempt(self, operation: Callable[..., T], args: tuple, after: Optional[Callable[[ops.Tx], None]],
                       attempts: Optional[Attempts], now_ns: int) -> T:
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
             attempts: Optional[Attempts], now_ns: int) -> tuple[T, int, int]:
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
                tx = self._new_tx(pipe, now_ns)
                result = operation(tx, *args)
                if after is not None:
                    after(tx)
                if attempts is not None:
                    pipe.queue(_MARK, (tx.inodes_delta, tx.used_delta, attempts.op, self.session_id, attempts.lane))
                elif tx.inodes_delta or tx.used_delta:
                    pipe.queue(ADD_COUNTERS, (tx.inodes_delta, tx.used_delta, self.session_id))
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

    def _done_before(self, pipe: Pipeline, attempts: Attempts) -> bool:
        """Take the operation's lane (waiting for an earlier attempt the server still runs);
        whether an earlier attempt committed, asked only after one sent its commit."""
        pipe.queue(ADVISORY_LOCK, (server.LANE_FENCE, server.lane_key(self.session_id, attempts.lane)))
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

    async def _call(self, statement: str, args: tuple, attempts: Optional[Attempts] = None,
                    changes: bool = True) -> list[tuple]:
        """One server-side operation (``functions``): one statement, one round trip, one
        transaction, committed without waiting for the WAL flush; its POSIX errors come back
        as :class:`RefusedByServer`. ``attempts``: records whether the last call was a retry after one that was sent;
        with a number (``op``), the statement's first arguments after the session are the
        lane, the number and that (``Attempts``). ``changes`` False: the operation changes
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

    def _new_tx(self, pipe: Pipeline, now_ns: Optional[int] = None) -> PgTx:
        return PgTx(pipe, self.block_size, self._holds, self.session_id, now_ns)

    async def _read(self, operation: Callable[..., T], *args: Any) -> T:
        return await self.pool.run(in_pipeline(self._new_tx, operation, *args), explicit=True)

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
        retry after a lost answer finds what the first attempt did (``Attempts``)."""
        async with self._lanes.hold() as lane:
            return await self._call(statement, args, attempts=Attempts(lane, next(self._ops)))

    async def create(self, parent: int, name: bytes, node: NewNode, hold: bool = False) -> Inode:
        """One call of ``fs_create``, holding a lane: a retry after its answer was lost
        returns the inode the call made rather than EEXIST (``Attempts``)."""
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
        attempts = Attempts(0, 0)
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

    # --- sessions -------------------------------------------------------------------------
    async def start(self) -> Freed:
        """Register this mount as a session; clean up sessions whose heartbeat stopped."""
        if not self.read_only:
            def register(cur: Any) -> tuple[int, float]:
                since = self._keep_holds(cur, 0)  # before the session's first heartbeat, which then trusts them
                cur.execute(f"INSERT INTO sessions (host, pid, mountpoint, started, heartbeat, timeout)"
                            f" VALUES (%s, %s, %s, {NOW}, {NOW}, %s) RETURNING id",
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
            cur.execute(f"UPDATE sessions SET heartbeat={NOW} WHERE id=%s", (self.session_id,))
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
            cur.execute(f"INSERT INTO holds_kept (since) VALUES ({NOW}) ON CONFLICT DO NOTHING")
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
            return drop_nameless(tx, [ino for (ino,) in kept])

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
            cur.execute(f"SELECT id, timeout FROM sessions WHERE heartbeat < {NOW} - timeout AND id <> %s"
                        " AND timeout <= %s"
                        " UNION SELECT DISTINCT session_id, NULL::float8 FROM uploads u"
                        " WHERE NOT EXISTS (SELECT 1 FROM sessions s WHERE s.id = u.session_id)",
                        (self.session_id, back_for))
            return [(r[0], r[1]) for r in cur.fetchall()]

        freed = Freed()
        for session, timeout in await self.pool.run(dead):
            one = await self._write(clean_session, session)
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
            cur.execute(f"SELECT id, host, pid, mountpoint, started, {NOW} - heartbeat FROM sessions ORDER BY id")
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
                self.pool.run_sync(in_pipeline(self._new_tx, end_session, self.session_id))
            except Exception as exc:  # noqa: BLE001 - the others clean it up after the timeout
                log.warning("could not end the metadata session: %s", exc)
        self.pool.close()


def _close_file(tx: ops.Tx, ino: int) -> Freed:
    """``operations.close_file`` without its row lock for a file that still has a name (the
    common close): the file's fence, the hold dropped, then the link count; a file with no
    name left is locked and deleted as there."""
    tx.exec(ADVISORY_LOCK, (server.INODE_FENCE, server.inode_key(ino)))
    tx.holds.remove(tx, ino)
    row = tx.one("SELECT nlink FROM inodes WHERE id=?", (ino,))
    if row is None or row[0] > 0:
        return Freed()
    return ops.close_file(tx, ino)
