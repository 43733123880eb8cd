"""The command line as a user meets it: settings, errors, and the README's commands."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from jobsignal.cli import main
from jobsignal.config import SERVE_SETTINGS, ConfigError, defaults, load_config, settings_table

# `main` configures logging on the captured stderr: the root logger is put back.
pytestmark = pytest.mark.usefixtures("root_logging")

ROOT = Path(__file__).parent.parent
# No kubeconfig or cluster reachable from the tests: an empty HOME and environment.
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("JOBSIGNAL_", "KUBE"))}


def test_defaults_match_the_design() -> None:
    config = defaults()
    assert config.listen == (("", 8899),)
    assert config.idle_timeout == 120
    assert config.roles == ("CCAgent", "DefaultUser1", "DefaultUser2", "FdAgent")
    assert config.snapshot_roles == ("FdAgent",)
    assert config.max_subscriptions_per_role == 20


def test_flag_beats_env_beats_default() -> None:
    env = {"JOBSIGNAL_IDLE_TIMEOUT": "30", "JOBSIGNAL_LISTEN": "[::1]:9000"}
    config = load_config({"idle_timeout": "45", "keepalive_time": "20"}, env)
    assert config.idle_timeout == 45
    assert config.listen == (("::1", 9000),)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"idle_timeout": "abc"}, {}, "--idle-timeout='abc': must be a positive number"),
        ({}, {"JOBSIGNAL_IDLE_TIMEOUT": "-1"}, "JOBSIGNAL_IDLE_TIMEOUT='-1': must be a positive"),
        ({"listen": "8899"}, {}, "--listen='8899': must be HOST:PORT"),
        ({"listen": "0.0.0.0:70000"}, {}, "port must be between 0 and 65535"),
        ({"source": "k8s"}, {}, "--source='k8s': must be one of auto, kubernetes, demo"),
        ({"max_registrations": "0"}, {}, "must be a positive integer"),
        ({"snapshot_roles": "Nobody"}, {}, "snapshot roles ['Nobody'] are not among"),
        ({"read_timeout": "30"}, {}, "must exceed the 60 s bookmark interval"),
        ({"idle_timeout": "60"}, {}, "--keepalive-time 60s must be below --idle-timeout 60s"),
        ({"keepalive_time": "130"}, {}, "--keepalive-time 130s must be below --idle-timeout 120s"),
    ],
)
def test_bad_values_are_one_line_errors(
    flags: dict[str, str | None], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(flags, env)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_cli_bad_value_exits_2_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--idle-timeout", "soon"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jobsignal: error: --idle-timeout='soon'")
    assert "Traceback" not in err and err.count("\n") == 1


def test_source_kubernetes_without_a_cluster_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    assert main(["serve", "--source", "kubernetes", "--listen", "127.0.0.1:0"]) == 2
    assert "no Kubernetes configuration found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--listen", "127.0.0.1:{taken}"],
        ["--listen", "127.0.0.1:0,127.0.0.1:{taken}"],  # the first address is let go
        ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:{taken}"],
    ],
    ids=["grpc", "second-grpc-address", "metrics"],
)
def test_an_address_in_use_is_a_one_line_error(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Not the 90-line exception group that trio-asyncio's nurseries wrapped it in."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--source", "demo", *(f.format(taken=port) for f in flags)]
        assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    setting = "--metrics-listen" if "--metrics-listen" in flags else "--listen"
    expected = f"jobsignal: error: {setting} 127.0.0.1:{port}: cannot listen there:"
    assert [line for line in err if line.startswith("jobsignal: error")] == [
        f"{expected} Address already in use"
    ]
    assert not any("Traceback" in line for line in err)


def test_help_groups_keep_their_order_and_each_flag_its_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    titles = ["gRPC", "TLS", "metrics", "Kubernetes", "relay", "limits", "keepalive"]
    titles += ["HTTP/2 protection", "shutdown", "logging"]
    found = re.findall(r"^(\S[^\n]*):$", help_text, re.M)
    assert found == ["options", *titles]
    # A title that comes back in the declarations lists its flags together.
    sections = dict(zip(titles, re.split(r"^\S[^\n]*:$", help_text, flags=re.M)[2:], strict=True))
    for setting in SERVE_SETTINGS:
        assert f"  {setting.flag} " in sections[setting.group], setting.name


def test_readme_configuration_table_matches_the_code() -> None:
    readme = (ROOT / "README.md").read_text()
    configuration = readme.split("\n## Configuration\n", 1)[1]
    assert settings_table() in configuration, "README's configuration table is stale"
    for setting in SERVE_SETTINGS:
        assert f"`{setting.flag}`" in readme


@contextmanager
def running(
    *args: str, open_files: tuple[int, int] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """`jobsignal *args` in a child process; `open_files`: its (soft, hard) RLIMIT_NOFILE."""

    def limit_open_files() -> None:
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, open_files)

    process = subprocess.Popen(
        [sys.executable, "-m", "jobsignal", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**CLEAN_ENV, "HOME": "/nonexistent"},
        preexec_fn=limit_open_files,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


def _read_until(stream: object, pattern: str, timeout: float = 30) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()  # type: ignore[attr-defined]
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"no line matching {pattern!r} in {lines}")


def test_jobsignal_demo_shows_signals_and_stops_on_sigint() -> None:
    with running("demo", "--listen", "127.0.0.1:0") as demo:
        lines = _read_until(demo.stdout, r"demo/llama-70b-\d+ running add total=3")
        assert any("serving on 127.0.0.1:" in line for line in lines)
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=15) == 0
        err = demo.stderr.read() if demo.stderr else ""
        assert "server shutting down" in err or "gRPC server stopped" in err


@pytest.mark.slow
def test_serve_and_subscribe_json() -> None:
    with running("serve", "--source", "demo", "--listen", "127.0.0.1:0") as server:
        lines = _read_until(server.stderr, r"gRPC listening on 127\.0\.0\.1:\d+")
        port = re.search(r"127\.0\.0\.1:(\d+)", lines[-1]).group(1)  # type: ignore[union-attr]
        with running(
            "subscribe", "--target", f"127.0.0.1:{port}", "--role", "FdAgent", "--json"
        ) as client:
            first = json.loads(_read_until(client.stdout, r"^\{")[-1])
            assert first["namespace"] == "demo" and first["cmIndex"] == "0"
            assert set(first) >= {"uuid", "jobId", "jobStatus", "HcclJson", "operator"}
        with running("subscribe", "--target", f"127.0.0.1:{port}", "--role", "Hacker") as bad:
            assert bad.wait(timeout=20) == 1
            err = bad.stderr.read() if bad.stderr else ""
            assert "INVALID_ARGUMENT" in err and "'Hacker' is not allowed" in err
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=15) == 0
