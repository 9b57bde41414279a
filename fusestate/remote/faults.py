"""Fault injection for tests of ordering and retries under a misbehaving bucket.

Enabled only by the ``FUSESTATE_FAULTS`` environment variable, e.g.
``error_rate=0.2,delay=0.05,ops=put+get,seed=7``: each matching remote call
sleeps up to ``delay`` seconds (and exactly ``pause`` seconds more) and fails with a
connection error at ``error_rate``, before it reaches the bucket. ``under=blocks/``
limits the faults to keys under that prefix.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Optional

ENV = "FUSESTATE_FAULTS"


class FaultInjector:
    def __init__(self, error_rate: float = 0.0, delay: float = 0.0, ops: Optional[set[str]] = None,
                 seed: Optional[int] = None, pause: float = 0.0, under: str = "") -> None:
        self.error_rate = error_rate
        self.delay = delay
        self.pause = pause
        self.under = under
        self.ops = ops
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.injected = 0

    @classmethod
    def from_env(cls) -> Optional["FaultInjector"]:
        spec = os.environ.get(ENV)
        if not spec:
            return None
        fields = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
        ops = set(fields["ops"].split("+")) if "ops" in fields else None
        seed = int(fields["seed"]) if "seed" in fields else None
        return cls(float(fields.get("error_rate", 0)), float(fields.get("delay", 0)), ops, seed,
                   float(fields.get("pause", 0)), fields.get("under", ""))

    def __call__(self, op: str, key: str) -> None:
        if (self.ops is not None and op not in self.ops) or not key.startswith(self.under):
            return
        with self._lock:
            pause = self.pause + (self._random.uniform(0, self.delay) if self.delay else 0.0)
            fail = self._random.random() < self.error_rate
        if pause:
            time.sleep(pause)
        if fail:
            self.injected += 1
            raise ConnectionError(f"injected fault in {op} {key}")
