-- Version 1 to 2: the store gets a version; the server functions and triggers lose their
-- _vN suffixes.
--
-- Version 1 is every database made before versions were recorded: no schema_version
-- table. Each of its releases brought the tables up to date when it opened the database,
-- so a volume last opened by an old one may lack what later ones added: added here, as
-- they did it. Then every function and trigger named with a _vN suffix goes; functions.sql
-- and change_feed.sql, applied after the last step, make the current ones.
--
-- By hand: psql -v ON_ERROR_STOP=1 --single-transaction -f upgrade/0002.sql
--   -f functions.sql -f change_feed.sql (with every node unmounted: the functions their
--   release calls are gone after this).

CREATE TABLE schema_version (
    one INTEGER PRIMARY KEY DEFAULT 1 CHECK (one = 1), version INTEGER NOT NULL
);
INSERT INTO schema_version (version) VALUES (2);

-- What releases before version 1's last added, each as it did it.
ALTER TABLE sessions ADD COLUMN IF NOT EXISTS timeout DOUBLE PRECISION NOT NULL DEFAULT 30;
CREATE INDEX IF NOT EXISTS entries_listing ON entries (parent, id);
CREATE INDEX IF NOT EXISTS inodes_scratch ON inodes (scratch) WHERE scratch <> 0;
CREATE UNLOGGED TABLE IF NOT EXISTS holds_kept (
    one INTEGER PRIMARY KEY DEFAULT 1 CHECK (one = 1), since DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS orphans_kept (inode BIGINT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS collected (key TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL);
ALTER TABLE objects ADD COLUMN IF NOT EXISTS deleting BIGINT NOT NULL DEFAULT 0;
DO $$ BEGIN
  IF (SELECT relpersistence FROM pg_class WHERE oid = 'holds'::regclass) = 'p' THEN
    ALTER TABLE holds SET UNLOGGED;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'objects'::regclass AND attname = 'data') THEN
    ALTER TABLE objects ADD COLUMN data BYTEA;
    ALTER TABLE objects ALTER COLUMN data SET STORAGE MAIN;
    ALTER TABLE objects SET (toast_tuple_target = 8160);
  END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'counters'::regclass AND attname = 'lane') THEN
    ALTER TABLE counters ADD COLUMN lane INTEGER NOT NULL DEFAULT 0, ADD COLUMN op BIGINT NOT NULL DEFAULT 0,
      ADD COLUMN made BIGINT NOT NULL DEFAULT 0, DROP CONSTRAINT counters_pkey, ADD PRIMARY KEY (session_id, lane);
  END IF;
END $$;
-- Superseded by holds' own key (inode, session_id).
DROP INDEX IF EXISTS holds_by_inode;

-- The triggers first (their functions depend on them), then every suffixed function.
DROP TRIGGER IF EXISTS fs_entries_changed_v1 ON entries;
DROP TRIGGER IF EXISTS fs_inodes_changed_v1 ON inodes;
DROP TRIGGER IF EXISTS fs_entries_changed_v2 ON entries;
DROP TRIGGER IF EXISTS fs_inodes_changed_v2 ON inodes;
DO $$
DECLARE
  f regprocedure;
BEGIN
  FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
            WHERE p.pronamespace = current_schema()::regnamespace AND p.proname ~ '^fs_[a-z_]+_v[0-9]+$' LOOP
    EXECUTE 'DROP FUNCTION ' || f;
  END LOOP;
END $$;
