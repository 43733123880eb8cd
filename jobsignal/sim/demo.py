"""The embedded demo cluster: the API emulator plus ClusterD's job lifecycle, played in a loop.

Used when no Kubernetes cluster is configured, so `jobsignal serve` and
`jobsignal demo` show real signals on a fresh machine. Each round starts a few
jobs in namespace `demo` and walks them through pending, running (with rank
tables), complete or failed, delete, and the removal of their ConfigMaps a
little later; one job is large enough that its rank table spans three
ConfigMaps. Every step goes through the emulator's HTTP API state, so the
watcher sees exactly what it would see from a real API server.
"""

from __future__ import annotations

import itertools
import logging
import time

import trio

from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.sim.emulator import ConfigMapStore, KubeEmulator, run_emulator
from jobsignal.util.uuids import random_uuid

log = logging.getLogger(__name__)

NAMESPACE = "demo"


def _write(state: ConfigMapStore, job: ClusterdJob, status: str, operator: str = "add") -> None:
    delete_time = int(time.time()) if operator == "delete" else None
    for name, data in job.configmaps(status, operator, delete_time):
        state.create_or_update_configmap(job.namespace, name, JOB_LABELS, data)


def _remove(state: ConfigMapStore, job: ClusterdJob) -> None:
    for index in range(job.configmap_count):
        state.delete_configmap(job.namespace, job.configmap_name(index))


async def play_scenario(state: ConfigMapStore, step: float = 2.0) -> None:
    """Forever: a round of jobs through their whole lifecycle, `step` seconds apart."""
    for round_number in itertools.count(1):
        # ClusterD's `time` is the job's start: now, so `jobsignal jobs` shows its true age.
        started = int(time.time())
        jobs = [
            ClusterdJob(
                NAMESPACE, f"resnet50-{round_number}", random_uuid(), servers=2, created=started
            ),
            ClusterdJob(
                NAMESPACE,
                f"llama-70b-{round_number}",
                random_uuid(),
                servers=96,
                servers_per_configmap=40,
                created=started,
            ),
            ClusterdJob(
                NAMESPACE,
                f"bert-{round_number}",
                random_uuid(),
                framework="mindspore",
                created=started,
            ),
        ]
        finals = ["complete", "complete", "failed"]
        for job in jobs:
            _write(state, job, "pending")
        await trio.sleep(step)
        for job in jobs:
            _write(state, job, "running")
        await trio.sleep(step)
        for job, final in zip(jobs, finals, strict=True):
            _write(state, job, final)
        await trio.sleep(step)
        for job, final in zip(jobs, finals, strict=True):
            _write(state, job, final, operator="delete")
        await trio.sleep(step)
        for job in jobs:
            _remove(state, job)
        await trio.sleep(step)


async def run_demo_cluster(
    *, step: float = 2.0, task_status: trio.TaskStatus[KubeEmulator] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the emulator on 127.0.0.1 and play the scenario; reports the emulator."""
    async with trio.open_nursery() as nursery:
        emulator: KubeEmulator = await nursery.start(run_emulator)
        log.info("demo cluster: Kubernetes API emulator at %s", emulator.url)
        nursery.start_soon(play_scenario, emulator.state, step)
        task_status.started(emulator)
