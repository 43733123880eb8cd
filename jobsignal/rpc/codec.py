"""The grpclib codec: pre-encoded bytes pass through, messages encode as usual.

Job events are encoded once by the broadcaster and handed to grpclib as bytes
(docs/architecture.md section 6, "Fan-out and slow clients"); Register
replies, health and reflection messages are ordinary protobuf/betterproto2
objects. Request decoding failures become
INVALID_ARGUMENT here, at the boundary, instead of a generic UNKNOWN.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import message_factory
from grpclib.const import Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError


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
    """Parse with the protobuf runtime, which rejects what betterproto2 lets by.

    betterproto2's parser accepts a length-delimited field that runs past the
    end of the message; protobuf's raises DecodeError. Both share the
    descriptor generated from protos/, so the check costs one extra parse of a
    small request. Messages that are already protobuf classes need no check.
    """
    descriptor = getattr(message_type, "DESCRIPTOR", None)
    if descriptor is None or hasattr(message_type, "ParseFromString"):
        return
    message_factory.GetMessageClass(descriptor).FromString(data)
