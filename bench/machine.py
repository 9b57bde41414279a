"""The machine and the versions of everything a run used, stored with every result.

A ratio means little without the machine it was measured on (cores, memory, kernel, the
disk the bucket shares) and the versions of the tools on both sides of it.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from bench.common import ROOT, juicefs_binary


def _first_line(cmd: list[str]) -> Optional[str]:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (proc.stdout or proc.stderr).strip()
    return text.splitlines()[0].strip() if text else None


def _package(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024
    return out


def _cpu_model() -> Optional[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def _git(*args: str) -> Optional[str]:
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _postgres_version() -> Optional[str]:
    """The PostgreSQL server the shared-volume systems run (the newest Debian installs)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    return _first_line([str(found[-1]), "--version"]) if found else None


def _os_release() -> Optional[str]:
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def describe() -> dict[str, Any]:
    """Cores, memory, kernel, disk, and the versions of the benchmarked tools."""
    mem = _meminfo()
    disk = shutil.disk_usage("/var/tmp")
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", "fusestate")
    return {
        "host": platform.node(),
        "cores": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": mem.get("MemTotal"),
        "kernel": platform.release(),
        "os": _os_release(),
        "disk_free_bytes": disk.free,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "versions": {
            "fusestate": _package("fusestate"),
            "fusestate_git": (_git("rev-parse", "--short=12", "HEAD") or "?") + ("+dirty" if dirty else ""),
            "python": platform.python_version(),
            "pyfuse3": _package("pyfuse3"),
            "trio": _package("trio"),
            "fsspec": _package("fsspec"),
            "s3fs_python": _package("s3fs"),
            "moto": _package("moto"),
            "pyspark": _package("pyspark"),
            "matplotlib": _package("matplotlib"),
            "db_bench": _first_line(["db_bench", "--version"]),
            "fio": _first_line(["fio", "--version"]),
            "rclone": _first_line(["rclone", "version"]),
            "s3fs_fuse": _first_line(["s3fs", "--version"]),
            "fuse": _first_line(["fusermount3", "-V"]),
            "java": _first_line(["java", "-version"]),
            "juicefs": _first_line([juicefs_binary() or "juicefs", "version"]),
            "postgresql": _postgres_version(),
        },
    }


def summary_line(m: dict[str, Any]) -> str:
    mem = (m.get("memory_bytes") or 0) / (1 << 30)
    return f"{m.get('cores')} cores ({m.get('cpu_model')}), {mem:.0f} GiB, Linux {m.get('kernel')}, {m.get('os')}"
