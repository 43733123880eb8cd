"""The grpclib codec: pre-encoded bytes pass through, messages encode as usual.

Job events are encoded once by the broadcaster and handed to grpclib as bytes
(docs/architecture.md section 6, "Fan-out and slow clients"); Register
replies and health messages are betterproto2 objects, reflection's protobuf
ones. Request decoding failures become
INVALID_ARGUMENT here, at the boundary, instead of a generic UNKNOWN, and
compressed requests are inflated here (`rpc.compression`).
"""

from __future__ import annotations

import struct
from typing import Any

import betterproto2
from grpclib.const import Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError

from jobsignal.rpc import compression

# The 5-byte prefix of every gRPC message: a compressed flag and the length.
MESSAGE_PREFIX = struct.Struct(">?I")


def truncated_request() -> GRPCError:
    return GRPCError(Status.INVALID_ARGUMENT, "request truncated: the stream ended mid-message")


class PassthroughCodec(CodecBase):
    __content_subtype__ = "proto"

    def __init__(self, max_request_bytes: int) -> None:
        self.max_request_bytes = max_request_bytes

    def encode(self, message: Any, message_type: Any) -> bytes:
        if type(message) is bytes:
            return message
        encoded: bytes = message.SerializeToString()
        return encoded

    def check_request_size(self, size: int) -> None:
        """RESOURCE_EXHAUSTED for a request above the limit (also used before buffering)."""
        if size > self.max_request_bytes:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"request of {size} bytes exceeds the limit of {self.max_request_bytes}",
            )

    def check_prefix(self, prefix: bytes, encoding: str | None) -> tuple[str | None, int]:
        """What a message's 5-byte prefix announces, checked before its body is read:
        the encoding it is compressed with (None: not compressed; `compression.
        check_encoding` refuses one the request's `encoding` header cannot
        give), and its length (RESOURCE_EXHAUSTED above the limit)."""
        compressed, length = MESSAGE_PREFIX.unpack(prefix)
        self.check_request_size(length)
        return (compression.check_encoding(encoding) if compressed else None), length

    def decompress(self, data: bytes, encoding: str) -> bytes:
        """A compressed message's body, inflated within the request size limit."""
        return compression.decompress(data, encoding, self.max_request_bytes)

    def decode(self, data: bytes, message_type: Any) -> Any:
        self.check_request_size(len(data))
        try:
            _strict_check(data, message_type)
            return message_type.FromString(data)
        except Exception:
            name = getattr(message_type, "__name__", "request")
            raise GRPCError(
                Status.INVALID_ARGUMENT, f"request is not a valid {name} message"
            ) from None


def _strict_check(data: bytes, message_type: Any) -> None:
    """Reject the malformed wire data that protobuf's parser rejects and betterproto2's
    lets by (a length-delimited or fixed-size field running past the end, wire
    types 6 and 7, field number 0, unmatched groups), without the protobuf runtime.

    The requests this server parses with betterproto2 (ClientInfo,
    HealthCheckRequest) hold only scalars and strings, so checking the framing
    of their fields is the whole of it; betterproto2 itself rejects overlong
    varints and invalid UTF-8. Protobuf classes (reflection) parse strictly
    themselves.
    """
    if isinstance(message_type, type) and issubclass(message_type, betterproto2.Message):
        _check_fields(data, 0, None, 0)


# protobuf's default recursion limit, which nested groups count against.
_MAX_GROUP_DEPTH = 100
_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LENGTH, _WIRE_GROUP, _WIRE_END, _WIRE_FIXED32 = range(6)


def _varint(data: bytes, pos: int, most: int = 10) -> tuple[int, int]:
    """The varint at `pos` (at most `most` bytes) and the position after it."""
    value = 0
    for shift in range(0, 7 * most, 7):
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
    raise ValueError("varint too long")


def _check_fields(data: bytes, pos: int, group: int | None, depth: int) -> int:
    """Walk the fields from `pos` to the end of `data` or, inside a group, to the
    group's END_GROUP; return the position after them. As protobuf's parser: a
    tag is a 32-bit varint of at most 5 bytes. Field number 0 is invalid wherever
    it appears, inside groups too (as protobuf's C++ parser and upb up to 6.33
    hold; upb from 7.34 skips a group's fields unchecked)."""
    while pos < len(data):
        tag, pos = _varint(data, pos, most=5)
        number, wire_type = tag >> 3, tag & 7
        if tag > 0xFFFFFFFF or number == 0:
            raise ValueError("invalid field tag")
        if wire_type == _WIRE_VARINT:
            pos = _varint(data, pos)[1]
        elif wire_type == _WIRE_FIXED64:
            pos += 8
        elif wire_type == _WIRE_FIXED32:
            pos += 4
        elif wire_type == _WIRE_LENGTH:
            length, pos = _varint(data, pos)
            pos += length
        elif wire_type == _WIRE_GROUP:
            if depth >= _MAX_GROUP_DEPTH:
                raise ValueError("groups nested too deeply")
            pos = _check_fields(data, pos, number, depth + 1)
        elif wire_type == _WIRE_END and number == group:
            return pos
        else:
            raise ValueError("invalid wire type or unmatched END_GROUP")
        if pos > len(data):
            raise ValueError("field runs past the end of the message")
    if group is not None:
        raise ValueError("unterminated group")
    return pos
