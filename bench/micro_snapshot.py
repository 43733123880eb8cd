"""Micro measurement: what a new subscriber's snapshot costs the loop.

    python -m bench.micro_snapshot [--jobs 10000] [--servers 2] [--rounds 3]

A job store holding `--jobs` jobs (`--servers` servers each, as the bench's
LIST of 10,000), then, in one trio run, one after another: the first List
subscriber (nothing encoded yet), a second one, an FdAgent (a Signal
snapshot) and an in-process consumer (`subscribe_events`). For each: the
seconds from subscribing until its snapshot is queued, and the longest time
the loop went without running another task meanwhile (a ticker task
records it). Prints one JSON line, medians of `--rounds`. An older tree
(`PYTHONPATH=<old tree>`) that composed the snapshot inside `subscribe` is
measured the same way: there the subscribe call is the stall.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Awaitable, Callable

import trio

from bench.store_apply import NOW, objects_of
from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.store import JobStore

CASES = ("first_list", "second_list", "signal_snapshot", "in_process")


async def composed(queue: object) -> None:
    """Until the queue's snapshot is composed (at once where subscribe did it)."""
    compose: Callable[[], Awaitable[None]] | None = getattr(queue, "compose_snapshot", None)
    if compose is not None:
        await compose()


async def one_round(store: JobStore) -> dict[str, float]:
    broadcaster = Broadcaster(jobs=store)
    figures: dict[str, float] = {}
    longest = 0.0
    ticks = 0

    async def ticker() -> None:
        nonlocal longest, ticks
        last = time.perf_counter()
        while True:
            await trio.lowlevel.checkpoint()
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now
            ticks += 1

    async def ticked() -> None:
        """Until the ticker has run again (it may come after this task in a turn)."""
        seen = ticks
        while ticks == seen:
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.lowlevel.checkpoint()
        for case in CASES:
            await (
                trio.lowlevel.checkpoint()
            )  # the ticker runs: stalls before this case are not counted
            longest = 0.0
            started = time.perf_counter()
            if case == "in_process":
                await composed(broadcaster.subscribe_events(snapshot=True))
            else:
                kind = StreamKind.SIGNAL if case == "signal_snapshot" else StreamKind.LIST
                await composed(broadcaster.subscribe(kind, "FdAgent", case, snapshot=True))
            figures[f"{case}_s"] = time.perf_counter() - started
            await ticked()
            figures[f"{case}_longest_stall_s"] = longest
        nursery.cancel_scope.cancel()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    objects = [
        obj
        for i in range(args.jobs)
        for obj in objects_of(
            ClusterdJob("ns", f"j{i}", f"uid-{i}", servers=args.servers), "running"
        )
    ]
    rounds = []
    for _ in range(args.rounds):
        store = JobStore()
        store.replace_all(objects, NOW)
        rounds.append(trio.run(one_round, store))
    result: dict[str, float] = {"jobs": args.jobs, "servers": args.servers}
    for key in rounds[0]:
        result[key] = round(statistics.median(r[key] for r in rounds), 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
