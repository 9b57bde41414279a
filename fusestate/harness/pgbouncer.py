"""A PgBouncer of this machine's own in front of a PostgreSQL server, for the tests of the
shared engine behind a connection pooler (Debian's ``pgbouncer`` package; ``scripts/setup.sh``
installs it). It listens on 127.0.0.1 only, runs as the ``postgres`` user with trust
authentication, and is removed by :meth:`LocalPgBouncer.close`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from fusestate.harness.postgres import PostgresServerError, free_port


class LocalPgBouncer:
    """PgBouncer in ``mode`` (session, transaction or statement) for every database of the
    server at ``host:port``, with at most ``pool_size`` server connections per database."""

    def __init__(self, host: str, port: int, mode: str = "transaction", pool_size: int = 4,
                 root: Optional[Path] = None) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.access(binary, os.X_OK):
            raise PostgresServerError("PgBouncer is not installed (Debian package pgbouncer; scripts/setup.sh "
                                      "installs it)")
        self.root = Path(tempfile.mkdtemp(prefix="fusestate-pgbouncer-", dir=root))
        shutil.chown(self.root, "postgres", "postgres")
        self.port = free_port()
        self.mode = mode
        (self.root / "users.txt").write_text('"postgres" ""\n')
        (self.root / "pgbouncer.ini").write_text(f"""[databases]
* = host={host} port={port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir = {self.root}
auth_type = trust
auth_file = {self.root}/users.txt
admin_users = postgres
pool_mode = {mode}
default_pool_size = {pool_size}
max_client_conn = 2000
server_reset_query = DISCARD ALL
logfile = {self.root}/pgbouncer.log
pidfile = {self.root}/pgbouncer.pid
""")
        for name in ("users.txt", "pgbouncer.ini"):
            shutil.chown(self.root / name, "postgres", "postgres")
        self.proc = subprocess.Popen([binary, str(self.root / "pgbouncer.ini")], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, user="postgres",
                                     group="postgres", extra_groups=[], start_new_session=True, cwd=self.root)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 20.0) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.admin_url(), autocommit=True, connect_timeout=2).close()
                return
            except psycopg.Error as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.root / "pgbouncer.log")
                    tail = log.read_text()[-400:] if log.exists() else ""
                    self.close()
                    raise PostgresServerError(f"PgBouncer did not start: {exc}; {tail}") from None
                time.sleep(0.1)

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def admin_url(self) -> str:
        return self.url("pgbouncer")

    def show(self, what: str) -> list[dict]:
        """``SHOW POOLS``, ``SHOW SERVERS``, ... of the admin console, as dicts."""
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(self.admin_url(), autocommit=True, prepare_threshold=None) as conn:
            return conn.cursor(row_factory=dict_row).execute(f"SHOW {what}").fetchall()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.root)
