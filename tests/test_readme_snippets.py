"""Every command and snippet of the README's quick start and commands table runs as written.

Against a real `jobsignal demo` on 127.0.0.1, as shell commands with this
environment's `jobsignal` on the PATH (what `. .venv/bin/activate` gives).
The demo listens on a free port (JOBSIGNAL_LISTEN), so the address a snippet
names (127.0.0.1:8899, HOST:PORT) becomes that port, and a client command
without `--target` gets it added: that `--target`'s default is where
`serve` and `demo` listen is tested on its own. Placeholders of the commands
table take example values. Each command is bounded in time and stops by
itself or is stopped. The two install commands of the quick start are run
whole by CI (`.ci/run` is the test command word for word); here their last
step runs.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobsignal.cli import DEFAULT_TARGET, build_parser
from jobsignal.client_cli import subscribe_options
from jobsignal.config import DEFAULTS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent  # this environment's scripts: jobsignal
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith(("JOBSIGNAL_", "KUBE"))},
    "HOME": "/nonexistent",  # no kubeconfig: the demo cluster
    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    "JOBSIGNAL_LISTEN": "127.0.0.1:0",  # `serve` and `demo` as written, on a free port
    "PYTHONUNBUFFERED": "1",  # print() reaches the pipe at once, as it reaches a terminal
}
CLIENTS = ("subscribe", "jobs", "check")
# A signal line of the demo's subscriber: namespace/name status operator.
SIGNAL_LINE = r"demo/\S+ (pending|running|complete|failed) (add|delete)"
# A row of `jobsignal jobs`: NAMESPACE NAME STATUS NPUS AGE.
JOBS_ROW = r"^demo +\S+ +(pending|running|complete|failed) +"
# Example values of the commands table's placeholders.
EXAMPLES = {"ROLE": "CCAgent", "NAMESPACE": "demo", "S": "20", "NAME": "job.Job", "N": "2"}


def section(title: str) -> str:
    return README.split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]


QUICK_START, COMMANDS = section("Quick start"), section("Commands")
SH_BLOCKS = re.findall(r"```sh\n(.*?)\n```", QUICK_START, re.S)
TABLE = [
    found.group(1).replace("\\|", "|")
    for found in re.finditer(r"^\| `(jobsignal [^`]+)`", COMMANDS, re.M)
]
# Inline commands in the table's descriptions and the paragraph after it.
INLINE = sorted(
    code
    for code in re.findall(r"`([^`]+)`", "\n".join(COMMANDS.split("\n\n")[1:3]))
    if code.startswith(("jobsignal ", "source <(jobsignal"))
    and not any(row.startswith(code.replace("\\|", "|")) for row in TABLE)  # (a row, named)
)


def concrete(command: str) -> list[str]:
    """A table command with its placeholders filled: with every option, and bare."""
    if "bash|zsh|tcsh" in command:
        return [command.replace("bash|zsh|tcsh", shell) for shell in ("bash", "zsh", "tcsh")]
    full = re.sub(r"\[([^\]]+)\]", r"\1", command)
    full = re.sub(r"\b(\w+)\|\w+\b", r"\1", full)  # of alternatives (-o wide|json), the first
    for placeholder, value in EXAMPLES.items():
        full = re.sub(rf"\b{placeholder}\b", value, full)
    bare = re.sub(r" \[[^\]]+\]", "", command)
    return [full] if bare == command else [full, bare]


@pytest.fixture(scope="module")
def demo() -> Iterator[str]:
    """`jobsignal demo` as the README runs it; its address (HOST:PORT)."""
    with subprocess.Popen(
        ["jobsignal", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    ) as process:
        try:
            assert process.stdout is not None
            first = process.stdout.readline()
            found = re.search(r"serving on (127\.0\.0\.1:\d+)", first)
            assert found, first
            yield found.group(1)
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=15)


def with_target(command: str, target: str) -> str:
    """The command pointed at the demo: its named address replaced, or one added (a
    second demo's `--listen` is a free port of its own)."""
    if command.startswith("jobsignal demo"):
        return command.replace("HOST:PORT", "127.0.0.1:0")
    command = command.replace("127.0.0.1:8899", target).replace("HOST:PORT", target)
    for client in CLIENTS:
        if f"jobsignal {client}" in command and "--target" not in command:
            pointed = f"jobsignal {client} --target {target}"
            command = command.replace(f"jobsignal {client}", pointed)
    return command


def run_for_a_while(
    command: str,
    *,
    until: str,
    stream: str = "stdout",
    stopped: int | None = 0,
    within: float = 30,
) -> tuple[str, str]:
    """Run a command that does not end by itself until its `stream` matches `until`,
    then stop it as Ctrl-C would (it must exit `stopped`, unless None); its output."""
    with subprocess.Popen(
        ["bash", "-c", f"exec {command}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    ) as process:
        watched = process.stdout if stream == "stdout" else process.stderr
        assert process.stdout is not None and process.stderr is not None and watched is not None
        seen: list[str] = []
        deadline = time.monotonic() + within
        try:
            while time.monotonic() < deadline and not re.search(until, "".join(seen)):
                line = watched.readline()
                if not line:
                    break
                seen.append(line)
        finally:
            process.send_signal(signal.SIGINT)
            try:
                status: int | None = process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                status = None
                if stopped is not None:
                    raise
        out, err = process.communicate()
    if stream == "stdout":
        out = "".join(seen) + out
    else:
        err = "".join(seen) + err
    assert re.search(until, "".join(seen)), f"{command}: no {until!r} in {seen}; {out}{err}"
    assert stopped is None or status == stopped, f"{command} exited {status} on SIGINT: {err}"
    return out, err


def run_to_end(command: str, within: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=within,
        check=False,
    )


def test_the_snippets_are_found() -> None:
    """The parsing below reads what the README holds (a new command is run too)."""
    assert len(SH_BLOCKS) == 3
    assert [c.split()[1] for c in TABLE] == ["serve", "demo", *CLIENTS, "clients", "completion"]
    assert INLINE == ["jobsignal subscribe --json | head -1", "source <(jobsignal completion bash)"]


def test_the_install_commands_are_ci_s_and_end_in_the_demo() -> None:
    run, test = SH_BLOCKS[:2]
    venv = "python3 -m venv --without-pip .venv && python3 -m pip --python .venv/bin/python install"
    assert run == f"{venv} . && .venv/bin/jobsignal demo"
    assert test == f"{venv} nox && .venv/bin/nox"
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"\n{test} --error-on-missing-interpreters\n" in ci
    assert "\nexport CI=true\n" in ci


def test_the_demo_as_the_first_command_ends_runs_without_alarms() -> None:
    # An ordinary user's limits: soft 1024 (or what this machine allows), hard as is.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    soft = min(1024, hard)
    last_step = SH_BLOCKS[0].rsplit(" && ", 1)[1].replace(".venv/bin/", f"{BIN}/")
    out, err = run_for_a_while(f"bash -c 'ulimit -Sn {soft}; exec {last_step}'", until=SIGNAL_LINE)
    assert "serving on 127.0.0.1:" in out
    # (2,048 files are room for the demo's connection limits; a machine whose hard
    # limit is lower gets the warning, rightly: tests/test_file_limit.py.)
    if hard == resource.RLIM_INFINITY or hard >= 2048:
        assert "WARNING" not in err and "ulimit" not in err, err


@pytest.mark.parametrize("command", [c for row in TABLE for c in concrete(row)])
def test_a_command_of_the_table_runs(command: str, demo: str) -> None:
    command = with_target(command, demo)
    if command.startswith("jobsignal serve"):
        run_for_a_while(command, until="ready: job store loaded", stream="stderr")
    elif command.startswith("jobsignal demo"):
        run_for_a_while(command, until=SIGNAL_LINE)
    elif command.startswith("jobsignal subscribe") and "--list" in command:
        # (the List RPC starts with the snapshot: a line at once)
        out, _ = run_for_a_while(command, until=r"\n", stopped=130)
        assert out.startswith("{") == ("--json" in command), out
    elif command.startswith("jobsignal subscribe"):  # signals come with the demo's next step
        run_for_a_while(command, until="waiting for job events", stream="stderr", stopped=130)
    elif command.startswith("jobsignal jobs"):
        # The demo's rounds have moments without a job ("No jobs found."): ask again.
        for _ in range(20):
            done = run_to_end(command)
            assert done.returncode == 0, done.stderr
            if re.search(JOBS_ROW, done.stdout, re.M):
                break
            time.sleep(0.5)
        assert re.search(JOBS_ROW, done.stdout, re.M), done
        assert done.stdout.startswith("NAMESPACE") == ("--no-headers" not in command)
    elif command.startswith("jobsignal check"):
        done = run_to_end(command)
        assert (done.returncode, done.stdout) == (0, "SERVING\n"), done.stderr
    elif command.startswith("jobsignal clients"):
        # The demo here serves no metrics port: pointed at its gRPC port, `clients`
        # says which address it wants (tests/test_subscriptions.py asks a real one).
        done = run_to_end(command)
        assert done.returncode == 1 and "--metrics-listen" in done.stderr, done
    else:
        done = run_to_end(command)
        assert done.returncode == 0 and "jobsignal" in done.stdout, done.stderr


def test_the_inline_snippets_run(demo: str) -> None:
    piped = run_to_end(with_target(INLINE[0], demo))
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.startswith('{"uuid"') and piped.stdout.count("\n") == 1, piped.stdout
    sourced = run_to_end(f"{INLINE[1]} && complete -p jobsignal")
    assert sourced.returncode == 0 and "jobsignal" in sourced.stdout, sourced.stderr


def test_the_subscribe_snippet_of_the_quick_start(demo: str) -> None:
    out, err = run_for_a_while(with_target(SH_BLOCKS[2], demo), until=r"\n", stopped=130)
    assert out.startswith("{") and "waiting for job events" in err


def test_the_embedding_example_runs_as_written(tmp_path: Path) -> None:
    section_text = section("Embedding in a trio program")
    example = re.findall(r"```python\n(.*?)\n```", section_text, re.S)[0]
    assert example.rstrip().endswith(
        "trio.run(main, restrict_keyboard_interrupt_to_checkpoints=True)"
    )
    (tmp_path / "example.py").write_text(example)
    # It ends by itself after its first signal (Ctrl-C: tests/test_embedding.py).
    done = run_to_end(f"{sys.executable} {tmp_path / 'example.py'}")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"\S+ (pending|running|complete|failed)\n", done.stdout), done.stdout


def test_the_client_default_target_is_where_serve_and_demo_listen() -> None:
    ((_, port),) = DEFAULTS.listen
    assert f"127.0.0.1:{port}" == DEFAULT_TARGET
    parser = build_parser()
    for client in CLIENTS:
        options = subscribe_options(parser.parse_args([client]), {})
        assert f"{options.host}:{options.port}" == DEFAULT_TARGET
