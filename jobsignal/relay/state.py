"""RelayedJobs: the relay's job state. Upstream signals in, job events out. Pure.

What the job store is to ConfigMaps (store/jobs.py), this is to an
upstream's `JobSummarySignal`s: it owns every relayed job's latest state
(the broadcaster builds snapshots from `live_items()`), and emits a job event
only when a job's client-visible state changes, so a signal repeated is not
an event twice. Each signal is checked as the store checks a ConfigMap (the
same field bounds, UTF-8, a strict-JSON rank table: `job_of`); a bad one is
rejected, counted by reason and reported, and the job keeps its last good state.

After a reconnect, the upstream's snapshot (all its batches, until
JobTotalNum signals) goes into a `Resync`, which then makes the relayed
state equal to it and emits exactly the differences: new jobs, changed
ones, and a delete (deleteTime the relay's clock, as the store does for
vanished ConfigMaps) for each job the snapshot no longer holds.
docs/architecture.md section 4, "Relaying another server".
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Iterator, Mapping

from jobsignal.relay.wire import Malformed, decode_signal
from jobsignal.store.configmap import (
    BadConfigMap,
    configmap_ref,
    rank_table_npus,
)
from jobsignal.store.jobs import MAX_JOINED_RANK_TABLE_CHARS, Changes, checked_parse
from jobsignal.store.model import JobKey, JobSummary
from jobsignal.util.text import quote

#: A uuid longer than this is refused (a UUID is 36 characters).
MAX_UUID_CHARS = 64
#: A snapshot announcing more jobs than this is refused: the relay holds them all.
MAX_JOBS = 200_000
# The name a signal's job is checked under, as if it were a ConfigMap.
_NAME = "(relayed)"
# The ConfigMap data key of each field the store checks, by JobSummary field.
_DATA_KEYS = {
    "job_id": "job_id",
    "job_name": "job_name",
    "framework": "framework",
    "job_status": "job_status",
    "time": "time",
    "total": "total",
    "delete_time": "deleteTime",
    "shared_tor_ip": "sharedTorIp",
    "master_addr": "masterAddr",
    "operator": "operator",
    "sid": "sid",
}


def job_of(values: Mapping[str, str]) -> JobSummary:
    """The job a decoded signal (`wire.decode_signal`) reports, with the upstream's
    uuid; BadConfigMap (or its `Malformed`) with a reason if it fails the store's checks."""
    data = {key: values[name] for name, key in _DATA_KEYS.items()}
    data["cm_index"] = "0"  # one signal is a whole job, whatever its total says
    configmap = {"metadata": {"namespace": values["namespace"], "name": _NAME}, "data": data}
    ref = configmap_ref(configmap)
    checked_parse(configmap, ref)  # bounds, UTF-8, job_id, total
    uuid = values["uuid"]
    if len(uuid) > MAX_UUID_CHARS:
        raise Malformed("bad_uuid", f"{ref}: uuid {quote(uuid, 80)} has {len(uuid)} characters")
    table = values["hccl_json"]
    if not table.strip():
        table = ""  # blank means no table, as in a ConfigMap
    if len(table) > MAX_JOINED_RANK_TABLE_CHARS:
        raise BadConfigMap("too_large", f"{ref}: HcclJson has {len(table)} characters")
    npus = rank_table_npus(ref, table)
    fields = {name: values[name] for name in _DATA_KEYS}
    return JobSummary(
        namespace=ref.namespace, hccl_json=table, npu_count=npus, event_uuid=uuid, **fields
    )


def same_event(previous: JobSummary, job: JobSummary) -> bool:
    """Whether `job` reports nothing new over `previous`: the same state, the same
    uuid, or the same state without its rank table (how a List snapshot carries a
    job over its batch size: docs/architecture.md section 2)."""
    if previous == job or (job.event_uuid and job.event_uuid == previous.event_uuid):
        return True
    return not job.hccl_json and previous == dataclasses.replace(job, hccl_json=previous.hccl_json)


class RelayedJobs:
    """The relayed jobs' latest states: live ones only (a delete forgets the job)."""

    def __init__(self) -> None:
        self._jobs: dict[JobKey, JobSummary] = {}
        self.rejected_total: Counter[str] = Counter()

    # -- queries (the broadcaster's `LiveJobs`) -------------------------------

    def live_items(self) -> Iterator[tuple[JobKey, JobSummary]]:
        """(key, state) of every live job, in first-seen order; consume it before a change."""
        return iter(self._jobs.items())

    def live_jobs(self) -> list[JobSummary]:
        return list(self._jobs.values())

    def live_job_count(self) -> int:
        return len(self._jobs)

    # -- updates -----------------------------------------------------------

    def apply(self, signal: bytes) -> Changes:
        """One live signal from the upstream (a list of one after the snapshot)."""
        changes = Changes()
        job = self.parse(signal, changes)[0]
        if job is not None:
            self._update(job, changes)
        return changes

    def resync(self, expected: int) -> Resync:
        """Take in a snapshot of `expected` signals: see `Resync`."""
        return Resync(self, expected)

    # -- internals ---------------------------------------------------------

    def parse(self, signal: bytes, changes: Changes) -> tuple[JobSummary | None, JobKey | None]:
        """The signal's job, or None and the rejection reported in `changes`; with
        the job's key whenever the signal names one (a rejected job keeps its state)."""
        key = None
        try:
            values = decode_signal(signal)
            key = JobKey(values["namespace"], values["job_id"])
            return job_of(values), key
        except BadConfigMap as error:
            self.rejected_total[error.reason] += 1
            changes.rejected.append(error)
        except Exception as error:  # a bug in a check must reject one signal, not stop the relay
            rejection = BadConfigMap("internal_error", f"{type(error).__name__} while parsing")
            rejection.__cause__ = error
            self.rejected_total[rejection.reason] += 1
            changes.rejected.append(rejection)
        return None, key

    def _update(self, job: JobSummary, changes: Changes) -> None:
        key = job.key
        previous = self._jobs.get(key)
        if job.is_deleted:
            if previous is None:
                return  # a delete matters only to clients that saw the job live
            del self._jobs[key]
        elif previous is not None and same_event(previous, job):
            return
        else:
            self._jobs[key] = job
        changes.events.append(job)

    def _vanished(self, listed: set[JobKey], now: float) -> list[JobSummary]:
        delete_time = str(int(now))
        return [job.as_deleted(delete_time) for key, job in self._jobs.items() if key not in listed]


class Resync:
    """The upstream's snapshot, taken in signal by signal (`add`), then made the
    relayed state in steps (`commit`) a caller can interleave with checkpoints.

    Nothing changes before the first `commit`, so a snapshot lost half-way
    (the upstream gone mid-batch) leaves the relayed state as it was.
    """

    def __init__(self, jobs: RelayedJobs, expected: int) -> None:
        self._jobs = jobs
        self.expected = expected
        self.received = 0
        self._fresh: dict[JobKey, JobSummary] = {}
        self._listed: set[JobKey] = set()  # named by the snapshot, good or not
        self._plan: deque[JobSummary] | None = None

    @property
    def complete(self) -> bool:
        return self.received >= self.expected

    def add(self, signal: bytes) -> Changes:
        """One signal of the snapshot; its rejection, if any, reported in the result."""
        changes = Changes()
        self.received += 1
        job, key = self._jobs.parse(signal, changes)
        if key is not None:
            self._listed.add(key)
        if job is not None:
            self._fresh[job.key] = job
        return changes

    def commit(self, now: float, budget: int | None = None) -> tuple[Changes, bool]:
        """Apply about `budget` jobs of the difference (all if None); the events, and
        whether the relayed state is now the snapshot's. `now` (Unix seconds) stamps
        the deletes of jobs the snapshot no longer holds."""
        jobs = self._jobs
        if self._plan is None:
            vanished = jobs._vanished(self._listed, now)
            self._plan = deque([*self._fresh.values(), *vanished])
            self._fresh, self._listed = {}, set()
        plan = self._plan
        changes = Changes()
        count = len(plan) if budget is None else min(budget, len(plan))
        for _ in range(count):
            jobs._update(plan.popleft(), changes)
        return changes, not plan
