"""Maximum connection age (rpc/max_age.py): the rule alone, then the server in virtual time.

Raw HTTP/2 peers on 127.0.0.1 under `io_clock`, answering the server's PINGs
(its keepalive ones, so they stay, and the one sent with the first GOAWAY,
unless a test says otherwise), with `--max-connection-age` 600 s: the
connection gets GOAWAY (last stream 2^31-1), a PING, and after its ACK a GOAWAY
naming the last stream taken; later streams are refused; the open
subscription goes on, and with a grace it ends with UNAVAILABLE at the end of
the grace, and the connection closes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, GoAwayFrame, PingFrame, RstStreamFrame

from jobsignal.config import ConfigError, load_config
from jobsignal.rpc.connections import MAX_AGE
from jobsignal.rpc.max_age import GOAWAY_PING, GOAWAY_PING_TIMEOUT, MAX_STREAM_ID, MaxAgePolicy
from jobsignal.rpc.server import ServerSettings
from tests.support.factories import make_job
from tests.support.grpc_server import ServerHarness, local_settings, open_jobsignal_server
from tests.support.waiting import wait_until

from .test_hostile_h2 import RawPeer, grpc_request_headers, raw_peer, register_body
from .test_keepalive import data_on, more_pings_than, pings_from_server, subscribed_raw_peer
from .test_robustness import all_released

AGE = 600.0
GRACE = 300.0

# -- the rule --------------------------------------------------------------------------------------


def test_the_age_is_jittered_by_ten_percent_either_way() -> None:
    policy = MaxAgePolicy(age=AGE, grace=None)
    assert policy.jittered_age(lambda: 0.0) == pytest.approx(540.0)
    assert policy.jittered_age(lambda: 0.5) == pytest.approx(600.0)
    assert policy.jittered_age(lambda: 0.999999) == pytest.approx(660.0, abs=1e-3)
    ages = {policy.jittered_age() for _ in range(100)}
    assert len(ages) > 90 and all(540.0 <= age < 660.0 for age in ages if age is not None)


def test_off_by_default_and_the_grace_unbounded() -> None:
    config = load_config({}, {})
    assert config.max_connection_age is None and config.max_connection_age_grace is None
    assert MaxAgePolicy().jittered_age() is None


def test_age_and_grace_from_flags_and_environment() -> None:
    config = load_config(
        {"max_connection_age": "3600"}, {"JOBSIGNAL_MAX_CONNECTION_AGE_GRACE": "0"}
    )
    assert MaxAgePolicy.from_config(config) == MaxAgePolicy(age=3600.0, grace=0.0)
    with pytest.raises(ConfigError, match="needs --max-connection-age"):
        load_config({"max_connection_age_grace": "60"}, {})
    with pytest.raises(ConfigError, match="positive number of seconds"):
        load_config({"max_connection_age": "0"}, {})


# -- the server ------------------------------------------------------------------------------------


async def answer_every_ping(peer: RawPeer, *, goaway_ping: bool = True) -> None:
    """Read the server's frames until it closes, ACKing its PINGs (the one sent with
    the first GOAWAY only if `goaway_ping`)."""
    answered = 0
    with trio.move_on_after(1e6):
        while not peer.closed:
            await peer.read_until(more_pings_than(answered), within=1e9)
            for ping in pings_from_server(peer)[answered:]:
                answered += 1
                if ping.opaque_data == GOAWAY_PING and not goaway_ping:
                    continue
                try:
                    await peer.send(PingFrame(0, opaque_data=ping.opaque_data, flags=["ACK"]))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return


def goaways(peer: RawPeer) -> list[GoAwayFrame]:
    return [f for f in peer.frames if isinstance(f, GoAwayFrame)]


def aged_settings(grace: float | None = None) -> ServerSettings:
    return local_settings(max_age=MaxAgePolicy(age=AGE, grace=grace))


async def time_of(condition: Callable[[], bool], within: float = 2 * AGE) -> float:
    """Trio's time once `condition` holds."""
    await wait_until(condition, within=within)
    return trio.current_time()


async def register_on(peer: RawPeer, stream_id: int) -> None:
    await peer.send(
        peer.headers_frame(stream_id, grpc_request_headers(peer.port)),
        DataFrame(stream_id, register_body(), flags=["END_STREAM"]),
    )


def status_of(peer: RawPeer, stream_id: int) -> tuple[str | None, str | None]:
    headers = dict(peer.headers.get(stream_id, []))
    return headers.get("grpc-status"), headers.get("grpc-message")


async def test_at_its_age_a_connection_gets_goaway_ping_goaway_and_its_subscription_goes_on(
    io_clock: trio.testing.MockClock,
) -> None:
    """Without a grace (the default): GOAWAY 2^31-1, PING, then after the ACK
    GOAWAY 3; the subscription on stream 3 keeps delivering long after, and a
    new call on the connection is refused with REFUSED_STREAM."""
    async with (
        open_jobsignal_server(aged_settings()) as server,
        raw_peer(server.port) as peer,
        trio.open_nursery() as nursery,
    ):
        connected = trio.current_time()
        await subscribed_raw_peer(server, peer)
        nursery.start_soon(answer_every_ping, peer)
        first = await time_of(lambda: len(goaways(peer)) >= 1)
        assert 0.9 * AGE <= first - connected < 1.1 * AGE
        await wait_until(lambda: len(goaways(peer)) == 2)
        assert trio.current_time() == pytest.approx(first, abs=0.5)  # the ACK came at once
        one, two = goaways(peer)
        assert (one.last_stream_id, one.error_code, one.additional_data) == (
            MAX_STREAM_ID,
            ErrorCodes.NO_ERROR,
            b"max_age",
        )
        assert (two.last_stream_id, two.error_code, two.additional_data) == (3, 0, b"max_age")
        (ping,) = [f for f in pings_from_server(peer) if f.opaque_data == GOAWAY_PING]
        frames = peer.frames
        assert frames.index(one) < frames.index(ping) < frames.index(two)
        assert server.connections.closed_by_server[MAX_AGE] == 1

        await register_on(peer, 5)
        await wait_until(lambda: 5 in peer.resets())
        assert peer.resets()[5] == ErrorCodes.REFUSED_STREAM

        await trio.sleep(2 * AGE)
        server.broadcaster.publish([make_job(1)])
        await wait_until(lambda: data_on(3)(peer))
        assert not peer.closed and 3 not in peer.ended_streams()
        assert len(server.broadcaster.subscribers) == 1
        assert server.broadcaster.stats.stream_ends["max_age"] == 0
        nursery.cancel_scope.cancel()


async def test_after_the_grace_the_subscription_ends_unavailable_and_the_connection_closes(
    io_clock: trio.testing.MockClock,
) -> None:
    async with (
        open_jobsignal_server(aged_settings(grace=GRACE)) as server,
        raw_peer(server.port) as peer,
        trio.open_nursery() as nursery,
    ):
        client_id = await subscribed_raw_peer(server, peer)
        nursery.start_soon(answer_every_ping, peer)
        first = await time_of(lambda: len(goaways(peer)) >= 1)
        server.broadcaster.publish([make_job(1)])  # during the grace: delivered
        await wait_until(lambda: data_on(3)(peer))
        ended = await time_of(lambda: 3 in peer.ended_streams())
        assert ended - first == pytest.approx(GRACE, abs=0.5)
        status, message = status_of(peer, 3)
        assert status == "14"
        assert message is not None and "maximum age" in message and "reconnect" in message
        await wait_until(lambda: peer.closed)
        assert trio.current_time() - ended < 0.5
        # Every GOAWAY names a last stream no higher than the one before.
        assert [f.last_stream_id for f in goaways(peer)] == [MAX_STREAM_ID, 3, 3]
        await wait_until(lambda: all_released(server), what="the aged subscription")
        assert server.broadcaster.stats.stream_ends["max_age"] == 1
        assert server.connections.closed_by_server[MAX_AGE] == 1
        assert client_id not in {s.client_id for s in server.broadcaster.subscribers}


async def test_a_call_before_the_ack_is_served_and_the_second_goaway_waits_at_most_a_minute(
    io_clock: trio.testing.MockClock,
) -> None:
    """A peer that never ACKs the GOAWAY's PING: calls it opens meanwhile are
    served (the first GOAWAY refuses nothing), the second GOAWAY comes
    GOAWAY_PING_TIMEOUT later naming the last of them, and the connection, with
    no stream left, closes."""
    async with (
        open_jobsignal_server(aged_settings()) as server,
        raw_peer(server.port) as peer,
        trio.open_nursery() as nursery,
    ):
        await peer.handshake()
        nursery.start_soon(lambda: answer_every_ping(peer, goaway_ping=False))
        first = await time_of(lambda: len(goaways(peer)) >= 1)
        await register_on(peer, 1)
        await wait_until(lambda: 1 in peer.ended_streams())
        assert status_of(peer, 1)[0] == "0"
        second = await time_of(lambda: len(goaways(peer)) >= 2)
        assert second - first == pytest.approx(GOAWAY_PING_TIMEOUT, abs=0.5)
        assert goaways(peer)[1].last_stream_id == 1
        await wait_until(lambda: peer.closed)
        assert len(server.connections) == 0


async def test_connections_opened_together_go_at_different_times(
    io_clock: trio.testing.MockClock,
) -> None:
    """The jitter: four connections opened at the same instant get their GOAWAYs
    at four different times within 10 % of the age, and close (no stream)."""
    async with open_jobsignal_server(aged_settings()) as server:
        times: list[float] = []

        async def one() -> None:
            async with raw_peer(server.port) as peer:
                await peer.handshake()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(answer_every_ping, peer)
                    times.append(await time_of(lambda: bool(goaways(peer))))
                    await wait_until(lambda: peer.closed)

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
        assert len(set(times)) == 4
        assert all(0.9 * AGE <= t - started < 1.1 * AGE + 1.0 for t in times)
        assert server.connections.closed_by_server[MAX_AGE] == 4


async def test_shutdown_after_the_goaways_names_no_higher_stream(
    io_clock: trio.testing.MockClock,
) -> None:
    """The server's own final GOAWAY (shutdown) after a maximum-age one never raises
    the last stream id (RFC 9113 section 6.8)."""
    async with (
        open_jobsignal_server(aged_settings()) as server,
        raw_peer(server.port) as peer,
        trio.open_nursery() as nursery,
    ):
        await subscribed_raw_peer(server, peer)
        nursery.start_soon(answer_every_ping, peer)
        await wait_until(lambda: len(goaways(peer)) == 2, within=2 * AGE)
        await register_on(peer, 5)  # refused, but h2 has seen stream 5
        await wait_until(lambda: 5 in peer.resets())
        await stop(server)
        await wait_until(lambda: peer.closed)
        assert status_of(peer, 3)[0] == "14"  # "server shutting down"
        assert [f.last_stream_id for f in goaways(peer)] == [MAX_STREAM_ID, 3, 3]


async def stop(server: ServerHarness) -> None:
    server.shutdown.set()
    await server.running.stopped.wait()


async def test_a_draining_connection_closes_when_its_last_stream_ends(
    io_clock: trio.testing.MockClock,
) -> None:
    """Without a grace the subscription outlives the GOAWAYs; when the client
    ends it (RST_STREAM CANCEL), the connection, with nothing left, closes at once."""
    async with (
        open_jobsignal_server(aged_settings()) as server,
        raw_peer(server.port) as peer,
        trio.open_nursery() as nursery,
    ):
        await subscribed_raw_peer(server, peer)
        nursery.start_soon(answer_every_ping, peer)
        await wait_until(lambda: len(goaways(peer)) == 2, within=2 * AGE)
        await peer.send(RstStreamFrame(3, error_code=ErrorCodes.CANCEL))
        reset_at = trio.current_time()
        await wait_until(lambda: peer.closed)
        assert trio.current_time() - reset_at < 0.5
        await wait_until(lambda: all_released(server))
        assert goaways(peer)[-1].last_stream_id == 3
