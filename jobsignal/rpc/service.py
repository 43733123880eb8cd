"""The job.Job service: grpclib handlers, the only asyncio code on the request path.

Register is bookkeeping and answers directly. Each Subscribe* stream crosses
into trio once (`trio_as_aio(serve_subscription)`), and the trio task crosses
back once per batch of pre-encoded messages to write them. How the stream
ended comes back as a value, and the trailers are sent here, outside any trio
nursery, so the client sees the intended status.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import grpclib.const
import grpclib.server
import trio
import trio_asyncio
from h2.exceptions import StreamClosedError

from jobsignal._proto.job import ClientInfo, JobSummarySignal, JobSummarySignalList, Status
from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.rpc.connections import ConnectionTable
from jobsignal.rpc.limits import RateLimiter
from jobsignal.rpc.registry import Refused, Registry, RegistryFull
from jobsignal.rpc.requests import read_request
from jobsignal.rpc.session import SessionSettings, serve_subscription

log = logging.getLogger(__name__)

Stream = grpclib.server.Stream[Any, Any]

_UNCOMPRESSED = b"\x00"

REGISTERED = 200
TOO_MANY_CLIENTS = 429


def _frame(frames: list[bytes]) -> bytes:
    parts: list[bytes] = []
    for frame in frames:
        parts += (_UNCOMPRESSED, len(frame).to_bytes(4, "big"), frame)
    return b"".join(parts)


def _write_frames_now(stream: Stream, frames: list[bytes]) -> bool:
    """Write a batch without waiting, if HTTP/2 lets it go at once; else False.

    The common case (headers sent, socket writable, flow-control window open)
    needs no asyncio at all: grpclib's HTTP/2 state and the transport are
    plain objects on this same thread, so the trio task writes directly and
    skips the trio->asyncio hop that dominates the cost of small batches.
    Anything that would have to wait goes through `_write_frames` instead.
    """
    h2_stream = stream._stream
    connection = h2_stream.connection
    if (
        not stream._send_initial_metadata_done
        or not connection.write_ready.is_set()
        or connection.is_closing()
    ):
        return False
    stream_id = h2_stream.id
    assert stream_id is not None  # set when the request arrived
    data = _frame(frames)
    h2_connection = h2_stream._h2_connection
    try:
        if h2_connection.local_flow_control_window(stream_id) < len(data):
            return False
        frame_size = h2_connection.max_outbound_frame_size
        for start in range(0, len(data), frame_size):
            h2_connection.send_data(stream_id, data[start : start + frame_size])
    except StreamClosedError:
        return False
    h2_stream._transport.write(h2_connection.data_to_send())
    connection.data_send_process()
    return True


async def _write_frames(stream: Stream, frames: list[bytes]) -> None:
    """Write a batch of pre-encoded messages as one HTTP/2 write.

    gRPC messages may share DATA frames, so the batch is framed (flag byte,
    big-endian length, message) and handed to grpclib's HTTP/2 stream in one
    `send_data`, which splits it by flow-control window and frame size. That
    is one h2 call and one socket write per batch instead of per message.
    """
    if not stream._send_initial_metadata_done:
        await stream.send_initial_metadata()
    await stream._stream.send_data(_frame(frames))
    stream._send_message_done = True


class JobService:
    """Serves `/job.Job/*` from a registry and a broadcaster."""

    def __init__(
        self,
        *,
        registry: Registry,
        broadcaster: Broadcaster,
        settings: SessionSettings,
        connections: ConnectionTable,
        max_request_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self.registry = registry
        self.broadcaster = broadcaster
        self.settings = settings
        self.connections = connections
        self.max_request_bytes = max_request_bytes
        # Subscribe handlers that have not yet written their trailers: shutdown
        # waits for them, so every stream learns why it ended.
        self._open_streams = 0
        self._all_streams_closed = trio.Event()
        self._all_streams_closed.set()
        limits = connections.limits
        self.register_limiter = RateLimiter(limits.register_rate, limits.register_burst)
        self.subscribe_limiter = RateLimiter(limits.subscribe_rate, limits.subscribe_burst)

    async def _refuse_if_over_limits(self, stream: Stream, limiter: RateLimiter, what: str) -> bool:
        """Answer RESOURCE_EXHAUSTED and return True when a limit is hit."""
        refusal = self.connections.stream_limit_refusal(stream)
        address = stream.peer.addr()
        ip = str(address[0]) if address else "unknown"
        if refusal is None and not limiter.allow(ip):
            refusal = (
                f"rate limit: at most {limiter.rate:g} {what} calls per second"
                f" (bursts of {limiter.burst}) per client address; retry later"
            )
        if refusal is None:
            return False
        log.info("refused %s from %s: %s", what, ip, refusal)
        self.broadcaster.stats.stream_ends["refused"] += 1
        await stream.send_trailing_metadata(
            status=grpclib.const.Status.RESOURCE_EXHAUSTED, status_message=refusal
        )
        return True

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary = grpclib.const.Cardinality.UNARY_UNARY
        streaming = grpclib.const.Cardinality.UNARY_STREAM
        return {
            "/job.Job/Register": grpclib.const.Handler(self.register, unary, ClientInfo, Status),
            "/job.Job/SubscribeJobSummarySignal": grpclib.const.Handler(
                functools.partial(self.subscribe, StreamKind.SIGNAL),
                streaming,
                ClientInfo,
                JobSummarySignal,
            ),
            "/job.Job/SubscribeJobSummarySignalList": grpclib.const.Handler(
                functools.partial(self.subscribe, StreamKind.LIST),
                streaming,
                ClientInfo,
                JobSummarySignalList,
            ),
        }

    async def register(self, stream: Stream) -> None:
        request = await read_request(stream, ClientInfo, self.max_request_bytes)
        if await self._refuse_if_over_limits(stream, self.register_limiter, "Register"):
            return
        try:
            client_id = self.registry.register(request.role, trio.current_time())
        except Refused as refusal:
            log.info("register refused: %s (peer %s)", refusal.message, _peer(stream))
            await stream.send_trailing_metadata(
                status=refusal.status, status_message=refusal.message
            )
            return
        except RegistryFull:
            limit = self.registry.max_registrations
            await stream.send_message(
                Status(
                    code=TOO_MANY_CLIENTS,
                    info=f"too many registered clients (limit {limit}); retry later",
                )
            )
            return
        await stream.send_message(
            Status(code=REGISTERED, info="registration successful", client_id=client_id)
        )

    async def subscribe(self, kind: StreamKind, stream: Stream) -> None:
        request = await read_request(stream, ClientInfo, self.max_request_bytes)
        if await self._refuse_if_over_limits(stream, self.subscribe_limiter, "Subscribe"):
            return
        self._open_streams += 1
        if self._all_streams_closed.is_set():
            self._all_streams_closed = trio.Event()
        try:
            await self._serve_stream(kind, stream, request)
        finally:
            self._open_streams -= 1
            if not self._open_streams:
                self._all_streams_closed.set()

    async def wait_streams_closed(self) -> None:
        """Until every Subscribe handler has sent its trailers (for shutdown)."""
        await self._all_streams_closed.wait()

    async def _serve_stream(self, kind: StreamKind, stream: Stream, request: ClientInfo) -> None:
        activity = self.connections.activity_of(stream)
        send_frames = functools.partial(trio_asyncio.aio_as_trio(_write_frames), stream)
        send_now = functools.partial(_write_frames_now, stream)
        end = await trio_asyncio.trio_as_aio(
            functools.partial(
                serve_subscription,
                kind=kind,
                role=request.role,
                client_id=request.client_id,
                registry=self.registry,
                broadcaster=self.broadcaster,
                settings=self.settings,
                activity=activity,
                send_frames=send_frames,
                send_now=send_now,
            )
        )()
        await stream.send_trailing_metadata(status=end.status, status_message=end.message)
        if end.close_connection_if_unused:
            self.connections.close_if_unused(stream)


def _peer(stream: Stream) -> str:
    address = stream.peer.addr()
    return f"{address[0]}:{address[1]}" if address else "unknown"
