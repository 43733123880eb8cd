"""The Kubernetes side of the benchmark: jobsignal's API emulator plus a ClusterD stand-in.

    python -m bench.cluster [--deadline S]

Runs `jobsignal.sim.emulator` on 127.0.0.1 in its own process (as a real
API server would be) and, on command, writes job-summary ConfigMaps the way
ClusterD does (`jobsignal.sim.clusterd`): a bulk population for the initial
LIST, a steady stream of changes at a given rate, or one large job split over
several ConfigMaps. Every write stamps its wall-clock time (Unix ns) into the
`sid` data key, so a subscriber can measure ConfigMap change to arrival; the
bulk population stamps "0" instead (no time: a subscriber tells the messages
of a snapshot by it). A change rewrites every ConfigMap of the job with the
same stamp, as ClusterD rewrites them all: the time of its first write.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from typing import Any

import trio
import trio.lowlevel

from bench.common import answer_commands, emit, run_child
from bench.events import clusterd_job
from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.sim.emulator import ConfigMapStore, KubeEmulator, run_emulator


def write_job(state: ConfigMapStore, job: ClusterdJob, status: str, sid: str) -> int:
    """Create or update every ConfigMap of `job`; returns how many were written."""
    written = 0
    for name, data in job.configmaps(status):
        data["sid"] = sid
        state.create_or_update_configmap(job.namespace, name, JOB_LABELS, data)
        written += 1
    return written


class Cluster:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.emulator: KubeEmulator | None = None
        self.jobs: list[ClusterdJob] = []
        self.large: ClusterdJob | None = None
        self.large_writes = 0
        self.changes = 0
        self.driver_scope: trio.CancelScope | None = None

    @property
    def state(self) -> ConfigMapStore:
        assert self.emulator is not None
        return self.emulator.state

    async def main(self) -> None:
        async with trio.open_nursery() as nursery:
            self.emulator = await nursery.start(
                lambda task_status: run_emulator(
                    history_size=self.args.history, task_status=task_status
                )
            )
            emit({"ready": True, "url": self.emulator.url, "pid": os.getpid()})
            await self._commands(nursery)
            nursery.cancel_scope.cancel()

    async def _commands(self, nursery: trio.Nursery) -> None:
        await answer_commands(functools.partial(self._handle, nursery=nursery))

    def _handle(self, command: dict[str, Any], nursery: trio.Nursery) -> dict[str, Any]:
        name = command["cmd"]
        if name == "populate":
            started = time.perf_counter()
            per_configmap = command.get("servers_per_configmap", 1000)
            self.jobs = [
                clusterd_job(i, command["servers"], per_configmap) for i in range(command["count"])
            ]
            written = sum(write_job(self.state, job, "running", "0") for job in self.jobs)
            return {"configmaps": written, "seconds": time.perf_counter() - started}
        if name == "mode":
            if self.driver_scope is not None:
                self.driver_scope.cancel()
                self.driver_scope = None
            if command["mode"] == "churn":
                self.driver_scope = trio.CancelScope()
                nursery.start_soon(self._churn, self.driver_scope, command["rate"])
            return {"ok": True}
        if name == "stats":
            return {"changes": self.changes, "configmaps": len(self.state)}
        if name == "large":
            if self.large is None:
                self.large = clusterd_job(
                    10_000_000, command["servers"], command["servers_per_configmap"]
                )
            self.large_writes += 1
            status = "running" if self.large_writes % 2 else "complete"
            started_ns = time.time_ns()
            written = write_job(self.state, self.large, status, str(started_ns))
            return {
                "configmaps": written,
                "started_ns": started_ns,
                "write_seconds": (time.time_ns() - started_ns) / 1e9,
            }
        return {"error": f"unknown command {name!r}"}

    async def _churn(self, scope: trio.CancelScope, rate: float) -> None:
        """Rewrite the jobs (a new `sid` in each of their ConfigMaps) in turn, at
        `rate` changes per second."""
        with scope:
            started = trio.current_time()
            done = 0
            while True:
                due = int((trio.current_time() - started) * rate)
                while done < due:
                    job = self.jobs[done % len(self.jobs)]
                    sid = str(time.time_ns())
                    for index in range(job.configmap_count):
                        name = job.configmap_name(index)
                        data = dict(self.state.get(job.namespace, name).data)
                        data["sid"] = sid
                        self.state.update_configmap(job.namespace, name, data=data)
                    done += 1
                    self.changes += 1
                await trio.sleep(0.002)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--history", type=int, default=1_000_000)
    run_child(parser, lambda args: trio.run(Cluster(args).main))


if __name__ == "__main__":
    main()
