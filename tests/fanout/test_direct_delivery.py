"""Direct delivery: a push to a parked subscriber is offered to its sink first,
and the order of what the client receives never changes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from jobsignal.fanout import Broadcaster, EndReason, StreamKind, Subscriber
from jobsignal.fanout.encoding import encode_signal
from jobsignal.fanout.subscriber import QueueEntry
from jobsignal.store.model import event_id
from tests.support.factories import make_job


def signal_of(index: int) -> bytes:
    job = make_job(index)
    return encode_signal(job, event_id(job))


class Sink:
    """Takes entries while `open`; records what it took, in order."""

    def __init__(self) -> None:
        self.open = True
        self.taken: list[bytes] = []
        self.offers = 0

    def __call__(self, entry: QueueEntry) -> bool:
        self.offers += 1
        if self.open:
            self.taken.append(entry[1])
        return self.open


def subscribe(broadcaster: Broadcaster, name: str) -> tuple[Subscriber, Sink]:
    subscriber = broadcaster.subscribe(StreamKind.SIGNAL, "CCAgent", name, snapshot=False)
    sink = Sink()
    subscriber.deliver_directly(sink)
    return subscriber, sink


@asynccontextmanager
async def parked_consumer(subscriber: Subscriber) -> AsyncIterator[list[bytes]]:
    """A consumer parked on `subscriber` for the block; yields the list its one
    batch ends up in (complete once the block has ended)."""
    received: list[bytes] = []
    async with trio.open_nursery() as nursery:

        async def consume() -> None:
            received.extend(await subscriber.next_batch(10))

        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        yield received


async def test_a_push_to_a_parked_subscriber_goes_to_its_sink_and_wakes_nobody() -> None:
    broadcaster = Broadcaster()
    subscriber, sink = subscribe(broadcaster, "a")
    batches: list[list[bytes]] = []
    async with trio.open_nursery() as nursery:

        async def consume() -> None:
            while True:
                batches.append(await subscriber.next_batch(10))

        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        for index in range(3):
            broadcaster.publish([make_job(index)])
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert sink.taken == [signal_of(0), signal_of(1), signal_of(2)]
    assert batches == []
    assert subscriber.pending == 0


async def test_no_sink_is_offered_anything_while_the_consumer_is_busy() -> None:
    """Not parked (it has not asked for the next batch yet): the push is queued, so
    nothing can overtake a batch the consumer is still sending."""
    broadcaster = Broadcaster()
    subscriber, sink = subscribe(broadcaster, "a")
    broadcaster.publish([make_job(0)])
    assert sink.offers == 0
    assert len(await subscriber.next_batch(10)) == 1


async def test_what_the_sink_refuses_is_queued_and_later_pushes_queue_behind_it() -> None:
    broadcaster = Broadcaster()
    subscriber, sink = subscribe(broadcaster, "a")
    async with parked_consumer(subscriber) as received:
        sink.open = False  # the window is shut: the first push is refused, so queued
        broadcaster.publish([make_job(0)])
        sink.open = True
        # The consumer is woken but has not run: these must queue behind "0", not overtake it.
        broadcaster.publish([make_job(1)])
        broadcaster.publish([make_job(2)])
    assert sink.offers == 1
    assert sink.taken == []
    assert received == [signal_of(0), signal_of(1), signal_of(2)]


async def test_a_failing_sink_costs_only_its_own_subscriber_the_fast_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broadcaster = Broadcaster()
    broken, _ = subscribe(broadcaster, "broken")

    def explode(entry: QueueEntry) -> bool:
        raise RuntimeError("bug in a sink")

    broken.deliver_directly(explode)
    healthy, sink = subscribe(broadcaster, "healthy")
    async with trio.open_nursery() as nursery:
        got: list[bytes] = []

        async def consume(subscriber: Subscriber) -> None:
            got.extend(await subscriber.next_batch(10))

        nursery.start_soon(consume, broken)
        nursery.start_soon(consume, healthy)
        await trio.testing.wait_all_tasks_blocked()
        broadcaster.publish([make_job(0)])
        # The healthy one took it directly (and its consume task still waits).
        assert len(sink.taken) == 1
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert len(got) == 1  # the broken subscriber received it through its queue
    assert broadcaster.stats.events_dropped == {}
    assert "direct delivery failed" in caplog.text


async def test_an_ended_subscriber_offers_nothing_more() -> None:
    broadcaster = Broadcaster()
    subscriber, sink = subscribe(broadcaster, "a")
    async with trio.open_nursery() as nursery:

        async def consume() -> None:
            with trio.CancelScope() as scope:
                subscriber.attach(scope)
                await subscriber.next_batch(10)

        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        subscriber.end(EndReason.REPLACED)
        broadcaster.publish([make_job(0)])
    assert sink.offers == 0


async def test_a_burst_sends_only_its_first_event_from_publish() -> None:
    """A relist step's many events: the rest queue behind the first, for the
    subscriber's task to send as one batch."""
    broadcaster = Broadcaster()
    subscriber, sink = subscribe(broadcaster, "a")
    async with parked_consumer(subscriber) as received:
        broadcaster.publish([make_job(index) for index in range(4)])
    assert sink.taken == [signal_of(0)]
    assert received == [signal_of(1), signal_of(2), signal_of(3)]
