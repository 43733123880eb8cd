"""TurnFlusher: one end-of-turn callback writes every connection with output due."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

import pytest

from jobsignal.rpc.output import ConnectionOutput, TurnFlusher


class FakeLoop:
    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.callbacks.append(callback)

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
