"""The node's side of the shared engine's functions on the PostgreSQL server.

The functions themselves are SQL, in ``sql/functions.sql`` (installed and upgraded by
``schema``), which says what each does and why it runs on the server: a create, link,
unlink, file rename, open or block commit is one statement, one round trip. Here: the
statements that call them, and the numbers both sides share (written out in the SQL with
their names in a comment; ``tests/test_pg_schema.py`` checks that both agree).
"""

from __future__ import annotations

from fusestate.meta.operations import INODE_COLUMNS

COLLECTED_KEEP = 3600.0  # seconds a collected block's row is kept: uploads older than this are put again
COLLECTED_MARGIN = 3.0  # seconds added to an upload's age: the commit's trip to the server, scheduling
SESSION_FENCE = 0x66757368  # advisory lock class of the session fence: (SESSION_FENCE, session key)
LANE_FENCE = 0x66757369  # advisory lock class of a session's lanes: (LANE_FENCE, lane key)
# Advisory lock class of a file's last holder and its last name: (INODE_FENCE, inode key). A
# close takes it before it drops its hold and then looks at the link count; whatever drops
# the last name takes it before it looks at the holds. One of the two sees what the other
# did, and deletes the file: no row lock, so no WAL record, for the close of a named file.
INODE_FENCE = 0x6675736a
LANES_PER_SESSION = 4096  # lane numbers a session key is spread over (more lanes share keys: a wait, no harm)
LOST_SQLSTATE = "FSLST"  # this session was cleaned up by the other nodes
RUN_GENERAL_SQLSTATE = "FSRUN"  # a server-side operation's answer: run operations.py's instead


def inode_key(ino: int) -> int:
    """The second key of an inode's advisory lock (``INODE_FENCE``)."""
    return ino % 2147483647


def lane_key(session: int, lane: int) -> int:
    """The second key of a lane's advisory lock, as the server computes it (``fs_lane_begin``)."""
    return (session * LANES_PER_SESSION + lane) % 2147483647


# The calls, with the columns of the rows they return.
CREATE = (f"SELECT {INODE_COLUMNS} FROM fs_create(?::bigint, ?::int, ?::bigint, ?::boolean, ?::bigint, ?::bytea,"
          " ?::int, ?::bigint, ?::bigint, ?::bigint, ?::bytea, ?::boolean, ?::boolean, ?::bigint)")
_NODE_COLUMNS = ", ".join(f"(node).{c}" for c in INODE_COLUMNS.split(", "))
OPEN = f"SELECT {_NODE_COLUMNS}, idx, keys, data FROM fs_open(?::bigint, ?::bigint)"
RENAME = (f"SELECT {_NODE_COLUMNS}, role, freed, deleted, inodes_delta, used_delta FROM fs_rename(?::bigint,"
          " ?::int, ?::bigint, ?::boolean, ?::bigint, ?::bytea, ?::bigint, ?::bytea, ?::bigint, ?::float8)")
LINK = (f"SELECT {INODE_COLUMNS} FROM fs_link(?::bigint, ?::int, ?::bigint, ?::boolean, ?::bigint, ?::bigint,"
        " ?::bytea, ?::bigint)")
UNLINK = (f"SELECT {_NODE_COLUMNS}, freed, deleted, inodes_delta, used_delta"
          " FROM fs_unlink(?::bigint, ?::int, ?::bigint, ?::boolean, ?::bigint, ?::bytea, ?::bigint, ?::float8)")
COMMIT = (f"SELECT {_NODE_COLUMNS}, freed, used_delta"
          " FROM fs_commit(?::bigint, ?::bigint, ?::bigint[], ?::text[], ?::bigint[], ?::bigint, ?::bigint,"
          " ?::float8, ?::boolean, ?::boolean, ?::float8, ?::bytea[])")
# The session fence and the commit mode of a namespace change, at once (the start of an
# operation run as statements of operations.py).
SESSION_CHECK = "SELECT fs_session(?::bigint, false)"
