"""One owner of the latest job state (docs/architecture.md section 4, "Who owns the
job state"): a Broadcaster given an owner builds snapshots, counts and `latest()`
from it, and its encoding cache never serves a state the owner no longer holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import trio
import trio.lowlevel

from jobsignal._proto.job import JobSummarySignal, JobSummarySignalList
from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.fanout.broadcaster import LiveJobs, PublishedJobs
from jobsignal.sim.clusterd import JOB_LABELS
from jobsignal.sim.emulator import open_emulator
from jobsignal.store import JobKey, JobStore, JobSummary
from jobsignal.store.jobs import ADDED, DELETED, MODIFIED
from jobsignal.store.model import event_id
from tests.support.factories import clusterd_job, configmap, make_job
from tests.support.watching import open_watcher

NOW = 1_800_000_000.0


class Owner:
    """A hand-driven owner: states change here without any event being published."""

    def __init__(self) -> None:
        self.jobs: dict[JobKey, JobSummary] = {}

    def set(self, *jobs: JobSummary) -> None:
        for job in jobs:
            if job.is_deleted:
                self.jobs.pop(job.key, None)
            else:
                self.jobs[job.key] = job

    def live_items(self) -> Iterable[tuple[JobKey, JobSummary]]:
        return self.jobs.items()

    def live_job_count(self) -> int:
        return len(self.jobs)


def owned(owner: LiveJobs, **options: int) -> Broadcaster:
    return Broadcaster(jobs=owner, wall_clock=lambda: 2.0, **options)  # type: ignore[arg-type]


async def snapshot_signals(broadcaster: Broadcaster) -> list[JobSummarySignal]:
    return [
        signal
        for batch in await broadcaster.snapshot_batches()
        for signal in JobSummarySignalList.parse(batch).job_summary_signals
    ]


def test_the_store_and_the_fallback_record_both_own_state() -> None:
    store: LiveJobs = JobStore()  # (structurally: mypy checks the store fits the Protocol)
    assert store.live_job_count() == 0
    assert PublishedJobs().live_job_count() == 0


async def test_a_snapshot_reflects_the_store_not_what_was_published() -> None:
    store = JobStore()
    broadcaster = owned(store)
    job = clusterd_job("a")
    [(name, pending)] = job.configmaps("pending")
    broadcaster.publish(store.apply(ADDED, configmap("ns", name, pending), NOW).events)
    [(_, running)] = job.configmaps("running")
    # The store moves on; its event is lost on the way (as when a store step fails half-way).
    [event] = store.apply(MODIFIED, configmap("ns", name, running), NOW).events
    [signal] = await snapshot_signals(broadcaster)
    assert (signal.job_status, signal.uuid) == ("running", event_id(event))
    assert [e.job for e in broadcaster.latest()] == store.live_jobs()
    # And a job the store ended is gone from snapshots and counts at once.
    store.apply(DELETED, configmap("ns", name, running), NOW)
    assert await snapshot_signals(broadcaster) == []
    assert broadcaster.job_count() == 0
    assert broadcaster.latest() == []


async def test_the_encoding_cache_is_used_only_for_the_object_the_owner_holds() -> None:
    owner = Owner()
    broadcaster = owned(owner)
    old = make_job(1, hccl_json="{}")
    owner.set(old)
    broadcaster.publish([old])
    [published] = broadcaster.latest()
    first = await snapshot_signals(broadcaster)
    # Same object: the cached entry, uuid and bytes are reused.
    [again] = broadcaster.latest()
    assert again is published and again.encoded is not None
    assert await snapshot_signals(broadcaster) == first
    # An equal state in a new object is still encoded from that object.
    twin = dataclasses.replace(old)
    owner.set(twin)
    [entry] = broadcaster.latest()
    assert entry is not published and entry.job is twin
    # A new state the broadcaster never saw published: served from the owner.
    new = dataclasses.replace(old, job_status="failed")
    owner.set(new)
    [signal] = await snapshot_signals(broadcaster)
    assert (signal.job_status, signal.uuid) == ("failed", event_id(new))
    [entry] = broadcaster.latest()
    assert entry.job is new and entry.uuid == event_id(new)


async def test_a_signal_snapshot_shares_the_published_encoding() -> None:
    owner = Owner()
    broadcaster = owned(owner)
    live = broadcaster.subscribe(StreamKind.SIGNAL, "CCAgent", "live", snapshot=False)
    job = make_job(2, hccl_json="{}")
    owner.set(job)
    broadcaster.publish([job])
    [frame] = await live.next_batch(10)
    late = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "late", snapshot=True)
    [owed] = await late.next_batch(10)
    assert owed is frame  # encoded once, at publish


async def test_in_process_snapshots_read_the_owner_too() -> None:
    owner = Owner()
    broadcaster = owned(owner)
    jobs = [make_job(i, hccl_json="{}") for i in range(3)]
    owner.set(*jobs)
    queue = broadcaster.subscribe_events(snapshot=True)
    assert queue.pending == 3
    owner.set(dataclasses.replace(jobs[1], operator="delete"))
    assert broadcaster.subscribe_events(snapshot=True).pending == 2


async def test_live_list_messages_carry_one_job_as_clusterd_does() -> None:
    """ClusterD master sends each live change as a list of one with JobTotalNum 1,
    whatever the number of jobs; snapshots count the live jobs."""
    store = JobStore()
    broadcaster = owned(store)
    lister = broadcaster.subscribe(StreamKind.LIST, "CCAgent", "x", snapshot=False)
    await lister.next_batch(10)  # the empty snapshot
    objects = [
        configmap("ns", name, data)
        for name_ in ("a", "b", "c")
        for name, data in clusterd_job(name_).configmaps("running")
    ]
    broadcaster.publish(store.replace_all(objects, NOW).events, 0.0)
    broadcaster.publish(store.replace_all(objects[1:], NOW).events, 0.0)  # a's delete
    live = [JobSummarySignalList.parse(f) for f in await lister.next_batch(10)]
    assert [len(m.job_summary_signals) for m in live] == [1, 1, 1, 1]
    assert [m.job_total_num for m in live] == [1, 1, 1, 1]
    assert [m.job_summary_signals[0].operator for m in live] == ["add"] * 3 + ["delete"]
    later = broadcaster.subscribe(StreamKind.LIST, "CCAgent", "y", snapshot=False)
    (snapshot,) = [JobSummarySignalList.parse(f) for f in await later.next_batch(10)]
    assert snapshot.job_total_num == 2


async def test_a_broken_job_of_the_owner_is_dropped_once_until_its_next_state() -> None:
    owner = Owner()
    broadcaster = owned(owner)
    good = make_job(1, hccl_json="{}")
    broken = make_job(2, hccl_json="{}", job_name="bad\udc80")
    owner.set(good, broken)
    broadcaster.publish([good, broken])  # nobody subscribed: nothing encoded yet
    assert [s.job_id for s in await snapshot_signals(broadcaster)] == [good.job_id]
    assert broadcaster.stats.events_dropped == {"snapshot": 1}
    assert broadcaster.job_count() == 1
    # Not retried on the next snapshot, nor counted in JobTotalNum.
    [batch] = await broadcaster.snapshot_batches()
    assert JobSummarySignalList.parse(batch).job_total_num == 1
    assert broadcaster.stats.events_dropped == {"snapshot": 1}
    assert [e.job for e in broadcaster.latest()] == [good]
    # Its next state gets its own chance.
    fixed = dataclasses.replace(broken, job_name="fixed")
    owner.set(fixed)
    broadcaster.publish([fixed])
    assert [s.job_id for s in await snapshot_signals(broadcaster)] == [good.job_id, fixed.job_id]
    assert broadcaster.job_count() == 2


async def test_the_owner_forgetting_a_dropped_job_forgets_the_drop() -> None:
    owner = Owner()
    broadcaster = owned(owner)
    broken = make_job(2, hccl_json="{}", job_name="bad\udc80")
    owner.set(broken)
    broadcaster.publish([broken])
    assert await snapshot_signals(broadcaster) == []
    owner.set(dataclasses.replace(broken, operator="delete"))  # no event published
    [batch] = await broadcaster.snapshot_batches()
    assert JobSummarySignalList.parse(batch).job_total_num == 0
    assert broadcaster.job_count() == 0


async def test_snapshots_follow_the_owner_order() -> None:
    store = JobStore()
    broadcaster = owned(store)
    for name in ("c", "a", "b"):
        for cm_name, data in clusterd_job(name).configmaps("running"):
            broadcaster.publish(store.apply(ADDED, configmap("ns", cm_name, data), NOW).events)
    expected = [job.job_id for job in store.live_jobs()]
    assert expected == ["uid-c", "uid-a", "uid-b"]
    assert [s.job_id for s in await snapshot_signals(broadcaster)] == expected


async def test_the_watcher_publishes_every_store_change_before_a_checkpoint() -> None:
    """At every checkpoint during a big LIST the store's live jobs are exactly the
    published ones, so a subscriber arriving then gets no event its snapshot holds."""
    published = PublishedJobs()
    mismatches: list[tuple[int, int]] = []

    def record(jobs: Iterable[JobSummary]) -> None:
        for job in jobs:
            published.record(job.key, job)

    async with open_emulator() as emu:
        for index in range(300):
            for name, data in clusterd_job(f"j{index}").configmaps("running"):
                emu.state.create_configmap("ns", name, JOB_LABELS, data)
        async with open_watcher(emu, on_publish=record) as harness:

            async def observer() -> None:
                while not harness.status.ready.is_set():
                    store_view = dict(harness.store.live_items())
                    if store_view != dict(published.live_items()):
                        mismatches.append((len(store_view), published.live_job_count()))
                    await trio.lowlevel.checkpoint()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(observer)
                with trio.fail_after(30):
                    await harness.status.ready.wait()
    assert published.live_job_count() == 300
    assert mismatches == []
