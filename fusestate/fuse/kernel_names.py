"""The names this node's kernel holds, so that another node's change of a file reaches it.

The kernel's writeback cache (on for speed: ``FuseOperations.enable_writeback_cache``) makes
the kernel trust its own size of a regular file it holds: a size in a later attribute reply
is ignored. On a shared volume another node may change the file: written shorter or longer,
then closed. The next open here must see it whole (close-to-open), but an inode the kernel
still holds would keep the old size for as long as it holds it.

The kernel keeps an inode while a name (a dentry) or an open file refers to it, and evicts
it as soon as neither does. So when the database announces that another node changed a
file to a size other than the one the kernel was last told (``change_feed``), the kernel is
told to drop the names it holds of that file (``invalidate_entry``); once no process has it
open, the inode goes, and the next lookup brings a fresh one with the new size. A change
that keeps the size (a link elsewhere, bytes rewritten in place) leaves the names and the
pages: an open finds changed content itself and drops the pages then (``keep_cache``).

The names come from the entries this daemon handed the kernel (lookup, create, link,
readdirplus), remembered per inode with the size last told (in an entry, or by the
kernel's own writes and truncates) and the kernel's lookup count, so that a record lasts exactly as long
as the kernel's inode (``forget``). A lookup that finds another size than the kernel was
told does the same as an announcement: a change whose announcement was missed (the
notification connection lost, or ``--lookup-cache off``) is caught at the next lookup the
kernel makes of the name (once ``--attr-timeout`` has passed), and the open after this
node's next close sees it. A bounded number of inodes is remembered, the least recently
told forgotten first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Iterable, Optional

log = logging.getLogger(__name__)

MAX_INODES = 200_000  # about 40 MB at most (one name each, the common case)
NAMES_PER_INODE = 8   # hard links of one file remembered (a checkpoint's and the store's)

Invalidate = Callable[[int, bytes], None]  # (parent inode, name): drop the kernel's entry


class _Known:
    __slots__ = ("names", "size", "lookups", "dropped")

    def __init__(self, size: int) -> None:
        self.names: set[tuple[int, bytes]] = set()
        self.size = size
        self.lookups = 0       # the kernel's lookup count of the inode: the record goes at 0
        self.dropped = False   # told to drop its names; the size it holds is unknown


class KernelNames:
    """Per inode, the (parent, name) entries the kernel was given, and the size it was told."""

    def __init__(self, invalidate: Invalidate, max_inodes: int = MAX_INODES) -> None:
        """``max_inodes`` 0: nothing is remembered (a volume no other node changes)."""
        self._invalidate = invalidate
        self._max = max_inodes
        self._known: OrderedDict[int, _Known] = OrderedDict()
        self.invalidated = 0  # entries the kernel was told to drop

    @property
    def enabled(self) -> bool:
        return self._max > 0

    def handed(self, ino: int, parent: int, name: bytes, size: int) -> None:
        """The kernel got an entry ``parent/name`` -> ``ino`` of ``size`` bytes. If it holds
        the inode with another size already, it keeps that one: it is told to drop the names."""
        if not self.enabled:
            return
        known = self._known.pop(ino, None)
        if known is None:
            known = _Known(size)
        elif known.size != size or known.dropped:
            self._drop(known, also=(parent, name))  # until the kernel forgets the inode
        if len(known.names) < NAMES_PER_INODE:
            known.names.add((parent, name))
        known.lookups += 1
        self._known[ino] = known
        while len(self._known) > self._max:
            self._known.popitem(last=False)

    def sized(self, ino: int, size: int) -> None:
        """The kernel's size of ``ino`` is now ``size`` (its own write or truncate)."""
        known = self._known.get(ino)
        if known is not None and not known.dropped:
            known.size = size

    def forgotten(self, inodes: Iterable[tuple[int, int]]) -> None:
        """The kernel let go of lookups of these inodes (inode, count); at none left it evicted it."""
        for ino, count in inodes:
            known = self._known.get(ino)
            if known is not None:
                known.lookups -= count
                if known.lookups <= 0:
                    del self._known[ino]

    def changed_elsewhere(self, changes: Iterable[tuple[int, Optional[int]]]) -> None:
        """Another node changed these files to these sizes (None: deleted): where the kernel
        holds another size, it drops its names of the file."""
        for ino, size in changes:
            known = self._known.get(ino)
            if known is not None and known.size != size:
                self._drop(known)

    def _drop(self, known: _Known, also: Optional[tuple[int, bytes]] = None) -> None:
        known.dropped = True
        for parent, name in known.names | ({also} if also else set()):
            try:
                self._invalidate(parent, name)
                self.invalidated += 1
            except Exception as exc:  # noqa: BLE001 - the kernel has it or not: never the daemon's end
                log.debug("could not drop the kernel's entry %d/%r: %s", parent, name, exc)
