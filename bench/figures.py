"""Figures the scenarios compute from what they measured: medians, latency
percentiles, how evenly subscribers were served."""

from __future__ import annotations

import math
from typing import Any


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if not ordered:
        return math.nan
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def latency_summary(samples_ns: list[int]) -> dict[str, Any]:
    """p50 / p99 / max in milliseconds (nearest rank) of latencies in nanoseconds."""
    if not samples_ns:
        return {"samples": 0, "p50_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}
    ordered = sorted(samples_ns)
    count = len(ordered)

    def rank(q: float) -> float:
        return ordered[min(count - 1, max(0, math.ceil(q * count) - 1))] / 1e6

    return {
        "samples": count,
        "p50_ms": rank(0.50),
        "p99_ms": rank(0.99),
        "max_ms": ordered[-1] / 1e6,
    }


def fairness(received: list[int], connections: int) -> dict[str, Any]:
    """How evenly the subscribers were served: their received counts (min, median,
    max, how many got nothing, the share within 10 % of the median) and, when
    they share connections (subscriber i on connection i mod `connections`),
    the totals per connection."""
    if not received:
        return {"min": 0, "median": math.nan, "max": 0, "starved": 0, "within_10pct": math.nan}
    middle = median([float(count) for count in received])
    within = sum(1 for count in received if abs(count - middle) <= 0.1 * middle)
    summary: dict[str, Any] = {
        "subscribers": len(received),
        "min": min(received),
        "median": middle,
        "max": max(received),
        "starved": sum(1 for count in received if count == 0),
        "within_10pct": within / len(received) if middle else math.nan,
    }
    if connections < len(received):
        totals = [sum(received[index::connections]) for index in range(connections)]
        summary["per_connection_min"] = min(totals)
        summary["per_connection_max"] = max(totals)
    return summary
