"""Random HTTP/2 input against the real server, next to a healthy subscriber.

Throwing random frames at a server found five faults the targeted tests had
missed (tests/rpc/test_odd_requests.py, and a window below zero that made
the server spin for ever: tests/rpc/test_whole_messages.py). These seeded
runs keep that search going on every CI run, bounded in count and time,
with what must hold whatever a peer sends:

- no connection is closed for an error of the server's own
  ("internal_error") and nothing is logged at ERROR;
- a healthy subscriber on its own connection receives every event, whole;
- once the hostile connections are gone, so are their streams and
  subscriptions;
- a hostile peer that takes part in the protocol (subscribes, then moves its
  windows and settings about) gets whole messages, and all of them once it
  opens its windows: the server's flow-control accounting agrees with the
  peer's.

Raw peers on 127.0.0.1 (`RawPeer`); time is virtual (`io_clock`), so the
whole run takes a few seconds of real time. A failure names its seed.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from h2.settings import SettingCodes
from hyperframe.frame import PingFrame, RstStreamFrame, SettingsFrame, WindowUpdateFrame

from jobsignal._proto.job import JobSummarySignal
from jobsignal.rpc.connections import INTERNAL_ERROR
from tests.support.factories import make_job
from tests.support.grpc_server import ServerHarness, open_jobsignal_server
from tests.support.h2_fuzz import FrameMaker
from tests.support.waiting import wait_until

from .test_hostile_h2 import PREFACE, RawPeer, raw_peer
from .test_whole_messages import cut_bytes, interrupted_after, messages

pytestmark = pytest.mark.usefixtures("nothing_logged_at_error")

HOSTILE_CONNECTIONS = 120
PLAYING_CONNECTIONS = 30
HEALTHY_STREAM = 3
INITIAL_WINDOW, MAX_FRAME = SettingCodes.INITIAL_WINDOW_SIZE, SettingCodes.MAX_FRAME_SIZE


@asynccontextmanager
async def healthy_subscriber(server: ServerHarness) -> AsyncIterator[RawPeer]:
    """A subscriber that reads all the time and pings every 20 s, as a client with
    keepalive does: a run takes about a minute of virtual time, past the server's
    keepalive, and publishes more than a socket buffer holds."""
    async with raw_peer(server.port) as peer, trio.open_nursery() as nursery:
        await peer.subscribe_wide_open("CCAgent")
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
        nursery.start_soon(read_and_ping, peer)
        yield peer
        nursery.cancel_scope.cancel()


async def read_and_ping(peer: RawPeer) -> None:
    """Until the server closes the connection (which fails the test's checks)."""
    while True:
        await read_for(peer, 20.0)
        if peer.closed:
            return
        await peer.send(PingFrame(0, opaque_data=b"healthy!"))


async def publishing(server: ServerHarness, count: int) -> None:
    """`count` events, one every 0.1 s, each a job of its own (none coalesced)."""
    for index in range(count):
        server.broadcaster.publish([make_job(index)])
        await trio.sleep(0.1)


async def read_for(peer: RawPeer, seconds: float) -> None:
    with trio.move_on_after(seconds):
        await peer.read_until(lambda p: False, within=seconds + 1)


async def assert_all_released(server: ServerHarness) -> None:
    """Only the healthy subscriber's connection and subscription are left."""
    await wait_until(lambda: len(server.connections) == 1, what="the hostile connections gone")
    await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
    await wait_until(lambda: server.registry.active_subscriptions() == 1)


async def hostile_connection(server: ServerHarness, seed: int) -> None:
    """One connection's worth of random frames, sent in random pieces."""
    rng = random.Random(seed)
    maker = FrameMaker(rng, f"127.0.0.1:{server.port}")
    preface = PREFACE if rng.random() < 0.95 else PREFACE[: rng.randrange(len(PREFACE))]
    data = preface + SettingsFrame(0).serialize() + maker.frames(rng.randint(1, 30), wrong=0.05)
    async with raw_peer(server.port) as peer:
        # Whatever SETTINGS_HEADER_TABLE_SIZE it sent, this peer reads what comes.
        peer.decoder.max_allowed_table_size = 2**32
        position = 0
        while position < len(data) and not peer.closed:
            piece = rng.choice((len(data), 9, 100, 1_000))
            try:
                await peer.send(data[position : position + piece])
            except trio.BrokenResourceError:  # closed by the server: its right
                break
            position += piece
            await read_for(peer, rng.choice((0.0, 0.05, 0.5)))
        await read_for(peer, 0.1)  # what it started runs before it goes


@pytest.mark.slow
async def test_random_frames_hurt_no_one_but_their_sender(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_jobsignal_server() as server, healthy_subscriber(server) as healthy:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publishing, server, 50)
            for seed in range(HOSTILE_CONNECTIONS):
                with interrupted_after(30.0):
                    await hostile_connection(server, seed)
        await wait_until(lambda: len(messages(healthy, HEALTHY_STREAM)) == 50)
        received = [JobSummarySignal.parse(m).job_name for m in messages(healthy, HEALTHY_STREAM)]
        assert received == [f"train-{index}" for index in range(50)]
        await assert_all_released(server)
        assert server.connections.closed_by_server[INTERNAL_ERROR] == 0


async def playing_connection(server: ServerHarness, seed: int) -> None:
    """A peer that subscribes, then moves its windows and settings about at random
    while events (some larger than any window it grants) are published; then it
    opens its windows wide, and every message must come whole."""
    rng = random.Random(seed)
    async with raw_peer(server.port) as peer:
        await peer.handshake()
        role = rng.choice(("FdAgent", "DefaultUser1"))  # FdAgent: a snapshot first
        client_id = await peer.register(1, role)
        window = rng.choice((0, 1, 100, 5_000, 65_535))
        await peer.send(SettingsFrame(0, settings={INITIAL_WINDOW: window}))
        await peer.subscribe(3, role, client_id)
        reset = False
        for _ in range(rng.randint(5, 40)):
            move = rng.randrange(8)
            if move == 0:
                server.broadcaster.publish([make_job(rng.randrange(1_000), npus=256)])
            elif move == 1:
                size = rng.choice((0, 1, 1_000, 65_535, 2**20))
                await peer.send(SettingsFrame(0, settings={INITIAL_WINDOW: size}))
            elif move == 2:
                frame_size = rng.choice((16_384, 2**24 - 1))
                await peer.send(SettingsFrame(0, settings={MAX_FRAME: frame_size}))
            elif move in (3, 4):
                increment = rng.choice((1, 100, 10_000, 2**20))
                await peer.send(WindowUpdateFrame(rng.choice((0, 3)), window_increment=increment))
            elif move == 5 and rng.random() < 0.1:
                await peer.send(RstStreamFrame(3, error_code=8))
                reset = True
            await read_for(peer, rng.choice((0.0, 0.01, 0.2)))
        if reset or peer.closed:
            return
        # Wide open: no window can pass 2**31 - 1 (the moves added at most 2**26).
        await peer.send(
            SettingsFrame(0, settings={INITIAL_WINDOW: 2**20}),
            WindowUpdateFrame(0, window_increment=2**30),
            WindowUpdateFrame(3, window_increment=2**30),
        )
        with trio.move_on_after(10.0):
            await peer.read_until(lambda p: not cut_bytes(p, 3), within=11.0)
        assert not cut_bytes(peer, 3), f"seed {seed}: a message never finished"


@pytest.mark.slow
async def test_peers_moving_their_windows_about_get_whole_messages(
    io_clock: trio.testing.MockClock,
) -> None:
    async with open_jobsignal_server() as server, healthy_subscriber(server) as healthy:
        for index in range(3):  # for the snapshots
            server.broadcaster.publish([make_job(10_000 + index, npus=256)])
        for seed in range(PLAYING_CONNECTIONS):
            with interrupted_after(30.0):
                await playing_connection(server, seed)
        await trio.sleep(1.0)
        assert all(JobSummarySignal.parse(m).job_id for m in messages(healthy, HEALTHY_STREAM))
        await assert_all_released(server)
        assert server.connections.closed_by_server[INTERNAL_ERROR] == 0
