"""Writing batches of pre-encoded messages to a grpclib server stream.

gRPC messages may share DATA frames, so a batch is framed (flag byte,
big-endian length, message) into one byte string. `write_frames_now` is the
fast path, called straight from the subscriber's trio task when HTTP/2 need
not wait; `write_frames` is the asyncio coroutine (one trio->asyncio hop)
for everything else. The HTTP/2 internals both need are in `rpc._grpclib`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpclib.server

from jobsignal.rpc import _grpclib

Stream = grpclib.server.Stream[Any, Any]

_UNCOMPRESSED = b"\x00"


def _frame(frames: list[bytes]) -> bytes:
    parts: list[bytes] = []
    for frame in frames:
        parts += (_UNCOMPRESSED, len(frame).to_bytes(4, "big"), frame)
    return b"".join(parts)


def write_frames_now(stream: Stream, flush: Callable[[], None], frames: list[bytes]) -> bool:
    """Write a batch without waiting, if HTTP/2 lets it go at once; else False.

    Skips the trio->asyncio hop that dominates the cost of small batches;
    anything that would have to wait goes through `write_frames` instead.
    `flush` writes the connection's output (once per loop turn for all its
    streams: `OutputFlusher.schedule`).
    """
    return _grpclib.try_send_now(stream, _frame(frames), flush)


async def write_frames(stream: Stream, frames: list[bytes]) -> None:
    """Write a batch, waiting for flow control as needed; also sends the response headers."""
    await _grpclib.send_waiting(stream, _frame(frames))
