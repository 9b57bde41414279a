"""PostgreSQL's own work over a stretch of a benchmark, and a daemon's CPU beside it.

A shared volume's metadata costs the database server work on every operation: transactions,
changed rows, WAL. :class:`Meter` reads ``pg_stat_database`` (of the volume's database) and
``pg_stat_wal`` (the server's) before and after each measured phase, and the daemon's CPU
seconds from ``/proc``, so each phase's cost can be divided by its operations; given the
server's postmaster, the whole server's CPU too (:func:`server_cpu_seconds`).

A backend publishes its counters at most once a second, and an idle backend holding
unpublished ones does so 10 s after they began to wait (``PGSTAT_IDLE_INTERVAL`` in
PostgreSQL 15 and later). So the counters after a phase are read :data:`FLUSH_WAIT`
seconds after it ended; the CPU is read at once. Whatever the daemons do in the
background meanwhile (heartbeats) is counted with the phase: small next to a phase's
hundreds of operations, and the same for every system.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

FLUSH_WAIT = 11.0        # s: PGSTAT_IDLE_INTERVAL (10 s) and a margin
REUSE_WITHIN = 0.5       # s: a reading this recent still stands for "before" the next phase
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PG_FIELDS = ("pg_xacts", "pg_rows", "pg_wal_records", "pg_wal_bytes")


def postmaster_pid(data_dir: str | os.PathLike) -> int:
    """The server's first process, from ``postmaster.pid`` in its data directory."""
    return int((Path(data_dir) / "postmaster.pid").read_text().split()[0])


def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def server_cpu_seconds(postmaster: int) -> float:
    """The whole server's CPU seconds so far: the postmaster's own, its live processes' (backends,
    WAL writer, checkpointer, autovacuum) and those of the ones that ended (which the postmaster
    reaped: its children's time). Other servers on the machine are not counted."""
    try:
        children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
    except OSError:
        children = []
    total = 0
    for child in children:
        try:
            fields = _stat_fields(int(child))
        except (OSError, ValueError):
            continue  # ended meanwhile: the postmaster's children's time has it once reaped
        total += int(fields[11]) + int(fields[12])
    own = _stat_fields(postmaster)
    total += sum(int(x) for x in own[11:15])  # utime, stime, cutime, cstime
    return total / CLOCK_TICKS


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system seconds of the whole process, threads that have exited included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def pg_counters(server_url: str, database: str) -> dict[str, float]:
    """Transactions and changed rows of ``database``, WAL records and bytes of the server, so far."""
    import psycopg

    with psycopg.connect(server_url, autocommit=True) as conn:
        xacts, rows = conn.execute(
            "SELECT xact_commit + xact_rollback, tup_inserted + tup_updated + tup_deleted "
            "FROM pg_stat_database WHERE datname = %s", (database,)).fetchone()
        records, wal_bytes = conn.execute("SELECT wal_records, wal_bytes FROM pg_stat_wal").fetchone()
    return {"pg_xacts": float(xacts), "pg_rows": float(rows), "pg_wal_records": float(records),
            "pg_wal_bytes": float(wal_bytes)}


@dataclass
class Database:
    """Where a system keeps its metadata: the server (any database of it to connect to) and its database."""

    server_url: str
    name: str


class Meter:
    """Each phase's daemon CPU and PostgreSQL work, per operation.

    ``pids`` are the daemons' (none, as on local disk; two for a change on one node seen on
    another, whose cost is both nodes'); ``db`` the system's
    metadata database (None: no PostgreSQL). ``wait`` is how long after a phase the
    database's counters are read (:data:`FLUSH_WAIT`; 0 only where the numbers do not
    matter, such as a run that tests the harness). ``server``: the postmaster's pid, for the
    server's CPU per operation (``pg_cpu_ms``), read at once like the daemons'."""

    def __init__(self, pids: Sequence[Optional[int]], db: Optional[Database], wait: float = FLUSH_WAIT,
                 server: Optional[int] = None) -> None:
        self.pids, self.db, self.wait, self.server = [p for p in pids if p], db, wait, server
        self._pg: Optional[dict[str, float]] = None
        self._pg_at = 0.0
        self.costs: dict[str, dict[str, float]] = {}

    def _settled_pg(self) -> Optional[dict[str, float]]:
        if self.db is None:
            return None
        if self._pg is None or time.monotonic() - self._pg_at > REUSE_WITHIN:
            time.sleep(self.wait)  # what happened since the last reading is published, and not ours
            self._read_pg()
        return self._pg

    def _read_pg(self) -> None:
        assert self.db is not None
        self._pg = pg_counters(self.db.server_url, self.db.name)
        self._pg_at = time.monotonic()

    def phase(self, op: str) -> "Phase":
        return Phase(self, op)

    def cpu(self) -> Optional[float]:
        return sum(sum(cpu_seconds(p)) for p in self.pids) if self.pids else None


class Phase:
    """``with meter.phase("create") as ph: ...; ph.ops = n``: the cost of that block, per operation."""

    def __init__(self, meter: Meter, op: str) -> None:
        self.meter, self.op = meter, op
        self.ops = 0.0

    def __enter__(self) -> "Phase":
        self.pg0 = self.meter._settled_pg()
        self.cpu0 = self.meter.cpu()
        self.server0 = server_cpu_seconds(self.meter.server) if self.meter.server else None
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self.meter._pg = None  # a failed phase leaves nothing to compare against
            return
        m = self.meter
        cpu1 = m.cpu()
        server1 = server_cpu_seconds(m.server) if m.server else None
        out: dict[str, float] = {"ops": self.ops}
        if self.ops > 0 and self.cpu0 is not None and cpu1 is not None:
            out["cpu_ms"] = 1000 * (cpu1 - self.cpu0) / self.ops
        if self.ops > 0 and self.server0 is not None and server1 is not None:
            out["pg_cpu_ms"] = 1000 * (server1 - self.server0) / self.ops
        if self.pg0 is not None:
            time.sleep(m.wait)
            m._read_pg()
            assert m._pg is not None
            if self.ops > 0:
                out.update({k: (m._pg[k] - self.pg0[k]) / self.ops for k in PG_FIELDS})
        m.costs[self.op] = out
