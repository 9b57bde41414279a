"""A PostgreSQL server of this machine's own, for a shared volume's metadata where no
database is given: the Spark cluster harness, the tests and the benchmarks start one.

Debian's ``postgresql`` package provides the binaries; the server is made with initdb in a
temporary directory as the ``postgres`` user, listens on 127.0.0.1 only, and is removed by
:meth:`LocalPostgres.close`. It is not a production database: for one, use your own server
and ``--meta postgresql://...``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from fusestate.errors import UserError


class PostgresServerError(UserError):
    """The local server could not be made, started or stopped."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def postgres_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not found:
        raise PostgresServerError("PostgreSQL is not installed (Debian package postgresql; scripts/setup.sh "
                                  "installs it), or give a database with --meta postgresql://...")
    return found[-1].parent


def server_processes(data: Path) -> list[int]:
    """The postmaster of the server in ``data`` (first), then its children. PostgreSQL puts
    each child in a session of its own, so a signal to the postmaster's process group
    reaches the postmaster alone."""
    try:
        postmaster = int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    children = []
    for task in Path(f"/proc/{postmaster}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            children += [int(pid) for pid in task.read_text().split()]
    return [postmaster, *children]


def freeze(data: Path) -> None:
    """Stop every process of the server (SIGSTOP), the postmaster first so it forks no
    more: its sockets stay open, and whoever waits on them waits for ever, as for a
    server whose machine froze or was cut off."""
    processes = server_processes(data)
    if processes:
        os.kill(processes[0], signal.SIGSTOP)
        for pid in server_processes(data)[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)


def thaw(data: Path) -> None:
    """Undo :func:`freeze`: the children first, then the postmaster."""
    processes = server_processes(data)
    for pid in reversed(processes):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


class LocalPostgres:
    """A server on 127.0.0.1 under a temporary directory.

    ``fsync=False`` for tests: a restart's shutdown checkpoint then takes no time even on a
    disk busy with other tests (only a crash of the machine could lose its data)."""

    def __init__(self, fsync: bool = True, root: Optional[Path] = None) -> None:
        self.fsync = fsync
        self.bin = postgres_bin()
        # Not under a private work dir: the postgres user must reach it.
        self.root = Path(tempfile.mkdtemp(prefix="fusestate-pg-", dir=root))
        self.data = self.root / "data"
        self.port = free_port()
        shutil.chown(self.root, "postgres", "postgres")
        self._as_postgres([str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                           "--no-sync", "-E", "UTF8"])
        self.start()

    def _as_postgres(self, cmd: list[str]) -> None:
        proc = subprocess.run(["runuser", "-u", "postgres", "--", *cmd], capture_output=True, text=True)
        if proc.returncode != 0:
            raise PostgresServerError(f"{' '.join(cmd[:2])} failed: {(proc.stderr or proc.stdout).strip()[-400:]}")

    def _pg_ctl(self, action: str) -> list[str]:
        options = (f"-h 127.0.0.1 -p {self.port} -k {self.root} -c max_connections=200"
                   f" -c fsync={'on' if self.fsync else 'off'}")
        return [str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-o", options,
                "-m", "fast", "-w", action]

    def start(self) -> None:
        self._as_postgres(self._pg_ctl("start"))

    def restart_soon(self, delay: float) -> subprocess.Popen:
        """Restart the server ``delay`` seconds from now, from a process forked now: one
        forked later by a process that holds files open on a mount would close them on
        its way to exec, and a close on a shared volume flushes through this very
        database, so the restart would wait for itself."""
        return subprocess.Popen(["sh", "-c", f"sleep {delay}; exec runuser -u postgres -- \"$@\"", "sh",
                                 *self._pg_ctl("restart")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self, mode: str = "fast") -> None:
        """``mode`` immediate is a crash of the server."""
        self._as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"])

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def close(self) -> None:
        with contextlib.suppress(PostgresServerError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
