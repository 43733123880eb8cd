"""One subscription stream, as a trio task: the idle rule and the send loop.

The stream runs inside a cancel scope armed at the idle deadline: every batch
written to the client and every heartbeat on its connection records activity,
and a scope that fires with activity since is opened again at the new
deadline, so expiry needs no timer task and is exact in virtual time. Other
ways a stream ends (replaced, too slow, server shutdown) cancel the
subscriber's scope and leave their reason on it. The function returns how
the stream ended instead of raising a gRPC error, so the status is decided
outside any nursery (docs/architecture.md section 8, "The grpclib adapter and
why it exists").

Nothing here moves a trio deadline per message: the idle scope is re-armed
once per quiet stretch, and the send timeout is applied by the sender only
when a batch has to wait (a deadline per batch cost more than the rest of
the send loop together).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio
from grpclib.const import Status

from jobsignal.config import LayerSettings, from_setting
from jobsignal.fanout import Broadcaster, EndReason, StreamKind
from jobsignal.fanout.stats import FanoutStats
from jobsignal.fanout.subscriber import QueueEntry, Subscriber
from jobsignal.rpc.activity import ConnectionActivity
from jobsignal.rpc.registry import Refused, Registry
from jobsignal.text import clip

log = logging.getLogger(__name__)

# Messages written per trio->asyncio hop: large enough to amortise the hop,
# small enough that one batch never hogs the loop.
MAX_BATCH = 256

# Writes a batch to the client; True when it went out without waiting for
# HTTP/2 flow control or the socket (`rpc.writer.StreamWriter.write`). It
# raises `SendTimedOut` when the batch waited `send_timeout` without going out.
Send = Callable[[list[bytes]], Awaitable[bool]]

# Sends one message now if HTTP/2 takes all of it without waiting, else sends
# nothing and returns False (`rpc.writer.StreamWriter.write_now`); `publish`
# calls it while the stream's task is parked, so no task is woken per message.
SendNow = Callable[[bytes], bool]


class SendTimedOut(Exception):
    """A batch waited `send_timeout` for the client to read: the client is too slow."""


class SessionHandle:
    """How the side that started a session tells it the client went away
    (`rpc.service`, whose asyncio handler grpclib cancels): the session ends
    with CLIENT_GONE, or never subscribes if it has not started yet."""

    __slots__ = ("gone", "subscriber")

    def __init__(self) -> None:
        self.gone = False
        self.subscriber: Subscriber | None = None

    def client_gone(self) -> None:
        self.gone = True
        if self.subscriber is not None:
            self.subscriber.end(EndReason.CLIENT_GONE)


@dataclass(frozen=True)
class SessionSettings(LayerSettings):
    """How one stream is served: each field is a setting (jobsignal/config.py)."""

    idle_timeout: float = from_setting(lambda c: c.idle_timeout)
    send_timeout: float = from_setting(lambda c: c.send_timeout)
    snapshot_roles: frozenset[str] = from_setting(lambda c: frozenset(c.snapshot_roles))


@dataclass(frozen=True)
class StreamEnd:
    """How a stream ended: the gRPC status and message the client receives."""

    status: Status
    message: str | None
    reason: EndReason

    @property
    def close_connection_if_unused(self) -> bool:
        return self.reason is EndReason.IDLE


def end_for(reason: EndReason, settings: SessionSettings, pending: int = 0) -> StreamEnd:
    if reason is EndReason.IDLE:
        seconds = f"{settings.idle_timeout:g}"
        return StreamEnd(
            Status.UNAVAILABLE,
            f"idle for {seconds}s without messages or heartbeats; enable gRPC keepalive"
            " (for example every 30s) to keep a quiet subscription open",
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
    if reason is EndReason.CLIENT_GONE:  # nobody reads it: the stream is gone
        return StreamEnd(Status.CANCELLED, "the client went away", reason)
    return StreamEnd(Status.UNAVAILABLE, "server shutting down", reason)


class IdleDeadline:
    """The idle rule's clock: `touch()` records activity, and `scope()` is a cancel
    scope that fires no earlier than the last activity plus the timeout.

    Touching only stores the time: moving a trio deadline on every message (tens
    of thousands a second) costs a heap push each. The scope is armed at the
    activity known when it is opened; when it fires, `expired()` tells a real
    idle stream from one with activity since, which opens a new scope armed at
    its last activity. So a stream still closes exactly `timeout` after its
    last message or heartbeat, at one re-arm per quiet stretch at most.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.last = trio.current_time()

    def touch(self, now: float | None = None) -> None:
        self.last = trio.current_time() if now is None else now

    def scope(self) -> trio.CancelScope:
        return trio.CancelScope(deadline=self.last + self.timeout)

    def expired(self) -> bool:
        return trio.current_time() >= self.last + self.timeout


def _record_delivery(
    stats: FanoutStats, idle: IdleDeadline, count: int, seen: Sequence[float]
) -> None:
    """`count` messages went out now: activity for the idle rule, the delivery
    counted, and the latency of those the source saw (`seen`), at one clock read."""
    now = trio.current_time()
    idle.touch(now)
    stats.messages_delivered += count
    for seen_at in seen:
        stats.delivery_latency.observe(now - seen_at)


def _direct_sink(
    send_now: SendNow, idle: IdleDeadline, stats: FanoutStats
) -> Callable[[QueueEntry], bool]:
    """What `publish` offers a parked subscriber's messages to: sent at once, the
    activity recorded and the delivery counted as the stream's task would."""

    def deliver(entry: QueueEntry) -> bool:
        if not send_now(entry[1]):
            return False
        stats.batches_written_from_publish += 1
        seen_at = entry[2]
        _record_delivery(stats, idle, 1, () if seen_at is None else (seen_at,))
        return True

    return deliver


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
    handle: SessionHandle | None = None,
) -> StreamEnd:
    """Serve one Subscribe* stream until it ends; return the status to send.

    With a `handle`, a client gone before the session started is never
    subscribed, and one gone later ends it (`SessionHandle.client_gone`).
    """
    if handle is not None and handle.gone:
        broadcaster.stats.stream_ended(EndReason.CLIENT_GONE)
        return end_for(EndReason.CLIENT_GONE, settings)
    try:
        claim, replaced = registry.claim(client_id, role, trio.current_time(), address=activity.ip)
    except Refused as refusal:
        log.info(
            "subscribe refused: %s (role %r, peer %s)",
            refusal.message,
            role,
            activity.peer,
            extra={
                "event": "subscribe_refused",
                "stream": kind.value,
                "role": clip(role),
                "client_id": clip(client_id),
                "peer": activity.peer,
                "reason": refusal.status.name,
            },
        )
        broadcaster.stats.stream_ended(EndReason.REFUSED)
        return StreamEnd(refusal.status, refusal.message, EndReason.REFUSED)
    if replaced is not None:
        for other in broadcaster.subscribers:
            if other.client_id == client_id:
                other.end(EndReason.REPLACED)
    subscriber = broadcaster.subscribe(
        kind, role, client_id, snapshot=role in settings.snapshot_roles
    )
    if handle is not None:
        handle.subscriber = subscriber
    idle = IdleDeadline(settings.idle_timeout)
    activity.heartbeat_listeners.add(idle.touch)
    log.info(
        "client subscribed: %s role=%s id=%s peer=%s",
        kind.value,
        role,
        client_id,
        activity.peer,
        extra={
            "event": "client_subscribed",
            "stream": kind.value,
            "role": role,
            "client_id": client_id,
            "peer": activity.peer,
        },
    )
    try:
        if send_now is not None:
            subscriber.deliver_directly(_direct_sink(send_now, idle, broadcaster.stats))
        while subscriber.end_reason is None:
            # One scope at a time (each costs half a kilobyte per idle stream): armed
            # at the idle deadline, and cancelled by `end()` for any other reason.
            with idle.scope() as scope:
                subscriber.attach(scope)
                while True:
                    frames, seen = await subscriber.next_batch_timed(MAX_BATCH)
                    try:
                        at_once = await send(frames)
                    except SendTimedOut:
                        subscriber.end(EndReason.SLOW)  # the next wait is cancelled
                        continue
                    if at_once:
                        broadcaster.stats.batches_written_at_once += 1
                    else:
                        broadcaster.stats.batches_written_waiting += 1
                    _record_delivery(broadcaster.stats, idle, len(frames), seen)
            if idle.expired():
                subscriber.end(EndReason.IDLE)  # unless another reason came first
        assert subscriber.end_reason is not None
        return end_for(subscriber.end_reason, settings)
    finally:
        # Reached on every path, including the client going away (cancellation).
        why = subscriber.end_reason or EndReason.CLIENT_GONE
        broadcaster.stats.stream_ended(why)
        reason = why.value
        activity.heartbeat_listeners.discard(idle.touch)
        broadcaster.unsubscribe(subscriber)
        registry.release(claim)
        subscriber.end(subscriber.end_reason or EndReason.SHUTDOWN)
        log.info(
            "client subscription ended: %s role=%s id=%s peer=%s reason=%s",
            kind.value,
            role,
            client_id,
            activity.peer,
            reason,
            extra={
                "event": "client_subscription_ended",
                "stream": kind.value,
                "role": role,
                "client_id": client_id,
                "peer": activity.peer,
                "reason": reason,
            },
        )
