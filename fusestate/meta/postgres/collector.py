"""The shared engine's part of the block ledger and of garbage collection.

A node registers no upload: its commit of a block finds out whether the collector deleted
those bytes meanwhile (``functions.sql``, "Blocks collected during their upload"). The
collector claims unreferenced blocks (``objects.deleting``), deletes them from the bucket,
and records them in ``collected``; blocks in the bucket the database knows nothing of are
claimed the same way (``sweep_unknown``). ``ObjectLedger`` is a part of ``PostgresEngine``.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

from fusestate.meta import operations as ops
from fusestate.meta.engine import ObjectInfo
from fusestate.meta.postgres import functions as server
from fusestate.meta.postgres.pool import PgPool
from fusestate.meta.postgres.sessions import SessionLost
from fusestate.meta.postgres.transaction import NOW

# Keys the database has no row and no upload registration (of an earlier release) for.
UNKNOWN = ("SELECT k FROM unnest(%s::text[]) AS k WHERE NOT EXISTS (SELECT 1 FROM objects WHERE key=k)"
           " AND NOT EXISTS (SELECT 1 FROM uploads WHERE key=k)")


class ObjectLedger:
    """The objects' rows: uploads, the collector's claims and deletions (a part of ``PostgresEngine``)."""

    pool: PgPool
    session_id: int
    lost: bool
    _read: Callable[..., Awaitable[Any]]
    _write: Callable[..., Awaitable[Any]]

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
                        f" INSERT INTO collected (key, at) SELECT key, {NOW} FROM gone"
                        f" ON CONFLICT (key) DO UPDATE SET at = excluded.at", (keys, self.session_id))
            cur.execute(f"DELETE FROM collected WHERE at < {NOW} - %s", (server.COLLECTED_KEEP,))

        if keys:
            await self.pool.run(forget)

    async def unknown(self, keys: list[str]) -> list[str]:
        """The keys the database has no row and no upload registered for."""
        def find(cur: Any) -> list[str]:
            cur.execute(UNKNOWN, (keys,))
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
            cur.execute(UNKNOWN, (keys,))
            unknown = [r[0] for r in cur.fetchall()]
            for key in unknown:
                cur.execute(f"INSERT INTO objects (key, size, refcount, uploaded, deleting, unreferenced_since)"
                            f" VALUES (%s, 0, 0, 1, %s, {NOW})", (key, self.session_id))
            return unknown

        return await self.pool.run(claim) if keys else []
