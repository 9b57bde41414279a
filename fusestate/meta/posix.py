"""The POSIX rules of the namespace: which error each operation answers, and in what
order, written once for every namespace implementation.

``operations`` (the SQL both engines run) and ``scratch.namespace`` (a scratch directory's
contents in the node's memory) call these with what they found: an inode or None, whether
a name or a directory's entries are there. Nothing here reads or writes anything. The
server-side functions of the PostgreSQL engine (``postgres/sql/functions.sql``) cannot
call Python and follow the same rules; the contract suite (``tests/test_meta_contract.py``)
holds all three to them.

Where POSIX lets several errors apply, the order is Linux's as the suite pins it: a bad
name first, then the directory (ENOENT, ENOTDIR), then the inode, then the name's
existence (EEXIST).
"""

from __future__ import annotations

import errno
import stat
from typing import Optional

from fusestate.errors import FsError
from fusestate.meta.engine import NAME_MAX, RENAME_EXCHANGE, RENAME_NOREPLACE, Inode, NewNode


def check_name(name: bytes) -> None:
    """A name that an operation makes (create, link, a rename's target)."""
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG)
    if not name or b"/" in name or name in (b".", b".."):
        raise FsError(errno.EINVAL)


def plain_name(name: bytes) -> bool:
    """Whether a lookup of ``name`` looks for an entry (not ``.``, ``..``, or a name too
    long to exist)."""
    return len(name) <= NAME_MAX and name not in (b".", b"..")


def check_lookup_name(name: bytes) -> None:
    """A name looked up in a directory that exists: too long is ENAMETOOLONG, not ENOENT."""
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG)


def directory(node: Optional[Inode]) -> Inode:
    """The directory an operation works in: ENOENT if there is none, ENOTDIR if it is no
    directory."""
    if node is None:
        raise FsError(errno.ENOENT)
    if not node.is_dir:
        raise FsError(errno.ENOTDIR)
    return node


def live_directory(node: Optional[Inode]) -> Inode:
    """A directory a name is made in: also ENOENT once it was removed (open still)."""
    node = directory(node)
    if node.nlink == 0:
        raise FsError(errno.ENOENT)
    return node


def check_free(exists: bool) -> None:
    """The name a create or link makes."""
    if exists:
        raise FsError(errno.EEXIST)


def check_found(exists: bool) -> None:
    """The name an unlink, rmdir or rename removes or moves."""
    if not exists:
        raise FsError(errno.ENOENT)


def check_linkable(is_dir: bool, nlink: int, held: bool = False) -> None:
    """A file that gets another name: no directory; not one whose last name went, unless
    the caller holds it (a file made on this node, on its way into the volume)."""
    if is_dir:
        raise FsError(errno.EPERM)
    if nlink == 0 and not held:
        raise FsError(errno.ENOENT)


def check_unlinkable(is_dir: bool) -> None:
    if is_dir:
        raise FsError(errno.EISDIR)


def check_rmdir_name(name: bytes) -> None:
    if name == b".":
        raise FsError(errno.EINVAL)
    if name == b"..":
        raise FsError(errno.ENOTEMPTY)


def check_removable(is_dir: bool, empty: bool) -> None:
    """The directory an rmdir removes."""
    if not is_dir:
        raise FsError(errno.ENOTDIR)
    if not empty:
        raise FsError(errno.ENOTEMPTY)


def check_rename_names(src_name: bytes, dst_name: bytes) -> None:
    check_name(dst_name)
    if src_name in (b".", b".."):
        raise FsError(errno.EINVAL)


def check_rename_target(flags: int, target_exists: bool) -> None:
    """RENAME_NOREPLACE refuses a target that is there, RENAME_EXCHANGE one that is not."""
    if flags & RENAME_NOREPLACE and target_exists:
        raise FsError(errno.EEXIST)
    if flags & RENAME_EXCHANGE and not target_exists:
        raise FsError(errno.ENOENT)


def check_not_into_itself(into_itself: bool) -> None:
    """A directory moved into its own subtree."""
    if into_itself:
        raise FsError(errno.EINVAL)


def check_replace(moving_dir: bool, replaced_dir: bool, replaced_empty: bool) -> None:
    """A rename over another name: a directory over an empty directory, anything else over
    anything but a directory."""
    if moving_dir and not replaced_dir:
        raise FsError(errno.ENOTDIR)
    if not moving_dir and replaced_dir:
        raise FsError(errno.EISDIR)
    if replaced_dir and not replaced_empty:
        raise FsError(errno.ENOTEMPTY)


def new_inode(parent: Inode, new: NewNode, now_ns: int, scratch: int, ino: int = 0) -> Inode:
    """What a create in ``parent`` makes: in a set-group-ID directory the group, and for a
    directory the bit too, come from the parent; a directory starts with two links."""
    mode, gid = new.mode, new.gid
    if parent.mode & stat.S_ISGID:
        gid = parent.gid
        if stat.S_ISDIR(mode):
            mode |= stat.S_ISGID
    size = len(new.symlink_target) if new.symlink_target is not None else 0
    nlink = 2 if stat.S_ISDIR(mode) else 1
    return Inode(ino, mode, new.uid, gid, size, nlink, now_ns, now_ns, now_ns, new.rdev, new.symlink_target, scratch)
