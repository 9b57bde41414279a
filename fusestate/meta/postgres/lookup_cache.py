"""Names and attributes a shared-volume node answers without asking the database.

A lookup on PostgreSQL is a round trip to the server: about 0.1 ms of the 0.13 ms a
``stat`` of an uncached name takes, where the rest is the kernel and the daemon. This
cache keeps what this node last read or wrote of each name and inode, and is trusted only
while the database's change notifications reach the node (``change_feed``): every other
node's change of a name or an inode drops that entry here, and this node's own changes
update it as they commit. An entry is two parts, the name's inode and the inode's
attributes, dropped apart: an inode changed elsewhere loses its attributes and keeps its
names. Directories are not kept: their attributes change with every create and unlink in
them, which would each be announced to every node; the kernel keeps a directory's name
for ``--attr-timeout`` anyway, so a path walk asks for each directory at most that often.

A read that started before a change was applied here may come back after it with what
the change replaced; every change advances a generation, and a read fills the cache only
if the generation it started under is still the current one.
"""

from __future__ import annotations

import dataclasses
import stat
from typing import Iterable, Optional

from fusestate.meta.engine import Inode

DEFAULT_ENTRIES = 25_000  # names and inodes each: about 10 MB (0.4 KB a name with its inode)

Name = tuple[int, bytes]  # (parent inode, name)


class LookupCache:
    """See the module docstring. Not thread-safe: used from the event loop only."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES) -> None:
        self.max_entries = max_entries
        self.generation = 0
        self._names: dict[Name, int] = {}
        self._nodes: dict[int, Inode] = {}
        self.hits = 0
        self.misses = 0
        self.dropped_elsewhere = 0  # entries dropped by other nodes' changes

    def lookup(self, parent: int, name: bytes) -> Optional[Inode]:
        ino = self._names.get((parent, name))
        node = None if ino is None else self._nodes.get(ino)
        if node is None:
            self.misses += 1
            return None
        self.hits += 1
        return dataclasses.replace(node)

    def node(self, ino: int) -> Optional[Inode]:
        node = self._nodes.get(ino)
        return None if node is None else dataclasses.replace(node)

    def fill(self, since: int, parent: int, name: bytes, node: Inode) -> None:
        """What a read (or this node's own create) started under generation ``since`` found."""
        if since != self.generation or stat.S_ISDIR(node.mode):
            return
        _put(self._names, (parent, name), node.id, self.max_entries)
        _put(self._nodes, node.id, dataclasses.replace(node), self.max_entries)

    def wrote(self, rows: dict[int, Optional[Inode]], names: Iterable[Name] = ()) -> None:
        """This node committed ``rows`` (None: the inode is gone) and changed ``names``. A row
        replaces only one already here: an absent one may have been dropped by a change that
        came from elsewhere after this node's."""
        self.generation += 1
        for key in names:
            self._names.pop(key, None)
        for ino, node in rows.items():
            if node is None:
                self._nodes.pop(ino, None)
            elif ino in self._nodes:
                self._nodes[ino] = dataclasses.replace(node)

    def changed_elsewhere(self, names: Iterable[Name], inodes: Iterable[int]) -> None:
        """Another node committed changes of these names and inodes."""
        self.generation += 1
        for key in names:
            self.dropped_elsewhere += self._names.pop(key, None) is not None
        for ino in inodes:
            self.dropped_elsewhere += self._nodes.pop(ino, None) is not None

    def clear(self) -> None:
        """Forget everything (notifications may have been missed)."""
        self.generation += 1
        self._names.clear()
        self._nodes.clear()

    def __len__(self) -> int:
        return len(self._names)


def _put(table: dict, key: object, value: object, limit: int) -> None:
    """Insert as the newest entry; the oldest go beyond ``limit`` (first in, first out)."""
    table.pop(key, None)
    table[key] = value
    while len(table) > limit:
        del table[next(iter(table))]
