"""POSIX semantics over the metadata engine and the block store, independent of FUSE."""

from fusestate.vfs.errors import FsError
from fusestate.vfs.filesystem import FileSystem, RequestContext

__all__ = ["FileSystem", "FsError", "RequestContext"]
