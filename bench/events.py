"""The job events both servers publish, built the way production builds them.

Jobs are written as ClusterD writes them (`jobsignal.sim.clusterd`) and
assembled by jobsignal's own job store, so the events carry realistic rank
tables. The publish time goes into `sid` (Unix nanoseconds): a subscriber
compares it with its own clock on arrival (every process runs on one machine).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from google.protobuf import message_factory

from bench.common import NAMESPACE
from jobsignal._proto.job import JobSummarySignal
from jobsignal.fanout.encoding import encode_signal
from jobsignal.rpc.reflection import own_pool
from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.store import JobStore, JobSummary

# JobSummarySignal in the protobuf runtime, built from the descriptor the server's
# reflection serves: it parses jobsignal's bytes and knows the field names of
# job.proto ("jobId", "HcclJson", ...).
_WIRE_SIGNAL = message_factory.GetMessageClass(
    own_pool().FindMessageTypeByName(f"job.{JobSummarySignal.__name__}")
)


def clusterd_job(index: int, servers: int, servers_per_configmap: int = 1000) -> ClusterdJob:
    return ClusterdJob(
        NAMESPACE,
        f"train-{index}",
        f"00000000-0000-4000-8000-{index:012d}",
        servers=servers,
        servers_per_configmap=servers_per_configmap,
    )


def configmap_objects(job: ClusterdJob, status: str, sid: str) -> list[dict[str, Any]]:
    """The job's ConfigMaps as API objects (what a LIST returns), `sid` stamped in."""
    objects = []
    for name, data in job.configmaps(status):
        data["sid"] = sid
        objects.append(
            {
                "metadata": {"namespace": job.namespace, "name": name, "labels": JOB_LABELS},
                "data": data,
            }
        )
    return objects


def make_jobs(count: int, servers: int, servers_per_configmap: int = 1000) -> list[JobSummary]:
    """`count` running jobs of `servers` x 8 NPUs each, as the job store emits them."""
    store = JobStore()
    objects: list[dict[str, Any]] = []
    for index in range(count):
        job = clusterd_job(index, servers, servers_per_configmap)
        objects += configmap_objects(job, "running", "0")
    store.replace_all(objects, time.time())
    jobs = store.live_jobs()
    assert len(jobs) == count, f"store assembled {len(jobs)} of {count} jobs"
    return jobs


def stamped(job: JobSummary, sid_ns: int) -> JobSummary:
    return dataclasses.replace(job, sid=str(sid_ns))


def latency_ns(sid: str, arrival_ns: int) -> int | None:
    """Arrival minus the publish time stamped in `sid`, or None if `sid` is not a stamp."""
    try:
        return arrival_ns - int(sid)
    except ValueError:
        return None


def signal_fields(job: JobSummary) -> dict[str, str]:
    """The JobSummarySignal fields of `job` but uuid and sid, keyed by proto field name.

    Read back from jobsignal's own encoding of the job, so they are what
    jobsignal sends: the grpc.aio and grpc-go reference servers publish these.
    """
    parsed = _WIRE_SIGNAL.FromString(encode_signal(job, uuid=""))
    return {
        field.name: getattr(parsed, field.name)
        for field in parsed.DESCRIPTOR.fields
        if field.name not in ("uuid", "sid")
    }
