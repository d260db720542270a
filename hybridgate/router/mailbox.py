"""A request stream's queue of outputs: one writer (the router's output pump), one reader (the stream's caller)."""

from __future__ import annotations

import asyncio
from collections import deque


class Mailbox:
    """A FIFO of at most `maxsize` items (`maxsize` <= 0: unbounded) between synchronous puts on the event
    loop and one reading coroutine; `asyncio.Queue`'s methods and errors for that case.

    The output pump puts one item per streamed message, so this sits on the gateway's hottest path:
    `asyncio.Queue` keeps a deque of getter futures, a putters deque, an unfinished-task count and an
    Event for `join()`, none of which one reader and a put that never waits need. Here a put appends
    and wakes the one waiting reader, if any; a reader that finds an item takes it without a future.
    Not thread-safe (neither is asyncio.Queue): every call is on the event loop.

    `items` is the deque itself: the reader's hot loop may test it and `popleft()` from it directly
    (`if not box.items: await box.arrival()`, then `box.items.popleft()`), without a call per item.
    """

    __slots__ = ("maxsize", "items", "_waiter")

    def __init__(self, maxsize: int = 0):
        self.maxsize = maxsize
        self.items: deque = deque()
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits in `get`

    def qsize(self) -> int:
        return len(self.items)

    def empty(self) -> bool:
        return not self.items

    def full(self) -> bool:
        return 0 < self.maxsize <= len(self.items)

    def put_nowait(self, item) -> None:
        """Append `item` and wake the reader. Raises asyncio.QueueFull when `maxsize` items are held."""
        if 0 < self.maxsize <= len(self.items):
            raise asyncio.QueueFull
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def get_nowait(self):
        """The oldest item. Raises asyncio.QueueEmpty when there is none."""
        if not self.items:
            raise asyncio.QueueEmpty
        return self.items.popleft()

    def arrival(self) -> asyncio.Future:
        """A future done once an item is held (at once if one is): `await box.arrival()` then
        `get_nowait()` is `get()` without a coroutine of its own, for the reader's hot loop.
        One reader at a time: a second reader waiting meanwhile is a RuntimeError (it would take
        the first one's wake-up)."""
        if self._waiter is not None and not self._waiter.done():  # (a cancelled wait's future is done)
            raise RuntimeError("Mailbox: another reader is waiting (a Mailbox has one reader)")
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        if self.items:
            self._waiter = None
            waiter.set_result(None)
        return waiter

    async def get(self):
        """The oldest item, waiting for one (one reader at a time, as `arrival`)."""
        while not self.items:
            await self.arrival()
        return self.items.popleft()

    def clear(self) -> None:
        """Drop every item held (the reader, if waiting, keeps waiting)."""
        self.items.clear()
