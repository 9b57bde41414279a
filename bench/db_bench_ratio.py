#!/usr/bin/env python3
"""RocksDB db_bench on local disk and on a fusestate mount, side by side.

Runs the same db_bench invocation against a directory on local disk and
against a fresh fusestate mount of a file:// bucket, interleaved
(local, fusestate, local, fusestate, ...) so that drift in machine load hits
both sides alike. Prints the median ops/sec per benchmark and the ratio
fusestate/local, and writes every raw number to bench/results/.

Each invocation runs the whole benchmark list in one db_bench process on a
fresh database (``--use_existing_db=0``): readrandom reads the database that
fillrandom just wrote, with the page cache and the daemon's caches warm.
Between runs the script waits until the mount has uploaded everything it
staged and calls sync(), so leftover background I/O from one run does not
land in the next one.

Example:
    .venv/bin/python bench/db_bench_ratio.py --repeats 3 --disable-wal
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DEFAULT_FUSESTATE = Path(sys.executable).parent / "fusestate"

LINE = re.compile(r"^(?P<name>\w+)\s*:\s*(?P<micros>[\d.]+) micros/op\s+(?P<ops>\d+) ops/sec")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--benchmarks", default="fillrandom,readrandom",
                   help="db_bench --benchmarks list, run in one process per run (default %(default)s)")
    p.add_argument("--with-fillseq", action="store_true", help="prepend fillseq to the benchmark list")
    p.add_argument("--with-overwrite", action="store_true", help="append overwrite to the benchmark list")
    p.add_argument("--repeats", type=int, default=3, help="runs per side (default %(default)s)")
    p.add_argument("--num", type=int, default=1_000_000, help="keys per benchmark (default %(default)s)")
    p.add_argument("--value-size", type=int, default=400, help="value bytes (default %(default)s)")
    p.add_argument("--key-size", type=int, default=16, help="key bytes (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="db_bench --threads (default %(default)s)")
    p.add_argument("--disable-wal", action="store_true",
                   help="db_bench --disable_wal=1 (how Spark's RocksDB state store writes)")
    p.add_argument("--db-bench-arg", action="append", default=[], metavar="ARG",
                   help="extra db_bench argument, e.g. --db-bench-arg=--compression_type=lz4 (repeatable)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the short untimed run on each side that warms binaries and caches")
    p.add_argument("--workdir", default=None,
                   help="local-disk directory for the local DB, the bucket, the mount and the cache "
                        "(default: a fresh temp dir, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the workdir")
    p.add_argument("--db-bench", default=shutil.which("db_bench") or "db_bench", help="db_bench binary")
    p.add_argument("--fusestate", default=str(DEFAULT_FUSESTATE), help="fusestate CLI")
    p.add_argument("--cache-size", default="8G", help="fusestate --cache-size (default %(default)s)")
    p.add_argument("--durability", choices=["remote", "local"], default="remote",
                   help="fusestate --durability (default %(default)s)")
    p.add_argument("--mount-arg", action="append", default=[], metavar="ARG",
                   help="extra fusestate mount argument (repeatable)")
    p.add_argument("--drain-timeout", type=float, default=600.0,
                   help="seconds to wait for uploads between runs (default %(default)s)")
    p.add_argument("--run-timeout", type=float, default=1800.0,
                   help="seconds one db_bench run may take (default %(default)s)")
    p.add_argument("--output", default=None, help="JSON result path (default bench/results/db_bench_ratio-<time>.json)")
    return p.parse_args(argv)


def benchmark_list(args: argparse.Namespace) -> list[str]:
    names = [b for b in args.benchmarks.split(",") if b]
    if args.with_fillseq and "fillseq" not in names:
        names.insert(0, "fillseq")
    if args.with_overwrite and "overwrite" not in names:
        names.append("overwrite")
    return names


def db_bench_cmd(args: argparse.Namespace, db: Path, benchmarks: list[str], num: int) -> list[str]:
    cmd = [
        args.db_bench,
        f"--db={db}",
        f"--benchmarks={','.join(benchmarks)}",
        f"--num={num}",
        f"--value_size={args.value_size}",
        f"--key_size={args.key_size}",
        f"--threads={args.threads}",
        "--use_existing_db=0",
        "--seed=1",
        f"--disable_wal={1 if args.disable_wal else 0}",
    ]
    return cmd + list(args.db_bench_arg)


# --- the mount -------------------------------------------------------------------
class FusestateMount:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.cli = args.fusestate
        self.bucket = work / "bucket"
        self.path = work / "mnt"
        self.cache = work / "cache"
        self.extra = ["--cache-size", args.cache_size, "--durability", args.durability, *args.mount_arg]
        self.env = dict(os.environ)
        self.env.setdefault("FUSESTATE_RUNTIME_DIR", str(work / "run"))
        Path(self.env["FUSESTATE_RUNTIME_DIR"]).mkdir(parents=True, exist_ok=True)
        self.mounted = False

    def _cli(self, *argv: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.cli, *argv], capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise RuntimeError(f"fusestate {' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def mount(self) -> None:
        for d in (self.bucket, self.path, self.cache):
            d.mkdir(parents=True, exist_ok=True)
        self._cli("mount", f"file://{self.bucket}", str(self.path), "--cache-dir", str(self.cache), *self.extra)
        self.mounted = True

    def status(self) -> dict[str, Any]:
        return json.loads(self._cli("status", "--json", str(self.path)).stdout)

    def wait_drained(self, timeout: float) -> float:
        """Wait until nothing is dirty or staged; returns the seconds waited."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            wb = self.status()["writeback"]
            if wb["staged_blocks"] == 0 and wb["dirty_bytes"] == 0:
                break
            time.sleep(0.5)
        else:
            print(f"  warning: uploads still pending after {timeout:.0f}s", file=sys.stderr)
        return time.monotonic() - started

    def umount(self) -> None:
        if not self.mounted and not is_mounted(self.path):
            return
        proc = self._cli("umount", str(self.path), "--timeout", "600", timeout=660, check=False)
        if proc.returncode != 0 or is_mounted(self.path):
            print(f"  warning: clean unmount failed ({proc.stderr.strip()}); detaching lazily", file=sys.stderr)
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        self.mounted = False


def is_mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == real for line in f)


# --- runs ------------------------------------------------------------------------
def run_db_bench(cmd: list[str], timeout: float) -> dict[str, Any]:
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"db_bench failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    results: dict[str, dict[str, float]] = {}
    for line in proc.stdout.splitlines():
        m = LINE.match(line.strip())
        if m:
            results[m["name"]] = {"ops_per_sec": int(m["ops"]), "micros_per_op": float(m["micros"])}
    return {"wall_seconds": round(wall, 3), "benchmarks": results}


def fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def one_run(args: argparse.Namespace, side: str, db_parent: Path, benchmarks: list[str], num: int,
            mount: FusestateMount) -> dict[str, Any]:
    fresh_dir(db_parent)
    load_before = os.getloadavg()[0]
    result = run_db_bench(db_bench_cmd(args, db_parent / "db", benchmarks, num), args.run_timeout)
    # Other work on the machine skews both sides; the 1-minute load average shows it.
    result["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    settle_started = time.monotonic()
    if side == "fusestate":
        result["status_after"] = {k: mount.status()[k] for k in ("writeback", "cache", "remote")}
    shutil.rmtree(db_parent, ignore_errors=True)
    if side == "fusestate":
        mount.wait_drained(args.drain_timeout)
    os.sync()
    result["settle_seconds"] = round(time.monotonic() - settle_started, 3)
    return result


def summarize(runs: dict[str, list[dict[str, Any]]], benchmarks: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in benchmarks:
        local = [r["benchmarks"][name]["ops_per_sec"] for r in runs["local"] if name in r["benchmarks"]]
        fuse = [r["benchmarks"][name]["ops_per_sec"] for r in runs["fusestate"] if name in r["benchmarks"]]
        if not local or not fuse:
            continue
        lm, fm = statistics.median(local), statistics.median(fuse)
        rows.append({"benchmark": name, "local_median": lm, "fusestate_median": fm,
                     "ratio": round(fm / lm, 3) if lm else None, "local_runs": local, "fusestate_runs": fuse})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'benchmark':<12} {'local ops/s':>12} {'fusestate ops/s':>16} {'ratio':>7}   runs local | fusestate"
    print(head)
    print("-" * len(head))
    for r in rows:
        runs = f"{','.join(str(x) for x in r['local_runs'])} | {','.join(str(x) for x in r['fusestate_runs'])}"
        print(f"{r['benchmark']:<12} {r['local_median']:>12.0f} {r['fusestate_median']:>16.0f} "
              f"{r['ratio']:>7.3f}   {runs}")


def environment(args: argparse.Namespace) -> dict[str, Any]:
    version = subprocess.run([args.db_bench, "--version"], capture_output=True, text=True).stdout.strip()
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "db_bench": version, "host": platform.node()}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    benchmarks = benchmark_list(args)
    if args.workdir:
        work = Path(args.workdir).resolve()
        work.mkdir(parents=True, exist_ok=True)
        owned = False
    else:
        work = Path(tempfile.mkdtemp(prefix="db_bench_ratio-", dir="/var/tmp"))
        owned = True
    mount = FusestateMount(args, work)
    sides = {"local": work / "local", "fusestate": mount.path / "bench"}
    runs: dict[str, list[dict[str, Any]]] = {"local": [], "fusestate": []}
    started = dt.datetime.now()
    print(f"workdir {work}")
    print("command: " + " ".join(db_bench_cmd(args, Path("<dir>/db"), benchmarks, args.num)))
    try:
        mount.mount()
        print(f"mounted {mount.path} (daemon pid {mount.status()['pid']})")
        if not args.no_warmup:
            for side, parent in sides.items():
                one_run(args, side, parent, benchmarks, max(10_000, args.num // 10), mount)
        for i in range(args.repeats):
            for side, parent in sides.items():
                r = one_run(args, side, parent, benchmarks, args.num, mount)
                runs[side].append(r)
                ops = "  ".join(f"{n}={v['ops_per_sec']}" for n, v in r["benchmarks"].items())
                print(f"run {i + 1}/{args.repeats} {side:<9} {r['wall_seconds']:7.1f}s  {ops}"
                      f"  (load {r['loadavg_1m'][0]:.1f}->{r['loadavg_1m'][1]:.1f})", flush=True)
    finally:
        mount.umount()
        if owned and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    rows = summarize(runs, benchmarks)
    print()
    print_table(rows)
    doc = {
        "started": started.isoformat(timespec="seconds"),
        "command": db_bench_cmd(args, Path("<dir>/db"), benchmarks, args.num),
        "mount_args": mount.extra,
        "params": {k: v for k, v in vars(args).items()},
        "environment": environment(args),
        "summary": rows,
        "runs": runs,
    }
    out = Path(args.output) if args.output else RESULTS / f"db_bench_ratio-{started:%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
