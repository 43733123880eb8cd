"""The relay's connection to its upstream `job.Job` server: gRPC over HTTP/2, on trio.

gRPC is spoken here with h2 alone, not with grpclib's client: grpclib takes
in a whole message, whatever length its 5-byte prefix announces (up to
4 GiB), before its caller sees a byte, and the upstream is a network peer
like any other (docs/architecture.md section 4, "Relaying another server").
Here a message's length is checked against the relay's bound as soon as its
prefix arrives, the HTTP/2 headers are bounded by h2's settings, and what is
read ahead of the caller is at most one read's worth.

One task reads (whoever waits for a message); `open_upstream` runs the
keepalive beside it, which PINGs a quiet upstream and declares the
connection dead when the reader waited through the PING's timeout without a
byte. Every failure leaves as an `UpstreamError`, its `reason` a metric
label; third-party errors (OSError, trio's, h2's, ssl's) are translated here.
"""

from __future__ import annotations

import logging
import ssl
import struct
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import trio

from jobsignal.relay.settings import RelaySettings
from jobsignal.relay.wire import Malformed, Status, decode_status, encode_client_info
from jobsignal.util.blocks import background_tasks
from jobsignal.util.text import quote
from jobsignal.version import __version__

log = logging.getLogger(__name__)

#: Every reason an upstream connection ends (the `reason` label of
#: jobsignal_relay_upstream_errors_total).
REASONS = {
    "unreachable": "no TCP connection, or the TLS handshake failed",
    "lost": "the connection broke or the upstream closed it",
    "keepalive": "no answer to a PING within the keepalive timeout",
    "timeout": "Register not answered in time",
    "refused": "Register answered other than 200, or a call ended with a gRPC error",
    "ended": "the subscription ended (a status, GOAWAY or RST_STREAM)",
    "protocol": "an HTTP/2 or gRPC framing violation, or a malformed reply to Register",
    "too_large": "a message over --upstream-max-message-bytes",
    "snapshot": "the upstream's snapshot did not add up (see the log)",
}

# HTTP/2 receive windows: the upstream may send this much ahead of the reader.
WINDOW = 4 * 1024 * 1024
# Response and trailer headers together (h2 refuses a larger block).
MAX_HEADER_LIST = 16 * 1024
RECEIVE_CHUNK = 64 * 1024
_PING = b"jsrelay0"
_GRPC_OK = 0


class UpstreamError(Exception):
    """The upstream connection or call failed; `reason` is a key of `REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass
class _Call:
    """One gRPC call's response as it arrives."""

    buffer: bytearray = field(default_factory=bytearray)
    messages: deque[bytes] = field(default_factory=deque)
    headers: bool = False
    status: int | None = None
    status_message: str = ""
    ended: bool = False
    error: UpstreamError | None = None


class UpstreamConnection:
    """An HTTP/2 connection to the upstream; `open_upstream` owns it."""

    def __init__(self, stream: trio.abc.Stream, settings: RelaySettings, *, tls: bool) -> None:
        self._stream = stream
        self._settings = settings
        self._scheme = b"https" if tls else b"http"
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self._h2 = h2.connection.H2Connection(config)
        self._send_lock = trio.Lock()
        self._calls: dict[int, _Call] = {}
        self._dead: UpstreamError | None = None
        self._heard_at = trio.current_time()
        self._reading_since: float | None = None

    async def start(self) -> None:
        self._h2.initiate_connection()
        self._h2.update_settings(
            {
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
            }
        )
        self._h2.increment_flow_control_window(WINDOW - 65535)
        await self._flush()

    # -- calls -------------------------------------------------------------

    async def register(self, role: str) -> str:
        """Register as `role`; the client id the upstream gave."""
        timeout = self._settings.request_timeout
        with trio.move_on_after(timeout) as scope:
            call_id = await self._request("/job.Job/Register", encode_client_info(role))
            reply = await self._next_message(call_id)
            if reply is not None and await self._next_message(call_id) is not None:
                raise UpstreamError("protocol", "Register answered with more than one message")
        if scope.cancelled_caught:
            raise UpstreamError("timeout", f"Register not answered in {timeout:g}s")
        self._check_status(call_id, "Register")
        if reply is None:
            raise UpstreamError("protocol", "Register ended without an answer")
        try:
            status: Status = decode_status(reply)
        except Malformed as error:
            raise UpstreamError("protocol", f"Register's answer: {error}") from None
        if status.code != 200 or not status.client_id:
            raise UpstreamError(
                "refused", f"Register as {role}: {status.code} {quote(status.info, 200)}"
            )
        return status.client_id

    async def subscribe_list(self, role: str, client_id: str) -> int:
        """Start SubscribeJobSummarySignalList; its messages come from `receive(call)`."""
        payload = encode_client_info(role, client_id)
        return await self._request("/job.Job/SubscribeJobSummarySignalList", payload)

    async def receive(self, call_id: int) -> bytes:
        """The call's next message; UpstreamError once it ends, however it ends."""
        message = await self._next_message(call_id)
        if message is None:
            self._check_status(call_id, "the subscription")
            raise UpstreamError("ended", "the upstream ended the subscription (status OK)")
        return message

    async def _request(self, path: str, payload: bytes) -> int:
        call_id = self._h2.get_next_available_stream_id()
        self._calls[call_id] = _Call()
        authority = self._settings.address.encode()
        headers = [
            (b":method", b"POST"),
            (b":scheme", self._scheme),
            (b":path", path.encode()),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            (b"user-agent", f"jobsignal-relay/{__version__}".encode()),
        ]
        frame = struct.pack(">?I", False, len(payload)) + payload
        try:
            self._h2.send_headers(call_id, headers)
            if self._h2.local_flow_control_window(call_id) < len(frame):
                raise UpstreamError("protocol", "the upstream's send window is too small")
            self._h2.send_data(call_id, frame, end_stream=True)
        except h2.exceptions.ProtocolError as error:
            raise UpstreamError("protocol", f"HTTP/2: {type(error).__name__}") from None
        await self._flush()
        return call_id

    def _check_status(self, call_id: int, what: str) -> None:
        call = self._calls[call_id]
        if call.status is None:
            raise UpstreamError("protocol", f"{what} ended without a gRPC status")
        if call.status != _GRPC_OK:
            raise UpstreamError(
                "refused" if what == "Register" else "ended",
                f"{what}: gRPC status {call.status} {quote(call.status_message, 200)}",
            )

    async def _next_message(self, call_id: int) -> bytes | None:
        """The call's next message, None once it ended; UpstreamError if it failed."""
        call = self._calls[call_id]
        while True:
            if call.messages:
                return call.messages.popleft()
            if call.error is not None:
                raise call.error
            if call.ended:
                if call.buffer:
                    raise UpstreamError("protocol", "the stream ended inside a message")
                return None
            await self._receive()

    # -- reading -----------------------------------------------------------

    async def _receive(self) -> None:
        self._reading_since = trio.current_time()
        try:
            data = await self._stream.receive_some(RECEIVE_CHUNK)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            raise self._dead or UpstreamError("lost", f"connection lost: {error}") from None
        finally:
            self._reading_since = None
        if not data:
            raise UpstreamError("lost", "the upstream closed the connection")
        self._heard_at = trio.current_time()
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError as error:
            raise UpstreamError("protocol", f"HTTP/2: {type(error).__name__}: {error}") from None
        for event in events:
            self._handle(event)
        await self._flush()  # window updates, SETTINGS and PING acknowledgements

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ConnectionTerminated):
            code = getattr(event.error_code, "name", event.error_code)
            raise UpstreamError("ended", f"the upstream sent GOAWAY ({code})")
        call = self._calls.get(getattr(event, "stream_id", 0) or 0)
        if isinstance(event, h2.events.DataReceived):
            self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if call is not None and event.data:
                self._feed(call, event.data)
        elif call is None:
            return
        elif isinstance(event, h2.events.ResponseReceived):
            self._response_headers(call, event.headers)
        elif isinstance(event, h2.events.TrailersReceived):
            self._status(call, event.headers)
        elif isinstance(event, h2.events.StreamEnded):
            call.ended = True
        elif isinstance(event, h2.events.StreamReset):
            code = getattr(event.error_code, "name", event.error_code)
            call.error = UpstreamError("ended", f"the upstream reset the stream ({code})")

    def _response_headers(self, call: _Call, headers: list[tuple[bytes, bytes]]) -> None:
        values = dict(headers)
        status = values.get(b":status", b"")
        if status != b"200":
            call.error = UpstreamError("refused", f"HTTP status {quote(status.decode(), 20)}")
        elif not values.get(b"content-type", b"").startswith(b"application/grpc"):
            call.error = UpstreamError("protocol", "the answer is not application/grpc")
        call.headers = True
        if b"grpc-status" in values:  # a trailers-only answer
            self._status(call, headers)

    def _status(self, call: _Call, headers: list[tuple[bytes, bytes]]) -> None:
        values = dict(headers)
        code = values.get(b"grpc-status", b"")
        call.status = int(code) if code.isdigit() and len(code) < 4 else 2  # 2: UNKNOWN
        message = values.get(b"grpc-message", b"")
        call.status_message = unquote(message.decode("utf-8", "replace"))

    def _feed(self, call: _Call, data: bytes) -> None:
        """Take in DATA: complete messages to the call's queue; a message whose
        announced length is over the bound fails the call (and so the connection)
        before its body arrives, once the messages before it are taken."""
        if not call.headers or call.error is not None:
            return
        buffer = call.buffer
        buffer += data
        while len(buffer) >= 5:
            compressed, length = struct.unpack_from(">?I", buffer)
            if length > self._settings.max_message_bytes:
                call.error = UpstreamError(
                    "too_large",
                    f"a message of {length} bytes, over --upstream-max-message-bytes"
                    f" ({self._settings.max_message_bytes})",
                )
            elif compressed:
                call.error = UpstreamError("protocol", "a compressed message (none negotiated)")
            elif len(buffer) >= 5 + length:
                call.messages.append(bytes(buffer[5 : 5 + length]))
                del buffer[: 5 + length]
                continue
            else:
                return  # the rest of the message is still to come
            buffer.clear()  # failed: nothing more of it is kept
            return

    # -- writing and keepalive ---------------------------------------------------

    async def _flush(self) -> None:
        async with self._send_lock:
            data = self._h2.data_to_send()
            if not data:
                return
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
                raise self._dead or UpstreamError("lost", f"connection lost: {error}") from None

    async def run_keepalive(self) -> None:
        """PING the upstream when it has been quiet for `keepalive_time`; when the
        reader then waits through `keepalive_timeout` hearing nothing, close the
        connection (the reader raises UpstreamError "keepalive")."""
        settings = self._settings
        while True:
            await trio.sleep_until(self._heard_at + settings.keepalive_time)
            if trio.current_time() < self._heard_at + settings.keepalive_time:
                continue  # heard from meanwhile
            sent_at = trio.current_time()
            self._h2.ping(_PING)
            try:
                await self._flush()
            except UpstreamError:
                return  # the reader finds out too
            await trio.sleep(settings.keepalive_timeout)
            reading_since = self._reading_since
            if self._heard_at >= sent_at or reading_since is None or reading_since > sent_at:
                # Answered, or the reader was busy (what arrived is not read yet): judge anew.
                self._heard_at = max(self._heard_at, sent_at)
                continue
            self._dead = UpstreamError(
                "keepalive",
                f"no answer to a PING in {settings.keepalive_timeout:g}s",
            )
            await trio.aclose_forcefully(self._stream)
            return

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self._stream)


def _unreachable(settings: RelaySettings, error: Exception) -> UpstreamError:
    if isinstance(error, trio.TooSlowError):
        return UpstreamError("unreachable", f"no connection within {settings.connect_timeout:g}s")
    if isinstance(error, trio.BrokenResourceError):  # the TLS handshake failed
        cause = error.__cause__
        detail = getattr(cause, "verify_message", None) or getattr(cause, "reason", None) or cause
        return UpstreamError("unreachable", f"TLS handshake failed: {detail}")
    return UpstreamError("unreachable", str(error))


@asynccontextmanager
async def open_upstream(
    settings: RelaySettings, context: ssl.SSLContext | None
) -> AsyncIterator[UpstreamConnection]:
    """A connection to the upstream (TCP, TLS with `context`, the HTTP/2 preface),
    kept alive while the block runs and closed after it."""
    stream: trio.abc.Stream | None = None
    try:
        with trio.fail_after(settings.connect_timeout):
            stream = await trio.open_tcp_stream(settings.host, settings.port)
            if context is not None:
                name = settings.tls_server_name or settings.host
                stream = trio.SSLStream(stream, context, server_hostname=name)
                await stream.do_handshake()
    except BaseException as error:  # (cancelled too: the socket is closed either way)
        if stream is not None:
            await trio.aclose_forcefully(stream)
        if isinstance(error, trio.TooSlowError | OSError | trio.BrokenResourceError):
            raise _unreachable(settings, error) from None
        raise
    connection = UpstreamConnection(stream, settings, tls=context is not None)
    try:
        async with background_tasks() as nursery:
            await connection.start()
            nursery.start_soon(connection.run_keepalive)
            yield connection
    finally:
        await connection.aclose()
