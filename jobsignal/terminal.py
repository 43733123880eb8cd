"""What a command writes for the person at the terminal, or the program reading it.

Output written to a reader that has gone (`jobsignal subscribe --json | head
-1`) raises `StdoutClosed`, which the command line turns into a quiet exit
with status 141, as SIGPIPE ends other Unix tools.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Awaitable, Callable
from typing import Any


class StdoutClosed(Exception):
    """Whoever read our standard output has gone (`jobsignal ... | head -1`)."""


def emit(text: str) -> None:
    """Print a line of the command's output, flushed at once (streams are live)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise StdoutClosed from None


def tell(text: str) -> None:
    """A note for the person at the terminal, on stderr (stdout stays parsable)."""
    with contextlib.suppress(OSError):  # nobody listens: not worth failing for
        print(text, file=sys.stderr, flush=True)


def lone_exception(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception inside `group` and the groups of one around it, if that is all."""
    while len(group.exceptions) == 1:
        (inner,) = group.exceptions
        if not isinstance(inner, BaseExceptionGroup):
            return inner
        group = inner
    return None


def run(function: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """trio.run, handing back a lone StdoutClosed that nurseries wrapped in groups."""
    import trio  # (here: the command line's parser and --help do without it)

    try:
        return trio.run(function, *args)
    except BaseExceptionGroup as group:
        closed, rest = group.split(StdoutClosed)
        if closed is not None and rest is None:
            raise StdoutClosed from None
        raise
