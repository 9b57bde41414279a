-- The shared engine's hot operations, as functions on the PostgreSQL server.
--
-- Applied by fusestate/meta/postgres/schema.py to a new database and after every upgrade
-- (CREATE OR REPLACE: running it again changes nothing); psql -f runs it as it is.
-- A change here is a new schema version (sql/upgrade/): a database keeps the functions of
-- the version it was last upgraded to.
--
-- A create or a block commit written as statements of operations.py costs three round
-- trips to the server and a transaction with its own BEGIN, session check and COMMIT. As
-- one function call it is one statement: one round trip, one implicit transaction, its
-- plans prepared once per connection by PL/pgSQL. The semantics are those of
-- operations.py (the reference, which the SQLite engine runs and the engine contract
-- suite judges both against); where this file differs in how, it says why.
--
-- Numbers the node's code shares are written out with their Python name in a comment
-- (1718973288 /* SESSION_FENCE */, in fusestate/meta/postgres/functions.py);
-- tests/test_pg_schema.py checks that both say the same.
--
-- * Errors. A POSIX error is raised as SQLSTATE FS + its three-digit errno (FS017:
--   EEXIST): the whole call rolls back, and the pool turns it into that errno
--   (pool.RefusedByServer) without a second round trip. FSLST: this session was cleaned
--   up by the other nodes. FSRUN: run operations.py's version of the operation instead.
-- * Fencing. A call takes a shared advisory lock on its session's key, then checks that
--   the session row is still there; the clean-up of a session takes that lock exclusively
--   before it deletes the row (SESSION_FENCE). Either the call commits first, or it waits
--   and then finds no row. Unlike SELECT ... FOR KEY SHARE this writes no WAL.
-- * Unknown outcomes. A create holds one of its session's lanes (PostgresEngine's
--   _Attempts) for all its attempts: it takes the lane's advisory lock first (LANE_FENCE)
--   and records its number (op) and its inode (made) in the lane's row of counters, which
--   it updates anyway. A retry after a connection that broke with the call in flight
--   (p_retry) takes the same lock, so it waits for an attempt the server is still
--   running, then finds the number if that attempt committed, and returns its inode
--   instead of making another (or EEXIST).
-- * Locks. A single-inode operation locks the row with the UPDATE that changes it, and
--   diagnoses ENOENT or ENOTDIR only when the UPDATE found nothing.
-- * Commit mode. Namespace changes commit without waiting for the WAL flush (as every
--   engine transaction does, see PostgresEngine.sync).
-- * Blocks collected during their upload. A node does not register its uploads (a
--   durable transaction per block): the commit finds out instead. A block the collector
--   has claimed (objects.deleting) is refused, and so is one whose deletion from the
--   bucket may have happened since the upload began (a row in collected, written by
--   garbage_deleted and by the clean-up of a collector's session, younger than the upload
--   plus COLLECTED_MARGIN): SQLSTATE FS011 (EAGAIN), and the node puts the bytes again
--   and commits again. The upload's age is measured on the node, the deletion's time on
--   the database's clock: no two clocks are compared.
-- * Inline blocks. A small file's only block (--inline-max) is kept in its row of
--   objects (column data, stored in the row: STORAGE MAIN), named by its hash behind
--   INLINE_PREFIX: its close is one call and no PUT, and an open on another node gets the
--   bytes with the block map. The row is counted, shared and collected as any block's
--   (the collector deletes no object for it).

-- Releases before schema versions (version 1) install their functions at every mount, and
-- would put them beside these. This one has the name and arguments of the first they make,
-- with another return type: their install fails (cannot change return type of existing
-- function), and so does their mount, before anything of theirs is written.
CREATE OR REPLACE FUNCTION fs_session_v1(p_session bigint, p_durable boolean) RETURNS text
LANGUAGE sql AS $$ SELECT 'this volume''s metadata is of a newer schema version: upgrade fusestate'::text $$;

-- The start of every call: the session's fence (p_session 0: no session yet, as fsck's),
-- and the commit mode of a namespace change.
CREATE OR REPLACE FUNCTION fs_session(p_session bigint, p_durable boolean) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  IF p_session <> 0 THEN
    PERFORM pg_advisory_xact_lock_shared(1718973288 /* SESSION_FENCE */, (p_session % 2147483647)::int);
    IF NOT EXISTS (SELECT 1 FROM sessions WHERE id = p_session) THEN
      RAISE EXCEPTION 'metadata session % is gone', p_session USING ERRCODE = 'FSLST' /* LOST_SQLSTATE */;
    END IF;
  END IF;
  IF NOT p_durable THEN
    PERFORM set_config('synchronous_commit', 'off', true);
  END IF;
END $$;

-- operations.create: two rows back, the new inode, then its parent as changed (just the
-- inode if the parent is gone: a retry that finds its create done, see Unknown outcomes above).
-- p_lane, p_op: the session's lane this call holds, and the operation's number, recorded
-- with the lane's counters; p_retry: an earlier attempt may have committed.
CREATE OR REPLACE FUNCTION fs_create(p_session bigint, p_lane int, p_op bigint, p_retry boolean,
    p_parent bigint, p_name bytea, p_mode int, p_uid bigint, p_gid bigint, p_rdev bigint, p_target bytea,
    p_scratch_name boolean, p_hold boolean, p_now bigint)
RETURNS SETOF inodes
LANGUAGE plpgsql AS $$
DECLARE
  par inodes;
  node inodes;
  v_isdir boolean := (p_mode & 61440) = 16384;
  v_mode int := p_mode;
  v_gid bigint := p_gid;
  v_made bigint;
BEGIN
  PERFORM fs_session(p_session, false);
  PERFORM pg_advisory_xact_lock(1718973289 /* LANE_FENCE */, ((p_session * 4096 /* LANES_PER_SESSION */ + p_lane) % 2147483647)::int);
  IF p_retry THEN
    SELECT made INTO v_made FROM counters WHERE session_id = p_session AND lane = p_lane AND op = p_op;
    IF FOUND THEN  -- done by an earlier attempt: its file, as it is now
      SELECT * INTO node FROM inodes WHERE id = v_made;
      IF NOT FOUND THEN  -- removed since by another node: as it was made, without a name
        node.id := v_made; node.mode := p_mode; node.uid := p_uid; node.gid := p_gid;
        node.size := coalesce(length(p_target), 0); node.nlink := 0; node.atime_ns := p_now;
        node.mtime_ns := p_now; node.ctime_ns := p_now; node.rdev := p_rdev; node.symlink_target := p_target;
        node.scratch := 0;
      END IF;
      RETURN NEXT node;
      RETURN QUERY SELECT * FROM inodes WHERE id = p_parent;
      RETURN;
    END IF;
  END IF;
  UPDATE inodes SET nlink = nlink + v_isdir::int, mtime_ns = p_now, ctime_ns = p_now
   WHERE id = p_parent AND (mode & 61440) = 16384 AND nlink > 0 AND (scratch = 0 OR scratch = p_session)
   RETURNING * INTO par;
  IF NOT FOUND THEN
    SELECT * INTO par FROM inodes WHERE id = p_parent;
    IF NOT FOUND OR ((par.mode & 61440) = 16384 AND par.nlink = 0) THEN
      RAISE EXCEPTION 'no such directory' USING ERRCODE = 'FS002';
    ELSIF (par.mode & 61440) <> 16384 THEN
      RAISE EXCEPTION 'not a directory' USING ERRCODE = 'FS020';
    ELSIF EXISTS (SELECT 1 FROM entries WHERE parent = p_parent AND name = p_name) THEN
      RAISE EXCEPTION 'file exists' USING ERRCODE = 'FS017';
    ELSIF par.scratch <> 0 AND par.scratch <> p_session THEN
      RAISE EXCEPTION 'a scratch directory of another node' USING ERRCODE = 'FS005';
    END IF;
    RAISE EXCEPTION 'directory % changed under the create', p_parent USING ERRCODE = '40001';
  END IF;
  -- Asked after the lock, with a snapshot of its own: a name made before it is seen.
  IF EXISTS (SELECT 1 FROM entries WHERE parent = p_parent AND name = p_name) THEN
    RAISE EXCEPTION 'file exists' USING ERRCODE = 'FS017';
  END IF;
  IF (par.mode & 1024) <> 0 THEN  -- S_ISGID: the group, and for a directory the bit, come from the parent
    v_gid := par.gid;
    IF v_isdir THEN v_mode := v_mode | 1024; END IF;
  END IF;
  INSERT INTO inodes (mode, uid, gid, size, nlink, atime_ns, mtime_ns, ctime_ns, rdev, symlink_target, scratch)
  VALUES (v_mode, p_uid, v_gid, coalesce(length(p_target), 0), 1 + v_isdir::int, p_now, p_now, p_now, p_rdev,
          p_target, CASE WHEN par.scratch <> 0 THEN par.scratch WHEN v_isdir AND p_scratch_name THEN p_session
                         ELSE 0 END)
  RETURNING * INTO node;
  INSERT INTO entries (parent, name, inode) VALUES (p_parent, p_name, node.id);
  IF p_hold THEN
    INSERT INTO holds (session_id, inode) VALUES (p_session, node.id);
  END IF;
  UPDATE counters SET inodes = inodes + 1, op = p_op, made = node.id WHERE session_id = p_session AND lane = p_lane;
  RETURN NEXT node;
  RETURN NEXT par;
END $$;

-- Whether the holds can be trusted: holds is UNLOGGED, emptied with holds_kept when the
-- server crashes or a standby takes over, and every live session registers its holds again
-- at its next heartbeat (PostgresEngine.heartbeat), which it records after doing so.
-- PL/pgSQL, not SQL: a SQL function called from another function is planned on every call
-- (about 80 us of the server's CPU per unlink), a PL/pgSQL one once per connection.
CREATE OR REPLACE FUNCTION fs_holds_trusted() RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
  RETURN EXISTS (SELECT 1 FROM holds_kept k WHERE NOT EXISTS (SELECT 1 FROM sessions s WHERE s.heartbeat < k.since));
END $$;

-- A file whose last name went and that no hold keeps: false, it goes now; or true while the
-- holds cannot be trusted: it is kept, and recorded for the sweep (PostgresEngine.sweep).
CREATE OR REPLACE FUNCTION fs_keep_orphan(p_ino bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
  IF fs_holds_trusted() THEN
    RETURN false;
  END IF;
  INSERT INTO orphans_kept (inode) VALUES (p_ino) ON CONFLICT DO NOTHING;
  RETURN true;
END $$;

-- operations._count_references for the references a change drops: the keys whose last
-- reference went (the collector's, once unreferenced for --gc-grace), and the change of
-- the bytes in use.
CREATE OR REPLACE FUNCTION fs_drop_refs(p_keys text[], p_now double precision)
RETURNS TABLE (freed text[], used_delta bigint)
LANGUAGE plpgsql AS $$
DECLARE
  v_rc bigint;
  v_bytes bigint;
  v_used bigint := 0;
  v_freed text[] := '{}';
  i int;
BEGIN
  FOR i IN 1 .. coalesce(array_length(p_keys, 1), 0) LOOP
    UPDATE objects SET refcount = refcount - 1,
           unreferenced_since = CASE WHEN refcount <= 1 THEN p_now ELSE unreferenced_since END,
           unreferenced_seq = CASE WHEN refcount <= 1 THEN 0 ELSE unreferenced_seq END
     WHERE key = p_keys[i] RETURNING refcount, size INTO v_rc, v_bytes;
    CONTINUE WHEN NOT FOUND;
    IF v_rc = 0 THEN v_used := v_used - v_bytes; END IF;
    IF v_rc <= 0 THEN v_freed := v_freed || p_keys[i]; END IF;
  END LOOP;
  RETURN QUERY SELECT v_freed, v_used;
END $$;

-- operations._drop_if_unused for a file whose last name just went (its row locked): under
-- its fence, deleted with its blocks unless a node holds it or the holds cannot be trusted.
CREATE OR REPLACE FUNCTION fs_drop_unheld(p_ino bigint, p_now_s double precision)
RETURNS TABLE (freed text[], used_delta bigint, deleted boolean)
LANGUAGE plpgsql AS $$
DECLARE
  v_keys text[];
BEGIN
  PERFORM pg_advisory_xact_lock(1718973290 /* INODE_FENCE */, (p_ino % 2147483647)::int);
  IF EXISTS (SELECT 1 FROM holds WHERE inode = p_ino) OR fs_keep_orphan(p_ino) THEN
    RETURN QUERY SELECT '{}'::text[], 0::bigint, false;
    RETURN;
  END IF;
  DELETE FROM inodes WHERE id = p_ino;
  WITH gone AS (DELETE FROM blocks WHERE inode = p_ino RETURNING key) SELECT array_agg(key) INTO v_keys FROM gone;
  RETURN QUERY SELECT d.freed, d.used_delta, true FROM fs_drop_refs(v_keys, p_now_s) d;
END $$;

-- The start of an operation that holds a lane (unlink, rename): the session's fence, the
-- lane's lock (waiting for an earlier attempt the server still runs), and on a retry the
-- inode the lane's row recorded if an earlier attempt committed (NULL: run the operation).
CREATE OR REPLACE FUNCTION fs_lane_begin(p_session bigint, p_lane int, p_op bigint, p_retry boolean)
RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
  v_made bigint;
BEGIN
  PERFORM fs_session(p_session, false);
  PERFORM pg_advisory_xact_lock(1718973289 /* LANE_FENCE */, ((p_session * 4096 /* LANES_PER_SESSION */ + p_lane) % 2147483647)::int);
  IF p_retry THEN
    SELECT made INTO v_made FROM counters WHERE session_id = p_session AND lane = p_lane AND op = p_op;
  END IF;
  RETURN v_made;
END $$;

-- operations.unlink: two rows back, the file as changed (nlink 0 and deleted: its inode
-- and blocks are gone, no node holding it open), then its directory. p_lane, p_op,
-- p_retry as fs_create's; the lane's row records the file's inode (made), so a retry
-- that finds the unlink done returns the file as it is now (deleted, if it is gone).
CREATE OR REPLACE FUNCTION fs_unlink(p_session bigint, p_lane int, p_op bigint, p_retry boolean,
    p_parent bigint, p_name bytea, p_now bigint, p_now_s double precision)
RETURNS TABLE (node inodes, freed text[], deleted boolean, inodes_delta int, used_delta bigint)
LANGUAGE plpgsql AS $$
DECLARE
  par inodes;
  child inodes;
  v_child bigint;
  v_again bigint;
  v_freed text[] := '{}';
  v_used bigint := 0;
  v_deleted boolean := false;
BEGIN
  v_child := fs_lane_begin(p_session, p_lane, p_op, p_retry);
  IF v_child IS NOT NULL THEN  -- done by an earlier attempt
    SELECT * INTO child FROM inodes WHERE id = v_child;
    v_deleted := NOT FOUND;
    child.id := v_child;
    RETURN QUERY SELECT child, '{}'::text[], v_deleted, 0, 0::bigint;
    RETURN QUERY SELECT i, NULL::text[], false, 0, 0::bigint FROM inodes i WHERE i.id = p_parent;
    RETURN;
  END IF;
  LOOP  -- the name, then both rows locked in inode order, then the name again
    SELECT inode INTO v_child FROM entries WHERE parent = p_parent AND name = p_name;
    IF v_child IS NULL THEN
      SELECT * INTO par FROM inodes WHERE id = p_parent;
      IF FOUND AND (par.mode & 61440) <> 16384 THEN
        RAISE EXCEPTION 'not a directory' USING ERRCODE = 'FS020';
      END IF;
      RAISE EXCEPTION 'no such file' USING ERRCODE = 'FS002';
    END IF;
    PERFORM 1 FROM inodes WHERE id IN (p_parent, v_child) ORDER BY id FOR UPDATE;
    SELECT inode INTO v_again FROM entries WHERE parent = p_parent AND name = p_name;
    EXIT WHEN v_again = v_child;
  END LOOP;
  SELECT * INTO child FROM inodes WHERE id = v_child;
  IF (child.mode & 61440) = 16384 THEN
    RAISE EXCEPTION 'is a directory' USING ERRCODE = 'FS021';
  END IF;
  DELETE FROM entries WHERE parent = p_parent AND name = p_name;
  UPDATE inodes SET nlink = nlink - 1, ctime_ns = p_now WHERE id = v_child RETURNING * INTO child;
  UPDATE inodes SET mtime_ns = p_now, ctime_ns = p_now WHERE id = p_parent RETURNING * INTO par;
  IF child.nlink <= 0 THEN
    SELECT d.freed, d.used_delta, d.deleted INTO v_freed, v_used, v_deleted FROM fs_drop_unheld(v_child, p_now_s) d;
  END IF;
  UPDATE counters SET inodes = inodes - v_deleted::int, used = used + v_used, op = p_op, made = v_child
   WHERE session_id = p_session AND lane = p_lane;
  RETURN QUERY SELECT child, v_freed, v_deleted, -v_deleted::int, v_used;
  RETURN QUERY SELECT par, NULL::text[], false, 0, 0::bigint;
END $$;

-- operations.link: two rows back, the file as changed, then its new directory. p_lane,
-- p_op, p_retry as fs_unlink's; the lane's row records the file's inode (made), so a
-- retry that finds the link done returns both rows as they are now (the name made once,
-- even if another node removed it meanwhile).
CREATE OR REPLACE FUNCTION fs_link(p_session bigint, p_lane int, p_op bigint, p_retry boolean,
    p_ino bigint, p_parent bigint, p_name bytea, p_now bigint)
RETURNS SETOF inodes
LANGUAGE plpgsql AS $$
DECLARE
  par inodes;
  node inodes;
BEGIN
  IF fs_lane_begin(p_session, p_lane, p_op, p_retry) IS NOT NULL THEN  -- done by an earlier attempt
    RETURN QUERY SELECT * FROM inodes WHERE id = p_ino;
    RETURN QUERY SELECT * FROM inodes WHERE id = p_parent;
    RETURN;
  END IF;
  PERFORM 1 FROM inodes WHERE id IN (p_ino, p_parent) ORDER BY id FOR UPDATE;
  SELECT * INTO node FROM inodes WHERE id = p_ino;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no such file' USING ERRCODE = 'FS002';
  ELSIF (node.mode & 61440) = 16384 THEN
    RAISE EXCEPTION 'a directory cannot be linked' USING ERRCODE = 'FS001';
  ELSIF node.nlink = 0 THEN
    RAISE EXCEPTION 'no such file' USING ERRCODE = 'FS002';
  END IF;
  SELECT * INTO par FROM inodes WHERE id = p_parent;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no such directory' USING ERRCODE = 'FS002';
  ELSIF (par.mode & 61440) <> 16384 THEN
    RAISE EXCEPTION 'not a directory' USING ERRCODE = 'FS020';
  ELSIF par.nlink = 0 THEN
    RAISE EXCEPTION 'no such directory' USING ERRCODE = 'FS002';
  END IF;
  -- operations._check_scratch_move, for a file: its own scratch, or a file of the volume
  -- named in this node's scratch dir.
  IF node.scratch <> par.scratch AND NOT (node.scratch = 0 AND par.scratch = p_session) THEN
    RAISE EXCEPTION 'scratch and the rest of the volume are separate' USING ERRCODE = 'FS018';
  END IF;
  IF EXISTS (SELECT 1 FROM entries WHERE parent = p_parent AND name = p_name) THEN
    RAISE EXCEPTION 'file exists' USING ERRCODE = 'FS017';
  END IF;
  INSERT INTO entries (parent, name, inode) VALUES (p_parent, p_name, p_ino);
  UPDATE inodes SET nlink = nlink + 1, ctime_ns = p_now WHERE id = p_ino RETURNING * INTO node;
  UPDATE inodes SET mtime_ns = p_now, ctime_ns = p_now WHERE id = p_parent RETURNING * INTO par;
  UPDATE counters SET op = p_op, made = p_ino WHERE session_id = p_session AND lane = p_lane;
  RETURN NEXT node;
  RETURN NEXT par;
END $$;

-- operations.rename without flags, of a file that is not a directory (the rename of a
-- commit: a new file over an old name); anything else answers FSRUN, and the node runs
-- operations.rename instead. Rows back: the file, the file it replaced (with freed,
-- deleted as unlink's) if any, then the directories. p_lane, p_op, p_retry as unlink's;
-- the lane's row records the replaced file's inode (made; 0 if none).
CREATE OR REPLACE FUNCTION fs_rename(p_session bigint, p_lane int, p_op bigint, p_retry boolean,
    p_src_parent bigint, p_src_name bytea, p_dst_parent bigint, p_dst_name bytea, p_now bigint,
    p_now_s double precision)
RETURNS TABLE (node inodes, role int, freed text[], deleted boolean, inodes_delta int, used_delta bigint)
LANGUAGE plpgsql AS $$
DECLARE
  src inodes;
  dst inodes;
  child inodes;
  old inodes;
  v_ino bigint;
  v_target bigint;
  v_again bigint;
  v_again_target bigint;
  v_freed text[] := '{}';
  v_used bigint := 0;
  v_deleted boolean := false;
BEGIN
  IF fs_lane_begin(p_session, p_lane, p_op, p_retry) IS NOT NULL THEN
    -- done by an earlier attempt: the directories as they are now
    RETURN QUERY SELECT i, 2, '{}'::text[], false, 0, 0::bigint FROM inodes i
                  WHERE i.id IN (p_src_parent, p_dst_parent);
    RETURN;
  END IF;
  LOOP  -- both names, then every row locked in inode order, then both names again
    SELECT inode INTO v_ino FROM entries WHERE parent = p_src_parent AND name = p_src_name;
    SELECT inode INTO v_target FROM entries WHERE parent = p_dst_parent AND name = p_dst_name;
    IF v_ino IS NULL THEN
      IF EXISTS (SELECT 1 FROM inodes WHERE id IN (p_src_parent, p_dst_parent) AND (mode & 61440) <> 16384) THEN
        RAISE EXCEPTION 'not a directory' USING ERRCODE = 'FS020';
      END IF;
      RAISE EXCEPTION 'no such file' USING ERRCODE = 'FS002';
    END IF;
    PERFORM 1 FROM inodes WHERE id IN (p_src_parent, p_dst_parent, v_ino, v_target) ORDER BY id FOR UPDATE;
    SELECT inode INTO v_again FROM entries WHERE parent = p_src_parent AND name = p_src_name;
    SELECT inode INTO v_again_target FROM entries WHERE parent = p_dst_parent AND name = p_dst_name;
    EXIT WHEN v_again = v_ino AND v_again_target IS NOT DISTINCT FROM v_target;
  END LOOP;
  SELECT * INTO src FROM inodes WHERE id = p_src_parent;
  SELECT * INTO dst FROM inodes WHERE id = p_dst_parent;
  SELECT * INTO child FROM inodes WHERE id = v_ino;
  IF dst.id IS NULL THEN
    RAISE EXCEPTION 'no such directory' USING ERRCODE = 'FS002';
  ELSIF (src.mode & 61440) <> 16384 OR (dst.mode & 61440) <> 16384 THEN
    RAISE EXCEPTION 'not a directory' USING ERRCODE = 'FS020';
  ELSIF dst.nlink = 0 THEN
    RAISE EXCEPTION 'no such directory' USING ERRCODE = 'FS002';
  END IF;
  IF (child.mode & 61440) = 16384 THEN
    RAISE EXCEPTION 'a directory: the general rename' USING ERRCODE = 'FSRUN';
  END IF;
  IF child.scratch <> dst.scratch AND NOT (child.scratch = 0 AND dst.scratch = p_session) THEN
    RAISE EXCEPTION 'scratch and the rest of the volume are separate' USING ERRCODE = 'FS018';
  END IF;
  IF v_target = v_ino THEN  -- two names of one file: POSIX says do nothing
    UPDATE counters SET op = p_op, made = 0 WHERE session_id = p_session AND lane = p_lane;
    RETURN QUERY SELECT child, 0, '{}'::text[], false, 0, 0::bigint;
    RETURN;
  END IF;
  IF v_target IS NOT NULL THEN
    SELECT * INTO old FROM inodes WHERE id = v_target;
    IF (old.mode & 61440) = 16384 THEN
      RAISE EXCEPTION 'is a directory' USING ERRCODE = 'FS021';
    END IF;
  END IF;
  DELETE FROM entries WHERE parent = p_src_parent AND name = p_src_name;
  IF v_target IS NOT NULL THEN
    UPDATE entries SET inode = v_ino WHERE parent = p_dst_parent AND name = p_dst_name;
    UPDATE inodes SET nlink = nlink - 1, ctime_ns = p_now WHERE id = v_target RETURNING * INTO old;
  ELSE
    INSERT INTO entries (parent, name, inode) VALUES (p_dst_parent, p_dst_name, v_ino);
  END IF;
  UPDATE inodes SET ctime_ns = p_now WHERE id = v_ino RETURNING * INTO child;
  UPDATE inodes SET mtime_ns = p_now, ctime_ns = p_now WHERE id IN (p_src_parent, p_dst_parent);
  IF v_target IS NOT NULL AND old.nlink <= 0 THEN
    SELECT d.freed, d.used_delta, d.deleted INTO v_freed, v_used, v_deleted FROM fs_drop_unheld(v_target, p_now_s) d;
  END IF;
  UPDATE counters SET inodes = inodes - v_deleted::int, used = used + v_used, op = p_op,
         made = coalesce(v_target, 0)
   WHERE session_id = p_session AND lane = p_lane;
  RETURN QUERY SELECT child, 0, '{}'::text[], false, 0, 0::bigint;
  IF v_target IS NOT NULL THEN
    RETURN QUERY SELECT old, 1, v_freed, v_deleted, -v_deleted::int, v_used;
  END IF;
  RETURN QUERY SELECT i, 2, '{}'::text[], false, 0, 0::bigint FROM inodes i
                WHERE i.id IN (p_src_parent, p_dst_parent);
END $$;

-- operations.open_file: the inode, its block map, and this session's hold on it; with the
-- bytes of the blocks the database keeps (keys behind INLINE_PREFIX), NULL for the others.
CREATE OR REPLACE FUNCTION fs_open(p_session bigint, p_ino bigint)
RETURNS TABLE (node inodes, idx bigint[], keys text[], data bytea[])
LANGUAGE plpgsql AS $$
DECLARE
  v_node inodes;
BEGIN
  PERFORM fs_session(p_session, false);
  SELECT * INTO v_node FROM inodes WHERE id = p_ino;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'no such file' USING ERRCODE = 'FS002';
  END IF;
  INSERT INTO holds (session_id, inode) VALUES (p_session, p_ino) ON CONFLICT DO NOTHING;
  RETURN QUERY SELECT v_node, coalesce(array_agg(b.idx), '{}'), coalesce(array_agg(b.key), '{}'),
                      coalesce(array_agg(CASE WHEN starts_with(b.key, 'db-' /* INLINE_PREFIX */)
                                         THEN (SELECT o.data FROM objects o WHERE o.key = b.key) END), '{}')
                 FROM blocks b WHERE b.inode = p_ino;
END $$;

-- operations.commit_blocks (and with p_promote, operations.promote), plus the end of the
-- blocks' upload registrations: the inode as changed, the keys whose last reference went,
-- and the change of the bytes in use. p_keys[i] NULL: block p_idx[i] is gone (a hole).
-- p_durable: an fsync waits for it; committed with the server's own synchronous_commit.
-- p_upload_age: seconds since the upload of these blocks began (NULL: not known).
-- p_data[i]: the bytes of block p_idx[i] if the database keeps them (inline), else NULL.
CREATE OR REPLACE FUNCTION fs_commit(p_session bigint, p_ino bigint, p_idx bigint[], p_keys text[],
    p_sizes bigint[], p_size bigint, p_mtime bigint, p_now double precision, p_promote boolean,
    p_durable boolean, p_upload_age double precision, p_data bytea[])
RETURNS TABLE (node inodes, freed text[], used_delta bigint)
LANGUAGE plpgsql AS $$
DECLARE
  v_node inodes;
  v_old text;
  v_rc bigint;
  v_bytes bigint;
  v_uploaded int;
  v_used bigint := 0;
  v_freed text[] := '{}';
  v_added text[] := '{}';
  v_added_sizes bigint[] := '{}';
  v_added_data bytea[] := '{}';
  v_dropped text[] := '{}';
  i int;
BEGIN
  PERFORM fs_session(p_session, p_durable);
  UPDATE inodes SET size = p_size, mtime_ns = p_mtime, ctime_ns = greatest(ctime_ns, p_mtime),
         scratch = CASE WHEN p_promote THEN 0 ELSE scratch END
   WHERE id = p_ino AND (NOT p_promote OR (scratch = p_session AND (mode & 61440) = 32768))
   RETURNING * INTO v_node;
  IF NOT FOUND THEN
    IF p_promote AND EXISTS (SELECT 1 FROM inodes WHERE id = p_ino) THEN
      RAISE EXCEPTION 'not a scratch file of this node' USING ERRCODE = 'FS018';
    END IF;
    RAISE EXCEPTION 'no such file' USING ERRCODE = 'FS002';
  END IF;
  FOR i IN 1 .. coalesce(array_length(p_idx, 1), 0) LOOP
    v_old := (SELECT key FROM blocks WHERE inode = p_ino AND idx = p_idx[i]);
    CONTINUE WHEN p_keys[i] IS NOT NULL AND p_keys[i] = v_old;
    -- Plain statements, no upsert (which logs a speculative insert's confirmation): the
    -- inode's row, locked above, keeps every other commit of its block map out.
    IF p_keys[i] IS NOT NULL AND v_old IS NULL THEN
      INSERT INTO blocks (inode, idx, key, size) VALUES (p_ino, p_idx[i], p_keys[i], p_sizes[i]);
    ELSIF p_keys[i] IS NOT NULL THEN
      UPDATE blocks SET key = p_keys[i], size = p_sizes[i] WHERE inode = p_ino AND idx = p_idx[i];
    END IF;
    IF p_keys[i] IS NOT NULL THEN
      v_added := v_added || p_keys[i];
      v_added_sizes := v_added_sizes || p_sizes[i];
      v_added_data := v_added_data || p_data[i];
    ELSIF v_old IS NOT NULL THEN
      DELETE FROM blocks WHERE inode = p_ino AND idx = p_idx[i];
    END IF;
    IF v_old IS NOT NULL THEN
      v_dropped := v_dropped || v_old;
    END IF;
  END LOOP;
  -- References added first, so a block that only moves within the commit never reaches
  -- zero. A scratch file's blocks never leave its node: not recorded as in the bucket.
  v_uploaded := (v_node.scratch = 0)::int;
  FOR i IN 1 .. coalesce(array_length(v_added, 1), 0) LOOP
    IF v_uploaded = 1 AND (p_upload_age > 3600.0 /* COLLECTED_KEEP */ - 120 OR EXISTS (
        SELECT 1 FROM collected WHERE key = v_added[i]
           AND at > extract(epoch from clock_timestamp()) - coalesce(p_upload_age, 3600.0 /* COLLECTED_KEEP */) - 3.0 /* COLLECTED_MARGIN */)) THEN
      RAISE EXCEPTION 'block % was collected while it was uploaded', v_added[i] USING ERRCODE = 'FS011';
    END IF;
    -- A row with no reference left (an abandoned upload's) takes this size. A new block
    -- (the common case) is a plain insert: a node inserting the same bytes at the same
    -- moment makes this call fail on the key (23505), and the pool runs it again.
    UPDATE objects SET refcount = refcount + 1, unreferenced_since = NULL,
           uploaded = CASE WHEN v_uploaded = 1 THEN 1 ELSE uploaded END,
           size = CASE WHEN refcount <= 0 THEN v_added_sizes[i] ELSE size END,
           data = coalesce(data, v_added_data[i])
     WHERE key = v_added[i] AND (deleting = 0 OR v_uploaded = 0)
    RETURNING refcount, size INTO v_rc, v_bytes;
    IF NOT FOUND THEN
      IF EXISTS (SELECT 1 FROM objects WHERE key = v_added[i]) THEN
        RAISE EXCEPTION 'block % is being collected', v_added[i] USING ERRCODE = 'FS011';
      END IF;
      INSERT INTO objects (key, size, refcount, uploaded, data)
      VALUES (v_added[i], v_added_sizes[i], 1, v_uploaded, v_added_data[i]);
      v_rc := 1;
      v_bytes := v_added_sizes[i];
    END IF;
    IF v_rc = 1 THEN v_used := v_used + v_bytes; END IF;
  END LOOP;
  SELECT d.freed, v_used + d.used_delta INTO v_freed, v_used FROM fs_drop_refs(v_dropped, p_now) d;
  IF v_used <> 0 THEN
    UPDATE counters SET used = used + v_used WHERE session_id = p_session AND lane = 0;
  END IF;
  RETURN QUERY SELECT v_node, v_freed, v_used;
END $$;
