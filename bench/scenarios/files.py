"""Scenario 2: plain file I/O with fio, and the small-file metadata rate, on every system.

fio writes one file sequentially in 1 MiB blocks and fsyncs it at the end (so every system
pays for making the data durable in its own way), reads it back sequentially and in
random 4 KiB reads (fio drops the file's page cache first: the system's own caches are
warm), then once more sequentially after the system's caches are made cold. The
small-file phase creates, stats, lists, renames and unlinks many 4 KiB files (each phase
bounded in time, so a slow peer costs seconds, not the run): the metadata rate, where
``fusestate-pg`` (the shared PostgreSQL engine) and ``fusestate-file`` (the embedded SQLite
engine) differ most.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from bench.common import BASELINE, Context, Metric, RunError, error_text, log, record, run_cmd, summarize
from bench.render import bars_from_rows, goal_row, medians_note, percentile_lines, ratio_table
from bench.systems import ALL, System, open_systems

NAME = "files"
TITLE = "Files (fio, small files)"
SUMMARY = ("fio sequential write/read 1 MiB, random read 4 KiB, cold sequential read; "
           "small-file create/stat/readdir/rename/unlink")
BUDGET = {"tiny": None, "quick": 130.0, "full": None}
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"file_mib": 16, "randread_seconds": 1, "small_files": 100, "phase_seconds": 5, "timeout": 60},
    "quick": {"file_mib": 256, "randread_seconds": 3, "small_files": 300, "phase_seconds": 4, "timeout": 120},
    "full": {"file_mib": 512, "randread_seconds": 10, "small_files": 1000, "phase_seconds": 10, "timeout": 600},
}
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
]
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


def small_files(d: Path, n: int, limit: float) -> dict[str, float]:
    """create/stat/readdir/rename/unlink rates over up to ``n`` files, each phase cut off after
    ``limit`` seconds (readdir: whole listings with attributes, as ``ls -l`` makes them)."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    payload = os.urandom(4096)
    names = [d / f"f{i:06d}" for i in range(n)]

    def create(p: Path) -> None:
        with open(p, "wb") as f:
            f.write(payload)

    rates: dict[str, float] = {}
    done, rates["create"] = _timed(names, create, limit)
    created = names[:done]
    _, rates["stat"] = _timed(created, os.stat, limit)
    t, listed = time.monotonic(), 0
    while not listed or (time.monotonic() - t < limit / 4 and listed < 20 * len(created)):
        with os.scandir(d) as it:
            listed += sum(1 for e in it if e.stat(follow_symlinks=False))
    rates["readdir"] = listed / (time.monotonic() - t)
    done, rates["rename"] = _timed(created, lambda p: os.rename(p, p.with_suffix(".r")), limit)
    created = [p.with_suffix(".r") for p in created[:done]] + created[done:]
    _, rates["unlink"] = _timed(created, os.unlink, limit)
    rates["files"] = len(created)
    return rates


def one(s: System, repeat: int, p: dict[str, Any], failed: dict[str, str]) -> dict[str, Any]:
    if s.error or s.name in failed:
        return record(s.name, repeat, error=s.error or f"skipped: {failed[s.name]}")
    f = s.path / "fio.dat"
    metrics: dict[str, float] = {}
    extra: dict[str, Any] = {}
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

    def small() -> None:
        rates = small_files(s.path / "small", p["small_files"], p["phase_seconds"])
        extra["small_files"] = rates.pop("files")
        metrics.update(rates)

    step("seqwrite", seqwrite)
    if "seqwrite" in metrics:
        step("seqread", seqread)
        step("randread", randread)
        step("seqread_cold", seqread_cold)
    step("small files", small)
    if errors:
        extra["diagnosis"] = s.diagnosis()
        if not s.usable():
            step("remount", s.revive)
    with_fs_unlink(f)
    shutil.rmtree(s.path / "small", ignore_errors=True)
    try:
        s.settle()
    except Exception as exc:  # noqa: BLE001
        errors.append(f"settle: {error_text(exc)}")
    if not metrics and errors:
        failed[s.name] = errors[0]
    error = "; ".join(errors) or None
    log(f"  files r{repeat + 1} {s.name:<15} " + " ".join(f"{k}={v:,.0f}" for k, v in metrics.items())
        + (f"  ERROR {error}" if error else ""))
    return record(s.name, repeat, metrics=metrics, error=error, **extra)


def with_fs_unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def run(ctx: Context) -> dict[str, Any]:
    p = dict(ctx.pick(SIZES))
    names = ctx.wanted(ALL)
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
            "runs": runs}


def render(doc: dict[str, Any], img_dir: Path, img_rel: str) -> str:
    p, names, rows = doc["params"], doc["systems"], doc["summary"]
    parts = [f"fio (`--ioengine=psync`) on one {p['file_mib']} MiB file: a sequential write in 1 MiB blocks with "
             f"`--end_fsync=1`, a sequential read, {p['randread_seconds']} s of random 4 KiB reads with `--direct=1` "
             f"(the page cache would answer them all otherwise), and a sequential read after the caches are made "
             f"cold. Small files: up to {p['small_files']:,} files of 4 KiB created, stat'ed, listed, renamed and "
             f"unlinked ({p['phase_seconds']} s per phase at most). " + medians_note(doc),
             ratio_table(rows, names, show_variant=False)]
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
    return out
