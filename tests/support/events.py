"""What a client saw: the job events it received, and checks that they replay the cluster.

An `Event` is one JobSummarySignal as received (uuid, cmIndex and the job
state), decoded from betterproto2 (a Broadcaster's frames) or from grpcio.
`assert_no_duplicates` and `assert_replays` check a client's events against
the history a `Cluster` (tests/support/cluster.py) recorded.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from jobsignal._proto.job import JobSummarySignal
from jobsignal.store import JobKey, JobSummary

from .cluster import Cluster
from .grpcio import GrpcioStream


def to_summary(signal: JobSummarySignal | Any) -> JobSummary:
    """A decoded JobSummarySignal (betterproto2 or grpcio) as the store's JobSummary."""
    if isinstance(signal, JobSummarySignal):
        values = {
            "namespace": signal.namespace,
            "job_id": signal.job_id,
            "job_name": signal.job_name,
            "framework": signal.frame_work,
            "job_status": signal.job_status,
            "time": signal.time,
            "total": signal.total,
            "hccl_json": signal.hccl_json,
            "delete_time": signal.delete_time,
            "shared_tor_ip": signal.shared_tor_ip,
            "master_addr": signal.master_addr,
            "operator": signal.operator,
            "sid": signal.sid,
        }
    else:  # grpcio message: proto field names
        values = {
            "namespace": signal.namespace,
            "job_id": signal.jobId,
            "job_name": signal.jobName,
            "framework": signal.frameWork,
            "job_status": signal.jobStatus,
            "time": signal.time,
            "total": signal.total,
            "hccl_json": signal.HcclJson,
            "delete_time": signal.deleteTime,
            "shared_tor_ip": signal.sharedTorIp,
            "master_addr": signal.masterAddr,
            "operator": signal.operator,
            "sid": signal.sid,
        }
    return JobSummary(**values)


@dataclass(frozen=True)
class Event:
    """One message a client received: its uuid, cmIndex and the job state."""

    uuid: str
    cm_index: str
    job: JobSummary


def event_of(signal: JobSummarySignal | Any) -> Event:
    if isinstance(signal, JobSummarySignal):
        return Event(signal.uuid, signal.cm_index, to_summary(signal))
    return Event(signal.uuid, signal.cmIndex, to_summary(signal))


def events_of(stream: GrpcioStream) -> list[Event]:
    """A grpcio SubscribeJobSummarySignal stream's messages so far, as events."""
    return [event_of(message) for message in list(stream.messages)]


async def wait_for_events(
    stream: GrpcioStream,
    condition: Callable[[list[Event]], bool],
    *,
    what: str,
    within: float = 10.0,
) -> list[Event]:
    """Wait until `condition` holds for the events a grpcio stream received; return them."""
    messages = await stream.wait_until(
        lambda messages: condition([event_of(m) for m in messages]), within=within, what=what
    )
    return [event_of(message) for message in messages]


def live_state(events: Iterable[Event]) -> dict[JobKey, JobSummary]:
    """The jobs a client holds after these events: the last one of each, unless deleted."""
    latest: dict[JobKey, JobSummary] = {}
    for event in events:
        latest[event.job.key] = event.job
    return {key: job for key, job in latest.items() if not job.is_deleted}


def by_job(events: Iterable[Event]) -> dict[JobKey, list[JobSummary]]:
    result: dict[JobKey, list[JobSummary]] = {}
    for event in events:
        result.setdefault(event.job.key, []).append(event.job)
    return result


def assert_no_duplicates(events: list[Event]) -> None:
    """cmIndex 0, and per job never the same event (uuid) or state twice in a row.

    Event ids are derived from the state, so a job back in an earlier state
    (ended, then listed again unchanged) carries that state's uuid again.
    """
    last_uuid: dict[JobKey, str] = {}
    for event in events:
        assert last_uuid.get(event.job.key) != event.uuid, "an event was delivered twice"
        last_uuid[event.job.key] = event.uuid
    assert {event.cm_index for event in events} <= {"0"}
    for key, jobs in by_job(events).items():
        for before, after in itertools.pairwise(jobs):
            assert before != after, f"duplicate event for {key}: {after}"
            assert not (before.is_deleted and after.is_deleted), f"{key} deleted twice"


def made_up_delete(job: JobSummary, previous: JobSummary | None) -> bool:
    """`job` is the delete event the watcher makes up when a live job's ConfigMaps vanish."""
    if previous is None or previous.is_deleted or not job.is_deleted or not job.delete_time:
        return False
    delete_time = previous.delete_time or job.delete_time
    return job == dataclasses.replace(previous, operator="delete", delete_time=delete_time)


def assert_replays(cluster: Cluster, events: list[Event], *, exact: bool) -> None:
    """Each job's events replay its history in the cluster: real states, in order.

    A delete event made up for vanished ConfigMaps stands for a `None` entry.
    With `exact`, no live state after the job's first event may be missing (a
    watch resumed without relist delivers every change); otherwise states may
    be skipped (a relist after a gap only sees the newest).
    """
    for key, received in by_job(events).items():
        history = cluster.history.get(key, [])
        position = 0
        previous: JobSummary | None = None
        for index, job in enumerate(received):
            skipped: list[JobSummary | None] = []
            while True:
                if position >= len(history):
                    raise AssertionError(
                        f"{key}: event {job} is not a later state of the cluster;"
                        f" history {history}, received {received}"
                    )
                state = history[position]
                position += 1
                if state == job or (state is None and made_up_delete(job, previous)):
                    break
                skipped.append(state)
            if exact and index > 0:
                lost = [state for state in skipped if state is not None and not state.is_deleted]
                assert not lost, f"{key}: states never delivered: {lost}"
            previous = job
