"""The API server's httpx client as `open_kube_client` builds it from a `KubeConnection`.

Raw HTTP/1.1 servers on 127.0.0.1 that answer as scripted, and what jobsignal
asks of the client: connections kept for the next request (a LIST's pages,
then its WATCH), none kept with an exec plugin (its renewed certificate must
be presented by the very next request), httpx's timeouts as the watcher sets
them (virtual time, `io_clock`), gzip decoded, a bound on a hostile response
head, TLS checked, and the proxy the connection names, or none.
"""

from __future__ import annotations

import gzip
import json
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import httpx
import pytest
import trio
import trio.testing
import trustme

from jobsignal.kube.api import ApiUnavailable, KubeApi, open_kube_client
from jobsignal.kube.credentials import KubeConnection
from jobsignal.kube.exec_credentials import ExecCredentials
from jobsignal.kube.exec_plugin import ExecPlugin, exec_info
from tests.support.proxy import open_proxy
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


def connection(
    url: str,
    *,
    verify: ssl.SSLContext | None = None,
    proxy: str | None = None,
    exec_plugin: bool = False,
) -> KubeConnection:
    credentials = None
    if exec_plugin:
        # A real plugin run: this interpreter printing a token's ExecCredential.
        credential = {
            "apiVersion": "client.authentication.k8s.io/v1",
            "kind": "ExecCredential",
            "status": {"token": "plugin-token"},
        }
        plugin = ExecPlugin(
            command=sys.executable,
            args=("-c", f"print({json.dumps(json.dumps(credential))})"),
            env=(),
            api_version="client.authentication.k8s.io/v1",
            exec_info=exec_info("client.authentication.k8s.io/v1", None),
            label="the test's exec plugin",
        )
        credentials = ExecCredentials(plugin)
    return KubeConnection(
        base_url=url,
        verify=verify,
        token_source=None,
        description="test",
        default_namespace=None,
        proxy=proxy,
        exec_credentials=credentials,
    )


def client(server: Server, *, exec_plugin: bool = False, **timeouts: float) -> httpx.AsyncClient:
    plain = connection(f"http://{LOOPBACK}:{server.port}", exec_plugin=exec_plugin)
    return open_kube_client(plain, timeout=httpx.Timeout(10.0, **timeouts))


async def test_a_kept_connection_carries_the_next_request_until_the_client_closes() -> None:
    async with raw_server(answer_each) as server:
        async with client(server) as api:
            for _ in range(3):
                assert (await api.get("/api/v1/configmaps")).text == "ok"
            assert server.connections == 1
            assert server.endings == []
        await wait_until(lambda: bool(server.endings), within=5, what="the connection closed")
        assert server.endings == ["eof"]
        assert server.requests[0].startswith(b"GET /api/v1/configmaps HTTP/1.1\r\n")
        assert b"\r\nHost: 127.0.0.1:" in server.requests[0]
        assert b"\r\nUser-Agent: jobsignal/" in server.requests[0]


async def test_with_an_exec_plugin_every_request_has_its_own_connection() -> None:
    async with raw_server(answer_each) as server, client(server, exec_plugin=True) as api:
        for _ in range(3):
            assert (await api.get("/")).text == "ok"
        await wait_until(lambda: len(server.endings) == 3, within=5, what="3 connections closed")
        assert server.connections == 3
        assert len(server.requests) == 3
        # Said, so that the server does not keep the connection either.
        assert all(b"\r\nConnection: close\r\n" in request for request in server.requests)
        assert not any(b"keep-alive" in request for request in server.requests)
        assert all(b"Bearer plugin-token" in request for request in server.requests)


async def test_a_kept_connection_the_server_closed_is_not_used() -> None:
    async def answer_once(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await server.read_request(stream)
        await stream.send_all(OK)
        await stream.aclose()

    async with raw_server(answer_once) as server, client(server) as api:
        assert (await api.get("/")).text == "ok"
        await wait_until(lambda: bool(server.endings), within=5, what="the server's close")
        assert (await api.get("/")).text == "ok"
        assert server.connections == 2


async def test_a_silent_server_times_out_as_the_watcher_asks(
    io_clock: trio.testing.MockClock,
) -> None:
    async def never_answer(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await trio.sleep_forever()

    async with raw_server(never_answer) as server, client(server, read=30.0) as api:
        started = trio.current_time()
        with pytest.raises(httpx.ReadTimeout):
            await api.get("/")
        assert trio.current_time() - started == pytest.approx(30.0, abs=0.5)


async def test_a_handshake_that_never_ends_is_a_connect_timeout(
    io_clock: trio.testing.MockClock,
) -> None:
    async def plain_tcp(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await trio.sleep_forever()  # no TLS: the client's hello goes unanswered

    async with raw_server(plain_tcp) as server:
        secure = connection(
            f"https://{LOOPBACK}:{server.port}", verify=ssl.create_default_context()
        )
        async with open_kube_client(secure, timeout=httpx.Timeout(60.0, connect=7.0)) as api:
            started = trio.current_time()
            with pytest.raises(httpx.ConnectTimeout):
                await api.get("/")
            assert trio.current_time() - started == pytest.approx(7.0, abs=0.5)


async def test_a_body_is_streamed_as_it_arrives() -> None:
    release = trio.Event()

    async def watch(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await server.read_request(stream)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await stream.send_all(b"6\r\nevent1\r\n")
        await release.wait()
        await stream.send_all(b"6\r\nevent2\r\n0\r\n\r\n")

    async with raw_server(watch) as server, client(server) as api:
        with trio.fail_after(5):
            async with api.stream("GET", "/watch") as response:
                pieces = response.aiter_raw()
                assert await pieces.__anext__() == b"event1"  # before the second is sent
                release.set()
                assert await pieces.__anext__() == b"event2"
                with pytest.raises(StopAsyncIteration):
                    await pieces.__anext__()


async def test_a_gzipped_body_is_decoded() -> None:
    # The API server compresses large responses when asked (httpx asks).
    document = b'{"kind": "ConfigMapList", "items": []}' * 100
    packed = gzip.compress(document)

    async def gzipped(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await server.read_request(stream)
        head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
        await stream.send_all(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed))

    async with raw_server(gzipped) as server, client(server) as api:
        response = await api.get("/api/v1/configmaps")
        assert response.content == document
        assert b"gzip" in server.requests[0].lower().split(b"accept-encoding:")[1].split(b"\r\n")[0]


async def test_a_response_head_without_end_is_a_remote_protocol_error() -> None:
    async def flood(server: Server, stream: trio.abc.Stream, number: int) -> None:
        await server.read_request(stream)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 1_000_000)

    async with raw_server(flood) as server, client(server) as api:
        with trio.fail_after(5), pytest.raises(httpx.RemoteProtocolError):
            await api.get("/")


async def test_a_refused_connection_is_a_connect_error() -> None:
    with trio.socket.socket() as probe:  # a port nobody listens on
        await probe.bind((LOOPBACK, 0))
        port = probe.getsockname()[1]
    refused = connection(f"http://{LOOPBACK}:{port}")
    async with open_kube_client(refused, timeout=httpx.Timeout(5.0)) as client:
        with pytest.raises(ApiUnavailable, match=r"LIST failed: ConnectError: .*refused"):
            await KubeApi(client, None, read_timeout=5.0).list_page(None, {})


async def test_https_checks_the_certificate(ca: trustme.CA) -> None:
    context = server_context(ca, client_certs=False)
    async with raw_server(answer_each, context) as server:
        trusted = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ca.configure_trust(trusted)
        url = f"https://{LOOPBACK}:{server.port}"
        async with open_kube_client(connection(url, verify=trusted), timeout=TIMEOUT) as api:
            assert (await api.get("/")).text == "ok"
            assert (await api.get("/")).text == "ok"
        assert server.connections == 1
        stranger = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        trustme.CA().configure_trust(stranger)
        async with open_kube_client(connection(url, verify=stranger), timeout=TIMEOUT) as client:
            # What the watcher logs names the reason (httpx's own message may be empty).
            with pytest.raises(ApiUnavailable, match=r"ConnectError: .*certificate verify failed"):
                await KubeApi(client, None, read_timeout=5.0).list_page(None, {})


async def test_a_plain_http_connection_refuses_https() -> None:
    # No TLS settings: an https URL finds no CA to trust, whatever the system has.
    async with open_kube_client(connection("http://127.0.0.1:1"), timeout=TIMEOUT) as api:
        with pytest.raises(httpx.ConnectError):
            await api.get(f"https://{LOOPBACK}:1/")


TIMEOUT = httpx.Timeout(5.0)
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


async def test_the_proxy_the_connection_names_carries_the_requests() -> None:
    async with raw_server(answer_each) as proxy:
        proxied = connection(
            "http://api.cluster.example:8080", proxy=f"http://{LOOPBACK}:{proxy.port}"
        )
        async with open_kube_client(proxied, timeout=TIMEOUT) as api:
            assert (await api.get("/version")).text == "ok"
        # The absolute form a proxy is sent: the API server was never resolved.
        assert proxy.requests[0].startswith(b"GET http://api.cluster.example:8080/version ")


@pytest.mark.parametrize("variable", PROXY_VARIABLES)
async def test_the_client_itself_reads_no_proxy_variable(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Which proxy applies is kube.credentials' decision (kube/proxies.py); httpx's
    # own reading of the environment would send this request to the proxy.
    async with raw_server(answer_each) as proxy, raw_server(answer_each) as server:
        for name in PROXY_VARIABLES:
            monkeypatch.delenv(name, raising=False)
            monkeypatch.delenv(name.lower(), raising=False)
        monkeypatch.setenv(variable, f"http://{LOOPBACK}:{proxy.port}")
        monkeypatch.setenv("NO_PROXY" if variable != "NO_PROXY" else "HTTP_PROXY", "")
        url = f"http://{LOOPBACK}:{server.port}"
        async with open_kube_client(connection(url), timeout=TIMEOUT) as api:
            assert (await api.get("/version")).text == "ok"
        assert proxy.requests == []
        assert server.requests[0].startswith(b"GET /version HTTP/1.1\r\n")


async def test_a_connect_proxy_tunnels_https(ca: trustme.CA) -> None:
    context = server_context(ca, client_certs=False)
    trusted = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca.configure_trust(trusted)
    async with raw_server(answer_each, context) as server, open_proxy() as proxy:
        url = f"https://{LOOPBACK}:{server.port}"
        tunnelled = connection(url, verify=trusted, proxy=proxy.url)
        async with open_kube_client(tunnelled, timeout=TIMEOUT) as api:
            assert (await api.get("/version")).text == "ok"
            assert (await api.get("/version")).text == "ok"
        assert proxy.tunnels == [f"{LOOPBACK}:{server.port}"]  # one tunnel, kept
        assert server.connections == 1
