"""Peers that stop reading, and the server's stop: the send timeout ends a stream
whose batch cannot go out, and the stop leaves no connection behind (refused ones
and peers that do not read are closed too), so no socket or asyncio transport
outlives the server's loop."""

from __future__ import annotations

import gc
import warnings

import grpclib.const
import pytest
import trio
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, WindowUpdateFrame

from jobsignal._proto.job import Status
from jobsignal.rpc.guard import ProtocolLimits
from jobsignal.rpc.limits import Limits
from jobsignal.rpc.session import SessionSettings
from tests.support.factories import make_job
from tests.support.grpc_server import ServerHarness, local_settings, open_jobsignal_server
from tests.support.waiting import wait_until

from .test_hostile_h2 import RawPeer, grpc_request_headers, raw_peer, register_body

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


async def slow_subscription(peer: RawPeer, server: ServerHarness, stream_window: int) -> None:
    """Register, then subscribe on stream 3 with `stream_window` bytes of window that
    the peer never opens further (it keeps reading, so only the window holds the
    server back), and publish an event larger than that window."""
    await peer.handshake(initial_window_size=stream_window)
    await peer.send(
        peer.headers_frame(1, grpc_request_headers(peer.port)),
        DataFrame(1, register_body("DefaultUser1"), flags=["END_STREAM"]),
        WindowUpdateFrame(1, window_increment=1_000),  # room for the Register reply
    )
    await peer.read_until(lambda p: 1 in p.ended_streams())
    client_id = Status.parse(b"".join(peer.data_frames(1))[5:]).client_id
    await peer.subscribe(3, "DefaultUser1", client_id)
    await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=WAIT)
    server.broadcaster.publish([make_job(0, npus=256)])


@pytest.mark.parametrize("stream_window", [0, 1_000], ids=["nothing_sent", "part_sent"])
async def test_a_slow_stream_cut_off_mid_message_is_reset_instead_of_ended_with_trailers(
    stream_window: int,
) -> None:
    """Trailers after part of a message would make the client fail to decode it
    (INTERNAL); the server resets such a stream with ENHANCE_YOUR_CALM, which gRPC
    clients read as RESOURCE_EXHAUSTED. A batch of which nothing went out still
    ends with trailers and their message."""
    send_timeout = 0.5
    settings = local_settings(
        protocol_limits=ProtocolLimits(write_stall_timeout=600.0),
        session=SessionSettings(send_timeout=send_timeout),
    )
    async with open_jobsignal_server(settings) as server, raw_peer(server.port) as peer:
        await slow_subscription(peer, server, stream_window)
        await peer.read_until(
            lambda p: 3 in p.resets() or 3 in p.ended_streams(), within=send_timeout + WAIT
        )
        assert server.broadcaster.stats.stream_ends["slow"] == 1
        sent = sum(len(data) for data in peer.data_frames(3))
        assert sent == stream_window  # the window's worth of the message, no more
        trailers = dict(peer.headers[3])
        if stream_window:
            assert peer.resets()[3] == ErrorCodes.ENHANCE_YOUR_CALM
            assert "grpc-status" not in trailers
        else:
            assert trailers["grpc-status"] == str(grpclib.const.Status.RESOURCE_EXHAUSTED.value)
            assert "fell too far behind" in trailers["grpc-message"]


async def test_a_stream_replaced_mid_message_is_reset_with_cancel() -> None:
    """The same for a stream that ends otherwise mid-message, here replaced by a
    newer subscription with its clientId: RST_STREAM CANCEL, not ABORTED trailers."""
    settings = local_settings(
        protocol_limits=ProtocolLimits(write_stall_timeout=600.0),
        session=SessionSettings(send_timeout=600.0),
    )
    async with open_jobsignal_server(settings) as server, raw_peer(server.port) as peer:
        await slow_subscription(peer, server, 1_000)
        await peer.read_until(lambda p: len(p.data_frames(3)) > 0)
        (subscriber,) = server.broadcaster.subscribers
        await peer.subscribe(5, "DefaultUser1", subscriber.client_id)
        await peer.read_until(lambda p: 3 in p.resets())
        assert peer.resets()[3] == ErrorCodes.CANCEL
        assert "grpc-status" not in dict(peer.headers[3])
        assert server.broadcaster.stats.stream_ends["replaced"] == 1
