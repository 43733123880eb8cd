"""Logging: set-up (readable lines, or one JSON object per line), and the
helper every fault boundary uses: `RateLimitedLog` bounds how many lines one
kind of fault can write, so a hostile peer cannot flood the log (how much of
an untrusted value a line quotes is bounded by `jobsignal.util.text`).

Both formats stamp lines in UTC, RFC 3339 with milliseconds
(2026-12-01T09:00:00.123Z). JSON lines carry a record's `extra` fields as keys
(`event`, `role`, `client_id`, `peer`, `reason`, ...), so a log pipeline need
not parse the message text; their formatter (`json_logs.py`, python-json-logger)
is imported only when JSON is asked for.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import TypedDict, Unpack

import trio


def _now() -> float:
    try:
        return trio.current_time()
    except RuntimeError:  # outside trio (plain unit tests, asyncio-only callers)
        return time.monotonic()


class LogOptions(TypedDict, total=False):
    """What `RateLimitedLog`'s methods pass on to `Logger.log` besides the message."""

    exc_info: bool | BaseException  # True: the exception being handled
    extra: Mapping[str, object] | None


class RateLimitedLog:
    """At most `burst` lines per `key` per `interval` seconds; the rest are counted.

    When a key's window has passed, its next line first says how many were
    suppressed. Keys are kinds of fault (for example "rapid_reset"), never
    peer-controlled text, so the table stays small.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 5,
        interval: float = 60.0,
        clock: Callable[[], float] = _now,
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.interval = interval
        self._clock = clock
        # key -> (window start, lines written in it, lines suppressed in it)
        self._windows: dict[str, tuple[float, int, int]] = {}

    def admit(self, key: str) -> tuple[bool, int]:
        """Whether a line for `key` may be written now, and how many were
        suppressed in the window that just ended (to be reported once)."""
        now = self._clock()
        start, written, suppressed = self._windows.get(key, (now, 0, 0))
        reported = 0
        if now - start >= self.interval:
            reported = suppressed
            start, written, suppressed = now, 0, 0
        if written >= self.burst:
            self._windows[key] = (start, written, suppressed + 1)
            return False, reported
        self._windows[key] = (start, written + 1, suppressed)
        return True, reported

    def log(
        self, level: int, key: str, message: str, *args: object, **options: Unpack[LogOptions]
    ) -> bool:
        """Log unless `key` is over its budget; True when the line was written."""
        admitted, suppressed = self.admit(key)
        if suppressed:
            self.logger.log(level, "%s: %d similar messages suppressed", key, suppressed)
        if admitted:
            self.logger.log(level, message, *args, **options)
        return admitted

    def warning(self, key: str, message: str, *args: object, **options: Unpack[LogOptions]) -> bool:
        return self.log(logging.WARNING, key, message, *args, **options)

    def error(self, key: str, message: str, *args: object, **options: Unpack[LogOptions]) -> bool:
        return self.log(logging.ERROR, key, message, *args, **options)


class RateLimitFilter(logging.Filter):
    """Rate-limits another library's log records, per message template.

    For loggers jobsignal does not write itself (grpclib logs every failed
    stream, with a traceback): their records stay visible, but a peer that
    makes them fail a thousand times a second cannot flood the log.
    """

    def __init__(self, *, burst: int = 5, interval: float = 60.0) -> None:
        super().__init__()
        self._budget = RateLimitedLog(logging.getLogger(__name__), burst=burst, interval=interval)

    def filter(self, record: logging.LogRecord) -> bool:
        admitted, suppressed = self._budget.admit(f"{record.name}:{record.msg}")
        if admitted and suppressed:
            record.msg = f"{record.msg} ({suppressed} similar messages suppressed before)"
        return admitted


def utc_timestamp(record: logging.LogRecord) -> str:
    """When `record` was made, in UTC: 2026-12-01T09:00:00.123Z (RFC 3339)."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """`2026-12-01T09:00:00.123Z INFO    jobsignal.app: message`, whatever the local zone."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return utc_timestamp(record)


# Other libraries' loggers that a peer can make write over and over: grpclib
# (every failed stream, with a traceback) and trio's accept loop, which the demo
# cluster's emulator uses (a line with a traceback every 0.1 s while the process
# is out of files; the ports have loops of their own that pause and warn).
RATE_LIMITED_LOGGERS = ("grpclib", "trio.serve_listeners")


def configure_logging(level: str, fmt: str) -> None:
    """Log to stderr at `level` (any case: INFO, Info, info) as `fmt` ("text" or "json")."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from jobsignal.json_logs import JsonFormatter  # (python-json-logger: json only)

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # grpclib logs cancelled streams at info level and protocol and handler
    # failures with tracebacks; jobsignal reports stream ends itself, so keep
    # only grpclib's warnings and errors.
    logging.getLogger("grpclib").setLevel(logging.WARNING)
    for name in RATE_LIMITED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(RateLimitFilter())
    logging.getLogger("httpx").setLevel(logging.WARNING)
