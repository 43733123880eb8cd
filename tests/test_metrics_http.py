"""The metrics port under odd and hostile HTTP: every connection ends alone, the server serves on.

Real sockets on 127.0.0.1 against the real metrics server task; each test
ends by checking that a plain GET /metrics is still answered.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import h11
import pytest
import trio
import trio.testing
from test_metrics import kubeconfig_for, sample, scrape

from jobsignal import metrics_server
from jobsignal.app import RunningJobsignal, run_jobsignal
from jobsignal.config import load_config
from jobsignal.kube.emulator import open_emulator
from jobsignal.logs import RateLimitedLog
from jobsignal.metrics_server import CONNECTION_TIMEOUT, HttpStats, run_metrics_server

METRICS_TEXT = "# HELP up Test.\n# TYPE up gauge\nup 1\n"


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class MetricsServer:
    port: int
    stats: HttpStats


@asynccontextmanager
async def open_metrics_server(
    render: Callable[[], str] = lambda: METRICS_TEXT,
) -> AsyncIterator[MetricsServer]:
    stats = HttpStats()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(run_metrics_server, stats=stats), "127.0.0.1", 0, render)
        yield MetricsServer(port, stats)
        nursery.cancel_scope.cancel()


async def exchange(port: int, request: bytes, *, shut_write: bool = False) -> bytes:
    """Send raw bytes, optionally half-close, and read until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        if request:
            await stream.send_all(request)
        if shut_write:
            await stream.send_eof()
        received = b""
        while chunk := await stream.receive_some(65536):
            received += chunk
        return received


def parse(raw: bytes) -> Response:
    head, separator, body = raw.partition(b"\r\n\r\n")
    assert separator, f"no complete response head in {raw[:200]!r}"
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    version, status, _ = status_line.split(" ", 2)
    assert version == "HTTP/1.1"
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Response(int(status), headers, body)


async def request(port: int, method: str, target: str, **options: bool) -> Response:
    raw = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: test\r\n\r\n"
    return parse(await exchange(port, raw.encode(), **options))


async def assert_still_serving(port: int, text: str = METRICS_TEXT) -> None:
    with trio.fail_after(5):
        response = await request(port, "GET", "/metrics")
    assert response.status == 200
    assert response.body == text.encode()
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")


async def test_get_serves_metrics_and_healthz() -> None:
    async with open_metrics_server() as server:
        healthz = await request(server.port, "GET", "/healthz?verbose=1")
        assert (healthz.status, healthz.body) == (200, b"ok\n")
        assert not server.stats.errors
        await assert_still_serving(server.port)


@pytest.mark.parametrize(
    ("path", "body"), [("/metrics", METRICS_TEXT.encode()), ("/healthz", b"ok\n")]
)
async def test_head_gets_the_headers_of_get_without_a_body(path: str, body: bytes) -> None:
    async with open_metrics_server() as server:
        response = await request(server.port, "HEAD", path)
        assert response.status == 200
        assert response.headers["content-length"] == str(len(body))
        assert response.body == b""
        assert not server.stats.errors
        await assert_still_serving(server.port)


@pytest.mark.parametrize(
    ("method", "target"),
    [("OPTIONS", "/metrics"), ("OPTIONS", "*"), ("POST", "/metrics"), ("DELETE", "/healthz")],
)
async def test_other_methods_get_405_with_allow(method: str, target: str) -> None:
    async with open_metrics_server() as server:
        response = await request(server.port, method, target)
        assert response.status == 405
        assert response.headers["allow"] == "GET, HEAD"
        await assert_still_serving(server.port)


async def test_a_post_with_a_body_gets_its_405_before_the_close() -> None:
    async with open_metrics_server() as server:
        body = b"x" * 200_000  # more than the server reads: it must not reset the answer away
        head = f"POST /metrics HTTP/1.1\r\nHost: h\r\nContent-Length: {len(body)}\r\n\r\n"
        response = parse(await exchange(server.port, head.encode() + body))
        assert response.status == 405
        await assert_still_serving(server.port)


async def test_unknown_path_is_404() -> None:
    async with open_metrics_server() as server:
        response = await request(server.port, "GET", "/admin")
        assert response.status == 404
        await assert_still_serving(server.port)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)) + b"\r\n\r\n",  # TLS
        b"GET /metrics HTTP/1.1\r\nHost: h\r\nContent-Length: nope\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
        b"\r\n\r\n\r\n\x00\x00\x00\r\n\r\n",
    ],
)
async def test_garbage_gets_400(garbage: bytes) -> None:
    async with open_metrics_server() as server:
        response = parse(await exchange(server.port, garbage))
        assert response.status == 400
        assert server.stats.errors == {"bad_request": 1}
        await assert_still_serving(server.port)


async def test_oversized_headers_get_431() -> None:
    async with open_metrics_server() as server:
        big = b"GET /metrics HTTP/1.1\r\nHost: h\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n"
        response = parse(await exchange(server.port, big))
        assert response.status == 431
        assert server.stats.errors == {"headers_too_large": 1}
        await assert_still_serving(server.port)


async def test_half_closed_after_a_whole_request_is_still_answered() -> None:
    async with open_metrics_server() as server:
        response = await request(server.port, "GET", "/metrics", shut_write=True)
        assert (response.status, response.body) == (200, METRICS_TEXT.encode())
        await assert_still_serving(server.port)


async def test_half_closed_in_the_middle_of_a_request_gets_400() -> None:
    async with open_metrics_server() as server:
        raw = await exchange(server.port, b"GET /metrics HTTP/1.1\r\nHost: h", shut_write=True)
        assert parse(raw).status == 400
        assert server.stats.errors == {"bad_request": 1}
        await assert_still_serving(server.port)


async def test_closed_without_a_request_ends_quietly() -> None:
    async with open_metrics_server() as server:
        assert await exchange(server.port, b"", shut_write=True) == b""
        assert not server.stats.errors
        await assert_still_serving(server.port)


async def test_a_client_reset_ends_only_its_connection() -> None:
    async with open_metrics_server() as server:
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", server.port))
        await sock.send(b"GET /metr")
        # SO_LINGER 0: close() sends RST instead of FIN.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
        await assert_still_serving(server.port)


@pytest.mark.parametrize("sent", [b"", b"GET /metrics HTTP/1.1\r\nHost: h\r\n"])
async def test_a_client_that_never_finishes_is_let_go_after_the_timeout(
    sent: bytes, mock_clock: trio.testing.MockClock
) -> None:
    # Jump virtual time only once nothing has happened for a (real) moment,
    # so bytes in flight on the loopback are delivered before any jump.
    mock_clock.autojump_threshold = 0.05
    async with open_metrics_server() as server:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            await stream.send_all(sent)
            start = trio.current_time()
            with trio.move_on_after(CONNECTION_TIMEOUT - 0.1):
                early = await stream.receive_some(65536)
                pytest.fail(f"answered before the timeout: {early!r}")
            received = b""
            while chunk := await stream.receive_some(65536):
                received += chunk
            waited = trio.current_time() - start
        assert CONNECTION_TIMEOUT <= waited < CONNECTION_TIMEOUT + 1
        assert parse(received).status == 408
        assert server.stats.errors == {"timeout": 1}
        await assert_still_serving(server.port)


async def test_render_failure_is_a_500_for_that_scrape_only(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_server, "fault_log", RateLimitedLog(metrics_server.log, burst=3))
    failures = [ZeroDivisionError("a bug in a metric source")] * 8

    def render() -> str:
        if failures:
            raise failures.pop()
        return METRICS_TEXT

    async with open_metrics_server(render) as server:
        with caplog.at_level(logging.ERROR, logger=metrics_server.__name__):
            for _ in range(8):
                response = await request(server.port, "GET", "/metrics")
                assert response.status == 500
        assert server.stats.errors == {"internal": 8}
        tracebacks = [
            r for r in caplog.records if r.exc_info and r.exc_info[0] is ZeroDivisionError
        ]
        assert len(tracebacks) == 3, "logged at a bounded rate"
        await assert_still_serving(server.port)


async def test_an_h11_error_of_our_own_is_a_500_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The HEAD bug as it was: a body written on a HEAD response makes h11 raise."""
    real_response = metrics_server._response
    broken = [True]

    def response_with_body_always(conn: h11.Connection, reply: object, *, with_body: bool) -> bytes:
        if broken:
            broken.clear()
            with_body = True
        return real_response(conn, reply, with_body=with_body)  # type: ignore[arg-type]

    monkeypatch.setattr(metrics_server, "_response", response_with_body_always)
    async with open_metrics_server() as server:
        response = await request(server.port, "HEAD", "/metrics")
        assert response.status == 500
        assert server.stats.errors == {"internal": 1}
        await assert_still_serving(server.port)
        head = await request(server.port, "HEAD", "/metrics")
        assert (head.status, head.body) == (200, b"")


async def test_the_whole_server_survives_and_counts_http_faults(tmp_path: Path) -> None:
    async with open_emulator(token="t0ken") as emulator:
        config = load_config(
            {
                "listen": "127.0.0.1:0",
                "metrics_listen": "127.0.0.1:0",
                "kubeconfig": str(kubeconfig_for(emulator, tmp_path / "config")),
                "source": "kubernetes",
            },
            {},
        )
        async with trio.open_nursery() as nursery:
            server: RunningJobsignal = await nursery.start(run_jobsignal, config)
            assert server.metrics_port is not None
            await server.status.ready.wait()
            head = await request(server.metrics_port, "HEAD", "/metrics")
            assert (head.status, head.body) == (200, b"")
            assert int(head.headers["content-length"]) > 0
            assert parse(await exchange(server.metrics_port, b"\x00garbage\r\n\r\n")).status == 400
            text = await scrape(server.metrics_port)
            assert sample(text, "jobsignal_http_errors_total", '{reason="bad_request"}') == 1
            assert sample(text, "jobsignal_jobs") == 0
            server.request_shutdown()
            await server.stopped.wait()
            nursery.cancel_scope.cancel()
