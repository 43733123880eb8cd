"""Owed snapshots (fanout/snapshot.py, docs/architecture.md section 6): the jobs
fixed when a consumer subscribes, composed by its own task in slices, with
what was published meanwhile queued behind them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from jobsignal._proto.job import JobSummarySignal, JobSummarySignalList
from jobsignal.events import JobEvents
from jobsignal.fanout import Broadcaster, EndReason, StreamKind, snapshot
from jobsignal.fanout.snapshot import SLICE_BYTES, SLICE_JOBS, OwedSnapshot
from jobsignal.store.model import event_id
from tests.support.factories import make_job

JOBS = 3 * SLICE_JOBS + 10


def published(count: int = JOBS) -> Broadcaster:
    """A broadcaster whose `count` jobs were published with nobody subscribed
    (so nothing is encoded yet)."""
    broadcaster = Broadcaster(wall_clock=lambda: 2.0)
    broadcaster.publish([make_job(i, hccl_json="{}") for i in range(count)])
    return broadcaster


class Slices:
    """Counts the checkpoints between a snapshot's slices (fanout/snapshot.py's
    seam), and runs `action` at checkpoint number `at`."""

    def __init__(self) -> None:
        self.count = 0
        self.action: Callable[[], object] | None = None
        self.at = 0

    def on(self, at: int, action: Callable[[], object]) -> None:
        self.at, self.action = at, action

    async def checkpoint(self) -> None:
        self.count += 1
        if self.count == self.at and self.action is not None:
            self.action()
        await trio.lowlevel.checkpoint()


@pytest.fixture
def slices(monkeypatch: pytest.MonkeyPatch) -> Slices:
    counter = Slices()
    monkeypatch.setattr(snapshot, "checkpoint", counter.checkpoint)
    return counter


async def test_slices_end_after_so_many_jobs_or_bytes(slices: Slices) -> None:
    small = OwedSnapshot(list(range(2 * SLICE_JOBS + 1)), lambda item: b"x")
    assert len(await small.made()) == 2 * SLICE_JOBS + 1
    assert slices.count == 2  # none after the last slice
    half = b"x" * (SLICE_BYTES // 2)
    large = OwedSnapshot(list(range(7)), lambda item: None if item == 1 else half)
    await large.made()
    assert slices.count == 2 + 2  # after items 0 to 2 (one left out) and 3 to 4


async def test_a_cancelled_composition_goes_on_where_it_stopped() -> None:
    made: list[int] = []
    scope = trio.CancelScope()

    def make(item: int) -> bytes | None:
        made.append(item)
        if item == SLICE_JOBS + 5:
            scope.cancel()  # taking effect at the end of the second slice
        return None if item % 7 == 0 else b"x" * item

    owed = OwedSnapshot(list(range(JOBS)), make)
    assert len(owed) == JOBS
    with scope:
        await owed.made()
    assert made == list(range(2 * SLICE_JOBS))
    results = await owed.made()
    assert made == list(range(JOBS))  # each item made once
    assert results == [b"x" * i for i in range(JOBS) if i % 7]
    assert await owed.made() is results


async def test_subscribing_encodes_nothing_and_the_snapshot_is_composed_in_slices(
    slices: Slices,
) -> None:
    broadcaster = published()
    lister = broadcaster.subscribe(StreamKind.LIST, "CCAgent", "l", snapshot=False)
    fd_agent = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "f", snapshot=True)
    assert all(entry.encoded is None for entry in broadcaster.latest())
    assert (lister.pending, fd_agent.pending) == (JOBS, JOBS)  # one per job until composed
    await lister.compose_snapshot()
    assert slices.count == JOBS // SLICE_JOBS + 1  # the slices, then the one batch
    assert not lister.owes_snapshot
    [batch] = await lister.next_batch(10)
    parsed = JobSummarySignalList.parse(batch)
    assert parsed.job_total_num == len(parsed.job_summary_signals) == JOBS
    # The FdAgent's snapshot reuses the encodings the List snapshot made.
    frames = await fd_agent.next_batch(JOBS + 1)
    assert frames == [entry.encoded for entry in broadcaster.latest()]


async def test_events_published_meanwhile_queue_behind_the_snapshot(slices: Slices) -> None:
    broadcaster = published()
    old = broadcaster.latest()[0].job
    fd_agent = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "f", snapshot=True)
    lister = broadcaster.subscribe(StreamKind.LIST, "CCAgent", "l", snapshot=False)
    newer = make_job(0, hccl_json="{}", job_status="failed")
    added = make_job(JOBS, hccl_json="{}")

    def publish_mid_way() -> None:
        assert fd_agent.owes_snapshot and lister.owes_snapshot
        broadcaster.publish([newer, added])

    slices.on(1, publish_mid_way)
    frames = await fd_agent.next_batch(JOBS + 10)
    batches = await lister.next_batch(10)
    signals = [JobSummarySignal.parse(frame) for frame in frames]
    # The state at subscribe time first (the old state of job 0 among it), then the live events.
    assert len(signals) == JOBS + 2
    assert (signals[0].job_status, signals[0].uuid) == (old.job_status, event_id(old))
    assert [(s.job_id, s.uuid) for s in signals[-2:]] == [
        (newer.job_id, event_id(newer)),
        (added.job_id, event_id(added)),
    ]
    snapshot, *live = (JobSummarySignalList.parse(batch) for batch in batches)
    assert snapshot.job_total_num == len(snapshot.job_summary_signals) == JOBS
    assert [message.job_total_num for message in live] == [1, 1]  # live: lists of one


async def test_an_empty_cluster_still_owes_a_list_subscriber_one_batch() -> None:
    broadcaster = Broadcaster(wall_clock=lambda: 2.0)
    lister = broadcaster.subscribe(StreamKind.LIST, "CCAgent", "l", snapshot=False)
    fd_agent = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "f", snapshot=True)
    assert (lister.pending, fd_agent.pending, fd_agent.owes_snapshot) == (1, 0, False)
    [batch] = await lister.next_batch(10)
    assert JobSummarySignalList.parse(batch) == JobSummarySignalList(report_time="2000")


async def test_a_consumer_ended_while_its_snapshot_is_composed_gets_nothing(
    slices: Slices,
) -> None:
    broadcaster = published()
    queue = broadcaster.subscribe_events(snapshot=True)
    slices.on(1, lambda: queue.end(EndReason.SHUTDOWN))
    assert await queue.next_batch_or_end(10) == []
    assert (queue.pending, queue.owes_snapshot) == (0, False)


async def test_a_reader_cancelled_mid_snapshot_reads_it_whole_afterwards(
    slices: Slices,
) -> None:
    broadcaster = published()
    events = JobEvents(broadcaster, snapshot=True)
    assert events.pending == JOBS
    with trio.CancelScope() as scope:
        slices.on(2, scope.cancel)
        await events.receive()
    assert scope.cancelled_caught
    received = [(await events.receive()).job.job_id for _ in range(JOBS)]
    assert received == [entry.job.job_id for entry in broadcaster.latest()]
    assert events.pending == 0
    assert slices.count == JOBS // SLICE_JOBS  # no slice made twice
