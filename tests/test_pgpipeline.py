"""The shared engine's statement pipeline against a real PostgreSQL server: values go in
and come back as they were, errors surface where their rows are read, and statements
prepared on a connection stay usable for its life."""

from __future__ import annotations

import errno

import psycopg
import pytest
import trio

from fusestate.meta.postgres.pipeline import Pipeline
from fusestate.meta.postgres.pool import PgPool, RefusedByServer


def _prepared_names(conn: psycopg.Connection) -> set[str]:
    with conn.cursor() as cur:
        cur.execute("SELECT name FROM pg_prepared_statements")
        return {r[0] for r in cur.fetchall()}


def test_values_of_every_kind_come_back_as_they_went_in(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id BIGINT PRIMARY KEY, name BYTEA, label TEXT, at DOUBLE PRECISION,"
                     " maybe BIGINT)")
        odd = 'quote " and back\\slash, comma'
        rows = [(1, b"\x00\xff/name", "plain", 1.5, None), (2, b"", odd, 1e-9, 7), (3, bytes(range(256)), "", 0.0, -5)]
        with Pipeline(conn) as pipe:
            for row in rows:
                pipe.queue("INSERT INTO t VALUES (?, ?, ?, ?, ?)", row)
            got = pipe.query("SELECT id, name, label, at, maybe FROM t WHERE id = ANY(?) ORDER BY id", ([1, 2, 3],))
            by_label = pipe.query("SELECT id FROM t WHERE label = ANY(?) ORDER BY id", ([odd, "plain"],))
            nothing = pipe.query("UPDATE t SET maybe = maybe + 1 WHERE id = ?", (99,))
            many = [pipe.queue("SELECT ? + 0", (n,), rows=True) for n in range(2500)]  # read in bounded runs
            pipe.read()
        assert [slot.rows for slot in many] == [[(n,)] for n in range(2500)]
        assert got == rows
        assert by_label == [(1,), (2,)]
        assert nothing == []


def test_an_error_is_raised_at_the_read_that_reaches_it_and_the_connection_stays_usable(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id BIGINT PRIMARY KEY)")
        with pytest.raises(psycopg.errors.UniqueViolation):
            with Pipeline(conn) as pipe:
                pipe.queue("BEGIN")
                pipe.queue("INSERT INTO t VALUES (?)", (1,))
                pipe.queue("INSERT INTO t VALUES (?)", (1,))  # fails; what follows is skipped
                pipe.queue("INSERT INTO t VALUES (?)", (2,))
                pipe.query("SELECT count(*) FROM t")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        conn.execute("ROLLBACK")
        with Pipeline(conn) as pipe:
            assert pipe.query("SELECT count(*) FROM t") == [(0,)]

        # An error left unread when the block ends by an exception of its own: drained,
        # and the block's exception is the one raised.
        with pytest.raises(KeyError):
            with Pipeline(conn) as pipe:
                pipe.queue("SELECT 1 / 0 FROM t WHERE id = ?", (1,))
                raise KeyError("from the operation")
        assert conn.execute("SELECT 41 + 1").fetchone() == (42,)


def test_a_statement_run_twice_is_prepared_and_outlives_a_rollback(pg_url: str) -> None:
    pool = PgPool(pg_url, size=1)
    query = "SELECT ? + 1"

    def run_query(cur: psycopg.Cursor, value: int) -> list[tuple]:
        with Pipeline(cur.connection) as pipe:
            return pipe.query(query, (value,))

    def fail(cur: psycopg.Cursor) -> None:
        with Pipeline(cur.connection) as pipe:
            pipe.queue("BEGIN")
            pipe.query("SELECT 1 / 0 WHERE ? = 1", (1,))

    async def main() -> None:
        for _ in range(6):  # the engine's other transactions use psycopg's cursors
            await pool.run(lambda cur: cur.execute("SELECT %s", (1,)))
        assert await pool.run(run_query, 1) == [(2,)]
        assert await pool.run(lambda cur: _prepared_names(cur.connection)) == set()
        assert await pool.run(run_query, 2) == [(3,)]
        assert len(await pool.run(lambda cur: _prepared_names(cur.connection))) == 1
        # The pool rolls the failed transaction back on the same connection.
        with pytest.raises(psycopg.errors.DivisionByZero):
            await pool.run(fail, explicit=True)
        assert await pool.run(run_query, 3) == [(4,)]
        assert len(await pool.run(lambda cur: _prepared_names(cur.connection))) == 1

    try:
        trio.run(main)
    finally:
        pool.close()


def test_a_prepared_statement_the_server_dropped_is_prepared_again(pg_url: str) -> None:
    pool = PgPool(pg_url, size=1)

    def run_query(cur: psycopg.Cursor, value: int) -> list[tuple]:
        with Pipeline(cur.connection) as pipe:
            return pipe.query("SELECT ? * 2", (value,))

    async def main() -> None:
        for value in (1, 2, 3):
            assert await pool.run(run_query, value) == [(value * 2,)]
        await pool.run(lambda cur: cur.execute("DEALLOCATE ALL"))
        assert await pool.run(run_query, 4) == [(8,)]  # one retry, transparent to the caller
        assert pool.retries == 1
        assert await pool.run(run_query, 5) == [(10,)]

    try:
        trio.run(main)
    finally:
        pool.close()


def test_an_operation_the_server_refuses_is_a_posix_error_not_an_outage(pg_url: str) -> None:
    """SQLSTATE 'FS' + errno, raised by a server-side operation, reaches the caller at once
    as that errno (not retried as a lost connection), and the connection stays in the pool."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE FUNCTION refuse(code text) RETURNS int LANGUAGE plpgsql AS"
                     " $$ BEGIN RAISE EXCEPTION 'refused: %', code USING ERRCODE = code; END $$")
    pool = PgPool(pg_url, size=1, outage_budget=30)

    def call(cur: psycopg.Cursor, code: str) -> None:
        cur.execute("SELECT refuse(%s)", (code,))

    try:
        for code, number in (("FS002", errno.ENOENT), ("FS017", errno.EEXIST), ("FSLST", errno.EIO)):
            with pytest.raises(RefusedByServer) as refused:
                pool.run_sync(call, code, explicit=True)
            assert (refused.value.errno, refused.value.sqlstate) == (number, code)
            assert f"refused: {code}" in str(refused.value)
        assert pool.reconnects == 1  # one connection, reused after every refusal
    finally:
        pool.close()
