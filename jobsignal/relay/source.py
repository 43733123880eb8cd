"""The relay source: an upstream `job.Job` server's List stream, followed into RelayedJobs.

It works behind the same interface as the Kubernetes watcher (jobsignal/source.py):
the relayed jobs own the state the broadcaster serves, each step's events go
to `publish` before the next checkpoint, and `SourceStatus` says ready, in
sync or out of touch. Per connection: Register with the configured role,
SubscribeJobSummarySignalList, take the snapshot (every batch until
JobTotalNum signals) into a `Resync` and apply the difference, then apply
each live message. On any failure the last state keeps being served, the
connection is tried again after a backoff, and health turns NOT_SERVING only
when the upstream stays lost for the grace period. docs/architecture.md
section 4, "Relaying another server".
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

import trio
import trio.lowlevel

from jobsignal.logs import RateLimitedLog
from jobsignal.relay.settings import RelaySettings
from jobsignal.relay.state import MAX_JOBS, RelayedJobs, Resync
from jobsignal.relay.upstream import UpstreamConnection, UpstreamError, open_upstream
from jobsignal.relay.wire import Malformed, SignalList, decode_list
from jobsignal.source import Publish
from jobsignal.status import SourceStatus
from jobsignal.store.jobs import Changes
from jobsignal.util.backoff import Backoff
from jobsignal.util.text import quote

log = logging.getLogger(__name__)

# Work between two checkpoints while a snapshot is taken in: characters of
# signals checked, and jobs of the difference applied (their events published
# in the same step), as the watcher slices a LIST (kube/watcher.py).
PARSE_SLICE = 256 * 1024
COMMIT_SLICE = 1000


class ListStream(Protocol):
    """A SubscribeJobSummarySignalList call: its messages, encoded."""

    async def receive(self) -> bytes:
        """The next message; UpstreamError when the call or the connection ends."""
        ...


OpenStream = Callable[[], AbstractAsyncContextManager[ListStream]]


@dataclass
class RelayCounters:
    # Connections that got as far as the subscription.
    subscriptions: int = 0
    snapshots: int = 0
    messages: int = 0
    # Upstream connections ended, by UpstreamError reason ("internal": a bug, logged).
    upstream_errors: Counter[str] = field(default_factory=Counter)
    # Whole messages refused, by reason.
    messages_rejected: Counter[str] = field(default_factory=Counter)
    # Signals refused, by reason: RelayedJobs.rejected_total.
    signals_rejected: Counter[str] = field(default_factory=Counter)


class _Subscription:
    """The List call on an upstream connection, as a `ListStream`."""

    def __init__(self, connection: UpstreamConnection, call_id: int) -> None:
        self._connection = connection
        self._call_id = call_id

    async def receive(self) -> bytes:
        return await self._connection.receive(self._call_id)


def stream_opener(settings: RelaySettings, context: ssl.SSLContext | None) -> OpenStream:
    """What opens the upstream subscription: connect, Register as the role, subscribe."""

    @asynccontextmanager
    async def open_stream() -> AsyncIterator[ListStream]:
        async with open_upstream(settings, context) as connection:
            client_id = await connection.register(settings.role)
            call_id = await connection.subscribe_list(settings.role, client_id)
            yield _Subscription(connection, call_id)

    return open_stream


class Relay:
    def __init__(
        self,
        open_stream: OpenStream,
        jobs: RelayedJobs,
        publish: Publish,
        status: SourceStatus,
        settings: RelaySettings,
        *,
        wall_clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self._open_stream = open_stream
        self._jobs = jobs
        self._publish_events = publish
        self._status = status
        self._settings = settings
        self._wall_clock = wall_clock
        self._rng = rng
        self.counters = RelayCounters(signals_rejected=jobs.rejected_total)
        self._faults = RateLimitedLog(log)
        self._grace: trio.CancelScope | None = None
        self._problem = ""
        self._where = settings.address if settings.upstream is not None else "upstream"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the upstream forever. Starts at once: readiness comes via SourceStatus."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            backoff = Backoff(self._settings.backoff_initial, self._settings.backoff_max, self._rng)
            while True:
                try:
                    async with self._open_stream() as stream:
                        self.counters.subscriptions += 1
                        log.info("subscribed to %s as %s", self._where, self._settings.role)
                        await self._follow(stream, backoff)
                except UpstreamError as error:
                    reason, problem = error.reason, str(error)
                except Exception:
                    # A fault not foreseen (a bug here or in a dependency): the relay
                    # serves every subscriber, so it must not end.
                    reason, problem = "internal", "unexpected error (logged)"
                    self._faults.error("internal", "relay failed unexpectedly", exc_info=True)
                self.counters.upstream_errors[reason] += 1
                self._lost(nursery, f"upstream {self._where}: {problem}")
                delay = backoff.next_delay()
                self._faults.warning(
                    f"upstream_{reason}",
                    "upstream %s: %s; serving the last state, reconnecting in %.1fs",
                    self._where,
                    problem,
                    delay,
                )
                await trio.sleep(delay)

    async def _follow(self, stream: ListStream, backoff: Backoff) -> None:
        """One subscription: the snapshot, then live messages, until it fails."""
        await self._take_snapshot(stream)
        backoff.reset()  # a snapshot applied ends an outage
        while True:
            batch = await self._next_batch(stream, live=True)
            if batch is None:
                continue
            for signal in batch.signals:
                self._publish(self._jobs.apply(signal))
            self._status.mark_synced(self._wall_clock())

    async def _take_snapshot(self, stream: ListStream) -> None:
        """The stream's first batches, until JobTotalNum signals, made the relayed state."""
        resync: Resync | None = None
        work = 0
        while resync is None or not resync.complete:
            batch = await self._next_batch(stream, live=False)
            assert batch is not None
            if resync is None:
                if batch.job_total > MAX_JOBS:
                    self.counters.messages_rejected["bad_total"] += 1
                    raise UpstreamError(
                        "snapshot", f"JobTotalNum {batch.job_total} is over {MAX_JOBS}"
                    )
                resync = self._jobs.resync(batch.job_total)
            for signal in batch.signals:
                self._report(resync.add(signal))
                work += len(signal)
                if work >= PARSE_SLICE:
                    work = 0
                    await trio.lowlevel.checkpoint()
        await self._commit(resync)

    async def _next_batch(self, stream: ListStream, *, live: bool) -> SignalList | None:
        """The stream's next message, decoded; a malformed one is counted, then
        skipped (None) if `live`, else the end of the connection: a snapshot batch
        lost takes the count of jobs still to come with it."""
        data = await stream.receive()
        self.counters.messages += 1
        try:
            return decode_list(data)
        except Malformed as error:
            self.counters.messages_rejected[error.reason] += 1
            if not live:
                raise UpstreamError("protocol", f"a snapshot batch: {error}") from None
            self._faults.warning(error.reason, "upstream message skipped: %s", error)
            return None

    async def _commit(self, resync: Resync) -> None:
        now = self._wall_clock()
        events = 0
        while True:
            changes, done = resync.commit(now, COMMIT_SLICE)
            self._publish(changes)
            events += len(changes.events)
            if done:
                break
            await trio.lowlevel.checkpoint()
        self.counters.snapshots += 1
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self._status.mark_list_applied()
        if self._status.ready.is_set():
            self._status.mark_synced(now)
        else:
            self._status.mark_ready(now)
        log.info(
            "upstream %s: snapshot of %d jobs applied, %d job events, %d live jobs",
            self._where,
            resync.received,
            events,
            self._jobs.live_job_count(),
        )

    def _lost(self, nursery: trio.Nursery, problem: str) -> None:
        """The upstream is out of reach: health goes NOT_SERVING once it stays so
        for the grace period (unless a snapshot is applied first)."""
        self._problem = problem
        if self._grace is None:
            self._grace = trio.CancelScope()
            nursery.start_soon(self._expire_grace, self._grace)

    async def _expire_grace(self, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(self._settings.grace)
            log.warning(
                "upstream lost for %gs: health %s NOT_SERVING (%s)",
                self._settings.grace,
                "jobsignal.KubernetesSync",
                self._problem,
            )
            self._status.mark_unreachable(self._problem)

    def _report(self, changes: Changes) -> None:
        for problem in changes.rejected:
            self._faults.warning(problem.reason, "upstream signal rejected: %s", problem)

    def _publish(self, changes: Changes) -> None:
        self._report(changes)
        if changes.events:
            self._publish_events(changes.events, trio.current_time())
        for job in changes.events:
            log.debug(
                "job event: %s/%s %s %s (uuid %s)",
                quote(job.namespace, 80),
                quote(job.job_name, 80),
                job.job_status,
                job.operator,
                job.event_uuid,
            )
