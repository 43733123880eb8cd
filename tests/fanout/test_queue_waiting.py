"""Waiting on a subscriber's queue: the consumer parks its own task (no trio Event),
and tasks that share one queue (an embedder's, on one JobEvents) may wait at once."""

from __future__ import annotations

import trio
import trio.testing

from jobsignal.fanout import Broadcaster, EndReason
from jobsignal.fanout.subscriber import EventQueue
from tests.support.factories import make_job


def event_queue() -> tuple[Broadcaster, EventQueue]:
    broadcaster = Broadcaster()
    return broadcaster, broadcaster.subscribe_events(snapshot=False)


async def test_a_push_wakes_the_waiting_consumer(autojump_clock: trio.testing.MockClock) -> None:
    broadcaster, queue = event_queue()
    got: list[int] = []

    async def consume() -> None:
        got.append(len(await queue.next_batch_or_end(10)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        broadcaster.publish([make_job(1)])
    assert got == [1]


async def test_tasks_waiting_together_all_wake_and_one_takes_the_entry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broadcaster, queue = event_queue()
    got: list[int] = []

    async def consume() -> None:
        got.append(len(await queue.next_batch_or_end(10)))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        broadcaster.publish([make_job(1)])
        await trio.testing.wait_all_tasks_blocked()
        assert got == [1]  # the others looked, found nothing and wait again
        broadcaster.publish([make_job(2)])
        await trio.testing.wait_all_tasks_blocked()
        assert got == [1, 1]
        queue.end(EndReason.SHUTDOWN)  # the last one learns of the end
    assert got == [1, 1, 0]


async def test_cancelled_waiters_leave_the_others_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first waiter holds the queue's slot, later ones a list: cancelling the
    one in the slot and one in the list leaves the third to get the entry."""
    broadcaster, queue = event_queue()
    scopes: dict[str, trio.CancelScope] = {}
    got: list[str] = []

    async def consume(name: str) -> None:
        with trio.CancelScope() as scopes[name]:
            got.append(f"{name}:{len(await queue.next_batch_or_end(10))}")

    async with trio.open_nursery() as nursery:
        for name in ("slot", "listed", "left"):
            nursery.start_soon(consume, name)
            await trio.testing.wait_all_tasks_blocked()  # they wait in this order
        scopes["slot"].cancel()
        scopes["listed"].cancel()
        await trio.testing.wait_all_tasks_blocked()
        broadcaster.publish([make_job(1)])
        await trio.testing.wait_all_tasks_blocked()
        assert got == ["left:1"]
        nursery.start_soon(consume, "again")  # the slot is free again
        await trio.testing.wait_all_tasks_blocked()
        broadcaster.publish([make_job(2)])
    assert got == ["left:1", "again:1"]
