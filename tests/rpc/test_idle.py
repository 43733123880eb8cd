"""The idle rule (docs/architecture.md section 3) in virtual time, with the production 120 s."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from grpclib.const import Status

from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.rpc.activity import ConnectionActivity, PingPolicy
from jobsignal.rpc.registry import Refused, Registry
from jobsignal.rpc.session import SendTimedOut, SessionSettings, StreamEnd, serve_subscription
from tests.support.factories import make_job

ROLE = "CCAgent"


class Harness:
    def __init__(self, settings: SessionSettings | None = None, *, direct: bool = False) -> None:
        # direct: messages go out from publish (rpc.writer's write_now), the task stays parked.
        self.direct = direct
        self.registry = Registry(
            roles=[ROLE, "FdAgent"], max_registrations=10, max_subscriptions_per_role=20, ttl=300
        )
        self.broadcaster = Broadcaster()
        self.settings = settings or SessionSettings()
        self.activity = ConnectionActivity(PingPolicy(), "test-peer")
        self.sent_at: list[float] = []
        self.end: StreamEnd | None = None
        self.ended_at: float | None = None
        self.client_id = self.registry.register(ROLE, trio.current_time(), address=self.activity.ip)

    async def send(self, frames: list[bytes]) -> bool:
        self.sent_at.extend(trio.current_time() for _ in frames)
        return True

    def send_now(self, message: bytes) -> bool:
        self.sent_at.append(trio.current_time())
        return True

    async def serve(self, kind: StreamKind = StreamKind.SIGNAL) -> None:
        self.end = await serve_subscription(
            kind=kind,
            role=ROLE,
            client_id=self.client_id,
            registry=self.registry,
            broadcaster=self.broadcaster,
            settings=self.settings,
            activity=self.activity,
            send=self.send,
            send_now=self.send_now if self.direct else None,
        )
        self.ended_at = trio.current_time()

    def assert_released(self) -> None:
        assert not self.broadcaster.subscribers
        assert self.registry.active_subscriptions() == 0
        assert not self.activity.heartbeat_listeners
        with pytest.raises(Refused) as refused:
            self.registry.claim(self.client_id, ROLE, trio.current_time(), address="test-peer")
        assert refused.value.status is Status.FAILED_PRECONDITION


async def test_no_traffic_closes_at_exactly_120s(autojump_clock: trio.testing.MockClock) -> None:
    harness = Harness()
    start = trio.current_time()
    await harness.serve()
    assert harness.ended_at is not None
    assert harness.ended_at - start == pytest.approx(120.0)
    assert harness.end is not None
    assert harness.end.status is Status.UNAVAILABLE
    assert harness.end.message is not None
    assert "idle for 120s without messages or heartbeats" in harness.end.message
    assert harness.end.close_connection_if_unused
    harness.assert_released()


# Both ways a message goes out count as activity: from the stream's task, or from publish.
delivery_paths = pytest.mark.parametrize("direct", [False, True], ids=["task", "from_publish"])


@delivery_paths
async def test_message_at_100s_moves_close_to_220s(
    autojump_clock: trio.testing.MockClock, direct: bool
) -> None:
    harness = Harness(direct=direct)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(harness.serve)
        await trio.sleep(100)
        harness.broadcaster.publish([make_job(1)])
        await trio.sleep(119)
        assert harness.end is None, "closed before 220 s"
    assert harness.sent_at == [pytest.approx(start + 100)]
    assert harness.ended_at is not None
    assert harness.ended_at - start == pytest.approx(220.0)
    harness.assert_released()


@delivery_paths
async def test_a_steady_stream_closes_exactly_120s_after_its_last_message(
    autojump_clock: trio.testing.MockClock, direct: bool
) -> None:
    """Messages move the close without moving a deadline each time (the scope is
    re-armed when it fires): still exactly 120 s after the last one."""
    harness = Harness(direct=direct)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(harness.serve)
        for index in range(25):  # one every 37 s for over fifteen minutes
            await trio.sleep(37)
            harness.broadcaster.publish([make_job(index)])
            assert harness.end is None
        last_message = trio.current_time()
    assert len(harness.sent_at) == 25
    assert harness.ended_at == pytest.approx(last_message + 120)
    harness.assert_released()


async def test_client_pings_keep_a_silent_stream_open(
    autojump_clock: trio.testing.MockClock,
) -> None:
    harness = Harness()
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(harness.serve)
        # gRPC keepalive every 30 s for eleven minutes: no message at all.
        for _ in range(22):
            await trio.sleep(30)
            assert harness.activity.ping_received()
        assert harness.end is None
        assert trio.current_time() - start > 600
        last_ping = trio.current_time()
    assert harness.sent_at == []
    assert harness.ended_at == pytest.approx(last_ping + 120)
    harness.assert_released()


async def test_pings_on_another_connection_do_not_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    harness = Harness()
    other_connection = ConnectionActivity(PingPolicy(), "other-peer")
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(harness.serve)
        for _ in range(10):
            await trio.sleep(30)
            other_connection.ping_received()
    assert harness.ended_at == pytest.approx(start + 120)


async def test_configured_timeout_is_used(autojump_clock: trio.testing.MockClock) -> None:
    harness = Harness(SessionSettings(idle_timeout=7.5))
    start = trio.current_time()
    await harness.serve(StreamKind.LIST)
    # The list stream's snapshot batch counts as a message at t=0.
    assert harness.sent_at == [pytest.approx(start)]
    assert harness.ended_at == pytest.approx(start + 7.5)
    assert harness.end is not None and harness.end.message is not None
    assert "idle for 7.5s" in harness.end.message


async def test_a_send_that_times_out_ends_with_resource_exhausted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The sender applies the send timeout (`StreamWriter`, tests/rpc/test_shutdown.py
    with a real peer that stops reading); the session ends the stream as too slow."""
    harness = Harness(SessionSettings(idle_timeout=120, send_timeout=60))

    async def times_out(frames: list[bytes]) -> bool:
        await trio.sleep(harness.settings.send_timeout)
        raise SendTimedOut

    harness.send = times_out  # type: ignore[method-assign]
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(harness.serve)
        await trio.sleep(1)
        harness.broadcaster.publish([make_job(1)])
    assert harness.end is not None
    assert harness.end.status is Status.RESOURCE_EXHAUSTED
    assert harness.ended_at == pytest.approx(start + 61)
    harness.assert_released()


async def test_cancellation_releases_everything(autojump_clock: trio.testing.MockClock) -> None:
    harness = Harness()
    with trio.move_on_after(30):
        await harness.serve()
    assert harness.end is None
    harness.assert_released()
