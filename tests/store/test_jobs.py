"""JobStore: ConfigMap events in, the right job events out (docs/architecture.md section 4)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.store import JobStore, jobs
from jobsignal.store.jobs import ADDED, DELETED, MODIFIED
from tests.support.factories import configmap

NOW = 1_800_000_000.0


def write(
    store: JobStore, job: ClusterdJob, status: str, operator: str = "add", kind: str = MODIFIED
) -> list[Any]:
    events = []
    for name, data in job.configmaps(status, operator):
        events += store.apply(kind, configmap(job.namespace, name, data), NOW).events
    return events


def test_single_configmap_lifecycle() -> None:
    store = JobStore()
    job = ClusterdJob("ns", "train", "uid-1", servers=2)
    [pending] = write(store, job, "pending", kind=ADDED)
    assert (pending.job_status, pending.operator, pending.total) == ("pending", "add", "1")
    assert json.loads(pending.hccl_json) == {"status": "initializing"}
    [running] = write(store, job, "running")
    table = json.loads(running.hccl_json)
    assert table["status"] == "complete" and len(table["server_list"]) == 2
    assert running.npu_count == 16
    [deleted] = write(store, job, "complete", operator="delete")
    assert deleted.operator == "delete" and deleted.job_status == "complete"
    assert store.live_jobs() == []
    # ClusterD removes the ConfigMap a minute later: no second delete event.
    name, data = job.configmaps("complete", "delete")[0]
    assert store.apply(DELETED, configmap("ns", name, data), NOW).events == []
    assert store.configmap_count() == 0


def test_unchanged_rewrite_emits_nothing() -> None:
    store = JobStore()
    job = ClusterdJob("ns", "train", "uid-1")
    assert len(write(store, job, "running", kind=ADDED)) == 1
    assert write(store, job, "running") == []


def test_multi_configmap_job_is_reassembled_once_all_slices_agree() -> None:
    store = JobStore()
    job = ClusterdJob("ns", "big", "uid-big", servers=10, servers_per_configmap=4)
    assert job.configmap_count == 3
    pieces = job.configmaps("running")
    # Slices arrive one by one: no event until the set is complete.
    assert store.apply(ADDED, configmap("ns", *pieces[0]), NOW).events == []
    assert store.apply(ADDED, configmap("ns", *pieces[2]), NOW).events == []
    [event] = store.apply(ADDED, configmap("ns", *pieces[1]), NOW).events
    table = json.loads(event.hccl_json)
    assert [s["server_name"] for s in table["server_list"]] == [f"node-{i}" for i in range(10)]
    assert table["server_count"] == "10" and table["total"] == 80
    assert list(table) == ["status", "server_list", "server_count", "total"]
    assert event.total == "3" and event.npu_count == 80
    # A status rewrite: slices disagree until the last one is rewritten.
    complete = job.configmaps("complete")
    assert store.apply(MODIFIED, configmap("ns", *complete[0]), NOW).events == []
    assert store.apply(MODIFIED, configmap("ns", *complete[1]), NOW).events == []
    [done] = store.apply(MODIFIED, configmap("ns", *complete[2]), NOW).events
    assert done.job_status == "complete"
    assert json.loads(done.hccl_json) == table


def test_a_joined_rank_table_over_the_cap_is_served_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = ClusterdJob("ns", "huge", "uid-huge", servers=10, servers_per_configmap=4)
    pieces = job.configmaps("running")
    store = JobStore()
    for piece in pieces:
        changes = store.apply(ADDED, configmap("ns", *piece), NOW)
    [whole] = changes.events
    assert changes.tables_over_cap == []
    size = len(whole.hccl_json)
    monkeypatch.setattr(jobs, "MAX_JOINED_RANK_TABLE_CHARS", size // 2)
    capped = JobStore()
    for piece in pieces:
        changes = capped.apply(ADDED, configmap("ns", *piece), NOW)
    [event] = changes.events
    # The job itself is served, with its state and NPU count, but no table,
    # and the store says so (the watcher logs and counts it).
    assert (event.hccl_json, event.job_status, event.npu_count) == ("", "running", 80)
    assert changes.tables_over_cap == [event]
    # Each later event of the job without its table is reported again.
    status = configmap("ns", *job.configmaps("complete")[0])
    assert capped.apply(MODIFIED, status, NOW).events == []  # the others still say running
    for piece in job.configmaps("complete")[1:]:
        changes = capped.apply(MODIFIED, configmap("ns", *piece), NOW)
    [done] = changes.events
    assert done.job_status == "complete" and changes.tables_over_cap == [done]


def test_unknown_rank_table_keys_are_kept() -> None:
    store = JobStore()
    job = ClusterdJob(
        "ns",
        "sp",
        "uid",
        servers=3,
        servers_per_configmap=2,
        extra_server_keys={"super_pod_id": "7", "host_ip": "1.2.3.4"},
    )
    [event] = write(store, job, "running", kind=ADDED)
    server = json.loads(event.hccl_json)["server_list"][2]
    assert server["super_pod_id"] == "7" and server["host_ip"] == "1.2.3.4"


def test_hand_deleted_configmap_ends_the_job_once() -> None:
    store = JobStore()
    job = ClusterdJob("ns", "big", "uid", servers=4, servers_per_configmap=2)
    write(store, job, "running", kind=ADDED)
    name, data = job.configmaps("running")[1]
    [ended] = store.apply(DELETED, configmap("ns", name, data), NOW).events
    assert ended.operator == "delete" and ended.delete_time == str(int(NOW))
    name0, data0 = job.configmaps("running")[0]
    assert store.apply(DELETED, configmap("ns", name0, data0), NOW).events == []
    assert store.live_jobs() == []


def test_relist_emits_exactly_the_differences() -> None:
    store = JobStore()
    a = ClusterdJob("ns", "a", "uid-a")
    b = ClusterdJob("ns", "b", "uid-b")
    c = ClusterdJob("ns", "c", "uid-c")
    write(store, a, "running", kind=ADDED)
    write(store, b, "running", kind=ADDED)
    # Missed while disconnected: a completed, b vanished, c appeared.
    listing = [configmap("ns", n, d) for n, d in a.configmaps("complete") + c.configmaps("pending")]
    events = store.replace_all(listing, NOW).events
    summary = sorted((e.job_id, e.job_status, e.operator) for e in events)
    assert summary == [
        ("uid-a", "complete", "add"),
        ("uid-b", "running", "delete"),
        ("uid-c", "pending", "add"),
    ]
    assert store.replace_all(listing, NOW).events == []


def test_relist_of_one_namespace_leaves_others_alone() -> None:
    store = JobStore()
    write(store, ClusterdJob("ns1", "a", "uid-a"), "running", kind=ADDED)
    write(store, ClusterdJob("ns2", "b", "uid-b"), "running", kind=ADDED)
    events = store.replace_all([], NOW, namespace="ns2").events
    assert [(e.namespace, e.operator) for e in events] == [("ns2", "delete")]
    assert [j.namespace for j in store.live_jobs()] == ["ns1"]


def test_bad_data_is_skipped_and_counted() -> None:
    store = JobStore()
    job = ClusterdJob("ns", "train", "uid")
    write(store, job, "running", kind=ADDED)
    name, data = job.configmaps("complete")[0]
    bad_cases = {
        "bad_hccl_json": {**data, "hccl.json": "{not json"},
        "no_job_id": {k: v for k, v in data.items() if k != "job_id"},
        "bad_index": {**data, "cm_index": "x"},
        "too_large": {**data, "hccl.json": "x" * (5 * 1024 * 1024)},
    }
    for reason, bad in bad_cases.items():
        changes = store.apply(MODIFIED, configmap("ns", name, bad), NOW)
        assert changes.events == []
        assert [r.reason for r in changes.rejected] == [reason]
        assert store.rejected_total[reason] == 1
    # The last good state still stands, and a good rewrite still works.
    [live] = store.live_jobs()
    assert live.job_status == "running"
    assert len(store.apply(MODIFIED, configmap("ns", name, data), NOW).events) == 1


def test_configmap_without_metadata_is_rejected() -> None:
    store = JobStore()
    changes = store.apply(ADDED, {"data": {}}, NOW)
    assert changes.events == [] and changes.rejected[0].reason == "no_metadata"
