"""Every socket the gRPC server's asyncio loop reads from, watched by one trio task.

trio-asyncio serves asyncio's `add_reader` with a trio task per file
descriptor: the task, its coroutine, a cancel scope in the handle and the
descriptor's registration in trio's epoll, about 2.5 KB per connection that
stay allocated while the connection is idle, which is most of its life.
`SharedReaders` keeps an epoll set of its own instead. trio waits on that one
descriptor; when it is readable, the task runs the read callback of every
socket that is ready, once each, then lets the asyncio loop run what those
callbacks scheduled, as trio-asyncio's task does after each callback. A
connection's reader is then an asyncio handle and a kernel registration
(docs/architecture.md section 8, "One reader for every socket").

Level-triggered epoll reports a socket again while it holds unread bytes, so
one peer sending without pause gets one read per round, like every other
ready socket, and cannot starve them. A callback's exception is reported by
`asyncio.Handle` to the loop's exception handler and ends nothing else.

The server opens its own loop (`rpc.server`), so every reader of that loop
is served here: the listening sockets and each connection. Writers (a
socket whose send buffer is full) stay with trio-asyncio: they are rare and
short-lived. The trio-asyncio and asyncio internals this takes over or uses
are functions of `rpc._grpclib` (the one module that reaches into
dependencies), and tests/rpc/test_socket_readers.py checks they are still there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
from collections.abc import Callable
from typing import Any

import trio
import trio_asyncio

from jobsignal.rpc import _grpclib

# epoll is Linux's; elsewhere the server leaves its readers to trio-asyncio.
AVAILABLE = hasattr(select, "epoll")

# One epoll_wait returns at most this many ready sockets; the rest come next round.
MAX_READY = 1024


def _fd_of(fileobj: int | Any) -> int:
    return fileobj if isinstance(fileobj, int) else int(fileobj.fileno())


def _is_open(fd: int) -> bool:
    # A socket closed without its reader removed first (asyncio's transports
    # always remove it) is not handed on.
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class _SharedReader(_grpclib.ReaderHandle):
    """A socket's read callback; cancelling it (asyncio's `remove_reader`, or a
    new reader for the same descriptor) takes the socket out of the epoll set."""

    __slots__ = ("_fd", "_readers")

    def __init__(
        self,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop,
        readers: SharedReaders,
        fd: int,
    ) -> None:
        super().__init__(callback, args, loop)
        self._readers = readers
        self._fd = fd

    def cancel(self) -> None:
        super().cancel()
        self._readers.forget(self._fd, self)


class SharedReaders:
    """The readers of one trio-asyncio loop, over one epoll set."""

    def __init__(self, loop: trio_asyncio.TrioEventLoop) -> None:
        self._loop = loop
        self._epoll = select.epoll()
        self._readers: dict[int, _SharedReader] = {}

    def __len__(self) -> int:
        return len(self._readers)

    def install(self) -> None:
        """Serve the loop's readers from here while `run` runs (install before the
        loop's first reader, so none is left with trio-asyncio)."""
        # What `add_reader` and every transport call; the rest of trio-asyncio's
        # reader bookkeeping (its map of readers, `remove_reader`) is used as it is.
        _grpclib.take_over_readers(self._loop, self.add_reader)

    def add_reader(
        self, fileobj: int | Any, callback: Callable[..., object], *args: Any
    ) -> asyncio.Handle:
        loop = self._loop
        if self._epoll.closed:  # `run` has ended: trio-asyncio's own way
            return _grpclib.add_reader_with_trio_asyncio(loop, fileobj, callback, *args)
        _grpclib.check_loop_open(loop)
        fd = _fd_of(fileobj)
        reader = _SharedReader(callback, args, loop, self, fd)
        replaced = _grpclib.set_read_handle(loop, fd, reader)
        if replaced is not None:
            replaced.cancel()
        self._readers[fd] = reader
        try:
            self._epoll.register(fd, select.EPOLLIN)
        except FileExistsError:
            self._epoll.modify(fd, select.EPOLLIN)
        return reader

    def forget(self, fd: int, reader: _SharedReader) -> None:
        if self._readers.get(fd) is reader:
            del self._readers[fd]
            if self._epoll.closed:
                return
            # Already gone from the set if the socket was closed first.
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the ready sockets' callbacks until cancelled.

        Then the readers still installed go back to trio-asyncio, one task each:
        cancelled with the server's nursery, this task may end before the
        server's stop has closed every connection, which still reads meanwhile.
        """
        try:
            task_status.started()
            while True:
                await trio.lowlevel.wait_readable(self._epoll.fileno())
                for fd, _events in self._epoll.poll(0, MAX_READY):
                    reader = self._readers.get(fd)
                    if reader is not None and not reader.cancelled():
                        _grpclib.run_handle(reader)
                await self._loop.synchronize()
        finally:
            self._epoll.close()
            self._hand_back()

    def _hand_back(self) -> None:
        loop = self._loop
        for fd, reader in list(self._readers.items()):
            del self._readers[fd]
            if reader.cancelled() or loop.is_closed() or not _is_open(fd):
                continue
            # Replaces (and so cancels) this reader in the loop's map of readers.
            # trio-asyncio starts its task in the loop's nursery, if still open.
            callback, args = _grpclib.callback_of(reader)
            with contextlib.suppress(RuntimeError):
                _grpclib.add_reader_with_trio_asyncio(loop, fd, callback, *args)
