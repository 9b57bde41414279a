"""Scenario: the daemon's CPU seconds per GiB written and read, the yardstick for its cost per byte.

On two cores that Spark keeps busy, every second of CPU the daemon spends is a second the
job does not get, so the daemon's cost is measured per byte rather than as throughput.
Files of distinct blocks are written through the mount in 1 MiB writes with an ``fsync``
per file, read back from the node's disk cache, then read again on a fresh node (the
volume remounted on an empty cache dir: every block from the bucket). The daemon's user
and system seconds for each phase come from ``/proc/<pid>/stat`` (JuiceFS: its mount
process's), and on a shared volume PostgreSQL's own work per GiB (:mod:`bench.pgwork`)
beside it: ``fusestate-pg`` against ``juicefs-pg`` on the same server. The kernel's page cache
is dropped before every phase (as root), so every read reaches the daemon, and so runs stay
comparable on an ext4 without a journal, where creating files slows down while the inode
table blocks of recently deleted files stay cached.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from bench.common import Choices, Context, Metric, error_text, log, record, repetitions, summarize
from bench.pgwork import FLUSH_WAIT, Meter, cpu_seconds
from bench.render import goal_row, ratio_between, variant_table
from bench.systems import System, drop_all_caches, open_systems

NAME = "daemon-cpu"
TITLE = "Daemon CPU per GiB"
SUMMARY = "the daemon's user and system CPU seconds per GiB: writing, reading back, reading on a fresh node"
BUDGET = {"tiny": None, "quick": 120.0, "full": None}
SYSTEMS = ["fusestate-file", "fusestate-pg", "juicefs-pg"]
PEER = "juicefs-pg"  # the ratios: each system against JuiceFS on the same PostgreSQL server
MIB = 1 << 20
# pg_wait: how long after a phase PostgreSQL's counters are read (tiny does not report them).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"files": 2, "file_mib": 32, "pg_wait": None},
    "quick": {"files": 1, "file_mib": 1024, "pg_wait": FLUSH_WAIT},
    "full": {"files": 3, "file_mib": 1024, "pg_wait": FLUSH_WAIT},
}
PHASES = ["write", "read back", "read on a fresh node"]
METRICS = [
    Metric("cpu_s_per_gib", "s/GiB", higher_is_better=False, label="daemon CPU"),
    Metric("user_s_per_gib", "s/GiB", higher_is_better=False, label="of which user"),
    Metric("sys_s_per_gib", "s/GiB", higher_is_better=False, label="of which system"),
    Metric("mib_per_s", "MiB/s", label="throughput"),
    Metric("pg_xacts", "/GiB", higher_is_better=False, label="PostgreSQL transactions"),
    Metric("pg_rows", "/GiB", higher_is_better=False, label="rows changed"),
    Metric("pg_wal_records", "/GiB", higher_is_better=False, label="WAL records"),
    Metric("pg_wal_bytes", "B", higher_is_better=False, label="WAL bytes per GiB"),
]


def measured(s: System, gib: float, work: Callable[[], None], meter: Meter, phase: str) -> dict[str, float]:
    """Run ``work()`` and return the daemon's CPU per GiB, the throughput it reached and, on a
    shared volume, PostgreSQL's work per GiB."""
    drop_all_caches()
    pid = s.daemon_pid()
    assert pid is not None
    with meter.phase(phase) as ph:
        (user0, sys0), t = cpu_seconds(pid), time.monotonic()
        work()
        (user1, sys1), wall = cpu_seconds(pid), time.monotonic() - t
        ph.ops = gib
    user, system = (user1 - user0) / gib, (sys1 - sys0) / gib
    pg = {k: v for k, v in meter.costs[phase].items() if k.startswith("pg_")}
    return {"cpu_s_per_gib": user + system, "user_s_per_gib": user, "sys_s_per_gib": system,
            "mib_per_s": gib * 1024 / wall, **pg}


def write_files(paths: list[Path], file_mib: int, seed: bytes) -> None:
    for n, path in enumerate(paths):
        with open(path, "wb", buffering=0) as f:
            for off in range(file_mib):  # distinct blocks: nothing deduplicates
                f.write((n << 32 | off).to_bytes(8, "little") + seed[8:])
            os.fsync(f.fileno())


def read_files(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(MIB):
                pass


def one_run(s: System, repeat: int, p: dict[str, Any]) -> list[dict[str, Any]]:
    """The three phases on one system; the files are removed afterwards. A new seed per run: the
    volume keeps the blocks of earlier runs until garbage collection, and must not find them again."""
    paths = [s.path / f"cpu-r{repeat}-{n}" for n in range(p["files"])]
    seed = os.urandom(MIB)
    gib = p["files"] * p["file_mib"] / 1024
    meter = Meter([], s.database() if p["pg_wait"] is not None else None, p["pg_wait"] or 0.0)
    try:
        out = {"write": measured(s, gib, lambda: write_files(paths, p["file_mib"], seed), meter, "write"),
               "read back": measured(s, gib, lambda: read_files(paths), meter, "read back")}
        s.make_cold(paths)  # a fresh node: unmount, empty cache dir, mount again
        out["read on a fresh node"] = measured(s, gib, lambda: read_files(paths), meter, "read on a fresh node")
    except Exception as exc:  # noqa: BLE001 - a failed run is a result
        log(f"  {NAME} r{repeat + 1} {s.name}: ERROR {error_text(exc)}")
        return [record(s.name, repeat, phase, error=error_text(exc)) for phase in PHASES]
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    log(f"  {NAME} r{repeat + 1} {s.name}: " + ", ".join(f"{k} {v['cpu_s_per_gib']:.2f} s/GiB" for k, v in out.items()))
    return [record(s.name, repeat, phase, metrics) for phase, metrics in out.items()]


def choices(size: str) -> Choices:  # noqa: ARG001 - the same at every size
    """The systems ``--systems`` may name here, and those run without it."""
    return Choices(SYSTEMS + ["fusestate-native", "fusestate-passthrough"], SYSTEMS)


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    names = ctx.chosen(choices(ctx.size))
    runs: list[dict[str, Any]] = []
    with open_systems(names, ctx.work, fusestate_extra=ctx.mount_options, shape=ctx.shape) as systems:
        for repeat in ctx.repetitions():
            for s in systems.values():
                if not s.error and s.daemon_pid() is not None:
                    runs += one_run(s, repeat, p)
                else:
                    runs += [record(s.name, repeat, phase, error=s.error or "no daemon") for phase in PHASES]
    return {"params": p, "systems": names, "summary": summarize(runs, METRICS, names, PHASES, baseline=PEER),
            "runs": runs}


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:  # noqa: ARG001 - no plot
    p = doc["params"]
    text = (f"{p['files']} file(s) of {p['file_mib']:,} MiB of distinct blocks written through a `file://` mount in "
            f"1 MiB writes with an `fsync` per file, read back from the node's disk cache, then read on a fresh node "
            f"(remounted on an empty cache dir); the kernel's page cache dropped before each phase. The daemon's CPU "
            f"seconds per GiB from `/proc/<pid>/stat` (JuiceFS: its mount process's); on a shared volume, "
            f"PostgreSQL's own work per GiB (transactions and rows changed in the volume's database, the server's "
            f"WAL records and bytes), read once every backend has published its counters. Median of "
            f"{repetitions(doc)} repetition(s); ratio against {PEER} in brackets.")
    return "\n\n".join([text, variant_table(doc["summary"], doc["systems"], [m.name for m in METRICS], "phase")])


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 46: the shared volume's daemon spends at most JuiceFS's CPU per GiB written."""
    row = next((r for r in doc["summary"] if r["variant"] == "write" and r["metric"] == "cpu_s_per_gib"), None)
    if row is None or not {"fusestate-pg", PEER} <= set(row["systems"]):
        return []
    r = ratio_between(row, "fusestate-pg", PEER)
    return [goal_row(f"daemon CPU per GiB written, fusestate-pg / {PEER} ≤ 1",
                     f"{r:.2f}" if r is not None else "no number", r is not None and r <= 1.0)]
