"""Contract tests of jobsignal's adapter around grpclib (jobsignal/rpc/_grpclib.py)."""

from __future__ import annotations

import asyncio

import grpclib.utils
import trio
import trio_asyncio

import jobsignal  # noqa: F401  (importing jobsignal installs the adapter)


def test_grpclib_looks_up_the_current_task_through_trio_asyncio() -> None:
    # On Python 3.12+ the C `current_task` grpclib captured at import cannot see
    # trio-asyncio's loop; every handler and call would fail with UNKNOWN.
    assert grpclib.utils._current_task is asyncio.current_task


async def test_grpclib_wrappers_work_inside_a_trio_asyncio_task() -> None:
    async def enter_wrapper() -> bool:
        wrapper = grpclib.utils.Wrapper()
        with wrapper:
            await asyncio.sleep(0)
        return True

    async with trio_asyncio.open_loop():
        assert await trio_asyncio.aio_as_trio(enter_wrapper)()
    await trio.lowlevel.checkpoint()
