"""The command line's client commands: `demo`, `subscribe`, `jobs` and `check`.

Imported by `jobsignal.cli` only when one of them runs, so `jobsignal serve`
loads no gRPC client (docs/architecture.md section 1, "Data flow").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import trio

from jobsignal._proto.job import JobSummarySignal, JobSummarySignalList
from jobsignal.app import run_jobsignal
from jobsignal.client import (
    CallFailed,
    Signal,
    SubscribeFailed,
    SubscribeOptions,
    check_health,
    client_ssl_context,
    fetch_jobs,
    open_subscription,
)
from jobsignal.config import (
    SERVE_SETTINGS,
    SUBSCRIBE_SETTINGS,
    ConfigError,
    load_config,
    parse_listen,
    resolve,
)
from jobsignal.logs import configure_logging
from jobsignal.terminal import emit, lone_exception, run, tell

T = TypeVar("T")


def _signal_json(signal: JobSummarySignal) -> dict[str, str]:
    return {
        "uuid": signal.uuid,
        "jobId": signal.job_id,
        "jobName": signal.job_name,
        "namespace": signal.namespace,
        "frameWork": signal.frame_work,
        "jobStatus": signal.job_status,
        "time": signal.time,
        "cmIndex": signal.cm_index,
        "total": signal.total,
        "HcclJson": signal.hccl_json,
        "deleteTime": signal.delete_time,
        "sharedTorIp": signal.shared_tor_ip,
        "masterAddr": signal.master_addr,
        "operator": signal.operator,
        "sid": signal.sid,
    }


def format_message(message: Signal, as_json: bool) -> str:
    if isinstance(message, JobSummarySignalList):
        if as_json:
            return json.dumps(
                {
                    "ReportTime": message.report_time,
                    "JobTotalNum": message.job_total_num,
                    "jobSummarySignals": [_signal_json(s) for s in message.job_summary_signals],
                },
                ensure_ascii=False,
            )
        lines = [
            f"list: {len(message.job_summary_signals)} signals,"
            f" JobTotalNum={message.job_total_num} ReportTime={message.report_time}"
        ]
        lines += ["  " + format_message(s, False) for s in message.job_summary_signals]
        return "\n".join(lines)
    if as_json:
        return json.dumps(_signal_json(message), ensure_ascii=False)
    return (
        f"{message.namespace}/{message.job_name} {message.job_status} {message.operator}"
        f" total={message.total} rank-table={len(message.hccl_json)}B uuid={message.uuid}"
    )


async def print_signals(options: SubscribeOptions, as_json: bool) -> None:
    async with open_subscription(options) as signals:
        async for message in signals:
            emit(format_message(message, as_json))


async def until_interrupted(function: Callable[..., Awaitable[None]], *args: object) -> None:
    """`function(*args)` until it returns or SIGINT (Ctrl-C) or SIGTERM comes; then,
    with the connection closed, KeyboardInterrupt (status 130). Left to Python, the
    interrupt lands in trio-asyncio's loop and comes out as the stream's error; and
    what the stream raises while the interrupt tears it down is no news either."""
    interrupted = False
    try:
        async with trio.open_nursery() as nursery:

            async def cancel_on_signal() -> None:
                nonlocal interrupted
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        interrupted = True
                        nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_on_signal)
            await function(*args)
            nursery.cancel_scope.cancel()
    except Exception as error:
        if not interrupted:  # what ended `function`, as itself (SubscribeFailed)
            lone = lone_exception(error) if isinstance(error, ExceptionGroup) else error
            raise (lone or error) from None
    if interrupted:
        raise KeyboardInterrupt


# -- jobsignal jobs ---------------------------------------------------------------------


def _cell(text: str) -> str:
    """A table cell from server data: no blanks or control characters to break columns."""
    return "".join(c if c.isprintable() and not c.isspace() else "?" for c in text) or "<none>"


def npu_count(hccl_json: str) -> str:
    """The NPUs in a rank table (its servers' devices); <unknown> when the server sent
    none (a job too large for one List batch goes without it) or it does not parse."""
    try:
        table = json.loads(hccl_json)
        servers = table.get("server_list", [])
        return str(sum(len(server.get("device", [])) for server in servers))
    except (ValueError, TypeError, AttributeError, RecursionError):
        return "<unknown>"


# kubectl's steps (its HumanDuration): an age below `bound` seconds is shown in
# `unit`, followed by the remainder in `then` unless that is zero or `then` is "".
_AGE_STEPS = (
    (2 * 60, "s", ""),
    (10 * 60, "m", "s"),
    (3 * 3600, "m", ""),
    (8 * 3600, "h", "m"),
    (48 * 3600, "h", ""),
    (8 * 86400, "d", "h"),
    (2 * 365 * 86400, "d", ""),
    (8 * 365 * 86400, "y", "d"),
)
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "y": 365 * 86400}


def human_age(seconds: float) -> str:
    """An age the way kubectl prints one: 45s, 7m3s, 2h10m, 3d4h, 400d, 3y12d."""
    s = max(0, int(seconds))
    unit, then = next(((unit, then) for bound, unit, then in _AGE_STEPS if s < bound), ("y", ""))
    size = _UNIT_SECONDS[unit]
    text = f"{s // size}{unit}"
    rest = (s % size) // _UNIT_SECONDS[then] if then else 0
    return f"{text}{rest}{then}" if rest else text


def job_age(started: str, now: float) -> str:
    """The age of a job from its `time` field: Unix seconds (milliseconds are taken too)."""
    try:
        value = float(started)
    except ValueError:
        return "<unknown>"
    if not 0 < value < float("inf"):
        return "<unknown>"
    if value > 1e11:  # milliseconds: 1e11 seconds is past the year 5000
        value /= 1000
    return human_age(now - value)


def jobs_table(jobs: Sequence[JobSummarySignal], now: float, headers: bool = True) -> str:
    """Columns as `kubectl get -A` prints them: NAMESPACE NAME STATUS NPUS AGE."""
    rows = [["NAMESPACE", "NAME", "STATUS", "NPUS", "AGE"]] if headers else []
    for job in sorted(jobs, key=lambda j: (j.namespace, j.job_name, j.job_id)):
        status = _cell(job.job_status)
        if job.operator == "delete":
            status += "(deleted)"
        age = job_age(job.time, now)
        rows.append(
            [_cell(job.namespace), _cell(job.job_name), status, npu_count(job.hccl_json), age]
        )
    widths = [max(len(row[column]) for row in rows) for column in range(5)]
    return "\n".join(
        "   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


async def _answer_within(
    seconds: float, what: str, options: SubscribeOptions, call: Callable[[], Awaitable[T]]
) -> T:
    """The answer of `call`, or CallFailed saying no `what` came within `seconds`."""
    try:
        with trio.fail_after(seconds):
            return await call()
    except trio.TooSlowError:
        raise CallFailed(
            f"no {what} from {options.host}:{options.port} within {seconds:g}s"
        ) from None


async def print_jobs(options: SubscribeOptions, args: argparse.Namespace) -> int:
    jobs = await _answer_within(
        args.timeout, "complete job list", options, lambda: fetch_jobs(options)
    )
    if args.namespace:
        jobs = [job for job in jobs if job.namespace == args.namespace]
    if not jobs:
        where = f" in namespace {args.namespace}" if args.namespace else ""
        tell(f"No jobs found{where}.")
        return 0
    emit(jobs_table(jobs, time.time(), headers=not args.no_headers))
    return 0


# -- jobsignal check --------------------------------------------------------------------


async def print_health(options: SubscribeOptions, args: argparse.Namespace) -> int:
    status = await _answer_within(
        args.timeout, "health answer", options, lambda: check_health(options, args.service)
    )
    emit(status)
    return 0 if status == "SERVING" else 1


# -- jobsignal demo ---------------------------------------------------------------------


# A demo is for this machine: it listens on loopback unless told otherwise.
DEMO_LISTEN = "127.0.0.1:8899"


async def _demo(config_flags: dict[str, str | None], environ: Mapping[str, str]) -> None:
    # No load balancer sends clients to a demo: Ctrl-C stops it without a drain.
    flags = {**config_flags, "source": "demo", "drain_delay": "0"}
    (listen,) = [s for s in SERVE_SETTINGS if s.name == "listen"]
    if flags.get("listen") is None and listen.env not in environ:
        flags["listen"] = DEMO_LISTEN
    config = load_config(flags, environ)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: run_jobsignal(config, handle_signals=True, task_status=task_status)
        )
        host = "127.0.0.1" if server.host in ("", "0.0.0.0", "::") else server.host
        options = SubscribeOptions(host, server.port, "CCAgent")
        emit(f"jobsignal demo: serving on {server.host}:{server.port}; subscriber output:")
        # The server beside it logs what happens; its own subscriber says only errors
        # (not, say, that the server it shares the process with is shutting down).
        logging.getLogger("jobsignal.client").setLevel(logging.ERROR)
        nursery.start_soon(print_signals, options, False)
        await server.stopped.wait()
        nursery.cancel_scope.cancel()


def subscribe_options(args: argparse.Namespace, environ: Mapping[str, str]) -> SubscribeOptions:
    """A client command's options from its flags and JOBSIGNAL_SUBSCRIBE_* env vars."""
    try:
        host, port = parse_listen(args.target)
    except ValueError as error:
        raise ConfigError(f"--target={args.target!r}: {error}") from None
    tls = resolve(SUBSCRIBE_SETTINGS, vars(args), environ)
    if not tls["tls_ca"] and any(tls.values()):
        raise ConfigError(
            "--tls-cert, --tls-key and --tls-server-name need --tls-ca"
            " (a PEM CA bundle, or 'system' for the system's trust store)"
        )
    if bool(tls["tls_cert"]) != bool(tls["tls_key"]):
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    options = SubscribeOptions(
        host,
        port,
        getattr(args, "role", ""),
        getattr(args, "list", False),
        getattr(args, "keepalive", 30.0),
        tls=bool(tls["tls_ca"]),
        tls_ca="" if tls["tls_ca"] == "system" else tls["tls_ca"],
        tls_cert=tls["tls_cert"],
        tls_key=tls["tls_key"],
        tls_server_name=tls["tls_server_name"],
    )
    if options.uses_tls:
        try:
            client_ssl_context(options)  # unreadable files are a usage error, found now
        except SubscribeFailed as error:
            raise ConfigError(str(error)) from None
    return options


def _announce_subscription(options: SubscribeOptions) -> SubscribeOptions:
    """`options` that say on stderr when the client has subscribed and is waiting."""
    stream = "job lists" if options.list_mode else "job events"

    def subscribed(client_id: str) -> None:
        tell(
            f"subscribed to {options.host}:{options.port} as {options.role}"
            f" (id {client_id}): waiting for {stream}"
        )

    return dataclasses.replace(options, on_subscribed=subscribed)


def run_client_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Run `args.command`; its exit status. A refused subscription or a call that
    failed is said on stderr (status 1); a ConfigError is the caller's to report."""
    try:
        if args.command == "demo":
            level = resolve(
                [s for s in SERVE_SETTINGS if s.name == "log_level"], vars(args), environ
            )
            configure_logging(level["log_level"], "text")
            run(_demo, vars(args), environ)
        elif args.command == "subscribe":
            configure_logging("warning", "text")
            options = _announce_subscription(subscribe_options(args, environ))
            run(until_interrupted, print_signals, options, args.json)
        elif args.command == "jobs":
            configure_logging("warning", "text")
            status: int = run(print_jobs, subscribe_options(args, environ), args)
            return status
        else:
            configure_logging("error", "text")
            status = run(print_health, subscribe_options(args, environ), args)
            return status
    except SubscribeFailed as error:
        print(f"jobsignal: subscription refused: {error}", file=sys.stderr)
        return 1
    except CallFailed as error:
        print(f"jobsignal {args.command}: {error}", file=sys.stderr)
        return 1
    return 0
