"""The metrics HTTP endpoint: GET or HEAD /metrics, /healthz, /livez and /readyz,
and who is subscribed: /debug/subscriptions (JSON) and / (its HTML page).

HTTP/1.1 over trio with h11; one short request per connection is all a
scraper needs, so connections are closed after each response and each one is
bounded in time (`CONNECTION_TIMEOUT`) and request size (`MAX_REQUEST_BYTES`).
At most `MAX_CONNECTIONS` are served at once, `MAX_CONNECTIONS_PER_ADDRESS`
from one address: a connection past either is closed at once, unanswered,
so a peer opening many cannot take the file descriptors the gRPC port and
the Kubernetes watch need, and one address cannot take every slot from the
kubelet's probes and the scraper.

Each connection is a fault boundary: a request h11 cannot parse gets 400 (or
431 for oversized headers), a client too slow to finish gets 408, and any
unexpected exception while handling one connection ends that connection only
(with 500 when a response can still be sent). Each such ending is counted in
`HttpStats.errors` (the `jobsignal_http_errors_total` metric) and logged at
a bounded rate, and the server goes on accepting. An `accept()` that fails
for want of descriptors or memory pauses accepting for a second, counted
(`HttpStats.accept_pauses`) and logged at WARNING at a bounded rate, as the
gRPC port does (trio's own accept loop logged a traceback at ERROR every
0.1 s).

`/metrics` is rendered by prometheus_client from the server's own registry,
in the format the scraper's `Accept` header asks for (OpenMetrics or the
Prometheus text format) and gzip-compressed when its `Accept-Encoding`
allows, as prometheus_client's own handlers do.

`/debug/subscriptions` and `/` list the live subscription streams a page at
a time (`?limit=N&continue=TOKEN`, at most `rpc.subscriptions.MAX_LIMIT`
rows), read when asked from the server's sessions (`rpc.subscriptions`) and
rendered by `subscriptions_page`; gzip-compressed when allowed. An operator's
view, on the operator's port: never on the gRPC port.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

import h11
import trio
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from jobsignal.config import cannot_listen
from jobsignal.logs import RateLimitedLog
from jobsignal.process.file_limit import ACCEPT_CAPACITY_ERRNOS, WHY_ACCEPT_FAILED
from jobsignal.rpc.limits import ConnectionCounter
from jobsignal.rpc.subscriptions import BadPageRequest, PageRequest, SubscriptionPage
from jobsignal.subscriptions_page import HTML_HEADERS, render_html
from jobsignal.util.text import quote
from jobsignal.version import __version__

log = logging.getLogger(__name__)
fault_log = RateLimitedLog(log)

# The whole exchange, from accepting to the last byte of the response: a client
# that never finishes its request (or never reads the answer) is let go then.
CONNECTION_TIMEOUT = 10.0
MAX_REQUEST_BYTES = 16 * 1024
# After the response: how long, and how much, to read the client's leftovers
# before closing, so that unread bytes do not make the kernel send a reset
# that destroys the response before the client has read it.
LINGER_TIME = 1.0
LINGER_BYTES = 64 * 1024
# Connections served at once: a scraper and the kubelet's probes need one each,
# for milliseconds.
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_ADDRESS = 8
# Sending a short error response to a client that may not be reading.
ERROR_SEND_TIMEOUT = 1.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ALLOWED_METHODS = "GET, HEAD"
# /metrics depends on these request headers (for caches between us and the scraper).
METRICS_VARY = "Accept, Accept-Encoding"
JSON_CONTENT_TYPE = "application/json"
HTML_CONTENT_TYPE = "text/html; charset=utf-8"
# After a failed accept(), as the gRPC port (asyncio's ACCEPT_RETRY_DELAY).
ACCEPT_PAUSE = 1.0


# Why a connection ended in a fault: the keys of HttpStats.errors.
HTTP_ERROR_REASONS = (
    "bad_request",
    "headers_too_large",
    "timeout",
    "internal",
    "too_many_connections",
)


@dataclass
class HttpStats:
    """Connections ended by a fault, by reason.

    Reasons: bad_request (400), headers_too_large (431), timeout (408 if it
    could still be sent), internal (an unexpected exception: 500),
    too_many_connections (closed unanswered: over the limit in all or from
    its address).
    """

    errors: Counter[str] = field(default_factory=Counter)
    # Times accepting paused, by the errno of the accept() that failed.
    accept_pauses: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    content_type: str = CONTENT_TYPE


Readiness = Callable[[], str | None]
# One page of the live subscriptions (`rpc.subscriptions.subscriptions_page`).
Subscriptions = Callable[[PageRequest], SubscriptionPage]


def _always_ready() -> str | None:
    return None


def gzip_accepted(accept_encoding: str) -> bool:
    """Whether `Accept-Encoding` allows gzip (a quality of 0 refuses it)."""
    for coding in accept_encoding.split(","):
        name, *parameters = (part.strip().lower() for part in coding.split(";"))
        if name not in ("gzip", "x-gzip"):
            continue
        for parameter in parameters:
            key, _, value = parameter.partition("=")
            if key.strip() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False


def _gzipped_if_accepted(reply: Reply, accept_encoding: str) -> Reply:
    if not gzip_accepted(accept_encoding):
        return reply
    headers = (*reply.headers, ("content-encoding", "gzip"))
    return Reply(reply.status, gzip.compress(reply.body), headers, reply.content_type)


def exposition(metrics: Collector, accept: str = "", accept_encoding: str = "") -> Reply:
    """`metrics` rendered in the format `accept` asks for, gzipped if allowed."""
    encoder, content_type = choose_encoder(accept)
    reply = Reply(200, encoder(metrics), (("vary", METRICS_VARY),), content_type)
    return _gzipped_if_accepted(reply, accept_encoding)


def subscriptions_reply(
    subscriptions: Subscriptions, query: str, *, as_html: bool, accept_encoding: str = ""
) -> Reply:
    """The page of live subscriptions `query` asks for, as JSON or as the HTML page."""
    try:
        request = PageRequest.parse(query)
    except BadPageRequest as error:
        return Reply(400, f"{error}\n".encode())
    page = subscriptions(request).as_json()
    if as_html:
        body = render_html(page, first_page=request.after == 0, version=__version__)
        reply = Reply(200, body, (*HTML_HEADERS, ("vary", "Accept-Encoding")), HTML_CONTENT_TYPE)
    else:
        body = json.dumps(page, indent=1).encode() + b"\n"  # ASCII: escapes all else
        headers = (("cache-control", "no-store"), ("vary", "Accept-Encoding"))
        reply = Reply(200, body, headers, JSON_CONTENT_TYPE)
    return _gzipped_if_accepted(reply, accept_encoding)


def route(
    method: bytes,
    target: bytes,
    metrics: Collector,
    readiness: Readiness = _always_ready,
    *,
    accept: str = "",
    accept_encoding: str = "",
    subscriptions: Subscriptions | None = None,
) -> Reply:
    """The reply to one request (for HEAD, the body is computed and not sent).
    Without `subscriptions`, `/` and `/debug/subscriptions` are not found."""
    if method not in (b"GET", b"HEAD"):
        return Reply(405, b"only GET and HEAD\n", (("allow", ALLOWED_METHODS),))
    path, _, query = target.partition(b"?")
    if subscriptions is not None and path in (b"/", b"/debug/subscriptions"):
        return subscriptions_reply(
            subscriptions,
            query.decode("ascii", "replace"),  # (h11 lets only ASCII into a target)
            as_html=path == b"/",
            accept_encoding=accept_encoding,
        )
    if path == b"/metrics":
        return exposition(metrics, accept, accept_encoding)
    if path in (b"/healthz", b"/livez"):
        # The process answers: its event loop runs.
        return Reply(200, b"ok\n")
    if path == b"/readyz":
        reason = readiness()
        if reason is None:
            return Reply(200, b"ok\n")
        return Reply(503, f"not ready: {reason}\n".encode())
    if subscriptions is not None:
        return Reply(404, b"try /metrics, /readyz, /livez, /debug/subscriptions or /\n")
    return Reply(404, b"try /metrics, /readyz or /livez\n")


def _response(conn: h11.Connection, reply: Reply, *, with_body: bool) -> bytes:
    headers = [
        ("content-type", reply.content_type),
        ("content-length", str(len(reply.body))),
        ("connection", "close"),
        *reply.headers,
    ]
    reason = HTTPStatus(reply.status).phrase.encode()
    data = conn.send(h11.Response(status_code=reply.status, headers=headers, reason=reason))
    if with_body:
        data += conn.send(h11.Data(data=reply.body))
    return data + conn.send(h11.EndOfMessage())


class _Connection:
    """One accepted connection: its h11 state, who it is, what was sent."""

    def __init__(self, stream: trio.SocketStream, stats: HttpStats, peer: Peer) -> None:
        self.stream = stream
        self.stats = stats
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        self.peer = peer.text
        self.response_started = False

    async def send(self, reply: Reply, *, with_body: bool = True) -> None:
        data = _response(self.h11, reply, with_body=with_body)
        self.response_started = True
        await self.stream.send_all(data)

    async def send_error(self, status: int) -> None:
        """Best effort: the client may already be gone or not reading."""
        if self.response_started:
            return  # too late for a status line: closing is all that is left
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            # Our own h11 state broke (the fault being handled): a fresh one
            # can still write a well-formed response, as nothing was sent yet.
            self.h11 = h11.Connection(h11.SERVER)
        body = f"{status} {HTTPStatus(status).phrase}\n".encode()
        gone = (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError)
        with trio.move_on_after(ERROR_SEND_TIMEOUT), contextlib.suppress(*gone):
            await self.send(Reply(status, body))

    async def read_request(self) -> h11.Request | None:
        """The next request, or None if the client closed before sending one."""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(4096))
            elif isinstance(event, h11.Request):
                return event
            elif isinstance(event, h11.ConnectionClosed):
                return None
            else:  # nothing else can come before a request; h11 would have raised
                raise AssertionError(f"unexpected HTTP event before a request: {event!r}")

    async def exchange(
        self, metrics: Collector, readiness: Readiness, subscriptions: Subscriptions | None
    ) -> None:
        with trio.move_on_after(CONNECTION_TIMEOUT) as deadline:
            try:
                request = await self.read_request()
            except h11.RemoteProtocolError as error:
                status = error.error_status_hint
                self.fault(
                    "headers_too_large" if status == 431 else "bad_request", quote(str(error))
                )
                await self.send_error(status)
                return
            if request is None:
                return
            reply = route(
                request.method,
                request.target,
                metrics,
                readiness,
                accept=_header(request, b"accept"),
                accept_encoding=_header(request, b"accept-encoding"),
                subscriptions=subscriptions,
            )
            await self.send(reply, with_body=request.method != b"HEAD")
        if deadline.cancelled_caught:
            self.fault("timeout", f"no complete exchange within {CONNECTION_TIMEOUT:g}s")
            await self.send_error(408)

    def fault(self, reason: str, detail: str) -> None:
        self.stats.errors[reason] += 1
        fault_log.log(
            logging.INFO, f"http:{reason}", "metrics HTTP %s from %s: %s", reason, self.peer, detail
        )


def _header(request: h11.Request, name: bytes) -> str:
    """The request's `name` headers (h11 lower-cases names) joined as one list."""
    values = [value.decode("latin-1") for key, value in request.headers if key == name]
    return ", ".join(values)


async def _close_gently(stream: trio.SocketStream) -> None:
    """Half-close, read (and drop) what the client still sends, then close."""
    try:
        with trio.move_on_after(LINGER_TIME):
            await stream.send_eof()
            drained = 0
            while drained < LINGER_BYTES:
                data = await stream.receive_some(4096)
                if not data:
                    break
                drained += len(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        await trio.aclose_forcefully(stream)


@dataclass(frozen=True)
class Peer:
    """Who is connected: the address its connections are counted by (one key for
    every peer whose address is unknown) and the text its log lines name."""

    address: str
    text: str

    @classmethod
    def of(cls, stream: trio.SocketStream) -> Peer:
        try:
            host, port = stream.socket.getpeername()[:2]
        except (OSError, ValueError):
            return cls("unknown", "unknown peer")
        return cls(str(host), f"{host}:{port}")


async def serve_connection(
    stream: trio.SocketStream,
    metrics: Collector,
    stats: HttpStats,
    readiness: Readiness = _always_ready,
    peer: Peer | None = None,
    subscriptions: Subscriptions | None = None,
) -> None:
    """Answer one request on `stream` from `peer` (read from the socket if not
    given); raises nothing but cancellation."""
    connection = _Connection(stream, stats, peer or Peer.of(stream))
    try:
        await connection.exchange(metrics, readiness, subscriptions)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the client went away: nothing to answer, nothing wrong with us
    except Exception:
        stats.errors["internal"] += 1
        fault_log.error(
            "http:internal",
            "unexpected error serving metrics HTTP to %s; the connection ends with 500",
            connection.peer,
            exc_info=True,
        )
        await connection.send_error(500)
    finally:
        await _close_gently(stream)


async def run_metrics_server(
    host: str,
    port: int,
    metrics: Collector,
    *,
    stats: HttpStats | None = None,
    readiness: Readiness = _always_ready,
    subscriptions: Subscriptions | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `metrics` (a registry) until cancelled; reports the bound port once listening.

    `/readyz` answers 503 with the reason while `readiness()` gives one;
    `/debug/subscriptions` and `/` list the pages `subscriptions` gives, if any.
    """
    stats = HttpStats() if stats is None else stats
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as error:
        raise cannot_listen("--metrics-listen", host, port, error) from None
    bound = listeners[0].socket.getsockname()[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    task_status.started(bound)
    connections = ConnectionCounter(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS)

    async def handler(stream: trio.SocketStream) -> None:
        peer = Peer.of(stream)
        address = peer.address
        refusal = connections.refusal(address)
        if refusal is not None:
            stats.errors["too_many_connections"] += 1
            fault_log.log(logging.INFO, "http:too_many_connections", "metrics HTTP: %s", refusal)
            await trio.aclose_forcefully(stream)
            return
        connections.opened(address)
        try:
            await serve_connection(stream, metrics, stats, readiness, peer, subscriptions)
        finally:
            connections.closed(address)

    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept_connections, listener, handler, stats, nursery)


async def _accept_connections(
    listener: trio.SocketListener,
    handler: Callable[[trio.SocketStream], Awaitable[None]],
    stats: HttpStats,
    nursery: trio.Nursery,
) -> None:
    """Hand each connection `listener` accepts to `handler` in `nursery`; pause for a
    second whenever accept() fails for want of descriptors or memory."""
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                name = errno.errorcode[exc.errno]
                stats.accept_pauses[name] += 1
                fault_log.warning(
                    f"accept:{name}",
                    "cannot accept metrics HTTP connections: %s (%s); accepting again in %g s",
                    WHY_ACCEPT_FAILED[name],
                    name,
                    ACCEPT_PAUSE,
                )
                await trio.sleep(ACCEPT_PAUSE)
                continue
            nursery.start_soon(handler, stream)
