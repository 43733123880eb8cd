"""Replica-consistent event ids (docs/architecture.md section 2).

An event's uuid is derived from the job's identity and client-visible state,
so two replicas watching one cluster, or one replica after a restart, give the
same event the same id. The unit tests pin the id function and the
broadcaster's use of it; the end-to-end test runs two servers with their own
watchers against one Kubernetes API emulator and a client that fails over.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from jobsignal._proto.job import JobSummarySignal
from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.sim.emulator import open_emulator
from jobsignal.store import JobKey, JobStore
from jobsignal.store.model import EVENT_ID_NAMESPACE, JobSummary, event_id
from tests.support.cluster import TOKEN, Cluster, expected_summary
from tests.support.events import Event, event_of, events_of, wait_for_events
from tests.support.factories import clusterd_job, configmap
from tests.support.grpcio import GrpcioClients, GrpcioStream
from tests.support.kube_server import open_kube_server, subscribe
from tests.support.lifecycle import Lifecycle
from tests.support.waiting import wait_until

JOB = ClusterdJob("training", "resnet50", "6f1c1d0e-0000-4000-8000-000000000001", servers=2)

#: Every field a client sees, except deleteTime (see test_delete_time_alone_keeps_the_id);
#: `event_uuid` is an id a source gave, not a field (test_an_id_the_source_gave_is_kept).
VISIBLE_FIELDS = [
    field.name
    for field in dataclasses.fields(JobSummary)
    if field.name not in ("delete_time", "npu_count", "event_uuid")
]


def running() -> JobSummary:
    return expected_summary(JOB, "running")


# -- the id function ---------------------------------------------------------------------


def test_event_id_is_a_uuid5_in_jobsignals_namespace() -> None:
    value = uuid.UUID(event_id(running()))
    assert value.version == 5
    assert value.variant == uuid.RFC_4122
    # Pinned: the id of a state must never change between releases, or
    # replicas of two versions would disagree during a rolling upgrade.
    assert str(uuid.UUID(bytes=EVENT_ID_NAMESPACE)) == "720fcb38-2424-4a4c-8de0-64942ee0d6d9"
    assert str(value) == "1e6b74b7-a0b5-59a9-8f22-a2b36037da81"  # as it always was


def test_same_state_same_id_even_as_a_new_object() -> None:
    first, second = running(), running()
    assert first is not second
    assert event_id(first) == event_id(second)
    assert event_id(first) == event_id(dataclasses.replace(first, npu_count=0))


@pytest.mark.parametrize("name", VISIBLE_FIELDS)
def test_any_client_visible_change_changes_the_id(name: str) -> None:
    job = running()
    changed = dataclasses.replace(job, **{name: getattr(job, name) + "x"})
    assert event_id(changed) != event_id(job)


def test_fields_do_not_run_into_each_other() -> None:
    """Moving a character from one field to the next is another state, another id."""
    job = running()
    a = dataclasses.replace(job, job_name="ab", framework="c")
    b = dataclasses.replace(job, job_name="a", framework="bc")
    assert event_id(a) != event_id(b)


def test_delete_time_alone_keeps_the_id() -> None:
    """Replicas stamp a vanished job's delete with their own clocks: still one event."""
    deleted = running().as_deleted("1800000000")
    elsewhere = running().as_deleted("1800000007")
    assert deleted.delete_time != elsewhere.delete_time
    assert event_id(deleted) == event_id(elsewhere)
    assert event_id(deleted) != event_id(running())  # the operator changed


def test_an_id_the_source_gave_is_kept_and_a_delete_made_of_it_gets_its_own() -> None:
    """A relay passes its upstream's uuids on (docs/architecture.md section 4)."""
    given = dataclasses.replace(running(), event_uuid="from-the-upstream")
    assert event_id(given) == "from-the-upstream"
    assert given == running()  # the same state: no change for the store or a relay
    assert event_id(given.as_deleted("1")) == event_id(running().as_deleted("1"))


def test_text_that_is_not_utf8_encodable_still_gets_an_id() -> None:
    job = dataclasses.replace(running(), job_name="bad\udc80name")
    assert event_id(job) != event_id(running())


# -- the broadcaster ---------------------------------------------------------------------


def published_uuids(states: list[JobSummary]) -> list[str]:
    """The uuids a SubscribeJobSummarySignal subscriber gets from a new Broadcaster."""
    broadcaster = Broadcaster()
    subscriber = broadcaster.subscribe(StreamKind.SIGNAL, "CCAgent", "c", snapshot=False)
    broadcaster.publish(states, seen_at=0.0)
    frames = [entry[1] for entry in list(subscriber._pending)]
    return [JobSummarySignal.parse(frame).uuid for frame in frames]


def test_broadcasters_give_the_same_events_the_same_ids() -> None:
    states = [expected_summary(JOB, "pending"), running(), running().as_deleted("1")]
    first, second = published_uuids(states), published_uuids(states)
    assert first == second == [event_id(state) for state in states]
    assert len(set(first)) == 3


async def test_a_snapshot_carries_the_id_of_the_event_that_produced_the_state() -> None:
    broadcaster = Broadcaster()
    broadcaster.publish([expected_summary(JOB, "pending"), running()], seen_at=0.0)
    (latest,) = broadcaster.latest()
    assert latest.uuid == event_id(running())
    subscriber = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "f", snapshot=True)
    (frame,) = await subscriber.next_batch(10)
    assert JobSummarySignal.parse(frame).uuid == latest.uuid


def test_two_stores_fed_the_same_configmaps_emit_the_same_ids() -> None:
    """A restart (a new store, a fresh LIST) reports the job with the same id."""

    def listed() -> list[str]:
        store = JobStore()
        relist = store.relist(None)
        for name, data in JOB.configmaps("running"):
            relist.add(configmap(JOB.namespace, name, data))
        relist.commit(0.0)
        events = store.settle().events
        return [event_id(job) for job in events]

    assert listed() == listed() == [event_id(running())]


# -- two replicas against one cluster ---------------------------------------------------------


def comparable(event: Event) -> tuple[str, JobSummary]:
    """(uuid, state), without the deleteTime a replica stamps on a vanished job."""
    return event.uuid, dataclasses.replace(event.job, delete_time="")


async def test_two_replicas_send_the_same_events_with_the_same_ids(
    grpc_clients: GrpcioClients, tmp_path: Path
) -> None:
    async with open_emulator(token=TOKEN) as emu:
        cluster = Cluster(emu.state)
        lifecycle = Lifecycle()
        lifecycle.before(cluster)  # in both replicas' first LIST
        marker = lifecycle.marker
        async with (
            trio.open_nursery() as nursery,
            open_kube_server(emu, tmp_path, ready=True, shutdown_grace="1") as one,
            open_kube_server(emu, tmp_path, ready=True, shutdown_grace="1") as two,
        ):
            # FdAgent gets the snapshot first: the early job, from each replica's LIST.
            streams = [
                await subscribe(grpc_clients, server, nursery, "FdAgent", timeout=30)
                for server in (one, two)
            ]
            lifecycle.drive(cluster)
            final = expected_summary(marker, "pending")
            seen = [
                await wait_for_events(
                    stream,
                    lambda events: bool(events) and events[-1].job == final,
                    what="the marker",
                )
                for stream in streams
            ]
            # What N replicas cost the API server: one LIST and one WATCH each.
            assert (emu.stats.list_requests, emu.stats.watch_requests) == (2, 2)
            assert emu.stats.open_watches == 2
            nursery.cancel_scope.cancel()
    first, second = seen
    assert [comparable(e) for e in first] == [comparable(e) for e in second]
    assert [e.uuid for e in first] == [event_id(e.job) for e in first]
    names = [(e.job.job_name, e.job.job_status, e.job.operator) for e in first]
    assert names == list(Lifecycle.EVENTS)
    # Everything but the made-up delete of the vanished job is equal field for field.
    assert [e.job for e in first if e.job.job_name != "b" or not e.job.is_deleted] == [
        e.job for e in second if e.job.job_name != "b" or not e.job.is_deleted
    ]


@dataclass
class FailoverClient:
    """What a client following the guidance holds: per job, the last event it took.

    It deduplicates by uuid per job (not against every id ever seen: a job back
    in an earlier state carries that state's id again), and after a reconnect
    treats the List RPC's snapshot as the whole state.
    """

    held: dict[JobKey, Event] = field(default_factory=dict)
    taken: list[Event] = field(default_factory=list)
    duplicates: list[Event] = field(default_factory=list)
    ended_while_away: list[JobKey] = field(default_factory=list)

    def take(self, event: Event) -> None:
        key = event.job.key
        last = self.held.get(key)
        if last is not None and last.uuid == event.uuid:
            self.duplicates.append(event)
            return
        self.taken.append(event)
        if event.job.is_deleted:
            self.held.pop(key, None)
        else:
            self.held[key] = event

    def snapshot(self, events: list[Event]) -> None:
        listed = {event.job.key for event in events}
        for key in [key for key in self.held if key not in listed]:
            self.ended_while_away.append(key)
            del self.held[key]
        for event in events:
            self.take(event)


def list_events(stream: GrpcioStream) -> list[list[Event]]:
    """Each JobSummarySignalList message of a list stream, as events."""
    return [[event_of(s) for s in message.jobSummarySignals] for message in list(stream.messages)]


async def test_a_client_failing_over_to_another_replica_misses_nothing(
    grpc_clients: GrpcioClients, tmp_path: Path
) -> None:
    steady, changes, ends, born, after = (
        clusterd_job("steady"),
        clusterd_job("changes"),
        clusterd_job("ends"),
        clusterd_job("born"),
        clusterd_job("after"),
    )
    async with open_emulator(token=TOKEN) as emu:
        cluster = Cluster(emu.state)
        client = FailoverClient()
        async with (
            trio.open_nursery() as nursery,
            open_kube_server(emu, tmp_path, ready=True, shutdown_grace="1") as two,
        ):
            # The reference: one uninterrupted stream from the replica that stays up.
            reference = await subscribe(grpc_clients, two, nursery, "FdAgent", timeout=30)
            async with open_kube_server(emu, tmp_path, ready=True, shutdown_grace="1") as one:
                stream = await subscribe(
                    grpc_clients, one, nursery, "CCAgent", as_list=True, timeout=30
                )
                for each in (steady, changes, ends):
                    cluster.write(each, "pending")
                cluster.write(steady, "running")
                await wait_until(
                    lambda: sum(map(len, list_events(stream))) == 4, what="the first events"
                )
                # Mid-stream, replica one goes away (its pod is rescheduled).
            with trio.fail_after(10):
                await stream.ended.wait()
            first = list_events(stream)
            assert first[0] == []  # the empty cluster's snapshot
            for batch in first[1:]:
                for event in batch:
                    client.take(event)
            # While the client is away, the cluster moves on.
            cluster.write(changes, "running")
            cluster.write(ends, "pending", "delete", 1_700_000_900)
            cluster.remove(ends)
            cluster.write(born, "pending")
            # Reconnect to replica two: the List RPC's snapshot, then live changes.
            again = await subscribe(grpc_clients, two, nursery, "CCAgent", as_list=True, timeout=30)
            cluster.write(after, "pending")
            expected = expected_summary(after, "pending")
            await wait_until(
                lambda: any(e.job == expected for batch in list_events(again) for e in batch),
                what="the live event after the reconnect",
            )
            snapshot, *live = list_events(again)
            client.snapshot(snapshot)
            for batch in live:
                for event in batch:
                    client.take(event)
            await wait_for_events(
                reference,
                lambda events: bool(events) and events[-1].job == expected,
                what="the reference",
            )
            nursery.cancel_scope.cancel()
    wanted = cluster.live()
    assert {key: event.job for key, event in client.held.items()} == wanted
    # Per job, the client ends on the very event the uninterrupted stream ended on.
    reference_last = {e.job.key: e for e in events_of(reference)}
    assert {key: e.uuid for key, e in client.held.items()} == {
        key: reference_last[key].uuid for key in wanted
    }
    # Every event the client took is one the replica that stayed up sent too.
    reference_ids = {e.uuid for e in events_of(reference)}
    assert {e.uuid for e in client.taken} <= reference_ids
    # The snapshot repeated what the client already had: recognised by uuid.
    assert [e.job.job_name for e in client.duplicates] == ["steady"]
    assert client.ended_while_away == [expected_summary(ends, "pending").key]
