"""Metadata: inodes, directory entries, block maps and object reference counts."""

from fusestate.meta.engine import DirEntry, Inode, MetadataEngine
from fusestate.meta.sqlite_engine import SQLiteEngine

__all__ = ["DirEntry", "Inode", "MetadataEngine", "SQLiteEngine"]
