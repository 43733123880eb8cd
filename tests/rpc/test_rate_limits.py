"""The per-address request rates (`rpc.limits.RateLimiter`, behind
--register-rate/--subscribe-rate) in virtual time: the burst, the refill, one
bucket per address, and the table forgetting full buckets. tests/rpc/test_limits.py
checks the same rules end to end through a real client, on the real clock."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from jobsignal.rpc.limits import RateLimiter

RATE, BURST = 4.0, 10


def allowed_in_a_row(limiter: RateLimiter, key: str) -> int:
    count = 0
    while limiter.allow(key):
        count += 1
    return count


async def test_a_burst_is_allowed_then_one_call_per_refilled_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = RateLimiter(RATE, BURST)
    assert allowed_in_a_row(limiter, "10.0.0.1") == BURST
    assert limiter.refused == 1
    await trio.sleep(1 / RATE - 0.01)
    assert not limiter.allow("10.0.0.1")  # not yet a whole token
    await trio.sleep(0.01)
    assert limiter.allow("10.0.0.1")
    assert not limiter.allow("10.0.0.1")
    # Refused calls cost nothing: after 2 s, 8 tokens, however often it was refused.
    for _ in range(100):
        assert not limiter.allow("10.0.0.1")
    await trio.sleep(2.0)
    assert allowed_in_a_row(limiter, "10.0.0.1") == int(2.0 * RATE)
    assert limiter.refused == 2 + 1 + 100 + 1


async def test_a_bucket_refills_to_the_burst_and_no_further(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = RateLimiter(RATE, BURST)
    allowed_in_a_row(limiter, "10.0.0.1")
    await trio.sleep(3600)
    assert allowed_in_a_row(limiter, "10.0.0.1") == BURST


async def test_each_address_has_a_bucket_of_its_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limiter = RateLimiter(RATE, BURST)
    assert allowed_in_a_row(limiter, "10.0.0.1") == BURST
    assert allowed_in_a_row(limiter, "10.0.0.2") == BURST
    await trio.sleep(1 / RATE)
    assert allowed_in_a_row(limiter, "10.0.0.2") == 1


@pytest.mark.parametrize("busy", [True, False])
async def test_full_buckets_are_forgotten_once_the_table_is_large(
    autojump_clock: trio.testing.MockClock, busy: bool
) -> None:
    limiter = RateLimiter(RATE, BURST)
    for i in range(1024):
        limiter.allow(f"10.1.{i // 256}.{i % 256}")  # one token each: not full
    assert len(limiter) == 1024
    if not busy:
        await trio.sleep(1 / RATE)  # every bucket full again
    limiter.allow("10.2.0.1")  # the 1025th address: the table is pruned
    assert len(limiter) == (1025 if busy else 1)
    # A forgotten address starts with a whole burst, as it would have had anyway.
    assert allowed_in_a_row(limiter, "10.1.0.0") == (BURST - 1 if busy else BURST)
