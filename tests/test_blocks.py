"""`jobsignal.util.blocks`: background tasks for the length of an `async with` block."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from jobsignal.util.blocks import background_tasks, for_block


async def test_the_blocks_own_exception_comes_out_unwrapped() -> None:
    with pytest.raises(KeyError, match="from the block"):
        async with background_tasks() as nursery:
            nursery.start_soon(trio.sleep_forever)
            raise KeyError("from the block")


async def test_background_tasks_are_cancelled_when_the_block_ends() -> None:
    cancelled = trio.Event()

    async def worker() -> None:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async with background_tasks() as nursery:
        nursery.start_soon(worker)
        await trio.testing.wait_all_tasks_blocked()
    assert cancelled.is_set()


async def serve(
    task_status: trio.TaskStatus[str], prefix: str, *, suffix: str, ran: list[str]
) -> None:
    ran.append("started")
    task_status.started(prefix + suffix)
    try:
        await trio.sleep_forever()
    finally:
        ran.append("cancelled")


async def test_for_block_yields_what_the_task_started_with_then_cancels_it() -> None:
    ran: list[str] = []
    async with for_block(serve)("a", suffix="b", ran=ran) as value:
        assert value == "ab"
        assert ran == ["started"]
    assert ran == ["started", "cancelled"]


async def test_for_block_raises_a_failure_before_started_as_itself() -> None:
    async def broken(task_status: trio.TaskStatus[int]) -> None:
        raise OSError("cannot bind")

    with pytest.raises(OSError, match="cannot bind"):
        async with for_block(broken)():
            pytest.fail("the block must not run")
