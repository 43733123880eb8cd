"""The one place where jobsignal adapts grpclib to running on trio-asyncio.

Python 3.12 made `asyncio.current_task` a C function that reads the running
loop from the interpreter's own thread state. trio-asyncio never sets that
state for the loop it runs inside trio; it replaces `asyncio.current_task`
(and `get_running_loop`) with versions that find its loop, at import time.
grpclib binds `asyncio.current_task` to `grpclib.utils._current_task` when
*it* is imported, which happens first (the generated message code imports
grpclib). Its `Wrapper` and `DeadlineWrapper`, entered by every server
handler and client call, then raise "RuntimeError: no running event loop"
and every RPC fails with UNKNOWN. On 3.11 `current_task` is pure Python and
looks the loop up through the patched function, so nothing shows.

`install()` rebinds grpclib's alias to trio-asyncio's replacement. It runs
when `jobsignal` is imported, whatever was imported before. It stays
necessary while grpclib caches `asyncio.current_task` at import (0.4.9, the
pinned version); a grpclib that looks it up at call time, or a trio-asyncio
that sets the C-level running loop, makes it a no-op.
"""

from __future__ import annotations

import asyncio

import grpclib.utils
import trio_asyncio  # noqa: F401  (imported for its patch of asyncio.current_task)


def install() -> None:
    """Make grpclib use trio-asyncio's `current_task` (idempotent)."""
    grpclib.utils._current_task = asyncio.current_task
