"""A diagnostic record of a mount's reads: what RocksDB asked for, and what crossed the network.

With ``--read-trace FILE`` the daemon writes one JSON line per event, written through as it
happens (the file is read while the mount runs):

| ``e`` | fields | what |
|---|---|---|
| ``read`` | ``ino``, ``off``, ``n`` | a read the daemon answered (the page cache did not have it) |
| ``get`` | ``n`` | a whole block fetched from the bucket |
| ``get_range`` | ``n`` | a range read from the bucket |
| ``fill`` | ``ino``, ``off``, ``n``, ``part`` | bytes handed to the page cache: ``first`` or ``data`` (lazy), ``whole`` |

Every line has ``t``, the wall-clock time in seconds. ``bench/run --scenario spark-restart``
turns it into the restart's breakdown (bench/read_breakdown.py). Off by default: it costs a
write per read.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Optional


class ReadTrace:
    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the mount's life
        self._lock = threading.Lock()  # bucket reads are traced from worker threads

    def event(self, kind: str, **fields: int | str) -> None:
        line = json.dumps({"t": round(time.time(), 4), "e": kind, **fields}, separators=(",", ":"))
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def open_trace(path: Optional[str]) -> Optional[ReadTrace]:
    return ReadTrace(path) if path else None
