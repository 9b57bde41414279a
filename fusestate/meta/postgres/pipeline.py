"""A transaction's statements sent through libpq's pipeline mode directly.

A namespace operation sends 5 to 13 statements. Through psycopg's cursors each costs the
daemon about 70 µs of CPU in pipeline mode (query conversion, generators and result
objects in Python), against about 10 µs for libpq itself: on a small node that was most
of a write's CPU. ``Pipeline`` keeps psycopg for connections, errors and loading rows
(its C loaders), and does the rest with ``psycopg.pq``:

- statements take ``?`` placeholders (as ``operations.py`` writes them) and plain Python
  values: ints, floats and strings as text, bytes as binary, lists as arrays, None as
  NULL; the server infers each parameter's type from the statement;
- ``queue`` only buffers a statement; ``read`` sends everything queued with a sync point
  and waits for the results, so a transaction costs one round trip per statement whose
  rows it reads;
- a statement with parameters run a second time on a connection is prepared there (kept
  for the connection's life, at most ``MAX_PREPARED`` of them), so the server plans it
  once, as psycopg's cursors do;
- an error in any statement is raised, as psycopg would raise it, at the ``read`` that
  reaches it (the statements after it in the pipeline are skipped by the server).

Waits for the socket go to the trio loop when running under ``loop_io.run_on_loop``, and
block the thread anywhere else; ``aread`` awaits them from a trio task directly.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import psycopg
import trio
from psycopg import errors, pq
from psycopg.adapt import Transformer

from fusestate.meta.postgres.loop_io import wait_socket

MAX_PREPARED = 256  # per connection; statements beyond these run unprepared
# Results the server may have to send before they are read: beyond this many, queue()
# reads them. The server stops reading while its results wait to be sent, so an
# unbounded queue could stall both ends on full socket buffers.
MAX_UNREAD = 1000
_TEXT, _BINARY = pq.Format.TEXT, pq.Format.BINARY
_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
_SYNC = pq.ExecStatus.PIPELINE_SYNC
_ERROR = (pq.ExecStatus.FATAL_ERROR, pq.ExecStatus.PIPELINE_ABORTED)


class _Prepared:
    """What one connection has prepared: statement text to name, and how often unprepared
    statements were seen (a statement run once is not worth a plan of its own)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # off behind a pooler in transaction mode (see ``never_prepare``)
        self.names: dict[bytes, bytes] = {}
        self.seen: dict[bytes, int] = {}
        self.generation = 0  # a new one after the server lost some: names never collide

    def forget(self) -> None:
        self.names.clear()
        self.generation += 1


def never_prepare(conn: psycopg.Connection) -> None:
    """Run every statement of this connection unprepared: behind a pooler in transaction
    mode (PgBouncer) consecutive transactions reach different server connections, where a
    name prepared on another is unknown, or names another statement."""
    conn._fusestate_prepared = _Prepared(enabled=False)  # type: ignore[attr-defined]


_CONVERTED: dict[str, bytes] = {}


def _convert(sql: str) -> bytes:
    """``?`` placeholders to ``$n``; no statement here has a literal ``?``."""
    query = _CONVERTED.get(sql)
    if query is None:
        parts = sql.split("?")
        query = "".join(p + (f"${n + 1}" if n < len(parts) - 1 else "") for n, p in enumerate(parts)).encode()
        if len(_CONVERTED) < 4096:  # the engine's statements are a fixed set
            _CONVERTED[sql] = query
    return query


def _array_item(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f'"\\\\x{bytes(value).hex()}"'  # bytea's hex input, its backslash escaped for the array
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _encode(values: Sequence[Any]) -> tuple[list[Optional[bytes]], list[int]]:
    out: list[Optional[bytes]] = []
    formats: list[int] = []
    for v in values:
        kind = type(v)
        if v is None:
            out.append(None)
            formats.append(_TEXT)
        elif kind is int or kind is bool:
            out.append(str(int(v)).encode())
            formats.append(_TEXT)
        elif kind is bytes or kind is bytearray or kind is memoryview:
            out.append(bytes(v))
            formats.append(_BINARY)
        elif kind is str:
            out.append(v.encode())
            formats.append(_TEXT)
        elif kind is float:
            out.append(repr(v).encode())
            formats.append(_TEXT)
        elif kind is list or kind is tuple:
            out.append(("{" + ",".join(_array_item(x) for x in v) + "}").encode())
            formats.append(_TEXT)
        else:
            raise TypeError(f"no SQL parameter for {kind.__name__}")
    return out, formats


class Slot:
    """Where the rows of one queued statement arrive."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: Optional[list[tuple]] = None


class Pipeline:
    """Statements on one connection in libpq's pipeline mode; see the module docstring.
    Use as a context manager: it leaves pipeline mode however the block ends."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn
        self._pgconn = conn.pgconn
        self._loader = Transformer(conn)
        prepared = getattr(conn, "_fusestate_prepared", None)
        if prepared is None:
            prepared = _Prepared()
            conn._fusestate_prepared = prepared  # type: ignore[attr-defined]
        self._prepared: _Prepared = prepared
        # One entry per result the server will send: a Slot for rows, None for results
        # nobody reads, a name for a statement being prepared.
        self._expected: list[Any] = []
        self._unsent = False
        self._preparing: dict[bytes, bytes] = {}

    def __enter__(self) -> "Pipeline":
        self._pgconn.enter_pipeline_mode()
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        pgconn = self._pgconn
        try:
            if pgconn.status == pq.ConnStatus.OK and (self._unsent or self._expected):
                self.read()  # on an error, only to drain it: the pool rolls the transaction back
        except psycopg.Error:
            if exc is None:
                raise
        finally:
            if pgconn.status == pq.ConnStatus.OK and pgconn.pipeline_status != pq.PipelineStatus.OFF:
                try:
                    pgconn.exit_pipeline_mode()
                except psycopg.Error:
                    self._conn.close()  # results left unread: the pool must not reuse it
                    if exc is None:
                        raise

    def queue(self, sql: str, args: Sequence[Any] = (), rows: bool = False) -> Optional[Slot]:
        """Buffer a statement; with ``rows``, the Slot its rows arrive in (at the next ``read``)."""
        query = _convert(sql)
        values, formats = _encode(args)
        pgconn = self._pgconn
        prepared = self._prepared
        name = prepared.names.get(query) or self._preparing.get(query)
        if name is None and args and prepared.enabled and len(prepared.names) + len(self._preparing) < MAX_PREPARED:
            seen = prepared.seen.get(query, 0) + 1
            if seen >= 2:
                prepared.seen.pop(query, None)
                name = f"fs{prepared.generation}_{len(prepared.names) + len(self._preparing)}".encode()
                pgconn.send_prepare(name, query)
                self._preparing[query] = name
                self._expected.append(name)
            elif len(prepared.seen) < MAX_PREPARED * 4:
                prepared.seen[query] = seen
        if name is not None:
            pgconn.send_query_prepared(name, values, formats, _BINARY)
        else:
            pgconn.send_query_params(query, values, None, formats, _BINARY)
        slot = Slot() if rows else None
        self._expected.append(slot)
        self._unsent = True
        if len(self._expected) >= MAX_UNREAD:
            self.read()
        return slot

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        """One statement's rows, after everything queued before it."""
        slot = self.queue(sql, args, rows=True)
        assert slot is not None
        self.read()
        return self.rows(slot)

    def rows(self, slot: Slot) -> list[tuple]:
        """A queued statement's rows, reading them if they have not come yet."""
        if slot.rows is None:
            self.read()
        assert slot.rows is not None
        return slot.rows

    def read(self) -> None:
        """Send what is queued with a sync point and take in every result up to it."""
        fd = self._pgconn.socket
        steps = self._exchange()
        for write in steps:
            wait_socket(fd, write)

    async def aread(self) -> None:
        """``read`` awaiting the socket on the trio loop: for a caller that is a trio task
        itself (``PgPool.query``), which needs no greenlet to wait."""
        fd = self._pgconn.socket
        for write in self._exchange():
            if write:
                await trio.lowlevel.wait_writable(fd)
            else:
                await trio.lowlevel.wait_readable(fd)

    def _exchange(self) -> Iterator[bool]:
        """The work of ``read``; yields each time it must wait for the socket (True:
        until it takes more to send, False: until there is more to read)."""
        pgconn = self._pgconn
        pgconn.pipeline_sync()
        self._unsent = False
        while pgconn.flush():
            yield True
        expected, self._expected = self._expected, []
        preparing, self._preparing = self._preparing, {}
        error: Optional[psycopg.Error] = None
        index = 0
        while True:
            while pgconn.is_busy():
                yield False
                pgconn.consume_input()
            result = pgconn.get_result()
            if result is None:
                continue  # the end of one statement's results
            status = result.status
            if status == _SYNC:
                break
            target = expected[index]
            index += 1
            if status in _OK:
                if type(target) is bytes:  # a statement now prepared on this connection
                    query = next(q for q, n in preparing.items() if n == target)
                    self._prepared.names[query] = target
                elif target is not None and error is None:
                    loader = self._loader
                    loader.set_pgresult(result)
                    target.rows = loader.load_rows(0, result.ntuples, tuple)
            elif status in _ERROR:
                if error is None and status == pq.ExecStatus.FATAL_ERROR:
                    error = errors.error_from_result(result, encoding=self._loader.encoding)
            else:
                error = error or psycopg.InterfaceError(f"unexpected result {status.name} in a pipeline")
        if error is not None:
            if isinstance(error, errors.InvalidSqlStatementName):
                self._prepared.forget()  # dropped by someone else: prepare again
            raise error
