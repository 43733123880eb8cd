"""The client-visible state of one job, as the store emits it, and the id of an event."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import NamedTuple

from jobsignal.util.uuids import name_uuid

OPERATOR_ADD = "add"
OPERATOR_DELETE = "delete"


class JobKey(NamedTuple):
    """Identity of a job: ClusterD keys jobs by owner UID within a namespace.

    A named tuple, not a dataclass: it keys every dict on the hot paths (the
    store, the broadcaster's caches, coalescing), and a tuple's hash and
    equality run in C where a frozen dataclass runs Python code for both: a
    lookup with an equal key 97 ns instead of 441, making one 307 instead of
    583 (bench/FINDINGS.md).
    """

    namespace: str
    job_id: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.job_id}"


@dataclass(frozen=True, slots=True)
class SignalFields:
    """The fields of a `JobSummarySignal` that describe the job: all but the
    per-event `uuid`, and `cmIndex`, always "0" on the wire (one message per
    job, never per ConfigMap), so not kept. Text as ClusterD wrote it."""

    namespace: str
    job_id: str
    job_name: str
    framework: str
    job_status: str
    time: str
    total: str
    hccl_json: str
    delete_time: str
    shared_tor_ip: str
    master_addr: str
    operator: str
    sid: str


@dataclass(frozen=True, slots=True)
class JobSummary(SignalFields):
    """Everything a `JobSummarySignal` carries except its per-event `uuid`.

    `npu_count` is derived from the rank table and is not compared: it never
    differs when `hccl_json` does not. `event_uuid` is the id the source gave
    the event ("" for none: `event_id` derives it): a relay passes on its
    upstream's (docs/architecture.md section 4, "Relaying another server").
    It is not compared either: the same state under another id is no change.
    """

    npu_count: int = dataclasses.field(default=0, compare=False)
    event_uuid: str = dataclasses.field(default="", compare=False)

    @property
    def key(self) -> JobKey:
        return JobKey(self.namespace, self.job_id)

    @property
    def is_deleted(self) -> bool:
        return self.operator == OPERATOR_DELETE

    def as_deleted(self, delete_time: str) -> JobSummary:
        """This job ended: same state, operator delete, deleteTime kept if already set.
        A new event, so not the id a source gave the state it ends."""
        return dataclasses.replace(
            self,
            operator=OPERATOR_DELETE,
            delete_time=self.delete_time or delete_time,
            event_uuid="",
        )


#: Namespace of jobsignal's event ids, the UUID 720fcb38-2424-4a4c-8de0-64942ee0d6d9
#: (fixed forever: changing it changes every id).
EVENT_ID_NAMESPACE = bytes.fromhex("720fcb3824244a4c8de064942ee0d6d9")


def event_id(job: JobSummary) -> str:
    """The uuid of the event that reports `job` in this state: the id its source
    gave it (`event_uuid`: a relay's upstream's), else one derived from it, the
    same on every replica and after every restart, and different whenever a
    client-visible field differs.

    A UUIDv5 under `EVENT_ID_NAMESPACE` over the SHA-256 of the job's identity
    and state, each field as UTF-8 (lone surrogates passed through, so nothing
    can fail here) behind its length, in a fixed order, so no two states share
    an encoding. `delete_time` is left out: for a job whose ConfigMaps vanished,
    each replica stamps the delete with its own clock, and it must still be one
    event. `npu_count` is derived from the rank table.
    """
    if job.event_uuid:
        return job.event_uuid
    digest = hashlib.sha256()
    for value in (
        job.namespace,
        job.job_id,
        job.job_name,
        job.framework,
        job.job_status,
        job.time,
        job.total,
        job.hccl_json,
        job.shared_tor_ip,
        job.master_addr,
        job.operator,
        job.sid,
    ):
        data = value.encode("utf-8", "surrogatepass")
        digest.update(b"%d:" % len(data))
        digest.update(data)
    return name_uuid(EVENT_ID_NAMESPACE, digest.hexdigest())
