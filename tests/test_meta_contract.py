"""The metadata engine contract: every namespace implementation answers every operation
the same way. Each test runs once per implementation against the real database (PostgreSQL:
a server started by the tests on 127.0.0.1): the SQLite engine, the PostgreSQL engine, and
``scratch``, a shared volume's scratch directory, whose contents live in the node's memory
(``meta.scratch``). The POSIX rules of names, links, renames, listings and open files run
on all three, in a directory of their own (``root``: the volume's root, or a scratch dir);
what only a file with blocks has (block maps, the ledger) on the two engines; the tests
marked ``shared`` run two engines on one database, as two nodes do.
"""

from __future__ import annotations

import errno
import stat
import time
from pathlib import Path
from typing import Awaitable, Callable, Iterator

import psycopg
import pytest
import trio

from fusestate.meta.engine import (RENAME_EXCHANGE, RENAME_NOREPLACE, ROOT_INODE, AttrChange, FsError, Inode,
                                   MetaEngine, NewNode)
from fusestate.meta.postgres.functions import COLLECTED_MARGIN, SESSION_FENCE
from fusestate.meta.postgres.engine import PostgresEngine
from fusestate.meta.scratch.namespace import NodeLocalNames
from fusestate.meta.embedded.engine import SQLiteEngine

BS = 64 * 1024
FILE = NewNode(stat.S_IFREG | 0o644, 1000, 1000)
DIR = NewNode(stat.S_IFDIR | 0o755, 1000, 1000)
SCRATCH_DIR = NewNode(stat.S_IFDIR | 0o755, 1000, 1000, scratch_name=True)
FAR_FUTURE = 2**62

Body = Callable[..., Awaitable[None]]


@pytest.fixture(params=["sqlite", "postgresql", "scratch"])
def engine_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def new_engine(engine_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., MetaEngine]]:
    """A factory of engines on one fresh database: each call is another node (PostgreSQL)."""
    made: list[MetaEngine] = []
    url = request.getfixturevalue("pg_url") if engine_kind != "sqlite" else ""

    def make(**kw) -> MetaEngine:
        if engine_kind == "sqlite":
            engine: MetaEngine = SQLiteEngine(str(tmp_path / "meta.db"), block_size=BS)
        else:
            engine = PostgresEngine(url, block_size=BS, mountpoint=f"/node{len(made)}", **kw)
            if engine_kind == "scratch":
                engine = NodeLocalNames(engine)  # type: ignore[assignment]
        made.append(engine)
        return engine

    make.kind = engine_kind  # type: ignore[attr-defined]
    yield make
    for engine in made:
        engine.close()


def drive(new_engine: Callable[..., MetaEngine], body: Body, nodes: int = 1, **kw) -> None:
    """Start ``nodes`` engines on the database and run ``body(*engines, root)`` under trio,
    ``root`` the directory to work in: the volume's root, or a scratch dir of the first
    engine's (``scratch``)."""
    async def main() -> None:
        engines = [new_engine(**kw) for _ in range(nodes)]
        for e in engines:
            await e.start()
        root = ROOT_INODE
        if new_engine.kind == "scratch":  # type: ignore[attr-defined]
            root = (await engines[0].create(ROOT_INODE, b"scratch-root", SCRATCH_DIR)).id
        await body(*engines, root)

    trio.run(main)


async def raises(code: int, call: Awaitable) -> None:
    with pytest.raises(FsError) as info:
        await call
    assert info.value.errno == code, f"expected {errno.errorcode[code]}, got {errno.errorcode.get(info.value.errno)}"


async def names(m: MetaEngine, ino: int) -> list[bytes]:
    return [entry.name for entry, _ in await m.readdir(ino, 0, 100000)]


def key(n: int) -> str:
    return f"{n:064x}"


shared_only = pytest.mark.parametrize("engine_kind", ["postgresql"])
# What only files with blocks have, or only the volume's root: not in a scratch dir.
engines_only = pytest.mark.parametrize("engine_kind", ["sqlite", "postgresql"])


async def held_and_unlinked(a: MetaEngine, b: MetaEngine) -> Inode:
    """A one-block file open on node ``a`` whose only name node ``b`` removes: it stays."""
    f = await a.create(ROOT_INODE, b"f", FILE, hold=True)
    await a.commit_blocks(f.id, {0: (key(1), BS)}, BS, 1)
    freed = await b.unlink(ROOT_INODE, b"f")
    assert not freed.keys and freed.deleted_inode is None
    return f


# --- namespace ------------------------------------------------------------------------

def test_every_inode_type_is_created_and_looked_up(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        kinds = {
            b"file": NewNode(stat.S_IFREG | 0o640, 1, 2),
            b"dir": NewNode(stat.S_IFDIR | 0o750, 1, 2),
            b"link": NewNode(stat.S_IFLNK | 0o777, 1, 2, symlink_target=b"../somewhere"),
            b"fifo": NewNode(stat.S_IFIFO | 0o600, 1, 2),
            b"sock": NewNode(stat.S_IFSOCK | 0o600, 1, 2),
            b"chr": NewNode(stat.S_IFCHR | 0o600, 1, 2, rdev=(1 << 8) | 3),
            b"blk": NewNode(stat.S_IFBLK | 0o600, 1, 2, rdev=(8 << 8) | 1),
        }
        inodes = m.stats().inodes
        made = {name: await m.create(root, name, node) for name, node in kinds.items()}
        for name, node in kinds.items():
            found = await m.lookup(root, name)
            assert found.id == made[name].id
            assert found.mode == node.mode and (found.uid, found.gid) == (1, 2)
            assert found.rdev == node.rdev
        assert (await m.lookup(root, b"link")).symlink_target == b"../somewhere"
        assert (await m.lookup(root, b"link")).size == len(b"../somewhere")
        assert (await m.getattr(made[b"dir"].id)).nlink == 2
        assert (await m.getattr(root)).nlink == 3  # ".", its own name, and dir's ".."
        assert sorted(await names(m, root)) == sorted(kinds)
        assert m.stats().inodes == inodes + len(kinds)

    drive(new_engine, body)


def test_create_errors(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        f = await m.create(root, b"f", FILE)
        await raises(errno.EEXIST, m.create(root, b"f", FILE))
        await raises(errno.EEXIST, m.create(root, b"f", DIR))
        await raises(errno.ENOTDIR, m.create(f.id, b"x", FILE))
        await raises(errno.ENAMETOOLONG, m.create(root, b"n" * 256, FILE))
        await raises(errno.ENAMETOOLONG, m.lookup(root, b"n" * 256))
        await m.create(root, b"n" * 255, FILE)
        d = await m.create(root, b"d", DIR)
        await m.rmdir(root, b"d")
        await raises(errno.ENOENT, m.create(d.id, b"x", FILE))  # into a removed directory
        await raises(errno.ENOENT, m.create(10**9, b"x", FILE))  # into no inode at all
        await raises(errno.ENOENT, m.lookup(root, b"missing"))
        await raises(errno.ENOTDIR, m.lookup(f.id, b"x"))

    drive(new_engine, body)


def test_dot_and_dotdot_and_parent(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        a = await m.create(root, b"a", DIR)
        b = await m.create(a.id, b"b", DIR)
        assert (await m.lookup(b.id, b".")).id == b.id
        assert (await m.lookup(b.id, b"..")).id == a.id
        assert (await m.lookup(root, b"..")).id == ROOT_INODE  # the root's own, or a scratch dir's parent
        assert await m.parent_of(b.id) == a.id

    drive(new_engine, body)


def test_setgid_directory_passes_its_group_down(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        d = await m.create(root, b"d", NewNode(stat.S_IFDIR | stat.S_ISGID | 0o775, 1000, 50))
        f = await m.create(d.id, b"f", NewNode(stat.S_IFREG | 0o644, 1000, 1000))
        sub = await m.create(d.id, b"sub", NewNode(stat.S_IFDIR | 0o755, 1000, 1000))
        assert f.gid == 50 and sub.gid == 50
        assert sub.mode & stat.S_ISGID and not f.mode & stat.S_ISGID

    drive(new_engine, body)


def test_link_and_unlink_count_names(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        f = await m.create(root, b"f", FILE)
        d = await m.create(root, b"d", DIR)
        assert (await m.link(f.id, d.id, b"g")).nlink == 2
        await raises(errno.EEXIST, m.link(f.id, root, b"d"))
        await raises(errno.EPERM, m.link(d.id, root, b"d2"))
        await raises(errno.ENOTDIR, m.link(f.id, f.id, b"x"))
        await raises(errno.ENOENT, m.link(f.id, 999_999, b"x"))
        assert [e.name for e, _ in await m.readdir(root, 0, 100)] == [b"f", b"d"]  # nothing made by them
        await raises(errno.EISDIR, m.unlink(root, b"d"))
        await raises(errno.ENOENT, m.unlink(root, b"missing"))
        freed = await m.unlink(root, b"f")
        assert freed.unlinked is not None and freed.unlinked.nlink == 1 and freed.deleted_inode is None
        assert (await m.lookup(d.id, b"g")).nlink == 1
        freed = await m.unlink(d.id, b"g")
        assert freed.deleted_inode == f.id
        await raises(errno.ENOENT, m.getattr(f.id))
        await raises(errno.ENOENT, m.link(f.id, root, b"back"))

    drive(new_engine, body)


def test_a_freed_inode_number_is_not_handed_out_again(new_engine) -> None:
    """The kernel may still hold a dead inode under its number (FUSE's generation is 0)."""
    async def body(m: MetaEngine, root: int) -> None:
        seen: set[int] = set()
        for _ in range(3):
            d = await m.create(root, b"d", DIR)
            s = await m.create(root, b"s", NewNode(stat.S_IFLNK | 0o777, 0, 0, symlink_target=b"t"))
            assert not {d.id, s.id} & seen
            seen |= {d.id, s.id}
            await m.unlink(root, b"s")
            await m.rmdir(root, b"d")

    drive(new_engine, body)


def test_rmdir_rules(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        d = await m.create(root, b"d", DIR)
        await m.create(d.id, b"f", FILE)
        await m.create(root, b"file", FILE)
        await raises(errno.ENOTEMPTY, m.rmdir(root, b"d"))
        await raises(errno.ENOTDIR, m.rmdir(root, b"file"))
        await raises(errno.EINVAL, m.rmdir(d.id, b"."))
        await raises(errno.ENOENT, m.rmdir(root, b"missing"))
        await m.unlink(d.id, b"f")
        assert (await m.getattr(root)).nlink == 3
        freed = await m.rmdir(root, b"d")
        assert freed.deleted_inode == d.id
        assert (await m.getattr(root)).nlink == 2
        assert await names(m, root) == [b"file"]

    drive(new_engine, body)


def test_rename_replace_noreplace_exchange(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        a = await m.create(root, b"a", FILE)
        b = await m.create(root, b"b", FILE)
        await raises(errno.EEXIST, m.rename(root, b"a", root, b"b", RENAME_NOREPLACE))
        await raises(errno.ENOENT, m.rename(root, b"a", root, b"none", RENAME_EXCHANGE))
        await m.rename(root, b"a", root, b"b", RENAME_EXCHANGE)
        assert (await m.lookup(root, b"a")).id == b.id
        assert (await m.lookup(root, b"b")).id == a.id
        freed = await m.rename(root, b"a", root, b"b")  # replaces a's inode (now named b)
        assert freed.deleted_inode == a.id
        assert (await m.lookup(root, b"b")).id == b.id
        await raises(errno.ENOENT, m.lookup(root, b"a"))
        await m.rename(root, b"b", root, b"c", RENAME_NOREPLACE)
        assert await names(m, root) == [b"c"]
        await m.link(b.id, root, b"c2")
        assert not (await m.rename(root, b"c", root, b"c2")).keys  # two names of one file: nothing
        assert sorted(await names(m, root)) == [b"c", b"c2"]

    drive(new_engine, body)


def test_rename_of_directories(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        a = await m.create(root, b"a", DIR)
        sub = await m.create(a.id, b"sub", DIR)
        b = await m.create(root, b"b", DIR)
        await m.create(b.id, b"x", FILE)
        await m.create(root, b"f", FILE)
        await raises(errno.EINVAL, m.rename(root, b"a", sub.id, b"a"))
        await raises(errno.ENOTEMPTY, m.rename(root, b"a", root, b"b"))
        await raises(errno.ENOTDIR, m.rename(root, b"a", root, b"f"))
        await raises(errno.EISDIR, m.rename(root, b"f", root, b"a"))
        await m.rename(a.id, b"sub", b.id, b"sub")
        assert (await m.getattr(a.id)).nlink == 2 and (await m.getattr(b.id)).nlink == 3
        assert (await m.lookup(sub.id, b"..")).id == b.id
        freed = await m.rename(b.id, b"sub", root, b"a")  # over an empty directory
        assert freed.deleted_inode == a.id
        assert (await m.getattr(root)).nlink == 4  # a (now sub), b, and "." + its name
        await m.rename(root, b"a", root, b"b", RENAME_EXCHANGE)
        assert (await m.lookup(root, b"b")).id == sub.id

    drive(new_engine, body)


def test_setattr_changes_what_it_names_and_ctime(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        d = await m.create(root, b"d", DIR)
        before = d.ctime_ns
        await trio.sleep(0.002)
        after = await m.setattr(d.id, AttrChange(mode=0o700, uid=7, gid=8, atime_ns=10**9, mtime_ns=2 * 10**9))
        assert stat.S_ISDIR(after.mode) and stat.S_IMODE(after.mode) == 0o700
        assert (after.uid, after.gid, after.atime_ns, after.mtime_ns) == (7, 8, 10**9, 2 * 10**9)
        assert after.ctime_ns > before
        assert await m.getattr(d.id) == after

    drive(new_engine, body)


def test_readdir_pages_in_id_order(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        d = await m.create(root, b"d", DIR)
        made = [await m.create(d.id, f"f{i:03}".encode(), FILE) for i in range(25)]
        seen: list = []
        after = 0
        while page := await m.readdir(d.id, after, limit=7):
            assert len(page) <= 7
            seen += page
            after = page[-1][0].entry_id
        assert [entry.name for entry, _ in seen] == [f"f{i:03}".encode() for i in range(25)]
        assert [node.id for _, node in seen] == [n.id for n in made]
        ids = [entry.entry_id for entry, _ in seen]
        assert ids == sorted(ids) and len(set(ids)) == 25

    drive(new_engine, body)


def test_names_are_checked_first(new_engine) -> None:
    """A name that cannot be, before anything about the directory or the file."""
    async def body(m: MetaEngine, root: int) -> None:
        f = await m.create(root, b"f", FILE)
        long = b"n" * 256
        for bad, code in ((b"", errno.EINVAL), (b"a/b", errno.EINVAL), (b".", errno.EINVAL),
                          (b"..", errno.EINVAL), (long, errno.ENAMETOOLONG)):
            await raises(code, m.create(root, bad, FILE))
            await raises(code, m.create(10**9, bad, DIR))
            await raises(code, m.link(f.id, root, bad))
            await raises(code, m.rename(root, b"f", root, bad))
        for call in (m.unlink(root, long), m.rmdir(root, long), m.lookup(f.id, long), m.unlink(f.id, long)):
            await raises(errno.ENAMETOOLONG, call)
        await raises(errno.EINVAL, m.rename(root, b".", root, b"x"))
        await raises(errno.EINVAL, m.rename(root, b"..", root, b"x"))
        await raises(errno.EINVAL, m.rmdir(root, b"."))
        await raises(errno.ENOTEMPTY, m.rmdir(root, b".."))
        assert await names(m, root) == [b"f"]

    drive(new_engine, body)


def test_a_file_is_no_directory(new_engine) -> None:
    """Every operation that works in a directory answers ENOTDIR when handed a file, and
    ENOENT when handed nothing."""
    async def body(m: MetaEngine, root: int) -> None:
        f = await m.create(root, b"f", FILE)
        g = await m.create(root, b"g", FILE)
        for parent, code in ((f.id, errno.ENOTDIR), (10**9, errno.ENOENT)):
            await raises(code, m.create(parent, b"x", FILE))
            await raises(code, m.lookup(parent, b"x"))
            await raises(code, m.link(g.id, parent, b"x"))
            await raises(code, m.unlink(parent, b"x"))
            await raises(code, m.rmdir(parent, b"x"))
            await raises(code, m.rename(parent, b"x", root, b"y"))
            await raises(code, m.rename(root, b"g", parent, b"y"))
            await raises(code, m.readdir(parent, 0))
        assert await names(m, root) == [b"f", b"g"] and (await m.getattr(g.id)).nlink == 1

    drive(new_engine, body)


def test_a_removed_directory_takes_no_new_names(new_engine) -> None:
    """Gone, or held open by this node after its rmdir (a process's working directory)."""
    async def body(m: MetaEngine, root: int) -> None:
        gone = await m.create(root, b"gone", DIR)
        held = await m.create(root, b"held", DIR)
        f = await m.create(root, b"f", FILE)
        await m.open_file(held.id)
        await m.rmdir(root, b"gone")
        await m.rmdir(root, b"held")
        for d in (gone, held):
            await raises(errno.ENOENT, m.create(d.id, b"x", FILE))
            await raises(errno.ENOENT, m.link(f.id, d.id, b"x"))
            await raises(errno.ENOENT, m.rename(root, b"f", d.id, b"x"))
        await raises(errno.ENOENT, m.lookup(root, b"held"))
        assert (await m.getattr(f.id)).nlink == 1 and await names(m, root) == [b"f"]
        await m.close_file(held.id)

    drive(new_engine, body)


def test_a_name_renamed_over_keeps_its_place_in_the_listing(new_engine) -> None:
    """A listing is in entry order, which a kernel's listing continues after: a new name
    comes last, a name renamed over or exchanged keeps its place."""
    async def body(m: MetaEngine, root: int) -> None:
        for name in (b"a", b"b", b"c", b"d"):
            await m.create(root, name, FILE)
        before = {e.name: e.entry_id for e, _ in await m.readdir(root, 0)}
        await m.rename(root, b"d", root, b"a")  # over a
        await m.rename(root, b"b", root, b"c", RENAME_EXCHANGE)
        await m.link((await m.lookup(root, b"a")).id, root, b"e")
        listing = await m.readdir(root, 0)
        assert [e.name for e, _ in listing] == [b"a", b"b", b"c", b"e"]
        assert {e.name: e.entry_id for e, _ in listing if e.name != b"e"} == {n: before[n] for n in (b"a", b"b", b"c")}
        assert listing[-1][0].entry_id > max(before.values())
        after = [e.name for e, _ in await m.readdir(root, before[b"b"])]  # a listing that had read a and b
        assert after == [b"c", b"e"]

    drive(new_engine, body)


def test_moves_and_exchanges_between_directories(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        x = await m.create(root, b"x", DIR)
        y = await m.create(root, b"y", DIR)
        xs = await m.create(x.id, b"xs", DIR)
        f = await m.create(y.id, b"f", FILE)
        await m.create(xs.id, b"in", FILE)
        await raises(errno.EINVAL, m.rename(root, b"x", xs.id, b"in", RENAME_EXCHANGE))  # x under itself
        await m.unlink(xs.id, b"in")
        await raises(errno.EINVAL, m.rename(x.id, b"xs", root, b"x", RENAME_EXCHANGE))  # x under xs
        await m.rename(x.id, b"xs", y.id, b"f", RENAME_EXCHANGE)  # a directory for a file
        assert (await m.lookup(y.id, b"f")).id == xs.id and (await m.lookup(x.id, b"xs")).id == f.id
        assert (await m.lookup(xs.id, b"..")).id == y.id
        assert [(await m.getattr(i)).nlink for i in (x.id, y.id)] == [2, 3]
        await m.rename(y.id, b"f", root, b"z")  # the directory up to the root
        assert (await m.getattr(root)).nlink == 5 and (await m.getattr(y.id)).nlink == 2
        assert (await m.lookup(xs.id, b"..")).id == root
        await m.rename(x.id, b"xs", y.id, b"f2")  # the file across
        assert await names(m, x.id) == [] and await names(m, y.id) == [b"f2"]
        assert (await m.parent_of(xs.id), await m.parent_of(y.id)) == (root, root)

    drive(new_engine, body)


def test_rename_over_an_open_file_keeps_it_until_its_close(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        old = await m.create(root, b"CURRENT", FILE, hold=True)
        new = await m.create(root, b"CURRENT.tmp", FILE)
        freed = await m.rename(root, b"CURRENT.tmp", root, b"CURRENT")
        assert freed.deleted_inode is None and freed.unlinked.id == old.id and freed.unlinked.nlink == 0
        assert (await m.lookup(root, b"CURRENT")).id == new.id
        assert (await m.getattr(old.id)).nlink == 0
        assert (await m.close_file(old.id)).deleted_inode == old.id
        await raises(errno.ENOENT, m.getattr(old.id))

    drive(new_engine, body)


async def scratch_tree(m: MetaEngine, name: bytes) -> tuple[Inode, Inode, Inode]:
    """A scratch dir with a file ``name`` in it, and a plain file next to the dir."""
    s = await m.create(ROOT_INODE, b"blockmgr-1", NewNode(DIR.mode, 0, 0, scratch_name=True))
    return s, await m.create(s.id, name, FILE), await m.create(ROOT_INODE, b"plain", FILE)


@engines_only
def test_scratch_directories_stay_apart(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        s, inner, plain = await scratch_tree(m, b"f")
        assert s.scratch and inner.scratch and not plain.scratch
        await raises(errno.EXDEV, m.link(inner.id, ROOT_INODE, b"g"))  # the vfs promotes it first
        await raises(errno.EXDEV, m.rename(s.id, b"f", ROOT_INODE, b"f"))
        # A file of the volume may be named in this node's scratch dirs (a state store's load).
        await m.link(plain.id, s.id, b"linked")
        await m.rename(ROOT_INODE, b"plain", s.id, b"plain")
        assert (await m.getattr(plain.id)).nlink == 2 and not (await m.getattr(plain.id)).scratch
        await m.rename(s.id, b"plain", ROOT_INODE, b"back")  # and leave them again

    drive(new_engine, body)


@engines_only
def test_a_promoted_scratch_file_joins_the_volume(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        _, f, plain = await scratch_tree(m, b"000012.sst")
        await m.commit_blocks(f.id, {}, BS + 100, 5)  # a scratch file's size, no blocks
        assert not (await m.promote(f.id, {0: (key(1), BS), 1: (key(2), 100)}, BS + 100, 7)).keys
        node = await m.getattr(f.id)
        assert (node.scratch, node.size, node.mtime_ns) == (0, BS + 100, 7)
        assert await m.block_map(f.id) == {0: key(1), 1: key(2)}
        assert (await m.object_info(key(1))).refcount == 1
        await m.link(f.id, ROOT_INODE, b"000012.sst")
        assert (await m.getattr(f.id)).nlink == 2
        await raises(errno.EXDEV, m.promote(f.id, {}, 0, 8))  # a file of the volume already
        await raises(errno.EXDEV, m.promote(plain.id, {}, 0, 8))
        await raises(errno.ENOENT, m.promote(999_999, {}, 0, 8))

    drive(new_engine, body)


# --- file data and the block ledger ---------------------------------------------------------

@engines_only
def test_block_maps_count_references_and_free_the_last(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        a = await m.create(ROOT_INODE, b"a", FILE)
        b = await m.create(ROOT_INODE, b"b", FILE)
        assert not (await m.commit_blocks(a.id, {0: (key(1), BS), 1: (key(2), 100)}, BS + 100, 5)).keys
        assert not (await m.commit_blocks(b.id, {0: (key(1), BS)}, BS, 6)).keys
        assert await m.block_map(a.id) == {0: key(1), 1: key(2)}
        assert (await m.object_info(key(1))).refcount == 2
        attrs = await m.getattr(a.id)
        assert (attrs.size, attrs.mtime_ns) == (BS + 100, 5)
        assert m.stats().used_bytes == BS + 100
        # a's block 0 moves to new bytes: key(1) still has b
        assert not (await m.commit_blocks(a.id, {0: (key(3), BS)}, BS + 100, 7)).keys
        # b's block 0 becomes a hole: key(1) loses its last reference
        assert (await m.commit_blocks(b.id, {0: None}, BS, 8)).keys == [key(1)]
        assert await m.block_map(b.id) == {}
        # removing a frees both of its blocks
        freed = await m.unlink(ROOT_INODE, b"a")
        assert sorted(freed.keys) == [key(2), key(3)] and freed.deleted_inode == a.id
        assert m.stats().used_bytes == 0
        await raises(errno.ENOENT, m.commit_blocks(a.id, {0: (key(4), 1)}, 1, 9))

    drive(new_engine, body)


@engines_only
def test_truncate_drops_blocks_past_the_end(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        f = await m.create(ROOT_INODE, b"f", FILE)
        await m.commit_blocks(f.id, {i: (key(i + 1), BS) for i in range(4)}, 4 * BS, 1)
        node, freed = await m.truncate(f.id, BS + 10, 2)
        assert node.size == BS + 10 and node.mtime_ns == 2
        assert sorted(freed.keys) == [key(3), key(4)]
        assert await m.block_map(f.id) == {0: key(1), 1: key(2)}
        node, freed = await m.truncate(f.id, 10 * BS, 3)
        assert node.size == 10 * BS and not freed.keys

    drive(new_engine, body)


def test_an_open_file_outlives_its_last_name(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        blocks = {} if (await m.getattr(root)).scratch else {0: key(1)}  # a scratch file's bytes are no blocks
        f = await m.create(root, b"f", FILE, hold=True)
        await m.commit_blocks(f.id, {i: (k, BS) for i, k in blocks.items()}, BS, 1)
        freed = await m.unlink(root, b"f")
        assert not freed.keys and freed.deleted_inode is None and freed.unlinked.nlink == 0
        assert await names(m, root) == []
        attrs, found = await m.open_file(f.id)  # opened again: still one hold of this node
        assert (attrs.nlink, attrs.size, found) == (0, BS, blocks)
        assert await m.block_map(f.id) == blocks
        await raises(errno.ENOENT, m.link(f.id, root, b"back"))  # no name to come back to
        freed = await m.close_file(f.id)
        assert freed.keys == list(blocks.values()) and freed.deleted_inode == f.id
        await raises(errno.ENOENT, m.getattr(f.id))
        await raises(errno.ENOENT, m.open_file(f.id))
        empty = await m.create(root, b"empty", FILE)
        assert (await m.open_file(empty.id))[1] == {}

    drive(new_engine, body)


@engines_only
def test_garbage_is_claimed_once_and_then_forgotten(new_engine) -> None:
    async def body(m: MetaEngine, root: int) -> None:
        f = await m.create(ROOT_INODE, b"f", FILE)
        await m.commit_blocks(f.id, {0: (key(1), BS), 1: (key(2), BS)}, 2 * BS, 1)
        await m.mark_uploaded(key(1))
        await m.mark_uploaded(key(2))
        await m.commit_blocks(f.id, {1: None}, 2 * BS, 2)
        assert await m.claim_garbage(time.time() - 3600, FAR_FUTURE) == []  # not old enough
        assert await m.claim_garbage(time.time() + 1, FAR_FUTURE) == [key(2)]
        assert await m.claim_garbage(time.time() + 1, FAR_FUTURE) == []  # claimed once
        await m.garbage_deleted([key(2)])
        assert await m.object_info(key(2)) is None
        assert (await m.object_info(key(1))).refcount == 1

    drive(new_engine, body)


@pytest.mark.parametrize("engine_kind", ["sqlite"])
def test_start_drops_scratch_and_orphans_of_the_last_mount(new_engine) -> None:
    """A node's own volume: what its last mount left (scratch files, files unlinked while
    open) goes at the next start."""
    async def main() -> None:
        a = new_engine()
        await a.start()
        s = await a.create(ROOT_INODE, b"blockmgr-1", NewNode(DIR.mode, 0, 0, scratch_name=True))
        f = await a.create(s.id, b"shuffle", FILE)
        await a.commit_blocks(f.id, {0: (key(1), BS)}, BS, 1)
        kept = await a.create(ROOT_INODE, b"kept", FILE, hold=True)
        await a.commit_blocks(kept.id, {0: (key(2), BS)}, BS, 1)
        await a.unlink(ROOT_INODE, b"kept")
        # Files of the volume named in the scratch dir: they lose those names only.
        vol = await a.create(ROOT_INODE, b"vol", FILE)
        await a.commit_blocks(vol.id, {0: (key(3), BS)}, BS, 1)
        await a.link(vol.id, s.id, b"vol")
        only = await a.create(ROOT_INODE, b"only", FILE)
        await a.commit_blocks(only.id, {0: (key(4), BS)}, BS, 1)
        await a.rename(ROOT_INODE, b"only", s.id, b"only")
        a.close()
        b = new_engine()
        freed = await b.start()
        assert sorted(freed.keys) == sorted([key(1), key(2), key(4)])
        assert await names(b, ROOT_INODE) == [b"vol"]
        assert (await b.getattr(vol.id)).nlink == 1 and await b.block_map(vol.id) == {0: key(3)}
        assert b.stats().inodes == 2

    trio.run(main)


@shared_only
@pytest.mark.parametrize("ending", ["unmount", "lost"])
def test_a_scratch_dir_belongs_to_its_session_and_goes_with_it(new_engine, ending: str) -> None:
    """On a shared volume a scratch dir records the session that made it, its blocks are
    recorded as not in the bucket (another node writing the same bytes uploads them), and
    its names go when that session ends: a clean unmount, or a lost node's clean-up."""
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        s = await a.create(ROOT_INODE, b"blockmgr-1", NewNode(DIR.mode, 0, 0, scratch_name=True))
        f = await a.create(s.id, b"shuffle", FILE)
        assert s.scratch == f.scratch == a.scratch_owner != b.scratch_owner != 0
        await a.commit_blocks(f.id, {0: (key(1), BS)}, BS, 1)
        info = await b.object_info(key(1))
        assert (info.refcount, info.uploaded) == (1, False)
        assert await b.begin_upload(key(1), BS) is False
        mine = await b.create(ROOT_INODE, b"blockmgr-2", NewNode(DIR.mode, 0, 0, scratch_name=True))
        assert mine.scratch == b.scratch_owner
        assert (await b.lookup(s.id, b"shuffle")).scratch == a.scratch_owner
        await raises(errno.EXDEV, b.rename(s.id, b"shuffle", mine.id, b"shuffle"))  # two nodes' scratch
        await raises(errno.EIO, b.create(s.id, b"mine", FILE))
        await raises(errno.EXDEV, b.rename(ROOT_INODE, b"blockmgr-2", s.id, b"blockmgr-2"))
        await b.rename(ROOT_INODE, b"blockmgr-2", ROOT_INODE, b"blockmgr-moved")  # within the volume: fine
        vol = await b.create(ROOT_INODE, b"vol", FILE)
        await raises(errno.EXDEV, b.link(vol.id, s.id, b"vol"))  # not into another node's scratch
        await a.link(vol.id, s.id, b"vol")  # A loads it into its own
        if ending == "unmount":
            a.close()
        else:
            await trio.sleep(1.5)  # a stops beating
            await b.heartbeat()
            assert (await b.clean_dead_sessions()).keys == [key(1)]
        assert await names(b, ROOT_INODE) == [b"blockmgr-moved", b"vol"]
        assert (await b.getattr(vol.id)).nlink == 1
        assert (await b.getattr(ROOT_INODE)).nlink == 3
        await raises(errno.ENOENT, b.getattr(f.id))
        assert (await b.object_info(key(1))).refcount == 0

    drive(new_engine, body, nodes=2, session_ttl=1.0)


@shared_only
def test_a_clean_unmount_lets_go_of_what_its_session_held(new_engine) -> None:
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        f = await held_and_unlinked(a, b)
        assert (await b.object_info(key(1))).refcount == 1
        a.close()
        await raises(errno.ENOENT, b.getattr(f.id))
        assert (await b.object_info(key(1))).refcount == 0
        assert [s.mountpoint for s in await b.sessions()] == ["/node1"]

    drive(new_engine, body, nodes=2)


# --- many nodes on one database ----------------------------------------------------------------

@shared_only
def test_one_name_created_by_many_at_once_has_one_winner(new_engine) -> None:
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        wins: list[int] = []
        losses: list[int] = []

        async def attempt(m: MetaEngine, i: int) -> None:
            try:
                wins.append((await m.create(ROOT_INODE, b"race", FILE)).id)
            except FsError as e:
                assert e.errno == errno.EEXIST
                losses.append(i)

        async with trio.open_nursery() as n:
            for i in range(16):
                n.start_soon(attempt, (a, b)[i % 2], i)
        assert len(wins) == 1 and len(losses) == 15
        assert (await b.lookup(ROOT_INODE, b"race")).id == wins[0]
        assert await names(a, ROOT_INODE) == [b"race"]

    drive(new_engine, body, nodes=2)


@shared_only
def test_concurrent_namespace_changes_lose_nothing(new_engine) -> None:
    """Two nodes create, link, rename and unlink in one directory at once: every name each
    node kept is there, once, and the link counts add up."""
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        d = await a.create(ROOT_INODE, b"d", DIR)

        async def churn(m: MetaEngine, tag: str) -> None:
            for i in range(30):
                f = await m.create(d.id, f"{tag}{i}".encode(), FILE)
                await m.link(f.id, d.id, f"{tag}{i}.link".encode())
                await m.rename(d.id, f"{tag}{i}".encode(), d.id, f"{tag}{i}.final".encode())
                if i % 3 == 0:
                    await m.unlink(d.id, f"{tag}{i}.link".encode())

        async with trio.open_nursery() as n:
            n.start_soon(churn, a, "a")
            n.start_soon(churn, b, "b")
        listing = await b.readdir(d.id, 0, 100000)
        got = sorted(entry.name for entry, _ in listing)
        want = sorted(f"{t}{i}.final".encode() for t in "ab" for i in range(30)) + sorted(
            f"{t}{i}.link".encode() for t in "ab" for i in range(30) if i % 3)
        assert got == sorted(want)
        for entry, node in listing:
            twin = entry.name.endswith(b".link") or int(entry.name[1:].split(b".")[0]) % 3
            assert node.nlink == (2 if twin else 1), entry.name

    drive(new_engine, body, nodes=2)


@shared_only
def test_crossing_directory_moves_never_make_a_cycle(new_engine) -> None:
    """Node A moves x under y's subtree while node B moves y under x's: one of them must
    fail with EINVAL, whatever the timing; every directory stays reachable from the root."""
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        for round_ in range(15):
            top = await a.create(ROOT_INODE, f"r{round_}".encode(), DIR)
            px = await a.create(top.id, b"px", DIR)
            py = await a.create(top.id, b"py", DIR)
            x = await a.create(px.id, b"x", DIR)
            y = await a.create(py.id, b"y", DIR)
            xs = await a.create(x.id, b"xs", DIR)
            ys = await a.create(y.id, b"ys", DIR)
            outcomes: list[str] = []

            async def move(m: MetaEngine, parent: int, name: bytes, into: int) -> None:
                try:
                    await m.rename(parent, name, into, name)
                    outcomes.append("moved")
                except FsError as e:
                    assert e.errno in (errno.EINVAL, errno.ENOENT)
                    outcomes.append("refused")

            async with trio.open_nursery() as n:
                n.start_soon(move, a, px.id, b"x", ys.id)
                n.start_soon(move, b, py.id, b"y", xs.id)
            assert sorted(outcomes) == ["moved", "refused"], outcomes
            for node in (x, y, xs, ys):
                ino, hops = node.id, 0
                while ino != ROOT_INODE:
                    ino = await b.parent_of(ino)
                    hops += 1
                    assert hops < 10, "a cycle of directories"

    drive(new_engine, body, nodes=2)


@shared_only
def test_a_file_held_by_another_node_outlives_its_unlink(new_engine) -> None:
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        f = await held_and_unlinked(a, b)
        assert await a.block_map(f.id) == {0: key(1)}
        freed = await a.close_file(f.id)
        assert freed.keys == [key(1)] and freed.deleted_inode == f.id

    drive(new_engine, body, nodes=2)


@shared_only
def test_a_dead_session_is_cleaned_and_cannot_publish_again(new_engine) -> None:
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        f = await held_and_unlinked(a, b)
        await trio.sleep(1.5)  # a stops beating
        await b.heartbeat()
        freed = await b.clean_dead_sessions()
        assert freed.keys == [key(1)]
        assert [s.mountpoint for s in await b.sessions()] == ["/node1"]
        await raises(errno.EIO, a.create(ROOT_INODE, b"late", FILE))  # fenced
        await raises(errno.ENOENT, b.lookup(ROOT_INODE, b"late"))

    drive(new_engine, body, nodes=2, session_ttl=1.0)


@shared_only
def test_a_cleaned_up_node_commits_no_upload(new_engine) -> None:
    """A node whose session was cleaned up may upload a block before it learns so: its
    commit is refused, the block stays unknown to the database (the sweep of unknown
    objects takes it), and once the node knows it uploads nothing more."""
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        f = await a.create(ROOT_INODE, b"f", FILE)
        await trio.sleep(1.5)  # a stops beating
        await b.heartbeat()
        await b.clean_dead_sessions()
        assert await a.begin_upload(key(7), BS) is False  # a has not noticed yet
        await raises(errno.EIO, a.commit_blocks(f.id, {0: (key(7), BS)}, BS, 1, uploads_began=time.monotonic()))
        assert a.lost
        assert await b.object_info(key(7)) is None
        assert await b.sweep_unknown([key(7)]) == [key(7)]
        await raises(errno.EIO, a.begin_upload(key(8), BS))

    drive(new_engine, body, nodes=2, session_ttl=1.0)


@shared_only
def test_an_fsync_does_not_wait_for_the_nodes_writes_in_flight(new_engine, pg_url: str) -> None:
    """Every write transaction fences its session against the clean-up, and every fsync
    commits a heartbeat to that session's row: the two must not wait for each other
    (RocksDB fsyncs while the same node commits blocks), while the clean-up still waits
    for the write."""
    async def body(a: MetaEngine, root: int) -> None:
        f = await a.create(ROOT_INODE, b"f", FILE)
        with psycopg.connect(pg_url) as other, psycopg.connect(pg_url) as cleaner:
            # Another node's transaction on the file: a's commit waits for it, inside its
            # session's fence meanwhile.
            other.execute("SELECT 1 FROM inodes WHERE id=%s FOR UPDATE", (f.id,))
            committed, synced = trio.Event(), trio.Event()

            async def commit() -> None:
                await a.commit_blocks(f.id, {}, 10, 2)
                committed.set()

            async def sync() -> None:
                await a.sync()
                synced.set()

            def clean_up() -> None:  # what the other nodes' clean-up of a's session does first
                cleaner.execute("SELECT pg_advisory_xact_lock(%s, %s)", (SESSION_FENCE, a.session_id))
                cleaner.execute("DELETE FROM sessions WHERE id=%s", (a.session_id,))

            async with trio.open_nursery() as nursery:
                try:
                    nursery.start_soon(commit)
                    await trio.sleep(0.5)
                    assert not committed.is_set()
                    nursery.start_soon(sync)
                    with trio.move_on_after(10):
                        await synced.wait()
                    synced_while_blocked = synced.is_set()
                    cleaner.execute("SET lock_timeout = '300ms'")
                    with pytest.raises(psycopg.errors.LockNotAvailable):  # waits: off the trio loop
                        await trio.to_thread.run_sync(clean_up)
                finally:
                    cleaner.rollback()
                    other.rollback()
            assert synced_while_blocked
        assert (await a.getattr(f.id)).size == 10

    drive(new_engine, body)


@shared_only
def test_a_block_collected_while_it_was_uploaded_is_put_again_before_its_commit(new_engine) -> None:
    """Uploads are not registered: a commit of a block the collector claimed, or deleted
    from the bucket after the upload began, is refused with EAGAIN and changes nothing;
    the same commit after the bytes were put again goes through."""
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        f = await a.create(ROOT_INODE, b"f", FILE)
        await a.commit_blocks(f.id, {0: (key(1), BS)}, BS, 1, uploads_began=time.monotonic())
        await a.commit_blocks(f.id, {0: None}, BS, 2)  # key(1) now unreferenced
        g = await b.create(ROOT_INODE, b"g", FILE)
        began = time.monotonic()  # b begins to upload the same bytes
        assert await a.claim_garbage(time.time() + 1, FAR_FUTURE) == [key(1)]
        await raises(errno.EAGAIN, b.commit_blocks(g.id, {0: (key(1), BS)}, BS, 3, uploads_began=began))
        await a.garbage_deleted([key(1)])
        await raises(errno.EAGAIN, b.commit_blocks(g.id, {0: (key(1), BS)}, BS, 3, uploads_began=began))
        await raises(errno.EAGAIN, b.commit_blocks(g.id, {0: (key(1), BS)}, BS, 3))  # began: not known
        assert await a.object_info(key(1)) is None and await a.block_map(g.id) == {}
        await trio.sleep(COLLECTED_MARGIN + 0.2)
        await b.commit_blocks(g.id, {0: (key(1), BS)}, BS, 3, uploads_began=time.monotonic())  # put again
        assert (await a.object_info(key(1))).refcount == 1
        assert await a.claim_garbage(time.time() + 1, FAR_FUTURE) == []

    drive(new_engine, body, nodes=2)


@shared_only
def test_blocks_nobody_will_commit_become_garbage(new_engine) -> None:
    """An upload superseded before its commit, and the deletions a node that died had
    claimed: each ends as an unreferenced block the collector takes, and a block that
    may be gone is never taken for present."""
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        assert await a.begin_upload(key(1), BS) is False
        await a.end_upload(key(1))
        info = await b.object_info(key(1))
        assert info is not None and info.refcount == 0 and not info.uploaded
        assert await b.claim_garbage(time.time() + 1, FAR_FUTURE) == [key(1)]
        await b.garbage_deleted([key(1)])

        f = await a.create(ROOT_INODE, b"f", FILE)
        await a.commit_blocks(f.id, {0: (key(3), BS)}, BS, 1, uploads_began=time.monotonic())
        await a.unlink(ROOT_INODE, b"f")
        assert await a.claim_garbage(time.time() + 1, FAR_FUTURE) == [key(3)]  # a dies mid-deletion
        began = time.monotonic()  # b begins to upload the same bytes
        await trio.sleep(1.5)
        await b.heartbeat()
        await b.clean_dead_sessions()
        three = await b.object_info(key(3))
        assert (three.refcount, three.uploaded) == (0, False)
        g = await b.create(ROOT_INODE, b"g", FILE)
        # The deletion may have come after b's upload began: b must put the bytes again.
        await raises(errno.EAGAIN, b.commit_blocks(g.id, {0: (key(3), BS)}, BS, 1, uploads_began=began))
        assert await b.claim_garbage(time.time() + 1, FAR_FUTURE) == [key(3)]

    drive(new_engine, body, nodes=2, session_ttl=1.0)


@shared_only
def test_a_sweep_of_unknown_blocks_holds_back_commits_of_the_same_bytes(new_engine) -> None:
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        f = await a.create(ROOT_INODE, b"f", FILE)
        await a.commit_blocks(f.id, {0: (key(2), BS)}, BS, 1, uploads_began=time.monotonic())  # known
        began = time.monotonic()  # a begins to upload key(3)'s bytes
        assert await b.sweep_unknown([key(1), key(2), key(3)]) == [key(1), key(3)]
        await raises(errno.EAGAIN, a.commit_blocks(f.id, {1: (key(3), BS)}, 2 * BS, 2, uploads_began=began))
        await b.garbage_deleted([key(1), key(3)])
        await raises(errno.EAGAIN, a.commit_blocks(f.id, {1: (key(3), BS)}, 2 * BS, 2, uploads_began=began))
        await trio.sleep(COLLECTED_MARGIN + 0.2)
        await a.commit_blocks(f.id, {1: (key(3), BS)}, 2 * BS, 2, uploads_began=time.monotonic())
        assert await a.block_map(f.id) == {0: key(2), 1: key(3)}

    drive(new_engine, body, nodes=2)


@shared_only
def test_closing_while_the_database_is_down_gives_up_in_seconds(new_engine, postgres_server) -> None:
    """Ending a session touches nothing but the session's own rows, which the other nodes
    clean up after the session timeout: an unmount does not wait the minute that an
    operation waits for the database to come back."""
    engine = new_engine()
    trio.run(engine.start)
    postgres_server.stop("fast")
    try:
        started = time.monotonic()
        engine.close()
        assert time.monotonic() - started < 20
    finally:
        postgres_server.start()


@shared_only
def test_a_nodes_own_writes_answer_its_getattr_for_the_attribute_timeout(new_engine) -> None:
    """What this node just wrote answers its getattr for attr_cache_seconds (the kernel's
    own attribute timeout), no longer; a lookup or an open always asks the database."""
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        d = await a.create(ROOT_INODE, b"d", DIR)
        await a.create(d.id, b"x", FILE)
        mine = await a.getattr(d.id)
        await b.create(d.id, b"y", DIR)  # another node changes d: nlink and mtime
        theirs = await b.getattr(d.id)
        assert theirs.nlink == mine.nlink + 1
        assert (await a.getattr(d.id)).nlink == mine.nlink  # a's own row, within its timeout
        assert (await a.lookup(ROOT_INODE, b"d")).nlink == theirs.nlink
        assert (await a.getattr(d.id)).nlink == theirs.nlink  # the lookup replaced it
        await a.create(d.id, b"z", FILE)
        await b.create(d.id, b"w", DIR)
        await trio.sleep(1.2)
        assert (await a.getattr(d.id)).nlink == theirs.nlink + 1  # past the timeout: the database's
        f = await a.create(d.id, b"f", FILE)
        await b.setattr(f.id, AttrChange(mode=0o600))
        node, _ = await a.open_file(f.id)
        assert node.mode & 0o777 == 0o600 and (await a.getattr(f.id)).mode & 0o777 == 0o600

    drive(new_engine, body, nodes=2, attr_cache_seconds=1.0)


@shared_only
def test_an_fsyncs_durable_commit_leaves_its_sync_nothing_to_do(new_engine, pg_url: str) -> None:
    """fsync commits a file's last blocks, then waits for the WAL flush in a statement of
    its own (the commit notifies other nodes, and must not hold the notification queue's
    lock through a flush), so the sync that follows sends nothing; a namespace change
    after it (the rename of a commit pattern) makes the next sync flush again."""
    async def body(a: MetaEngine, root: int) -> None:
        sent = []
        run, query = a.pool.run, a.pool.query

        async def counting(fn, *args, **kw):
            sent.append(fn)
            return await run(fn, *args, **kw)

        async def counting_query(sql, *args, **kw):
            sent.append(sql)
            return await query(sql, *args, **kw)

        a.pool.run, a.pool.query = counting, counting_query
        f = await a.create(ROOT_INODE, b"tmp", FILE)
        await a.sync()
        assert len(sent) == 2  # the create committed without waiting for the WAL flush
        await a.commit_blocks(f.id, {0: (key(1), BS)}, BS, 1, durable=True)
        assert len(sent) == 4  # the commit, then its flush
        await a.sync()
        assert len(sent) == 4
        await a.rename(ROOT_INODE, b"tmp", ROOT_INODE, b"final")
        await a.sync()
        await a.sync()
        assert len(sent) == 6

    drive(new_engine, body)

    with psycopg.connect(pg_url, autocommit=True) as conn:  # the commit mode each call sets
        session = conn.execute("INSERT INTO sessions (host, pid, mountpoint, started, heartbeat)"
                               " VALUES ('t', 1, '/t', 0, 0) RETURNING id").fetchone()[0]
        ino = conn.execute("SELECT inode FROM entries WHERE name = 'final'").fetchone()[0]
        for durable, mode in ((False, "off"), (True, "on")):
            with conn.transaction(force_rollback=True):
                conn.execute("SELECT * FROM fs_commit(%s, %s, '{}', '{}', '{}', 1, 1, 0, false, %s, NULL, '{}')",
                             (session, ino, durable))
                assert conn.execute("SELECT current_setting('synchronous_commit')").fetchone()[0] == mode


@shared_only
def test_after_an_outage_no_node_is_cleaned_up_before_it_could_beat_again(new_engine, postgres_server) -> None:
    """The database is away longer than the session timeout (a failover, a restart): the
    first node back must not take the others, whose heartbeats were held up as long as its
    own, for dead; a node that stays silent once the database is back is cleaned up."""
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        await a.heartbeat()
        await b.heartbeat()
        await trio.to_thread.run_sync(postgres_server.stop, "fast")
        try:
            await trio.sleep(2.5)  # longer than the session timeout
        finally:
            await trio.to_thread.run_sync(postgres_server.start)
        await b.heartbeat()  # b is back first, and waits for its connection through the outage
        assert (await b.clean_dead_sessions()).keys == [] and b.sessions_cleaned == 0
        await a.heartbeat()  # a beats again: alive
        await trio.sleep(2.2)  # now a is silent for longer than its timeout, with the database up
        await b.heartbeat()
        await b.clean_dead_sessions()
        assert b.sessions_cleaned == 1
        await raises(errno.EIO, a.heartbeat())

    drive(new_engine, body, nodes=2, session_ttl=2.0)


# --- the change feed -------------------------------------------------------------------

@shared_only
def test_another_nodes_change_made_by_a_server_process_once_this_nodes_is_seen(new_engine) -> None:
    """A node skips the notifications of its own changes. The server gives a process id to a
    new connection once the last one that had it closed, so a process that served this node
    may serve another's: its changes must still reach this node's lookup memory. Forced here:
    one of node A's connections, its server process with it, is handed to node B (which
    names its session on it, as at any connect) and unlinks a name A remembers."""
    async def body(a: MetaEngine, b: MetaEngine, root: int) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(a.changes.run)
            f = await a.create(ROOT_INODE, b"f", FILE)
            with trio.fail_after(5):
                while not a.changes.fresh():
                    await trio.sleep(0.02)
            assert (await a.lookup(ROOT_INODE, b"f")).id == f.id
            conn = a.pool._take_idle()
            assert conn is not None
            conn.execute("SELECT set_config('fusestate.session', %s, false)", (b.pool.tag,))
            conn.tag = b.pool.tag
            b.pool.close_idle()
            b.pool._idle.append(conn)
            await b.unlink(ROOT_INODE, b"f")
            assert not b.pool._idle or b.pool._idle[-1] is conn  # B's unlink ran on it
            with trio.fail_after(3):
                while True:
                    try:
                        await a.lookup(ROOT_INODE, b"f")
                    except FsError as exc:
                        assert exc.errno == errno.ENOENT
                        break
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    drive(new_engine, body, nodes=2)


@shared_only
def test_a_failover_fails_the_first_sync_only_after_changes_it_may_have_lost(new_engine) -> None:
    """When the server's timeline goes up (a standby promoted), the first sync fails with EIO
    if this node committed changes on the old timeline since its last durable commit (they
    may not have reached the standby), once. An open changes nothing a failover loses (its
    hold is in an UNLOGGED table, registered again after a failover): a node that only
    opened files since its last sync syncs without error. The failover is the connections'
    timeline moved on, as a reconnection to a promoted standby reads it."""
    def fail_over(m: PostgresEngine) -> None:
        for conn in m.pool._idle:
            conn.timeline += 1

    async def body(m: PostgresEngine, root: int) -> None:
        f = await m.create(ROOT_INODE, b"f", FILE)
        await m.sync()
        await m.open_file(f.id)
        fail_over(m)
        await m.sync()  # only an open since the last sync: nothing lost
        await m.create(ROOT_INODE, b"g", FILE)  # a change on the new timeline
        fail_over(m)
        await raises(errno.EIO, m.sync())
        await m.sync()  # reported once
        await m.close_file(f.id)

    drive(new_engine, body)


@shared_only
def test_fsck_finds_a_name_in_a_directory_that_does_not_exist(new_engine, pg_url: str) -> None:
    """What a rename into a directory removed meanwhile left, before it was refused."""
    async def body(m: MetaEngine, root: int) -> None:
        f = await m.create(root, b"f", FILE)
        assert await m.check() == []
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("UPDATE entries SET parent = 999999 WHERE inode = %s", (f.id,))
        assert await m.check() == ["entry b'f' is in directory 999999, which does not exist"]

    drive(new_engine, body)
