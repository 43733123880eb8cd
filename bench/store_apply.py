"""Micro measurement: applying one job split over 4,096 ConfigMaps.

    python -m bench.store_apply [--configmaps 4096] [--jobs 10000] [--rounds 3]

A job as ClusterD writes it, one server (8 NPUs) per ConfigMap, applied to
jobsignal's own store in each way the watcher meets it: the whole LIST
(`replace_all`), one watch event per ConfigMap (ADDED, then a status rewrite,
then ClusterD's periodic unchanged rewrite), and through the `Watcher` fed by
an in-memory API (500-item pages; watch events in bursts of 50, about what one
64 KiB read holds), while a second trio task records the longest time the
loop went without running it; the same for a LIST of `--jobs` small jobs
(2 servers each). Prints one JSON line: seconds, the median of
`--rounds`. Uses only `JobStore.replace_all` / `apply` and the `Watcher`, so
the same script measures an older tree (`PYTHONPATH=<old tree>`).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, cast

import trio

from jobsignal.fanout import Broadcaster
from jobsignal.kube.api import KubeApi
from jobsignal.kube.watcher import Watcher, WatchSettings
from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.status import SourceStatus
from jobsignal.store import JobStore

NOW = 1_800_000_000.0
PAGE = 500
BURST = 50


def objects_of(job: ClusterdJob, status: str) -> list[dict[str, Any]]:
    return [
        {"metadata": {"namespace": "ns", "name": name, "labels": dict(JOB_LABELS)}, "data": data}
        for name, data in job.configmaps(status)
    ]


def job_objects(count: int, status: str) -> list[dict[str, Any]]:
    job = ClusterdJob("ns", "huge", "uid-huge", servers=count, servers_per_configmap=1)
    return objects_of(job, status)


def many_jobs(count: int) -> list[dict[str, Any]]:
    jobs = (ClusterdJob("ns", f"j{i}", f"uid-{i}", servers=2) for i in range(count))
    return [obj for job in jobs for obj in objects_of(job, "running")]


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def store_figures(count: int) -> dict[str, float]:
    running, complete = job_objects(count, "running"), job_objects(count, "complete")
    figures: dict[str, float] = {}
    figures["list_s"] = timed(lambda: JobStore().replace_all(running, NOW))
    store = JobStore()
    for phase, kind, objects in (
        ("watch_added", "ADDED", running),
        ("watch_rewrite", "MODIFIED", complete),
        ("watch_unchanged", "MODIFIED", complete),
    ):
        costs = [timed(functools.partial(store.apply, kind, obj, NOW)) for obj in objects]
        figures[f"{phase}_s"] = sum(costs)
        figures[f"{phase}_worst_event_s"] = max(costs)
    assert [job.job_status for job in store.live_jobs()] == ["complete"]
    return figures


class MemoryApi:
    """The two calls the watcher makes, served from memory: LIST pages, then a
    watch that delivers `watch_objects` in bursts and then stays open."""

    def __init__(self, listed: list[dict[str, Any]], watched: list[dict[str, Any]]) -> None:
        self._listed = listed
        self._watched = watched
        self.watch_done = trio.Event()

    async def list_page(self, namespace: str | None, params: Mapping[str, str]) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        start = int(params.get("continue", "0"))
        end = start + PAGE
        metadata: dict[str, str] = {"resourceVersion": "1"}
        if end < len(self._listed):
            metadata["continue"] = str(end)
        return {"items": self._listed[start:end], "metadata": metadata}

    @asynccontextmanager
    async def watch(
        self, namespace: str | None, params: Mapping[str, str]
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        yield self._events()

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        for index, obj in enumerate(self._watched):
            if index % BURST == 0:
                await trio.lowlevel.checkpoint()  # the next read from the socket
            yield {"type": "ADDED", "object": obj}
        self.watch_done.set()
        await trio.sleep_forever()


async def longest_stall(
    listed: list[dict[str, Any]], watched: list[dict[str, Any]], jobs: int = 1
) -> float:
    """Seconds the loop went without running another task while the watcher applied
    `listed` (LIST) and `watched` (watch events), until the `jobs` are served."""
    api = MemoryApi(listed, watched)
    store, broadcaster, status = JobStore(), Broadcaster(), SourceStatus()
    watcher = Watcher(
        cast(KubeApi, api), store, broadcaster.publish, status, WatchSettings(page_size=PAGE)
    )
    longest = 0.0

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while True:
            await trio.lowlevel.checkpoint()
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await nursery.start(watcher.run)
        await status.ready.wait()
        await api.watch_done.wait()  # set once the watcher asks for more than the last event
        assert broadcaster.job_count() == jobs
        nursery.cancel_scope.cancel()
    return longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configmaps", type=int, default=4096)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    count = args.configmaps
    rounds = [store_figures(count) for _ in range(args.rounds)]
    result: dict[str, Any] = {"configmaps": count, "npus": count * 8}
    for key in rounds[0]:
        result[key] = round(statistics.median(r[key] for r in rounds), 4)
    running = job_objects(count, "running")
    result["watcher_list_longest_stall_s"] = round(
        statistics.median(trio.run(longest_stall, running, []) for _ in range(args.rounds)), 4
    )
    result["watcher_watch_longest_stall_s"] = round(
        statistics.median(trio.run(longest_stall, [], running) for _ in range(args.rounds)), 4
    )
    listing = many_jobs(args.jobs)
    result["jobs"] = args.jobs
    result["many_jobs_list_s"] = round(
        statistics.median(
            timed(lambda: JobStore().replace_all(listing, NOW)) for _ in range(args.rounds)
        ),
        4,
    )
    result["watcher_many_jobs_list_longest_stall_s"] = round(
        statistics.median(
            trio.run(longest_stall, listing, [], args.jobs) for _ in range(args.rounds)
        ),
        4,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
