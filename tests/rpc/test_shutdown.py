"""Peers that stop reading, and the server's stop: the send timeout ends a stream
whose batch cannot go out, and the stop leaves no connection behind (refused ones
and peers that do not read are closed too), so no socket or asyncio transport
outlives the server's loop."""

from __future__ import annotations

import gc
import warnings

import trio

from jobsignal.rpc.guard import ProtocolLimits
from jobsignal.rpc.limits import Limits
from jobsignal.rpc.session import SessionSettings
from tests.support.factories import make_job
from tests.support.grpc_server import ServerHarness, local_settings, open_jobsignal_server
from tests.support.waiting import wait_until

from .test_hostile_h2 import RawPeer, raw_peer

WAIT = 10.0


def assert_nothing_leaked() -> None:
    """A transport or socket the server forgot warns when it is collected."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


async def test_a_refused_connection_open_at_shutdown_is_closed() -> None:
    settings = local_settings(limits=Limits(max_connections=1, max_connections_per_ip=1))
    async with (
        open_jobsignal_server(settings) as server,
        raw_peer(server.port) as admitted,
        raw_peer(server.port) as refused,
    ):
        await admitted.handshake()
        await refused.handshake()
        await wait_until(lambda: server.connections.counter.refused == 1, within=WAIT)
        # The refused one lingers for its request (5 s); the server stops first.
        await server.stop()
        assert server.connections.open_transports == 0
        await admitted.read_until(lambda p: False, within=2.0)
        await refused.read_until(lambda p: False, within=2.0)
        assert admitted.closed and refused.closed
        assert admitted.goaway() is not None and refused.goaway() is not None
    assert_nothing_leaked()


async def subscribe_then_stop_reading(peer: RawPeer, server: ServerHarness) -> None:
    """Open the windows wide, register, subscribe, then read nothing while big
    events fill the socket, until the server can no longer write to it."""
    await peer.subscribe_wide_open()
    await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=WAIT)
    (protocol,) = server.connections.protocols()
    for i in range(40):
        server.broadcaster.publish([make_job(i, npus=2048)])
        await trio.sleep(0.01)
    await wait_until(lambda: protocol._write_blocked, within=WAIT)


async def test_a_peer_that_does_not_read_is_dropped_at_the_end_of_the_grace() -> None:
    grace = 1.0
    settings = local_settings(
        shutdown_grace=grace,
        # Longer than the test: only the stop may close it.
        protocol_limits=ProtocolLimits(write_stall_timeout=600.0),
        session=SessionSettings(send_timeout=600.0),
    )
    async with (
        open_jobsignal_server(settings) as server,
        raw_peer(server.port, receive_buffer=4096) as peer,
    ):
        await subscribe_then_stop_reading(peer, server)
        started = trio.current_time()
        await server.stop()
        stopped_after = trio.current_time() - started
        assert server.connections.open_transports == 0
        assert stopped_after < grace + 2.0
        # Dropped: the socket reads whatever was buffered, then the end.
        with trio.fail_after(WAIT):
            while await receive_or_reset(peer.stream):
                pass
    assert_nothing_leaked()


async def test_a_batch_that_waits_past_the_send_timeout_ends_the_stream_as_too_slow() -> None:
    """The send timeout is the writer's: it applies only to a batch that has to wait."""
    send_timeout = 0.5
    settings = local_settings(
        protocol_limits=ProtocolLimits(write_stall_timeout=600.0),
        session=SessionSettings(send_timeout=send_timeout),
    )
    async with (
        open_jobsignal_server(settings) as server,
        raw_peer(server.port, receive_buffer=4096) as peer,
    ):
        await subscribe_then_stop_reading(peer, server)
        await wait_until(
            lambda: server.broadcaster.stats.stream_ends["slow"] == 1,
            within=send_timeout + WAIT,
            what="the stalled stream to end as too slow",
        )
        assert not server.broadcaster.subscribers
        assert server.broadcaster.stats.batches_written_at_once >= 1


async def receive_or_reset(stream: trio.SocketStream) -> bytes:
    try:
        return await stream.receive_some(1 << 20)
    except trio.BrokenResourceError:  # aborted: the server's kernel sent RST
        return b""
