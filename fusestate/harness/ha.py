"""PostgreSQL made highly available on this machine, for the tests and the Spark cluster
harness: Patroni with a three-member etcd cluster, from Debian's ``patroni`` and
``etcd-server`` packages (``scripts/setup.sh`` installs them).

Each part listens on a loopback address of its own (etcd on 127.0.0.21-23, the
PostgreSQL members on 127.0.0.11 and up, each with its Patroni REST API beside it), on
free ports, under a temporary directory, and runs as the ``postgres`` user. Patroni runs
in synchronous mode: the primary's ``synchronous_standby_names`` names the standby while
it streams, so a commit made with ``synchronous_commit = on`` (what fsync waits for) is
on the standby when it returns, and only that standby may be promoted. When no standby
is left, Patroni empties the setting and commits go on (not ``synchronous_mode_strict``).

A member is lost as a machine would be: :meth:`LocalHA.kill` SIGKILLs its Patroni and
every PostgreSQL process (PostgreSQL alone would be restarted in place by Patroni, which
still holds the leader key); :meth:`LocalHA.freeze` stops them all with SIGSTOP, sockets
open. The leader key expires after ``ttl`` seconds and the synchronous standby is
promoted. :meth:`LocalHA.start` (after a kill) or :meth:`LocalHA.thaw` (after a
freeze) brings the member back; Patroni demotes it if it was the primary, rewinds it
with ``pg_rewind`` and makes it a standby of the new primary.

Not a production setup (no passwords, trust authentication on loopback, fsync off by
default): for that, see docs/deploy.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fusestate.harness.postgres import PostgresServerError, free_port, freeze, postgres_bin, server_processes, thaw

ETCD_ADDRESSES = ("127.0.0.21", "127.0.0.22", "127.0.0.23")
MEMBER_ADDRESS = "127.0.0.{}"  # member i (from 1) on 127.0.0.(10 + i)


class HAServerError(PostgresServerError):
    """The HA cluster could not be made, started or brought to the wanted state."""


def ha_binaries() -> tuple[str, str]:
    """The ``etcd`` and ``patroni`` executables, or one clear error."""
    etcd, patroni = shutil.which("etcd"), shutil.which("patroni")
    if not etcd or not patroni:
        raise HAServerError("Patroni or etcd is not installed (Debian packages patroni and etcd-server; "
                            "scripts/setup.sh installs them)")
    return etcd, patroni


@dataclass
class Member:
    """One PostgreSQL server with its Patroni."""

    name: str
    host: str
    port: int
    rest_port: int
    data: Path
    config: Path
    log: Path
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class LocalHA:
    """Three etcd members and ``members`` PostgreSQL servers under Patroni, started at
    construction and healthy (a primary, and a synchronous standby streaming from it;
    an asynchronous one with ``synchronous=False``) when it returns. ``close`` removes
    everything."""

    def __init__(self, members: int = 2, root: Optional[Path] = None, fsync: bool = False, ttl: int = 10,
                 loop_wait: int = 1, retry_timeout: int = 3, synchronous: bool = True,
                 start_timeout: float = 120.0) -> None:
        self.etcd_bin, self.patroni_bin = ha_binaries()
        self.bin = postgres_bin()
        self.root = Path(tempfile.mkdtemp(prefix="fusestate-ha-", dir=root))
        shutil.chown(self.root, "postgres", "postgres")
        self.fsync, self.ttl, self.loop_wait, self.retry_timeout = fsync, ttl, loop_wait, retry_timeout
        self.synchronous = synchronous
        self._etcd: list[subprocess.Popen] = []
        self.etcd_clients: list[str] = []
        self.members: list[Member] = []
        try:
            self._start_etcd()
            for i in range(1, members + 1):
                host = MEMBER_ADDRESS.format(10 + i)
                member = Member(f"pg{i}", host, free_port(host), free_port(host), self.root / f"pg{i}",
                                self.root / f"pg{i}.yml", self.root / f"pg{i}.log")
                self._write_config(member)
                self.members.append(member)
            started = time.monotonic()
            self.start(self.members[0])
            self.wait_primary(timeout=start_timeout)  # the first member bootstraps the cluster
            for member in self.members[1:]:
                self.start(member)
            self.wait_healthy(timeout=max(10.0, start_timeout - (time.monotonic() - started)))
        except BaseException:
            self.close()
            raise

    # --- processes ------------------------------------------------------------------------
    def _spawn(self, argv: list[str], log: Path) -> subprocess.Popen:
        with open(log, "ab") as out:
            os.chown(log, *_postgres_ids())
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=self.root,
                                    user="postgres", group="postgres", extra_groups=[], start_new_session=True,
                                    env={"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(self.root),
                                         "LANG": "C.UTF-8"})

    def _start_etcd(self) -> None:
        peers = [(host, free_port(host), free_port(host)) for host in ETCD_ADDRESSES]
        cluster = ",".join(f"etcd{i}=http://{host}:{peer}" for i, (host, peer, _) in enumerate(peers))
        for i, (host, peer, client) in enumerate(peers):
            self._etcd.append(self._spawn([
                self.etcd_bin, "--name", f"etcd{i}", "--data-dir", str(self.root / f"etcd{i}"),
                "--listen-peer-urls", f"http://{host}:{peer}", "--initial-advertise-peer-urls", f"http://{host}:{peer}",
                "--listen-client-urls", f"http://{host}:{client}", "--advertise-client-urls", f"http://{host}:{client}",
                "--listen-metrics-urls", f"http://{host}:{free_port(host)}",
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", self.root.name, "--log-level", "warn", "--enable-v2=true"],
                self.root / f"etcd{i}.log"))
            self.etcd_clients.append(f"{host}:{client}")

    def _write_config(self, m: Member) -> None:
        parameters = {"max_connections": 300, "fsync": "on" if self.fsync else "off", "wal_log_hints": "on",
                      "unix_socket_directories": str(m.data.parent / f"{m.name}.sock"),
                      "wal_keep_size": "256MB"}
        (m.data.parent / f"{m.name}.sock").mkdir()
        shutil.chown(m.data.parent / f"{m.name}.sock", "postgres", "postgres")
        config: dict[str, Any] = {
            "scope": self.root.name, "name": m.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"{m.host}:{m.rest_port}", "connect_address": f"{m.host}:{m.rest_port}"},
            # etcd's v2 API: Patroni 3.0.2 renews its leader key there with a compare-and-swap on
            # its own name. Through the v3 API it puts the key back unconditionally once its
            # lease was renewed: a leader frozen past its ttl and thawed took the key back from
            # the standby promoted meanwhile, which was then rewound onto the old timeline,
            # losing what had been committed on it.
            "etcd": {"hosts": ",".join(self.etcd_clients)},
            "bootstrap": {
                "dcs": {"ttl": self.ttl, "loop_wait": self.loop_wait, "retry_timeout": self.retry_timeout,
                        "synchronous_mode": self.synchronous,
                        "postgresql": {"use_pg_rewind": True, "parameters": parameters}},
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}, "no-sync"],
                "pg_hba": ["local all all trust", "host replication all 127.0.0.0/8 trust",
                           "host all all 127.0.0.0/8 trust"],
            },
            "postgresql": {
                "listen": f"{m.host}:{m.port}", "connect_address": f"{m.host}:{m.port}",
                "data_dir": str(m.data), "bin_dir": str(self.bin), "pgpass": str(self.root / f"{m.name}.pgpass"),
                "authentication": {"superuser": {"username": "postgres"}, "replication": {"username": "postgres"},
                                   "rewind": {"username": "postgres"}},
                "parameters": {"unix_socket_directories": str(m.data.parent / f"{m.name}.sock")},
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
            },
        }
        m.config.write_text(json.dumps(config, indent=2))  # YAML is a superset of JSON
        shutil.chown(m.config, "postgres", "postgres")

    def start(self, member: Member) -> None:
        """Start (or start again, after :meth:`kill`) the member's Patroni, which starts its
        PostgreSQL: as the primary of a new cluster, or as a standby of the primary."""
        if member.proc is not None and member.proc.poll() is None:
            return
        member.proc = self._spawn([self.patroni_bin, str(member.config)], member.log)

    def kill(self, member: Member) -> None:
        """The member's machine is lost: SIGKILL its Patroni and its PostgreSQL processes."""
        if member.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(member.proc.pid, signal.SIGKILL)
            member.proc.wait()
        for pid in server_processes(member.data):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_gone(server_processes(member.data))

    def freeze(self, member: Member) -> None:
        """The member's machine freezes, its sockets open: SIGSTOP its Patroni's process
        group and every PostgreSQL process."""
        if member.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(member.proc.pid, signal.SIGSTOP)
        freeze(member.data)

    def freeze_server(self, member: Member) -> None:
        """Only the member's PostgreSQL freezes; its Patroni goes on (and, finding its server
        unresponsive for ``ttl`` seconds, gives up its place in the cluster)."""
        freeze(member.data)

    def thaw(self, member: Member) -> None:
        thaw(member.data)
        if member.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(member.proc.pid, signal.SIGCONT)

    # --- state ----------------------------------------------------------------------------
    def cluster(self) -> list[dict[str, Any]]:
        """Patroni's view of the members (its REST API's ``/cluster``), from any member that answers."""
        for m in self.members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"http://{m.host}:{m.rest_port}/cluster", timeout=1) as reply:
                    return list(json.load(reply)["members"])
        return []

    def primary(self) -> Optional[Member]:
        """The member Patroni calls the leader, if it runs."""
        for state in self.cluster():
            if state.get("role") == "leader" and state.get("state") == "running":
                return self._member(state["name"])
        return None

    def _member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def wait_primary(self, timeout: float = 60.0, other_than: Optional[Member] = None) -> Member:
        """The running primary, once there is one (other than ``other_than``) that takes writes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            primary = self.primary()
            if primary is not None and primary is not other_than and self._takes_writes(primary):
                return primary
            time.sleep(0.2)
        raise HAServerError(f"no primary after {timeout:.0f} s: {self.cluster()}; see the logs in {self.root}")

    def wait_healthy(self, timeout: float = 60.0) -> Member:
        """A primary and every other member a streaming standby, one of them synchronous."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.cluster()
            roles = sorted(s.get("role", "") for s in states)
            standby = "sync_standby" if self.synchronous else "replica"
            if (len(states) == len(self.members) and "leader" in roles and standby in roles
                    and all(s.get("state") in ("running", "streaming") for s in states)):
                return self.wait_primary(timeout=max(1.0, deadline - time.monotonic()))
            time.sleep(0.2)
        raise HAServerError(f"not healthy after {timeout:.0f} s: {self.cluster()}; see the logs in {self.root}")

    def _takes_writes(self, m: Member) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.member_url(m), connect_timeout=2, autocommit=True) as conn:
                return not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]
        except psycopg.Error:
            return False

    # --- URLs -----------------------------------------------------------------------------
    def url(self, database: str = "postgres") -> str:
        """The libpq multi-host URL of the cluster: every member, the one that takes writes wins."""
        servers = ",".join(m.address for m in self.members)
        return f"postgresql://postgres@{servers}/{database}?target_session_attrs=read-write"

    def member_url(self, member: Member, database: str = "postgres") -> str:
        return f"postgresql://postgres@{member.address}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def close(self) -> None:
        """Stop everything (SIGKILL: nothing here is worth a clean shutdown) and remove it."""
        for m in self.members:
            self.thaw(m)
            self.kill(m)
        for proc in self._etcd:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _postgres_ids() -> tuple[int, int]:
    import pwd

    entry = pwd.getpwnam("postgres")
    return entry.pw_uid, entry.pw_gid


def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                    break  # a zombie: dead, waiting for its parent
            time.sleep(0.05)
