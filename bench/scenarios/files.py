"""Scenario 2: plain file I/O with fio, and the small-file metadata rate, on every system.

fio writes one file sequentially in 1 MiB blocks and fsyncs it at the end (so every system
pays for making the data durable in its own way), reads it back sequentially and in
random 4 KiB reads (fio drops the file's page cache first: the system's own caches are
warm), then once more sequentially after the system's caches are made cold. The
small-file phase creates, stats, lists, renames and unlinks many 4 KiB files (each phase
bounded in time, so a slow peer costs seconds, not the run): the metadata rate, where
``fusestate-pg`` (the shared PostgreSQL engine) and ``fusestate-file`` (the embedded SQLite
engine) differ most. Then the commit pattern of a state store (write 4 KiB, fsync, rename,
fsync the directory) and, where a volume takes a second mount (``fusestate-pg`` and the
JuiceFS systems: another node's mountpoint and cache dir, the same metadata), how long a file
closed on one mount takes to be read whole on the other, new and overwritten; then files made
through the second mount (another node's names) stat'ed, opened and read, renamed and unlinked
through the first.

For every phase of those, the daemons' CPU per operation and, on a shared volume,
PostgreSQL's own work per operation (:mod:`bench.pgwork`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

from bench.common import (BASELINE, Choices, Context, Metric, RunError, error_text, fold_rows, log, record, run_cmd,
                          summarize, text_grid, text_table)
from bench.pgwork import FLUSH_WAIT, Meter
from bench.render import bars_from_rows, goal_row, md_table, medians_note, percentile_lines, ratio_between, \
    ratio_table, table_cell
from bench.systems import ALL, DEFAULT, PG_BACKED, System, open_systems

NAME = "files"
TITLE = "Files (fio, small files)"
SUMMARY = ("fio sequential write/read 1 MiB, random read 4 KiB, cold sequential read; "
           "small-file create/stat/readdir/rename/unlink")
BUDGET = {"tiny": None, "quick": 130.0, "full": None}
# pg_wait: how long after a phase PostgreSQL's counters are read (bench.pgwork); tiny, which
# tests the harness, does not wait and does not report them.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"file_mib": 16, "randread_seconds": 1, "small_files": 100, "phase_seconds": 5, "timeout": 60,
             "commits": 20, "visibility_files": 10, "pg_wait": None},
    "quick": {"file_mib": 256, "randread_seconds": 3, "small_files": 1000, "phase_seconds": 4, "timeout": 120,
              "commits": 100, "visibility_files": 50, "pg_wait": FLUSH_WAIT},
    "full": {"file_mib": 512, "randread_seconds": 10, "small_files": 1000, "phase_seconds": 10, "timeout": 600,
             "commits": 300, "visibility_files": 200, "pg_wait": FLUSH_WAIT},
}
SEEN_TIMEOUT = 10.0  # s a change may take to show on the other mount before the run fails
METRICS = [
    Metric("seqwrite", "MiB/s", label="sequential write 1 MiB (+fsync)"),
    Metric("seqread", "MiB/s", label="sequential read 1 MiB"),
    Metric("seqread_cold", "MiB/s", label="sequential read 1 MiB, cold cache"),
    Metric("randread", "IOPS", label="random read 4 KiB, direct I/O"),
    Metric("create", "files/s", label="create 4 KiB file"),
    Metric("stat", "files/s", label="stat"),
    Metric("readdir", "entries/s", label="readdir (names and attributes)"),
    Metric("rename", "files/s", label="rename in the directory"),
    Metric("unlink", "files/s", label="unlink"),
    Metric("stat_other", "files/s", label="stat of a name made on B"),
    Metric("open_other", "files/s", label="open and read whole a 4 KiB file made on B"),
    Metric("rename_other", "files/s", label="rename of a file made on B"),
    Metric("unlink_other", "files/s", label="unlink of a file made on B"),
    Metric("commit_p50", "ms", higher_is_better=False, label="commit: write 4 KiB, fsync, rename, fsync dir (median)"),
    Metric("commit_p90", "ms", higher_is_better=False, label="commit: write 4 KiB, fsync, rename, fsync dir (p90)"),
    Metric("seen_new", "ms", higher_is_better=False, label="new 4 KiB file written on A, read whole on B (median)"),
    Metric("seen_overwrite", "ms", higher_is_better=False,
           label="4 KiB overwritten on A, read whole on B (median)"),
]
# The cost of each operation: the daemons' CPU and, on a shared volume, PostgreSQL's work.
# Another node's names, worked on from the first mount (A): the phases of other_files.
OTHER_OPS = {"stat_other": "stat of B's name", "open_other": "open+read of B's file",
             "rename_other": "rename of B's file", "unlink_other": "unlink of B's file"}
OPS = ["create", "stat", "readdir", "rename", "unlink", *OTHER_OPS.values(), "commit", "new file seen on B",
       "overwrite seen on B"]
COSTS = [
    Metric("cpu_ms", "ms", higher_is_better=False, label="daemon CPU"),
    Metric("pg_xacts", "/op", higher_is_better=False, label="transactions"),
    Metric("pg_rows", "/op", higher_is_better=False, label="rows changed"),
    Metric("pg_wal_records", "/op", higher_is_better=False, label="WAL records"),
    Metric("pg_wal_bytes", "B", higher_is_better=False, label="WAL bytes"),
]
OURS = "fusestate-pg"  # the shared-volume comparison: ours against each JuiceFS system
JUICEFS = ("juicefs-pg", "juicefs-pg-fast")  # its defaults; its fastest comparable settings
# Every system by default, but for those of bench.systems run only when --systems names them;
# juicefs-pg-fast is this scenario's second JuiceFS peer.
SYSTEMS = [n for n in ALL if n in DEFAULT or n in JUICEFS]
PCTS = ("50.000000", "90.000000", "99.000000", "99.900000", "99.990000")


def fio(job: str, filename: Path, rw: str, bs: str, size_mib: int, timeout: float, *more: str) -> dict[str, Any]:
    cmd = ["fio", f"--name={job}", f"--filename={filename}", f"--rw={rw}", f"--bs={bs}", f"--size={size_mib}M",
           "--ioengine=psync", "--fallocate=none", "--invalidate=1", "--output-format=json", *more]
    proc = run_cmd(cmd, timeout=timeout)
    data = json.loads(proc.stdout[proc.stdout.index("{"):])
    job0 = data["jobs"][0]
    if job0.get("error"):
        raise RunError(f"fio {job}: error {job0['error']}")
    return job0


def _io(job: dict[str, Any], kind: str) -> dict[str, Any]:
    side = job[kind]
    pct = side.get("clat_ns", {}).get("percentile", {})
    return {"bw_mib_s": side["bw_bytes"] / (1 << 20), "iops": side["iops"],
            "clat_us": {k.split(".")[0] if k.endswith(".000000") else k.rstrip("0"): v / 1000
                        for k, v in pct.items() if k in PCTS}}


def _timed(paths: list[Path], op: Callable[[Path], object], limit: float) -> tuple[int, float]:
    """Apply ``op`` to ``paths`` until done or ``limit`` seconds have passed: (count, per second)."""
    t = time.monotonic()
    done = 0
    for p in paths:
        op(p)
        done += 1
        if time.monotonic() - t > limit:
            break
    return done, done / (time.monotonic() - t)


def small_files(d: Path, n: int, limit: float, meter: Meter) -> dict[str, float]:
    """create/stat/readdir/rename/unlink rates over up to ``n`` files, each phase cut off after
    ``limit`` seconds (readdir: whole listings with attributes, as ``ls -l`` makes them). Every
    file has bytes of its own, as state files do (the same bytes would be stored once by a
    content-addressed store)."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    names = [d / f"f{i:06d}" for i in range(n)]

    def create(p: Path) -> None:
        with open(p, "wb") as f:
            f.write(os.urandom(4096))

    rates: dict[str, float] = {}
    with meter.phase("create") as ph:
        done, rates["create"] = _timed(names, create, limit)
        ph.ops = done
    created = names[:done]
    with meter.phase("stat") as ph:
        ph.ops, rates["stat"] = _timed(created, os.stat, limit)
    with meter.phase("readdir") as ph:
        t, listed = time.monotonic(), 0
        while not listed or time.monotonic() - t < limit / 4:  # a whole quarter phase: one listing lasts ms
            with os.scandir(d) as it:
                listed += sum(1 for e in it if e.stat(follow_symlinks=False))
        rates["readdir"] = listed / (time.monotonic() - t)
        ph.ops = listed
    with meter.phase("rename") as ph:
        done, rates["rename"] = _timed(created, lambda p: os.rename(p, p.with_suffix(".r")), limit)
        ph.ops = done
    created = [p.with_suffix(".r") for p in created[:done]] + created[done:]
    with meter.phase("unlink") as ph:
        ph.ops, rates["unlink"] = _timed(created, os.unlink, limit)
    rates["files"] = len(created)
    return rates


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def commit_pattern(d: Path, n: int, limit: float, meter: Meter) -> list[float]:
    """A state store's commit, ``n`` times (or until ``limit`` seconds): a new file of 4 KiB
    written and fsynced, renamed to its final name, the directory fsynced (its descriptor
    kept open, as RocksDB keeps its directories'). Seconds per commit."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    latencies: list[float] = []
    try:
        with meter.phase("commit") as ph:
            start = time.monotonic()
            for i in range(n):
                data = os.urandom(4096)
                t = time.perf_counter()
                tmp = d / f".c{i:06d}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, d / f"c{i:06d}")
                os.fsync(dfd)
                latencies.append(time.perf_counter() - t)
                if time.monotonic() - start > limit:
                    break
            ph.ops = len(latencies)
    finally:
        os.close(dfd)
    return latencies


def wait_until_seen(path: Path, timeout: float = SEEN_TIMEOUT) -> None:
    """Wait until ``path``, made on another mount, exists on this one (one name looked up, again and again)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RunError(f"{path.name}, made on one mount, not seen on the other after {timeout:.0f} s")
        time.sleep(0.01)


def read_until(path: Path, expected: bytes, timeout: float = SEEN_TIMEOUT) -> int:
    """Open and read ``path`` whole until it holds ``expected`` (another mount's change); the
    number of tries. Each try is a fresh open, as a reader on another node would make it."""
    deadline = time.monotonic() + timeout
    tries = 0
    while True:
        tries += 1
        try:
            with open(path, "rb") as f:
                if f.read() == expected:
                    return tries
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise RunError(f"{path.name} not seen whole on the other mount after {timeout:.0f} s ({tries} tries)")
        time.sleep(0.001)


def visibility(a: Path, b: Path, n: int, limit: float, meter: Meter) -> dict[str, list[float]]:
    """Cross-node visibility on two mounts of one volume: a new file of 4 KiB written and
    closed on ``a``, then opened and read whole on ``b`` (retried every millisecond until it
    is all there); then each file overwritten in place on ``a`` with new bytes of the same
    size, after ``b`` has read the old ones, until ``b`` reads the new. Seconds from the
    open on ``a`` to the whole read on ``b``, and to the close on ``a``."""
    da, db = a / "seen", b / "seen"
    shutil.rmtree(da, ignore_errors=True)
    da.mkdir(parents=True)
    wait_until_seen(db)
    out: dict[str, list[float]] = {"new": [], "new_closed": [], "overwrite": [], "overwrite_closed": [],
                                   "tries": []}

    def change(name: str, data: bytes, mode: str, kind: str) -> None:
        t = time.perf_counter()
        with open(da / name, mode) as f:
            f.write(data)
        out[f"{kind}_closed"].append(time.perf_counter() - t)
        out["tries"].append(read_until(db / name, data))
        out[kind].append(time.perf_counter() - t)

    names: list[str] = []
    with meter.phase("new file seen on B") as ph:
        start = time.monotonic()
        for i in range(n):
            names.append(f"v{i:05d}")
            change(names[-1], os.urandom(4096), "wb", "new")
            if time.monotonic() - start > limit:
                break
        ph.ops = len(names)
    with meter.phase("overwrite seen on B") as ph:
        start = time.monotonic()
        for name in names:
            change(name, os.urandom(4096), "r+b", "overwrite")
            ph.ops += 1
            if time.monotonic() - start > limit:
                break
    return out


def other_files(a: Path, b: Path, n: int, limit: float, meter: Meter) -> dict[str, float]:
    """Another node's files, worked on from this node: for each phase, ``n`` files of 4 KiB of its own
    written and closed through mount ``b`` (another node); then through mount ``a`` each of them
    stat'ed; opened, read whole and closed; renamed in the directory; unlinked. Every phase works
    on names ``a`` has never looked up (nor listed), each phase cut off after ``limit`` seconds:
    the rate of each."""
    da, db = a / "others", b / "others"
    shutil.rmtree(da, ignore_errors=True)
    db.mkdir(parents=True, exist_ok=True)
    names = {metric: [f"{metric[0]}{i:06d}" for i in range(n)] for metric in OTHER_OPS}  # s, o, r, u
    for name in (x for group in names.values() for x in group):
        with open(db / name, "wb") as f:
            f.write(os.urandom(4096))
    (db / "made").write_bytes(b"")  # the last name made on b: once a sees it, it sees every one before
    wait_until_seen(da / "made")

    def read_whole(path: Path) -> None:
        with open(path, "rb") as f:
            if len(f.read()) != 4096:
                raise RunError(f"{path.name}: not all of its 4 KiB read on the other mount")

    ops: dict[str, Callable[[Path], object]] = {
        "stat_other": os.stat, "open_other": read_whole,
        "rename_other": lambda path: os.rename(path, path.with_suffix(".r")), "unlink_other": os.unlink}
    rates: dict[str, float] = {}
    for metric, op in ops.items():
        with meter.phase(OTHER_OPS[metric]) as ph:
            ph.ops, rates[metric] = _timed([da / name for name in names[metric]], op, limit)
    return rates


def one(s: System, repeat: int, p: dict[str, Any], failed: dict[str, str]) -> dict[str, Any]:
    if s.error or s.name in failed:
        return record(s.name, repeat, error=s.error or f"skipped: {failed[s.name]}")
    f = s.path / "fio.dat"
    metrics: dict[str, float] = {}
    costs: dict[str, dict[str, float]] = {}
    extra: dict[str, Any] = {"costs": costs}
    errors: list[str] = []
    size, timeout = p["file_mib"], p["timeout"]

    def step(name: str, fn) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a failed step is that cell's result
            errors.append(f"{name}: {error_text(exc)}")

    def seqwrite() -> None:
        with_fs_unlink(f)
        job = fio("seqwrite", f, "write", "1M", size, timeout, "--end_fsync=1")
        metrics["seqwrite"] = _io(job, "write")["bw_mib_s"]
        extra["settle_after_write_s"] = round(s.settle(), 2)

    def seqread() -> None:
        metrics["seqread"] = _io(fio("seqread", f, "read", "1M", size, timeout), "read")["bw_mib_s"]

    def randread() -> None:
        args = ("--time_based", f"--runtime={p['randread_seconds']}", "--randrepeat=1", "--norandommap")
        try:  # direct I/O, so the page cache does not answer for the system under test
            job = _io(fio("randread", f, "randread", "4k", size, timeout, "--direct=1", *args), "read")
            extra["randread_mode"] = "direct"
        except RunError as exc:
            extra["randread_mode"] = f"buffered (direct I/O failed: {exc})"
            job = _io(fio("randread", f, "randread", "4k", size, timeout, *args), "read")
        metrics["randread"] = job["iops"]
        extra["randread_clat_us"] = job["clat_us"]

    def seqread_cold() -> None:
        s.make_cold([f])
        metrics["seqread_cold"] = _io(fio("seqread_cold", f, "read", "1M", size, timeout), "read")["bw_mib_s"]

    def meter(*pids: Optional[int]) -> Meter:
        db = s.database() if p["pg_wait"] is not None else None
        return Meter(pids, db, p["pg_wait"] or 0.0)

    def small() -> None:
        m = meter(s.daemon_pid())
        rates = small_files(s.path / "small", p["small_files"], p["phase_seconds"], m)
        extra["small_files"] = rates.pop("files")
        metrics.update(rates)
        costs.update(m.costs)

    def commit() -> None:
        m = meter(s.daemon_pid())
        lat = commit_pattern(s.path / "commit", p["commits"], p["phase_seconds"], m)
        metrics["commit_p50"], metrics["commit_p90"] = 1000 * percentile(lat, 0.5), 1000 * percentile(lat, 0.9)
        extra["commits"] = len(lat)
        costs.update(m.costs)

    def seen(other: System) -> None:
        m = meter(s.daemon_pid(), other.daemon_pid())
        out = visibility(s.path, other.path, p["visibility_files"], p["phase_seconds"], m)
        metrics["seen_new"] = 1000 * statistics.median(out["new"])
        metrics["seen_overwrite"] = 1000 * statistics.median(out["overwrite"])
        extra["visibility_ms"] = {k: {"median": round(1000 * statistics.median(v), 3),
                                      "p90": round(1000 * percentile(v, 0.9), 3), "n": len(v)}
                                  for k, v in out.items() if v and k != "tries"}
        extra["visibility_tries"] = {"median": statistics.median(out["tries"]), "max": max(out["tries"])}
        costs.update(m.costs)
        shutil.rmtree(s.path / "seen", ignore_errors=True)

    def others(other: System) -> None:
        m = meter(s.daemon_pid(), other.daemon_pid())
        metrics.update(other_files(s.path, other.path, p["small_files"], p["phase_seconds"], m))
        costs.update(m.costs)
        shutil.rmtree(s.path / "others", ignore_errors=True)

    def second_mount() -> None:
        """Where the volume takes a second mount (node B): what B reads of A's files, then B's files on A."""
        other = s.twin()
        if other is None:
            return
        try:
            other.start()
            step("visibility", lambda: seen(other))
            step("another node's files", lambda: others(other))
        finally:
            try:
                other.stop()
            finally:
                other.close()

    step("seqwrite", seqwrite)
    if "seqwrite" in metrics:
        step("seqread", seqread)
        step("randread", randread)
        if s.keeps_files:  # a scratch dir's files are gone after the remount that makes caches cold
            step("seqread_cold", seqread_cold)
    step("small files", small)
    step("commit", commit)
    step("second mount", second_mount)
    if errors:
        extra["diagnosis"] = s.diagnosis()
        if not s.usable():
            step("remount", s.revive)
    with_fs_unlink(f)
    for d in ("small", "commit", "seen", "others"):
        shutil.rmtree(s.path / d, ignore_errors=True)
    try:
        s.settle()
    except Exception as exc:  # noqa: BLE001
        errors.append(f"settle: {error_text(exc)}")
    if not metrics and errors:
        failed[s.name] = errors[0]
    error = "; ".join(errors) or None
    log(f"  files r{repeat + 1} {s.name:<15} " + " ".join(f"{k}={v:,.1f}" for k, v in metrics.items())
        + (f"  ERROR {error}" if error else ""))
    return record(s.name, repeat, metrics=metrics, error=error, **extra)


def with_fs_unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def choices(size: str) -> Choices:  # noqa: ARG001 - the same at every size
    """The systems ``--systems`` may name here, and those run without it."""
    return Choices(ALL, SYSTEMS)


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    names = ctx.chosen(choices(ctx.size))
    runs: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    with open_systems(names, ctx.work, fusestate_extra=ctx.mount_options, shape=ctx.shape) as systems:
        for repeat in ctx.repetitions():
            for s in systems.values():
                runs.append(one(s, repeat, p, failed))
        info = {n: s.info() for n, s in systems.items()}
    rows = summarize(runs, METRICS, names, [""])
    lat: dict[str, dict[str, float]] = {}
    for name in names:
        mine = [r["randread_clat_us"] for r in runs if r["system"] == name and r.get("randread_clat_us")]
        if mine:
            lat[name] = {k: sorted(x[k] for x in mine)[len(mine) // 2] for k in mine[0]}
    return {"params": p, "systems": names, "system_info": info, "summary": rows, "randread_latency_us": lat,
            "costs": cost_rows(runs, names), "runs": runs}


def cost_rows(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Median cost per operation and system; ratios against JuiceFS with its defaults where it ran."""
    per_op = [record(r["system"], r["repeat"], op, {k: v for k, v in c.items() if k != "ops"})
              for r in runs for op, c in (r.get("costs") or {}).items() if c.get("ops")]
    return summarize(per_op, COSTS, names, OPS, baseline=JUICEFS[0])


def cost_systems(doc: dict[str, Any]) -> list[str]:
    """The shared volumes whose costs were measured (the comparison with JuiceFS)."""
    return [n for n in doc["systems"] if n in PG_BACKED and any(n in r["systems"] for r in doc.get("costs", []))]


def terminal(doc: dict[str, Any]) -> str:
    text = text_table(doc["summary"], doc["systems"])
    names = cost_systems(doc)
    if names:
        head, body = fold_rows(doc["costs"], names, [m.name for m in COSTS], "per operation")
        text += f"\n\nCost per operation, {' / '.join(names)} (ratio against {JUICEFS[0]}):\n" + text_grid(head, body)
    return text


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:
    p, names, rows = doc["params"], doc["systems"], doc["summary"]
    parts = [f"fio (`--ioengine=psync`) on one {p['file_mib']} MiB file: a sequential write in 1 MiB blocks with "
             f"`--end_fsync=1`, a sequential read, {p['randread_seconds']} s of random 4 KiB reads with `--direct=1` "
             f"(the page cache would answer them all otherwise), and a sequential read after the caches are made "
             f"cold. Small files: up to {p['small_files']:,} files of 4 KiB created, stat'ed, listed, renamed and "
             f"unlinked ({p['phase_seconds']} s per phase at most), each with bytes of its own. *Commit*: up to "
             f"{p.get('commits', 0):,} times, a new 4 KiB file written and fsynced, renamed, its directory fsynced. "
             f"*Read on B*: where a volume takes a second mount (another node's mountpoint and cache dir, the same "
             f"bucket and metadata), up to {p.get('visibility_files', 0):,} files of 4 KiB written and closed on "
             f"mount A, then opened and read whole on mount B (retried every millisecond until the bytes are all "
             f"there), timed from the open on A; then each overwritten in place on A with new bytes after B read "
             f"the old. *Made on B*: on the same two mounts, up to {p['small_files']:,} files of 4 KiB for each "
             f"phase written and closed on B, then on A each stat'ed, opened and read whole, renamed, unlinked "
             f"({p['phase_seconds']} s per phase at most), every phase on names of its own that A has never looked "
             f"up: another node's names. " + juicefs_note(doc) + medians_note(doc),
             ratio_table(rows, names, show_variant=False)]
    peers = cost_systems(doc)
    if peers:
        parts.append(f"Cost per operation on the shared volumes (median per run; ratio against {JUICEFS[0]} in "
                     f"brackets): the daemons' CPU (both mounts' in the rows of B's files and of what B reads), "
                     f"and PostgreSQL's own work: "
                     f"transactions and rows changed (`xact_commit + xact_rollback`, `tup_inserted + tup_updated + "
                     f"tup_deleted` of the volume's database in `pg_stat_database`), WAL records and bytes (the "
                     f"server's `pg_stat_wal`), read {p.get('pg_wait') or 0:g} s after each phase, once every "
                     f"backend has published its counters. readdir counts per entry listed.")
        parts.append(md_table(*fold_rows(doc["costs"], peers, [m.name for m in COSTS], "operation", table_cell)))
    by, images = {r["metric"]: r for r in rows}, []
    tput = [by[m] for m in ("seqwrite", "seqread", "seqread_cold") if m in by]
    if tput:
        img = bars_from_rows(img_dir / "files-throughput.png", tput, names, ylabel="MiB/s",
                             title="fio sequential throughput, 1 MiB blocks (x = failed)")
        images.append(f"![fio throughput]({img_rel}/{img.name})")
    if doc.get("randread_latency_us"):
        img = percentile_lines(img_dir / "files-randread-latency.png", doc["randread_latency_us"],
                               ylabel="µs (completion latency)", title="fio random 4 KiB read latency percentiles")
        images.append(f"![randread latency]({img_rel}/{img.name})")
    return "\n\n".join(parts + [" ".join(images)] if images else parts)


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    by = {r["metric"]: r for r in doc["summary"]}
    for metric in ("seqwrite", "seqread"):
        row = by.get(metric)
        if not row:
            continue
        for name in ("fusestate-file", "fusestate-s3"):
            if name not in row["systems"]:
                continue
            ratio = row["ratio"].get(name)
            out.append(goal_row(f"fio {row['label']}, {name} / {BASELINE} ≥ 0.8",
                                f"{ratio:.2f}" if ratio is not None else "error", ratio is not None and ratio >= 0.8))
        fs3 = row["systems"].get("fusestate-s3", {}).get("median")
        peers = {n: row["systems"][n].get("median") for n in ("rclone", "s3fs") if n in row["systems"]}
        if fs3 is not None and peers:
            beaten = all(v is None or fs3 > v for v in peers.values())
            shown = ", ".join(f"{n} {v:,.0f}" if v is not None else f"{n} failed" for n, v in peers.items())
            out.append(goal_row(f"fio {row['label']}: fusestate-s3 beats rclone and s3fs on the same endpoint",
                                f"fusestate-s3 {fs3:,.0f} MiB/s; {shown}", beaten))
    return out + peer_goals(doc)


def juicefs_note(doc: dict[str, Any]) -> str:
    """How each JuiceFS system of the run was set up: its defaults, or the options it was given."""
    info = doc.get("system_info", {})
    said = []
    for name in (n for n in doc["systems"] if n.startswith("juicefs-")):
        fmt, mnt = info.get(name, {}).get("format_options"), info.get(name, {}).get("mount_options")
        opts = [f"`{' '.join(o)}` ({what})" for o, what in ((fmt, "format"), (mnt, "mount")) if o]
        said.append(f"`{name}` with " + (" and ".join(opts) if opts else "JuiceFS's defaults"))
    return f"JuiceFS: {'; '.join(said)}. " if said else ""


def peer_goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The shared volume against JuiceFS on the same PostgreSQL server (issue 46), each a ratio of
    medians of one run, ours / theirs, against each JuiceFS system: its defaults (``juicefs-pg``)
    and its fastest comparable settings (``juicefs-pg-fast``). A goal is met only where it holds
    against both; one not run, or without a number, leaves it not met. The small-file goals hold
    for another node's names too (the rows of files made on B)."""
    runs = set(doc["systems"])
    if OURS not in runs or not runs & set(JUICEFS):
        return []
    by = {r["metric"]: r for r in doc["summary"]}
    costs = {(r["variant"], r["metric"]): r for r in doc.get("costs", [])}
    labels = {m.name: m.label for m in METRICS}
    versus = f"{OURS} / {' and '.join(JUICEFS)}"
    out = []

    def ratios(row: Optional[dict[str, Any]]) -> dict[str, Optional[float]]:
        return {t: ratio_between(row, OURS, t) if row and t in runs else None for t in JUICEFS}

    def shown(rs: dict[str, Optional[float]]) -> str:
        return ", ".join(f"{t} {r:.2f}" if r is not None else f"{t} no number" + ("" if t in runs else " (not run)")
                         for t, r in rs.items())

    def add(goal: str, row: Optional[dict[str, Any]], met: Callable[[float], bool]) -> None:
        rs = ratios(row)
        out.append(goal_row(f"{goal}, {versus}", shown(rs), all(r is not None and met(r) for r in rs.values())))

    for metric in ("create", "stat", "readdir", "rename", "unlink", "stat_other", "rename_other", "unlink_other"):
        add(f"{labels[metric]} ≥ 1.5", by.get(metric), lambda r: r >= 1.5)
    for metric in ("commit_p50", "seen_new", "seen_overwrite"):
        add(f"{labels[metric]} ≤ 1", by.get(metric), lambda r: r <= 1.0)
    add(f"fio {labels['seqwrite']} ≥ 1", by.get("seqwrite"), lambda r: r >= 1.0)
    cpu = {op: ratios(costs.get((op, "cpu_ms"))) for op in OPS}
    per = {t: {op: rs[t] for op, rs in cpu.items() if rs[t] is not None} for t in JUICEFS}
    text = "; ".join(f"against {t}: " + (", ".join(f"{op} {r:.2f}" for op, r in got.items()) or "no number")
                     for t, got in per.items())
    out.append(goal_row(f"daemon CPU per operation ≤ 1 on every operation, {versus}", text,
                        all(got and all(r <= 1.0 for r in got.values()) for got in per.values())))
    for metric, label in (("pg_xacts", "transactions"), ("pg_wal_records", "WAL records")):
        add(f"PostgreSQL {label} per create ≤ 1", costs.get(("create", metric)), lambda r: r <= 1.0)
    return out
