"""Reading a unary request at the boundary, with every framing problem answered.

grpclib's `recv_message` buffers whatever length a request's prefix
announces before anything can check it, and lets framing errors escape as
NotImplementedError / AssertionError (seen by the client as UNKNOWN). This
reader looks at the 5-byte gRPC message prefix first: a compressed flag, a
length above the limit, a missing or truncated message each get a precise
status before a byte of the body is buffered. It uses grpclib's protocol
stream (`Stream._stream`); grpclib is pinned for that reason.
"""

from __future__ import annotations

import struct
from typing import Any, TypeVar

import grpclib.server
from grpclib.const import Status
from grpclib.exceptions import GRPCError

T = TypeVar("T")

_PREFIX = struct.Struct(">?I")


async def read_request(
    stream: grpclib.server.Stream[Any, Any], message_type: type[T], max_bytes: int
) -> T:
    h2_stream = stream._stream
    prefix = await _receive(h2_stream, _PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise GRPCError(Status.INVALID_ARGUMENT, "request has no message")
    compressed, length = _PREFIX.unpack(prefix)
    if compressed:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed requests are not supported")
    if length > max_bytes:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"request of {length} bytes exceeds the limit of {max_bytes}",
        )
    body = await _receive(h2_stream, length)
    if len(body) < length:
        raise _truncated()
    message: T = stream._codec.decode(body, message_type)
    return message


def _truncated() -> GRPCError:
    return GRPCError(Status.INVALID_ARGUMENT, "request truncated: the stream ended mid-message")


async def _receive(h2_stream: Any, size: int) -> bytes:
    try:
        data: bytes = await h2_stream.recv_data(size)
    except AssertionError:
        # grpclib's buffer asserts when the stream ends short of `size` bytes.
        raise _truncated() from None
    return data
