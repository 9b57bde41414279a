"""Remote store: the only code that knows which cloud it talks to."""

from fusestate.remote.backends import open_bucket
from fusestate.remote.store import RemoteError, RemoteStore

__all__ = ["RemoteError", "RemoteStore", "open_bucket"]
