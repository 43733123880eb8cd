"""Drain on SIGTERM: health NOT_SERVING and /readyz 503 at once, live streams served
through --drain-delay, then the graceful shutdown; plus /readyz and /livez."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from jobsignal.app import _handle_signals, readiness
from jobsignal.metrics_server import route
from jobsignal.status import SourceStatus
from tests.support.grpcio import GrpcioClients, GrpcioStubs, cli_command, cli_env
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


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def _health(stubs: GrpcioStubs, target: str) -> dict[str, str]:
    done = subprocess.run(
        cli_command("health", target, "", "job.Job"),
        capture_output=True,
        env=cli_env(stubs),
        timeout=30,
        check=True,
    )
    result: dict[str, str] = json.loads(done.stdout.decode().splitlines()[-1])
    return result


def test_sigterm_drains_a_real_server(
    grpc_clients: GrpcioClients, grpcio_stubs: GrpcioStubs
) -> None:
    drain = 3.0
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jobsignal",
            "serve",
            "--source",
            "demo",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--drain-delay",
            str(drain),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"},
    )
    try:
        assert server.stderr is not None
        ports: dict[str, int] = {}
        deadline = time.monotonic() + 30
        while len(ports) < 2 and time.monotonic() < deadline:
            line = server.stderr.readline()
            if match := re.search(r"gRPC listening on 127\.0\.0\.1:(\d+)", line):
                ports["grpc"] = int(match.group(1))
            if match := re.search(r"metrics on http://127\.0\.0\.1:(\d+)", line):
                ports["metrics"] = int(match.group(1))
        readyz = f"http://127.0.0.1:{ports['metrics']}/readyz"
        wait_until_blocking(
            lambda: _get(readyz) == 200,
            within=deadline - time.monotonic(),
            what="/readyz 200",
            interval=0.05,
        )

        client = grpc_clients.connect(f"127.0.0.1:{ports['grpc']}")
        assert _health(grpcio_stubs, f"127.0.0.1:{ports['grpc']}") == {
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
            lambda: _get(readyz) == 503,
            within=signalled + 1.0 - time.monotonic(),
            what="/readyz to turn 503 at once",
            interval=0.02,
        )
        assert _get(readyz.replace("readyz", "livez")) == 200
        target = f"127.0.0.1:{ports['grpc']}"
        assert _health(grpcio_stubs, target) == {"": "NOT_SERVING", "job.Job": "NOT_SERVING"}
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
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(timeout=10)
        if server.stderr is not None:
            server.stderr.close()
