"""The one exception the vfs raises: an errno for the caller (FUSE or a test)."""

import errno as _errno
import os


class FsError(OSError):
    def __init__(self, code: int, detail: str = "") -> None:
        super().__init__(code, detail or os.strerror(code))


def enoent() -> FsError:
    return FsError(_errno.ENOENT)
