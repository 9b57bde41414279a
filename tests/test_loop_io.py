"""Database transactions run on the event loop's thread without holding the loop up."""

from __future__ import annotations

import threading

import psycopg
import pytest
import trio

from fusestate.meta.postgres.loop_io import await_, run_on_loop
from fusestate.meta.postgres.pool import PgPool


def test_a_transaction_waits_for_the_database_on_the_loop_without_blocking_it(pg_url: str) -> None:
    pool = PgPool(pg_url, size=2)
    seen: dict[str, object] = {}

    def slow(cur: psycopg.Cursor) -> int:
        seen["thread"] = threading.get_ident()
        cur.execute("SELECT pg_sleep(0.5), 7")
        return cur.fetchone()[1]

    async def main() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await trio.sleep(0.01)
                ticks += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            seen["result"] = await pool.run(slow)
            nursery.cancel_scope.cancel()
        seen["ticks"] = ticks

    try:
        trio.run(main)
    finally:
        pool.close()
    assert seen["result"] == 7
    assert seen["thread"] == threading.get_ident()  # no worker thread
    assert seen["ticks"] >= 20  # the loop went on during the 0.5 s the server took


def test_blocking_code_on_the_loop_gets_what_it_awaits_and_its_errors() -> None:
    def body() -> tuple[str, str]:
        got = await_(lambda: _later("value"))
        try:
            await_(_fails)
        except KeyError as exc:
            return got, exc.args[0]
        return got, "no error"

    assert trio.run(run_on_loop, body) == ("value", "from the loop")

    def broken() -> None:
        raise ValueError("from the greenlet")

    with pytest.raises(ValueError, match="from the greenlet"):
        trio.run(run_on_loop, broken)


def test_await_outside_the_loop_is_refused() -> None:
    with pytest.raises(RuntimeError):
        await_(trio.lowlevel.checkpoint)


async def _later(value: str) -> str:
    await trio.sleep(0.01)
    return value


async def _fails() -> None:
    await trio.lowlevel.checkpoint()
    raise KeyError("from the loop")
