"""A mount's session on the shared database, and what goes when one ends.

Each mount is a row of ``sessions`` with a heartbeat; the files its node holds open are rows
of ``holds`` (``SessionHolds``). A clean unmount ends its own session (``end_session``); the
other nodes clean up one whose heartbeat stopped (``clean_session``), and a node that finds
its own cleaned up publishes nothing more (``SessionLost``, ``LOST_MESSAGE``).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Callable

from fusestate.errors import FsError
from fusestate.meta import operations as ops
from fusestate.meta.engine import Freed
from fusestate.meta.postgres import functions as server
from fusestate.meta.postgres.transaction import ADD_COUNTERS, ADVISORY_LOCK, NOW


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


class SessionHolds:
    """The files this node holds open, as rows of ``holds`` (see ``operations.Holds``)."""

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
        tx.exec(ADVISORY_LOCK, (server.INODE_FENCE, server.inode_key(ino)))
        row = tx.one("SELECT EXISTS (SELECT 1 FROM holds WHERE inode=?) OR fs_keep_orphan(?)", (ino, ino))
        return bool(row and row[0])


def clean_session(tx: ops.Tx, session: int) -> Freed:
    """A session ends (its unmount, or its clean-up by another node): what it held, claimed
    and made only for itself goes with it."""
    freed = Freed()
    held = [r[0] for r in tx.all("DELETE FROM holds WHERE session_id=? RETURNING inode", (session,))]
    end_uploads(tx, "session_id=?", (session,))
    # Deletions it claimed may or may not have happened: the blocks are unreferenced still,
    # and maybe gone from the bucket, so the next upload of their bytes must not skip the
    # PUT, and a commit of an upload that began before now must put them again.
    tx.exec(f"INSERT INTO collected (key, at) SELECT key, {NOW} FROM objects WHERE deleting=?"
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
    freed.keys += drop_nameless(tx, held).keys
    return freed


def drop_nameless(tx: ops.Tx, inodes: list[int]) -> Freed:
    """Delete those of these files that have no name left and that no node holds."""
    freed = Freed()
    for ino in sorted(inodes):
        tx.lock([ino])
        row = tx.one("SELECT nlink FROM inodes WHERE id=?", (ino,))
        if row is not None and row[0] == 0 and not tx.holds.held(tx, ino):
            freed.keys += ops.drop_orphans(tx, [ino]).keys
    return freed


def end_session(tx: ops.Tx, session: int) -> Freed:
    """A clean unmount: its own clean-up, outside the transactions that count their changes
    (``_txn``), so it counts its own."""
    freed = clean_session(tx, session)
    if tx.inodes_delta or tx.used_delta:
        tx.exec(ADD_COUNTERS, (tx.inodes_delta, tx.used_delta, session))
    return freed


def end_uploads(tx: ops.Tx, where: str, args: tuple) -> None:
    """Registered uploads whose commits will not come become unreferenced objects: the
    block may be in the bucket, and the collector deletes it once its grace has passed."""
    for key, size in tx.all(f"DELETE FROM uploads WHERE {where} RETURNING key, size", args):
        if tx.one("SELECT 1 FROM uploads WHERE key=?", (key,)) is None:
            # uploaded=0: the PUT may not have happened, so the next upload of these bytes
            # must not skip it.
            tx.exec("INSERT INTO objects (key, size, refcount, uploaded, unreferenced_since)"
                    " VALUES (?, ?, 0, 0, ?) ON CONFLICT DO NOTHING", (key, size, tx.now_ns / 1e9))
