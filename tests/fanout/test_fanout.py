"""Encoding once, coalescing queues, and snapshot batching."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import trio

from jobsignal._proto.job import JobSummarySignal, JobSummarySignalList
from jobsignal.fanout import Broadcaster, EndReason, StreamKind
from jobsignal.fanout import broadcaster as broadcaster_module
from jobsignal.fanout.encoding import encode_signal, encode_signal_list, signal_message
from jobsignal.fanout.subscriber import COALESCE_ABOVE, Subscriber
from jobsignal.store.model import JobSummary
from tests.support.factories import make_job
from tests.support.grpcio import expected_signal

#: Job events with a stub rank table: fan-out tests want small messages of known size.
small_job = functools.partial(make_job, hccl_json='{"status":"complete"}')


def test_composed_list_equals_generated_encoding() -> None:
    signals = [signal_message(small_job(job_id=str(i)), f"uuid-{i}") for i in range(3)]
    composed = encode_signal_list([bytes(s) for s in signals], 1_700_000_000_123, 300)
    expected = JobSummarySignalList(
        job_summary_signals=signals, report_time="1700000000123", job_total_num=300
    )
    assert composed == bytes(expected)
    parsed = JobSummarySignalList.parse(composed)
    assert [s.job_id for s in parsed.job_summary_signals] == ["0", "1", "2"]
    assert encode_signal_list([], 5, 0) == bytes(JobSummarySignalList(report_time="5"))


def test_every_field_is_mapped() -> None:
    job = make_job(1)  # every field distinct
    expected = expected_signal(job, "u-1")
    expected["hcclJson"] = expected.pop("HcclJson")  # to_dict's spelling
    del expected["deleteTime"]  # empty: to_dict leaves out default values
    assert JobSummarySignal.parse(encode_signal(job, "u-1")).to_dict() == expected


async def test_one_encoding_per_event_shared_by_all_subscribers() -> None:
    broadcaster = Broadcaster()
    subs = [
        broadcaster.subscribe(StreamKind.SIGNAL, "CCAgent", str(i), snapshot=False)
        for i in range(3)
    ]
    broadcaster.publish([small_job(job_id="a")])
    frames = [(await s.next_batch(10))[0] for s in subs]
    assert frames[0] is frames[1] is frames[2]


@pytest.mark.parametrize(
    ("extra", "encodings", "stripped"),
    [
        (-200, [False], False),  # fits with room to spare
        (-40, [False, True], True),  # fits alone, not with the signal's other fields
        (1, [True], True),  # more characters than the limit: not encoded whole at all
    ],
)
def test_a_signal_over_the_send_limit_goes_without_its_rank_table(
    monkeypatch: pytest.MonkeyPatch, extra: int, encodings: list[bool], stripped: bool
) -> None:
    limit = 4096
    table = "x" * (limit - 64 + extra)
    made: list[bool] = []

    def recording_encode(job: JobSummary, uuid: str, *, strip_rank_table: bool = False) -> bytes:
        made.append(strip_rank_table)
        return encode_signal(job, uuid, strip_rank_table=strip_rank_table)

    monkeypatch.setattr(broadcaster_module, "encode_signal", recording_encode)
    broadcaster = Broadcaster(max_message_bytes=limit)
    signal = broadcaster._encode(small_job(hccl_json=table), "u-1")
    assert made == encodings
    assert broadcaster.stats.rank_tables_stripped == int(stripped)
    assert JobSummarySignal.parse(signal).hccl_json == ("" if stripped else table)
    assert len(signal) <= limit - 64


async def test_slow_subscriber_is_coalesced_then_ended() -> None:
    broadcaster = Broadcaster(max_pending=4)
    slow = broadcaster.subscribe(StreamKind.SIGNAL, "CCAgent", "slow", snapshot=False)
    # Many changes of two jobs: coalescing keeps the newest state of each.
    for status in ["pending", "running", "complete", "failed"] * 3:
        broadcaster.publish(
            [small_job(job_id="a", status=status), small_job(job_id="b", status=status)]
        )
    assert slow.end_reason is None
    assert slow.pending <= 4 and slow.coalesced > 0
    latest = [JobSummarySignal.parse(f) for f in await slow.next_batch(10)]
    newest = {s.job_id: s.job_status for s in latest}
    assert newest == {"a": "failed", "b": "failed"}
    # More distinct jobs than the queue holds: the subscriber is ended and its queue freed.
    broadcaster.publish([small_job(job_id=str(i)) for i in range(6)])
    assert slow.end_reason is EndReason.SLOW
    assert slow.pending == 0 and slow.pending_bytes == 0


async def test_a_backlog_past_the_soft_bound_is_coalesced_long_before_the_limit() -> None:
    """A consumer a little behind gets its jobs' newest states next: past
    COALESCE_ABOVE live entries the queue keeps only the newest of each job,
    far below --max-pending-messages."""
    broadcaster = Broadcaster(max_pending=1024)
    sub = broadcaster.subscribe(StreamKind.SIGNAL, "CCAgent", "x", snapshot=False)
    for i in range(COALESCE_ABOVE):
        broadcaster.publish([small_job(job_id=str(i % 3), status=f"s{i}")])
    assert sub.pending == COALESCE_ABOVE and sub.coalesced == 0  # at the bound: kept
    broadcaster.publish([small_job(job_id="0", status="newest")])
    assert sub.pending == 3 and sub.coalesced == COALESCE_ABOVE + 1 - 3
    newest = {s.job_id: s.job_status for s in map(JobSummarySignal.parse, sub.take(10)[0])}
    assert newest == {"0": "newest", "1": f"s{COALESCE_ABOVE - 3}", "2": f"s{COALESCE_ABOVE - 2}"}
    assert sub.end_reason is None


async def test_a_backlog_of_distinct_jobs_is_scanned_only_when_it_doubles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing to coalesce (every entry a different job): the soft bound moves
    to twice the backlog, so pushes stay O(1) amortized; once the queue is
    drained it is back at COALESCE_ABOVE."""
    broadcaster = Broadcaster(max_pending=100_000)
    sub = broadcaster.subscribe(StreamKind.SIGNAL, "CCAgent", "x", snapshot=False)
    scans: list[int] = []
    coalesce = Subscriber._coalesce

    def counted(queue: Subscriber) -> None:
        scans.append(queue.pending)
        coalesce(queue)

    monkeypatch.setattr(Subscriber, "_coalesce", counted)
    for i in range(4_000):
        broadcaster.publish([small_job(job_id=str(i))])
    assert sub.pending == 4_000 and sub.coalesced == 0
    assert scans == [65, 131, 263, 527, 1055, 2111]  # each at twice the last, plus one
    while sub.pending:
        sub.take(1_000)
    for i in range(COALESCE_ABOVE + 1):
        broadcaster.publish([small_job(job_id="same", status=str(i))])
    assert len(scans) == 7 and scans[-1] == COALESCE_ABOVE + 1
    assert len(sub.take(10)[0]) == 1  # the newest of the one job


async def test_byte_limit_ends_a_subscriber() -> None:
    broadcaster = Broadcaster(max_pending=100, max_pending_bytes=1000)
    sub = broadcaster.subscribe(StreamKind.SIGNAL, "CCAgent", "x", snapshot=False)
    big = dataclasses.replace(small_job(job_id="a"), hccl_json="x" * 600)
    broadcaster.publish([big, dataclasses.replace(big, job_id="b")])
    assert sub.end_reason is EndReason.SLOW


async def test_signal_snapshot_only_when_asked() -> None:
    broadcaster = Broadcaster()
    deleted = small_job(job_id="c", operator="delete")
    broadcaster.publish([small_job(job_id="a"), small_job(job_id="b"), deleted])
    with_snapshot = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "1", snapshot=True)
    without = broadcaster.subscribe(StreamKind.SIGNAL, "CCAgent", "2", snapshot=False)
    assert [JobSummarySignal.parse(f).job_id for f in await with_snapshot.next_batch(10)] == [
        "a",
        "b",
    ]
    assert without.pending == 0


@pytest.mark.parametrize("kind", [StreamKind.SIGNAL, StreamKind.LIST])
async def test_a_snapshot_larger_than_the_queue_limits_is_owed_not_a_backlog(
    kind: StreamKind,
) -> None:
    broadcaster = Broadcaster(max_pending=4, max_pending_bytes=2000, batch_npus=8)
    jobs = [dataclasses.replace(small_job(job_id=str(i)), hccl_json="x" * 300) for i in range(10)]
    broadcaster.publish(jobs)
    sub = broadcaster.subscribe(kind, "FdAgent", "1", snapshot=True)
    # Ten messages and 3,000+ bytes queued: over both limits, and not slow.
    assert sub.end_reason is None and sub.pending == 10
    # A live change of a job the snapshot holds replaces its queued state.
    broadcaster.publish([small_job(job_id="3", status="complete")])
    assert sub.end_reason is None
    delivered: list[bytes] = []
    while sub.pending:
        delivered += await sub.next_batch(3)
    assert len(delivered) >= 10
    # Once the snapshot is delivered the usual limits hold again.
    broadcaster.publish([small_job(job_id=f"new-{i}") for i in range(5)])
    assert sub.end_reason is EndReason.SLOW


async def test_a_live_backlog_on_top_of_a_snapshot_is_still_bounded() -> None:
    broadcaster = Broadcaster(max_pending=4)
    broadcaster.publish([small_job(job_id=str(i)) for i in range(10)])
    sub = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "1", snapshot=True)
    broadcaster.publish([small_job(job_id=f"new-{i}") for i in range(4)])
    assert sub.end_reason is None
    broadcaster.publish([small_job(job_id="new-4")])
    assert sub.end_reason is EndReason.SLOW


@pytest.mark.parametrize(
    ("npus", "expected_batches"),
    [
        ([10_000] * 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ([30_000, 50_000, 5_000, 20_000], [[0], [1], [2, 3]]),
        ([40_000, 1], [[0], [1]]),
    ],
)
async def test_list_snapshot_batches_by_npus(
    npus: list[int], expected_batches: list[list[int]]
) -> None:
    broadcaster = Broadcaster(wall_clock=lambda: 1234.5)
    broadcaster.publish([small_job(job_id=str(i), npus=n) for i, n in enumerate(npus)])
    sub = broadcaster.subscribe(StreamKind.LIST, "CCAgent", "x", snapshot=False)
    batches = [JobSummarySignalList.parse(f) for f in await sub.next_batch(100)]
    assert [[int(s.job_id) for s in b.job_summary_signals] for b in batches] == expected_batches
    assert {b.report_time for b in batches} == {"1234500"}
    assert {b.job_total_num for b in batches} == {len(npus)}
    for batch in batches:
        for signal in batch.job_summary_signals:
            huge = npus[int(signal.job_id)] > 40_000
            assert (signal.hccl_json == "") == huge


async def test_live_changes_arrive_as_lists_of_one() -> None:
    broadcaster = Broadcaster(wall_clock=lambda: 2.0)
    sub = broadcaster.subscribe(StreamKind.LIST, "CCAgent", "x", snapshot=False)
    [empty] = [JobSummarySignalList.parse(f) for f in await sub.next_batch(10)]
    assert empty.job_total_num == 0 and empty.job_summary_signals == []
    broadcaster.publish([small_job(job_id="a"), small_job(job_id="b")])
    lists = [JobSummarySignalList.parse(f) for f in await sub.next_batch(10)]
    assert [len(x.job_summary_signals) for x in lists] == [1, 1]
    assert [x.job_total_num for x in lists] == [1, 1]


async def test_end_cancels_the_attached_scope() -> None:
    broadcaster = Broadcaster()
    sub = broadcaster.subscribe(StreamKind.SIGNAL, "CCAgent", "x", snapshot=False)
    with trio.CancelScope() as scope:
        sub.attach(scope)
        sub.end(EndReason.REPLACED)
        await trio.sleep_forever()
    assert scope.cancelled_caught and sub.end_reason is EndReason.REPLACED
