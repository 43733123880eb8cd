"""The job store: ConfigMap events in, job events out. Pure: no I/O, no clock."""

from jobsignal.store.jobs import JobStore
from jobsignal.store.model import JobKey, JobSummary

__all__ = ["JobKey", "JobStore", "JobSummary"]
