-- The PostgreSQL store of a shared volume: its tables, as a new database gets them.
--
-- Applied by fusestate/meta/postgres/schema.py to an empty database, then functions.sql
-- and change_feed.sql; psql -f runs the three as they are. A database made by an earlier
-- version is brought here by the steps in upgrade/, in order, instead: a change here is
-- one of those steps too, and the version below its number.

-- One row: the version of this whole store (tables, functions, triggers).
CREATE TABLE schema_version (
    one INTEGER PRIMARY KEY DEFAULT 1 CHECK (one = 1), version INTEGER NOT NULL
);
INSERT INTO schema_version (version) VALUES (2);

CREATE TABLE inodes (
    id BIGSERIAL PRIMARY KEY,
    mode INTEGER NOT NULL, uid BIGINT NOT NULL, gid BIGINT NOT NULL,
    size BIGINT NOT NULL DEFAULT 0, nlink INTEGER NOT NULL DEFAULT 0,
    atime_ns BIGINT NOT NULL, mtime_ns BIGINT NOT NULL, ctime_ns BIGINT NOT NULL,
    rdev BIGINT NOT NULL DEFAULT 0, symlink_target BYTEA,
    scratch BIGINT NOT NULL DEFAULT 0  -- 0, or the session whose node-local file it is (--scratch)
);
CREATE INDEX inodes_scratch ON inodes (scratch) WHERE scratch <> 0;

CREATE TABLE entries (
    id BIGSERIAL PRIMARY KEY,
    parent BIGINT NOT NULL, name BYTEA NOT NULL, inode BIGINT NOT NULL,
    UNIQUE (parent, name)
);
CREATE INDEX entries_by_inode ON entries (inode);
-- A listing's pages in entry order, each read on its own (not the whole directory sorted).
CREATE INDEX entries_listing ON entries (parent, id);

CREATE TABLE blocks (
    inode BIGINT NOT NULL, idx BIGINT NOT NULL, key TEXT NOT NULL, size BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (inode, idx)
);

-- data: the bytes of an inline block (functions.sql, "Inline blocks"), kept in the row, one
-- heap record per write: up to a page is left as it is (past the default 2 kB the toaster
-- would move the key out to the TOAST table, two more WAL records per inline block).
CREATE TABLE objects (
    key TEXT PRIMARY KEY, size BIGINT NOT NULL, refcount BIGINT NOT NULL,
    uploaded INTEGER NOT NULL DEFAULT 1, unreferenced_since DOUBLE PRECISION, unreferenced_seq BIGINT,
    deleting BIGINT NOT NULL DEFAULT 0,  -- the session deleting it from the bucket, 0 if none
    data BYTEA
) WITH (toast_tuple_target = 8160);
ALTER TABLE objects ALTER COLUMN data SET STORAGE MAIN;

CREATE TABLE sessions (
    id BIGSERIAL PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL, mountpoint TEXT NOT NULL,
    started DOUBLE PRECISION NOT NULL, heartbeat DOUBLE PRECISION NOT NULL,
    timeout DOUBLE PRECISION NOT NULL DEFAULT 30  -- its own --session-timeout: others clean it up after that
);

-- Keyed by inode first: "does any node hold it" and "does this node" are both one index
-- lookup, and a hold costs one index entry. UNLOGGED: a hold is written and deleted for
-- every file a node opens, and no WAL record for either; a crash or a failover of the
-- server empties the table, and so holds_kept, which tells the nodes to register their
-- holds again (see PostgresEngine.heartbeat and fs_holds_trusted).
CREATE UNLOGGED TABLE holds (
    session_id BIGINT NOT NULL, inode BIGINT NOT NULL, PRIMARY KEY (inode, session_id)
);
-- One row, emptied with holds: since when (the database's clock) holds has been filled again.
CREATE UNLOGGED TABLE holds_kept (
    one INTEGER PRIMARY KEY DEFAULT 1 CHECK (one = 1), since DOUBLE PRECISION NOT NULL
);
-- Files with no name left that were kept while the holds could not be trusted: the sweep's.
CREATE TABLE orphans_kept (inode BIGINT PRIMARY KEY);

-- Upload registrations of releases before the commit checked for collected blocks: read
-- and ended, never written.
CREATE TABLE uploads (
    session_id BIGINT NOT NULL, key TEXT NOT NULL, size BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, key)
);
CREATE INDEX uploads_by_key ON uploads (key);

-- Blocks deleted from the bucket (or maybe deleted) in the last hour (COLLECTED_KEEP): a
-- commit of one whose upload began before that is refused, and the node puts it again
-- (functions.sql).
CREATE TABLE collected (
    key TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL
);

-- Per session and lane (PostgresEngine's _Attempts): the counts of inodes and bytes its
-- transactions added, and the number (op) of the lane's last operation, with what it made.
-- Session 0 holds what no session made: the root directory.
CREATE TABLE counters (
    session_id BIGINT NOT NULL, inodes BIGINT NOT NULL DEFAULT 0, used BIGINT NOT NULL DEFAULT 0,
    lane INTEGER NOT NULL DEFAULT 0, op BIGINT NOT NULL DEFAULT 0, made BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, lane)
);

-- The root directory, inode 1; the sequence hands out 2 next.
INSERT INTO inodes (id, mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns)
SELECT 1, 16877, 0, 0, 0, 2, t, t, t  -- mode: S_IFDIR | 0o755
  FROM (SELECT (extract(epoch from clock_timestamp()) * 1e9)::bigint AS t) now;
SELECT setval(pg_get_serial_sequence('inodes', 'id'), 1);
INSERT INTO counters (session_id, inodes) VALUES (0, 1);
