"""What ``fusestate fsck`` checks of a shared volume's tables."""

from __future__ import annotations

from fusestate.blocks.keys import INLINE_PREFIX, key_matches
from fusestate.meta import operations as ops


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
