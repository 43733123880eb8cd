"""Work per event is proportional to the change, not to the job.

Measured without clocks: the number of Python and C function calls one
`apply` makes (`sys.setprofile`), which for a job over N ConfigMaps used to
grow with N on every slice event (each reassembled the whole job), and the
step sizes of a relist applied with `Relist` and `settle`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.store import JobStore
from jobsignal.store.jobs import ADDED, MODIFIED
from tests.support.factories import configmap

NOW = 1_800_000_000.0
SLICES = 1024


def calls_during(action: Callable[[], object]) -> int:
    count = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return count


def big_job() -> ClusterdJob:
    return ClusterdJob("ns", "huge", "uid-huge", servers=SLICES, servers_per_configmap=1)


def test_slice_events_of_a_big_job_cost_the_same_early_and_late() -> None:
    store = JobStore()
    job = big_job()
    objects = [configmap("ns", name, data) for name, data in job.configmaps("running")]
    costs = {}
    for index, obj in enumerate(objects[:-1]):
        if index in (8, SLICES - 8):
            costs[index] = calls_during(functools.partial(store.apply, ADDED, obj, NOW))
        else:
            assert store.apply(ADDED, obj, NOW).events == []
    [complete] = store.apply(ADDED, objects[-1], NOW).events
    assert complete.npu_count == SLICES * 8
    # Without incremental tallies the late event cost ~SLICES times more.
    assert costs[SLICES - 8] <= costs[8] + 20, costs

    # A status rewrite, slice by slice: each in-between event is cheap too.
    rewrite = [configmap("ns", name, data) for name, data in job.configmaps("complete")]
    rewrite_costs = []
    for index, obj in enumerate(rewrite[:-1]):
        if index in (8, SLICES - 8):
            rewrite_costs.append(calls_during(functools.partial(store.apply, MODIFIED, obj, NOW)))
        else:
            assert store.apply(MODIFIED, obj, NOW).events == []
    assert rewrite_costs[1] <= rewrite_costs[0] + 20, rewrite_costs
    [done] = store.apply(MODIFIED, rewrite[-1], NOW).events
    assert done.job_status == "complete"

    # ClusterD's periodic unchanged rewrite of one slice: no reassembly at all.
    unchanged = calls_during(lambda: store.apply(MODIFIED, rewrite[SLICES // 2], NOW))
    assert unchanged <= costs[8] + 20, (unchanged, costs)


def test_relist_settles_in_bounded_steps_with_the_same_events() -> None:
    jobs = [ClusterdJob("ns", f"j{i}", f"uid-{i:03d}", servers=3) for i in range(300)]
    jobs.append(big_job())
    listing = [configmap("ns", n, d) for job in jobs for n, d in job.configmaps("running")]
    expected = JobStore().replace_all(listing, NOW).events

    store = JobStore()
    relist = store.relist()
    for obj in listing:
        assert relist.add(obj) >= 1
    assert store.configmap_count() == 0  # nothing changes before the commit
    assert relist.commit(NOW) and relist.rejected == []
    assert store.configmap_count() == len(listing) and store.pending == len(jobs)
    steps = []
    while store.pending:
        steps.append(store.settle(budget=64).events)
    assert [event for step in steps for event in step] == expected
    # A step stops once it has joined 64 slices: only its last job goes past that.
    for step in steps:
        assert sum(int(event.total) for event in step[:-1]) < 64
    assert len(steps) >= 300 // 64


def test_relist_commits_in_bounded_steps_and_marks_jobs_only_at_the_end() -> None:
    before = [ClusterdJob("ns", f"j{i}", f"uid-{i:03d}") for i in range(0, 200, 2)]
    after = [ClusterdJob("ns", f"j{i}", f"uid-{i:03d}") for i in range(100, 300)]
    store, expected = JobStore(), JobStore()
    for each in (store, expected):
        each.replace_all([configmap("ns", *j.configmaps("running")[0]) for j in before], NOW)
    listing = [configmap("ns", *j.configmaps("complete")[0]) for j in after]
    relist = store.relist("ns")
    for obj in listing:
        relist.add(obj)
    counts = []
    while not relist.commit(NOW, budget=30):
        counts.append(store.configmap_count())
        assert store.pending == 0  # nothing is recomputed while half-updated
    # 50 removed, 50 replaced, 150 added: 250 changes, 30 per step.
    assert len(counts) == 250 // 30
    assert store.configmap_count() == 200 and store.pending == 250
    assert store.settle().events == expected.replace_all(listing, NOW).events


def test_an_event_overtaking_a_pending_relist_is_applied_once() -> None:
    store = JobStore()
    a, b = ClusterdJob("ns", "a", "uid-a"), ClusterdJob("ns", "b", "uid-b")
    for job in (a, b):
        for name, data in job.configmaps("running"):
            store.apply(ADDED, configmap("ns", name, data), NOW)
    # A relist finds a gone and b complete, but is not settled yet...
    relist = store.relist()
    relist.add(configmap("ns", *b.configmaps("complete")[0]))
    assert relist.commit(NOW)
    assert store.pending == 2
    # ...when a watch event recreates a: the relist's delete of a comes first.
    ended, recreated = store.apply(
        ADDED, configmap("ns", *a.configmaps("pending")[0]), NOW + 5
    ).events
    assert (ended.job_id, ended.operator, ended.delete_time) == ("uid-a", "delete", str(int(NOW)))
    assert (recreated.job_id, recreated.job_status, recreated.operator) == (
        "uid-a",
        "pending",
        "add",
    )
    rest = store.settle().events
    assert [(e.job_id, e.job_status, e.operator) for e in rest] == [("uid-b", "complete", "add")]
    assert store.pending == 0
