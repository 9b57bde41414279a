"""Per-mount kernel tunables: the mount's backing device info (``/sys/class/bdi``).

The kernel gives a FUSE mount 128 KiB of read-ahead, so a sequential reader, and
RocksDB's 2 MiB compaction reads (which it makes on files it has told the kernel are
read at random), arrive as one 128 KiB request after another, each a round trip
through the daemon. FUSE requests can carry 1 MiB; with the read-ahead window as large,
a 1 GiB scan is about 1,000 requests instead of 8,000.
"""

from __future__ import annotations

import os
from pathlib import Path

BDI_ROOT = Path("/sys/class/bdi")


def bdi_dir(st_dev: int, root: Path = BDI_ROOT) -> Path:
    """The sysfs directory of the device a mount's files report in ``st_dev``."""
    return root / f"{os.major(st_dev)}:{os.minor(st_dev)}"


def read_ahead_bytes(st_dev: int, root: Path = BDI_ROOT) -> int:
    return int((bdi_dir(st_dev, root) / "read_ahead_kb").read_text()) * 1024


def set_read_ahead(st_dev: int, nbytes: int, root: Path = BDI_ROOT) -> int:
    """Set the mount's read-ahead window; returns what the kernel kept. Raises OSError
    where sysfs is not writable (not root, or a container with a read-only /sys)."""
    (bdi_dir(st_dev, root) / "read_ahead_kb").write_text(f"{nbytes // 1024}\n")
    return read_ahead_bytes(st_dev, root)
