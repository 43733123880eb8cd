"""jobsignal's grpc.health.v1 service answers as grpclib's did (the server's before).

Both run the same scenarios against a stand-in for grpclib's server stream;
the statuses they send (as numbers: the enums are the same values) and the
trailers must agree. The wire side is tested in tests/rpc/test_interop.py
(grpcio's health client) and tests/test_cli_ux.py (`jobsignal check`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing
import trio_asyncio
from grpclib.const import Status
from grpclib.health.check import ServiceStatus
from grpclib.health.service import OVERALL
from grpclib.health.service import Health as GrpclibHealth
from grpclib.health.v1.health_pb2 import HealthCheckRequest as PbRequest

from jobsignal._proto.grpc.health.v1 import HealthCheckRequest
from jobsignal.rpc.health import Health


class Named:
    """A servable named `name`, for grpclib's health service."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __mapping__(self) -> dict[str, None]:
        return {f"/{self.name}/Method": None}


class FakeStream:
    def __init__(self, request: Any) -> None:
        self.request = request
        self.sent: asyncio.Queue[int] = asyncio.Queue()
        self.trailer: Status | None = None

    async def recv_message(self) -> Any:
        return self.request

    async def send_message(self, message: Any) -> None:
        self.sent.put_nowait(int(message.status))

    async def send_trailing_metadata(self, *, status: Status) -> None:
        self.trailer = status


def ours(checks: dict[str, list[ServiceStatus]]) -> tuple[Any, Callable[[str], Any]]:
    return Health(checks, request_timeout=10.0), lambda name: HealthCheckRequest(service=name)


def grpclib_s(checks: dict[str, list[ServiceStatus]]) -> tuple[Any, Callable[[str], Any]]:
    config: dict[Any, list[ServiceStatus]] = {
        OVERALL if name == "" else Named(name): c for name, c in checks.items()
    }
    return GrpclibHealth(config), lambda name: PbRequest(service=name)


IMPLEMENTATIONS = pytest.mark.parametrize("make", [ours, grpclib_s], ids=["jobsignal", "grpclib"])


@IMPLEMENTATIONS
async def test_check_answers_each_entry_and_not_found(make: Any) -> None:
    ready, source = ServiceStatus(), ServiceStatus()
    health, request = make({"": [ready], "job.Job": [ready], "src": [source, ready]})
    answers: list[object] = []
    async with trio_asyncio.open_loop():
        for step in (None, True, False):
            if step is not None:
                ready.set(step)
                source.set(True)
            for name in ("", "job.Job", "src", "no.such.Service"):
                stream = FakeStream(request(name))
                checker = health.check if isinstance(health, Health) else health.Check
                await trio_asyncio.aio_as_trio(checker)(stream)
                answers.append(stream.trailer if stream.sent.empty() else stream.sent.get_nowait())
    assert answers == [
        0, 0, 0, Status.NOT_FOUND,  # UNKNOWN before any status
        1, 1, 1, Status.NOT_FOUND,  # SERVING
        2, 2, 2, Status.NOT_FOUND,  # NOT_SERVING (src: one of two checks fails)
    ]  # fmt: skip


@IMPLEMENTATIONS
async def test_watch_sends_the_status_then_every_change(make: Any) -> None:
    ready = ServiceStatus()
    health, request = make({"": [ready]})
    watcher: Any = health.watch if isinstance(health, Health) else health.Watch
    async with trio_asyncio.open_loop() as loop:
        known, unknown = FakeStream(request("")), FakeStream(request("nope"))
        tasks = [loop.create_task(watcher(known)), loop.create_task(watcher(unknown))]

        async def next_sent(stream: FakeStream) -> int:
            with trio.fail_after(5):
                sent: int = await trio_asyncio.aio_as_trio(stream.sent.get)()
                return sent

        seen = [await next_sent(known)]
        for value in (True, True, False, None):  # True twice: no change, no message
            ready.set(value)
            if value is not True or seen[-1] != 1:
                seen.append(await next_sent(known))
        assert await next_sent(unknown) == 3  # SERVICE_UNKNOWN, and the call stays open
        await trio.testing.wait_all_tasks_blocked()
        assert not any(task.done() for task in tasks)
        assert known.sent.empty() and unknown.sent.empty()
        for task in tasks:
            task.cancel()
        await trio_asyncio.aio_as_trio(asyncio.gather)(*tasks, return_exceptions=True)
        assert not ready._events  # the watcher unsubscribed when its call ended
    assert seen == [0, 1, 2, 0]
