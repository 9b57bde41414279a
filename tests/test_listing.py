"""Directory listings on every namespace implementation: the embedded engine, the
PostgreSQL engine, and a shared volume's scratch directories (``meta.scratch.namespace``).

A listing is read in pieces, each continuing after the last entry id it took (the kernel's
readdir offset), and the vfs cuts those pieces from pages it keeps (``DirListing``). Both
rely on one rule of the engine interface: ``readdir`` hands out entries in increasing id
order. A scratch directory once broke it (a name renamed over another kept its place with
a new, higher id) and a listing of that directory never ended. Random sequences of the
operations that give a name a new entry (create, link, rename over a name, exchange,
unlink) are run here against each implementation, and every listing is read the way the
kernel reads it, in small pieces, also across a change made while it is read.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Awaitable, Callable

import pytest
import trio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fusestate.meta.engine import RENAME_EXCHANGE, ROOT_INODE, FsError, MetaEngine, NewNode
from fusestate.meta.scratch.namespace import NodeLocalNames
from fusestate.meta.postgres.engine import PostgresEngine
from fusestate.meta.embedded.engine import SQLiteEngine
from fusestate.vfs.dir_listing import DirListing

FILE = NewNode(stat.S_IFREG | 0o644, 0, 0)
DIR = NewNode(stat.S_IFDIR | 0o755, 0, 0)
SCRATCH_DIR = NewNode(stat.S_IFDIR | 0o755, 0, 0, scratch_name=True)
NAMES = [b"a", b"b", b"c", b"d", b"e"]
FIRST = [b"a", b"b", b"c"]  # made before the operations, so that most of them meet a name

names = st.sampled_from(NAMES)
operations = st.lists(st.one_of(
    st.tuples(st.just("create"), names),
    st.tuples(st.just("link"), names, names),
    st.tuples(st.just("rename"), names, names),
    st.tuples(st.just("exchange"), names, names),
    st.tuples(st.just("unlink"), names),
    st.tuples(st.just("rename_from_sub"), names, names),
), min_size=1, max_size=25)

Body = Callable[[MetaEngine, int], Awaitable[None]]
Run = Callable[[Body], None]

# Examples are many and cheap; a failure is reported as generated (shrinking one that needs a
# database round trip per step can take minutes). The slow run shrinks.
FAST = settings(max_examples=40, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.function_scoped_fixture])
THOROUGH = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=["sqlite", "postgresql", "postgresql-scratch"])
def run(request: pytest.FixtureRequest, tmp_path: Path) -> Run:
    """Runs one example's body under trio with an engine on the test's database and a fresh
    directory to work in (``postgresql-scratch``: a scratch dir, whose contents live in the
    wrapper), closing the engine after it."""
    kind = request.param
    url = request.getfixturevalue("pg_url") if kind.startswith("postgresql") else ""
    count = iter(range(1 << 30))

    def run_body(body: Body) -> None:
        async def main() -> None:
            if kind == "sqlite":
                inner: MetaEngine = SQLiteEngine(str(tmp_path / "meta.db"), block_size=65536)
            else:
                inner = PostgresEngine(url, block_size=65536, mountpoint="/listing")
            engine = NodeLocalNames(inner) if kind == "postgresql-scratch" else inner
            try:
                await engine.start()
                home = await engine.create(ROOT_INODE, b"ex-%d" % next(count),
                                           SCRATCH_DIR if kind == "postgresql-scratch" else DIR)
                await body(engine, home.id)  # type: ignore[arg-type]
            finally:
                inner.close()

        trio.run(main)

    return run_body


async def walk(engine: MetaEngine, ino: int, take: int, between: Callable[[], Awaitable[None]] | None = None
               ) -> list[tuple[int, bytes]]:
    """A listing read as the kernel reads it: ``take`` entries from each answer, the next
    piece after the last id taken, through one open handle's ``DirListing``. ``between``
    runs once, after the first piece."""
    listing = DirListing(ino)
    after, seen = 0, []
    while True:
        piece = (await listing.after(after, engine.readdir))[:take]
        if not piece:
            return seen
        seen += [(entry.entry_id, entry.name) for entry, _ in piece]
        after = piece[-1][0].entry_id
        assert len(seen) < 10 * len(NAMES) + 10, f"the listing does not end: {seen[:30]}"
        if between is not None:
            await between()
            between = None


async def apply(engine: MetaEngine, home: int, sub: int, model: dict[bytes, int], op: tuple) -> None:
    """One operation on the engine and on ``model`` (name -> inode), if the engine takes it."""
    kind, *args = op
    try:
        if kind == "create":
            model[args[0]] = (await engine.create(home, args[0], FILE)).id
        elif kind == "link":
            src, dst = args
            if src in model:
                await engine.link(model[src], home, dst)
                model[dst] = model[src]
        elif kind == "rename":
            await engine.rename(home, args[0], home, args[1])
            if args[0] != args[1] and model[args[0]] != model.get(args[1]):
                model[args[1]] = model.pop(args[0])
            elif args[0] != args[1]:  # two names of one file: nothing happens
                pass
        elif kind == "exchange":
            await engine.rename(home, args[0], home, args[1], RENAME_EXCHANGE)
            model[args[0]], model[args[1]] = model[args[1]], model[args[0]]
        elif kind == "unlink":
            await engine.unlink(home, args[0])
            del model[args[0]]
        elif kind == "rename_from_sub":  # a name comes in from another directory, over one here
            made = await engine.create(sub, args[0], FILE)
            await engine.rename(sub, args[0], home, args[1])
            model[args[1]] = made.id
    except FsError:
        pass  # EEXIST, ENOENT...: the model changed only after the call succeeded


def check(listed: list[tuple[int, bytes]], model: dict[bytes, int]) -> None:
    ids = [entry_id for entry_id, _ in listed]
    assert ids == sorted(set(ids)), f"entry ids not increasing: {listed}"
    assert sorted(name for _, name in listed) == sorted(model), f"listed {listed}, expected {sorted(model)}"


async def populated(engine: MetaEngine, home: int) -> dict[bytes, int]:
    """The directory's first names, as the model (name -> inode) that follows it."""
    model = {b"sub": (await engine.create(home, b"sub", DIR)).id}
    for name in FIRST:
        model[name] = (await engine.create(home, name, FILE)).id
    return model


async def listed_in_order(engine: MetaEngine, home: int, ops: list[tuple], take: int) -> None:
    model = await populated(engine, home)
    sub = model[b"sub"]
    for op in ops:
        await apply(engine, home, sub, model, op)
        check(await walk(engine, home, take), model)
        for entry, _ in await engine.readdir(home, 0, 1000):
            assert (await engine.lookup(home, entry.name)).id == model[entry.name]


async def listed_across(engine: MetaEngine, home: int, setup: list[tuple], change: tuple, take: int) -> None:
    model = await populated(engine, home)
    sub = model[b"sub"]
    for op in setup:
        await apply(engine, home, sub, model, op)
    before = dict(model)
    listed = await walk(engine, home, take, lambda: apply(engine, home, sub, model, change))
    touched = {name for name in NAMES if before.get(name) != model.get(name)}
    touched |= {arg for arg in change[1:] if isinstance(arg, bytes)}
    kept = [name for _, name in listed if name not in touched]
    assert sorted(kept) == sorted(name for name in model if name not in touched), listed


changes = operations.map(lambda ops: ops[0])
takes = st.sampled_from([1, 2, 3, 1000])


@FAST
@given(ops=operations, take=takes)
def test_a_listing_shows_each_name_once_in_id_order(run: Run, ops: list[tuple], take: int) -> None:
    run(lambda engine, home: listed_in_order(engine, home, ops, take))


@FAST
@given(setup=operations, change=changes, take=takes)
def test_a_listing_read_across_a_change_ends_and_keeps_the_names_not_changed(
        run: Run, setup: list[tuple], change: tuple, take: int) -> None:
    """POSIX lets a listing miss or repeat a name changed while it is read; every other name
    appears exactly once, and the listing ends."""
    run(lambda engine, home: listed_across(engine, home, setup, change, take))


@pytest.mark.slow
@THOROUGH
@given(ops=operations, take=takes)
def test_many_listings_show_each_name_once_in_id_order(run: Run, ops: list[tuple], take: int) -> None:
    run(lambda engine, home: listed_in_order(engine, home, ops, take))


@pytest.mark.slow
@THOROUGH
@given(setup=operations, change=changes, take=takes)
def test_many_listings_read_across_a_change(run: Run, setup: list[tuple], change: tuple, take: int) -> None:
    run(lambda engine, home: listed_across(engine, home, setup, change, take))


def test_a_name_renamed_over_another_is_listed_once(run: Run) -> None:
    """The listing that looped in a scratch dir: a file renamed over a name that has later
    names after it."""
    async def body(engine: MetaEngine, home: int) -> None:
        d = (await engine.create(home, b"d", DIR)).id
        await engine.create(home, b"a", FILE)
        await engine.create(d, b"a", FILE)
        await engine.create(home, b"c", FILE)
        await engine.rename(d, b"a", home, b"a")
        for take in (1, 2, 1000):
            assert sorted(name for _, name in await walk(engine, home, take)) == [b"a", b"c", b"d"]

    run(body)
