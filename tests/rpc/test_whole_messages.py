"""A stream ended part-way through a message finishes the message before its status.

Trailers right after part of a gRPC message break the message: grpc-go
reports such a stream as INTERNAL "unexpected EOF", whatever status the
trailers carry (tests/interop/test_grpc_go.py shows it with a real grpc-go
client). So a stream that is ended (replaced, shut down) while the rest of a
begun batch waits for the client's window keeps its turn until the batch is
out, within the send timeout (`rpc/output.py`, `send_in_turn`). Raw HTTP/2
peers on 127.0.0.1 hold the window shut; time is virtual (`io_clock`).
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
import trio
import trio.testing
from h2.settings import SettingCodes
from hyperframe.frame import HeadersFrame, RstStreamFrame, SettingsFrame, WindowUpdateFrame

from jobsignal.fanout import EndReason, Subscriber
from jobsignal.rpc.connections import INTERNAL_ERROR
from jobsignal.rpc.session import SessionSettings
from tests.support.factories import make_job
from tests.support.grpc_server import ServerHarness, open_jobsignal_server
from tests.support.waiting import wait_until

from .test_hostile_h2 import RawPeer, raw_peer

WINDOW = 1000  # the stream window the peer grants: part of one message
SIGNAL_STREAM = 3
ABORTED = "10"
RESOURCE_EXHAUSTED = "8"
SEND_TIMEOUT = SessionSettings().send_timeout


@asynccontextmanager
async def part_way(server: ServerHarness) -> AsyncIterator[tuple[RawPeer, Subscriber]]:
    """A subscriber whose first message has gone out as far as `WINDOW` bytes."""
    async with raw_peer(server.port) as peer:
        await peer.handshake(initial_window_size=WINDOW)
        await peer.subscribe(SIGNAL_STREAM, "CCAgent", await peer.register(1))
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
        (subscriber,) = server.broadcaster.subscribers
        server.broadcaster.publish([make_job(1, npus=256)])
        await peer.read_until(lambda p: received(p) == WINDOW)
        (protocol,) = server.connections.protocols()
        assert protocol.output.has_waiting
        yield peer, subscriber


def subscription_released(server: ServerHarness) -> bool:
    return not server.broadcaster.subscribers and server.registry.active_subscriptions() == 0


def received(peer: RawPeer) -> int:
    return sum(len(data) for data in peer.data_frames(SIGNAL_STREAM))


def trailers_came(peer: RawPeer) -> bool:
    return any(
        isinstance(f, HeadersFrame) and f.stream_id == SIGNAL_STREAM and "END_STREAM" in f.flags
        for f in peer.frames
    )


def messages(peer: RawPeer, stream_id: int) -> list[bytes]:
    """The gRPC messages received whole on `stream_id` (a cut last one is left out)."""
    body = b"".join(peer.data_frames(stream_id))
    found = []
    while len(body) >= 5 and len(body) >= 5 + (length := int.from_bytes(body[1:5], "big")):
        found.append(body[5 : 5 + length])
        body = body[5 + length :]
    return found


def cut_bytes(peer: RawPeer, stream_id: int) -> int:
    """The bytes received on `stream_id` of a message not (yet) finished."""
    whole = sum(5 + len(message) for message in messages(peer, stream_id))
    return sum(len(data) for data in peer.data_frames(stream_id)) - whole


def whole_messages(peer: RawPeer) -> list[int]:
    """The lengths of the gRPC messages received on the signal stream; raises if one is cut."""
    cut = cut_bytes(peer, SIGNAL_STREAM)
    assert not cut, f"a message cut after {cut} bytes (its prefix included)"
    return [len(message) for message in messages(peer, SIGNAL_STREAM)]


async def test_a_replaced_stream_finishes_its_message_before_the_status(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_jobsignal_server() as server, part_way(server) as (peer, subscriber):
        subscriber.end(EndReason.REPLACED)
        with trio.move_on_after(SEND_TIMEOUT / 2):
            await peer.read_until(trailers_came, within=SEND_TIMEOUT)
        assert not trailers_came(peer), "the status came before the rest of the message"
        await peer.send(WindowUpdateFrame(SIGNAL_STREAM, window_increment=1 << 20))
        await peer.read_until(trailers_came)
        assert len(whole_messages(peer)) == 1
        assert dict(peer.headers[SIGNAL_STREAM])["grpc-status"] == ABORTED
        await wait_until(lambda: subscription_released(server))


async def test_a_message_the_client_never_makes_room_for_waits_only_the_send_timeout(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_jobsignal_server() as server, part_way(server) as (peer, subscriber):
        waiting_since = trio.current_time()
        subscriber.end(EndReason.REPLACED)
        await peer.read_until(trailers_came, within=2 * SEND_TIMEOUT)
        assert trio.current_time() - waiting_since == pytest.approx(SEND_TIMEOUT, abs=1.0)
        assert dict(peer.headers[SIGNAL_STREAM])["grpc-status"] == ABORTED
        await wait_until(lambda: subscription_released(server))


@pytest.mark.parametrize("how", ["reset", "disconnect"])
async def test_a_client_that_leaves_part_way_is_released_at_once(
    io_clock: trio.testing.MockClock, how: str
) -> None:
    """Its stream reset or its connection gone while the server finishes a
    message for a stream it ended: nothing waits for the send timeout."""
    async with open_jobsignal_server() as server, part_way(server) as (peer, subscriber):
        subscriber.end(EndReason.REPLACED)
        await trio.sleep(1.0)
        left_at = trio.current_time()
        if how == "reset":
            await peer.send(RstStreamFrame(SIGNAL_STREAM, error_code=8))  # CANCEL
        else:
            await peer.stream.aclose()
        await wait_until(lambda: subscription_released(server), within=SEND_TIMEOUT)
        assert trio.current_time() - left_at < 1.0


async def test_a_client_too_far_behind_is_not_waited_for(
    io_clock: trio.testing.MockClock,
) -> None:
    """Ended as SLOW (its queue overflowed), the client would take the rest of
    the message no sooner than the rest of its backlog: its status comes at
    once, after the part it has, and its subscription is released."""
    async with open_jobsignal_server() as server, part_way(server) as (peer, subscriber):
        ended_at = trio.current_time()
        subscriber.end(EndReason.SLOW)
        await peer.read_until(trailers_came)
        assert trio.current_time() - ended_at < 1.0
        assert dict(peer.headers[SIGNAL_STREAM])["grpc-status"] == RESOURCE_EXHAUSTED
        await wait_until(lambda: subscription_released(server))


@contextmanager
def interrupted_after(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in whatever code runs once `seconds` of real time have
    passed: code that never yields to the loop (or to trio's clock) is stopped."""

    def interrupt(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds:g}s of real time")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


async def test_a_window_the_peer_lowers_below_zero_holds_the_rest_of_the_message(
    io_clock: trio.testing.MockClock,
) -> None:
    """A lower SETTINGS_INITIAL_WINDOW_SIZE takes the difference from every stream's
    window, below zero here (RFC 9113, 6.9.2). The server spun for ever on such a
    window, at full CPU, its memory growing, and every client with it (found by
    fuzzing). Now the rest waits, the server goes on serving others, and the
    message arrives whole once the peer opens the window again."""
    async with open_jobsignal_server() as server, part_way(server) as (peer, _):
        with interrupted_after(30.0):  # a regression spins inside one loop turn
            await peer.send(SettingsFrame(0, settings={SettingCodes.INITIAL_WINDOW_SIZE: 0}))
            await peer.send(WindowUpdateFrame(0, window_increment=1 << 20))  # the output pumps
            async with raw_peer(server.port) as other:
                await other.handshake()
                await other.assert_serves_a_request(1)
        assert server.connections.closed_by_server[INTERNAL_ERROR] == 0
        assert received(peer) == WINDOW  # nothing more through a window below zero
        await peer.send(SettingsFrame(0, settings={SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20}))
        await peer.read_until(lambda p: not cut_bytes(p, SIGNAL_STREAM))
        assert len(whole_messages(peer)) == 1
        assert not trailers_came(peer)  # the subscription goes on
