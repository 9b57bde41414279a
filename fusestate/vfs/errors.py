"""The one exception the vfs raises: an errno for the caller (FUSE or a test)."""

import errno as _errno

from fusestate.errors import FsError

__all__ = ["FsError", "commit_error", "enoent", "from_os_error"]


def enoent() -> FsError:
    return FsError(_errno.ENOENT)


def from_os_error(exc: OSError) -> FsError:
    """An error of the cache disk (a scratch file's, a block's) as the caller's errno."""
    return exc if isinstance(exc, FsError) else FsError(exc.errno or _errno.EIO, exc.strerror or "")


def commit_error(exc: BaseException) -> BaseException:
    """What a failed seal and commit of a local file reports: EIO for an upload that failed
    its retries, the errno of the cache disk's own error, anything else as it is."""
    from fusestate.blocks.uploader import UploadFailed

    if isinstance(exc, UploadFailed):
        return FsError(_errno.EIO, str(exc))
    if isinstance(exc, OSError) and not isinstance(exc, FsError):
        return from_os_error(exc)
    return exc
