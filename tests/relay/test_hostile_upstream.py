"""The upstream is a network peer like any other: a fake one, served by grpclib.

`FakeUpstream` is job.Job as a test scripts it: Register answers 200, and each
List subscription sends the next script's messages exactly as given (bytes,
well-formed or not) and then holds the stream open. The relay under test is
the whole server (`open_relay_server`), over real sockets on 127.0.0.1: what
it rejects is counted and logged, never fatal, and its subscribers see only
well-formed, validated jobs.
"""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio
import trio_asyncio
from grpclib.const import Cardinality, Handler
from grpclib.server import Server, Stream

from jobsignal._proto.job import ClientInfo, JobSummarySignalList, Status
from jobsignal.app import RunningJobsignal
from jobsignal.fanout.encoding import encode_signal, encode_signal_list
from jobsignal.relay.source import Relay
from jobsignal.rpc.codec import PassthroughCodec
from jobsignal.store.model import JobSummary, event_id
from tests.support.factories import make_job
from tests.support.relay import open_relay_server
from tests.support.waiting import wait_until


class FakeUpstream:
    def __init__(self, scripts: Sequence[Sequence[bytes]]) -> None:
        self.scripts = list(scripts)
        self.subscriptions = 0

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/job.Job/Register": Handler(
                self.register, Cardinality.UNARY_UNARY, ClientInfo, Status
            ),
            "/job.Job/SubscribeJobSummarySignalList": Handler(
                self.subscribe_list, Cardinality.UNARY_STREAM, ClientInfo, JobSummarySignalList
            ),
        }

    async def register(self, stream: Stream[Any, Any]) -> None:
        await stream.recv_message()
        await stream.send_message(Status(code=200, info="ok", client_id="fake-id"))

    async def subscribe_list(self, stream: Stream[Any, Any]) -> None:
        await stream.recv_message()
        script = self.scripts[min(self.subscriptions, len(self.scripts) - 1)]
        self.subscriptions += 1
        for message in script:
            await stream.send_message(message)
        await asyncio.Event().wait()  # until the server closes


def listening_socket(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


@asynccontextmanager
async def serving(fake: FakeUpstream, port: int = 0) -> AsyncIterator[int]:
    """`fake` on 127.0.0.1:`port` (0: any) for the block; yields the port."""
    sock = listening_socket(port)
    async with trio_asyncio.open_loop():

        async def start() -> Server:
            server = Server([fake], codec=PassthroughCodec(4096))
            await server.start(sock=sock)
            return server

        server = await trio_asyncio.aio_as_trio(start)()
        try:
            yield sock.getsockname()[1]
        finally:
            server.close()
            await trio_asyncio.aio_as_trio(server.wait_closed)()


def batch(jobs: Sequence[JobSummary], total: int | None = None) -> bytes:
    signals = [encode_signal(job, event_id(job)) for job in jobs]
    return encode_signal_list(signals, 1, len(jobs) if total is None else total)


def relay_of(server: RunningJobsignal) -> Relay:
    source = server._parts.source
    assert isinstance(source, Relay)
    return source


def live_ids(server: RunningJobsignal) -> list[str]:
    return sorted(job.job_id for job in server._parts.store.live_jobs())


async def test_an_oversized_message_ends_the_connection_not_the_relay() -> None:
    one, two = make_job(1), make_job(2)
    oversized = b"\x0a" + b"\x80\x80\x80\x01" + bytes(2 * 1024 * 1024)  # a 2 MiB "signal"
    fake = FakeUpstream([[batch([one]), oversized], [batch([one]), batch([two], total=2)]])
    async with (
        serving(fake) as port,
        open_relay_server(port, upstream_max_message_bytes="1048576") as relay,
    ):
        await wait_until(lambda: live_ids(relay) == ["uid-0001", "uid-0002"], within=20)
        counters = relay_of(relay).counters
        assert counters.upstream_errors["too_large"] == 1
        assert (counters.subscriptions, counters.snapshots) == (2, 2)


async def test_malformed_messages_and_signals_are_rejected_counted_and_survived() -> None:
    good, nan, late = make_job(1), make_job(2, hccl_json='{"x":NaN}'), make_job(3)
    not_utf8 = b"\x22\x02\xed\xb2"  # a signal: namespace, half a surrogate's UTF-8
    snapshot = encode_signal_list(
        [encode_signal(good, "g"), not_utf8, encode_signal(nan, "n")], 1, 3
    )
    fake = FakeUpstream([[snapshot, b"\x0a\x09abc", batch([late], total=2)]])
    async with (
        serving(fake) as port,
        open_relay_server(port, metrics_listen="127.0.0.1:0") as relay,
    ):
        await wait_until(lambda: live_ids(relay) == ["uid-0001", "uid-0003"], within=20)
        counters = relay_of(relay).counters
        assert counters.signals_rejected == {"not_utf8": 1, "hccl_json_not_strict": 1}
        assert counters.messages_rejected == {"bad_protobuf": 1}
        assert counters.subscriptions == 1  # a bad live message costs only itself
        (kept,) = [job for job in relay._parts.store.live_jobs() if job.job_id == "uid-0001"]
        assert kept.event_uuid == "g"
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{relay.metrics_port}/metrics")).text
    assert 'jobsignal_relay_signals_rejected_total{reason="not_utf8"} 1.0' in text
    assert 'jobsignal_relay_messages_rejected_total{reason="bad_protobuf"} 1.0' in text
    assert "jobsignal_relay_snapshots_total 1.0" in text
    assert "jobsignal_source_in_sync 1.0" in text


async def _pipe(backend: int, client: trio.SocketStream) -> None:
    async with client, await trio.open_tcp_stream("127.0.0.1", backend) as server:

        async def copy(source: trio.SocketStream, sink: trio.SocketStream) -> None:
            async for data in source:
                await sink.send_all(data)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(copy, client, server)
            await copy(server, client)
            nursery.cancel_scope.cancel()


async def run_fake(
    fake: FakeUpstream,
    port: int,
    stop: trio.Event,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`fake` reached through a TCP proxy on 127.0.0.1:`port` (0: any) until `stop`
    is set, when every connection is closed, as when its process dies. (A task of
    its own: the relay outlives it.)"""
    async with serving(fake) as backend:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, functools.partial(_pipe, backend), listeners)
            task_status.started(listeners[0].socket.getsockname()[1])
            await stop.wait()
            nursery.cancel_scope.cancel()


async def test_an_upstream_restarted_and_lost_mid_snapshot() -> None:
    one, two, three = make_job(1, status="pending"), make_job(2), make_job(3)
    one_running = make_job(1)
    half = FakeUpstream([[batch([one_running], total=3)]])  # 1 of 3 jobs, then lost
    whole = FakeUpstream([[batch([one_running], total=2), batch([three], total=2)]])
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        port = await nursery.start(run_fake, FakeUpstream([[batch([one, two])]]), 0, stop)
        async with open_relay_server(port, upstream_grace="60") as relay:
            assert live_ids(relay) == ["uid-0001", "uid-0002"]
            async with relay.open_subscription(snapshot=True) as events:
                with trio.fail_after(10):
                    snapshot = [await events.receive() for _ in range(2)]
                assert [e.uuid for e in snapshot] == [event_id(one), event_id(two)]
                stop.set()
                for fake in (half, whole):
                    await wait_until(lambda: relay_of(relay).counters.upstream_errors.total() > 0)
                    stop = trio.Event()
                    await nursery.start(run_fake, fake, port, stop)
                    await wait_until(lambda: fake.subscriptions == 1, within=20)  # noqa: B023
                    if fake is half:
                        await trio.sleep(0.2)
                        assert live_ids(relay) == ["uid-0001", "uid-0002"]  # nothing yet
                        stop.set()
                with trio.fail_after(20):
                    got = [await events.receive() for _ in range(3)]
                assert relay._parts.status.in_sync  # back within the grace
            assert relay_of(relay).counters.snapshots == 2
            assert live_ids(relay) == ["uid-0001", "uid-0003"]
            stop.set()
    assert [(e.kind.value, e.job.job_id, e.job.job_status) for e in got] == [
        ("changed", "uid-0001", "running"),
        ("added", "uid-0003", "running"),
        ("deleted", "uid-0002", "running"),
    ]
    assert [e.uuid for e in got[:2]] == [event_id(one_running), event_id(three)]
