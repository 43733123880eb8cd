"""The ClusterD stand-in's ConfigMaps: a split rank table, the same in every
status that has servers (built once), and fresh data on every call; the demo
cluster's jobs start now."""

from __future__ import annotations

import json
import time

import trio
import trio.testing

from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.sim.demo import play_scenario
from jobsignal.sim.emulator import ConfigMapStore


def test_a_split_job_carries_its_servers_in_order_and_the_header_everywhere() -> None:
    job = ClusterdJob("ns", "big", "uid", servers=5, servers_per_configmap=2)
    configmaps = job.configmaps("running")
    assert [name for name, _ in configmaps] == [
        "job-summary-big",
        "job-summary-big-1",
        "job-summary-big-2",
    ]
    tables = [json.loads(data["hccl.json"]) for _, data in configmaps]
    servers = [server for table in tables for server in table["server_list"]]
    assert servers == job.server_list()
    assert [len(table["server_list"]) for table in tables] == [2, 2, 1]
    assert {(t["status"], t["server_count"], t["total"]) for t in tables} == {("complete", "5", 40)}
    assert [data["cm_index"] for _, data in configmaps] == ["0", "1", "2"]


def test_a_status_change_rewrites_the_same_rank_table() -> None:
    job = ClusterdJob("ns", "big", "uid", servers=3, servers_per_configmap=2)
    by_status = {status: job.configmaps(status) for status in ("running", "complete", "failed")}
    tables = {
        status: [data["hccl.json"] for _, data in configmaps]
        for status, configmaps in by_status.items()
    }
    assert tables["running"] == tables["complete"] == tables["failed"]
    assert {data["job_status"] for _, data in by_status["failed"]} == {"failed"}


def test_pending_and_other_statuses_have_no_servers() -> None:
    job = ClusterdJob("ns", "big", "uid", servers=3, servers_per_configmap=2)
    pending = [json.loads(data["hccl.json"]) for _, data in job.configmaps("pending")]
    assert pending == [{"status": "initializing"}] * 2
    other = [json.loads(data["hccl.json"]) for _, data in job.configmaps("unknown")]
    assert (
        other == [{"status": "complete", "server_list": [], "server_count": "3", "total": 24}] * 2
    )


def test_every_call_returns_data_of_its_own() -> None:
    job = ClusterdJob("ns", "one", "uid", servers=2)
    [(_, first)] = job.configmaps("running")
    first["sid"] = "changed"
    first["hccl.json"] = "{}"
    [(_, again)] = job.configmaps("running")
    assert again["sid"] == ""
    assert json.loads(again["hccl.json"])["server_list"] == job.server_list()


async def test_the_demo_cluster_stamps_its_jobs_with_their_real_start() -> None:
    """`jobsignal jobs` on the demo shows the age of a job just started, not years."""
    state = ConfigMapStore()
    before = time.time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(play_scenario, state, 3600.0)
        await trio.testing.wait_all_tasks_blocked()  # the first round is written, pending
        nursery.cancel_scope.cancel()
    after = time.time()
    starts = {int(cm.data["time"]) for cm in state.objects()}
    assert len(state.objects()) >= 3 and len(starts) == 1, starts
    (started,) = starts
    assert int(before) <= started <= after
    assert {cm.data["job_status"] for cm in state.objects()} == {"pending"}
