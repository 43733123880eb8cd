"""The watcher against the Kubernetes API emulator, over real 127.0.0.1 HTTP.

One test per rule of docs/architecture.md section 5 (LIST then WATCH, paging, resume,
bookmarks, 410 in both forms, dropped / stalled / malformed streams, backoff,
429, 401, restarts with a history gap, namespaces, readiness, the label
selector). Every test observes what a client would: the frames a Broadcaster
subscriber receives, decoded; plus the watcher's counters and the requests the
emulator recorded. After every fault: no lost change, no duplicate event, and
the subscriber ends up holding exactly the cluster's state.

All tests run in virtual time on `io_clock`: the emulator, httpx and the
watcher all time themselves with trio's clock, nothing here uses threads, and
the clock jumps only once loopback I/O has been still for a real moment
(tests/conftest.py), so I/O and timers interleave deterministically.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

from jobsignal.kube.credentials import TokenSource
from jobsignal.kube.watcher import WatchSettings
from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.sim.emulator import (
    Drop,
    ExpireWatch,
    HttpError,
    KubeEmulator,
    MalformedLine,
    SplitLines,
    Stall,
    open_emulator,
)
from jobsignal.status import SourceStatus
from jobsignal.store import jobs
from jobsignal.util.backoff import Backoff
from tests.support.cluster import SELECTOR, Cluster, expected_summary, hccl
from tests.support.events import assert_no_duplicates, assert_replays
from tests.support.factories import clusterd_job
from tests.support.waiting import wait_until
from tests.support.watching import WALL, WatchHarness, open_watcher


def watches(emu: KubeEmulator) -> list[dict[str, str]]:
    return [dict(r.query) for r in emu.requests if r.kind == "watch"]


def lists(emu: KubeEmulator) -> list[dict[str, str]]:
    return [dict(r.query) for r in emu.requests if r.kind == "list"]


def gaps(times: list[float]) -> list[float]:
    return [round(later - earlier, 3) for earlier, later in itertools.pairwise(times)]


def check_faithful(harness: WatchHarness, cluster: Cluster, *, exact: bool) -> None:
    """No duplicate, every event a real state of its job (all of them if `exact`)."""
    assert_no_duplicates(harness.log.events)
    assert_replays(cluster, harness.log.events, exact=exact)
    assert harness.log.live() == cluster.live()


# -- LIST, then WATCH ----------------------------------------------------------------


async def test_list_then_watch_from_the_lists_version(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        a, b = clusterd_job("a"), clusterd_job("b", servers=2)
        cluster.write(a, "pending")
        cluster.write(b, "running")
        # The newest write is not selected: the LIST's version is newer than any item's.
        emu.state.create_configmap("ns", "unrelated", {"app": "other"}, {"k": "v"})
        list_version = str(emu.state.resource_version)
        async with open_watcher(emu, WatchSettings(watch_timeout=240)) as harness:
            await harness.watch_open()
            await harness.caught_up(cluster)
            counters = harness.watcher.counters
            assert (counters.lists, counters.watches, counters.errors) == (1, 1, 0)

        first, second = list(emu.requests)[:2]
        assert first.kind == "list" and first.path == "/api/v1/configmaps"
        assert dict(first.query) == {"labelSelector": SELECTOR, "limit": "500"}
        assert second.kind == "watch" and second.path == "/api/v1/configmaps"
        assert dict(second.query) == {
            "labelSelector": SELECTOR,
            "resourceVersion": list_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "240",
            "watch": "1",
        }
        labelled = [o for o in emu.state.objects() if o.labels.get("outside-job-info")]
        assert list_version not in {str(o.resource_version) for o in labelled}
        assert harness.log.jobs() == [
            expected_summary(a, "pending"),
            expected_summary(b, "running"),
        ]


async def test_paged_list_assembles_every_item(io_clock: trio.testing.MockClock) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        jobs = [
            clusterd_job("a"),
            clusterd_job("big", servers=7, servers_per_configmap=2),
            clusterd_job("c"),
            clusterd_job("d"),
        ]
        for each in jobs:
            cluster.write(each, "running")
        assert len(emu.state) == 7
        wrote_during_list = False

        def write_between_pages(response: object) -> None:
            # ClusterD writes while the LIST is being paged: the pages still
            # come from one snapshot and the write arrives by the WATCH.
            nonlocal wrote_during_list
            if not wrote_during_list:
                wrote_during_list = True
                cluster.write(jobs[0], "complete")

        settings = WatchSettings(page_size=2)
        async with open_watcher(emu, settings, on_response=write_between_pages) as harness:
            await harness.watch_open()
            await harness.caught_up(cluster)
            assert harness.watcher.counters.lists == 1
            assert harness.watcher.counters.events == 1

        pages = lists(emu)
        assert len(pages) == 4  # 7 ConfigMaps, 2 per page
        assert all(page["limit"] == "2" and page["labelSelector"] == SELECTOR for page in pages)
        assert "continue" not in pages[0]
        tokens = [page["continue"] for page in pages[1:]]
        assert len(set(tokens)) == 3
        # The watch starts at the snapshot of the pages, before the write.
        assert watches(emu)[0]["resourceVersion"] == str(emu.state.resource_version - 1)
        assert harness.log.jobs() == [
            *(expected_summary(each, "running") for each in jobs),
            expected_summary(jobs[0], "complete"),
        ]
        big = harness.log.jobs()[1]
        assert big.total == "4"
        assert [s["server_name"] for s in hccl(big)["server_list"]] == [
            f"node-{i}" for i in range(7)
        ]


async def page_bytes(emu: KubeEmulator, limit: int) -> int:
    """The size of the first LIST page of `limit` ConfigMaps, as the emulator sends it."""
    async with httpx.AsyncClient(base_url=emu.url) as client:
        response = await client.get(
            "/api/v1/configmaps", params={"labelSelector": SELECTOR, "limit": str(limit)}
        )
    return len(response.content)


async def test_a_page_over_the_byte_bound_is_asked_for_again_in_halves(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        for name in "abcdef":
            cluster.write(clusterd_job(name, servers=3), "running")
        # Room for two ConfigMaps a page, not for four.
        bound = (await page_bytes(emu, 2) + await page_bytes(emu, 4)) // 2
        asked_before = len(lists(emu))
        async with open_watcher(emu, WatchSettings(page_size=4), max_page_bytes=bound) as harness:
            await harness.watch_open()
            await harness.caught_up(cluster)
            assert harness.watcher.counters.lists == 1
            assert harness.watcher.counters.errors == 0
        pages = lists(emu)[asked_before:]
        assert [page["limit"] for page in pages] == ["4", "2", "2", "2"]
        # The refused first page is asked for again as it was, only smaller.
        assert "continue" not in pages[0] and "continue" not in pages[1]
        assert len({page["continue"] for page in pages[2:]}) == 2
        assert len(harness.log.live()) == 6


async def test_a_single_configmap_over_the_byte_bound_fails_the_list_and_it_is_retried(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        cluster.write(clusterd_job("a", servers=3), "running")
        cluster.write(clusterd_job("b", servers=3), "running")
        bound = await page_bytes(emu, 1) // 2
        asked_before = len(lists(emu))
        settings = WatchSettings(page_size=2, backoff_initial=1.0, backoff_max=1.0)
        async with open_watcher(emu, settings, max_page_bytes=bound) as harness:
            await wait_until(lambda: harness.watcher.counters.errors >= 2, within=30)
            assert not harness.status.ready.is_set()
            assert f"over {bound} bytes" in harness.status.problem
        limits = [page["limit"] for page in lists(emu)[asked_before:]]
        assert limits[:4] == ["2", "1", "2", "1"]  # each LIST starts at the full page size


async def test_clean_watch_end_resumes_from_the_last_version_without_relist(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_emulator(bookmark_interval=60) as emu:
        cluster = Cluster(emu.state)
        a, b = clusterd_job("a"), clusterd_job("b")
        cluster.write(a, "pending")
        async with open_watcher(emu, WatchSettings(watch_timeout=5)) as harness:
            await harness.caught_up(cluster)
            for status in ("running", "complete"):
                await trio.sleep(7)  # a watch ends every 5 s
                cluster.write(a, status)
                cluster.write(b, status)
                await harness.caught_up(cluster)
            await trio.sleep(11)
            counters = harness.watcher.counters
            assert counters.lists == 1
            assert counters.watch_restarts >= 4
            assert counters.errors == counters.relists_after_gone == 0
        check_faithful(harness, cluster, exact=True)
        versions = [int(query["resourceVersion"]) for query in watches(emu)]
        assert versions == sorted(versions)
        assert versions[-1] == emu.state.resource_version


async def test_bookmarks_advance_the_version(io_clock: trio.testing.MockClock) -> None:
    async with open_emulator(bookmark_interval=2) as emu:
        cluster = Cluster(emu.state)
        a = clusterd_job("a")
        cluster.write(a, "running")
        async with open_watcher(emu, WatchSettings(watch_timeout=10)) as harness:
            await harness.caught_up(cluster)
            event_version = emu.state.resource_version
            # Writes the selector filters out: no event, only bookmarks know of them.
            for i in range(5):
                emu.state.create_configmap("ns", f"other-{i}", {"app": "x"}, {"i": str(i)})
            await wait_until(lambda: harness.watcher.counters.bookmarks >= 1)
            # Forget all history: resuming from the last *event* would now be 410.
            emu.state.compact()
            await wait_until(lambda: len(watches(emu)) == 2, within=30)
            await trio.sleep(1)
            counters = harness.watcher.counters
            assert counters.events == 0
            assert counters.lists == 1 and counters.relists_after_gone == 0
        resumed = watches(emu)[1]["resourceVersion"]
        assert int(resumed) == emu.state.resource_version > event_version


# -- 410: relist and emit exactly the differences ----------------------------------------


async def test_410_error_event_relists_and_emits_exactly_the_differences(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        a, b, c, d, e = (clusterd_job(name) for name in "abcde")
        for each in (a, b, c, d):
            cluster.write(each, "running")
        emu.faults.push(ExpireWatch(after_events=1))
        async with open_watcher(emu) as harness:
            await harness.watch_open()
            await harness.caught_up(cluster)
            before = len(harness.log.events)
            # One burst: the watch delivers the first change, then says 410.
            cluster.write(a, "complete")
            cluster.write(b, "failed")
            cluster.remove(c)
            cluster.write(e, "pending")
            await harness.caught_up(cluster)
            counters = harness.watcher.counters
            assert counters.relists_after_gone == 1 and counters.lists == 2
            assert counters.events == 1 and counters.errors == 0
            assert harness.status.in_sync

        after = harness.log.jobs()[before:]
        ended = expected_summary(c, "running", "delete", int(WALL))
        assert after[0] == expected_summary(a, "complete")  # by the watch
        assert sorted(after[1:], key=lambda j: j.job_id) == [  # by the relist
            expected_summary(b, "failed"),
            ended,
            expected_summary(e, "pending"),
        ]
        check_faithful(harness, cluster, exact=True)


async def test_plain_http_410_relists(io_clock: trio.testing.MockClock) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        a, b = clusterd_job("a"), clusterd_job("b")
        cluster.write(a, "pending")
        cluster.write(b, "pending")
        wrote = False

        def write_after_list(response: object) -> None:
            nonlocal wrote
            if not wrote:  # the watch that should deliver this gets 410 instead
                wrote = True
                cluster.write(a, "running")

        emu.faults.push(HttpError(410, target="watch"))
        async with open_watcher(emu, on_response=write_after_list) as harness:
            await harness.watch_open()
            await harness.caught_up(cluster)
            cluster.write(b, "running")
            await harness.caught_up(cluster)
            counters = harness.watcher.counters
            assert (counters.lists, counters.relists_after_gone, counters.errors) == (2, 1, 0)
        # The relist's version includes the write; the next watch starts there.
        assert int(watches(emu)[1]["resourceVersion"]) == emu.state.resource_version - 1
        assert harness.log.jobs() == [
            expected_summary(a, "pending"),
            expected_summary(b, "pending"),
            expected_summary(a, "running"),
            expected_summary(b, "running"),
        ]
        check_faithful(harness, cluster, exact=True)


async def test_repeated_410_backs_off_between_relists(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        cluster.write(clusterd_job("a"), "running")
        emu.faults.push(*[HttpError(410, target="watch")] * 6)
        async with open_watcher(emu, rng=lambda: 1.0) as harness:
            await wait_until(lambda: len(emu.faults) == 0, within=120)
            # The initial LIST plus one relist per 410.
            await wait_until(lambda: harness.watcher.counters.lists == 7, within=120)
            await harness.caught_up(cluster)
        # The first 410 relists at once; the next ones, with no progress in between,
        # should be spaced like any other error (0.8 s doubling, jitter down to half).
        spacing = gaps(harness.sent_times("list"))[1:]
        assert len(spacing) == 5
        assert min(spacing) >= 0.4 and spacing == sorted(spacing)


# -- broken streams: resume from the last version -------------------------------------------

#: Faults that break a watch after its first two events, and how a test names them.
BROKEN_STREAMS = {
    "drop-between-lines": Drop(after_events=2),
    "drop-mid-line": Drop(after_events=2, mid_line=True),
    "stall": Stall(after_events=2),
    "malformed-line": MalformedLine(after_events=2),
}


def burst(cluster: Cluster, a: ClusterdJob, b: ClusterdJob) -> None:
    """Four changes in one go: they travel in one batch of the watch."""
    cluster.write(a, "running")
    cluster.write(b, "pending")
    cluster.write(a, "complete")
    cluster.write(b, "running")


@asynccontextmanager
async def caught_up_with_a_fault_ahead(
    job: ClusterdJob, fault: Drop | Stall | MalformedLine
) -> AsyncIterator[tuple[KubeEmulator, Cluster, WatchHarness]]:
    """A watcher (90 s read timeout) caught up with `job` pending, `fault` queued."""
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        cluster.write(job, "pending")
        emu.faults.push(fault)
        async with open_watcher(emu, read_timeout=90.0) as harness:
            await harness.watch_open()
            await harness.caught_up(cluster)
            yield emu, cluster, harness


@pytest.mark.parametrize("fault", BROKEN_STREAMS.values(), ids=BROKEN_STREAMS.keys())
async def test_broken_watch_rewatches_without_relist_loss_or_duplicates(
    io_clock: trio.testing.MockClock, fault: Drop | Stall | MalformedLine
) -> None:
    a, b = clusterd_job("a"), clusterd_job("b", servers=3, servers_per_configmap=2)
    async with caught_up_with_a_fault_ahead(a, fault) as (_, cluster, harness):
        broken_at = trio.current_time()
        cluster.write(a, "running")  # event 1
        cluster.write(b, "pending")  # events 2 and 3: the fault falls between them
        cluster.write(a, "complete")
        await harness.caught_up(cluster, timeout=200)
        waited = trio.current_time() - broken_at
        counters = harness.watcher.counters
        assert counters.errors == 1 and counters.watches == 2
        assert counters.lists == 1 and counters.relists_after_gone == 0
        assert harness.status.in_sync
    check_faithful(harness, cluster, exact=True)
    assert len(harness.log.events) == 4
    # A silent stream is given up after the read timeout; the others at once.
    # Either way the watcher then waits out one backoff step (0.6 s here).
    assert waited == pytest.approx(90.6 if isinstance(fault, Stall) else 0.6, abs=0.05)


@pytest.mark.parametrize("fault", BROKEN_STREAMS.values(), ids=BROKEN_STREAMS.keys())
async def test_broken_watch_resumes_after_the_last_event_it_delivered(
    io_clock: trio.testing.MockClock, fault: Drop | Stall | MalformedLine
) -> None:
    a = clusterd_job("a")
    async with caught_up_with_a_fault_ahead(a, fault) as (emu, cluster, harness):
        cluster.write(a, "running")  # event 1
        cluster.write(a, "complete")  # event 2, then the stream breaks
        delivered = emu.state.resource_version
        await harness.caught_up(cluster, timeout=200)
        await wait_until(lambda: len(watches(emu)) == 2, within=200)
        await trio.sleep(1)
    statuses = [(j.job_status, j.operator) for j in harness.log.jobs()]
    assert statuses == [("pending", "add"), ("running", "add"), ("complete", "add")]
    assert_no_duplicates(harness.log.events)
    assert watches(emu)[1]["resourceVersion"] == str(delivered)


async def test_lines_split_over_reads_are_reassembled(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        a, b = clusterd_job("a", servers=5), clusterd_job("b")
        emu.faults.push(SplitLines())
        async with open_watcher(emu) as harness:
            await harness.watch_open()
            burst(cluster, a, b)
            await harness.caught_up(cluster)
            assert harness.watcher.counters.errors == 0
        check_faithful(harness, cluster, exact=True)
        assert len(harness.log.events) == 4


async def test_quiet_watch_with_bookmarks_is_not_restarted(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_emulator(bookmark_interval=60) as emu:
        cluster = Cluster(emu.state)
        cluster.write(clusterd_job("a"), "running")
        async with open_watcher(emu, WatchSettings(watch_timeout=600), read_timeout=90) as h:
            await h.caught_up(cluster)
            await trio.sleep(500)  # nothing happens but bookmarks
            counters = h.watcher.counters
            assert counters.bookmarks >= 8
            assert (counters.watches, counters.errors) == (1, 0)


# -- errors: backoff, Retry-After, credentials ------------------------------------------------


async def record_status(status: SourceStatus, out: list[tuple[float, bool, bool]]) -> None:
    while True:
        out.append((trio.current_time(), status.ready.is_set(), status.in_sync))
        await status.wait_changed()


@pytest.mark.parametrize(("jitter", "factor"), [(1.0, 1.0), (0.0, 0.5)])
async def test_server_errors_back_off_exponentially_up_to_30s(
    io_clock: trio.testing.MockClock, jitter: float, factor: float
) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        a = clusterd_job("a")
        cluster.write(a, "pending")
        emu.faults.push(*[HttpError(500, target="list")] * 8)
        settings = WatchSettings(watch_timeout=5)
        async with (
            open_watcher(emu, settings, rng=lambda: jitter) as harness,
            trio.open_nursery() as nursery,
        ):
            seen: list[tuple[float, bool, bool]] = []
            nursery.start_soon(record_status, harness.status, seen)
            await wait_until(lambda: harness.watcher.counters.errors == 3)
            assert not harness.status.ready.is_set() and not harness.status.in_sync
            assert "500" in harness.status.problem
            with trio.fail_after(200):
                await harness.status.ready.wait()
                await emu.wait_open_watches(1)
            await harness.caught_up(cluster)

            # Later errors (after the watch times out): out of sync meanwhile,
            # the last state still served.
            emu.faults.push(*[HttpError(503, target="watch")] * 3)
            await wait_until(lambda: harness.watcher.counters.errors == 11)
            assert not harness.status.in_sync
            assert harness.broadcaster.job_count() == 1
            cluster.write(a, "running")
            await harness.caught_up(cluster, timeout=60)
            assert harness.status.in_sync
            nursery.cancel_scope.cancel()

        expected = [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]
        assert gaps(harness.sent_times("list")) == pytest.approx(
            [d * factor for d in expected], abs=0.02
        )
        # The backoff starts over after a success.
        assert gaps(harness.sent_times("watch"))[1:4] == pytest.approx(
            [d * factor for d in (0.8, 1.6, 3.2)], abs=0.02
        )
        in_sync = [synced for _, _, synced in seen]
        transitions = [s for i, s in enumerate(in_sync) if i == 0 or s != in_sync[i - 1]]
        assert transitions == [False, True, False, True]
        check_faithful(harness, cluster, exact=True)


def test_backoff_delays_and_jitter() -> None:
    ceiling = Backoff(0.8, 30.0, lambda: 0.999999)
    assert [round(ceiling.next_delay(), 2) for _ in range(9)] == [
        0.8,
        1.6,
        3.2,
        6.4,
        12.8,
        25.6,
        30.0,
        30.0,
        30.0,
    ]
    halves = Backoff(0.8, 30.0, lambda: 0.0)
    assert [halves.next_delay() for _ in range(3)] == [0.4, 0.8, 1.6]
    halves.reset()
    assert halves.next_delay() == 0.4


@pytest.mark.parametrize(("retry_after", "delay"), [(7, 7.0), (None, 0.6)])
async def test_429_honours_retry_after(
    io_clock: trio.testing.MockClock, retry_after: int | None, delay: float
) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        cluster.write(clusterd_job("a"), "running")
        emu.faults.push(HttpError(429, retry_after=retry_after, target="watch"))
        async with open_watcher(emu, rng=lambda: 0.5) as harness:
            await wait_until(lambda: len(watches(emu)) == 2, within=30)
            await harness.caught_up(cluster)
            assert harness.watcher.counters.errors == 1
        assert gaps(harness.sent_times("watch")) == pytest.approx([delay], abs=0.02)
        check_faithful(harness, cluster, exact=True)


class SpyTokens(TokenSource):
    """A token file source that counts invalidate() calls."""

    def __init__(self, path: Path) -> None:
        self.invalidations = 0
        super().__init__(path=path)

    def invalidate(self) -> None:
        self.invalidations += 1
        super().invalidate()


def rewrite_in_place(path: Path, token: str) -> None:
    """Change the token without changing what a stat() sees (inode, size, mtime).

    Only a forced re-read (after a 401) can notice this rotation.
    """
    before = path.stat()
    with path.open("r+b") as file:
        file.write(token.encode())
        file.truncate()
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )


async def test_401_invalidates_the_credentials_and_recovers(
    io_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("token-1")
    tokens = SpyTokens(token_file)
    async with open_emulator(token="token-1") as emu:
        cluster = Cluster(emu.state)
        a = clusterd_job("a")
        cluster.write(a, "pending")
        settings = WatchSettings(watch_timeout=5)
        async with open_watcher(emu, settings, tokens=tokens, credentials=tokens) as harness:
            await harness.watch_open()
            await harness.caught_up(cluster)
            emu.set_token("token-2")  # open watches are not checked again
            rewrite_in_place(token_file, "token-2")
            # The watch times out, the next one is refused.
            await wait_until(lambda: harness.watcher.counters.errors == 1)
            assert not harness.status.in_sync
            cluster.write(a, "running")
            await harness.caught_up(cluster, timeout=30)
            assert harness.status.in_sync
            assert emu.stats.unauthorized == 1
            assert tokens.invalidations == 1
            counters = harness.watcher.counters
            assert counters.errors == 1 and counters.lists == 1
        # LIST, WATCH (until its timeout), WATCH refused, WATCH with the new token.
        auth = [r.authorization for r in emu.requests]
        assert auth[:4] == ["Bearer token-1"] * 3 + ["Bearer token-2"]
        assert set(auth[4:]) <= {"Bearer token-2"}
        check_faithful(harness, cluster, exact=True)


# -- restarts with a history gap ----------------------------------------------------------------


@pytest.mark.parametrize("drop_connections", [False, True], ids=["clean-end", "dropped"])
async def test_api_server_restart_with_history_gap(
    io_clock: trio.testing.MockClock, drop_connections: bool
) -> None:
    jobs = [clusterd_job(f"job-{i}", servers=1 + i, servers_per_configmap=2) for i in range(6)]
    script = [("pending", each) for each in jobs[2:]] + [
        (step, each) for step in ("running", "complete", "delete", "remove") for each in jobs
    ]
    async with open_emulator(history_size=100) as emu:
        cluster = Cluster(emu.state)
        for each in jobs[:2]:
            cluster.write(each, "pending")
        survivor = clusterd_job("survivor")
        cluster.write(survivor, "running")
        async with open_watcher(emu) as harness:
            await harness.caught_up(cluster)
            # ClusterD carries on while the API server restarts now and then,
            # each time right after a write the watch had no chance to send.
            for number, (step, each) in enumerate(script, 1):
                if step == "remove":
                    cluster.remove(each)
                elif step == "delete":
                    cluster.write(each, "complete", "delete", 1_700_000_500)
                else:
                    cluster.write(each, step)
                if number % 5 == 0:
                    emu.restart(lose_history=True, drop_connections=drop_connections)
                await trio.sleep(0.25)
            await harness.caught_up(cluster, timeout=30)
            counters = harness.watcher.counters
            assert counters.relists_after_gone == 5
            assert counters.lists == 6
        kept = expected_summary(survivor, "running")
        assert cluster.live() == {kept.key: kept}
        check_faithful(harness, cluster, exact=False)
        # The survivor never changed: only the first LIST reported it.
        assert [j for j in harness.log.jobs() if j.job_name == "survivor"] == [kept]


# -- scope, readiness, selector -----------------------------------------------------------------


async def test_namespaces_mode_watches_only_those_namespaces(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state, namespaces=("a", "b"))
        in_a = clusterd_job("x", namespace="a")
        in_b, in_c = clusterd_job("y", namespace="b"), clusterd_job("z", namespace="c")
        for each in (in_a, in_b, in_c):
            cluster.write(each, "pending")
        settings = WatchSettings(namespaces=("a", "b"))
        async with open_watcher(emu, settings) as harness:
            with trio.fail_after(10):
                await emu.wait_open_watches(2)
            await harness.caught_up(cluster)
            for each in (in_a, in_b, in_c):
                cluster.write(each, "running")
            await harness.caught_up(cluster)
            # Both namespaces relist after a restart with a gap; each relist
            # replaces only its own namespace's jobs.
            cluster.write(in_a, "complete")
            cluster.write(in_c, "complete")
            emu.restart(lose_history=True)
            # b's relist changes nothing, so only the counter tells it happened.
            await wait_until(lambda: harness.watcher.counters.lists == 4)
            await harness.caught_up(cluster)
        paths = {r.path for r in emu.requests}
        assert paths == {"/api/v1/namespaces/a/configmaps", "/api/v1/namespaces/b/configmaps"}
        assert {event.job.namespace for event in harness.log.events} == {"a", "b"}
        check_faithful(harness, cluster, exact=True)
        assert len(harness.log.events) == 5


async def test_ready_only_after_the_first_list_of_every_namespace(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        for name, namespace in (("x", "a"), ("y", "b"), ("z", "b")):
            cluster.write(clusterd_job(name, namespace=namespace), "running")
        emu.faults.push(HttpError(503, target="list"))
        settings = WatchSettings(namespaces=("a", "b"))
        async with open_watcher(emu, settings) as harness:
            counters = harness.watcher.counters
            await wait_until(lambda: counters.lists == 1 and counters.errors == 1)
            assert not harness.status.ready.is_set()  # one namespace is still missing
            with trio.fail_after(10):
                await harness.status.ready.wait()
            # Ready means: every listed job is already being served.
            assert harness.broadcaster.job_count() == 3
            assert counters.lists == 2
            await harness.caught_up(cluster)


async def test_not_ready_while_the_first_list_hangs(io_clock: trio.testing.MockClock) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        cluster.write(clusterd_job("a"), "running")
        emu.faults.push(Stall(target="list"))
        async with open_watcher(emu, read_timeout=90.0) as harness:
            await trio.sleep(60)
            assert not harness.status.ready.is_set() and not harness.status.in_sync
            assert harness.broadcaster.job_count() == 0
            with trio.fail_after(60):
                await harness.status.ready.wait()
            assert trio.current_time() >= 90.0
            await harness.caught_up(cluster)


async def test_label_selector_ignores_other_configmaps_and_a_removed_label_ends_the_job(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        a, b, stray = (
            clusterd_job("a", servers=3, servers_per_configmap=2),
            clusterd_job("b"),
            clusterd_job("stray"),
        )
        cluster.write(a, "running")
        cluster.write(b, "running")
        # Same data as a job's, but not labelled (or labelled otherwise): ignored.
        cluster.write(stray, "running", labels={"ring-controller.atlas": "ascend-910"})
        emu.state.create_configmap(
            "ns", "job-summary-false", {**JOB_LABELS, "outside-job-info": "false"}, {}
        )
        async with open_watcher(emu) as harness:
            await harness.caught_up(cluster)
            assert {event.job.job_name for event in harness.log.events} == {"a", "b"}
            cluster.write(stray, "complete", labels={})
            # Take the label off one ConfigMap of a live job: the job ends.
            unlabelled = {"ring-controller.atlas": "ascend-910"}
            cluster.relabel("ns", a.configmap_name(1), unlabelled)
            await harness.caught_up(cluster)
            assert harness.store.configmap_count() == 2  # a's index 0 and b
            # Labelled again: the job is back, once.
            cluster.relabel("ns", a.configmap_name(1), JOB_LABELS)
            await harness.caught_up(cluster)
        assert harness.log.jobs()[2:] == [
            expected_summary(a, "running", "delete", int(WALL)),
            expected_summary(a, "running"),
        ]
        check_faithful(harness, cluster, exact=True)


async def test_a_job_served_without_its_joined_table_is_logged_and_counted(
    io_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A split job whose joined rank table is over the store's cap is served
    without it (tests/store/test_jobs.py); the watcher says so in a warning and
    in jobsignal_store_rank_tables_over_cap_total."""
    monkeypatch.setattr(jobs, "MAX_JOINED_RANK_TABLE_CHARS", 100)
    async with open_emulator() as emu:
        cluster = Cluster(emu.state)
        cluster.write(clusterd_job("big", servers=10, servers_per_configmap=4), "running")
        cluster.write(clusterd_job("small"), "running")  # one ConfigMap: served as written
        async with open_watcher(emu) as harness:
            await harness.watch_open()
            counters = harness.watcher.counters
            await wait_until(lambda: counters.rank_tables_over_cap == 1)
            assert {job.job_name: bool(job.hccl_json) for job in harness.store.live_jobs()} == {
                "big": False,
                "small": True,
            }
    [warning] = [r for r in caplog.records if "served without HcclJson" in r.getMessage()]
    assert "'ns'/'uid-big'" in warning.getMessage() and "3 ConfigMaps" in warning.getMessage()
