"""Odd requests, each found by fuzzing the server with random HTTP/2 frames.

Every one of them must end its own stream with a precise status, log nothing
at ERROR (grpclib logged a traceback for most), and leave its connection
serving. Before the fixes, the grpc-timeout and the no-message cases were
answered UNKNOWN with an ERROR traceback, health and reflection let framing
errors through as UNKNOWN, and a stream reset in the same read as its
malformed HEADERS cost the whole connection (closed as "internal_error").
Raw HTTP/2 peers on 127.0.0.1; time is virtual (`io_clock`).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, GoAwayFrame, RstStreamFrame

from jobsignal.logs import RateLimitedLog
from jobsignal.rpc import connections
from jobsignal.rpc.connections import INTERNAL_ERROR, PROTOCOL_ERROR
from jobsignal.rpc.session import SessionSettings
from tests.support.grpc_server import open_jobsignal_server
from tests.support.waiting import wait_until

from .test_hostile_h2 import RawPeer, goaway_of, grpc_request_headers, raw_peer, register_body
from .test_request_bounds import ended, status_of

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
REGISTER = "/job.Job/Register"
REQUEST_TIMEOUT = SessionSettings().request_timeout
OK, INVALID_ARGUMENT, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL = "0", "3", "4", "12", "13"


pytestmark = pytest.mark.usefixtures("nothing_logged_at_error")


async def call(
    peer: RawPeer, stream_id: int, path: str, body: bytes | None, **headers: str
) -> None:
    """Open a call of `path` on `stream_id` (extra headers with - for _), its request
    `body` then END_STREAM (None: END_STREAM on the HEADERS, no message at all)."""
    fields = grpc_request_headers(peer.port, path)
    fields += [(name.replace("_", "-"), value) for name, value in headers.items()]
    if body is None:
        await peer.send(peer.headers_frame(stream_id, fields, end_stream=True))
    else:
        await peer.send(
            peer.headers_frame(stream_id, fields), DataFrame(stream_id, body, flags=["END_STREAM"])
        )


async def answer(peer: RawPeer, stream_id: int) -> tuple[str, str]:
    await peer.read_until(ended(stream_id))
    return status_of(peer, stream_id)


BAD_MESSAGES = {
    # END_STREAM on the HEADERS: grpclib's health assertion failed (UNKNOWN).
    "none": (None, INVALID_ARGUMENT, "request has no message"),
    # Flagged compressed with no grpc-encoding: grpclib raised NotImplementedError
    # (UNKNOWN). Compressed requests: tests/rpc/test_compressed_requests.py.
    "compressed": (b"\x01\x00\x00\x00\x03abc", INTERNAL, "request message is flagged"),
    # Part of a prefix, or of a body: grpclib's buffer raised AssertionError (UNKNOWN).
    "part-prefix": (b"\x00\x00", INVALID_ARGUMENT, "request truncated"),
    "part-body": (b"\x00\x00\x00\x00\x64" + b"x" * 50, INVALID_ARGUMENT, "request truncated"),
    # A prefix, then the end: grpclib's buffer gave no bytes (no AssertionError).
    "no-body": (b"\x00\x00\x00\x00\x09", INVALID_ARGUMENT, "request truncated"),
}


@pytest.mark.parametrize("path", [HEALTH_CHECK, HEALTH_WATCH, REFLECTION, REGISTER])
@pytest.mark.parametrize("case", BAD_MESSAGES)
async def test_a_bad_request_message_ends_its_stream_with_a_precise_status(
    io_clock: trio.testing.MockClock, path: str, case: str
) -> None:
    body, code, message = BAD_MESSAGES[case]
    if path == REFLECTION and body is None:  # a stream of requests may hold none
        code, message = OK, ""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        await call(peer, 1, path, body)
        answered = await answer(peer, 1)
        assert answered[0] == code and answered[1].startswith(message)
        await peer.assert_serves_a_request(3)


@pytest.mark.parametrize("path", [HEALTH_CHECK, HEALTH_WATCH])
async def test_a_health_request_must_arrive_in_time(
    io_clock: trio.testing.MockClock, path: str
) -> None:
    """As job.Job's: a stream waiting for its request is not held for as long as
    the connection lives."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        await peer.send(peer.headers_frame(1, grpc_request_headers(server.port, path)))
        opened = trio.current_time()
        await peer.read_until(ended(1), within=2 * REQUEST_TIMEOUT)
        assert trio.current_time() - opened == pytest.approx(REQUEST_TIMEOUT, abs=0.5)
        code, message = status_of(peer, 1)
        assert code == DEADLINE_EXCEEDED and "within 10s" in message
        await peer.assert_serves_a_request(3)


@pytest.mark.parametrize("timeout", ["0n", "1u", "999u"])
async def test_a_call_whose_deadline_is_already_over_is_deadline_exceeded(
    io_clock: trio.testing.MockClock, timeout: str
) -> None:
    """grpclib started the deadline in the call's task, found none of it left,
    logged a traceback at ERROR and answered UNKNOWN."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        await call(peer, 1, REGISTER, register_body(), grpc_timeout=timeout)
        assert await answer(peer, 1) == (DEADLINE_EXCEEDED, "deadline exceeded at arrival")
        await call(peer, 3, REGISTER, register_body(), grpc_timeout="1m")  # enough
        assert (await answer(peer, 3))[0] == OK


@pytest.mark.parametrize("peer_stream_limit", [None, 0], ids=["default", "no-server-streams"])
async def test_a_malformed_request_reset_in_the_same_read_costs_only_its_stream(
    io_clock: trio.testing.MockClock, peer_stream_limit: int | None
) -> None:
    """HEADERS without :path, its RST_STREAM and a new stream, in one read: by the
    time the server answers the first, h2 has forgotten it (the new stream's id is
    higher), and the answer raised instead of being dropped: StreamIDTooLowError,
    or TooManyStreamsError where the peer allows the server no streams of its own."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        limit = {} if peer_stream_limit is None else {"max_concurrent_streams": 0}
        await peer.handshake(**limit)
        no_path = [h for h in grpc_request_headers(server.port) if h[0] != ":path"]
        await peer.send(
            peer.headers_frame(1, no_path),
            RstStreamFrame(1, error_code=ErrorCodes.CANCEL),
            peer.headers_frame(3, grpc_request_headers(server.port)),
            DataFrame(3, register_body(), flags=["END_STREAM"]),
        )
        assert (await answer(peer, 3))[0] == OK
        assert peer.goaway() is None
        await peer.assert_serves_a_request(5)
        assert server.connections.closed_by_server[INTERNAL_ERROR] == 0


async def test_a_request_answered_at_once_beside_the_peers_goaway_costs_nothing(
    io_clock: trio.testing.MockClock,
) -> None:
    """A call the server answers itself (its deadline already over) and the peer's
    GOAWAY in one read: h2 has closed the connection by the time the answer goes,
    and the answer raised (the connection closed as "internal_error")."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        fields = [*grpc_request_headers(server.port), ("grpc-timeout", "0n")]
        await peer.send(
            peer.headers_frame(1, fields),
            GoAwayFrame(0, last_stream_id=0, error_code=ErrorCodes.NO_ERROR),
        )
        await peer.read_until(lambda p: False)  # until the server closes
        await wait_until(lambda: len(server.connections) == 0)
        assert server.connections.closed_by_server[INTERNAL_ERROR] == 0


async def test_a_frame_on_a_stream_the_peer_ended_is_named_in_the_log(
    io_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once h2 has forgotten an ended stream (a later one opened), HEADERS on it
    is a connection error (RFC 9113, 5.1): GOAWAY STREAM_CLOSED, and a log line
    that says what happened (h2's text is the stream id alone)."""
    # (The log is rate-limited per kind, across tests: a budget of its own here.)
    monkeypatch.setattr(connections, "fault_log", RateLimitedLog(connections.log))
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        await peer.assert_serves_a_request(1)
        await peer.assert_serves_a_request(3)
        await call(peer, 1, REGISTER, register_body())
        await peer.read_until(lambda p: p.goaway() is not None)
        assert goaway_of(peer)[0] == ErrorCodes.STREAM_CLOSED
        assert server.connections.closed_by_server[PROTOCOL_ERROR] == 1
    assert any("a frame on stream 1, which it had ended" in r.getMessage() for r in caplog.records)
