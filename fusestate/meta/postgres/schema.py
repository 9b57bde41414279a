"""The PostgreSQL store's schema: one version for the whole store, upgraded in order.

The SQL lives in ``sql/`` beside this module, shipped with the package and runnable by
psql as it is: ``schema.sql`` (the tables of a new database, its version row and root),
``functions.sql`` (the server-side operations) and ``change_feed.sql`` (the triggers that
announce changes). ``sql/upgrade/NNNN.sql`` brings a database of version NNNN - 1 to
NNNN: it changes the tables, drops what the new version supersedes and sets the version
row. The highest NNNN is the version this code speaks (``VERSION``); a database made
before versions were recorded (tables, no ``schema_version``) is version 1.

``install`` runs at every open. A database at ``VERSION`` costs one query. Otherwise,
under an advisory lock and in one transaction (PostgreSQL's DDL is transactional), it
makes a new database or applies the missing steps, then the functions and triggers: two
nodes opening at once upgrade once, the second waits and finds the work done. A database
of a newer version is refused, as is an upgrade while a node of the old release is
mounted (the functions it calls would be gone under it).
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any, Optional

from fusestate.errors import UserError

SCHEMA_LOCK = 0x66757365  # advisory lock id taken while the schema is made or upgraded
_SQL = resources.files(__package__) / "sql"


def sql(name: str) -> str:
    """The text of one of the package's SQL files (``"functions.sql"``, ``"upgrade/0002.sql"``)."""
    return _SQL.joinpath(name).read_text()


def upgrades() -> list[tuple[int, str]]:
    """The upgrade steps in order: (the version each makes, its file name)."""
    steps = []
    for entry in _SQL.joinpath("upgrade").iterdir():
        match = re.fullmatch(r"(\d{4})\.sql", entry.name)
        if match:
            steps.append((int(match.group(1)), f"upgrade/{entry.name}"))
    return sorted(steps)


VERSION = max((version for version, _ in upgrades()), default=1)


class SchemaError(UserError):
    """The database's schema is one this code cannot or may not open."""


# Whether a table exists, read from the catalog with the statement's own snapshot, never
# from the server's cache of names (``to_regclass``): a transaction that waited for the
# lock must see what the last holder made, and a cached "no such table" would hide it.
_EXISTS = ("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class WHERE relname = %s"
           " AND relnamespace = current_schema()::regnamespace)")


def version_of(cur: Any) -> Optional[int]:
    """The database's version; 1 for one made before versions were recorded; None if empty."""
    cur.execute(_EXISTS, ("schema_version",))
    if cur.fetchone()[0]:
        cur.execute("SELECT version FROM schema_version")
        return int(cur.fetchone()[0])
    cur.execute(_EXISTS, ("inodes",))
    return 1 if cur.fetchone()[0] else None


def install(cur: Any) -> None:
    """Make the database this code's version (see the module), in the caller's transaction."""
    if version_of(cur) == VERSION:
        return
    cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
    _install(cur, version_of(cur))  # asked again: another node may have done it meanwhile


def _install(cur: Any, version: Optional[int]) -> None:
    if version == VERSION:
        return
    if version is None:
        cur.execute(sql("schema.sql"))
    else:
        _check_upgradable(cur, version)
        for target, name in upgrades():
            if target > version:
                cur.execute(sql(name))
                if version_of(cur) != target:
                    raise SchemaError(f"{name} left the schema at version {version_of(cur)}, not {target}")
    cur.execute(sql("functions.sql"))
    cur.execute(sql("change_feed.sql"))


def _check_upgradable(cur: Any, version: int) -> None:
    if version > VERSION:
        raise SchemaError(f"the metadata database has schema version {version}, newer than this fusestate "
                          f"knows (up to {VERSION}): upgrade fusestate on this node")
    # A session's own timeout, 30 s where its release recorded none (sessions.timeout came later).
    cur.execute("SELECT count(*) FROM sessions s WHERE s.heartbeat >= extract(epoch from clock_timestamp())"
                " - coalesce((to_jsonb(s) ->> 'timeout')::float8, 30)")
    alive = int(cur.fetchone()[0])
    if alive:
        raise SchemaError(f"the metadata database has schema version {version} and {alive} node(s) of an older "
                          f"release have it mounted: unmount them, then mount with this release (which upgrades "
                          f"it to version {VERSION}) everywhere")
