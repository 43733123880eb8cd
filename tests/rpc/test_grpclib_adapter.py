"""Contract tests of jobsignal's adapter around grpclib (jobsignal/rpc/_grpclib.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import types
from typing import Any, cast

import grpclib.protocol
import grpclib.utils
import h2.connection
import h2.exceptions
import h2.stream
import hyperframe.frame
import pytest
import trio
import trio_asyncio
from grpclib.config import Configuration
from h2.connection import ConnectionInputs, H2Connection
from h2.events import (
    DataReceived,
    PingAckReceived,
    PingReceived,
    RequestReceived,
    ResponseReceived,
    WindowUpdated,
)
from h2.events import Event as H2Event
from h2.settings import SettingCodes
from h2.stream import StreamInputs
from hypothesis import given
from hypothesis import strategies as st

import jobsignal.rpc  # noqa: F401  (importing jobsignal.rpc installs the adapter)
from jobsignal.rpc import _grpclib
from tests.support.grpc_server import open_jobsignal_server
from tests.support.grpcio import GrpcioClients, GrpcioStream
from tests.support.h2_client import h2_pair
from tests.support.threads import in_thread
from tests.support.waiting import wait_until


def test_grpclib_looks_up_the_current_task_through_trio_asyncio() -> None:
    # On Python 3.12+ the C `current_task` grpclib captured at import cannot see
    # trio-asyncio's loop; every handler and call would fail with UNKNOWN.
    assert grpclib.utils._current_task is asyncio.current_task


IMPORT_ORDER = """
import sys
for name in sys.argv[1:]:
    __import__(name)
print("imported")
"""


@pytest.mark.parametrize(
    "grpclib_first", [False, True], ids=["trio_asyncio_first", "grpclib_first"]
)
def test_jobsignal_binds_grpclib_to_trio_asyncio_without_writing_into_it(
    grpclib_first: bool,
) -> None:
    """jobsignal.rpc imports trio_asyncio before grpclib; a program that bound grpclib
    first is told what to do (on 3.12+, where that binding fails every RPC)."""
    order = ["grpclib.utils", "trio_asyncio"] if grpclib_first else []
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ORDER, *order, "jobsignal.rpc"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if grpclib_first and sys.version_info >= (3, 12):
        assert done.returncode != 0
        assert "import trio_asyncio before grpclib" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "imported"


async def test_grpclib_wrappers_work_inside_a_trio_asyncio_task() -> None:
    async def enter_wrapper() -> bool:
        wrapper = grpclib.utils.Wrapper()
        with wrapper:
            await asyncio.sleep(0)
        return True

    async with trio_asyncio.open_loop():
        assert await trio_asyncio.aio_as_trio(enter_wrapper)()
    await trio.lowlevel.checkpoint()


async def test_every_grpclib_internal_the_adapter_uses_exists() -> None:
    """A grpclib or h2 upgrade that renames one of these fails here, by name."""
    import grpclib.protocol
    import grpclib.server
    import h2.connection
    import h2.settings

    server_attrs = ["_protocol_factory", "_server", "_server_closed_fut", "_handlers"]
    async with trio_asyncio.open_loop():  # Server() reads the current loop
        server = grpclib.server.Server([])
    for name in server_attrs:
        assert hasattr(server, name), f"grpclib Server.{name}"
    stream_attrs = ["_stream", "_codec", "_send_initial_metadata_done", "_send_message_done"]
    source = grpclib.server.Stream.__init__.__code__.co_names
    for name in stream_attrs:
        assert name in source or hasattr(grpclib.server.Stream, name), f"Stream.{name}"
    protocol_stream = grpclib.protocol.Stream.__init__.__code__.co_names
    for name in ["_h2_connection", "_transport", "connection", "id"]:
        assert name in protocol_stream or hasattr(grpclib.protocol.Stream, name), name
    processor_methods = ["register", "process", "process_stream_reset", "close"]
    for name in processor_methods:
        assert callable(getattr(grpclib.protocol.EventsProcessor, name)), name
    assert "processors" in grpclib.protocol.EventsProcessor.__init__.__code__.co_names
    for name in ["_tasks", "_cancelled"]:  # forget_task drops finished tasks from both
        assert name in grpclib.server.Handler.__init__.__code__.co_names, f"Handler.{name}"
    connection = h2.connection.H2Connection()
    assert isinstance(connection.local_settings._settings, dict)
    assert h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS in connection.local_settings._settings
    for name in ["send_data", "send_headers", "reset_stream", "close_connection", "streams"]:
        assert hasattr(connection, name), f"H2Connection.{name}"


# -- the advertised stream limit ---------------------------------------------------------------


def test_advertised_stream_limit_survives_the_acknowledgement() -> None:
    server, client = h2_pair()
    _grpclib.advertise_stream_limit(server, 10, 110)
    client.receive_data(server.data_to_send())
    assert client.remote_settings.max_concurrent_streams == 10  # what the peer is told
    server.receive_data(client.data_to_send())  # its ACK
    assert server.local_settings.max_concurrent_streams == 110  # what h2 enforces


def headers_of(event: RequestReceived | ResponseReceived) -> list[tuple[object, object]]:
    return [tuple(header) for header in event.headers or []]  # type: ignore[misc]


def request_and_response(server: H2Connection, client: H2Connection, index: int) -> bytes:
    """One request (headers that fill and churn the server's decoder table) and its
    response (churning the server's encoder table); the bytes the server wrote."""
    stream_id = 2 * index + 1
    client.send_headers(
        stream_id,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/job.Job/SubscribeJobSummarySignal"),
            (":authority", "127.0.0.1"),
            (f"x-request-{index % 7}", "v" * (50 + index)),
        ],
        end_stream=True,
    )
    (request, *_) = server.receive_data(client.data_to_send())
    assert isinstance(request, RequestReceived)
    assert (f"x-request-{index % 7}", "v" * (50 + index)) in headers_of(request)
    server.send_headers(
        stream_id,
        [(":status", "200"), ("grpc-status", "0"), ("grpc-message", f"done {index}" * 20)],
        end_stream=True,
    )
    written = server.data_to_send()
    (response, *_) = client.receive_data(written)
    assert isinstance(response, ResponseReceived)
    assert ("grpc-message", f"done {index}" * 20) in headers_of(response)
    return written


class RecordingTransport:
    """Enough of an asyncio transport for grpclib's Connection and Stream: what was
    written (and each write apart), closing on demand."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written += data
        self.writes.append(bytes(data))

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        self.write(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        pass


def grpclib_stream() -> tuple[grpclib.protocol.Connection, grpclib.protocol.Stream, H2Connection]:
    """A grpclib server connection with one open request stream (id 1) from a client."""
    server, client = h2_pair()
    request = [(":method", "POST"), (":scheme", "http"), (":path", "/x"), (":authority", "a")]
    client.send_headers(1, request)
    server.receive_data(client.data_to_send())
    transport: Any = RecordingTransport()
    connection = grpclib.protocol.Connection(server, transport, config=Configuration())
    return connection, connection.create_stream(stream_id=1), client


def stream_events(stream: grpclib.protocol.Stream) -> list[asyncio.Event]:
    return [stream.window_updated, stream.headers_received, stream.trailers_received]


def frame_exchange(server: H2Connection, client: H2Connection) -> list[str]:
    """Every kind of frame a client sends a server; the events (by name) it produced."""
    names: list[str] = []

    def deliver() -> None:
        names.extend(type(event).__name__ for event in server.receive_data(client.data_to_send()))
        client.receive_data(server.data_to_send())

    request = [(":method", "POST"), (":scheme", "http"), (":path", "/x"), (":authority", "a")]
    client.send_headers(1, request)
    client.send_data(1, b"request")
    client.increment_flow_control_window(1000)
    client.ping(b"12345678")
    client.prioritize(1, weight=32)
    client.update_settings({SettingCodes.MAX_FRAME_SIZE: 32768})
    deliver()
    client.send_headers(3, request, end_stream=True)
    client.reset_stream(1)
    client.close_connection()
    deliver()
    return names


class RecordingHandler:
    """A grpclib request handler that records what it is given."""

    def __init__(self) -> None:
        self.accepted: list[int | None] = []
        self.closed = False

    def accept(self, stream: Any, headers: Any, release_stream: Any) -> None:
        self.accepted.append(stream.id)

    def cancel(self, stream: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def grpclib_processor(h2_connection: H2Connection) -> grpclib.protocol.EventsProcessor:
    transport: Any = RecordingTransport()
    connection = grpclib.protocol.Connection(h2_connection, transport, config=Configuration())
    handler: Any = RecordingHandler()
    return grpclib.protocol.EventsProcessor(handler, connection)


class OtherEvent(H2Event):
    """An event grpclib has no processor for."""


async def test_connection_can_send_follows_the_socket_and_the_shared_window() -> None:
    """The waiting streams' pump stops on it: it must turn False when the connection's
    window is used up or the socket is paused, and True again when either reopens."""

    async def scenario() -> None:
        connection, _, client = grpclib_stream()
        server = connection._connection
        connection.write_ready.set()
        assert _grpclib.connection_can_send(connection)
        server.send_headers(1, [(":status", "200")])
        window = server.outbound_flow_control_window
        frame = server.max_outbound_frame_size
        for start in range(0, window, frame):
            server.send_data(1, b"x" * min(frame, window - start))
        assert server.outbound_flow_control_window == 0
        assert not _grpclib.connection_can_send(connection)
        client.receive_data(server.data_to_send())
        client.increment_flow_control_window(1024)
        server.receive_data(client.data_to_send())
        assert _grpclib.connection_can_send(connection)
        connection.write_ready.clear()  # the socket is paused
        assert not _grpclib.connection_can_send(connection)

    async with trio_asyncio.open_loop():
        await trio_asyncio.aio_as_trio(scenario)()


# -- the one-frame fast path of send_now ----------------------------------------------------------


class ReadyConnection:
    """The parts of grpclib's Connection that send_now reads: writable, not closing."""

    class _Ready:
        def is_set(self) -> bool:
            return True

    write_ready = _Ready()

    def is_closing(self) -> bool:
        return False

    def data_send_process(self) -> None:
        pass


def server_stream_on(server: H2Connection, stream_id: int) -> Any:
    """A grpclib server stream, as far as send_now looks at it, on `server`'s stream."""
    protocol_stream = types.SimpleNamespace(
        connection=ReadyConnection(), id=stream_id, _h2_connection=server
    )
    return types.SimpleNamespace(_stream=protocol_stream, _send_initial_metadata_done=True)


def responding(server: H2Connection, client: H2Connection, stream_id: int = 1) -> None:
    """A request on `stream_id`, and the response headers the server sends first."""
    request = [(":method", "POST"), (":scheme", "http"), (":path", "/p"), (":authority", "h")]
    client.send_headers(stream_id, request, end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(stream_id, [(":status", "200")])
    client.receive_data(server.data_to_send())


def h2_state(server: H2Connection, stream_id: int) -> tuple[object, ...]:
    stream = server.streams[stream_id]
    return (
        server.outbound_flow_control_window,
        stream.outbound_flow_control_window,
        server.local_flow_control_window(stream_id),
        server.state_machine.state,
        stream.state_machine.state,
    )


@pytest.mark.parametrize("size", [1, 1_000, 16_384, 16_385, 40_000])
@pytest.mark.parametrize("view", [False, True], ids=["bytes", "memoryview"])
def test_send_now_leaves_h2_exactly_as_its_own_send_data(size: int, view: bool) -> None:
    """send_now frames DATA itself, not through hyperframe; the bytes on the wire,
    both flow-control windows and both state machines agree with h2's own
    send_data, frame by frame, and the peer reads the message."""
    (fast, fast_client), (plain, plain_client) = h2_pair(), h2_pair()
    for server, client in ((fast, fast_client), (plain, plain_client)):
        responding(server, client)
    message = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    data = memoryview(message) if view else message
    assert _grpclib.send_now(server_stream_on(fast, 1), data, whole=True) == size
    frame_size = plain.max_outbound_frame_size
    for start in range(0, size, frame_size):
        plain.send_data(1, message[start : start + frame_size])
    assert h2_state(fast, 1) == h2_state(plain, 1)
    written = fast.data_to_send()
    assert written == plain.data_to_send()
    received = fast_client.receive_data(written)
    assert b"".join(e.data for e in received if isinstance(e, DataReceived)) == message


@pytest.mark.parametrize("size", [_grpclib.WRITE_PAST_H2_BYTES, 200_000])
def test_large_data_goes_past_h2s_buffer_as_h2_would_have_written_it(size: int) -> None:
    """DATA of WRITE_PAST_H2_BYTES or more goes to the transport as views, not through
    h2's buffer: after what h2 held already (a PING here), the same bytes, windows
    and states as h2's own send_data, and the peer reads the message."""
    (fast, fast_client), (plain, plain_client) = h2_pair(), h2_pair()
    for server, client in ((fast, fast_client), (plain, plain_client)):
        responding(server, client)
        client.increment_flow_control_window(2**20)
        client.increment_flow_control_window(2**20, stream_id=1)
        server.receive_data(client.data_to_send())
        server.ping(b"12345678")  # held by h2, not written yet
    transport = RecordingTransport()
    connection = grpclib.protocol.Connection(fast, cast(Any, transport), config=Configuration())
    stream: Any = types.SimpleNamespace(
        _stream=connection.create_stream(stream_id=1), _send_initial_metadata_done=True
    )
    message = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    assert _grpclib.send_now(stream, memoryview(message)) == size
    assert fast.data_to_send() == b""  # nothing left in h2's buffer
    frame_size = plain.max_outbound_frame_size
    for start in range(0, size, frame_size):
        plain.send_data(1, message[start : start + frame_size])
    assert bytes(transport.written) == plain.data_to_send()
    assert h2_state(fast, 1) == h2_state(plain, 1)
    received = fast_client.receive_data(bytes(transport.written))
    assert b"".join(e.data for e in received if isinstance(e, DataReceived)) == message


def test_the_states_where_send_now_skips_h2s_state_machines_are_self_loops() -> None:
    """`_send_data_frame` feeds SEND_DATA to h2's state machines only outside these
    states: an h2 whose transitions there act or move fails here."""
    connection_state = _grpclib.SENDING_CONNECTION_STATE
    transitions = h2.connection.H2ConnectionStateMachine._transitions
    assert transitions[(connection_state, ConnectionInputs.SEND_DATA)] == (None, connection_state)
    for state in _grpclib.SENDING_STREAM_STATES:
        assert h2.stream._transitions[(state, StreamInputs.SEND_DATA)] == (None, state)


def test_send_now_whole_sends_nothing_when_the_window_is_short() -> None:
    server, client = h2_pair()
    responding(server, client)
    before = h2_state(server, 1)
    window = server.local_flow_control_window(1)
    stream = server_stream_on(server, 1)
    assert _grpclib.send_now(stream, b"x" * (window + 1), whole=True) == 0
    assert h2_state(server, 1) == before and server.data_to_send() == b""
    assert _grpclib.send_now(stream, b"x" * (window + 1)) == window  # not whole: what fits


@pytest.mark.parametrize("lowered_by", [0, 1, 65_535], ids=["shut", "negative", "far-below"])
def test_send_now_sends_nothing_through_a_shut_or_negative_window(lowered_by: int) -> None:
    """A peer that lowers SETTINGS_INITIAL_WINDOW_SIZE takes the difference from
    every stream's window, which may go below zero (RFC 9113, 6.9.2). send_now
    returned that negative size, and the output's round-robin then spun for ever
    at full CPU, its budget growing (found by fuzzing the server)."""
    server, client = h2_pair()
    responding(server, client)
    window = server.local_flow_control_window(1)
    assert _grpclib.send_now(server_stream_on(server, 1), b"x" * window) == window  # all of it
    client.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 65_535 - lowered_by})
    server.receive_data(client.data_to_send())
    server.data_to_send()
    assert server.streams[1].outbound_flow_control_window == -lowered_by
    before = h2_state(server, 1)
    for whole in (False, True):
        assert _grpclib.send_now(server_stream_on(server, 1), b"y" * 10, whole=whole) == 0
    assert h2_state(server, 1) == before and server.data_to_send() == b""


def test_send_now_on_a_closed_stream_sends_nothing() -> None:
    server, client = h2_pair()
    responding(server, client)
    server.end_stream(1)
    server.data_to_send()
    assert _grpclib.send_now(server_stream_on(server, 1), b"late", whole=True) == 0
    assert server.data_to_send() == b""


def test_send_now_builds_no_hyperframe_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path is taken, for one frame and many, from bytes and from a view
    (h2's own send_data would construct a DataFrame per frame)."""
    server, client = h2_pair()
    responding(server, client)

    def no_frames(*args: object, **kwargs: object) -> None:
        raise AssertionError("h2 built a DataFrame")

    monkeypatch.setattr(h2.stream, "DataFrame", no_frames)
    assert _grpclib.send_now(server_stream_on(server, 1), b"m" * 1_000, whole=True) == 1_000
    many = memoryview(b"m" * 40_000)  # three frames of the default 16 KiB
    assert _grpclib.send_now(server_stream_on(server, 1), many) == 40_000
    with pytest.raises(AssertionError, match="DataFrame"):  # the patch is in force
        server.send_data(1, b"m")


# -- DirectSender: one whole message from publish ------------------------------------------------


def direct_sender_on(
    server: H2Connection, stream_id: int = 1
) -> tuple[_grpclib.DirectSender, grpclib.protocol.Connection, RecordingTransport]:
    """A DirectSender of a grpclib server stream on `server`'s stream, its response
    headers out; with grpclib's connection and the transport it writes to."""
    transport = RecordingTransport()
    connection = grpclib.protocol.Connection(server, cast(Any, transport), config=Configuration())
    stream: Any = types.SimpleNamespace(
        _stream=connection.create_stream(stream_id=stream_id), _send_initial_metadata_done=True
    )
    sender = _grpclib.DirectSender.of(stream)
    assert sender is not None
    return sender, connection, transport


def grpc_framed(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


@pytest.mark.parametrize("size", [0, 1, 1_000, 16_384 - 5])
def test_direct_sender_leaves_h2_exactly_as_its_own_send_data(size: int) -> None:
    """The frame DirectSender writes, both windows and both state machines agree
    with h2's own send_data of the gRPC-framed message,
    and the peer reads the message."""
    (fast, fast_client), (plain, plain_client) = h2_pair(), h2_pair()
    for server, client in ((fast, fast_client), (plain, plain_client)):
        responding(server, client)
        server.data_to_send()
    message = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    sender, connection, transport = direct_sender_on(fast)
    frame = sender.frame_now(message)
    assert frame is not None
    sender.write(frame, at_once=True)
    plain.send_data(1, grpc_framed(message))
    assert connection.last_data_sent is not None
    assert h2_state(fast, 1) == h2_state(plain, 1)
    assert transport.writes == [plain.data_to_send()]  # straight to the transport
    received = fast_client.receive_data(transport.writes[0])
    assert b"".join(e.data for e in received if isinstance(e, DataReceived)) == grpc_framed(message)


def test_direct_sender_writes_after_what_h2_holds_and_can_wait_for_the_flush() -> None:
    """Frames keep their order: with output already in h2's buffer (a PING ACK
    waiting for the next write) the frame goes behind it; not at once, it waits
    in h2's buffer for the connection's flush."""
    server, client = h2_pair()
    responding(server, client)
    server.data_to_send()
    sender, connection, transport = direct_sender_on(server)
    server.ping(b"12345678")  # something of the connection's already waiting
    first = sender.frame_now(b"one")
    assert first is not None
    sender.write(first, at_once=True)
    assert len(transport.writes) == 1 and transport.writes[0].endswith(first)
    second = sender.frame_now(b"two")
    assert second is not None
    sender.write(second, at_once=False)
    assert len(transport.writes) == 1  # waits for the flush
    connection.flush()
    assert transport.writes[1] == second
    events = client.receive_data(bytes(transport.written))
    data = b"".join(e.data for e in events if isinstance(e, DataReceived))
    assert data == grpc_framed(b"one") + grpc_framed(b"two")


def test_direct_sender_sends_nothing_where_http2_would_not_take_all_of_it_now() -> None:
    """A short window, a message over the frame size, a paused socket, a closing
    transport, a closed stream: None, and h2's state as it was."""
    server, client = h2_pair()
    responding(server, client)
    server.data_to_send()
    sender, connection, transport = direct_sender_on(server)
    before = h2_state(server, 1)
    window = server.local_flow_control_window(1)
    assert sender.frame_now(b"x" * (window - 4)) is None  # 5 bytes of framing: one too many
    assert sender.frame_now(b"x" * server.max_outbound_frame_size) is None
    connection.write_ready.clear()
    assert sender.frame_now(b"x") is None
    connection.write_ready.set()
    transport.closing = True
    assert sender.frame_now(b"x") is None
    transport.closing = False
    assert h2_state(server, 1) == before and connection.last_data_sent is None
    server.end_stream(1)
    server.data_to_send()
    assert sender.frame_now(b"late") is None
    assert server.data_to_send() == b"" and transport.writes == []


def test_direct_sender_waits_for_the_response_headers() -> None:
    server, client = h2_pair()
    request = [(":method", "POST"), (":scheme", "http"), (":path", "/p"), (":authority", "h")]
    client.send_headers(1, request, end_stream=True)
    server.receive_data(client.data_to_send())
    connection = grpclib.protocol.Connection(
        server, cast(Any, RecordingTransport()), config=Configuration()
    )
    stream: Any = types.SimpleNamespace(
        _stream=connection.create_stream(stream_id=1), _send_initial_metadata_done=False
    )
    assert _grpclib.DirectSender.of(stream) is None
    stream._send_initial_metadata_done = True
    assert _grpclib.DirectSender.of(stream) is not None


def test_direct_sender_knows_whether_its_stream_is_alone() -> None:
    server, client = h2_pair()
    responding(server, client, 1)
    sender, _, _ = direct_sender_on(server)
    assert sender.alone
    responding(server, client, 3)
    assert not sender.alone


def test_the_states_where_pings_and_window_updates_skip_h2s_machines() -> None:
    """`receive_pings_and_window_updates` works only in these states: there h2's
    connection machine neither acts nor moves on PING and WINDOW_UPDATE, and a
    stream's machine only announces the update. An h2 that does more fails here."""
    state = _grpclib.RECEIVING_CONNECTION_STATE
    transitions = h2.connection.H2ConnectionStateMachine._transitions
    for received in (ConnectionInputs.RECV_PING, ConnectionInputs.RECV_WINDOW_UPDATE):
        assert transitions[(state, received)] == (None, state)
    for stream_state in _grpclib.WINDOW_STREAM_STATES:
        action, target = h2.stream._transitions[(stream_state, StreamInputs.RECV_WINDOW_UPDATE)]
        assert (action, target) == (h2.stream.H2StreamStateMachine.window_updated, stream_state)


def frame_bytes(frame_type: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    header = len(payload).to_bytes(3, "big") + bytes([frame_type, flags])
    return header + stream_id.to_bytes(4, "big") + payload


# What a client may send between two requests: the connection-level PING and
# WINDOW_UPDATE of the fast path, and now and then a frame only h2 may handle.
FAST_FRAMES = st.one_of(
    st.builds(
        lambda ack, other_flags, opaque: frame_bytes(0x6, ack | other_flags, 0, opaque),
        st.sampled_from([0, 1]),
        st.sampled_from([0, 0x80]),
        st.binary(min_size=8, max_size=8),
    ),
    st.builds(
        lambda stream_id, increment: frame_bytes(0x8, 0, stream_id, increment.to_bytes(4, "big")),
        st.sampled_from([0, 1]),  # the connection, or the open stream
        st.integers(1, 70_000),
    ),
)
OTHER_FRAMES = st.one_of(
    st.builds(  # an increment of 0, or one that overflows the window
        lambda increment: frame_bytes(0x8, 0, 0, increment.to_bytes(4, "big")),
        st.sampled_from([0, 2**31 - 1, 2**31, 2**32 - 1]),
    ),
    st.builds(  # a stream h2 never saw, or one that would overflow the open stream's window
        lambda stream_id, increment: frame_bytes(0x8, 0, stream_id, increment.to_bytes(4, "big")),
        st.sampled_from([1, 3]),
        st.sampled_from([100, 2**31 - 1]),
    ),
    st.builds(lambda: frame_bytes(0x6, 0, 1, b"12345678")),  # PING off stream 0
    st.builds(lambda n: frame_bytes(0x6, 0, 0, b"p" * n), st.sampled_from([0, 7, 9])),
    st.builds(  # the reserved bit set, on the connection or on the open stream
        lambda stream_id: frame_bytes(0x8, 0, stream_id, (5).to_bytes(4, "big")),
        st.sampled_from([0x80000000, 0x80000001]),
    ),
    st.builds(lambda: frame_bytes(0x4, 0, 0, b"")),  # SETTINGS
)


@given(
    frames=st.lists(FAST_FRAMES, min_size=1, max_size=6),
    other=st.none() | st.tuples(st.integers(0, 6), OTHER_FRAMES),
    cut=st.sampled_from([0, 0, 0, 1, 8, 13]),
)
def test_pings_and_window_updates_leave_h2_exactly_as_its_own_receive_data(
    frames: list[bytes], other: tuple[int, bytes] | None, cut: int
) -> None:
    """For any chunk it takes, the fast path gives h2's events, the same bytes to
    send (the PING ACKs) and the same send window; a chunk it refuses (another
    frame in it, a frame cut short) changes nothing, for h2 to handle."""
    if other is not None:
        frames.insert(other[0], other[1])
    chunk = b"".join(frames)
    chunk = chunk[: len(chunk) - cut] if cut < len(chunk) else chunk
    (fast, fast_client), (plain, plain_client) = h2_pair(), h2_pair()
    for server, client in ((fast, fast_client), (plain, plain_client)):
        responding(server, client)
        server.data_to_send()
    before = h2_state(fast, 1)
    events = _grpclib.receive_pings_and_window_updates(fast, chunk)
    if events is None:
        assert h2_state(fast, 1) == before
        assert fast.data_to_send() == b""
        return
    assert events == plain.receive_data(chunk)
    assert fast.data_to_send() == plain.data_to_send()
    assert h2_state(fast, 1) == h2_state(plain, 1)


def test_a_grpc_go_clients_answer_to_a_message_takes_the_fast_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection WINDOW_UPDATE and a BDP PING, as grpc-go sends after each
    message: handled without a hyperframe frame, the ACK queued, the window grown."""
    server, client = h2_pair()
    responding(server, client)
    server.data_to_send()
    client.increment_flow_control_window(300)
    client.ping(b"bdp-ping")
    chunk = client.data_to_send()

    def no_frames(*args: object, **kwargs: object) -> None:
        raise AssertionError("a hyperframe frame was built")

    monkeypatch.setattr(hyperframe.frame.Frame, "__init__", no_frames)
    window = server.outbound_flow_control_window
    events = _grpclib.receive_pings_and_window_updates(server, chunk)
    assert events == [WindowUpdated(stream_id=0, delta=300), PingReceived(ping_data=b"bdp-ping")]
    assert server.outbound_flow_control_window == window + 300
    monkeypatch.undo()
    acks = client.receive_data(server.data_to_send())
    assert acks == [PingAckReceived(ping_data=b"bdp-ping")]


def test_pings_and_window_updates_leave_to_h2_what_h2_is_in_the_middle_of() -> None:
    """Half a frame h2 buffers, a header block awaiting CONTINUATION, a connection
    before its first request, a stream the server has ended: h2 handles the next
    chunk, whatever it holds."""
    ping = frame_bytes(0x6, 0, 0, b"12345678")
    server, client = h2_pair()
    assert server.state_machine.state is not _grpclib.RECEIVING_CONNECTION_STATE
    assert _grpclib.receive_pings_and_window_updates(server, ping) is None
    responding(server, client)
    assert _grpclib.receive_pings_and_window_updates(server, ping) is not None
    server.receive_data(ping[:5])
    assert _grpclib.receive_pings_and_window_updates(server, ping) is None
    assert [type(event) for event in server.receive_data(ping[5:])] == [PingReceived]
    headers = frame_bytes(0x1, 0, 3, b"")  # no END_HEADERS: CONTINUATION must follow
    assert server.receive_data(headers) == []
    assert _grpclib.receive_pings_and_window_updates(server, ping) is None
    ended, ended_client = h2_pair()
    responding(ended, ended_client)
    update = frame_bytes(0x8, 0, 1, (10).to_bytes(4, "big"))
    assert _grpclib.receive_pings_and_window_updates(ended, update) is not None
    ended.end_stream(1)
    assert _grpclib.receive_pings_and_window_updates(ended, update) is None


def test_the_servers_encoder_keeps_no_dynamic_table() -> None:
    server, client = h2_pair()
    _grpclib.keep_encoder_table_empty(server)
    for index in range(3):
        request_and_response(server, client, index)  # the client decodes every response
        assert len(server.encoder.header_table.dynamic_entries) == 0
    # The peer's SETTINGS resize h2's encoder table: run again after each of them.
    client.update_settings({SettingCodes.HEADER_TABLE_SIZE: 8192})
    server.receive_data(client.data_to_send())
    assert server.encoder.header_table_size == 8192
    _grpclib.keep_encoder_table_empty(server)
    client.receive_data(server.data_to_send())
    request_and_response(server, client, 3)
    assert len(server.encoder.header_table.dynamic_entries) == 0
    # The decoder's table is the peer's to fill, as before (see the docstring).
    assert len(server.decoder.header_table.dynamic_entries) > 0


async def test_a_finished_register_leaves_no_task_or_stream_in_grpclibs_handler(
    grpc_clients: GrpcioClients,
) -> None:
    """`accept_request` drops a finished handler task at once (grpclib kept it, and
    its stream, until the connection's tenth request)."""
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target)
        client_id = await in_thread(client.register_id, "CCAgent")
        stream = GrpcioStream(client.subscribe("CCAgent", client_id, timeout=60)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1, what="the subscriber")
        (protocol,) = server.connections.protocols()
        handler: Any = protocol.processor.handler
        assert len(handler._tasks) == 1 and not handler._cancelled
        assert list(handler._tasks) == list(protocol.processor.streams.values())
        client.close()
        await stream.wait_end()
