"""Broadcaster: turns job events into encoded messages and fans them out.

`publish()` is synchronous and never waits: it encodes each event once per
message type and pushes the same bytes into every subscriber's queue, through
the pacer (`fanout/pacing.py`), which spreads a large fan-out over loop turns.
Subscribing fixes which job states a new subscriber's snapshot holds, in
one synchronous step, so no event can fall between the snapshot and the live
stream; the subscriber's own task makes it, in slices (fanout/snapshot.py).

The broadcaster keeps no job state of its own (docs/architecture.md section
4, "Who owns the job state"): snapshots, `job_count()` and `latest()` read
the live jobs from their owner (`LiveJobs`), the job store in a server. What
it keeps per job is derived and checked against the owner on every read: an
encoding cache (uuid and signal bytes) valid only while the owner holds that
very `JobSummary` object, and the jobs it dropped as unencodable. A
broadcaster built without an owner keeps one itself (`PublishedJobs`, what
was published), for tests and embedders that publish by hand.

One job event is a fault boundary: the store only emits valid UTF-8, so an
event that fails to encode or queue is a bug, but it costs only that event
(dropped, logged rate-limited, counted in `FanoutStats.events_dropped`), not
the watcher, the other events or a snapshot.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from jobsignal.config import DEFAULTS, Config
from jobsignal.fanout.encoding import encode_signal, encode_signal_list
from jobsignal.fanout.pacing import FanOutPacer, Groups
from jobsignal.fanout.snapshot import OwedSnapshot, sliced
from jobsignal.fanout.stats import FanoutStats
from jobsignal.fanout.subscriber import (
    UNIQUE,
    ComposeSnapshot,
    EndReason,
    EventQueue,
    QueuedEvent,
    QueueEntry,
    StreamKind,
    Subscriber,
)
from jobsignal.logs import RateLimitedLog
from jobsignal.store.model import JobKey, JobSummary, event_id
from jobsignal.util.text import quote

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


class LiveJobs(Protocol):
    """The owner of every live job's latest state, read by the broadcaster:
    `JobStore` in a server, `PublishedJobs` in a broadcaster built without one."""

    def live_items(self) -> Iterable[tuple[JobKey, JobSummary]]:
        """(key, state) of every live job, in a stable order; consumed before
        the owner changes."""
        ...

    def live_job_count(self) -> int: ...


class PublishedJobs:
    """The live jobs as published: the owner of the state when the broadcaster
    was given none (`Broadcaster.publish` records every event here)."""

    def __init__(self) -> None:
        self._jobs: dict[JobKey, JobSummary] = {}

    def record(self, key: JobKey, job: JobSummary) -> None:
        if job.is_deleted:
            self._jobs.pop(key, None)
        else:
            self._jobs[key] = job

    def live_items(self) -> Iterable[tuple[JobKey, JobSummary]]:
        return self._jobs.items()

    def live_job_count(self) -> int:
        return len(self._jobs)


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
        jobs: LiveJobs | None = None,
    ) -> None:
        """`jobs` owns the live jobs' state (the job store whose events are
        published here); without it, the broadcaster records what it publishes."""
        self._max_pending = max_pending
        self._max_pending_bytes = max_pending_bytes
        self._batch_npus = batch_npus
        self._max_message_bytes = max_message_bytes
        self._wall_clock = wall_clock
        self._own_record: PublishedJobs | None = None
        if jobs is None:
            jobs = self._own_record = PublishedJobs()
        self._jobs = jobs
        # Derived from the owner's state, never a second copy of it: an entry
        # counts only while its `job` is the object the owner holds now.
        self._encoded: dict[JobKey, EncodedJob] = {}
        # Jobs that failed to encode, left out of snapshots and counts until
        # their next event (so a broken one is not retried on every snapshot).
        self._dropped: dict[JobKey, JobSummary] = {}
        self._signal_subscribers: set[Subscriber] = set()
        self._list_subscribers: set[Subscriber] = set()
        # Each kind's subscribers grouped by connection, made anew after a change.
        self._groups: dict[StreamKind, Groups] = {}
        # In-process consumers (jobsignal.watch_jobs, RunningJobsignal.open_subscription).
        self._event_queues: set[EventQueue] = set()
        self.stats = stats or FanoutStats()
        # Spreads a large fan-out over loop turns once its task runs (the gRPC server starts it).
        self.pacer = FanOutPacer(self.stats, max_pending=max_pending)
        self._faults = RateLimitedLog(log)

    @classmethod
    def from_config(cls, config: Config, *, jobs: LiveJobs | None = None) -> Broadcaster:
        """The queue bounds of --max-pending-messages and --max-pending-bytes, and
        --max-send-bytes; `jobs` as for the constructor."""
        return cls(
            max_pending=config.max_pending_messages,
            max_pending_bytes=config.max_pending_bytes,
            max_message_bytes=config.max_send_bytes,
            jobs=jobs,
        )

    # -- state -------------------------------------------------------------

    @property
    def subscribers(self) -> frozenset[Subscriber]:
        return frozenset(self._signal_subscribers | self._list_subscribers)

    def streams_up(self) -> Counter[tuple[str, str]]:
        """The streams reported up (`Subscriber.up`: their snapshot, if owed one,
        written), by RPC and role: what `jobsignal_subscribers` shows."""
        return Counter((s.kind.value, s.role) for s in self.subscribers if s.up)

    def _set_of(self, kind: StreamKind) -> set[Subscriber]:
        return self._signal_subscribers if kind is StreamKind.SIGNAL else self._list_subscribers

    def _groups_of(self, kind: StreamKind) -> Groups:
        groups = self._groups.get(kind)
        if groups is None:
            by_group: dict[Hashable, list[Subscriber]] = {}
            for subscriber in self._set_of(kind):
                key = subscriber if subscriber.group is None else subscriber.group
                by_group.setdefault(key, []).append(subscriber)
            groups = self._groups[kind] = [tuple(group) for group in by_group.values()]
        return groups

    def job_count(self) -> int:
        """Live jobs, as snapshots count them (JobTotalNum)."""
        return self._jobs.live_job_count() - len(self._dropped)

    def latest(self) -> list[EncodedJob]:
        """Every live job's latest event, in snapshot order."""
        return [entry for _, entry in self._live_entries()]

    # -- events ------------------------------------------------------------

    def publish(self, jobs: Iterable[JobSummary], seen_at: float | None = None) -> None:
        """Send job events to every subscriber; `seen_at` is when the source saw them.

        A live change goes to List subscribers as a list of one with
        JobTotalNum 1, as ClusterD sends it (docs/architecture.md section 2).

        The hot loop: one encoding and one shared queue entry per event and
        message type, handed to every subscriber by the pacer (at once, or a
        slice per loop turn while its task runs: fanout/pacing.py). Only the first event
        may go out from here to parked subscribers (`BoundedQueue.push_entry`):
        the rest of a burst (a relist step) queues behind it, so each
        subscriber's task sends it as one batch in its own loop turn instead of
        this call writing every message of the burst to every stream at once.
        """
        if seen_at is None:
            seen_at = trio.current_time()
        stats, pacer = self.stats, self.pacer
        own_record, encoded, dropped = self._own_record, self._encoded, self._dropped
        for index, job in enumerate(jobs):
            key = job.key
            event = EncodedJob(job)
            if own_record is not None:
                own_record.record(key, job)
            if job.is_deleted:
                encoded.pop(key, None)
            else:
                encoded[key] = event
            if dropped:
                dropped.pop(key, None)  # a new state gets its own chance
            stats.events_published += 1
            if self._event_queues:
                queued = (key, QueuedEvent(job, event.uuid), seen_at)
                for queue in self._event_queues:
                    queue.push_entry(queued)
            if not (self._signal_subscribers or self._list_subscribers):
                continue
            direct = index == 0
            try:
                signal = self._signal(event)
                if self._signal_subscribers:
                    groups = self._groups_of(StreamKind.SIGNAL)
                    pacer.deliver((key, signal, seen_at), groups, direct=direct)
                if self._list_subscribers:
                    as_list = encode_signal_list([signal], self._now_ms(), 1)
                    groups = self._groups_of(StreamKind.LIST)
                    pacer.deliver((key, as_list, seen_at), groups, direct=direct)
            except Exception:
                self._drop(key, event, "publish")
                continue
            stats.messages_queued += len(self._signal_subscribers) + len(self._list_subscribers)

    # -- subscriptions -----------------------------------------------------

    def subscribe(
        self,
        kind: StreamKind,
        role: str,
        client_id: str,
        *,
        snapshot: bool,
        group: Hashable = None,
    ) -> Subscriber:
        """A new subscriber, owed the snapshot of its kind and role (composed by its
        own task: fanout/snapshot.py); `group` names what it shares its writes with
        (its connection), if anything."""
        subscriber = Subscriber(
            kind,
            role,
            client_id,
            max_pending=self._max_pending,
            max_pending_bytes=self._max_pending_bytes,
            stats=self.stats,
            group=group,
        )
        if kind is StreamKind.LIST:
            self._owe_list_snapshot(subscriber)
        elif snapshot and (live := self._live_entries()):
            owed = OwedSnapshot(live, self._snapshot_entry)
            subscriber.owe(owed.made, len(owed))
        self._set_of(kind).add(subscriber)
        self._groups.pop(kind, None)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._set_of(subscriber.kind).discard(subscriber)
        self._groups.pop(subscriber.kind, None)

    def subscribe_events(self, *, snapshot: bool) -> EventQueue:
        """A queue of job events for an in-process consumer, with the same
        bounds as a stream's; owed every live job's latest event if `snapshot`
        (the jobs fixed now, so nothing falls between; the events made by the
        consumer's task as it reads)."""
        queue = EventQueue(
            max_pending=self._max_pending,
            max_pending_bytes=self._max_pending_bytes,
            stats=self.stats,
        )
        if snapshot and (live := self._live_entries()):
            owed = OwedSnapshot(live, _queued_event)
            queue.owe(owed.made, len(owed))
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

    async def snapshot_batches(self) -> list[bytes]:
        """The current state as JobSummarySignalList batches (docs/architecture.md
        section 2), composed in slices as a List subscriber's snapshot is."""
        compose = self._list_snapshot()
        return [batch for _, batch, _ in await compose()]

    def _owe_list_snapshot(self, subscriber: Subscriber) -> None:
        # At least one batch, even for an empty cluster.
        subscriber.owe(self._list_snapshot(), max(1, self._jobs.live_job_count()))

    def _list_snapshot(self) -> ComposeSnapshot[bytes]:
        """What composes the batches of the live jobs as they are now: each
        job's signal in slices, then the batches, one checkpoint after each."""
        report_time = self._now_ms()
        owed = OwedSnapshot(self._live_entries(), self._list_signal)

        async def compose() -> list[QueueEntry]:
            signals = await owed.made()
            batches = self._batches(signals, report_time)
            return [(UNIQUE, batch, None) for batch in await sliced(batches)]

        return compose

    def _batches(self, signals: Sequence[_ListSignal], report_time: int) -> Iterator[bytes]:
        """Pack signals into batches of at most `batch_npus` NPUs (and the message
        size limit); a job larger than that goes alone, with an empty HcclJson.
        Every batch carries the same ReportTime and JobTotalNum, the jobs that
        could be encoded."""
        total = len(signals)
        batch: list[bytes] = []
        batch_npus = batch_bytes = 0
        for item in signals:
            npus, signal = item.npus, item.signal
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

    def _live_entries(self) -> list[tuple[JobKey, EncodedJob]]:
        """The owner's live jobs, but those dropped, each with its cache entry:
        reused while it holds the very object the owner does, else made anew."""
        encoded, dropped = self._encoded, self._dropped
        entries: list[tuple[JobKey, EncodedJob]] = []
        still_dropped: list[JobKey] = []
        for key, job in self._jobs.live_items():
            if dropped and dropped.get(key) is job:
                still_dropped.append(key)
                continue
            entry = encoded.get(key)
            if entry is None or entry.job is not job:
                entry = encoded[key] = EncodedJob(job)
            entries.append((key, entry))
        if len(encoded) > len(entries) or len(dropped) > len(still_dropped):
            # The owner changed jobs without publishing their events (a store
            # update that failed half-way): forget what was derived from them.
            live = {key for key, _ in entries}
            self._encoded = {key: entry for key, entry in encoded.items() if key in live}
            self._dropped = {key: dropped[key] for key in still_dropped}
        return entries

    def _signal(self, event: EncodedJob) -> bytes:
        if event.encoded is None:
            event.encoded = self._encode(event.job, event.uuid)
        return event.encoded

    def _snapshot_entry(self, live: tuple[JobKey, EncodedJob]) -> QueueEntry | None:
        """A snapshot's entry for a live job, or None, and the job dropped, if it
        cannot be encoded."""
        key, event = live
        signal = event.encoded
        if signal is None:  # (the common case is the cached encoding of a published event)
            signal = self._snapshot_signal(key, event)
        return None if signal is None else (key, signal, None)

    def _list_signal(self, live: tuple[JobKey, EncodedJob]) -> _ListSignal | None:
        """A live job's signal for a List snapshot (without its rank table above
        `batch_npus`), or None as for `_snapshot_entry`."""
        key, event = live
        npus = event.job.npu_count
        stripped = npus > self._batch_npus
        signal = None if stripped else event.encoded
        if signal is None:
            signal = self._snapshot_signal(key, event, stripped=stripped)
        return None if signal is None else _ListSignal(npus, signal)

    def _snapshot_signal(
        self, key: JobKey, event: EncodedJob, *, stripped: bool = False
    ) -> bytes | None:
        """The event's signal (without its rank table if `stripped`) for a snapshot,
        or None, and the job dropped, if it cannot be encoded."""
        try:
            if stripped:
                return encode_signal(event.job, event.uuid, strip_rank_table=True)
            return self._signal(event)
        except Exception:
            self._drop(key, event, "snapshot")
            return None

    def _drop(self, key: JobKey, event: EncodedJob, step: str) -> None:
        """Leave out an event that cannot be sent (called from an `except` block):
        snapshots skip the job until its next event, instead of tripping over it again."""
        if self._encoded.get(key) is event:
            del self._encoded[key]
            self._dropped[key] = event.job
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
        # Headroom for the list wrapper (tag, length, ReportTime, JobTotalNum).
        room = self._max_message_bytes - 64
        # A table of more characters than that is more bytes still: stripped
        # without encoding it first.
        if len(job.hccl_json) <= room:
            signal = encode_signal(job, event_uuid)
            if len(signal) <= room:
                return signal
        self.stats.rank_tables_stripped += 1
        return encode_signal(job, event_uuid, strip_rank_table=True)

    def _now_ms(self) -> int:
        return int(self._wall_clock() * 1000)


@dataclass(frozen=True, slots=True)
class _ListSignal:
    """A job's signal in a List snapshot, and its NPUs (which batch it fits)."""

    npus: int
    signal: bytes

    def __len__(self) -> int:  # what composing it cost, for the slice budget
        return len(self.signal)


def _queued_event(live: tuple[JobKey, EncodedJob]) -> tuple[Hashable, QueuedEvent, float | None]:
    """An in-process consumer's snapshot entry for a live job."""
    key, event = live
    return key, QueuedEvent(event.job, event.uuid), None
