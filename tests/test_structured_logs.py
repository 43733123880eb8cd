"""Logs a pipeline can use: JSON lines with fields as keys, UTC RFC 3339 stamps, levels in any case.

The last test runs the real `jobsignal serve` with `--log-format json` and reads
the fields of its client lines (subscribed, ended, refused) off its stderr.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
import trio

from jobsignal.cli import main
from jobsignal.config import ConfigError, load_config
from jobsignal.json_logs import JsonFormatter
from jobsignal.logs import RateLimitedLog, TextFormatter, configure_logging
from tests.support.grpcio import GrpcioClients, rpc_error
from tests.support.threads import in_thread

# 2026-12-01T09:00:00.123Z
CREATED = 1_796_115_600.123
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("JOBSIGNAL_", "KUBE"))}


@pytest.fixture
def far_east() -> Iterator[None]:
    """A local zone 8 hours ahead of UTC, so a local-time stamp would show."""
    saved = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Shanghai"
    time.tzset()
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = saved
        time.tzset()


def record(message: str = "hello", **extra: object) -> logging.LogRecord:
    made = logging.makeLogRecord(
        {"name": "jobsignal.test", "levelno": logging.INFO, "levelname": "INFO", "msg": message}
    )
    made.created, made.msecs = CREATED, 123.0
    made.__dict__.update(extra)
    return made


def json_lines(err: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def test_json_lines_carry_the_records_extra_fields_as_keys(
    root_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info", "json")
    fields = {
        "event": "client_subscription_ended",
        "role": "CCAgent",
        "client_id": "0d6c",
        "peer": "127.0.0.1:5000",
        "reason": "idle",
        "namespace": "training",
        "job": "llama-70b",
        "npus": 768,
    }
    logging.getLogger("jobsignal.test").info(
        "client subscription ended: %s reason=%s", "CCAgent", "idle", extra=fields
    )
    (line,) = json_lines(capsys.readouterr().err)
    assert line == {
        "time": line["time"],
        "level": "info",
        "logger": "jobsignal.test",
        "message": "client subscription ended: CCAgent reason=idle",
        **fields,
    }
    assert list(line)[:4] == ["time", "level", "logger", "message"]


def test_json_envelope_is_kept_and_odd_values_still_make_a_json_line() -> None:
    formatter = JsonFormatter()
    # An extra field cannot replace the envelope; values JSON cannot hold are written as text.
    line = json.loads(
        formatter.format(record(time="forged", level="debug", peer=("10.0.0.1", 5), what=object()))
    )
    assert (line["time"], line["level"]) == ("2026-12-01T09:00:00.123Z", "info")
    assert line["peer"] == ["10.0.0.1", 5]
    assert str(line["what"]).startswith("<object object at")
    # Non-ASCII stays readable; a newline in a message cannot start a second line.
    text = formatter.format(record("job 训练\nsecond line"))
    assert "\n" not in text and json.loads(text)["message"] == "job 训练\nsecond line"
    assert "训练" in text


def test_json_lines_carry_the_traceback_as_error(
    root_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info", "json")
    try:
        raise KeyError("missing")
    except KeyError:
        logging.getLogger("jobsignal.test").exception("lookup failed", extra={"event": "x"})
    (line,) = json_lines(capsys.readouterr().err)
    assert line["message"] == "lookup failed" and line["event"] == "x"
    assert line["level"] == "error"
    assert "Traceback" in str(line["error"]) and "KeyError: 'missing'" in str(line["error"])


def test_rate_limited_lines_keep_their_fields(
    root_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info", "json")
    faults = RateLimitedLog(logging.getLogger("jobsignal.test"), burst=1, clock=lambda: 0.0)
    for _ in range(3):
        faults.warning("register_full", "refused %s", "x", extra={"event": "register_refused"})
    (line,) = json_lines(capsys.readouterr().err)
    assert (line["message"], line["event"]) == ("refused x", "register_refused")


def test_timestamps_are_utc_rfc3339_whatever_the_local_zone(far_east: None) -> None:
    assert (
        TextFormatter().format(record()) == "2026-12-01T09:00:00.123Z INFO    jobsignal.test: hello"
    )
    assert json.loads(JsonFormatter().format(record()))["time"] == "2026-12-01T09:00:00.123Z"


def test_a_real_text_line_is_stamped_now_in_utc(
    root_logging: None, far_east: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info", "text")
    logging.getLogger("jobsignal.test").warning("hello")
    err = capsys.readouterr().err
    match = re.fullmatch(
        r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z WARNING jobsignal\.test: hello\n", err
    )
    assert match, err
    stamped = datetime.fromisoformat(match.group(1)).replace(tzinfo=UTC)
    assert abs(stamped.timestamp() - time.time()) < 60


@pytest.mark.parametrize("given", ["INFO", "Info", "info"])
def test_log_level_in_any_case(given: str, root_logging: None) -> None:
    assert load_config({"log_level": given}, {}).log_level == "info"
    assert load_config({}, {"JOBSIGNAL_LOG_LEVEL": given.swapcase()}).log_level == "info"
    configure_logging(load_config({"log_level": given}, {}).log_level, "text")
    assert logging.getLogger().level == logging.INFO


def test_a_bad_log_level_is_a_clear_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as error:
        load_config({}, {"JOBSIGNAL_LOG_LEVEL": "loud"})
    assert str(error.value) == (
        "JOBSIGNAL_LOG_LEVEL='loud': must be one of debug, info, warning, error (in any case)"
    )
    for command in ("serve", "demo"):
        assert main([command, "--log-level", "LOUD"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("jobsignal: error: --log-level='LOUD': must be one of debug, info")
        assert "Traceback" not in err


# -- the real server ---------------------------------------------------------------------------


class JsonLog:
    """The JSON lines of a process's stderr, read as they come."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.lines: list[dict[str, Any]] = []
        self._buffer = bytearray()

    async def next(self, wanted: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The next line for which `wanted` is true."""
        with trio.fail_after(30):
            while True:
                while b"\n" in self._buffer:
                    raw, _, rest = bytes(self._buffer).partition(b"\n")
                    self._buffer[:] = rest
                    line: dict[str, Any] = json.loads(raw)  # every line is one JSON object
                    self.lines.append(line)
                    if wanted(line):
                        return line
                chunk = await self.stream.receive_some()
                assert chunk, f"the server exited; its lines: {self.lines}"
                self._buffer += chunk

    async def event(self, name: str) -> dict[str, Any]:
        return await self.next(lambda line: line.get("event") == name)


async def test_the_servers_json_lines_name_role_client_peer_and_reason(
    grpc_clients: GrpcioClients,
) -> None:
    command = [sys.executable, "-m", "jobsignal", "serve", "--source", "demo"]
    command += ["--listen", "127.0.0.1:0", "--log-format", "json", "--log-level", "INFO"]
    env = {**CLEAN_ENV, "HOME": "/nonexistent"}
    process = await trio.lowlevel.open_process(
        command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
    try:
        assert process.stderr is not None
        log = JsonLog(process.stderr)
        listening = await log.next(lambda line: "gRPC listening on" in line["message"])
        port = re.search(r"127\.0\.0\.1:(\d+)", listening["message"]).group(1)  # type: ignore[union-attr]
        client = grpc_clients.connect(f"127.0.0.1:{port}")

        client_id = await in_thread(client.register_id, "CCAgent")
        stream = client.subscribe("CCAgent", client_id)
        subscribed = await log.event("client_subscribed")
        stream.cancel()
        ended = await log.event("client_subscription_ended")
        refused_role = await rpc_error(lambda: client.register("Hacker"))
        register_refused = await log.event("register_refused")
        refused_id = await rpc_error(lambda: list(client.subscribe("CCAgent", "no-such-id")))
        subscribe_refused = await log.event("subscribe_refused")
    finally:
        process.kill()
        await process.wait()

    assert refused_role.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused_id.code() == grpc.StatusCode.FAILED_PRECONDITION
    peer = subscribed["peer"]
    assert re.fullmatch(r"127\.0\.0\.1:\d+", peer), peer
    common = {"role": "CCAgent", "client_id": client_id, "peer": peer}
    common["stream"] = "SubscribeJobSummarySignal"
    assert subscribed.items() >= common.items()
    assert subscribed["level"] == "info" and subscribed["logger"] == "jobsignal.rpc.session"
    assert ended.items() >= {**common, "reason": "client_gone"}.items()
    assert (
        register_refused.items()
        >= {
            "role": "Hacker",
            "peer": peer,
            "reason": "INVALID_ARGUMENT",
        }.items()
    )
    assert (
        subscribe_refused.items()
        >= {
            "role": "CCAgent",
            "client_id": "no-such-id",
            "peer": peer,
            "reason": "FAILED_PRECONDITION",
        }.items()
    )
    # The message text is still there for people reading the log.
    assert subscribed["message"].startswith("client subscribed: SubscribeJobSummarySignal")
