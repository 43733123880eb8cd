"""An idle subscriber stays small (docs/architecture.md section 8, issue 10's memory target).

- `rpc.lean`'s containers behave as the deques they replace, for every
  sequence of the operations their owners perform (hypothesis);
- on a live connection with a grpcio subscriber, every per-connection and
  per-stream container h2, grpclib and asyncio made is a light one, and the
  finished Register left nothing behind in grpclib's handler;
- measured with tracemalloc (`bench.memory_profile`, subscribers in a child
  process), the Python allocations the server holds per idle subscriber stay
  under a generous bound, and the third-party containers that used to
  dominate them are gone from the table. Not a timing test: the bytes held
  by a fixed number of idle subscribers are the same from run to run within
  a few percent.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import memory_profile
from jobsignal.rpc import _grpclib
from jobsignal.rpc.lean import Fifo, MethodTable, NewestFirst, SmallDeque
from tests.support.grpc_server import open_jobsignal_server
from tests.support.grpcio import GrpcioClients, GrpcioStream, GrpcioStubs
from tests.support.threads import in_thread
from tests.support.waiting import wait_until

ROLE = "CCAgent"
# Python allocations held per idle subscriber, one connection each: 24–26 KiB
# with 40 subscribers on 3.11–3.13 (22 KiB with 400) after issue 10's changes;
# 63 KiB before them. That no task is held per idle stream or socket is checked
# directly (tests/rpc/test_sessions.py, tests/rpc/test_socket_readers.py).
BOUND_BYTES = 30 * 1024
# Attribute names an object may have and still keep them in CPython's compact array.
MAX_COMPACT_ATTRIBUTES = 28
# What h2's settings deques, asyncio's Events and grpclib's Queues cost each
# idle subscriber before (23 KiB); with the light containers, under 1 KiB.
OLD_CONTAINER_FILES = ("h2/settings.py", "asyncio/locks.py", "asyncio/queues.py")

# -- the containers themselves ---------------------------------------------------------------


def operations(*choices: st.SearchStrategy[tuple[Any, ...]]) -> st.SearchStrategy[Any]:
    """Sequences of (method name, arguments...)."""
    return st.lists(st.one_of(*choices), max_size=200)


def outcome(container: Any, method: str, *args: Any) -> Any:
    """What a method returned, or the type of exception it raised."""
    try:
        return getattr(container, method)(*args)
    except (IndexError, ValueError) as error:
        return type(error)


def replay(steps: list[tuple[Any, ...]], light: Any) -> Iterator[tuple[Any, Any]]:
    """Apply each step to `light` and to a deque, checking that both answer and hold
    the same; yields both after each step for further checks."""
    reference: collections.deque[int] = collections.deque()
    for method, *args in steps:
        assert outcome(light, method, *args) == outcome(reference, method, *args)
        assert list(light) == list(reference)
        assert len(light) == len(reference) and bool(light) == bool(reference)
        yield light, reference


@settings(max_examples=300, deadline=None)
@given(
    operations(
        st.tuples(st.just("append"), st.integers(0, 5)),
        st.tuples(st.just("popleft")),
        st.tuples(st.just("appendleft"), st.integers(0, 5)),
        st.tuples(st.just("extend"), st.lists(st.integers(0, 5), max_size=3)),
        st.tuples(st.just("remove"), st.integers(0, 5)),
        st.tuples(st.just("__getitem__"), st.integers(-4, 4)),
        st.tuples(st.just("__setitem__"), st.integers(-4, 4), st.just(9)),
        st.tuples(st.just("clear")),
    )
)
def test_fifo_behaves_as_a_deque(steps: list[tuple[Any, ...]]) -> None:
    for fifo, reference in replay(steps, Fifo[int]()):
        assert list(reversed(fifo)) == list(reversed(reference))


@settings(max_examples=300, deadline=None)
@given(
    operations(
        st.tuples(st.just("appendleft"), st.integers(0, 9)),
        st.tuples(st.just("pop")),
        st.tuples(st.just("__getitem__"), st.integers(-4, 4)),
        st.tuples(st.just("clear")),
    )
)
def test_newest_first_behaves_as_hpacks_deque(steps: list[tuple[Any, ...]]) -> None:
    for _ in replay(steps, NewestFirst[int]()):
        pass


def test_fifo_popleft_frees_the_items_it_hands_out() -> None:
    fifo: Fifo[object] = Fifo(object() for _ in range(10))
    fifo.append(taken := object())
    for _ in range(10):
        fifo.popleft()
    # Nothing but the last item is left in the list underneath.
    assert fifo._items.count(None) + 1 == len(fifo._items) and fifo._items[-1] is taken


def test_small_deque_is_a_list_with_popleft() -> None:
    values = SmallDeque([4096, 8192])
    assert values.popleft() == 4096 and values == [8192] and values[0] == 8192
    with pytest.raises(IndexError):
        SmallDeque[int]().popleft()


class Owner:
    def first(self) -> str:
        return "first"

    def second(self) -> str:
        return "second"


def bound_to(method: Any) -> object:
    return method.__self__


def test_method_table_binds_on_lookup_and_shares_its_names() -> None:
    one, two = Owner(), Owner()
    tables = [MethodTable(owner, {1: owner.first, 2: owner.second}) for owner in (one, two)]
    assert tables[0][1]() == "first" and tables[1][2]() == "second"
    assert bound_to(tables[0][1]) is one and bound_to(tables[1][1]) is two
    assert tables[0]._names is tables[1]._names  # one table of names for every owner
    with pytest.raises(KeyError):
        tables[0][3]
    assert tables[0].get(3) is None and 3 not in tables[0]
    tables[0][3] = print  # set later; the other owner's table is unchanged
    assert tables[0][3] is print and 3 in tables[0] and tables[1].get(3) is None
    tables[0][1] = two.second  # an entry set later wins over the name
    assert tables[0][1]() == "second" and len(tables[0]) == 3
    foreign = MethodTable(one, {1: one.first, 2: two.first})  # not one's own method: kept
    assert bound_to(foreign[2]) is two


# -- a live connection -----------------------------------------------------------------------


def containers_of(protocol: Any) -> dict[str, object]:
    """Every container and table the adapter lightens on one connection and its open streams."""
    h2 = _grpclib.h2_connection_of(protocol)
    found: dict[str, object] = {}
    for side in ("local_settings", "remote_settings"):
        for code, values in getattr(h2, side)._settings.items():
            found[f"{side}[{code}]"] = values
    for coder in ("encoder", "decoder"):
        found[f"{coder} table"] = getattr(h2, coder).header_table.dynamic_entries
    connection = protocol.connection
    for name in ("write_ready", "stream_close_waiter"):
        found[f"connection.{name}"] = getattr(connection, name)._waiters
    found["output waiting"] = protocol.output._waiting
    found["h2 frame dispatch"] = h2._frame_dispatch_table
    found["grpclib event processors"] = protocol.processor.processors
    for stream_id, stream in protocol.processor.streams.items():
        for name in ("window_updated", "headers_received", "trailers_received"):
            found[f"stream {stream_id} {name}"] = getattr(stream, name)._waiters
        buffer = stream.buffer
        found[f"stream {stream_id} chunks"] = buffer._acked
        queue = buffer._unacked
        for name in ("_getters", "_putters", "_queue"):
            found[f"stream {stream_id} queue {name}"] = getattr(queue, name)
        found[f"stream {stream_id} queue finished"] = queue._finished._waiters
    return found


async def test_a_live_connections_containers_are_the_light_ones(
    grpc_clients: GrpcioClients,
) -> None:
    async with trio.open_nursery() as nursery, open_jobsignal_server() as server:
        client = grpc_clients.connect(server.target)
        client_id = await in_thread(client.register_id, ROLE)
        stream = GrpcioStream(client.subscribe(ROLE, client_id, timeout=60)).start(nursery)
        await wait_until(lambda: len(server.broadcaster.subscribers) == 1, what="the subscriber")
        (protocol,) = server.connections.protocols()
        # grpcio's SETTINGS named settings h2 had not seen: settled and shared on receipt.
        found = containers_of(protocol)
        assert len(found) > 20
        light = (SmallDeque, Fifo, NewestFirst, MethodTable, tuple)  # tuple: a settled setting
        assert not {name: type(held) for name, held in found.items() if type(held) not in light}
        # The Register that finished left no task (and no stream) in grpclib's handler.
        handler: Any = protocol.processor.handler
        assert len(handler._tasks) == 1 and not handler._cancelled
        assert list(handler._tasks) == list(protocol.processor.streams.values())
        # After grpcio's SETTINGS too, the server's encoder indexes no header.
        encoder = _grpclib.h2_connection_of(protocol).encoder
        assert encoder.header_table_size == 0 and not encoder.header_table.dynamic_entries
        # CPython keeps an instance's attributes in a compact array only while its
        # class has fewer than 29 attribute names (30 before 3.13); past that, every
        # connection's protocol carries a dict of its own, 1.3 KB more. (Last: `vars`
        # makes that dict.)
        assert len(vars(protocol)) <= MAX_COMPACT_ATTRIBUTES
        client.close()
        await stream.wait_end()


# -- bytes per idle subscriber ---------------------------------------------------------------


async def test_an_idle_subscriber_holds_under_the_bound(
    grpcio_stubs: GrpcioStubs, tmp_path: Path
) -> None:
    profile = await memory_profile.measure(
        40, warmup=5, stubs=grpcio_stubs.directory, log_dir=tmp_path
    )
    table = memory_profile.report(profile, 15)
    assert profile.python_bytes_per_subscriber < BOUND_BYTES, table
    old = sum(profile.share_of(name) for name in OLD_CONTAINER_FILES)
    assert old < 1024, table
    # Still measuring something: the connection's own HTTP/2 state is there.
    assert profile.share_of("h2/connection.py") > 1000, table
