"""Property: whatever ConfigMap events, lost events and relists happen, subscribers end
holding exactly the cluster's final state, and never receive the same state twice."""

from __future__ import annotations

from typing import Any

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobsignal._proto.job import JobSummarySignal
from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.store import JobStore
from jobsignal.store.configmap import parse_slice
from jobsignal.store.jobs import ADDED, DELETED, MODIFIED, assemble
from tests.support.factories import configmap

NOW = 1_800_000_000.0
JOBS = [
    ClusterdJob("ns1", "small", "uid-small", servers=1),
    ClusterdJob("ns1", "split", "uid-split", servers=5, servers_per_configmap=2),
    ClusterdJob("ns2", "other", "uid-other", framework="mindspore", servers=2),
]
STATES = [
    ("pending", "add"),
    ("running", "add"),
    ("complete", "add"),
    ("failed", "add"),
    ("complete", "delete"),
    ("failed", "delete"),
]

# One step: (job index, action, state index, slice index, delivered?)
#   action "write": rewrite every ConfigMap of the job in a state
#   action "drop": remove one ConfigMap of the job; "clear": remove all of them
#   action "relist": the watcher relists (after a 410 or a reconnect)
step = st.tuples(
    st.integers(0, len(JOBS) - 1),
    st.sampled_from(["write", "write", "write", "drop", "clear", "relist"]),
    st.integers(0, len(STATES) - 1),
    st.integers(0, 2),
    st.booleans(),
)


def expected_view(cluster: dict[tuple[str, str], dict[str, Any]]) -> dict[tuple[str, str], Any]:
    slices_by_job: dict[tuple[str, str], list[Any]] = {}
    for (namespace, _), obj in cluster.items():
        piece = parse_slice(obj)
        slices_by_job.setdefault((namespace, piece.fields.job_id), []).append(piece)
    view = {}
    for key, pieces in slices_by_job.items():
        state = assemble(pieces)
        if state is not None and state.operator != "delete":
            view[key] = (state.job_status, state.hccl_json, state.total)
    return view


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=40))
def test_subscribers_converge_to_the_cluster_state(steps: list[Any]) -> None:
    trio.run(_run, steps)


async def _run(steps: list[Any]) -> None:
    store = JobStore()
    broadcaster = Broadcaster(max_pending=10_000, jobs=store)
    subscriber = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "id", snapshot=True)
    cluster: dict[tuple[str, str], dict[str, Any]] = {}

    def deliver(kind: str, obj: dict[str, Any], delivered: bool) -> None:
        if delivered:
            broadcaster.publish(store.apply(kind, obj, NOW).events)

    for job_index, action, state_index, slice_index, delivered in steps:
        job = JOBS[job_index]
        if action == "write":
            status, operator = STATES[state_index]
            for name, data in job.configmaps(status, operator):
                kind = MODIFIED if (job.namespace, name) in cluster else ADDED
                obj = configmap(job.namespace, name, data)
                cluster[(job.namespace, name)] = obj
                deliver(kind, obj, delivered)
        elif action in ("drop", "clear"):
            names = [job.configmap_name(i) for i in range(job.configmap_count)]
            if action == "drop":
                names = [names[slice_index % len(names)]]
            for name in names:
                if (job.namespace, name) in cluster:
                    deliver(DELETED, cluster.pop((job.namespace, name)), delivered)
        else:
            broadcaster.publish(store.replace_all(list(cluster.values()), NOW).events)
    # The watcher always ends with a relist after any lost event.
    broadcaster.publish(store.replace_all(list(cluster.values()), NOW).events)

    view: dict[tuple[str, str], Any] = {}
    last_seen: dict[tuple[str, str], Any] = {}
    while subscriber.pending:
        for frame in await subscriber.next_batch(1000):
            signal = JobSummarySignal.parse(frame)
            key = (signal.namespace, signal.job_id)
            state = (signal.job_status, signal.operator, signal.hccl_json, signal.total)
            assert last_seen.get(key) != state, f"duplicate event for {key}: {state}"
            last_seen[key] = state
            if signal.operator == "delete":
                assert key in view, f"delete for {key}, which subscribers never saw live"
                del view[key]
            else:
                view[key] = (signal.job_status, signal.hccl_json, signal.total)
    assert view == expected_view(cluster)
    assert {(j.namespace, j.job_id) for j in store.live_jobs()} == set(view)
    # A subscriber arriving now gets the same view from the store's state.
    late = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "late", snapshot=True)
    snapshot = (
        [JobSummarySignal.parse(f) for f in await late.next_batch(10_000)] if late.pending else []
    )
    assert {(s.namespace, s.job_id): (s.job_status, s.hccl_json, s.total) for s in snapshot} == view
