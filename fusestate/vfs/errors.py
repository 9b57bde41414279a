"""The one exception the vfs raises: an errno for the caller (FUSE or a test)."""

import errno as _errno

from fusestate.errors import FsError

__all__ = ["FsError", "enoent", "from_os_error"]


def enoent() -> FsError:
    return FsError(_errno.ENOENT)


def from_os_error(exc: OSError) -> FsError:
    """An error of the cache disk (a scratch file's, a block's) as the caller's errno."""
    return exc if isinstance(exc, FsError) else FsError(exc.errno or _errno.EIO, exc.strerror or "")
