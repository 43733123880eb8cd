"""The command line's client commands: `demo`, `subscribe`, `jobs` and `check`.

Imported by `jobsignal.cli` only when one of them runs, so `jobsignal serve`
loads no gRPC client (docs/architecture.md section 1, "Data flow"); and the server
only for `demo`, so `check` (an exec probe) and `jobs` load no server.
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
from jobsignal.client import CallFailed, Signal, check_health, fetch_jobs, open_subscription
from jobsignal.client_options import SubscribeFailed, SubscribeOptions, client_ssl_context
from jobsignal.config import (
    SUBSCRIBE_SETTINGS,
    TARGET_SETTING,
    Config,
    ConfigError,
    load_config,
    resolve,
    show_address,
)
from jobsignal.logs import configure_logging
from jobsignal.terminal import emit, lone_exception, run, tell
from jobsignal.util.text import cell, columns, human_age

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


def rank_table_size(hccl_json: str) -> tuple[str, str]:
    """(servers, NPUs) of a rank table (its servers, their devices); <unknown> when the
    server sent none (a job too large for one List batch goes without it) or it does
    not parse."""
    try:
        table = json.loads(hccl_json)
        servers = table.get("server_list", [])
        npus = sum(len(server.get("device", [])) for server in servers)
        return str(len(servers)), str(npus)
    except (ValueError, TypeError, AttributeError, RecursionError):
        return "<unknown>", "<unknown>"


def npu_count(hccl_json: str) -> str:
    """The NPUs in a rank table (its servers' devices), as `rank_table_size` finds them."""
    return rank_table_size(hccl_json)[1]


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


COLUMNS = ("NAMESPACE", "NAME", "STATUS", "NPUS", "AGE")
# `-o wide` adds these, as kubectl's wide output adds columns after the usual ones.
WIDE_COLUMNS = ("FRAMEWORK", "SERVERS", "CONFIGMAPS", "MASTER", "JOB-ID")


def _sorted_jobs(jobs: Sequence[JobSummarySignal]) -> list[JobSummarySignal]:
    return sorted(jobs, key=lambda j: (j.namespace, j.job_name, j.job_id))


def jobs_table(
    jobs: Sequence[JobSummarySignal], now: float, headers: bool = True, wide: bool = False
) -> str:
    """Columns as `kubectl get -A` prints them: NAMESPACE NAME STATUS NPUS AGE, and with
    `wide` FRAMEWORK SERVERS CONFIGMAPS MASTER JOB-ID after them."""
    rows = [[*COLUMNS, *WIDE_COLUMNS] if wide else list(COLUMNS)] if headers else []
    for job in _sorted_jobs(jobs):
        status = cell(job.job_status)
        if job.operator == "delete":
            status += "(deleted)"
        servers, npus = rank_table_size(job.hccl_json)
        row = [cell(job.namespace), cell(job.job_name), status, npus, job_age(job.time, now)]
        if wide:
            row += [cell(job.frame_work), servers, cell(job.total)]
            row += [cell(job.master_addr), cell(job.job_id)]
        rows.append(row)
    return columns(rows)


def jobs_json(jobs: Sequence[JobSummarySignal]) -> str:
    """Every field of every job, named as on the wire (as `subscribe --json`), in one array."""
    return json.dumps([_signal_json(job) for job in _sorted_jobs(jobs)], ensure_ascii=False)


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
    if args.output == "json":
        # An empty array, not a note: a script reads stdout.
        emit(jobs_json(jobs))
        return 0
    if not jobs:
        where = f" in namespace {args.namespace}" if args.namespace else ""
        tell(f"No jobs found{where}.")
        return 0
    emit(jobs_table(jobs, time.time(), headers=not args.no_headers, wide=args.output == "wide"))
    return 0


# -- jobsignal check --------------------------------------------------------------------


async def print_health(options: SubscribeOptions, args: argparse.Namespace) -> int:
    status = await _answer_within(
        args.timeout, "health answer", options, lambda: check_health(options, args.service)
    )
    emit(status)
    return 0 if status == "SERVING" else 1


# -- jobsignal demo ---------------------------------------------------------------------


def demo_config(flags: Mapping[str, str | None], environ: Mapping[str, str]) -> Config:
    """`demo`'s settings: the demo cluster, no drain (no load balancer sends clients to
    a demo: Ctrl-C stops it at once), and its own default address, this host only,
    after the flag and JOBSIGNAL_LISTEN."""
    from jobsignal.cli import DEMO_SETTINGS

    defaults = {s.env: s.default for s in DEMO_SETTINGS}
    return load_config({**flags, "source": "demo", "drain_delay": "0"}, {**defaults, **environ})


async def _demo(config_flags: dict[str, str | None], environ: Mapping[str, str]) -> None:
    from jobsignal.app import run_jobsignal  # (only here: no other client command serves)

    config = demo_config(config_flags, environ)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: run_jobsignal(
                config, handle_signals=True, settle_memory=True, task_status=task_status
            )
        )
        host = "127.0.0.1" if server.host in ("", "0.0.0.0", "::") else server.host
        options = SubscribeOptions(host, server.port, "CCAgent")
        shown = show_address(server.host, server.port)
        emit(f"jobsignal demo: serving on {shown}; subscriber output:")
        # The server beside it logs what happens; its own subscriber says only errors
        # (not, say, that the server it shares the process with is shutting down).
        logging.getLogger("jobsignal.client").setLevel(logging.ERROR)
        nursery.start_soon(print_signals, options, False)
        await server.stopped.wait()
        nursery.cancel_scope.cancel()


def subscribe_options(args: argparse.Namespace, environ: Mapping[str, str]) -> SubscribeOptions:
    """A client command's options from its flags, JOBSIGNAL_TARGET and the
    JOBSIGNAL_SUBSCRIBE_* env vars (a flag beats its env var)."""
    host, port = resolve([TARGET_SETTING], vars(args), environ)["target"]
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
            from jobsignal.cli import DEMO_SETTINGS

            level = resolve(
                [s for s in DEMO_SETTINGS if s.name == "log_level"], vars(args), environ
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
