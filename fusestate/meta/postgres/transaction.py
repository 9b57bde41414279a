"""A transaction of the shared engine, and the attempts of one operation.

``PgTx`` is ``operations.Tx`` on a connection of the pool: the statements of an operation of
``operations.py``, pipelined (``pipeline``), its row locks queued and taken with the next
query that reads. ``Lanes`` and ``Attempts`` let an operation whose answer was lost with its
connection run again without being applied twice (``PostgresEngine._write``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Optional, TypeVar

import trio

from fusestate.meta import operations as ops
from fusestate.meta.engine import Inode
from fusestate.meta.postgres.pipeline import Pipeline, Slot

T = TypeVar("T")

MOVE_LOCK = 0x66757366    # advisory lock id that serializes directory moves between parents
LOCK_INODES = f"SELECT {ops.INODE_COLUMNS} FROM inodes WHERE id = ANY(?) ORDER BY id FOR UPDATE"
# A lane's lock (Attempts) or an inode's fence (functions.INODE_FENCE): (class, key).
ADVISORY_LOCK = "SELECT pg_advisory_xact_lock(?::int, ?::int)"
# A session's rows are made when it registers (``start``): an UPDATE writes one WAL record,
# the upsert it replaces two (a row lock, then the update). Lane 0 takes the counts of
# operations that hold no lane.
ADD_COUNTERS = "UPDATE counters SET inodes = inodes + ?, used = used + ? WHERE session_id = ? AND lane = 0"
NOW = "extract(epoch from clock_timestamp())"  # the database's clock: one clock for every node


class Lanes:
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
class Attempts:
    """The attempts of one operation whose outcome may become unknown.

    The pool runs an operation again on a new connection when its connection breaks; if
    that happened after the commit was sent, the commit may or may not have happened.
    Such an operation holds a lane (``Lanes``) and has a number (``op``, unique within
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


class PgTx:
    """One transaction on a connection, its statements in a :class:`Pipeline`: a statement
    whose result nobody reads (``exec``) is only queued, and goes to the server with the
    next one whose rows are read, or with COMMIT. A namespace operation then costs one
    round trip per query it reads, not one per statement."""

    commits_uploaded = True

    def __init__(self, pipe: Pipeline, block_size: int, holds: ops.Holds, session: int,
                 now_ns: Optional[int] = None) -> None:
        self._pipe = pipe
        self.now_ns = time.time_ns() if now_ns is None else now_ns
        self.block_size = block_size
        self.holds = holds
        self.inodes_delta = 0
        self.used_delta = 0
        self.scratch_owner = session
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
        self._lock_slots.append(self._pipe.queue(LOCK_INODES, (sorted(set(inodes)),), rows=True))

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


def in_pipeline(new_tx: Callable[[Pipeline], PgTx], operation: Callable[..., T], *args: Any) -> Callable[[Any], T]:
    """``operation(tx, *args)`` as a pool transaction function, its statements pipelined."""
    def run(cur: Any) -> T:
        with Pipeline(cur.connection) as pipe:
            return operation(new_tx(pipe), *args)
    return run
