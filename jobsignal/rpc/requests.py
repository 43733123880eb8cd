"""Reading the request of a unary-request call at the boundary: bounded in size and time.

The stream itself checks every message's framing before its body is
buffered (`_grpclib.check_reads`: a length over the codec's limit, a
compressed flag, a stream ending mid-message each get a precise status).
Here a call's one request must also arrive in time and be there at all.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar, cast

import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from jobsignal._proto.job import ClientInfo

T = TypeVar("T")


async def read_request(
    stream: grpclib.server.Stream[Any, Any], message_type: type[T], within: float
) -> T:
    """The call's request, a `message_type` (the handler's request type, which grpclib
    decodes). It must arrive `within` seconds (the loop's clock, which is trio's),
    or the stream ends with DEADLINE_EXCEEDED: a client that opens streams and
    trickles their requests would otherwise hold each of them as long as its
    connection lives."""
    try:
        async with asyncio.timeout(within):
            message = await stream.recv_message()
    except TimeoutError:
        raise GRPCError(
            Status.DEADLINE_EXCEEDED, f"the request did not arrive within {within:g}s"
        ) from None
    if message is None:
        raise GRPCError(Status.INVALID_ARGUMENT, "request has no message")
    return cast(T, message)


# Longer than any role or clientId a client can mean (ids are 36-character
# UUIDs): a longer one is refused before it reaches a log line or a reply.
MAX_ROLE_CHARS = 64
MAX_CLIENT_ID_CHARS = 128


async def read_client_info(stream: grpclib.server.Stream[Any, Any], within: float) -> ClientInfo:
    """The request of every job.Job RPC (`read_request`), with its fields' lengths bounded."""
    info = await read_request(stream, ClientInfo, within)
    for field, value, limit in (
        ("role", info.role, MAX_ROLE_CHARS),
        ("clientId", info.client_id, MAX_CLIENT_ID_CHARS),
    ):
        if len(value) > limit:
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"{field} of {len(value)} characters is longer than the limit of {limit}",
            )
    return info
