"""Emulated cluster → watcher → store → gRPC → the official grpcio client.

The whole server runs as `jobsignal serve` does (`run_jobsignal` with a Config
from `load_config`), reaching the emulator through a kubeconfig with a bearer
token, so the real credential path is used. Clients are grpcio's blocking
stubs in worker threads; health uses grpcio-health-checking out of process
(see tests/support/grpcio_cli.py). Real clock: grpclib and grpcio keep their own
time, so every wait is short, polled and bounded.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
import trio

from jobsignal.app import RunningJobsignal, run_jobsignal
from jobsignal.config import load_config
from jobsignal.rpc.server import SOURCE_HEALTH_NAME
from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.sim.emulator import (
    Drop,
    ExpireWatch,
    KubeEmulator,
    Stall,
)
from jobsignal.store.model import event_id
from tests.support.cluster import TOKEN, Cluster, expected_summary, hccl, write_kubeconfig
from tests.support.events import (
    Event,
    assert_no_duplicates,
    assert_replays,
    by_job,
    live_state,
    wait_for_events,
)
from tests.support.grpcio import GrpcioClients, GrpcioStream, GrpcioStubs, cli_command, cli_env
from tests.support.kube_server import open_kube_server, subscribe, take_fault, target
from tests.support.waiting import wait_until


class Watched(NamedTuple):
    server: RunningJobsignal
    stream: GrpcioStream  # a CCAgent's SubscribeJobSummarySignal
    nursery: trio.Nursery


@asynccontextmanager
async def watched_by_a_client(
    emu: KubeEmulator, tmp_path: Path, clients: GrpcioClients
) -> AsyncIterator[Watched]:
    """The server once its watch is open, and a grpcio client subscribed to it."""
    async with (
        trio.open_nursery() as nursery,
        open_kube_server(emu, tmp_path, shutdown_grace="2") as server,
    ):
        with trio.fail_after(10):
            await emu.wait_requests(1, "watch")
        yield Watched(server, await subscribe(clients, server, nursery), nursery)


#: The server as a whole, the job service, and the Kubernetes source.
HEALTH_SERVICES = ("", "job.Job", SOURCE_HEALTH_NAME)


async def health(stubs: GrpcioStubs, server: RunningJobsignal) -> dict[str, str]:
    """grpc.health.v1 Check of the server, the job service and the source."""
    result = await trio.run_process(
        cli_command("health", target(server), *HEALTH_SERVICES),
        env=cli_env(stubs),
        capture_stdout=True,
    )
    decoded: dict[str, str] = json.loads(result.stdout)
    return decoded


async def converged(stream: GrpcioStream, cluster: Cluster, what: str) -> list[Event]:
    """Wait until the grpcio subscriber holds exactly the cluster's live jobs."""
    expected = cluster.live()
    return await wait_for_events(
        stream, lambda events: live_state(events) == expected, what=what, within=15
    )


async def settle(stream: GrpcioStream, cluster: Cluster, marker: ClusterdJob) -> list[Event]:
    """Write a marker job and wait for it: every earlier event has arrived by then."""
    cluster.write(marker, "pending")
    events = await converged(stream, cluster, f"marker {marker.name}")
    assert events[-1].job == expected_summary(marker, "pending")
    return events


def assert_event_uuid(event: Event) -> None:
    """Event ids are derived from the state (UUIDv5), the same on every replica."""
    assert uuid.UUID(event.uuid).version == 5, event.uuid
    assert event.uuid == event_id(event.job), event


@pytest.fixture
def cluster(emu: KubeEmulator) -> Cluster:
    return Cluster(emu.state)


# -- a job's life, as a ClusterD client sees it ---------------------------------------------


async def test_whole_lifecycle_of_a_job(
    emu: KubeEmulator, cluster: Cluster, grpc_clients: GrpcioClients, tmp_path: Path
) -> None:
    job = ClusterdJob("training", "resnet50", str(uuid.uuid4()), servers=2)
    async with watched_by_a_client(emu, tmp_path, grpc_clients) as (_, stream, _):
        cluster.write(job, "pending")
        (pending,) = await wait_for_events(stream, lambda e: len(e) == 1, what="pending")
        message = stream.messages[0]
        assert {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields} == {
            "uuid": pending.uuid,
            "jobId": job.uid,
            "jobName": "resnet50",
            "namespace": "training",
            "frameWork": "pytorch",
            "jobStatus": "pending",
            "time": "1700000000",
            "cmIndex": "0",
            "total": "1",
            "HcclJson": '{"status":"initializing"}',
            "deleteTime": "",
            "sharedTorIp": "[]",
            "masterAddr": "192.168.0.0",
            "operator": "add",
            "sid": "",
        }

        cluster.write(job, "running")
        events = await wait_for_events(stream, lambda e: len(e) == 2, what="running")
        running = events[1].job
        assert running == expected_summary(job, "running")
        table = hccl(running)
        assert table["server_list"] == job.server_list()
        assert (table["status"], table["server_count"], table["total"]) == ("complete", "2", 16)

        cluster.write(job, "complete")
        await wait_for_events(stream, lambda e: len(e) == 3, what="complete")
        cluster.write(job, "complete", "delete", 1_700_000_900)
        events = await wait_for_events(stream, lambda e: len(e) == 4, what="delete")
        deleted = events[3].job
        assert (deleted.operator, deleted.delete_time) == ("delete", "1700000900")

        # A minute or two later ClusterD removes the ConfigMaps: no signal for that.
        cluster.remove(job)
        events = await settle(stream, cluster, ClusterdJob("training", "marker", "uid-marker"))

    assert [event.job for event in events[:4]] == [
        expected_summary(job, "pending"),
        expected_summary(job, "running"),
        expected_summary(job, "complete"),
        expected_summary(job, "complete", "delete", 1_700_000_900),
    ]
    assert len(events) == 5
    for event in events:
        assert_event_uuid(event)
    assert_no_duplicates(events)
    # The watcher reached the emulator with the kubeconfig's token, and only with it.
    assert {r.authorization for r in emu.requests} == {f"Bearer {TOKEN}"}
    assert emu.stats.unauthorized == 0


async def test_multi_configmap_job_is_one_rank_table(
    emu: KubeEmulator, cluster: Cluster, grpc_clients: GrpcioClients, tmp_path: Path
) -> None:
    job = ClusterdJob(
        "training",
        "llama",
        str(uuid.uuid4()),
        servers=10,
        servers_per_configmap=4,
        extra_server_keys={"super_pod_id": "7", "host_ip": "10.9.9.9"},
    )
    assert job.configmap_count == 3
    async with watched_by_a_client(emu, tmp_path, grpc_clients) as (server, stream, nursery):
        cluster.write(job, "pending")
        cluster.write(job, "running")
        events = await wait_for_events(stream, lambda e: len(e) == 2, what="pending and running")
        # A snapshot subscriber gets the reassembled job too.
        snapshot = await subscribe(grpc_clients, server, nursery, "DefaultUser1", as_list=True)
        await wait_until(lambda: len(snapshot.messages) == 1, what="the snapshot batch")
        events = await settle(stream, cluster, ClusterdJob("training", "marker", "uid-m"))

    pending, running = (event.job for event in events[:2])
    assert len(events) == 3  # one message per job event, never one per ConfigMap
    assert (pending.total, pending.hccl_json) == ("3", '{"status":"initializing"}')
    table = hccl(running)
    assert running.total == "3"
    assert table["server_list"] == job.server_list()  # in order, unknown keys kept
    assert (table["server_count"], table["total"]) == ("10", 80)
    assert list(table) == ["status", "server_list", "server_count", "total"]
    batch = snapshot.messages[0]  # then live events (the marker) follow
    assert batch.JobTotalNum == 1
    (listed,) = batch.jobSummarySignals
    assert listed.HcclJson == running.hccl_json and listed.cmIndex == "0"


async def test_hand_deleted_configmap_ends_the_job_once(
    emu: KubeEmulator, cluster: Cluster, grpc_clients: GrpcioClients, tmp_path: Path
) -> None:
    job = ClusterdJob("training", "bert", str(uuid.uuid4()), servers=3, servers_per_configmap=2)
    single = ClusterdJob("training", "gpt", str(uuid.uuid4()))
    async with watched_by_a_client(emu, tmp_path, grpc_clients) as (_, stream, _):
        cluster.write(job, "running")
        cluster.write(single, "running")
        await converged(stream, cluster, "two running jobs")
        # kubectl delete configmap, through the API.
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(
            base_url=emu.url,
            headers=headers,
            timeout=5,
            verify=False,  # plain HTTP
        ) as kubectl:
            before = time.time()
            for name in (job.configmap_name(1), single.configmap_name(0), job.configmap_name(0)):
                response = await kubectl.delete(f"/api/v1/namespaces/training/configmaps/{name}")
                assert response.status_code == 200
        events = await settle(stream, cluster, ClusterdJob("training", "marker", "uid-mk"))
        after = time.time()

    deletes = [event.job for event in events if event.job.is_deleted]
    assert sorted(d.job_name for d in deletes) == ["bert", "gpt"]  # once each
    for ended in deletes:
        assert before - 1 <= int(ended.delete_time) <= after + 1
        assert ended.job_status == "running"
    assert len(events) == 2 + 2 + 1
    assert_no_duplicates(events)


async def test_health_serving_after_the_first_list(
    emu: KubeEmulator,
    cluster: Cluster,
    grpcio_stubs: GrpcioStubs,
    tmp_path: Path,
) -> None:
    cluster.write(ClusterdJob("training", "a", "uid-a"), "running")
    emu.faults.push(Stall(target="list"))  # the first LIST hangs half way
    async with open_kube_server(emu, tmp_path, shutdown_grace="2") as server:
        with trio.fail_after(10):
            await emu.wait_requests(1, "list")
        assert await health(grpcio_stubs, server) == dict.fromkeys(HEALTH_SERVICES, "NOT_SERVING")
        emu.restart(lose_history=False)  # the stalled LIST breaks; the watcher lists again
        with trio.fail_after(10):
            await emu.wait_requests(1, "watch")
        assert await health(grpcio_stubs, server) == dict.fromkeys(HEALTH_SERVICES, "SERVING")
        assert server.ready.is_set()
        assert server._parts.broadcaster.job_count() == 1
    assert emu.stats.list_requests == 2


# -- faults in the middle of the lifecycle ---------------------------------------------------


async def test_faults_mid_lifecycle_leave_the_client_with_the_clusters_state(
    emu: KubeEmulator, cluster: Cluster, grpc_clients: GrpcioClients, tmp_path: Path
) -> None:
    a = ClusterdJob("training", "a", "uid-a", servers=3, servers_per_configmap=2)
    b = ClusterdJob("training", "b", "uid-b")
    c = ClusterdJob("inference", "c", "uid-c", framework="mindspore")
    async with watched_by_a_client(emu, tmp_path, grpc_clients) as (server, stream, _):
        cluster.write(a, "pending")
        cluster.write(b, "pending")
        await converged(stream, cluster, "two pending jobs")

        # The connection drops in the middle of a burst.
        await take_fault(emu, Drop(after_events=2, mid_line=True))
        cluster.write(a, "running")  # two ConfigMaps: both events arrive, then the drop
        cluster.write(b, "running")
        await converged(stream, cluster, "after the drop")
        counters = server._parts.watcher.counters
        assert counters.errors >= 1 and counters.relists_after_gone == 0

        # 410 in the middle of the stream: what the watch did not send comes by relist.
        await take_fault(emu, ExpireWatch(after_events=1))
        cluster.write(c, "pending")
        cluster.write(a, "complete")
        cluster.write(b, "failed")
        await converged(stream, cluster, "after the 410")
        assert counters.relists_after_gone == 1

        # The API server restarts and forgets its history, while ClusterD writes.
        cluster.write(c, "running")
        emu.restart(lose_history=True, drop_connections=True)
        cluster.write(a, "complete", "delete", 1_700_000_100)
        cluster.write(b, "failed", "delete", 1_700_000_200)
        await converged(stream, cluster, "after the restart")
        assert counters.relists_after_gone == 2

        cluster.remove(a)
        cluster.remove(b)
        events = await settle(stream, cluster, ClusterdJob("training", "marker", "uid-mk"))
        watches = emu.stats.watch_requests

    assert_no_duplicates(events)
    assert_replays(cluster, events, exact=False)
    assert live_state(events) == cluster.live()
    per_job = by_job(events)
    # Nothing a client must act on was lost: each job's final word arrived.
    assert per_job[expected_summary(a, "pending").key][-1].delete_time == "1700000100"
    assert per_job[expected_summary(b, "pending").key][-1].delete_time == "1700000200"
    assert per_job[expected_summary(c, "pending").key][-1].job_status == "running"
    assert watches >= 4


async def test_grpc_client_sees_no_regression_after_a_dropped_watch(
    emu: KubeEmulator, cluster: Cluster, grpc_clients: GrpcioClients, tmp_path: Path
) -> None:
    a = ClusterdJob("training", "a", "uid-a")
    async with watched_by_a_client(emu, tmp_path, grpc_clients) as (_, stream, _):
        cluster.write(a, "pending")
        await converged(stream, cluster, "pending")
        await take_fault(emu, Drop(after_events=2))
        cluster.write(a, "running")
        cluster.write(a, "complete")  # delivered, then the connection drops
        events = await settle(stream, cluster, ClusterdJob("training", "marker", "uid-mk"))

    # The watch after the drop resumed after the last event delivered: the client
    # never sees the job go back to "running".
    statuses = [e.job.job_status for e in events if e.job.job_name == "a"]
    assert statuses == ["pending", "running", "complete"]
    assert_no_duplicates(events)


async def test_run_jobsignal_accepts_a_shutdown_event(emu: KubeEmulator, tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", emu.url)
    config = load_config({"listen": "127.0.0.1:0", "kubeconfig": str(kubeconfig)}, {})
    shutdown = trio.Event()
    crashed: list[BaseException] = []
    with trio.fail_after(10):
        try:
            async with trio.open_nursery() as nursery:
                server: RunningJobsignal = await nursery.start(
                    functools.partial(run_jobsignal, config, shutdown=shutdown, environ={})
                )
                shutdown.set()  # the caller's event stops the server
                await server.stopped.wait()
        except BaseExceptionGroup as group:
            crashed.extend(group.exceptions)
    assert not crashed, f"run_jobsignal(shutdown=trio.Event()) crashed: {crashed!r}"
