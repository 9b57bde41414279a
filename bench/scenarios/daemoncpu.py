"""The daemon's CPU per GiB: the yardstick for work on its cost per byte.

On two cores that Spark keeps busy, every second of CPU the daemon spends is a second
the job does not get (docs/benchmarks.md, the Spark scenario). This writes GiB-sized
files of distinct blocks through a ``file://`` mount in 1 MiB writes with an ``fsync``
per file, then reads them back (kernel page cache dropped first, so every read reaches
the daemon) from the node's disk cache, then again on a fresh node (the volume mounted
on an empty cache dir, every block from the bucket), and reports the daemon's user and
system seconds per GiB for each phase, from ``/proc/<pid>/stat``. Wall time is printed
but is not the point.

``--against DIR`` runs a second source tree of fusestate (a ``git worktree`` of another
revision) interleaved with this one, so a change is judged side by side::

    git worktree add /tmp/base HEAD~1
    .venv/bin/python bench/daemon_cpu.py --gib 4 --repeats 3 --against /tmp/base

The kernel's page cache is dropped before every run (root only): on an ext4 without a
journal, as on our test VMs, creating files gets slower while inode table blocks of
recently deleted files stay cached, which otherwise drifts the system time upwards run
after run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.spark_bench import FUSESTATE, drop_page_cache, status, unmount  # noqa: E402

MIB = 1 << 20
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system seconds of the whole process, threads that have exited included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def daemon_pid(mnt: Path) -> int:
    return int(status(mnt)["pid"])


def one_run(work: Path, gib: int, source: Optional[str], seed: bytes) -> dict:
    env = dict(os.environ)
    if source:
        env["PYTHONPATH"] = source  # ahead of the editable install: that tree's daemon runs
    bucket, mnt, cache = work / "bucket", work / "mnt", work / "cache"
    for d in (bucket, mnt):
        d.mkdir(parents=True)
    drop_page_cache()

    def mount() -> None:
        subprocess.run([FUSESTATE, "mount", f"file://{bucket}", str(mnt), "--cache-dir", str(cache),
                        "--metrics-addr", "off"], check=True, env=env, cwd="/")
    mount()
    try:
        pid = daemon_pid(mnt)
        result: dict = {"source": source or "this tree", "gib": gib}
        before, started = cpu_seconds(pid), time.monotonic()
        for n in range(gib):
            with open(mnt / f"file-{n}", "wb", buffering=0) as f:
                for off in range(0, 1 << 30, MIB):  # distinct blocks: nothing deduplicates
                    f.write((n << 32 | off).to_bytes(8, "little") + seed[8:])
                os.fsync(f.fileno())
        result["write"] = phase(pid, before, started, gib)
        result["read"] = read_all(mnt, pid, gib)
        # A fresh node: the same volume on an empty cache dir, every block from the bucket.
        unmount(mnt)
        shutil.rmtree(cache)
        mount()
        result["read_fresh"] = read_all(mnt, daemon_pid(mnt), gib)
        return result
    finally:
        unmount(mnt)
        shutil.rmtree(work, ignore_errors=True)


def read_all(mnt: Path, pid: int, gib: int) -> dict:
    drop_page_cache()
    before, started = cpu_seconds(pid), time.monotonic()
    for n in range(gib):
        with open(mnt / f"file-{n}", "rb", buffering=0) as f:
            while f.read(MIB):
                pass
    return phase(pid, before, started, gib)


def phase(pid: int, before: tuple[float, float], started: float, gib: int) -> dict:
    user, system = cpu_seconds(pid)
    return {"wall_s": round(time.monotonic() - started, 2),
            "user_s_per_gib": round((user - before[0]) / gib, 3),
            "sys_s_per_gib": round((system - before[1]) / gib, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=int, default=4, help="GiB written and read per run (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--against", metavar="DIR", help="another fusestate source tree, run interleaved")
    p.add_argument("--workdir", default="/var/tmp", help="where buckets and cache dirs go")
    args = p.parse_args()
    seed = os.urandom(MIB)
    sources: list[Optional[str]] = [None] + ([os.path.abspath(args.against)] if args.against else [])
    runs: list[dict] = []
    for _ in range(args.repeats):
        for source in sources:
            work = Path(tempfile.mkdtemp(prefix="fusestate-cpu-", dir=args.workdir))
            shutil.rmtree(work)
            runs.append(one_run(work, args.gib, source, seed))
            print(json.dumps(runs[-1]), flush=True)
    print(f"\nmedian daemon CPU seconds per GiB ({args.repeats} runs each)")
    for source in sources:
        mine = [r for r in runs if r["source"] == (source or "this tree")]
        cells = []
        for name in ("write", "read", "read_fresh"):
            user = statistics.median(r[name]["user_s_per_gib"] for r in mine)
            system = statistics.median(r[name]["sys_s_per_gib"] for r in mine)
            cells.append(f"{name}: user {user:.2f} + sys {system:.2f}")
        print(f"  {source or 'this tree'}: " + ";  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
