"""Other nodes' changes of names and inodes, as the database announces them.

Triggers on ``entries`` and ``inodes`` (``sql/change_feed.sql``) send a notification on
``CHANNEL`` for every name updated or deleted and every inode other than a directory
updated or deleted, in the transaction that changes it: PostgreSQL delivers it to each
listening session once the transaction commits. A new name is not announced (no node
caches a name as missing), nor a directory's attributes, which change with every create
and unlink in it (no node caches them: ``LookupCache``). Each notifying commit signals every
node's listening session on the server, so a create announces nothing, and its close one
inode.

Each node keeps one connection of its own that listens, and asks the server one question
after another, each a sleep of ``PING_EVERY`` seconds (``_QUESTION``). The server sends a
session the notifications of every transaction committed before a statement ends ahead of
that statement's answer, so once the answer is in, every change committed before the
question was sent has been applied to the cache. The cache is trusted while the last
answered question was sent less than ``MAX_LAG`` seconds ago: a lost connection, a server
that stops answering or a daemon too busy to read its socket turn it off within that time,
and every lookup asks the database until the connection is back (the cache emptied first:
what came meanwhile is unknown).

A change another node made shows here within about ``PING_EVERY`` seconds (the answer it
comes with), at the latest ``MAX_LAG``. This node's own changes are skipped: its operations
update the cache themselves as they commit (``LookupCache.wrote``). A notification names the
session whose connection made the change (``SESSION_SETTING``, set on each of the pool's
connections, ``PgPool.tag``): a session id is never given twice, where a server process id
is reused, and a process id that once was this node's may serve another node's changes.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

import psycopg
import trio
from psycopg import pq

from fusestate.meta.postgres.lookup_cache import LookupCache, Name
from fusestate.meta.postgres.pool import PgPool

log = logging.getLogger(__name__)

CHANNEL = "fusestate_changes"
PING_EVERY = 0.1  # seconds each question lasts: notifications come in batches, with its answer
MAX_LAG = 0.5  # the cache answers while the last answered question is younger than this
PING_TIMEOUT = 5.0  # an answer this late: the connection is made again
RECONNECT_DELAYS = (0.2, 0.5, 1.0, 2.0, 5.0)  # after a failed connection, then the last one
# The question: a sleep. While it runs, the server only marks that notifications wait (a
# signal per notifying commit); it reads them from its queue and sends them once, before
# the answer. An idle listening session would instead run a transaction to read them at
# each notifying commit of any node: about 20 us of the server's CPU per change and node.
_QUESTION = f"SELECT pg_sleep({PING_EVERY})".encode()

# Each notification: its kind (e: a name, i: an inode), the session that made the change,
# ':', and what changed, as the triggers of ``sql/change_feed.sql`` write it.


class ChangeFeed:
    """See the module docstring."""

    def __init__(self, pool: PgPool, cache: LookupCache) -> None:
        self.pool = pool
        self.cache = cache
        self._answered_since = -math.inf  # when the last answered question was sent (trio clock)
        self._pg: Any = None  # the listening connection's libpq side, while connected
        # Told of the inodes other nodes changed, with each one's new size (None: deleted),
        # after the cache (the kernel's names of them: ``fuse.kernel_names``).
        self.inode_listeners: list[Callable[[list[tuple[int, Optional[int]]]], None]] = []

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def fresh(self) -> bool:
        """Whether the cache holds every change committed more than MAX_LAG seconds ago."""
        return trio.current_time() - self._answered_since < MAX_LAG

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        failures = 0
        while True:
            conn: Optional[psycopg.Connection] = None
            try:
                conn = await trio.to_thread.run_sync(self._listen, abandon_on_cancel=True)
                self.cache.clear()
                failures = 0
                await self._follow(conn.pgconn)
            except Exception as exc:  # noqa: BLE001 - lookups ask the database meanwhile; never the daemon's end
                if failures == 0:
                    log.warning("metadata change notifications lost (%s): lookups ask the database until "
                                "they are back", str(exc).strip() or type(exc).__name__)
                failures += 1
            finally:
                self._answered_since = -math.inf
                self._pg = None
                if conn is not None:
                    conn.close()
            await trio.sleep(RECONNECT_DELAYS[min(failures, len(RECONNECT_DELAYS)) - 1])

    def _listen(self) -> psycopg.Connection:
        conn = self.pool.dedicated_connection()
        try:
            # Told apart from the pool's connections in pg_stat_activity; its question is
            # a sleep, which a server's statement_timeout must not cut.
            conn.execute("SELECT set_config('application_name', current_setting('application_name') || ' changes',"
                         " false), set_config('statement_timeout', '0', false)")
            conn.execute(f"LISTEN {CHANNEL}")
            conn.pgconn.nonblocking = 1
        except BaseException:
            conn.close()
            raise
        return conn

    async def _follow(self, pg: Any) -> None:
        """Ask, take the notifications in with the answer; again, until the connection fails."""
        fd = pg.socket
        self._pg = pg
        while True:
            sent = trio.current_time()
            pg.send_query(_QUESTION)
            while pg.flush():
                await trio.lowlevel.wait_writable(fd)
            with trio.fail_after(PING_EVERY + PING_TIMEOUT):
                while True:
                    while pg.is_busy():
                        await trio.lowlevel.wait_readable(fd)
                        pg.consume_input()
                    result = pg.get_result()
                    if result is None:  # the server is ready again: every notification sent before is in
                        break
                    if result.status != pq.ExecStatus.TUPLES_OK:
                        raise psycopg.OperationalError(result.error_message.decode(errors="replace"))
            self._take(pg)
            self._answered_since = sent

    def _take(self, pg: Any) -> None:
        own = self.pool.tag.encode()
        names: list[Name] = []
        inodes: list[tuple[int, Optional[int]]] = []  # (inode, its new size; None: deleted)
        unknown = False
        while (note := pg.notifies()) is not None:
            kind, body = note.extra[:1], note.extra[1:]
            session, colon, what = body.partition(b":")
            if not colon:  # a release before sessions were named: another node's, or this one's
                session, what = b"", body
            if own and session == own:
                continue
            try:
                if kind == b"i":
                    ino, slash, size = what.partition(b"/")
                    inodes.append((int(ino), int(size) if slash else None))
                elif kind == b"e":
                    parent, _, name = what.partition(b"/")
                    names.append((int(parent), bytes.fromhex(name.decode())))
                else:
                    unknown = True
            except ValueError:
                unknown = True
        if unknown:  # a change this release cannot place (a newer node's): forget everything
            self.cache.clear()
        elif names or inodes:
            self.cache.changed_elsewhere(names, [ino for ino, _ in inodes])
        if inodes:
            for listener in self.inode_listeners:
                listener(inodes)
