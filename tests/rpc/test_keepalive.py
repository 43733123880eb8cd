"""Server keepalive (rpc/keepalive.py): the rule alone, then the real server in virtual time.

The server's PINGs, and the close of a peer that does not answer, run on
trio's clock: the tests below use the default settings (a PING after 60 s
without a heartbeat, 5 s for anything to come back, the idle rule's 120 s)
under `io_clock`, with raw HTTP/2 peers on 127.0.0.1 that answer, stay
silent, stop reading or talk on their own.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing
from hyperframe.frame import DataFrame, PingFrame, WindowUpdateFrame

from jobsignal.rpc.connections import KEEPALIVE_TIMEOUT
from jobsignal.rpc.guard import FREE_CONTROL_FRAMES, ProtocolLimits
from jobsignal.rpc.keepalive import KeepalivePolicy, Liveness, PeerLiveness
from jobsignal.rpc.registry import Refused
from jobsignal.rpc.session import SessionSettings
from tests.support.factories import make_job
from tests.support.grpc_server import (
    QUICK_IDLE_TIMEOUT,
    QUICK_KEEPALIVE,
    ServerHarness,
    local_settings,
    open_jobsignal_server,
)
from tests.support.grpcio import GrpcioClients, GrpcioStream
from tests.support.h2_client import OTHER_LOOPBACK
from tests.support.threads import in_thread
from tests.support.waiting import wait_until

from .test_hostile_h2 import RawPeer, grpc_request_headers, raw_peer, register_body
from .test_robustness import all_released

POLICY = KeepalivePolicy(interval=60.0, timeout=5.0)


# -- the rule --------------------------------------------------------------------------------------


def test_a_quiet_peer_is_pinged_after_the_interval_and_gone_after_the_timeout() -> None:
    liveness = PeerLiveness(POLICY, now=100.0)
    assert liveness.check(130.0) == (Liveness.WAIT, 30.0)
    assert liveness.check(160.0) == (Liveness.PING, 5.0)
    assert liveness.check(165.0) == (Liveness.GONE, 0.0)


def test_the_ack_after_the_ping_keeps_the_peer_even_at_the_same_instant() -> None:
    liveness = PeerLiveness(POLICY, now=0.0)
    assert liveness.check(60.0) == (Liveness.PING, 5.0)
    assert liveness.ping_outstanding
    liveness.heartbeat(60.0)  # the ACK, read before the clock moved
    assert not liveness.ping_outstanding
    assert liveness.check(65.0) == (Liveness.WAIT, 55.0)
    assert liveness.check(120.0) == (Liveness.PING, 5.0)


def test_a_peer_that_pings_on_its_own_is_never_pinged() -> None:
    liveness = PeerLiveness(POLICY, now=0.0)
    now = 0.0
    while now < 600.0:
        verdict, delay = liveness.check(now)
        assert verdict is Liveness.WAIT
        now += min(delay, 40.0)
        liveness.heartbeat(now)


def test_a_peer_that_talks_without_heartbeats_is_pinged_once_an_interval_and_kept() -> None:
    """Input other than a heartbeat proves the peer is there (never GONE), but only
    a heartbeat keeps a quiet stream open: such a peer is still asked once a minute."""
    liveness = PeerLiveness(POLICY, now=0.0)
    verdicts = []
    now = 0.0
    while now < 300.0:
        verdict, delay = liveness.check(now)
        verdicts.append((now, verdict))
        assert verdict is not Liveness.GONE
        now += min(delay, 4.0)
        liveness.heard()  # a WINDOW_UPDATE, a new request: anything but a PING or its ACK
    assert [t for t, v in verdicts if v is Liveness.PING] == [60.0, 120.0, 180.0, 240.0]


def test_an_interval_below_the_timeout_pings_each_interval_and_waits_out_the_timeout() -> None:
    liveness = PeerLiveness(KeepalivePolicy(interval=1.0, timeout=5.0), now=0.0)
    assert liveness.check(1.0) == (Liveness.PING, 1.0)
    liveness.heartbeat(1.25)  # the ACK
    assert liveness.check(2.0) == (Liveness.WAIT, 0.25)
    assert liveness.check(2.25) == (Liveness.PING, 1.0)
    assert liveness.check(3.25) == (Liveness.WAIT, 4.0)  # no answer yet: not gone before 5 s
    assert liveness.check(7.25) == (Liveness.GONE, 0.0)


def test_a_server_that_is_not_listening_neither_pings_nor_gives_up() -> None:
    liveness = PeerLiveness(POLICY, now=0.0)
    assert liveness.check(60.0) == (Liveness.PING, 5.0)
    liveness.not_listening(65.0)
    assert liveness.check(65.0) == (Liveness.WAIT, 60.0)


# -- the server ------------------------------------------------------------------------------------


def pings_from_server(peer: RawPeer) -> list[PingFrame]:
    return [f for f in peer.frames if isinstance(f, PingFrame) and "ACK" not in f.flags]


def more_pings_than(count: int) -> Callable[[RawPeer], bool]:
    return lambda peer: len(pings_from_server(peer)) > count


def acked(count: int) -> Callable[[RawPeer], bool]:
    """Until the server has ACKed `count` of the peer's PINGs."""
    return lambda peer: (
        count <= sum(isinstance(f, PingFrame) and "ACK" in f.flags for f in peer.frames)
    )


async def answer_pings(peer: RawPeer, *, until: float) -> None:
    """Read the server's frames and ACK each of its PINGs, until trio's clock says `until`."""
    answered = 0
    with trio.move_on_at(until):
        while not peer.closed:
            await peer.read_until(more_pings_than(answered), within=1e9)
            for ping in pings_from_server(peer)[answered:]:
                await peer.send(PingFrame(0, opaque_data=ping.opaque_data, flags=["ACK"]))
                answered += 1


async def test_a_silent_subscriber_is_closed_and_released_after_interval_and_timeout(
    io_clock: trio.testing.MockClock,
) -> None:
    """A peer that subscribes and then goes silent without closing its socket (its
    host died): it never answers the PING, so it is closed and its subscription
    released 65 s after it was last heard, well before the idle rule's 120 s."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        client_id = await peer.register(1)
        await peer.subscribe(3, "CCAgent", client_id)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
        last_heard = trio.current_time()
        # It reads (and so sees the PING) but never sends again.
        await peer.read_until(lambda p: False, within=300)
        assert peer.closed
        assert trio.current_time() - last_heard == pytest.approx(65.0, abs=0.5)
        assert server.connections.closed_by_server[KEEPALIVE_TIMEOUT] == 1
        await wait_until(lambda: all_released(server), what="the silent peer's subscription")
        assert len(pings_from_server(peer)) == 1


async def subscribed_raw_peer(server: ServerHarness, peer: RawPeer, role: str = "CCAgent") -> str:
    """Handshake, Register and Subscribe (stream 3) on a raw peer: its client id."""
    await peer.handshake()
    client_id = await peer.register(1)
    await peer.subscribe(3, role, client_id)
    await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
    return client_id


def data_on(stream_id: int) -> Callable[[RawPeer], bool]:
    return lambda peer: any(
        isinstance(f, DataFrame) and f.stream_id == stream_id and f.data for f in peer.frames
    )


async def test_a_quiet_subscriber_that_only_answers_server_pings_is_never_idle(
    io_clock: trio.testing.MockClock,
) -> None:
    """A client with default gRPC options (no PING of its own) on a quiet cluster:
    ten minutes, five times the idle rule's 120 s, on the same stream, which then
    delivers. Its ACKs of the server's keepalive PINGs are its heartbeats."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await subscribed_raw_peer(server, peer)
        started = trio.current_time()
        await answer_pings(peer, until=started + 600.0)
        assert not peer.closed and peer.goaway() is None
        assert 3 not in peer.ended_streams()
        assert len(pings_from_server(peer)) >= 9
        server.broadcaster.publish([make_job(1)])
        await peer.read_until(data_on(3))
        assert not peer.closed and 3 not in peer.ended_streams()
        assert server.broadcaster.stats.stream_ends["idle"] == 0
        assert server.connections.closed_by_server[KEEPALIVE_TIMEOUT] == 0


async def test_a_subscriber_that_stops_reading_is_released_within_keepalive_time_and_timeout(
    io_clock: trio.testing.MockClock,
) -> None:
    """A raw connection that subscribes and then neither reads nor sends (a hung
    process): the server's PING goes unanswered, so the connection is dropped and
    the subscription and its id are freed 65 s after the subscribe."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        client_id = await subscribed_raw_peer(server, peer)
        subscribed_at = trio.current_time()
        await wait_until(lambda: all_released(server), within=300, what="the hung peer")
        released_after = trio.current_time() - subscribed_at
        assert released_after == pytest.approx(65.0, abs=0.5)
        assert server.connections.closed_by_server[KEEPALIVE_TIMEOUT] == 1
        with pytest.raises(Refused):
            server.registry.claim(client_id, "CCAgent", trio.current_time(), address="127.0.0.1")


async def test_an_ack_nobody_asked_for_is_no_heartbeat(
    io_clock: trio.testing.MockClock,
) -> None:
    """Unsolicited PING ACKs (a peer working around the ping-flood rule) do not keep
    a quiet stream open: it ends at the idle rule's 120 s after the subscribe."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await subscribed_raw_peer(server, peer)
        subscribed_at = trio.current_time()
        with trio.move_on_after(119.0):
            while True:
                await trio.sleep(20.0)
                await peer.send(PingFrame(0, opaque_data=b"unasked!", flags=["ACK"]))
        assert server.broadcaster.subscribers
        await peer.read_until(lambda p: 3 in p.ended_streams(), within=30)
        assert trio.current_time() - subscribed_at == pytest.approx(120.0, abs=0.5)
        assert dict(peer.headers[3]).get("grpc-status") == "14"


async def test_a_peer_that_answers_stays_and_is_pinged_once_a_quiet_minute(
    io_clock: trio.testing.MockClock,
) -> None:
    """A connection without streams whose peer ACKs every PING: kept for ten
    minutes, with one PING per 60 s of silence."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        started = trio.current_time()
        await answer_pings(peer, until=started + 610.0)
        assert not peer.closed and peer.goaway() is None
        assert len(server.connections) == 1
        assert len(pings_from_server(peer)) == 10
        assert server.connections.closed_by_server[KEEPALIVE_TIMEOUT] == 0


async def test_a_peer_that_pings_on_its_own_is_not_pinged(
    io_clock: trio.testing.MockClock,
) -> None:
    """Anything read from the peer proves it is there: a client with keepalive
    every 30 s (its PINGs within the ping policy) never gets a server PING."""
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        for sent in range(1, 11):
            await trio.sleep(30.0)
            await peer.send(PingFrame(0, opaque_data=b"client!!"))
            await peer.read_until(acked(sent))
        await trio.sleep(50.0)
        with trio.move_on_after(1.0):
            await peer.read_until(lambda p: False)
        assert not peer.closed
        assert pings_from_server(peer) == []
        assert len(server.connections) == 1


async def test_a_peer_whose_input_the_pacer_holds_is_not_taken_for_gone(
    io_clock: trio.testing.MockClock,
) -> None:
    """While its input waits for its address's control-frame pacer, the server
    is not reading from the peer, so it cannot hear it: such a connection is
    kept past the keepalive's 65 s and its request is answered when its turn
    comes."""
    limits = ProtocolLimits(max_control_frames_per_second_per_ip=1)
    async with (
        open_jobsignal_server(local_settings(protocol_limits=limits)) as server,
        raw_peer(server.port, source=OTHER_LOOPBACK) as peer,
    ):
        await peer.handshake()
        started = trio.current_time()
        await peer.send(*[WindowUpdateFrame(0, window_increment=1)] * (FREE_CONTROL_FRAMES + 200))
        await wait_until(lambda: server.connections.input_held >= 1)
        await peer.send(
            peer.headers_frame(1, grpc_request_headers(server.port)),
            DataFrame(1, register_body(), flags=["END_STREAM"]),
        )
        await peer.read_until(lambda p: 1 in p.ended_streams(), within=300)
        assert dict(peer.headers[1]).get("grpc-status") == "0"
        assert trio.current_time() - started > 80.0
        assert server.connections.closed_by_server[KEEPALIVE_TIMEOUT] == 0


async def test_a_quiet_grpcio_subscriber_answers_server_keepalive_and_stays(
    grpc_clients: GrpcioClients,
) -> None:
    """The official grpcio client with no keepalive of its own, quiet for twice the
    idle timeout: it answers the server's PINGs, which keeps its stream open, and
    the same stream delivers. Real clock, scaled down (QUICK_KEEPALIVE's half
    second, QUICK_IDLE_TIMEOUT's 2 s)."""
    settings = local_settings(
        keepalive=QUICK_KEEPALIVE, session=SessionSettings(idle_timeout=QUICK_IDLE_TIMEOUT)
    )
    async with trio.open_nursery() as nursery, open_jobsignal_server(settings) as server:
        client = grpc_clients.connect(server.target)
        client_id = await in_thread(client.register_id, "CCAgent")
        stream = GrpcioStream(client.subscribe("CCAgent", client_id, timeout=60)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
        (protocol,) = server.connections.protocols()
        own_pings = protocol.activity.pings_received
        await trio.sleep(2 * QUICK_IDLE_TIMEOUT)
        assert protocol.liveness.pings_sent >= 3
        assert protocol.activity.ping_acks_received >= 3
        # No keepalive of its own: its only heartbeats were ACKs.
        assert protocol.activity.pings_received == own_pings
        server.broadcaster.publish([make_job(1)])
        await stream.wait_for(1)
        assert server.broadcaster.stats.stream_ends["idle"] == 0
        assert server.connections.closed_by_server[KEEPALIVE_TIMEOUT] == 0
        client.close()
        await stream.wait_end()
