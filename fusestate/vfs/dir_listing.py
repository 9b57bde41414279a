"""An open directory's listing, read from the metadata a page at a time.

The kernel asks for a listing in pieces that fit its buffer (a few hundred entries with
their attributes), each piece continuing after the last entry it took. One page from the
metadata holds up to ``PAGE`` entries: the pieces after the first are cut from it, and a
page that came back short ends the listing without asking the metadata again. A page
serves continuations for ``PAGE_SECONDS`` at most, so a listing read slowly still hands
the kernel recent attributes; a rewind (offset 0) always reads afresh. Entries added or
removed while a listing is read may be missed or still shown, as POSIX allows.
"""

from __future__ import annotations

import bisect
import time
from typing import Awaitable, Callable, Optional

from fusestate.meta.engine import DirEntry, Inode

PAGE = 1000
PAGE_SECONDS = 1.0

Listed = list[tuple[DirEntry, Inode]]
ReadPage = Callable[[int, int, int], Awaitable[Listed]]  # (directory, after entry id, limit)


class DirListing:
    """One open handle of a directory and the page it read last."""

    def __init__(self, ino: int) -> None:
        self.ino = ino
        self._page: Listed = []
        self._after: Optional[int] = None  # the entry id the page was read after
        self._ended = False  # the page reached the end of the directory
        self._read_at = 0.0

    async def after(self, after_id: int, read_page: ReadPage) -> Listed:
        """The entries after ``after_id``, from the page held where it covers them."""
        if self._covers(after_id):
            rest = self._page[bisect.bisect_right(self._page, after_id, key=_entry_id):]
            if rest or self._ended:
                return rest
        page = await read_page(self.ino, after_id, PAGE)
        self._page, self._after, self._ended, self._read_at = page, after_id, len(page) < PAGE, time.monotonic()
        return page

    def _covers(self, after_id: int) -> bool:
        if after_id == 0 or self._after is None or time.monotonic() - self._read_at > PAGE_SECONDS:
            return False
        page = self._page
        return after_id == self._after or bool(page) and _entry_id(page[0]) <= after_id <= _entry_id(page[-1])


def _entry_id(listed: tuple[DirEntry, Inode]) -> int:
    return listed[0].entry_id
