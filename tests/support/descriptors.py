"""Running a test's process out of file descriptors, and connections waiting in a backlog."""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager


@contextmanager
def file_limit(room: int) -> Iterator[None]:
    """The soft limit of open files lowered to `room` more than are open now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + room, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def connect_without_yielding(port: int, count: int, stack: ExitStack) -> list[socket.socket]:
    """`count` connections the kernel completes in the listen backlog: the server,
    which runs only when this task yields, has accepted none of them yet."""
    return [
        stack.enter_context(socket.create_connection(("127.0.0.1", port))) for _ in range(count)
    ]
