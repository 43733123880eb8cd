"""JobStore: the pure heart of jobsignal. ConfigMap events in, job events out.

It keeps every job-summary ConfigMap as a parsed slice, groups slices by job
(namespace + job_id), and after each change recomputes the affected jobs. A
job event is emitted only when a job's slices form a complete, agreeing set
whose client-visible state differs from what was last emitted, or when a job
loses a ConfigMap (deleted, no longer selected, missing after a relist) and
has not yet been reported as deleted. Because events come from comparing
states, a relist emits exactly the differences, and the same input never
yields the same event twice.

Work per event is proportional to the change, not to the job: each job keeps
tallies (`JobSlices`) that say in constant time whether its slices agree, so
the rank table is joined only when a complete set changes, and an unchanged
rewrite costs one comparison. A relist is applied in steps (`Relist`, then
`settle`) that a caller can interleave with checkpoints; `replace_all` does
all steps at once.

The store owns the latest state of every job (docs/architecture.md section
4, "Who owns the job state"): the broadcaster builds snapshots from
`live_items()` and keeps no copy of its own.
"""

from __future__ import annotations

import json
import operator
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from jobsignal.store.configmap import (
    SERVER_LIST_SLOT,
    BadConfigMap,
    ConfigMapRef,
    JobFields,
    Slice,
    configmap_ref,
    parse_slice,
)
from jobsignal.store.model import JobKey, JobSummary
from jobsignal.util.text import quote

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"

# Jobs are recomputed in (namespace, job_id) order, so events come in a stable order.
_KEY_ORDER = operator.attrgetter("namespace", "job_id")

Header = tuple[tuple[str, str], ...]


@dataclass
class Changes:
    """What one store update produced: job events, in order, and rejected input."""

    events: list[JobSummary] = field(default_factory=list)
    rejected: list[BadConfigMap] = field(default_factory=list)
    # Those of `events` served without HcclJson: the rank table joined from the
    # job's ConfigMaps would be over MAX_JOINED_RANK_TABLE_CHARS.
    tables_over_cap: list[JobSummary] = field(default_factory=list)

    def extend(self, other: Changes) -> None:
        self.events += other.events
        self.rejected += other.rejected
        self.tables_over_cap += other.tables_over_cap


def checked_parse(
    configmap: Mapping[str, Any], ref: ConfigMapRef, previous: Slice | None = None
) -> Slice:
    """`parse_slice`, with any unexpected error turned into a rejection of this ConfigMap.
    `previous` is the slice this version replaces (its unchanged rank table is reused)."""
    try:
        return parse_slice(configmap, previous)
    except BadConfigMap:
        raise
    except Exception as error:  # a parser bug must reject one ConfigMap, not end the watcher
        rejection = BadConfigMap("internal_error", f"{ref}: {type(error).__name__} while parsing")
        raise rejection from error


class JobSlices:
    """The ConfigMaps of one job, with tallies that tell in O(1) whether they agree.

    The slices form the job when no two share a cm_index, index 0 is there,
    exactly `total` slices carry index 0's job fields (being valid, they then
    hold indices 0..total-1; others, past the end, are ignored) and those
    slices carry at most one distinct rank-table header.
    """

    __slots__ = ("_at_index", "_duplicated", "_fields", "_headers", "members", "table_over_cap")

    def __init__(self) -> None:
        self.members: dict[ConfigMapRef, Slice] = {}
        self._at_index: dict[int, list[Slice]] = {}
        self._duplicated = 0  # indices claimed by more than one slice
        # Plain dicts, not Counters: a relist creates one of these per job.
        self._fields: dict[JobFields, int] = {}
        self._headers: dict[JobFields, dict[Header, int]] = {}
        # The last `state()` left out a joined rank table over the cap.
        self.table_over_cap = False

    def __len__(self) -> int:
        return len(self.members)

    def add(self, piece: Slice) -> None:
        assert piece.ref not in self.members
        self.members[piece.ref] = piece
        holders = self._at_index.setdefault(piece.cm_index, [])
        holders.append(piece)
        if len(holders) == 2:
            self._duplicated += 1
        fields = piece.fields
        self._fields[fields] = self._fields.get(fields, 0) + 1
        if piece.header is not None:
            headers = self._headers.setdefault(fields, {})
            headers[piece.header] = headers.get(piece.header, 0) + 1

    def remove(self, ref: ConfigMapRef) -> Slice:
        piece = self.members.pop(ref)
        holders = self._at_index[piece.cm_index]
        holders.remove(piece)
        if len(holders) == 1:
            self._duplicated -= 1
        elif not holders:
            del self._at_index[piece.cm_index]
        _decrement(self._fields, piece.fields)
        if piece.header is not None:
            headers = self._headers[piece.fields]
            _decrement(headers, piece.header)
            if not headers:
                del self._headers[piece.fields]
        return piece

    def state(self) -> JobSummary | None:
        """The job these slices describe, or None while they are incomplete or disagree."""
        if self._duplicated:
            return None  # two ConfigMaps claim one index: wait for ClusterD to settle
        firsts = self._at_index.get(0)
        if not firsts:
            return None
        first = firsts[0]
        fields = first.fields
        if self._fields.get(fields) != fields.total:
            return None
        headers = self._headers.get(fields)
        if headers is not None and len(headers) > 1:
            return None  # slices from different rewrites of the rank table
        pieces = [self._at_index[index][0] for index in range(fields.total)]
        header = next(iter(headers)) if headers else None
        state, self.table_over_cap = _summary(first, pieces, header)
        return state


def _decrement(counts: dict[Any, int], key: Any) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


def assemble(slices: Iterable[Slice]) -> JobSummary | None:
    """The job a set of slices (of distinct ConfigMaps) describes, or None while
    they are incomplete or disagree."""
    group = JobSlices()
    for piece in slices:
        group.add(piece)
    return group.state()


def _summary(first: Slice, pieces: list[Slice], header: Header | None) -> tuple[JobSummary, bool]:
    """The job's state, and whether its joined rank table was left out (over the cap)."""
    total = first.fields.total
    joined: str | None = ""
    if total == 1:
        joined = first.hccl_raw
    elif header is not None:
        joined = _join_rank_table(header, pieces)
    f = first.fields
    summary = JobSummary(
        namespace=first.ref.namespace,
        job_id=f.job_id,
        job_name=f.job_name,
        framework=f.framework,
        job_status=f.job_status,
        time=f.time,
        total=str(total),
        hccl_json=joined or "",
        delete_time=f.delete_time,
        shared_tor_ip=f.shared_tor_ip,
        master_addr=f.master_addr,
        operator=f.operator,
        sid=f.sid,
        npu_count=sum(s.npu_count for s in pieces),
    )
    return summary, joined is None


# A whole job's rank table joined from its slices is at most this long; a
# larger one (only a hostile job: 4,096 ConfigMaps of up to 1 MiB each) is
# served with an empty HcclJson, as events over the send limit are, instead of
# doubling the memory its slices already take.
MAX_JOINED_RANK_TABLE_CHARS = 64 * 1024 * 1024


def _join_rank_table(header: Header, pieces: list[Slice]) -> str | None:
    """The whole rank table, or None when it would be over MAX_JOINED_RANK_TABLE_CHARS."""
    size = sum(len(server) + 1 for piece in pieces for server in piece.servers)
    if size > MAX_JOINED_RANK_TABLE_CHARS:
        return None
    servers = ",".join(server for piece in pieces for server in piece.servers)
    parts = []
    for key, value in header:
        encoded_key = json.dumps(key, ensure_ascii=False)
        if value == SERVER_LIST_SLOT:
            parts.append(f"{encoded_key}:[{servers}]")
        else:
            parts.append(f"{encoded_key}:{value}")
    return "{" + ",".join(parts) + "}"


@dataclass(slots=True)
class _Pending:
    """A job whose slices changed in a relist and whose state is not recomputed yet."""

    lost: bool  # it lost a ConfigMap: a delete is due unless its slices still form it
    now: float  # the relist's time, for the deleteTime of such a delete


class JobStore:
    def __init__(self) -> None:
        self._slices: dict[ConfigMapRef, Slice] = {}
        self._jobs: dict[JobKey, JobSlices] = {}
        # Last state emitted per job, including jobs reported deleted whose
        # ConfigMaps still exist (ClusterD removes them a minute or two later).
        # The one record of the jobs' latest state: snapshots are built from it.
        self._emitted: dict[JobKey, JobSummary] = {}
        self._live_count = 0  # entries of _emitted not reported deleted
        # Jobs a relist changed, recomputed by `settle` in key order.
        self._pending: dict[JobKey, _Pending] = {}
        self._pending_order: deque[JobKey] = deque()
        self.rejected_total: Counter[str] = Counter()

    # -- queries -----------------------------------------------------------

    def live_jobs(self) -> list[JobSummary]:
        """Current state of every job not reported as deleted, in first-seen order."""
        return [job for job in self._emitted.values() if not job.is_deleted]

    def live_items(self) -> Iterator[tuple[JobKey, JobSummary]]:
        """`live_jobs()` with their keys, lazily: consume it before the store changes."""
        return ((key, job) for key, job in self._emitted.items() if not job.is_deleted)

    def live_job_count(self) -> int:
        return self._live_count

    def configmap_count(self) -> int:
        return len(self._slices)

    def job_count(self) -> int:
        """Jobs with at least one ConfigMap (complete or not)."""
        return len(self._jobs)

    @property
    def pending(self) -> int:
        """Jobs changed by a relist and not yet recomputed (see `settle`)."""
        return len(self._pending)

    # -- updates -----------------------------------------------------------

    def apply(self, event_type: str, configmap: Mapping[str, Any], now: float) -> Changes:
        """Apply one watch event (ADDED, MODIFIED or DELETED). `now` is Unix seconds."""
        changes = Changes()
        try:
            ref = configmap_ref(configmap)
        except BadConfigMap as error:
            self.reject(changes, error)
            return changes
        old = self._slices.get(ref)
        old_key = {JobKey(ref.namespace, old.fields.job_id)} if old is not None else set()
        if event_type == DELETED:
            self._settle_keys(old_key, changes)
            lost = self._remove(ref)
            self._recompute(lost, now, changes, lost=lost)
            return changes
        if event_type not in (ADDED, MODIFIED):
            detail = f"{ref}: event type {quote(event_type)}"
            self.reject(changes, BadConfigMap("bad_event", detail))
            return changes
        try:
            new_slice = checked_parse(configmap, ref, old)
        except BadConfigMap as error:
            # Keep the last good version: a bad rewrite must not end a job.
            self.reject(changes, error)
            return changes
        if old == new_slice:
            return changes  # an unchanged rewrite: no job changed
        new_key = JobKey(ref.namespace, new_slice.fields.job_id)
        # A relist's changes to these jobs come first, so events keep their order.
        self._settle_keys(old_key | {new_key}, changes)
        lost = self._remove(ref)
        self._insert(new_slice)
        lost.discard(new_key)
        self._recompute(lost | {new_key}, now, changes, lost=lost)
        return changes

    def relist(self, namespace: str | None = None) -> Relist:
        """Start applying a fresh LIST (of one namespace, or of all): see `Relist`."""
        return Relist(self, namespace)

    def settle(self, budget: int | None = None) -> Changes:
        """Recompute jobs a relist changed, about `budget` slices' worth (all if None).

        Jobs come in key order; a job counts as many slices as it has
        ConfigMaps, so one call joins at most about `budget` slices' tables.
        """
        changes = Changes()
        spent = 0
        while self._pending_order and (budget is None or spent < budget):
            key = self._pending_order.popleft()
            if key in self._pending:  # else an event already settled it
                group = self._jobs.get(key)
                spent += max(1, len(group) if group is not None else 0)
                self._settle_keys((key,), changes)
        if not self._pending:
            self._pending_order.clear()
        return changes

    def replace_all(
        self, configmaps: Iterable[Mapping[str, Any]], now: float, namespace: str | None = None
    ) -> Changes:
        """Make the store hold exactly `configmaps` (a fresh LIST); emit the differences.

        With `namespace`, only that namespace's ConfigMaps are replaced (one
        LIST per watched namespace); listed objects from elsewhere are ignored.
        """
        relist = self.relist(namespace)
        for configmap in configmaps:
            relist.add(configmap)
        relist.commit(now)
        changes = Changes(rejected=relist.rejected)
        changes.extend(self.settle())
        return changes

    # -- internals ---------------------------------------------------------

    def reject(self, changes: Changes, error: BadConfigMap) -> None:
        """Count a rejected ConfigMap and report it in `changes`."""
        self.rejected_total[error.reason] += 1
        changes.rejected.append(error)

    def _diff(
        self, namespace: str | None, fresh: dict[ConfigMapRef, Slice], listed: set[ConfigMapRef]
    ) -> list[tuple[ConfigMapRef, Slice | None]]:
        """What makes the namespace hold exactly `fresh`: (ConfigMap, new slice or None)."""
        # A listed but malformed ConfigMap still exists: keep its last good slice.
        for ref in listed - fresh.keys():
            if ref in self._slices:
                fresh[ref] = self._slices[ref]
        diff: list[tuple[ConfigMapRef, Slice | None]] = []
        for ref, old in self._slices.items():
            if namespace is None or ref.namespace == namespace:
                new = fresh.get(ref)
                if new != old:
                    diff.append((ref, new))
        diff += [(ref, new) for ref, new in fresh.items() if ref not in self._slices]
        return diff

    def _replace(
        self,
        changes: Iterable[tuple[ConfigMapRef, Slice | None]],
        affected: set[JobKey],
        lost: set[JobKey],
    ) -> None:
        """Apply part of a `_diff`, collecting the jobs it changed and those that lost one."""
        for ref, new in changes:
            old = self._slices.get(ref)
            if old is not None:
                affected |= self._remove(ref)
                if new is None or new.fields.job_id != old.fields.job_id:
                    lost.add(JobKey(ref.namespace, old.fields.job_id))
            if new is not None:
                self._insert(new)
                affected.add(JobKey(ref.namespace, new.fields.job_id))

    def _insert(self, new_slice: Slice) -> None:
        self._slices[new_slice.ref] = new_slice
        key = JobKey(new_slice.ref.namespace, new_slice.fields.job_id)
        group = self._jobs.get(key)
        if group is None:
            group = self._jobs[key] = JobSlices()
        group.add(new_slice)

    def _remove(self, ref: ConfigMapRef) -> set[JobKey]:
        """Forget a ConfigMap; return the job it belonged to (empty if unknown)."""
        old = self._slices.pop(ref, None)
        if old is None:
            return set()
        key = JobKey(ref.namespace, old.fields.job_id)
        group = self._jobs[key]
        group.remove(ref)
        if not group:
            del self._jobs[key]
        return {key}

    def _mark_pending(self, keys: Iterable[JobKey], now: float, *, lost: set[JobKey]) -> None:
        for key in sorted(keys, key=_KEY_ORDER):
            pending = self._pending.get(key)
            if pending is None:
                self._pending[key] = _Pending(key in lost, now)
                self._pending_order.append(key)
            else:
                pending.lost = pending.lost or key in lost
                pending.now = now

    def _settle_keys(self, keys: Iterable[JobKey], changes: Changes) -> None:
        """Recompute those of `keys` a relist left pending."""
        for key in keys:
            pending = self._pending.pop(key, None)
            if pending is not None:
                lost = {key} if pending.lost else set()
                self._recompute_one(key, pending.now, changes, lost=lost)

    def _recompute(
        self, keys: Iterable[JobKey], now: float, changes: Changes, *, lost: set[JobKey]
    ) -> None:
        for key in sorted(keys, key=_KEY_ORDER):
            self._recompute_one(key, now, changes, lost=lost)

    def _recompute_one(
        self, key: JobKey, now: float, changes: Changes, *, lost: set[JobKey]
    ) -> None:
        group = self._jobs.get(key)
        state = group.state() if group is not None else None
        previous = self._emitted.get(key)
        if state is not None:
            if state != previous:
                self._record(key, previous, state)
                # A delete matters only to clients that saw the job live; a
                # job first seen already deleted is recorded silently.
                if not state.is_deleted or (previous is not None and not previous.is_deleted):
                    self._emit(changes, state)
                    if group is not None and group.table_over_cap:
                        changes.tables_over_cap.append(state)
        elif key in lost and previous is not None and not previous.is_deleted:
            ended = previous.as_deleted(str(int(now)))
            self._record(key, previous, ended)
            self._emit(changes, ended)
        if group is None:
            self._record(key, self._emitted.get(key), None)

    def _record(self, key: JobKey, previous: JobSummary | None, state: JobSummary | None) -> None:
        """Make `state` the job's last emitted state (None: forget the job)."""
        if previous is not None and not previous.is_deleted:
            self._live_count -= 1
        if state is None:
            self._emitted.pop(key, None)
        else:
            self._emitted[key] = state
            if not state.is_deleted:
                self._live_count += 1

    def _emit(self, changes: Changes, state: JobSummary) -> None:
        changes.events.append(state)


class Relist:
    """A fresh LIST applied in steps, so a caller can checkpoint between them.

    `add` parses one listed ConfigMap (no store change yet, so a LIST that
    fails half-way changes nothing); `commit` makes the store hold exactly
    what was added, a slice of ConfigMaps per call if asked to, and leaves the
    changed jobs to `JobStore.settle`. Between two commit steps only this
    namespace is half-updated, and no job of it is recomputed: its jobs are
    marked for `settle` only once the last step is done.
    """

    def __init__(self, store: JobStore, namespace: str | None) -> None:
        self._store = store
        self._namespace = namespace
        self._fresh: dict[ConfigMapRef, Slice] = {}
        self._listed: set[ConfigMapRef] = set()
        self._diff: deque[tuple[ConfigMapRef, Slice | None]] | None = None
        self._affected: set[JobKey] = set()
        self._lost: set[JobKey] = set()
        self.rejected: list[BadConfigMap] = []

    def add(self, configmap: Mapping[str, Any]) -> int:
        """Parse one listed ConfigMap; returns the size of its rank table, a measure of the work."""
        assert self._diff is None, "add after commit"
        data = configmap.get("data")
        table = data.get("hccl.json") if isinstance(data, Mapping) else None
        work = 1 + (len(table) if isinstance(table, str) else 0)
        try:
            ref = configmap_ref(configmap)
            if self._namespace is not None and ref.namespace != self._namespace:
                return work
            self._listed.add(ref)
            self._fresh[ref] = checked_parse(configmap, ref, self._store._slices.get(ref))
        except BadConfigMap as error:
            changes = Changes()
            self._store.reject(changes, error)
            self.rejected += changes.rejected
        return work

    def commit(self, now: float, budget: int | None = None) -> bool:
        """Replace about `budget` of the namespace's ConfigMaps (all if None).

        True once the store holds exactly what was added (the changed jobs
        then wait for `JobStore.settle`); call again while False.
        """
        store = self._store
        if self._diff is None:
            self._diff = deque(store._diff(self._namespace, self._fresh, self._listed))
            self._fresh, self._listed = {}, set()
        diff = self._diff
        count = len(diff) if budget is None else min(budget, len(diff))
        store._replace((diff.popleft() for _ in range(count)), self._affected, self._lost)
        if diff:
            return False
        if self._affected or self._lost:
            store._mark_pending(self._affected | self._lost, now, lost=self._lost)
            self._affected, self._lost = set(), set()
        return True
