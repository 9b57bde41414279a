-- The change feed's triggers (fusestate/meta/postgres/change_feed.py): every name updated
-- or deleted and every inode other than a directory updated or deleted is announced on
-- the channel 'fusestate_changes' /* CHANNEL */ in the transaction that changes it, and
-- PostgreSQL delivers it to each listening node once the transaction commits.
--
-- Each notification: its kind, the session of the connection that made the change (the
-- setting 'fusestate.session' /* SESSION_SETTING */, empty if it has none), ':', and what
-- changed:
--   e<session>:<parent>/<name in hex>   a name updated or deleted
--   i<session>:<inode>/<size>           an inode other than a directory updated: its new size
--   i<session>:<inode>                  ... or deleted
--
-- Applied with functions.sql (to a new database, and after every upgrade); running it
-- again changes nothing.

CREATE OR REPLACE FUNCTION fs_entry_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('fusestate_changes' /* CHANNEL */,
                    'e' || coalesce(current_setting('fusestate.session' /* SESSION_SETTING */, true), '') || ':'
                    || OLD.parent || '/' || encode(OLD.name, 'hex'));
  RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION fs_inode_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('fusestate_changes' /* CHANNEL */,
                    'i' || coalesce(current_setting('fusestate.session' /* SESSION_SETTING */, true), '') || ':'
                    || OLD.id || CASE WHEN TG_OP = 'UPDATE' THEN '/' || NEW.size ELSE '' END);
  RETURN NULL;
END $$;

-- Made again rather than CREATE OR REPLACE TRIGGER, which PostgreSQL 13 lacks.
DROP TRIGGER IF EXISTS fs_entries_changed ON entries;
CREATE TRIGGER fs_entries_changed AFTER UPDATE OR DELETE ON entries
  FOR EACH ROW EXECUTE FUNCTION fs_entry_changed();
DROP TRIGGER IF EXISTS fs_inodes_changed ON inodes;
CREATE TRIGGER fs_inodes_changed AFTER UPDATE OR DELETE ON inodes
  FOR EACH ROW WHEN ((OLD.mode & 61440) <> 16384)  -- not a directory: (mode & S_IFMT) <> S_IFDIR
  EXECUTE FUNCTION fs_inode_changed();
