"""Counters of the fan-out path, shared by the broadcaster and every stream.

Plain integers and one histogram, incremented on the hot path; `jobsignal.metrics`
reads them at scrape time.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobsignal.fanout.subscriber import EndReason

# Seconds from the watcher seeing an event to its bytes being handed to the
# client's connection: sub-millisecond to a slow client's many seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Histogram:
    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.count += times

    def cumulative_buckets(self) -> list[tuple[str, float]]:
        """(le, observations <= le) per bound, ending with +Inf: the exposition's buckets."""
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            cumulative += count
            buckets.append((str(float(bound)), cumulative))  # 1 -> "1.0", as clients write it
        buckets.append(("+Inf", self.count))
        return buckets


@dataclass
class FanoutStats:
    """Counters of the fan-out path, shared by the broadcaster and every stream."""

    events_published: int = 0
    messages_queued: int = 0
    messages_delivered: int = 0
    coalesced: int = 0
    rank_tables_stripped: int = 0
    # Batches written straight from the subscriber's trio task, and batches that
    # had to wait for HTTP/2 (flow control, a full socket) through asyncio.
    batches_written_at_once: int = 0
    batches_written_waiting: int = 0
    # Batches of one message sent by `publish` itself to a stream whose task was parked.
    batches_written_from_publish: int = 0
    # Job events that could not be encoded or queued, by where it failed.
    events_dropped: Counter[str] = field(default_factory=Counter)
    # Streams ended, by `EndReason` value (the metrics' label); see `stream_ended`.
    stream_ends: Counter[str] = field(default_factory=Counter)
    delivery_latency: Histogram = field(default_factory=Histogram)

    def stream_ended(self, reason: EndReason) -> None:
        self.stream_ends[reason.value] += 1
