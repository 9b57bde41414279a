"""Scenario 11: a shared volume whose metadata database fails over (issue 49's benchmarks).

The volume's metadata is in :class:`fusestate.harness.ha.LocalHA`: Patroni with a
three-member etcd cluster and two PostgreSQL servers (``fsync`` on), the primary's
synchronous standby promoted when the primary is lost. Two parts:

- *failover*: two mounts of one volume (two nodes), each committing files in a loop the
  way a state store does (write 4 KiB and fsync, rename, fsync the directory); the
  primary's machine is lost (its Patroni and PostgreSQL SIGKILLed, as tests/test_ha.py
  does). Per node: the stall, from the loss to the end of the first fsync (of a file or the
  directory) that began after it and was answered, against Patroni's own failover time
  (the loss to the standby taking writes); the fsyncs that answered EIO (the engine's
  "some of this node's commits since its last durable one ran on the lost primary") and the
  renames whose file's create was lost with the primary. The old primary is then started
  again and rejoins as the standby, so each repetition loses the other member.
- *cost*: one mount, the commit pattern (as ``files``: median and p90) and the small-file
  create rate, on the HA cluster with its synchronous standby, the same with an
  asynchronous one (synchronous mode off), and one PostgreSQL server, in one run.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from bench.common import Choices, Context, Metric, error_text, fmt_num, log, record, summarize, text_grid
from bench.pgwork import Meter
from bench.render import goal_row, md_table
from bench.scenarios.files import commit_pattern, percentile, small_files
from bench.systems import FusestateSystem, detach_all_under

NAME = "failover"
TITLE = "Failover of the metadata database"
SUMMARY = ("two nodes commit files while the HA primary is SIGKILLed: stall vs Patroni's failover time; "
           "the synchronous standby's cost")
BUDGET = {"tiny": None, "quick": 900.0, "full": None}
SETUPS = ["HA, synchronous standby", "HA, asynchronous standby", "single server"]
SYNC, ASYNC, SINGLE = SETUPS
NODES = ("a", "b")
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"commits": 20, "files": 50, "phase_seconds": 5.0, "before": 5, "after": 5, "ttl": 10},
    "quick": {"commits": 200, "files": 500, "phase_seconds": 15.0, "before": 20, "after": 20, "ttl": 10},
    "full": {"commits": 500, "files": 2000, "phase_seconds": 30.0, "before": 50, "after": 50, "ttl": 10},
}
# Mounts ride out the failover: a session outlives it, operations retry through it.
MOUNT_ARGS = ["--session-timeout", "60", "--meta-outage-budget", "90"]
COST_METRICS = [
    Metric("commit_p50", "ms", higher_is_better=False, label="commit: write 4 KiB, fsync, rename, fsync dir (median)"),
    Metric("commit_p90", "ms", higher_is_better=False, label="commit (p90)"),
    Metric("server_commit_p50", "ms", higher_is_better=False,
           label="the server alone: one-row INSERT committed (median)"),
    Metric("create", "files/s", label="create 4 KiB file"),
    Metric("rename", "ops/s", label="rename"),
    Metric("unlink", "ops/s", label="unlink"),
]
FAILOVER_METRICS = [
    Metric("promoted_s", "s", higher_is_better=False, label="Patroni: loss to promotion"),
    Metric("stall_a_s", "s", higher_is_better=False, label="node a: loss to first answered fsync"),
    Metric("stall_b_s", "s", higher_is_better=False, label="node b: loss to first answered fsync"),
    Metric("eio_fsyncs", "count", higher_is_better=False, label="fsyncs that answered EIO (both nodes)"),
    Metric("lost_creates", "count", higher_is_better=False, label="creates lost with the primary (both nodes)"),
]
GRACE = 2.0  # s: the goal is a stall of at most Patroni's failover time plus this


# --- a node committing files ---------------------------------------------------------------
@dataclass
class Committer:
    """A node committing 4 KiB files in a thread (write and fsync, rename, fsync the directory)
    until told to stop; every fsync's (start, end, errno) is kept."""

    directory: Path
    fsyncs: list[tuple[float, float, int]] = field(default_factory=list)
    acked: dict[str, bytes] = field(default_factory=dict)
    lost_creates: int = 0
    error: Optional[str] = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: Optional[threading.Thread] = None

    def start(self) -> "Committer":
        self.directory.mkdir(parents=True)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _fsync(self, fd: int) -> bool:
        """fsync ``fd``: True if it succeeded, False if it answered EIO (recorded either way)."""
        t = time.monotonic()
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            self.fsyncs.append((t, time.monotonic(), errno.EIO))
            return False
        self.fsyncs.append((t, time.monotonic(), 0))
        return True

    def _run(self) -> None:
        d = self.directory
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        n = 0
        try:
            while not self.stop.is_set():
                data, tmp, final = os.urandom(4096), d / f"{n:06d}.tmp", d / f"{n:06d}"
                n += 1
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, data)
                    synced = self._fsync(fd)
                finally:
                    os.close(fd)
                if not synced:
                    continue
                try:
                    os.rename(tmp, final)
                except FileNotFoundError:
                    self.lost_creates += 1  # its create, not covered by an fsync of the directory, was lost
                    continue
                if self._fsync(dfd):
                    self.acked[final.name] = data
        except OSError as exc:
            self.error = f"{exc.filename or ''}: {exc.strerror or exc}"
        finally:
            os.close(dfd)

    def commits_after(self, moment: float) -> int:
        return sum(1 for s, _, e in self.fsyncs if s >= moment and not e) // 2

    def wait(self, count: int, after: float, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.commits_after(after) < count and self.error is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.directory.name}: {count} commits did not finish in {timeout:.0f} s")
            time.sleep(0.05)
        if self.error:
            raise RuntimeError(f"{self.directory.name}: {self.error}")

    def finish(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=180)

    def stall_after(self, moment: float) -> Optional[float]:
        """Seconds from ``moment`` to the end of the first fsync that began after it and was
        answered (done, or EIO): how long the node went without a durable commit being served."""
        ends = [end for start, end, _ in self.fsyncs if start >= moment]
        return min(ends) - moment if ends else None

    def eio_after(self, moment: float) -> int:
        return sum(1 for _, end, e in self.fsyncs if e and end >= moment)


# --- the clusters --------------------------------------------------------------------------
def open_setup(name: str, ttl: int) -> Any:
    """A server (fsync on) for ``name``: the HA cluster with a synchronous or an asynchronous
    standby, or one PostgreSQL server."""
    if name == SINGLE:
        from fusestate.harness.postgres import LocalPostgres

        return LocalPostgres(fsync=True)
    from fusestate.harness.ha import LocalHA

    return LocalHA(members=2, fsync=True, ttl=ttl, synchronous=name == SYNC)


def mount(work: Path, node: str, bucket: Path, meta: str, extra: list[str]) -> FusestateSystem:
    s = FusestateSystem(f"node-{node}", work / f"node-{node}", f"file://{bucket}",
                        extra=["--meta", meta, *MOUNT_ARGS, *extra])
    s.start()
    return s


def server_commit_ms(url: str, n: int) -> float:
    """The server's own commit, without a mount: the median of ``n`` one-row INSERTs, each its
    own transaction (``synchronous_commit`` on: with a synchronous standby, on the standby too)."""
    import psycopg

    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        conn.execute("CREATE TABLE bench_commit (x int)")
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            conn.execute("INSERT INTO bench_commit VALUES (1)")
            lat.append(time.perf_counter() - t)
        conn.execute("DROP TABLE bench_commit")
    return 1000 * percentile(lat, 0.5)


def cost_run(server: Any, setup: str, work: Path, repeat: int, p: dict[str, Any],
             extra: list[str]) -> dict[str, Any]:
    """One mount on a fresh volume of ``server``: the commit pattern and the small-file rates."""
    db = f"cost{repeat}{SETUPS.index(setup)}"
    root = work / f"cost-r{repeat}-{SETUPS.index(setup)}"
    (root / "bucket").mkdir(parents=True)
    node: Optional[FusestateSystem] = None
    try:
        meta = server.create_database(db)
        server_commit = server_commit_ms(meta, p["commits"])
        node = mount(root, "a", root / "bucket", meta, extra)
        meter = Meter([], None, 0.0)
        lat = commit_pattern(node.path / "commit", p["commits"], p["phase_seconds"], meter)
        rates = small_files(node.path / "small", p["files"], p["phase_seconds"], meter)
        metrics = {"commit_p50": 1000 * percentile(lat, 0.5), "commit_p90": 1000 * percentile(lat, 0.9),
                   "server_commit_p50": server_commit, **{k: rates[k] for k in ("create", "rename", "unlink")}}
        log(f"  {NAME} r{repeat + 1} {setup:<25} commit p50 {metrics['commit_p50']:.1f} ms "
            f"p90 {metrics['commit_p90']:.1f} ms, {metrics['create']:.0f} creates/s; "
            f"the server's commit {server_commit:.2f} ms")
        return record(setup, repeat, "cost", metrics, commits=len(lat))
    except Exception as exc:  # noqa: BLE001 - a failed run is a result
        log(f"  {NAME} r{repeat + 1} {setup}: ERROR {error_text(exc)}")
        return record(setup, repeat, "cost", error=error_text(exc))
    finally:
        if node is not None:
            node.stop()


def failover_run(ha: Any, work: Path, repeat: int, p: dict[str, Any], extra: list[str]) -> dict[str, Any]:
    """Two nodes commit; the primary's machine is lost; the standby is promoted; both go on.
    Then the lost member is started again and the cluster waits until it is the standby."""
    root = work / f"failover-r{repeat}"
    (root / "bucket").mkdir(parents=True)
    nodes: list[FusestateSystem] = []
    writers: list[Committer] = []
    try:
        meta = ha.create_database(f"failover{repeat}")
        for n in NODES:
            nodes.append(mount(root, n, root / "bucket", meta, extra))
        writers = [Committer(s.path / f"w{n}").start() for s, n in zip(nodes, NODES)]
        t0 = time.monotonic()
        for w in writers:
            w.wait(p["before"], t0, 120)
        old = ha.primary()
        if old is None:
            raise RuntimeError("no primary before the loss")
        kill_started = time.monotonic()
        ha.kill(old)
        # The loss is when the old primary's processes are gone: until then it still answers,
        # and a commit it answers is on the standby (synchronous), not a stall.
        lost_at = time.monotonic()
        new = ha.wait_primary(timeout=120, other_than=old)
        promoted = time.monotonic() - lost_at
        for w in writers:
            w.wait(p["after"], lost_at + promoted, 180)
        for w in writers:
            w.finish()
        stalls = [w.stall_after(lost_at) for w in writers]
        # Every acknowledged file reads back whole on both nodes.
        missing = sum(1 for s in nodes for w in writers for name, data in w.acked.items()
                      if _read(s.path / w.directory.name / name) != data)
        metrics = {"promoted_s": promoted, "stall_a_s": stalls[0], "stall_b_s": stalls[1],
                   "eio_fsyncs": sum(w.eio_after(lost_at) for w in writers),
                   "lost_creates": sum(w.lost_creates for w in writers),
                   "acked_files": sum(len(w.acked) for w in writers), "acked_missing": missing}
        log(f"  {NAME} r{repeat + 1} {old.name} lost, {new.name} promoted after {promoted:.1f} s; stalls "
            + ", ".join(f"{s:.1f} s" if s is not None else "—" for s in stalls)
            + f"; EIO fsyncs {metrics['eio_fsyncs']}, creates lost {metrics['lost_creates']}, "
              f"acknowledged files missing {missing} of {metrics['acked_files']}")
        ha.start(old)
        ha.wait_healthy(timeout=180)
        return record(SYNC, repeat, "failover", metrics, lost=old.name, promoted=new.name,
                      kill_seconds=round(lost_at - kill_started, 3))
    except Exception as exc:  # noqa: BLE001 - a failed run is a result
        log(f"  {NAME} r{repeat + 1} failover: ERROR {error_text(exc)}")
        return record(SYNC, repeat, "failover", error=error_text(exc))
    finally:
        for w in writers:
            w.finish()
        for s in reversed(nodes):
            s.stop()


def _read(path: Path) -> Optional[bytes]:
    try:
        return path.read_bytes()
    except OSError:
        return None


def choices(size: str) -> Choices:  # noqa: ARG001 - the same at every size
    """The systems ``--systems`` may name here, and those run without it."""
    return Choices(SETUPS, SETUPS)


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    setups = ctx.chosen(choices(ctx.size))
    ctx.work.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    servers: dict[str, Any] = {}
    try:
        for name in setups:
            try:
                servers[name] = open_setup(name, p["ttl"])
            except Exception as exc:  # noqa: BLE001 - a setup that cannot start is a result
                servers[name] = None
                runs.append(record(name, 0, "cost", error=error_text(exc)))
        for repeat in ctx.repetitions():
            for name in setups:  # interleaved: the three setups in turn, in each repetition
                if servers[name] is not None:
                    runs.append(cost_run(servers[name], name, ctx.work, repeat, p, ctx.mount_options))
        for name in setups:  # the failover gets the machine to itself
            if name != SYNC and servers.get(name) is not None:
                servers.pop(name).close()
        if servers.get(SYNC) is not None:
            for repeat in range(ctx.done_repeats or 1):
                runs.append(failover_run(servers[SYNC], ctx.work, repeat, p, ctx.mount_options))
    finally:
        detach_all_under(ctx.work)
        for s in servers.values():
            if s is not None:
                s.close()
    costs = [r for r in runs if r["variant"] == "cost"]
    fails = [r for r in runs if r["variant"] == "failover"]
    return {"params": {**p, "mount_args": MOUNT_ARGS, "grace_s": GRACE}, "systems": setups,
            "summary": summarize(costs, COST_METRICS, setups, ["cost"], baseline=SINGLE),
            "failover": summarize(fails, FAILOVER_METRICS, [SYNC], ["failover"], baseline=SYNC) if fails else [],
            "runs": runs}


# --- tables --------------------------------------------------------------------------------
def failover_table(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One line per repetition: who was lost, Patroni's time, each node's stall, EIO fsyncs."""
    head = ["repetition", "lost → promoted", "Patroni: loss to promotion (s)", "node a stall (s)",
            "node b stall (s)", "fsyncs answering EIO", "creates lost", "acknowledged files missing"]
    body = []
    for r in [r for r in doc.get("runs", []) if r["variant"] == "failover"]:
        m = r["metrics"]
        if r.get("error"):
            body.append([r["repeat"] + 1, "failed", "", "", "", "", "", ""])
            continue
        body.append([r["repeat"] + 1, f"{r.get('lost')} → {r.get('promoted')}", f"{m['promoted_s']:.1f}",
                     _s(m.get("stall_a_s")), _s(m.get("stall_b_s")), m["eio_fsyncs"], m["lost_creates"],
                     f"{m['acked_missing']} of {m['acked_files']}"])
    return head, body


def cost_table(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    names = doc["systems"]
    head = ["metric", "unit", *names]
    body = [[r["label"], r["unit"], *[_cell(r, n) for n in names]] for r in doc["summary"]]
    return head, body


def _s(x: Optional[float]) -> str:
    return f"{x:.1f}" if x is not None else "—"


def _cell(row: dict[str, Any], name: str) -> str:
    c = row["systems"].get(name)
    if c is None:
        return "—"
    if c["median"] is None:
        return "failed"
    r = row["ratio"].get(name)
    return fmt_num(c["median"], row["unit"]) + (f" ({r:.2f})" if r is not None and name != SINGLE else "")


def terminal(doc: dict[str, Any]) -> str:
    return (f"failover (SIGKILL of the primary's machine), two nodes committing\n{text_grid(*failover_table(doc))}\n\n"
            f"cost of the standby, one mount (ratio against one server)\n{text_grid(*cost_table(doc))}")


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:  # noqa: ARG001 - no plot
    p = doc["params"]
    text = (f"Metadata in Patroni's cluster (three etcd members, two PostgreSQL servers with `fsync` on, on loopback "
            f"addresses; leader key ttl {p['ttl']} s, loop_wait 1 s). *Failover*: two mounts of one volume "
            f"(`{' '.join(p['mount_args'])}`) each commit 4 KiB files in a loop (write and fsync, rename, fsync "
            f"the directory); after {p['before']} commits on each, the primary's Patroni and PostgreSQL processes "
            f"are SIGKILLed (its machine lost; the loss is the moment the last of them is gone); once the synchronous standby takes writes, each node commits "
            f"{p['after']} more; the lost member is started again and rejoins as the standby before the next "
            f"repetition, which loses the other member. A node's stall is the time from the loss to the end of "
            f"the first fsync (of a file or the directory) that began after it and was answered; Patroni's time "
            f"is the loss to the standby taking writes (polled every 0.2 s). Every acknowledged file is then read "
            f"on both nodes. *Cost*: one mount on a fresh volume, the commit pattern {p['commits']:,} times (or "
            f"{p['phase_seconds']:g} s) and up to {p['files']:,} files of 4 KiB created, renamed, unlinked (and, "
            f"for the server alone, {p['commits']:,} one-row INSERTs from psycopg, each its own transaction), on the "
            f"HA cluster with its synchronous standby, with an asynchronous one (Patroni's synchronous mode off), "
            f"and on one PostgreSQL server (`fsync` on), in turn in each repetition; medians, ratio against one "
            f"server in brackets.")
    return f"{text}\n\n{md_table(*failover_table(doc))}\n\n{md_table(*cost_table(doc))}"


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 49: each node's stall at most Patroni's own failover time plus 2 s, per repetition."""
    out = []
    for r in [r for r in doc.get("runs", []) if r["variant"] == "failover" and not r.get("error")]:
        m = r["metrics"]
        stall = max((m.get(k) for k in ("stall_a_s", "stall_b_s") if m.get(k) is not None), default=None)
        out.append(goal_row(f"repetition {r['repeat'] + 1}: longest stall ≤ failover time + {GRACE:g} s",
                            f"{_s(stall)} s against {m['promoted_s']:.1f} + {GRACE:g} s",
                            stall is not None and stall <= m["promoted_s"] + GRACE))
    fails = [r for r in doc.get("runs", []) if r["variant"] == "failover"]
    if fails:
        missing = sum(r["metrics"].get("acked_missing", 0) for r in fails if not r.get("error"))
        out.append(goal_row("no acknowledged file lost", f"{missing} missing", missing == 0 and
                            not any(r.get("error") for r in fails)))
    return out
