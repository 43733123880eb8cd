"""Contract tests of jobsignal's adapter around grpclib (jobsignal/rpc/_grpclib.py)."""

from __future__ import annotations

import asyncio
import collections
import socket
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
from h2.config import H2Configuration
from h2.connection import ConnectionInputs, H2Connection
from h2.events import (
    DataReceived,
    PingAckReceived,
    PingReceived,
    RemoteSettingsChanged,
    RequestReceived,
    ResponseReceived,
    SettingsAcknowledged,
    WindowUpdated,
)
from h2.events import Event as H2Event
from h2.settings import SettingCodes
from h2.stream import StreamInputs
from hypothesis import given
from hypothesis import strategies as st

import jobsignal.rpc  # noqa: F401  (importing jobsignal.rpc installs the adapter)
from jobsignal.rpc import _grpclib
from jobsignal.rpc.lean import Fifo, MethodTable, NewestFirst, SmallDeque


def test_grpclib_looks_up_the_current_task_through_trio_asyncio() -> None:
    # On Python 3.12+ the C `current_task` grpclib captured at import cannot see
    # trio-asyncio's loop; every handler and call would fail with UNKNOWN.
    assert grpclib.utils._current_task is asyncio.current_task


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


# -- lighter containers: each replaced attribute, its type before, behaviour after -------------


# A setting id no peer sent before (hyperframe writes ids as one byte).
UNKNOWN_SETTING = 0x10


def h2_pair() -> tuple[H2Connection, H2Connection]:
    """A server and a client h2 connection that have exchanged prefaces and SETTINGS."""
    server = H2Connection(H2Configuration(client_side=False, header_encoding="ascii"))
    client = H2Connection(H2Configuration(client_side=True, header_encoding="ascii"))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    return server, client


def settings_containers(h2_connection: H2Connection) -> list[object]:
    return [
        *h2_connection.local_settings._settings.values(),
        *h2_connection.remote_settings._settings.values(),
    ]


def settled_and_shared(h2_connection: H2Connection) -> bool:
    """Every setting of both peers settled, in a 1-tuple shared between connections."""
    return all(
        type(held) is tuple and held is _grpclib._settled(held[0])
        for held in settings_containers(h2_connection)
    )


def test_h2_settings_acknowledgement_works_on_lean_settings() -> None:
    server, client = h2_pair()
    assert all(type(held) is collections.deque for held in settings_containers(server))
    _grpclib.lighten_settings(server)
    assert type(server.local_settings) is _grpclib.LeanSettings
    assert settled_and_shared(server)
    other, _ = h2_pair()  # another connection holds the very same values
    _grpclib.lighten_settings(other)
    code = SettingCodes.INITIAL_WINDOW_SIZE
    assert other.local_settings._settings[code] is server.local_settings._settings[code]
    default = server.local_settings.initial_window_size
    # Changed twice before the peer acknowledges: each ACK applies one change, in order.
    server.update_settings({code: 1000})
    server.update_settings({code: 2000})
    assert kind(server.local_settings._settings[code]) is SmallDeque  # its own now
    assert server.local_settings.initial_window_size == default
    assert other.local_settings.initial_window_size == default  # untouched
    client.receive_data(server.data_to_send())
    acks = client.data_to_send()
    assert len(acks) == 18  # two empty SETTINGS frames with ACK
    (first,) = server.receive_data(acks[:9])
    assert isinstance(first, SettingsAcknowledged)
    changed = first.changed_settings[code]
    assert (changed.original_value, changed.new_value) == (default, 1000)
    assert server.local_settings.initial_window_size == 1000
    (second,) = server.receive_data(acks[9:])
    assert isinstance(second, SettingsAcknowledged)
    assert server.local_settings.initial_window_size == 2000
    assert settled_and_shared(server)  # settled again once acknowledged
    # Settings the peer names, also for the first time, are settled on receipt.
    others_limit = other.remote_settings.max_header_list_size
    client.update_settings({SettingCodes.MAX_HEADER_LIST_SIZE: 8192, UNKNOWN_SETTING: 1})
    events = server.receive_data(client.data_to_send())
    assert any(isinstance(event, RemoteSettingsChanged) for event in events)
    assert settled_and_shared(server)
    assert server.remote_settings.max_header_list_size == 8192
    assert server.remote_settings[UNKNOWN_SETTING] == 1
    assert other.remote_settings.max_header_list_size == others_limit != 8192
    # h2 still refuses an invalid value, and still reads a setting it never had as missing.
    with pytest.raises(h2.exceptions.InvalidSettingsValueError):
        server.local_settings[SettingCodes.ENABLE_PUSH] = 2
    assert UNKNOWN_SETTING + 1 not in server.remote_settings


def test_shared_settings_are_bounded_whatever_values_peers_choose() -> None:
    for value in range(10_000, 10_000 + 2 * _grpclib._MAX_SHARED_SETTINGS):
        assert _grpclib._settled(value) == (value,)
    assert len(_grpclib._shared_settings) <= _grpclib._MAX_SHARED_SETTINGS


def test_advertised_stream_limit_survives_the_acknowledgement() -> None:
    server, client = h2_pair()
    _grpclib.advertise_stream_limit(server, 10, 110)
    _grpclib.lighten_settings(server)
    client.receive_data(server.data_to_send())
    assert client.remote_settings.max_concurrent_streams == 10  # what the peer is told
    server.receive_data(client.data_to_send())  # its ACK
    assert server.local_settings.max_concurrent_streams == 110  # what h2 enforces


def headers_of(event: RequestReceived | ResponseReceived) -> list[tuple[object, object]]:
    return [tuple(header) for header in event.headers or []]  # type: ignore[misc]


def kind(held: object) -> type[object]:
    """The exact type of a container (its declared type says deque; it may not be one)."""
    return type(held)


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


def test_hpack_tables_encode_the_same_bytes_when_light() -> None:
    plain, plain_client = h2_pair()
    light, light_client = h2_pair()
    tables = [light.encoder.header_table, light.decoder.header_table]
    assert all(type(table.dynamic_entries) is collections.deque for table in tables)
    _grpclib.lighten_header_tables(light)
    assert all(kind(table.dynamic_entries) is NewestFirst for table in tables)
    # Far more than the 4,096-byte tables hold: entries are evicted all along.
    for index in range(60):
        assert request_and_response(light, light_client, index) == request_and_response(
            plain, plain_client, index
        )
    for light_table, plain_table in zip(
        tables, [plain.encoder.header_table, plain.decoder.header_table], strict=True
    ):
        assert list(light_table.dynamic_entries) == list(plain_table.dynamic_entries)
        assert len(light_table.dynamic_entries) == len(plain_table.dynamic_entries) > 0


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


async def test_grpclib_events_wake_their_waiters_when_light() -> None:
    async def scenario() -> None:
        connection, stream, _ = grpclib_stream()
        events = [connection.write_ready, connection.stream_close_waiter, *stream_events(stream)]
        assert all(type(event._waiters) is collections.deque for event in events)
        _grpclib.lighten_connection(connection)
        _grpclib.lighten_stream(stream)
        assert all(kind(event._waiters) is SmallDeque for event in events)
        for event in events:
            event.clear()
            waiters = [asyncio.ensure_future(event.wait()) for _ in range(3)]
            await asyncio.sleep(0)
            assert len(event._waiters) == 3
            waiters[1].cancel()  # a waiter that goes away is removed from the list
            await asyncio.sleep(0)
            assert len(event._waiters) == 2
            event.set()
            assert await waiters[0] and await waiters[2]
            assert waiters[1].cancelled()
            assert not event._waiters

    async with trio_asyncio.open_loop():
        await trio_asyncio.aio_as_trio(scenario)()


async def test_grpclib_stream_buffer_reads_and_waits_when_light() -> None:
    async def scenario() -> None:
        connection, stream, client = grpclib_stream()
        buffer: Any = stream.buffer
        queue: Any = buffer._unacked
        assert kind(queue) is asyncio.Queue
        assert kind(buffer._acked) is collections.deque
        for name in ("_getters", "_putters", "_queue"):
            assert kind(getattr(queue, name)) is collections.deque, name
        assert kind(queue._finished._waiters) is collections.deque
        _grpclib.lighten_stream(stream)
        assert kind(buffer._acked) is Fifo and kind(queue._queue) is Fifo
        assert kind(queue._getters) is SmallDeque and kind(queue._putters) is SmallDeque
        assert kind(queue._finished._waiters) is SmallDeque
        # A read waits for data (a waiting getter), then takes part of a chunk
        # (the chunk buffer's `[0]` is replaced) and the rest of it.
        read = asyncio.ensure_future(stream.recv_data(2))
        await asyncio.sleep(0)
        assert len(queue._getters) == 1
        stream.buffer.add(b"abcdef", 6)
        assert await read == b"ab"
        assert await stream.recv_data(4) == b"cdef"
        # Many small chunks, read across their boundaries; every byte is acknowledged.
        for index in range(100):
            stream.buffer.add(bytes([65 + index % 26]), 1)
        assert await stream.recv_data(60) == bytes(65 + i % 26 for i in range(60))
        assert await stream.recv_data(40) == bytes(65 + i % 26 for i in range(60, 100))
        assert not buffer._acked and queue.empty()
        # Getters that give up are removed; the next item goes to one still waiting.
        first, second = asyncio.ensure_future(queue.get()), asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        assert len(queue._getters) == 1
        queue.put_nowait("item")
        assert await second == "item"
        stream.buffer.eof()
        assert await stream.recv_data(1) == b""
        if sys.version_info >= (3, 13):  # Queue.shutdown pops every waiter
            waiting = asyncio.ensure_future(queue.get())
            await asyncio.sleep(0)
            queue.shutdown()
            with pytest.raises(asyncio.QueueShutDown):
                await waiting
        del connection, client

    async with trio_asyncio.open_loop():
        await trio_asyncio.aio_as_trio(scenario)()


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


def test_h2_frames_are_dispatched_the_same_with_a_method_table() -> None:
    plain, plain_client = h2_pair()
    light, light_client = h2_pair()
    assert isinstance(light._frame_dispatch_table, dict)
    _grpclib.lighten_dispatch_tables(light, grpclib_processor(light))
    assert isinstance(light._frame_dispatch_table, MethodTable)
    events = frame_exchange(light, light_client)
    assert events == frame_exchange(plain, plain_client)
    assert {"RequestReceived", "DataReceived", "PingReceived", "StreamReset"} <= set(events)
    assert "ConnectionTerminated" in events


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


def test_grpclib_events_are_processed_the_same_with_a_method_table() -> None:
    server, client = h2_pair()
    processor = grpclib_processor(server)
    assert isinstance(processor.processors, dict)
    _grpclib.lighten_dispatch_tables(server, processor)
    assert isinstance(processor.processors, MethodTable)
    pings: list[object] = []
    _grpclib.set_event_handler(processor, PingReceived, pings.append)
    request = [(":method", "POST"), (":scheme", "http"), (":path", "/x"), (":authority", "a")]
    client.send_headers(1, request)
    client.ping(b"12345678")
    for event in server.receive_data(client.data_to_send()):
        processor.process(event)  # grpclib's own dispatch
    handler: Any = processor.handler
    assert handler.accepted == [1]  # process_request_received, found by name
    assert len(pings) == 1  # the handler set on top
    with pytest.raises(NotImplementedError):  # an event grpclib has no processor for
        processor.process(OtherEvent())
    _grpclib.process_event(processor, OtherEvent())  # the adapter ignores it
    processor.close()  # deletes its processors, as grpclib does
    assert handler.closed and not hasattr(processor, "processors")
    _grpclib.process_event(processor, PingReceived(ping_data=b"12345678"))
    assert len(pings) == 1


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
    both flow-control windows, both state machines and the frames-sent hook agree
    with h2's own send_data, frame by frame, and the peer reads the message."""
    (fast, fast_client), (plain, plain_client) = h2_pair(), h2_pair()
    for server, client in ((fast, fast_client), (plain, plain_client)):
        responding(server, client)
    message = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    noted: list[int] = []
    _grpclib.on_frames_sent(fast, lambda: noted.append(1))
    data = memoryview(message) if view else message
    assert _grpclib.send_now(server_stream_on(fast, 1), data, whole=True) == size
    frame_size = plain.max_outbound_frame_size
    for start in range(0, size, frame_size):
        plain.send_data(1, message[start : start + frame_size])
    assert len(noted) == -(-size // frame_size)  # one per DATA frame
    assert h2_state(fast, 1) == h2_state(plain, 1)
    written = fast.data_to_send()
    assert written == plain.data_to_send()
    received = fast_client.receive_data(written)
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
    """The frame DirectSender writes, both windows, both state machines and the
    frames-sent hook agree with h2's own send_data of the gRPC-framed message,
    and the peer reads the message."""
    (fast, fast_client), (plain, plain_client) = h2_pair(), h2_pair()
    for server, client in ((fast, fast_client), (plain, plain_client)):
        responding(server, client)
        server.data_to_send()
    message = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    noted: list[int] = []
    _grpclib.on_frames_sent(fast, lambda: noted.append(1))
    sender, connection, transport = direct_sender_on(fast)
    frame = sender.frame_now(message)
    assert frame is not None
    sender.write(frame, at_once=True)
    plain.send_data(1, grpc_framed(message))
    assert noted == [1] and connection.last_data_sent is not None
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


async def test_a_lightened_transport_writes_everything_through_backpressure() -> None:
    """A peer that reads late: asyncio buffers, sends part of a chunk, puts the rest
    back at the front; the bytes arrive whole and in order."""
    payload = bytes(range(256)) * 4096 * 4  # 4 MiB, far beyond the socket buffers
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)

    async def write_then_read() -> bytes:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, sock=ours)
        _grpclib.lighten_transport(transport)
        buffer = transport._buffer  # type: ignore[attr-defined]
        # 3.12 and later buffer in a deque, now a Fifo; 3.11 in a bytearray, kept.
        assert type(buffer) is (bytearray if sys.version_info < (3, 12) else Fifo)
        for start in range(0, len(payload), 4099):
            transport.write(payload[start : start + 4099])
        assert transport.get_write_buffer_size() > 0
        received = bytearray()
        while len(received) < len(payload):
            try:
                received += theirs.recv(1 << 16)
            except BlockingIOError:
                await asyncio.sleep(0)  # the transport writes more meanwhile
        transport.close()
        return bytes(received)

    try:
        async with trio_asyncio.open_loop():
            with trio.fail_after(30):
                received = await trio_asyncio.aio_as_trio(write_then_read)()
    finally:
        theirs.close()
    assert received == payload
