"""The trio transport to an API server reached directly (kube/transport.py).

Raw HTTP/1.1 servers on 127.0.0.1 that answer as scripted: connections kept
and reused, a kept connection the server closed, timeouts (virtual time,
`io_clock`), a body abandoned halfway, TLS, and which transport
`open_kube_client` picks with and without a proxy.
"""

from __future__ import annotations

import gzip
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import httpx
import pytest
import trio
import trio.testing
import trustme

from jobsignal.kube.api import open_kube_client
from jobsignal.kube.credentials import KubeConnection
from jobsignal.kube.transport import IDLE_EXPIRY, DirectTransport
from tests.support.tls import server_context
from tests.support.waiting import wait_until

LOOPBACK = "127.0.0.1"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@dataclass
class Server:
    port: int = 0
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    # How each connection ended, seen from the server: "eof" once the client closed it.
    endings: list[str] = field(default_factory=list)

    async def read_request(self, stream: trio.abc.Stream) -> bool:
        """One request's head (False at end of stream)."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return False
            data += chunk
        self.requests.append(data)
        return True


# What a server does with one connection: the server, the stream, which connection (from 1).
Handler = Callable[[Server, trio.abc.Stream, int], Awaitable[None]]


@asynccontextmanager
async def raw_server(
    handler: Handler,
    context: ssl.SSLContext | None = None,
) -> AsyncIterator[Server]:
    server = Server()

    async def serve(stream: trio.abc.Stream) -> None:
        server.connections += 1
        try:
            await handler(server, stream, server.connections)
            while await stream.receive_some(65536):
                pass
            server.endings.append("eof")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            server.endings.append("broken")

    async with trio.open_nursery() as nursery:
        if context is None:
            listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host=LOOPBACK))
        else:
            serving = partial(trio.serve_ssl_over_tcp, serve, 0, context, host=LOOPBACK)
            listeners = await nursery.start(serving)
        socket = getattr(listeners[0], "transport_listener", listeners[0]).socket
        server.port = socket.getsockname()[1]
        yield server
        nursery.cancel_scope.cancel()


async def answer_each(server: Server, stream: trio.abc.Stream, number: int) -> None:
    while await server.read_request(stream):
        await stream.send_all(OK)


def client(server: Server, transport: DirectTransport, **timeouts: Any) -> httpx.AsyncClient:
    timeout = httpx.Timeout(10.0, **timeouts)
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{server.port}", transport=transport, timeout=timeout
    )


async def test_a_kept_connection_carries_the_next_request_until_the_client_closes() -> None:
    async with raw_server(answer_each) as server:
        async with client(server, DirectTransport(None)) as api:
            for _ in range(3):
                assert (await api.get("/api/v1/configmaps")).text == "ok"
            assert server.connections == 1
            assert server.endings == []
        await wait_until(lambda: bool(server.endings), within=5, what="the connection closed")
        assert server.endings == ["eof"]
        assert server.requests[0].startswith(b"GET /api/v1/configmaps HTTP/1.1\r\n")
        assert b"\r\nHost: 127.0.0.1:" in server.requests[0]


async def test_without_keep_alive_every_request_has_its_own_connection() -> None:
    transport = DirectTransport(None, keep_alive=False)
    async with raw_server(answer_each) as server, client(server, transport) as api:
        for _ in range(3):
            assert (await api.get("/")).text == "ok"
        await wait_until(lambda: len(server.endings) == 3, within=5, what="3 connections closed")
        assert server.connections == 3
        assert server.endings == ["eof"] * 3  # each closed by the client once read
        assert len(server.requests) == 3
        assert all(b"\r\nConnection: close\r\n" in request for request in server.requests)
        assert not any(b"keep-alive" in request for request in server.requests)


async def test_a_kept_connection_the_server_closed_is_not_used() -> None:
    async def answer_once(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await server.read_request(stream)
        await stream.send_all(OK)
        await stream.aclose()

    async with raw_server(answer_once) as server, client(server, DirectTransport(None)) as api:
        assert (await api.get("/")).text == "ok"
        await wait_until(lambda: bool(server.endings), within=5, what="the server's close")
        assert (await api.get("/")).text == "ok"
        assert server.connections == 2


async def test_a_request_on_a_kept_connection_closed_in_the_meantime_goes_again() -> None:
    # The server reads the second request and closes without answering: the
    # race between a server's idle timeout and a request, made certain.
    async def drop_second(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await server.read_request(stream)
        await stream.send_all(OK)
        if number == 1:
            await server.read_request(stream)
            await stream.aclose()
        else:
            await answer_each(server, stream, number)

    async with raw_server(drop_second) as server, client(server, DirectTransport(None)) as api:
        assert (await api.get("/first")).text == "ok"
        assert (await api.get("/second")).text == "ok"
        assert server.connections == 2
        assert [request.split(b" ")[1] for request in server.requests] == [
            b"/first",
            b"/second",
            b"/second",
        ]


async def test_a_new_connection_closed_without_an_answer_is_not_retried() -> None:
    async def hang_up(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await server.read_request(stream)
        await stream.aclose()

    async with raw_server(hang_up) as server, client(server, DirectTransport(None)) as api:
        with pytest.raises(httpx.RemoteProtocolError, match="without a response"):
            await api.get("/")
        assert server.connections == 1


async def test_an_idle_connection_expires(io_clock: trio.testing.MockClock) -> None:
    async with raw_server(answer_each) as server, client(server, DirectTransport(None)) as api:
        await api.get("/")
        await trio.sleep(IDLE_EXPIRY - 1)
        await api.get("/")
        assert server.connections == 1
        await trio.sleep(IDLE_EXPIRY + 1)
        await api.get("/")
        assert server.connections == 2


async def test_a_silent_server_times_out_as_httpx_says(io_clock: trio.testing.MockClock) -> None:
    async def never_answer(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await trio.sleep_forever()

    async with (
        raw_server(never_answer) as server,
        client(server, DirectTransport(None), read=30.0) as api,
    ):
        started = trio.current_time()
        with pytest.raises(httpx.ReadTimeout, match="nothing received for 30s"):
            await api.get("/")
        assert trio.current_time() - started == pytest.approx(30.0, abs=0.5)


async def test_a_handshake_that_never_ends_is_a_connect_timeout(
    io_clock: trio.testing.MockClock,
) -> None:
    async def plain_tcp(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await trio.sleep_forever()  # no TLS: the client's hello goes unanswered

    async with raw_server(plain_tcp) as server:
        transport = DirectTransport(ssl.create_default_context())
        async with httpx.AsyncClient(
            base_url=f"https://127.0.0.1:{server.port}",
            transport=transport,
            timeout=httpx.Timeout(60.0, connect=7.0),
        ) as api:
            started = trio.current_time()
            with pytest.raises(httpx.ConnectTimeout, match="within 7s"):
                await api.get("/")
            assert trio.current_time() - started == pytest.approx(7.0, abs=0.5)


async def test_a_body_is_streamed_as_it_arrives_and_abandoning_it_closes_the_connection() -> None:
    release = trio.Event()

    async def watch(server: Server, stream: trio.abc.Stream, number: int) -> None:
        if number > 1:
            return await answer_each(server, stream, number)
        await server.read_request(stream)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await stream.send_all(b"6\r\nevent1\r\n")
        await release.wait()
        await stream.send_all(b"6\r\nevent2\r\n")

    async with raw_server(watch) as server, client(server, DirectTransport(None)) as api:
        with trio.fail_after(5):
            async with api.stream("GET", "/watch") as response:
                # (httpx's aiter_raw is an async generator: closed here, not by the GC.)
                pieces = cast(AsyncGenerator[bytes, None], response.aiter_raw())
                assert await pieces.__anext__() == b"event1"  # before the second is sent
                release.set()
                assert await pieces.__anext__() == b"event2"
                await pieces.aclose()
        await wait_until(lambda: bool(server.endings), within=5, what="the connection closed")
        assert server.endings == ["eof"]
        assert (await api.get("/")).text == "ok"  # on a new connection
        assert server.connections == 2


async def test_a_gzipped_body_is_decoded_by_httpx_above_the_transport() -> None:
    # The API server compresses large responses when asked (httpx asks).
    document = b'{"kind": "ConfigMapList", "items": []}' * 100
    packed = gzip.compress(document)

    async def gzipped(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await server.read_request(stream)
        head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
        await stream.send_all(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed))

    async with raw_server(gzipped) as server, client(server, DirectTransport(None)) as api:
        response = await api.get("/api/v1/configmaps")
        assert response.content == document
        assert b"gzip" in server.requests[0].lower().split(b"accept-encoding:")[1].split(b"\r\n")[0]


async def test_hostile_bytes_are_a_remote_protocol_error() -> None:
    async def flood(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await server.read_request(stream)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 100_000)

    async with raw_server(flood) as server, client(server, DirectTransport(None)) as api:
        with trio.fail_after(5), pytest.raises(httpx.RemoteProtocolError, match="65536"):
            await api.get("/")


async def test_a_refused_connection_is_a_connect_error() -> None:
    with trio.socket.socket() as probe:  # a port nobody listens on
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", transport=DirectTransport(None)
    ) as api:
        with pytest.raises(httpx.ConnectError, match=r"127\.0\.0\.1:\d+ failed \(.*refused\)"):
            await api.get("/")


async def test_https_checks_the_certificate(ca: trustme.CA) -> None:
    context = server_context(ca, client_certs=False)
    async with raw_server(answer_each, context) as server:
        trusted = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ca.configure_trust(trusted)
        url = f"https://127.0.0.1:{server.port}"
        async with httpx.AsyncClient(base_url=url, transport=DirectTransport(trusted)) as api:
            assert (await api.get("/")).text == "ok"
            assert (await api.get("/")).text == "ok"
        assert server.connections == 1
        stranger = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        trustme.CA().configure_trust(stranger)
        async with httpx.AsyncClient(base_url=url, transport=DirectTransport(stranger)) as api:
            with pytest.raises(httpx.ConnectError, match="certificate verify failed"):
                await api.get("/")


async def test_a_plain_http_transport_refuses_https() -> None:
    async with httpx.AsyncClient(transport=DirectTransport(None)) as api:
        with pytest.raises(httpx.UnsupportedProtocol, match="https without TLS settings"):
            await api.get("https://127.0.0.1:1/")


def without_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


def plain_http_connection(base_url: str, proxy: str | None = None) -> KubeConnection:
    return KubeConnection(
        base_url=base_url,
        verify=None,
        token_source=None,
        description="test",
        default_namespace=None,
        proxy=proxy,
    )


@pytest.mark.parametrize("via", ["proxy-url", "HTTP_PROXY"])
async def test_a_proxy_carries_the_requests_when_one_is_configured(
    via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with raw_server(answer_each) as proxy:
        proxy_url = f"http://127.0.0.1:{proxy.port}"
        without_proxy_environment(monkeypatch)
        if via == "HTTP_PROXY":
            monkeypatch.setenv("HTTP_PROXY", proxy_url)
        connection = plain_http_connection(
            "http://api.cluster.example:8080", proxy=proxy_url if via == "proxy-url" else None
        )
        async with open_kube_client(connection, timeout=httpx.Timeout(5.0)) as api:
            assert (await api.get("/version")).text == "ok"
        # The absolute form a proxy is sent: the API server was never resolved.
        assert proxy.requests[0].startswith(b"GET http://api.cluster.example:8080/version ")


async def test_without_a_proxy_the_client_goes_straight_to_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without_proxy_environment(monkeypatch)
    async with raw_server(answer_each) as server:
        connection = plain_http_connection(f"http://127.0.0.1:{server.port}")
        async with open_kube_client(connection, timeout=httpx.Timeout(5.0)) as api:
            assert (await api.get("/version")).text == "ok"
        assert server.requests[0].startswith(b"GET /version HTTP/1.1\r\n")
        assert b"\r\nUser-Agent: jobsignal/" in server.requests[0]
