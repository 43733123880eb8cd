"""The microbenchmarks measure real deliveries and answers (bench/micro_session.py,
micro_publish.py, micro_input.py)."""

from __future__ import annotations

import math

from bench.micro_input import measure as measure_input
from bench.micro_publish import measure as measure_publish
from bench.micro_session import measure
from jobsignal.rpc.connections import ObservedH2Protocol


async def test_every_subscriber_gets_every_event_and_the_cost_is_a_number() -> None:
    result = await measure(subscribers=5, events=3)
    assert result["delivered"] == 15
    assert math.isfinite(result["us_per_delivery"]) and result["us_per_delivery"] > 0


async def test_publish_sends_to_every_raw_subscriber_itself() -> None:
    """bench/micro_publish.py: every event reaches every subscriber from publish."""
    result = await measure_publish(subscribers=3, events=5)
    assert result["from_publish"] == 15
    assert math.isfinite(result["us_per_subscriber"]) and result["us_per_subscriber"] > 0


async def test_every_subscribers_answer_is_timed_on_the_server() -> None:
    """bench/micro_input.py: each round, every subscriber's WINDOW_UPDATE and PING
    reach the server in one read each, and the timing wrapper is gone afterwards."""
    before = ObservedH2Protocol.data_received
    result = await measure_input(subscribers=3, events=4)
    assert result["reads_per_round_median"] == 3
    assert math.isfinite(result["us_per_answer_median"]) and result["us_per_answer_median"] > 0
    assert ObservedH2Protocol.data_received is before
