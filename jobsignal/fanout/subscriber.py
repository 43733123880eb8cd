"""One subscriber's bounded, coalescing queue: encoded messages for a gRPC
stream (`Subscriber`), job events for an in-process consumer (`EventQueue`).

The broadcaster pushes without ever waiting; the subscriber's task drains in
batches. While that task is parked on an empty queue, a push is first offered
to the consumer's direct sink (`deliver_directly`): a gRPC stream whose
HTTP/2 window is open takes the message there and then, from `publish`, and
no task is woken for it (docs/architecture.md section 6).

When a consumer falls behind (a live backlog of more than `COALESCE_ABOVE`
entries, or the hard bounds), queued messages of the same job are coalesced
(every message carries the whole state of its job, so the newest one is
enough). A consumer still too far behind after coalescing is ended with
`EndReason.SLOW` and its queue dropped at once, so one stuck consumer can never
hold memory or delay anyone else. Both kinds share that policy (`BoundedQueue`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Hashable, Sized
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

from jobsignal.fanout.stats import FanoutStats
from jobsignal.logs import RateLimitedLog
from jobsignal.store.model import JobSummary
from jobsignal.util.fifo import Fifo

log = logging.getLogger(__name__)
_faults = RateLimitedLog(log)


class StreamKind(enum.Enum):
    SIGNAL = "SubscribeJobSummarySignal"
    LIST = "SubscribeJobSummarySignalList"


class EndReason(enum.Enum):
    """Why a subscription stream ended, as `FanoutStats.stream_ends` counts it.

    The first five are the server's: set on the subscriber (`Subscriber.end`),
    turned into a gRPC status by `rpc`. The last two it does not choose: a
    stream refused before it subscribed, and a client that went away.
    """

    IDLE = "idle"
    SLOW = "slow"
    REPLACED = "replaced"
    SHUTDOWN = "shutdown"
    MAX_AGE = "max_age"  # its connection's maximum age and grace ran out
    REFUSED = "refused"
    CLIENT_GONE = "client_gone"


# Snapshot batches are never coalesced: each carries different jobs.
UNIQUE: Hashable = None

# A live backlog longer than this is coalesced (the newest state of each job
# wins) long before the hard bound: a consumer a little behind then gets its
# jobs' newest states next instead of working through stale ones first. The
# next time is at twice what coalescing left, so a backlog of distinct jobs
# costs O(1) per push.
COALESCE_ABOVE = 64

#: What a queue holds; its `len()` is what it charges against the byte bound.
P = TypeVar("P", bound=Sized)

# (job key, encoded message, trio time the source saw the event or None)
QueueEntry = tuple[Hashable, bytes, float | None]

#: Takes an entry now, without waiting, and says so (True), or takes nothing (False).
DirectSink = Callable[[tuple[Hashable, P, float | None]], bool]

#: Makes the snapshot a new consumer is owed, in its task (fanout/snapshot.py);
#: called again after a cancellation, it goes on where it stopped.
ComposeSnapshot = Callable[[], Awaitable[list[tuple[Hashable, P, float | None]]]]


class BoundedQueue(Generic[P]):
    """The slow-consumer policy: bounded, coalesced per job, ended when hopeless."""

    __slots__ = (
        "_cancel_scope",
        "_coalesce_above",
        "_compose_owed",
        "_direct",
        "_max_pending",
        "_max_pending_bytes",
        "_more_waiters",
        "_on_wake",
        "_owed",
        "_owed_bytes",
        "_owed_later",
        "_parked",
        "_pending",
        "_pending_bytes",
        "_stats",
        "_waiter",
        "coalesced",
        "end_reason",
        "last_taken",
    )

    def __init__(self, *, max_pending: int, max_pending_bytes: int, stats: FanoutStats) -> None:
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._stats = stats
        # Not a deque: one costs 760 bytes, and most subscribers' queues are empty.
        self._pending: Fifo[tuple[Hashable, P, float | None]] = Fifo()
        self._pending_bytes = 0
        # The snapshot this subscriber is owed sits at the front of its queue and
        # does not count against the limits: only a live backlog on top of it does.
        self._owed = 0
        self._owed_bytes = 0
        # A snapshot not composed yet (`owe`): its entries, once made, go in front
        # of whatever was pushed meanwhile.
        self._compose_owed: ComposeSnapshot[P] | None = None
        self._owed_later = 0
        self._coalesce_above = COALESCE_ABOVE
        # The consumer's task while it waits for entries, rescheduled by the next
        # push: no trio Event per queue (and per wake-up). Others that wait at the
        # same time (an embedder's tasks sharing one JobEvents) wait in a list
        # made only for them.
        self._waiter: trio.lowlevel.Task | None = None
        self._more_waiters: list[trio.lowlevel.Task] | None = None
        # Or, for a consumer with no task while its queue is empty (a gRPC
        # stream's session), what starts one: called on every wake-up.
        self._on_wake: Callable[[], None] | None = None
        # The consumer waits in `next_batch_timed` on an empty queue: nothing it
        # took is still on its way out, so a direct delivery keeps the order.
        self._parked = False
        self._direct: DirectSink[P] | None = None
        self._cancel_scope: trio.CancelScope | None = None
        self.end_reason: EndReason | None = None
        self.coalesced = 0
        # The job key of the last entry `take` returned (UNIQUE: a snapshot batch),
        # for the operator's view of what a stream last sent (rpc.subscriptions).
        self.last_taken: Hashable = UNIQUE

    @property
    def pending(self) -> int:
        """Entries queued, and those of a snapshot still to be composed (one
        per job it holds until then; a List snapshot's batches are fewer)."""
        return len(self._pending) + self._owed_later

    @property
    def owes_snapshot(self) -> bool:
        """A snapshot is owed and not composed yet (`compose_snapshot`)."""
        return self._compose_owed is not None

    @property
    def sending_snapshot(self) -> bool:
        """A snapshot is owed, or composed and not all taken yet."""
        return self._compose_owed is not None or self._owed > 0

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def push(self, key: Hashable, frame: P, seen_at: float | None = None) -> None:
        """Queue one encoded message; `key` names the job it describes."""
        self.push_entry((key, frame, seen_at))

    def push_entry(self, entry: tuple[Hashable, P, float | None], *, direct: bool = True) -> None:
        """Queue a (job key, message, seen_at) entry, or with `direct` first offer it
        to the sink of a parked consumer. The broadcaster builds one entry per
        event and shares it between all queues: no allocation per push."""
        if self.end_reason is not None:
            return
        sink = self._direct if direct and self._parked else None
        if sink is not None and self._offer(sink, entry):
            return
        self._pending.append(entry)
        self._pending_bytes += len(entry[1])
        if self._over_limits() or self._backlog() > self._coalesce_above:
            self._coalesce()
            if self._over_limits(after_coalescing=True):
                self.end(EndReason.SLOW)
                return
            self._coalesce_above = max(COALESCE_ABOVE, 2 * self._backlog())
        self._parked = False  # the consumer is woken: what follows queues behind this
        self._wake()

    def deliver_directly(self, sink: DirectSink[P]) -> None:
        """Offer each push made while the consumer is parked to `sink` first;
        what it does not take is queued as usual."""
        self._direct = sink

    def _offer(self, sink: DirectSink[P], entry: tuple[Hashable, P, float | None]) -> bool:
        # A fault boundary: a failing sink costs its own subscriber the fast path
        # for this message (it is queued instead), never the rest of the publish.
        try:
            return sink(entry)
        except Exception:
            _faults.error("direct_delivery", "direct delivery failed; queued", exc_info=True)
            return False

    def owe(self, compose: ComposeSnapshot[P], jobs: int) -> None:
        """A new consumer is owed a snapshot of `jobs` jobs, which `compose` makes:
        in the consumer's own task, before anything else it takes
        (`compose_snapshot`), not in the step that subscribed it."""
        self._compose_owed = compose
        self._owed_later = jobs
        self._parked = False  # pushes queue behind the snapshot

    async def compose_snapshot(self) -> None:
        """Make the owed snapshot, if any, and queue it in front of what was pushed
        meanwhile, whatever its size: it is the state the consumer asked for, not
        a backlog (live events that follow may still coalesce with it). Called by
        the consumer's task; it checkpoints between slices."""
        compose = self._compose_owed
        if compose is None:
            return
        entries = await compose()
        self._compose_owed = None
        self._owed_later = 0
        if self.end_reason is not None:
            return
        live = self._pending
        self._pending = Fifo(entries)
        self._pending.extend(live)
        self._pending_bytes += sum(len(entry[1]) for entry in entries)
        self._owed = len(entries)
        self._owed_bytes = sum(len(entry[1]) for entry in entries)

    def _backlog(self) -> int:
        """Live entries queued: those on top of the owed snapshot."""
        return len(self._pending) - self._owed

    def _over_limits(self, *, after_coalescing: bool = False) -> bool:
        backlog = self._backlog()
        backlog_bytes = self._pending_bytes - self._owed_bytes
        if backlog > self._max_pending:
            return True
        # One message alone may exceed the byte limit; after coalescing it is let through.
        return backlog_bytes > self._max_pending_bytes and not (after_coalescing and backlog <= 1)

    def _coalesce(self) -> None:
        newest: dict[Hashable, int] = {}
        for position, (key, _, _) in enumerate(self._pending):
            if key is not UNIQUE:
                newest[key] = position
        kept: Fifo[tuple[Hashable, P, float | None]] = Fifo()
        owed = owed_bytes = 0
        for position, entry in enumerate(self._pending):
            if entry[0] is UNIQUE or newest[entry[0]] == position:
                kept.append(entry)
                if position < self._owed:
                    owed += 1
                    owed_bytes += len(entry[1])
        self._owed, self._owed_bytes = owed, owed_bytes
        dropped = len(self._pending) - len(kept)
        self.coalesced += dropped
        self._stats.coalesced += dropped
        self._pending = kept
        self._pending_bytes = sum(len(entry[1]) for entry in kept)

    async def next_batch(self, max_frames: int) -> list[P]:
        """Wait for at least one message; return up to `max_frames` in order."""
        return (await self.next_batch_timed(max_frames))[0]

    async def next_batch_or_end(self, max_frames: int) -> list[P]:
        """Like `next_batch`, but an empty list once the queue has ended (for a
        consumer with no cancel scope attached)."""
        await self.compose_snapshot()
        while not self._pending:
            if self.end_reason is not None:
                return []
            await self._wait()
        return await self.next_batch(max_frames)

    async def next_batch_timed(self, max_frames: int) -> tuple[list[P], list[float]]:
        """Like `next_batch`, plus when the watcher saw each live event (for latency)."""
        await self.compose_snapshot()
        while not self._pending:
            self._parked = True
            try:
                await self._wait()
            finally:
                self._parked = False
        return self.take(max_frames)

    def take(self, max_frames: int) -> tuple[list[P], list[float]]:
        """Up to `max_frames` queued messages, in order, and when the watcher saw
        each live one; nothing if the queue is empty. For a consumer that waits
        by other means (`on_wake`), once its snapshot is composed."""
        entries = self._pending.take(max_frames)
        if entries:
            self.last_taken = entries[-1][0]
        frames = [frame for _, frame, _ in entries]
        seen = [seen_at for _, _, seen_at in entries if seen_at is not None]
        self._pending_bytes -= sum(len(frame) for frame in frames)
        if self._owed:
            delivered_owed = frames[: self._owed]
            self._owed -= len(delivered_owed)
            self._owed_bytes -= sum(len(frame) for frame in delivered_owed)
        if not self._pending:
            self._coalesce_above = COALESCE_ABOVE
        return frames, seen

    async def _wait(self) -> None:
        """Until the next `_wake` (or a cancellation)."""
        task = trio.lowlevel.current_task()
        if self._waiter is None:
            self._waiter = task
            await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
            return
        if self._more_waiters is None:
            self._more_waiters = []
        more = self._more_waiters
        more.append(task)

        def abort(_: object) -> trio.lowlevel.Abort:
            more.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def _abort_wait(self, _: object) -> trio.lowlevel.Abort:
        # The waiter in the slot is cancelled (trio calls this from the task that
        # cancels it, so it names no task). A method, not a closure: a parked
        # subscriber holds less.
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def on_wake(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever a waiting consumer would be woken: an entry
        queued, or the end. A consumer that holds no task while the queue is
        empty (`take`, then `park`) starts one there."""
        self._on_wake = callback

    def park(self) -> None:
        """The consumer took everything and waits without a task (`on_wake`):
        pushes go to its direct sink first, as while a task waits in
        `next_batch_timed`."""
        self._parked = True

    def _wake(self) -> None:
        """Wake every task waiting in `_wait`; each looks at the queue again."""
        if self._on_wake is not None:
            self._on_wake()
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            trio.lowlevel.reschedule(waiter)
        if self._more_waiters is not None:
            more, self._more_waiters = self._more_waiters, None
            for task in more:
                trio.lowlevel.reschedule(task)

    def attach(self, cancel_scope: trio.CancelScope | None) -> None:
        """The consumer task's scope, which `end()` cancels (None: no task now)."""
        self._cancel_scope = cancel_scope
        if cancel_scope is not None and self.end_reason is not None:
            cancel_scope.cancel()

    def end(self, reason: EndReason) -> None:
        """End this subscription (first reason wins) and free its queue now."""
        if self.end_reason is None:
            self.end_reason = reason
        self._direct = None
        self._compose_owed = None
        self._pending.clear()
        self._pending_bytes = self._owed = self._owed_bytes = self._owed_later = 0
        self._wake()  # a consumer waiting in next_batch_or_end learns of it
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()


class Subscriber(BoundedQueue[bytes]):
    """The queue of one gRPC subscription stream: encoded messages."""

    __slots__ = ("client_id", "group", "kind", "role", "up")

    def __init__(
        self,
        kind: StreamKind,
        role: str,
        client_id: str,
        *,
        max_pending: int,
        max_pending_bytes: int,
        stats: FanoutStats,
        group: Hashable = None,
    ) -> None:
        super().__init__(max_pending=max_pending, max_pending_bytes=max_pending_bytes, stats=stats)
        self.kind = kind
        self.role = role
        self.client_id = client_id
        # What it shares its writes with (its connection; None: nothing), so a
        # fan-out serves the subscribers of one group together (fanout/pacing.py).
        self.group = group
        # Reported up (`jobsignal_subscribers`): set by the stream's session once
        # the snapshot it was owed, if any, is written (rpc/session.py).
        self.up = False


#: What an in-process event costs a queue beyond its rank table: the other
#: fields and the objects around them, roughly.
EVENT_OVERHEAD_BYTES = 512


@dataclass(frozen=True, slots=True)
class QueuedEvent:
    """One job event on its way to in-process consumers, shared by their queues."""

    job: JobSummary
    uuid: str

    def __len__(self) -> int:
        return len(self.job.hccl_json) + EVENT_OVERHEAD_BYTES


class EventQueue(BoundedQueue[QueuedEvent]):
    """The queue of one in-process consumer: the same policy as a gRPC
    stream's (docs/architecture.md section 6), job events instead of bytes."""

    __slots__ = ()
