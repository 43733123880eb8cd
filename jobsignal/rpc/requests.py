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

from jobsignal.rpc.codec import PassthroughCodec

T = TypeVar("T")

_PREFIX = struct.Struct(">?I")


async def read_request(stream: grpclib.server.Stream[Any, Any], message_type: type[T]) -> T:
    """The request message; the size limit is the server codec's (`PassthroughCodec`)."""
    codec = stream._codec
    assert isinstance(codec, PassthroughCodec)
    h2_stream = stream._stream
    prefix = await _receive(h2_stream, _PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise GRPCError(Status.INVALID_ARGUMENT, "request has no message")
    compressed, length = _PREFIX.unpack(prefix)
    if compressed:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed requests are not supported")
    codec.check_request_size(length)
    body = await _receive(h2_stream, length)
    if len(body) < length:
        raise _truncated()
    message: T = codec.decode(body, message_type)
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
