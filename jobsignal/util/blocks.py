"""Background tasks for the length of an `async with` block.

`background_tasks()` is a nursery whose tasks are cancelled when the block
ends. The block's own exception comes out of it as itself, not wrapped in the
nursery's exception group, so an `except` or `pytest.raises` around the
block sees what the block raised. `for_block(run)` turns a task that reports
through `task_status.started(value)` into such a block yielding that value.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Concatenate, ParamSpec, TypeVar

import trio

P = ParamSpec("P")
T = TypeVar("T")


@asynccontextmanager
async def background_tasks() -> AsyncIterator[trio.Nursery]:
    """A nursery for the block's background tasks, cancelled when the block ends.

    An exception from the block is raised as itself once the nursery is done;
    one from a background task comes out in the nursery's group, as usual.
    """
    raised: BaseException | None = None
    async with trio.open_nursery() as nursery:
        try:
            yield nursery
        except BaseException as exc:
            raised = exc  # raised again below, not wrapped in the nursery's group
        finally:
            nursery.cancel_scope.cancel()
    if raised is not None:
        raise raised


def for_block(
    run: Callable[Concatenate[trio.TaskStatus[T], P], Awaitable[object]],
) -> Callable[P, AbstractAsyncContextManager[T]]:
    """`run` (called with the same arguments) as an `async with` block that yields
    what it passes to `task_status.started()` and cancels it when the block ends.

    A failure before `started()` and the block's own exception both come out
    as themselves (see `background_tasks`).
    """

    @asynccontextmanager
    async def block(*args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
        """Runs the task with these arguments for the block, yielding what it started with."""
        async with background_tasks() as nursery:
            started: T = await nursery.start(
                lambda task_status: run(task_status, *args, **kwargs), name=run
            )
            yield started

    return block
