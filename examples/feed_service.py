"""Feed job events into another trio task: a toy inventory of busy servers.

Run it with `python examples/feed_service.py [COUNT]`: jobsignal watches the
embedded demo cluster in-process; one task forwards the events over a trio
memory channel to an "inventory" task, which keeps the servers each running
job holds (from its rank table) and prints a line on every change of the
inventory, COUNT lines in all (default 5).

Back-pressure: the memory channel is small, so a slow inventory makes the
forwarder wait; jobsignal's own queue then keeps only the newest event per
job, and drops the consumer (`jobsignal.FellBehind`) only if it is hopelessly
behind, when starting over from the current state is the cure.
"""

from __future__ import annotations

import sys

import trio

import jobsignal

JobKey = tuple[str, str]


async def forward(
    events: jobsignal.JobEvents, sink: trio.MemorySendChannel[jobsignal.JobEvent]
) -> None:
    async with sink:
        async for event in events:
            await sink.send(event)


async def inventory(
    source: trio.MemoryReceiveChannel[jobsignal.JobEvent], count: int, done: trio.CancelScope
) -> None:
    servers: dict[JobKey, tuple[str, ...]] = {}
    npus: dict[JobKey, int] = {}
    printed = 0
    async with source:
        async for event in source:
            key = event.job.key
            table = event.rank_table() if event.job.job_status == "running" else None
            if table is None or event.kind is jobsignal.EventKind.DELETED:
                changed = servers.pop(key, None) is not None
                npus.pop(key, None)
            else:
                held = tuple(server.server_id for server in table.servers)
                changed = servers.get(key) != held
                servers[key], npus[key] = held, table.npu_count
            if changed:
                busy = sum(len(held) for held in servers.values())
                print(
                    f"inventory: {len(servers)} running jobs, {busy} servers,"
                    f" {sum(npus.values())} NPUs",
                    flush=True,
                )
                printed += 1
                if printed == count:
                    done.cancel()
                    return


async def main(count: int) -> None:
    config = jobsignal.configure(source="demo")
    async with jobsignal.watch_jobs(config) as events, trio.open_nursery() as nursery:
        sink, source = trio.open_memory_channel[jobsignal.JobEvent](8)
        nursery.start_soon(forward, events, sink)
        nursery.start_soon(inventory, source, count, nursery.cancel_scope)


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 5)
