"""Metadata: inodes, directory entries, block maps and object reference counts, behind one
operation-level engine interface.

This package's own modules are what every engine shares: the contract (``engine``:
``MetaEngine``, ``Inode`` and the rest) and the POSIX operations as SQL (``operations``).
Each engine family is a sub-package that builds on them and on nothing of another:
``embedded`` (SQLite, one node), ``postgres`` (many nodes), ``scratch`` (a shared volume's
node-local directories).
"""

from fusestate.meta.engine import DirEntry, Inode, MetaEngine

__all__ = ["DirEntry", "Inode", "MetaEngine"]
