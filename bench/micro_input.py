"""Microbenchmark of a client's answer to each message: server time per WINDOW_UPDATE + PING.

    python -m bench.micro_input [--subscribers 100] [--events 200]

A grpc-go client answers every message it reads with a connection
WINDOW_UPDATE and a PING (its bandwidth estimate), written together; the
server owes a PING ACK. This runs jobsignal's real gRPC server in this
process and `--subscribers` raw HTTP/2 subscribers on 127.0.0.1, one
connection each, publishes one event at a time and has every subscriber
answer its message that way. The figure is the time the server spends in
its connections' `data_received` per answer (the frames' handling, the
budgets, the event processing; the ACK's write is left to the next message,
docs/architecture.md section 6), not the clients'. Prints one JSON line;
FINDINGS.md quotes it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import h2.events
import trio

from bench.common import ROLES, run_micro
from bench.events import make_jobs
from bench.micro_publish import RawSubscriber, serving, wait_for_subscribers
from jobsignal.fanout import Broadcaster
from jobsignal.rpc.connections import ObservedH2Protocol


class AnsweringSubscriber(RawSubscriber):
    """A subscriber with h2's default windows that answers each message as grpc-go does."""

    async def answer_one_message(self, round_number: int) -> None:
        """Read until a message arrives, then send the WINDOW_UPDATE and PING."""
        while True:
            data = await self.stream.receive_some(1 << 20)
            if not data:
                raise EOFError("the server closed the connection")
            received = [
                event
                for event in self.h2.receive_data(data)
                if isinstance(event, h2.events.DataReceived) and event.stream_id is not None
            ]
            for event in received:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if received:
                break
        self.h2.increment_flow_control_window(300)
        self.h2.ping(round_number.to_bytes(8, "big"))
        await self.stream.send_all(self.h2.data_to_send())


class InputClock:
    """Time spent in the server connections' `data_received`, while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        original = ObservedH2Protocol.data_received

        def timed(protocol: ObservedH2Protocol, data: bytes) -> None:
            started = time.perf_counter()
            try:
                original(protocol, data)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        setattr(ObservedH2Protocol, "data_received", timed)  # noqa: B010
        try:
            yield
        finally:
            setattr(ObservedH2Protocol, "data_received", original)  # noqa: B010

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


async def measure(subscribers: int, events: int) -> dict[str, Any]:
    clock = InputClock()
    with clock.installed():
        return await measure_with(clock, subscribers, events)


async def measure_with(clock: InputClock, subscribers: int, events: int) -> dict[str, Any]:
    broadcaster = Broadcaster()
    async with serving(broadcaster) as running:
        peers = []
        for _ in range(subscribers):
            peer = AnsweringSubscriber(
                await trio.open_tcp_stream("127.0.0.1", running.port), running.port
            )
            await peer.subscribe(ROLES[0], wide_open=False)
            peers.append(peer)
        await wait_for_subscribers(broadcaster, subscribers)
        jobs = make_jobs(50, servers=1)
        per_answer: list[float] = []
        calls: list[int] = []
        for event in range(events + 1):  # the first round sends the response headers too
            async with trio.open_nursery() as round_nursery:
                for peer in peers:
                    round_nursery.start_soon(peer.answer_one_message, event + 1)
                await trio.sleep(0.002)  # every subscriber waiting for its message
                clock.reset()
                broadcaster.publish([jobs[event % len(jobs)]])
            await trio.sleep(0.005)  # the last answers handled
            if event:
                per_answer.append(clock.seconds / subscribers)
                calls.append(clock.calls)
        for peer in peers:
            await trio.aclose_forcefully(peer.stream)
    return {
        "subscribers": subscribers,
        "events": events,
        "us_per_answer_median": statistics.median(per_answer) * 1e6,
        "reads_per_round_median": statistics.median(calls),
    }


def main(argv: list[str] | None = None) -> None:
    run_micro("python -m bench.micro_input", measure, subscribers=100, events=200, argv=argv)


if __name__ == "__main__":
    main()
