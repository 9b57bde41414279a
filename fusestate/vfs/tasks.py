"""Running one coroutine over several items at once, failing as a sequential loop would."""

from __future__ import annotations

from typing import Awaitable, Callable, Iterable, TypeVar

import trio

T = TypeVar("T")


async def each_at_once(run: Callable[[T], Awaitable[None]], items: Iterable[T], limit: int) -> None:
    """``run(item)`` for every item, at most ``limit`` at a time. The first error is raised
    as itself once all have ended, not wrapped in an exception group: the FUSE operation
    that called this answers with its errno, as it would from a loop. Cancellation is not
    caught."""
    slots = trio.CapacityLimiter(limit)
    errors: list[Exception] = []

    async def one(item: T) -> None:
        async with slots:
            if errors:
                return  # one failed: the operation fails, so the rest need not run
            try:
                await run(item)
            except Exception as exc:  # noqa: BLE001 - raised below, after the others
                errors.append(exc)

    async with trio.open_nursery() as nursery:
        for item in items:
            nursery.start_soon(one, item)
    if errors:
        raise errors[0]
