"""An HTTP proxy of the tests' own on 127.0.0.1 that records what it carries.

CONNECT opens a tunnel (https servers); any other method must use an absolute
URI and is forwarded with ``Connection: close``, so each request crosses on a
connection of its own and is recorded. Targets are 127.0.0.1, or a name in
`names` (which the proxy alone resolves, to 127.0.0.1: a name the client
must not resolve itself); anything else is refused with 502, so nothing
leaves the machine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from urllib.parse import urlsplit

import trio

LOOPBACK = "127.0.0.1"


@dataclass
class HttpProxy:
    port: int = 0
    #: Host names the proxy takes for 127.0.0.1.
    names: frozenset[str] = frozenset()
    #: "host:port" of every CONNECT tunnel, in order.
    tunnels: list[str] = field(default_factory=list)
    #: (method, absolute target, headers) of every forwarded request, in order.
    forwarded: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def _address(self, host: str) -> str | None:
        return LOOPBACK if host == LOOPBACK or host in self.names else None

    async def handle(self, client: trio.SocketStream) -> None:
        async with client:
            head, rest = await _read_head(client)
            if head is None:
                return
            request_line, *lines = head.decode("latin-1").split("\r\n")
            method, target, version = request_line.split(" ")
            headers = {
                name.strip().lower(): value.strip()
                for name, value in (line.split(":", 1) for line in lines if line)
            }
            if method == "CONNECT":
                host, port = target.rsplit(":", 1)
                address = self._address(host)
                if address is None:
                    await client.send_all(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
                    return
                self.tunnels.append(target)
                upstream = await trio.open_tcp_stream(address, int(port))
                await client.send_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                first = rest
            else:
                url = urlsplit(target)
                address = self._address(url.hostname or "")
                if url.scheme != "http" or url.port is None or address is None:
                    await client.send_all(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
                    return
                self.forwarded.append((method, target, headers))
                upstream = await trio.open_tcp_stream(address, url.port)
                path = url.path + (f"?{url.query}" if url.query else "")
                kept = [
                    f"{name}: {value}"
                    for name, value in headers.items()
                    if name not in ("connection", "proxy-connection", "proxy-authorization")
                ]
                first = (
                    "\r\n".join([f"{method} {path} {version}", *kept, "Connection: close"])
                    + "\r\n\r\n"
                ).encode("latin-1") + rest
            async with upstream:
                if first:
                    await upstream.send_all(first)
                await _splice(client, upstream)


async def _read_head(stream: trio.SocketStream) -> tuple[bytes | None, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = await stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return None, b""
        if not chunk or len(data) > 65536:
            return None, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


async def _splice(a: trio.SocketStream, b: trio.SocketStream) -> None:
    """Copy both ways until either side closes."""

    async def copy(source: trio.SocketStream, sink: trio.SocketStream) -> None:
        try:
            while chunk := await source.receive_some(65536):
                await sink.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(copy, a, b)
        nursery.start_soon(copy, b, a)


@asynccontextmanager
async def open_proxy(names: frozenset[str] = frozenset()) -> AsyncIterator[HttpProxy]:
    """A proxy listening on 127.0.0.1 (an ephemeral port) for the block."""
    proxy = HttpProxy(names=names)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, proxy.handle, 0, host=LOOPBACK))
        proxy.port = listeners[0].socket.getsockname()[1]
        yield proxy
        nursery.cancel_scope.cancel()
