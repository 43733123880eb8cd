"""The one bridge from trio to blocking code (grpcio's stubs): `in_thread`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import trio
import trio.lowlevel

T = TypeVar("T")

_THREADS: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("test_threads")


def _limiter() -> trio.CapacityLimiter:
    # trio's default limiter (40 threads) is too small for 50+ open grpcio streams.
    try:
        return _THREADS.get()
    except LookupError:
        limiter = trio.CapacityLimiter(256)
        _THREADS.set(limiter)
        return limiter


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking call in a worker thread, off the trio thread.

    The thread is abandoned if the test is cancelled: every grpcio call in the
    tests carries a deadline and the `grpc_clients` fixture (tests/conftest.py)
    closes every channel, so an abandoned thread still ends.
    """
    return await trio.to_thread.run_sync(
        functools.partial(fn, *args), limiter=_limiter(), abandon_on_cancel=True
    )
