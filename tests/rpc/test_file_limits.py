"""The gRPC port past the process's file limit, and errors only asyncio sees.

asyncio hands a failed `accept()` (no file descriptor left) and an exception
escaping a transport's callback to its loop's exception handler, and
trio-asyncio's default handler raised them into the server's nursery: a
client that opened connections past `ulimit -n` ended the server. Now
accepting pauses for a second and everything open is served on
(`rpc/loop_faults.py`), and refused connections cannot hold descriptors
without bound (`MAX_LINGERING_REFUSALS`).

Real sockets on 127.0.0.1, virtual time (asyncio's timers run on trio's clock).
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import ExitStack

import pytest
import trio
import trio.testing

from jobsignal._proto.job import JobSummarySignal
from jobsignal.rpc import connections as rpc_connections
from jobsignal.rpc.connections import MAX_LINGERING_REFUSALS
from jobsignal.rpc.limits import Limits
from tests.support.descriptors import connect_without_yielding, file_limit
from tests.support.factories import make_job
from tests.support.grpc_server import ServerHarness, local_settings, open_jobsignal_server
from tests.support.waiting import wait_until

from .test_h2_fuzz import HEALTHY_STREAM, healthy_subscriber
from .test_hostile_h2 import RawPeer, raw_peer
from .test_whole_messages import messages


async def assert_delivers(server: ServerHarness, healthy: RawPeer, index: int) -> None:
    """Event `index` reaches the healthy subscriber (its `index`-th message)."""
    server.broadcaster.publish([make_job(index)])
    await wait_until(lambda: len(messages(healthy, HEALTHY_STREAM)) == index + 1)
    last = JobSummarySignal.parse(messages(healthy, HEALTHY_STREAM)[-1])
    assert last.job_name == f"train-{index}"


async def read_to_end(stream: trio.SocketStream, closed: list[int], index: int) -> None:
    """Read until the server closes `stream`, then note `index` in `closed`."""
    async with stream:
        with contextlib.suppress(trio.BrokenResourceError):
            while await stream.receive_some(65536):
                pass
    closed.append(index)


def lines_of(caplog: pytest.LogCaptureFixture, logger: str, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == level]


async def test_connections_past_the_file_limit_pause_accepting_and_end_nothing(
    io_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with open_jobsignal_server() as server, healthy_subscriber(server) as healthy:
        with ExitStack() as stack:
            connect_without_yielding(server.port, 30, stack)
            with file_limit(room=5):
                await wait_until(lambda: server.running.loop_faults.accept_pauses["EMFILE"] == 1)
                await assert_delivers(server, healthy, 0)
            # Accepting again a second later: every waiting connection is taken.
            await wait_until(lambda: server.connections.open_transports == 31)
            assert server.running.loop_faults.accept_pauses["EMFILE"] == 1
            await assert_delivers(server, healthy, 1)
        # A new client is served as ever.
        async with raw_peer(server.port) as newcomer:
            await newcomer.handshake()
            await newcomer.assert_serves_a_request(1)
    warnings = lines_of(caplog, "jobsignal.rpc.loop_faults", logging.WARNING)
    assert len(warnings) == 1, warnings  # one pause, one line: not one per failed accept()
    assert "(EMFILE)" in warnings[0] and "ulimit -n" in warnings[0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert server.running.loop_faults.unexpected == 0


async def test_an_error_escaping_a_transport_callback_closes_that_connection_only(
    io_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_jobsignal_server() as server, healthy_subscriber(server) as healthy:
        (healthy_protocol,) = server.connections.protocols()
        async with raw_peer(server.port) as doomed:
            await doomed.handshake()
            await wait_until(lambda: len(server.connections) == 2)
            (protocol,) = [p for p in server.connections.protocols() if p is not healthy_protocol]

            def data_received(data: bytes) -> None:
                raise KeyError("a fault nobody foresaw")

            # (An instance attribute: asyncio's transport calls it, nothing else changes.)
            setattr(protocol, "data_received", data_received)  # noqa: B010
            await doomed.send(b"\0" * 9)
            await doomed.read_until(lambda peer: False)
            assert doomed.closed
        await wait_until(lambda: len(server.connections) == 1)
        await assert_delivers(server, healthy, 0)
    assert server.running.loop_faults.unexpected == 1
    (error,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.name == "jobsignal.rpc.loop_faults"
    assert "protocol.data_received() call failed" in error.getMessage()
    assert "that connection is closed" in error.getMessage()
    assert error.exc_info is not None and isinstance(error.exc_info[1], KeyError)


async def test_refused_connections_past_the_cap_are_closed_at_once(
    io_clock: trio.testing.MockClock,
) -> None:
    cap = MAX_LINGERING_REFUSALS
    settings = local_settings(limits=Limits(max_connections=1, max_connections_per_ip=1))
    closed: list[int] = []
    async with (
        open_jobsignal_server(settings) as server,
        healthy_subscriber(server),
        trio.open_nursery() as nursery,
    ):
        for index in range(cap + 10):
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            nursery.start_soon(read_to_end, stream, closed, index)
        await wait_until(lambda: server.connections.counter.refused == cap + 10)
        assert server.connections.lingering_refusals == cap
        # The ten past the cap were closed unanswered; the others wait for a request.
        await wait_until(lambda: len(closed) == 10)
        assert sorted(closed) == list(range(cap, cap + 10))
        # After the linger the others are let go too, and the count is back to zero.
        await trio.sleep(rpc_connections.REFUSED_CONNECTION_LINGER + 1)
        await wait_until(lambda: len(closed) == cap + 10)
        assert server.connections.lingering_refusals == 0
