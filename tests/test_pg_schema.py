"""The PostgreSQL store's schema: SQL files that psql runs as they are, one version for the
whole store, and the upgrade of a volume made by the release before versions
(``tests/fixtures/postgres_v1.sql``, that release's tables and functions, frozen).
"""

from __future__ import annotations

import errno
import hashlib
import re
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Optional

import psycopg
import pytest
import trio

from fusestate.blocks.keys import INLINE_PREFIX, inline_key
from fusestate.meta.engine import ROOT_INODE, FsError, NewNode
from fusestate.meta.postgres import change_feed, functions, pool, schema
from fusestate.meta.postgres.engine import PostgresEngine

V1 = Path(__file__).parent / "fixtures" / "postgres_v1.sql"
SQL_DIR = Path(schema.__file__).parent / "sql"
BS = 65536
FILE = NewNode(stat.S_IFREG | 0o644, 1000, 1000)
CURRENT = b"MANIFEST-000001\n"  # a small file, its block inline

# The digest of every SQL file, for each version. A change to the SQL is a new version: add
# sql/upgrade/NNNN.sql (its changes to the tables, what it drops, the version row), make
# schema.sql what a new database of that version is, and add the new digest here.
DIGESTS = {2: "c3cc72249cfb4307ea4c9e9051ea0bf0f01d367ccb926a076832ff2422d1d24e"}


def sql_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(SQL_DIR.rglob("*.sql")):
        h.update(str(path.relative_to(SQL_DIR)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def psql(url: str, *files: str) -> subprocess.CompletedProcess:
    args = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "--single-transaction", "-d", url]
    for name in files:
        args += ["-f", name]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=SQL_DIR)


def fetch(url: str, query: str, args: tuple = ()) -> list[tuple]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(query, args).fetchall()


def version_1_volume(url: str) -> dict[str, Any]:
    """A volume as the release before versions left it: its schema, and files made by its
    own server functions (``fs_create_v2``, ``fs_link_v1``, ``fs_commit_v3``) of session 0."""
    now = time.time_ns()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(V1.read_text())

        def create(parent: int, name: bytes, mode: int) -> int:
            row = conn.execute("SELECT id FROM fs_create_v2(0, 0, 0, false, %s, %s, %s, 1000, 1000, 0, NULL,"
                               " false, false, %s)", (parent, name, mode, now)).fetchone()
            return row[0]

        def commit(ino: int, keys: list[str], size: int, data: Optional[list[Optional[bytes]]] = None) -> None:
            conn.execute("SELECT * FROM fs_commit_v3(0, %s, %s, %s, %s, %s, %s, %s, false, false, NULL, %s)",
                         (ino, list(range(len(keys))), keys, [BS] * len(keys), size, now, time.time(),
                          data or [None] * len(keys)))

        d = create(ROOT_INODE, b"state", stat.S_IFDIR | 0o755)
        sst = create(d, b"000001.sst", stat.S_IFREG | 0o644)
        commit(sst, ["a" * 64, "b" * 64], BS + 10)
        conn.execute("SELECT * FROM fs_link_v1(0, 0, 0, false, %s, %s, %s, %s)", (sst, ROOT_INODE, b"linked", now))
        small = create(d, b"CURRENT", stat.S_IFREG | 0o644)
        commit(small, [inline_key(CURRENT)], len(CURRENT), [CURRENT])
        # A session of that release that died: the new code cleans it up.
        conn.execute("INSERT INTO sessions (host, pid, mountpoint, started, heartbeat) VALUES ('old', 1, '/m', 0, 0)")
    return {"dir": d, "sst": sst, "small": small}


def test_the_numbers_in_the_sql_are_the_codes() -> None:
    """A number the node's code shares with the SQL is written there with its name."""
    shared = {**vars(functions), "INLINE_PREFIX": INLINE_PREFIX, "CHANNEL": change_feed.CHANNEL,
              "SESSION_SETTING": pool.SESSION_SETTING}
    found = set()
    for path in SQL_DIR.rglob("*.sql"):
        for literal, name in re.findall(r"('[^']*'|[\d.]+) /\* ([A-Z_]+) \*/", path.read_text()):
            value = literal.strip("'") if literal.startswith("'") else float(literal)
            expected = shared[name] if isinstance(value, str) else float(shared[name])
            assert value == expected, f"{path.name}: {name} is {literal} there, {shared[name]!r} in the code"
            found.add(name)
    assert found == {"SESSION_FENCE", "LANE_FENCE", "INODE_FENCE", "LANES_PER_SESSION", "LOST_SQLSTATE",
                     "INLINE_PREFIX", "COLLECTED_KEEP", "COLLECTED_MARGIN", "CHANNEL", "SESSION_SETTING"}


def test_the_sql_is_pinned_to_its_version() -> None:
    assert schema.VERSION == max(DIGESTS)
    assert sql_digest() == DIGESTS[schema.VERSION], (
        "the SQL changed: a new schema version (see DIGESTS), or the digest of this one if it was never released")


def test_psql_makes_a_volume_from_the_files_as_they_are(pg_url: str) -> None:
    proc = psql(pg_url, "schema.sql", "functions.sql", "change_feed.sql")
    assert proc.returncode == 0, proc.stderr
    assert fetch(pg_url, "SELECT version FROM schema_version") == [(schema.VERSION,)]

    async def main() -> None:  # the engine finds it complete: nothing to install, a volume to use
        engine = PostgresEngine(pg_url, block_size=BS)
        try:
            await engine.start()
            f = await engine.create(ROOT_INODE, b"f", FILE)
            assert (await engine.lookup(ROOT_INODE, b"f")).id == f.id == 2
            assert await engine.check() == []
        finally:
            engine.close()

    trio.run(main)


def test_psql_upgrades_a_version_1_volume(pg_url: str) -> None:
    version_1_volume(pg_url)
    steps = [name for _, name in schema.upgrades()]
    proc = psql(pg_url, *steps, "functions.sql", "change_feed.sql")
    assert proc.returncode == 0, proc.stderr
    assert fetch(pg_url, "SELECT version FROM schema_version") == [(schema.VERSION,)]


def test_a_version_1_volume_is_upgraded_at_open_and_reads_back(pg_url: str) -> None:
    made = version_1_volume(pg_url)

    async def main() -> None:
        engine = PostgresEngine(pg_url, block_size=BS, mountpoint="/upgraded")
        try:
            freed = await engine.start()  # cleans up the old release's dead session
            assert not freed.keys
            state = await engine.lookup(ROOT_INODE, b"state")
            assert [e.name for e, _ in await engine.readdir(state.id, 0)] == [b"000001.sst", b"CURRENT"]
            node, blocks = await engine.open_file(made["sst"])
            assert (node.size, node.nlink, blocks) == (BS + 10, 2, {0: "a" * 64, 1: "b" * 64})
            assert (await engine.lookup(ROOT_INODE, b"linked")).id == made["sst"]
            node, blocks = await engine.open_file(made["small"])
            assert node.size == len(CURRENT) and await engine.block_data(blocks[0]) == CURRENT
            assert engine.stats().inodes == 4 and engine.stats().used_bytes == 3 * BS
            assert await engine.check() == []
            # The new release's operations on it, and the change feed's triggers announce them.
            with psycopg.connect(pg_url, autocommit=True) as listener:
                listener.execute(f"LISTEN {change_feed.CHANNEL}")
                await engine.close_files([made["sst"], made["small"]])
                f = await engine.create(state.id, b"000002.sst", FILE, hold=True)
                await engine.commit_blocks(f.id, {0: ("d" * 64, BS)}, BS, 1)
                await engine.rename(state.id, b"000002.sst", ROOT_INODE, b"linked")
                await engine.unlink(state.id, b"000001.sst")
                await engine.close_file(f.id)
                notes = [n.payload for n in listener.notifies(timeout=2, stop_after=3)]
            assert any(n.startswith(f"e{engine.session_id}:{ROOT_INODE}/") for n in notes), notes
            await raises_errno(errno.ENOENT, engine.getattr(made["sst"]))  # its last name went
            assert await engine.check() == []
        finally:
            engine.close()

    trio.run(main)
    assert fetch(pg_url, "SELECT version FROM schema_version") == [(schema.VERSION,)]
    # Every function of version 1 gone; in the place of its first, the guard against its release.
    assert fetch(pg_url, "SELECT proname, prorettype::regtype::text FROM pg_proc WHERE proname ~ '^fs_.*_v[0-9]+$'") == [
        ("fs_session_v1", "text")]
    assert sorted(fetch(pg_url, "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")) == [
        ("fs_entries_changed",), ("fs_inodes_changed",)]


async def raises_errno(code: int, call: Any) -> None:
    with pytest.raises(FsError) as info:
        await call
    assert info.value.errno == code


def test_two_nodes_opening_a_version_1_volume_at_once_upgrade_it_once(pg_url: str) -> None:
    version_1_volume(pg_url)
    engines: list[PostgresEngine] = []
    errors: list[BaseException] = []

    def open_one(n: int) -> None:
        try:
            engines.append(PostgresEngine(pg_url, block_size=BS, mountpoint=f"/node{n}"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with psycopg.connect(pg_url) as holder:  # both find version 1, then wait for the lock
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (schema.SCHEMA_LOCK,))
        threads = [threading.Thread(target=open_one, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while fetch(pg_url, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")[0][0] < 2:
            assert time.monotonic() < deadline, "the opens never waited for the schema lock"
            time.sleep(0.05)
        holder.rollback()
    for t in threads:
        t.join(60)
    try:
        assert not errors, errors
        assert len(engines) == 2
        assert fetch(pg_url, "SELECT version FROM schema_version") == [(schema.VERSION,)]

        async def main() -> None:
            for e in engines:
                await e.start()
            a, b = engines
            f = await a.create(ROOT_INODE, b"from-a", FILE)
            assert (await b.lookup(ROOT_INODE, b"from-a")).id == f.id
            assert await b.check() == []

        trio.run(main)
    finally:
        for e in engines:
            e.close()


def test_a_release_before_versions_cannot_mount_an_upgraded_volume(pg_url: str) -> None:
    """Its mount installs its schema and functions (version 1's SQL) in one transaction: the
    guard fails it, and nothing of it stays."""
    version_1_volume(pg_url)
    PostgresEngine(pg_url, block_size=BS).close()
    before = catalog(pg_url)
    with pytest.raises(psycopg.errors.InvalidFunctionDefinition, match="cannot change return type"):
        with psycopg.connect(pg_url, autocommit=True) as conn:  # its tables and functions, one transaction
            conn.execute(V1.read_text().rsplit("\nINSERT INTO inodes (id,", 1)[0])
    assert catalog(pg_url) == before


def test_a_newer_schema_is_refused_with_one_clear_line(pg_url: str) -> None:
    assert psql(pg_url, "schema.sql").returncode == 0
    fetch(pg_url, "UPDATE schema_version SET version = version + 1 RETURNING 1")
    with pytest.raises(schema.SchemaError) as info:
        PostgresEngine(pg_url, block_size=BS)
    message = str(info.value)
    assert "\n" not in message
    assert f"schema version {schema.VERSION + 1}" in message and "upgrade fusestate" in message


def test_no_upgrade_while_a_node_of_the_old_release_is_mounted(pg_url: str) -> None:
    version_1_volume(pg_url)
    fetch(pg_url, "INSERT INTO sessions (host, pid, mountpoint, started, heartbeat)"
                  " VALUES ('old', 2, '/m', 0, extract(epoch from clock_timestamp())) RETURNING 1")
    with pytest.raises(schema.SchemaError, match="1 node.* have it mounted: unmount them"):
        PostgresEngine(pg_url, block_size=BS)
    assert fetch(pg_url, "SELECT to_regclass('schema_version')") == [(None,)]  # nothing changed
    assert fetch(pg_url, "SELECT count(*) FROM pg_proc WHERE proname = 'fs_create_v2'") == [(1,)]


_CATALOG = {
    "columns": "SELECT table_name, column_name, data_type, is_nullable, column_default FROM information_schema.columns"
               " WHERE table_schema = 'public'",
    "tables": "SELECT relname, relkind, relpersistence, reloptions::text FROM pg_class"
              " WHERE relnamespace = 'public'::regnamespace AND relkind IN ('r', 'S')",
    "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'",
    "constraints": "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint"
                   " WHERE connamespace = 'public'::regnamespace",
    "storage": "SELECT c.relname, a.attname, a.attstorage FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
               " WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r' AND a.attnum > 0",
    "functions": "SELECT proname, pg_get_function_identity_arguments(oid), md5(prosrc) FROM pg_proc"
                 " WHERE pronamespace = 'public'::regnamespace",
    "triggers": "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal",
}


def catalog(url: str) -> dict[str, list[tuple]]:
    return {what: sorted(fetch(url, query), key=repr) for what, query in _CATALOG.items()}


def test_a_new_volume_and_an_upgraded_one_have_one_schema(postgres_server) -> None:
    new = postgres_server.create_database(f"new{int(time.time() * 1e6)}")
    old = postgres_server.create_database(f"old{int(time.time() * 1e6)}")
    version_1_volume(old)
    for url in (new, old):
        PostgresEngine(url, block_size=BS).close()
    made, upgraded = catalog(new), catalog(old)
    for what in _CATALOG:
        assert made[what] == upgraded[what], what


def test_a_wheel_carries_the_sql(tmp_path: Path) -> None:
    import sys
    import zipfile

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(root)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("fusestate-*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.endswith(".sql")}
    assert shipped == {f"fusestate/meta/postgres/sql/{p.relative_to(SQL_DIR)}" for p in SQL_DIR.rglob("*.sql")}
