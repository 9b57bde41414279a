"""The kernel's names of each inode (``fuse.kernel_names``), alone: which changes make the
kernel drop them. The end-to-end proof (two mounts, a file rewritten on one, read at its new
size on the other) is in test_shared.py."""

from __future__ import annotations

from fusestate.fuse.kernel_names import KernelNames


def names() -> tuple[KernelNames, list[tuple[int, bytes]]]:
    dropped: list[tuple[int, bytes]] = []
    return KernelNames(lambda parent, name: dropped.append((parent, name))), dropped


def test_another_nodes_change_of_size_drops_every_name_of_the_file_and_only_then() -> None:
    k, dropped = names()
    k.handed(10, 1, b"a", 300)
    k.handed(10, 2, b"link", 300)
    k.changed_elsewhere([(10, 300)])  # a link elsewhere, bytes rewritten in place: same size
    assert dropped == []
    k.changed_elsewhere([(10, 53), (11, 7)])  # 11: never handed to the kernel
    assert sorted(dropped) == [(1, b"a"), (2, b"link")]


def test_the_kernels_own_writes_and_truncates_are_its_size() -> None:
    k, dropped = names()
    k.handed(10, 1, b"a", 300)
    k.sized(10, 4096)  # this node wrote past the end
    k.changed_elsewhere([(10, 4096)])
    assert dropped == []
    k.sized(10, 0)
    k.handed(10, 1, b"a", 0)  # a lookup after its own truncate
    assert dropped == []


def test_a_lookup_that_finds_another_size_drops_the_names_until_the_kernel_forgets_the_inode() -> None:
    k, dropped = names()
    k.handed(10, 1, b"a", 300)
    k.handed(10, 1, b"a", 53)  # the announcement was missed: the lookup finds the new size
    assert dropped == [(1, b"a")]
    k.handed(10, 1, b"a", 53)  # still the old inode in the kernel (open somewhere): again
    assert len(dropped) == 2
    k.forgotten([(10, 3)])  # the kernel let go of the inode: every lookup of it
    k.handed(10, 1, b"a", 53)  # a fresh inode, with the new size
    k.changed_elsewhere([(10, 53)])
    assert len(dropped) == 2


def test_a_record_lasts_as_long_as_the_kernels_lookups() -> None:
    k, dropped = names()
    k.handed(10, 1, b"a", 300)
    k.handed(10, 1, b"a", 300)
    k.forgotten([(10, 1)])  # one lookup of two let go: the kernel still holds the inode
    k.changed_elsewhere([(10, 1)])
    assert dropped == [(1, b"a")]
    k2, dropped2 = names()
    k2.handed(10, 1, b"a", 300)
    k2.forgotten([(10, 1)])
    k2.changed_elsewhere([(10, 1)])
    assert dropped2 == []


def test_a_volume_no_other_node_changes_remembers_nothing() -> None:
    dropped: list = []
    k = KernelNames(lambda parent, name: dropped.append(name), max_inodes=0)
    k.handed(10, 1, b"a", 300)
    k.changed_elsewhere([(10, 5)])
    assert dropped == []
