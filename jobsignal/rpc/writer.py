"""Writing batches of pre-encoded messages to a grpclib server stream.

gRPC messages may share DATA frames, so a batch is framed (flag byte,
big-endian length, message) into one byte string. `write_frames_now` is the
fast path, called straight from the subscriber's trio task when HTTP/2 need
not wait; `write_frames` is the asyncio coroutine (one trio->asyncio hop)
for everything else. Both use grpclib's HTTP/2 stream internals
(`Stream._stream`, its `_h2_connection` and `_transport`); grpclib is pinned
in pyproject.toml for that reason, and the gRPC tests run both paths.
"""

from __future__ import annotations

from typing import Any

import grpclib.server
from h2.exceptions import StreamClosedError

Stream = grpclib.server.Stream[Any, Any]

_UNCOMPRESSED = b"\x00"


def _frame(frames: list[bytes]) -> bytes:
    parts: list[bytes] = []
    for frame in frames:
        parts += (_UNCOMPRESSED, len(frame).to_bytes(4, "big"), frame)
    return b"".join(parts)


def write_frames_now(stream: Stream, frames: list[bytes]) -> bool:
    """Write a batch without waiting, if HTTP/2 lets it go at once; else False.

    The common case (headers sent, socket writable, flow-control window open)
    needs no asyncio at all: grpclib's HTTP/2 state and the transport are
    plain objects on this same thread, so the trio task writes directly and
    skips the trio->asyncio hop that dominates the cost of small batches.
    Anything that would have to wait goes through `write_frames` instead.
    """
    h2_stream = stream._stream
    connection = h2_stream.connection
    if (
        not stream._send_initial_metadata_done
        or not connection.write_ready.is_set()
        or connection.is_closing()
    ):
        return False
    stream_id = h2_stream.id
    assert stream_id is not None  # set when the request arrived
    data = _frame(frames)
    h2_connection = h2_stream._h2_connection
    try:
        if h2_connection.local_flow_control_window(stream_id) < len(data):
            return False
        frame_size = h2_connection.max_outbound_frame_size
        for start in range(0, len(data), frame_size):
            h2_connection.send_data(stream_id, data[start : start + frame_size])
    except StreamClosedError:
        return False
    h2_stream._transport.write(h2_connection.data_to_send())
    connection.data_send_process()
    return True


async def write_frames(stream: Stream, frames: list[bytes]) -> None:
    """Write a batch, waiting for flow control as needed (grpclib's `send_data`
    splits it by window and frame size); also sends the response headers."""
    if not stream._send_initial_metadata_done:
        await stream.send_initial_metadata()
    await stream._stream.send_data(_frame(frames))
    stream._send_message_done = True
