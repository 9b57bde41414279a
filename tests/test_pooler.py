"""A shared volume's database behind PgBouncer (Debian's, 1.18): which pool modes the
engine works through, and what each does with the nodes' connections."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Iterator

import psycopg
import pytest

from conftest import Bucket, Mount, fusestate
from fusestate.harness.pgbouncer import LocalPgBouncer
from fusestate.harness.postgres import LocalPostgres

@pytest.fixture
def bouncer(own_server: LocalPostgres) -> Iterator:
    """PgBouncers in front of ``own_server``, made by ``bouncer(mode, pool_size)``. Ask for
    it before make_mount: the mounts must go first."""
    made: list[LocalPgBouncer] = []

    def factory(mode: str, pool_size: int) -> LocalPgBouncer:
        made.append(LocalPgBouncer("127.0.0.1", own_server.port, mode=mode, pool_size=pool_size))
        return made[-1]

    yield factory
    for b in made:
        b.close()


def server_connections(pg: LocalPostgres, database: str) -> int:
    with psycopg.connect(pg.url(), autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)).fetchone()[0]


def commit_files(root: Path, name: str, count: int, threads: int) -> None:
    """``threads`` writers, each committing ``count`` files as RocksDB does."""
    errors: list[BaseException] = []

    def one(t: int) -> None:
        directory = root / f"{name}-{t}"
        try:
            directory.mkdir()
            for i in range(count):
                with open(directory / f"{i}.tmp", "wb") as f:
                    f.write(os.urandom(20_000))
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(directory / f"{i}.tmp", directory / f"{i}.sst")
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=one, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def connections_of(m: Mount) -> int:
    return int(m.status()["session"]["connections"])


def test_each_connection_of_a_node_is_a_server_connection_in_session_mode(own_server: LocalPostgres, bouncer,
                                                                        make_mount, file_bucket: Bucket) -> None:
    """Session pooling works in front of the engine, and saves nothing: a daemon keeps
    the connections it made, and each holds a server connection for its life."""
    own_server.create_database("vol")
    url = bouncer("session", 20).url("vol")
    m = make_mount(file_bucket, extra=["--meta", url, "--metrics-addr", "off"]).mount()
    commit_files(m.path, "w", 20, threads=8)
    held = connections_of(m)
    assert 2 <= held <= 9  # --meta-connections, and the one that listens (--lookup-cache)
    assert server_connections(own_server, "vol") == held
    print(f"session mode: 8 writers on one node, {held} connections, as many on the server")
    m.umount()


def test_transaction_pooling_shares_a_few_server_connections_once_statements_are_unprepared(
        own_server: LocalPostgres, bouncer, make_mount, file_bucket: Bucket) -> None:
    """Transaction pooling in front of two nodes: with the pipeline's named prepared
    statements off, 16 writers on two nodes go through two server connections, and the
    volume is sound; with them on, operations fail."""
    own_server.create_database("vol")
    pooler = bouncer("transaction", 2)
    opts = ["--meta", pooler.url("vol"), "--metrics-addr", "off"]
    a = make_mount(file_bucket, name="node-a", cache="cache-a", extra=[*opts, "--meta-pooler", "transaction"]).mount()
    b = make_mount(file_bucket, name="node-b", cache="cache-b", extra=[*opts, "--meta-pooler", "transaction"]).mount()
    on_b = threading.Thread(target=commit_files, args=(b.path, "node-b", 15, 8))
    on_b.start()
    commit_files(a.path, "node-a", 15, 8)
    on_b.join()
    assert sorted(os.listdir(a.path)) == sorted(os.listdir(b.path)) == sorted(
        f"node-{n}-{t}" for n in "ab" for t in range(8))
    assert all(len(os.listdir(b.path / d)) == 15 for d in os.listdir(b.path))
    clients = connections_of(a) + connections_of(b)
    pools = {p["database"]: p for p in pooler.show("POOLS")}
    assert clients > 2 and pools["vol"]["sv_active"] + pools["vol"]["sv_idle"] <= 2, (clients, pools["vol"])
    assert server_connections(own_server, "vol") <= 2
    print(f"transaction mode: 16 writers on two nodes, {clients} client connections, "
          f"{server_connections(own_server, 'vol')} on the server")
    report = json.loads(fusestate("fsck", file_bucket.url, "--meta", pooler.url("vol"), "--json").stdout)
    assert report["healthy"], report
    b.umount()

    # The same with prepared statements: a statement's name reaches a server connection
    # where it is unknown, taken, or names another statement.
    plain = make_mount(file_bucket, name="node-c", cache="cache-c",
                       extra=[*opts, "--meta-outage-budget", "5"]).mount()
    with pytest.raises(OSError):
        commit_files(plain.path, "plain", 30, threads=8)
    assert "prepared statement" in (plain.cache_dir / "fusestate.log").read_text()
