"""The root of a jobsignal server: one nursery, started in order.

gRPC server first (it answers health NOT_SERVING at once), then the source
(watcher against Kubernetes or the embedded demo cluster, or a relay of an
upstream job.Job server) which marks the server ready once the first LIST, or
the upstream's first snapshot, is applied. `shutdown` ends it gracefully.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import trio

from jobsignal.config import Config, ConfigError
from jobsignal.fanout import Broadcaster
from jobsignal.kube.api import KubeApi, open_kube_client
from jobsignal.kube.credentials import KubeConfigError, KubeConnection, discover
from jobsignal.kube.watcher import Watcher, WatchSettings
from jobsignal.process.file_limit import open_file_limit, shortfall
from jobsignal.process.gc_pacing import GcPacing
from jobsignal.process.heap import release_free_memory
from jobsignal.rpc.connections import MAX_LINGERING_REFUSALS
from jobsignal.rpc.registry import Registry
from jobsignal.rpc.server import RunningServer, ServerSettings, run_grpc_server
from jobsignal.status import SourceStatus
from jobsignal.store import JobStore

if TYPE_CHECKING:  # imported where used: without them a server loads no prometheus_client or h11
    import ssl

    from jobsignal.events import JobEvents
    from jobsignal.metrics import MetricSources
    from jobsignal.metrics_server import HttpStats
    from jobsignal.relay.source import Relay  # (and no gRPC client unless it relays)
    from jobsignal.relay.state import RelayedJobs
    from jobsignal.rpc.session import Sessions
    from jobsignal.rpc.subscriptions import PageRequest, SubscriptionPage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerParts:
    """The running pieces of a server, for tests and diagnostics: not API, may change."""

    broadcaster: Broadcaster
    registry: Registry
    store: JobStore | RelayedJobs
    status: SourceStatus
    source: Watcher | Relay
    grpc: RunningServer

    @property
    def watcher(self) -> Watcher:
        assert isinstance(self.source, Watcher), "this server relays: it has no watcher"
        return self.source


class RunningJobsignal:
    """A started server, as `serve` (`run_jobsignal`) reports it to `nursery.start`.

    `host` and `port` are the first gRPC listen address as bound (port 0 asked:
    the port the system chose); `addresses` every bound gRPC socket, one per
    --listen address (two for a host-less `:PORT` on a host with IPv4 and
    IPv6). `metrics_port` is the bound --metrics-listen port, None when off.
    `ready` is set once every watched scope's first LIST is applied (health
    turns SERVING), `stopped` once the gRPC server has shut down.
    """

    def __init__(self, parts: ServerParts, shutdown: trio.Event, metrics_port: int | None) -> None:
        self._parts = parts  # for tests and diagnostics only; not API
        self._shutdown = shutdown
        self._metrics_port = metrics_port

    @property
    def host(self) -> str:
        return self._parts.grpc.host

    @property
    def port(self) -> int:
        return self._parts.grpc.port

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        return tuple(self._parts.grpc.addresses)

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_port

    @property
    def ready(self) -> trio.Event:
        return self._parts.status.ready

    @property
    def stopped(self) -> trio.Event:
        return self._parts.grpc.stopped

    def request_shutdown(self) -> None:
        """End every stream with UNAVAILABLE, stop the server, return from run_jobsignal."""
        self._shutdown.set()

    @asynccontextmanager
    async def open_subscription(self, *, snapshot: bool = True) -> AsyncIterator[JobEvents]:
        """Job events in-process, from the broadcaster that feeds the gRPC streams.

        Enters once the first LIST is applied; with `snapshot` the channel
        starts with an ADDED event for every live job. The queue is bounded
        like a stream's (`--max-pending-messages`, `--max-pending-bytes`); the
        channel ends when the server shuts down. Leaving the block closes it.
        """
        await self.ready.wait()
        from jobsignal.events import JobEvents  # (for embedders only: not loaded by `serve`)

        events = JobEvents(self._parts.broadcaster, snapshot=snapshot)
        try:
            yield events
        finally:
            events.close()


def server_settings(config: Config) -> ServerSettings:
    """The gRPC server's settings, its TLS files loaded once: a broken one is a
    ConfigError at start-up, with the file named, not a failure at the first client."""
    settings = ServerSettings.from_config(config)
    if settings.tls is not None:
        from jobsignal.rpc.tls import TlsConfigError, build_context

        try:
            build_context(settings.tls)
        except TlsConfigError as error:
            raise ConfigError(str(error)) from None
    return settings


def choose_connection(config: Config, environ: Mapping[str, str]) -> KubeConnection | None:
    """The cluster to watch, or None for the embedded demo cluster (or a relay)."""
    if config.source in ("demo", "relay"):
        return None
    try:
        connection = discover(
            Path(config.kubeconfig) if config.kubeconfig else None,
            config.context or None,
            environ,
        )
    except KubeConfigError as error:
        raise ConfigError(str(error)) from None
    if connection is None and config.source == "kubernetes":
        raise ConfigError(
            "no Kubernetes configuration found: not in a cluster (KUBERNETES_SERVICE_HOST"
            " unset), no KUBECONFIG, no ~/.kube/config; pass --kubeconfig or --source demo"
        )
    return connection


async def run_source(
    config: Config,
    connection: KubeConnection | None,
    store: JobStore,
    broadcaster: Broadcaster,
    status: SourceStatus,
    *,
    task_status: trio.TaskStatus[Watcher] = trio.TASK_STATUS_IGNORED,
) -> None:
    settings = WatchSettings.from_config(config)
    async with trio.open_nursery() as nursery:
        if connection is None:
            from jobsignal.sim.demo import run_demo_cluster  # (the emulator, for the demo only)

            if config.source == "demo":
                log.info("serving the embedded demo cluster (--source demo)")
            else:
                log.warning("no Kubernetes cluster configured: serving the embedded DEMO cluster")
            emulator = await nursery.start(run_demo_cluster)
            connection = KubeConnection(
                base_url=emulator.url,
                verify=None,
                token_source=None,
                description="embedded demo cluster",
                default_namespace=None,
            )
        log.info("watching ConfigMaps via %s", connection.description)
        tokens = connection.token_source
        timeout = httpx.Timeout(10.0, read=config.read_timeout + 5)
        async with open_kube_client(connection, timeout=timeout) as client:
            api = KubeApi(client, tokens, read_timeout=config.read_timeout)
            watcher = Watcher(api, store, broadcaster.publish, status, settings, credentials=tokens)
            await nursery.start(watcher.run)
            task_status.started(watcher)
            await trio.sleep_forever()


async def run_relay_source(
    config: Config,
    context: ssl.SSLContext | None,
    jobs: RelayedJobs,
    broadcaster: Broadcaster,
    status: SourceStatus,
    *,
    task_status: trio.TaskStatus[Relay] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The relay source (jobsignal/relay/): the upstream's jobs into `jobs`."""
    from jobsignal.relay.settings import RelaySettings
    from jobsignal.relay.source import Relay, stream_opener

    settings = RelaySettings.from_config(config)
    relay = Relay(stream_opener(settings, context), jobs, broadcaster.publish, status, settings)
    log.info("relaying the job.Job server at %s as %s", settings.address, settings.role)
    async with trio.open_nursery() as nursery:
        await nursery.start(relay.run)
        task_status.started(relay)


def metric_sources(
    broadcaster: Broadcaster,
    registry: Registry,
    server: RunningServer,
    store: JobStore | RelayedJobs,
    source: Watcher | Relay,
    status: SourceStatus,
    http_stats: HttpStats,
) -> MetricSources:
    from jobsignal.metrics import MetricSources

    watcher = source if isinstance(source, Watcher) else None
    relay = None if isinstance(source, Watcher) else source

    return MetricSources(
        fanout=broadcaster.stats,
        subscribers_by_kind_and_role=broadcaster.streams_up,
        in_process_consumers=lambda: len(broadcaster.event_queues),
        registered_ids=lambda: len(registry),
        registrations_expired=lambda: registry.expired_total,
        connections=lambda: len(server.connections),
        connections_refused=lambda: server.connections.counter.refused,
        connections_closed_by_server=lambda: server.connections.closed_by_server,
        streams_refused=lambda: server.connections.streams_refused,
        input_held=lambda: server.connections.input_held,
        accept_pauses=lambda: {
            "grpc": server.loop_faults.accept_pauses,
            "metrics": http_stats.accept_pauses,
        },
        tls_handshakes=lambda: server.connections.tls_handshakes.total,
        tls_handshakes_refused=lambda: server.connections.tls_handshakes.refused,
        loop_errors=lambda: server.loop_faults.unexpected,
        rpc_handler_errors=lambda: server.handler_errors,
        rate_limited=server.rate_limited,
        http_errors=lambda: http_stats.errors,
        jobs=store.live_job_count,
        configmaps_rejected=lambda: store.rejected_total if watcher is not None else {},
        watch_counters=None if watcher is None else (lambda: watcher.counters),
        last_sync_time=lambda: status.last_sync_time,
        source_in_sync=lambda: status.in_sync,
        relay_counters=None if relay is None else (lambda: relay.counters),
    )


async def _settle_memory_after_lists(status: SourceStatus) -> None:
    """Tidy the process's memory once the first LIST is loaded, and after every LIST.

    The objects alive after start-up and the first LIST (modules, the job
    store's slices) live for the whole run: `gc.freeze()` moves them out of
    the collector's way, so full collections do not walk them again, a cost
    that grows with the subscribers' queue entries. A LIST's parsing leaves
    its peak in the C heap: `release_free_memory` gives those pages back
    after each one (docs/architecture.md section 10, "Supported Pythons and
    dependencies").
    """
    await status.ready.wait()
    gc.collect()
    gc.freeze()
    while True:
        release_free_memory()
        await status.wait_list_applied()


async def _handle_signals(
    shutdown: trio.Event, draining: trio.Event, drain_delay: float, cancel_scope: trio.CancelScope
) -> None:
    """First signal: drain, then shut down gracefully; second: shut down at once; third: stop."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            async for signum in signals:
                name = signal.Signals(signum).name
                if shutdown.is_set():
                    log.warning("another %s: stopping now", name)
                    cancel_scope.cancel()
                    return
                if draining.is_set():
                    log.warning("another %s: shutting down without waiting for the drain", name)
                    shutdown.set()
                    continue
                log.info(
                    "%s: draining for %gs (health NOT_SERVING, /readyz 503, live streams served),"
                    " then shutting down gracefully",
                    name,
                    drain_delay,
                )
                draining.set()
                nursery.start_soon(_shut_down_after, drain_delay, shutdown)


async def _shut_down_after(delay: float, shutdown: trio.Event) -> None:
    await trio.sleep(delay)
    shutdown.set()


def readiness(status: SourceStatus, draining: trio.Event) -> str | None:
    """Why the server should get no new clients now, or None when it should."""
    if draining.is_set():
        return "shutting down"
    if not status.ready.is_set():
        return "the job store is not loaded yet (first LIST pending)"  # (or first snapshot)
    return None


def _relay_tls(config: Config) -> ssl.SSLContext | None:
    """The relay's TLS context for its upstream, loaded once: a broken file is a
    ConfigError at start-up. None without TLS, or when not relaying."""
    if config.source != "relay":
        return None
    from jobsignal.relay.settings import RelaySettings

    return RelaySettings.from_config(config).ssl_context()


def subscriptions_now(sessions: Sessions, request: PageRequest) -> SubscriptionPage:
    """The page of live subscriptions `request` asks for, as they are now."""
    from jobsignal.rpc.subscriptions import subscriptions_page

    return subscriptions_page(sessions, request, now=trio.current_time(), wall_now=time.time())


def _most_connections(config: Config) -> int:
    """The connections the server may hold at once: gRPC ones, refused ones lingering
    to answer, and the metrics port's."""
    most = config.max_connections + MAX_LINGERING_REFUSALS
    if config.metrics_listen is not None:
        from jobsignal.metrics_server import MAX_CONNECTIONS as METRICS_CONNECTIONS

        most += METRICS_CONNECTIONS
    return most


async def run_jobsignal(
    config: Config,
    *,
    shutdown: trio.Event | None = None,
    handle_signals: bool = False,
    settle_memory: bool = False,
    environ: Mapping[str, str] = os.environ,
    task_status: trio.TaskStatus[RunningJobsignal] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a whole jobsignal server until `shutdown` is set (or, with
    `handle_signals`, SIGINT/SIGTERM).

    With `settle_memory` (the CLI's `jobsignal serve` asks for it) it calls
    `gc.freeze()` once the first LIST is loaded, gives free C heap pages back
    to the system after every LIST (`_settle_memory_after_lists`) and keeps
    full garbage collections short (`gc_pacing.GcPacing`): all act on the
    whole process, so an embedding program gets none unless it asks.
    """
    connection = choose_connection(config, environ)
    relay_tls = _relay_tls(config)
    settings = server_settings(config)
    if (why := shortfall(_most_connections(config), open_file_limit())) is not None:
        log.warning("%s", why)
    if shutdown is None:  # (a trio.Event has no truth value)
        shutdown = trio.Event()
    store: JobStore | RelayedJobs = JobStore()
    if config.source == "relay":
        from jobsignal.relay.state import RelayedJobs

        store = RelayedJobs()
    status = SourceStatus()
    broadcaster = Broadcaster.from_config(config, jobs=store)  # the store owns the job state
    registry = Registry.from_config(config)
    draining = trio.Event()
    async with trio.open_nursery() as nursery:
        if handle_signals:
            nursery.start_soon(
                _handle_signals, shutdown, draining, config.drain_delay, nursery.cancel_scope
            )
        server: RunningServer = await nursery.start(
            partial(run_grpc_server, draining=draining),
            settings,
            broadcaster,
            registry,
            status,
            shutdown,
        )
        source: Watcher | Relay
        if isinstance(store, JobStore):
            source = await nursery.start(run_source, config, connection, store, broadcaster, status)
        else:
            source = await nursery.start(
                run_relay_source, config, relay_tls, store, broadcaster, status
            )
        metrics_port = None
        if config.metrics_listen is not None:
            from jobsignal.metrics import build_registry
            from jobsignal.metrics_server import HttpStats, run_metrics_server

            http_stats = HttpStats()
            sources = metric_sources(
                broadcaster, registry, server, store, source, status, http_stats
            )
            host, port = config.metrics_listen
            metrics_port = await nursery.start(
                partial(
                    run_metrics_server,
                    stats=http_stats,
                    readiness=partial(readiness, status, draining),
                    subscriptions=partial(subscriptions_now, server.sessions),
                ),
                host,
                port,
                build_registry(sources),
            )
        if settle_memory:
            nursery.start_soon(_settle_memory_after_lists, status)
            await nursery.start(GcPacing().run)
        parts = ServerParts(broadcaster, registry, store, status, source, server)
        task_status.started(RunningJobsignal(parts, shutdown, metrics_port))
        await server.stopped.wait()
        nursery.cancel_scope.cancel()
