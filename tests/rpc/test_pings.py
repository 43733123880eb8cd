"""Client PINGs as heartbeats, idle rule, ping floods (docs/architecture.md sections 3, 8).

These run on the real clock with short timeouts. grpcio's core sends at most
about one keepalive PING per second, whatever `grpc.keepalive_time_ms` says,
so the tests allow pings every 0.5 s (the default policy, one per 4 s, would
rightly call a 1 s keepalive a flood).
"""

from __future__ import annotations

import grpc
import pytest
import trio

from jobsignal.rpc.activity import PingPolicy
from jobsignal.rpc.session import SessionSettings
from tests.support.factories import make_job
from tests.support.grpc_server import local_settings, open_jobsignal_server
from tests.support.grpcio import (
    PING_FLOOD_LOG,
    GrpcioClients,
    GrpcioStream,
    assert_ended_for_too_many_pings,
    rpc_error,
)
from tests.support.threads import in_thread
from tests.support.waiting import wait_until

KEEPALIVE = {
    "keepalive_time_ms": 1000,
    "keepalive_permit_without_calls": 1,
    "http2__max_pings_without_data": 0,
}
LENIENT = PingPolicy(min_interval=0.5, max_strikes=2)


async def test_client_keepalive_pings_are_seen_by_the_server(
    grpc_clients: GrpcioClients,
) -> None:
    """Guards the grpclib protocol subclass (grpclib is pinned for it)."""
    async with (
        trio.open_nursery() as nursery,
        open_jobsignal_server(local_settings(ping_policy=LENIENT)) as server,
    ):
        client = grpc_clients.connect(server.target, **KEEPALIVE)
        client_id = await in_thread(client.register_id, "CCAgent")
        GrpcioStream(client.subscribe("CCAgent", client_id)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
        (protocol,) = server.connections.protocols()
        # The stream is quiet from here on: any further PING is keepalive.
        before = protocol.activity.pings_received
        await wait_until(
            lambda: protocol.activity.pings_received >= before + 2,
            within=5,
            what="two keepalive pings",
        )
        assert server.connections.ping_floods == 0


async def test_idle_rule_spares_pinging_clients_and_closes_silent_ones(
    grpc_clients: GrpcioClients,
) -> None:
    idle = 2.5
    settings = local_settings(session=SessionSettings(idle_timeout=idle), ping_policy=LENIENT)
    async with trio.open_nursery() as nursery, open_jobsignal_server(settings) as server:
        pinging = grpc_clients.connect(server.target, **KEEPALIVE)
        silent = grpc_clients.connect(server.target)
        pinging_id = await in_thread(pinging.register_id, "CCAgent")
        silent_id = await in_thread(silent.register_id, "CCAgent")
        kept = GrpcioStream(pinging.subscribe("CCAgent", pinging_id)).start(nursery)
        dropped = GrpcioStream(silent.subscribe("CCAgent", silent_id)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 2)
        subscribed_at = trio.current_time()
        assert len(server.connections) == 2

        code, details = await dropped.wait_end(within=idle + 5)
        ended_after = trio.current_time() - subscribed_at
        assert code == grpc.StatusCode.UNAVAILABLE
        assert details is not None and f"idle for {idle:g}s" in details, details
        assert idle - 0.5 < ended_after < idle + 2.5, ended_after
        # Its registration is released and its connection closed by the server.
        await wait_until(lambda: server.registry.active_subscriptions() == 1)
        await wait_until(lambda: len(server.connections) == 1, what="idle connection closed")
        (survivor,) = server.connections.protocols()
        assert survivor.activity.pings_received >= 2
        gone = await rpc_error(lambda: list(silent.subscribe("CCAgent", silent_id, timeout=5)))
        assert gone.code() == grpc.StatusCode.FAILED_PRECONDITION

        # The pinging subscription outlives the idle timeout and still delivers.
        await trio.sleep_until(subscribed_at + idle + 1.0)
        assert not kept.ended.is_set(), (kept.code, kept.details)
        job = make_job(5)
        server.broadcaster.publish([job])
        (message,) = await kept.wait_for(1)
        assert message.jobId == job.job_id


async def test_ping_flood_gets_goaway_while_others_are_served(
    grpc_clients: GrpcioClients, capfd: pytest.CaptureFixture[str]
) -> None:
    settings = local_settings(ping_policy=PingPolicy(min_interval=10, max_strikes=2))
    async with trio.open_nursery() as nursery, open_jobsignal_server(settings) as server:
        polite = grpc_clients.connect(server.target)
        flooder = grpc_clients.connect(
            server.target,
            keepalive_time_ms=100,
            keepalive_permit_without_calls=1,
            http2__max_pings_without_data=0,
        )
        polite_id = await in_thread(polite.register_id, "CCAgent")
        flooder_id = await in_thread(flooder.register_id, "FdAgent")
        served = GrpcioStream(polite.subscribe("CCAgent", polite_id)).start(nursery)
        flooding = GrpcioStream(flooder.subscribe("FdAgent", flooder_id)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 2)

        assert_ended_for_too_many_pings(*await flooding.wait_end(within=8))
        # What grpcio read off the wire, whatever its version says in the status: the
        # GOAWAY's code and text (it throttles its keepalive on them).
        assert PING_FLOOD_LOG in capfd.readouterr().err
        assert server.connections.ping_floods == 1
        await wait_until(lambda: server.registry.active_subscriptions() == 1)
        await wait_until(lambda: len(server.connections) == 1)

        job = make_job(3)
        server.broadcaster.publish([job])
        (message,) = await served.wait_for(1)
        assert message.jobId == job.job_id
        assert (await in_thread(polite.register, "CCAgent")).code == 200
        assert server.connections.ping_floods == 1
