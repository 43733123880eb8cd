"""One trio task serves every reader of a trio-asyncio loop (`rpc.socket_readers`).

Real socket pairs on this host: the callbacks run when bytes arrive, a socket
that stays readable cannot starve the others, removing and replacing a reader
takes effect, a failing callback ends nothing else, and asyncio transports
(the server's connections) cost no trio task each.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import trio
import trio_asyncio

from jobsignal.rpc.socket_readers import SharedReaders
from tests.support.tasks import count_tasks
from tests.support.waiting import wait_until


@asynccontextmanager
async def shared_loop() -> AsyncIterator[tuple[Any, SharedReaders]]:
    async with trio_asyncio.open_loop() as loop, trio.open_nursery() as nursery:
        readers = SharedReaders(loop)
        readers.install()
        await nursery.start(readers.run)
        yield loop, readers
        nursery.cancel_scope.cancel()


@contextmanager
def socket_pairs(count: int) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    pairs = [socket.socketpair() for _ in range(count)]
    for ours, _ in pairs:
        ours.setblocking(False)
    try:
        yield pairs
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


async def test_a_callback_runs_when_its_socket_has_bytes() -> None:
    async with shared_loop() as (loop, readers):
        with socket_pairs(2) as pairs:
            received: dict[int, bytes] = {0: b"", 1: b""}

            def reader(index: int, sock: socket.socket) -> None:
                received[index] += sock.recv(100)

            for index, (ours, _) in enumerate(pairs):
                loop.add_reader(ours, reader, index, ours)
            assert len(readers) == 2
            pairs[1][1].send(b"second")
            await wait_until(lambda: received[1] == b"second")
            pairs[0][1].send(b"first")
            await wait_until(lambda: received[0] == b"first")
            assert received == {0: b"first", 1: b"second"}


async def test_a_socket_that_stays_readable_does_not_starve_the_others() -> None:
    async with shared_loop() as (loop, _):
        with socket_pairs(2) as ((noisy, noisy_peer), (quiet, quiet_peer)):
            calls = {"noisy": 0, "quiet": 0}

            def never_reads() -> None:  # level-triggered: ready again every round
                calls["noisy"] += 1

            def reads() -> None:
                quiet.recv(100)
                calls["quiet"] += 1

            loop.add_reader(noisy, never_reads)
            loop.add_reader(quiet, reads)
            noisy_peer.send(b"x")
            await wait_until(lambda: calls["noisy"] >= 5)
            quiet_peer.send(b"y")
            await wait_until(lambda: calls["quiet"] == 1)
            # One call per round each: the noisy one ran only a few rounds more.
            before = calls["noisy"]
            await wait_until(lambda: calls["noisy"] >= before + 3)
            assert calls["quiet"] == 1


async def test_removed_and_replaced_readers_are_not_called_again() -> None:
    async with shared_loop() as (loop, readers):
        with socket_pairs(2) as [(ours, theirs), (probe, probe_peer)]:
            calls: list[str] = []

            def first() -> None:
                calls.append("first")

            def second() -> None:
                ours.recv(100)
                calls.append("second")

            def probed() -> None:
                probe.recv(100)
                calls.append("probe")

            loop.add_reader(ours, first)
            assert loop.remove_reader(ours) is True
            loop.add_reader(probe, probed)
            assert len(readers) == 1
            theirs.send(b"x")
            probe_peer.send(b"x")
            # Both were readable in the round that saw the probe.
            await wait_until(lambda: calls == ["probe"])
            loop.add_reader(ours, first)
            loop.add_reader(ours, second)  # replaces `first`
            assert len(readers) == 2
            await wait_until(lambda: calls == ["probe", "second"])
            assert loop.remove_reader(ours) is True
            assert loop.remove_reader(ours) is False


async def test_a_failing_callback_is_reported_and_the_others_go_on() -> None:
    async with shared_loop() as (loop, _):
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        with socket_pairs(2) as ((bad, bad_peer), (good, good_peer)):
            got: list[bytes] = []

            def fails() -> None:
                bad.recv(100)
                raise ValueError("a bug in one connection's callback")

            loop.add_reader(bad, fails)
            loop.add_reader(good, lambda: got.append(good.recv(100)))
            bad_peer.send(b"x")
            await wait_until(lambda: bool(reported))
            good_peer.send(b"fine")
            await wait_until(lambda: got == [b"fine"])
            assert isinstance(reported[0]["exception"], ValueError)


async def test_a_socket_closed_before_its_reader_is_removed() -> None:
    async with shared_loop() as (loop, readers):
        with socket_pairs(1) as [(ours, theirs)]:
            loop.add_reader(ours.fileno(), lambda: None)
            fd = ours.detach()
            socket.close(fd)  # the kernel drops it from the epoll set by itself
            assert loop.remove_reader(fd) is True
            assert len(readers) == 0
            theirs.close()


async def test_the_loop_closes_with_readers_still_installed() -> None:
    with socket_pairs(1) as [(ours, _)]:
        async with shared_loop() as (loop, readers):
            loop.add_reader(ours, lambda: None)
            assert len(readers) == 1
        # trio-asyncio's close looked at the reader (its `_scope`) without failing.


async def test_asyncio_connections_need_no_trio_task_each() -> None:
    clients = 20
    async with shared_loop() as (_, readers):
        echoed: list[bytes] = []

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readexactly(4))
            await writer.drain()
            await reader.read()  # until the client closes
            writer.close()
            await writer.wait_closed()

        async def serve_and_connect() -> tuple[asyncio.Server, list[asyncio.StreamWriter]]:
            server = await asyncio.start_server(echo, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            writers = []
            for index in range(clients):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"%04d" % index)
                echoed.append(await reader.readexactly(4))
                writers.append(writer)
            return server, writers

        tasks_before = count_tasks()
        server, writers = await trio_asyncio.aio_as_trio(serve_and_connect)()
        assert sorted(echoed) == [b"%04d" % index for index in range(clients)]
        # The listening socket and both ends of every connection, one task for all.
        assert len(readers) == 1 + 2 * clients
        assert count_tasks() == tasks_before

        async def close() -> None:
            for writer in writers:
                writer.close()
                await writer.wait_closed()
            server.close()
            await server.wait_closed()

        await trio_asyncio.aio_as_trio(close)()
        await wait_until(lambda: len(readers) == 0)


async def test_readers_go_back_to_trio_asyncio_when_the_task_ends_first() -> None:
    """Cancelled with the server's nursery, the task may end while the server's stop
    still reads from its connections."""
    with socket_pairs(2) as [(ours, theirs), (later, later_peer)]:
        got: list[bytes] = []
        async with trio_asyncio.open_loop() as loop:
            readers = SharedReaders(loop)
            readers.install()
            async with trio.open_nursery() as nursery:
                await nursery.start(readers.run)
                loop.add_reader(ours, lambda: got.append(ours.recv(100)))
                nursery.cancel_scope.cancel()
            assert len(readers) == 0
            theirs.send(b"still read")
            loop.add_reader(later, lambda: got.append(later.recv(100)))  # after the end
            later_peer.send(b"added later")
            await wait_until(lambda: len(got) == 2)
            assert sorted(got) == [b"added later", b"still read"]
            loop.remove_reader(ours)
            loop.remove_reader(later)


def test_every_trio_asyncio_and_asyncio_internal_the_readers_use_exists() -> None:
    """A trio-asyncio or Python upgrade that renames one of these fails here, by name
    (rpc._grpclib's functions for the shared readers use each of them)."""
    import inspect

    loop_class = trio_asyncio.TrioEventLoop
    for name in ["_add_reader", "_set_read_handle", "_check_closed", "_cancel_fds"]:
        assert callable(getattr(loop_class, name, None)), f"TrioEventLoop.{name}"
    # At close trio-asyncio cancels the scope it finds in each reader's `_scope`.
    assert "_scope" in inspect.getsource(loop_class._cancel_fds)
    assert callable(getattr(asyncio.Handle, "_run", None)), "asyncio.Handle._run"
    for name in ["_callback", "_args"]:
        assert name in asyncio.Handle.__slots__, f"asyncio.Handle.{name}"
