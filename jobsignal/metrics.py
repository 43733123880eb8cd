"""Prometheus metrics: the hot-path counters' types and one collector that reads them.

Counters live where the work happens (broadcaster, registry, watcher,
connection table) as plain integers and `Counter`s, so the hot paths pay for
an increment and nothing else. At scrape time `JobsignalCollector` turns
them into prometheus_client metric families; `build_registry` puts it, with
prometheus_client's process, platform and GC collectors, into a registry of
its own per server (never the process-wide default one, so several servers in
one process do not clash). The HTTP side (formats, compression) is
`metrics_server`'s.
"""

from __future__ import annotations

import platform
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpclib
import trio
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from jobsignal.fanout.stats import FanoutStats
from jobsignal.metrics_server import HTTP_ERROR_REASONS
from jobsignal.process.file_limit import ACCEPT_ERRORS
from jobsignal.store.configmap import REASONS as CONFIGMAP_REJECTION_REASONS
from jobsignal.version import __version__

if TYPE_CHECKING:
    from jobsignal.kube.watcher import WatchCounters
    from jobsignal.relay.source import RelayCounters


@dataclass
class MetricSources:
    """Everything a scrape reads; filled in as the server starts its parts."""

    fanout: FanoutStats
    subscribers_by_kind_and_role: Callable[[], Counter[tuple[str, str]]]
    in_process_consumers: Callable[[], int]
    registered_ids: Callable[[], int]
    registrations_expired: Callable[[], int]
    connections: Callable[[], int]
    connections_refused: Callable[[], int]
    connections_closed_by_server: Callable[[], Mapping[str, int]]
    streams_refused: Callable[[], int]
    input_held: Callable[[], int]
    accept_pauses: Callable[[], Mapping[str, Mapping[str, int]]]  # by port, then errno
    tls_handshakes: Callable[[], int]
    tls_handshakes_refused: Callable[[], int]
    loop_errors: Callable[[], int]
    rpc_handler_errors: Callable[[], Mapping[str, int]]
    rate_limited: Callable[[], Mapping[str, int]]
    http_errors: Callable[[], Mapping[str, int]]
    jobs: Callable[[], int]
    configmaps_rejected: Callable[[], Mapping[str, int]]
    # The source's own counters: the Kubernetes watcher's, or a relay's.
    watch_counters: Callable[[], WatchCounters] | None
    last_sync_time: Callable[[], float | None]
    source_in_sync: Callable[[], bool]
    relay_counters: Callable[[], RelayCounters] | None = None


@dataclass(frozen=True)
class BuildInfo:
    version: str
    python: str
    grpclib: str
    trio: str

    @classmethod
    def of_this_process(cls) -> BuildInfo:
        return cls(__version__, platform.python_version(), grpclib.__version__, trio.__version__)


def _counter(
    name: str,
    help_text: str,
    label: str,
    counts: Mapping[str, int],
    known: Collection[str] = (),
) -> CounterMetricFamily:
    """A counter family by one label; `known` values are exported even at zero,
    so that rate() and increase() see their first occurrence."""
    family = CounterMetricFamily(name, help_text, labels=[label])
    for value in sorted({*known, *counts}):
        family.add_metric([value], counts.get(value, 0))
    return family


class JobsignalCollector(Collector):
    """Reads every jobsignal counter at scrape time; holds no metric state itself."""

    def __init__(self, sources: MetricSources, build: BuildInfo) -> None:
        self._sources = sources
        self._build = build

    def collect(self) -> Iterator[Metric]:
        yield InfoMetricFamily(
            "jobsignal_build",
            "The running jobsignal: its version and those of Python, grpclib and trio.",
            value={
                "version": self._build.version,
                "python": self._build.python,
                "grpclib": self._build.grpclib,
                "trio": self._build.trio,
            },
        )
        yield from self._clients()
        yield from self._fanout()
        yield from self._source()

    def _clients(self) -> Iterator[Metric]:
        sources = self._sources
        subscribers = GaugeMetricFamily(
            "jobsignal_subscribers", "Active subscriptions by RPC and role.", labels=["rpc", "role"]
        )
        for (kind, role), count in sorted(sources.subscribers_by_kind_and_role().items()):
            subscribers.add_metric([kind, role], count)
        yield subscribers
        yield GaugeMetricFamily(
            "jobsignal_in_process_consumers",
            "Consumers of job events in this process (jobsignal.watch_jobs,"
            " RunningJobsignal.open_subscription), each with a queue like a subscription's.",
            value=sources.in_process_consumers(),
        )
        yield GaugeMetricFamily(
            "jobsignal_registered_ids",
            "Registered client ids (waiting for their subscription or subscribed).",
            value=sources.registered_ids(),
        )
        yield CounterMetricFamily(
            "jobsignal_registrations_expired_total",
            "Registered ids that expired without subscribing.",
            value=sources.registrations_expired(),
        )
        yield GaugeMetricFamily(
            "jobsignal_connections", "Open gRPC (HTTP/2) connections.", value=sources.connections()
        )
        yield CounterMetricFamily(
            "jobsignal_connections_refused_total",
            "gRPC connections refused over --max-connections or --max-connections-per-ip"
            " (the first request is answered RESOURCE_EXHAUSTED, then the connection closes).",
            value=sources.connections_refused(),
        )
        yield _counter(
            "jobsignal_connections_closed_by_server_total",
            "gRPC connections the server closed on the peer's misbehaviour or silence, or"
            " asked to go at their maximum age, by reason (too_many_pings, rapid_reset,"
            " control_flood, handshake_timeout, write_stalled, keepalive_timeout,"
            " protocol_error, internal_error, max_age: counted at its first GOAWAY).",
            "reason",
            sources.connections_closed_by_server(),
        )
        yield CounterMetricFamily(
            "jobsignal_streams_refused_total",
            "HTTP/2 streams refused with REFUSED_STREAM: over the stream limit advertised in"
            " SETTINGS.",
            value=sources.streams_refused(),
        )
        yield CounterMetricFamily(
            "jobsignal_input_held_total",
            "Times a connection's input waited for its address's turn: control frames"
            " beyond --max-control-frames-per-second-per-ip.",
            value=sources.input_held(),
        )
        accept_pauses = CounterMetricFamily(
            "jobsignal_accept_pauses_total",
            "Times a port (grpc, metrics) stopped accepting for a second because accept()"
            " failed, by error (EMFILE: the process's file limit, ENFILE: the system's,"
            " ENOBUFS and ENOMEM: kernel memory).",
            labels=["port", "error"],
        )
        for port, pauses in sorted(sources.accept_pauses().items()):
            for error in sorted({*ACCEPT_ERRORS, *pauses}):
                accept_pauses.add_metric([port, error], pauses.get(error, 0))
        yield accept_pauses
        yield GaugeMetricFamily(
            "jobsignal_tls_handshakes",
            "TLS connections of the gRPC port still in their handshake (not yet counted"
            " in jobsignal_connections).",
            value=sources.tls_handshakes(),
        )
        yield CounterMetricFamily(
            "jobsignal_tls_handshakes_refused_total",
            "TLS connections closed as they came: 256 handshakes in progress, or 64 from"
            " the same address, already.",
            value=sources.tls_handshakes_refused(),
        )
        yield CounterMetricFamily(
            "jobsignal_loop_errors_total",
            "Unexpected exceptions the gRPC server's asyncio loop caught (logged at ERROR;"
            " the connection concerned, when known, is closed).",
            value=sources.loop_errors(),
        )
        yield _counter(
            "jobsignal_rpc_handler_errors_total",
            "Unexpected exceptions caught at the gRPC handler boundary (answered INTERNAL),"
            " by RPC.",
            "rpc",
            sources.rpc_handler_errors(),
        )
        yield _counter(
            "jobsignal_rate_limited_total",
            "Register and Subscribe calls refused by the per-address rate limits"
            " (--register-rate, --subscribe-rate), by RPC.",
            "rpc",
            sources.rate_limited(),
            known=("Register", "Subscribe"),
        )
        yield _counter(
            "jobsignal_http_errors_total",
            "Metrics-port HTTP connections ended by a fault, by reason (bad_request,"
            " headers_too_large, timeout, internal).",
            "reason",
            sources.http_errors(),
            HTTP_ERROR_REASONS,
        )

    def _fanout(self) -> Iterator[Metric]:
        fanout = self._sources.fanout
        yield CounterMetricFamily(
            "jobsignal_job_events_total",
            "Job events published to the subscribers (each encoded once).",
            value=fanout.events_published,
        )
        yield CounterMetricFamily(
            "jobsignal_messages_queued_total",
            "Messages queued for subscribers.",
            value=fanout.messages_queued,
        )
        yield CounterMetricFamily(
            "jobsignal_messages_delivered_total",
            "Messages written to client streams.",
            value=fanout.messages_delivered,
        )
        yield CounterMetricFamily(
            "jobsignal_messages_coalesced_total",
            "Queued messages replaced by a newer state of the same job (slow clients).",
            value=fanout.coalesced,
        )
        yield CounterMetricFamily(
            "jobsignal_rank_tables_stripped_total",
            "Job events sent without HcclJson because the message exceeded the send limit.",
            value=fanout.rank_tables_stripped,
        )
        yield _counter(
            "jobsignal_job_events_dropped_total",
            "Job events dropped because encoding or queueing them failed (a bug: logged), by step.",
            "reason",
            fanout.events_dropped,
        )
        yield _counter(
            "jobsignal_write_batches_total",
            "Batches of messages written to client streams: from publish itself (one message,"
            " the stream's task parked), at once from the subscriber's task, or after waiting"
            " for HTTP/2 flow control or the socket.",
            "path",
            {
                "from_publish": fanout.batches_written_from_publish,
                "at_once": fanout.batches_written_at_once,
                "waiting": fanout.batches_written_waiting,
            },
        )
        yield _counter(
            "jobsignal_stream_ends_total",
            "Ended subscription streams by reason (idle, slow, replaced, shutdown, max_age,"
            " client_gone),"
            " and refused calls (refused: Subscribe refused by the registry or a rate limit,"
            " Register refused by a rate limit).",
            "reason",
            fanout.stream_ends,
        )
        latency = fanout.delivery_latency
        yield HistogramMetricFamily(
            "jobsignal_delivery_latency_seconds",
            "From the watcher seeing an event to its message being written to the client.",
            buckets=latency.cumulative_buckets(),
            sum_value=latency.total,
        )

    def _source(self) -> Iterator[Metric]:
        sources = self._sources
        yield GaugeMetricFamily("jobsignal_jobs", "Live jobs in the store.", value=sources.jobs())
        yield _counter(
            "jobsignal_configmaps_rejected_total",
            "ConfigMaps skipped as malformed, by reason.",
            "reason",
            sources.configmaps_rejected(),
            CONFIGMAP_REJECTION_REASONS,
        )
        if sources.watch_counters is not None:
            yield from _kube_families(sources.watch_counters())
        if sources.relay_counters is not None:
            yield from _relay_families(sources.relay_counters())
        last_sync = sources.last_sync_time()
        yield GaugeMetricFamily(
            "jobsignal_last_sync_timestamp_seconds",
            "Unix time the Kubernetes API (a relay: the upstream) was last heard from (0: never).",
            value=last_sync or 0,
        )
        yield GaugeMetricFamily(
            "jobsignal_source_in_sync",
            "1 while the watch is connected, 0 while the API is unreachable (a relay: 0 once"
            " the upstream has been lost for --upstream-grace).",
            value=1 if sources.source_in_sync() else 0,
        )


def _kube_families(counters: WatchCounters) -> Iterator[Metric]:
    """The watcher's counters, each field in exactly one series."""
    requests = CounterMetricFamily(
        "jobsignal_kube_requests_total",
        "Kubernetes API calls by verb: list counts LISTs completed (all pages of one scope),"
        " watch counts WATCH requests made.",
        labels=["verb"],
    )
    requests.add_metric(["list"], counters.lists)
    requests.add_metric(["watch"], counters.watches)
    yield requests
    yield CounterMetricFamily(
        "jobsignal_kube_watch_events_total",
        "ADDED, MODIFIED and DELETED events received on watches.",
        value=counters.events,
    )
    yield CounterMetricFamily(
        "jobsignal_kube_watch_bookmarks_total",
        "BOOKMARK events received on watches (they only advance the resourceVersion).",
        value=counters.bookmarks,
    )
    yield CounterMetricFamily(
        "jobsignal_kube_watch_restarts_total",
        "Watches the API server ended cleanly (its timeoutSeconds), watched again from the"
        " last resourceVersion.",
        value=counters.watch_restarts,
    )
    yield CounterMetricFamily(
        "jobsignal_kube_relists_total",
        "LISTs made again because the API answered 410 Gone (the resourceVersion watched from"
        " is no longer in its history).",
        value=counters.relists_after_gone,
    )
    yield CounterMetricFamily(
        "jobsignal_kube_errors_total",
        "Failed LIST or WATCH calls (unreachable, timeouts, 401/403, 429, 5xx, unreadable"
        " answers, watch ERROR events other than 410, unexpected faults logged with their"
        " traceback), each followed by a backoff.",
        value=counters.errors,
    )
    yield CounterMetricFamily(
        "jobsignal_store_apply_errors_total",
        "Watch events or LISTs whose application to the job store failed unexpectedly"
        " (a bug: logged with its traceback); the event or LIST is skipped.",
        value=counters.apply_errors,
    )
    yield CounterMetricFamily(
        "jobsignal_store_rank_tables_over_cap_total",
        "Job events served without HcclJson because the rank table joined from the job's"
        " ConfigMaps was over 64 Mi characters (logged, rate-limited).",
        value=counters.rank_tables_over_cap,
    )


def _relay_families(counters: RelayCounters) -> Iterator[Metric]:
    """A relay's counters (jobsignal/relay/), each in exactly one series."""
    from jobsignal.relay.upstream import REASONS as UPSTREAM_REASONS
    from jobsignal.relay.wire import REASONS as WIRE_REASONS

    yield CounterMetricFamily(
        "jobsignal_relay_subscriptions_total",
        "Subscriptions made to the upstream (Register and SubscribeJobSummarySignalList answered).",
        value=counters.subscriptions,
    )
    yield CounterMetricFamily(
        "jobsignal_relay_snapshots_total",
        "Upstream snapshots (every batch until JobTotalNum) applied to the relayed state.",
        value=counters.snapshots,
    )
    yield CounterMetricFamily(
        "jobsignal_relay_messages_total",
        "JobSummarySignalList messages received from the upstream.",
        value=counters.messages,
    )
    yield _counter(
        "jobsignal_relay_upstream_errors_total",
        "Upstream connections ended, by reason (internal: an unexpected fault, logged with"
        " its traceback); each followed by a backoff and a reconnect.",
        "reason",
        counters.upstream_errors,
        [*UPSTREAM_REASONS, "internal"],
    )
    yield _counter(
        "jobsignal_relay_messages_rejected_total",
        "Upstream messages refused whole as malformed, by reason (a snapshot batch also"
        " ends the connection).",
        "reason",
        counters.messages_rejected,
        WIRE_REASONS,
    )
    yield _counter(
        "jobsignal_relay_signals_rejected_total",
        "Upstream signals rejected by the store's checks or as malformed, by reason; the"
        " job keeps its last good state.",
        "reason",
        counters.signals_rejected,
        [*CONFIGMAP_REJECTION_REASONS, *WIRE_REASONS],
    )


def build_registry(sources: MetricSources, build: BuildInfo | None = None) -> CollectorRegistry:
    """A registry of its own for one server: jobsignal's counters plus process,
    platform (python_info) and garbage collector metrics."""
    # auto_describe: registering collects once, so clashing names fail here, not in a scrape.
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(JobsignalCollector(sources, build or BuildInfo.of_this_process()))
    return registry
