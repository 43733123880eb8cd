"""JobStore: the pure heart of jobsignal. ConfigMap events in, job events out.

It keeps every job-summary ConfigMap as a parsed slice, groups slices by job
(namespace + job_id), and after each change recomputes the affected jobs. A
job event is emitted only when a job's slices form a complete, agreeing set
whose client-visible state differs from what was last emitted, or when a job
loses a ConfigMap (deleted, no longer selected, missing after a relist) and
has not yet been reported as deleted. Because events come from comparing
states, a relist (`replace_all`) emits exactly the differences, and the same
input never yields the same event twice.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jobsignal.store.configmap import (
    SERVER_LIST_SLOT,
    BadConfigMap,
    ConfigMapRef,
    Slice,
    configmap_ref,
    parse_slice,
)
from jobsignal.store.model import JobKey, JobSummary

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"


@dataclass
class Changes:
    """What one store update produced: job events, in order, and rejected input."""

    events: list[JobSummary] = field(default_factory=list)
    rejected: list[BadConfigMap] = field(default_factory=list)


class JobStore:
    def __init__(self) -> None:
        self._slices: dict[ConfigMapRef, Slice] = {}
        self._members: dict[JobKey, set[ConfigMapRef]] = {}
        # Last state emitted per job, including jobs reported deleted whose
        # ConfigMaps still exist (ClusterD removes them a minute or two later).
        self._emitted: dict[JobKey, JobSummary] = {}
        self.rejected_total: Counter[str] = Counter()

    # -- queries -----------------------------------------------------------

    def live_jobs(self) -> list[JobSummary]:
        """Current state of every job not reported as deleted, in first-seen order."""
        return [job for job in self._emitted.values() if not job.is_deleted]

    def live_job_count(self) -> int:
        return sum(1 for job in self._emitted.values() if not job.is_deleted)

    def configmap_count(self) -> int:
        return len(self._slices)

    # -- updates -----------------------------------------------------------

    def apply(self, event_type: str, configmap: Mapping[str, Any], now: float) -> Changes:
        """Apply one watch event (ADDED, MODIFIED or DELETED). `now` is Unix seconds."""
        changes = Changes()
        try:
            ref = configmap_ref(configmap)
        except BadConfigMap as error:
            self._reject(changes, error)
            return changes
        if event_type == DELETED:
            affected = self._remove(ref)
            self._recompute(affected, now, changes, lost=affected)
            return changes
        if event_type not in (ADDED, MODIFIED):
            self._reject(changes, BadConfigMap("bad_event", f"{ref}: event type {event_type!r}"))
            return changes
        try:
            new_slice = parse_slice(configmap)
        except BadConfigMap as error:
            # Keep the last good version: a bad rewrite must not end a job.
            self._reject(changes, error)
            return changes
        lost = self._remove(ref)
        self._insert(new_slice)
        new_key = JobKey(ref.namespace, new_slice.fields.job_id)
        lost.discard(new_key)
        self._recompute(lost | {new_key}, now, changes, lost=lost)
        return changes

    def replace_all(
        self, configmaps: Iterable[Mapping[str, Any]], now: float, namespace: str | None = None
    ) -> Changes:
        """Make the store hold exactly `configmaps` (a fresh LIST); emit the differences.

        With `namespace`, only that namespace's ConfigMaps are replaced (one
        LIST per watched namespace); listed objects from elsewhere are ignored.
        """
        changes = Changes()
        fresh: dict[ConfigMapRef, Slice] = {}
        listed: set[ConfigMapRef] = set()
        for configmap in configmaps:
            try:
                ref = configmap_ref(configmap)
                if namespace is not None and ref.namespace != namespace:
                    continue
                listed.add(ref)
                fresh[ref] = parse_slice(configmap)
            except BadConfigMap as error:
                self._reject(changes, error)
        # A listed but malformed ConfigMap still exists: keep its last good slice.
        for ref in listed - fresh.keys():
            if ref in self._slices:
                fresh[ref] = self._slices[ref]
        lost: set[JobKey] = set()
        affected: set[JobKey] = set()
        for ref, old in list(self._slices.items()):
            if namespace is not None and ref.namespace != namespace:
                continue
            new = fresh.get(ref)
            if new == old:
                continue
            affected |= self._remove(ref)
            if new is None or new.fields.job_id != old.fields.job_id:
                lost.add(JobKey(ref.namespace, old.fields.job_id))
        for ref, new in fresh.items():
            if ref not in self._slices:
                self._insert(new)
                affected.add(JobKey(ref.namespace, new.fields.job_id))
        self._recompute(affected | lost, now, changes, lost=lost)
        return changes

    # -- internals ---------------------------------------------------------

    def _reject(self, changes: Changes, error: BadConfigMap) -> None:
        self.rejected_total[error.reason] += 1
        changes.rejected.append(error)

    def _insert(self, new_slice: Slice) -> None:
        self._slices[new_slice.ref] = new_slice
        key = JobKey(new_slice.ref.namespace, new_slice.fields.job_id)
        self._members.setdefault(key, set()).add(new_slice.ref)

    def _remove(self, ref: ConfigMapRef) -> set[JobKey]:
        """Forget a ConfigMap; return the job it belonged to (empty if unknown)."""
        old = self._slices.pop(ref, None)
        if old is None:
            return set()
        key = JobKey(ref.namespace, old.fields.job_id)
        members = self._members[key]
        members.discard(ref)
        if not members:
            del self._members[key]
        return {key}

    def _recompute(
        self, keys: Iterable[JobKey], now: float, changes: Changes, *, lost: set[JobKey]
    ) -> None:
        for key in sorted(keys, key=lambda k: (k.namespace, k.job_id)):
            members = self._members.get(key, set())
            state = assemble([self._slices[ref] for ref in members])
            previous = self._emitted.get(key)
            if state is not None:
                if state != previous:
                    self._emitted[key] = state
                    # A delete matters only to clients that saw the job live; a
                    # job first seen already deleted is recorded silently.
                    if not state.is_deleted or (previous is not None and not previous.is_deleted):
                        changes.events.append(state)
            elif key in lost and previous is not None and not previous.is_deleted:
                ended = previous.as_deleted(str(int(now)))
                self._emitted[key] = ended
                changes.events.append(ended)
            if not members:
                self._emitted.pop(key, None)


def assemble(slices: list[Slice]) -> JobSummary | None:
    """The job a set of slices describes, or None while they are incomplete or disagree."""
    by_index: dict[int, Slice] = {}
    for piece in slices:
        if piece.cm_index in by_index:
            return None  # two ConfigMaps claim one index: wait for ClusterD to settle
        by_index[piece.cm_index] = piece
    first = by_index.get(0)
    if first is None:
        return None
    total = first.fields.total
    ordered = [by_index.get(i) for i in range(total)]
    if any(s is None or s.fields != first.fields for s in ordered):
        return None
    pieces = [s for s in ordered if s is not None]
    headers = {s.header for s in pieces if s.header is not None}
    if len(headers) > 1:
        return None  # slices from different rewrites of the rank table
    if total == 1:
        hccl_json = first.hccl_raw
    elif headers:
        hccl_json = _join_rank_table(next(iter(headers)), pieces)
    else:
        hccl_json = ""
    f = first.fields
    return JobSummary(
        namespace=first.ref.namespace,
        job_id=f.job_id,
        job_name=f.job_name,
        framework=f.framework,
        job_status=f.job_status,
        time=f.time,
        total=str(total),
        hccl_json=hccl_json,
        delete_time=f.delete_time,
        shared_tor_ip=f.shared_tor_ip,
        master_addr=f.master_addr,
        operator=f.operator,
        sid=f.sid,
        npu_count=sum(s.npu_count for s in pieces),
    )


def _join_rank_table(header: tuple[tuple[str, str], ...], pieces: list[Slice]) -> str:
    servers = ",".join(server for piece in pieces for server in piece.servers)
    parts = []
    for key, value in header:
        encoded_key = json.dumps(key, ensure_ascii=False)
        if value == SERVER_LIST_SLOT:
            parts.append(f"{encoded_key}:[{servers}]")
        else:
            parts.append(f"{encoded_key}:{value}")
    return "{" + ",".join(parts) + "}"
