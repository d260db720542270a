"""The stream's Mailbox against asyncio.Queue, whose behaviour it keeps for one reader."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgate.router.mailbox import Mailbox

OPS = st.lists(st.one_of(st.tuples(st.just("put"), st.integers(0, 99)), st.just(("get",)), st.just(("clear",))),
               max_size=40)


def apply(box, op) -> object:
    """One operation: its result, or the exception's type."""
    try:
        if op[0] == "put":
            return box.put_nowait(op[1])
        if op[0] == "get":
            return box.get_nowait()
        if isinstance(box, Mailbox):
            return box.clear()
        while not box.empty():  # asyncio.Queue has no clear(): what it means, there
            box.get_nowait()
        return None
    except (asyncio.QueueFull, asyncio.QueueEmpty) as exc:
        return type(exc)


@settings(max_examples=300, deadline=None)
@given(maxsize=st.integers(0, 4), ops=OPS)
def test_nowait_operations_answer_as_asyncio_queue_does(maxsize, ops):
    async def main():
        box, queue = Mailbox(maxsize), asyncio.Queue(maxsize)
        for op in ops:
            assert apply(box, op) == apply(queue, op)
            assert (box.qsize(), box.empty(), box.full()) == (queue.qsize(), queue.empty(), queue.full())

    asyncio.run(main())


def test_a_waiting_reader_gets_items_in_order_and_a_cancelled_wait_leaves_it_usable():
    async def main():
        box = Mailbox(8)
        reader = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        assert not reader.done()
        box.put_nowait("a")
        box.put_nowait("b")
        assert await reader == "a" and await box.get() == "b"
        waiting = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        box.put_nowait("c")  # nobody waits now: no wake-up of the cancelled reader is owed
        assert await asyncio.wait_for(box.get(), 1) == "c"

    asyncio.run(main())


def test_a_second_concurrent_reader_is_refused():
    async def main():
        box = Mailbox()
        first = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one reader"):
            await box.get()
        box.put_nowait(1)
        assert await first == 1

    asyncio.run(main())
