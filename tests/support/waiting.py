"""The one way tests wait for a condition: `wait_until`, and `wait_until_blocking` off trio.

A test waits for what it can observe (a counter, a subscriber, a message)
instead of sleeping, and every wait is bounded: on timeout it fails the test
with what it was waiting for rather than hanging.

How the condition is re-checked depends on the clock (docs/architecture.md
section 9):

- the real clock: every `interval` seconds, since much of what these tests
  wait for is changed by grpcio's worker threads, which no trio task step
  announces;
- a `trio.testing.MockClock`: once per turn of trio's run loop, from an
  instrument, and never by a timer of its own. A polling timer would make an
  autojumping clock jump to it again and again, and each jump of `io_clock`
  (tests/conftest.py) costs its threshold in real time. On a frozen clock
  (`mock_clock`: no autojump, no rate) it also re-checks after every
  `FROZEN_RECHECK` real seconds of idleness, for what a child process or a
  thread changes, and `within` counts real seconds: the clock's never pass.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import trio
import trio.lowlevel
import trio.testing

#: Real-clock polling interval (seconds).
POLL_INTERVAL = 0.005
#: On a frozen MockClock: real seconds of idleness between re-checks.
FROZEN_RECHECK = 0.05


def _timed_out(within: float, what: str | None, condition: Callable[[], object]) -> AssertionError:
    description = what or getattr(condition, "__name__", "condition")
    return AssertionError(f"timed out after {within}s waiting for {description}")


class _RecheckEveryTurn(trio.abc.Instrument):
    """Sets `met` once `condition` holds, checked each time the run loop is about to wait."""

    def __init__(self, condition: Callable[[], bool], met: trio.Event) -> None:
        self.condition = condition
        self.met = met

    def before_io_wait(self, timeout: float) -> None:
        if self.met.is_set():
            return
        try:
            holds = self.condition()
        except Exception:  # the waiting task evaluates it again, and raises it there
            holds = True
        if holds:
            self.met.set()


async def _recheck_while_idle(instrument: _RecheckEveryTurn) -> None:
    while True:
        await trio.testing.wait_all_tasks_blocked(FROZEN_RECHECK)
        instrument.met.set()


async def _wait_on_mock_clock(
    condition: Callable[[], bool], clock: trio.testing.MockClock, within: float
) -> None:
    """Raises trio.TooSlowError when a frozen clock's wait has taken `within` real seconds."""
    instrument = _RecheckEveryTurn(condition, trio.Event())
    frozen = clock.rate == 0 and clock.autojump_threshold == math.inf
    real_deadline = time.monotonic() + within
    timed_out = False
    trio.lowlevel.add_instrument(instrument)
    try:
        async with trio.open_nursery() as nursery:
            if frozen:
                nursery.start_soon(_recheck_while_idle, instrument)
            while not condition():
                if frozen and time.monotonic() > real_deadline:
                    timed_out = True
                    break
                instrument.met = trio.Event()
                await instrument.met.wait()
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(instrument)
    if timed_out:
        raise trio.TooSlowError


async def wait_until(
    condition: Callable[[], bool],
    *,
    within: float = 10.0,
    what: str | None = None,
    interval: float = POLL_INTERVAL,
) -> float:
    """Wait until `condition()` holds; return the seconds it took (trio's clock).

    Fails the test with an AssertionError naming `what` after `within` seconds.
    `interval` is the real-clock polling interval (raise it for a costly condition).
    """
    if condition():
        return 0.0
    start = trio.current_time()
    clock = trio.lowlevel.current_clock()
    try:
        with trio.fail_after(within):
            if isinstance(clock, trio.testing.MockClock):
                await _wait_on_mock_clock(condition, clock, within)
            else:
                while not condition():
                    await trio.sleep(interval)
    except trio.TooSlowError:
        raise _timed_out(within, what, condition) from None
    return trio.current_time() - start


def wait_until_blocking(
    condition: Callable[[], bool],
    *,
    within: float = 10.0,
    what: str | None = None,
    interval: float = POLL_INTERVAL,
) -> float:
    """`wait_until` for code outside trio (a plain test, a worker thread): polls in real time."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > within:
            raise _timed_out(within, what, condition)
        time.sleep(interval)
    return time.monotonic() - start
