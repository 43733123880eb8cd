"""A subscriber client in trio: register, subscribe, yield signals, start over on failure.

grpclib does the gRPC on trio-asyncio's loop; this module is the boundary.
The channel keeps the connection alive with HTTP/2 PINGs (which also count
as heartbeats for the server's idle rule), and when a stream ends for any
reason other than a refusal that retrying cannot fix, the client registers
again and resubscribes after a jittered backoff.

Over TLS, problems that another attempt cannot cure end the subscription with
`SubscribeFailed`: a server certificate that does not verify, a failed
handshake, and a server that closes the connection right after the handshake
without a word, which is how jobsignal's mutual TLS turns down a missing or
untrusted client certificate.

`fetch_jobs` and `check_health` are one-shot calls over the same connection
and TLS set-up: the current jobs from the List RPC's snapshot, and the
server's grpc.health.v1 status.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import TypeAlias, TypeVar

import trio
import trio_asyncio
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Cardinality
from grpclib.const import Status as GrpcStatus
from grpclib.exceptions import GRPCError, StreamTerminatedError

import jobsignal.rpc  # noqa: F401  (grpclib bound to trio-asyncio, checked: jobsignal/rpc/__init__.py)
from jobsignal._proto.grpc.health.v1 import HealthCheckRequest, HealthCheckResponse
from jobsignal._proto.job import ClientInfo, JobSummarySignal, JobSummarySignalList, Status
from jobsignal.client_options import SubscribeFailed, SubscribeOptions, client_ssl_context
from jobsignal.terminal import lone_exception
from jobsignal.util.backoff import Backoff

log = logging.getLogger(__name__)

# The RPCs called, by their full names (protos/job/job.proto, grpc.health.v1).
REGISTER = "/job.Job/Register"
SUBSCRIBE_SIGNAL = "/job.Job/SubscribeJobSummarySignal"
SUBSCRIBE_LIST = "/job.Job/SubscribeJobSummarySignalList"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"

# What connect() fails with when there is no server to reach at all.
_CONNECT_ERRNOS = frozenset(
    {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT}
)


def _never_connected(error: BaseException) -> bool:
    """True for an error of connecting (refused, unreachable, unknown host), as
    opposed to a connection that was made and then lost."""
    if isinstance(error, socket.gaierror):
        return True
    return isinstance(error, OSError) and error.errno in _CONNECT_ERRNOS


# Refusals that another attempt cannot cure: a wrong role or a bad request.
FATAL_STATUSES = frozenset({GrpcStatus.INVALID_ARGUMENT, GrpcStatus.UNIMPLEMENTED})
# Seconds a cancelled subscriber waits for its stream's reset to be queued.
CLOSE_STREAM_TIMEOUT = 1.0


Signal: TypeAlias = JobSummarySignal | JobSummarySignalList


def _server_name(options: SubscribeOptions) -> str:
    return options.tls_server_name or options.host


def _handshake_failure(options: SubscribeOptions, error: ssl.SSLError) -> str:
    where = f"{options.host}:{options.port}"
    if isinstance(error, ssl.SSLCertVerificationError):
        return (
            f"TLS: the certificate of {where} does not verify as {_server_name(options)!r}"
            f" ({error.verify_message}): check the CA bundle and the server name"
        )
    return f"TLS handshake with {where} failed ({error.reason or error}): does it serve TLS?"


# How an OpenSSL handshake ends when the peer hangs up in the middle of it.
_EOF_REASONS = frozenset({"UNEXPECTED_EOF_WHILE_READING", "EOF_OCCURRED_IN_VIOLATION_OF_PROTOCOL"})


async def _tls_refusal(options: SubscribeOptions, context: ssl.SSLContext) -> str | None:
    """Why a TLS connection was lost before Register answered, if retrying cannot help.

    jobsignal turns down a missing or untrusted client certificate by closing
    the connection without a TLS alert, so grpclib only reports a lost
    connection. A fresh handshake tells that apart from a transient loss: an
    accepted client hears the server's HTTP/2 SETTINGS at once, a refused one
    is hung up on during or right after the handshake.
    """
    try:
        with trio.fail_after(5):
            stream = trio.SSLStream(
                await trio.open_tcp_stream(options.host, options.port),
                context,
                server_hostname=_server_name(options),
            )
            try:
                await stream.do_handshake()
                heard = await stream.receive_some()
            finally:
                await trio.aclose_forcefully(stream)
    except trio.BrokenResourceError as error:
        cause = error.__cause__
        hung_up = isinstance(cause, ssl.SSLEOFError | ConnectionError) or (
            isinstance(cause, ssl.SSLError) and cause.reason in _EOF_REASONS
        )
        if not hung_up:
            return _handshake_failure(options, cause) if isinstance(cause, ssl.SSLError) else None
        heard = b""
    except (OSError, trio.TooSlowError):
        return None  # the server is down or slow: worth another attempt
    if heard:
        return None
    where = f"{options.host}:{options.port}"
    if options.tls_cert:
        return (
            f"TLS: {where} hung up during the handshake: it does not accept the client"
            f" certificate {options.tls_cert} (mutual TLS: the certificate must be signed"
            " by a CA the server trusts)"
        )
    return (
        f"TLS: {where} hung up during the handshake: it requires a client certificate"
        " (mutual TLS): give a certificate and its key"
    )


async def _open_channel(options: SubscribeOptions, context: ssl.SSLContext | None) -> Channel:
    # Async so it runs on the asyncio side: grpclib binds the channel to the
    # running asyncio loop when it is created.
    config = Configuration(
        _keepalive_time=options.keepalive_time,
        _keepalive_timeout=10.0,
        _keepalive_permit_without_calls=True,
        _http2_max_pings_without_data=0,
        _http2_min_sent_ping_interval_without_data=options.keepalive_time,
        ssl_target_name_override=options.tls_server_name or None,
    )
    return Channel(options.host, options.port, ssl=context, config=config)


_Request = TypeVar("_Request", ClientInfo, HealthCheckRequest)
_Reply = TypeVar("_Reply", Status, HealthCheckResponse, JobSummarySignal, JobSummarySignalList)


async def _unary(
    channel: Channel, route: str, request: _Request, reply_type: type[_Reply]
) -> _Reply:
    """One request, one reply, through grpclib's public `Channel.request`."""
    async with channel.request(route, Cardinality.UNARY_UNARY, type(request), reply_type) as call:
        await call.send_message(request, end=True)
        reply = await call.recv_message()
    if reply is None:  # grpclib raises the call's status first, if it had one
        raise GRPCError(GrpcStatus.UNKNOWN, f"{route}: no reply")
    return reply


async def _server_stream(
    channel: Channel, route: str, request: _Request, reply_type: type[_Reply]
) -> AsyncGenerator[_Reply, None]:
    """One request, then every message of the server's stream."""
    async with channel.request(route, Cardinality.UNARY_STREAM, type(request), reply_type) as call:
        await call.send_message(request, end=True)
        async for message in call:
            yield message


def _subscription(
    channel: Channel, request: ClientInfo, list_mode: bool
) -> AsyncGenerator[Signal, None]:
    if list_mode:
        return _server_stream(channel, SUBSCRIBE_LIST, request, JobSummarySignalList)
    return _server_stream(channel, SUBSCRIBE_SIGNAL, request, JobSummarySignal)


async def _register(channel: Channel, role: str) -> str:
    status = await _unary(channel, REGISTER, ClientInfo(role=role), Status)
    if status.code != 200:
        raise GRPCError(GrpcStatus.RESOURCE_EXHAUSTED, f"Register: {status.code} {status.info}")
    client_id: str = status.client_id
    return client_id


async def subscribe(options: SubscribeOptions) -> AsyncGenerator[Signal, None]:
    """Yield every message the server sends, across reconnects, until cancelled.

    Must run inside `trio_asyncio.open_loop()`.
    """
    backoff = Backoff(options.backoff_initial, options.backoff_max)
    context = client_ssl_context(options) if options.uses_tls else None
    while True:
        channel = await trio_asyncio.aio_as_trio(_open_channel)(options, context)
        registered = False
        try:
            client_id = await trio_asyncio.aio_as_trio(_register)(channel, options.role)
            registered = True
            log.info("registered as %s (role %s)", client_id, options.role)
            request = ClientInfo(role=options.role, client_id=client_id)
            stream = _subscription(channel, request, options.list_mode)
            if options.on_subscribed is not None:
                options.on_subscribed(client_id)
            try:
                while (message := await _next_message(stream)) is not None:
                    backoff.reset()
                    yield message
            finally:
                await _close_stream(stream)
            log.warning("stream ended without a status; resubscribing")
        except GRPCError as error:
            if error.status in FATAL_STATUSES:
                raise SubscribeFailed(f"{error.status.name}: {error.message}") from None
            log.warning("stream ended: %s %s", error.status.name, error.message or "")
        except (StreamTerminatedError, OSError) as error:  # ssl.SSLError is an OSError
            if context is not None and not registered:
                if isinstance(error, ssl.SSLCertVerificationError):
                    raise SubscribeFailed(_handshake_failure(options, error)) from None
                refusal = await _tls_refusal(options, context)
                if refusal is not None:
                    raise SubscribeFailed(refusal) from None
            if _never_connected(error):
                log.warning("cannot connect to %s:%d: %s", options.host, options.port, error)
            else:
                log.warning("connection to %s:%d lost: %s", options.host, options.port, error)
        finally:
            channel.close()
        await trio.sleep(backoff.next_delay())


async def _next_message(stream: AsyncGenerator[Signal, None]) -> Signal | None:
    """The stream's next message (None: it ended), read by an asyncio task.

    Not trio_asyncio's iterator adapter (`aio_as_trio(stream)`): when a
    cancellation (Ctrl-C) interrupts a read whose stream then fails instead
    of taking the cancellation (the connection closes as the loop stops), the
    adapter hands that late error to whatever the trio task waits on next, so
    Ctrl-C ended a subscriber with StreamTerminatedError. Waiting for the read
    task as a future, the task is woken once, by its own read's outcome.
    """
    try:
        return await trio_asyncio.aio_as_trio(stream.__anext__)()
    except StopAsyncIteration:
        return None


async def _close_stream(stream: AsyncGenerator[Signal, None]) -> None:
    """Close the stream on the asyncio side (its call reset), even while the trio
    task is being cancelled: briefly shielded, it only queues frames."""
    with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_STREAM_TIMEOUT):
        await trio_asyncio.aio_as_trio(stream.aclose)()


@asynccontextmanager
async def open_subscription(options: SubscribeOptions) -> AsyncIterator[AsyncIterator[Signal]]:
    """`subscribe(options)` with the asyncio loop grpclib needs opened around it.

    For trio programs::

        async with open_subscription(SubscribeOptions("127.0.0.1", 8899, "CCAgent")) as signals:
            async for signal in signals:
                ...

    Run the program with `trio.run(..., restrict_keyboard_interrupt_to_checkpoints=True)`
    (or take SIGINT yourself): Ctrl-C raised inside asyncio's code can leave the
    program hanging (docs/embedding.md).
    """
    try:
        # Close the generator (and its channel) while the loop still runs.
        async with trio_asyncio.open_loop(), aclosing(subscribe(options)) as signals:
            yield signals
    except BaseExceptionGroup as group:
        # trio-asyncio's loop nurseries wrap whatever ends the block (SubscribeFailed,
        # or the caller's own exception) in groups of one: hand back the exception.
        lone = lone_exception(group)
        if lone is None:
            raise
        raise lone from None


class CallFailed(Exception):
    """A one-shot call (`fetch_jobs`, `check_health`) failed; the message says why."""


_Result = TypeVar("_Result")


async def fetch_jobs(options: SubscribeOptions) -> list[JobSummarySignal]:
    """The server's current jobs, one signal each: Register as `options.role`, take the
    SubscribeJobSummarySignalList snapshot (its batches, until JobTotalNum jobs have
    arrived) and hang up. For trio programs, which bound it with `trio.fail_after`;
    CallFailed when that does not work out."""

    async def snapshot(channel: Channel) -> list[JobSummarySignal]:
        client_id = await _register(channel, options.role)
        request = ClientInfo(role=options.role, client_id=client_id)
        stream = _server_stream(channel, SUBSCRIBE_LIST, request, JobSummarySignalList)
        jobs: list[JobSummarySignal] = []
        async with aclosing(stream) as batches:
            async for batch in batches:
                jobs += batch.job_summary_signals
                if len(jobs) >= batch.job_total_num:
                    return jobs
        raise CallFailed(f"the stream ended after {len(jobs)} jobs of the snapshot")

    return await _call_once(options, snapshot)


async def check_health(options: SubscribeOptions, service: str = "") -> str:
    """The grpc.health.v1 status of `service` ("": the server as a whole), by name:
    SERVING, NOT_SERVING, ... For trio programs, which bound it with `trio.fail_after`;
    CallFailed when there is no answer."""

    async def check(channel: Channel) -> str:
        try:
            request = HealthCheckRequest(service=service)
            reply = await _unary(channel, HEALTH_CHECK, request, HealthCheckResponse)
        except GRPCError as error:
            if error.status is not GrpcStatus.NOT_FOUND:
                raise
            raise CallFailed(f"NOT_FOUND: the server has no health entry {service!r}") from None
        return reply.status.name or f"status {int(reply.status)}"

    return await _call_once(options, check)


async def _call_once(
    options: SubscribeOptions, call: Callable[[Channel], Awaitable[_Result]]
) -> _Result:
    """`call` on a fresh channel to the server of `options`; grpclib's and the
    connection's errors become CallFailed."""
    context = client_ssl_context(options) if options.uses_tls else None
    try:
        async with trio_asyncio.open_loop():
            channel = await trio_asyncio.aio_as_trio(_open_channel)(options, context)
            try:
                result: _Result = await trio_asyncio.aio_as_trio(call)(channel)
                return result
            except GRPCError as error:
                detail = f": {error.message}" if error.message else ""
                raise CallFailed(f"{error.status.name}{detail}") from None
            except (StreamTerminatedError, OSError) as error:  # ssl.SSLError is an OSError
                raise CallFailed(await _connection_failure(options, context, error)) from None
            finally:
                channel.close()
    except BaseExceptionGroup as group:
        lone = lone_exception(group)  # as in open_subscription
        if lone is None:
            raise
        raise lone from None


async def _connection_failure(
    options: SubscribeOptions, context: ssl.SSLContext | None, error: Exception
) -> str:
    if context is not None:
        if isinstance(error, ssl.SSLCertVerificationError):
            return _handshake_failure(options, error)
        refusal = await _tls_refusal(options, context)
        if refusal is not None:
            return refusal
    return f"cannot reach {options.host}:{options.port}: {error or type(error).__name__}"
