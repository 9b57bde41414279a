"""Other nodes' changes of names and inodes, as the database announces them.

Triggers on ``entries`` and ``inodes`` (``CHANGE_TRIGGERS``) send a notification on
``CHANNEL`` for every name updated or deleted and every inode other than a directory
updated or deleted, in the transaction that changes it: PostgreSQL delivers it to each
listening session once the transaction commits. A new name is not announced (no node
caches a name as missing), nor a directory's attributes, which change with every create
and unlink in it (no node caches them: ``LookupCache``). Each notifying commit wakes every
node's listening session on the server, so a create announces nothing, and its close one
inode.

Each node keeps one connection of its own that listens, and asks the server ``SELECT 1``
every ``PING_EVERY`` seconds. The server sends a session the notifications of every
transaction committed before a statement ahead of that statement's answer, so once the
answer is in, every change committed before the question was sent has been applied to the
cache. The cache is trusted while the last answered question was sent less than
``MAX_LAG`` seconds ago: a lost connection, a server that stops answering or a daemon too
busy to read its socket turn it off within that time, and every lookup asks the database
until the connection is back (the cache emptied first: what came meanwhile is unknown).

Notifications sent by this node's own connections are skipped: its operations update the
cache themselves as they commit (``LookupCache.wrote``).
"""

from __future__ import annotations

import logging
import math
import stat
from typing import Any, Optional

import psycopg
import trio
from psycopg import pq

from fusestate.meta.lookup_cache import LookupCache, Name
from fusestate.meta.pgpool import PgPool

log = logging.getLogger(__name__)

CHANNEL = "fusestate_changes"
PING_EVERY = 0.1  # seconds between two questions that prove the notifications are all in
MAX_LAG = 0.5  # the cache answers while the last answered question is younger than this
PING_TIMEOUT = 5.0  # an answer this late: the connection is made again
RECONNECT_DELAYS = (0.2, 0.5, 1.0, 2.0, 5.0)  # after a failed connection, then the last one

_S_IFMT = 0o170000  # the file type bits of st_mode
# Installed with the schema (idempotent: a node of this release creates them once).
CHANGE_TRIGGERS = f"""
CREATE OR REPLACE FUNCTION fs_entry_changed_v1() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('{CHANNEL}', 'e' || OLD.parent || '/' || encode(OLD.name, 'hex'));
  RETURN NULL;
END $$;
CREATE OR REPLACE FUNCTION fs_inode_changed_v1() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('{CHANNEL}', 'i' || OLD.id);
  RETURN NULL;
END $$;
DO $$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'fs_entries_changed_v1') THEN
    CREATE TRIGGER fs_entries_changed_v1 AFTER UPDATE OR DELETE ON entries
      FOR EACH ROW EXECUTE FUNCTION fs_entry_changed_v1();
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'fs_inodes_changed_v1') THEN
    CREATE TRIGGER fs_inodes_changed_v1 AFTER UPDATE OR DELETE ON inodes
      FOR EACH ROW WHEN ((OLD.mode & {_S_IFMT}) <> {stat.S_IFDIR}) EXECUTE FUNCTION fs_inode_changed_v1();
  END IF;
END $$;
"""


class ChangeFeed:
    """See the module docstring."""

    def __init__(self, pool: PgPool, cache: LookupCache) -> None:
        self.pool = pool
        self.cache = cache
        self._answered_since = -math.inf  # when the last answered question was sent (trio clock)
        self._pg: Any = None  # the listening connection's libpq side
        self._asking = False  # a question is out: its task reads the socket
        self.connects = 0

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def fresh(self) -> bool:
        """Whether the cache holds every change committed more than MAX_LAG seconds ago, and
        every one whose notification has reached this node."""
        if trio.current_time() - self._answered_since >= MAX_LAG:
            return False
        self.drain()
        return trio.current_time() - self._answered_since < MAX_LAG

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        failures = 0
        while True:
            conn: Optional[psycopg.Connection] = None
            try:
                conn = await trio.to_thread.run_sync(self._listen, abandon_on_cancel=True)
                self.connects += 1
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
            # Told apart from the pool's connections in pg_stat_activity.
            conn.execute("SELECT set_config('application_name', current_setting('application_name') || ' changes',"
                         " false)")
            conn.execute(f"LISTEN {CHANNEL}")
            conn.pgconn.nonblocking = 1
        except BaseException:
            conn.close()
            raise
        return conn

    async def _follow(self, pg: Any) -> None:
        """Ask, take the notifications in until the answer, sleep; again, until the
        connection fails. While it sleeps, the socket is read by :meth:`drain`."""
        fd = pg.socket
        self._pg = pg
        while True:
            self._asking = True  # drain reads no socket now: the answer's wake-up is this task's
            sent = trio.current_time()
            pg.send_query(b"SELECT 1")
            while pg.flush():
                await trio.lowlevel.wait_writable(fd)
            with trio.fail_after(PING_TIMEOUT):
                while pg.is_busy():
                    await trio.lowlevel.wait_readable(fd)
                    pg.consume_input()
                    self._take(pg)
            while (result := pg.get_result()) is not None:
                if result.status != pq.ExecStatus.TUPLES_OK:
                    raise psycopg.OperationalError(result.error_message.decode(errors="replace"))
            self._take(pg)
            self._answered_since = sent
            self._asking = False
            await trio.sleep(PING_EVERY)

    def drain(self) -> None:
        """Apply the notifications that reached this node, before the cache answers: a
        wake-up per notification would cost CPU for every change, this node's own included."""
        pg = self._pg
        if pg is None:
            return
        if not self._asking:
            try:
                pg.consume_input()
            except psycopg.Error:
                self._answered_since = -math.inf  # the follower finds out at its next question
                return
        self._take(pg)

    def _take(self, pg: Any) -> None:
        own = self.pool.backend_pids
        names: list[Name] = []
        inodes: list[int] = []
        unknown = False
        while (note := pg.notifies()) is not None:
            if note.be_pid in own:
                continue
            kind, payload = note.extra[:1], note.extra[1:]
            try:
                if kind == b"i":
                    inodes.append(int(payload))
                elif kind == b"e":
                    parent, _, name = payload.partition(b"/")
                    names.append((int(parent), bytes.fromhex(name.decode())))
                else:
                    unknown = True
            except ValueError:
                unknown = True
        if unknown:  # a change this release cannot place (a newer node's): forget everything
            self.cache.clear()
        elif names or inodes:
            self.cache.changed_elsewhere(names, inodes)
