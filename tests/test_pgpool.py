"""The shared engine's connection pool against real PostgreSQL servers: a multi-host URL
reaches the server that takes writes, a frozen server's connections are broken instead of
waited on for ever, a slow transaction on a live server is left alone, and a server on an
older timeline than the pool has written to is refused; a read on its own (a lookup's)
survives a cut connection, reports a refusal as its errno, and leaves nothing behind when
cancelled."""

from __future__ import annotations

import errno
import threading
import time

import psycopg
import pytest
import trio

from fusestate.config import redact_url
from fusestate.daemon.volume import engine_identity
from fusestate.harness.postgres import LocalPostgres, free_port, freeze, thaw
from fusestate.meta.postgres.pool import DatabaseUnavailable, PgPool, RefusedByServer


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


def test_a_read_on_its_own_answers_after_its_connection_was_cut(pg_url: str) -> None:
    """``query`` (a lookup's or a stat's one statement) sends on an idle connection
    itself; when the server has dropped that connection, the read is run again on a new
    one and answers, as a transaction would."""
    pool = PgPool(pg_url, size=1)

    async def main() -> None:
        assert await pool.query("SELECT ?::int + 1", (1,)) == [(2,)]
        pid = pool._idle[-1].info.backend_pid
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        assert await pool.query("SELECT ?::int + 1", (41,)) == [(42,)]

    try:
        trio.run(main)
        assert pool.reconnects == 2
    finally:
        pool.close()


def test_a_read_on_its_own_refused_by_the_server_raises_its_errno(pg_url: str) -> None:
    """A server-side refusal (SQLSTATE FS + errno) is the answer, not a lost connection:
    raised as the POSIX error, the connection kept."""
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("CREATE FUNCTION refuse() RETURNS int LANGUAGE plpgsql AS"
                      " $$BEGIN RAISE SQLSTATE 'FS002' USING MESSAGE = 'no such name'; END$$")
    pool = PgPool(pg_url, size=1)

    async def main() -> None:
        await pool.query("SELECT 1")
        with pytest.raises(RefusedByServer) as refused:
            await pool.query("SELECT refuse()")
        assert refused.value.errno == errno.ENOENT
        assert await pool.query("SELECT 3") == [(3,)]

    try:
        trio.run(main)
        assert pool.reconnects == 1 and pool.open_connections == 1
    finally:
        pool.close()


def test_a_read_cancelled_while_it_waits_leaves_no_answer_behind(pg_url: str) -> None:
    """A read abandoned while its answer is on the way must not leave that answer for
    the next read on the connection: the connection is closed, the next read gets its own."""
    pool = PgPool(pg_url, size=1)

    async def main() -> None:
        await pool.query("SELECT 1")
        with trio.move_on_after(0.2):
            await pool.query("SELECT 'late' FROM pg_sleep(0.5)")
        await trio.sleep(0.5)  # the abandoned answer arrives meanwhile
        assert await pool.query("SELECT 'mine'") == [("mine",)]
        assert await pool.query("SELECT ?::int", (5,)) == [(5,)]

    try:
        trio.run(main)
        assert pool.reconnects == 2
    finally:
        pool.close()
