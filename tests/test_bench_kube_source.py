"""The grpc.aio reference server's job cache (bench/kube_source.py) against jobsignal's store.

The real-path benchmark compares servers that each put the same ConfigMaps
back together into job events; these check that the reference's cache
publishes what jobsignal's store does (the same fields, the same rank table
as JSON) and when it does: once per change of a complete job whose slices
agree, never for a rewrite that changes nothing, a delete when a ConfigMap
of a published job goes. The HTTP side runs in the benchmark's smoke test.
"""

from __future__ import annotations

import json
import time
from typing import Any

from bench.events import configmap_objects, signal_fields
from bench.kube_source import KubeJobs
from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.store import JobStore

# A job split over three ConfigMaps (40 servers, 15 per ConfigMap).
JOB = ClusterdJob("bench", "split", "00000000-0000-4000-8000-000000000007", servers=40,
                  servers_per_configmap=15)  # fmt: skip


def cache() -> tuple[KubeJobs, list[tuple[str, dict[str, str]]]]:
    published: list[tuple[str, dict[str, str]]] = []
    jobs = KubeJobs(
        "http://127.0.0.1:1", "bench", lambda key, fields: published.append((key, fields))
    )
    return jobs, published


def write(jobs: KubeJobs, objects: list[dict[str, Any]], kind: str = "MODIFIED") -> None:
    for obj in objects:
        assert not jobs._event({"type": kind, "object": obj})


def test_a_split_job_is_published_as_jobsignal_assembles_it() -> None:
    objects = configmap_objects(JOB, "running", "1700000000000000000")
    jobs, published = cache()
    write(jobs, objects, "ADDED")
    store = JobStore()
    store.replace_all(objects, time.time())
    (expected,) = store.live_jobs()
    wanted = signal_fields(expected)

    (key, fields) = published[-1]
    assert key == f"bench/{JOB.uid}"
    assert len(published) == 1  # nothing before the last slice arrived
    assert fields.pop("sid") == expected.sid  # signal_fields leaves out uuid and sid
    assert json.loads(fields.pop("HcclJson")) == json.loads(wanted.pop("HcclJson"))
    assert fields == wanted


def test_one_event_per_change_of_the_whole_job() -> None:
    jobs, published = cache()
    write(jobs, configmap_objects(JOB, "running", "1"), "ADDED")
    changed = configmap_objects(JOB, "running", "2")
    write(jobs, changed[:2])  # slices from two writes disagree: no event yet
    assert len(published) == 1
    write(jobs, changed[2:])
    assert [fields["sid"] for _, fields in published] == ["1", "2"]
    write(jobs, changed)  # the same again: nothing changed
    assert len(published) == 2


def test_a_published_job_losing_a_configmap_is_deleted_once() -> None:
    jobs, published = cache()
    objects = configmap_objects(JOB, "running", "1")
    write(jobs, objects, "ADDED")
    for obj in objects[1:]:
        write(jobs, [obj], "DELETED")
    assert [fields["operator"] for _, fields in published] == ["add", "delete"]
