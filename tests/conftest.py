"""Fixtures shared by the whole suite; the helpers themselves are in tests/support/.

- `grpcio_stubs`: job_pb2 / job_pb2_grpc generated from protos/ at test time;
- `grpc_clients`: opens grpcio channels and closes every one of them at
  teardown, which also ends any worker thread still blocked on a stream;
- `ca`: a certificate authority made for the session (trustme);
- `emu`: the Kubernetes API emulator on 127.0.0.1, requiring the bearer token
  `tests.support.cluster.TOKEN` (which `write_kubeconfig` writes by default);
- `io_clock`: virtual time for tests that do real I/O;
- the run's last line names the foreign peers (grpc-js, grpc-go) that ran
  and those that could not be had (tests/support/peers_needed.py).

The clock rule (docs/architecture.md section 9). Timing rules are tested in
virtual time (`trio.testing.MockClock`), and which MockClock depends on what
the test does:

- pure in-memory tests (no sockets, signals, threads or child processes) use
  pytest-trio's `autojump_clock`: its threshold 0 jumps the clock the moment
  every task is blocked, which trio documents as safe only without real I/O;
- tests with real sockets (loopback HTTP, TLS, the metrics port), OS signals,
  threads or child processes under an autojumping clock use `io_clock`, whose
  small positive threshold (`IO_AUTOJUMP_THRESHOLD` real seconds) lets bytes in
  flight, signals and other processes be seen before the clock jumps;
- a frozen `mock_clock` (no autojump) stays as it is: it never jumps by itself.

`tests.support.waiting.wait_until` never polls on a MockClock, so waiting
adds no jumps (each jump of `io_clock` costs its threshold in real time).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Generator, Iterator
from typing import cast

import pytest
import trio.testing
import trio_asyncio  # noqa: F401  (before any grpclib: jobsignal/rpc/__init__.py says why)
import trustme

from jobsignal.sim.emulator import KubeEmulator, open_emulator
from tests.support import peers_needed
from tests.support.cluster import TOKEN
from tests.support.grpcio import GrpcioClients, GrpcioStubs, load

#: Real seconds every task must have been blocked before `io_clock` jumps.
IO_AUTOJUMP_THRESHOLD = 0.02
# The test report's property that carries a worker's news of the peers.
PEERS_NEWS = "jobsignal-peers"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport() -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Tell the controller (pytest-xdist) which peers this worker ran or missed."""
    report = yield
    news = peers_needed.news()
    if news is not None:
        report.user_properties.append((PEERS_NEWS, news))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == PEERS_NEWS:
            peers_needed.learn(cast("dict[str, dict[str, str]]", value))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per reason tests were skipped, then the peers' line."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else "")
        if " peer not available: " not in reason:
            reason = reason.removeprefix("Skipped: ")
            reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in reasons.items():
        terminalreporter.write_line(f"skipped {count}: {reason}", yellow=True)
    if (line := peers_needed.summary()) is not None:
        terminalreporter.write_line(line, bold=True)


@pytest.fixture
def root_logging() -> Iterator[None]:
    """Leave the root logger as it was: configure_logging (and `main`, which calls
    it) replaces its handlers, and one writing to a test's captured stderr would
    outlive the test ("I/O operation on closed file" in later tests)."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


@pytest.fixture(scope="session")
def grpcio_stubs() -> GrpcioStubs:
    return load()


@pytest.fixture
def grpc_clients(grpcio_stubs: GrpcioStubs) -> Iterator[GrpcioClients]:
    clients = GrpcioClients(grpcio_stubs)
    try:
        yield clients
    finally:
        clients.close_all()


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def emu() -> AsyncIterator[KubeEmulator]:
    async with open_emulator(token=TOKEN) as emulator:
        yield emulator


@pytest.fixture
def io_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=IO_AUTOJUMP_THRESHOLD)


@pytest.fixture
def nothing_logged_at_error(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Whatever a test's peer sends, nothing is logged at ERROR (by anyone).

    For modules of hostile input: `pytestmark = pytest.mark.usefixtures(...)`.
    """
    caplog.set_level(logging.INFO)
    yield
    # (In teardown `caplog.records` holds teardown's records: ask for the test's.)
    records = caplog.get_records("setup") + caplog.get_records("call")
    errors = [f"{r.name}: {r.getMessage()}" for r in records if r.levelno >= logging.ERROR]
    assert not errors, errors
