"""Prometheus metrics: a latency histogram and the text exposition of every counter.

Counters live where the work happens (broadcaster, registry, watcher,
connection table); this module reads them at scrape time and renders the
Prometheus text format (version 0.0.4), so the hot paths pay for a plain
integer increment and nothing else.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# Seconds from the watcher seeing an event to its bytes being handed to the
# client's connection: sub-millisecond to a slow client's many seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Histogram:
    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.count += times


@dataclass
class FanoutStats:
    """Counters of the fan-out path, shared by the broadcaster and every stream."""

    events_published: int = 0
    messages_queued: int = 0
    messages_delivered: int = 0
    coalesced: int = 0
    rank_tables_stripped: int = 0
    # Batches written straight from the subscriber's trio task, and batches that
    # had to wait for HTTP/2 (flow control, a full socket) through asyncio.
    batches_written_at_once: int = 0
    batches_written_waiting: int = 0
    # Job events that could not be encoded or queued, by where it failed.
    events_dropped: Counter[str] = field(default_factory=Counter)
    stream_ends: Counter[str] = field(default_factory=Counter)
    delivery_latency: Histogram = field(default_factory=Histogram)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Exposition:
    """Builds one scrape's text, metric family by family."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, str], float]],
    ) -> None:
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self._lines.append(f"{name}{_labels(labels)} {_number(value)}")

    def single(self, name: str, kind: str, help_text: str, value: float) -> None:
        self.family(name, kind, help_text, [({}, value)])

    def histogram(self, name: str, help_text: str, histogram: Histogram) -> None:
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} histogram")
        cumulative = 0
        for bound, count in zip(histogram.bounds, histogram.counts, strict=False):
            cumulative += count
            self._lines.append(f'{name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        self._lines.append(f'{name}_bucket{{le="+Inf"}} {histogram.count}')
        self._lines.append(f"{name}_sum {_number(histogram.total)}")
        self._lines.append(f"{name}_count {histogram.count}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{_escape(value)}"' for key, value in sorted(labels.items()))
    return "{" + inner + "}"


def _number(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


Renderer = Callable[[], str]


@dataclass
class MetricSources:
    """Everything a scrape reads; filled in as the server starts its parts."""

    fanout: FanoutStats
    subscribers_by_kind_and_role: Callable[[], Counter[tuple[str, str]]]
    registered_ids: Callable[[], int]
    registrations_expired: Callable[[], int]
    connections: Callable[[], int]
    ping_floods: Callable[[], int]
    connections_closed_by_server: Callable[[], Counter[str]]
    streams_refused: Callable[[], int]
    rpc_handler_errors: Callable[[], Counter[str]]
    http_errors: Callable[[], Counter[str]]
    jobs: Callable[[], int]
    configmaps_rejected: Callable[[], Counter[str]]
    watch_counters: Callable[[], dict[str, int]]
    last_sync_time: Callable[[], float | None]
    source_in_sync: Callable[[], bool]


def render(sources: MetricSources) -> str:
    out = Exposition()
    fanout = sources.fanout
    out.family(
        "jobsignal_subscribers",
        "gauge",
        "Active subscriptions by RPC and role.",
        [
            ({"rpc": kind, "role": role}, count)
            for (kind, role), count in sorted(sources.subscribers_by_kind_and_role().items())
        ],
    )
    out.single(
        "jobsignal_registered_ids", "gauge", "Registered client ids.", sources.registered_ids()
    )
    out.single(
        "jobsignal_registrations_expired_total",
        "counter",
        "Registered ids that expired without subscribing.",
        sources.registrations_expired(),
    )
    out.single("jobsignal_connections", "gauge", "Open HTTP/2 connections.", sources.connections())
    out.single(
        "jobsignal_ping_floods_total",
        "counter",
        "Connections closed with GOAWAY too_many_pings.",
        sources.ping_floods(),
    )
    out.family(
        "jobsignal_connections_closed_by_server_total",
        "counter",
        "Connections the server closed on the peer's misbehaviour, by reason (too_many_pings,"
        " rapid_reset, control_flood, handshake_timeout, write_stalled, protocol_error,"
        " internal_error).",
        [({"reason": r}, n) for r, n in sorted(sources.connections_closed_by_server().items())],
    )
    out.single(
        "jobsignal_streams_refused_total",
        "counter",
        "HTTP/2 streams refused with REFUSED_STREAM: over the stream limit advertised in SETTINGS.",
        sources.streams_refused(),
    )
    out.family(
        "jobsignal_rpc_handler_errors_total",
        "counter",
        "Unexpected exceptions caught at the gRPC handler boundary (answered INTERNAL), by RPC.",
        [({"rpc": r}, n) for r, n in sorted(sources.rpc_handler_errors().items())],
    )
    out.family(
        "jobsignal_http_errors_total",
        "counter",
        "Metrics-port HTTP connections ended by a fault, by reason (bad_request,"
        " headers_too_large, timeout, internal).",
        [({"reason": r}, n) for r, n in sorted(sources.http_errors().items())],
    )
    out.single("jobsignal_jobs", "gauge", "Live jobs in the store.", sources.jobs())
    out.single(
        "jobsignal_job_events_total",
        "counter",
        "Job events published (each encoded once).",
        fanout.events_published,
    )
    out.single(
        "jobsignal_messages_queued_total",
        "counter",
        "Messages queued for subscribers.",
        fanout.messages_queued,
    )
    out.single(
        "jobsignal_messages_delivered_total",
        "counter",
        "Messages written to client streams.",
        fanout.messages_delivered,
    )
    out.single(
        "jobsignal_messages_coalesced_total",
        "counter",
        "Queued messages replaced by a newer state of the same job (slow clients).",
        fanout.coalesced,
    )
    out.single(
        "jobsignal_rank_tables_stripped_total",
        "counter",
        "Job events sent without HcclJson because the message exceeded the send limit.",
        fanout.rank_tables_stripped,
    )
    out.family(
        "jobsignal_job_events_dropped_total",
        "counter",
        "Job events dropped because encoding or queueing them failed (a bug: logged), by step.",
        [({"reason": reason}, count) for reason, count in sorted(fanout.events_dropped.items())],
    )
    out.family(
        "jobsignal_write_batches_total",
        "counter",
        "Batches of messages written to client streams: at once from the subscriber's task,"
        " or after waiting for HTTP/2 flow control or the socket.",
        [
            ({"path": "at_once"}, fanout.batches_written_at_once),
            ({"path": "waiting"}, fanout.batches_written_waiting),
        ],
    )
    out.family(
        "jobsignal_stream_ends_total",
        "counter",
        "Ended subscription streams by reason (idle, slow, replaced, shutdown, client_gone).",
        [({"reason": reason}, count) for reason, count in sorted(fanout.stream_ends.items())],
    )
    out.histogram(
        "jobsignal_delivery_latency_seconds",
        "From the watcher seeing an event to its message being written to the client.",
        fanout.delivery_latency,
    )
    out.family(
        "jobsignal_configmaps_rejected_total",
        "counter",
        "ConfigMaps skipped as malformed, by reason.",
        [({"reason": r}, n) for r, n in sorted(sources.configmaps_rejected().items())],
    )
    watch = sources.watch_counters()
    out.family(
        "jobsignal_watch_total",
        "counter",
        "Kubernetes watcher activity: lists, relists after 410, watches, restarts, events,"
        " bookmarks, errors.",
        [({"what": name}, value) for name, value in sorted(watch.items())],
    )
    last_sync = sources.last_sync_time()
    out.single(
        "jobsignal_last_sync_timestamp_seconds",
        "gauge",
        "Unix time the Kubernetes API was last heard from (0: never).",
        last_sync or 0,
    )
    out.single(
        "jobsignal_source_in_sync",
        "gauge",
        "1 while the watch is connected, 0 while the API is unreachable.",
        1 if sources.source_in_sync() else 0,
    )
    return out.text()
