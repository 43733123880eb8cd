"""The one place where jobsignal reaches into grpclib and h2 internals.

grpclib (pinned in pyproject.toml) has no hooks for what a production server
must see and bound per connection: PING frames, stream resets, the streams a
connection holds, the frames the server sends. Each private access lives in
a named function here, so a grpclib upgrade breaks this module (and its
contract test, tests/rpc/test_grpclib_adapter.py) and nothing else.

It also carries one workaround. Python 3.12 made `asyncio.current_task` a C
function that reads the running loop from the interpreter's thread state;
trio-asyncio never sets that state for the loop it runs inside trio, so it
replaces `asyncio.current_task` with a version that finds its loop, at
import time. grpclib binds `asyncio.current_task` to `grpclib.utils.
_current_task` when *it* is imported, which happens first (the generated
message code imports grpclib). Its `Wrapper` and `DeadlineWrapper`, entered
by every server handler and client call, then raise "RuntimeError: no
running event loop" and every RPC fails with UNKNOWN. On 3.11
`current_task` is pure Python and finds the loop through the patched
function, so nothing shows. `install()` rebinds grpclib's alias; it runs
when `jobsignal` is imported. It stays necessary while grpclib caches
`asyncio.current_task` at import (0.4.9); a grpclib that looks it up at
call time, or a trio-asyncio that sets the C-level running loop, makes it a
no-op.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import Callable, Sequence
from typing import Any

import grpclib
import grpclib.server
import grpclib.utils
import trio_asyncio  # noqa: F401  (imported for its patch of asyncio.current_task)
from grpclib.metadata import encode_grpc_message
from grpclib.protocol import Connection, EventsProcessor, H2Protocol
from h2.connection import H2Connection
from h2.events import Event, RequestReceived, StreamReset
from h2.exceptions import StreamClosedError
from h2.settings import SettingCodes

PINNED_GRPCLIB = "0.4.9"

if grpclib.__version__ != PINNED_GRPCLIB:  # pragma: no cover (guards an upgrade)
    raise ImportError(
        f"jobsignal needs grpclib {PINNED_GRPCLIB} (it relies on its internals, see"
        f" {__name__}); found {grpclib.__version__}: pip install grpclib=={PINNED_GRPCLIB}"
    )

ServerStream = grpclib.server.Stream[Any, Any]


def install() -> None:
    """Make grpclib use trio-asyncio's `current_task` (idempotent)."""
    grpclib.utils._current_task = asyncio.current_task


# -- the listening server -----------------------------------------------------------------------


async def start_server(
    server: grpclib.server.Server,
    addresses: Sequence[tuple[str, int]],
    *,
    backlog: int,
    ssl: Any,
    ssl_handshake_timeout: float | None,
) -> list[asyncio.Server]:
    """`Server.start` on each address, plus what it does not pass on: a TLS handshake
    timeout. Host "" means every address of the host (IPv4 and IPv6 where it has both).

    asyncio calls the protocol's `connection_made` only once TLS is set up, so
    a peer that never finishes the TLS handshake is bounded here, not there.
    grpclib knows the first listener only; the caller closes the others.
    """
    loop = asyncio.get_running_loop()
    listeners = []
    for host, port in addresses:
        family = (
            socket.AF_UNSPEC if not host else (socket.AF_INET6 if ":" in host else socket.AF_INET)
        )
        listeners.append(
            await loop.create_server(
                server._protocol_factory,
                host or None,
                port,
                family=family,
                backlog=backlog,
                ssl=ssl,
                ssl_handshake_timeout=ssl_handshake_timeout if ssl is not None else None,
                reuse_address=True,
            )
        )
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


def on_frames_sent(h2_connection: H2Connection, callback: Callable[[], None]) -> None:
    """Call `callback` for each DATA or HEADERS frame the server sends on this connection.

    Every path that writes (grpclib's, and `rpc.writer`'s fast path) goes
    through h2's `send_data` (one frame per call, as frames are split to the
    peer's frame size before) and `send_headers`.
    """
    send_data, send_headers = h2_connection.send_data, h2_connection.send_headers

    def noted_send_data(*args: Any, **kwargs: Any) -> None:
        callback()
        send_data(*args, **kwargs)

    def noted_send_headers(*args: Any, **kwargs: Any) -> None:
        callback()
        send_headers(*args, **kwargs)

    setattr(h2_connection, "send_data", noted_send_data)  # noqa: B010
    setattr(h2_connection, "send_headers", noted_send_headers)  # noqa: B010


# -- reading requests and writing responses on a server stream ----------------------------------


def request_codec(stream: ServerStream) -> Any:
    """The server's codec, as grpclib handed it to this stream."""
    return stream._codec


async def receive(stream: ServerStream, size: int) -> bytes | None:
    """Up to `size` bytes of the request body: fewer when the stream ended before any of
    them, None when it ended part-way (grpclib's buffer asserts in that case)."""
    try:
        data: bytes = await stream._stream.recv_data(size)
    except AssertionError:
        return None
    return data


def headers_sent(stream: ServerStream) -> bool:
    """Whether the response headers of a server stream are out."""
    return bool(stream._send_initial_metadata_done)


def send_now(stream: ServerStream, data: memoryview) -> int:
    """Queue as much of `data` as HTTP/2 lets go without waiting; the bytes queued (0: wait).

    grpclib's HTTP/2 state is plain objects on this same thread, so a trio
    task frames the data directly. h2 keeps the frames (its flow-control
    windows already count them) until the connection's output is written.
    Nothing goes before the response headers, on a paused socket or past the
    stream's window.
    """
    h2_stream = stream._stream
    connection = h2_stream.connection
    if not headers_sent(stream) or not connection.write_ready.is_set() or connection.is_closing():
        return 0
    stream_id = h2_stream.id
    assert stream_id is not None  # set when the request arrived
    h2_connection = h2_stream._h2_connection
    try:
        size = min(len(data), h2_connection.local_flow_control_window(stream_id))
        frame_size = h2_connection.max_outbound_frame_size
        for start in range(0, size, frame_size):
            h2_connection.send_data(stream_id, bytes(data[start : min(size, start + frame_size)]))
    except StreamClosedError:
        return 0
    connection.data_send_process()
    return size


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


def accept_request(processor: EventsProcessor, event: RequestReceived) -> None:
    """Start grpclib's handler for a new request, with its stream released however it ends.

    grpclib releases a stream in the handler task's `finally`. A stream reset
    before its task first runs (HTTP/2 Rapid Reset) cancels a task that never
    starts, so that `finally` never runs and the stream stayed in the
    processor forever. Here the release also runs when the task is done, once.
    """
    stream = processor.connection.create_stream(stream_id=event.stream_id)
    release = processor.register(stream)
    released = False

    def release_once() -> None:
        nonlocal released
        if not released:
            released = True
            release()

    handler = processor.handler
    handler.accept(stream, event.headers, release_once)  # type: ignore[arg-type]
    task: asyncio.Task[None] | None = getattr(handler, "_tasks", {}).get(stream)
    if task is not None:
        task.add_done_callback(lambda _: release_once())


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
