"""The job.Job service: grpclib handlers, the asyncio side of each request.

Register is bookkeeping and answers directly. Each Subscribe* stream's
session (`rpc.session.Session`) is opened in the server's `Sessions` straight
from the handler, which waits for its end on an asyncio future: no
trio-asyncio bridge per stream, and no task at all while the stream is idle.
The session writes its batches through `rpc.writer`. How the stream ended
comes back as a value, and the trailers are sent here, outside any trio
nursery, so the client sees the intended status.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpclib.const
import grpclib.server
import h2.exceptions
import trio
from grpclib.exceptions import GRPCError, StreamTerminatedError

from jobsignal._proto.job import ClientInfo, JobSummarySignal, JobSummarySignalList, Status
from jobsignal.fanout import Broadcaster, EndReason, StreamKind
from jobsignal.logs import RateLimitedLog
from jobsignal.rpc.connections import ConnectionTable
from jobsignal.rpc.limits import RateLimiter
from jobsignal.rpc.registry import Refused, Registry, RegistryFull
from jobsignal.rpc.requests import read_client_info
from jobsignal.rpc.session import Sessions, SessionSettings, StreamEnd, StreamRequest
from jobsignal.rpc.writer import StreamWriter
from jobsignal.util.text import clip

log = logging.getLogger(__name__)
fault_log = RateLimitedLog(log)

Stream = grpclib.server.Stream[Any, Any]
Handler = Callable[[Stream], Awaitable[None]]

# How grpclib itself ends a stream (a status we chose, the client's reset, a
# deadline, a peer that broke the protocol): not faults of ours.
_STREAM_ENDINGS = (GRPCError, StreamTerminatedError, TimeoutError, h2.exceptions.ProtocolError)

REGISTERED = 200
TOO_MANY_CLIENTS = 429


class JobService:
    """Serves `/job.Job/*` from a registry and a broadcaster."""

    def __init__(
        self,
        *,
        registry: Registry,
        broadcaster: Broadcaster,
        settings: SessionSettings,
        connections: ConnectionTable,
    ) -> None:
        self.registry = registry
        self.broadcaster = broadcaster
        self.settings = settings
        self.connections = connections
        # Subscribe handlers that have not yet written their trailers: shutdown
        # waits for them, so every stream learns why it ended.
        self._open_streams = 0
        self._all_streams_closed = trio.Event()
        self._all_streams_closed.set()
        limits = connections.limits
        self.register_limiter = RateLimiter(limits.register_rate, limits.register_burst)
        self.subscribe_limiter = RateLimiter(limits.subscribe_rate, limits.subscribe_burst)
        # Unexpected exceptions caught at the handler boundary, by RPC.
        self.handler_errors: Counter[str] = Counter()
        # Where the sessions run (`serve_sessions_with`).
        self._sessions: Sessions | None = None

    def serve_sessions_with(self, sessions: Sessions) -> None:
        """Serve the streams' sessions in `sessions` (running in the server's nursery)."""
        self._sessions = sessions

    def rate_limited(self) -> dict[str, int]:
        """Calls refused by the per-address rate limits, by RPC."""
        return {
            "Register": self.register_limiter.refused,
            "Subscribe": self.subscribe_limiter.refused,
        }

    def _fault_boundary(self, rpc: str, handler: Handler) -> Handler:
        """End only this stream, with INTERNAL, when `handler` fails unexpectedly.

        grpclib would answer UNKNOWN "Internal Server Error" and log to its own
        (silenced) logger; this logs the RPC and the peer, rate-limited, and
        counts the fault, so a bug that one request triggers is seen.
        """

        async def guarded(stream: Stream) -> None:
            try:
                await handler(stream)
            except _STREAM_ENDINGS:
                raise
            except Exception:
                self.handler_errors[rpc] += 1
                fault_log.error(
                    f"handler_error:{rpc}",
                    "unexpected error in %s from %s; the stream ends with INTERNAL",
                    rpc,
                    self._peer_text(stream),
                    exc_info=True,
                )
                raise GRPCError(
                    grpclib.const.Status.INTERNAL, "internal server error (logged by the server)"
                ) from None

        return guarded

    def _peer_text(self, stream: Stream) -> str:
        try:
            return self.connections.activity_of(stream).peer
        except KeyError:  # a refused connection is not in the table
            return "unknown peer"

    async def _refuse_if_over_limits(self, stream: Stream, limiter: RateLimiter, what: str) -> bool:
        """Answer RESOURCE_EXHAUSTED and return True when a limit is hit."""
        ip = self.connections.activity_of(stream).ip
        if limiter.allow(ip):
            return False
        refusal = (
            f"rate limit: at most {limiter.rate:g} {what} calls per second"
            f" (bursts of {limiter.burst}) per client address; retry later"
        )
        # One flooding address must not fill the log: counted, logged a few times a minute.
        fault_log.log(
            logging.INFO, f"rate_limited:{what}", "refused %s from %s: %s", what, ip, refusal
        )
        self.broadcaster.stats.stream_ended(EndReason.REFUSED)
        await stream.send_trailing_metadata(
            status=grpclib.const.Status.RESOURCE_EXHAUSTED, status_message=refusal
        )
        return True

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary = grpclib.const.Cardinality.UNARY_UNARY
        streaming = grpclib.const.Cardinality.UNARY_STREAM
        # Every RPC takes a ClientInfo; by name: the handler, its cardinality, the reply.
        rpcs: dict[str, tuple[Handler, grpclib.const.Cardinality, type[Any]]] = {
            "Register": (self.register, unary, Status),
            "SubscribeJobSummarySignal": (
                functools.partial(self.subscribe, StreamKind.SIGNAL),
                streaming,
                JobSummarySignal,
            ),
            "SubscribeJobSummarySignalList": (
                functools.partial(self.subscribe, StreamKind.LIST),
                streaming,
                JobSummarySignalList,
            ),
        }
        return {
            f"/job.Job/{rpc}": grpclib.const.Handler(
                self._fault_boundary(rpc, handler), cardinality, ClientInfo, reply
            )
            for rpc, (handler, cardinality, reply) in rpcs.items()
        }

    async def register(self, stream: Stream) -> None:
        request = await read_client_info(stream, self.settings.request_timeout)
        if await self._refuse_if_over_limits(stream, self.register_limiter, "Register"):
            return
        activity = self.connections.activity_of(stream)
        try:
            client_id = self.registry.register(
                request.role, trio.current_time(), address=activity.ip
            )
        except Refused as refusal:
            log.info(
                "register refused: %s (peer %s)",
                refusal.message,
                activity.peer,
                extra={
                    "event": "register_refused",
                    "role": clip(request.role),
                    "peer": activity.peer,
                    "reason": refusal.status.name,
                },
            )
            await stream.send_trailing_metadata(
                status=refusal.status, status_message=refusal.message
            )
            return
        except RegistryFull as full:
            # ClusterD's contract: a normal reply with code 429, not a gRPC error.
            fault_log.log(
                logging.INFO,
                "register_full",
                "register refused: %s (peer %s)",
                full,
                activity.peer,
                extra={
                    "event": "register_refused",
                    "role": clip(request.role),
                    "peer": activity.peer,
                    "reason": "registry_full",
                },
            )
            await stream.send_message(Status(code=TOO_MANY_CLIENTS, info=str(full)))
            return
        await stream.send_message(
            Status(code=REGISTERED, info="registration successful", client_id=client_id)
        )

    async def subscribe(self, kind: StreamKind, stream: Stream) -> None:
        request = await read_client_info(stream, self.settings.request_timeout)
        if await self._refuse_if_over_limits(stream, self.subscribe_limiter, "Subscribe"):
            return
        self._open_streams += 1
        if self._all_streams_closed.is_set():
            self._all_streams_closed = trio.Event()
        try:
            # Here, not in a helper: this frame lives as long as the stream.
            activity = self.connections.activity_of(stream)
            # Not the protocol itself: grpclib keeps finished handlers for a while.
            writer = StreamWriter(
                stream,
                self.connections.protocol_of(stream).output,
                self.settings.send_timeout,
                asyncio.get_running_loop(),
            )
            end = await self._run_session(
                StreamRequest(
                    kind,
                    request.role,
                    request.client_id,
                    activity,
                    writer.write,
                    writer.write_now,
                    writer.give_up,
                )
            )
            await stream.send_trailing_metadata(status=end.status, status_message=end.message)
            if end.close_connection_if_unused:
                self.connections.close_if_unused(stream)
            else:
                self.connections.close_if_draining(stream)
        finally:
            self._open_streams -= 1
            if not self._open_streams:
                self._all_streams_closed.set()

    async def _run_session(self, request: StreamRequest) -> StreamEnd:
        """Open the stream's session and wait here for how it ended.

        The session runs in the server's `Sessions` (trio), opened from this
        asyncio handler synchronously; it tells the future how it ended.
        grpclib cancels this handler when the client goes away (a reset, a lost
        connection); the session then ends as CLIENT_GONE and cleans up in its
        own task.
        """
        if self._sessions is None:
            raise RuntimeError("JobService.serve_sessions_with was not called")
        ended: asyncio.Future[StreamEnd] = asyncio.get_running_loop().create_future()
        opened = self._sessions.open(request, functools.partial(_settle, ended))
        if isinstance(opened, StreamEnd):
            return opened
        try:
            return await ended
        except asyncio.CancelledError:
            opened.client_gone()
            raise

    async def wait_streams_closed(self) -> None:
        """Until every Subscribe handler has sent its trailers (for shutdown)."""
        await self._all_streams_closed.wait()


def _settle(ended: asyncio.Future[StreamEnd], outcome: StreamEnd | Exception) -> None:
    """How a session ended, to the handler waiting for it. An error goes to the
    handler, whose fault boundary answers INTERNAL. Nothing when the handler
    was cancelled first (the client went away)."""
    if ended.done():
        return
    if isinstance(outcome, Exception):
        ended.set_exception(outcome)
    else:
        ended.set_result(outcome)
