"""A minimal HTTP/2 client over a trio socket, for gRPC requests grpcio won't send.

Malformed requests, streams left open, a source address of the test's choosing
(grpcio cannot pick one): written with the `h2` state machine.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import trio

LOOPBACK = "127.0.0.1"
# Another loopback address: Linux routes all of 127.0.0.0/8 to `lo`, so a
# socket bound to it reaches the server on 127.0.0.1 from a different address.
OTHER_LOOPBACK = "127.0.0.2"


def h2_pair() -> tuple[h2.connection.H2Connection, h2.connection.H2Connection]:
    """A server and a client h2 connection, in memory, that have exchanged prefaces
    and SETTINGS."""
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding="ascii")
    )
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="ascii")
    )
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    return server, client


def grpc_frame(payload: bytes, *, compressed: bool = False, length: int | None = None) -> bytes:
    """The gRPC length-prefixed message framing."""
    size = len(payload) if length is None else length
    return struct.pack(">?I", compressed, size) + payload


def client_info(role: str = "", client_id: str = "") -> bytes:
    """ClientInfo encoded by hand (field 1 role, field 3 clientId)."""
    out = b""
    for tag, value in ((0x0A, role), (0x1A, client_id)):
        if value:
            raw = value.encode()
            out += bytes([tag, len(raw)]) + raw
    return out


@dataclass
class H2Response:
    headers: dict[str, str] = field(default_factory=dict)
    trailers: dict[str, str] = field(default_factory=dict)
    data: bytes = b""
    reset: int | None = None
    ended: bool = False

    @property
    def grpc_status(self) -> int | None:
        value = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return None if value is None else int(value)

    @property
    def grpc_message(self) -> str:
        return self.trailers.get("grpc-message", self.headers.get("grpc-message", ""))

    @property
    def message(self) -> bytes:
        """The one gRPC message of a unary reply, without its 5-byte prefix."""
        return self.data[5:]


class H2Client:
    """One HTTP/2 connection to the server, speaking gRPC by hand."""

    def __init__(self, stream: trio.SocketStream, authority: str) -> None:
        self.stream = stream
        self.authority = authority
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.connection = h2.connection.H2Connection(config=config)
        self.responses: dict[int, H2Response] = {}

    @classmethod
    async def connect(cls, port: int, *, source: str | None = None) -> H2Client:
        """Connect to 127.0.0.1:`port`, from the address `source` if given."""
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        try:
            if source is not None:
                await sock.bind((source, 0))
            await sock.connect((LOOPBACK, port))
        except BaseException:
            sock.close()
            raise
        client = cls(trio.SocketStream(sock), f"{LOOPBACK}:{port}")
        client.connection.initiate_connection()
        await client.flush()
        return client

    async def flush(self) -> None:
        data = self.connection.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def request(
        self,
        path: str,
        body: bytes | None,
        *,
        content_type: str = "application/grpc",
        end_stream: bool = True,
    ) -> int:
        stream_id: int = self.connection.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", self.authority),
            ("content-type", content_type),
            ("te", "trailers"),
        ]
        self.connection.send_headers(stream_id, headers, end_stream=body is None and end_stream)
        if body is not None:
            size = self.connection.max_outbound_frame_size
            chunks = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
            for index, chunk in enumerate(chunks):
                last = index == len(chunks) - 1
                self.connection.send_data(stream_id, chunk, end_stream=end_stream and last)
        self.responses[stream_id] = H2Response()
        await self.flush()
        return stream_id

    async def response(self, stream_id: int) -> H2Response:
        """Read until the stream ends or is reset (the caller bounds the wait)."""
        response = self.responses[stream_id]
        while not response.ended and response.reset is None:
            data = await self.stream.receive_some()
            if not data:
                raise AssertionError("server closed the connection")
            for event in self.connection.receive_data(data):
                self._handle(event)
            await self.flush()
        return response

    def _handle(self, event: h2.events.Event) -> None:
        stream_id = getattr(event, "stream_id", None)
        response = self.responses.get(stream_id) if stream_id else None
        if response is None:
            return
        if isinstance(event, h2.events.ResponseReceived):
            response.headers = dict(_text_headers(event.headers))
        elif isinstance(event, h2.events.TrailersReceived):
            response.trailers = dict(_text_headers(event.headers))
        elif isinstance(event, h2.events.DataReceived):
            response.data += event.data
            self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            response.ended = True
        elif isinstance(event, h2.events.StreamReset):
            response.reset = event.error_code

    async def call(
        self,
        path: str,
        body: bytes | None,
        *,
        content_type: str = "application/grpc",
        within: float = 5.0,
    ) -> H2Response:
        stream_id = await self.request(path, body, content_type=content_type)
        with trio.fail_after(within):
            return await self.response(stream_id)

    async def aclose(self) -> None:
        await self.stream.aclose()


def _text_headers(headers: Sequence[tuple[bytes | str, bytes | str]]) -> list[tuple[str, str]]:
    return [
        (
            name.decode() if isinstance(name, bytes) else name,
            value.decode() if isinstance(value, bytes) else value,
        )
        for name, value in headers
    ]


async def raw_register(port: int, *, source: str, role: str = "CCAgent") -> H2Response:
    """One Register on a connection of its own from the address `source`."""
    client = await H2Client.connect(port, source=source)
    try:
        return await client.call("/job.Job/Register", grpc_frame(client_info(role)), within=10)
    finally:
        await client.aclose()
