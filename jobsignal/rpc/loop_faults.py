"""Errors the asyncio loop catches itself: the gRPC server's last resort.

asyncio hands some errors to its loop's exception handler instead of raising
them anywhere: an `accept()` that fails for want of file descriptors or
memory, an exception escaping a callback (a protocol's `data_received`, a
timer), a task whose exception nobody retrieved. trio-asyncio's default
handler raises each of them into the loop's nursery, which ends the gRPC
server and with it the process: a client that opened connections past the
process's file limit (`ulimit -n`) ended the server.

`LoopFaults` replaces that handler (docs/architecture.md section 7,
"The asyncio loop's last resort"):

- a failed accept pauses accepting on that listener for a second (asyncio
  does that itself), and the connections already open are served on; each
  pause is counted by the accept's errno and logged at WARNING at a bounded
  rate;
- anything else is counted, logged at ERROR with its traceback (rate-limited),
  and the connection it names, if any, is aborted: one peer's fault ends that
  peer's connection only, as in `rpc.connections`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
from asyncio.constants import ACCEPT_RETRY_DELAY
from collections import Counter
from typing import Any

from jobsignal.logs import RateLimitedLog
from jobsignal.process.file_limit import ACCEPT_CAPACITY_ERRNOS, WHY_ACCEPT_FAILED

log = logging.getLogger(__name__)
fault_log = RateLimitedLog(log)


class LoopFaults:
    """The exception handler of the gRPC server's asyncio loop, and what it counted."""

    def __init__(self) -> None:
        # Times accepting paused, by the errno of the accept that failed.
        self.accept_pauses: Counter[str] = Counter()
        self.unexpected = 0
        self._paused_at: dict[int, float] = {}  # listening socket -> when it paused

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.set_exception_handler(self.handle)

    def handle(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exception = context.get("exception")
        listener = context.get("socket")
        if (
            isinstance(exception, OSError)
            and exception.errno in ACCEPT_CAPACITY_ERRNOS
            and listener is not None
        ):
            self._accept_failed(errno.errorcode[exception.errno], listener.fileno(), loop.time())
            return
        self.unexpected += 1
        message = context.get("message") or "unhandled error in the event loop"
        aborted = _abort_named_connection(context)
        fault_log.error(
            "loop_error",
            "unexpected error in the gRPC server's event loop: %s%s; the server goes on",
            message,
            "; that connection is closed" if aborted else "",
            exc_info=exception if isinstance(exception, BaseException) else False,
        )

    def _accept_failed(self, name: str, listener: int, now: float) -> None:
        # asyncio goes on calling accept() for the rest of its batch (up to the
        # backlog) after the first failure, each failing alike: one pause.
        if now - self._paused_at.get(listener, -math.inf) < ACCEPT_RETRY_DELAY:
            return
        self._paused_at[listener] = now
        self.accept_pauses[name] += 1
        fault_log.warning(
            f"accept:{name}",
            "cannot accept gRPC connections: %s (%s); accepting again in %g s."
            " Open connections are served on; raise the limit or lower --max-connections",
            WHY_ACCEPT_FAILED[name],
            name,
            ACCEPT_RETRY_DELAY,
        )


def _abort_named_connection(context: dict[str, Any]) -> bool:
    """Abort the transport the context names; whether it named one."""
    abort = getattr(context.get("transport"), "abort", None)
    if abort is None:
        return False
    abort()
    return True
