"""Fan-out in slices (fanout/pacing.py): a slice per loop turn, whole groups,
publish order kept, a bounded backlog, and nothing lost when the task stops."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from jobsignal.fanout import Broadcaster, StreamKind, Subscriber
from jobsignal.fanout.pacing import FanOutPacer
from jobsignal.fanout.stats import FanoutStats
from jobsignal.fanout.subscriber import QueueEntry
from tests.support.factories import make_job


def subscriber(name: str) -> Subscriber:
    return Subscriber(
        StreamKind.SIGNAL,
        "CCAgent",
        name,
        max_pending=1024,
        max_pending_bytes=2**20,
        stats=FanoutStats(),
    )


def groups_of(count: int, size: int) -> list[tuple[Subscriber, ...]]:
    return [tuple(subscriber(f"{g}-{i}") for i in range(size)) for g in range(count)]


def entry(name: str, job: str | None = None) -> QueueEntry:
    """A message `name` about job `job` (its own job unless named)."""
    return (job or name, name.encode(), None)


def received(group: tuple[Subscriber, ...]) -> list[int]:
    return [member.pending for member in group]


class Failing(Subscriber):
    def push_entry(self, entry: QueueEntry, *, direct: bool = True) -> None:
        raise RuntimeError("a bug in one delivery")


async def test_without_its_task_everything_goes_out_at_once() -> None:
    pacer = FanOutPacer(FanoutStats(), max_pending=8, slice_deliveries=10)
    groups = groups_of(10, 5)
    pacer.deliver(entry("a"), groups, direct=True)
    assert all(received(group) == [1] * 5 for group in groups)
    assert pacer.pending_events == 0


class RecordingPacer(FanOutPacer):
    """Notes how many of `groups` have the event after each slice, and in which loop turn."""

    def __init__(self, groups: list[tuple[Subscriber, ...]], **kwargs: int) -> None:
        super().__init__(FanoutStats(), **kwargs)
        self.groups = groups
        self.served: list[tuple[int, int]] = []
        self.queued: list[list[int]] = []  # after each slice: every subscriber's queue length
        self.turns = 0

    def _slice(self) -> None:
        super()._slice()
        complete = sum(1 for group in self.groups if received(group) == [1] * len(group))
        self.served.append((complete, self.turns))
        self.queued.append([member.pending for group in self.groups for member in group])


async def test_one_slice_per_turn_in_whole_groups() -> None:
    groups = groups_of(9, 4)  # a slice: three groups (12 subscribers, never part of one)
    pacer = RecordingPacer(groups, max_pending=8, slice_deliveries=10)
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        pacer.deliver(entry("a"), groups, direct=True)
        assert all(received(group) in ([1] * 4, [0] * 4) for group in groups)
        while pacer.pending_events:
            await trio.lowlevel.checkpoint()
            pacer.turns += 1
        nursery.cancel_scope.cancel()
    assert [complete for complete, _ in pacer.served] == [3, 6, 9]
    turns = [turn for _, turn in pacer.served]
    assert turns[0] == 0  # the first slice in the publish itself
    assert turns[1] >= 1  # the next ones in later turns (never two in the one task step)


async def test_a_later_event_waits_behind_an_earlier_one() -> None:
    pacer = FanOutPacer(FanoutStats(), max_pending=8, slice_deliveries=4)
    groups = groups_of(6, 2)
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        pacer.deliver(entry("a"), groups, direct=True)
        pacer.deliver(entry("b"), groups, direct=False)
        # The second event is not sent with the first one's first slice.
        assert [member.pending for group in groups for member in group] == [1] * 4 + [0] * 8
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    for group in groups:
        for member in group:
            assert member.take(10)[0] == [b"a", b"b"]


async def test_a_waiting_event_replaces_an_older_waiting_one_of_its_job() -> None:
    stats = FanoutStats()
    pacer = FanOutPacer(stats, max_pending=8, slice_deliveries=1)
    groups = groups_of(3, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        pacer.deliver(entry("a1", "a"), groups, direct=True)  # under way: kept
        pacer.deliver(entry("a2", "a"), groups, direct=True)  # waits
        pacer.deliver(entry("b1", "b"), groups, direct=True)
        pacer.deliver(entry("a3", "a"), groups, direct=True)  # replaces a2, reached by nobody
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert [member.take(10)[0] for (member,) in groups] == [[b"a1", b"b1", b"a3"]] * 3
    assert stats.coalesced == 3


async def test_events_that_reached_the_same_subscribers_go_out_together() -> None:
    groups = groups_of(4, 1)
    pacer = RecordingPacer(groups, max_pending=8, slice_deliveries=2)  # two deliveries a turn
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        pacer.deliver(entry("x"), groups, direct=True)  # to the first two now
        pacer.deliver(entry("y"), groups, direct=True)
        pacer.deliver(entry("z"), groups, direct=True)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    # x reached the last two; then y and z together, one subscriber per turn.
    assert pacer.queued == [
        [1, 1, 0, 0],
        [1, 1, 1, 1],
        [3, 1, 1, 1],
        [3, 3, 1, 1],
        [3, 3, 3, 1],
        [3, 3, 3, 3],
    ]
    assert [member.take(10)[0] for (member,) in groups] == [[b"x", b"y", b"z"]] * 4


async def test_the_oldest_event_goes_out_at_once_past_the_bound() -> None:
    pacer = FanOutPacer(FanoutStats(), max_pending=2, slice_deliveries=1)
    groups = groups_of(3, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        for name in "abc":
            pacer.deliver(entry(name), groups, direct=True)
        assert pacer.pending_events == 2
        # "a" reached everyone (its first slice now, the rest past the bound); "b" and "c" wait.
        assert [member.take(10)[0] for (member,) in groups] == [[b"a"], [b"a"], [b"a"]]
        nursery.cancel_scope.cancel()


async def test_what_is_pending_when_the_task_stops_goes_out() -> None:
    pacer = FanOutPacer(FanoutStats(), max_pending=8, slice_deliveries=1)
    groups = groups_of(5, 1)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(pacer.run)
            pacer.deliver(entry("a"), groups, direct=True)
            assert sum(member.pending for (member,) in groups) == 1
            scope.cancel()
    assert [member.pending for (member,) in groups] == [1] * 5
    assert pacer.pending_events == 0


async def test_a_failing_delivery_costs_only_its_slice() -> None:
    stats = FanoutStats()
    pacer = FanOutPacer(stats, max_pending=8, slice_deliveries=1)
    broken = Failing(
        StreamKind.SIGNAL, "CCAgent", "x", max_pending=8, max_pending_bytes=2**20, stats=stats
    )
    groups = [(broken,), *groups_of(3, 1)]
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        pacer.deliver(entry("a"), groups, direct=True)
        pacer.deliver(entry("b"), groups, direct=True)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert stats.events_dropped["fan_out"] == 2
    assert [member.take(10)[0] for (member,) in groups[1:]] == [[b"a", b"b"]] * 3


@pytest.mark.parametrize("running", [False, True])
async def test_the_broadcaster_serves_a_connection_s_subscribers_together(running: bool) -> None:
    broadcaster = Broadcaster()
    broadcaster.pacer.slice_deliveries = 3
    connections = [object() for _ in range(4)]
    subscribers = [
        broadcaster.subscribe(
            StreamKind.SIGNAL, "CCAgent", f"c{i}", snapshot=False, group=connections[i % 4]
        )
        for i in range(12)
    ]
    async with trio.open_nursery() as nursery:
        if running:
            await nursery.start(broadcaster.pacer.run)
        broadcaster.publish([make_job(1)])
        by_connection = [
            {subscribers[i].pending for i in range(c, 12, 4)} for c in range(len(connections))
        ]
        # Each connection's three subscribers have the event or none has it yet.
        assert all(len(seen) == 1 for seen in by_connection)
        assert sum(seen == {1} for seen in by_connection) == (1 if running else 4)
        await trio.testing.wait_all_tasks_blocked()
        assert all(member.pending == 1 for member in subscribers)
        nursery.cancel_scope.cancel()
