"""jobsignal's own client over TLS and mutual TLS: `SubscribeOptions` and `jobsignal subscribe`.

The server's certificate names only "jobsignal.internal", so every client that
reaches it on 127.0.0.1 must override the server name: the override is proven
by every success, and its absence by the verification failure.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import trio
import trustme

from jobsignal._proto.job import JobSummarySignal
from jobsignal.cli import EXIT_USAGE, build_parser
from jobsignal.client import open_subscription
from jobsignal.client_cli import subscribe_options
from jobsignal.client_options import SubscribeFailed, SubscribeOptions
from jobsignal.config import ConfigError
from jobsignal.rpc.tls import TlsFiles
from tests.support.factories import make_job
from tests.support.grpc_server import ServerHarness, local_settings, open_jobsignal_server
from tests.support.grpcio import expected_signal
from tests.support.tls import write_pair
from tests.support.waiting import wait_until

SERVER_NAME = "jobsignal.internal"


@dataclass
class Certificates:
    server_cert: Path
    server_key: Path
    server_ca: Path  # what clients trust
    client_ca: Path  # what the server trusts, for mutual TLS
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # a client certificate from a CA the server does not trust
    stranger_key: Path

    def server(self, mutual: bool) -> TlsFiles:
        return TlsFiles(self.server_cert, self.server_key, self.client_ca if mutual else None)


@pytest.fixture
def certs(tmp_path: Path) -> Certificates:
    server_ca, client_ca = trustme.CA(), trustme.CA()
    server_cert, server_key = write_pair(server_ca.issue_cert(SERVER_NAME), tmp_path, "server")
    client_cert, client_key = write_pair(client_ca.issue_cert("agent@x"), tmp_path, "client")
    stranger = trustme.CA().issue_cert("agent@x")
    stranger_cert, stranger_key = write_pair(stranger, tmp_path, "stranger")
    server_ca.cert_pem.write_to_path(str(tmp_path / "server-ca.pem"))
    client_ca.cert_pem.write_to_path(str(tmp_path / "client-ca.pem"))
    return Certificates(
        server_cert,
        server_key,
        tmp_path / "server-ca.pem",
        tmp_path / "client-ca.pem",
        client_cert,
        client_key,
        stranger_cert,
        stranger_key,
    )


JOB = make_job(1)


@asynccontextmanager
async def serving_a_job(certs: Certificates, *, mutual: bool) -> AsyncIterator[ServerHarness]:
    """A server on TLS (mutual or not) that holds the one job event `JOB`."""
    async with open_jobsignal_server(local_settings(tls=certs.server(mutual=mutual))) as server:
        server.broadcaster.publish([JOB])
        yield server


def uuid_of_the_job(server: ServerHarness) -> str:
    (uuid,) = [entry.uuid for entry in server.broadcaster.latest()]
    return uuid


def options(port: int, certs: Certificates, cert: Path | None = None) -> SubscribeOptions:
    """Subscribe to 127.0.0.1:`port` over TLS, with client certificate `cert` if given."""
    return SubscribeOptions(
        "127.0.0.1",
        port,
        "FdAgent",  # snapshot on subscribe: the first signal needs no publish
        backoff_initial=0.05,
        tls_ca=str(certs.server_ca),
        tls_server_name=SERVER_NAME,
        tls_cert=str(cert) if cert else "",
        tls_key=str(cert.with_suffix(".key")) if cert else "",
    )


async def first_signal(subscribe: SubscribeOptions) -> JobSummarySignal:
    with trio.fail_after(10):
        async with open_subscription(subscribe) as signals:
            async for signal in signals:
                assert isinstance(signal, JobSummarySignal)
                return signal
    raise AssertionError("the subscription ended without a signal")


async def refusal(subscribe: SubscribeOptions) -> str:
    """Subscribe, expecting SubscribeFailed at once (no retrying); its message."""
    with trio.fail_after(10), pytest.raises(SubscribeFailed) as failed:
        await first_signal(subscribe)
    return str(failed.value)


# -- the public API -------------------------------------------------------------------------------


async def test_tls_subscription_receives_signals(certs: Certificates) -> None:
    async with serving_a_job(certs, mutual=False) as server:
        uuid = uuid_of_the_job(server)
        signal = await first_signal(options(server.port, certs))
    assert signal.hccl_json == JOB.hccl_json
    assert (signal.uuid, signal.job_id, signal.sid) == (uuid, JOB.job_id, JOB.sid)


async def test_server_certificate_must_verify(certs: Certificates) -> None:
    async with serving_a_job(certs, mutual=False) as server:
        wrong_name = await refusal(replace(options(server.port, certs), tls_server_name=""))
        wrong_ca = await refusal(replace(options(server.port, certs), tls_ca=str(certs.client_ca)))
    assert "does not verify as '127.0.0.1'" in wrong_name, wrong_name
    assert "check the CA bundle and the server name" in wrong_ca, wrong_ca
    async with open_jobsignal_server() as plain:
        not_tls = await refusal(options(plain.port, certs))
    assert f"TLS handshake with 127.0.0.1:{plain.port} failed" in not_tls, not_tls


async def test_mutual_tls_accepts_the_trusted_client_certificate_only(
    certs: Certificates,
) -> None:
    async with serving_a_job(certs, mutual=True) as server:
        trusted = options(server.port, certs, certs.client_cert)
        signal = await first_signal(trusted)
        refused = await refusal(options(server.port, certs, certs.stranger_cert))
        anonymous = await refusal(options(server.port, certs))
        # The refusals did not consume anything: a trusted client still gets in.
        again = await first_signal(trusted)
        await wait_until(lambda: server.registry.active_subscriptions() == 0)
    assert signal.job_id == again.job_id == JOB.job_id
    assert "does not accept the client certificate" in refused, refused
    assert str(certs.stranger_cert) in refused
    assert "requires a client certificate" in anonymous, anonymous


def test_certificate_and_key_go_together(certs: Certificates) -> None:
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        SubscribeOptions("127.0.0.1", 1, "CCAgent", tls_cert=str(certs.client_cert))


async def test_unreadable_files_fail_before_connecting(certs: Certificates) -> None:
    missing = str(certs.client_ca.parent / "missing.pem")
    message = await refusal(SubscribeOptions("127.0.0.1", 1, "CCAgent", tls_ca=missing))
    assert message.startswith(f"TLS: cannot load {missing}"), message


# -- the command line ---------------------------------------------------------------------------


def parse(*argv: str, env: dict[str, str] | None = None) -> SubscribeOptions:
    args = build_parser().parse_args(["subscribe", "--target", "127.0.0.1:8899", *argv])
    return subscribe_options(args, env or {})


def test_cli_tls_flags_and_env_vars(certs: Certificates) -> None:
    flags = parse(
        "--role=CCAgent",
        f"--tls-ca={certs.server_ca}",
        f"--tls-cert={certs.client_cert}",
        f"--tls-key={certs.client_key}",
        f"--tls-server-name={SERVER_NAME}",
    )
    env = {
        "JOBSIGNAL_SUBSCRIBE_TLS_CA": str(certs.server_ca),
        "JOBSIGNAL_SUBSCRIBE_TLS_CERT": str(certs.client_cert),
        "JOBSIGNAL_SUBSCRIBE_TLS_KEY": str(certs.client_key),
        "JOBSIGNAL_SUBSCRIBE_TLS_SERVER_NAME": SERVER_NAME,
        # serve's own files are not the client's
        "JOBSIGNAL_TLS_CERT": str(certs.server_cert),
        "JOBSIGNAL_TLS_KEY": str(certs.server_key),
    }
    from_env = parse("--role=CCAgent", env=env)
    for parsed in (flags, from_env):
        assert parsed.uses_tls
        assert (parsed.tls_ca, parsed.tls_cert, parsed.tls_key, parsed.tls_server_name) == (
            str(certs.server_ca),
            str(certs.client_cert),
            str(certs.client_key),
            SERVER_NAME,
        )
    # A flag beats its env var; 'system' is the system's trust store.
    system = parse("--role=CCAgent", "--tls-ca=system", env={"JOBSIGNAL_SUBSCRIBE_TLS_CA": "x"})
    assert (system.tls, system.tls_ca) == (True, "")
    assert not parse("--role=CCAgent").uses_tls


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tls-server-name=x"], "need --tls-ca"),
        (["--tls-ca=system", "--tls-cert=c.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-ca=/nonexistent/ca.pem"], "TLS: cannot load /nonexistent/ca.pem"),
    ],
)
def test_cli_tls_mistakes_are_usage_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse("--role=CCAgent", *argv)


async def run_cli(argv: list[str], within: float) -> tuple[int | None, list[str], str]:
    """Run `jobsignal subscribe` until its first line or exit.

    Returns (exit status, or None when it was still running and got killed;
    stdout lines; stderr).
    """
    command = [sys.executable, "-m", "jobsignal", "subscribe", "--role", "FdAgent", *argv]
    process = await trio.lowlevel.open_process(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    stdout, stderr = process.stdout, process.stderr
    assert stdout is not None and stderr is not None
    out, err = bytearray(), bytearray()

    async def read(stream: trio.abc.ReceiveStream, sink: bytearray) -> None:
        async for chunk in stream:
            sink += chunk

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, stdout, out)
        nursery.start_soon(read, stderr, err)
        with trio.move_on_after(within):
            await wait_until(
                lambda: process.poll() is not None or b"\n" in out, within=math.inf, interval=0.02
            )
        still_running = process.poll() is None
        if still_running:
            process.kill()
        await process.wait()
    return (None if still_running else process.returncode), out.decode().splitlines(), err.decode()


@pytest.mark.slow
async def test_cli_subscribes_over_mutual_tls_and_exits_1_when_refused(
    certs: Certificates,
) -> None:
    async with serving_a_job(certs, mutual=True) as server:
        uuid = uuid_of_the_job(server)
        tls = [
            f"--target=127.0.0.1:{server.port}",
            f"--tls-ca={certs.server_ca}",
            f"--tls-server-name={SERVER_NAME}",
            "--json",
        ]
        trusted = [f"--tls-cert={certs.client_cert}", f"--tls-key={certs.client_key}"]
        stranger = [f"--tls-cert={certs.stranger_cert}", f"--tls-key={certs.stranger_key}"]
        accepted = await run_cli([*tls, *trusted], within=20)
        refused = await run_cli([*tls, *stranger], within=20)
        bad_file = await run_cli([*tls, "--tls-cert=/nonexistent", "--tls-key=/x"], within=20)

    status, lines, _ = accepted
    assert status is None, accepted  # still subscribed when killed
    assert json.loads(lines[0]) == expected_signal(JOB, uuid)
    status, lines, err = refused
    assert (status, lines) == (1, []), refused
    assert "jobsignal: subscription refused: TLS:" in err, err
    assert "does not accept the client certificate" in err, err
    assert "Traceback" not in err
    status, _, err = bad_file
    assert status == EXIT_USAGE, bad_file
    assert "jobsignal: error: TLS: cannot load" in err, err


async def test_a_tls_server_that_is_down_is_retried_not_refused(certs: Certificates) -> None:
    async with open_jobsignal_server() as stopped:
        port = stopped.port
    with pytest.raises(trio.TooSlowError), trio.fail_after(1):
        # A refused connection is transient: the client keeps retrying, it does not fail.
        await first_signal(options(port, certs))
