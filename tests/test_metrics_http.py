"""The metrics port under odd and hostile HTTP: every connection ends alone, the server serves on.

Real sockets on 127.0.0.1 against the real metrics server task; each test
ends by checking that a plain GET /metrics is still answered.
"""

from __future__ import annotations

import gzip
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import h11
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from jobsignal import metrics_server
from jobsignal.app import RunningJobsignal, run_jobsignal
from jobsignal.config import load_config
from jobsignal.logs import RateLimitedLog
from jobsignal.metrics_server import (
    CONNECTION_TIMEOUT,
    HttpStats,
    gzip_accepted,
    run_metrics_server,
)
from jobsignal.sim.emulator import open_emulator
from tests.support.cluster import TOKEN, write_kubeconfig
from tests.support.descriptors import connect_without_yielding, file_limit
from tests.support.metrics import Scrape, scrape, scrape_text
from tests.support.waiting import wait_until

UP = CollectorRegistry()
Gauge("up", "Test.", registry=UP).set(1)
METRICS_TEXT = "# HELP up Test.\n# TYPE up gauge\nup 1.0\n"


def openmetrics_families(text: str) -> list[Metric]:
    """Parsed strictly by prometheus_client's OpenMetrics parser (it raises on bad input)."""
    return list(text_string_to_metric_families(text))  # type: ignore[no-untyped-call]


OPENMETRICS_TEXT = "# HELP up Test.\n# TYPE up gauge\nup 1.0\n# EOF\n"
# What Prometheus 2.x and 3.x send when scraping (3.x by default, with UTF-8 names allowed).
PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROMETHEUS_3_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
)


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
async def open_metrics_server(metrics: CollectorRegistry = UP) -> AsyncIterator[MetricsServer]:
    stats = HttpStats()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            partial(run_metrics_server, stats=stats), "127.0.0.1", 0, metrics
        )
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


async def request(
    port: int,
    method: str,
    target: str,
    headers: tuple[tuple[str, str], ...] = (),
    **options: bool,
) -> Response:
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", "User-Agent: test"]
    lines += [f"{name}: {value}" for name, value in headers]
    raw = "\r\n".join(lines) + "\r\n\r\n"
    return parse(await exchange(port, raw.encode(), **options))


async def assert_still_serving(port: int, text: str = METRICS_TEXT) -> None:
    with trio.fail_after(5):
        response = await request(port, "GET", "/metrics")
    assert response.status == 200
    assert response.body == text.encode()
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "content-encoding" not in response.headers


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


async def _held(port: int, host: str = "127.0.0.1") -> trio.SocketStream:
    """A connection from `host` (an address of the loopback range) that sends nothing."""
    sock = trio.socket.socket()
    await sock.bind((host, 0))
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


async def _closed_unanswered(stream: trio.SocketStream) -> bool:
    """Whether the server closed `stream` without a byte (before its request timeout)."""
    with trio.move_on_after(CONNECTION_TIMEOUT / 2):
        try:
            return await stream.receive_some(65536) == b""
        except trio.BrokenResourceError:  # reset: closed with the request unread
            return True
    return False


async def test_one_address_gets_its_share_of_connections_and_no_more() -> None:
    async with open_metrics_server() as server:
        share = metrics_server.MAX_CONNECTIONS_PER_ADDRESS
        # Each held connection waits for its request: the next one is refused.
        held = [await _held(server.port) for _ in range(share)]
        extra = await _held(server.port)
        assert await _closed_unanswered(extra)
        assert server.stats.errors == {"too_many_connections": 1}
        # Another address is still served, and so is this one once a slot is free.
        other = await _held(server.port, "127.0.0.2")
        await other.send_all(b"GET /healthz HTTP/1.1\r\nHost: h\r\n\r\n")
        assert (await other.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
        await held.pop().aclose()
        await wait_until_served(server.port)
        for stream in [extra, other, *held]:
            await stream.aclose()


async def test_all_addresses_together_get_at_most_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics_server, "MAX_CONNECTIONS", 6)
    monkeypatch.setattr(metrics_server, "MAX_CONNECTIONS_PER_ADDRESS", 2)
    async with open_metrics_server() as server:
        held = [await _held(server.port, f"127.0.0.{2 + i // 2}") for i in range(6)]
        extra = await _held(server.port, "127.0.0.9")
        assert await _closed_unanswered(extra)
        assert server.stats.errors == {"too_many_connections": 1}
        for stream in [extra, *held]:
            await stream.aclose()
        await wait_until_served(server.port)


async def test_connections_past_the_file_limit_pause_accepting_and_end_nothing(
    io_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """trio's own accept loop logged a traceback at ERROR every 0.1 s while the
    process was out of files; now accepting pauses for a second, with one warning."""
    caplog.set_level(logging.INFO)
    async with open_metrics_server() as server:
        with ExitStack() as stack:
            # (No more than one address's share: past it they would be refused.)
            share = metrics_server.MAX_CONNECTIONS_PER_ADDRESS
            waiting = connect_without_yielding(server.port, share, stack)
            for sock in waiting:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: h\r\n\r\n")
            with file_limit(room=0):
                await wait_until(lambda: server.stats.accept_pauses["EMFILE"] == 1)
            # A second later every waiting connection is accepted and answered.
            for sock in waiting:
                stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock.dup()))
                async with stream:
                    with trio.fail_after(5):
                        assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
        assert server.stats.accept_pauses == {"EMFILE": 1}
        assert not server.stats.errors
        await assert_still_serving(server.port)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "jobsignal.metrics_server" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1, warnings
    assert "(EMFILE)" in warnings[0] and "ulimit -n" in warnings[0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def wait_until_served(port: int) -> None:
    """Until a fresh connection from 127.0.0.1 gets GET /metrics answered."""
    with trio.fail_after(5):
        while True:
            try:
                await assert_still_serving(port)
                return
            except (AssertionError, trio.BrokenResourceError):
                await trio.sleep(0.01)  # the freed slot is not counted free yet


@pytest.mark.parametrize("sent", [b"", b"GET /metrics HTTP/1.1\r\nHost: h\r\n"])
async def test_a_client_that_never_finishes_is_let_go_after_the_timeout(
    sent: bytes, io_clock: trio.testing.MockClock
) -> None:
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

    class Failing:
        def collect(self) -> Iterator[Metric]:
            if failures:
                raise failures.pop()
            yield GaugeMetricFamily("up", "Test.", value=1)

    metrics = CollectorRegistry()
    metrics.register(Failing())
    async with open_metrics_server(metrics) as server:
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


@pytest.mark.parametrize("accept", [PROMETHEUS_2_ACCEPT, PROMETHEUS_3_ACCEPT])
@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_openmetrics_when_the_scraper_asks_for_it(accept: str, method: str) -> None:
    async with open_metrics_server() as server:
        response = await request(server.port, method, "/metrics", (("Accept", accept),))
        assert response.status == 200
        content_type = response.headers["content-type"]
        assert content_type.startswith("application/openmetrics-text; version=1.0.0;")
        assert "charset=utf-8" in content_type
        assert response.headers["vary"] == "Accept, Accept-Encoding"
        assert response.headers["content-length"] == str(len(OPENMETRICS_TEXT))
        if method == "GET":
            assert response.body.decode() == OPENMETRICS_TEXT
            (family,) = openmetrics_families(response.body.decode())
            assert (family.name, family.type, family.samples[0].value) == ("up", "gauge", 1)
        else:
            assert response.body == b""
        await assert_still_serving(server.port)


@pytest.mark.parametrize(
    "accept", ["", "*/*", "text/plain", "text/plain;version=0.0.4", "application/json"]
)
async def test_the_prometheus_text_format_otherwise(accept: str) -> None:
    async with open_metrics_server() as server:
        headers = (("Accept", accept),) if accept else ()
        response = await request(server.port, "GET", "/metrics", headers)
        assert response.status == 200
        assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert response.body == METRICS_TEXT.encode()


@pytest.mark.parametrize("accept", ["", PROMETHEUS_3_ACCEPT])
async def test_gzip_when_the_client_accepts_it(accept: str) -> None:
    async with open_metrics_server() as server:
        plain = await request(server.port, "GET", "/metrics", (("Accept", accept),))
        headers = (("Accept", accept), ("Accept-Encoding", "gzip, deflate, br"))
        zipped = await request(server.port, "GET", "/metrics", headers)
        assert zipped.status == 200
        assert zipped.headers["content-encoding"] == "gzip"
        assert zipped.headers["content-type"] == plain.headers["content-type"]
        assert zipped.headers["content-length"] == str(len(zipped.body))
        assert zipped.body != plain.body
        assert gzip.decompress(zipped.body) == plain.body
        head = await request(server.port, "HEAD", "/metrics", headers)
        assert head.headers["content-encoding"] == "gzip"
        assert head.headers["content-length"] == str(len(zipped.body))
        assert head.body == b""
        await assert_still_serving(server.port)


async def test_no_gzip_for_a_client_that_refuses_it() -> None:
    async with open_metrics_server() as server:
        headers = (("Accept-Encoding", "gzip;q=0, identity"),)
        response = await request(server.port, "GET", "/metrics", headers)
        assert "content-encoding" not in response.headers
        assert response.body == METRICS_TEXT.encode()


async def test_gzip_is_only_for_metrics() -> None:
    async with open_metrics_server() as server:
        for path in ("/healthz", "/livez", "/readyz", "/nothing"):
            response = await request(server.port, "GET", path, (("Accept-Encoding", "gzip"),))
            assert "content-encoding" not in response.headers, path


@pytest.mark.parametrize(
    ("accept_encoding", "accepted"),
    [
        ("", False),
        ("gzip", True),
        ("GZIP", True),
        ("deflate, gzip;q=0.5", True),
        ("x-gzip", True),
        ("gzip;q=0", False),
        ("gzip; q=0.0", False),
        ("gzip;q=nonsense", False),
        ("deflate, br", False),
        ("gzipped", False),
    ],
)
def test_gzip_accepted(accept_encoding: str, accepted: bool) -> None:
    assert gzip_accepted(accept_encoding) is accepted


async def test_the_whole_server_survives_and_counts_http_faults(tmp_path: Path) -> None:
    async with open_emulator(token=TOKEN) as emulator:
        config = load_config(
            {
                "listen": "127.0.0.1:0",
                "metrics_listen": "127.0.0.1:0",
                "kubeconfig": str(write_kubeconfig(tmp_path / "config", emulator.url)),
                "source": "kubernetes",
            },
            {},
        )
        async with trio.open_nursery() as nursery:
            server: RunningJobsignal = await nursery.start(run_jobsignal, config)
            assert server.metrics_port is not None
            await server.ready.wait()
            head = await request(server.metrics_port, "HEAD", "/metrics")
            assert (head.status, head.body) == (200, b"")
            assert int(head.headers["content-length"]) > 0
            assert parse(await exchange(server.metrics_port, b"\x00garbage\r\n\r\n")).status == 400
            metrics = await scrape(server.metrics_port)
            assert metrics.value("jobsignal_http_errors_total", reason="bad_request") == 1
            assert metrics.value("jobsignal_jobs") == 0
            openmetrics = await request(
                server.metrics_port,
                "GET",
                "/metrics",
                (("Accept", PROMETHEUS_3_ACCEPT), ("Accept-Encoding", "gzip")),
            )
            families = {
                family.name: family
                for family in openmetrics_families(gzip.decompress(openmetrics.body).decode())
            }
            assert families["jobsignal_build"].type == "info"
            assert families["jobsignal_http_errors"].type == "counter"
            assert families["process_cpu_seconds"].type == "counter"
            plain = Scrape.parse(await scrape_text(server.metrics_port))
            names = {s.name for s in plain.samples}
            assert {s.name for f in families.values() for s in f.samples} == names
            server.request_shutdown()
            await server.stopped.wait()
            nursery.cancel_scope.cancel()
