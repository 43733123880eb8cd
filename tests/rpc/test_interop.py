"""The job.Job contract (docs/architecture.md section 2) as the official grpcio client sees it.

Also health (NOT_SERVING until the first LIST), reflection, and graceful
shutdown. Health and reflection use grpcio-health-checking and
grpcio-reflection out of process (see tests/support/grpcio_cli.py for why).
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from typing import Any

import grpc
import pytest
import trio
import trio.testing

from jobsignal.store.model import JobSummary, event_id
from tests.support.factories import make_job
from tests.support.grpc_server import (
    ROLES,
    count_writes,
    local_settings,
    make_registry,
    open_jobsignal_server,
)
from tests.support.grpcio import (
    GrpcioClients,
    GrpcioStream,
    GrpcioStubs,
    cli_command,
    cli_env,
    expected_signal,
    rpc_error,
    signal_fields,
)
from tests.support.threads import in_thread
from tests.support.waiting import wait_until

BATCH_NPUS = 40_000  # docs/architecture.md section 2


def assert_uuid4(value: str) -> None:
    assert uuid.UUID(value).version == 4, value


def assert_recent_unix_ms(value: str) -> None:
    assert abs(int(value) - time.time() * 1000) < 60_000, value


# -- Register ---------------------------------------------------------------------


async def test_register_hands_out_a_fresh_uuid_per_call(grpc_clients: GrpcioClients) -> None:
    async with open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target)
        replies = [await in_thread(client.register, role, "chosen-by-client") for role in ROLES]
        assert len(server.registry) == len(ROLES)
    for reply in replies:
        assert (reply.code, reply.info) == (200, "registration successful")
        assert reply.clientId != "chosen-by-client"
        assert_uuid4(reply.clientId)
    assert len({reply.clientId for reply in replies}) == len(ROLES)


@pytest.mark.parametrize("algorithm", [grpc.Compression.Gzip, grpc.Compression.Deflate])
async def test_a_channel_compressing_its_requests_is_served(
    grpc_clients: GrpcioClients, algorithm: grpc.Compression
) -> None:
    """grpcio compresses a message when that makes it smaller: a clientId of 120
    repeated characters is (it got UNIMPLEMENTED before the server inflated them)."""
    async with open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target, default_compression_algorithm=algorithm)
        reply = await in_thread(client.register, "FdAgent", "a" * 120)
        assert (reply.code, len(server.registry)) == (200, 1)


async def test_register_with_unknown_role_is_invalid_argument(
    grpc_clients: GrpcioClients,
) -> None:
    async with open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target)
        error = await rpc_error(lambda: client.register("Intruder"))
        assert len(server.registry) == 0
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.details()
    assert "Intruder" in details
    for role in ROLES:
        assert role in details, f"allowed role {role} not named in {details!r}"


async def test_register_when_full_answers_status_429(grpc_clients: GrpcioClients) -> None:
    async with open_jobsignal_server(registry=make_registry(max_registrations=2)) as server:
        client = grpc_clients.connect(server.target)
        first = await in_thread(client.register, "CCAgent")
        second = await in_thread(client.register, "FdAgent")
        full = await in_thread(client.register, "CCAgent")
        assert len(server.registry) == 2
    assert (first.code, second.code) == (200, 200)
    # ClusterD answers a full registry with a normal reply, not a gRPC error.
    assert full.code == 429
    assert full.clientId == ""
    assert "2" in full.info and "retry" in full.info.lower(), full.info


# -- SubscribeJobSummarySignal: who may subscribe ------------------------------------


async def test_subscribe_refusals_tell_the_client_what_to_do(
    grpc_clients: GrpcioClients,
) -> None:
    registry = make_registry(max_subscriptions_per_role=2)
    async with trio.open_nursery() as nursery, open_jobsignal_server(registry=registry) as server:
        client = grpc_clients.connect(server.target)

        unknown = await rpc_error(lambda: list(client.subscribe("CCAgent", "never-registered")))
        assert unknown.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "never-registered" in unknown.details()
        assert "Register" in unknown.details()

        fd_id = await in_thread(client.register_id, "FdAgent")
        mismatch = await rpc_error(lambda: list(client.subscribe("CCAgent", fd_id)))
        assert mismatch.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "FdAgent" in mismatch.details() and "CCAgent" in mismatch.details()

        cc_ids = [await in_thread(client.register_id, "CCAgent") for _ in range(3)]
        streams = [
            GrpcioStream(client.subscribe("CCAgent", cc_id)).start(nursery) for cc_id in cc_ids[:2]
        ]
        await wait_until(lambda: registry.active_subscriptions("CCAgent") == 2)
        limit = await rpc_error(lambda: list(client.subscribe("CCAgent", cc_ids[2])))
        assert limit.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "CCAgent" in limit.details() and "2" in limit.details(), limit.details()

        # The limit is per role, and a refusal does not burn the id: the
        # FdAgent id refused above for its role mismatch still subscribes.
        GrpcioStream(client.subscribe("FdAgent", fd_id)).start(nursery)
        await wait_until(lambda: registry.active_subscriptions("FdAgent") == 1)

        # Ending one CCAgent stream frees a slot for the refused id.
        streams[0].call.cancel()
        assert (await streams[0].wait_end())[0] == grpc.StatusCode.CANCELLED
        await wait_until(lambda: registry.active_subscriptions("CCAgent") == 1)
        GrpcioStream(client.subscribe("CCAgent", cc_ids[2])).start(nursery)
        await wait_until(lambda: registry.active_subscriptions("CCAgent") == 2)
        assert len(server.broadcaster.subscribers) == 3


async def test_second_subscription_replaces_the_first_and_ids_are_single_use(
    grpc_clients: GrpcioClients,
) -> None:
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target)
        client_id = await in_thread(client.register_id, "CCAgent")
        first = GrpcioStream(client.subscribe("CCAgent", client_id)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)

        # The same id again, as a client that reconnected on a new channel would.
        again = grpc_clients.connect(server.target)
        second = GrpcioStream(again.subscribe("CCAgent", client_id)).start(nursery)
        code, details = await first.wait_end()
        assert code == grpc.StatusCode.ABORTED
        assert details is not None and "replaced" in details
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
        assert server.registry.active_subscriptions() == 1
        assert server.subscriber(client_id).client_id == client_id

        job = make_job(1)
        server.broadcaster.publish([job])
        (message,) = await second.wait_for(1)
        assert message.jobId == job.job_id
        assert first.messages == []

        second.call.cancel()
        assert (await second.wait_end())[0] == grpc.StatusCode.CANCELLED
        await wait_until(
            lambda: (
                not server.broadcaster.subscribers and server.registry.active_subscriptions() == 0
            )
        )
        reused = await rpc_error(lambda: list(client.subscribe("CCAgent", client_id, timeout=5)))
        assert reused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert len(server.registry) == 0


# -- SubscribeJobSummarySignal: what subscribers receive -------------------------------


async def test_every_event_reaches_every_subscriber_once_in_order(
    grpc_clients: GrpcioClients,
) -> None:
    events = [
        make_job(0, status="pending", hccl_json='{"status":"initializing"}', npus=0),
        make_job(1, status="running", npus=16),
        make_job(0, status="running", npus=8, version=1),
        make_job(2, status="running", npus=64),
        make_job(1, status="complete", npus=16, version=1),
        make_job(0, status="failed", npus=8, version=2),
        make_job(2, status="running", operator="delete", npus=64, version=1),
        make_job(3, status="pending", hccl_json='{"status":"initializing"}', npus=0),
    ]
    marker = make_job(99)
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        signal_streams = []
        for _ in range(3):
            client = grpc_clients.connect(server.target)
            client_id = await in_thread(client.register_id, "CCAgent")
            signal_streams.append(GrpcioStream(client.subscribe("CCAgent", client_id)))
        list_client = grpc_clients.connect(server.target)
        list_id = await in_thread(list_client.register_id, "DefaultUser1")
        list_stream = GrpcioStream(list_client.subscribe_list("DefaultUser1", list_id))
        for stream in [*signal_streams, list_stream]:
            stream.start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 4)
        (empty_snapshot,) = await list_stream.wait_for(1)
        assert list(empty_snapshot.jobSummarySignals) == []
        assert empty_snapshot.JobTotalNum == 0

        server.broadcaster.publish(events[:3])
        server.broadcaster.publish(events[3:])
        # A marker after the events: nothing may arrive between the last
        # event and the marker, so every event arrived exactly once.
        server.broadcaster.publish([marker])
        received = [await stream.wait_for(len(events) + 1) for stream in signal_streams]
        lists = (await list_stream.wait_for(len(events) + 2))[1:]

    uuids = [message.uuid for message in received[0]]
    for value, job in zip(uuids, [*events, marker], strict=True):
        assert uuid.UUID(value).version == 5, value
        assert value == event_id(job), "event ids are derived from the state"
    assert len(set(uuids)) == len(uuids), "uuid must be fresh per event"
    expected = [
        expected_signal(job, uid) for job, uid in zip([*events, marker], uuids, strict=True)
    ]
    for messages in received:
        assert [signal_fields(message) for message in messages] == expected

    live: set[str] = set()
    for job, as_list, want in zip([*events, marker], lists, expected, strict=True):
        if job.is_deleted:
            live.discard(job.job_id)
        else:
            live.add(job.job_id)
        (signal,) = as_list.jobSummarySignals
        assert signal_fields(signal) == want
        assert_recent_unix_ms(as_list.ReportTime)
        assert as_list.JobTotalNum == 1  # a live change, as ClusterD master sends it


async def test_snapshot_on_subscribe_for_fdagent_only(grpc_clients: GrpcioClients) -> None:
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        server.broadcaster.publish(
            [
                make_job(0),
                make_job(1, status="pending"),
                make_job(2),
                make_job(2, operator="delete", version=1),
                make_job(1, status="running", version=1),
            ]
        )
        latest = {entry.job.job_id: entry for entry in server.broadcaster.latest()}
        assert sorted(latest) == ["uid-0000", "uid-0001"]

        client = grpc_clients.connect(server.target)
        fd_id = await in_thread(client.register_id, "FdAgent")
        cc_id = await in_thread(client.register_id, "CCAgent")
        fd = GrpcioStream(client.subscribe("FdAgent", fd_id)).start(nursery)
        cc = GrpcioStream(client.subscribe("CCAgent", cc_id)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 2)
        marker = make_job(7)
        server.broadcaster.publish([marker])
        fd_messages = await fd.wait_for(3)
        (cc_first,) = await cc.wait_for(1)

    snapshot = sorted(fd_messages[:2], key=lambda message: message.jobId)
    assert [signal_fields(message) for message in snapshot] == [
        expected_signal(latest[job_id].job, latest[job_id].uuid) for job_id in sorted(latest)
    ]
    # CCAgent gets no snapshot: its first message is the live marker.
    assert cc_first.jobId == marker.job_id
    assert fd_messages[2].jobId == marker.job_id
    assert cc_first.uuid == fd_messages[2].uuid


# -- SubscribeJobSummarySignalList ----------------------------------------------------


def rank_table_header(npus: int) -> str:
    """A stand-in rank table: the broadcaster batches by npu_count, not by parsing it."""
    return json.dumps({"status": "complete", "server_count": str(npus // 8), "total": npus})


async def test_list_stream_sends_snapshot_batches_then_live_changes(
    grpc_clients: GrpcioClients,
) -> None:
    heavy = [make_job(i, npus=15_000, hccl_json=rank_table_header(15_000)) for i in range(5)]
    small = [make_job(10 + i, npus=8) for i in range(3)]
    huge = make_job(20, npus=50_000, hccl_json=rank_table_header(50_000))
    gone = make_job(30)
    published: list[JobSummary] = [
        heavy[0],
        small[0],
        heavy[1],
        huge,
        heavy[2],
        small[1],
        gone,
        heavy[3],
        small[2],
        heavy[4],
        gone.as_deleted("1700000999"),
    ]
    live = {job.job_id: job for job in [*heavy, *small, huge]}

    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        server.broadcaster.publish(published)
        uuids = {entry.job.job_id: entry.uuid for entry in server.broadcaster.latest()}
        client = grpc_clients.connect(server.target, max_receive_message_length=64 << 20)
        client_id = await in_thread(client.register_id, "CCAgent")
        stream = GrpcioStream(client.subscribe_list("CCAgent", client_id)).start(nursery)

        def snapshot_jobs() -> int:
            return sum(len(batch.jobSummarySignals) for batch in stream.messages)

        await wait_until(lambda: snapshot_jobs() >= len(live), what="the whole snapshot")
        batches = list(stream.messages)
        assert snapshot_jobs() == len(live)

        update = make_job(3, status="complete", npus=15_000, hccl_json=rank_table_header(15_000))
        server.broadcaster.publish([update])
        newcomer = make_job(40, status="pending", npus=0, hccl_json='{"status":"initializing"}')
        server.broadcaster.publish([newcomer])
        changes = (await stream.wait_for(len(batches) + 2))[len(batches) :]
        new_uuids = {entry.job.job_id: entry.uuid for entry in server.broadcaster.latest()}

    # The snapshot: every live job once, deleted ones not at all.
    seen = [signal.jobId for batch in batches for signal in batch.jobSummarySignals]
    assert sorted(seen) == sorted(live)
    assert gone.job_id not in seen
    assert len({batch.ReportTime for batch in batches}) == 1
    assert_recent_unix_ms(batches[0].ReportTime)
    assert all(batch.JobTotalNum == len(live) for batch in batches)
    # Batching by 40,000 NPUs: 75,024 NPUs of ordinary jobs need at least two
    # batches; the 50,000-NPU job travels alone without its rank table.
    assert len(batches) >= 3
    for batch in batches:
        signals = list(batch.jobSummarySignals)
        if any(signal.jobId == huge.job_id for signal in signals):
            (signal,) = signals
            assert signal_fields(signal) == {
                **expected_signal(huge, uuids[huge.job_id]),
                "HcclJson": "",
            }
            continue
        assert sum(live[signal.jobId].npu_count for signal in signals) <= BATCH_NPUS
        for signal in signals:
            assert signal_fields(signal) == expected_signal(live[signal.jobId], uuids[signal.jobId])

    # Then each live change as a list of one.
    for change, job in zip(changes, [update, newcomer], strict=True):
        (signal,) = change.jobSummarySignals
        assert signal_fields(signal) == expected_signal(job, new_uuids[job.job_id])
        assert change.JobTotalNum == 1
        assert int(change.ReportTime) >= int(batches[0].ReportTime)


# -- registration lifetime --------------------------------------------------------------


async def test_registration_that_never_subscribes_expires(grpc_clients: GrpcioClients) -> None:
    ttl = 0.3
    async with open_jobsignal_server(registry=make_registry(ttl=ttl)) as server:
        client = grpc_clients.connect(server.target)
        stale = await in_thread(client.register_id, "CCAgent")
        assert len(server.registry) == 1
        # The registry runs on trio's clock, the real one here: a real wait.
        await trio.sleep(ttl + 0.1)
        error = await rpc_error(lambda: list(client.subscribe("CCAgent", stale, timeout=5)))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "Register" in error.details()
        # Refused because the id expired (not for any other reason), and gone.
        assert server.registry.expired_total == 1
        assert len(server.registry) == 0


# -- health and reflection ------------------------------------------------------------


async def run_cli(stubs: GrpcioStubs, *args: str) -> Any:
    """Run grpcio_stubs' out-of-process client; return its last JSON line."""
    with trio.fail_after(30):
        result = await trio.run_process(
            cli_command(*args), capture_stdout=True, capture_stderr=True, env=cli_env(stubs)
        )
    return json.loads(result.stdout.decode().splitlines()[-1])


async def test_health_is_not_serving_until_the_first_list(grpcio_stubs: GrpcioStubs) -> None:
    services = ["", "job.Job", "no.such.Service"]
    async with open_jobsignal_server(ready=False) as server:
        before = await run_cli(grpcio_stubs, "health", server.target, *services)
        server.mark_ready()
        after = await run_cli(grpcio_stubs, "health", server.target, *services)
    assert before == {
        "": "NOT_SERVING",
        "job.Job": "NOT_SERVING",
        "no.such.Service": "error:NOT_FOUND",
    }
    assert after == {"": "SERVING", "job.Job": "SERVING", "no.such.Service": "error:NOT_FOUND"}


async def test_reflection_describes_job_service(grpcio_stubs: GrpcioStubs) -> None:
    async with open_jobsignal_server() as server:
        reflected = await run_cli(grpcio_stubs, "reflection", server.target)
    assert {"job.Job", "grpc.health.v1.Health"} <= set(reflected["services"])
    # From the server's own descriptor pool; this process's grpcio stubs are
    # registered in protobuf's default pool as "job.proto" instead.
    assert reflected["job_file"] == "job/job.proto"
    assert reflected["job_package"] == "job"
    assert reflected["methods"] == {
        "Register": {"input": "job.ClientInfo", "output": "job.Status", "server_streaming": False},
        "SubscribeJobSummarySignal": {
            "input": "job.ClientInfo",
            "output": "job.JobSummarySignal",
            "server_streaming": True,
        },
        "SubscribeJobSummarySignalList": {
            "input": "job.ClientInfo",
            "output": "job.JobSummarySignalList",
            "server_streaming": True,
        },
    }
    assert reflected["signal_fields"] == list(expected_signal(make_job(0), "u"))


# -- shutdown ----------------------------------------------------------------------------


async def test_graceful_shutdown_ends_streams_and_frees_everything(
    grpc_clients: GrpcioClients,
) -> None:
    async with (
        trio.open_nursery() as nursery,
        open_jobsignal_server(local_settings(shutdown_grace=5.0)) as server,
    ):
        streams = []
        for role, as_list in [("CCAgent", False), ("FdAgent", False), ("DefaultUser1", True)]:
            client = grpc_clients.connect(server.target)
            client_id = await in_thread(client.register_id, role)
            call = (client.subscribe_list if as_list else client.subscribe)(role, client_id)
            streams.append(GrpcioStream(call).start(nursery))
        quiet = grpc_clients.connect(server.target)  # a connection without streams
        await in_thread(quiet.register_id, "DefaultUser2")
        await wait_until(lambda: len(server.broadcaster.subscribers) == 3)
        server.broadcaster.publish([make_job(1)])
        for stream, count in zip(streams, [1, 1, 2], strict=True):  # list: snapshot + event
            await stream.wait_for(count)
        assert len(server.connections) == 4

        started = trio.current_time()
        await server.stop()
        took = trio.current_time() - started

        for stream in streams:
            code, details = await stream.wait_end()
            assert code == grpc.StatusCode.UNAVAILABLE, details
        assert not server.broadcaster.subscribers
        assert server.registry.active_subscriptions() == 0
        assert len(server.connections) == 0
        # Far less than the grace period: nothing waited for it.
        assert took < 5.0, f"shutdown took {took:.2f}s though every stream ended at once"
        refused = await rpc_error(lambda: quiet.register("CCAgent", timeout=2))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE


async def test_graceful_shutdown_tells_every_stream_why(grpc_clients: GrpcioClients) -> None:
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        streams = []
        for _ in range(16):
            client = grpc_clients.connect(server.target)
            client_id = await in_thread(client.register_id, "CCAgent")
            streams.append(GrpcioStream(client.subscribe("CCAgent", client_id)).start(nursery))
        await wait_until(lambda: len(server.broadcaster.subscribers) == len(streams))
        await server.stop()
        ends = [await stream.wait_end() for stream in streams]
    expected = (grpc.StatusCode.UNAVAILABLE, "server shutting down")
    wrong = [end for end in ends if end != expected]
    assert not wrong, f"{len(wrong)} of {len(ends)} streams ended otherwise, e.g. {wrong[0]}"


def received(stream: GrpcioStream, count: int) -> bool:
    return len(stream.messages) == count


async def test_ordinary_deliveries_go_out_from_publish(grpc_clients: GrpcioClients) -> None:
    """A reading client's small events are sent by publish itself (rpc.writer's
    write_now): its stream's task is not woken for them."""
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target)
        client_id = await in_thread(client.register_id, "CCAgent")
        stream = GrpcioStream(client.subscribe("CCAgent", client_id)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
        for i in range(20):
            server.broadcaster.publish([make_job(i)])
            await wait_until(functools.partial(received, stream, i + 1))
        stats = server.broadcaster.stats
        # The first batch waits for the response headers (the task sends them); the rest
        # go straight from publish.
        assert stats.batches_written_from_publish >= 15, stats
        written = (
            stats.batches_written_from_publish
            + stats.batches_written_at_once
            + stats.batches_written_waiting
        )
        assert written == 20, stats
        assert stats.messages_delivered == 20


async def test_a_publish_to_many_streams_of_one_connection_is_one_write(
    grpc_clients: GrpcioClients,
) -> None:
    streams = 10
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target)  # one channel: one HTTP/2 connection
        collectors = []
        for _ in range(streams):
            client_id = await in_thread(client.register_id, "CCAgent")
            collectors.append(GrpcioStream(client.subscribe("CCAgent", client_id)).start(nursery))
        await wait_until(lambda: len(server.broadcaster.subscribers) == streams)
        server.broadcaster.publish([make_job(0)])  # the response headers go out first
        await wait_until(lambda: all(len(c.messages) == 1 for c in collectors))
        writes = count_writes(server.connections)
        for index in range(1, 6):
            server.broadcaster.publish([make_job(index)])
            await wait_until(functools.partial(all_received, collectors, index + 1))
        # 5 events to 10 streams: 50 messages, in about one write per event.
        assert server.broadcaster.stats.batches_written_from_publish >= 40
        assert len(writes) <= 10, writes


async def test_a_stream_alone_on_its_connection_is_written_within_publish(
    grpc_clients: GrpcioClients,
) -> None:
    """One subscription per channel (the usual client): nothing to coalesce its
    message with, so the bytes reach the socket before publish returns."""
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target)
        client_id = await in_thread(client.register_id, "CCAgent")
        stream = GrpcioStream(client.subscribe("CCAgent", client_id)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
        server.broadcaster.publish([make_job(0)])  # the response headers go out first
        await wait_until(functools.partial(received, stream, 1))
        writes = count_writes(server.connections)
        server.broadcaster.publish([make_job(1)])
        assert len(writes) == 1, writes  # no checkpoint since publish: written in it
        await wait_until(functools.partial(received, stream, 2))
        assert len(writes) == 1, writes
        # A burst in one publish: the first at once, the rest as one batch by the task.
        await trio.testing.wait_all_tasks_blocked()  # the last turn's flush has run
        server.broadcaster.publish([make_job(index) for index in range(2, 12)])
        assert len(writes) == 2, writes
        await wait_until(functools.partial(received, stream, 12))
        assert len(writes) == 3, writes


def all_received(collectors: list[GrpcioStream], count: int) -> bool:
    return all(len(c.messages) == count for c in collectors)
