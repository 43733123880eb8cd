"""A subscriber client in trio: register, subscribe, yield signals, start over on failure.

grpclib does the gRPC on trio-asyncio's loop; this module is the boundary.
The channel keeps the connection alive with HTTP/2 PINGs (which also count
as heartbeats for the server's idle rule), and when a stream ends for any
reason other than a refusal that retrying cannot fix, the client registers
again and resubscribes after a jittered backoff.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import TypeAlias

import trio
import trio_asyncio
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Status as GrpcStatus
from grpclib.exceptions import GRPCError, StreamTerminatedError

from jobsignal._proto.job import ClientInfo, JobStub, JobSummarySignal, JobSummarySignalList
from jobsignal.backoff import Backoff

log = logging.getLogger(__name__)

# Refusals that another attempt cannot cure: a wrong role or a bad request.
FATAL_STATUSES = frozenset({GrpcStatus.INVALID_ARGUMENT, GrpcStatus.UNIMPLEMENTED})


class SubscribeFailed(Exception):
    """The server refused in a way retrying cannot fix; the message says why."""


@dataclass(frozen=True)
class SubscribeOptions:
    host: str
    port: int
    role: str
    list_mode: bool = False
    keepalive_time: float = 30.0
    backoff_initial: float = 0.8
    backoff_max: float = 30.0


Signal: TypeAlias = JobSummarySignal | JobSummarySignalList


async def _open_channel(options: SubscribeOptions) -> Channel:
    # Async so it runs on the asyncio side: grpclib binds the channel to the
    # running asyncio loop when it is created.
    config = Configuration(
        _keepalive_time=options.keepalive_time,
        _keepalive_timeout=10.0,
        _keepalive_permit_without_calls=True,
        _http2_max_pings_without_data=0,
        _http2_min_sent_ping_interval_without_data=options.keepalive_time,
    )
    return Channel(options.host, options.port, config=config)


async def _register(stub: JobStub, role: str) -> str:
    status = await stub.register(ClientInfo(role=role))
    if status.code != 200:
        raise GRPCError(GrpcStatus.RESOURCE_EXHAUSTED, f"Register: {status.code} {status.info}")
    client_id: str = status.client_id
    return client_id


async def subscribe(options: SubscribeOptions) -> AsyncGenerator[Signal, None]:
    """Yield every message the server sends, across reconnects, until cancelled.

    Must run inside `trio_asyncio.open_loop()`.
    """
    backoff = Backoff(options.backoff_initial, options.backoff_max)
    while True:
        channel = await trio_asyncio.aio_as_trio(_open_channel)(options)
        try:
            stub = JobStub(channel)
            client_id = await trio_asyncio.aio_as_trio(_register)(stub, options.role)
            log.info("registered as %s (role %s)", client_id, options.role)
            request = ClientInfo(role=options.role, client_id=client_id)
            if options.list_mode:
                stream: AsyncIterator[Signal] = stub.subscribe_job_summary_signal_list(request)
            else:
                stream = stub.subscribe_job_summary_signal(request)
            async for message in trio_asyncio.aio_as_trio(stream):
                backoff.reset()
                yield message
            log.warning("stream ended without a status; resubscribing")
        except GRPCError as error:
            if error.status in FATAL_STATUSES:
                raise SubscribeFailed(f"{error.status.name}: {error.message}") from None
            log.warning("stream ended: %s %s", error.status.name, error.message or "")
        except (StreamTerminatedError, OSError, ConnectionError) as error:
            log.warning("connection to %s:%d lost: %s", options.host, options.port, error)
        finally:
            channel.close()
        await trio.sleep(backoff.next_delay())


@asynccontextmanager
async def open_subscription(options: SubscribeOptions) -> AsyncIterator[AsyncIterator[Signal]]:
    """`subscribe(options)` with the asyncio loop grpclib needs opened around it.

    For trio programs::

        async with open_subscription(SubscribeOptions("127.0.0.1", 8899, "CCAgent")) as signals:
            async for signal in signals:
                ...
    """
    # Close the generator (and its channel) while the loop still runs.
    async with trio_asyncio.open_loop(), aclosing(subscribe(options)) as signals:
        yield signals
