"""Drain on SIGTERM: health NOT_SERVING and /readyz 503 at once, live streams served
through --drain-delay, then the graceful shutdown; plus /readyz and /livez."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from jobsignal.app import _handle_signals, readiness
from jobsignal.metrics_server import route
from jobsignal.status import SourceStatus
from tests.support.grpcio import GrpcioClients, GrpcioStubs, health_statuses
from tests.support.serve_process import serving_demo
from tests.support.waiting import wait_until_blocking


@asynccontextmanager
async def handling_signals(drain_delay: float) -> AsyncIterator[tuple[trio.Event, trio.Event]]:
    """`jobsignal serve`'s signal handler, installed: (shutdown, draining) events."""
    shutdown, draining = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_handle_signals, shutdown, draining, drain_delay, nursery.cancel_scope)
        await trio.testing.wait_all_tasks_blocked()
        yield shutdown, draining
        nursery.cancel_scope.cancel()


async def test_first_signal_drains_for_the_delay_then_shuts_down(
    io_clock: trio.testing.MockClock,
) -> None:
    async with handling_signals(5.0) as (shutdown, draining):
        os.kill(os.getpid(), signal.SIGTERM)
        await draining.wait()
        drained_at = trio.current_time()
        assert not shutdown.is_set()
        await shutdown.wait()
        assert trio.current_time() - drained_at == 5.0


async def test_a_second_signal_skips_the_rest_of_the_drain(
    io_clock: trio.testing.MockClock,
) -> None:
    async with handling_signals(60.0) as (shutdown, draining):
        os.kill(os.getpid(), signal.SIGTERM)
        await draining.wait()
        await trio.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)
        await shutdown.wait()
        assert trio.current_time() < 2.0


async def test_readiness_names_why_not() -> None:
    status, draining = SourceStatus(), trio.Event()
    assert "not loaded" in (readiness(status, draining) or "")
    status.mark_ready(time.time())
    assert readiness(status, draining) is None
    draining.set()
    assert readiness(status, draining) == "shutting down"


def test_readyz_and_livez_routes() -> None:
    ready = route(b"GET", b"/readyz", CollectorRegistry(), lambda: None)
    assert (ready.status, ready.body) == (200, b"ok\n")
    not_ready = route(b"GET", b"/readyz", CollectorRegistry(), lambda: "shutting down")
    assert (not_ready.status, not_ready.body) == (503, b"not ready: shutting down\n")
    live = route(b"HEAD", b"/livez", CollectorRegistry(), lambda: "shutting down")
    assert live.status == 200  # alive while it drains


def test_sigterm_drains_a_real_server(
    grpc_clients: GrpcioClients, grpcio_stubs: GrpcioStubs
) -> None:
    drain = 3.0
    env = {"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"}
    with serving_demo("--drain-delay", str(drain), env=env) as serving:
        server = serving.process
        wait_until_blocking(
            lambda: serving.get("/readyz")[0] == 200, within=30, what="/readyz 200", interval=0.05
        )

        client = grpc_clients.connect(serving.target)
        assert health_statuses(grpcio_stubs, serving.target, "", "job.Job") == {
            "": "SERVING",
            "job.Job": "SERVING",
        }
        client_id = client.register_id("FdAgent")
        stream = client.subscribe("FdAgent", client_id, timeout=30)
        first = next(stream)  # the snapshot arrives
        assert first.namespace == "demo"

        server.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until_blocking(
            lambda: serving.get("/readyz")[0] == 503,
            within=signalled + 1.0 - time.monotonic(),
            what="/readyz to turn 503 at once",
            interval=0.02,
        )
        assert serving.get("/livez")[0] == 200
        assert health_statuses(grpcio_stubs, serving.target, "", "job.Job") == {
            "": "NOT_SERVING",
            "job.Job": "NOT_SERVING",
        }
        # The live stream is still served while it drains...
        assert server.poll() is None

        def drain_stream() -> tuple[grpc.StatusCode, str]:
            try:
                for _ in stream:
                    pass
            except grpc.RpcError as error:
                return error.code(), error.details()
            raise AssertionError("the stream ended without a status")

        code, details = drain_stream()
        ended_after = time.monotonic() - signalled
        # ... and ends with the graceful shutdown's status once the drain is over.
        assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "server shutting down")
        assert ended_after >= drain - 0.2, ended_after
        assert server.wait(15) == 0
