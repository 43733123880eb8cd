"""Metrics scraped over HTTP match what happened in a run, metric by metric.

The exposition is parsed with prometheus_client's own parser; the run
drives every counter it can from outside (subscribers, job events, a
rejected ConfigMap, a quiet subscriber kept open by its PING ACKs, a
refused connection, a clean watch end, a 410, an API error, bookmarks, a
bad HTTP request) and checks each jobsignal metric, plus the process,
platform and GC ones, against that.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import time
from collections import Counter
from functools import partial
from pathlib import Path

import grpclib
import prometheus_client
import trio
import trio_asyncio
from prometheus_client.samples import Sample

import jobsignal
from jobsignal._proto.job import JobSummarySignal
from jobsignal.app import RunningJobsignal, run_jobsignal
from jobsignal.client import subscribe
from jobsignal.client_options import SubscribeOptions
from jobsignal.config import load_config
from jobsignal.fanout.stats import FanoutStats, Histogram
from jobsignal.kube.watcher import WatchCounters
from jobsignal.metrics import BuildInfo, MetricSources, build_registry
from jobsignal.process.file_limit import ACCEPT_ERRORS
from jobsignal.sim.clusterd import JOB_LABELS, ClusterdJob
from jobsignal.sim.emulator import open_emulator
from jobsignal.sim.emulator.server import ExpireWatch, HttpError
from jobsignal.store.configmap import REASONS
from tests.support.cluster import TOKEN, write_kubeconfig
from tests.support.metrics import Scrape, scrape, scrape_text
from tests.support.waiting import wait_until


def more_than(items: list[str], count: int) -> bool:
    return len(items) > count


# Every jobsignal family, by type: a metric added without a check here fails the run test.
JOBSIGNAL_FAMILIES = {
    "jobsignal_build_info": "gauge",  # the text format has no info type
    "jobsignal_subscribers": "gauge",
    "jobsignal_in_process_consumers": "gauge",
    "jobsignal_registered_ids": "gauge",
    "jobsignal_registrations_expired": "counter",
    "jobsignal_connections": "gauge",
    "jobsignal_connections_refused": "counter",
    "jobsignal_connections_closed_by_server": "counter",
    "jobsignal_streams_refused": "counter",
    "jobsignal_input_held": "counter",
    "jobsignal_accept_pauses": "counter",
    "jobsignal_tls_handshakes": "gauge",
    "jobsignal_tls_handshakes_refused": "counter",
    "jobsignal_loop_errors": "counter",
    "jobsignal_rpc_handler_errors": "counter",
    "jobsignal_rate_limited": "counter",
    "jobsignal_http_errors": "counter",
    "jobsignal_job_events": "counter",
    "jobsignal_messages_queued": "counter",
    "jobsignal_messages_delivered": "counter",
    "jobsignal_messages_coalesced": "counter",
    "jobsignal_rank_tables_stripped": "counter",
    "jobsignal_job_events_dropped": "counter",
    "jobsignal_write_batches": "counter",
    "jobsignal_stream_ends": "counter",
    "jobsignal_delivery_latency_seconds": "histogram",
    "jobsignal_jobs": "gauge",
    "jobsignal_configmaps_rejected": "counter",
    "jobsignal_kube_requests": "counter",
    "jobsignal_kube_watch_events": "counter",
    "jobsignal_kube_watch_bookmarks": "counter",
    "jobsignal_kube_watch_restarts": "counter",
    "jobsignal_kube_relists": "counter",
    "jobsignal_kube_errors": "counter",
    "jobsignal_store_apply_errors": "counter",
    "jobsignal_store_rank_tables_over_cap": "counter",
    "jobsignal_last_sync_timestamp_seconds": "gauge",
    "jobsignal_source_in_sync": "gauge",
}


def acks_received(server: RunningJobsignal) -> int:
    """ACKs of the server's keepalive PINGs, over every connection."""
    return sum(p.activity.ping_acks_received for p in server._parts.grpc.connections.protocols())


async def test_every_metric_follows_what_happened_in_a_run(tmp_path: Path) -> None:
    started_wall = time.time()
    async with open_emulator(token=TOKEN, bookmark_interval=0.25) as emulator:
        config = load_config(
            {
                "listen": "127.0.0.1:0",
                "metrics_listen": "127.0.0.1:0",
                "kubeconfig": str(write_kubeconfig(tmp_path / "config", emulator.url)),
                "source": "kubernetes",
                # The silent subscriber answers the server's PING every second, so it
                # outlives quiet stretches of several idle timeouts.
                "idle_timeout": "2",
                "keepalive_time": "1",
                # The pinging subscriber's 0.5 s is within the rules (no too_many_pings).
                "min_client_ping_interval": "0.25",
                "max_connections": "2",
            },
            {},
        )
        received: list[str] = []
        async with trio.open_nursery() as nursery:
            server: RunningJobsignal = await nursery.start(run_jobsignal, config)
            assert server.metrics_port is not None
            await server.ready.wait()

            async def subscriber(role: str, keepalive: float) -> None:
                # A long backoff: a stream that ended would not come back during the test.
                options = SubscribeOptions(
                    "127.0.0.1", server.port, role, keepalive_time=keepalive, backoff_initial=60
                )
                async with trio_asyncio.open_loop():
                    async for message in subscribe(options):
                        assert isinstance(message, JobSummarySignal)
                        received.append(message.job_id)

            # One subscriber that pings every 0.5 s, one silent one (kept by its ACKs).
            nursery.start_soon(subscriber, "CCAgent", 0.5)
            nursery.start_soon(subscriber, "FdAgent", 600)
            await wait_until(lambda: len(server._parts.broadcaster.subscribers) == 2)
            first = await scrape(server.metrics_port)
            assert first.series("jobsignal_subscribers") == {
                frozenset({("rpc", "SubscribeJobSummarySignal"), ("role", role)}): 1
                for role in ("CCAgent", "FdAgent")
            }
            assert first.value("jobsignal_registered_ids") == 2
            assert first.value("jobsignal_connections") == 2

            # A third connection is over --max-connections 2: refused at once.
            extra = await trio.open_tcp_stream("127.0.0.1", server.port)
            await wait_until(lambda: server._parts.grpc.connections.counter.refused == 1)
            await extra.aclose()

            writes = 0
            job = ClusterdJob("ns", "train", "uid-1")
            for status in ("pending", "running", "complete"):
                for name, data in job.configmaps(status):
                    if status == "pending":
                        emulator.state.create_configmap("ns", name, JOB_LABELS, data)
                    else:
                        emulator.state.update_configmap("ns", name, data=data)
                    writes += 1
                await wait_until(partial(more_than, received, len(received)))
            emulator.state.create_configmap("ns", "not-a-job", JOB_LABELS, {"no": "job_id"})
            writes += 1
            await wait_until(lambda: sum(server._parts.store.rejected_total.values()) == 1)

            # The watch ends cleanly (restart 1); the next one gets 410 (relist 1),
            # the one after that a 500 (error 1); the fourth one stays.
            emulator.faults.push(ExpireWatch(), HttpError(500, target="watch"))
            emulator.restart(lose_history=False)
            await wait_until(lambda: emulator.stats.watch_requests == 4)
            await wait_until(
                lambda: emulator.stats.open_watches == 1 and server._parts.status.in_sync
            )
            # Quiet for more than twice the idle timeout (a server PING a second).
            acks_now = acks_received(server)
            await wait_until(lambda: acks_received(server) >= acks_now + 5)
            await wait_until(lambda: server._parts.watcher.counters.bookmarks >= 1)

            garbage = await trio.open_tcp_stream("127.0.0.1", server.metrics_port)
            async with garbage:
                await garbage.send_all(b"\x00garbage\r\n\r\n")
                assert (await garbage.receive_some(100)).startswith(b"HTTP/1.1 400 ")

            bookmarks_before = server._parts.watcher.counters.bookmarks
            text = await scrape_text(server.metrics_port)
            bookmarks_after = server._parts.watcher.counters.bookmarks
            run = Scrape.parse(text)
            server.request_shutdown()
            await server.stopped.wait()
            nursery.cancel_scope.cancel()

    jobsignal_types = {n: t for n, t in run.types.items() if n.startswith("jobsignal_")}
    assert jobsignal_types == JOBSIGNAL_FAMILIES
    assert run.series("jobsignal_build_info") == {
        frozenset(
            {
                ("version", jobsignal.__version__),
                ("python", platform.python_version()),
                ("grpclib", grpclib.__version__),
                ("trio", trio.__version__),
            }
        ): 1
    }

    # Clients: both still subscribed (the silent FdAgent answered the server's
    # PINGs, its heartbeats); the refused connection.
    assert run.series("jobsignal_subscribers") == {
        frozenset({("rpc", "SubscribeJobSummarySignal"), ("role", role)}): 1
        for role in ("CCAgent", "FdAgent")
    }
    assert run.value("jobsignal_in_process_consumers") == 0
    assert run.value("jobsignal_registered_ids") == 2
    assert run.value("jobsignal_registrations_expired_total") == 0
    assert run.value("jobsignal_connections") == 2
    assert run.value("jobsignal_connections_refused_total") == 1
    assert run.by("jobsignal_connections_closed_by_server_total", "reason") == {}
    assert run.value("jobsignal_streams_refused_total") == 0
    assert run.value("jobsignal_input_held_total") == 0
    assert run.series("jobsignal_accept_pauses_total") == {
        frozenset({("port", port), ("error", error)}): 0
        for port in ("grpc", "metrics")
        for error in ACCEPT_ERRORS
    }
    assert run.value("jobsignal_loop_errors_total") == 0
    assert run.value("jobsignal_tls_handshakes") == 0
    assert run.value("jobsignal_tls_handshakes_refused_total") == 0
    assert run.by("jobsignal_rpc_handler_errors_total", "rpc") == {}
    assert run.by("jobsignal_rate_limited_total", "rpc") == {"Register": 0, "Subscribe": 0}
    assert run.by("jobsignal_http_errors_total", "reason") == {
        "bad_request": 1,
        "headers_too_large": 0,
        "timeout": 0,
        "internal": 0,
        "too_many_connections": 0,
    }

    # Fan-out: three job events to two subscribers, each message received once.
    assert run.value("jobsignal_job_events_total") == 3
    delivered = run.value("jobsignal_messages_delivered_total")
    assert delivered == len(received)
    coalesced = run.value("jobsignal_messages_coalesced_total")
    assert run.value("jobsignal_messages_queued_total") == delivered + coalesced == 6
    assert run.value("jobsignal_rank_tables_stripped_total") == 0
    assert run.by("jobsignal_job_events_dropped_total", "reason") == {}
    batches = run.by("jobsignal_write_batches_total", "path")
    assert set(batches) == {"from_publish", "at_once", "waiting"}
    assert batches["from_publish"] + batches["at_once"] >= 1
    assert 1 <= sum(batches.values()) <= delivered
    assert run.by("jobsignal_stream_ends_total", "reason") == {}  # no stream ended
    buckets = run.by("jobsignal_delivery_latency_seconds_bucket", "le")
    counts = list(buckets.values())
    assert counts == sorted(counts), "cumulative"
    assert buckets["+Inf"] == run.value("jobsignal_delivery_latency_seconds_count") == delivered
    assert 0 < run.value("jobsignal_delivery_latency_seconds_sum") < delivered * 10
    assert set(buckets) == {*(str(float(b)) for b in Histogram().bounds), "+Inf"}

    # Source: one job, one rejected ConfigMap, and the watcher's story.
    assert run.value("jobsignal_jobs") == 1
    rejected = run.by("jobsignal_configmaps_rejected_total", "reason")
    # Counted per parse: once from its ADDED event, once more in the LIST after the 410.
    assert rejected == {reason: (2 if reason == "no_job_id" else 0) for reason in REASONS}
    assert run.by("jobsignal_kube_requests_total", "verb") == {
        "list": emulator.stats.list_requests,
        "watch": emulator.stats.watch_requests,
    }
    assert emulator.stats.list_requests == 2  # the first LIST and the one after the 410
    assert run.value("jobsignal_kube_watch_events_total") == writes
    bookmarks = run.value("jobsignal_kube_watch_bookmarks_total")
    assert 1 <= bookmarks_before <= bookmarks <= bookmarks_after
    assert run.value("jobsignal_kube_watch_restarts_total") == 1
    assert run.value("jobsignal_kube_relists_total") == 1
    assert run.value("jobsignal_kube_errors_total") == 1
    assert run.value("jobsignal_store_apply_errors_total") == 0
    assert started_wall <= run.value("jobsignal_last_sync_timestamp_seconds") <= time.time()
    assert run.value("jobsignal_source_in_sync") == 1

    # prometheus_client's process, platform and GC collectors.
    assert run.value("process_resident_memory_bytes") > 1024 * 1024
    assert run.value("process_open_fds") > 0
    assert run.value("process_cpu_seconds_total") > 0
    assert started_wall - 3600 < run.value("process_start_time_seconds") <= started_wall
    python = platform.python_version_tuple()
    assert run.series("python_info") == {
        frozenset(
            {
                ("implementation", platform.python_implementation()),
                ("major", python[0]),
                ("minor", python[1]),
                ("patchlevel", python[2]),
                ("version", platform.python_version()),
            }
        ): 1
    }
    assert set(run.by("python_gc_collections_total", "generation")) == {"0", "1", "2"}


def sources_with(
    fanout: FanoutStats | None = None, watch: WatchCounters | None = None, **values: object
) -> MetricSources:
    """MetricSources reading fixed values (all zero or empty unless given)."""
    defaults: dict[str, object] = {
        "subscribers_by_kind_and_role": Counter(),
        "in_process_consumers": 0,
        "registered_ids": 0,
        "registrations_expired": 0,
        "connections": 0,
        "connections_refused": 0,
        "connections_closed_by_server": Counter(),
        "streams_refused": 0,
        "input_held": 0,
        "accept_pauses": {},
        "tls_handshakes": 0,
        "tls_handshakes_refused": 0,
        "loop_errors": 0,
        "rpc_handler_errors": Counter(),
        "rate_limited": Counter(),
        "http_errors": Counter(),
        "jobs": 0,
        "configmaps_rejected": Counter(),
        "last_sync_time": None,
        "source_in_sync": False,
    }
    assert set(values) <= set(defaults)
    readers = {name: (lambda v=value: v) for name, value in {**defaults, **values}.items()}
    watch = watch or WatchCounters()
    return MetricSources(
        fanout=fanout or FanoutStats(),
        watch_counters=lambda: watch,
        **readers,
    )


BUILD = BuildInfo("1.2.3", "3.11.0", "0.4.9", "0.35.0")


def jobsignal_samples(sources: MetricSources) -> list[Sample]:
    text = prometheus_client.generate_latest(build_registry(sources, BUILD)).decode()
    return [s for s in Scrape.parse(text).samples if s.name.startswith("jobsignal_")]


def test_each_watcher_counter_is_exactly_one_series() -> None:
    """Distinct values in every WatchCounters field: each shows up once, unchanged."""
    fields = [f.name for f in dataclasses.fields(WatchCounters)]
    values = {name: 1000 + 7 * index for index, name in enumerate(fields)}
    samples = jobsignal_samples(sources_with(watch=WatchCounters(**values)))
    kube = [s for s in samples if s.name.startswith(("jobsignal_kube_", "jobsignal_store_"))]
    assert sorted(s.value for s in kube) == sorted(values.values())
    by_field = {name: [s for s in kube if s.value == value] for name, value in values.items()}
    assert {name: (s.name, s.labels) for name, (s,) in by_field.items()} == {
        "lists": ("jobsignal_kube_requests_total", {"verb": "list"}),
        "watches": ("jobsignal_kube_requests_total", {"verb": "watch"}),
        "relists_after_gone": ("jobsignal_kube_relists_total", {}),
        "watch_restarts": ("jobsignal_kube_watch_restarts_total", {}),
        "events": ("jobsignal_kube_watch_events_total", {}),
        "bookmarks": ("jobsignal_kube_watch_bookmarks_total", {}),
        "errors": ("jobsignal_kube_errors_total", {}),
        "apply_errors": ("jobsignal_store_apply_errors_total", {}),
        "rank_tables_over_cap": ("jobsignal_store_rank_tables_over_cap_total", {}),
    }


def test_each_fanout_counter_is_exported() -> None:
    stats = FanoutStats()
    plain = [f.name for f in dataclasses.fields(FanoutStats) if f.type == "int"]
    for index, name in enumerate(plain):
        setattr(stats, name, 2000 + 7 * index)
    stats.events_dropped["encode"] = 3001
    stats.stream_ends["slow"] = 3002
    stats.delivery_latency.observe(0.003, times=3003)
    values = {s.value for s in jobsignal_samples(sources_with(fanout=stats))}
    assert {getattr(stats, name) for name in plain} <= values
    assert {3001, 3002, 3003} <= values


def test_the_asyncio_loops_faults_and_tls_handshakes_are_exported() -> None:
    sources = sources_with(
        accept_pauses={
            "grpc": Counter({"EMFILE": 4001, "ENOBUFS": 4002}),
            "metrics": Counter({"EMFILE": 4006}),
        },
        loop_errors=4003,
        tls_handshakes=4004,
        tls_handshakes_refused=4005,
    )
    samples = {(s.name, tuple(s.labels.items())): s.value for s in jobsignal_samples(sources)}
    pauses = {
        (s.labels["port"], s.labels["error"]): s.value
        for s in jobsignal_samples(sources)
        if s.name == "jobsignal_accept_pauses_total"
    }
    assert pauses[("grpc", "EMFILE")] == 4001
    assert pauses[("grpc", "ENOBUFS")] == 4002
    assert pauses[("grpc", "ENFILE")] == 0
    assert pauses[("metrics", "EMFILE")] == 4006
    assert pauses[("metrics", "ENOBUFS")] == 0
    assert samples[("jobsignal_loop_errors_total", ())] == 4003
    assert samples[("jobsignal_tls_handshakes", ())] == 4004
    assert samples[("jobsignal_tls_handshakes_refused_total", ())] == 4005


def test_registries_are_private_to_each_server() -> None:
    one = build_registry(sources_with(jobs=1), BUILD)
    two = build_registry(sources_with(jobs=2), BUILD)
    for registry, jobs in ((one, 1), (two, 2)):
        text = prometheus_client.generate_latest(registry).decode()
        assert Scrape.parse(text).value("jobsignal_jobs") == jobs
    default = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "jobsignal_" not in default


def test_labelled_counters_keep_unusual_label_values_intact() -> None:
    odd = 'a "quoted"\\ role\nwith a newline'
    samples = jobsignal_samples(
        sources_with(subscribers_by_kind_and_role=Counter({("SubscribeJobSummarySignal", odd): 4}))
    )
    (subscribers,) = [s for s in samples if s.name == "jobsignal_subscribers"]
    assert subscribers.labels == {"rpc": "SubscribeJobSummarySignal", "role": odd}
    assert subscribers.value == 4


def test_histogram_buckets_are_cumulative() -> None:
    histogram = Histogram([0.1, 1])
    for value in (0.05, 0.5, 0.5, 5):
        histogram.observe(value)
    assert histogram.counts == [1, 2, 1]
    assert histogram.count == 4 and math.isclose(histogram.total, 6.05)
    assert histogram.cumulative_buckets() == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]
