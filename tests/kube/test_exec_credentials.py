"""Kubeconfigs from managed clusters: exec credential plugins, proxy-url, impersonation, User-Agent.

The plugin is a real program (tests/kube/fake_credential_plugin.py, run with
this interpreter) that answers from a plan the test writes and logs every run;
it serves tokens and client certificates to the Kubernetes API emulator over
127.0.0.1, directly or through the tests' HTTP proxy (tests/support/proxy.py:
CONNECT for https, absolute-URI forwarding for http). Caching by expiry runs in virtual
time with a frozen `mock_clock` (the plugin process takes real time, which a
frozen clock does not count), and so does the plugin timeout, jumped by hand.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import trio
import trio.testing
import trustme

import jobsignal
from jobsignal.kube.api import ApiUnavailable, KubeApi, Unauthorized, open_kube_client
from jobsignal.kube.credentials import KubeConfigError, KubeConnection, load_kubeconfig
from jobsignal.kube.exec_credentials import MAX_STDOUT, RUN_TIMEOUT, ExecCredentials
from jobsignal.kube.exec_plugin import ExecCredentialError
from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.sim.emulator import KubeEmulator, open_emulator
from tests.support.cluster import Cluster, write_kubeconfig
from tests.support.proxy import open_proxy
from tests.support.tls import b64, server_context, trusting
from tests.support.waiting import wait_until
from tests.support.watching import open_source

PLUGIN = Path(__file__).with_name("fake_credential_plugin.py")
V1 = "client.authentication.k8s.io/v1"
V1BETA1 = "client.authentication.k8s.io/v1beta1"
SECRET = "plugin-token-0001"
JOB = ClusterdJob("training", "bert", "uid-bert")
AGENT = f"jobsignal/{jobsignal.__version__}"
TIMEOUT = httpx.Timeout(10.0)


class Plugin:
    """The fake plugin's plan (what it answers) and log (how it was run)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.plan = directory / "plan.json"
        self.log = directory / "calls.jsonl"
        self.record_env: list[str] = []
        self.respond({"token": SECRET})

    def respond(self, *responses: dict[str, Any]) -> None:
        """Answer the n-th run from now with responses[n]; the last one repeats."""
        plan = {
            "calls": str(self.log),
            "record_env": self.record_env,
            # The plan indexes by the number of runs logged so far.
            "responses": [{}] * len(self.calls()) + list(responses),
        }
        self.plan.write_text(json.dumps(plan))

    def calls(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def stanza(self, api_version: str = V1, **extra: Any) -> dict[str, Any]:
        """A kubeconfig user's `exec` entry running this plugin."""
        args = [str(PLUGIN), str(self.plan), *extra.pop("args", [])]
        return {"apiVersion": api_version, "command": sys.executable, "args": args, **extra}

    def cert_files(
        self, cert: trustme.LeafCert, name: str, *, chain: bytes | None = None
    ) -> dict[str, str]:
        """PEM files for a response's cert_file and key_file (*chain* replaces the chain)."""
        cert_path = self.directory / f"{name}.crt"
        key_path = self.directory / f"{name}.key"
        if chain is None:
            chain = b"".join(pem.bytes() for pem in cert.cert_chain_pems)
        cert_path.write_bytes(chain)
        key_path.write_bytes(cert.private_key_pem.bytes())
        return {"cert_file": str(cert_path), "key_file": str(key_path)}


@pytest.fixture
def plugin(tmp_path: Path) -> Plugin:
    return Plugin(tmp_path / "plugin")


def exec_connection(
    tmp_path: Path,
    plugin: Plugin,
    server: str = "https://10.0.0.1:6443",
    *,
    cluster: dict[str, Any] | None = None,
    **stanza: Any,
) -> KubeConnection:
    kubeconfig = write_kubeconfig(
        tmp_path / "config", server, user={"exec": plugin.stanza(**stanza)}, cluster=cluster
    )
    return load_kubeconfig(kubeconfig, environ={})


def exec_source(connection: KubeConnection) -> ExecCredentials:
    assert connection.exec_credentials is not None
    return connection.exec_credentials


def assert_clean(message: str, *secrets: str) -> None:
    assert "\n" not in message
    for secret in (SECRET, *secrets):
        assert secret not in message


# -- running the plugin ------------------------------------------------------------------


@pytest.mark.parametrize("api_version", [V1, V1BETA1])
async def test_plugin_runs_with_args_env_and_no_stdin(
    tmp_path: Path, plugin: Plugin, api_version: str
) -> None:
    plugin.record_env = ["PLUGIN_REGION", "PATH"]
    plugin.respond({"token": SECRET})
    connection = exec_connection(
        tmp_path,
        plugin,
        api_version=api_version,
        args=["--cluster", "c-1"],
        env=[{"name": "PLUGIN_REGION", "value": "eu-west-9"}],
        interactiveMode="IfAvailable",
    )
    assert connection.token_source is None
    assert "exec plugin" in connection.description
    credential, fresh = await exec_source(connection).get()
    assert fresh
    assert credential.token == SECRET
    assert credential.client_certificate is None
    assert credential.refresh_at is None
    [call] = plugin.calls()
    assert call["args"] == ["--cluster", "c-1"]
    assert call["env"]["PLUGIN_REGION"] == "eu-west-9"
    assert call["env"]["PATH"]  # the entry's env is added to the process's own
    assert call["stdin_is_devnull"]
    # Without provideClusterInfo the request carries no cluster.
    assert call["exec_info"] == {
        "apiVersion": api_version,
        "kind": "ExecCredential",
        "spec": {"interactive": False},
    }
    assert SECRET not in repr(credential)
    assert SECRET not in repr(connection)


def test_relative_command_resolves_against_the_kubeconfig(tmp_path: Path) -> None:
    stanza = {"apiVersion": V1, "command": "bin/get-token"}
    kubeconfig = write_kubeconfig(tmp_path / "config", "https://x", user={"exec": stanza})
    resolved = exec_source(load_kubeconfig(kubeconfig, environ={})).plugin.command
    assert resolved == str(tmp_path / "bin" / "get-token")
    # A bare name is looked up on PATH when it runs.
    stanza["command"] = "aws"
    kubeconfig = write_kubeconfig(tmp_path / "config", "https://x", user={"exec": stanza})
    assert exec_source(load_kubeconfig(kubeconfig, environ={})).plugin.command == "aws"


async def test_provide_cluster_info(tmp_path: Path, plugin: Plugin, ca: trustme.CA) -> None:
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "ca.crt").write_bytes(ca.cert_pem.bytes())
    cluster = {
        "certificate-authority": "pki/ca.crt",  # passed as data, as client-go does
        "tls-server-name": "api.internal",
        "proxy-url": "http://127.0.0.1:3128",
        "extensions": [
            {"name": "other.example/ext", "extension": {"ignored": True}},
            {"name": "client.authentication.k8s.io/exec", "extension": {"audience": "jobs"}},
        ],
    }
    connection = exec_connection(
        tmp_path, plugin, "https://10.0.0.1:6443", cluster=cluster, provideClusterInfo=True
    )
    await exec_source(connection).get()
    [call] = plugin.calls()
    assert call["exec_info"] == {
        "apiVersion": V1,
        "kind": "ExecCredential",
        "spec": {
            "interactive": False,
            "cluster": {
                "server": "https://10.0.0.1:6443",
                "tls-server-name": "api.internal",
                "certificate-authority-data": b64(ca.cert_pem.bytes()),
                "proxy-url": "http://127.0.0.1:3128",
                "config": {"audience": "jobs"},
            },
        },
    }


async def test_provide_cluster_info_insecure(tmp_path: Path, plugin: Plugin) -> None:
    connection = exec_connection(
        tmp_path,
        plugin,
        cluster={"insecure-skip-tls-verify": True},
        provideClusterInfo=True,
    )
    await exec_source(connection).get()
    assert plugin.calls()[0]["exec_info"]["spec"]["cluster"] == {
        "server": "https://10.0.0.1:6443",
        "insecure-skip-tls-verify": True,
    }


async def test_cached_until_shortly_before_expiry(
    mock_clock: trio.testing.MockClock, tmp_path: Path, plugin: Plugin
) -> None:
    plugin.respond(
        {"token": "token-1", "expires_in": 600},
        {"token": "token-2", "expires_in": 600},
    )
    source = exec_source(exec_connection(tmp_path, plugin))
    first, fresh = await source.get()
    assert (first.token, fresh) == ("token-1", True)
    mock_clock.jump(560)  # 40 s before expiry: still good
    assert await source.get() == (first, False)
    mock_clock.jump(20)  # 20 s before expiry: inside the renewal margin
    second, fresh = await source.get()
    assert (second.token, fresh) == ("token-2", True)
    assert len(plugin.calls()) == source.runs == 2


async def test_without_expiry_cached_until_refused(
    mock_clock: trio.testing.MockClock, tmp_path: Path, plugin: Plugin
) -> None:
    plugin.respond({"token": "token-1"}, {"token": "token-2"}, {"token": "token-3"})
    source = exec_source(exec_connection(tmp_path, plugin))
    first, _ = await source.get()
    mock_clock.jump(30 * 86400)
    assert await source.get() == (first, False)
    source.invalidate(first)
    second, fresh = await source.get()
    assert (second.token, fresh) == ("token-2", True)
    # A late 401 for the old credential must not throw away the new one.
    source.invalidate(first)
    assert await source.get() == (second, False)
    assert len(plugin.calls()) == 2


async def test_expired_on_arrival_serves_one_request(
    mock_clock: trio.testing.MockClock, tmp_path: Path, plugin: Plugin
) -> None:
    plugin.respond({"token": SECRET, "expires_in": -5})
    source = exec_source(exec_connection(tmp_path, plugin))
    assert (await source.get())[1]
    assert (await source.get())[1]
    assert len(plugin.calls()) == 2


async def test_concurrent_requests_share_one_run(tmp_path: Path, plugin: Plugin) -> None:
    source = exec_source(exec_connection(tmp_path, plugin))
    tokens: list[str | None] = []

    async def fetch() -> None:
        credential, _ = await source.get()
        tokens.append(credential.token)

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(fetch)
    assert tokens == [SECRET] * 5
    assert len(plugin.calls()) == 1


async def test_plugin_that_hangs_is_killed(
    mock_clock: trio.testing.MockClock, tmp_path: Path, plugin: Plugin
) -> None:
    plugin.respond({"sleep": 3600, "token": SECRET})
    source = exec_source(exec_connection(tmp_path, plugin))
    errors: list[ExecCredentialError] = []

    async def fetch() -> None:
        with pytest.raises(ExecCredentialError) as raised:
            await source.get()
        errors.append(raised.value)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fetch)
        await wait_until(lambda: len(plugin.calls()) >= 1, within=20, what="the plugin to run")
        mock_clock.jump(RUN_TIMEOUT - 1)
        await trio.testing.wait_all_tasks_blocked(0.05)
        assert errors == []  # still waiting for the plugin
        mock_clock.jump(2)
    [error] = errors
    assert f"did not finish within {RUN_TIMEOUT:g}s and was killed" in str(error)
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(plugin.calls()[0]["pid"], 0)


async def test_loud_stderr_is_drained_not_fatal(tmp_path: Path, plugin: Plugin) -> None:
    # Far more than a pipe buffer: unread, it would block the plugin forever.
    plugin.respond({"stderr_bytes": 4 * 1024 * 1024, "token": SECRET})
    source = exec_source(exec_connection(tmp_path, plugin))
    with trio.fail_after(20):
        credential, _ = await source.get()
    assert credential.token == SECRET


LONG_STDERR = "refresh failed: " + "x" * 1000
FAILURES: dict[str, tuple[dict[str, Any], str]] = {
    "exit-status": (
        {"exit": 3, "stderr": f"{LONG_STDERR}\nsecond line"},
        "exited with status 3; stderr: 'refresh failed: xxxx",
    ),
    "exit-quiet": ({"exit": 1}, "exited with status 1 (no stderr)"),
    "not-json": ({"stdout": f"token={SECRET}"}, "printed something that is not JSON"),
    "too-deep": ({"stdout": "[" * 100_000 + "]" * 100_000}, "printed JSON nested too deep to read"),
    "not-object": ({"stdout": json.dumps([SECRET])}, "did not print a JSON object"),
    "wrong-kind": (
        {"stdout": json.dumps({"kind": "Secret", "apiVersion": V1})},
        "printed kind 'Secret', not ExecCredential",
    ),
    "wrong-version": (
        {"token": SECRET, "api_version": V1BETA1},
        f"answered with apiVersion '{V1BETA1}', but the kubeconfig asks for {V1}",
    ),
    "no-status": (
        {"stdout": json.dumps({"kind": "ExecCredential", "apiVersion": V1})},
        "returned no status",
    ),
    "empty-status": ({}, "returned neither a token nor a client certificate and key"),
    "token-not-string": (
        {
            "stdout": json.dumps(
                {"kind": "ExecCredential", "apiVersion": V1, "status": {"token": 7}}
            )
        },
        "returned a status.token that is not a string",
    ),
    "cert-without-key": (
        {
            "stdout": json.dumps(
                {
                    "kind": "ExecCredential",
                    "apiVersion": V1,
                    "status": {"clientCertificateData": "-----BEGIN CERTIFICATE-----"},
                }
            )
        },
        "returned a client certificate or key but no clientKeyData",
    ),
    "bad-expiry": (
        {"token": SECRET, "expiration": "tomorrow"},
        "returned an expirationTimestamp that is not an RFC 3339 time: 'tomorrow'",
    ),
    "naive-expiry": (
        {"token": SECRET, "expiration": "2030-01-01T00:00:00"},
        "returned an expirationTimestamp that is not an RFC 3339 time",
    ),
    "too-much-output": ({"stdout_bytes": MAX_STDOUT + 1}, "printed more than 1048576 bytes"),
}


@pytest.mark.parametrize("case", FAILURES)
async def test_plugin_failures_are_one_clear_line(
    tmp_path: Path, plugin: Plugin, case: str
) -> None:
    response, expected = FAILURES[case]
    plugin.respond(response)
    source = exec_source(exec_connection(tmp_path, plugin))
    with trio.fail_after(20), pytest.raises(ExecCredentialError) as raised:
        await source.get()
    message = str(raised.value)
    where = f"exec plugin {sys.executable!r} of user 'jobsignal' in kubeconfig {tmp_path}/config"
    assert message.startswith(where)
    assert expected in message
    assert_clean(message)
    if case == "exit-status":  # stderr is quoted, but only its first ~200 characters
        assert len(message) < len(where) + 300
        assert "second line" not in message


async def test_missing_command_names_the_install_hint(tmp_path: Path) -> None:
    stanza = {
        "apiVersion": V1,
        "command": "jobsignal-test-no-such-plugin",
        "installHint": "Install it with:\n  pip install something",
    }
    kubeconfig = write_kubeconfig(tmp_path / "config", "https://x", user={"exec": stanza})
    source = exec_source(load_kubeconfig(kubeconfig, environ={}))
    with pytest.raises(ExecCredentialError) as raised:
        await source.get()
    assert str(raised.value) == (
        f"exec plugin 'jobsignal-test-no-such-plugin' of user 'jobsignal' in kubeconfig "
        f"{tmp_path}/config cannot be run: command not found; install hint: "
        "'Install it with: pip install something'"
    )


# -- kubeconfig entries refused at start-up ------------------------------------------------

U = "user 'jobsignal' in kubeconfig {dir}/config"
E = "exec plugin 'aws' of " + U
C = "cluster 'emulator' in kubeconfig {dir}/config"
AWS = {"apiVersion": V1, "command": "aws", "args": ["eks", "get-token"]}
REFUSED: dict[str, tuple[dict[str, Any], dict[str, Any] | None, str]] = {
    "interactive-always": (
        {"exec": {**AWS, "interactiveMode": "Always"}},
        None,
        f"{E} has interactiveMode Always, but jobsignal runs without a terminal",
    ),
    "interactive-unknown": (
        {"exec": {**AWS, "interactiveMode": "Sometimes"}},
        None,
        f"{E}: interactiveMode 'Sometimes' is not Never, IfAvailable or Always",
    ),
    "no-api-version": (
        {"exec": {"command": "aws"}},
        None,
        f"{E} has no apiVersion (use {V1} or {V1BETA1})",
    ),
    "v1alpha1": (
        {"exec": {**AWS, "apiVersion": "client.authentication.k8s.io/v1alpha1"}},
        None,
        f"{E}: apiVersion 'client.authentication.k8s.io/v1alpha1' is not supported",
    ),
    "no-command": ({"exec": {"apiVersion": V1}}, None, f"{U}: exec has no command"),
    "exec-not-mapping": ({"exec": "aws"}, None, f"{U}: exec is not a mapping"),
    "args-not-strings": (
        {"exec": {**AWS, "args": ["eks", 7]}},
        None,
        f"{E}: args is not a list of strings",
    ),
    "env-without-value": (
        {"exec": {**AWS, "env": [{"name": "AWS_PROFILE"}]}},
        None,
        f"{E}: env[0] needs a name and a string value",
    ),
    "env-not-list": (
        {"exec": {**AWS, "env": {"AWS_PROFILE": SECRET}}},
        None,
        f"{E}: env is not a list of name/value pairs",
    ),
    "provide-not-bool": (
        {"exec": {**AWS, "provideClusterInfo": "yes"}},
        None,
        f"{E}: provideClusterInfo is not true or false",
    ),
    "exec-and-token": (
        {"exec": AWS, "token": SECRET},
        None,
        f"{U} sets both exec and token; keep only one way to authenticate",
    ),
    "exec-and-cert": (
        {"exec": AWS, "client-certificate": "c.crt", "client-key": "c.key"},
        None,
        f"{U} sets both exec and a client certificate",
    ),
    "extensions-not-list": (
        {"exec": {**AWS, "provideClusterInfo": True}},
        {"extensions": {"name": "x"}},
        f"{C}: extensions is not a list",
    ),
    "impersonate-user": (
        {"token": SECRET, "as": "admin"},
        None,
        f"{U} sets as (impersonation), which jobsignal does not support",
    ),
    "impersonate-all": (
        {
            "token": SECRET,
            "as": "admin",
            "as-uid": "1234",
            "as-groups": ["system:masters"],
            "as-user-extra": {"reason": ["audit"]},
        },
        None,
        f"{U} sets as, as-uid, as-groups, as-user-extra (impersonation)",
    ),
    "impersonate-groups-with-exec": (
        {"exec": AWS, "as-groups": ["system:masters"]},
        None,
        f"{U} sets as-groups (impersonation)",
    ),
    "proxy-socks": (
        {"token": SECRET},
        {"proxy-url": "socks5://127.0.0.1:1080"},
        f"{C}: proxy-url uses socks5, which jobsignal does not support",
    ),
    "proxy-not-url": (
        {"token": SECRET},
        {"proxy-url": "127.0.0.1:3128"},
        f"{C}: proxy-url is not an http(s) URL",
    ),
    "proxy-port": (
        {"token": SECRET},
        {"proxy-url": "http://127.0.0.1:99999"},
        f"{C}: proxy-url has an invalid port",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_entries_are_refused(tmp_path: Path, case: str) -> None:
    user, cluster, expected = REFUSED[case]
    kubeconfig = write_kubeconfig(tmp_path / "config", "https://x", user=user, cluster=cluster)
    with pytest.raises(KubeConfigError) as raised:
        load_kubeconfig(kubeconfig, environ={})
    assert expected.format(dir=tmp_path) in str(raised.value)
    assert_clean(str(raised.value))


def test_proxy_url_is_kept_and_described_without_credentials(tmp_path: Path) -> None:
    proxy = f"http://jobsignal:{SECRET}@proxy.example.test:3128"
    kubeconfig = write_kubeconfig(
        tmp_path / "config", "https://x", user={"token": "t"}, cluster={"proxy-url": proxy}
    )
    connection = load_kubeconfig(kubeconfig, environ={})
    assert connection.proxy == proxy
    assert ", via proxy http://proxy.example.test:3128," in connection.description
    assert SECRET not in connection.description
    assert SECRET not in repr(connection)


# -- against the API emulator ------------------------------------------------------------


@asynccontextmanager
async def open_api(connection: KubeConnection) -> AsyncIterator[KubeApi]:
    async with open_kube_client(connection, timeout=TIMEOUT) as client:
        yield KubeApi(client, connection.token_source, read_timeout=30)


@asynccontextmanager
async def open_api_on_mutual_tls(
    tmp_path: Path, plugin: Plugin, ca: trustme.CA
) -> AsyncIterator[tuple[KubeEmulator, KubeApi]]:
    """An emulator requiring client certificates from `ca`, and an API client that
    gets its certificate from the plugin."""
    async with open_emulator(ssl_context=server_context(ca, client_certs=True)) as emu:
        connection = exec_connection(tmp_path, plugin, emu.url, cluster=trusting(ca))
        async with open_api(connection) as api:
            yield emu, api


async def test_token_from_plugin_and_a_new_run_after_401(tmp_path: Path, plugin: Plugin) -> None:
    plugin.respond({"token": "token-1"}, {"token": "token-2"})
    async with open_emulator(token="token-1") as emu:
        connection = exec_connection(tmp_path, plugin, emu.url)
        async with open_api(connection) as api:
            await api.list_page(None, {})
            await api.list_page(None, {})
            assert len(plugin.calls()) == 1  # cached: no expiry given
            emu.set_token("token-2")  # the API server no longer accepts token-1
            with pytest.raises(Unauthorized):
                await api.list_page(None, {})
            await api.list_page(None, {})  # the plugin ran again
            assert len(plugin.calls()) == 2
    assert [r.authorization for r in emu.requests] == [
        "Bearer token-1",
        "Bearer token-1",
        "Bearer token-1",
        "Bearer token-2",
    ]
    assert emu.stats.unauthorized == 1
    assert {r.user_agent for r in emu.requests} == {AGENT}


async def test_plugin_failure_is_a_retryable_api_error(tmp_path: Path, plugin: Plugin) -> None:
    plugin.respond({"exit": 2, "stderr": "no identity provider"}, {"token": SECRET})
    async with open_emulator(token=SECRET) as emu:
        api_context = open_api(exec_connection(tmp_path, plugin, emu.url))
        async with api_context as api:
            with pytest.raises(ApiUnavailable) as raised:
                await api.list_page(None, {})
            assert "LIST failed: no credentials: exec plugin" in str(raised.value)
            assert "no identity provider" in str(raised.value)
            assert emu.stats.requests == 0  # nothing was sent without credentials
            await api.list_page(None, {})
    assert emu.stats.requests == 1


async def test_unusable_certificate_from_plugin_is_a_retryable_api_error(
    tmp_path: Path, plugin: Plugin, ca: trustme.CA
) -> None:
    plugin.respond(plugin.cert_files(ca.issue_cert("d"), "bad", chain=b"not a certificate"))
    async with open_api_on_mutual_tls(tmp_path, plugin, ca) as (emu, api):
        with pytest.raises(ApiUnavailable) as raised:
            await api.list_page(None, {})
    assert str(raised.value) == (
        "LIST failed: no credentials: client certificate from exec plugin "
        f"{sys.executable!r} of user 'jobsignal' in kubeconfig {tmp_path}/config "
        "is not a PEM certificate"
    )
    assert emu.stats.connections == 0


async def test_client_certificate_from_plugin_is_renewed_before_expiry(
    mock_clock: trio.testing.MockClock, tmp_path: Path, plugin: Plugin, ca: trustme.CA
) -> None:
    plugin.respond(
        {**plugin.cert_files(ca.issue_cert("a", common_name="exec-one"), "one"), "expires_in": 600},
        {**plugin.cert_files(ca.issue_cert("b", common_name="exec-two"), "two"), "expires_in": 600},
    )
    async with open_api_on_mutual_tls(tmp_path, plugin, ca) as (emu, api):
        await api.list_page(None, {})
        await api.list_page(None, {})
        mock_clock.jump(590)
        await api.list_page(None, {})
    assert [r.client_certificate for r in emu.requests] == ["exec-one", "exec-one", "exec-two"]
    assert {r.authorization for r in emu.requests} == {None}
    assert len(plugin.calls()) == 2
    # Not kept alive: the renewed certificate is presented by the very next request.
    assert emu.stats.connections == 3
    assert emu.stats.tls_handshake_failures == 0


async def test_watcher_with_exec_token(tmp_path: Path, plugin: Plugin) -> None:
    async with open_emulator(token=SECRET) as emu:
        cluster = Cluster(emu.state)
        cluster.write(JOB, "running")
        kubeconfig = write_kubeconfig(
            tmp_path / "config", emu.url, user={"exec": plugin.stanza(api_version=V1BETA1)}
        )
        async with open_source(kubeconfig) as source:
            await source.holds(cluster)
            cluster.write(JOB, "complete")
            await source.holds(cluster)
            assert source.watcher.counters.errors == 0
    assert {r.authorization for r in emu.requests} == {f"Bearer {SECRET}"}
    assert {r.kind for r in emu.requests} == {"list", "watch"}
    assert len(plugin.calls()) == 1


async def test_watcher_with_exec_client_certificate(
    tmp_path: Path, plugin: Plugin, ca: trustme.CA
) -> None:
    plugin.respond(plugin.cert_files(ca.issue_cert("c", common_name="exec-cert"), "c"))
    async with open_emulator(ssl_context=server_context(ca, client_certs=True)) as emu:
        cluster = Cluster(emu.state)
        cluster.write(JOB, "running")
        kubeconfig = write_kubeconfig(
            tmp_path / "config",
            emu.url,
            user={"exec": plugin.stanza()},
            cluster=trusting(ca),
        )
        async with open_source(kubeconfig) as source:
            await source.holds(cluster)
            # Stopped mid-handshake, httpcore would leave the WATCH's socket unclosed
            # (its trio start_tls closes it on Exception, not on Cancelled).
            with trio.fail_after(10):
                await emu.wait_open_watches(1)
    assert {r.client_certificate for r in emu.requests} == {"exec-cert"}
    assert emu.stats.tls_handshake_failures == 0


# -- proxy-url ---------------------------------------------------------------------------


def watched(emu: KubeEmulator) -> list[str]:
    return [r.kind for r in emu.requests]


async def test_proxy_url_forwards_http_requests(tmp_path: Path) -> None:
    async with open_emulator(token=SECRET) as emu, open_proxy() as proxy:
        cluster = Cluster(emu.state)
        cluster.write(JOB, "running")
        kubeconfig = write_kubeconfig(
            tmp_path / "config",
            emu.url,
            user={"token": SECRET},
            cluster={"proxy-url": f"http://127.0.0.1:{proxy.port}"},
        )
        async with open_source(kubeconfig) as source:
            await source.holds(cluster)
            with trio.fail_after(10):
                await emu.wait_open_watches(1)
        assert proxy.tunnels == []
        # Every request the API server saw came through the proxy, in order.
        assert [(m, urlsplit(t).path) for m, t, _ in proxy.forwarded] == [
            (r.method, r.path) for r in emu.requests
        ]
        assert watched(emu) == ["list", "watch"]
        for _, target, headers in proxy.forwarded:
            assert target.startswith(f"{emu.url}/api/v1/configmaps?")
            assert headers["user-agent"] == AGENT
            assert headers["authorization"] == f"Bearer {SECRET}"


async def test_proxy_url_tunnels_https(tmp_path: Path, plugin: Plugin, ca: trustme.CA) -> None:
    # An exec plugin's token and client certificate, through CONNECT tunnels.
    client = ca.issue_cert("proxied", common_name="proxied")
    plugin.respond({"token": SECRET, **plugin.cert_files(client, "proxied")})
    async with open_emulator(
        ssl_context=server_context(ca, client_certs=True), token=SECRET
    ) as emu:
        cluster = Cluster(emu.state)
        cluster.write(JOB, "running")
        async with open_proxy() as proxy:
            kubeconfig = write_kubeconfig(
                tmp_path / "config",
                emu.url,
                user={"exec": plugin.stanza()},
                cluster={**trusting(ca), "proxy-url": f"http://127.0.0.1:{proxy.port}"},
            )
            async with open_source(kubeconfig) as source:
                await source.holds(cluster)
                with trio.fail_after(10):
                    await emu.wait_open_watches(1)
            port = urlsplit(emu.url).port
            # Connections are not kept alive with exec plugins: one tunnel per request.
            assert proxy.tunnels == [f"127.0.0.1:{port}"] * len(emu.requests)
            assert proxy.forwarded == []
        assert watched(emu) == ["list", "watch"]
        assert {r.client_certificate for r in emu.requests} == {"proxied"}
        assert {r.authorization for r in emu.requests} == {f"Bearer {SECRET}"}
        assert {r.user_agent for r in emu.requests} == {AGENT}
