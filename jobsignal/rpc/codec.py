"""The grpclib codec: pre-encoded bytes pass through, messages encode as usual.

Job events are encoded once by the broadcaster and handed to grpclib as bytes
(DESIGN.md section 8); Register replies, health and reflection messages are
ordinary protobuf/betterproto2 objects. Request decoding failures become
INVALID_ARGUMENT here, at the boundary, instead of a generic UNKNOWN.
"""

from __future__ import annotations

from typing import Any

from grpclib.const import Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError


class PassthroughCodec(CodecBase):
    __content_subtype__ = "proto"

    def __init__(self, max_request_bytes: int = 4 * 1024 * 1024) -> None:
        self.max_request_bytes = max_request_bytes

    def encode(self, message: Any, message_type: Any) -> bytes:
        if type(message) is bytes:
            return message
        encoded: bytes = message.SerializeToString()
        return encoded

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > self.max_request_bytes:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"request of {len(data)} bytes exceeds the limit of {self.max_request_bytes}",
            )
        try:
            return message_type.FromString(data)
        except Exception:
            name = getattr(message_type, "__name__", "request")
            raise GRPCError(
                Status.INVALID_ARGUMENT, f"request is not a valid {name} message"
            ) from None
