"""The send-loop microbenchmark measures real deliveries (bench/micro_session.py)."""

from __future__ import annotations

import math

from bench.micro_session import measure


async def test_every_subscriber_gets_every_event_and_the_cost_is_a_number() -> None:
    result = await measure(subscribers=5, events=3)
    assert result["delivered"] == 15
    assert math.isfinite(result["us_per_delivery"]) and result["us_per_delivery"] > 0
