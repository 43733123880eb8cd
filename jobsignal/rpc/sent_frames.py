"""The transport grpclib writes a connection's frames through: it counts what the server sends.

Two rules need to know when the server sends DATA or HEADERS frames: the
ping-flood rule forgives a client's PINGs while data flows (`rpc.activity`),
and the control-frame budget earns the peer credit for the WINDOW_UPDATEs it
may answer them with (`rpc.guard`). Every DATA and HEADERS frame of a
connection leaves through one transport: grpclib's own writes and
jobsignal's (`rpc.writer`, `rpc.output`). (The maximum-age GOAWAYs of
`rpc.connections`, neither, go to the socket's transport directly, whole
frames between whole writes.) The protocol hands grpclib a
`FrameCountingTransport` around the socket's transport when the connection
is made; each write is counted from its 9-byte frame headers (the frame
format of RFC 9113, section 4.1) and then passed on as it is.

A write is whole frames in practice (h2's output, a frame built in one
piece); a frame split across writes is still counted once, where it starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

FRAME_HEADER_SIZE = 9
DATA, HEADERS = 0x0, 0x1


def _nothing(count: int) -> None:
    pass


class FrameCountingTransport(asyncio.Transport):
    """`transport`, with `frames_sent(count)` called for each write that holds the
    start of DATA or HEADERS frames (`count` of them), before the write (set once
    the connection's rules exist: the first writes are SETTINGS)."""

    __slots__ = ("_header", "_skip", "frames_sent", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self.transport = transport
        self.frames_sent: Callable[[int], None] = _nothing
        self._skip = 0  # bytes of a frame that began in an earlier write
        self._header = b""  # the start of a frame header split across writes

    def write(self, data: bytes | bytearray | memoryview) -> None:
        count = self._count(data)
        if count:
            self.frames_sent(count)
        self.transport.write(data)

    def _count(self, data: bytes | bytearray | memoryview) -> int:
        end = len(data)
        position = min(self._skip, end)
        self._skip -= position
        count = 0
        if self._header:
            wanted = FRAME_HEADER_SIZE - len(self._header)
            header = self._header + bytes(data[position : position + wanted])
            if len(header) < FRAME_HEADER_SIZE:
                self._header = header
                return 0
            self._header = b""
            count += header[3] <= HEADERS
            position += wanted + int.from_bytes(header[:3], "big")
        while position + FRAME_HEADER_SIZE <= end:
            count += data[position + 3] <= HEADERS
            position += FRAME_HEADER_SIZE + int.from_bytes(data[position : position + 3], "big")
        if position > end:
            self._skip = position - end
        elif position < end:
            self._header = bytes(data[position:])
        return count

    # -- the rest of the transport, passed on ------------------------------------------------

    def writelines(self, list_of_data: Any) -> None:
        # Passed on whole: asyncio sends a list of views with one sendmsg (3.12+)
        # and keeps what the socket does not take as views, not copies.
        parts = list(list_of_data)
        count = sum(self._count(data) for data in parts)
        if count:
            self.frames_sent(count)
        self.transport.writelines(parts)

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close(self) -> None:
        self.transport.close()

    def abort(self) -> None:
        self.transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        self.transport.resume_reading()

    def is_reading(self) -> bool:
        return self.transport.is_reading()

    def can_write_eof(self) -> bool:
        return self.transport.can_write_eof()

    def write_eof(self) -> None:
        self.transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.transport.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.transport.get_protocol()
