"""Writing batches of pre-encoded messages to a grpclib server stream.

gRPC messages may share DATA frames, so a batch is framed (flag byte,
big-endian length, message) into one byte string. `StreamWriter.write` runs
in the subscriber's trio task: what HTTP/2 lets go at once (headers sent,
socket writable, flow-control window open) is queued straight into h2,
without the trio->asyncio hop that dominates the cost of small batches, at
most `WRITE_SLICE` bytes per loop turn, so one large rank table cannot hold
the loop while other streams wait. Whatever has to wait goes out in turn with
the connection's other waiting streams (`rpc.output`), with no asyncio hop
either. The HTTP/2 internals both need are in `rpc._grpclib`.
"""

from __future__ import annotations

from typing import Any

import grpclib.server
import trio
import trio_asyncio

from jobsignal.rpc import _grpclib
from jobsignal.rpc.output import ConnectionOutput

Stream = grpclib.server.Stream[Any, Any]

_UNCOMPRESSED = b"\x00"
# Bytes one stream may queue per loop turn: a 4 MiB event goes out in 16
# turns, and other streams (small events to other clients) write in between.
WRITE_SLICE = 256 * 1024


def frame(frames: list[bytes]) -> bytes:
    parts: list[bytes] = []
    for message in frames:
        parts += (_UNCOMPRESSED, len(message).to_bytes(4, "big"), message)
    return b"".join(parts)


class StreamWriter:
    """Writes one server stream's batches through its connection's output."""

    def __init__(self, stream: Stream, output: ConnectionOutput) -> None:
        self._stream = stream
        self._output = output
        self._send_headers = trio_asyncio.aio_as_trio(stream.send_initial_metadata)

    async def write(self, frames: list[bytes]) -> bool:
        """Write a batch; True when it all went out without waiting."""
        if not _grpclib.headers_sent(self._stream):
            # Once, through grpclib: then a first batch (a whole snapshot) is sliced too.
            await self._send_headers()
        data = memoryview(frame(frames))
        sent = 0
        if not self._output.has_waiting:  # never overtake streams waiting their turn
            # The slices are never waited for, so they are shielded: a stream
            # cancelled mid-message must not leave a truncated message behind.
            with trio.CancelScope(shield=True):
                while sent < len(data):
                    if sent:
                        await trio.lowlevel.checkpoint()
                    queued = _grpclib.send_now(self._stream, data[sent : sent + WRITE_SLICE])
                    if not queued:
                        break
                    sent += queued
                    self._output.schedule_flush()
        if sent == len(data):
            return True
        await self._output.send_in_turn(self._stream, data[sent:])
        return False
