"""Mount namespaces made on one machine (a cluster's nodes, a network namespace's server)."""

from __future__ import annotations

import ctypes
import os
import re

MNT_DETACH = 2  # umount2 flag: lazy


def drop_copies_of_fuse_mounts() -> None:
    """A new mount namespace starts with a copy of every mount of the machine, and the
    unmount of a FUSE mount waits until its last copy goes: detach this namespace's copies,
    so that it never holds up anyone's unmount (another node's, a test's, a user's). Call it
    first thing in a namespace of its own, never in the machine's."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/self/mounts") as f:
        targets = [fields[1] for fields in (line.split() for line in f) if fields[2].startswith("fuse")]
    for target in sorted(targets, key=len, reverse=True):  # the deepest first
        path = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), target)
        libc.umount2(os.fsencode(path), MNT_DETACH)  # one gone already: nothing to do
