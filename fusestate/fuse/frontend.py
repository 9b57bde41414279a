"""Which front end speaks to the kernel for a mount, and why.

Two front ends serve the same :class:`FuseOperations`:

- ``pyfuse3``: libfuse 3 through pyfuse3. Runs on any kernel, without privileges; it cannot
  hand a file to the kernel (no FUSE passthrough in the libfuse it is built against).
- ``native``: the ``fusestate_kernel`` extension (Rust, fuser), with the kernel's writeback
  cache, as pyfuse3.
- ``passthrough``: the same extension, answering opens of files with a local copy with a
  backing file, whose reads and writes the kernel then serves itself (FUSE passthrough,
  Linux 6.9 and later, CAP_SYS_ADMIN); the kernel then keeps no writeback cache.

``--frontend auto`` picks pyfuse3 for now; the others are chosen by name.
"""

from __future__ import annotations

import logging
import os
import platform
import re
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from fusestate.config import FRONTENDS
from fusestate.errors import UserError
from fusestate.fuse.adapter import FuseOperations

log = logging.getLogger(__name__)

PASSTHROUGH_KERNEL = (6, 9)
CAP_SYS_ADMIN = 21


class FrontEnd(Protocol):
    name: str

    def mount(self, mountpoint: str, options: set[str]) -> None: ...
    async def serve(self) -> None: ...
    def notify_store(self, inode: int, offset: int, data: bytes) -> None: ...
    def terminate(self) -> None: ...
    def close(self) -> None: ...
    def agreed(self) -> dict[str, Any]: ...


class Pyfuse3FrontEnd:
    """libfuse 3 through pyfuse3: the kernel's writeback cache, no passthrough."""

    name = "pyfuse3"

    def __init__(self, ops: FuseOperations) -> None:
        self.ops = ops

    def mount(self, mountpoint: str, options: set[str]) -> None:
        import pyfuse3

        pyfuse3.init(self.ops, mountpoint, options)

    async def serve(self) -> None:
        import pyfuse3

        await pyfuse3.main(max_tasks=64)

    def notify_store(self, inode: int, offset: int, data: bytes) -> None:
        import pyfuse3

        pyfuse3.notify_store(inode, offset, data)

    def terminate(self) -> None:
        import pyfuse3

        pyfuse3.terminate()

    def close(self) -> None:
        import pyfuse3

        pyfuse3.close(unmount=True)

    def agreed(self) -> dict[str, Any]:
        return {"writeback_cache": True, "passthrough": False}


@dataclass(frozen=True)
class Choice:
    name: str                  # the front end that serves the mount
    reason: str                # why, in words for `fusestate status`
    passthrough: bool = False  # ask the kernel for FUSE passthrough (native only)


def kernel_version(release: Optional[str] = None) -> tuple[int, int]:
    """The running kernel's (major, minor), from a release such as ``6.18.44-fc``."""
    match = re.match(r"(\d+)\.(\d+)", release or platform.release())
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def has_cap_sys_admin() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (the backing-file ioctl needs it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def native_available() -> Optional[str]:
    """None when the native front end can run here; otherwise why not."""
    try:
        import fusestate_kernel  # noqa: F401
    except ImportError as exc:
        return f"the fusestate_kernel extension is not installed ({exc})"
    return None


def passthrough_available(release: Optional[str] = None) -> Optional[str]:
    """None when the kernel and this process allow FUSE passthrough; otherwise why not."""
    version = kernel_version(release)
    if version < PASSTHROUGH_KERNEL:
        return f"kernel {version[0]}.{version[1]} has no FUSE passthrough (6.9 or later has)"
    if not has_cap_sys_admin():
        return "the daemon lacks CAP_SYS_ADMIN, which registering a backing file needs"
    return native_available()


def choose(requested: str) -> Choice:
    """The front end for ``--frontend requested``; one named that cannot run here is an
    error (the mount fails with the reason)."""
    if requested not in FRONTENDS:
        raise UserError(f"bad --frontend {requested!r}: expected one of {', '.join(FRONTENDS)}")
    if requested == "pyfuse3":
        return Choice("pyfuse3", "chosen with --frontend pyfuse3")
    if requested in ("native", "passthrough"):
        missing = native_available()
        if missing:
            raise UserError(f"--frontend {requested} cannot run: {missing}")
    if requested == "native":
        return Choice("native", "chosen with --frontend native")
    if requested == "passthrough":
        missing = passthrough_available()
        if missing:
            raise UserError(f"--frontend passthrough cannot run: {missing}")
        return Choice("passthrough", "chosen with --frontend passthrough", passthrough=True)
    return Choice("pyfuse3", "the default (--frontend auto)")


def build(choice: Choice, ops: FuseOperations) -> FrontEnd:
    if choice.name in ("native", "passthrough"):
        from fusestate.fuse.native import NativeFrontEnd

        # The kernel takes no writeback cache with passthrough: files written get backing files.
        return NativeFrontEnd(ops, writeback_cache=ops.enable_writeback_cache and not choice.passthrough,
                              passthrough=choice.passthrough)
    return Pyfuse3FrontEnd(ops)
