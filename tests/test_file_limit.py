"""`jobsignal serve`, `demo` and their limit of open files (jobsignal/process/file_limit.py).

The real command in a child process whose limit is set before it starts, as
a service manager would set it.
"""

from __future__ import annotations

import re
import signal

import pytest

from jobsignal.metrics_server import MAX_CONNECTIONS as METRICS_CONNECTIONS
from jobsignal.process.file_limit import RESERVED_FILES, shortfall
from jobsignal.rpc.connections import MAX_LINGERING_REFUSALS
from tests.test_cli import _read_until, running

READY = r"ready: job store loaded"
DEFAULT_MAX_CONNECTIONS = 1024


def serve_with_open_files(soft: int, hard: int, *flags: str) -> str:
    """What `jobsignal serve --source demo` logged until it was ready, then stopped."""
    with running(
        "serve", "--source", "demo", "--listen", "127.0.0.1:0", *flags, open_files=(soft, hard)
    ) as server:
        lines = _read_until(server.stderr, READY)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=15) == 0
    return "".join(lines)


def test_serve_raises_its_soft_limit_to_the_hard_limit() -> None:
    log = serve_with_open_files(256, 4096)
    assert "open files: soft limit raised from 256 to 4096" in log
    assert "ulimit -n" not in log  # enough for the default limits: no warning


@pytest.mark.slow
def test_serve_warns_when_the_limit_is_below_what_its_connections_need() -> None:
    log = serve_with_open_files(512, 512, "--metrics-listen", "127.0.0.1:0")
    assert "soft limit raised" not in log
    needed = DEFAULT_MAX_CONNECTIONS + MAX_LINGERING_REFUSALS + METRICS_CONNECTIONS + RESERVED_FILES
    (warning,) = [line for line in log.splitlines() if "ulimit -n" in line]
    assert "WARNING" in warning
    assert re.search(rf"may open 512 files \(ulimit -n\), fewer than the {needed} ", warning)
    assert "--max-connections" in warning
    # Lowering --max-connections is the way out the warning names: it goes.
    quiet = serve_with_open_files(512, 512, "--max-connections", "300")
    assert "ulimit -n" not in quiet


def test_shortfall_counts_the_reserve_and_ignores_no_limit() -> None:
    assert shortfall(100, 100 + RESERVED_FILES) is None
    assert shortfall(100, None) is None  # unlimited
    why = shortfall(100, 100 + RESERVED_FILES - 1)
    assert why is not None and f"fewer than the {100 + RESERVED_FILES} " in why


def demo_with_open_files(soft: int, hard: int) -> str:
    """What `jobsignal demo` wrote on stderr until its subscriber showed a job, then stopped."""
    with running("demo", "--listen", "127.0.0.1:0", open_files=(soft, hard)) as demo:
        _read_until(demo.stdout, r"running add")
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=15) == 0
        assert demo.stderr is not None
        return demo.stderr.read()


def test_demo_raises_its_soft_limit_before_judging_it() -> None:
    # An ordinary user's limits (soft 1024 is common) with room in the hard one: no alarm.
    assert "ulimit -n" not in demo_with_open_files(256, 4096)
    # Only a hard limit that is itself short is worth a warning.
    assert "may open 256 files (ulimit -n)" in demo_with_open_files(256, 256)
