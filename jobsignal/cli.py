"""Command line: `jobsignal serve`, `demo`, `subscribe`, `jobs`, `check`, `clients`
and `completion`.

Every setting's flag sits in a --help group and names the kind of value it
takes (the settings table in jobsignal/config.py says which). The client
commands live in `client_cli.py` (`clients`: `clients_cli.py`), imported
only when one runs, and shtab
only for `completion`: `serve` loads neither. Output written to a reader that
has gone (`jobsignal subscribe --json | head -1`) ends the command quietly
with status 141, as SIGPIPE ends other Unix tools; the process keeps
ignoring SIGPIPE itself, so a peer closing a socket never kills the server.
`serve` and `demo` raise the soft limit of open files to the hard limit
first, before the server judges it against its connection limits
(`file_limit.py`).

Building the parser imports nothing beyond the settings: the server and trio
are imported by the command that runs them, so `--help` and an exec probe's
`check` do not pay for them (`python -X importtime`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence

from jobsignal.config import (
    SERVE_SETTINGS,
    SUBSCRIBE_SETTINGS,
    TARGET_SETTING,
    ConfigError,
    add_arguments,
    load_config,
)
from jobsignal.terminal import StdoutClosed, emit, lone_exception
from jobsignal.version import __version__

EXIT_USAGE = 2
# What a shell reports for a command that SIGPIPE ended.
EXIT_STDOUT_CLOSED = 128 + signal.SIGPIPE
SHELLS = ("bash", "zsh", "tcsh")
# `jobs -o`: the table's extra columns, or every field of every job as JSON.
OUTPUT_FORMATS = ("wide", "json")
# `demo` serves plain text to whoever can connect: this host only, unless told otherwise.
DEMO_SETTINGS = tuple(
    dataclasses.replace(
        s,
        default="127.0.0.1:8899",
        help=s.help + "; the demo listens on this host only unless told otherwise",
    )
    if s.name == "listen"
    else s
    for s in SERVE_SETTINGS
    if s.name in ("listen", "log_level")
)

log = logging.getLogger(__name__)


# -- the parser -------------------------------------------------------------------------


# Where `serve` and `demo` listen by default, as a client reaches them on this host.
DEFAULT_TARGET = TARGET_SETTING.default
# The role of a person's own tool (ClusterD's whitelist), which `jobs` and `subscribe` take.
DEFAULT_ROLE = "DefaultUser1"


def _target_flags(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    group = parser.add_argument_group(title)
    # No default here: JOBSIGNAL_TARGET comes before it (client_cli.subscribe_options).
    group.add_argument(
        TARGET_SETTING.flag,
        dest=TARGET_SETTING.name,
        default=None,
        metavar=TARGET_SETTING.value_name,
        help=f"{TARGET_SETTING.help} [env {TARGET_SETTING.env}; default {TARGET_SETTING.default}]",
    )
    return group


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _count(text: str) -> int:
    if not (text.isascii() and text.isdigit() and 0 < int(text) < 1_000_000):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1")
    return int(text)


def _seconds_flag(group: argparse._ArgumentGroup, flag: str, default: float, what: str) -> None:
    group.add_argument(
        flag,
        type=_seconds,
        default=default,
        metavar="SECONDS",
        help=f"{what} (default {default:g})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobsignal",
        description="Stream Ascend job-summary ConfigMaps to ClusterD-compatible gRPC clients.",
    )
    parser.add_argument("--version", action="version", version=f"jobsignal {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the server (every flag also has an env var)",
        usage="jobsignal serve [-h] [FLAGS]",  # not all 40-odd flags in one line
    )
    add_arguments(serve, SERVE_SETTINGS)

    demo = commands.add_parser(
        "demo", help="serve the embedded demo cluster and print what a subscriber receives"
    )
    add_arguments(demo, DEMO_SETTINGS)

    sub = commands.add_parser("subscribe", help="register, subscribe and print job signals")
    group = _target_flags(sub, "subscription")
    group.add_argument(
        "--role",
        default=DEFAULT_ROLE,
        metavar="ROLE",
        help=f"client role, e.g. CCAgent (default {DEFAULT_ROLE})",
    )
    group.add_argument("--list", action="store_true", help="use SubscribeJobSummarySignalList")
    group.add_argument("--json", action="store_true", help="one JSON object per line")
    _seconds_flag(group, "--keepalive", 30.0, "seconds between keepalive PINGs")
    add_arguments(sub, SUBSCRIBE_SETTINGS)

    jobs = commands.add_parser(
        "jobs",
        help="print the current jobs as a table (through the List RPC's snapshot)",
        description="Register, take the SubscribeJobSummarySignalList snapshot, print it"
        " as a table like `kubectl get` and hang up. Exit status 1 when the server"
        " cannot be asked, 2 on bad usage.",
    )
    group = _target_flags(jobs, "query")
    group.add_argument(
        "--role",
        default=DEFAULT_ROLE,
        metavar="ROLE",
        help=f"role to register with (default {DEFAULT_ROLE})",
    )
    group.add_argument(
        "-n", "--namespace", default="", metavar="NAME", help="only the jobs of this namespace"
    )
    group.add_argument("--no-headers", action="store_true", help="no header line")
    group.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default=None,
        help="wide: more columns (FRAMEWORK SERVERS CONFIGMAPS MASTER JOB-ID); json: every"
        " field of every job, as `subscribe --json` names them, in one array",
    )
    _seconds_flag(group, "--timeout", 30.0, "give up after this long")
    add_arguments(jobs, SUBSCRIBE_SETTINGS)

    check = commands.add_parser(
        "check",
        help="print the server's gRPC health (SERVING: exit 0, else 1), for exec probes",
        description="Ask grpc.health.v1 Check and print the status. Exit status 0 only"
        " for SERVING; 1 for any other status, no answer or a refused connection;"
        " 2 on bad usage.",
    )
    group = _target_flags(check, "probe")
    group.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help="health entry to check: '' (default) the server as a whole, job.Job,"
        " jobsignal.KubernetesSync",
    )
    _seconds_flag(group, "--timeout", 5.0, "give up after this long")
    add_arguments(check, SUBSCRIBE_SETTINGS)

    clients = commands.add_parser(
        "clients",
        help="print every live subscription, from the metrics port, as a table",
        description="Ask a server's metrics port (its --metrics-listen address) for its"
        " live subscription streams, page by page, and print them like `kubectl get`:"
        " client id (a short hash), role, RPC, peer, time connected, messages sent,"
        " bytes queued, the last message's job and how long ago it went. Exit status 1"
        " when the server cannot be asked, 2 on bad usage.",
    )
    group = clients.add_argument_group("query")
    group.add_argument(
        "--target", required=True, metavar="HOST:PORT", help="the server's metrics address"
    )
    group.add_argument("--no-headers", action="store_true", help="no header line")
    group.add_argument(
        "--chunk-size",
        type=_count,
        default=500,
        metavar="N",
        help="subscriptions asked per page (default 500, the server's most)",
    )
    _seconds_flag(group, "--timeout", 30.0, "give up after this long")

    completion = commands.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print the completion script of a shell, for example"
        " `jobsignal completion bash > /etc/bash_completion.d/jobsignal`, or"
        " `source <(jobsignal completion bash)` in ~/.bashrc.",
    )
    completion.add_argument("shell", choices=SHELLS, help="bash, zsh or tcsh")
    return parser


def completion_script(shell: str) -> str:
    """The completion script of `shell`, offering every command, flag and choice."""
    import shtab  # (only here: no other command needs it)

    parser = build_parser()
    settings = (*SERVE_SETTINGS, *SUBSCRIBE_SETTINGS)
    choices = {s.flag: s.choices for s in settings if s.choices}
    files = {s.flag for s in settings if s.value_name == "FILE"}
    for action in _all_actions(parser):
        words = next((choices[f] for f in action.option_strings if f in choices), None)
        if words:
            # Only for completion: parsing keeps its own check, which accepts any case.
            action.choices = words
        if files.intersection(action.option_strings):
            # Files are offered for file settings (and nothing for the others).
            action.complete = shtab.FILE  # type: ignore[attr-defined]
    script: str = shtab.complete(parser, shell=shell)
    return script


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                actions += _all_actions(subparser)
    return actions


def _command(args: argparse.Namespace) -> int:
    # Raised before run_jobsignal warns when the limit is short of its connection limits.
    from jobsignal.process.file_limit import raise_open_file_limit

    raised = raise_open_file_limit() if args.command in ("serve", "demo") else None
    if args.command == "serve":
        import trio

        from jobsignal.app import run_jobsignal
        from jobsignal.logs import configure_logging

        config = load_config(vars(args), os.environ)
        configure_logging(config.log_level, config.log_format)
        if raised is not None and raised[1] > raised[0]:
            log.info("open files: soft limit raised from %d to %d", *raised)
        try:
            # The process is jobsignal's own: signals and the gc and heap settling are its.
            trio.run(lambda: run_jobsignal(config, handle_signals=True, settle_memory=True))
        except BaseExceptionGroup as group:
            # A start-up error (a port in use) comes wrapped by trio-asyncio's nurseries.
            lone = lone_exception(group)
            if isinstance(lone, ConfigError):
                raise lone from None
            raise
    elif args.command == "completion":
        emit(completion_script(args.shell).rstrip("\n"))
    elif args.command == "clients":
        from jobsignal.clients_cli import run_clients_command  # (a server never loads it)

        return run_clients_command(args)
    else:
        from jobsignal.client_cli import run_client_command  # (a server never loads it)

        return run_client_command(args, os.environ)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _command(args)
    except ConfigError as error:
        print(f"jobsignal: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except StdoutClosed:
        # Python would complain at exit that the rest of stdout cannot be flushed.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_STDOUT_CLOSED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
