"""The one exception the vfs raises: an errno for the caller (FUSE or a test)."""

import errno as _errno

from fusestate.errors import FsError

__all__ = ["FsError", "enoent"]


def enoent() -> FsError:
    return FsError(_errno.ENOENT)
