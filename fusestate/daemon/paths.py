"""Where things live on the node: the cache directory layout and the control socket."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class CacheLayout:
    root: str

    @property
    def metadata(self) -> str:
        return os.path.join(self.root, "meta.db")

    @property
    def volume_file(self) -> str:
        return os.path.join(self.root, "volume.json")

    @property
    def staging(self) -> str:
        return os.path.join(self.root, "staging")

    @property
    def scratch(self) -> str:
        return os.path.join(self.root, "scratch")

    @property
    def read_cache(self) -> str:
        return os.path.join(self.root, "blocks")

    @property
    def lock(self) -> str:
        return os.path.join(self.root, "lock")

    @property
    def log(self) -> str:
        return os.path.join(self.root, "fusestate.log")


def runtime_dir() -> str:
    explicit = os.environ.get("FUSESTATE_RUNTIME_DIR")
    if explicit:
        return explicit
    if os.geteuid() == 0:
        return "/run/fusestate"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(xdg, "fusestate") if xdg else f"/tmp/fusestate-{os.geteuid()}"


def control_socket(mountpoint: str, runtime: Optional[str] = None) -> str:
    """The daemon's control socket, found from the mountpoint alone (and the runtime dir of
    the daemon's environment, when that is not this process's)."""
    digest = hashlib.sha256(os.path.realpath(mountpoint).encode()).hexdigest()[:20]
    return os.path.join(runtime or runtime_dir(), f"{digest}.sock")
