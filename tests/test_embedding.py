"""The public API for trio programs, and the example that shows it."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import jobsignal
from tests.support.metrics import scrape

ROOT = Path(__file__).parent.parent


def test_public_api_is_small_and_documented() -> None:
    assert sorted(jobsignal.__all__) == [
        "Config",
        "ConfigError",
        "EventKind",
        "FellBehind",
        "JobEvent",
        "JobEvents",
        "JobState",
        "JobSummarySignal",
        "JobSummarySignalList",
        "RankDevice",
        "RankServer",
        "RankTable",
        "RunningJobsignal",
        "SubscribeFailed",
        "SubscribeOptions",
        "configure",
        "open_subscription",
        "serve",
        "subscribe",
        "watch_jobs",
    ]
    for name in jobsignal.__all__:
        assert has_written_docstring(getattr(jobsignal, name)), f"{name} has no docstring"


def has_written_docstring(obj: object) -> bool:
    """A docstring someone wrote: a dataclass without one gets `Name(field: type, ...)`."""
    doc = (getattr(obj, "__doc__", None) or "").strip()
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        return bool(doc) and not doc.startswith(f"{obj.__name__}(")
    return bool(doc)


def test_the_docstring_check_sees_through_generated_ones() -> None:
    @dataclasses.dataclass
    class Bare:
        field: int

    @dataclasses.dataclass
    class Written:
        """What it is for."""

        field: int

    def bare() -> None:
        pass

    assert Bare.__doc__  # generated, so a plain truth test would pass it
    assert not has_written_docstring(Bare)
    assert not has_written_docstring(bare)
    assert has_written_docstring(Written)
    assert has_written_docstring(has_written_docstring)


def test_a_running_server_shows_only_what_embedders_need() -> None:
    public = {name for name in vars(jobsignal.RunningJobsignal) if not name.startswith("_")}
    assert public == {
        "addresses",
        "host",
        "metrics_port",
        "open_subscription",
        "port",
        "ready",
        "request_shutdown",
        "stopped",
    }


async def test_a_running_server_reports_its_addresses_readiness_and_end() -> None:
    config = jobsignal.configure(
        listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", source="demo", drain_delay=0
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server: jobsignal.RunningJobsignal = await nursery.start(
                functools.partial(jobsignal.serve, config, environ={})
            )
            assert server.host == "127.0.0.1" and server.port > 0
            assert server.addresses == (("127.0.0.1", server.port),)
            assert server.metrics_port is not None and server.metrics_port > 0
            assert server.metrics_port != server.port
            await server.ready.wait()  # the demo cluster's first LIST is applied
            assert not server.stopped.is_set()
            # An in-process consumer shows in the metrics, and goes when it leaves.
            async with server.open_subscription(snapshot=False):
                scraped = await scrape(server.metrics_port)
                assert scraped.value("jobsignal_in_process_consumers") == 1
            assert (await scrape(server.metrics_port)).value("jobsignal_in_process_consumers") == 0
            server.request_shutdown()
            await server.stopped.wait()


def test_configure_validates_like_the_command_line() -> None:
    config = jobsignal.configure(
        listen="127.0.0.1:0", idle_timeout=30, keepalive_time=20, roles="CCAgent", snapshot_roles=""
    )
    assert config.listen == (("127.0.0.1", 0),)
    assert config.idle_timeout == 30.0
    assert config.roles == ("CCAgent",)
    with pytest.raises(jobsignal.ConfigError, match="--idle-timeout='0'"):
        jobsignal.configure(idle_timeout=0, snapshot_roles="")
    with pytest.raises(jobsignal.ConfigError, match="unknown settings \\['idle'\\]"):
        jobsignal.configure(idle=3)


def test_example_program_runs() -> None:
    # This checkout's jobsignal, not whichever one the interpreter has installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed.py"), "3"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert all(line.startswith("demo/") and "(add)" in line for line in lines), lines
    assert "Traceback" not in result.stderr


SUBSCRIBER = """
import sys
import trio
import jobsignal

async def main():
    options = jobsignal.SubscribeOptions("127.0.0.1", int(sys.argv[1]), role="CCAgent")
    async with jobsignal.open_subscription(options) as signals:
        async for signal in signals:
            print(signal.job_name, flush=True)

trio.run(main, restrict_keyboard_interrupt_to_checkpoints=True)
"""


async def test_ctrl_c_ends_a_subscriber_with_keyboard_interrupt_not_a_stream_error() -> None:
    """Ctrl-C during a subscription, run as docs/embedding.md says, ends the program
    with KeyboardInterrupt: not StreamTerminatedError (trio_asyncio's iterator
    adapter handed the cancelled read's late error to the program, three times
    in four), and not a hang (Ctrl-C inside asyncio's callbacks, the moment the
    first signals arrive: pause 0)."""
    config = jobsignal.configure(listen="127.0.0.1:0", source="demo", log_level="warning")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    async with trio.open_nursery() as nursery:
        server: jobsignal.RunningJobsignal = await nursery.start(
            functools.partial(jobsignal.serve, config, environ={})
        )
        for pause in (0.0, 0.0, 0.0, 0.5, 1.0):  # after the first signals
            with trio.fail_after(30):
                told, returncode = await _interrupted_subscriber(server.port, path, pause)
            assert returncode == -signal.SIGINT, told
            assert told.rstrip().endswith("KeyboardInterrupt"), told
            assert "StreamTerminatedError" not in told
        server.request_shutdown()


async def _interrupted_subscriber(port: int, path: str, pause: float) -> tuple[str, int]:
    """SUBSCRIBER's stderr and exit status when SIGINT comes `pause` s after its
    first signals."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", SUBSCRIBER, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": path},
        # Ctrl-C's default, whatever this run inherited: a suite started in the
        # background of a non-interactive shell has SIGINT ignored, and a child
        # that starts so never sees it.
        preexec_fn=_sigint_default,
    )
    assert process.stdout is not None and process.stderr is not None
    try:
        first = await process.stdout.receive_some()
        assert first.strip(), "the subscriber printed nothing"
        await trio.sleep(pause)
        process.send_signal(signal.SIGINT)
        stderr = bytearray()
        while chunk := await process.stderr.receive_some():
            stderr += chunk
        returncode = await process.wait()
    finally:
        process.kill()
        with trio.CancelScope(shield=True):  # (closed even when the test timed out)
            await process.stdout.aclose()
            await process.stderr.aclose()
            await process.wait()
    return stderr.decode(), returncode


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
