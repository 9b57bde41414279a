"""The shared engine's connection pool against real PostgreSQL servers: a multi-host URL
reaches the server that takes writes, a frozen server's connections are broken instead of
waited on for ever, a slow transaction on a live server is left alone, and a server on an
older timeline than the pool has written to is refused."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import psycopg
import pytest

from fusestate.config import redact_url
from fusestate.daemon.volume import engine_identity
from fusestate.meta.local_postgres import LocalPostgres, free_port, freeze, thaw
from fusestate.meta.pgpool import DatabaseUnavailable, PgPool


@pytest.fixture
def own_server() -> Iterator[LocalPostgres]:
    """A server of this test's own: the tests freeze it."""
    server = LocalPostgres(fsync=False)
    try:
        yield server
    finally:
        thaw(server.data)
        server.close()


def _one(cur: psycopg.Cursor, sql: str = "SELECT 1") -> object:
    cur.execute(sql)
    return cur.fetchone()[0]


def test_a_multi_host_url_reaches_the_server_that_answers(pg_url: str) -> None:
    """libpq's multi-host URL as --meta takes it: a first host that refuses is skipped,
    the volume records both servers, and no message shows the password."""
    host, port_db = pg_url.split("@", 1)[1].split(":", 1)
    port, database = port_db.split("/", 1)
    url = (f"postgresql://postgres:secret@127.0.0.1:{free_port()},{host}:{port}/{database}"
           "?target_session_attrs=read-write")
    pool = PgPool(url, size=1)
    try:
        assert pool.run_sync(_one) == 1
        assert pool.timeline == 1
    finally:
        pool.close()
    assert engine_identity(url).endswith(f",{host}:{port}/{database}")
    assert "secret" not in redact_url(url) and "secret" not in pool.redacted


def test_a_frozen_server_fails_the_transaction_within_the_outage_budget(own_server: LocalPostgres) -> None:
    """SIGSTOP of every server process: the sockets stay open and nothing would end the
    wait; the pool breaks the connection once the server no longer takes a new one, and
    gives up after its outage budget instead of hanging."""
    pool = PgPool(own_server.url(), size=1, outage_budget=3)
    try:
        assert pool.run_sync(_one) == 1
        freeze(own_server.data)
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable):
            pool.run_sync(_one)
        waited = time.monotonic() - started
        assert pool.stalls_broken == 1
        # stall probe (2 s) + a probe's timeout (2 s) + a tick, then the budget (3 s) and
        # the connect attempt in flight (5 s)
        assert waited < 20, waited
    finally:
        pool.close()


def test_a_frozen_server_that_comes_back_serves_the_transaction(own_server: LocalPostgres) -> None:
    pool = PgPool(own_server.url(), size=1, outage_budget=30)
    try:
        assert pool.run_sync(_one) == 1
        freeze(own_server.data)
        timer = threading.Timer(6, thaw, (own_server.data,))
        timer.start()
        assert pool.run_sync(_one, "SELECT 2") == 2
        timer.join()
        assert pool.stalls_broken == 1
    finally:
        pool.close()


def test_a_slow_transaction_on_a_live_server_is_left_alone(own_server: LocalPostgres) -> None:
    pool = PgPool(own_server.url(), size=1)
    try:
        assert pool.run_sync(_one, "SELECT 5 FROM pg_sleep(5)") == 5
        assert pool.stalls_broken == 0 and pool.reconnects == 1
    finally:
        pool.close()


def test_a_server_on_an_older_timeline_is_refused(own_server: LocalPostgres) -> None:
    """An old primary that came back after a failover, not yet demoted, still says it
    takes writes: the pool, which has written on a newer timeline, does not use it."""
    pool = PgPool(own_server.url(), size=1, outage_budget=2)
    try:
        assert pool.run_sync(_one) == 1
        pool.timeline = 2  # as if a standby had been promoted and written to meanwhile
        with pytest.raises(DatabaseUnavailable, match="older timeline"):
            pool.run_sync(_one)
    finally:
        pool.close()
