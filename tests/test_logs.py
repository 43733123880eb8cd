"""The log helpers every fault boundary uses: bounded quotes, rate-limited lines."""

from __future__ import annotations

import logging

import pytest

from jobsignal.logs import RateLimitedLog, RateLimitFilter, configure_logging
from jobsignal.util.text import quote


def test_quote_bounds_untrusted_values() -> None:
    assert quote("short") == "'short'"
    long = quote("x" * 10_000, limit=50)
    assert long.startswith("'" + "x" * 49) and "(9952 more characters)" in long
    assert len(long) < 100


def test_rate_limited_log_writes_a_burst_then_counts_and_reports(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    faults = RateLimitedLog(logging.getLogger("t"), burst=3, interval=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        written = [faults.warning("flood", "line %d", i) for i in range(10)]
        assert written == [True] * 3 + [False] * 7
        # Another kind of fault has its own budget.
        assert faults.warning("other", "other line")
        now[0] = 61.0
        assert faults.warning("flood", "after the window")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "line 0",
        "line 1",
        "line 2",
        "other line",
        "flood: 7 similar messages suppressed",
        "after the window",
    ]


def test_third_party_records_are_rate_limited_per_template(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("some.library")
    limiter = RateLimitFilter(burst=2, interval=60.0)
    logger.addFilter(limiter)
    try:
        with caplog.at_level(logging.WARNING):
            for i in range(5):
                logger.warning("Application error %d", i)
            logger.warning("Protocol error")
        assert [r.getMessage() for r in caplog.records] == [
            "Application error 0",
            "Application error 1",
            "Protocol error",
        ]
    finally:
        logger.removeFilter(limiter)


def test_grpclib_and_trios_accept_loop_are_rate_limited_not_silenced(root_logging: None) -> None:
    root = logging.getLogger()
    configure_logging("info", "text")
    configure_logging("info", "text")  # idempotent: one filter
    grpclib_log = logging.getLogger("grpclib")
    assert grpclib_log.getEffectiveLevel() == logging.WARNING
    assert sum(isinstance(f, RateLimitFilter) for f in grpclib_log.filters) == 1
    # trio's accept loop (the demo cluster's emulator) out of files: a line every 0.1 s.
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    root.addHandler(handler)
    accept_log = logging.getLogger("trio.serve_listeners")
    for _ in range(50):
        accept_log.error("accept returned %s (%s); retrying in %s seconds", "EMFILE", "", 0.1)
    assert len(seen) == 5
