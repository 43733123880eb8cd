"""Microbenchmark of the send loop: CPU per delivered message in `serve_subscription`.

    python -m bench.micro_session [--subscribers 1000] [--events 200]

Runs jobsignal's real `serve_subscription` for each subscriber, with a send
that never waits (so HTTP/2 and sockets are left out), publishes `--events`
job events one at a time and lets every subscriber's task take each one:
what the session itself costs per delivery (task wake-up, queue, idle rule,
send timeout, statistics). Prints one JSON line; FINDINGS.md quotes it.
"""

from __future__ import annotations

import time

import trio
import trio.testing

from bench.common import run_micro
from bench.events import make_jobs
from bench.jobsignal_server import bench_registry
from jobsignal.fanout import Broadcaster, StreamKind
from jobsignal.rpc.activity import ConnectionActivity, PingPolicy
from jobsignal.rpc.session import SessionSettings, serve_subscription

ROLE = "CCAgent"
ADDRESS = "10.0.0.1"


async def measure(subscribers: int, events: int) -> dict[str, float]:
    registry = bench_registry()
    broadcaster = Broadcaster()
    settings = SessionSettings()
    delivered = 0

    async def send(frames: list[bytes]) -> bool:
        nonlocal delivered
        delivered += len(frames)
        return True

    async def subscription(index: int) -> None:
        activity = ConnectionActivity(PingPolicy(), f"peer-{index}", ADDRESS)
        client_id = registry.register(ROLE, trio.current_time(), address=ADDRESS)
        await serve_subscription(
            kind=StreamKind.SIGNAL,
            role=ROLE,
            client_id=client_id,
            registry=registry,
            broadcaster=broadcaster,
            settings=settings,
            activity=activity,
            send=send,
        )

    jobs = make_jobs(50, servers=1)
    async with trio.open_nursery() as nursery:
        for index in range(subscribers):
            nursery.start_soon(subscription, index)
        await trio.testing.wait_all_tasks_blocked()
        started = time.process_time()
        for event in range(events):
            broadcaster.publish([jobs[event % len(jobs)]])
            await trio.testing.wait_all_tasks_blocked()
        cpu = time.process_time() - started
        nursery.cancel_scope.cancel()
    return {
        "subscribers": subscribers,
        "events": events,
        "delivered": delivered,
        "us_per_delivery": cpu / delivered * 1e6 if delivered else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    run_micro("python -m bench.micro_session", measure, subscribers=1000, events=200, argv=argv)


if __name__ == "__main__":
    main()
