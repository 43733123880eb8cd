"""Microbenchmark of the fan-out hot loop: `Broadcaster.publish` per subscriber push.

    python -m bench.micro [--subscribers 1000,5000] [--events 16]

Measures jobsignal's real `Broadcaster.publish`, with the garbage collector
as it is and with the long-lived objects frozen (`gc.freeze()`, which the
server does after its first LIST), plus the cost of a trio -> asyncio hop.
FINDINGS.md records what the first version cost (3.4 us per push at 1,000
subscribers) and why; the shared queue entry it proposed is now in
`Broadcaster.publish`. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from typing import Any

import trio

from bench.events import make_jobs, stamped
from jobsignal.fanout import Broadcaster, StreamKind, Subscriber
from jobsignal.store import JobSummary


def _measure(
    publish: Callable[[list[JobSummary]], None],
    subscribers: list[Subscriber],
    jobs: list[JobSummary],
    rounds: int,
) -> float:
    """Median µs per subscriber push over `rounds` publishes of `jobs`."""
    costs = []
    for _ in range(rounds):
        for subscriber in subscribers:
            subscriber._pending.clear()
            subscriber._pending_bytes = 0
        batch = [stamped(job, time.time_ns()) for job in jobs]
        started = time.perf_counter()
        publish(batch)
        costs.append((time.perf_counter() - started) * 1e6 / (len(jobs) * len(subscribers)))
    costs.sort()
    return costs[len(costs) // 2]


async def _run(counts: list[int], events: int, ballast: int, rounds: int) -> dict[str, Any]:
    jobs = make_jobs(events, 2)
    # Long-lived objects like a busy server's (connections, h2 state, tasks).
    heap: list[list[None]] = [[None] for _ in range(ballast)]
    results: dict[str, Any] = {"events": events, "heap_objects": len(gc.get_objects())}
    rows = []
    for count in counts:
        broadcaster = Broadcaster()
        subscribers = [
            broadcaster.subscribe(StreamKind.SIGNAL, "CCAgent", f"id-{i}", snapshot=False)
            for i in range(count)
        ]
        row: dict[str, Any] = {"subscribers": count}
        for gc_mode in ("gc", "frozen"):
            if gc_mode == "frozen":
                gc.collect()
                gc.freeze()
            row[f"publish_{gc_mode}_us"] = _measure(broadcaster.publish, subscribers, jobs, rounds)
            if gc_mode == "frozen":
                gc.unfreeze()
        rows.append(row)
        for subscriber in subscribers:
            broadcaster.unsubscribe(subscriber)
    del heap
    results["rows"] = rows
    return results


async def _noop() -> None:
    pass


async def _hop_cost(tasks: int, hops: int) -> float:
    """µs per trio -> asyncio -> trio round trip (`aio_as_trio`), `tasks` hopping at once."""
    import trio_asyncio

    async with trio_asyncio.open_loop():
        hop = trio_asyncio.aio_as_trio(_noop)
        go = trio.Event()
        done = 0

        async def worker() -> None:
            nonlocal done
            await go.wait()
            for _ in range(max(1, hops // tasks)):
                await hop()
                done += 1

        async with trio.open_nursery() as nursery:
            for _ in range(tasks):
                nursery.start_soon(worker)
            await trio.sleep(0.05)
            started = time.perf_counter()
            go.set()
        return (time.perf_counter() - started) * 1e6 / done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--subscribers", default="1000,5000")
    parser.add_argument("--events", type=int, default=16)
    parser.add_argument("--ballast", type=int, default=1_000_000, help="long-lived objects")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hops", type=int, default=20_000)
    args = parser.parse_args()
    counts = [int(n) for n in args.subscribers.split(",")]
    result = trio.run(_run, counts, args.events, args.ballast, args.rounds)
    result["hop_us"] = {
        str(tasks): trio.run(_hop_cost, tasks, args.hops) for tasks in (1, counts[-1])
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
