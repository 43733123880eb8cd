"""A minimal HTTP endpoint for Prometheus: GET /metrics, plus GET /healthz.

HTTP/1.1 over trio with h11; one short request per connection is all a
scraper needs, so connections are closed after each response and every read
is bounded in time and size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import h11
import trio

log = logging.getLogger(__name__)

READ_TIMEOUT = 10.0
MAX_REQUEST_BYTES = 16 * 1024
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def _respond(
    stream: trio.SocketStream, conn: h11.Connection, status: int, body: bytes
) -> None:
    headers = [
        ("content-type", CONTENT_TYPE),
        ("content-length", str(len(body))),
        ("connection", "close"),
    ]
    data = conn.send(h11.Response(status_code=status, headers=headers))
    data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
    await stream.send_all(data)


async def _serve_connection(stream: trio.SocketStream, render: Callable[[], str]) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
    try:
        with trio.move_on_after(READ_TIMEOUT):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(4096)
                    conn.receive_data(data)
                    if not data:
                        return
                    continue
                if isinstance(event, h11.Request):
                    path = event.target.split(b"?")[0]
                    if event.method != b"GET":
                        await _respond(stream, conn, 405, b"only GET\n")
                    elif path == b"/metrics":
                        await _respond(stream, conn, 200, render().encode())
                    elif path == b"/healthz":
                        await _respond(stream, conn, 200, b"ok\n")
                    else:
                        await _respond(stream, conn, 404, b"try /metrics\n")
                return
    except (h11.RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
        return
    finally:
        await trio.aclose_forcefully(stream)


async def run_metrics_server(
    host: str,
    port: int,
    render: Callable[[], str],
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve metrics until cancelled; reports the bound port once listening."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    task_status.started(bound)

    async def handler(stream: trio.SocketStream) -> None:
        await _serve_connection(stream, render)

    await trio.serve_listeners(handler, listeners)
