"""Writing batches of pre-encoded messages to a grpclib server stream.

gRPC messages may share DATA frames, so a batch is framed (flag byte,
big-endian length, message) into one byte string. `StreamWriter.write` runs
in the subscriber's trio task: what HTTP/2 lets go at once (headers sent,
socket writable, flow-control window open) is queued straight into h2,
without the trio->asyncio hop that dominates the cost of small batches, at
most `WRITE_SLICE` bytes per loop turn, so one large rank table cannot hold
the loop while other streams wait. Whatever has to wait goes out in turn with
the connection's other waiting streams (`rpc.output`), with no asyncio hop
either. `StreamWriter.write_now` is the shortest path: one message sent from
`publish` itself when HTTP/2 takes all of it at once, so no task is woken
for it. A stream's response headers go out in the same write as its first
batch (`_grpclib.queue_headers`): a client sees no stream before its first
message, an FdAgent's snapshot. The HTTP/2 internals all of these need are in
`rpc._grpclib`.
"""

from __future__ import annotations

from typing import Any

import grpclib.server
import trio
import trio_asyncio

from jobsignal.rpc import _grpclib
from jobsignal.rpc.output import ConnectionOutput
from jobsignal.rpc.session import SendTimedOut

Stream = grpclib.server.Stream[Any, Any]

_UNCOMPRESSED = b"\x00"
# Bytes one stream may queue per loop turn: a 4 MiB event goes out in 16
# turns, and other streams (small events to other clients) write in between.
WRITE_SLICE = 256 * 1024


def frame(frames: list[bytes]) -> bytes:
    """The batch as gRPC messages: one byte string (immutable: `_grpclib.send_now`
    may hand views of it to the transport). A large message alone is framed once
    for every stream it goes to (`_LastFramed`)."""
    if len(frames) == 1 and len(frames[0]) >= FRAME_ONCE_BYTES:
        return _last_framed.of(frames[0])
    parts: list[bytes] = []
    for message in frames:
        parts += (_UNCOMPRESSED, len(message).to_bytes(4, "big"), message)
    return b"".join(parts)


# A message alone in its batch and at least this large is framed once for all
# the streams it goes to: a 700 KB rank table to 1,000 connections was copied
# per stream just to put five bytes in front of it.
FRAME_ONCE_BYTES = 64 * 1024


class _LastFramed:
    """The last large message framed, and its framing. Holding the message itself
    makes the identity check sound (its id cannot be reused meanwhile); it costs
    one large message and its copy until the next one."""

    __slots__ = ("_framed", "_message")

    def __init__(self) -> None:
        self._message: bytes | None = None
        self._framed = b""

    def of(self, message: bytes) -> bytes:
        if message is not self._message:
            self._framed = b"".join((_UNCOMPRESSED, len(message).to_bytes(4, "big"), message))
            self._message = message
        return self._framed


_last_framed = _LastFramed()


class StreamWriter:
    """Writes one server stream's batches through its connection's output."""

    __slots__ = ("_loop", "_output", "_send_timeout", "_sender", "_stream")

    def __init__(
        self,
        stream: Stream,
        output: ConnectionOutput,
        send_timeout: float,
        loop: trio_asyncio.TrioEventLoop,
    ) -> None:
        self._stream = stream
        self._output = output
        self._send_timeout = send_timeout
        # The loop grpclib runs on, named: `write` runs in whichever trio task the
        # session started, which need not know of the loop (`publish`'s does not).
        self._loop = loop
        # Made at the first `write_now` after the response headers went out.
        self._sender: _grpclib.DirectSender | None = None

    async def write(self, frames: list[bytes]) -> bool:
        """Write a batch; True when it all went out without waiting.

        Raises `SendTimedOut` when what had to wait did not go out within the
        send timeout (only then is a deadline set: none on the usual path).
        """
        headers_queued = False
        if not _grpclib.headers_sent(self._stream):
            headers_queued = await self._queue_headers()
        data = memoryview(frame(frames))
        if self._output.has_waiting:  # never overtake streams waiting their turn
            sent = 0
        elif len(data) <= WRITE_SLICE:  # the usual case: one slice, no checkpoint
            sent = self._queue_now(data)
        else:
            sent = await self._queue_slices(data)
        if sent == len(data):
            return True
        if headers_queued and not sent:
            # The first batch waits (a shut window, streams before it): the headers
            # go at the end of the turn, as grpc-go's would, not with that batch.
            self._output.schedule_flush()
        deadline = trio.current_time() + self._send_timeout
        if not await self._output.send_in_turn(
            self._stream, data[sent:], deadline=deadline, begun=sent > 0
        ):
            raise SendTimedOut
        return False

    async def _queue_headers(self) -> bool:
        """The response headers, once: queued into h2 to go out in one write with
        the first batch (True), or, when h2 cannot take them now, sent through
        grpclib, which waits for the socket (False)."""
        if _grpclib.queue_headers(self._stream):
            return True
        with trio.move_on_after(self._send_timeout) as waited:
            await self._loop.run_aio_coroutine(self._stream.send_initial_metadata())
        if waited.cancelled_caught:
            raise SendTimedOut
        return False

    def write_now(self, message: bytes) -> bool:
        """Send one message if HTTP/2 takes all of it now; otherwise send nothing
        and return False (the caller queues it for `write`).

        Safe to call from any trio task on the loop's thread (`publish` calls it
        for a parked subscriber): it never waits, and it never overtakes a
        stream waiting its turn on the connection.
        """
        output = self._output
        if output.has_waiting or len(message) + 5 > WRITE_SLICE:
            return False
        sender = self._sender
        if sender is None:
            sender = self._sender = _grpclib.DirectSender.of(self._stream)
            if sender is None:  # before the response headers: the task sends those
                return False
        frame = sender.frame_now(message)
        if frame is None:
            return False
        sender.write(frame, at_once=output.goes_now(alone=sender.alone))
        return True

    def give_up(self) -> None:
        """Do not finish a batch the client has part of: it fell behind, and the
        stream ends with the trailers after what it has."""
        self._output.give_up(self._stream)

    def _flush(self) -> None:
        """Write out what was queued, now or with the other streams' frames at the
        end of the loop turn (`ConnectionOutput.goes_now`)."""
        self._output.flush(alone=_grpclib.alone_on_connection(self._stream))

    def _queue_now(self, data: memoryview) -> int:
        """Queue what the stream's window takes of `data` into h2; the bytes queued."""
        queued = _grpclib.send_now(self._stream, data)
        if queued:
            self._flush()
        return queued

    async def _queue_slices(self, data: memoryview) -> int:
        """`_queue_now` one `WRITE_SLICE` per loop turn while the window takes them.

        Never waited for, so shielded: a stream cancelled between slices must
        not leave a truncated message behind.
        """
        sent = 0
        with trio.CancelScope(shield=True):
            while sent < len(data):
                if sent:
                    await trio.lowlevel.checkpoint()
                queued = self._queue_now(data[sent : sent + WRITE_SLICE])
                if not queued:
                    break
                sent += queued
        return sent
