"""Fan-out in slices: one publish to many subscribers goes out over several loop turns.

`publish` hands each message straight to every parked subscriber's stream
(docs/architecture.md section 6). For a thousand subscribers that is one long
step (17 ms on a slow machine) in which the loop reads nothing: the clients'
WINDOW_UPDATEs and PINGs wait behind it, so a connection whose HTTP/2 window
is small gets one window per publish while one with a large window takes
every message, and once the server is overloaded the first kind falls ever
further behind (grpc-go only grows a window when the round trip is short).
`FanOutPacer` delivers one event to at most `SLICE_SUBSCRIBERS` subscribers
per loop turn, a connection's subscribers together (their messages share one
system call), and the rest from its own task in the turns that follow, with
the loop's input handled in between. Events go out in publish order: one
published while an earlier one is still going out waits behind it.

Without its task running (a broadcaster used by hand), every event goes out
at once, as before. Subscribers' own queues keep bounding each one's backlog;
the pacer itself holds at most `max_pending` events, and delivers the oldest
at once, queued rather than sent directly, when it would hold more.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from jobsignal.fanout.stats import FanoutStats
from jobsignal.fanout.subscriber import QueueEntry, Subscriber
from jobsignal.fifo import Fifo
from jobsignal.logs import RateLimitedLog

log = logging.getLogger(__name__)
_faults = RateLimitedLog(log)

# Subscribers one event reaches per loop turn (rounded up to a whole
# connection): about 1 to 2.5 ms of deliveries, so a fan-out to a hundred
# subscribers (issue 10's end-to-end case) still goes out in the publish itself.
SLICE_SUBSCRIBERS = 128

#: Subscribers grouped by connection, in the order they are served.
Groups = Sequence[Sequence[Subscriber]]


@dataclass(slots=True)
class _FanOut:
    """One event still going out: the groups it has not reached yet start at `next_group`."""

    entry: QueueEntry
    direct: bool
    groups: Groups
    next_group: int = 0


class FanOutPacer:
    """Delivers events to subscribers a slice per loop turn, in publish order."""

    __slots__ = ("_max_pending", "_pending", "_running", "_stats", "_wakeup", "slice_subscribers")

    def __init__(
        self,
        stats: FanoutStats,
        *,
        max_pending: int,
        slice_subscribers: int = SLICE_SUBSCRIBERS,
    ) -> None:
        self._stats = stats
        self._max_pending = max_pending
        self.slice_subscribers = slice_subscribers
        self._pending: Fifo[_FanOut] = Fifo()
        self._running = False
        self._wakeup: trio.Event | None = None

    @property
    def pending_events(self) -> int:
        """Events not yet handed to every subscriber."""
        return len(self._pending)

    def deliver(self, entry: QueueEntry, groups: Groups, *, direct: bool) -> None:
        """Hand `entry` to every subscriber of `groups` (each `push_entry(entry,
        direct=direct)`): the first slice now, unless earlier events are still
        going out, the rest from `run`."""
        if not self._running:
            _push(entry, direct, groups, 0, len(groups))
            return
        waiting = bool(self._pending)
        self._pending.append(_FanOut(entry, direct, groups))
        if len(self._pending) > self._max_pending:
            # Overloaded: the oldest goes into the subscribers' bounded queues now.
            oldest = self._pending.popleft()
            self._guarded(oldest.entry, False, oldest.groups, oldest.next_group, None)
        if not waiting:
            self._slice()
        if self._pending and self._wakeup is not None:
            self._wakeup.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Deliver the rest of every event, a slice per loop turn; until cancelled.
        What is still pending when it stops goes out at once."""
        self._running = True
        task_status.started()
        try:
            while True:
                if not self._pending:
                    self._wakeup = trio.Event()
                    await self._wakeup.wait()
                    self._wakeup = None
                # Let the loop read and write (the clients' window updates) first.
                await trio.lowlevel.checkpoint()
                self._slice()
        finally:
            self._running = False
            while self._pending:
                rest = self._pending.popleft()
                self._guarded(rest.entry, rest.direct, rest.groups, rest.next_group, None)

    def _slice(self) -> None:
        """About `slice_subscribers` deliveries, whole groups, from the oldest event on."""
        budget = self.slice_subscribers
        pending = self._pending
        while pending and budget > 0:
            fan_out = pending[0]
            groups, start = fan_out.groups, fan_out.next_group
            end = start
            while end < len(groups) and budget > 0:
                budget -= len(groups[end])
                end += 1
            fan_out.next_group = end
            if end == len(groups):
                pending.popleft()
            self._guarded(fan_out.entry, fan_out.direct, groups, start, end)

    def _guarded(
        self,
        entry: QueueEntry,
        direct: bool,
        groups: Groups,
        start: int,
        end: int | None,
    ) -> None:
        # A fault boundary, as the publish loop is: a bug in one delivery costs
        # this event for the rest of these groups, never the pacer's task.
        try:
            _push(entry, direct, groups, start, len(groups) if end is None else end)
        except Exception:
            self._stats.events_dropped["fan_out"] += 1
            _faults.error("fan_out", "delivering a job event failed", exc_info=True)


def _push(entry: QueueEntry, direct: bool, groups: Groups, start: int, end: int) -> None:
    for index in range(start, end):
        for subscriber in groups[index]:
            subscriber.push_entry(entry, direct=direct)
