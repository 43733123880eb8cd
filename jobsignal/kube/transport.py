"""httpx's transport to an API server reached directly: HTTP/1.1 on trio streams.

`DirectTransport` opens TCP connections with trio (TLS through `trio.SSLStream`
with the connection's SSLContext, built for https servers only), speaks
HTTP/1.1 through `http1`, keeps idle connections for the next request (a
LIST's pages, then its WATCH) and honours httpx's connect, read and write
timeouts. Every failure leaves as the httpx exception httpcore would have
raised (ConnectError, ReadTimeout, RemoteProtocolError, ...), so `kube.api`
translates httpx's errors alone. A cluster behind a proxy uses httpx's own
transport instead (`kube.api.open_kube_client`): CONNECT tunnels stay httpx's.

Why not httpcore: it imports anyio, h11 and its sync half, and httpx builds
an SSLContext for every client, TLS or not; together about 1.7 MB of an
idle server's 40 (docs/architecture.md section 10, "Memory at idle").
"""

from __future__ import annotations

import math
import ssl
from dataclasses import dataclass

import httpx
import trio

from jobsignal.kube import http1

# How long an idle connection is kept for the next request (httpx's default).
IDLE_EXPIRY = 5.0
# Idle connections kept per server (the watcher uses one or two at a time).
MAX_IDLE_PER_SERVER = 4
# The most bytes asked of the socket per read.
READ_SIZE = 64 * 1024

_DEFAULT_PORTS = {"http": 80, "https": 443}

_Server = tuple[str, str, int]  # scheme, host, port


@dataclass
class _Connection:
    stream: trio.abc.Stream
    socket: trio.socket.SocketType
    idle_since: float = 0.0

    def still_usable(self, now: float) -> bool:
        # Readable while idle: the server closed it (or sent what was not asked for).
        return now - self.idle_since < IDLE_EXPIRY and not self.socket.is_readable()


class DirectTransport(httpx.AsyncBaseTransport):
    """Requests straight to the server in their URL, over HTTP/1.1.

    `tls`: the SSLContext for https URLs (None: plain http only).
    `keep_alive=False` closes each connection after its response (exec
    plugins: a renewed client certificate must be presented by the very next
    request).
    """

    def __init__(self, tls: ssl.SSLContext | None, *, keep_alive: bool = True) -> None:
        self._tls = tls
        self._keep_alive = keep_alive
        self._idle: dict[_Server, list[_Connection]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        connect_within = timeouts.get("connect")
        url = request.url
        server = (url.scheme, url.host, url.port or _DEFAULT_PORTS.get(url.scheme, 0))
        if "transfer-encoding" in request.headers:
            raise httpx.LocalProtocolError("streamed request bodies are not sent", request=request)
        headers = request.headers.raw
        if not self._keep_alive:
            # Said, so that the server does not keep the connection for us either
            # (httpx's own default header says keep-alive).
            headers = [(n, v) for n, v in headers if n.lower() != b"connection"]
            headers.append((b"Connection", b"close"))
        try:
            data = http1.encode_request(
                request.method, url.raw_path, headers, await request.aread()
            )
        except ValueError as error:
            raise httpx.LocalProtocolError(str(error), request=request) from None
        # A kept connection the server has just closed fails before any byte of
        # a response: a GET goes again, once, on a new connection.
        reused = self._take_idle(server)
        may_resend = request.method in ("GET", "HEAD")
        while True:
            connection = reused or await _connect(request, server, self._tls, connect_within)
            reader = http1.ResponseReader(head_request=request.method == "HEAD")
            try:
                await _send(request, connection, data, timeouts.get("write"))
                head = await _read_head(request, connection, reader, timeouts.get("read"))
                break
            except httpx.TransportError as error:
                await trio.aclose_forcefully(connection.stream)
                resend = may_resend and reused is not None and not reader.received
                if not resend or isinstance(error, httpx.TimeoutException):
                    raise
                reused = None
            except BaseException:
                await trio.aclose_forcefully(connection.stream)
                raise
        body = _ResponseBody(self, request, server, connection, reader, timeouts.get("read"))
        return httpx.Response(
            head.status,
            headers=head.headers,
            stream=body,
            extensions={"http_version": head.http_version, "reason_phrase": head.reason},
        )

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                await trio.aclose_forcefully(connection.stream)

    def _take_idle(self, server: _Server) -> _Connection | None:
        connections = self._idle.get(server, [])
        now = trio.current_time()
        while connections:
            connection = connections.pop()
            if connection.still_usable(now):
                return connection
            connection.socket.close()  # (a plain close: nothing to say on a dead connection)
        return None

    def _release(self, server: _Server, connection: _Connection, reusable: bool) -> bool:
        """Keep a connection whose response has ended for the next request;
        False when it should be closed instead."""
        idle = self._idle.setdefault(server, [])
        if not (reusable and self._keep_alive) or len(idle) >= MAX_IDLE_PER_SERVER:
            return False
        connection.idle_since = trio.current_time()
        idle.append(connection)
        return True


class _ResponseBody(httpx.AsyncByteStream):
    """A response's body as httpx reads it; the connection goes back to the
    transport once the body has ended, and is closed if it is abandoned."""

    def __init__(
        self,
        transport: DirectTransport,
        request: httpx.Request,
        server: _Server,
        connection: _Connection,
        reader: http1.ResponseReader,
        read_within: float | None,
    ) -> None:
        self._transport = transport
        self._request = request
        self._server = server
        self._connection: _Connection | None = connection
        self._reader = reader
        self._read_within = read_within

    # An iterator, not an async generator: one abandoned mid-body would be left
    # to the garbage collector, which trio warns about; `aclose` closes the connection.
    def __aiter__(self) -> _ResponseBody:
        return self

    async def __anext__(self) -> bytes:
        while (connection := self._connection) is not None:
            try:
                piece = self._reader.read_body()
            except http1.ProtocolError as error:
                raise httpx.RemoteProtocolError(str(error), request=self._request) from None
            if piece is None:
                self._connection = None
                if not self._transport._release(self._server, connection, self._reader.reusable):
                    await trio.aclose_forcefully(connection.stream)
                break
            if piece:
                return piece
            await _receive(self._request, connection, self._reader, self._read_within)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:  # the body was not read to its end
            await trio.aclose_forcefully(connection.stream)


async def _connect(
    request: httpx.Request, server: _Server, tls: ssl.SSLContext | None, within: float | None
) -> _Connection:
    scheme, host, port = server
    if scheme not in _DEFAULT_PORTS:
        raise httpx.UnsupportedProtocol(f"{scheme!r} URLs are not supported", request=request)
    if scheme == "https" and tls is None:
        raise httpx.UnsupportedProtocol("https without TLS settings", request=request)
    stream: trio.SocketStream | None = None
    try:
        with trio.fail_after(_seconds(within)):
            stream = await trio.open_tcp_stream(host, port)
            if tls is None:
                return _Connection(stream, stream.socket)
            sni = request.extensions.get("sni_hostname") or host
            secure = trio.SSLStream(stream, tls, server_hostname=sni, https_compatible=True)
            await secure.do_handshake()
            return _Connection(secure, stream.socket)
    except trio.TooSlowError:
        error: Exception = httpx.ConnectTimeout(
            f"no connection to {host}:{port} within {within:g}s", request=request
        )
    except (OSError, trio.BrokenResourceError) as failure:
        error = httpx.ConnectError(_reason(failure), request=request)
    if stream is not None:
        await trio.aclose_forcefully(stream)
    raise error


async def _send(
    request: httpx.Request, connection: _Connection, data: bytes, within: float | None
) -> None:
    try:
        with trio.fail_after(_seconds(within)):
            await connection.stream.send_all(data)
    except trio.TooSlowError:
        raise httpx.WriteTimeout(f"request not sent within {within:g}s", request=request) from None
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as failure:
        raise httpx.WriteError(_reason(failure), request=request) from None


async def _read_head(
    request: httpx.Request,
    connection: _Connection,
    reader: http1.ResponseReader,
    within: float | None,
) -> http1.ResponseHead:
    while True:
        try:
            head = reader.read_head()
        except http1.ProtocolError as error:
            raise httpx.RemoteProtocolError(str(error), request=request) from None
        if head is not None:
            return head
        await _receive(request, connection, reader, within)


async def _receive(
    request: httpx.Request,
    connection: _Connection,
    reader: http1.ResponseReader,
    within: float | None,
) -> None:
    try:
        with trio.fail_after(_seconds(within)):
            data = await connection.stream.receive_some(READ_SIZE)
    except trio.TooSlowError:
        raise httpx.ReadTimeout(f"nothing received for {within:g}s", request=request) from None
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as failure:
        raise httpx.ReadError(_reason(failure), request=request) from None
    if data:
        reader.feed(data)
    else:
        reader.feed_eof()


def _seconds(within: float | None) -> float:
    """A limit of httpx's timeout extension in seconds (None: no limit)."""
    return math.inf if within is None else within


def _reason(failure: BaseException) -> str:
    """What went wrong: the OS or OpenSSL error under trio's wrapper, with the
    errors of every address tried when a connection could not be made."""
    cause = failure.__cause__
    if isinstance(failure, trio.BrokenResourceError) and cause is not None:
        failure = cause
    text = str(failure) or type(failure).__name__
    if isinstance(cause, BaseExceptionGroup):  # trio's open_tcp_stream: one per address
        text += f" ({'; '.join(sorted({str(error) for error in cause.exceptions}))})"
    return text
