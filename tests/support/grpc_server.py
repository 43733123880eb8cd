"""jobsignal's gRPC server on its own, as the integration tests run it over 127.0.0.1.

`open_jobsignal_server` runs the server (docs/architecture.md sections 2 and 6)
on an ephemeral port with its broadcaster, registry and source status at
hand, and stops it gracefully on exit. Everything runs on the real clock:
grpclib's timers use `time.monotonic()`, so waits are short and bounded.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from jobsignal.fanout import Broadcaster, Subscriber
from jobsignal.rpc import _grpclib
from jobsignal.rpc.connections import ConnectionTable
from jobsignal.rpc.keepalive import KeepalivePolicy
from jobsignal.rpc.registry import Registry
from jobsignal.rpc.server import RunningServer, ServerSettings, run_grpc_server
from jobsignal.status import SourceStatus

# ClusterD's role whitelist (docs/architecture.md section 2).
ROLES = ("CCAgent", "DefaultUser1", "DefaultUser2", "FdAgent")


def make_registry(
    *,
    max_registrations: int = 1000,
    max_subscriptions_per_role: int = 100,
    ttl: float = 60.0,
    max_registrations_per_ip: int | None = None,
    max_subscriptions_per_role_per_ip: int | None = None,
) -> Registry:
    """A Registry of ClusterD's roles; per-address shares only when given."""
    return Registry(
        roles=ROLES,
        max_registrations=max_registrations,
        max_subscriptions_per_role=max_subscriptions_per_role,
        ttl=ttl,
        max_registrations_per_ip=max_registrations_per_ip,
        max_subscriptions_per_role_per_ip=max_subscriptions_per_role_per_ip,
    )


# Server keepalive at a pace a few real seconds can show, for peers on the real
# clock: a PING after half a second of silence, a second for anything to come back.
QUICK_KEEPALIVE = KeepalivePolicy(interval=0.5, timeout=1.0)
# An idle timeout above QUICK_KEEPALIVE's interval and timeout, as --idle-timeout
# must be: a quiet client that answers the PINGs outlives it many times over.
QUICK_IDLE_TIMEOUT = 2.0


def local_settings(**overrides: Any) -> ServerSettings:
    """ServerSettings on 127.0.0.1 and an ephemeral port."""
    return ServerSettings(host="127.0.0.1", port=0, **overrides)


@dataclass
class ServerHarness:
    settings: ServerSettings
    broadcaster: Broadcaster
    registry: Registry
    status: SourceStatus
    running: RunningServer
    shutdown: trio.Event

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.running.port}"

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def connections(self) -> ConnectionTable:
        return self.running.connections

    def mark_ready(self) -> None:
        """The first LIST is loaded: health turns SERVING."""
        self.status.mark_ready(time.time())

    def subscriber(self, client_id: str) -> Subscriber:
        """The broadcaster's live subscriber for `client_id`."""
        (found,) = [s for s in self.broadcaster.subscribers if s.client_id == client_id]
        return found

    async def stop(self, within: float = 10.0) -> None:
        """Graceful shutdown; returns once the server task has finished it."""
        self.shutdown.set()
        with trio.fail_after(within):
            await self.running.stopped.wait()


@asynccontextmanager
async def open_jobsignal_server(
    settings: ServerSettings | None = None,
    *,
    broadcaster: Broadcaster | None = None,
    registry: Registry | None = None,
    ready: bool = True,
) -> AsyncIterator[ServerHarness]:
    """Run jobsignal's gRPC server for the duration of the block."""
    # `is None`, not `or`: an empty Registry is falsy (it has __len__).
    settings = local_settings() if settings is None else settings
    broadcaster = Broadcaster() if broadcaster is None else broadcaster
    registry = make_registry() if registry is None else registry
    status = SourceStatus()
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        running: RunningServer = await nursery.start(
            run_grpc_server, settings, broadcaster, registry, status, shutdown
        )
        harness = ServerHarness(settings, broadcaster, registry, status, running, shutdown)
        if ready:
            harness.mark_ready()
        try:
            yield harness
        finally:
            shutdown.set()
            with trio.move_on_after(settings.shutdown_grace + 5):
                await running.stopped.wait()
            nursery.cancel_scope.cancel()


def count_writes(connections: ConnectionTable) -> list[int]:
    """From now on, the size of every write to the server's one connection's socket."""
    writes: list[int] = []
    _on_each_write(connections, lambda data: writes.append(len(data)))
    return writes


def record_writes(connections: ConnectionTable) -> list[bytes]:
    """From now on, the bytes of every write to the server's one connection's socket."""
    writes: list[bytes] = []
    _on_each_write(connections, lambda data: writes.append(bytes(data)))
    return writes


def _on_each_write(connections: ConnectionTable, note: Callable[[bytes], None]) -> None:
    (protocol,) = connections.protocols()
    transport = protocol.socket_transport
    write, writelines = transport.write, transport.writelines

    def noted_write(data: bytes) -> None:
        note(data)
        write(data)

    def noted_writelines(parts: list[bytes]) -> None:  # (large DATA: one write of views)
        note(b"".join(parts))
        writelines(parts)

    setattr(transport, "write", noted_write)  # noqa: B010  (an instance, not the class)
    setattr(transport, "writelines", noted_writelines)  # noqa: B010


def collect_grpclib_garbage() -> None:
    """Let grpclib drop what it keeps of closed connections now: its deferred
    clean-up would blur a measurement of what the server really keeps."""
    _grpclib.collect_garbage()
