"""Broadcaster: turns job events into encoded messages and fans them out.

`publish()` is synchronous and never waits: it encodes each event once per
message type, records it as the job's latest state (for snapshots), and
pushes the same bytes into every subscriber's queue. Subscribing and taking
the snapshot happen in one synchronous step, so no event can fall between the
snapshot and the live stream.

One job event is a fault boundary: the store only emits valid UTF-8, so an
event that fails to encode or queue is a bug, but it costs only that event
(dropped, logged rate-limited, counted in `FanoutStats.events_dropped`), not
the watcher, the other events or a snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import trio

from jobsignal.config import DEFAULTS, Config
from jobsignal.fanout.encoding import encode_signal, encode_signal_list
from jobsignal.fanout.stats import FanoutStats
from jobsignal.fanout.subscriber import (
    UNIQUE,
    EndReason,
    EventQueue,
    QueuedEvent,
    QueueEntry,
    StreamKind,
    Subscriber,
)
from jobsignal.logs import RateLimitedLog
from jobsignal.store.model import JobKey, JobSummary, event_id
from jobsignal.text import quote

log = logging.getLogger(__name__)

# docs/architecture.md section 2: a snapshot batch carries rank tables of at most this many NPUs.
DEFAULT_BATCH_NPUS = 40_000


@dataclass(slots=True)
class EncodedJob:
    """The latest event of a live job: its state and, once someone needs them,
    its uuid and encoded signal (an initial LIST with nobody subscribed yet
    then costs neither a digest nor an encoding).

    The uuid is `event_id(job)`: derived from the state, so every replica and
    every restart gives the same event the same id (docs/architecture.md
    section 2), and a snapshot carries the id of the event that produced it.
    """

    job: JobSummary
    encoded: bytes | None = None
    _uuid: str | None = None

    @property
    def uuid(self) -> str:
        if self._uuid is None:
            self._uuid = event_id(self.job)
        return self._uuid


class Broadcaster:
    def __init__(
        self,
        *,
        max_pending: int = DEFAULTS.max_pending_messages,
        max_pending_bytes: int = DEFAULTS.max_pending_bytes,
        batch_npus: int = DEFAULT_BATCH_NPUS,
        # gRPC clients' default receive limit (grpcio, grpc-go, grpc-java): a
        # bigger message would end a default client's stream.
        max_message_bytes: int = DEFAULTS.max_send_bytes,
        wall_clock: Callable[[], float] = time.time,
        stats: FanoutStats | None = None,
    ) -> None:
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._batch_npus = batch_npus
        self._max_message_bytes = max_message_bytes
        self._wall_clock = wall_clock
        self._latest: dict[JobKey, EncodedJob] = {}
        self._signal_subscribers: set[Subscriber] = set()
        self._list_subscribers: set[Subscriber] = set()
        # In-process consumers (jobsignal.watch_jobs, RunningJobsignal.open_subscription).
        self._event_queues: set[EventQueue] = set()
        self.stats = stats or FanoutStats()
        self._faults = RateLimitedLog(log)

    @classmethod
    def from_config(cls, config: Config) -> Broadcaster:
        """The queue bounds of --max-pending-messages and --max-pending-bytes, and
        --max-send-bytes."""
        return cls(
            max_pending=config.max_pending_messages,
            max_pending_bytes=config.max_pending_bytes,
            max_message_bytes=config.max_send_bytes,
        )

    # -- state -------------------------------------------------------------

    @property
    def subscribers(self) -> frozenset[Subscriber]:
        return frozenset(self._signal_subscribers | self._list_subscribers)

    def _set_of(self, kind: StreamKind) -> set[Subscriber]:
        return self._signal_subscribers if kind is StreamKind.SIGNAL else self._list_subscribers

    def job_count(self) -> int:
        return len(self._latest)

    def latest(self) -> list[EncodedJob]:
        return list(self._latest.values())

    # -- events ------------------------------------------------------------

    def publish(self, jobs: Iterable[JobSummary], seen_at: float | None = None) -> None:
        """Send job events to every subscriber; `seen_at` is when the source saw them.

        The hot loop: one encoding and one shared queue entry per event and
        message type, then a plain append per subscriber.
        """
        if seen_at is None:
            seen_at = trio.current_time()
        stats = self.stats
        for job in jobs:
            key = job.key
            event = EncodedJob(job)
            if job.is_deleted:
                self._latest.pop(key, None)
            else:
                self._latest[key] = event
            stats.events_published += 1
            if self._event_queues:
                queued = (key, QueuedEvent(job, event.uuid), seen_at)
                for queue in self._event_queues:
                    queue.push_entry(queued)
            if not (self._signal_subscribers or self._list_subscribers):
                continue
            try:
                signal = self._signal(event)
                entry: QueueEntry = (key, signal, seen_at)
                for subscriber in self._signal_subscribers:
                    subscriber.push_entry(entry)
                if self._list_subscribers:
                    as_list = encode_signal_list([signal], self._now_ms(), len(self._latest))
                    entry = (key, as_list, seen_at)
                    for subscriber in self._list_subscribers:
                        subscriber.push_entry(entry)
            except Exception:
                self._drop(event, "publish")
                continue
            stats.messages_queued += len(self._signal_subscribers) + len(self._list_subscribers)

    # -- subscriptions -----------------------------------------------------

    def subscribe(
        self, kind: StreamKind, role: str, client_id: str, *, snapshot: bool
    ) -> Subscriber:
        """A new subscriber, its queue primed with the snapshot it is owed."""
        subscriber = Subscriber(
            kind,
            role,
            client_id,
            max_pending=self._max_pending,
            max_pending_bytes=self._max_pending_bytes,
            stats=self.stats,
        )
        if kind is StreamKind.LIST:
            subscriber.prime([(UNIQUE, batch, None) for batch in self.snapshot_batches()])
        elif snapshot:
            owed: list[QueueEntry] = []
            for entry in list(self._latest.values()):
                signal = self._snapshot_signal(entry)
                if signal is not None:
                    owed.append((entry.job.key, signal, None))
            subscriber.prime(owed)
        self._set_of(kind).add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._set_of(subscriber.kind).discard(subscriber)

    def subscribe_events(self, *, snapshot: bool) -> EventQueue:
        """A queue of job events for an in-process consumer, with the same
        bounds as a stream's; primed with every live job's latest event if
        `snapshot` (in the same synchronous step, so nothing falls between)."""
        queue = EventQueue(
            max_pending=self._max_pending,
            max_pending_bytes=self._max_pending_bytes,
            stats=self.stats,
        )
        if snapshot:
            queue.prime(
                [(e.job.key, QueuedEvent(e.job, e.uuid), None) for e in list(self._latest.values())]
            )
        self._event_queues.add(queue)
        return queue

    def unsubscribe_events(self, queue: EventQueue) -> None:
        self._event_queues.discard(queue)

    @property
    def event_queues(self) -> frozenset[EventQueue]:
        return frozenset(self._event_queues)

    def end_all(self, reason: EndReason) -> None:
        for subscriber in self.subscribers:
            subscriber.end(reason)
        for queue in self.event_queues:
            queue.end(reason)

    def snapshot_batches(self) -> Iterator[bytes]:
        """The current state as JobSummarySignalList batches (docs/architecture.md section 2).

        Every batch carries the same ReportTime and JobTotalNum. Jobs are packed
        while their rank tables total at most `batch_npus` NPUs; a job larger
        than that goes alone, with an empty HcclJson.
        """
        report_time = self._now_ms()
        # Encoded first, so that a job dropped as unencodable is not in JobTotalNum.
        signals = [
            (entry, self._snapshot_signal(entry, stripped=entry.job.npu_count > self._batch_npus))
            for entry in list(self._latest.values())
        ]
        total = len(self._latest)
        batch: list[bytes] = []
        batch_npus = batch_bytes = 0
        for entry, signal in signals:
            if signal is None:
                continue
            npus = entry.job.npu_count
            if npus > self._batch_npus:
                if batch:
                    yield encode_signal_list(batch, report_time, total)
                    batch, batch_npus, batch_bytes = [], 0, 0
                yield encode_signal_list([signal], report_time, total)
                continue
            size = len(signal) + 8
            too_big = batch_bytes + size + 64 > self._max_message_bytes
            if batch and (batch_npus + npus > self._batch_npus or too_big):
                yield encode_signal_list(batch, report_time, total)
                batch, batch_npus, batch_bytes = [], 0, 0
            batch.append(signal)
            batch_npus += npus
            batch_bytes += size
        if batch or total == 0:
            # An empty cluster still answers with one (empty) batch so the
            # client learns JobTotalNum = 0 and the ReportTime of the state.
            yield encode_signal_list(batch, report_time, total)

    def _signal(self, event: EncodedJob) -> bytes:
        if event.encoded is None:
            event.encoded = self._encode(event.job, event.uuid)
        return event.encoded

    def _snapshot_signal(self, event: EncodedJob, *, stripped: bool = False) -> bytes | None:
        """The event's signal (without its rank table if `stripped`) for a snapshot,
        or None, and the job dropped, if it cannot be encoded."""
        try:
            if stripped:
                return encode_signal(event.job, event.uuid, strip_rank_table=True)
            return self._signal(event)
        except Exception:
            self._drop(event, "snapshot")
            return None

    def _drop(self, event: EncodedJob, step: str) -> None:
        """Forget an event that cannot be sent (called from an `except` block)."""
        key = event.job.key
        if self._latest.get(key) is event:
            del self._latest[key]  # a snapshot must not trip over it again
        self.stats.events_dropped[step] += 1
        self._faults.error(
            f"event_{step}",
            "dropped the job event of %s/%s (%s failed)",
            quote(event.job.namespace, 80),
            quote(event.job.job_id, 80),
            step,
            exc_info=True,
        )

    def _encode(self, job: JobSummary, event_uuid: str) -> bytes:
        """Encode a signal; one above the send limit goes out without its rank table
        (docs/architecture.md section 2: the rule for huge jobs) rather than killing
        every stream."""
        signal = encode_signal(job, event_uuid)
        # Headroom for the list wrapper (tag, length, ReportTime, JobTotalNum).
        if len(signal) + 64 > self._max_message_bytes:
            self.stats.rank_tables_stripped += 1
            signal = encode_signal(job, event_uuid, strip_rank_table=True)
        return signal

    def _now_ms(self) -> int:
        return int(self._wall_clock() * 1000)
