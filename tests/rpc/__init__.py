"""Integration tests of the job.Job gRPC server against the official grpcio client.

Everything here runs over real loopback sockets (127.0.0.1) on the real
clock: grpclib's timers use `time.monotonic()`, so waits are short and every
one of them is bounded. The grpcio client is blocking and runs in worker
threads; the server runs on the trio thread, which is never blocked.

Shared helpers for the tests in this package:

- `open_jobsignal_server`: the server on an ephemeral port, with its
  broadcaster, registry and source status at hand, stopped gracefully on exit;
- `StreamCollector`: consumes one grpcio response stream in a worker thread;
- `in_thread`, `rpc_error`: run blocking grpcio calls off the trio thread;
- `wait_until`: poll a condition with a deadline instead of sleeping;
- `make_job`: job events whose fields are all distinct, to catch mix-ups.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import trio
import trio.lowlevel

from jobsignal.fanout import Broadcaster, Subscriber
from jobsignal.rpc.connections import ConnectionTable
from jobsignal.rpc.registry import Registry
from jobsignal.rpc.server import RunningServer, ServerSettings, run_grpc_server
from jobsignal.status import SourceStatus
from jobsignal.store.model import JobSummary

T = TypeVar("T")

# ClusterD's role whitelist (docs/architecture.md section 2).
ROLES = ("CCAgent", "DefaultUser1", "DefaultUser2", "FdAgent")


def make_registry(
    *,
    max_registrations: int = 1000,
    max_subscriptions_per_role: int = 100,
    ttl: float = 60.0,
) -> Registry:
    return Registry(
        roles=ROLES,
        max_registrations=max_registrations,
        max_subscriptions_per_role=max_subscriptions_per_role,
        ttl=ttl,
    )


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


# -- waiting -----------------------------------------------------------------


async def wait_until(
    condition: Callable[[], bool], *, within: float = 5.0, what: str | None = None
) -> float:
    """Poll `condition` until it holds; return the seconds it took.

    Fails the test (instead of hanging) after `within` seconds.
    """
    start = trio.current_time()
    deadline = start + within
    while not condition():
        if trio.current_time() > deadline:
            description = what or getattr(condition, "__name__", "condition")
            raise AssertionError(f"timed out after {within}s waiting for {description}")
        await trio.sleep(0.005)
    return trio.current_time() - start


# -- grpcio in worker threads ----------------------------------------------------

_THREADS: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("grpcio_threads")


def _limiter() -> trio.CapacityLimiter:
    # trio's default limiter (40 threads) is too small for 50+ open streams.
    try:
        return _THREADS.get()
    except LookupError:
        limiter = trio.CapacityLimiter(256)
        _THREADS.set(limiter)
        return limiter


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking grpcio call in a worker thread.

    The thread is abandoned if the test is cancelled; every grpcio call here
    carries a deadline and the `grpc_clients` fixture (tests/conftest.py) closes every channel, so
    an abandoned thread still ends.
    """
    return await trio.to_thread.run_sync(
        functools.partial(fn, *args), limiter=_limiter(), abandon_on_cancel=True
    )


def _expect_rpc_error(fn: Callable[[], object]) -> Any:
    try:
        result = fn()
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"expected a gRPC error, got {result!r}")


async def rpc_error(fn: Callable[[], object]) -> Any:
    """Run `fn` (a grpcio call) in a thread; return the grpc.RpcError it raises."""
    return await in_thread(_expect_rpc_error, fn)


@dataclass(eq=False)
class StreamCollector:
    """Reads one grpcio response stream in a worker thread until it ends."""

    call: Any
    messages: list[Any] = field(default_factory=list)
    code: Any = None  # grpc.StatusCode once the stream has ended
    details: str | None = None
    ended: trio.Event = field(default_factory=trio.Event)

    def _consume(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.code = error.code()
            self.details = error.details()

    async def run(self) -> None:
        await in_thread(self._consume)
        self.ended.set()

    def start(self, nursery: trio.Nursery) -> StreamCollector:
        nursery.start_soon(self.run)
        return self

    async def wait_for(self, count: int, within: float = 5.0) -> list[Any]:
        """Wait until `count` messages have arrived; return them."""
        await wait_until(
            lambda: len(self.messages) >= count or self.ended.is_set(),
            within=within,
            what=f"{count} messages",
        )
        assert len(self.messages) >= count, (
            f"stream ended after {len(self.messages)} of {count} messages:"
            f" {self.code} {self.details!r}"
        )
        return self.messages[:count]

    async def wait_end(self, within: float = 5.0) -> tuple[Any, str | None]:
        """Wait until the stream has ended; return (status code, details)."""
        with trio.fail_after(within):
            await self.ended.wait()
        return self.code, self.details


# -- job events ----------------------------------------------------------------


def rank_table(npus: int, index: int = 0) -> str:
    """A complete hccl.json rank table with `npus` devices, 8 per server."""
    servers = []
    for server in range((npus + 7) // 8):
        devices = [
            {
                "device_id": str(device),
                "device_ip": f"10.{index % 250}.{server % 250}.{device}",
                "rank_id": str(server * 8 + device),
            }
            for device in range(min(8, npus - server * 8))
        ]
        servers.append(
            {
                "device": devices,
                "server_id": f"192.168.{index % 250}.{server % 250}",
                "server_name": f"node-{index}-{server}",
                "server_sn": f"SN{index:04d}{server:04d}",
            }
        )
    table = {
        "status": "complete",
        "server_list": servers,
        "server_count": str(len(servers)),
        "total": npus,
    }
    return json.dumps(table, separators=(",", ":"))


def make_job(
    index: int,
    *,
    status: str = "running",
    operator: str = "add",
    npus: int = 8,
    hccl_json: str | None = None,
    version: int = 0,
) -> JobSummary:
    """Job `index` with every field distinct, so swapped fields show up."""
    return JobSummary(
        namespace=f"ns-{index % 3}",
        job_id=f"uid-{index:04d}",
        job_name=f"train-{index}",
        framework="pytorch" if index % 2 else "mindspore",
        job_status=status,
        time=str(1_700_000_000 + index),
        total=str(1 + index % 4),
        hccl_json=rank_table(npus, index) if hccl_json is None else hccl_json,
        delete_time=str(1_700_100_000 + index + version) if operator == "delete" else "",
        shared_tor_ip=f"10.254.{index % 250}.{version % 250}",
        master_addr=f"10.253.{index % 250}.1",
        operator=operator,
        sid=f"sid-{index}-{version}",
        npu_count=npus,
    )


def expected_signal(job: JobSummary, uuid: str) -> dict[str, str]:
    """The JobSummarySignal fields (proto names) a client must see for `job`."""
    return {
        "uuid": uuid,
        "jobId": job.job_id,
        "jobName": job.job_name,
        "namespace": job.namespace,
        "frameWork": job.framework,
        "jobStatus": job.job_status,
        "time": job.time,
        "cmIndex": "0",
        "total": job.total,
        "HcclJson": job.hccl_json,
        "deleteTime": job.delete_time,
        "sharedTorIp": job.shared_tor_ip,
        "masterAddr": job.master_addr,
        "operator": job.operator,
        "sid": job.sid,
    }


def signal_fields(message: Any) -> dict[str, str]:
    """All 15 fields of a grpcio JobSummarySignal, by proto name."""
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}


def count_writes(connections: ConnectionTable) -> list[int]:
    """From now on, the size of every write to the server's one connection's socket."""
    (protocol,) = connections.protocols()
    transport = protocol.connection._transport
    writes: list[int] = []
    write = transport.write

    def counted_write(data: bytes) -> None:
        writes.append(len(data))
        write(data)

    setattr(transport, "write", counted_write)  # noqa: B010  (an instance, not the class)
    return writes
