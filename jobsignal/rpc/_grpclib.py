"""The one place where jobsignal reaches into its dependencies' internals.

grpclib (a range in pyproject.toml) has no hooks for what a production server
must see and bound per connection: PING frames, stream resets, the streams a
connection holds. Each private access to grpclib, h2, trio-asyncio or asyncio
lives in a named function here, so an upgrade of one of them breaks this
module (and its contract tests: tests/rpc/test_grpclib_adapter.py, and
tests/rpc/test_socket_readers.py for the loop's readers) and nothing else.
Each is kept because it pays or is needed (docs/architecture.md section 10).

It also checks one condition of running grpclib on trio-asyncio
(`check_current_task`): grpclib must have bound trio-asyncio's
`asyncio.current_task`, or on Python 3.12+ every RPC fails with UNKNOWN.

`accept_request` drops a finished handler task at once, where grpclib kept
it (and its stream) until the connection's tenth request.

The hot paths of a subscription, each checked against h2's own and each
measured on the real path (docs/architecture.md section 10: 12 to 19 % of
CPU per message, 31 to 49 % of p99): `send_now` queues its DATA frames into
h2 the way h2's own `send_data` does (state machines, both windows, the
output buffer) without building a hyperframe frame object, and
`DirectSender` writes one whole message from `publish` in one piece;
`receive_pings_and_window_updates` takes the PING and WINDOW_UPDATE frames a
client answers each message with the way h2's `receive_data` would
(section 8).

Last, the server loop's socket readers (`rpc.socket_readers`) take over
trio-asyncio's `_add_reader`; the functions they use are at the end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import grpclib
import grpclib.server
import grpclib.utils
from grpclib.metadata import decode_timeout, encode_grpc_message
from grpclib.protocol import Connection, EventsProcessor, H2Protocol
from grpclib.protocol import Stream as ProtocolStream
from h2.connection import ConnectionInputs, ConnectionState, H2Connection
from h2.events import (
    Event,
    PingAckReceived,
    PingReceived,
    RequestReceived,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import StreamClosedError
from h2.settings import SettingCodes
from h2.stream import H2Stream, StreamInputs, StreamState

from jobsignal.config import cannot_listen
from jobsignal.rpc.codec import MESSAGE_PREFIX, PassthroughCodec, truncated_request

# The grpclib releases whose internals this module is tested against (pyproject.toml's
# range; `nox -s tests_lowest` and `tests_newest` run the suite at both ends).
GRPCLIB_RANGE = ((0, 4, 9), (0, 5))


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


if not GRPCLIB_RANGE[0] <= _release(grpclib.__version__) < GRPCLIB_RANGE[1]:
    raise ImportError(  # pragma: no cover (pip enforces the range; this names it)
        f"jobsignal works with grpclib >=0.4.9,<0.5 (it relies on its internals, see"
        f" {__name__}); found {grpclib.__version__}"
    )

ServerStream = grpclib.server.Stream[Any, Any]


def check_current_task() -> None:
    """Refuse to run where grpclib cannot find trio-asyncio's tasks.

    Python 3.12 made `asyncio.current_task` a C function that reads the running
    loop from the thread state, which trio-asyncio never sets for the loop it runs
    inside trio; trio-asyncio replaces `asyncio.current_task` with one that finds
    its loop, when it is imported. grpclib binds `asyncio.current_task` when
    `grpclib.utils` is imported: bound before trio-asyncio's, its `Wrapper` (entered
    by every server handler and client call) raises "no running event loop" and
    every RPC fails with UNKNOWN. jobsignal.rpc imports trio_asyncio first; an
    embedding program that imported grpclib's utilities before trio_asyncio must
    import trio_asyncio first too (on 3.11 the stale binding still works).
    """
    if sys.version_info >= (3, 12) and grpclib.utils._current_task is not asyncio.current_task:
        raise ImportError(
            "grpclib was imported before trio_asyncio, so it cannot find trio-asyncio's"
            " tasks on Python 3.12+ and every RPC would fail: import trio_asyncio before"
            " grpclib (or before anything that imports it), then jobsignal"
        )


# -- the listening server -----------------------------------------------------------------------


async def start_server(
    server: grpclib.server.Server,
    addresses: Sequence[tuple[str, int]],
    *,
    backlog: int,
    wrap: Callable[[H2Protocol], asyncio.BaseProtocol] | None = None,
) -> list[asyncio.Server]:
    """`Server.start` on each address, with a backlog, and each connection's protocol
    (grpclib's own) passed through `wrap` if given (the server's observed protocol,
    rpc/connections.py, and TLS around it, rpc/tls_connections.py). Host "" means every
    address of the host (IPv4 and IPv6 where it has both).

    grpclib knows the first listener only; the caller closes the others.
    """
    loop = asyncio.get_running_loop()

    def protocol_factory() -> asyncio.BaseProtocol:
        protocol: H2Protocol = server._protocol_factory()
        return protocol if wrap is None else wrap(protocol)

    listeners: list[asyncio.Server] = []
    for host, port in addresses:
        family = (
            socket.AF_UNSPEC if not host else (socket.AF_INET6 if ":" in host else socket.AF_INET)
        )
        try:
            listener = await loop.create_server(
                protocol_factory,
                host or None,
                port,
                family=family,
                backlog=backlog,
                reuse_address=True,
            )
        except OSError as error:
            for opened in listeners:
                opened.close()
            raise cannot_listen("--listen", host, port, error) from None
        listeners.append(listener)
    server._server = listeners[0]
    server._server_closed_fut = loop.create_future()
    return listeners


# -- connections and streams ---------------------------------------------------------------------


def connection_of(stream: ServerStream) -> Connection:
    """The grpclib connection a server stream belongs to."""
    connection: Connection = stream._stream.connection
    return connection


def h2_connection_of(protocol: H2Protocol) -> H2Connection:
    h2_connection: H2Connection = protocol.connection._connection
    return h2_connection


def live_streams(processor: EventsProcessor) -> int:
    """Streams of this connection that grpclib accepted and HTTP/2 has not closed.

    Not h2's own count, which already includes every stream opened in the same
    read; not grpclib's, which keeps a stream the client cancelled until its
    handler has finished (a client may open a new stream at once).
    """
    h2_streams = processor.connection._connection.streams
    return sum(
        1
        for stream_id in processor.streams
        if (h2_stream := h2_streams.get(stream_id)) is not None and not h2_stream.closed
    )


def advertise_stream_limit(h2_connection: H2Connection, advertised: int, enforced: int) -> None:
    """Tell the peer `advertised` concurrent streams; let h2 end the connection only past
    `enforced`. h2 enforces the very value it advertises, and a stream over it kills
    the whole connection (it cannot decode that stream's headers, so HPACK state is
    lost); the server refuses the streams in between one by one instead."""
    h2_connection.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: advertised})
    # The acknowledgement would make `advertised` h2's own limit: keep `enforced`.
    h2_connection.local_settings._settings[SettingCodes.MAX_CONCURRENT_STREAMS] = collections.deque(
        [enforced]
    )


def keep_encoder_table_empty(h2_connection: H2Connection) -> None:
    """The server's HPACK encoder without a dynamic table: run when the connection
    is made and after each SETTINGS frame of the peer (h2 resizes the table to
    the peer's HEADER_TABLE_SIZE then).

    A connection answers a Register and a Subscribe or two, whose response
    headers and trailers gain little from indexing, while the table would keep
    them for the connection's whole life. An encoder may use less than the
    size its peer allows and says so at the start of its next header block
    (RFC 7541 section 4.2). The decoder's table stays: telling the peer 0 is
    not enough, since gRPC's C core may send a header block it encoded before
    it read that SETTINGS frame, which h2 then refuses.
    """
    h2_connection.encoder.header_table_size = 0


class _CheckedStream(ProtocolStream):
    """A server stream whose request is read as gRPC messages checked at the boundary.

    Every request is read by grpclib's `recv_message` (through
    `requests.read_request` for job.Job and health, directly by reflection):
    a message's 5-byte prefix, then the body it announces. It buffered the whole
    announced length before its codec saw it (a peer announcing megabytes
    and sending them slowly had them all held), and let a compressed flag or
    a stream ending part-way escape as NotImplementedError or AssertionError
    (UNKNOWN to the client, an ERROR in the log). Here the codec checks each
    prefix before its body is read (`PassthroughCodec.check_prefix`), and a
    stream ending mid-message is INVALID_ARGUMENT. A compressed message is
    read and inflated when its prefix is asked for, and grpclib is given the
    prefix of the inflated message, then the message: it never sees the flag.
    """

    request_codec: PassthroughCodec
    request_encoding: str | None = None  # the request's grpc-encoding header
    body_next = False  # the prefix of a message was read, its body is next
    inflated: bytes | None = None  # a compressed message, inflated: the body to give next

    async def recv_data(self, size: int) -> bytes:
        if self.inflated is not None:
            body, self.inflated = self.inflated, None
            return body
        if self.body_next:
            self.body_next = False
            return await self._read_body(size)
        prefix = await self._read(size)
        if not prefix:  # the stream ended between messages
            return prefix
        encoding, length = self.request_codec.check_prefix(prefix, self.request_encoding)
        if encoding is None:
            self.body_next = True
            return prefix
        self.inflated = self.request_codec.decompress(await self._read_body(length), encoding)
        return MESSAGE_PREFIX.pack(False, len(self.inflated))

    async def _read_body(self, size: int) -> bytes:
        body = await self._read(size)
        if len(body) < size:  # the stream ended before the body
            raise truncated_request()
        return body

    async def _read(self, size: int) -> bytes:
        """grpclib's read: `size` bytes, none when the stream ended before them, and
        AssertionError when it ended part-way."""
        try:
            data: bytes = await super().recv_data(size)
        except AssertionError:
            raise truncated_request() from None
        return data


def _checked_stream(
    connection: Connection, stream_id: int, codec: PassthroughCodec, encoding: str | None
) -> _CheckedStream:
    """A new grpclib stream for a request, reading for `codec` a request sent with
    `encoding` (its grpc-encoding header): what grpclib's `Connection.create_stream`
    makes, as a `_CheckedStream`."""
    stream = _CheckedStream(
        connection, connection._connection, connection._transport, stream_id=stream_id
    )
    stream.request_codec = codec
    stream.request_encoding = encoding
    return stream


# -- reading requests and writing responses on a server stream ----------------------------------


def headers_sent(stream: ServerStream) -> bool:
    """Whether the response headers of a server stream are out."""
    return bool(stream._send_initial_metadata_done)


def queue_headers(stream: ServerStream) -> bool:
    """Queue a server stream's response headers into h2 without writing them; False
    when they cannot go now (a paused socket, a closing connection, a stream h2 no
    longer holds: then grpclib's `send_initial_metadata` waits and decides).

    What grpclib's `send_initial_metadata` does (`:status` 200 and the content
    type; no metadata: jobsignal sends none, and listens to none of grpclib's
    events), minus its write: the caller's next flush writes the headers and the
    DATA queued after them in one write, so a client never sees a stream's
    headers before its first message (an owed snapshot's first job), and no
    trio->asyncio hop is spent per stream (docs/architecture.md section 6).
    """
    if headers_sent(stream):
        return True
    h2_stream = stream._stream
    connection = h2_stream.connection
    stream_id = h2_stream.id
    h2_connection = h2_stream._h2_connection
    if (
        stream_id is None
        or not connection.write_ready.is_set()
        or connection.is_closing()
        or stream_id not in h2_connection.streams
    ):
        return False
    h2_connection.send_headers(
        stream_id, [(":status", "200"), ("content-type", stream._content_type)]
    )
    connection.headers_send_process()
    stream._send_initial_metadata_done = True
    return True


def send_now(stream: ServerStream, data: bytes | memoryview, *, whole: bool = False) -> int:
    """Queue as much of `data` as HTTP/2 lets go without waiting; the bytes queued (0: wait).
    With `whole`, all of `data` or nothing.

    grpclib's HTTP/2 state is plain objects on this same thread, so a trio
    task frames the data directly. h2 keeps the frames (its flow-control
    windows already count them) until the connection's output is written.
    Nothing goes before the response headers, on a paused socket or past the
    stream's window (h2's window for a stream is the smaller of its own and
    the connection's). This is on every delivery's path, so it reads h2's
    state directly rather than through its lookup methods.
    """
    h2_stream = stream._stream
    connection = h2_stream.connection
    if not headers_sent(stream) or not connection.write_ready.is_set() or connection.is_closing():
        return 0
    stream_id = h2_stream.id
    assert stream_id is not None  # set when the request arrived
    h2_connection = h2_stream._h2_connection
    state = h2_connection.streams.get(stream_id)
    if state is None:  # closed, and forgotten by h2
        return 0
    size = min(
        len(data), h2_connection.outbound_flow_control_window, state.outbound_flow_control_window
    )
    # A window may be below zero: a peer that lowers SETTINGS_INITIAL_WINDOW_SIZE
    # takes the difference from every stream's window (RFC 9113, 6.9.2).
    if size <= 0 or (whole and size < len(data)):
        return 0
    frame_size = h2_connection.max_outbound_frame_size
    try:
        if size <= frame_size:  # the usual case: one frame
            _send_data_frame(h2_connection, state, data if size == len(data) else data[:size])
        elif size >= WRITE_PAST_H2_BYTES:
            _write_data_frames(stream, h2_connection, state, memoryview(data)[:size], frame_size)
        else:
            for start in range(0, size, frame_size):
                _send_data_frame(h2_connection, state, data[start : min(size, start + frame_size)])
    except StreamClosedError:
        return 0
    connection.data_send_process()
    return size


# DATA of at least this many bytes at once goes to the transport as views of the
# caller's bytes (`_write_data_frames`), not through h2's output buffer.
WRITE_PAST_H2_BYTES = 64 * 1024


def _write_data_frames(
    stream: ServerStream,
    h2_connection: H2Connection,
    h2_stream: H2Stream,
    data: memoryview,
    frame_size: int,
) -> None:
    """`data` as DATA frames (the caller checked the windows), written now, after
    whatever h2 holds already, as a list of frame headers and views of `data`.

    Through h2's buffer a large rank table was copied twice more per stream
    (appended to `_data_to_send`, then taken out as bytes): a third of the
    server's time with 700 KB tables to 1,000 connections (bench/FINDINGS.md).
    `writelines` hands the views to the socket with one `sendmsg` where asyncio
    has it (3.12 and later; 3.11 joins them once), and keeps what the socket
    does not take as views: `data` is immutable bytes (`rpc.writer.frame`).
    """
    parts: list[bytes | memoryview] = []
    for start in range(0, len(data), frame_size):
        chunk = data[start : start + frame_size]
        parts += (_data_frame_header(h2_connection, h2_stream, len(chunk)), chunk)
    protocol_stream = stream._stream
    protocol_stream.connection.flush()  # what h2 holds goes first
    protocol_stream._transport.writelines(parts)


# The states in which sending DATA leaves h2's state machines as they are (their
# transition is a self-loop with no action: tests/rpc/test_grpclib_adapter.py
# checks it against the installed h2), so `_send_data_frame` skips the machine
# there, and its enum hashing, on every delivery.
SENDING_CONNECTION_STATE = ConnectionState.SERVER_OPEN
SENDING_STREAM_STATES = (StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE)


def _send_data_frame(
    h2_connection: H2Connection, h2_stream: H2Stream, data: bytes | memoryview
) -> None:
    """What h2's `send_data` does for one unpadded DATA frame that fits the windows and
    the frame size (the caller checked both), without building and serializing a
    hyperframe `DataFrame` (a third of the cost of a small delivery) or copying
    a slice of `data` first: the connection's and the stream's state machines
    see SEND_DATA (unless it would leave them as they are:
    `SENDING_CONNECTION_STATE`, `SENDING_STREAM_STATES`), both flow-control
    windows shrink by the payload, and the frame's bytes go to h2's output
    buffer. `tests/rpc/test_grpclib_adapter.py`
    checks that the bytes and the state agree with h2's own `send_data`."""
    h2_connection._data_to_send += _data_frame_header(h2_connection, h2_stream, len(data))
    h2_connection._data_to_send += data


def _data_frame_header(h2_connection: H2Connection, h2_stream: H2Stream, size: int) -> bytes:
    """A DATA frame of `size` payload bytes is sent: h2's machines see SEND_DATA (where
    it changes them), the windows shrink; its 9-byte frame header."""
    connection_machine = h2_connection.state_machine
    if connection_machine.state is not SENDING_CONNECTION_STATE:
        connection_machine.process_input(ConnectionInputs.SEND_DATA)  # raises unless open
    stream_machine = h2_stream.state_machine
    if stream_machine.state not in SENDING_STREAM_STATES:
        stream_machine.process_input(StreamInputs.SEND_DATA)  # raises once closed
    _account_data_frame(h2_connection, h2_stream, size)
    return size.to_bytes(3, "big") + b"\x00\x00" + h2_stream.stream_id.to_bytes(4, "big")


def _account_data_frame(h2_connection: H2Connection, h2_stream: H2Stream, size: int) -> None:
    """A DATA frame of `size` payload bytes leaves: both flow-control windows shrink by it."""
    h2_stream.outbound_flow_control_window -= size
    h2_connection.outbound_flow_control_window -= size


class DirectSender:
    """The shortest path of one whole gRPC message on a server stream whose response
    headers are out: a DATA frame built in one piece and, when nothing else of the
    connection is waiting to be written, handed to the transport as it is.

    It is what `send_now(whole=True)` and a flush do for a message that fits
    one frame and both windows, without their lookups per call (it holds h2's
    stream and connection, grpclib's connection and the transport) and without
    copying the message three times (framed, into h2's buffer, out of it):
    `publish` calls it for every parked subscriber (docs/architecture.md
    section 6). `tests/rpc/test_grpclib_adapter.py` checks that the bytes and
    h2's state agree with h2's own `send_data`.
    """

    __slots__ = ("_connection", "_h2", "_h2_stream", "_stream_tail", "_transport")

    def __init__(self, stream: ServerStream, h2_stream: H2Stream) -> None:
        protocol_stream = stream._stream
        self._connection = protocol_stream.connection
        self._h2: H2Connection = protocol_stream._h2_connection
        self._h2_stream = h2_stream
        self._transport: asyncio.WriteTransport = protocol_stream._transport
        # The frame header's type and flags (DATA, none), the stream id, and the
        # gRPC message's compressed flag (not compressed).
        self._stream_tail = b"\x00\x00" + h2_stream.stream_id.to_bytes(4, "big") + b"\x00"

    @classmethod
    def of(cls, stream: ServerStream) -> DirectSender | None:
        """The stream's sender once its response headers are out and h2 still holds it."""
        protocol_stream = stream._stream
        stream_id = protocol_stream.id
        if not headers_sent(stream) or stream_id is None:
            return None
        h2_stream = protocol_stream._h2_connection.streams.get(stream_id)
        return None if h2_stream is None else cls(stream, h2_stream)

    @property
    def alone(self) -> bool:
        """Whether this is the only stream h2 holds for the connection (see
        `alone_on_connection`)."""
        return len(self._h2.streams) == 1

    def frame_now(self, message: bytes) -> bytes | None:
        """The DATA frame carrying `message`, accounted as sent (both windows,
        grpclib's last-data time), when HTTP/2 lets all of it go
        now in one frame; else None, and nothing changed. The caller writes the
        frame (`write`) before anything else is written on the connection."""
        h2_connection, h2_stream, connection = self._h2, self._h2_stream, self._connection
        size = len(message) + 5
        if (
            size > h2_connection.outbound_flow_control_window
            or size > h2_stream.outbound_flow_control_window
            or size > h2_connection.max_outbound_frame_size
            or not connection.write_ready.is_set()
            or self._transport.is_closing()
            # Elsewhere SEND_DATA would move h2's machines or raise: the general
            # path (`send_now`) deals with those.
            or h2_connection.state_machine.state is not SENDING_CONNECTION_STATE
            or h2_stream.state_machine.state not in SENDING_STREAM_STATES
        ):
            return None
        _account_data_frame(h2_connection, h2_stream, size)
        connection.data_send_process()
        return b"".join(
            (size.to_bytes(3, "big"), self._stream_tail, (size - 5).to_bytes(4, "big"), message)
        )

    def write(self, frame: bytes, *, at_once: bool) -> None:
        """Write `frame` now (`at_once`) or with the connection's next flush; either
        way after whatever h2 holds already, so the frames keep their order."""
        output = self._h2._data_to_send
        if at_once and not output:
            self._transport.write(frame)
            return
        output += frame
        if at_once:
            self._connection.flush()


# -- the frames a gRPC client sends after each message ---------------------------------------

# A grpc-go client answers each message it receives with a connection
# WINDOW_UPDATE and a PING for its bandwidth estimate (BDP), now and then a
# stream WINDOW_UPDATE too, and the server owes a PING ACK: through h2's
# general path (a hyperframe frame object each, its repr for a trace log that
# is off, the state machines, the ACK built and serialized as a frame object)
# about three times the work of the delivery itself.
_PING = 0x6
_WINDOW_UPDATE = 0x8
_ACK = 0x1
_LARGEST_WINDOW = 2**31 - 1
_FRAME_LENGTHS = {_PING: 8, _WINDOW_UPDATE: 4}  # frame type: its only valid length
_PING_ACK_HEADER = b"\x00\x00\x08\x06\x01\x00\x00\x00\x00"
# The states in which receiving PING and WINDOW_UPDATE leaves h2's connection
# machine as it is, and a stream's machine too, only announcing the update
# (checked against the installed h2 by tests/rpc/test_grpclib_adapter.py).
RECEIVING_CONNECTION_STATE = ConnectionState.SERVER_OPEN
WINDOW_STREAM_STATES = (StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE)


def receive_pings_and_window_updates(
    h2_connection: H2Connection, chunk: bytes
) -> list[Event] | None:
    """h2's `receive_data(chunk)` for a chunk of whole, valid PING and WINDOW_UPDATE
    frames (the connection's, or an open stream's) and nothing else, without
    hyperframe: the same events, the PING ACKs in h2's output buffer, the send
    windows grown, as h2 does. None, with nothing changed, for any other chunk (a
    frame of another type, one split across reads, a window that would overflow,
    a stream h2 does not hold open, a connection not open, input h2 still
    buffers): the caller then hands it to h2. `tests/rpc/test_grpclib_adapter.py`
    checks events, bytes and windows against h2 for random chunks."""
    if h2_connection.state_machine.state is not RECEIVING_CONNECTION_STATE:
        return None
    if not _frame_buffer_empty(h2_connection.incoming_buffer):
        return None
    # Every frame is checked before anything changes, so that a chunk h2 must see
    # leaves h2 as it was: the events, the ACKs and the windows after the chunk
    # are gathered first, and applied only once the whole chunk is taken.
    end = len(chunk)
    position = 0
    events: list[Event] = []
    acks = b""
    windows: dict[int, int] = {}  # stream id (0: the connection): its window after the chunk
    streams = h2_connection.streams
    while position < end:
        if end - position < 9:
            return None
        frame_type = chunk[position + 3]
        length = _FRAME_LENGTHS.get(frame_type)
        if length is None or int.from_bytes(chunk[position : position + 3], "big") != length:
            return None
        stream_id = int.from_bytes(chunk[position + 5 : position + 9], "big")
        body = position + 9
        if end - body < length:
            return None
        if frame_type == _PING:
            if stream_id:
                return None
            opaque = chunk[body : body + 8]
            if chunk[position + 4] & _ACK:
                events.append(PingAckReceived(ping_data=opaque))
            else:
                events.append(PingReceived(ping_data=opaque))
                acks += _PING_ACK_HEADER + opaque
        else:
            window = windows.get(stream_id)
            if window is None:
                if not stream_id:
                    window = h2_connection.outbound_flow_control_window
                else:
                    stream = streams.get(stream_id)  # (a reserved bit set: no such id)
                    if stream is None or stream.state_machine.state not in WINDOW_STREAM_STATES:
                        return None
                    window = stream.outbound_flow_control_window
            increment = int.from_bytes(chunk[body : body + 4], "big")
            if not 1 <= increment <= _LARGEST_WINDOW - window:  # (h2 raises or resets; let it)
                return None
            windows[stream_id] = window + increment
            events.append(WindowUpdated(stream_id=stream_id, delta=increment))
        position = body + length
    for stream_id, window in windows.items():
        if stream_id:
            streams[stream_id].outbound_flow_control_window = window
        else:
            h2_connection.outbound_flow_control_window = window
    h2_connection._data_to_send += acks
    return events


def _frame_buffer_empty(buffer: Any) -> bool:
    """Whether h2's frame buffer holds nothing: the preface read, no partial frame,
    no header block waiting for its CONTINUATION (False where it cannot tell)."""
    buffered = getattr(buffer, "_data", getattr(buffer, "data", None))
    if buffered is None or getattr(buffer, "_preamble_len", None) != 0:
        return False
    return not buffered and not getattr(buffer, "_headers_buffer", True)


def alone_on_connection(stream: ServerStream) -> bool:
    """Whether this is the only stream h2 holds for its connection (h2 forgets closed
    streams lazily, so False may also mean a finished one lingers)."""
    return len(stream._stream._h2_connection.streams) == 1


def connection_can_send(connection: Connection) -> bool:
    """Whether any stream of this grpclib connection could send data now: the socket
    takes writes and the connection's own flow-control window is open."""
    if not connection.write_ready.is_set() or connection.is_closing():
        return False
    window: int = connection._connection.outbound_flow_control_window
    return window > 0


def stream_closed(stream: ServerStream) -> bool:
    """Whether HTTP/2 will take no more data on this stream (it or its connection ended)."""
    h2_stream = stream._stream
    if h2_stream.connection.is_closing():
        return True
    stream_id = h2_stream.id
    state = h2_stream._h2_connection.streams.get(stream_id) if stream_id is not None else None
    return state is None or bool(state.closed)


# -- grpclib's event processing ------------------------------------------------------------------


def set_event_handler(
    processor: EventsProcessor, event_type: type[Event], handler: Callable[[Any], None]
) -> None:
    processor.processors[event_type] = handler


def process_event(processor: EventsProcessor, event: Event) -> None:
    """grpclib's handling of `event`; events it has no handler for are informational
    (unknown frame types, for example) and ignored, where grpclib would raise."""
    processors = getattr(processor, "processors", None)
    if processors is None:  # the connection is closed
        return
    handler = processors.get(type(event))
    if handler is not None:
        handler(event)


def grpc_timeout(headers: Sequence[Any]) -> float | None:
    """The shortest grpc-timeout of a request's headers (str pairs: grpclib has h2
    decode them), in seconds, as grpclib reads it; None without one, or with one
    grpclib cannot read (it answers that itself)."""
    timeouts = [value for name, value in headers if name == "grpc-timeout"]
    try:
        return min(map(decode_timeout, timeouts), default=None)
    except ValueError:
        return None


def request_encoding(headers: Sequence[Any]) -> str | None:
    """The grpc-encoding a request's headers (str pairs) name for its messages, if any."""
    for name, value in headers:
        if name == "grpc-encoding":
            return str(value)
    return None


def accept_request(processor: EventsProcessor, event: RequestReceived) -> None:
    """Start grpclib's handler for a new request, with its stream released however it ends.

    grpclib releases a stream in the handler task's `finally`. A stream reset
    before its task first runs (HTTP/2 Rapid Reset) cancels a task that never
    starts, so that `finally` never runs and the stream stayed in the
    processor forever. Here the release also runs when the task is done, once.
    """
    handler: Any = processor.handler  # grpclib's server Handler
    encoding = request_encoding(event.headers)
    stream = _checked_stream(processor.connection, event.stream_id, handler.codec, encoding)
    release = _ReleaseOnce(processor.register(stream), handler, stream)
    handler.accept(stream, event.headers, release)
    task: asyncio.Task[None] | None = getattr(handler, "_tasks", {}).get(stream)
    if task is not None:
        task.add_done_callback(release.task_done)


class _ReleaseOnce:
    """grpclib's release of one stream, run once: by its handler's `finally` or when
    its task is done, whichever comes first (a slotted object, not closures)."""

    __slots__ = ("_handler", "_release", "_stream")

    def __init__(self, release: Callable[[], None], handler: Any, stream: ProtocolStream) -> None:
        self._release: Callable[[], None] | None = release
        self._handler = handler
        self._stream = stream

    def __call__(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def task_done(self, task: asyncio.Task[None]) -> None:
        self()
        forget_task(self._handler, self._stream, task)


def forget_task(handler: Any, stream: ProtocolStream, task: asyncio.Task[None]) -> None:
    """Drop a finished handler task from grpclib's `Handler`, as its own clean-up
    does, but now: that runs only every tenth request of a connection, and until
    then a finished Register (say) kept its task and its whole stream."""
    tasks: dict[ProtocolStream, asyncio.Task[None]] = handler._tasks  # rebuilt by each clean-up
    if tasks.get(stream) is task:
        del tasks[stream]
    handler._cancelled.discard(task)


def reset_stream(processor: EventsProcessor, event: StreamReset) -> None:
    """grpclib's handling of a reset stream, for a stream whose task may be gone.

    grpclib's handler forgets finished tasks every few requests; a reset of a
    stream whose task it already forgot raised KeyError out of the protocol.
    """
    with contextlib.suppress(KeyError):  # its handler task had finished: nothing to cancel
        processor.process_stream_reset(event)


def encode_message(message: str) -> str:
    """A `grpc-message` header value (percent-encoded as gRPC requires)."""
    encoded: str = encode_grpc_message(message)
    return encoded


# -- trio-asyncio's loop: its readers (rpc/socket_readers.py) ----------------------------------
# trio-asyncio serves asyncio's `add_reader` with its loop's private `_add_reader`
# (a trio task per descriptor); `rpc.socket_readers` takes that method over and
# keeps the rest of trio-asyncio's reader bookkeeping. Checked against the
# installed trio-asyncio and asyncio by tests/rpc/test_socket_readers.py.


def take_over_readers(loop: asyncio.AbstractEventLoop, add_reader: Callable[..., Any]) -> None:
    """Have `add_reader(fileobj, callback, *args)` serve every reader `loop` adds from
    now on (`add_reader` and each transport's reads), on this loop object only."""
    trio_asyncio_loop: Any = loop
    trio_asyncio_loop._add_reader = add_reader


def add_reader_with_trio_asyncio(
    loop: asyncio.AbstractEventLoop, fileobj: Any, callback: Callable[..., object], *args: Any
) -> asyncio.Handle:
    """trio-asyncio's own way of adding a reader (its trio task for the descriptor),
    whether or not `take_over_readers` replaced it on `loop`."""
    handle: asyncio.Handle = type(loop)._add_reader(loop, fileobj, callback, *args)  # type: ignore[attr-defined]
    return handle


def check_loop_open(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio's RuntimeError for a closed loop, as its `add_reader` raises it."""
    trio_asyncio_loop: Any = loop
    trio_asyncio_loop._check_closed()


def set_read_handle(
    loop: asyncio.AbstractEventLoop, fd: int, handle: asyncio.Handle
) -> asyncio.Handle | None:
    """Make `handle` the reader of `fd` in trio-asyncio's map of readers and writers
    (which its `remove_reader` and its transports consult); the reader it replaced."""
    trio_asyncio_loop: Any = loop
    replaced: asyncio.Handle | None = trio_asyncio_loop._set_read_handle(fd, handle)
    return replaced


class ReaderHandle(asyncio.Handle):
    """A reader's handle that trio-asyncio's loop can close with: at close it cancels
    the trio cancel scope it finds in each reader's `_scope`; this one has none."""

    __slots__ = ("_scope",)

    def __init__(
        self, callback: Callable[..., object], args: Sequence[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        super().__init__(callback, args, loop)
        self._scope = None


def run_handle(handle: asyncio.Handle) -> None:
    """Run a handle's callback as the loop would (errors to its exception handler)."""
    runnable: Any = handle
    runnable._run()


def callback_of(handle: asyncio.Handle) -> tuple[Callable[..., object], tuple[Any, ...]]:
    """A handle's callback and its arguments."""
    held: Any = handle
    return held._callback, held._args


# -- for tests: grpclib's deferred clean-up -------------------------------------------------------


def collect_garbage() -> None:
    """Make every grpclib server drop now what it keeps of closed connections.

    grpclib forgets a closed connection's handler (with its finished request
    tasks and streams) only at every tenth new connection, and a live
    connection's finished tasks at every tenth request (grpclib.server._GC).
    """
    from grpclib._registry import servers  # (the live grpclib servers, a WeakSet)

    for server in list(servers):
        server.__gc_collect__()
        for handler in server._handlers:
            handler.__gc_collect__()
