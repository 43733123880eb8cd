"""A relay in front of jobsignal in front of the Kubernetes API emulator, over real sockets.

The upstream is `jobsignal serve` watching the emulator (tests/support/kube_server.py),
the relay `jobsignal serve --source relay` subscribed to it, and the subscribers are
grpcio clients of both tiers. Every uuid a relay subscriber gets is the upstream's;
through an upstream restart the relay's subscribers see exactly what changed
meanwhile, and nothing twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import trio

from jobsignal.app import RunningJobsignal
from jobsignal.client import check_health
from jobsignal.client_options import SubscribeOptions
from jobsignal.relay.source import Relay
from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.sim.emulator import open_emulator
from jobsignal.store.model import event_id
from tests.support.cluster import TOKEN, Cluster, expected_summary
from tests.support.events import Event, event_of, events_of, wait_for_events
from tests.support.factories import clusterd_job
from tests.support.grpcio import GrpcioClients, GrpcioStream
from tests.support.kube_server import open_kube_server, subscribe
from tests.support.lifecycle import Lifecycle
from tests.support.relay import open_relay_server, serve_upstream
from tests.support.waiting import wait_until

SOURCE_HEALTH = "jobsignal.KubernetesSync"


def list_events(stream: GrpcioStream) -> list[Event]:
    """A List stream's signals so far, batches flattened, as events."""
    return [event_of(s) for message in list(stream.messages) for s in message.jobSummarySignals]


def last_is(job: ClusterdJob, status: str) -> Callable[[list[Event]], bool]:
    final = expected_summary(job, status)
    return lambda events: bool(events) and events[-1].job == final


async def health(server: RunningJobsignal, service: str) -> str:
    with trio.fail_after(10):
        return await check_health(SubscribeOptions("127.0.0.1", server.port, "CCAgent"), service)


async def test_a_relay_serves_its_upstreams_events_with_the_upstreams_uuids(
    grpc_clients: GrpcioClients, tmp_path: Path
) -> None:
    async with open_emulator(token=TOKEN) as emu:
        cluster = Cluster(emu.state)
        lifecycle = Lifecycle()
        lifecycle.before(cluster)  # in the snapshot of both tiers
        marker = lifecycle.marker
        async with (
            trio.open_nursery() as nursery,
            open_kube_server(emu, tmp_path, ready=True, shutdown_grace="1") as upstream,
            open_relay_server(upstream.port) as relay,
        ):
            direct = await subscribe(grpc_clients, upstream, nursery, "FdAgent")
            relayed = await subscribe(grpc_clients, relay, nursery, "FdAgent")
            relayed_list = await subscribe(grpc_clients, relay, nursery, "CCAgent", as_list=True)
            lifecycle.drive(cluster)
            seen = [
                await wait_for_events(stream, last_is(marker, "pending"), what="the marker")
                for stream in (direct, relayed)
            ]
            await wait_until(lambda: last_is(marker, "pending")(list_events(relayed_list)))
            assert await health(relay, "") == await health(relay, SOURCE_HEALTH) == "SERVING"
            nursery.cancel_scope.cancel()
    at_upstream, at_relay = seen
    # The same messages, field for field, and the same uuids: the upstream's.
    assert at_relay == at_upstream
    assert [e.uuid for e in at_relay] == [event_id(e.job) for e in at_upstream]
    assert list_events(relayed_list)[0] == at_upstream[0]  # the List snapshot: the early job
    assert list_events(relayed_list)[1:] == at_upstream[1:]
    names = [(e.job.job_name, e.job.job_status, e.job.operator) for e in at_relay]
    assert names == list(Lifecycle.EVENTS)


async def test_through_an_upstream_restart_subscribers_see_exactly_the_changes(
    grpc_clients: GrpcioClients, tmp_path: Path
) -> None:
    steady, changes, ends, born, after = (
        clusterd_job("steady"),
        clusterd_job("changes"),
        clusterd_job("ends"),
        clusterd_job("born"),
        clusterd_job("after"),
    )
    async with open_emulator(token=TOKEN) as emu, trio.open_nursery() as nursery:
        cluster = Cluster(emu.state)
        stop_first = trio.Event()
        first = await nursery.start(serve_upstream, emu, tmp_path, stop_first, "127.0.0.1:0")
        port = first.port
        async with open_relay_server(port, upstream_grace="1") as relay:
            signals = await subscribe(grpc_clients, relay, nursery, "FdAgent")
            lists = await subscribe(grpc_clients, relay, nursery, "CCAgent", as_list=True)
            for job in (steady, changes, ends):
                cluster.write(job, "pending")
            await wait_for_events(signals, last_is(ends, "pending"), what="the first events")
            before = events_of(signals)

            stop_first.set()  # the upstream goes away: the relay keeps serving its last state
            relaying = relay._parts.source
            assert isinstance(relaying, Relay)
            await wait_until(lambda: relaying.counters.upstream_errors.total() > 0)
            assert relay._parts.status.in_sync  # within the grace
            await wait_until(lambda: not relay._parts.status.in_sync, within=10)
            assert await health(relay, SOURCE_HEALTH) == "NOT_SERVING"
            assert await health(relay, "") == await health(relay, "job.Job") == "SERVING"
            assert len(relay._parts.store.live_jobs()) == 3

            cluster.write(changes, "running")  # what happens while it is away
            cluster.remove(ends)
            cluster.write(born, "pending")
            stop_second = trio.Event()
            second = await nursery.start(
                serve_upstream, emu, tmp_path, stop_second, f"127.0.0.1:{port}"
            )
            direct = await subscribe(grpc_clients, second, nursery, "FdAgent")
            await wait_until(lambda: relay._parts.status.in_sync, within=40, what="the resync")
            assert await health(relay, SOURCE_HEALTH) == "SERVING"
            cluster.write(after, "pending")
            await wait_for_events(signals, last_is(after, "pending"), what="the live event")
            await wait_for_events(direct, last_is(after, "pending"), what="the direct one")
            await wait_until(lambda: last_is(after, "pending")(list_events(lists)))
            stop_second.set()
        nursery.cancel_scope.cancel()

    seen = events_of(signals)
    assert seen[: len(before)] == before
    resynced, live = seen[len(before) : -1], seen[-1]
    # Exactly the changes, each once: steady, unchanged, is not sent again.
    assert sorted((e.job.job_name, e.job.job_status, e.job.operator) for e in resynced) == [
        ("born", "pending", "add"),
        ("changes", "running", "add"),
        ("ends", "pending", "delete"),
    ]
    (vanished,) = [e for e in resynced if e.job.is_deleted]
    assert vanished.job == dataclasses.replace(
        expected_summary(ends, "pending", "delete"), delete_time=vanished.job.delete_time
    )
    assert int(vanished.job.delete_time) > 1_700_000_000  # the relay's clock stamped it
    # Every relayed event of the new upstream carries the uuid that upstream gave it.
    upstream_ids = {e.job: e.uuid for e in events_of(direct)}
    for event in [*resynced, live]:
        if not event.job.is_deleted:
            assert event.uuid == upstream_ids[event.job]
    # The List subscriber (its snapshot: the empty cluster) saw the same events.
    assert next(iter(lists.messages)).jobSummarySignals == []
    assert [(e.uuid, e.job) for e in list_events(lists)] == [(e.uuid, e.job) for e in seen]
