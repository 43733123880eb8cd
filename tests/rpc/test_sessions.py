"""Sessions run as tasks of the server's nursery, awaited by their asyncio handler
(`JobService._run_session`): outcomes, errors and cancellation cross either way."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import sniffio
import trio
import trio_asyncio
from grpclib.const import Status

from jobsignal.fanout import Broadcaster, EndReason
from jobsignal.rpc.activity import PingPolicy
from jobsignal.rpc.connections import ConnectionTable
from jobsignal.rpc.registry import Registry
from jobsignal.rpc.service import JobService
from jobsignal.rpc.session import SessionHandle, SessionSettings, StreamEnd

END = StreamEnd(Status.UNAVAILABLE, "idle", EndReason.IDLE)
Session = Callable[[], Awaitable[StreamEnd]]


def job_service() -> JobService:
    registry = Registry(roles=["CCAgent"], max_registrations=1, max_subscriptions_per_role=1, ttl=1)
    return JobService(
        registry=registry,
        broadcaster=Broadcaster(),
        settings=SessionSettings(),
        connections=ConnectionTable(PingPolicy()),
    )


async def in_handler(service: JobService, session: Session, handle: SessionHandle) -> StreamEnd:
    """`_run_session` in an asyncio task, as grpclib calls a handler."""
    end: StreamEnd = await trio_asyncio.aio_as_trio(service._run_session)(session(), handle)
    return end


async def test_the_handler_gets_the_sessions_end_and_the_session_runs_as_trio() -> None:
    service = job_service()
    seen: list[str] = []

    async def session() -> StreamEnd:
        seen.append(sniffio.current_async_library())
        await trio.lowlevel.checkpoint()  # a trio checkpoint: this is a trio task
        return END

    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        service.run_sessions_in(nursery)
        assert await in_handler(service, session, SessionHandle()) == END
    assert seen == ["trio"]


async def test_an_error_in_a_session_reaches_its_handler_not_the_server() -> None:
    service = job_service()

    async def broken() -> StreamEnd:
        raise ValueError("a bug in the session")

    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        service.run_sessions_in(nursery)
        with pytest.raises(ValueError, match="a bug in the session"):
            await in_handler(service, broken, SessionHandle())
        # The nursery (the server's) lives on and starts the next session.
        assert await in_handler(service, _ends_at_once, SessionHandle()) == END


async def _ends_at_once() -> StreamEnd:
    return END


async def test_a_cancelled_handler_tells_its_session_the_client_went_away() -> None:
    service = job_service()
    handle = SessionHandle()
    session_done = trio.Event()

    running = []

    async def waits_for_the_client() -> StreamEnd:
        running.append(True)
        try:
            while not handle.gone:
                await trio.lowlevel.checkpoint()
            return END
        finally:
            session_done.set()

    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        service.run_sessions_in(nursery)

        async def handler() -> None:
            task = asyncio.ensure_future(service._run_session(waits_for_the_client(), handle))
            while not running:
                await asyncio.sleep(0)
            task.cancel()  # what grpclib does when the client resets the stream
            with pytest.raises(asyncio.CancelledError):
                await task

        await trio_asyncio.aio_as_trio(handler)()
        with trio.fail_after(5):
            await session_done.wait()
    assert handle.gone


async def test_a_session_cancelled_with_the_server_cancels_its_handler() -> None:
    service = job_service()
    started = trio.Event()

    async def forever() -> StreamEnd:
        started.set()
        await trio.sleep_forever()
        raise AssertionError("not reached")

    async with trio_asyncio.open_loop(), trio.open_nursery() as outer:
        outcome: list[str] = []

        async def serve() -> None:
            async with trio.open_nursery() as server_nursery:
                service.run_sessions_in(server_nursery)

                async def handler() -> None:
                    try:
                        await service._run_session(forever(), SessionHandle())
                    except asyncio.CancelledError:
                        outcome.append("cancelled")

                outer.start_soon(trio_asyncio.aio_as_trio(handler))
                await started.wait()
                server_nursery.cancel_scope.cancel()  # the server stops

        await serve()
        with trio.fail_after(5):
            while not outcome:
                await trio.lowlevel.checkpoint()
    assert outcome == ["cancelled"]


def test_a_service_without_a_nursery_says_so() -> None:
    async def main() -> None:
        async with trio_asyncio.open_loop():
            with pytest.raises(RuntimeError, match="run_sessions_in"):
                await in_handler(job_service(), _ends_at_once, SessionHandle())

    trio.run(main)
