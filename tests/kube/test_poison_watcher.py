"""Poison ConfigMaps through the real watcher (emulator over 127.0.0.1 HTTP).

Whatever a tenant writes into a labelled ConfigMap, in the initial LIST or by
the watch: start-up completes, the watcher keeps going, each bad ConfigMap is
rejected with its reason (the job's last good state stands), rejections are
logged rate-limited, and every frame a subscriber gets encodes valid UTF-8
with a strict-JSON rank table. Unexpected errors while applying or encoding
one event cost only that event. A large LIST is applied with checkpoints.
Every watcher test runs straight to the emulator and through a CONNECT proxy
of the tests' own (`WatchPath`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

import jobsignal.fanout.encoding as encoding_module
import jobsignal.store.configmap as configmap_module
from jobsignal._proto.job import JobSummarySignal, JobSummarySignalList
from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.kube import documents
from jobsignal.kube import watcher as watcher_module
from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.sim.emulator import KubeEmulator, RawJson
from jobsignal.store import JobStore, JobSummary
from jobsignal.store.jobs import Changes
from tests.support.cluster import Cluster, expected_summary
from tests.support.factories import clusterd_job
from tests.support.waiting import wait_until
from tests.support.watching import WatchHarness, WatchPath


@pytest.fixture(params=["direct", "proxy"])
def watch_path(request: pytest.FixtureRequest) -> Iterator[WatchPath]:
    """Each watcher test straight to the emulator and through a CONNECT proxy."""
    path = WatchPath(request.param)
    yield path
    path.check_carried()


def strict_loads(text: str) -> Any:
    def refuse(literal: str) -> Any:
        raise ValueError(f"not JSON: {literal}")

    return json.loads(text, parse_constant=refuse)


def create(emu: KubeEmulator, name: str, data: dict[str, str]) -> None:
    emu.state.create_configmap("ns", name, JOB_LABELS, data)


def write_poison(emu: KubeEmulator, tag: str) -> dict[str, int]:
    """One poison job per kind (each name ending in `tag`); returns the expected reasons."""
    expected: Counter[str] = Counter()

    def poison_table(
        name: str, old: str, new: str, reason: str, servers: int = 1, per_configmap: int = 1000
    ) -> None:
        bad = clusterd_job(f"{name}-{tag}", servers=servers, servers_per_configmap=per_configmap)
        for cm_name, data in bad.configmaps("running"):
            create(emu, cm_name, {**data, "hccl.json": data["hccl.json"].replace(old, new)})
            expected[reason] += 1

    # The reported crash: a split job whose rank table escapes a lone surrogate.
    poison_table(
        "surrogate", '"node-', '"\\udc80node-', "hccl_json_not_strict", servers=2, per_configmap=1
    )
    poison_table("nan", '"total":', '"x":NaN,"total":', "hccl_json_not_strict")
    poison_table(
        "inf",
        '"total":',
        '"x":-Infinity,"total":',
        "hccl_json_not_strict",
        servers=2,
        per_configmap=1,
    )
    poison_table("huge", '"total":', f'"x":1{"0" * 5000},"total":', "hccl_json_not_strict")
    poison_table(
        "deep", '"total":', '"x":' + "[" * 5000 + "]" * 5000 + ',"total":', "hccl_json_too_deep"
    )
    fields = {
        "raw-surrogate": ("job_name", "name\udc80", "not_utf8"),  # sent as a JSON escape
        "long-id": ("job_id", "u" * 10_000, "too_long"),
        "bad-index": ("cm_index", "\u0661", "bad_index"),
    }
    for name, (key, value, reason) in fields.items():
        cm_name, data = clusterd_job(f"{name}-{tag}").configmaps("running")[0]
        create(emu, cm_name, {**data, key: value})
        expected[reason] += 1
    return dict(expected)


def assert_frames_deliverable(events: list[Any]) -> None:
    for event in events:
        if event.job.hccl_json:
            strict_loads(event.job.hccl_json)
        for value in dataclasses.astuple(event.job):
            if isinstance(value, str):
                value.encode("utf-8")


async def test_poison_in_the_initial_list_and_the_watch_never_stops_the_watcher(
    io_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, watch_path: WatchPath
) -> None:
    caplog.set_level(logging.WARNING, logger="jobsignal.kube.watcher")
    async with watch_path.emulator() as emu:
        cluster = Cluster(emu.state)
        good, split = (
            clusterd_job("good"),
            clusterd_job("split", servers=3, servers_per_configmap=2),
        )
        cluster.write(good, "running")
        cluster.write(split, "running")
        listed_reasons = write_poison(emu, "listed")
        async with watch_path.watcher(emu) as harness:
            with trio.fail_after(10):
                await harness.status.ready.wait()  # the poison did not stop start-up
            await harness.caught_up(cluster)
            assert harness.store.rejected_total == listed_reasons
            # The same poison again, now by the watch; then a change that is fine.
            watched_reasons = write_poison(emu, "watched")
            cluster.write(good, "complete")
            await harness.caught_up(cluster)
            # A good job's ConfigMap rewritten with poison: its last good state stands.
            name, data = split.configmaps("complete")[1]
            emu.state.update_configmap("ns", name, data={**data, "hccl.json": "[NaN]"})
            cluster.write(good, "failed")
            await wait_until(
                lambda: (
                    harness.log.live().get(expected_summary(good, "failed").key)
                    == expected_summary(good, "failed")
                )
            )
            counters = harness.watcher.counters
            assert counters.apply_errors == 0 and counters.errors == 0
            assert counters.lists == 1
        expected = dict(Counter(listed_reasons) + Counter(watched_reasons))
        expected["hccl_json_not_strict"] += 1
        assert harness.store.rejected_total == expected
        assert harness.log.live() == {
            expected_summary(good, "failed").key: expected_summary(good, "failed"),
            expected_summary(split, "running").key: expected_summary(split, "running"),
        }
        assert {e.job.job_id for e in harness.log.events} == {"uid-good", "uid-split"}
        assert_frames_deliverable(harness.log.events)
    # Rate-limited: at most 5 lines per reason (burst) in the minute this took.
    lines = Counter(
        r.getMessage().split(": ")[1]
        for r in caplog.records
        if "skipped ConfigMap" in r.getMessage()
    )
    assert set(lines) == set(expected)
    assert all(count <= 5 for count in lines.values()), lines
    assert all(len(r.getMessage()) < 500 for r in caplog.records)


def deep_managed_fields(depth: int) -> RawJson:
    """managedFields whose one entry nests `depth` levels of fields, as a writer may
    set them (the API server's decoder allows 10,000)."""
    fields = '{"f:data":' * depth + "{}" + "}" * depth
    entry = '{"manager":"tenant","operation":"Update","apiVersion":"v1","fieldsType":"FieldsV1"'
    return RawJson(f'[{entry},"fieldsV1":{fields}}}]')


async def test_managed_fields_too_deep_for_json_cost_no_job_its_state(
    io_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, watch_path: WatchPath
) -> None:
    # Deeper than Python's json decodes on any version (about 1,000 to 10,000).
    deep = deep_managed_fields(20_000)
    caplog.set_level(logging.WARNING, logger="jobsignal.kube")
    async with watch_path.emulator() as emu:
        cluster = Cluster(emu.state)
        listed, watched, plain = clusterd_job("listed"), clusterd_job("watched"), clusterd_job("b")
        cluster.write(listed, "running", managed_fields=deep)
        cluster.write(plain, "running")
        async with watch_path.watcher(emu) as harness:
            with trio.fail_after(10):
                await harness.status.ready.wait()
            await harness.caught_up(cluster)
            # By the watch: a new job with deep fields, then a change to one listed with them.
            cluster.write(watched, "pending", managed_fields=deep)
            cluster.write(listed, "complete")
            cluster.write(plain, "complete")
            await harness.caught_up(cluster)
            counters = harness.watcher.counters
            assert (counters.lists, counters.errors, counters.apply_errors) == (1, 0, 0)
    assert harness.log.live() == {
        expected_summary(job, status).key: expected_summary(job, status)
        for job, status in ((listed, "complete"), (watched, "pending"), (plain, "complete"))
    }
    warnings = [r.getMessage() for r in caplog.records if "nested deeper" in r.getMessage()]
    assert warnings[0].startswith("LIST response nested deeper than 64 levels: 1 values")
    assert any(w.startswith("WATCH event nested deeper than 64 levels") for w in warnings)


async def test_rejection_logs_are_rate_limited_per_reason(
    io_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, watch_path: WatchPath
) -> None:
    caplog.set_level(logging.WARNING, logger="jobsignal.kube.watcher")
    async with watch_path.emulator() as emu:
        for index in range(40):
            name, data = clusterd_job(f"nan-{index}").configmaps("running")[0]
            create(emu, name, {**data, "hccl.json": "NaN"})
        async with watch_path.watcher(emu) as harness:
            with trio.fail_after(10):
                await harness.status.ready.wait()
            assert harness.store.rejected_total == {"hccl_json_not_strict": 40}
            await trio.sleep(61)  # the next window: one more line, with the summary
            name, data = clusterd_job("nan-late").configmaps("running")[0]
            create(emu, name, {**data, "hccl.json": "NaN"})
            await wait_until(lambda: harness.store.rejected_total["hccl_json_not_strict"] == 41)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("skipped ConfigMap" in m for m in messages) == 6
    assert any("35 similar messages suppressed" in m for m in messages)


@asynccontextmanager
async def cursed_then_a_runs(
    watch_path: WatchPath,
) -> AsyncIterator[tuple[WatchHarness, Cluster, ClusterdJob]]:
    """A watcher caught up with job "a" pending; then job "cursed" is written
    running, and "a" made running."""
    async with watch_path.emulator() as emu:
        cluster = Cluster(emu.state)
        a = clusterd_job("a")
        cluster.write(a, "pending")
        async with watch_path.watcher(emu) as harness:
            await harness.caught_up(cluster)
            cluster.write(clusterd_job("cursed"), "running")
            cluster.write(a, "running")
            yield harness, cluster, a


async def test_unexpected_error_applying_one_event_skips_only_that_event(
    io_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    watch_path: WatchPath,
) -> None:
    real_apply = JobStore.apply

    def apply(self: JobStore, kind: str, obj: dict[str, Any], now: float) -> Changes:
        if obj["metadata"]["name"] == "job-summary-cursed":
            raise RuntimeError("a bug in the store")
        return real_apply(self, kind, obj, now)

    monkeypatch.setattr(JobStore, "apply", apply)
    async with cursed_then_a_runs(watch_path) as (harness, _, a):
        await wait_until(lambda: harness.log.jobs()[-1] == expected_summary(a, "running"))
        assert harness.watcher.counters.apply_errors == 1
        assert harness.watcher.counters.watches == 1  # the watch went on
    assert any("applying a ADDED event failed" in r.getMessage() for r in caplog.records)


async def test_an_unforeseen_error_of_the_api_layer_costs_a_relist_not_the_watcher(
    io_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    watch_path: WatchPath,
) -> None:
    real_loads = documents.loads
    failures = [KeyError("a bug in the WATCH decoding"), KeyError("and again in the LIST")]

    def loads(data: bytes | str) -> tuple[Any, int]:
        cursed = b"job-summary-cursed" in (data if isinstance(data, bytes) else data.encode())
        if cursed and failures:
            raise failures.pop(0)
        return real_loads(data)

    monkeypatch.setattr(documents, "loads", loads)
    async with cursed_then_a_runs(watch_path) as (harness, cluster, a):
        # The watch event fails, then the relist: a backoff after each.
        await harness.caught_up(cluster, timeout=60)
        counters = harness.watcher.counters
        assert (counters.errors, counters.lists) == (2, 2)  # one LIST failed
        assert harness.status.ready.is_set()
    assert harness.log.live() == {
        expected_summary(job, "running").key: expected_summary(job, "running")
        for job in (a, clusterd_job("cursed"))
    }
    failed = [r for r in caplog.records if "failed unexpectedly" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.ERROR] * 2
    assert all(r.exc_info is not None for r in failed)


async def test_parser_bug_rejects_one_configmap_and_is_logged_with_where_it_failed(
    io_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    watch_path: WatchPath,
) -> None:
    real_parse = configmap_module.parse_slice

    def parse(obj: dict[str, Any], previous: Any = None) -> Any:
        if obj["metadata"]["name"] == "job-summary-cursed":
            raise KeyError("x" * 10_000)
        return real_parse(obj, previous)

    monkeypatch.setattr("jobsignal.store.jobs.parse_slice", parse)
    async with watch_path.emulator() as emu:
        a = clusterd_job("a")
        create(emu, *a.configmaps("running")[0])
        create(emu, *clusterd_job("cursed").configmaps("running")[0])
        async with watch_path.watcher(emu) as harness:
            with trio.fail_after(10):
                await harness.status.ready.wait()
            running = expected_summary(a, "running")
            assert harness.log.live() == {running.key: running} or not harness.log.events
            await wait_until(lambda: harness.log.live() == {running.key: running})
            assert harness.store.rejected_total == {"internal_error": 1}
    [line] = [r.getMessage() for r in caplog.records if "internal_error" in r.getMessage()]
    assert "ns/job-summary-cursed" in line and "KeyError" in line
    assert "test_poison_watcher.py" in line and len(line) < 600


async def test_unencodable_event_is_dropped_and_the_watcher_goes_on(
    io_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    watch_path: WatchPath,
) -> None:
    # The store never emits such an event now; inject a failing encoder to
    # check the last line of defence behind it.
    real_encode = encoding_module.encode_signal

    def encode(job: JobSummary, uuid: str, *, strip_rank_table: bool = False) -> bytes:
        if job.job_name == "cursed":
            "\udc80".encode()
        return real_encode(job, uuid, strip_rank_table=strip_rank_table)

    monkeypatch.setattr("jobsignal.fanout.broadcaster.encode_signal", encode)
    async with cursed_then_a_runs(watch_path) as (harness, _, a):
        await wait_until(lambda: harness.log.jobs()[-1] == expected_summary(a, "running"))
        stats = harness.broadcaster.stats
        assert stats.events_dropped == {"publish": 1}
        # A snapshot subscriber now gets the jobs that can be sent.
        late = harness.broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "late", snapshot=True)
        frames = [JobSummarySignal.parse(f) for f in await late.next_batch(10)]
        assert [f.job_id for f in frames] == ["uid-a"]
        assert harness.watcher.counters.apply_errors == 0


def poison_summary(job_id: str) -> JobSummary:
    return JobSummary(
        "ns", job_id, "bad\udc80", "pytorch", "running", "1", "1", "{}", "", "", "", "add", ""
    )


def good_summary(job_id: str) -> JobSummary:
    return JobSummary(
        "ns", job_id, "good", "pytorch", "running", "1", "1", "{}", "", "", "", "add", ""
    )


async def test_broadcaster_drops_an_unencodable_event_in_publish_and_in_snapshots() -> None:
    broadcaster = Broadcaster()
    # Nobody subscribed: encoding is deferred, so the failure shows in the snapshot.
    broadcaster.publish([good_summary("a"), poison_summary("b")])
    [batch] = await broadcaster.snapshot_batches()
    parsed = JobSummarySignalList.parse(batch)
    assert [s.job_id for s in parsed.job_summary_signals] == ["a"]
    assert parsed.job_total_num == 1
    assert broadcaster.stats.events_dropped == {"snapshot": 1}
    # Subscribed: the event is dropped at publish; the next events still go out.
    subscriber = broadcaster.subscribe(StreamKind.SIGNAL, "FdAgent", "x", snapshot=True)
    lister = broadcaster.subscribe(StreamKind.LIST, "FdAgent", "y", snapshot=True)
    broadcaster.publish([poison_summary("c"), good_summary("d")])
    frames = [JobSummarySignal.parse(f) for f in await subscriber.next_batch(10)]
    assert [f.job_id for f in frames] == ["a", "d"]
    await lister.compose_snapshot()
    assert lister.pending == 2  # its snapshot, then d
    assert broadcaster.stats.events_dropped == {"snapshot": 1, "publish": 1}
    assert {e.job.job_id for e in broadcaster.latest()} == {"a", "d"}


async def test_a_large_list_is_applied_with_checkpoints(
    io_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, watch_path: WatchPath
) -> None:
    """No more than about PARSE_SLICE characters parsed, COMMIT_SLICE ConfigMaps
    stored, nor SETTLE_SLICE slices settled, without letting another task run."""
    ticks = 0
    parsed_at: list[int] = []
    settled_at: list[int] = []
    real_parse = configmap_module.parse_slice
    real_recompute = JobStore._recompute_one
    inserted_at: list[int] = []
    real_insert = JobStore._insert

    def parse(obj: dict[str, Any], previous: Any = None) -> Any:
        parsed_at.append(ticks)
        return real_parse(obj, previous)

    def recompute(self: JobStore, *args: Any, **kwargs: Any) -> None:
        settled_at.append(ticks)
        real_recompute(self, *args, **kwargs)

    def insert(self: JobStore, *args: Any, **kwargs: Any) -> None:
        inserted_at.append(ticks)
        real_insert(self, *args, **kwargs)

    monkeypatch.setattr("jobsignal.store.jobs.parse_slice", parse)
    monkeypatch.setattr(JobStore, "_recompute_one", recompute)
    monkeypatch.setattr(JobStore, "_insert", insert)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.lowlevel.checkpoint()
            ticks += 1

    async with watch_path.emulator() as emu:
        jobs = [clusterd_job(f"j{i}", servers=4) for i in range(2500)]
        for each in jobs:
            create(emu, *each.configmaps("running")[0])
        table_chars = len(jobs[0].configmaps("running")[0][1]["hccl.json"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            async with watch_path.watcher(emu) as harness:
                with trio.fail_after(30):
                    await harness.status.ready.wait()
                nursery.cancel_scope.cancel()
            assert harness.broadcaster.job_count() == 2500
    # Trio runs every runnable task once per scheduling batch, in random order,
    # so two of the watcher's slices can fall between two turns of the ticker.
    assert len(parsed_at) == 2500
    most_parsed = max(Counter(parsed_at).values())
    assert most_parsed <= 2 * (watcher_module.PARSE_SLICE // table_chars + 1), most_parsed
    assert len(inserted_at) == 2500
    most_inserted = max(Counter(inserted_at).values())
    assert most_inserted <= 2 * watcher_module.COMMIT_SLICE, most_inserted
    assert len(settled_at) == 2500
    most_settled = max(Counter(settled_at).values())
    assert most_settled <= 2 * watcher_module.SETTLE_SLICE, most_settled
    assert len(set(settled_at)) >= 2
