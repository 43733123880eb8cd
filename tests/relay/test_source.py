"""The relay source's rules in virtual time: snapshot then live, backoff, the grace period.

The upstream here is a fake `OpenStream` (no sockets), so trio's MockClock
(`autojump_clock`) runs every delay: backoff between attempts, the grace
before health turns NOT_SERVING, and its end when a snapshot is applied.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from jobsignal.fanout.encoding import encode_signal, encode_signal_list
from jobsignal.kube.watcher import Watcher
from jobsignal.relay.settings import RelaySettings
from jobsignal.relay.source import ListStream, Relay
from jobsignal.relay.state import MAX_JOBS, RelayedJobs
from jobsignal.relay.upstream import UpstreamError
from jobsignal.source import JobSource
from jobsignal.status import SourceStatus
from jobsignal.store.model import JobSummary, event_id
from tests.support.factories import make_job

GRACE = 30.0
NOW = 1_800_000_000.0

Item = bytes | UpstreamError


def batch(jobs: Sequence[JobSummary], total: int | None = None) -> bytes:
    signals = [encode_signal(job, event_id(job)) for job in jobs]
    return encode_signal_list(signals, 1, len(jobs) if total is None else total)


class _Stream:
    def __init__(self, receive: trio.MemoryReceiveChannel[Item]) -> None:
        self._receive = receive

    async def receive(self) -> bytes:
        item = await self._receive.receive()
        if isinstance(item, UpstreamError):
            raise item
        return item


@dataclass
class FakeUpstream:
    """Each subscription takes what the test sends it; `down` makes attempts fail."""

    down: bool = False
    attempts: list[float] = field(default_factory=list)
    stream: trio.MemorySendChannel[Item] | None = None

    @asynccontextmanager
    async def open_stream(self) -> AsyncIterator[ListStream]:
        self.attempts.append(trio.current_time())
        if self.down:
            raise UpstreamError("unreachable", "connection refused")
        send, receive = trio.open_memory_channel[Item](100)
        self.stream = send
        yield _Stream(receive)

    async def send(self, *items: Item) -> None:
        assert self.stream is not None
        for item in items:
            await self.stream.send(item)

    async def lose(self) -> None:
        await self.send(UpstreamError("lost", "connection reset"))


@dataclass
class Running:
    relay: Relay
    jobs: RelayedJobs
    status: SourceStatus
    upstream: FakeUpstream
    published: list[JobSummary]


@asynccontextmanager
async def running_relay(*, down: bool = False) -> AsyncIterator[Running]:
    """A relay of a fake upstream; `down`: unreachable from the first attempt."""
    jobs, status, upstream = RelayedJobs(), SourceStatus(), FakeUpstream(down=down)
    published: list[JobSummary] = []

    def publish(events: Sequence[JobSummary], seen_at: float) -> None:
        published.extend(events)

    settings = RelaySettings(upstream=("127.0.0.1", 1), grace=GRACE)
    relay = Relay(
        upstream.open_stream,
        jobs,
        publish,
        status,
        settings,
        wall_clock=lambda: NOW,
        rng=lambda: 1.0,  # every backoff at its ceiling
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(relay.run)
        yield Running(relay, jobs, status, upstream, published)
        nursery.cancel_scope.cancel()


async def settle() -> None:
    """Let the relay take in what was sent (virtual time: no real wait)."""
    await trio.sleep(0.001)


async def test_the_snapshot_then_live_changes(autojump_clock: trio.testing.MockClock) -> None:
    one, two = make_job(1, status="pending"), make_job(2)
    async with running_relay() as run:
        await settle()
        await run.upstream.send(batch([one], total=2))
        await settle()
        assert not run.status.ready.is_set()  # half the snapshot: not ready yet
        assert run.published == []
        await run.upstream.send(batch([two], total=2))
        await settle()
        assert run.status.ready.is_set() and run.status.in_sync
        assert run.status.lists_applied == 1
        assert run.published == [one, two]
        running = make_job(1)
        await run.upstream.send(batch([running], total=2))
        await settle()
        assert run.published == [one, two, running]
        assert run.relay.counters.snapshots == 1
        assert run.relay.counters.messages == 3


async def test_backoff_doubles_to_its_ceiling_and_resets_after_a_snapshot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_relay(down=True) as run:
        await trio.sleep(120)
        gaps = [b - a for a, b in itertools.pairwise(run.upstream.attempts)]
        assert gaps[:7] == pytest.approx([0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0])
        assert run.relay.counters.upstream_errors["unreachable"] == len(run.upstream.attempts)
        run.upstream.down = False
        await trio.sleep(30)
        await run.upstream.send(batch([]))
        await settle()
        assert run.status.ready.is_set()
        lost_at = trio.current_time()
        await run.upstream.lose()
        await trio.sleep(1)
        assert run.upstream.attempts[-1] - lost_at == pytest.approx(0.8, abs=0.01)


async def test_health_turns_not_serving_only_once_the_grace_has_passed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    job = make_job(1)
    async with running_relay() as run:
        await settle()
        await run.upstream.send(batch([job]))
        await settle()
        assert run.status.in_sync
        run.upstream.down = True
        lost_at = trio.current_time()
        await run.upstream.lose()
        await trio.sleep_until(lost_at + GRACE - 0.01)
        assert run.status.in_sync  # the last state is served, health still SERVING
        await trio.sleep_until(lost_at + GRACE + 0.01)
        assert not run.status.in_sync
        assert "127.0.0.1:1" in run.status.problem
        assert run.jobs.live_jobs() == [job]  # still served
        run.upstream.down = False
        await trio.sleep(31)  # the next attempt (backoff at most 30 s)
        await run.upstream.send(batch([job]))
        await settle()
        assert run.status.in_sync and run.status.lists_applied == 2
        assert run.published == [job]  # the same state again: nothing twice


async def test_an_upstream_back_within_the_grace_never_turns_health_not_serving(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_relay() as run:
        await settle()
        await run.upstream.send(batch([make_job(1)]))
        await settle()
        changes = 0

        async def count_changes() -> None:
            nonlocal changes
            while True:
                await run.status.wait_changed()
                changes += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(count_changes)
            await run.upstream.lose()
            await trio.sleep(1)  # reconnected after 0.8 s
            await run.upstream.send(batch([make_job(1)]))
            await trio.sleep(GRACE * 2)
            nursery.cancel_scope.cancel()
        assert changes == 0 and run.status.in_sync


async def test_before_the_first_snapshot_the_server_is_not_ready(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_relay(down=True) as run:
        await trio.sleep(GRACE * 3)
        assert len(run.upstream.attempts) > 3
        assert not run.status.ready.is_set() and not run.status.in_sync


async def test_a_malformed_live_message_is_skipped_and_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_relay() as run:
        await settle()
        await run.upstream.send(batch([]), b"\x0a\x09abc", batch([make_job(1)]))
        await settle()
        assert [job.job_id for job in run.published] == ["uid-0001"]
        assert run.relay.counters.messages_rejected == {"bad_protobuf": 1}
        assert len(run.upstream.attempts) == 1  # the subscription went on


@pytest.mark.parametrize(
    ("first", "reason"),
    [
        (b"\x0a\x09abc", "protocol"),
        (encode_signal_list([], 1, MAX_JOBS + 1), "snapshot"),
    ],
    ids=["malformed-batch", "too-many-jobs"],
)
async def test_a_snapshot_that_cannot_be_counted_ends_the_connection(
    autojump_clock: trio.testing.MockClock, first: bytes, reason: str
) -> None:
    async with running_relay() as run:
        await settle()
        await run.upstream.send(first)
        await trio.sleep(1)
        assert run.relay.counters.upstream_errors == {reason: 1}
        assert len(run.upstream.attempts) == 2
        assert not run.status.ready.is_set()


async def test_a_snapshot_lost_half_way_is_taken_again_whole(
    autojump_clock: trio.testing.MockClock,
) -> None:
    one, two, three = make_job(1), make_job(2), make_job(3)
    async with running_relay() as run:
        await settle()
        await run.upstream.send(batch([one, two]))
        await settle()
        await run.upstream.lose()
        await trio.sleep(1)
        await run.upstream.send(batch([one], total=3))
        await run.upstream.lose()  # mid-snapshot
        await trio.sleep(2)
        assert run.published == [one, two]  # nothing from the lost half
        assert run.jobs.live_job_count() == 2
        await run.upstream.send(batch([two, three], total=2))
        await settle()
        assert run.published == [one, two, three, one.as_deleted(str(int(NOW)))]


def test_the_relay_and_the_watcher_are_job_sources() -> None:
    """What app.py wires into the store and fan-out: mypy checks that both classes
    fit the interface (jobsignal/source.py); the rest of the server sees only it."""
    sources: list[type[JobSource]] = [Relay, Watcher]
    assert [source.run.__name__ for source in sources] == ["run", "run"]
