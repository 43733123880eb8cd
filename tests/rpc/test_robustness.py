"""Slow, stuck, vanished and malformed clients (docs/architecture.md sections 6 and 7).

One stalled reader among fifty must not delay the others and is cut off;
clients that disconnect or die release their subscription; peers that go
silent are found by the server's keepalive pings; malformed HTTP/2 and gRPC
requests get a clear status and leave the server serving everyone else.
Malformed requests are written with the `h2` state machine over a plain
trio socket.
"""

from __future__ import annotations

import json
import subprocess

import grpc
import pytest
import trio

from jobsignal.fanout import Broadcaster, EndReason
from tests.support.factories import make_job
from tests.support.grpc_server import (
    ServerHarness,
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
    rpc_error,
)
from tests.support.h2_client import H2Client, client_info, grpc_frame
from tests.support.threads import in_thread
from tests.support.waiting import wait_until

# -- a stalled reader among many ----------------------------------------------------------


async def test_stalled_client_is_cut_off_without_delaying_the_others(
    grpc_clients: GrpcioClients,
) -> None:
    normal_count, rounds, per_round = 50, 10, 8
    broadcaster = Broadcaster(max_pending=32)
    async with (
        trio.open_nursery() as nursery,
        open_jobsignal_server(
            broadcaster=broadcaster, registry=make_registry(max_subscriptions_per_role=100)
        ) as server,
    ):
        normal = []
        for _ in range(normal_count):
            client = grpc_clients.connect(server.target)
            client_id = await in_thread(client.register_id, "CCAgent")
            normal.append(GrpcioStream(client.subscribe("CCAgent", client_id)).start(nursery))
        # Without BDP probing the stalled client's receive window stays at
        # 64 KiB, so a few 16 KiB messages fill it and the server's sends block.
        staller = grpc_clients.connect(server.target, http2__bdp_probe=0)
        stalled_id = await in_thread(staller.register_id, "FdAgent")
        stalled_call = staller.subscribe("FdAgent", stalled_id)
        await wait_until(lambda: len(broadcaster.subscribers) == normal_count + 1)
        stalled = server.subscriber(stalled_id)

        warm_up = make_job(1000)
        broadcaster.publish([warm_up])
        assert (await in_thread(next, stalled_call)).jobId == warm_up.job_id
        # From here on the stalled client never reads again (until the end).

        big = "x" * 16 * 1024
        jobs = [make_job(i, hccl_json=big) for i in range(rounds * per_round)]
        slowest_round = 0.0
        for start in range(0, len(jobs), per_round):
            broadcaster.publish(jobs[start : start + per_round])
            delivered = 1 + start + per_round

            def all_delivered(count: int = delivered) -> bool:
                return all(len(stream.messages) >= count for stream in normal)

            took = await wait_until(
                all_delivered,
                within=15,
                what=f"all {normal_count} normal subscribers to get {delivered} messages",
            )
            slowest_round = max(slowest_round, took)

        # The stalled subscriber was ended as too slow and its queue dropped.
        assert stalled.end_reason is EndReason.SLOW
        await wait_until(lambda: stalled not in broadcaster.subscribers)
        assert (stalled.pending, stalled.pending_bytes) == (0, 0)
        assert server.registry.active_subscriptions("FdAgent") == 0
        assert server.registry.active_subscriptions("CCAgent") == normal_count
        assert len(broadcaster.subscribers) == normal_count

        # Draining now yields what was in flight, then RESOURCE_EXHAUSTED.
        rest = GrpcioStream(stalled_call).start(nursery)
        code, details = await rest.wait_end()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details is not None and "behind" in details, details

    expected = [warm_up.job_id] + [job.job_id for job in jobs]
    for stream in normal:
        assert [message.jobId for message in stream.messages] == expected
    in_flight = [message.jobId for message in rest.messages]
    assert len(in_flight) < len(jobs) // 2
    assert in_flight == expected[1 : 1 + len(in_flight)]
    assert slowest_round < 8.0, f"a round took {slowest_round:.2f}s"


# -- clients that go away ---------------------------------------------------------------


def all_released(server: ServerHarness) -> bool:
    return (
        not server.broadcaster.subscribers
        and server.registry.active_subscriptions() == 0
        and len(server.connections) == 0
    )


async def test_closed_channel_releases_its_subscriptions(grpc_clients: GrpcioClients) -> None:
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target)
        signal_id = await in_thread(client.register_id, "CCAgent")
        list_id = await in_thread(client.register_id, "DefaultUser1")
        signals = GrpcioStream(client.subscribe("CCAgent", signal_id)).start(nursery)
        lists = GrpcioStream(client.subscribe_list("DefaultUser1", list_id)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 2)
        server.broadcaster.publish([make_job(1)])
        await signals.wait_for(1)
        await lists.wait_for(2)

        await in_thread(client.close)
        assert (await signals.wait_end())[0] == grpc.StatusCode.CANCELLED
        assert (await lists.wait_end())[0] == grpc.StatusCode.CANCELLED
        await wait_until(lambda: all_released(server), what="subscriptions released")
        # The server carries on publishing without the departed subscribers.
        server.broadcaster.publish([make_job(2)])
        assert server.broadcaster.job_count() == 2


async def read_json_line(stream: trio.abc.ReceiveStream, buffer: bytearray) -> object:
    while b"\n" not in buffer:
        chunk = await stream.receive_some()
        if not chunk:
            raise AssertionError(f"client exited; output so far: {bytes(buffer)!r}")
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return json.loads(line)


async def test_killed_client_process_releases_its_subscription(
    grpcio_stubs: GrpcioStubs,
) -> None:
    async with open_jobsignal_server() as server:
        process = await trio.lowlevel.open_process(
            cli_command("subscribe", server.target, "CCAgent"),
            stdout=subprocess.PIPE,
            env=cli_env(grpcio_stubs),
        )
        try:
            assert process.stdout is not None
            output = bytearray()
            with trio.fail_after(20):
                registered = await read_json_line(process.stdout, output)
            assert isinstance(registered, dict) and "registered" in registered
            await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=10)
            job = make_job(4)
            server.broadcaster.publish([job])
            with trio.fail_after(5):
                received = await read_json_line(process.stdout, output)
            assert isinstance(received, dict) and received["jobId"] == job.job_id
        finally:
            process.kill()
            with trio.move_on_after(5):
                await process.wait()
        await wait_until(lambda: all_released(server), what="subscription released")


# -- raw HTTP/2 ------------------------------------------------------------------------


async def assert_still_serving(server: ServerHarness, grpc_clients: GrpcioClients) -> None:
    """A well-behaved grpcio client is served, and no stray connection lingers."""
    client = grpc_clients.connect(server.target)
    assert (await in_thread(client.register, "CCAgent")).code == 200
    await in_thread(client.close)
    await wait_until(lambda: len(server.connections) == 0, what="connections closed")


async def test_garbage_instead_of_the_http2_preface(grpc_clients: GrpcioClients) -> None:
    async with open_jobsignal_server() as server:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: jobsignal\r\n\r\n" + bytes(range(256)))
        with trio.fail_after(5):
            while await stream.receive_some():
                pass  # the server's SETTINGS, maybe a GOAWAY, then EOF
        await stream.aclose()
        await assert_still_serving(server, grpc_clients)


GRPC = "application/grpc"
REGISTER = "/job.Job/Register"
SUBSCRIBE = "/job.Job/SubscribeJobSummarySignal"
CC_AGENT = grpc_frame(client_info("CCAgent"))
NOT_UTF8 = grpc_frame(b"\x0a\x02\xff\xfe")  # a role of two bytes that are not UTF-8
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
#: id: (path, body, content-type, HTTP status, grpc-status, words of grpc-message)
MALFORMED: dict[str, tuple[str, bytes, str, str, int | None, str]] = {
    "wrong-content-type": (REGISTER, CC_AGENT, "application/json", "415", None, "content-type"),
    "register-invalid-utf8": (REGISTER, NOT_UTF8, GRPC, "200", INVALID, "ClientInfo"),
    "subscribe-invalid-utf8": (SUBSCRIBE, NOT_UTF8, GRPC, "200", INVALID, "ClientInfo"),
    "unknown-method": ("/job.Job/Unsubscribe", CC_AGENT, GRPC, "200", UNIMPLEMENTED, ""),
    "unknown-service": ("/no.such.Service/Register", CC_AGENT, GRPC, "200", UNIMPLEMENTED, ""),
}


@pytest.mark.parametrize(
    ("path", "body", "content_type", "want_status", "want_grpc_status", "want_message"),
    MALFORMED.values(),
    ids=MALFORMED.keys(),
)
async def test_malformed_request_gets_a_clear_answer(
    grpc_clients: GrpcioClients,
    path: str,
    body: bytes,
    content_type: str,
    want_status: str,
    want_grpc_status: int | None,
    want_message: str,
) -> None:
    async with open_jobsignal_server() as server:
        peer = await H2Client.connect(server.port)
        response = await peer.call(path, body, content_type=content_type)
        await peer.aclose()
        assert response.headers[":status"] == want_status
        if want_grpc_status is not None:
            assert response.grpc_status == want_grpc_status, response
        assert want_message.lower() in response.grpc_message.lower(), response
        assert len(server.registry) == 0
        await assert_still_serving(server, grpc_clients)


async def test_oversize_request_is_resource_exhausted(grpc_clients: GrpcioClients) -> None:
    async with open_jobsignal_server(local_settings(max_request_bytes=1024)) as server:
        client = grpc_clients.connect(server.target)
        huge_role = "x" * 10 * 1024
        error = await rpc_error(lambda: client.register(huge_role))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1024" in error.details(), error.details()
        stream_error = await rpc_error(lambda: list(client.subscribe("CCAgent", huge_role)))
        assert stream_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(server.registry) == 0
        await in_thread(client.close)
        await assert_still_serving(server, grpc_clients)


@pytest.mark.parametrize("rpc", ["register", "subscribe"])
async def test_a_huge_client_id_or_role_is_refused_without_being_echoed(
    grpc_clients: GrpcioClients, caplog: pytest.LogCaptureFixture, rpc: str
) -> None:
    """Under the request size limit (4 KiB), but no role or id is 3,000 characters."""
    async with open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target)
        huge = "x" * 3_000
        if rpc == "register":
            error = await rpc_error(lambda: client.register(huge))
        else:
            error = await rpc_error(lambda: list(client.subscribe("CCAgent", huge)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "3000 characters" in error.details(), error.details()
        assert len(error.details()) < 200
        assert all(len(r.getMessage()) < 1000 for r in caplog.records)
        assert len(server.registry) == 0
        await in_thread(client.close)
        await assert_still_serving(server, grpc_clients)


# -- request framing (fixed in 62dbaf8: jobsignal/rpc/requests.py) --------------------------


async def test_truncated_protobuf_is_invalid_argument(grpc_clients: GrpcioClients) -> None:
    """betterproto2 alone accepts a length-delimited field running past the end."""
    async with open_jobsignal_server() as server:
        peer = await H2Client.connect(server.port)
        truncated = client_info("CCAgent") + b"\x1a\x64abc"  # clientId: 100 bytes, 3 follow
        response = await peer.call("/job.Job/Register", grpc_frame(truncated))
        await peer.aclose()
        assert response.grpc_status == grpc.StatusCode.INVALID_ARGUMENT.value[0], response
        assert "ClientInfo" in response.grpc_message, response
        assert len(server.registry) == 0
        await assert_still_serving(server, grpc_clients)


async def test_declared_oversize_request_is_refused_before_buffering() -> None:
    async with open_jobsignal_server(local_settings(max_request_bytes=1024)) as server:
        peer = await H2Client.connect(server.port)
        # Announces 64 MiB, sends 16 KiB of it and keeps the stream open: the
        # prefix alone must be enough to refuse it.
        stream_id = await peer.request(
            "/job.Job/Register",
            grpc_frame(b"x" * 16 * 1024, length=64 << 20),
            end_stream=False,
        )
        with trio.move_on_after(2):
            await peer.response(stream_id)
        response = peer.responses[stream_id]
        await peer.aclose()
        refused = (
            response.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            or response.reset is not None
        )
        assert refused, f"server still waiting for the rest of a 64 MiB request: {response}"


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(None, id="no-request-message"),
        pytest.param(grpc_frame(client_info("CCAgent"), compressed=True), id="compressed-flag"),
        pytest.param(grpc_frame(client_info("CCAgent"))[:8], id="truncated-frame"),
    ],
)
async def test_request_framing_errors_get_a_precise_status(
    grpc_clients: GrpcioClients, body: bytes | None
) -> None:
    """Not UNKNOWN 'Internal Server Error', which is an exception escaping the handler."""
    async with open_jobsignal_server() as server:
        peer = await H2Client.connect(server.port)
        response = await peer.call("/job.Job/Register", body)
        await peer.aclose()
        allowed = {
            grpc.StatusCode.INTERNAL.value[0],
            grpc.StatusCode.INVALID_ARGUMENT.value[0],
            grpc.StatusCode.UNIMPLEMENTED.value[0],
        }
        assert response.grpc_status in allowed, response
        assert len(server.registry) == 0
        await assert_still_serving(server, grpc_clients)
