"""What a client's requests may hold on the server: their size, their time, what follows them.

A job.Job request is a ClientInfo of a few hundred bytes. Before these
bounds, a peer could announce 4 MiB requests on 64 streams of a connection
and trickle them in, and the server held every byte (36 MiB for 8 streams in
a throwaway check), for as long as the connection lived. Raw HTTP/2 peers on
127.0.0.1; time is virtual (`io_clock`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import trio
import trio.testing
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import DataFrame, HeadersFrame

from jobsignal._proto.job import ClientInfo
from jobsignal.rpc.connections import PROTOCOL_ERROR
from jobsignal.rpc.server import RECEIVE_WINDOW, ServerSettings
from jobsignal.rpc.session import SessionSettings
from tests.support.grpc_server import open_jobsignal_server
from tests.support.h2_client import grpc_frame
from tests.support.waiting import wait_until

from .test_hostile_h2 import RawPeer, goaway_of, grpc_request_headers, raw_peer

SUBSCRIBE = "/job.Job/SubscribeJobSummarySignal"
REQUEST_TIMEOUT = SessionSettings().request_timeout
DEADLINE_EXCEEDED = "4"
RESOURCE_EXHAUSTED = "8"


def ended(stream_id: int) -> Callable[[RawPeer], bool]:
    return lambda peer: any(
        isinstance(f, HeadersFrame) and f.stream_id == stream_id and "END_STREAM" in f.flags
        for f in peer.frames
    )


async def call_with(peer: RawPeer, body: bytes, path: str = SUBSCRIBE) -> None:
    """Handshake, then open a call of `path` on stream 1 whose request body is `body`."""
    await peer.handshake()
    await peer.send(
        peer.headers_frame(1, grpc_request_headers(peer.port, path)), DataFrame(1, body)
    )


def status_of(peer: RawPeer, stream_id: int) -> tuple[str, str]:
    headers = dict(peer.headers[stream_id])
    return headers["grpc-status"], headers.get("grpc-message", "")


async def test_the_defaults_are_small() -> None:
    settings = ServerSettings()
    assert settings.max_request_bytes == 4096
    assert settings.session.request_timeout == 10.0


async def test_a_request_that_does_not_arrive_in_time_ends_its_stream(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await call_with(peer, b"\x00" + (100).to_bytes(4, "big") + b"x" * 50)  # half
        opened = trio.current_time()
        with trio.move_on_after(REQUEST_TIMEOUT - 1):
            await peer.read_until(ended(1), within=REQUEST_TIMEOUT)
        assert not ended(1)(peer)
        await peer.read_until(ended(1), within=REQUEST_TIMEOUT)
        assert trio.current_time() - opened == pytest.approx(REQUEST_TIMEOUT, abs=0.5)
        code, message = status_of(peer, 1)
        assert code == DEADLINE_EXCEEDED and "within 10s" in message
        # Only that stream: the connection serves the next request at once.
        await peer.assert_serves_a_request(3)
        assert not server.broadcaster.subscribers


async def test_a_request_over_the_size_limit_is_refused_before_its_body(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await call_with(peer, b"\x00" + (4 * 1024 * 1024).to_bytes(4, "big"))
        await peer.read_until(ended(1))
        code, message = status_of(peer, 1)
        assert code == RESOURCE_EXHAUSTED and "limit of 4096" in message


@pytest.mark.parametrize(
    "path",
    [
        "/grpc.health.v1.Health/Check",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    ],
)
async def test_requests_grpclib_reads_are_held_to_the_same_limit(
    io_clock: trio.testing.MockClock, path: str
) -> None:
    """Health and reflection read their requests through grpclib, which reads the
    length a prefix announces whole before any codec sees it: the stream's reads
    are checked first, so the refusal comes before the body, as for job.Job."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await call_with(peer, b"\x00" + (4 * 1024 * 1024).to_bytes(4, "big"), path)
        await peer.read_until(ended(1))
        code, message = status_of(peer, 1)
        assert code == RESOURCE_EXHAUSTED and "limit of 4096" in message


async def test_what_follows_a_request_is_bounded_by_the_receive_window(
    io_clock: trio.testing.MockClock,
) -> None:
    """A subscription's request, then data nobody reads: the server advertises
    HTTP/2's default window of 64 KiB (grpclib's would be 4 MiB), so a peer that
    goes on sending breaks flow control long before 200 KiB, and is cut off."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        client_id = await peer.register(1)
        assert peer.server_settings().get(SettingCodes.INITIAL_WINDOW_SIZE, 65535) == RECEIVE_WINDOW
        request = grpc_frame(bytes(ClientInfo(role="CCAgent", client_id=client_id)))
        await peer.send(
            peer.headers_frame(3, grpc_request_headers(server.port, SUBSCRIBE)),
            DataFrame(3, request),  # and no END_STREAM: the stream stays open
        )
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
        # (The server may close the connection while these are still going out.)
        with contextlib.suppress(trio.BrokenResourceError):
            await peer.send(*[DataFrame(3, b"x" * 16_000) for _ in range(13)])
        await wait_until(lambda: server.connections.closed_by_server[PROTOCOL_ERROR] == 1)
        await wait_until(lambda: len(server.connections) == 0)
        await wait_until(lambda: not server.broadcaster.subscribers)
        await peer.read_until(lambda p: p.goaway() is not None)
        if peer.goaway() is not None:  # (unless the reset overtook it)
            assert goaway_of(peer)[0] == ErrorCodes.FLOW_CONTROL_ERROR
