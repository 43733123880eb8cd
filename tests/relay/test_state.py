"""RelayedJobs (jobsignal/relay/state.py): upstream signals in, exactly the job events out."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from jobsignal.fanout.encoding import encode_signal
from jobsignal.relay.state import MAX_UUID_CHARS, RelayedJobs, Resync
from jobsignal.store.jobs import Changes
from jobsignal.store.model import JobSummary, event_id
from tests.support.factories import make_job


def signal(job: JobSummary, uuid: str | None = None) -> bytes:
    """The upstream's message for `job`: its uuid the one a jobsignal upstream gives."""
    return encode_signal(job, event_id(job) if uuid is None else uuid)


def seen(changes: Changes) -> list[tuple[str, str, str, str]]:
    return [(j.job_id, j.job_status, j.operator, event_id(j)) for j in changes.events]


def resync(jobs: RelayedJobs, states: list[JobSummary], now: float = 1_800_000_000) -> Changes:
    """A whole snapshot of `states`, applied in one go."""
    taking = jobs.resync(len(states))
    for state in states:
        assert not taking.complete
        assert taking.add(signal(state)).rejected == []
    assert taking.complete
    changes, done = taking.commit(now)
    assert done
    return changes


def test_live_signals_become_events_with_the_upstreams_uuids() -> None:
    jobs = RelayedJobs()
    pending, running = make_job(1, status="pending"), make_job(1)
    first = jobs.apply(signal(pending, "11111111-1111-4111-8111-111111111111"))
    second = jobs.apply(signal(running, "22222222-2222-4222-8222-222222222222"))
    assert [event_id(job) for job in first.events + second.events] == [
        "11111111-1111-4111-8111-111111111111",
        "22222222-2222-4222-8222-222222222222",
    ]
    assert first.events == [pending] and second.events == [running]
    assert jobs.live_jobs() == [running] and jobs.live_job_count() == 1
    assert jobs.live_jobs()[0].npu_count == 8  # counted from the rank table, for batching


def test_the_same_state_again_is_no_event_even_under_another_uuid() -> None:
    jobs = RelayedJobs()
    job = make_job(1)
    assert seen(jobs.apply(signal(job, "a")))
    assert jobs.apply(signal(job, "a")).events == []
    assert jobs.apply(signal(job, "b")).events == []
    (kept,) = jobs.live_jobs()
    assert kept.event_uuid == "a"  # what the subscribers saw stays what snapshots carry


def test_a_delete_ends_the_job_and_one_of_an_unknown_job_says_nothing() -> None:
    jobs = RelayedJobs()
    jobs.apply(signal(make_job(1)))
    deleted = make_job(1, operator="delete")
    assert jobs.apply(signal(deleted)).events == [deleted]
    assert jobs.live_job_count() == 0
    assert jobs.apply(signal(deleted)).events == []  # repeated: nothing twice
    assert jobs.apply(signal(make_job(2, operator="delete"))).events == []


def test_a_signal_without_a_uuid_gets_the_id_derived_from_its_state() -> None:
    jobs = RelayedJobs()
    job = make_job(1)
    (event,) = jobs.apply(signal(job, "")).events
    assert event_id(event) == event_id(job) != ""


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"job_id": ""}, "no_job_id"),
        ({"job_id": "x" * 129}, "too_long"),
        ({"namespace": "n" * 64}, "too_long"),
        ({"hccl_json": '{"server_list":[{"device":[]}],"x":NaN}'}, "hccl_json_not_strict"),
        ({"hccl_json": '{"server_list":[{"device":[]}],"x":"\\udc80"}'}, "hccl_json_not_strict"),
        ({"hccl_json": "[1, 2]"}, "bad_hccl_json"),
        ({"hccl_json": "{"}, "bad_hccl_json"),
        ({"total": "1e3"}, "bad_index"),
        ({"total": "0"}, "bad_index"),
    ],
)
def test_a_signal_failing_the_stores_checks_is_rejected_and_the_job_kept(
    change: dict[str, Any], reason: str
) -> None:
    jobs = RelayedJobs()
    good = make_job(1)
    jobs.apply(signal(good))
    bad = dataclasses.replace(make_job(1, status="failed"), **change)
    changes = jobs.apply(signal(bad))
    assert changes.events == []
    assert [problem.reason for problem in changes.rejected] == [reason]
    assert jobs.rejected_total == {reason: 1}
    assert jobs.live_jobs() == [good]


def test_undecodable_signals_and_overlong_uuids_are_rejected() -> None:
    jobs = RelayedJobs()
    assert [p.reason for p in jobs.apply(b"\x0a\x09abc").rejected] == ["bad_protobuf"]
    assert [p.reason for p in jobs.apply(b"\x22\x02\xed\xb2").rejected] == ["not_utf8"]
    long_uuid = signal(make_job(1), "u" * (MAX_UUID_CHARS + 1))
    assert [p.reason for p in jobs.apply(long_uuid).rejected] == ["bad_uuid"]
    assert jobs.live_job_count() == 0


def test_a_blank_rank_table_is_no_table() -> None:
    jobs = RelayedJobs()
    (event,) = jobs.apply(signal(make_job(1, hccl_json="  \n"))).events
    assert event.hccl_json == "" and event.npu_count == 0


# -- the snapshot after a reconnect ----------------------------------------------------------


def test_a_resync_emits_exactly_the_differences() -> None:
    jobs = RelayedJobs()
    steady, changes, ends = make_job(1), make_job(2, status="pending"), make_job(3)
    resync(jobs, [steady, changes, ends])
    born, changed = make_job(4, status="pending"), make_job(2)
    events = resync(jobs, [steady, changed, born], now=1_800_000_123)
    vanished = ends.as_deleted("1800000123")
    assert events.events == [changed, born, vanished]
    assert events.events[2].delete_time == "1800000123"
    assert event_id(events.events[2]) == event_id(vanished)  # a new event: its own id
    assert {job.job_id for job in jobs.live_jobs()} == {"uid-0001", "uid-0002", "uid-0004"}
    assert resync(jobs, [steady, changed, born]).events == []  # nothing twice


def test_a_resync_keeps_an_unchanged_jobs_uuid_and_its_rank_table() -> None:
    """A List snapshot carries a job over its batch size without HcclJson (and
    ClusterD may give a snapshot fresh uuids): neither is a change."""
    jobs = RelayedJobs()
    big = make_job(1, npus=64)
    jobs.apply(signal(big, "first"))
    taking = jobs.resync(1)
    taking.add(signal(dataclasses.replace(big, hccl_json=""), "second"))
    assert taking.commit(0.0) == (Changes(), True)
    (kept,) = jobs.live_jobs()
    assert (kept.hccl_json, kept.event_uuid) == (big.hccl_json, "first")


def test_a_rejected_signal_in_a_snapshot_keeps_its_jobs_last_state() -> None:
    jobs = RelayedJobs()
    job = make_job(1)
    resync(jobs, [job, make_job(2)])
    taking = jobs.resync(2)
    taking.add(signal(dataclasses.replace(job, hccl_json="{NaN")))
    taking.add(signal(make_job(2)))
    changes, _ = taking.commit(0.0)
    assert changes.events == []
    assert jobs.live_job_count() == 2


def test_a_snapshot_lost_half_way_changes_nothing() -> None:
    jobs = RelayedJobs()
    resync(jobs, [make_job(1), make_job(2)])
    before = jobs.live_jobs()
    taking: Resync = jobs.resync(3)
    taking.add(signal(make_job(5)))
    del taking  # the connection broke before the last batch
    assert jobs.live_jobs() == before


def test_a_resync_commits_in_steps() -> None:
    jobs = RelayedJobs()
    taking = jobs.resync(5)
    for index in range(5):
        taking.add(signal(make_job(index)))
    sizes = []
    done = False
    while not done:
        changes, done = taking.commit(0.0, budget=2)
        sizes.append(len(changes.events))
    assert sizes == [2, 2, 1]
    assert jobs.live_job_count() == 5


def test_an_empty_snapshot_is_complete_at_once_and_ends_every_job() -> None:
    jobs = RelayedJobs()
    resync(jobs, [make_job(1)])
    taking = jobs.resync(0)
    assert taking.complete
    changes, done = taking.commit(7.0)
    assert done and [(j.operator, j.delete_time) for j in changes.events] == [("delete", "7")]
