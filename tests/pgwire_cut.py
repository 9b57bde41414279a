"""A TCP proxy between a client and a PostgreSQL server that breaks one connection at a
chosen point of the wire protocol: where a real network may break it, but on cue.

Every message after the startup is framed the same way (one type byte, then a 4-byte
length that counts itself), so the proxy can follow both directions message by message.
It knows a connection's statements from the client's Parse ('P', with the text; a named
one is remembered), Bind ('B', naming a prepared statement) and Query ('Q') messages. Armed
with a pattern, the first connection whose client sends a matching statement is broken:

- ``cut_reply``: the statement reaches the server; the server's answers from the last
  ReadyForQuery up to the next one that says the connection is idle ('Z' with status
  'I': the transaction is over, committed or not) are dropped, and both sides closed. The
  client never learns how its transaction ended.
- ``cut_before``: the matching message and everything after it never reach the server
  (what came before it in the same packet does); both sides are closed.
- ``cut_after``: the matching message and the rest of the packet reach the server, then
  the client's side is closed at once. The server goes on with what it received (and
  commits it, if that is what it was sent) while the client is already retrying.

``hold_new`` makes connections accepted from then on wait, unconnected, until ``resume``:
a test can act between the break and the client's retry.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
from typing import Optional
from urllib.parse import urlsplit, urlunsplit


class _Connection:
    def __init__(self, proxy: "CuttingProxy", client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server: Optional[socket.socket] = None
        self.statements: dict[bytes, str] = {}  # prepared statement name -> text
        self.cut_reply = False  # drop the server's answers up to the next idle ReadyForQuery
        self.client_gone = False  # cut after: the client's side is closed, the server's drained
        self.closed = False

    def close(self) -> None:
        self.closed = True
        for sock in (self.client, self.server):
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def statement_of(self, kind: bytes, body: bytes) -> Optional[str]:
        if kind == b"Q":
            return body.split(b"\0", 1)[0].decode(errors="replace")
        if kind == b"P":
            name, rest = body.split(b"\0", 1)
            text = rest.split(b"\0", 1)[0].decode(errors="replace")
            if name:
                self.statements[name] = text
            return text
        if kind == b"B":
            _portal, rest = body.split(b"\0", 1)
            name = rest.split(b"\0", 1)[0]
            return self.statements.get(name) if name else None
        return None


class CuttingProxy:
    """Listens on 127.0.0.1; forwards to ``host:port``. See the module docstring."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._armed: Optional[tuple[str, re.Pattern]] = None
        self._released = threading.Event()
        self._released.set()
        self.cut = threading.Event()  # set once the armed cut happened
        self.connections: list[_Connection] = []
        self._closing = False
        threading.Thread(target=self._accept, name="pgwire-cut-accept", daemon=True).start()

    def url(self, url: str) -> str:
        """``url`` through this proxy (no TLS or GSS encryption: the proxy reads the stream)."""
        parts = urlsplit(url)
        netloc = f"{parts.username}@" if parts.username else ""
        query = "&".join(q for q in (parts.query, "sslmode=disable&gssencmode=disable") if q)
        return urlunsplit((parts.scheme, f"{netloc}127.0.0.1:{self.port}", parts.path, query, ""))

    # --- arming ---------------------------------------------------------------------------
    def cut_reply(self, pattern: str) -> None:
        self._arm("reply", pattern)

    def cut_before(self, pattern: str) -> None:
        self._arm("before", pattern)

    def cut_after(self, pattern: str) -> None:
        self._arm("after", pattern)

    def _arm(self, mode: str, pattern: str) -> None:
        with self._lock:
            self.cut.clear()
            self._armed = (mode, re.compile(pattern))

    def hold_new(self) -> None:
        self._released.clear()

    def resume(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._closing = True
        self._released.set()
        self._listener.close()
        for conn in list(self.connections):
            conn.close()

    # --- forwarding -------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            conn = _Connection(self, client)
            self.connections.append(conn)
            threading.Thread(target=self._open, args=(conn,), name="pgwire-cut-conn", daemon=True).start()

    def _open(self, conn: _Connection) -> None:
        self._released.wait()
        try:
            conn.server = socket.create_connection(self.upstream)
        except OSError:
            conn.close()
            return
        threading.Thread(target=self._from_server, args=(conn,), name="pgwire-cut-server", daemon=True).start()
        self._from_client(conn)

    def _take(self, conn: _Connection, mode: str, statement: Optional[str]) -> bool:
        """Whether this statement triggers the armed cut of ``mode`` (disarming it)."""
        if statement is None:
            return False
        with self._lock:
            if self._armed is None or self._armed[0] != mode or not self._armed[1].search(statement):
                return False
            self._armed = None
            return True

    def _from_client(self, conn: _Connection) -> None:
        buffer = b""
        started = False
        try:
            while True:
                data = conn.client.recv(65536)
                if not data:
                    break
                buffer += data
                out = b""
                while True:
                    if not started:  # the startup packet has no type byte
                        if len(buffer) < 4:
                            break
                        length = struct.unpack("!I", buffer[:4])[0]
                        if len(buffer) < length:
                            break
                        started = True
                        out, buffer = out + buffer[:length], buffer[length:]
                        continue
                    if len(buffer) < 5:
                        break
                    length = struct.unpack("!I", buffer[1:5])[0]
                    if len(buffer) < 1 + length:
                        break
                    message, kind, body = buffer[:1 + length], buffer[:1], buffer[5:1 + length]
                    statement = conn.statement_of(kind, body)
                    if self._take(conn, "before", statement):
                        if out:
                            conn.server.sendall(out)
                        self.cut.set()
                        conn.close()
                        return
                    if self._take(conn, "reply", statement):
                        conn.cut_reply = True
                    if self._take(conn, "after", statement):
                        conn.server.sendall(out + buffer)
                        self.cut.set()
                        self._cut_after(conn)
                        return
                    out, buffer = out + message, buffer[1 + length:]
                if out:
                    conn.server.sendall(out)
        except OSError:
            pass
        if not conn.closed:
            conn.close()

    def _cut_after(self, conn: _Connection) -> None:
        """The client's side goes at once; the server's stays open for reading until the server
        ends it (a close with its data unread could reset the stream before the server read it)."""
        conn.client_gone = True
        try:
            conn.client.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.client.close()
        assert conn.server is not None
        try:
            conn.server.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _from_server(self, conn: _Connection) -> None:
        assert conn.server is not None
        buffer = b""
        answer = b""  # complete messages of the answer in progress, held while its cut is armed
        try:
            while True:
                data = conn.server.recv(65536)
                if not data:
                    break
                if conn.client_gone:
                    continue  # cut after: the server's answers go nowhere
                buffer += data
                while len(buffer) >= 5:
                    length = struct.unpack("!I", buffer[1:5])[0]
                    if len(buffer) < 1 + length:
                        break
                    message, buffer = buffer[:1 + length], buffer[1 + length:]
                    answer += message
                    if message[:1] != b"Z":
                        continue
                    if conn.cut_reply and message[5:6] == b"I":
                        self.cut.set()
                        conn.close()  # this whole answer, up to its end, is never forwarded
                        return
                    conn.client.sendall(answer)
                    answer = b""
                if answer and not conn.cut_reply:
                    conn.client.sendall(answer)
                    answer = b""
        except OSError:
            pass
        if not conn.closed:
            conn.close()
