"""Fan-out in slices: one publish to many subscribers goes out over several loop turns.

`publish` hands each message straight to every parked subscriber's stream
(docs/architecture.md section 6). For a thousand subscribers that is one long
step (17 ms on a slow machine) in which the loop reads nothing: the clients'
WINDOW_UPDATEs and PINGs wait behind it, so a connection whose HTTP/2 window
is small gets one window per publish while one with a large window takes
every message, and once the server is overloaded the first kind falls ever
further behind (grpc-go only grows a window when the round trip is short).
`FanOutPacer` makes at most about `SLICE_DELIVERIES` deliveries per loop
turn, a connection's subscribers together (their messages share one system
call), and the rest from its own task in the turns that follow, with the
loop's input handled in between. Events go out in publish order: one
published while an earlier one is still going out waits behind it, and one
that waits replaces an older waiting event of the same job that has reached
nobody yet (every message carries its job's whole state, so the newest is
enough: docs/architecture.md section 6). So a publisher faster than the
fan-out costs at most one waiting event per job, not a growing backlog.

Without its task running (a broadcaster used by hand), every event goes out
at once, as before. Subscribers' own queues keep bounding each one's backlog;
the pacer itself holds at most `max_pending` events, and delivers the oldest
at once, queued rather than sent directly, when it would hold more.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import trio

from jobsignal.fanout.stats import FanoutStats
from jobsignal.fanout.subscriber import UNIQUE, QueueEntry, Subscriber
from jobsignal.logs import RateLimitedLog
from jobsignal.util.fifo import Fifo

log = logging.getLogger(__name__)
_faults = RateLimitedLog(log)

# Deliveries (subscribers times the events going out together) per loop turn,
# rounded up to a whole connection: about 1 to 2.5 ms, so one event to a hundred
# subscribers (issue 10's end-to-end case) still goes out in the publish itself.
SLICE_DELIVERIES = 128

#: Subscribers grouped by connection, in the order they are served.
Groups = Sequence[Sequence[Subscriber]]


@dataclass(slots=True)
class _FanOut:
    """One event still going out: the groups it has not reached yet start at `next_group`."""

    entry: QueueEntry
    direct: bool
    groups: Groups
    next_group: int = 0
    superseded: bool = False


class FanOutPacer:
    """Delivers events to subscribers a slice per loop turn, in publish order."""

    __slots__ = (
        "_max_pending",
        "_pending",
        "_running",
        "_stats",
        "_unstarted",
        "_wakeup",
        "slice_deliveries",
    )

    def __init__(
        self,
        stats: FanoutStats,
        *,
        max_pending: int,
        slice_deliveries: int = SLICE_DELIVERIES,
    ) -> None:
        self._stats = stats
        self._max_pending = max_pending
        self.slice_deliveries = slice_deliveries
        self._pending: Fifo[_FanOut] = Fifo()
        # Waiting events that have reached nobody yet, by job key and subscriber
        # groups (the broadcaster's groups object, the same while nobody subscribes or leaves).
        self._unstarted: dict[tuple[Hashable, int], _FanOut] = {}
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
        fan_out = _FanOut(entry, direct, groups)
        if not self._running:
            _push([fan_out], groups, 0, len(groups))
            return
        if not self._pending:
            self._pending.append(fan_out)
            self._slice()
        else:
            self._wait(fan_out)
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
            self._unstarted.clear()
            while self._pending:
                self._finish_now(self._pending.popleft(), direct=None)

    def _wait(self, fan_out: _FanOut) -> None:
        """Queue `fan_out` behind the events still going out, in place of an older
        waiting one of its job."""
        key = _replacement_key(fan_out)
        if key is not None:
            older = self._unstarted.get(key)
            if older is not None:
                older.superseded = True
                fan_out.direct |= older.direct
                self._stats.coalesced += sum(len(group) for group in older.groups)
            self._unstarted[key] = fan_out
        self._pending.append(fan_out)
        if len(self._pending) > self._max_pending:
            # Still too many (that many jobs changing at once): the oldest goes
            # into the subscribers' bounded, coalescing queues now.
            oldest = self._pending.popleft()
            self._started(oldest)
            self._finish_now(oldest, direct=False)

    def _finish_now(self, fan_out: _FanOut, *, direct: bool | None) -> None:
        """Hand `fan_out` to every subscriber it has not reached yet, now (`direct`:
        whether to offer it to their sinks; None: as published), unless replaced."""
        if fan_out.superseded:
            return
        if direct is not None:
            fan_out.direct = direct
        self._guarded([fan_out], fan_out.groups, fan_out.next_group, len(fan_out.groups))

    def _started(self, fan_out: _FanOut) -> None:
        """`fan_out` reaches someone now: nothing may replace it any more."""
        key = _replacement_key(fan_out) if fan_out.next_group == 0 else None
        if key is not None and self._unstarted.get(key) is fan_out:
            del self._unstarted[key]

    def _slice(self) -> None:
        """About `slice_deliveries` deliveries, whole groups, from the oldest event
        on; the events waiting behind it that have reached the same subscribers
        go with it (a subscriber's messages of one turn share its writes, as when
        `publish` sent them all at once)."""
        budget = self.slice_deliveries
        pending = self._pending
        while True:
            while pending and (pending[0].superseded or _reached_all(pending[0])):
                pending.popleft()
            if not pending or budget <= 0:
                return
            head = pending[0]
            groups, start = head.groups, head.next_group
            batch: list[_FanOut] = []
            for later in pending:
                if later.groups is not groups or later.next_group != start:
                    break
                if not later.superseded:
                    batch.append(later)
            end = start
            while end < len(groups) and budget > 0:
                budget -= len(groups[end]) * len(batch)
                end += 1
            for fan_out in batch:
                self._started(fan_out)
                fan_out.next_group = end
            self._guarded(batch, groups, start, end)

    def _guarded(self, batch: list[_FanOut], groups: Groups, start: int, end: int) -> None:
        # A fault boundary, as the publish loop is: a bug in one delivery costs
        # these events for the rest of these groups, never the pacer's task.
        try:
            _push(batch, groups, start, end)
        except Exception:
            self._stats.events_dropped["fan_out"] += len(batch)
            _faults.error("fan_out", "delivering a job event failed", exc_info=True)


def _replacement_key(fan_out: _FanOut) -> tuple[Hashable, int] | None:
    """What a later event of the same job, for the same subscribers, is found by
    (None: an entry of no job, which nothing replaces)."""
    job = fan_out.entry[0]
    return None if job is UNIQUE else (job, id(fan_out.groups))


def _reached_all(fan_out: _FanOut) -> bool:
    return fan_out.next_group == len(fan_out.groups)


def _push(batch: list[_FanOut], groups: Groups, start: int, end: int) -> None:
    for index in range(start, end):
        for subscriber in groups[index]:
            for fan_out in batch:
                subscriber.push_entry(fan_out.entry, direct=fan_out.direct)
