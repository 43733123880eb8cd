"""The client-visible state of one job, as the store emits it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

OPERATOR_ADD = "add"
OPERATOR_DELETE = "delete"


@dataclass(frozen=True, slots=True)
class JobKey:
    """Identity of a job: ClusterD keys jobs by owner UID within a namespace."""

    namespace: str
    job_id: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.job_id}"


@dataclass(frozen=True, slots=True)
class JobSummary:
    """Everything a `JobSummarySignal` carries except its per-event `uuid`.

    `cmIndex` is always "0" on the wire (one message per job, never per
    ConfigMap) so it is not stored. `npu_count` is derived from the rank table
    and is not compared: it never differs when `hccl_json` does not.
    """

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
    npu_count: int = dataclasses.field(default=0, compare=False)

    @property
    def key(self) -> JobKey:
        return JobKey(self.namespace, self.job_id)

    @property
    def is_deleted(self) -> bool:
        return self.operator == OPERATOR_DELETE

    def as_deleted(self, delete_time: str) -> JobSummary:
        """This job ended: same state, operator delete, deleteTime kept if already set."""
        return dataclasses.replace(
            self, operator=OPERATOR_DELETE, delete_time=self.delete_time or delete_time
        )
