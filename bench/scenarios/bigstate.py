"""Scenario 3: a RocksDB state ten times larger than fusestate's local cache.

fusestate mounts with a small cache (``--cache-size``, and a memory cache a quarter of it);
db_bench fills a database of ten times that size (no compression, WAL off), then reads it
at random for a fixed time with direct I/O (``--use_direct_reads=1``, so the kernel's page
cache does not hide the daemon's cache). db_bench reports its throughput every second and a
sampler polls ``fusestate status`` every second for the cache hit ratio. Local disk runs
the same workload (also with direct reads) as the baseline.

What must hold: no errors, and no stall past the backpressure bound — the longest stretch
without a completed operation, and the slowest single write, stay under the time the
uploader needs to drain the dirty bound (``max_dirty`` / measured upload rate, at least 2 s).
"""

from __future__ import annotations

import csv
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import (BASELINE, Choices, Context, Metric, RunError, error_text, fmt_num, log, median_or_none,
                          record, run_cmd, summarize)
from bench.render import goal_row, medians_note, ratio_table, time_series
from bench.scenarios.rocksdb import parse_db_bench
from bench.systems import FusestateSystem, System, open_systems

NAME = "bigstate"
TITLE = "State larger than the cache"
SUMMARY = "RocksDB working set 10x the local cache: throughput and cache hit ratio over time, stalls"
BUDGET = {"tiny": None, "quick": 100.0, "full": None}
SYSTEMS = ["local", "fusestate-file", "fusestate-s3", "fusestate-s3-shaped", "juicefs-pg"]
SUPPORTED = SYSTEMS + ["fusestate-pg", "juicefs-pg-s3", "juicefs-pg-s3-shaped"]  # with --systems
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"cache_mib": 32, "read_seconds": 3, "timeout": 120, "systems": ["local", "fusestate-file"]},
    "quick": {"cache_mib": 40, "read_seconds": 10, "timeout": 300,
              "systems": ["local", "fusestate-file", "juicefs-pg"]},
    "full": {"cache_mib": 128, "read_seconds": 30, "timeout": 1800, "systems": SYSTEMS},
}
KEY, VALUE = 16, 400
METRICS = [
    Metric("fill_ops", "ops/s", label="fillrandom"),
    Metric("read_ops", "ops/s", label="readrandom (direct reads)"),
    Metric("read_hit_ratio", "ratio", label="cache hit ratio while reading"),
    Metric("longest_stall_s", "s", higher_is_better=False, label="longest interval without progress"),
    Metric("max_write_ms", "ms", higher_is_better=False, label="slowest write"),
    Metric("stall_bound_s", "s", label="backpressure bound"),
]


class Sampler(threading.Thread):
    """Polls ``fusestate status`` every second, so the hit ratio can be drawn over time."""

    def __init__(self, s: FusestateSystem, t0: float, phase: str, out: list[dict[str, Any]]) -> None:
        super().__init__(daemon=True)
        self.s, self.t0, self.phase, self.out = s, t0, phase, out
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                st = self.s.status()
            except Exception:  # noqa: BLE001 - a missed sample is not a failure
                st = None
            if st:
                c, wb = st["cache"], st["writeback"]
                self.out.append({"t": round(time.monotonic() - self.t0, 2), "phase": self.phase,
                                 "memory_hits": c["memory_hits"], "memory_misses": c["memory_misses"],
                                 "disk_hits": c["disk_hits"], "disk_misses": c["disk_misses"],
                                 "disk_bytes": c["disk_bytes"], "memory_bytes": c["memory_bytes"],
                                 "dirty_bytes": wb["dirty_bytes"], "staged_bytes": wb["staged_bytes"],
                                 "uploaded_bytes": wb["uploaded_bytes"], "bytes_in": st["remote"]["bytes_in"],
                                 "backpressure_seconds": wb["backpressure_seconds"]})
            self.stop_event.wait(1.0)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)


def hit_ratio(a: dict[str, Any], b: dict[str, Any]) -> Optional[float]:
    """Share of block lookups between two samples served from memory or the disk cache."""
    looked = (b["memory_hits"] - a["memory_hits"]) + (b["memory_misses"] - a["memory_misses"])
    hits = (b["memory_hits"] - a["memory_hits"]) + (b["disk_hits"] - a["disk_hits"])
    return min(1.0, hits / looked) if looked > 0 else None


def read_report(path: Path, offset: float) -> list[tuple[float, float]]:
    """db_bench's --report_file: (seconds since phase start + offset, ops/s in that second)."""
    if not path.exists():
        return []
    with open(path) as f:
        rows = list(csv.reader(f))
    out = []
    for row in rows[1:]:
        try:
            out.append((float(row[0]) + offset, float(row[1])))
        except (ValueError, IndexError):
            continue
    return out


def longest_stall(series: list[tuple[float, float]]) -> float:
    longest = current = 0.0
    prev_t = None
    for t, qps in series:
        step = t - prev_t if prev_t is not None else 1.0
        prev_t = t
        current = current + step if qps <= 0 else 0.0
        longest = max(longest, current)
    return longest


def db_cmd(db: Path, benchmark: str, num: int, report: Path, *more: str) -> list[str]:
    return ["db_bench", f"--db={db}", f"--benchmarks={benchmark}", f"--num={num}", f"--value_size={VALUE}",
            f"--key_size={KEY}", "--compression_type=none", "--disable_wal=1", "--seed=1", "--histogram=1",
            "--report_interval_seconds=1", f"--report_file={report}", *more]


def one(s: System, repeat: int, p: dict[str, Any], scratch: Path) -> dict[str, Any]:
    if s.error:
        return record(s.name, repeat, error=s.error)
    db = s.path / "bigdb"
    num = p["working_set_bytes"] // (KEY + VALUE)
    samples: list[dict[str, Any]] = []
    series: dict[str, list[tuple[float, float]]] = {}
    metrics: dict[str, float] = {}
    extra: dict[str, Any] = {}
    error = None
    t0 = read_t = time.monotonic()
    read_rep: Optional[Path] = None
    sampler: Optional[Sampler] = None
    try:
        shutil.rmtree(db, ignore_errors=True)
        if isinstance(s, FusestateSystem):
            before = s.status()
            extra["max_dirty"] = before["writeback"]["max_dirty"]
            sampler = Sampler(s, t0, "fill", samples)
            sampler.start()
        rep = scratch / f"{s.name}-{repeat}-fill.csv"
        t = time.monotonic()
        out = run_cmd(db_cmd(db, "fillrandom", num, rep, "--use_existing_db=0"), timeout=p["timeout"])
        fill_wall = time.monotonic() - t
        fill = parse_db_bench(out.stdout).get("fillrandom")
        if not fill:
            raise RunError("db_bench printed no fillrandom result")
        series["fill"] = read_report(rep, t - t0)
        metrics["fill_ops"] = fill["ops_per_sec"]
        metrics["max_write_ms"] = fill.get("max_us", 0) / 1000
        extra["db_bytes"] = sum(f.stat().st_size for f in db.rglob("*") if f.is_file())
        if sampler:
            sampler.phase = "settle"
        extra["settle_s"] = round(s.settle(), 2)
        read_start = time.monotonic() - t0
        if sampler:
            sampler.phase = "read"
        rep = read_rep = scratch / f"{s.name}-{repeat}-read.csv"
        t = read_t = time.monotonic()
        out = run_cmd(db_cmd(db, "readrandom", num, rep, "--use_existing_db=1", "--use_direct_reads=1",
                             f"--duration={p['read_seconds']}"), timeout=p["timeout"])
        read = parse_db_bench(out.stdout).get("readrandom")
        if not read:
            raise RunError("db_bench printed no readrandom result")
        series["read"] = read_report(rep, t - t0)
        metrics["read_ops"] = read["ops_per_sec"]
        metrics["longest_stall_s"] = max(longest_stall(series["fill"]), longest_stall(series["read"]))
        extra["read_start_s"] = round(read_start, 2)
        if sampler:
            sampler.stop()
            sampler = None
            reads = [x for x in samples if x["phase"] == "read"]
            fills = [x for x in samples if x["phase"] == "fill"]
            if len(reads) >= 2:
                metrics["read_hit_ratio"] = hit_ratio(reads[0], reads[-1]) or 0.0
                extra["read_bytes_in"] = reads[-1]["bytes_in"] - reads[0]["bytes_in"]
            uploaded = (fills[-1]["uploaded_bytes"] - before["writeback"]["uploaded_bytes"]) if fills else 0
            rate = uploaded / fill_wall if fill_wall > 0 else 0
            extra["fill_upload_mib_s"] = round(rate / (1 << 20), 1)
            metrics["stall_bound_s"] = max(2.0, extra["max_dirty"] / rate) if rate > 0 else 2.0
            extra["max_cache_disk_bytes"] = max(x["disk_bytes"] for x in samples)
            extra["backpressure_seconds"] = samples[-1]["backpressure_seconds"] - before["writeback"]["backpressure_seconds"]
    except Exception as exc:  # noqa: BLE001 - recorded as the run's error
        error = error_text(exc)
        extra["diagnosis"] = s.diagnosis()
        if read_rep is not None and "read" not in series:  # the throughput up to the failure
            series["read"] = read_report(read_rep, read_t - t0)
        if not s.usable():
            try:
                s.revive()
            except Exception as exc2:  # noqa: BLE001
                s.error = f"unusable after a failure: {error_text(exc2)}"
    finally:
        if sampler:
            sampler.stop()
        shutil.rmtree(db, ignore_errors=True)
        try:
            s.settle()
        except Exception as exc:  # noqa: BLE001
            log(f"  {s.name}: settle failed: {exc}")
    log(f"  bigstate r{repeat + 1} {s.name:<15} " + " ".join(f"{k}={v:,.2f}" for k, v in metrics.items())
        + (f"  ERROR {error}" if error else ""))
    return record(s.name, repeat, metrics=metrics, error=error, series=series, samples=samples, **extra)


def choices(size: str) -> Choices:
    """The systems ``--systems`` may name here, and those run without it at ``size``."""
    return Choices(SUPPORTED, SIZES[size]["systems"])


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    p.pop("systems")
    names = ctx.chosen(choices(ctx.size))
    cache = p["cache_mib"] << 20
    p["working_set_bytes"] = 10 * cache
    p["memory_cache_mib"] = max(4, p["cache_mib"] // 4)
    scratch = ctx.work / "reports"
    scratch.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    extra = ["--memory-cache-size", f"{p['memory_cache_mib']}M", *ctx.mount_options]
    with open_systems(names, ctx.work, cache_size=f"{p['cache_mib']}M", fusestate_extra=extra,
                      shape=ctx.shape) as systems:
        for repeat in ctx.repetitions():
            for s in systems.values():
                runs.append(one(s, repeat, p, scratch))
        info = {n: s.info() for n, s in systems.items()}
    return {"params": p, "systems": names, "system_info": info,
            "summary": summarize(runs, METRICS, names, [""]), "runs": runs}


def _hit_series(samples: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for a, b in zip(samples, samples[1:]):
        r = hit_ratio(a, b)
        if r is not None:
            xs.append(b["t"])
            ys.append(r)
    return xs, ys


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:
    p, names = doc["params"], doc["systems"]
    parts = [f"fusestate with `--cache-size {p['cache_mib']}M --memory-cache-size {p['memory_cache_mib']}M` "
             f"(JuiceFS: `--cache-size {p['cache_mib']}M`); "
             f"db_bench `fillrandom` of {p['working_set_bytes'] / (1 << 20):,.0f} MiB (10 × the cache; "
             f"{KEY} + {VALUE} bytes per key, no compression, WAL off), then `readrandom` with direct reads for "
             f"{p['read_seconds']} s. " + medians_note(doc, more=" (for the time and ratio rows it is only a quotient)"),
             ratio_table(doc["summary"], names, show_variant=False)]
    details = " ".join(d for d in (_run_sentence(n, doc["runs"]) for n in names if n.startswith("fusestate")) if d)
    if details:
        parts[0] += f" {details}"
    panels_runs = [r for r in doc["runs"] if r.get("series")]  # a failed run shows up to its failure
    first = {}
    for r in panels_runs:
        first.setdefault(r["system"], r)
    if first:
        nan = float("nan")
        tput = {}
        for n, r in first.items():
            fill, read = r["series"].get("fill", []), r["series"].get("read", [])
            pts = fill + ([(fill[-1][0], nan)] if fill and read else []) + read  # a gap while settling
            tput[n] = ([t for t, _ in pts], [max(q, 0.5) if q == q else q for _, q in pts])
        hits = {n: _hit_series(r["samples"]) for n, r in first.items() if r.get("samples")}
        panels = [{"ylabel": "ops/s (log)", "lines": tput, "logy": True,
                   "notes": [(0.5, "fillrandom, then readrandom after the gap")]}]
        if hits:
            panels.append({"ylabel": "cache hit ratio", "lines": hits, "ylim": (0, 1.05)})
        img = time_series(img_dir / "bigstate-timeline.png", panels,
                          title="State 10x the cache: throughput and cache hit ratio (first repetition)")
        parts.append(f"![bigstate timeline]({img_rel}/{img.name})")
    return "\n\n".join(parts)


def _run_sentence(name: str, runs: list[dict[str, Any]]) -> str:
    """The medians of one fusestate system's per-run numbers, in a sentence."""
    mine = [r for r in runs if r["system"] == name and not r.get("error")]
    if not mine:
        return ""

    def med(key: str) -> Optional[float]:
        return median_or_none(r.get(key) for r in mine)

    return (f"{name}, medians per run: database {fmt_num(med('db_bytes'), 'B')}, cache dir peak "
            f"{fmt_num(med('max_cache_disk_bytes'), 'B')}, dirty at most {fmt_num(med('max_dirty'), 'B')}, uploads "
            f"{med('fill_upload_mib_s') or 0:,.0f} MiB/s while filling, writers waited "
            f"{med('backpressure_seconds') or 0:.1f} s, {fmt_num(med('read_bytes_in'), 'B')} fetched while reading.")


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name in doc["systems"]:
        if not name.startswith("fusestate"):
            continue
        mine = [r for r in doc["runs"] if r["system"] == name]
        errors = [r["error"] for r in mine if r.get("error")]
        stalls = [(r["metrics"].get("longest_stall_s"), r["metrics"].get("max_write_ms"),
                   r["metrics"].get("stall_bound_s")) for r in mine if not r.get("error")]
        ok = not errors and bool(stalls) and all(
            st is not None and b is not None and st <= b and (w or 0) / 1000 <= b for st, w, b in stalls)
        worst = max((st or 0 for st, _, _ in stalls), default=None)
        slow = max((w or 0 for _, w, _ in stalls), default=None)
        bound = median_or_none(b for _, _, b in stalls)
        measured = f"{len(errors)} of {len(mine)} run(s) failed"
        if errors:
            measured += f" (first: {errors[0].split(': ')[-1][-90:]})"
        if stalls:
            measured += (f"; longest stall {worst or 0:.1f} s, slowest write {slow or 0:,.0f} ms, "
                         f"bound {bound or 0:.1f} s")
        out.append(goal_row(f"state 10x the cache on {name}: no errors, no stall past the backpressure bound",
                            measured, ok))
    return out

