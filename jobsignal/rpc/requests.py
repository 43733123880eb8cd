"""Reading a unary request at the boundary, with every framing problem answered.

grpclib's `recv_message` buffers whatever length a request's prefix
announces before anything can check it, and lets framing errors escape as
NotImplementedError / AssertionError (seen by the client as UNKNOWN). This
reader looks at the 5-byte gRPC message prefix first: a compressed flag, a
missing or truncated message each get a precise status. A length above the
limit is refused by the stream's own reads, which every server stream checks
against the codec's limit before a byte is buffered (`_grpclib.check_reads`,
for grpclib's readers too). The stream internals it needs are in
`rpc._grpclib`.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, TypeVar

import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from jobsignal._proto.job import ClientInfo
from jobsignal.rpc import _grpclib
from jobsignal.rpc.codec import PassthroughCodec

T = TypeVar("T")

_PREFIX = struct.Struct(">?I")


async def read_request(stream: grpclib.server.Stream[Any, Any], message_type: type[T]) -> T:
    """The request message; the size limit is the server codec's (`PassthroughCodec`),
    checked by the stream's read of the body before anything is buffered."""
    codec = _grpclib.request_codec(stream)
    assert isinstance(codec, PassthroughCodec)
    prefix = await _grpclib.receive(stream, _PREFIX.size)
    if prefix is None:
        raise _truncated()
    if len(prefix) < _PREFIX.size:
        raise GRPCError(Status.INVALID_ARGUMENT, "request has no message")
    compressed, length = _PREFIX.unpack(prefix)
    if compressed:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed requests are not supported")
    body = await _grpclib.receive(stream, length)
    if body is None or len(body) < length:
        raise _truncated()
    message: T = codec.decode(body, message_type)
    return message


def _truncated() -> GRPCError:
    return GRPCError(Status.INVALID_ARGUMENT, "request truncated: the stream ended mid-message")


# Longer than any role or clientId a client can mean (ids are 36-character
# UUIDs): a longer one is refused before it reaches a log line or a reply.
MAX_ROLE_CHARS = 64
MAX_CLIENT_ID_CHARS = 128


async def read_client_info(stream: grpclib.server.Stream[Any, Any], within: float) -> ClientInfo:
    """The request of every job.Job RPC, with its fields' lengths bounded; it must
    arrive `within` seconds (the loop's clock, which is trio's), or the stream
    ends with DEADLINE_EXCEEDED: a client that opens streams and trickles their
    requests would otherwise hold each of them as long as its connection lives."""
    try:
        async with asyncio.timeout(within):
            info = await read_request(stream, ClientInfo)
    except TimeoutError:
        raise GRPCError(
            Status.DEADLINE_EXCEEDED, f"the request did not arrive within {within:g}s"
        ) from None
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
