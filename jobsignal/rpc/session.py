"""Subscription streams: the idle rule and the send loop, with no task while idle.

A stream's `Session` holds a trio task only while it has messages to write:
one is started when its queue is woken (an entry queued, or the end) and
returns once the queue is empty. An idle stream is then its objects and
nothing else, no coroutine frames and no cancel scope; a message for it
goes out from `publish` itself when HTTP/2 takes it at once
(`Subscriber.deliver_directly`). Every stream's idle deadline is watched by
the one task of `Sessions`: every message written and every heartbeat on
its connection records activity, and a deadline that comes with activity
since is set again from the last, so a stream closes exactly `idle_timeout`
after its last message or heartbeat, in virtual time too. Other ways a
stream ends (replaced, too slow, the client gone, server shutdown) end the
subscriber, whose wake-up runs the session's task to its clean-up. How the
stream ended is handed to the side that opened it (`done`) as a value, so
the gRPC status is decided outside any nursery (docs/architecture.md
section 8, "The grpclib adapter and why it exists").

Nothing here moves a trio deadline per message: activity only stores the
time, and the send timeout is applied by the sender only when a batch has
to wait (a deadline per batch cost more than the rest of the send loop).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import trio
from grpclib.const import Status

from jobsignal.config import LayerSettings, from_setting
from jobsignal.fanout import Broadcaster, EndReason, StreamKind
from jobsignal.fanout.subscriber import UNIQUE, QueueEntry
from jobsignal.rpc.activity import ConnectionActivity
from jobsignal.rpc.registry import Claim, Refused, Registry
from jobsignal.util.text import clip

log = logging.getLogger(__name__)

# Messages written per batch: large enough to amortise a write, small enough
# that one batch never hogs the loop.
MAX_BATCH = 256
# Snapshots composed and written at once. Each is a burst of messages (one per
# job, or a List's batches); a thousand subscribers arriving together would
# otherwise each take a loop turn for their slices, and the live events of the
# subscribers already there would wait behind all of them (docs/architecture.md
# section 6, "Owed snapshots"). A client that does not read holds its turn until
# --send-timeout ends it; one address holds at most --max-subscriptions-per-role-
# per-ip (10) streams of a role, so it cannot take every turn.
SNAPSHOTS_AT_ONCE = 32

# Writes a batch to the client; True when it went out without waiting for
# HTTP/2 flow control or the socket (`rpc.writer.StreamWriter.write`). It
# raises `SendTimedOut` when the batch waited `send_timeout` without going out.
Send = Callable[[list[bytes]], Awaitable[bool]]

# Sends one message now if HTTP/2 takes all of it without waiting, else sends
# nothing and returns False (`rpc.writer.StreamWriter.write_now`); `publish`
# calls it while the session has no task, so no task is woken per message.
SendNow = Callable[[bytes], bool]

# Stops finishing a message the client has part of, when the stream ends because the
# client fell behind (`rpc.writer.StreamWriter.give_up`): waiting for it is pointless.
GiveUp = Callable[[], None]

# Told once how a session ended: the status to send, or the error that ended it.
Done = Callable[["StreamEnd | Exception"], None]


class SendTimedOut(Exception):
    """A batch waited `send_timeout` for the client to read: the client is too slow."""


@dataclass(frozen=True)
class SessionSettings(LayerSettings):
    """How one stream is served: each field is a setting (jobsignal/config.py)."""

    idle_timeout: float = from_setting(lambda c: c.idle_timeout)
    send_timeout: float = from_setting(lambda c: c.send_timeout)
    # Seconds to read the request of a job.Job or health call (`rpc.requests.read_request`).
    request_timeout: float = from_setting(lambda c: c.request_timeout)
    snapshot_roles: frozenset[str] = from_setting(lambda c: frozenset(c.snapshot_roles))


@dataclass(frozen=True)
class StreamEnd:
    """How a stream ended: the gRPC status and message the client receives."""

    status: Status
    message: str | None
    reason: EndReason

    @property
    def close_connection_if_unused(self) -> bool:
        return self.reason is EndReason.IDLE or self.reason is EndReason.MAX_AGE


def end_for(reason: EndReason, settings: SessionSettings) -> StreamEnd:
    if reason is EndReason.IDLE:
        seconds = f"{settings.idle_timeout:g}"
        return StreamEnd(
            Status.UNAVAILABLE,
            f"idle for {seconds}s without messages or heartbeats (the client neither pinged"
            " nor answered the server's keepalive PINGs)",
            reason,
        )
    if reason is EndReason.SLOW:
        return StreamEnd(
            Status.RESOURCE_EXHAUSTED,
            "client fell too far behind the job events and was disconnected; read the"
            " stream promptly, then register and subscribe again",
            reason,
        )
    if reason is EndReason.REPLACED:
        return StreamEnd(
            Status.ABORTED,
            "replaced by a newer subscription with the same clientId",
            reason,
        )
    if reason is EndReason.MAX_AGE:
        return StreamEnd(
            Status.UNAVAILABLE,
            "the connection reached its maximum age (--max-connection-age and its grace);"
            " reconnect, register again and subscribe again",
            reason,
        )
    if reason is EndReason.CLIENT_GONE:  # nobody reads it: the stream is gone
        return StreamEnd(Status.CANCELLED, "the client went away", reason)
    return StreamEnd(Status.UNAVAILABLE, "server shutting down", reason)


class IdleDeadline:
    """The idle rule's clock for one stream: `touch()` records activity (it only
    stores the time: moving a trio deadline on every message, tens of thousands
    a second, costs a heap push each), `deadline` is when the stream is idle
    unless there is activity before."""

    __slots__ = ("last", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.last = trio.current_time()

    def touch(self, now: float | None = None) -> None:
        self.last = trio.current_time() if now is None else now

    @property
    def deadline(self) -> float:
        return self.last + self.timeout


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """Who subscribes, to what, and through which connection and writer."""

    kind: StreamKind
    role: str
    client_id: str
    activity: ConnectionActivity
    send: Send
    # None: every message waits for the session's task (tests, benchmarks).
    send_now: SendNow | None = None
    give_up: GiveUp | None = None


class _IdleEntry:
    """A session's place in the heap of idle deadlines; `session` is None once
    the session has ended (the entry waits for its deadline, or a compaction)."""

    __slots__ = ("at", "order", "session")

    def __init__(self, at: float, order: int, session: Session) -> None:
        self.at = at
        self.order = order
        self.session: Session | None = session

    def __lt__(self, other: _IdleEntry) -> bool:
        return (self.at, self.order) < (other.at, other.order)


class Sessions:
    """Where subscription streams are served: the nursery their tasks run in,
    and the one task that watches every stream's idle deadline (`run`)."""

    def __init__(
        self, registry: Registry, broadcaster: Broadcaster, settings: SessionSettings
    ) -> None:
        self.registry = registry
        self.broadcaster = broadcaster
        self.settings = settings
        self._nursery: trio.Nursery | None = None
        self._deadlines: list[_IdleEntry] = []  # a heap
        self._order = itertools.count()
        # By serial: in the order they opened, what `live_after` pages through.
        self._live: dict[int, Session] = {}
        self._serials = itertools.count(1)
        self._wake_timer: trio.CancelScope | None = None
        # Snapshots composed and written at once; the rest wait their turn, so that
        # a crowd of subscribers arriving together cannot crowd out live events.
        self.snapshots = trio.CapacityLimiter(SNAPSHOTS_AT_ONCE)

    def __len__(self) -> int:
        return len(self._live)

    def live_after(self, serial: int) -> Iterator[Session]:
        """The live sessions opened after the one numbered `serial`, oldest first
        (`rpc.subscriptions`). Read-only; consume it before the next checkpoint."""
        if serial <= 0:
            return iter(self._live.values())
        # Serials only grow, so the dict is in serial order: skip to the first one
        # after `serial` without building anything.
        return (session for key, session in self._live.items() if key > serial)

    async def run(
        self, *, task_status: trio.TaskStatus[Sessions] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve sessions until cancelled; the sessions still open then end as SHUTDOWN."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started(self)
                await self._watch_deadlines()
        finally:
            self._nursery = None
            for session in list(self._live.values()):
                session.subscriber.end(EndReason.SHUTDOWN)
                session.finish()

    def open(self, request: StreamRequest, done: Done) -> Session | StreamEnd:
        """Subscribe `request` and serve it from now on, or say why not (refused).

        Synchronous, so it may be called from grpclib's asyncio handler: the
        session's tasks run in this object's nursery. `done` is told how the
        stream ended, once; the session is not told to end by the caller
        except through `Session.client_gone`.
        """
        if self._nursery is None:
            raise RuntimeError("Sessions.run is not running")
        try:
            claim, replaced = self.registry.claim(
                request.client_id, request.role, trio.current_time(), address=request.activity.ip
            )
        except Refused as refusal:
            log.info(
                "subscribe refused: %s (role %r, peer %s)",
                refusal.message,
                request.role,
                request.activity.peer,
                extra={
                    "event": "subscribe_refused",
                    "stream": request.kind.value,
                    "role": clip(request.role),
                    "client_id": clip(request.client_id),
                    "peer": request.activity.peer,
                    "reason": refusal.status.name,
                },
            )
            self.broadcaster.stats.stream_ended(EndReason.REFUSED)
            return StreamEnd(refusal.status, refusal.message, EndReason.REFUSED)
        if replaced is not None:
            for other in self.broadcaster.subscribers:
                if other.client_id == request.client_id:
                    other.end(EndReason.REPLACED)
        session = Session(self, request, claim, done, next(self._serials))
        self._live[session.serial] = session
        self._watch(session)
        session.start()
        return session

    def _start_task(self, session: Session) -> None:
        # Stopping (the nursery gone or closed): `run` ends what is left.
        if self._nursery is not None:
            with contextlib.suppress(RuntimeError):
                self._nursery.start_soon(session.drain)

    def _forget(self, session: Session) -> None:
        self._live.pop(session.serial, None)
        entry = session.deadline_entry
        if entry is not None:
            entry.session = None
            session.deadline_entry = None
        # Ended sessions' entries wait for their deadline; bound how many there are.
        if len(self._deadlines) > 2 * len(self._live) + 64:
            self._deadlines = [entry for entry in self._deadlines if entry.session is not None]
            heapq.heapify(self._deadlines)

    def _watch(self, session: Session) -> None:
        entry = _IdleEntry(session.idle.deadline, next(self._order), session)
        session.deadline_entry = entry
        heapq.heappush(self._deadlines, entry)
        timer = self._wake_timer
        if timer is not None and session.idle.deadline < timer.deadline:
            timer.deadline = session.idle.deadline

    async def _watch_deadlines(self) -> None:
        deadlines = self._deadlines
        while True:
            first = deadlines[0].at if deadlines else math.inf
            with trio.CancelScope(deadline=first) as self._wake_timer:
                await trio.sleep_forever()
            self._wake_timer = None
            now = trio.current_time()
            deadlines = self._deadlines  # `_forget` may have rebuilt it
            while deadlines and deadlines[0].at <= now:
                session = heapq.heappop(deadlines).session
                if session is None:
                    continue  # ended before its deadline
                session.deadline_entry = None
                if session.idle.deadline <= now:
                    session.subscriber.end(EndReason.IDLE)  # its task cleans up
                else:
                    self._watch(session)  # activity since: from the last one


class Session:
    """One subscription stream: its queue, its idle clock, and a task only while
    it has something to write.

    What it has sent (`messages_sent`, `last_key`, `last_sent_at`) and when it
    opened (`opened_at`, trio time) are kept for the operator's view of who is
    subscribed (`rpc.subscriptions`), nothing else reads them.
    """

    __slots__ = (
        "_done",
        "_running",
        "claim",
        "deadline_entry",
        "finished",
        "idle",
        "last_key",
        "last_sent_at",
        "messages_sent",
        "opened_at",
        "request",
        "serial",
        "sessions",
        "subscriber",
    )

    def __init__(
        self, sessions: Sessions, request: StreamRequest, claim: Claim, done: Done, serial: int
    ) -> None:
        self.sessions = sessions
        self.request = request
        self.claim = claim
        self._done = done
        self._running = False
        self.finished = False
        self.deadline_entry: _IdleEntry | None = None
        self.serial = serial
        self.opened_at = trio.current_time()
        self.messages_sent = 0
        # The job of the last message sent (UNIQUE: a List snapshot batch), and when.
        self.last_key: Hashable = UNIQUE
        self.last_sent_at: float | None = None
        settings = sessions.settings
        self.subscriber = sessions.broadcaster.subscribe(
            request.kind,
            request.role,
            request.client_id,
            snapshot=request.role in settings.snapshot_roles,
            group=request.activity,  # one per connection
        )
        self.idle = IdleDeadline(settings.idle_timeout)
        request.activity.heartbeat_listeners.add(self.idle.touch)
        log.info(
            "client subscribed: %s role=%s id=%s peer=%s",
            request.kind.value,
            request.role,
            request.client_id,
            request.activity.peer,
            extra={
                "event": "client_subscribed",
                "stream": request.kind.value,
                "role": request.role,
                "client_id": request.client_id,
                "peer": request.activity.peer,
            },
        )

    def start(self) -> None:
        subscriber = self.subscriber
        if self.request.send_now is not None:
            subscriber.deliver_directly(self._deliver_now)
        subscriber.on_wake(self._wake)
        if subscriber.sending_snapshot:  # composed and written by its task, then up
            self._wake()
            return
        subscriber.up = True
        if subscriber.pending:
            self._wake()
        else:
            subscriber.park()

    def client_gone(self) -> None:
        """The client went away (grpclib cancelled the handler): end as CLIENT_GONE."""
        self.subscriber.end(EndReason.CLIENT_GONE)

    def _wake(self) -> None:
        if self._running:
            give_up = self.request.give_up
            if give_up is not None and self.subscriber.end_reason is EndReason.SLOW:
                give_up()  # before the task's write is cancelled
        elif not self.finished:
            self._running = True
            self.sessions._start_task(self)

    def _deliver_now(self, entry: QueueEntry) -> bool:
        # What `publish` offers while the session has no task: sent at once,
        # the activity recorded and the delivery counted as the task would.
        send_now = self.request.send_now
        if send_now is None or not send_now(entry[1]):
            return False
        self.sessions.broadcaster.stats.batches_written_from_publish += 1
        seen_at = entry[2]
        self._delivered(1, entry[0], () if seen_at is None else (seen_at,))
        return True

    def _delivered(self, count: int, last_key: Hashable, seen: Sequence[float]) -> None:
        """`count` messages went out now, the last about `last_key`: activity for the
        idle rule, the delivery counted, and the latency of those the source saw
        (`seen`), at one clock read."""
        now = trio.current_time()
        self.idle.touch(now)
        self.messages_sent += count
        self.last_key = last_key
        self.last_sent_at = now
        stats = self.sessions.broadcaster.stats
        stats.messages_delivered += count
        for seen_at in seen:
            stats.delivery_latency.observe(now - seen_at)

    async def drain(self) -> None:
        """The session's task: write what is queued, then return, parked, or clean
        up if the stream has ended."""
        subscriber = self.subscriber
        try:
            with trio.CancelScope() as scope:
                subscriber.attach(scope)
                if subscriber.sending_snapshot:  # first, in turn with other streams'
                    async with self.sessions.snapshots:
                        await subscriber.compose_snapshot()
                        await self._send_queued(until_snapshot_sent=True)
                    # Up only now, as a ClusterD-style server reports a stream once
                    # its snapshot is sent; the client saw the response headers with
                    # the snapshot's first message (`_grpclib.queue_headers`).
                    subscriber.up = True
                await self._send_queued(until_snapshot_sent=False)
            subscriber.attach(None)
        except Exception as error:  # freed now; the handler answers INTERNAL and logs it
            self.finish(error)
            return
        finally:
            self._running = False
            if subscriber.end_reason is not None:  # also when cancelled with the server
                self.finish()

    async def _send_queued(self, *, until_snapshot_sent: bool) -> None:
        """Write what is queued, a batch at a time, until none is left (then park) or
        the stream ends; with `until_snapshot_sent`, only until the snapshot is out."""
        subscriber = self.subscriber
        stats = self.sessions.broadcaster.stats
        while subscriber.end_reason is None:
            if until_snapshot_sent and not subscriber.sending_snapshot:
                return
            frames, seen = subscriber.take(MAX_BATCH)
            if not frames:
                subscriber.park()
                return
            try:
                at_once = await self.request.send(frames)
            except SendTimedOut:
                subscriber.end(EndReason.SLOW)
                return
            if at_once:
                stats.batches_written_at_once += 1
            else:
                stats.batches_written_waiting += 1
            self._delivered(len(frames), subscriber.last_taken, seen)

    def finish(self, error: Exception | None = None) -> None:
        """Release everything the stream held and tell `done` (once)."""
        if self.finished:
            return
        self.finished = True
        subscriber = self.subscriber
        request = self.request
        sessions = self.sessions
        why = subscriber.end_reason or EndReason.CLIENT_GONE
        sessions.broadcaster.stats.stream_ended(why)
        request.activity.heartbeat_listeners.discard(self.idle.touch)
        sessions.broadcaster.unsubscribe(subscriber)
        sessions.registry.release(self.claim)
        subscriber.end(why)
        sessions._forget(self)
        log.info(
            "client subscription ended: %s role=%s id=%s peer=%s reason=%s",
            request.kind.value,
            request.role,
            request.client_id,
            request.activity.peer,
            why.value,
            extra={
                "event": "client_subscription_ended",
                "stream": request.kind.value,
                "role": request.role,
                "client_id": request.client_id,
                "peer": request.activity.peer,
                "reason": why.value,
            },
        )
        self._done(error if error is not None else end_for(why, sessions.settings))


async def serve_subscription(
    *,
    kind: StreamKind,
    role: str,
    client_id: str,
    registry: Registry,
    broadcaster: Broadcaster,
    settings: SessionSettings,
    activity: ConnectionActivity,
    send: Send,
    send_now: SendNow | None = None,
) -> StreamEnd:
    """Serve one stream until it ends, with `Sessions` of its own; return the
    status to send (tests and benchmarks: the server shares one `Sessions`).
    Cancelled, the stream ends as CLIENT_GONE."""
    ended: list[StreamEnd | Exception] = []
    done = trio.Event()

    def settle(outcome: StreamEnd | Exception) -> None:
        ended.append(outcome)
        done.set()

    async with trio.open_nursery() as nursery:
        sessions: Sessions = await nursery.start(Sessions(registry, broadcaster, settings).run)
        opened = sessions.open(
            StreamRequest(kind, role, client_id, activity, send, send_now), settle
        )
        if isinstance(opened, StreamEnd):
            nursery.cancel_scope.cancel()
            return opened
        try:
            await done.wait()
        finally:
            opened.client_gone()  # a no-op once it has ended
            nursery.cancel_scope.cancel()
    outcome = ended[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
