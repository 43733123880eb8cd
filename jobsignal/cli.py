"""Command line: `jobsignal serve`, `jobsignal demo`, `jobsignal subscribe`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence

import trio

from jobsignal import __version__
from jobsignal._proto.job import JobSummarySignal, JobSummarySignalList
from jobsignal.app import run_jobsignal
from jobsignal.client import (
    Signal,
    SubscribeFailed,
    SubscribeOptions,
    client_ssl_context,
    open_subscription,
)
from jobsignal.config import (
    SERVE_SETTINGS,
    SUBSCRIBE_SETTINGS,
    ConfigError,
    add_arguments,
    load_config,
    parse_listen,
    resolve,
)
from jobsignal.logs import configure_logging

EXIT_USAGE = 2


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
            print(format_message(message, as_json), flush=True)


async def _demo(config_flags: dict[str, str | None]) -> None:
    # No load balancer sends clients to a demo: Ctrl-C stops it without a drain.
    config = load_config({**config_flags, "source": "demo", "drain_delay": "0"}, os.environ)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: run_jobsignal(config, handle_signals=True, task_status=task_status)
        )
        host = "127.0.0.1" if server.host in ("0.0.0.0", "::") else server.host
        options = SubscribeOptions(host, server.port, "CCAgent")
        print(f"jobsignal demo: serving on {server.host}:{server.port}; subscriber output:")
        nursery.start_soon(print_signals, options, False)
        await server.stopped.wait()
        nursery.cancel_scope.cancel()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobsignal",
        description="Stream Ascend job-summary ConfigMaps to ClusterD-compatible gRPC clients.",
    )
    parser.add_argument("--version", action="version", version=f"jobsignal {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the server (every flag also has an env var)")
    add_arguments(serve, SERVE_SETTINGS)
    demo = commands.add_parser(
        "demo", help="serve the embedded demo cluster and print what a subscriber receives"
    )
    add_arguments(demo, [s for s in SERVE_SETTINGS if s.name in ("listen", "log_level")])
    sub = commands.add_parser("subscribe", help="register, subscribe and print job signals")
    sub.add_argument("--target", required=True, help="server HOST:PORT")
    sub.add_argument("--role", required=True, help="client role, e.g. CCAgent")
    sub.add_argument("--list", action="store_true", help="use SubscribeJobSummarySignalList")
    sub.add_argument("--json", action="store_true", help="one JSON object per line")
    sub.add_argument(
        "--keepalive", type=float, default=30.0, help="seconds between keepalive PINGs"
    )
    add_arguments(sub, SUBSCRIBE_SETTINGS)
    return parser


def subscribe_options(args: argparse.Namespace, environ: Mapping[str, str]) -> SubscribeOptions:
    """`jobsignal subscribe`'s options from its flags and JOBSIGNAL_SUBSCRIBE_* env vars."""
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
        args.role,
        args.list,
        args.keepalive,
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            config = load_config(vars(args), os.environ)
            configure_logging(config.log_level, config.log_format)
            trio.run(lambda: run_jobsignal(config, handle_signals=True))
        elif args.command == "demo":
            configure_logging(args.log_level or "info", "text")
            trio.run(_demo, vars(args))
        else:
            configure_logging("warning", "text")
            trio.run(print_signals, subscribe_options(args, os.environ), args.json)
    except ConfigError as error:
        print(f"jobsignal: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except SubscribeFailed as error:
        print(f"jobsignal: subscription refused: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
