"""TurnFlusher: one end-of-turn callback writes every connection with output due;
LateFlusher: one timer writes the PING ACKs no other write took."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import pytest

from jobsignal.rpc import output as output_module
from jobsignal.rpc.output import ConnectionOutput, LateFlusher, TurnFlusher


class FakeLoop:
    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.timers: list[tuple[float, Callable[[], None]]] = []

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.callbacks.append(callback)

    def call_later(self, delay: float, callback: Callable[[], None]) -> object:
        self.timers.append((delay, callback))
        return object()  # the handle, which LateFlusher only holds

    def fire_timers(self) -> None:
        timers, self.timers = self.timers, []
        for _, callback in timers:
            callback()

    def run_turn(self) -> None:
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


class FakeOutput:
    def __init__(self, name: str, flushed: list[str], *, broken: bool = False) -> None:
        self.name, self.flushed, self.broken = name, flushed, broken

    def flush_due(self) -> None:
        if self.broken:
            raise RuntimeError("transport gone wrong")
        self.flushed.append(self.name)


def due(flusher: TurnFlusher, output: FakeOutput, loop: FakeLoop) -> None:
    flusher.due(cast(ConnectionOutput, output), cast(asyncio.AbstractEventLoop, loop))


def test_one_callback_per_turn_for_all_connections() -> None:
    flusher, loop = TurnFlusher(), FakeLoop()
    flushed: list[str] = []
    for index in range(100):
        due(flusher, FakeOutput(str(index), flushed), loop)
    assert len(loop.callbacks) == 1
    loop.run_turn()
    assert flushed == [str(index) for index in range(100)]
    due(flusher, FakeOutput("next turn", flushed), loop)  # a new turn, a new callback
    assert len(loop.callbacks) == 1


def test_a_failing_connection_does_not_keep_the_others_output(
    caplog: pytest.LogCaptureFixture,
) -> None:
    flusher, loop = TurnFlusher(), FakeLoop()
    flushed: list[str] = []
    outputs = [
        FakeOutput("a", flushed),
        FakeOutput("broken", flushed, broken=True),
        FakeOutput("b", flushed),
    ]
    for output in outputs:
        due(flusher, output, loop)
    loop.run_turn()
    assert flushed == ["a", "b"]
    assert "writing a connection's output failed" in caplog.text


class FakeConnection:
    """What `ConnectionOutput` uses of grpclib's Connection: flush and is_closing."""

    def __init__(self) -> None:
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1

    def is_closing(self) -> bool:
        return False


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> FakeLoop:
    """The loop a `ConnectionOutput` made now takes as its own."""
    fake = FakeLoop()
    monkeypatch.setattr(asyncio, "get_running_loop", lambda: fake)
    return fake


def output_on(
    connection: FakeConnection, flusher: TurnFlusher, late: LateFlusher | None = None
) -> ConnectionOutput:
    return ConnectionOutput(cast(Any, connection), flusher, late or LateFlusher())


def test_the_first_write_of_a_turn_goes_out_at_once_and_later_ones_at_its_end(
    loop: FakeLoop,
) -> None:
    flusher, connection = TurnFlusher(), FakeConnection()
    output = output_on(connection, flusher)
    output.flush(alone=True)
    assert connection.flushes == 1  # not delayed
    output.flush(alone=True)
    output.flush(alone=True)
    assert connection.flushes == 1  # the rest of the burst waits for the end of the turn
    loop.run_turn()
    assert connection.flushes == 2  # ... and goes out in one write
    output.flush(alone=True)  # a new turn: at once again
    assert connection.flushes == 3


def test_a_stream_sharing_its_connection_always_waits_for_the_end_of_the_turn(
    loop: FakeLoop,
) -> None:
    flusher, connection = TurnFlusher(), FakeConnection()
    output = output_on(connection, flusher)
    assert not output.goes_now(alone=False)
    output.flush(alone=False)
    assert connection.flushes == 0  # its neighbours' frames may still join this write
    loop.run_turn()
    assert connection.flushes == 1
    # A stream alone after a shared write in the same turn waits too.
    output.flush(alone=False)
    assert not output.goes_now(alone=True)
    loop.run_turn()
    assert connection.flushes == 2


def test_a_single_write_in_a_turn_costs_no_flush_at_its_end(loop: FakeLoop) -> None:
    flusher = TurnFlusher()
    connections = [FakeConnection() for _ in range(100)]
    outputs = [output_on(connection, flusher) for connection in connections]
    for output in outputs:  # a publish to a hundred connections, one message each
        output.flush(alone=True)
    assert len(loop.callbacks) == 1  # one end-of-turn callback for all of them
    loop.run_turn()
    assert [connection.flushes for connection in connections] == [1] * 100
    outputs[0].flush(alone=True)
    assert connections[0].flushes == 2


def test_late_frames_of_every_connection_wait_for_one_timer(loop: FakeLoop) -> None:
    late, flusher = LateFlusher(), TurnFlusher()
    connections = [FakeConnection() for _ in range(50)]
    outputs = [output_on(connection, flusher, late) for connection in connections]
    for output in outputs:  # fifty clients' PINGs, answered in one write each, later
        output.flush_late()
        output.flush_late()  # asking again while waiting changes nothing
    assert [delay for delay, _ in loop.timers] == [output_module.ACK_DELAY]
    assert [connection.flushes for connection in connections] == [0] * 50
    loop.fire_timers()
    assert [connection.flushes for connection in connections] == [1] * 50
    outputs[0].flush_late()  # the next wait has a timer of its own
    assert len(loop.timers) == 1
    loop.fire_timers()
    assert connections[0].flushes == 2


def test_a_late_flush_does_not_hold_back_the_connections_own_writes(loop: FakeLoop) -> None:
    """A message written meanwhile goes at once (taking the ACK with it, in h2's
    output); the timer then writes whatever is left, which is nothing."""
    connection = FakeConnection()
    output = output_on(connection, TurnFlusher())
    output.flush_late()
    output.flush(alone=True)
    assert connection.flushes == 1
    loop.fire_timers()
    assert connection.flushes == 2
