"""Hostile HTTP/2 peers, speaking raw frames over 127.0.0.1, against the real server.

Each attack runs next to a healthy grpcio subscriber that must keep receiving
every event while it happens, and must leave nothing behind: the attacker's
streams are released, its connection closed with the GOAWAY that names what
it did (flushed before the close), and the server goes on serving.

`RawPeer` writes frames with hyperframe and hpack and reads the server's
frames the same way, so it can do what no well-behaved client library lets
a test do: ignore SETTINGS, reset streams before they start, never read.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpclib.protocol
import hpack
import pytest
import trio
import trio.lowlevel
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from jobsignal._proto.job import ClientInfo, JobSummarySignal, Status
from jobsignal.rpc import output as output_module
from jobsignal.rpc.guard import CONTROL_FLOOD, FREE_CONTROL_FRAMES, RAPID_RESET, ProtocolLimits
from jobsignal.rpc.limits import Limits
from jobsignal.rpc.session import SessionSettings
from jobsignal.rpc.writer import WRITE_SLICE
from tests.support.factories import make_job
from tests.support.grpc_server import (
    ServerHarness,
    collect_grpclib_garbage,
    count_writes,
    local_settings,
    open_jobsignal_server,
    record_writes,
)
from tests.support.grpcio import GrpcioClients, GrpcioStream
from tests.support.h2_client import OTHER_LOOPBACK, grpc_frame
from tests.support.threads import in_thread
from tests.support.waiting import wait_until

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
WAIT = 10.0
HEALTHY_ROLE = "CCAgent"


def grpc_request_headers(port: int, path: str = "/job.Job/Register") -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]


def register_body(role: str = "CCAgent") -> bytes:
    return grpc_frame(bytes(ClientInfo(role=role)))


@dataclass
class RawPeer:
    """One raw HTTP/2 connection to the server."""

    stream: trio.SocketStream
    port: int
    encoder: hpack.Encoder = field(default_factory=hpack.Encoder)
    decoder: hpack.Decoder = field(default_factory=hpack.Decoder)
    frames: list[Frame] = field(default_factory=list)
    headers: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    closed: bool = False
    _buffer: bytearray = field(default_factory=bytearray)

    async def send(self, *frames: Frame | bytes) -> None:
        data = b"".join(f if isinstance(f, bytes) else f.serialize() for f in frames)
        await self.stream.send_all(data)

    async def handshake(self, **settings: int) -> None:
        """The client preface and SETTINGS (frames are sent as built; nothing is ACKed)."""
        frame = SettingsFrame(0)
        frame.settings = {getattr(SettingCodes, k.upper()): v for k, v in settings.items()}
        await self.send(PREFACE, frame)

    def headers_frame(
        self, stream_id: int, headers: Sequence[tuple[str, str]], *, end_stream: bool = False
    ) -> HeadersFrame:
        frame = HeadersFrame(stream_id)
        frame.data = self.encoder.encode(list(headers))
        frame.flags.add("END_HEADERS")
        if end_stream:
            frame.flags.add("END_STREAM")
        return frame

    async def read_until(
        self, condition: Callable[[RawPeer], bool], *, within: float = WAIT
    ) -> None:
        """Read and parse the server's frames until `condition` holds or it closes."""
        with trio.fail_after(within):
            while not condition(self) and not self.closed:
                try:
                    chunk = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:  # reset by the server
                    chunk = b""
                if not chunk:
                    self.closed = True
                    break
                self._buffer += chunk
                self._parse()

    def _parse(self) -> None:
        while len(self._buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(bytes(self._buffer[:9])))
            if len(self._buffer) < 9 + length:
                return
            frame.parse_body(memoryview(bytes(self._buffer[9 : 9 + length])))
            del self._buffer[: 9 + length]
            self.frames.append(frame)
            if isinstance(frame, HeadersFrame):
                decoded = self.decoder.decode(frame.data)
                self.headers.setdefault(frame.stream_id, []).extend(
                    (str(k), str(v)) for k, v in decoded
                )

    async def assert_serves_a_request(self, stream_id: int) -> None:
        """A well-formed Register on `stream_id` is answered OK."""
        await self.send(
            self.headers_frame(stream_id, grpc_request_headers(self.port)),
            DataFrame(stream_id, register_body(), flags=["END_STREAM"]),
        )
        await self.read_until(lambda p: stream_id in p.ended_streams())
        assert dict(self.headers[stream_id]).get("grpc-status") == "0"

    async def register(self, stream_id: int, role: str = "CCAgent") -> str:
        """Register on `stream_id` and read the reply: the clientId the server handed out."""
        await self.send(
            self.headers_frame(stream_id, grpc_request_headers(self.port)),
            DataFrame(stream_id, register_body(role), flags=["END_STREAM"]),
        )
        await self.read_until(lambda p: stream_id in p.ended_streams())
        reply = b"".join(self.data_frames(stream_id))
        client_id: str = Status.parse(reply[5:]).client_id
        return client_id

    async def subscribe(self, stream_id: int, role: str, client_id: str) -> None:
        """Open SubscribeJobSummarySignal on `stream_id`; its messages arrive as DATA."""
        message = grpc_frame(bytes(ClientInfo(role=role, client_id=client_id)))
        path = "/job.Job/SubscribeJobSummarySignal"
        await self.send(
            self.headers_frame(stream_id, grpc_request_headers(self.port, path)),
            DataFrame(stream_id, message, flags=["END_STREAM"]),
        )

    async def subscribe_wide_open(self, role: str = "DefaultUser1") -> None:
        """Handshake with the widest windows HTTP/2 allows, then Register (stream 1)
        and Subscribe (stream 3): flow control never holds the server back, only
        the socket, once the peer stops reading."""
        await self.handshake(initial_window_size=2**31 - 1, max_frame_size=2**24 - 1)
        await self.send(WindowUpdateFrame(0, window_increment=2**31 - 1 - 65535))
        await self.subscribe(3, role, await self.register(1, role))

    def data_frames(self, stream_id: int) -> list[bytes]:
        return [
            f.data for f in self.frames if isinstance(f, DataFrame) and f.stream_id == stream_id
        ]

    def goaway(self) -> GoAwayFrame | None:
        found = [f for f in self.frames if isinstance(f, GoAwayFrame)]
        return found[0] if found else None

    def resets(self) -> dict[int, int]:
        return {f.stream_id: f.error_code for f in self.frames if isinstance(f, RstStreamFrame)}

    def server_settings(self) -> dict[int, int]:
        settings: dict[int, int] = {}
        for frame in self.frames:
            if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                settings.update(frame.settings)
        return settings

    def ended_streams(self) -> set[int]:
        return {
            f.stream_id
            for f in self.frames
            if isinstance(f, HeadersFrame | DataFrame) and "END_STREAM" in f.flags
        }


@asynccontextmanager
async def raw_peer(
    port: int, *, receive_buffer: int | None = None, source: str | None = None
) -> AsyncIterator[RawPeer]:
    """A connection to 127.0.0.1:`port`, from the address `source` if given."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    if source is not None:
        await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    try:
        yield RawPeer(stream, port)
    finally:
        await stream.aclose()


def goaway_of(peer: RawPeer) -> tuple[int, bytes]:
    frame = peer.goaway()
    assert frame is not None, f"no GOAWAY; frames: {[type(f).__name__ for f in peer.frames]}"
    return frame.error_code, frame.additional_data


async def assert_closed_with_goaway(
    server: ServerHarness, peer: RawPeer, code: int, reason: str
) -> None:
    """The server sends GOAWAY `code` and then closes the connection, counted as `reason`."""
    await peer.read_until(lambda p: False)
    assert peer.closed
    assert goaway_of(peer)[0] == code
    assert server.connections.closed_by_server[reason] == 1


def has_goaway(peer: RawPeer) -> bool:
    return peer.goaway() is not None


@dataclass
class Healthy:
    """A grpcio subscriber that must get every event published during an attack."""

    stream: GrpcioStream
    published: list[str] = field(default_factory=list)

    def publish(self, server: ServerHarness) -> None:
        job = make_job(len(self.published) + 1)
        self.published.append(job.job_id)
        server.broadcaster.publish([job])

    async def assert_got_everything(self) -> None:
        await wait_until(
            lambda: [m.jobId for m in self.stream.messages] == self.published,
            within=WAIT,
            what="the healthy subscriber to receive every event",
        )
        assert not self.stream.ended.is_set(), (self.stream.code, self.stream.details)


async def open_healthy(
    server: ServerHarness, clients: GrpcioClients, nursery: trio.Nursery
) -> Healthy:
    client = clients.connect(server.target)
    client_id = await in_thread(client.register_id, HEALTHY_ROLE)
    stream = GrpcioStream(client.subscribe(HEALTHY_ROLE, client_id, timeout=120))
    stream.start(nursery)
    await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=WAIT)
    return Healthy(stream)


async def publish_while(server: ServerHarness, healthy: Healthy, attack: Any) -> None:
    """Publish an event before, during (between the attack's steps) and after an attack."""
    healthy.publish(server)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(attack)
        for _ in range(5):
            await trio.sleep(0.01)
            healthy.publish(server)
    healthy.publish(server)


def live_grpclib_streams() -> int:
    # grpclib forgets finished tasks of closed connections every tenth new
    # connection: bounded, but not what this measures.
    collect_grpclib_garbage()
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, grpclib.protocol.Stream))


# -- Rapid Reset ----------------------------------------------------------------------------------


async def test_rapid_reset_gets_goaway_and_leaves_no_stream_behind(
    grpc_clients: GrpcioClients,
) -> None:
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        healthy = await open_healthy(server, grpc_clients, nursery)
        baseline = live_grpclib_streams()
        async with raw_peer(server.port) as peer:
            await peer.handshake()
            headers = grpc_request_headers(server.port)

            async def attack() -> None:
                for batch in range(20):
                    frames: list[Frame] = []
                    for i in range(100):
                        stream_id = 1 + 2 * (batch * 100 + i)
                        frames.append(peer.headers_frame(stream_id, headers))
                        frames.append(RstStreamFrame(stream_id, error_code=ErrorCodes.CANCEL))
                    try:
                        await peer.send(*frames)
                    except trio.BrokenResourceError:
                        return  # the server has closed the connection
                    await trio.lowlevel.checkpoint()

            await publish_while(server, healthy, attack)
            await peer.read_until(has_goaway)
            assert goaway_of(peer) == (ErrorCodes.ENHANCE_YOUR_CALM, RAPID_RESET.encode())
            await peer.read_until(lambda p: False)  # then the server closes it
            assert peer.closed
        assert server.connections.closed_by_server[RAPID_RESET] == 1
        await healthy.assert_got_everything()
        await wait_until(lambda: len(server.connections) == 1, within=WAIT)
        # Every reset stream was released: nothing of the attack stays in memory.
        await wait_until(lambda: live_grpclib_streams() <= baseline, within=WAIT)


async def test_connections_from_one_address_share_one_reset_budget() -> None:
    """Rapid Reset spread over two connections of one address: each sends 190
    resets, just under the burst (the default: 100 a second, bursts of 200),
    which alone would pass; together they are over it (unless the second came
    1.8 s after the first), and the second is closed."""
    async with (
        open_jobsignal_server() as server,
        raw_peer(server.port) as first,
        raw_peer(server.port) as second,
    ):
        headers = grpc_request_headers(server.port)

        def open_and_reset(peer: RawPeer) -> list[Frame]:
            frames: list[Frame] = []
            for i in range(190):
                stream_id = 1 + 2 * i
                frames.append(peer.headers_frame(stream_id, headers))
                frames.append(RstStreamFrame(stream_id, error_code=ErrorCodes.CANCEL))
            return frames

        for peer in (first, second):
            await peer.handshake()
        await first.send(*open_and_reset(first))
        await first.assert_serves_a_request(1001)  # its resets are all counted by now
        await second.send(*open_and_reset(second))
        await second.read_until(has_goaway)
        assert goaway_of(second) == (ErrorCodes.ENHANCE_YOUR_CALM, RAPID_RESET.encode())
        assert first.goaway() is None
        await first.assert_serves_a_request(1003)
        assert server.connections.closed_by_server[RAPID_RESET] == 1


async def test_a_control_flood_spread_over_connections_waits_for_its_address(
    io_clock: trio.testing.MockClock,
) -> None:
    """Eight connections from one address, each sending 20 WINDOW_UPDATEs beyond
    its allowance and then a request: far under a connection's budget, together
    over the address's burst of 40 (20 a second). Nobody is cut off: their input
    waits its turn, so their requests are answered seconds later. Meanwhile a
    client of another address is served at once, and so is an idle client of the
    same address whose SETTINGS comes a second after its handshake."""
    limits = ProtocolLimits(
        max_control_frames_per_second=1000, max_control_frames_per_second_per_ip=20
    )
    update = WindowUpdateFrame(0, window_increment=1)

    def acked(count: int) -> Callable[[RawPeer], bool]:
        """Until the server has acknowledged `count` SETTINGS frames."""
        return lambda peer: (
            count <= sum(isinstance(f, SettingsFrame) and "ACK" in f.flags for f in peer.frames)
        )

    async with (
        open_jobsignal_server(local_settings(protocol_limits=limits)) as server,
        contextlib.AsyncExitStack() as stack,
    ):
        idle = await stack.enter_async_context(raw_peer(server.port, source=OTHER_LOOPBACK))
        await idle.handshake()
        # Its whole allowance, with its first SETTINGS (no PINGs: strikes, with no data).
        await idle.send(*[SettingsFrame(0) for _ in range(FREE_CONTROL_FRAMES - 1)])
        await idle.read_until(acked(FREE_CONTROL_FRAMES))
        flooders = [
            await stack.enter_async_context(raw_peer(server.port, source=OTHER_LOOPBACK))
            for _ in range(8)
        ]
        started = trio.current_time()
        for peer in flooders:
            await peer.handshake()
            await peer.send(*[update] * (FREE_CONTROL_FRAMES - 1 + 20))
        await wait_until(lambda: server.connections.input_held >= 1, within=WAIT)
        async with raw_peer(server.port) as neighbour:
            await neighbour.handshake()
            await neighbour.assert_serves_a_request(1)
        assert trio.current_time() - started < 0.5
        await trio.sleep_until(started + 1.5)
        await idle.send(SettingsFrame(0))
        await idle.read_until(acked(FREE_CONTROL_FRAMES + 1))
        assert trio.current_time() - started < 2.0
        for peer in flooders:
            await peer.assert_serves_a_request(1)
        # 160 frames beyond the burst of 40, at 20 a second: the last flooder's
        # turn comes 6 s after its frames were counted.
        assert trio.current_time() - started >= 5.5
        assert all(peer.goaway() is None for peer in [idle, *flooders])
        assert not server.connections.closed_by_server
        assert server.connections.input_held >= 4


async def test_a_grpcio_client_on_a_flooded_address_is_not_held(
    grpc_clients: GrpcioClients,
) -> None:
    """The flood comes from the healthy client's own address (a NAT neighbour)
    and puts its pacer about 40 s behind. Then 9 MiB of events, which the client
    can only receive by opening its windows again and again: its WINDOW_UPDATEs
    (and grpcio's BDP pings) answer the data, are paid by the credit it earned,
    and are not held."""
    limits = ProtocolLimits(
        max_control_frames_per_second=1000, max_control_frames_per_second_per_ip=20
    )
    update = WindowUpdateFrame(0, window_increment=1)
    async with (
        trio.open_nursery() as nursery,
        open_jobsignal_server(local_settings(protocol_limits=limits)) as server,
        contextlib.AsyncExitStack() as stack,
    ):
        healthy = await open_healthy(server, grpc_clients, nursery)
        flooders = [await stack.enter_async_context(raw_peer(server.port)) for _ in range(8)]

        async def attack() -> None:
            for peer in flooders:
                await peer.handshake()
                await peer.send(*[update] * 100)

        await publish_while(server, healthy, attack)
        await wait_until(lambda: server.connections.input_held >= 1, within=WAIT)
        for index in range(len(healthy.published) + 1, len(healthy.published) + 65):
            job = make_job(index, npus=2048)  # a signal of about 144 KiB
            healthy.published.append(job.job_id)
            server.broadcaster.publish([job])
        await wait_until(
            lambda: [m.jobId for m in healthy.stream.messages] == healthy.published,
            within=5.0,
            what="the healthy subscriber to receive every event before the pacer's turn",
        )
        assert not healthy.stream.ended.is_set()
        assert not server.connections.closed_by_server


async def test_streams_reset_before_they_start_are_released_at_once() -> None:
    """Resets under the budget: the connection stays, but no reset stream stays in it."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        headers = grpc_request_headers(server.port)
        frames: list[Frame] = []
        for i in range(50):
            stream_id = 1 + 2 * i
            frames += [
                peer.headers_frame(stream_id, headers),
                RstStreamFrame(stream_id, error_code=ErrorCodes.CANCEL),
            ]
        await peer.send(*frames)
        await wait_until(lambda: len(server.connections) == 1, within=WAIT)
        (protocol,) = server.connections.protocols()
        await wait_until(lambda: not protocol.processor.streams, within=WAIT, what="no streams")
        # The connection still serves a request.
        await peer.send(
            peer.headers_frame(101, headers), DataFrame(101, register_body(), flags=["END_STREAM"])
        )
        await peer.read_until(lambda p: 101 in p.ended_streams())
        assert dict(peer.headers[101]).get("grpc-status") == "0"
        assert peer.goaway() is None


# -- control-frame floods -----------------------------------------------------------------------


def settings_flood(peer: RawPeer) -> list[Frame]:
    return [SettingsFrame(0) for _ in range(5000)]


def ping_flood(peer: RawPeer) -> list[Frame]:
    return [PingFrame(0, opaque_data=i.to_bytes(8, "big")) for i in range(5000)]


def window_update_flood(peer: RawPeer) -> list[Frame]:
    return [WindowUpdateFrame(0, window_increment=1) for _ in range(5000)]


def priority_flood(peer: RawPeer) -> list[Frame]:
    return [PriorityFrame(1, depends_on=0, stream_weight=16) for _ in range(5000)]


def empty_data_flood(peer: RawPeer) -> list[Frame]:
    # An open request stream, then DATA frames that carry nothing.
    return [
        peer.headers_frame(1, grpc_request_headers(peer.port)),
        *(DataFrame(1, b"") for _ in range(5000)),
    ]


@pytest.mark.parametrize(
    "flood",
    [settings_flood, ping_flood, window_update_flood, priority_flood, empty_data_flood],
)
async def test_control_frame_flood_gets_goaway_while_others_are_served(
    grpc_clients: GrpcioClients, flood: Callable[[RawPeer], list[Frame]]
) -> None:
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        healthy = await open_healthy(server, grpc_clients, nursery)
        async with raw_peer(server.port) as peer:
            await peer.handshake()
            frames = flood(peer)

            async def attack() -> None:
                for start in range(0, len(frames), 500):
                    try:
                        await peer.send(*frames[start : start + 500])
                    except trio.BrokenResourceError:
                        return

            await publish_while(server, healthy, attack)
            await peer.read_until(has_goaway)
            code, debug = goaway_of(peer)
            assert code == ErrorCodes.ENHANCE_YOUR_CALM
            # A PING flood is also a ping-strike offence; whichever rule fires first.
            assert debug in (CONTROL_FLOOD.encode(), b"too_many_pings"), debug
        await healthy.assert_got_everything()
        await wait_until(lambda: len(server.connections) == 1, within=WAIT)


# -- handshake and stream limits ----------------------------------------------------------------


@pytest.mark.parametrize("sends", [b"", PREFACE], ids=["nothing", "preface-only"])
async def test_a_connection_without_handshake_is_closed_after_the_timeout(
    io_clock: trio.testing.MockClock, sends: bytes
) -> None:
    # Virtual time: the timer is asyncio's `call_later`, which trio-asyncio runs on trio's clock.
    timeout = ProtocolLimits().handshake_timeout
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        if sends:
            await peer.send(sends)
        started = trio.current_time()
        await peer.read_until(lambda p: False, within=timeout + 5)
        assert peer.closed
        assert trio.current_time() - started == pytest.approx(timeout, abs=0.05)
        assert server.connections.closed_by_server["handshake_timeout"] == 1
        await wait_until(lambda: len(server.connections) == 0, within=WAIT)


async def test_a_connection_that_completes_the_handshake_stays_open(
    io_clock: trio.testing.MockClock,
) -> None:
    timeout = ProtocolLimits().handshake_timeout
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        await trio.sleep(timeout * 3)
        await peer.send(PingFrame(0, opaque_data=b"12345678"))
        await peer.read_until(
            lambda p: any(isinstance(f, PingFrame) and "ACK" in f.flags for f in p.frames)
        )
        assert not peer.closed and peer.goaway() is None
        assert server.connections.closed_by_server["handshake_timeout"] == 0


async def test_stream_limit_is_advertised_and_extra_streams_are_refused_one_by_one() -> None:
    limit = 4
    settings = local_settings(limits=Limits(max_streams_per_connection=limit))
    async with open_jobsignal_server(settings) as server, raw_peer(server.port) as peer:
        await peer.handshake()
        await peer.read_until(lambda p: SettingCodes.MAX_CONCURRENT_STREAMS in p.server_settings())
        assert peer.server_settings()[SettingCodes.MAX_CONCURRENT_STREAMS] == limit

        # limit + 2 requests whose body never comes: they stay open, as a peer
        # that ignored SETTINGS would hold them.
        headers = grpc_request_headers(server.port)
        ids = [1 + 2 * i for i in range(limit + 2)]
        await peer.send(*(peer.headers_frame(i, headers) for i in ids))
        await peer.read_until(lambda p: len(p.resets()) == 2)
        assert peer.resets() == {
            ids[-2]: ErrorCodes.REFUSED_STREAM,
            ids[-1]: ErrorCodes.REFUSED_STREAM,
        }
        assert server.connections.streams_refused == 2

        # The connection is alive and the accepted streams are served.
        for stream_id in ids[:limit]:
            await peer.send(DataFrame(stream_id, register_body(), flags=["END_STREAM"]))
        await peer.read_until(lambda p: set(ids[:limit]) <= p.ended_streams())
        assert all(dict(peer.headers[i]).get("grpc-status") == "0" for i in ids[:limit])
        assert peer.goaway() is None

        # Freed slots take new streams again.
        await peer.send(
            peer.headers_frame(101, headers), DataFrame(101, register_body(), flags=["END_STREAM"])
        )
        await peer.read_until(lambda p: 101 in p.ended_streams())
        assert dict(peer.headers[101]).get("grpc-status") == "0"


# -- malformed requests and protocol errors ----------------------------------------------------


async def test_a_request_without_path_gets_a_status_and_the_connection_goes_on() -> None:
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        headers = [h for h in grpc_request_headers(server.port) if h[0] != ":path"]
        await peer.send(peer.headers_frame(1, headers, end_stream=True))
        await peer.read_until(lambda p: 1 in p.ended_streams())
        answer = dict(peer.headers[1])
        assert answer["grpc-status"] == "13"
        assert "no :path" in answer["grpc-message"]
        # The same connection still serves a well-formed request.
        await peer.assert_serves_a_request(3)


async def test_a_protocol_error_gets_its_goaway_before_the_close() -> None:
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        # DATA on stream 0 is a connection error of type PROTOCOL_ERROR (RFC 9113
        # 6.1); hyperframe refuses to build it, so here are its bytes: length 4,
        # type DATA, no flags, stream 0.
        await peer.send(b"\x00\x00\x04\x00\x00\x00\x00\x00\x00junk")
        await assert_closed_with_goaway(server, peer, ErrorCodes.PROTOCOL_ERROR, "protocol_error")
        await wait_until(lambda: len(server.connections) == 0, within=WAIT)


# -- peers that do not read ---------------------------------------------------------------------


async def test_a_peer_that_never_reads_is_no_longer_read_then_closed(
    grpc_clients: GrpcioClients,
) -> None:
    """It opens its flow-control windows wide, subscribes, and stops reading."""
    stall = 1.0
    settings = local_settings(
        protocol_limits=ProtocolLimits(write_stall_timeout=stall),
        session=SessionSettings(send_timeout=60.0, snapshot_roles=frozenset({"FdAgent"})),
    )
    async with trio.open_nursery() as nursery, open_jobsignal_server(settings) as server:
        healthy = await open_healthy(server, grpc_clients, nursery)
        async with raw_peer(server.port, receive_buffer=4096) as peer:
            await peer.subscribe_wide_open()
            await wait_until(lambda: len(server.broadcaster.subscribers) == 2, within=WAIT)
            # From here on the peer reads nothing. Big events fill its socket.
            for i in range(40):
                job = make_job(1000 + i, npus=2048)
                server.broadcaster.publish([job])
                healthy.published.append(job.job_id)
                await trio.sleep(0.01)
            await wait_until(
                lambda: server.connections.closed_by_server["write_stalled"] == 1,
                within=stall + WAIT,
                what="the stalled connection to be closed",
            )
            await wait_until(lambda: len(server.connections) == 1, within=WAIT)
        await healthy.assert_got_everything()


async def test_a_stalled_peer_is_closed_when_the_stall_timeout_runs_out(
    io_clock: trio.testing.MockClock,
) -> None:
    """The same rule in virtual time, with the default timeout: the stall timer is
    asyncio's `call_later`, which trio-asyncio runs on trio's clock."""
    stall = ProtocolLimits().write_stall_timeout
    async with (
        open_jobsignal_server() as server,
        raw_peer(server.port, receive_buffer=4096) as peer,
    ):
        await peer.subscribe_wide_open()
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=WAIT)
        # Big events, one per loop turn, all at one virtual instant, until the
        # socket is full and the stall timer starts.
        filled = trio.current_time()
        for i in range(40):
            server.broadcaster.publish([make_job(1000 + i, npus=2048)])
            await trio.lowlevel.checkpoint()
        assert trio.current_time() == filled
        await wait_until(
            lambda: server.connections.closed_by_server["write_stalled"] == 1,
            within=stall + WAIT,
            what="the stalled connection to be closed",
        )
        assert trio.current_time() - filled == pytest.approx(stall, abs=0.1)
        await wait_until(lambda: len(server.connections) == 0, within=WAIT)


# -- header abuse ---------------------------------------------------------------------------------


async def test_an_hpack_bomb_ends_only_its_connection() -> None:
    """A small header block that decodes to more than the header list limit (64 KiB)."""
    async with open_jobsignal_server() as server:
        async with raw_peer(server.port) as peer:
            await peer.handshake()
            big = "x" * 4000
            # One literal added to the dynamic table, then many 1-byte references to it.
            first = [*grpc_request_headers(server.port), ("bomb", big)]
            frame = peer.headers_frame(1, first)
            frame.data += bytes([0xBE]) * 100  # indexed field 62: the "bomb" entry
            await peer.send(frame)
            # h2 answers an oversized header list with ENHANCE_YOUR_CALM.
            calm = ErrorCodes.ENHANCE_YOUR_CALM
            await assert_closed_with_goaway(server, peer, calm, "protocol_error")
        await wait_until(lambda: len(server.connections) == 0, within=WAIT)
        # The server goes on serving.
        async with raw_peer(server.port) as peer:
            await peer.handshake()
            await peer.assert_serves_a_request(1)


async def test_a_continuation_flood_ends_only_its_connection() -> None:
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        headers = peer.headers_frame(1, grpc_request_headers(server.port))
        headers.flags.discard("END_HEADERS")
        continuations = [ContinuationFrame(1, b"") for _ in range(1000)]
        with contextlib.suppress(trio.BrokenResourceError):
            await peer.send(headers, *continuations)
        await assert_closed_with_goaway(server, peer, ErrorCodes.PROTOCOL_ERROR, "protocol_error")


@pytest.mark.parametrize(
    "data",
    [
        lambda: DataFrame(1, b""),
        lambda: DataFrame(1, b"x"),
        lambda: DataFrame(1, b"", flags=["END_STREAM"]),
    ],
    ids=["empty", "one-byte", "empty-end-stream"],
)
async def test_data_on_a_stream_the_server_closed_still_counts(
    grpc_clients: GrpcioClients, data: Callable[[], DataFrame]
) -> None:
    """h2 answers such frames with RST_STREAM by itself, without an event."""
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        healthy = await open_healthy(server, grpc_clients, nursery)
        async with raw_peer(server.port) as peer:
            await peer.handshake()
            # A request ended at once: the server answers and closes stream 1.
            await peer.send(
                peer.headers_frame(1, grpc_request_headers(server.port), end_stream=True)
            )
            await peer.read_until(lambda p: 1 in p.ended_streams())

            async def attack() -> None:
                for _ in range(10):
                    with contextlib.suppress(trio.BrokenResourceError):
                        await peer.send(*(data() for _ in range(500)))

            await publish_while(server, healthy, attack)
            await peer.read_until(has_goaway)
            assert goaway_of(peer) == (ErrorCodes.ENHANCE_YOUR_CALM, CONTROL_FLOOD.encode())
        await healthy.assert_got_everything()


def _data_on(peer: RawPeer, stream_id: int) -> int:
    return sum(len(data) for data in peer.data_frames(stream_id))


async def test_a_large_message_is_written_one_slice_per_loop_turn() -> None:
    """With every window open, a 2 MB rank table still leaves the loop between slices."""
    settings = local_settings(session=SessionSettings(snapshot_roles=frozenset({"FdAgent"})))
    async with open_jobsignal_server(settings) as server, raw_peer(server.port) as peer:
        await peer.handshake(initial_window_size=2**31 - 1, max_frame_size=2**24 - 1)
        await peer.send(WindowUpdateFrame(0, window_increment=2**31 - 1 - 65535))
        await peer.subscribe(3, "FdAgent", await peer.register(1, "FdAgent"))
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=WAIT)
        server.broadcaster.publish([make_job(1)])  # the response headers go out first
        await peer.read_until(lambda p: _data_on(p, 3) > 0)
        writes = count_writes(server.connections)
        before = _data_on(peer, 3)
        big = make_job(2, npus=30_000)
        size = len(big.hccl_json)
        assert size > 2_000_000
        server.broadcaster.publish([big])
        await peer.read_until(lambda p: _data_on(p, 3) - before > size)
        # Written whole it would be one write of `size`; sliced, the loop turns
        # between slices (an output flush may still take two slices at once).
        assert WRITE_SLICE <= 512 * 1024
        assert len(writes) >= 4, writes
        assert max(writes) < size // 2, writes


async def test_an_owed_snapshot_leaves_with_the_response_headers_and_up_follows_it() -> None:
    """An FdAgent's response HEADERS leave in the same write as its snapshot's first
    message (a client that waits for the headers finds the snapshot behind them),
    a live event published meanwhile follows the snapshot, and the stream is
    reported up (`jobsignal_subscribers`) only once its snapshot is written."""
    window = 200  # less than one job's message: the snapshot cannot go at once
    settings = local_settings(session=SessionSettings(snapshot_roles=frozenset({"FdAgent"})))
    async with open_jobsignal_server(settings) as server, raw_peer(server.port) as peer:
        snapshot = [make_job(index) for index in range(3)]
        server.broadcaster.publish(snapshot)
        await peer.handshake(initial_window_size=window)
        client_id = await peer.register(1, "FdAgent")
        writes = record_writes(server.connections)
        await peer.subscribe(3, "FdAgent", client_id)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=WAIT)
        await peer.read_until(lambda p: _data_on(p, 3) >= window)
        await trio.sleep(0.1)  # the stream stays short of its snapshot, so not up
        assert not server.broadcaster.streams_up()
        live = make_job(99)
        server.broadcaster.publish([live])
        await peer.send(WindowUpdateFrame(3, window_increment=1_000_000))
        await peer.read_until(lambda p: len(_messages_on(p, 3)) == 4)
        up = collections.Counter({("SubscribeJobSummarySignal", "FdAgent"): 1})
        await wait_until(lambda: server.broadcaster.streams_up() == up, within=WAIT)
    ids = [JobSummarySignal.parse(message).job_id for message in _messages_on(peer, 3)]
    assert sorted(ids[:3]) == sorted(job.job_id for job in snapshot)
    assert ids[3] == live.job_id
    first = next(frames for frames in map(_frames_of, writes) if _on_stream(frames, 3))
    kinds = [type(frame).__name__ for frame in _on_stream(first, 3)]
    assert kinds[:2] == ["HeadersFrame", "DataFrame"], kinds


def _frames_of(written: bytes) -> list[Frame]:
    """The whole frames of one write to the socket."""
    frames = []
    data = memoryview(written)
    while len(data) >= 9:
        frame, length = Frame.parse_frame_header(data[:9])
        frame.parse_body(data[9 : 9 + length])
        frames.append(frame)
        data = data[9 + length :]
    return frames


def _on_stream(frames: list[Frame], stream_id: int) -> list[Frame]:
    return [frame for frame in frames if frame.stream_id == stream_id]


def _messages_on(peer: RawPeer, stream_id: int) -> list[bytes]:
    """The gRPC messages received on `stream_id`, whole ones only."""
    data = b"".join(peer.data_frames(stream_id))
    messages = []
    while len(data) >= 5 and len(data) >= 5 + int.from_bytes(data[1:5], "big"):
        end = 5 + int.from_bytes(data[1:5], "big")
        messages.append(data[5:end])
        data = data[end:]
    return messages


async def test_direct_and_queued_deliveries_keep_the_order_and_the_window() -> None:
    """A stream window that fills mid-way: the messages that fit go straight from
    publish, the rest queue; nothing passes the window, and once it opens the
    client has every message whole and in order."""
    window = 3_000
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake(initial_window_size=window)
        await peer.subscribe(3, "CCAgent", await peer.register(1))
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=WAIT)
        server.broadcaster.publish([make_job(0)])  # the response headers go first
        await peer.read_until(lambda p: len(_messages_on(p, 3)) == 1)
        for index in range(1, 30):
            server.broadcaster.publish([make_job(index)])
        stats = server.broadcaster.stats
        assert stats.batches_written_from_publish >= 2, stats
        # The queued messages fill the window to the byte (h2 refuses more).
        await peer.read_until(lambda p: _data_on(p, 3) >= window)
        assert _data_on(peer, 3) == window
        await peer.send(WindowUpdateFrame(3, window_increment=1_000_000))
        await peer.read_until(lambda p: len(_messages_on(p, 3)) == 30)
    ids = [JobSummarySignal.parse(message).job_id for message in _messages_on(peer, 3)]
    assert ids == [make_job(index).job_id for index in range(30)]
    assert stats.batches_written_waiting >= 1, stats


async def test_streams_waiting_on_one_connection_window_are_served_in_turn() -> None:
    """Two streams with a large message each, the connection's window opened a
    little at a time: both progress together; neither waits for the other's
    whole message."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        # Stream windows wide open; the connection's own window stays at 64 KiB.
        await peer.handshake(initial_window_size=2**30)
        ids = [await peer.register(stream_id) for stream_id in (1, 3)]
        for stream_id, client_id in zip((5, 7), ids, strict=True):
            await peer.subscribe(stream_id, "CCAgent", client_id)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 2, within=WAIT)
        big = make_job(1, npus=4_000)  # about 290 KB to each stream
        server.broadcaster.publish([big])
        await peer.read_until(lambda p: _data_on(p, 5) + _data_on(p, 7) >= 60_000)
        start = {s: _data_on(peer, s) for s in (5, 7)}
        granted = 256 * 1024  # less than either message still needs
        await peer.send(WindowUpdateFrame(0, window_increment=granted))
        # The window is counted in payload bytes: exactly this much more arrives.
        await peer.read_until(lambda p: sum(_data_on(p, s) - start[s] for s in start) >= granted)
        got = {s: _data_on(peer, s) - start[s] for s in start}
        # Served in turn, 16 KiB a round: about half each (one stream first would get it all).
        assert min(got.values()) >= 96 * 1024, got


async def test_a_connection_s_subscribers_are_one_group_of_the_fan_out() -> None:
    """The pacer serves a connection's subscribers together (fanout/pacing.py): each
    session subscribes with its connection as the group, one group per connection."""
    async with (
        open_jobsignal_server() as server,
        raw_peer(server.port) as first,
        raw_peer(server.port) as second,
    ):
        await first.handshake()
        await second.handshake()
        ids = [await first.register(stream_id) for stream_id in (1, 3)]
        for stream_id, client_id in zip((5, 7), ids, strict=True):
            await first.subscribe(stream_id, "CCAgent", client_id)
        await second.subscribe(3, "CCAgent", await second.register(1))
        await wait_until(lambda: len(server.broadcaster.subscribers) == 3, within=WAIT)
        sizes = collections.Counter(s.group for s in server.broadcaster.subscribers)
    assert None not in sizes
    assert sorted(sizes.values()) == [1, 2]


# -- PING ACKs (rpc/output.py, LateFlusher) -----------------------------------------------


async def a_subscriber_after_one_message(server: ServerHarness, peer: RawPeer) -> list[int]:
    """The peer subscribed, its first message read; the server's writes counted from here."""
    await peer.handshake()
    await peer.subscribe(3, "CCAgent", await peer.register(1))
    await wait_until(lambda: len(server.broadcaster.subscribers) == 1, within=WAIT)
    server.broadcaster.publish([make_job(0)])
    await peer.read_until(lambda p: len(_messages_on(p, 3)) == 1)
    return count_writes(server.connections)


async def answer_like_grpc_go(server: ServerHarness, peer: RawPeer, opaque: bytes) -> None:
    """What grpc-go sends for each message: a connection WINDOW_UPDATE and a PING,
    in one write; back once the server has handled both."""
    (protocol,) = server.connections.protocols()
    pings = protocol.activity.pings_received
    await peer.send(WindowUpdateFrame(0, window_increment=300), PingFrame(0, opaque_data=opaque))
    await wait_until(lambda: protocol.activity.pings_received == pings + 1, within=WAIT)


def ping_acks(peer: RawPeer) -> list[bytes]:
    return [f.opaque_data for f in peer.frames if isinstance(f, PingFrame) and "ACK" in f.flags]


async def test_a_ping_ack_goes_out_with_the_connections_next_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ACK waits in h2's output and shares the next message's system call,
    ahead of it (RFC 9113: PING responses before other frames)."""
    monkeypatch.setattr(output_module, "ACK_DELAY", 3600.0)  # only the message can take it
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        writes = await a_subscriber_after_one_message(server, peer)
        await answer_like_grpc_go(server, peer, b"bdp-ping")
        assert writes == []
        server.broadcaster.publish([make_job(1)])
        await peer.read_until(lambda p: len(_messages_on(p, 3)) == 2)
        assert len(writes) == 1
        assert ping_acks(peer) == [b"bdp-ping"]
        ack_at = next(i for i, f in enumerate(peer.frames) if isinstance(f, PingFrame))
        last_data_at = max(i for i, f in enumerate(peer.frames) if isinstance(f, DataFrame))
        assert ack_at < last_data_at


async def test_a_ping_ack_with_no_message_to_follow_goes_out_after_the_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(output_module, "ACK_DELAY", 0.05)
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        writes = await a_subscriber_after_one_message(server, peer)
        await answer_like_grpc_go(server, peer, b"keepaliv")
        await peer.read_until(lambda p: ping_acks(p) == [b"keepaliv"])
        assert len(writes) == 1


async def test_what_h2s_general_path_answers_goes_out_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the fast path's PING ACKs wait: a status the server writes while handling
    other frames (here a request without :path) does not wait for the late flush."""
    monkeypatch.setattr(output_module, "ACK_DELAY", 3600.0)
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        headers = [h for h in grpc_request_headers(server.port) if h[0] != ":path"]
        await peer.send(peer.headers_frame(1, headers, end_stream=True))
        await peer.read_until(lambda p: 1 in p.ended_streams(), within=5)
        assert dict(peer.headers[1])["grpc-status"] == "13"
