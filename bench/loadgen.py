"""A load generator: many job.Job subscribers in one process, on grpc.aio.

    python -m bench.loadgen --target 127.0.0.1:PORT --count N [--stall K] [--deadline S]

Each subscriber has its own channel (its own TCP connection, as separate
client programs would), registers, subscribes to SubscribeJobSummarySignal,
and counts what arrives. The latency of a message is its arrival time minus
the publish time the server stamped into `sid`. The first `--stall`
subscribers stop reading on the `stall` command (slow-client scenario); their
messages are counted apart. Commands and replies are JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from array import array
from typing import Any

import grpc

from bench.common import (
    MAX_MESSAGE_BYTES,
    ROLE,
    answer_commands_on_asyncio,
    emit,
    load_stubs,
    run_child,
)

job_pb2, job_pb2_grpc = load_stubs()

CHANNEL_OPTIONS = [
    # One connection per channel: without it grpcio shares one between
    # channels with the same options.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.enable_retries", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.received = 0
        self.stalled_received = 0
        self.started = 0
        self.failed = 0
        self.ended = 0
        self.errors: dict[str, int] = {}
        self.latencies = array("q")
        self.stall = asyncio.Event()
        self.channels: list[Any] = []

    async def subscriber(self, index: int, gate: asyncio.Semaphore) -> None:
        stallable = index < self.args.stall
        async with gate:
            channel = grpc.aio.insecure_channel(self.args.target, options=CHANNEL_OPTIONS)
            self.channels.append(channel)
            stub = job_pb2_grpc.JobStub(channel)
            try:
                # wait_for_ready: a connection refused or reset while thousands of
                # clients connect at once is retried instead of failing the call.
                status = await stub.Register(
                    job_pb2.ClientInfo(role=ROLE), timeout=120, wait_for_ready=True
                )
                call = stub.SubscribeJobSummarySignal(
                    job_pb2.ClientInfo(role=ROLE, clientId=status.clientId), wait_for_ready=True
                )
            except grpc.RpcError as error:
                self._error(error)
                self.failed += 1
                return
            self.started += 1
        latencies = self.latencies
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    break
                arrival = time.time_ns()
                if stallable:
                    self.stalled_received += 1
                    if self.stall.is_set():
                        await asyncio.Event().wait()  # stop reading, for good
                    continue
                self.received += 1
                latencies.append(arrival - int(message.sid))
        except grpc.RpcError as error:
            self._error(error)
        except asyncio.CancelledError:
            raise
        self.ended += 1

    def _error(self, error: Any) -> None:
        code = error.code().name if hasattr(error, "code") else type(error).__name__
        self.errors[code] = self.errors.get(code, 0) + 1

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        name = command["cmd"]
        if name == "count":
            return {
                "received": self.received,
                "stalled_received": self.stalled_received,
                "started": self.started,
                "failed": self.failed,
                "ended": self.ended,
                "errors": self.errors,
            }
        if name == "lat_reset":
            del self.latencies[:]  # in place: the subscriber tasks hold this array
            return {"ok": True}
        if name == "lat_dump":
            with open(command["path"], "wb") as out:
                self.latencies.tofile(out)
            return {"samples": len(self.latencies)}
        if name == "stall":
            self.stall.set()
            return {"ok": True}
        return {"error": f"unknown command {name!r}"}

    async def main(self) -> None:
        gate = asyncio.Semaphore(self.args.concurrency)
        tasks = [
            asyncio.create_task(self.subscriber(index, gate)) for index in range(self.args.count)
        ]
        emit({"ready": True, "pid": os.getpid()})
        await answer_commands_on_asyncio(self.handle)
        for task in tasks:
            task.cancel()
        for channel in self.channels:
            await channel.close(grace=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--stall", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=100)
    run_child(parser, lambda args: asyncio.run(Load(args).main()))


if __name__ == "__main__":
    main()
