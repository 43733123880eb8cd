"""The ping-flood rule (`rpc.activity.ConnectionActivity.ping_received`,
--min-client-ping-interval and --ping-strikes) in virtual time: what counts
as a strike, what forgives one, and when the connection is a flood.
tests/rpc/test_pings.py checks it end to end against grpcio's keepalive, on the
real clock."""

from __future__ import annotations

import trio
import trio.testing

from jobsignal.rpc.activity import TIMER_SLACK, ConnectionActivity, PingPolicy

POLICY = PingPolicy(min_interval=4.0, max_strikes=2)


def connection() -> ConnectionActivity:
    return ConnectionActivity(POLICY, "10.0.0.1:5000")


async def test_pings_at_the_interval_are_heartbeats_never_strikes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    activity = connection()
    beats: list[float] = []
    activity.heartbeat_listeners.add(lambda: beats.append(trio.current_time()))
    for _ in range(20):
        assert activity.ping_received()
        # A timer may fire a little early: up to TIMER_SLACK under the interval is fine.
        await trio.sleep(POLICY.min_interval * (1 - TIMER_SLACK) + 0.001)
    assert (activity.strikes, activity.pings_received, len(beats)) == (0, 20, 20)


async def test_pings_too_close_together_strike_until_the_connection_is_a_flood(
    autojump_clock: trio.testing.MockClock,
) -> None:
    activity = connection()
    assert activity.ping_received()  # the first one has nothing to be close to
    for strike in range(1, POLICY.max_strikes + 1):
        await trio.sleep(POLICY.min_interval * (1 - TIMER_SLACK) - 0.01)
        assert activity.ping_received()
        assert activity.strikes == strike
    await trio.sleep(0.1)
    beats: list[None] = []
    activity.heartbeat_listeners.add(lambda: beats.append(None))
    assert not activity.ping_received()  # one strike past the limit
    assert beats == []  # a flood's ping is not a heartbeat


async def test_data_sent_since_the_last_ping_forgives_the_strikes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client may ping as often as it likes while the server sends it data
    (grpc-go's BDP probes do), as grpc-go's own server policy allows."""
    activity = connection()
    for _ in range(50):
        activity.note_sent()
        assert activity.ping_received()
        await trio.sleep(0.01)
    assert activity.strikes == 0
    # Without data between them, the strikes count again from zero.
    for _ in range(POLICY.max_strikes):
        assert activity.ping_received()
    assert not activity.ping_received()


async def test_a_slow_ping_after_strikes_does_not_clear_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    activity = connection()
    activity.ping_received()
    activity.ping_received()  # strike 1
    await trio.sleep(POLICY.min_interval * 10)
    assert activity.ping_received()
    assert activity.strikes == 1  # only data sent forgives
