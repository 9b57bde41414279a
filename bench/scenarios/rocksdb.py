"""Scenario 1: RocksDB's db_bench on local disk, on fusestate (file:// and S3) and on the FUSE peers.

One db_bench process per run writes a fresh database and runs
fillseq, fillrandom, readrandom, overwrite, readwhilewriting on it (warm caches), with the
WAL off (as Spark's state store writes) and on. Then the system's caches are made cold
(fusestate: unmount, wipe the cache dir, mount; rclone: the same with its VFS cache; s3fs:
remount; local disk: the database's pages are dropped from the page cache) and a second
db_bench reads the existing database (``readrandom`` cold). Systems run interleaved
within each repetition, so load drift hits them alike.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import BASELINE, Choices, Context, Metric, RunError, error_text, log, record, run_cmd, summarize
from bench.render import bars_from_rows, goal_row, medians_note, percentile_lines, ratio_between, ratio_table
from bench.systems import ALL, DEFAULT, System, open_systems

NAME = "rocksdb"
TITLE = "RocksDB (db_bench)"
SUMMARY = "db_bench fillseq/fillrandom/readrandom/overwrite/readwhilewriting, WAL off and on, warm and cold cache"
BUDGET = {"tiny": None, "quick": 290.0, "full": None}
BENCHMARKS = ["fillseq", "fillrandom", "readrandom", "overwrite", "readwhilewriting"]
VARIANTS = ["wal-off", "wal-on"]
METRICS = [Metric(b, "ops/s") for b in BENCHMARKS] + [Metric("readrandom_cold", "ops/s", label="readrandom, cold cache")]
SIZES: dict[str, dict[str, Any]] = {
    # Small sizes get a smaller memtable, so that flushes and compactions still happen.
    "tiny": {"num": 20_000, "cold_reads": 5_000, "run_timeout": 120, "extra": ["--write_buffer_size=4194304"]},
    "quick": {"num": 60_000, "cold_reads": 15_000, "run_timeout": 90,
              "extra": ["--write_buffer_size=8388608", "--reads=30000"]},
    "full": {"num": 300_000, "cold_reads": 100_000, "run_timeout": 900, "extra": ["--write_buffer_size=16777216"]},
}
COLD_VARIANT = "wal-off"  # the read path does not depend on the WAL: one cold pass is enough
PERCENTILES = re.compile(r"P([\d.]+):\s*([\d.]+)")
LINE = re.compile(r"^(?P<name>\w+)\s*:\s*(?P<micros>[\d.]+) micros/op\s+(?P<ops>\d+) ops/sec")


def db_bench_cmd(db: Path, benchmarks: list[str], num: int, wal_off: bool, existing: bool,
                 extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    return ["db_bench", f"--db={db}", f"--benchmarks={','.join(benchmarks)}", f"--num={num}",
            "--value_size=400", "--key_size=16", "--threads=1", f"--use_existing_db={int(existing)}",
            "--seed=1", f"--disable_wal={int(wal_off)}", "--histogram=1", *extra]


def parse_db_bench(stdout: str) -> dict[str, dict[str, Any]]:
    """ops/s, micros/op and latency percentiles (µs) per benchmark from db_bench's stdout."""
    out: dict[str, dict[str, Any]] = {}
    current: Optional[str] = None
    for raw in stdout.splitlines():
        line = raw.strip()
        m = LINE.match(line)
        if m:
            current = m["name"]
            out[current] = {"ops_per_sec": int(m["ops"]), "micros_per_op": float(m["micros"])}
        elif current and line.startswith("Percentiles:"):
            out[current]["percentiles"] = {k: float(v) for k, v in PERCENTILES.findall(line)}
        elif current and line.startswith("Min:") and "Max:" in line:
            out[current]["max_us"] = float(line.rsplit("Max:", 1)[1].split()[0])
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0), 3) for k in after}


def warm_run(s: System, db: Path, wal_off: bool, p: dict[str, Any]) -> dict[str, Any]:
    shutil.rmtree(db, ignore_errors=True)
    before = s.counters()
    load = os.getloadavg()[0]
    t = time.monotonic()
    proc = run_cmd(db_bench_cmd(db, BENCHMARKS, p["num"], wal_off, False, p["extra"]), timeout=p["run_timeout"])
    wall = time.monotonic() - t
    parsed = parse_db_bench(proc.stdout)
    missing = [b for b in BENCHMARKS if b not in parsed]
    if missing:
        raise RunError(f"db_bench printed no result for {','.join(missing)}")
    settle = s.settle()
    return {"wall_seconds": round(wall, 2), "settle_seconds": round(settle, 2), "loadavg_1m": round(load, 2),
            "benchmarks": parsed, "counters": _delta(s.counters(), before)}


def cold_run(s: System, db: Path, wal_off: bool, p: dict[str, Any]) -> dict[str, Any]:
    s.make_cold([db])
    before = s.counters()
    extra = (*p["extra"], f"--reads={p['cold_reads']}")
    proc = run_cmd(db_bench_cmd(db, ["readrandom"], p["num"], wal_off, True, extra), timeout=p["run_timeout"])
    parsed = parse_db_bench(proc.stdout)
    if "readrandom" not in parsed:
        raise RunError("db_bench printed no readrandom result")
    return {"benchmarks": parsed, "counters": _delta(s.counters(), before)}


def choices(size: str) -> Choices:  # noqa: ARG001 - the same at every size
    """The systems ``--systems`` may name here, and those run without it."""
    return Choices(ALL, DEFAULT)


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    if ctx.db_keys:  # --db-keys: the time limits grow with the keys
        scale = max(1.0, ctx.db_keys / p["num"])
        p.update(num=ctx.db_keys, cold_reads=round(p["cold_reads"] * scale), run_timeout=p["run_timeout"] * scale)
    names = ctx.chosen(choices(ctx.size))
    runs: list[dict[str, Any]] = []
    failed: dict[tuple[str, str], str] = {}
    with open_systems(names, ctx.work, fusestate_extra=ctx.mount_options, shape=ctx.shape) as systems:
        for repeat in ctx.repetitions():
            for variant in VARIANTS:
                for name, s in systems.items():
                    runs.append(_one(s, repeat, variant, p, failed))
        info = {n: s.info() for n, s in systems.items()}
    rows = [row for v in VARIANTS
            for row in summarize(runs, METRICS if v == COLD_VARIANT else METRICS[:-1], names, [v])]
    return {"params": {**p, "benchmarks": BENCHMARKS, "value_size": 400, "key_size": 16,
                       "command": db_bench_cmd(Path("<dir>/db"), BENCHMARKS, p["num"], True, False, p["extra"])},
            "systems": names, "system_info": info, "summary": rows, "latency": _latency(runs, names), "runs": runs}


def _one(s: System, repeat: int, variant: str, p: dict[str, Any], failed: dict[tuple[str, str], str]) -> dict[str, Any]:
    """One warm run (and, WAL off, one cold read) of one system; a failure becomes the run's error."""
    key = (s.name, variant)
    if s.error or key in failed:
        return record(s.name, repeat, variant, error=s.error or f"skipped: {failed[key]}")
    wal_off = variant == "wal-off"
    db = s.path / f"db-{variant}"
    metrics: dict[str, float] = {}
    extra: dict[str, Any] = {}
    error = None
    try:
        warm = warm_run(s, db, wal_off, p)
        metrics.update({b: v["ops_per_sec"] for b, v in warm["benchmarks"].items()})
        extra["warm"] = warm
    except Exception as exc:  # noqa: BLE001 - recorded as the run's error
        error = error_text(exc)
        failed[key] = error
        _revive(s, extra)
    if error is None and variant == COLD_VARIANT:
        try:
            cold = cold_run(s, db, wal_off, p)
            metrics["readrandom_cold"] = cold["benchmarks"]["readrandom"]["ops_per_sec"]
            extra["cold"] = cold
        except Exception as exc:  # noqa: BLE001 - recorded as the cold cell's error
            error = f"cold read: {error_text(exc)}"
            _revive(s, extra)
    shutil.rmtree(db, ignore_errors=True)
    try:
        s.settle()
    except Exception as exc:  # noqa: BLE001
        log(f"  {s.name}: settle failed: {exc}")
    ops = " ".join(f"{k}={v:,.0f}" for k, v in metrics.items())
    log(f"  rocksdb {variant} r{repeat + 1} {s.name:<15} {ops}{'  ERROR ' + error if error else ''}")
    return record(s.name, repeat, variant, metrics, error, **extra)


def _revive(s: System, extra: dict[str, Any]) -> None:
    """After a failure, keep the system's log tail and make sure it is mounted again for the next runs."""
    diag = s.diagnosis()
    if diag:
        extra["diagnosis"] = diag
    if s.usable():
        return
    try:
        s.revive()
    except Exception as exc:  # noqa: BLE001
        s.error = f"unusable after a failure: {error_text(exc)}"


def _latency(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Median latency percentiles (µs) per variant, benchmark and system."""
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        for bench in BENCHMARKS:
            for name in names:
                pcts = [r["warm"]["benchmarks"][bench].get("percentiles", {}) for r in runs
                        if r["system"] == name and r["variant"] == variant and "warm" in r]
                pcts = [x for x in pcts if x]
                if pcts:
                    keys = set.intersection(*(set(x) for x in pcts))
                    out.setdefault(variant, {}).setdefault(bench, {})[name] = {
                        k: statistics.median(x[k] for x in pcts) for k in sorted(keys, key=float)}
    return out


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:
    names, p = doc["systems"], doc["params"]
    extra = " ".join(a for a in p["command"] if a.startswith("--write_buffer_size"))
    parts = [f"One `db_bench` process per run on a fresh database: {', '.join(BENCHMARKS)} of {p['num']:,} keys of "
             f"16 + 400 bytes (`{extra}`), WAL off (`--disable_wal=1`, as Spark writes) and on; then, WAL off, the "
             f"caches made cold (fusestate and rclone remount on an empty cache dir, s3fs remounts, local disk "
             f"drops the files' pages) and `readrandom` of {p['cold_reads']:,} keys. Numbers are ops/s. "
             + medians_note(doc),
             ratio_table(doc["summary"], names)]
    images = []
    off = [r for r in doc["summary"] if r["variant"] == "wal-off"]
    if off:
        img = bars_from_rows(img_dir / "rocksdb-wal-off.png", off, names, ylabel="ops/s",
                             title="db_bench, WAL off: median ops/s (x = failed)")
        images.append(f"![db_bench, WAL off]({img_rel}/{img.name})")
    lat = doc.get("latency", {}).get("wal-off", {}).get("readrandom")
    if lat:
        img = percentile_lines(img_dir / "rocksdb-latency-readrandom.png", lat, ylabel="µs per op",
                               title="db_bench readrandom latency percentiles, WAL off")
        images.append(f"![readrandom latency]({img_rel}/{img.name})")
    return "\n\n".join(parts + [" ".join(images)] if images else parts)


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for bench in ("fillrandom", "readrandom"):
        row = next((r for r in doc["summary"] if r["variant"] == "wal-off" and r["metric"] == bench), None)
        if row is None:
            continue
        for name in ("fusestate-file", "fusestate-s3"):
            if name not in row["systems"]:
                continue
            ratio = row["ratio"].get(name)
            measured = f"{ratio:.2f}" if ratio is not None else f"error: {row['systems'][name].get('error')}"
            out.append(goal_row(f"db_bench {bench}, WAL off, warm cache, {name} / {BASELINE} ≥ 0.9", measured,
                                ratio is not None and ratio >= 0.9))
        if "fusestate-pg" in row["systems"] and "fusestate-file" in row["systems"]:
            # The shared engine against the embedded one: data must not wait on the database.
            ratio = ratio_between(row, "fusestate-pg", "fusestate-file")
            out.append(goal_row(f"db_bench {bench}, WAL off, PostgreSQL engine / SQLite engine ≥ 0.9",
                                f"{ratio:.2f}" if ratio is not None else "error", ratio is not None and ratio >= 0.9))
    return out
