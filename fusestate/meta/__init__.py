"""Metadata: inodes, directory entries, block maps and object reference counts, behind one
operation-level engine interface (``engine.MetaEngine``)."""

from fusestate.meta.engine import DirEntry, Inode, MetaEngine

__all__ = ["DirEntry", "Inode", "MetaEngine"]
