"""CPU time spent by each part of a run, read from /proc.

On a machine where every part shares the same cores, a throughput ratio is a ratio of CPU
spent per record: what fusestate's daemons and its database take is what Spark does not
get. A snapshot before and after a phase gives each part's share of it.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

TICK = os.sysconf("SC_CLK_TCK")
PARTS = ("fusestate", "juicefs", "postgresql", "spark", "endpoint", "other")


def _part(comm: str, cmdline: str) -> str:
    if "-m fusestate mount" in cmdline:
        return "fusestate"
    if comm == "juicefs":
        return "juicefs"  # the peer's mount processes (a cluster whose checkpoint is on JuiceFS)
    if "-m bench.shaped_s3" in cmdline or "moto_server" in cmdline:
        return "endpoint"  # the S3 endpoint: a remote service, here on the machine's cores
    if comm == "postgres":
        return "postgresql"
    if comm == "java" or "pyspark" in cmdline or "spark-pipeline" in cmdline:
        return "spark"
    return "other"


@dataclass
class CpuSnapshot:
    """The machine's busy time read just before and just after the scan of every process,
    so that a window from one snapshot's first reading to the next one's last holds all
    the process time either scan saw (on a busy machine the scan itself takes a while)."""

    busy_before_scan: float                  # seconds of every core not idle, since boot
    busy_after_scan: float
    by_process: dict[tuple[int, int], tuple[str, float]] = field(default_factory=dict)
    # (pid, start tick) -> (part, seconds): the start tick tells a reused pid from its predecessor


def _machine_busy() -> float:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return (sum(ticks[:8]) - idle) / TICK


def snapshot() -> CpuSnapshot:
    busy_before = _machine_busy()
    by_process: dict[tuple[int, int], tuple[str, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        by_process[(int(name), int(fields[19]))] = (_part(comm, cmdline),
                                                    (int(fields[11]) + int(fields[12])) / TICK)
    return CpuSnapshot(busy_before, _machine_busy(), by_process)


def spent(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """CPU seconds between two snapshots: the machine's, and each part's (a process that
    ended in between is missing from its part, and counted in the machine's). A process
    is charged to the part it belongs to at the end (an exec may change it)."""
    parts: Counter[str] = Counter({p: 0.0 for p in PARTS})
    for key, (part, seconds) in after.by_process.items():
        earlier = before.by_process.get(key)
        parts[part] += seconds - (earlier[1] if earlier else 0.0)
    return {"machine": after.busy_after_scan - before.busy_before_scan, **dict(parts)}
