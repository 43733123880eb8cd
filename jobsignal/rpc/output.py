"""Connections' output: writes coalesced per loop turn, waiting streams served in turn.

Every stream that writes in the same loop turn shares one system call (a
publish to many subscribers of one connection is one write); one callback at
the end of the turn (`TurnFlusher`) writes every connection that has output
due, so a publish to a thousand connections schedules one, not a thousand.
Streams that must wait for HTTP/2 flow control (the connection's window,
their own, or a socket the peer does not read) queue here and are served
round-robin, at most `QUANTUM` bytes each per round and `TURN_BUDGET` bytes
per loop turn, whenever the peer opens a window: a stream with a large
backlog cannot take the whole window while its neighbours wait, and none
waits behind another's whole message. The waiting needs no asyncio: it is a
trio Event set from the protocol's event handling, which runs on the same
thread.

It holds grpclib's Connection, not the protocol, so finished streams that
still reference it keep no protocol alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpclib.server
import trio
from grpclib.exceptions import StreamTerminatedError
from grpclib.protocol import Connection

from jobsignal.logs import RateLimitedLog
from jobsignal.rpc import _grpclib
from jobsignal.util.fifo import Fifo

log = logging.getLogger(__name__)
_faults = RateLimitedLog(log)

Stream = grpclib.server.Stream[Any, Any]

# Bytes a waiting stream gets per round: one default-sized DATA frame.
QUANTUM = 16 * 1024
# Bytes all waiting streams of one connection get per loop turn.
TURN_BUDGET = 256 * 1024


@dataclass(eq=False)
class _Waiting:
    stream: Stream
    data: memoryview
    sent: int = 0
    closed: bool = False
    done: trio.Event = field(default_factory=trio.Event)
    # Finishing a begun batch for a stream that is ending, and whether not to.
    finishing: trio.CancelScope | None = None
    given_up: bool = False


class TurnFlusher:
    """Writes the output due on any connection at the end of the loop turn, in one
    callback (a callback per connection and turn cost more than the h2 framing).

    It also numbers the turns in which anything was written (`turn`), so a
    connection can tell its first write of a turn, which goes out at once,
    from later ones, which wait for the end of the turn (`goes_now`),
    without a flush of nothing at the end of every turn it wrote in.
    """

    __slots__ = ("_due", "_scheduled", "turn")

    def __init__(self) -> None:
        self._due: list[ConnectionOutput] = []
        self._scheduled = False
        self.turn = 0

    def due(self, output: ConnectionOutput, loop: asyncio.AbstractEventLoop) -> None:
        self._due.append(output)
        self.end_turn_later(loop)

    def end_turn_later(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make sure this turn ends: its number moves on, what is due is written."""
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush_all)

    def _flush_all(self) -> None:
        self._scheduled = False
        self.turn += 1
        due, self._due = self._due, []
        _flush_each([output.flush_due for output in due])


# How late a PING ACK may go out when no other write on its connection takes it
# first (`LateFlusher`).
ACK_DELAY = 0.02


class LateFlusher:
    """Writes the frames connections owe but need not hurry, PING ACKs, at most
    `ACK_DELAY` seconds late, in one timer for every connection.

    A client that reads a stream answers each message with a PING (grpc-go's
    bandwidth estimate); written at once, its ACK costs a system call per
    message beside the message's own. Left in h2's output, it goes out with the
    connection's next write (the next message, typically), or at the latest
    when this timer fires. RFC 9113 asks that PING ACKs go before other frames,
    which they do (h2's output keeps its order), not that they go at once; a
    client's round-trip figure grows by at most `ACK_DELAY`.
    """

    __slots__ = ("_due", "_timer")

    def __init__(self) -> None:
        self._due: list[ConnectionOutput] = []
        self._timer: asyncio.TimerHandle | None = None

    def due(self, output: ConnectionOutput, loop: asyncio.AbstractEventLoop) -> None:
        self._due.append(output)
        if self._timer is None:
            self._timer = loop.call_later(ACK_DELAY, self._flush_all)

    def _flush_all(self) -> None:
        self._timer = None
        due, self._due = self._due, []
        _flush_each([output.flush_late_due for output in due])


def _flush_each(flushes: list[Callable[[], None]]) -> None:
    for flush in flushes:
        try:
            flush()
        except Exception:  # one connection's failure must not keep the others' output
            _faults.error("flush", "writing a connection's output failed", exc_info=True)


class ConnectionOutput:
    __slots__ = (
        "_connection",
        "_flush_scheduled",
        "_flusher",
        "_late_flusher",
        "_late_scheduled",
        "_loop",
        "_pump_scheduled",
        "_waiting",
        "_written_in_turn",
    )

    def __init__(
        self, connection: Connection, flusher: TurnFlusher, late_flusher: LateFlusher
    ) -> None:
        self._connection = connection
        self._flusher = flusher
        self._late_flusher = late_flusher
        self._late_scheduled = False
        # Held, not looked up: writes also come from trio tasks outside any asyncio context.
        self._loop = asyncio.get_running_loop()
        self._flush_scheduled = False
        # The flusher's turn of this connection's last immediate write.
        self._written_in_turn = -1
        self._pump_scheduled = False
        # Not a deque: one costs 760 bytes on every idle connection.
        self._waiting: Fifo[_Waiting] = Fifo()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The connection's event loop, for callbacks from code outside asyncio's context."""
        return self._loop

    @property
    def has_waiting(self) -> bool:
        """Streams are waiting their turn: a new write must queue behind them."""
        return bool(self._waiting)

    def schedule_flush(self) -> None:
        """Write the connection's queued frames at the end of this loop turn."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._flusher.due(self, self._loop)

    def flush_late(self) -> None:
        """Write the connection's queued frames with its next write, or `ACK_DELAY`
        from now at the latest (`LateFlusher`)."""
        if not self._late_scheduled:
            self._late_scheduled = True
            self._late_flusher.due(self, self._loop)

    def goes_now(self, *, alone: bool) -> bool:
        """The rule for output a stream just queued: at once (True: the caller
        writes it) when the stream is alone on its connection (nothing to share
        the system call with, and the client waits for it) and this is the
        connection's first write of the loop turn; else at the end of the turn
        (scheduled here), so a burst still costs at most two system calls."""
        if alone and self._first_write_of_turn():
            return True
        self.schedule_flush()
        return False

    def flush(self, *, alone: bool) -> None:
        """Write the connection's queued frames now or at the end of the turn, by
        the `goes_now` rule."""
        if self.goes_now(alone=alone):
            self._flush_now()

    def _first_write_of_turn(self) -> bool:
        flusher = self._flusher
        if self._flush_scheduled or self._written_in_turn == flusher.turn:
            return False
        self._written_in_turn = flusher.turn
        flusher.end_turn_later(self._loop)
        return True

    def _flush_now(self) -> None:
        if not self._connection.is_closing():
            self._connection.flush()

    def flush_due(self) -> None:
        """The end of the turn (`TurnFlusher`): write what was queued since."""
        self._flush_scheduled = False
        self._flush_now()

    def flush_late_due(self) -> None:
        """The end of the late frames' wait (`LateFlusher`): write what is still queued
        (nothing, when a write since took it)."""
        self._late_scheduled = False
        self._flush_now()

    async def send_in_turn(
        self, stream: Stream, data: memoryview, *, deadline: float, begun: bool
    ) -> bool:
        """Send `data` on `stream`, taking turns with the connection's other waiting
        streams; False if `deadline` (trio's clock) passed first.

        Cancelled (the stream is ending: replaced, shut down), it gives up the
        data only if none of its batch has gone out (`begun`: bytes before
        `data` did) or `give_up` said so. Otherwise it finishes the batch first,
        up to `deadline`, then raises: trailers right after part of a message
        would turn the stream's status into grpc-go's INTERNAL "unexpected EOF".
        """
        entry = _Waiting(stream, data)
        self._waiting.append(entry)
        self.pump()
        try:
            with trio.move_on_at(deadline):
                await entry.done.wait()
        except trio.Cancelled:
            if (begun or entry.sent) and not entry.given_up:
                with trio.CancelScope(deadline=deadline, shield=True) as entry.finishing:
                    await entry.done.wait()
            raise
        finally:
            if not entry.done.is_set():
                with contextlib.suppress(ValueError):
                    self._waiting.remove(entry)
        if entry.closed:
            raise StreamTerminatedError("the stream closed while its data waited")
        return entry.done.is_set()

    def give_up(self, stream: Stream) -> None:
        """Let `stream`'s waiting batch go unfinished when the stream ends."""
        for entry in self._waiting:
            if entry.stream is stream:
                entry.given_up = True
                if entry.finishing is not None:
                    entry.finishing.cancel()

    def release_closed(self) -> None:
        """Wake the waiting streams that closed (reset by the peer, or the connection
        lost): their data will never go, and nothing else would tell them."""
        for entry in [entry for entry in self._waiting if _grpclib.stream_closed(entry.stream)]:
            self._waiting.remove(entry)
            entry.closed = True
            entry.done.set()

    def pump(self) -> None:
        """Serve the waiting streams round-robin while HTTP/2 lets data go.

        Called when a stream starts waiting and whenever the peer may have
        opened a window (WINDOW_UPDATE, SETTINGS, a socket writable again).
        """
        budget = TURN_BUDGET
        stalled = 0  # consecutive streams that could send nothing
        while self._waiting and stalled < len(self._waiting) and budget > 0:
            if not _grpclib.connection_can_send(self._connection):
                # The shared window is shut (or the socket full): no stream can
                # send, so asking each of them (dozens per connection) is waste.
                break
            entry = self._waiting.popleft()
            if _grpclib.stream_closed(entry.stream):
                entry.closed = True
                entry.done.set()
                continue
            end = entry.sent + min(QUANTUM, budget)
            queued = _grpclib.send_now(entry.stream, entry.data[entry.sent : end])
            if queued:
                stalled = 0
                budget -= queued
                entry.sent += queued
                if entry.sent == len(entry.data):
                    entry.done.set()
                    continue
            else:
                stalled += 1
            self._waiting.append(entry)
        if budget < TURN_BUDGET:
            self.schedule_flush()
        if budget <= 0 and self._waiting and not self._pump_scheduled:
            # The rest next turn: other connections and tasks get the loop first.
            self._pump_scheduled = True
            self._loop.call_soon(self._pump_again)

    def _pump_again(self) -> None:
        self._pump_scheduled = False
        self.pump()
