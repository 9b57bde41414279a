"""Where things live on the node: the mountpoint, the cache directory layout and the control socket.

Light on imports: the CLI checks the mountpoint and the cache dir with these before it starts
the daemon, without loading the daemon's modules."""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from typing import Optional

from fusestate.errors import UserError


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
    def backing(self) -> str:
        """Backing files of volume files the kernel writes itself (FUSE passthrough)."""
        return os.path.join(self.root, "backing")

    @property
    def read_cache(self) -> str:
        return os.path.join(self.root, "blocks")

    @property
    def lock(self) -> str:
        return os.path.join(self.root, "lock")

    @property
    def log(self) -> str:
        return os.path.join(self.root, "fusestate.log")


UNIX_PATH_MAX = 108  # sun_path's size on Linux, its terminating NUL included


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


def check_mountpoint(path: str) -> None:
    if not os.path.exists(path):
        raise UserError(f"mountpoint {path} does not exist")
    if not os.path.isdir(path):
        raise UserError(f"mountpoint {path} is not a directory")
    if os.path.ismount(path) or _mounted_at(path):
        raise UserError(f"mountpoint {path} is busy: something is already mounted there")
    if not os.access(path, os.W_OK | os.X_OK) and os.geteuid() != 0:
        raise UserError(f"mountpoint {path} is not writable by this user")
    socket_path = control_socket(path)
    if len(os.fsencode(socket_path)) >= UNIX_PATH_MAX:
        raise UserError(f"the control socket's path {socket_path} is longer than a unix socket allows "
                        f"({UNIX_PATH_MAX - 1} bytes): set FUSESTATE_RUNTIME_DIR to a shorter directory")


def _mounted_at(path: str) -> bool:
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1 and fields[1].replace("\\040", " ") == real:
                return True
    return False


def prepare_cache_dir(path: str) -> CacheLayout:
    layout = CacheLayout(path)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write-test")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"cache dir {path} is not usable: {exc.strerror or exc}") from None
    return layout
