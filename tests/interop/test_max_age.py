"""The maximum connection age as grpcio and grpc-go live through it (real clock, short).

A connection aged 1 s (less or more 10 %) with a 1 s grace: the client's
subscription goes on through the GOAWAYs and receives, then ends with
UNAVAILABLE "the connection reached its maximum age"; the client registers
and subscribes again on the same channel, which the server sees on a new
connection, and receives the next event there. (The timing itself, and the
default of no grace, are tested in virtual time: tests/rpc/test_max_age.py.)
"""

from __future__ import annotations

from pathlib import Path

import grpc
import trio

from jobsignal.rpc.connections import MAX_AGE
from jobsignal.rpc.max_age import MaxAgePolicy
from tests.support.factories import make_job
from tests.support.grpc_server import ServerHarness, local_settings, open_jobsignal_server
from tests.support.grpcio import GrpcioClients, GrpcioStream
from tests.support.threads import in_thread
from tests.support.waiting import wait_until

from .peers import code, running
from .test_grpc_go import go

SETTINGS = local_settings(max_age=MaxAgePolicy(age=1.0, grace=1.0))
ROLE = "CCAgent"


def subscriber_peer(server: ServerHarness) -> str:
    """The address:port of the one live subscription's connection."""
    (subscriber,) = server.broadcaster.subscribers
    peer: str = subscriber.group.peer  # type: ignore[attr-defined]
    return peer


async def test_a_grpcio_subscriber_reconnects_at_the_maximum_age_and_keeps_receiving(
    grpc_clients: GrpcioClients,
) -> None:
    async with trio.open_nursery() as nursery, open_jobsignal_server(SETTINGS) as server:
        client = grpc_clients.connect(server.target)
        client_id = await in_thread(client.register_id, ROLE)
        first = GrpcioStream(client.subscribe(ROLE, client_id, timeout=30)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
        first_connection = subscriber_peer(server)
        await wait_until(lambda: server.connections.closed_by_server[MAX_AGE] >= 1)
        server.broadcaster.publish([make_job(1)])  # within the grace: still delivered
        await first.wait_for(1)
        status, details = await first.wait_end(within=5.0)
        assert status == grpc.StatusCode.UNAVAILABLE
        assert details is not None and "maximum age" in details
        # Again on the same channel: grpcio opens a new connection.
        client_id = await in_thread(client.register_id, ROLE)
        second = GrpcioStream(client.subscribe(ROLE, client_id, timeout=30)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
        assert subscriber_peer(server) != first_connection
        server.broadcaster.publish([make_job(2)])
        (message,) = await second.wait_for(1)
        assert message.jobId == make_job(2).job_id
        assert server.broadcaster.stats.stream_ends["max_age"] == 1
        client.close()
        await second.wait_end()


async def test_a_grpc_go_subscriber_reconnects_at_the_maximum_age_and_keeps_receiving(
    go_peer: Path,
) -> None:
    async with open_jobsignal_server(SETTINGS) as server:
        argv = go(go_peer, "resubscribe", server.target, count=2, resubscribes=1)
        async with running(argv) as peer:
            await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
            first_connection = subscriber_peer(server)
            await peer.wait_for(lambda p: bool(p.goaways()), within=5, what="the GOAWAY")
            server.broadcaster.publish([make_job(1)])  # within the grace: still delivered
            await peer.wait_for(lambda p: len(p.messages) == 1, within=5, what="job 1")
            await peer.wait_for(lambda p: bool(p.of("end")), within=5, what="the stream end")
            await wait_until(
                lambda: (
                    len(server.broadcaster.subscribers) == 1
                    and subscriber_peer(server) != first_connection
                ),
                what="the subscription on a new connection",
            )
            server.broadcaster.publish([make_job(2)])
            await peer.wait_exit()
        end = peer.end()
        assert end["code"] == code(grpc.StatusCode.UNAVAILABLE), peer.describe()
        assert "maximum age" in end["message"]
        assert [s["jobId"] for s in peer.signals] == [make_job(1).job_id, make_job(2).job_id]
        assert {g["debug"] for g in peer.goaways()} == {MAX_AGE}
        assert peer.goaways()[0]["code"] == 0  # NO_ERROR
        assert len(peer.of("dialed")) >= 2, peer.describe()
        assert peer.returncode == 0
