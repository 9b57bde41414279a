"""Operations whose outcome the node did not learn: the connection broke after the server
got the commit, or before. The engine retries such an operation on a new connection; it
must then neither apply it a second time nor turn its own success into an error (a create
into EEXIST, a rename into ENOENT), whatever another node did in between.

Node ``a`` reaches the test server through a proxy that breaks its connection at a chosen
point of the wire protocol (``pgwire_cut``); node ``b`` connects directly and checks.
"""

from __future__ import annotations

import stat
import time
from typing import Any, Awaitable, Callable, Iterator, Optional

import psycopg
import pytest
import trio

from fusestate.meta.engine import ROOT_INODE, Inode, NewNode
from fusestate.meta.postgres.engine import PostgresEngine
from pgwire_cut import CuttingProxy

BS = 64 * 1024
FILE = NewNode(stat.S_IFREG | 0o644, 1000, 1000)
CUT_TIMEOUT = 10.0
CREATE_CALL = r"fs_create\("
UNLINK_CALL = r"fs_unlink\("
LINK_CALL = r"fs_link\("
RENAME_CALL = r"fs_rename\("  # a file's rename; a directory's is operations.rename, ended by COMMIT
DIR = NewNode(stat.S_IFDIR | 0o755, 1000, 1000)
COMMIT = r"^COMMIT$"  # the statement that ends a namespace operation's transaction


@pytest.fixture
def proxy(postgres_server: Any) -> Iterator[CuttingProxy]:
    p = CuttingProxy("127.0.0.1", postgres_server.port)
    yield p
    p.close()


def drive(pg_url: str, proxy: CuttingProxy, body: Callable[[PostgresEngine, PostgresEngine], Awaitable[None]]) -> None:
    """Node ``a`` through the proxy, node ``b`` directly, both started; ``body(a, b)``."""
    a = PostgresEngine(proxy.url(pg_url), block_size=BS, mountpoint="/a")
    b = PostgresEngine(pg_url, block_size=BS, mountpoint="/b")
    try:
        async def main() -> None:
            await a.start()
            await b.start()
            await body(a, b)

        trio.run(main)
    finally:
        a.close()
        b.close()


async def broken(proxy: CuttingProxy, call: Awaitable, meanwhile: Optional[Callable[[], Awaitable]] = None) -> Any:
    """``call``'s result, its connection broken as the proxy was armed; ``meanwhile`` runs
    after the break and before ``a`` may connect again."""
    proxy.hold_new()
    done: list = []

    async def run() -> None:
        done.append(await call)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        with trio.fail_after(CUT_TIMEOUT):
            while not proxy.cut.is_set():
                await trio.sleep(0.01)
        if meanwhile is not None:
            await meanwhile()
        proxy.resume()
    return done[0]


async def names(m: PostgresEngine, ino: int = ROOT_INODE) -> dict[bytes, int]:
    return {entry.name: entry.inode for entry, _ in await m.readdir(ino, 0, 1000)}


other_node = pytest.mark.parametrize("other_node_acts", [False, True], ids=["alone", "other-node-acts"])


@other_node
def test_a_create_whose_commit_answer_was_lost(pg_url: str, proxy: CuttingProxy, other_node_acts: bool) -> None:
    """Made once: the retry returns the file the lost answer would have, not EEXIST; and a
    node that removed it meanwhile does not see it come back."""
    async def body(a: PostgresEngine, b: PostgresEngine) -> None:
        seen: list[Inode] = []

        async def remove() -> None:
            seen.append(await b.lookup(ROOT_INODE, b"f"))
            await b.unlink(ROOT_INODE, b"f")

        proxy.cut_reply(CREATE_CALL)
        made = await broken(proxy, a.create(ROOT_INODE, b"f", FILE), remove if other_node_acts else None)
        if other_node_acts:
            assert made.id == seen[0].id and await names(b) == {}
        else:
            assert await names(b) == {b"f": made.id}
            assert (await b.lookup(ROOT_INODE, b"f")).nlink == 1
        assert await b.check() == []

    drive(pg_url, proxy, body)


@other_node
def test_a_rename_whose_commit_answer_was_lost(pg_url: str, proxy: CuttingProxy, other_node_acts: bool) -> None:
    """Moved once: the retry does not fail with ENOENT, nor move a file another node made
    under the old name meanwhile."""
    async def body(a: PostgresEngine, b: PostgresEngine) -> None:
        f = await a.create(ROOT_INODE, b"src", FILE)
        newer: list[Inode] = []

        async def remake() -> None:
            newer.append(await b.create(ROOT_INODE, b"src", FILE))

        proxy.cut_reply(RENAME_CALL)
        await broken(proxy, a.rename(ROOT_INODE, b"src", ROOT_INODE, b"dst"), remake if other_node_acts else None)
        expected = {b"dst": f.id, **({b"src": newer[0].id} if other_node_acts else {})}
        assert await names(b) == expected
        assert await b.check() == []

    drive(pg_url, proxy, body)


def test_a_directory_rename_whose_commit_answer_was_lost(pg_url: str, proxy: CuttingProxy) -> None:
    """The same for a directory's rename, which runs as pipelined statements: moved once."""
    async def body(a: PostgresEngine, b: PostgresEngine) -> None:
        d = await a.create(ROOT_INODE, b"src", DIR)
        proxy.cut_reply(COMMIT)
        await broken(proxy, a.rename(ROOT_INODE, b"src", ROOT_INODE, b"dst"))
        assert await names(b) == {b"dst": d.id}
        assert await b.check() == []

    drive(pg_url, proxy, body)


@other_node
def test_a_link_whose_commit_answer_was_lost(pg_url: str, proxy: CuttingProxy, other_node_acts: bool) -> None:
    """Linked once: no EEXIST from its own link, and a name another node removed meanwhile
    is not made again."""
    async def body(a: PostgresEngine, b: PostgresEngine) -> None:
        f = await a.create(ROOT_INODE, b"f", FILE)

        async def remove() -> None:
            await b.unlink(ROOT_INODE, b"g")

        proxy.cut_reply(LINK_CALL)
        linked = await broken(proxy, a.link(f.id, ROOT_INODE, b"g"), remove if other_node_acts else None)
        # The retry answers with the file as it is now: linked, and unlinked again by b.
        assert linked.id == f.id and linked.nlink == (1 if other_node_acts else 2)
        if other_node_acts:
            assert await names(b) == {b"f": f.id}
            assert (await b.getattr(f.id)).nlink == 1
        else:
            assert await names(b) == {b"f": f.id, b"g": f.id}
            assert (await b.getattr(f.id)).nlink == 2
        assert await b.check() == []

    drive(pg_url, proxy, body)


@other_node
def test_an_unlink_whose_commit_answer_was_lost(pg_url: str, proxy: CuttingProxy, other_node_acts: bool) -> None:
    """Removed once: no ENOENT from its own unlink, and a file another node made under the
    same name meanwhile stays."""
    async def body(a: PostgresEngine, b: PostgresEngine) -> None:
        f = await a.create(ROOT_INODE, b"f", FILE)
        newer: list[Inode] = []

        async def remake() -> None:
            newer.append(await b.create(ROOT_INODE, b"f", FILE))

        proxy.cut_reply(UNLINK_CALL)
        freed = await broken(proxy, a.unlink(ROOT_INODE, b"f"), remake if other_node_acts else None)
        assert freed.deleted_inode == f.id
        assert await names(b) == ({b"f": newer[0].id} if other_node_acts else {})
        assert await b.check() == []

    drive(pg_url, proxy, body)


def test_a_promotion_whose_commit_answer_was_lost(pg_url: str, proxy: CuttingProxy) -> None:
    """A scratch file of this node made a file of the volume (before a link out of its
    scratch dir): the retry finds it promoted with these blocks, and is not refused as
    'not a scratch file' (EXDEV)."""
    async def body(a: PostgresEngine, b: PostgresEngine) -> None:
        scratch = await a.create(ROOT_INODE, b"blockmgr-1", NewNode(stat.S_IFDIR | 0o755, 0, 0, scratch_name=True))
        f = await a.create(scratch.id, b"000012.sst", FILE)
        blocks = {0: (f"{1:064x}", BS), 1: (f"{2:064x}", 100)}
        proxy.cut_reply(r"fs_commit\(")
        await broken(proxy, a.promote(f.id, blocks, BS + 100, 7, uploads_began=time.monotonic()))
        node, keys = await b.read_file(f.id)
        assert (node.scratch, node.size) == (0, BS + 100)
        assert keys == {i: k for i, (k, _) in blocks.items()}
        await a.link(f.id, ROOT_INODE, b"000012.sst")
        assert await b.check() == []

    drive(pg_url, proxy, body)


@pytest.mark.parametrize("operation", ["create", "rename"])
def test_an_operation_cut_before_its_commit_reached_the_server_happens_once(
        pg_url: str, proxy: CuttingProxy, operation: str) -> None:
    """The commit (a create: its call) never reached the server: the transaction rolled
    back, and the retry applies the operation, once."""
    async def body(a: PostgresEngine, b: PostgresEngine) -> None:
        if operation == "create":
            proxy.cut_before(CREATE_CALL)
            made = await broken(proxy, a.create(ROOT_INODE, b"f", FILE))
            assert await names(b) == {b"f": made.id}
        else:
            f = await a.create(ROOT_INODE, b"src", FILE)
            proxy.cut_before(RENAME_CALL)
            await broken(proxy, a.rename(ROOT_INODE, b"src", ROOT_INODE, b"dst"))
            assert await names(b) == {b"dst": f.id}
        assert await b.check() == []

    drive(pg_url, proxy, body)


def test_a_retry_waits_for_the_first_attempt_the_server_is_still_running(pg_url: str, proxy: CuttingProxy) -> None:
    """The connection broke while the server was still running the create (waiting for a
    lock another transaction holds); the node retries at once. The retry waits for that
    first attempt to end, then finds it committed, and returns its file."""
    async def body(a: PostgresEngine, b: PostgresEngine) -> None:
        with psycopg.connect(pg_url) as blocker, psycopg.connect(pg_url, autocommit=True) as watcher:
            blocker.execute("SELECT 1 FROM inodes WHERE id = %s FOR UPDATE", (ROOT_INODE,))
            proxy.cut_after(CREATE_CALL)
            made: list[Inode] = []

            async def create() -> None:
                made.append(await a.create(ROOT_INODE, b"f", FILE))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(create)
                with trio.fail_after(CUT_TIMEOUT):
                    while not proxy.cut.is_set():
                        await trio.sleep(0.01)
                    # The first attempt waits for the blocker, its retry for the first attempt.
                    while watcher.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                                          " AND wait_event_type = 'Lock'").fetchone()[0] < 2:
                        await trio.sleep(0.02)
                blocker.rollback()
        assert await names(b) == {b"f": made[0].id}
        assert await b.check() == []

    drive(pg_url, proxy, body)
