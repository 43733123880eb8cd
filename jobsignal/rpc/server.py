"""Run the gRPC server: grpclib on trio-asyncio's loop, job.Job + health + reflection.

`run_grpc_server` is a trio task for `nursery.start`: it reports the bound
address once the port accepts connections, serves until `shutdown` is set,
then stops in the order docs/architecture.md section 8 explains: end every live stream
with UNAVAILABLE "server shutting down", give them the grace period to
flush, close the server, then close every connection still open (refused ones too),
and at the end of the grace period drop those whose peer has not read its GOAWAY.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
import trio_asyncio
from grpclib.config import Configuration
from grpclib.health.check import ServiceStatus

from jobsignal.config import Config, LayerSettings, from_setting
from jobsignal.fanout import Broadcaster, EndReason
from jobsignal.rpc import _grpclib, socket_readers
from jobsignal.rpc.activity import ConnectionActivity, PingPolicy
from jobsignal.rpc.codec import PassthroughCodec
from jobsignal.rpc.connections import ConnectionTable, JobsignalServer
from jobsignal.rpc.guard import ProtocolLimits
from jobsignal.rpc.health import Health, service_name
from jobsignal.rpc.keepalive import KeepalivePolicy
from jobsignal.rpc.limits import Limits
from jobsignal.rpc.loop_faults import LoopFaults
from jobsignal.rpc.max_age import MaxAgePolicy
from jobsignal.rpc.reflection import LazyReflection
from jobsignal.rpc.registry import Registry
from jobsignal.rpc.service import JobService
from jobsignal.rpc.session import Sessions, SessionSettings
from jobsignal.status import SourceStatus

if TYPE_CHECKING:
    from grpclib.protocol import H2Protocol

    from jobsignal.rpc.tls import ReloadingTls, TlsFiles
    from jobsignal.rpc.tls_connections import TlsServing

log = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.partition("%")[0]).is_loopback
    except ValueError:
        return False


def _tls_files(config: Config) -> TlsFiles | None:
    """The files --tls-cert, --tls-key and --tls-client-ca name; `app` loads them once
    at start-up, so a broken one fails before anything runs."""
    if not config.tls_cert:
        return None
    # The TLS modules load only where TLS is configured (an idle server's memory).
    from jobsignal.rpc.tls import TlsFiles

    client_ca = Path(config.tls_client_ca) if config.tls_client_ca else None
    return TlsFiles(Path(config.tls_cert), Path(config.tls_key), client_ca)


@dataclass(frozen=True)
class ServerSettings(LayerSettings):
    """The gRPC server's settings: all but `backlog` read from settings (jobsignal/config.py)."""

    # The first address; `more_addresses` are served too (host "": every address).
    host: str = from_setting(lambda c: c.listen[0][0])
    port: int = from_setting(lambda c: c.listen[0][1])
    more_addresses: tuple[tuple[str, int], ...] = from_setting(lambda c: c.listen[1:])
    session: SessionSettings = from_setting(SessionSettings.from_config)
    ping_policy: PingPolicy = from_setting(PingPolicy.from_config)
    keepalive: KeepalivePolicy = from_setting(KeepalivePolicy.from_config)
    max_age: MaxAgePolicy = from_setting(MaxAgePolicy.from_config)
    shutdown_grace: float = from_setting(lambda c: c.shutdown_grace)
    max_request_bytes: int = from_setting(lambda c: c.max_request_bytes)
    # grpclib's default of 100 starves handshakes when many clients connect at once.
    backlog: int = 4096
    tls: TlsFiles | None = from_setting(_tls_files)
    limits: Limits = from_setting(Limits.from_config)
    protocol_limits: ProtocolLimits = from_setting(ProtocolLimits.from_config)
    tls_reload_interval: float = from_setting(lambda c: c.tls_reload_interval)


@dataclass
class RunningServer:
    """What `run_grpc_server` reports to `nursery.start` once it listens."""

    host: str
    port: int
    # Every bound (host, port), one per listening socket.
    addresses: list[tuple[str, int]]
    connections: ConnectionTable
    registry: Registry
    stopped: trio.Event
    # Unexpected exceptions caught at the handler boundary, by RPC.
    handler_errors: Counter[str]
    # Calls refused by the per-address rate limits, by RPC (read at scrape time).
    rate_limited: Callable[[], dict[str, int]]
    # What the asyncio loop's exception handler caught: failed accepts, the unforeseen.
    loop_faults: LoopFaults
    # The live subscription streams (read by the operator's view, rpc/subscriptions.py).
    sessions: Sessions


# Server keepalive is jobsignal's own, on trio's clock (rpc/keepalive.py): grpclib's
# (every 2 h by default, its spacing measured by time.monotonic()) is turned off.
# The receive windows are HTTP/2's defaults, not grpclib's 4 MiB: requests are a few
# hundred bytes, and what a peer sends beyond what the handlers read waits,
# unacknowledged, in grpclib's buffers; the windows bound it (docs/architecture.md
# section 7, "Request bodies").
RECEIVE_WINDOW = 2**16 - 1
GRPCLIB_CONFIG = Configuration(
    _keepalive_time=None,
    http2_connection_window_size=RECEIVE_WINDOW,
    http2_stream_window_size=RECEIVE_WINDOW,
)

SOURCE_HEALTH_NAME = "jobsignal.KubernetesSync"


def _observed_in_tls(
    server: JobsignalServer, tls: TlsServing
) -> Callable[[H2Protocol], asyncio.BaseProtocol]:
    """Each connection's protocol: grpclib's, observed, inside TLS."""

    def wrap(protocol: H2Protocol) -> asyncio.BaseProtocol:
        return tls.wrap(server.observe(protocol))

    return wrap


def tls_serving(
    tls: ReloadingTls, settings: ServerSettings, connections: ConnectionTable
) -> TlsServing:
    """TLS for each connection, its handshake bounded in time and in number."""
    from jobsignal.rpc.tls_connections import TlsServing

    return TlsServing(
        tls.listening_context,
        # Peers that never finish the TLS handshake hold a connection too.
        settings.protocol_limits.handshake_timeout,
        connections.tls_handshakes,
    )


def _end_aged_subscriptions(broadcaster: Broadcaster, connection: ConnectionActivity) -> None:
    """End the subscriptions of a connection whose maximum age and grace ran out:
    each handler then sends UNAVAILABLE and closes the connection after the last."""
    for subscriber in broadcaster.subscribers:
        if subscriber.group is connection:
            subscriber.end(EndReason.MAX_AGE)


async def _track_health(
    status: SourceStatus, ready: ServiceStatus, synced: ServiceStatus, draining: trio.Event
) -> None:
    """Overall and job.Job: SERVING once the first LIST is loaded, NOT_SERVING again
    from the moment the server drains (so new clients go to another replica); the
    source entry additionally turns NOT_SERVING while the Kubernetes API is out of reach."""
    ready.set(False)
    synced.set(False)
    async with trio.open_nursery() as nursery:

        async def serving_until_drained() -> None:
            await status.ready.wait()
            if draining.is_set():
                return
            ready.set(True)
            log.info("ready: job store loaded, health SERVING")
            await draining.wait()
            ready.set(False)
            nursery.cancel_scope.cancel()

        nursery.start_soon(serving_until_drained)
        await status.ready.wait()
        while True:
            synced.set(status.in_sync)
            await status.wait_changed()


async def run_grpc_server(
    settings: ServerSettings,
    broadcaster: Broadcaster,
    registry: Registry,
    status: SourceStatus,
    shutdown: trio.Event,
    *,
    draining: trio.Event | None = None,
    task_status: trio.TaskStatus[RunningServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown`; health turns NOT_SERVING when `draining` (or `shutdown`) is set."""
    draining = trio.Event() if draining is None else draining
    connections = ConnectionTable(
        settings.ping_policy,
        settings.limits,
        settings.protocol_limits,
        settings.keepalive,
        settings.max_age,
    )
    connections.end_subscriptions = functools.partial(_end_aged_subscriptions, broadcaster)
    service = JobService(
        registry=registry,
        broadcaster=broadcaster,
        settings=settings.session,
        connections=connections,
    )
    ready_health, source_health = ServiceStatus(), ServiceStatus()
    health = Health(
        {
            "": [ready_health],  # the server as a whole
            service_name(service): [ready_health],
            SOURCE_HEALTH_NAME: [source_health],
        },
        request_timeout=settings.session.request_timeout,
    )
    services: list[Any] = [service, health]
    services.append(LazyReflection(services))
    tls = None
    if settings.tls is not None:
        from jobsignal.rpc.tls import ReloadingTls

        tls = ReloadingTls(settings.tls)
    loop_faults = LoopFaults()
    async with trio_asyncio.open_loop() as loop, trio.open_nursery() as nursery:
        loop_faults.install(loop)
        if socket_readers.AVAILABLE:
            readers = socket_readers.SharedReaders(loop)
            readers.install()
            await nursery.start(readers.run)
        await nursery.start(broadcaster.pacer.run)
        sessions: Sessions = await nursery.start(
            Sessions(registry, broadcaster, settings.session).run
        )
        service.serve_sessions_with(sessions)
        server = JobsignalServer(
            services,
            codec=PassthroughCodec(settings.max_request_bytes),
            config=GRPCLIB_CONFIG,
            connections=connections,
        )
        listeners = await trio_asyncio.aio_as_trio(_grpclib.start_server)(
            server,
            [(settings.host, settings.port), *settings.more_addresses],
            backlog=settings.backlog,
            wrap=server.observe
            if tls is None
            else _observed_in_tls(server, tls_serving(tls, settings, connections)),
        )
        addresses = [
            (str(name[0]), int(name[1]))
            for listener in listeners
            for name in (sock.getsockname() for sock in listener.sockets)
        ]
        shown = ", ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in addresses)
        nursery.start_soon(_track_health, status, ready_health, source_health, draining)
        if tls is None:
            # Only where other machines can connect is plain text worth a warning.
            local = all(_is_loopback(host) for host, _ in addresses)
            log.log(
                logging.INFO if local else logging.WARNING,
                "gRPC listening on %s in PLAIN TEXT (as ClusterD does); set --tls-cert"
                " and --tls-key for TLS, plus --tls-client-ca for mutual TLS",
                shown,
            )
        else:
            mode = "mutual TLS" if tls.files.mutual else "TLS"
            log.info("gRPC listening on %s with %s", shown, mode)
            nursery.start_soon(tls.run_reloader, settings.tls_reload_interval)
        host, port = addresses[0]
        running = RunningServer(
            host,
            port,
            addresses,
            connections,
            registry,
            trio.Event(),
            service.handler_errors,
            service.rate_limited,
            loop_faults,
            sessions,
        )
        task_status.started(running)
        try:
            await shutdown.wait()
            draining.set()
        finally:
            with trio.CancelScope(shield=True):
                await _stop(
                    server, listeners, service, broadcaster, connections, settings.shutdown_grace
                )
            nursery.cancel_scope.cancel()
            running.stopped.set()


# Seconds asyncio gets to close the transports aborted at the end of the stop.
ABORT_WAIT = 1.0


async def _stop(
    server: JobsignalServer,
    listeners: list[asyncio.Server],
    service: JobService,
    broadcaster: Broadcaster,
    connections: ConnectionTable,
    grace: float,
) -> None:
    log.info("shutting down: ending %d streams", len(broadcaster.subscribers))
    for listener in listeners:
        listener.close()  # stop accepting; live connections stay for the trailers
    broadcaster.end_all(EndReason.SHUTDOWN)
    deadline = trio.current_time() + grace  # the whole stop fits in the grace period
    with trio.move_on_at(deadline):
        # Handlers, not just subscriptions: the trailers are written on the
        # asyncio side after the trio session has already returned.
        await service.wait_streams_closed()
    server.close()
    connections.close_all()
    with trio.move_on_at(deadline):
        await trio_asyncio.aio_as_trio(server.wait_closed)()
        for listener in listeners[1:]:  # grpclib waits for the first only
            await trio_asyncio.aio_as_trio(listener.wait_closed)()
        await connections.wait_transports_closed()
    # A peer that does not read keeps its transport open with the GOAWAY unsent,
    # and the asyncio loop ends with the server: drop those connections now.
    connections.abort_all()
    with trio.move_on_after(ABORT_WAIT):
        await connections.wait_transports_closed()
    log.info("gRPC server stopped")
