"""The relay's gRPC client on h2 (jobsignal/relay/upstream.py), against a scripted h2 server.

No sockets: the client and an h2 server connection talk over
`trio.testing.memory_stream_pair`, so keepalive is timed in virtual time.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import pytest
import trio
import trio.testing

from jobsignal._proto.job import Status
from jobsignal.relay.settings import RelaySettings
from jobsignal.relay.upstream import UpstreamConnection, UpstreamError

SETTINGS = RelaySettings(upstream=("127.0.0.1", 1), max_message_bytes=1024)
Answer = Callable[[h2.connection.H2Connection, int, str], None]


def frame(payload: bytes) -> bytes:
    return struct.pack(">?I", False, len(payload)) + payload


def answer_ok(conn: h2.connection.H2Connection, stream_id: int, path: str) -> None:
    """Register: 200 and an id; the List call: one message, then the stream stays open."""
    conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
    if path.endswith("/Register"):
        conn.send_data(stream_id, frame(bytes(Status(code=200, client_id="id"))))
        conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)
    else:
        conn.send_data(stream_id, frame(b"\x18\x00"))


@dataclass
class FakeServer:
    """An h2 server answering each request with `answer`; `silent` stops it writing
    (PING ACKs included) once both calls are answered and the answers sent."""

    answer: Answer = answer_ok
    silent: bool = False
    pings: int = 0
    requests: list[str] = field(default_factory=list)

    async def run(self, stream: trio.abc.Stream) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        await stream.send_all(conn.data_to_send())
        paths: dict[int, str] = {}
        async for data in stream:
            quiet = self.silent and len(self.requests) == 2  # both answered before
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    paths[event.stream_id] = dict(event.headers)[b":path"].decode()
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    self.requests.append(paths[event.stream_id])
                    self.answer(conn, event.stream_id, paths[event.stream_id])
                elif isinstance(event, h2.events.PingReceived):
                    self.pings += 1
            outgoing = conn.data_to_send()
            if not quiet:
                await stream.send_all(outgoing)


@asynccontextmanager
async def connected(server: FakeServer) -> AsyncIterator[UpstreamConnection]:
    client_end, server_end = trio.testing.memory_stream_pair()
    connection = UpstreamConnection(client_end, SETTINGS, tls=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run, server_end)
        await connection.start()
        nursery.start_soon(connection.run_keepalive)
        yield connection
        nursery.cancel_scope.cancel()


async def subscribed(connection: UpstreamConnection) -> int:
    client_id = await connection.register("DefaultUser2")
    assert client_id == "id"
    call = await connection.subscribe_list("DefaultUser2", client_id)
    assert await connection.receive(call) == b"\x18\x00"
    return call


async def test_a_silent_upstream_is_dropped_once_a_ping_goes_unanswered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = FakeServer(silent=True)
    async with connected(server) as connection:
        call = await subscribed(connection)
        start = trio.current_time()
        with pytest.raises(UpstreamError) as raised:
            await connection.receive(call)
        waited = trio.current_time() - start
    assert raised.value.reason == "keepalive"
    # Quiet for keepalive_time (30 s), then the PING's timeout (10 s).
    assert waited == pytest.approx(SETTINGS.keepalive_time + SETTINGS.keepalive_timeout, abs=0.1)
    assert server.requests == ["/job.Job/Register", "/job.Job/SubscribeJobSummarySignalList"]


async def test_an_upstream_that_answers_pings_is_kept_however_quiet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = FakeServer()
    async with connected(server) as connection:
        call = await subscribed(connection)
        with trio.move_on_after(300):
            await connection.receive(call)
    assert 9 <= server.pings <= 10  # one per 30 s of silence


def announce_a_gigabyte(conn: h2.connection.H2Connection, stream_id: int, path: str) -> None:
    answer_ok(conn, stream_id, path)
    if not path.endswith("/Register"):
        conn.send_data(stream_id, struct.pack(">?I", False, 1 << 30) + b"partial")


async def test_a_message_over_the_bound_fails_before_its_body(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with connected(FakeServer(announce_a_gigabyte)) as connection:
        call = await subscribed(connection)  # the message before it is taken first
        with pytest.raises(UpstreamError) as raised:
            await connection.receive(call)
    assert raised.value.reason == "too_large"
    assert "1073741824 bytes" in str(raised.value)


def refuse_the_role(conn: h2.connection.H2Connection, stream_id: int, path: str) -> None:
    headers = [(":status", "200"), ("content-type", "application/grpc")]
    headers += [("grpc-status", "3"), ("grpc-message", "unknown%20role")]
    conn.send_headers(stream_id, headers, end_stream=True)  # trailers-only


async def test_a_refusal_of_register_comes_with_its_status(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with connected(FakeServer(refuse_the_role)) as connection:
        with pytest.raises(UpstreamError) as raised:
            await connection.register("Nobody")
    assert raised.value.reason == "refused"
    assert "gRPC status 3 'unknown role'" in str(raised.value)


def answer_429(conn: h2.connection.H2Connection, stream_id: int, path: str) -> None:
    conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
    conn.send_data(stream_id, frame(bytes(Status(code=429, info="too many clients"))))
    conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)


async def test_register_answered_429_is_a_refusal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with connected(FakeServer(answer_429)) as connection:
        with pytest.raises(UpstreamError) as raised:
            await connection.register("CCAgent")
    assert raised.value.reason == "refused"
    assert "429 'too many clients'" in str(raised.value)
