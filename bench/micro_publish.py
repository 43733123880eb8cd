"""Microbenchmark of delivery from publish: time of `Broadcaster.publish` per subscriber.

    python -m bench.micro_publish [--subscribers 100] [--events 300]

Runs jobsignal's real gRPC server in this process and `--subscribers` raw
HTTP/2 subscribers on 127.0.0.1, one connection each (the usual client), with
the widest windows HTTP/2 allows. They read everything in this process too,
so no other process is woken by a write: the figure is the server's own
cost (framing, h2 state, one system call per connection), not a client's.
Then it publishes one job event at a time and times each `publish`, which
sends straight into every parked subscriber's stream (docs/architecture.md
section 6). Prints one JSON line; FINDINGS.md quotes it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import h2.config
import h2.connection
import h2.events
import trio
from h2.settings import SettingCodes

from bench.common import ROLES, run_micro
from bench.events import make_jobs
from bench.jobsignal_server import bench_registry
from jobsignal._proto.job import ClientInfo, Status
from jobsignal.fanout import Broadcaster
from jobsignal.rpc.server import RunningServer, ServerSettings, run_grpc_server
from jobsignal.status import SourceStatus

WIDEST = 2**31 - 1


def grpc_message(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


class RawSubscriber:
    """One HTTP/2 connection: Register, then Subscribe, then read and count."""

    def __init__(self, stream: trio.SocketStream, port: int) -> None:
        self.stream = stream
        self.port = port
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="ascii")
        )
        self.bodies: dict[int, bytes] = {}
        self.ended: set[int] = set()

    def request(self, stream_id: int, method: str, message: bytes) -> None:
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"/job.Job/{method}"),
            (":authority", f"127.0.0.1:{self.port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        self.h2.send_headers(stream_id, headers)
        self.h2.send_data(stream_id, grpc_message(message), end_stream=True)

    async def exchange(self) -> None:
        """Send what h2 has queued, then read one chunk and handle its events."""
        if outgoing := self.h2.data_to_send():
            await self.stream.send_all(outgoing)
        data = await self.stream.receive_some(1 << 20)
        if not data:
            raise EOFError("the server closed the connection")
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.DataReceived) and event.stream_id is not None:
                self.bodies[event.stream_id] = self.bodies.get(event.stream_id, b"") + event.data
            elif isinstance(event, h2.events.StreamEnded) and event.stream_id is not None:
                self.ended.add(event.stream_id)

    async def subscribe(self, role: str, *, wide_open: bool = True) -> None:
        """Register, then Subscribe; `wide_open`: with the widest windows HTTP/2 allows
        (else h2's defaults, which the peer must then open itself)."""
        self.h2.initiate_connection()
        if wide_open:
            self.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: WIDEST})
            self.h2.increment_flow_control_window(WIDEST - 65_535)
        self.request(1, "Register", bytes(ClientInfo(role=role)))
        while 1 not in self.ended:
            await self.exchange()
        client_id = Status.parse(self.bodies[1][5:]).client_id
        self.request(
            3, "SubscribeJobSummarySignal", bytes(ClientInfo(role=role, client_id=client_id))
        )
        await self.stream.send_all(self.h2.data_to_send())

    async def read_until_closed(self) -> None:
        try:
            with contextlib.suppress(EOFError, trio.BrokenResourceError):
                while True:
                    await self.exchange()
                    self.bodies.pop(3, None)  # counted by the server; nothing to keep
        finally:
            await trio.aclose_forcefully(self.stream)


async def wait_for_subscribers(broadcaster: Broadcaster, count: int) -> None:
    """Until the server has subscribed every stream (the requests are in flight)."""
    with trio.fail_after(30):
        while len(broadcaster.subscribers) < count:  # noqa: ASYNC110 (a count, not an event)
            await trio.sleep(0.01)


@contextlib.asynccontextmanager
async def serving(broadcaster: Broadcaster) -> AsyncIterator[RunningServer]:
    """jobsignal's gRPC server on 127.0.0.1 in this process, ready; stopped on exit."""
    settings = ServerSettings(host="127.0.0.1", port=0)
    status, shutdown = SourceStatus(), trio.Event()
    async with trio.open_nursery() as nursery:
        running: RunningServer = await nursery.start(
            run_grpc_server, settings, broadcaster, bench_registry(), status, shutdown
        )
        status.mark_ready(time.time())
        yield running
        shutdown.set()
        with trio.move_on_after(settings.shutdown_grace + 5):
            await running.stopped.wait()
        nursery.cancel_scope.cancel()


async def measure(subscribers: int, events: int) -> dict[str, Any]:
    broadcaster = Broadcaster()
    async with serving(broadcaster) as running, trio.open_nursery() as nursery:
        for _ in range(subscribers):
            peer = RawSubscriber(
                await trio.open_tcp_stream("127.0.0.1", running.port), running.port
            )
            await peer.subscribe(ROLES[0])
            nursery.start_soon(peer.read_until_closed)
        await wait_for_subscribers(broadcaster, subscribers)
        jobs = make_jobs(50, servers=1)
        broadcaster.publish([jobs[0]])  # every stream's response headers go out first
        await trio.sleep(0.2)
        stats = broadcaster.stats
        before = stats.batches_written_from_publish
        wall: list[float] = []
        cpu: list[float] = []
        for event in range(events):
            started_wall, started_cpu = time.perf_counter(), time.process_time()
            broadcaster.publish([jobs[(event + 1) % len(jobs)]])
            wall.append(time.perf_counter() - started_wall)
            cpu.append(time.process_time() - started_cpu)
            await trio.sleep(0.005)  # the readers drain, the loop flushes
        from_publish = stats.batches_written_from_publish - before
        nursery.cancel_scope.cancel()  # the readers
    return {
        "subscribers": subscribers,
        "events": events,
        "from_publish": from_publish,
        "publish_us_median": statistics.median(wall) * 1e6,
        "us_per_subscriber": statistics.median(wall) * 1e6 / subscribers,
        "cpu_us_per_subscriber": sum(cpu) * 1e6 / (events * subscribers),
    }


def main(argv: list[str] | None = None) -> None:
    run_micro("python -m bench.micro_publish", measure, subscribers=100, events=300, argv=argv)


if __name__ == "__main__":
    main()
