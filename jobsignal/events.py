"""Job events for trio programs that embed jobsignal, and the channel that delivers them.

`JobEvent`, `JobState` and `RankTable` are plain frozen dataclasses (no
protobuf): what a gRPC client would get in a `JobSummarySignal`, with the
rank table parsed only when asked for. `JobEvents` is a trio receive channel
over one in-process queue of the broadcaster, the same bounded, coalescing
queue a gRPC stream has (docs/architecture.md section 6): a consumer that falls
hopelessly behind gets `FellBehind` instead of holding memory or delaying the
watcher.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.lowlevel

from jobsignal.fanout.broadcaster import Broadcaster
from jobsignal.fanout.subscriber import EndReason, EventQueue, QueuedEvent
from jobsignal.store import strict_json
from jobsignal.store.model import JobSummary, SignalFields


class EventKind(enum.Enum):
    """What happened to the job, as seen by this consumer."""

    ADDED = "added"
    CHANGED = "changed"
    DELETED = "deleted"


@dataclass(frozen=True, slots=True)
class RankDevice:
    """One NPU of a server in the rank table: its id, IP and global rank."""

    device_id: str
    device_ip: str
    rank_id: str


@dataclass(frozen=True, slots=True)
class RankServer:
    """One server of the rank table and its NPUs, in the table's order."""

    server_id: str
    devices: tuple[RankDevice, ...]


@dataclass(frozen=True, slots=True)
class RankTable:
    """A job's HCCL rank table: `status`, the servers and their devices.

    Scalars are given as text whatever JSON type ClusterD used, missing ones
    as "". `raw` is the whole decoded document, unknown keys included.
    """

    status: str
    servers: tuple[RankServer, ...]
    raw: Mapping[str, Any] = field(compare=False, hash=False, repr=False)

    @property
    def npu_count(self) -> int:
        return sum(len(server.devices) for server in self.servers)


def _text(value: object) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)


def parse_rank_table(text: str) -> RankTable | None:
    """The rank table in `text` (a job's hccl.json), or None when there is none.

    The store let only strict JSON objects with a list of server objects
    through, so this does not fail on what jobsignal delivers.
    """
    if not text.strip():
        return None  # no table, or stripped because it was too big to send
    document = strict_json.loads(text)
    if not isinstance(document, dict):
        raise ValueError("hccl.json is not a JSON object")
    servers = []
    for server in document.get("server_list", ()):
        if not isinstance(server, dict):
            raise ValueError("server_list holds something other than objects")
        devices = server.get("device", ())
        servers.append(
            RankServer(
                server_id=_text(server.get("server_id")),
                devices=tuple(
                    RankDevice(
                        _text(device.get("device_id")),
                        _text(device.get("device_ip")),
                        _text(device.get("rank_id")),
                    )
                    for device in (devices if isinstance(devices, list) else ())
                    if isinstance(device, dict)
                ),
            )
        )
    return RankTable(_text(document.get("status")), tuple(servers), document)


# A JobSummary's SignalFields values, in their order.
_signal_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(SignalFields)))


@dataclass(frozen=True, slots=True)
class JobState(SignalFields):
    """A job as its last event describes it: the fields of a `JobSummarySignal`.

    Text as ClusterD wrote it: `job_status` pending, running, complete or
    failed; `operator` add or delete; `time` and `delete_time` Unix seconds;
    `total` the number of the job's ConfigMaps; `hccl_json` the whole rank
    table (see `rank_table()`).
    """

    @classmethod
    def of(cls, job: JobSummary) -> JobState:
        return cls(*_signal_fields(job))

    @property
    def key(self) -> tuple[str, str]:
        """(namespace, job_id): ClusterD's identity of a job."""
        return self.namespace, self.job_id

    def rank_table(self) -> RankTable | None:
        """The rank table, parsed now (each call parses again: keep the result)."""
        return parse_rank_table(self.hccl_json)


@dataclass(frozen=True, slots=True)
class JobEvent:
    """One job event: what happened, the job's state after it, and its uuid.

    `uuid` is the one a gRPC client gets for the same event: derived from the
    state, so every replica and every restart gives it the same id (a relay's:
    its upstream's, passed on).
    """

    kind: EventKind
    uuid: str
    job: JobState

    def rank_table(self) -> RankTable | None:
        return self.job.rank_table()


class FellBehind(trio.BrokenResourceError):
    """The consumer fell too far behind the cluster: its queue held more than
    its bound even after coalescing, so it was dropped. Start over (a new
    subscription begins with the current state)."""


class JobEvents(trio.abc.ReceiveChannel[JobEvent]):
    """A receive channel of job events; `async for event in events` reads it.

    Per job, events arrive in the order they happened; when the consumer lags,
    older events of a job it has not read yet are dropped in favour of the
    newest (each carries the whole state). `kind` is relative to what this
    channel delivered: the first event of a job is ADDED, then CHANGED, and
    DELETED when it ends (a job whose whole life fell into a coalesced stretch
    may appear only as DELETED). The channel ends (`EndOfChannel`) when the
    server shuts down, and raises `FellBehind` when the consumer was dropped.
    """

    def __init__(self, broadcaster: Broadcaster, *, snapshot: bool) -> None:
        self._broadcaster = broadcaster
        self._queue: EventQueue = broadcaster.subscribe_events(snapshot=snapshot)
        self._known: set[tuple[str, str]] = set()
        self._closed = False

    @property
    def pending(self) -> int:
        """Events queued for this consumer and not read yet."""
        return self._queue.pending

    async def receive(self) -> JobEvent:
        if self._closed:
            raise trio.ClosedResourceError("this JobEvents channel was closed")
        if self._queue.pending:
            await trio.lowlevel.checkpoint()  # a checkpoint, as every receive is
        batch = await self._queue.next_batch_or_end(1)
        if not batch:
            if self._closed:
                raise trio.ClosedResourceError("this JobEvents channel was closed")
            if self._queue.end_reason is EndReason.SLOW:
                raise FellBehind(
                    "the consumer fell too far behind: more events queued than"
                    " --max-pending-messages / --max-pending-bytes allow, even after"
                    " keeping only the newest per job"
                )
            raise trio.EndOfChannel
        return self._deliver(batch[0])

    def _deliver(self, queued: QueuedEvent) -> JobEvent:
        state = JobState.of(queued.job)
        key = state.key
        if queued.job.is_deleted:
            self._known.discard(key)
            kind = EventKind.DELETED
        elif key in self._known:
            kind = EventKind.CHANGED
        else:
            self._known.add(key)
            kind = EventKind.ADDED
        return JobEvent(kind, queued.uuid, state)

    def close(self) -> None:
        """Stop receiving: the broadcaster forgets this consumer and its queue."""
        if self._closed:
            return
        self._closed = True
        self._broadcaster.unsubscribe_events(self._queue)
        self._queue.end(EndReason.SHUTDOWN)

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()
