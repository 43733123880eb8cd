"""TLS connections' cost and the bound on handshakes in progress (rpc/tls_connections.py).

asyncio's own TLS protocol held a 256 KiB buffer per connection, and nothing
bounded the connections still in their handshake: 12,486 silent peers took a
server to 2.9 GB. Real sockets on 127.0.0.1 (and 127.0.0.2, another client
address), virtual time; the client side is trio's TLS.
"""

from __future__ import annotations

import contextlib
import ssl
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
import trio.testing

from jobsignal.rpc.limits import MAX_TLS_HANDSHAKES_PER_IP
from jobsignal.rpc.tls_connections import TLS_READ_BUFFER
from tests.support.grpc_server import ServerHarness, local_settings, open_jobsignal_server
from tests.support.tls import Pki
from tests.support.waiting import wait_until

from .test_file_limits import read_to_end
from .test_hostile_h2 import PREFACE

HANDSHAKE_TIMEOUT = 5.0  # ProtocolLimits' default


def client_context(pki: Pki) -> ssl.SSLContext:
    context = ssl.create_default_context()
    pki.server_ca.configure_trust(context)
    context.set_alpn_protocols(["h2"])
    return context


@asynccontextmanager
async def tls_client(
    server: ServerHarness, pki: Pki, source: str = "127.0.0.1"
) -> AsyncIterator[trio.SSLStream[trio.SocketStream]]:
    """A connection from `source` whose TLS handshake is done, HTTP/2 preface sent."""
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", server.port))
    stream = trio.SSLStream(
        trio.SocketStream(sock), client_context(pki), server_hostname="localhost"
    )
    async with stream:
        await stream.do_handshake()
        await stream.send_all(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # SETTINGS
        yield stream


async def test_silent_peers_past_the_handshake_bound_are_closed_as_they_come(
    io_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    pki = Pki(tmp_path)
    bound = MAX_TLS_HANDSHAKES_PER_IP
    closed: list[int] = []
    settings = local_settings(tls=pki.files(mutual=False))
    async with open_jobsignal_server(settings) as server, trio.open_nursery() as nursery:
        handshakes = server.connections.tls_handshakes
        for index in range(bound + 10):  # connect, then say nothing
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            nursery.start_soon(read_to_end, stream, closed, index)
        await wait_until(lambda: handshakes.refused == 10)
        assert handshakes.total == bound
        await wait_until(lambda: len(closed) == 10)
        assert sorted(closed) == list(range(bound, bound + 10))
        # Another address still gets its handshake, and its connection is served.
        async with tls_client(server, pki, source="127.0.0.2"):
            await wait_until(lambda: len(server.connections) == 1)
        # The silent ones are let go at the handshake timeout, and the count with them.
        await trio.sleep(HANDSHAKE_TIMEOUT + 1)
        await wait_until(lambda: len(closed) == bound + 10)
        assert handshakes.total == 0
        async with tls_client(server, pki):
            await wait_until(lambda: len(server.connections) == 1)
        assert handshakes.total == 0
        assert handshakes.refused == 10


async def test_a_tls_connection_costs_a_small_read_buffer_not_256_kib(
    io_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    pki = Pki(tmp_path)
    count = 20
    settings = local_settings(tls=pki.files(mutual=False))
    async with open_jobsignal_server(settings) as server, contextlib.AsyncExitStack() as stack:
        async with tls_client(server, pki):  # one-time costs (caches, first handshake)
            await wait_until(lambda: len(server.connections) == 1)
        await wait_until(lambda: len(server.connections) == 0)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(count):
                await stack.enter_async_context(tls_client(server, pki))
            await wait_until(lambda: len(server.connections) == count)
            per_connection = (tracemalloc.get_traced_memory()[0] - before) / count
        finally:
            tracemalloc.stop()
    # Both ends of each connection are in this process: the server's share, its
    # read buffer included, and the client's; asyncio's own buffer alone was 256 KiB.
    assert per_connection < 4 * TLS_READ_BUFFER, per_connection
