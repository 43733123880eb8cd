"""The command line as people, scripts and probes use it.

--help groups the flags and names the kind of value each takes; shell
completion offers commands, flags and choices; output into a closed pipe ends
quietly; `subscribe` says when it waits; `jobs` prints the List snapshot as a
table (wider with `-o wide`, or JSON); `check` answers exec probes and, like
`--help`, loads no server; the client commands find their server in
JOBSIGNAL_TARGET; `demo` listens on this host only. The commands run as real
processes against a real server on 127.0.0.1 (the server in this test's trio loop).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import trio
import trustme

from jobsignal.cli import EXIT_STDOUT_CLOSED, main
from jobsignal.client_cli import demo_config, job_age, jobs_table, npu_count
from jobsignal.config import (
    DEFAULTS,
    SERVE_SETTINGS,
    SUBSCRIBE_SETTINGS,
    ConfigError,
    parse_listen,
    show_address,
)
from jobsignal.fanout import Broadcaster
from jobsignal.rpc.tls import TlsFiles
from jobsignal.store.model import JobSummary
from jobsignal.util.text import human_age
from tests.support.factories import make_job, rank_table
from tests.support.grpc_server import local_settings, open_jobsignal_server
from tests.support.tls import write_pair
from tests.support.waiting import wait_until

# `main` configures logging on the captured stderr: the root logger is put back.
pytestmark = pytest.mark.usefixtures("root_logging")

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("JOBSIGNAL_", "KUBE"))}
GROUPS = [
    "gRPC",
    "TLS",
    "metrics",
    "Kubernetes",
    "relay",
    "limits",
    "keepalive",
    "HTTP/2 protection",
    "shutdown",
    "logging",
]


async def jobsignal(
    *args: str, within: float = 30, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """`python -m jobsignal ARGS` run to its end, its output captured; `env` added to a
    clean environment."""
    with trio.fail_after(within):
        return await trio.run_process(
            [sys.executable, "-m", "jobsignal", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**CLEAN_ENV, "HOME": "/nonexistent", **(env or {})},
        )


def job(
    namespace: str,
    name: str,
    status: str,
    *,
    npus: int = 8,
    age: float = 0,
    operator: str = "add",
    hccl_json: str | None = None,
    started: str | None = None,
) -> JobSummary:
    """A job started `age` seconds ago (ClusterD's `time`: Unix seconds)."""
    return dataclasses.replace(
        make_job(1, status=status, operator=operator),
        namespace=namespace,
        job_id=f"uid-{namespace}-{name}",
        job_name=name,
        time=started if started is not None else str(int(time.time() - age)),
        hccl_json=rank_table(npus) if hccl_json is None else hccl_json,
        npu_count=npus,
    )


# -- --help -------------------------------------------------------------------------------------


def help_sections(text: str) -> dict[str, dict[str, str]]:
    """--help's flags by group title: {group: {flag: metavar}}."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in text.splitlines():
        title = re.fullmatch(r"(\S.*):", line)
        if title:
            current = sections.setdefault(title.group(1), {})
            continue
        flag = re.match(r"  (?:-\w, )?(--[\w-]+)(?: (\S+))?", line)
        if flag:
            current[flag.group(1)] = flag.group(2) or ""
    return sections


def test_serve_help_groups_the_flags_and_names_their_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    sections = help_sections(out)
    assert list(sections) == ["options", *GROUPS]
    flags = {flag: (group, metavar) for group, f in sections.items() for flag, metavar in f.items()}
    for setting in SERVE_SETTINGS:
        assert flags[setting.flag] == (setting.group, setting.value_name), setting.flag
    assert "VALUE" not in out
    assert flags["--listen"][0] == "gRPC" and flags["--listen"][1].startswith("HOST:PORT")
    assert flags["--tls-cert"] == ("TLS", "FILE")
    assert flags["--kubeconfig"] == ("Kubernetes", "FILE")
    assert flags["--idle-timeout"] == ("gRPC", "SECONDS")
    assert flags["--max-send-bytes"] == ("limits", "BYTES")
    assert flags["--max-connections"] == ("limits", "COUNT")
    assert flags["--register-rate"] == ("limits", "PER_SECOND")
    assert flags["--max-stream-resets-per-second"] == ("HTTP/2 protection", "PER_SECOND")
    assert flags["--metrics-listen"] == ("metrics", "HOST:PORT")
    assert flags["--source"] == ("Kubernetes", "{auto,kubernetes,demo,relay}")
    assert flags["--upstream"] == ("relay", "HOST:PORT")
    assert flags["--upstream-role"] == ("relay", "ROLE")
    assert flags["--upstream-grace"] == ("relay", "SECONDS")
    assert flags["--log-level"] == ("logging", "{debug,info,warning,error}")
    # A help text with a literal % (the ping interval's) does not break --help.
    assert "less 10% for timer jitter" in " ".join(out.split())


def test_every_setting_has_a_group_and_a_kind_of_value() -> None:
    for setting in (*SERVE_SETTINGS, *SUBSCRIBE_SETTINGS):
        assert setting.group in GROUPS, setting.name
        assert setting.value_name != "VALUE", setting.name


def test_rates_and_sizes_say_what_they_expect(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--register-rate", "fast"]) == 2
    assert "--register-rate='fast': must be a positive number per second" in capsys.readouterr().err
    assert main(["serve", "--max-send-bytes", "0"]) == 2
    assert "--max-send-bytes='0': must be a positive number of bytes" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["subscribe", "jobs", "check"])
def test_client_commands_group_target_and_tls(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    sections = help_sections(capsys.readouterr().out)
    (own,) = [flags for title, flags in sections.items() if "--target" in flags]
    assert own["--target"] == "HOST:PORT"
    assert sections["TLS"] == {
        "--tls-ca": "FILE",
        "--tls-cert": "FILE",
        "--tls-key": "FILE",
        "--tls-server-name": "NAME",
    }


# -- shell completion ---------------------------------------------------------------------------

COMPLETE = """
source "$1"
complete_words() {
  COMP_WORDS=("$@"); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
  COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}; COMPREPLY=()
  _shtab_jobsignal jobsignal "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
  printf '%s ' "${COMPREPLY[@]}"; echo
}
cd "$2"
complete_words jobsignal ""
complete_words jobsignal ch
complete_words jobsignal serve --log-
complete_words jobsignal serve --log-level ""
complete_words jobsignal serve --source d
complete_words jobsignal subscribe --tls-ca ca
complete_words jobsignal completion ""
"""


async def test_bash_completion_offers_commands_flags_choices_and_files(tmp_path: Path) -> None:
    done = await jobsignal("completion", "bash")
    assert done.returncode == 0, done.stderr
    script = tmp_path / "jobsignal.bash"
    script.write_bytes(done.stdout)
    (tmp_path / "ca.pem").write_text("")
    answers = await trio.run_process(
        ["bash", "-c", COMPLETE, "bash", str(script), str(tmp_path)],
        capture_stdout=True,
        capture_stderr=True,
    )
    assert answers.stderr == b""
    lines = [sorted(line.split()) for line in answers.stdout.decode().splitlines()]
    assert lines == [
        ["check", "clients", "completion", "demo", "jobs", "serve", "subscribe"],
        ["check"],
        ["--log-format", "--log-level"],
        ["debug", "error", "info", "warning"],
        ["demo"],
        ["ca.pem"],
        ["bash", "tcsh", "zsh"],
    ]


async def test_zsh_and_tcsh_scripts_and_an_unknown_shell() -> None:
    # No zsh or tcsh on the test machines: the scripts are checked for what they must name.
    zsh = await jobsignal("completion", "zsh")
    assert zsh.returncode == 0 and zsh.stdout.startswith(b"#compdef jobsignal")
    tcsh = await jobsignal("completion", "tcsh")
    assert tcsh.returncode == 0 and b"complete jobsignal" in tcsh.stdout
    for script in (zsh.stdout, tcsh.stdout):
        assert all(word in script for word in (b"subscribe", b"--log-level", b"kubernetes"))
    fish = await jobsignal("completion", "fish")
    assert fish.returncode == 2 and b"invalid choice: 'fish'" in fish.stderr


# -- a closed pipe, and the waiting note ---------------------------------------------------------


@pytest.mark.parametrize(
    "command", [["subscribe", "--role", "FdAgent", "--json"], ["jobs", "--no-headers"]]
)
async def test_output_into_a_closed_pipe_ends_quietly(command: list[str]) -> None:
    # Far more output than a pipe holds (64 KiB; FdAgent gets every job at once), so
    # the writes after `head` has gone hit EPIPE.
    jobs = [job("big", f"job-{i:04d}-{'x' * 80}", "running", npus=16) for i in range(800)]
    async with open_jobsignal_server() as server:
        server.broadcaster.publish(jobs)
        pipeline = (
            f'"{sys.executable}" -m jobsignal {" ".join(command)} --target {server.target}'
            ' | head -n 1; echo "status=${PIPESTATUS[0]}" >&2'
        )
        with trio.fail_after(30):
            done = await trio.run_process(
                ["bash", "-c", pipeline],
                capture_stdout=True,
                capture_stderr=True,
                env={**CLEAN_ENV, "HOME": "/nonexistent"},
            )
    out, err = done.stdout.decode(), done.stderr.decode()
    assert f"status={EXIT_STDOUT_CLOSED}" in err, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception" not in err, err
    (line,) = out.splitlines()
    assert "big" in line and "job-" in line


async def test_subscribe_says_on_stderr_that_it_is_subscribed_and_waiting() -> None:
    async with open_jobsignal_server() as server:
        command = ["subscribe", "--target", server.target, "--role", "CCAgent", "--json"]
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "jobsignal", *command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**CLEAN_ENV, "HOME": "/nonexistent"},
        )
        try:
            assert process.stderr is not None and process.stdout is not None
            err = bytearray()
            with trio.fail_after(30):
                while b"waiting for job events\n" not in err:
                    chunk = await process.stderr.receive_some()
                    assert chunk, f"exited: {err.decode()}"
                    err += chunk
            note = err.decode().strip()
            await wait_until(lambda: len(server.broadcaster.subscribers) == 1)
            (subscriber,) = server.broadcaster.subscribers
            assert note == (
                f"subscribed to {server.target} as CCAgent (id {subscriber.client_id}):"
                " waiting for job events"
            )
            # The note came before any job; stdout has only signals.
            server.broadcaster.publish([job("ns", "first", "running")])
            with trio.fail_after(30):
                out = await process.stdout.receive_some()
            assert json.loads(out)["jobName"] == "first"
        finally:
            process.kill()
            await process.wait()


async def test_subscribe_to_no_server_says_it_cannot_connect_not_lost() -> None:
    with socket.socket() as unused:  # a port nobody listens on once closed
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "jobsignal", "subscribe", "--target", f"127.0.0.1:{port}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**CLEAN_ENV, "HOME": "/nonexistent"},
    )
    try:
        assert process.stderr is not None
        err = bytearray()
        with trio.fail_after(30):
            while b"\n" not in err:
                chunk = await process.stderr.receive_some()
                assert chunk, f"exited: {err.decode()}"
                err += chunk
    finally:
        process.kill()
        await process.wait()
    line = err.decode().splitlines()[0]
    assert f"WARNING jobsignal.client: cannot connect to 127.0.0.1:{port}: " in line, line
    assert "lost" not in line


# -- jobsignal jobs -----------------------------------------------------------------------------

DAY = 86_400


async def test_jobs_prints_the_list_snapshot_as_a_table() -> None:
    jobs = [
        job("team-b", "resnet", "running", npus=16, age=20.5 * 3600),
        job("team-a", "llama-70b", "complete", npus=16, age=10 * DAY + 3600),
        # Over a List batch's NPUs a job is sent alone without its rank table.
        job("team-c", "huge", "running", npus=24, age=30 * 60 + 30),
        job("team-a", "bert", "failed", npus=8, age=400 * DAY),
        job("team-a", "gpt", "pending", hccl_json='{"status":"initializing"}', age=5 * DAY),
        # ClusterD writes seconds; milliseconds are read too.
        job("team-c", "t5", "running", started=str(int((time.time() - 3 * DAY - 7 * 3600) * 1000))),
    ]
    # 16 NPUs per List batch (40,000 by default): the snapshot comes in several
    # batches, all of them awaited.
    async with open_jobsignal_server(broadcaster=Broadcaster(batch_npus=16)) as server:
        server.broadcaster.publish(jobs)
        gone = job("team-a", "old", "complete", age=DAY)
        server.broadcaster.publish([gone, dataclasses.replace(gone, operator="delete")])
        table = await jobsignal("jobs", "--target", server.target)
        only_a = await jobsignal("jobs", "--target", server.target, "-n", "team-a", "--no-headers")
        # It hung up after the snapshot: no subscription is left behind.
        await wait_until(lambda: server.registry.active_subscriptions() == 0)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.decode().splitlines()
    assert [line.split() for line in lines] == [
        ["NAMESPACE", "NAME", "STATUS", "NPUS", "AGE"],
        ["team-a", "bert", "failed", "8", "400d"],
        ["team-a", "gpt", "pending", "0", "5d"],
        ["team-a", "llama-70b", "complete", "16", "10d"],
        ["team-b", "resnet", "running", "16", "20h"],
        ["team-c", "huge", "running", "<unknown>", "30m"],
        ["team-c", "t5", "running", "8", "3d7h"],
    ]
    # Columns line up under their headers, three spaces apart, as kubectl prints them.
    starts = [lines[0].index(h) for h in ("NAME ", "STATUS", "NPUS", "AGE")]
    assert starts[0] == len("NAMESPACE") + 3
    for line in lines[1:]:
        assert all(line[start - 1] == " " and line[start] != " " for start in starts), line
    assert only_a.returncode == 0
    assert [line.split()[1] for line in only_a.stdout.decode().splitlines()] == [
        "bert",
        "gpt",
        "llama-70b",
    ]


async def test_jobs_of_an_empty_cluster_and_failures() -> None:
    async with open_jobsignal_server() as server:
        empty = await jobsignal("jobs", "--target", server.target)
        refused = await jobsignal("jobs", "--target", server.target, "--role", "Hacker")
    down = await jobsignal("jobs", "--target", server.target)
    bad = await jobsignal("jobs", "--target", "nowhere")
    assert (empty.returncode, empty.stdout, empty.stderr) == (0, b"", b"No jobs found.\n")
    assert refused.returncode == 1
    assert b"jobsignal jobs: INVALID_ARGUMENT: role 'Hacker' is not allowed" in refused.stderr
    assert down.returncode == 1
    assert f"jobsignal jobs: cannot reach {server.target}".encode() in down.stderr
    assert bad.returncode == 2 and b"--target='nowhere': must be HOST:PORT" in bad.stderr
    for done in (empty, refused, down, bad):
        assert b"Traceback" not in done.stderr


async def test_jobs_wide_adds_columns_and_json_carries_every_field() -> None:
    jobs = [
        job("team-b", "resnet", "running", npus=16, age=20.5 * 3600),
        job("team-a", "bert", "failed", npus=8, age=10 * DAY + 60),
        job("team-c", "huge", "running", hccl_json="", age=5 * DAY),
    ]
    async with open_jobsignal_server() as server:
        server.broadcaster.publish(jobs)
        wide = await jobsignal("jobs", "--target", server.target, "-o", "wide")
        as_json = await jobsignal("jobs", "--target", server.target, "--output", "json")
        only_c = await jobsignal("jobs", "--target", server.target, "-o", "json", "-n", "team-c")
        none = await jobsignal("jobs", "--target", server.target, "-o", "json", "-n", "other")
        bad = await jobsignal("jobs", "--target", server.target, "-o", "yaml")
    assert wide.returncode == 0, wide.stderr
    # (Each line's cells one space apart.)
    assert [" ".join(line.split()) for line in wide.stdout.decode().splitlines()] == [
        "NAMESPACE NAME STATUS NPUS AGE FRAMEWORK SERVERS CONFIGMAPS MASTER JOB-ID",
        "team-a bert failed 8 10d pytorch 1 2 10.253.1.1 uid-team-a-bert",
        "team-b resnet running 16 20h pytorch 2 2 10.253.1.1 uid-team-b-resnet",
        "team-c huge running <unknown> 5d pytorch <unknown> 2 10.253.1.1 uid-team-c-huge",
    ]
    assert as_json.returncode == 0, as_json.stderr
    listed = json.loads(as_json.stdout)
    assert [(j["namespace"], j["jobName"]) for j in listed] == [
        ("team-a", "bert"),
        ("team-b", "resnet"),
        ("team-c", "huge"),
    ]
    # The wire's field names, as `subscribe --json` prints them, rank table included.
    by_name = {j["jobName"]: j for j in listed}
    resnet = next(j for j in jobs if j.job_name == "resnet")
    assert by_name["resnet"]["HcclJson"] == resnet.hccl_json
    assert by_name["resnet"]["jobId"] == "uid-team-b-resnet"
    assert by_name["resnet"]["time"] == resnet.time
    assert set(by_name["bert"]) >= {"uuid", "frameWork", "jobStatus", "total", "operator"}
    assert [j["jobName"] for j in json.loads(only_c.stdout)] == ["huge"]
    # An empty result is an empty array on stdout, for scripts, and no note.
    assert (none.returncode, json.loads(none.stdout), none.stderr) == (0, [], b"")
    assert bad.returncode == 2 and b"invalid choice: 'yaml'" in bad.stderr


async def test_client_commands_find_their_server_in_jobsignal_target() -> None:
    async with open_jobsignal_server() as server:
        server.broadcaster.publish([job("ns", "from-env", "running")])
        by_env = await jobsignal("jobs", "--no-headers", env={"JOBSIGNAL_TARGET": server.target})
        checked = await jobsignal("check", env={"JOBSIGNAL_TARGET": server.target})
        # A flag beats its env var, either way round.
        flag_wins = await jobsignal(
            "check", "--target", server.target, env={"JOBSIGNAL_TARGET": "nowhere"}
        )
    down = await jobsignal("check", "--target", server.target, env={"JOBSIGNAL_TARGET": "x:1"})
    malformed = await jobsignal("jobs", env={"JOBSIGNAL_TARGET": "nowhere"})
    assert by_env.returncode == 0, by_env.stderr
    assert by_env.stdout.split()[:2] == [b"ns", b"from-env"]
    assert (checked.returncode, checked.stdout) == (0, b"SERVING\n")
    assert (flag_wins.returncode, flag_wins.stdout) == (0, b"SERVING\n")
    assert down.returncode == 1 and f"cannot reach {server.target}".encode() in down.stderr
    assert malformed.returncode == 2
    assert b"JOBSIGNAL_TARGET='nowhere': must be HOST:PORT" in malformed.stderr
    assert b"Traceback" not in malformed.stderr


def test_a_table_row_holds_no_blanks_and_marks_deleted_jobs() -> None:
    # Job names come from ConfigMap data: a blank or an escape must not break the columns.
    odd = job("ns", "a b\x1b[2J", "running", age=60)
    deleted = job("ns", "done", "complete", age=60, operator="delete")
    lines = jobs_table([odd, deleted], time.time(), headers=False).splitlines()
    assert [line.split() for line in lines] == [
        ["ns", "a?b?[2J", "running", "8", "60s"],
        ["ns", "done", "complete(deleted)", "8", "60s"],
    ]


def test_npus_and_ages_as_kubectl_shows_them() -> None:
    assert npu_count(rank_table(24)) == "24"
    assert npu_count('{"status":"initializing"}') == "0"
    assert npu_count("") == npu_count("[1]") == npu_count("not json") == "<unknown>"
    assert npu_count("[" * 100_000 + "]" * 100_000) == "<unknown>"
    ages = {
        -5: "0s",
        0: "0s",
        119: "119s",
        120: "2m",
        7 * 60 + 3: "7m3s",
        179 * 60: "179m",
        3 * 3600: "3h",
        7 * 3600 + 59 * 60: "7h59m",
        47 * 3600: "47h",
        2 * DAY + 5 * 3600: "2d5h",
        8 * DAY: "8d",
        729 * DAY: "729d",
        731 * DAY: "2y1d",
        9 * 365 * DAY: "9y",
    }
    assert {seconds: human_age(seconds) for seconds in ages} == ages
    now = 1_700_000_000 + 3600
    assert job_age("1700000000", now) == job_age("1700000000000", now) == "60m"
    assert job_age("", 0) == job_age("soon", 0) == job_age("nan", 0) == "<unknown>"


# -- jobsignal check ----------------------------------------------------------------------------


async def test_check_prints_the_health_and_exits_0_only_when_serving() -> None:
    async with open_jobsignal_server(ready=False) as server:
        starting = await jobsignal("check", "--target", server.target)
        server.mark_ready()
        serving = await jobsignal("check", "--target", server.target)
        job_service = await jobsignal("check", "--target", server.target, "--service", "job.Job")
        unknown = await jobsignal("check", "--target", server.target, "--service", "nope")
    down = await jobsignal("check", "--target", server.target)
    assert (starting.returncode, starting.stdout) == (1, b"NOT_SERVING\n")
    assert (serving.returncode, serving.stdout, serving.stderr) == (0, b"SERVING\n", b"")
    assert (job_service.returncode, job_service.stdout) == (0, b"SERVING\n")
    assert unknown.returncode == 1 and b"no health entry 'nope'" in unknown.stderr
    assert down.returncode == 1 and b"cannot reach" in down.stderr
    usage = await jobsignal("check", "--target", server.target, "--timeout", "-1")
    assert usage.returncode == 2 and b"not a positive number of seconds" in usage.stderr


async def test_check_gives_up_on_a_silent_server_within_its_timeout() -> None:
    # A listener that accepts and never answers (a hung process, a wrong port).
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    accepted: list[trio.SocketStream] = []

    async def hold(stream: trio.SocketStream) -> None:
        accepted.append(stream)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, hold, listeners)
        started = time.monotonic()
        silent = await jobsignal("check", "--target", f"127.0.0.1:{port}", "--timeout", "0.5")
        took = time.monotonic() - started
        nursery.cancel_scope.cancel()
    assert silent.returncode == 1, silent.stderr
    assert f"no health answer from 127.0.0.1:{port} within 0.5s".encode() in silent.stderr
    assert accepted and took < 20


async def test_check_over_mutual_tls(tmp_path: Path) -> None:
    server_ca, client_ca = trustme.CA(), trustme.CA()
    cert, key = write_pair(server_ca.issue_cert("jobsignal.internal"), tmp_path, "server")
    client_cert, client_key = write_pair(client_ca.issue_cert("probe"), tmp_path, "client")
    server_ca.cert_pem.write_to_path(str(tmp_path / "server-ca.pem"))
    client_ca.cert_pem.write_to_path(str(tmp_path / "client-ca.pem"))
    tls = [f"--tls-ca={tmp_path / 'server-ca.pem'}", "--tls-server-name=jobsignal.internal"]
    settings = local_settings(tls=TlsFiles(cert, key, tmp_path / "client-ca.pem"))
    async with open_jobsignal_server(settings) as server:
        target = ["--target", server.target]
        trusted = await jobsignal(
            "check", *target, *tls, f"--tls-cert={client_cert}", f"--tls-key={client_key}"
        )
        anonymous = await jobsignal("check", *target, *tls)
        listed = await jobsignal(
            "jobs", *target, *tls, f"--tls-cert={client_cert}", f"--tls-key={client_key}"
        )
    assert (trusted.returncode, trusted.stdout) == (0, b"SERVING\n"), trusted.stderr
    assert anonymous.returncode == 1 and b"requires a client certificate" in anonymous.stderr
    assert (listed.returncode, listed.stderr) == (0, b"No jobs found.\n")


async def test_check_and_help_load_no_server() -> None:
    """An exec probe's `check` and `--help` import neither the server (jobsignal.app, the
    watcher, fan-out, the metrics) nor httpx: that was most of what a call cost (python
    -X importtime; figures in CHANGELOG.md)."""
    server_modules = (
        "jobsignal.app",
        "jobsignal.kube",
        "jobsignal.fanout",
        "jobsignal.metrics",
        "jobsignal.store",
        "jobsignal.sim",
        "httpx",
        "prometheus_client",
    )
    script = (
        "import json, sys\n"
        "from jobsignal.cli import main\n"
        "try:\n"
        "    status = main(sys.argv[1:])\n"
        "except SystemExit as exit:\n"
        "    status = exit.code\n"
        "print(json.dumps([status, sorted(sys.modules)]))\n"
    )

    async def loaded(*args: str) -> tuple[int, set[str]]:
        done = await trio.run_process(
            [sys.executable, "-c", script, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**CLEAN_ENV, "HOME": "/nonexistent"},
        )
        status, modules = json.loads(done.stdout.decode().splitlines()[-1])
        return status, {m for m in modules if m.startswith(server_modules)}

    async with open_jobsignal_server() as server:
        checked = await loaded("check", "--target", server.target)
    assert checked == (0, set())
    assert await loaded("--help") == (0, set())
    assert await loaded("check", "--help") == (0, set())
    assert await loaded("completion", "bash") == (0, set())
    # The probe is not blind: `serve` (stopped by a bad address) has loaded the server.
    serve_status, serve_modules = await loaded("serve", "--listen", "nowhere")
    assert serve_status == 2 and "jobsignal.app" in serve_modules


# -- jobsignal demo -----------------------------------------------------------------------------


def test_demo_listens_on_this_host_only_unless_told_otherwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert demo_config({}, {}).listen == (("127.0.0.1", 8899),)
    assert demo_config({}, {"JOBSIGNAL_LISTEN": ":9000"}).listen == (("", 9000),)
    flag = demo_config({"listen": "127.0.0.1:0"}, {"JOBSIGNAL_LISTEN": ":9000"})
    assert flag.listen == (("127.0.0.1", 0),)
    assert (flag.source, flag.drain_delay) == ("demo", 0)
    with pytest.raises(ConfigError, match="JOBSIGNAL_LISTEN='bad'"):
        demo_config({}, {"JOBSIGNAL_LISTEN": "bad"})
    # `serve` keeps every address: in a pod it must be reachable.
    assert DEFAULTS.listen == (("", 8899),)
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "default '127.0.0.1:8899'" in capsys.readouterr().out


def test_addresses_are_shown_as_listen_reads_them() -> None:
    shown = {
        ("::", 8899): "[::]:8899",
        ("::1", 1): "[::1]:1",
        ("0.0.0.0", 8899): "0.0.0.0:8899",
        ("127.0.0.1", 0): "127.0.0.1:0",
        ("", 8899): ":8899",
    }
    assert {address: show_address(*address) for address in shown} == shown
    for (host, port), text in shown.items():
        assert parse_listen(text, any_host=True) == (host, port)
