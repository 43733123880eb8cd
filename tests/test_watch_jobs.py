"""The in-process trio API: `jobsignal.watch_jobs`, `RunningJobsignal.open_subscription`.

Against the Kubernetes API emulator over real 127.0.0.1 HTTP (real clock, short
bounded waits), plus unit tests of the event channel over a bare Broadcaster
for the kinds, ordering and the slow-consumer rule; and the examples in
examples/, run as a user would run them.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

import jobsignal
from jobsignal.config import Config
from jobsignal.events import EventKind, FellBehind, JobEvent, JobEvents, JobState, parse_rank_table
from jobsignal.fanout import Broadcaster
from jobsignal.sim.emulator import KubeEmulator
from jobsignal.store.model import JobSummary, event_id
from tests.support.cluster import Cluster, expected_summary, write_kubeconfig
from tests.support.factories import clusterd_job
from tests.support.waiting import wait_until

ROOT = Path(__file__).parent.parent


def config_for(emu: KubeEmulator, tmp_path: Path, **settings: object) -> Config:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", emu.url)
    return jobsignal.configure(
        source="kubernetes", kubeconfig=str(kubeconfig), listen="127.0.0.1:0", **settings
    )


async def next_event(events: JobEvents) -> JobEvent:
    with trio.fail_after(10):
        return await events.receive()


# -- watch_jobs against a cluster ------------------------------------------------------------


async def test_watch_jobs_yields_the_cluster_then_its_changes(
    emu: KubeEmulator, tmp_path: Path
) -> None:
    cluster = Cluster(emu.state)
    early, split = clusterd_job("early"), clusterd_job("split", servers=3, servers_per_configmap=2)
    cluster.write(early, "running")
    async with jobsignal.watch_jobs(config_for(emu, tmp_path), environ={}) as events:
        first = await next_event(events)
        assert first.kind is EventKind.ADDED
        assert first.job == JobState.of(expected_summary(early, "running"))
        assert first.uuid == event_id(expected_summary(early, "running"))

        cluster.write(split, "pending")
        added = await next_event(events)
        assert (added.kind, added.job.job_name, added.job.job_status) == (
            EventKind.ADDED,
            "split",
            "pending",
        )
        assert added.rank_table() == parse_rank_table('{"status":"initializing"}')

        cluster.write(split, "running")
        running = await next_event(events)
        assert (running.kind, running.job.job_status) == (EventKind.CHANGED, "running")
        table = running.rank_table()
        assert table is not None
        assert table.status == "complete"
        assert [server.server_id for server in table.servers] == [
            server["server_id"] for server in split.server_list()
        ]
        assert table.npu_count == 24
        assert table.servers[1].devices[0].rank_id == "8"

        cluster.write(early, "complete", "delete", 1_700_000_900)
        deleted = await next_event(events)
        assert deleted.kind is EventKind.DELETED
        assert deleted.job == JobState.of(
            expected_summary(early, "complete", "delete", 1_700_000_900)
        )
        assert deleted.job.delete_time == "1700000900"
        assert events.pending == 0
    # Leaving the block stopped the watcher: its WATCH connection is gone.
    with trio.fail_after(5):
        await emu.wait_open_watches(0)


async def test_watch_jobs_cancels_cleanly_with_its_nursery(
    emu: KubeEmulator, tmp_path: Path
) -> None:
    Cluster(emu.state).write(clusterd_job("a"), "pending")
    entered = trio.Event()
    received: list[JobEvent] = []

    async def consume() -> None:
        async with jobsignal.watch_jobs(config_for(emu, tmp_path), environ={}) as events:
            entered.set()
            async for event in events:
                received.append(event)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await entered.wait()
            await emu.wait_open_watches(1)
            await wait_until(lambda: bool(received), what="the first event")
            nursery.cancel_scope.cancel()  # the consumer is blocked in `async for`
        await emu.wait_open_watches(0)
    assert [event.job.job_name for event in received] == ["a"]


async def test_watch_jobs_refuses_a_broken_kubeconfig_at_once(tmp_path: Path) -> None:
    config = jobsignal.configure(source="kubernetes", kubeconfig=str(tmp_path / "missing"))
    with pytest.raises(jobsignal.ConfigError):
        async with jobsignal.watch_jobs(config, environ={}):
            pytest.fail("entered without a cluster")


# -- open_subscription on a running server -----------------------------------------------------


@asynccontextmanager
async def open_server(config: Config) -> AsyncIterator[jobsignal.RunningJobsignal]:
    async with trio.open_nursery() as nursery:
        server: jobsignal.RunningJobsignal = await nursery.start(
            functools.partial(jobsignal.serve, config, environ={})
        )
        yield server
        server.request_shutdown()


async def test_open_subscription_shares_the_servers_events_and_ends_with_it(
    emu: KubeEmulator, tmp_path: Path
) -> None:
    cluster = Cluster(emu.state)
    cluster.write(clusterd_job("early"), "pending")
    config = config_for(emu, tmp_path, shutdown_grace=1)
    received: list[JobEvent] = []
    with trio.fail_after(15):
        async with open_server(config) as server:
            async with (
                server.open_subscription() as events,
                server.open_subscription(snapshot=False) as live_only,
            ):
                assert len(server._parts.broadcaster.event_queues) == 2
                received.append(await next_event(events))
                cluster.write(clusterd_job("early"), "running")
                received.append(await next_event(events))
                only = await next_event(live_only)
                # Without the snapshot, the first event of a job is ADDED for this consumer.
                assert (only.kind, only.uuid) == (EventKind.ADDED, received[1].uuid)
                server.request_shutdown()
                # The server's shutdown ends the channel: `async for` just stops.
                assert [event async for event in events] == []
            assert server._parts.broadcaster.event_queues == frozenset()
    assert [(e.kind, e.job.job_status) for e in received] == [
        (EventKind.ADDED, "pending"),
        (EventKind.CHANGED, "running"),
    ]
    # The same uuid a gRPC client gets for the same event.
    assert received[1].uuid == event_id(expected_summary(clusterd_job("early"), "running"))


# -- the channel: kinds, order, slow consumers ---------------------------------------------------


def summary(name: str, status: str = "pending", operator: str = "add") -> JobSummary:
    return expected_summary(clusterd_job(name), status, operator)


async def drain(events: JobEvents) -> list[tuple[EventKind, str, str]]:
    result = []
    while events.pending:
        event = await events.receive()
        result.append((event.kind, event.job.job_name, event.job.job_status))
    return result


async def test_events_keep_their_order_per_job_and_kinds_follow_the_consumer() -> None:
    broadcaster = Broadcaster()
    broadcaster.publish([summary("old")])
    events = JobEvents(broadcaster, snapshot=True)
    broadcaster.publish([summary("a"), summary("b"), summary("a", "running")])
    broadcaster.publish([summary("old", "running", "delete"), summary("b", "failed")])
    assert await drain(events) == [
        (EventKind.ADDED, "old", "pending"),  # the snapshot
        (EventKind.ADDED, "a", "pending"),
        (EventKind.ADDED, "b", "pending"),
        (EventKind.CHANGED, "a", "running"),
        (EventKind.DELETED, "old", "running"),
        (EventKind.CHANGED, "b", "failed"),
    ]


async def test_a_lagging_consumer_gets_the_newest_state_per_job() -> None:
    broadcaster = Broadcaster(max_pending=4)
    events = JobEvents(broadcaster, snapshot=False)
    statuses = ["pending", "running", "complete", "failed", "running", "complete"]
    broadcaster.publish([summary("a", status) for status in statuses])
    broadcaster.publish([summary("b")])
    # The fifth state of "a" went over the bound: the four before it were
    # coalesced away; the sixth and "b" queued behind it.
    assert events.pending == 3
    assert broadcaster.stats.coalesced == 4
    assert await drain(events) == [
        (EventKind.ADDED, "a", "running"),  # the first this consumer sees of "a"
        (EventKind.CHANGED, "a", "complete"),
        (EventKind.ADDED, "b", "pending"),
    ]


async def test_a_hopeless_consumer_is_dropped_and_told() -> None:
    broadcaster = Broadcaster(max_pending=4)
    events = JobEvents(broadcaster, snapshot=False)
    broadcaster.publish([summary(f"job-{n}") for n in range(5)])  # 5 jobs: nothing to coalesce
    assert events.pending == 0  # its queue is freed at once
    with pytest.raises(FellBehind, match="fell too far behind"):
        await events.receive()
    broadcaster.publish([summary("later")])  # the others go on; nothing queues for it
    assert events.pending == 0
    events.close()
    assert broadcaster.event_queues == frozenset()


async def test_a_snapshot_is_owed_not_a_backlog() -> None:
    """A consumer joining a cluster larger than its bound still gets every job."""
    broadcaster = Broadcaster(max_pending=4)
    broadcaster.publish([summary(f"job-{n}") for n in range(10)])
    events = JobEvents(broadcaster, snapshot=True)
    broadcaster.publish([summary("job-0", "running")])
    delivered = await drain(events)
    assert len(delivered) == 11
    assert delivered[-1] == (EventKind.CHANGED, "job-0", "running")


async def test_a_closed_channel_refuses_and_unsubscribes() -> None:
    broadcaster = Broadcaster()
    events = JobEvents(broadcaster, snapshot=False)
    await events.aclose()
    assert broadcaster.event_queues == frozenset()
    with pytest.raises(trio.ClosedResourceError):
        await events.receive()


async def test_a_receive_waiting_when_the_channel_closes_is_told() -> None:
    broadcaster = Broadcaster()
    events = JobEvents(broadcaster, snapshot=False)
    outcome: list[BaseException] = []

    async def wait() -> None:
        try:
            await events.receive()
        except trio.ClosedResourceError as error:
            outcome.append(error)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        events.close()
    assert len(outcome) == 1


def test_rank_tables_parse_on_demand_and_tolerate_odd_shapes() -> None:
    assert parse_rank_table("") is None
    odd = parse_rank_table('{"status":1,"server_list":[{"server_id":7,"device":"none"},{}],"x":[]}')
    assert odd is not None
    assert odd.status == "1"
    assert [(s.server_id, s.devices) for s in odd.servers] == [("7", ()), ("", ())]
    assert odd.raw["x"] == []
    state = JobState.of(dataclasses.replace(summary("a"), hccl_json=""))
    assert state.rank_table() is None  # a table stripped for size, or none at all


# -- the examples -------------------------------------------------------------------------------


def run_example(name: str, *args: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result.stdout.splitlines()


def test_the_transitions_example_prints_job_transitions() -> None:
    lines = run_example("job_transitions.py", "6")
    assert len(lines) == 6, lines
    # The demo's first round: three jobs added pending, then each one running.
    assert sum("added" in line and "pending" in line for line in lines) == 3, lines
    assert sum("pending -> running" in line for line in lines) == 3, lines
    assert all(line.startswith("demo/") for line in lines), lines


def test_the_feeding_example_hands_events_to_another_task() -> None:
    lines = run_example("feed_service.py", "3")
    assert len(lines) == 3, lines
    assert all(line.startswith("inventory:") for line in lines), lines
    # The demo runs 2 + 96 + 1 servers of 8 NPUs once every job of a round runs.
    assert lines[-1].startswith("inventory: 3 running jobs, 99 servers, 792 NPUs"), lines
