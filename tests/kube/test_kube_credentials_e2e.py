"""The watcher through kubeconfig credentials, against the emulator.

Each test writes a kubeconfig, turns it into a connection with
`jobsignal.app.choose_connection` (as `jobsignal serve --kubeconfig` does) and
runs `jobsignal.app.run_source` on it: bearer tokens (inline and tokenFile),
client certificates over HTTPS with a CA made here (trustme), token rotation
(kubelet's symlink swap, and a token the API server stops accepting), and
broken kubeconfigs, which must fail at start-up with one clear line.

Virtual time on `io_clock` (real loopback sockets: see tests/conftest.py): the
emulator, httpx, TLS (trio's in-memory SSL) and the watcher all run on trio's
clock, in this thread.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import NamedTuple

import pytest
import trio
import trio.testing
import trustme

import jobsignal
from jobsignal.app import choose_connection
from jobsignal.config import ConfigError, load_config
from jobsignal.sim.clusterd import ClusterdJob
from jobsignal.sim.emulator import KubeEmulator, open_emulator
from tests.support.cluster import Cluster, write_kubeconfig
from tests.support.tls import b64, server_context, trusting
from tests.support.waiting import wait_until
from tests.support.watching import Source, open_source

TOKEN = "kubeconfig-token-0001"
JOB = ClusterdJob("training", "resnet", "uid-resnet")


# -- bearer tokens ----------------------------------------------------------------------


async def follows_the_job(source: Source, cluster: Cluster) -> None:
    """The source turns ready holding `JOB`, and follows it to complete."""
    with trio.fail_after(10):
        await source.status.ready.wait()
    await source.holds(cluster)
    cluster.write(JOB, "complete")
    await source.holds(cluster)


async def test_token_from_kubeconfig(io_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    async with open_emulator(token=TOKEN) as emu:
        cluster = Cluster(emu.state)
        cluster.write(JOB, "running")
        kubeconfig = write_kubeconfig(tmp_path / "config", emu.url, user={"token": TOKEN})
        async with open_source(kubeconfig) as source:
            await follows_the_job(source, cluster)
        assert {r.authorization for r in emu.requests} == {f"Bearer {TOKEN}"}
        assert {r.user_agent for r in emu.requests} == {f"jobsignal/{jobsignal.__version__}"}
        assert emu.stats.unauthorized == 0


async def test_refused_token_keeps_the_source_unready_and_retrying(
    io_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with open_emulator(token=TOKEN) as emu:
        Cluster(emu.state).write(JOB, "running")
        kubeconfig = write_kubeconfig(tmp_path / "config", emu.url, user={"token": "wrong"})
        async with open_source(kubeconfig) as source:
            await wait_until(lambda: emu.stats.unauthorized >= 4, within=60)
            assert not source.status.ready.is_set() and not source.status.in_sync
            assert "401" in source.status.problem
            assert "wrong" not in source.status.problem
            assert source.broadcaster.job_count() == 0
            assert source.watcher.counters.lists == 0


async def test_token_file_from_kubeconfig(io_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "token").write_text(TOKEN + "\n")
    async with open_emulator(token=TOKEN) as emu:
        cluster = Cluster(emu.state)
        cluster.write(JOB, "running")
        # Relative to the kubeconfig's directory, as kubectl resolves it.
        kubeconfig = write_kubeconfig(
            tmp_path / "config", emu.url, user={"tokenFile": "secrets/token"}
        )
        async with open_source(kubeconfig) as source:
            await source.holds(cluster)
        assert {r.authorization for r in emu.requests} == {f"Bearer {TOKEN}"}


# -- client certificates over HTTPS --------------------------------------------------------


@pytest.mark.parametrize("form", ["data", "files"])
async def test_client_certificate_over_https(
    io_clock: trio.testing.MockClock, tmp_path: Path, ca: trustme.CA, form: str
) -> None:
    client = ca.issue_cert("jobsignal@example.test")
    ca_pem = ca.cert_pem.bytes()
    cert_pem = client.cert_chain_pems[0].bytes()
    key_pem = client.private_key_pem.bytes()
    if form == "data":
        cluster_tls = {"certificate-authority-data": b64(ca_pem)}
        user = {"client-certificate-data": b64(cert_pem), "client-key-data": b64(key_pem)}
    else:
        (tmp_path / "pki").mkdir()
        for name, pem in (("ca.crt", ca_pem), ("client.crt", cert_pem), ("client.key", key_pem)):
            (tmp_path / "pki" / name).write_bytes(pem)
        cluster_tls = {"certificate-authority": "pki/ca.crt"}
        user = {"client-certificate": "pki/client.crt", "client-key": "pki/client.key"}
    async with open_emulator(ssl_context=server_context(ca, client_certs=True)) as emu:
        assert emu.url.startswith("https://127.0.0.1:")
        cluster = Cluster(emu.state)
        cluster.write(JOB, "running")
        kubeconfig = write_kubeconfig(tmp_path / "config", emu.url, user=user, cluster=cluster_tls)
        async with open_source(kubeconfig) as source:
            await follows_the_job(source, cluster)
            assert source.watcher.counters.errors == 0
        assert emu.stats.tls_handshake_failures == 0
        assert {r.authorization for r in emu.requests} == {None}


@pytest.mark.parametrize("problem", ["no-client-certificate", "unknown-ca"])
async def test_tls_refusals_keep_the_source_unready(
    io_clock: trio.testing.MockClock, tmp_path: Path, ca: trustme.CA, problem: str
) -> None:
    if problem == "no-client-certificate":
        cluster_tls = trusting(ca)
        user: dict[str, str] = {}
    else:
        other = trustme.CA()
        client = other.issue_cert("jobsignal@example.test")
        cluster_tls = {"certificate-authority-data": b64(other.cert_pem.bytes())}
        user = {
            "client-certificate-data": b64(client.cert_chain_pems[0].bytes()),
            "client-key-data": b64(client.private_key_pem.bytes()),
        }
    async with open_emulator(ssl_context=server_context(ca, client_certs=True)) as emu:
        Cluster(emu.state).write(JOB, "running")
        kubeconfig = write_kubeconfig(tmp_path / "config", emu.url, user=user, cluster=cluster_tls)
        async with open_source(kubeconfig) as source:
            await wait_until(lambda: source.watcher.counters.errors >= 3, within=60)
            assert not source.status.ready.is_set()
            assert source.broadcaster.job_count() == 0
            assert source.status.problem.startswith("LIST failed")
            if problem == "no-client-certificate":  # the emulator refused each handshake
                await wait_until(lambda: emu.stats.tls_handshake_failures >= 3)
        assert emu.stats.list_requests == 0  # nothing got past the handshake


# -- token rotation --------------------------------------------------------------------------


class ProjectedToken:
    """A service-account token as the kubelet projects it: `token` -> `..data/token`,
    `..data` -> a timestamped directory, rotated by an atomic rename of `..data`."""

    def __init__(self, root: Path, token: str) -> None:
        self.root = root
        self.generation = 0
        root.mkdir()
        self._write(token)
        (root / "token").symlink_to(Path("..data") / "token")

    @property
    def path(self) -> Path:
        return self.root / "token"

    def rotate(self, token: str) -> None:
        self._write(token)

    def _write(self, token: str) -> None:
        self.generation += 1
        directory = self.root / f"..2026_{self.generation:02d}"
        directory.mkdir()
        (directory / "token").write_text(token)
        staging = self.root / "..data_tmp"
        staging.symlink_to(directory.name)
        os.replace(staging, self.root / "..data")


class Rotating(NamedTuple):
    emu: KubeEmulator
    cluster: Cluster
    token: ProjectedToken
    source: Source


@asynccontextmanager
async def watching_with_a_projected_token(tmp_path: Path) -> AsyncIterator[Rotating]:
    """A source whose token file the kubelet projects ("token-generation-1"), its watch
    open (timing out every 5 s) and the cluster's pending job held."""
    projected = ProjectedToken(tmp_path / "serviceaccount", "token-generation-1")
    async with open_emulator(token="token-generation-1") as emu:
        cluster = Cluster(emu.state)
        cluster.write(JOB, "pending")
        kubeconfig = write_kubeconfig(
            tmp_path / "config", emu.url, user={"tokenFile": str(projected.path)}
        )
        async with open_source(kubeconfig, watch_timeout="5") as source:
            with trio.fail_after(10):
                await emu.wait_open_watches(1)
            await source.holds(cluster)
            yield Rotating(emu, cluster, projected, source)


async def test_token_rotation_after_401_recovers(
    io_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with watching_with_a_projected_token(tmp_path) as (emu, cluster, projected, source):
        # The API server stops accepting the old token before the file changes.
        emu.set_token("token-generation-2")
        await wait_until(lambda: emu.stats.unauthorized >= 1, within=30)
        await wait_until(lambda: not source.status.in_sync)
        projected.rotate("token-generation-2")
        cluster.write(JOB, "running")
        await source.holds(cluster, timeout=60)
        assert source.status.in_sync
        assert source.watcher.counters.lists == 1  # the watch resumed: no relist
    refused = [r for r in emu.requests if r.authorization == "Bearer token-generation-1"]
    assert emu.stats.unauthorized == len(refused) - 2  # all but the first LIST and WATCH
    assert emu.requests[-1].authorization == "Bearer token-generation-2"


async def test_token_rotation_within_the_grace_period_needs_no_401(
    io_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with watching_with_a_projected_token(tmp_path) as (emu, cluster, projected, source):
        projected.rotate("token-generation-2")
        emu.set_token("token-generation-2", also_accept=["token-generation-1"])
        watches = emu.stats.watch_requests
        await wait_until(lambda: emu.stats.watch_requests > watches, within=30)
        emu.set_token("token-generation-2")  # the old token expires
        cluster.write(JOB, "running")
        await source.holds(cluster, timeout=30)
    assert emu.stats.unauthorized == 0
    assert emu.requests[-1].authorization == "Bearer token-generation-2"


async def test_token_file_briefly_empty_is_retried_not_fatal(
    io_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("token-generation-1")
    async with open_emulator(token="token-generation-1") as emu:
        cluster = Cluster(emu.state)
        cluster.write(JOB, "pending")
        kubeconfig = write_kubeconfig(
            tmp_path / "config", emu.url, user={"tokenFile": str(token_file)}
        )
        async with open_source(kubeconfig, tolerate_crash=True, watch_timeout="5") as source:
            await source.holds(cluster)
            token_file.write_text("")  # truncated: the writer has not written yet
            watches = emu.stats.watch_requests
            await trio.sleep(6)  # the watch times out and is opened again meanwhile
            token_file.write_text("token-generation-1")
            cluster.write(JOB, "running")
            with trio.move_on_after(30):
                await source.holds(cluster)
            assert not source.crashes, f"run_source ended: {source.crashes!r}"
            assert emu.stats.watch_requests > watches
            assert source.log.live() == cluster.live()


# -- broken kubeconfigs ------------------------------------------------------------------------

BROKEN: dict[str, tuple[str | None, str]] = {
    "missing": (None, "does not exist"),
    "not-yaml": (f"users:\n- name: u\n  user: {{token: {TOKEN}\n", "not valid YAML"),
    "no-current-context": ("apiVersion: v1\nclusters: []\n", "no current-context"),
    "unknown-cluster": (
        "current-context: c\ncontexts:\n- name: c\n  context: {cluster: nowhere, user: u}\n"
        f"users:\n- name: u\n  user: {{token: {TOKEN}}}\n",
        "cluster 'nowhere'",
    ),
    "no-server": (
        "current-context: c\ncontexts:\n- name: c\n  context: {cluster: k, user: u}\n"
        "clusters:\n- name: k\n  cluster: {}\nusers:\n- name: u\n  user: {}\n",
        "has no server",
    ),
    "exec-plugin-interactive": (
        "current-context: c\ncontexts:\n- name: c\n  context: {cluster: k, user: u}\n"
        "clusters:\n- name: k\n  cluster: {server: 'https://127.0.0.1:6443'}\n"
        "users:\n- name: u\n  user: {exec: {command: kubelogin, interactiveMode: Always,"
        " apiVersion: client.authentication.k8s.io/v1beta1}}\n",
        "exec plugin 'kubelogin' of user 'u'",
    ),
    "impersonation": (
        "current-context: c\ncontexts:\n- name: c\n  context: {cluster: k, user: u}\n"
        "clusters:\n- name: k\n  cluster: {server: 'https://127.0.0.1:6443'}\n"
        f"users:\n- name: u\n  user: {{token: {TOKEN}, as: admin}}\n",
        "sets as (impersonation)",
    ),
    "missing-token-file": (
        "current-context: c\ncontexts:\n- name: c\n  context: {cluster: k, user: u}\n"
        "clusters:\n- name: k\n  cluster: {server: 'https://127.0.0.1:6443'}\n"
        "users:\n- name: u\n  user: {tokenFile: /nonexistent/token}\n",
        "cannot read token file /nonexistent/token",
    ),
    "bad-ca-data": (
        "current-context: c\ncontexts:\n- name: c\n  context: {cluster: k, user: u}\n"
        "clusters:\n- name: k\n  cluster: {server: 'https://127.0.0.1:6443',"
        " certificate-authority-data: '!!not base64!!'}\n"
        f"users:\n- name: u\n  user: {{token: {TOKEN}}}\n",
        "not valid base64",
    ),
}


@pytest.mark.parametrize("case", BROKEN.keys())
def test_broken_kubeconfig_is_one_clear_line(tmp_path: Path, case: str) -> None:
    text, expected = BROKEN[case]
    path = tmp_path / "kube config"
    if text is not None:
        path.write_text(text)
    config = load_config({"kubeconfig": str(path)}, {})
    with pytest.raises(ConfigError) as raised:
        choose_connection(config, {})
    message = str(raised.value)
    assert "\n" not in message
    assert expected in message
    assert TOKEN not in message
    if case not in ("missing-token-file",):
        assert str(path) in message


def test_no_kubeconfig_anywhere_with_source_kubernetes(tmp_path: Path) -> None:
    config = load_config({"source": "kubernetes"}, {})
    with pytest.raises(ConfigError) as raised:
        choose_connection(config, {"HOME": str(tmp_path)})
    assert "\n" not in str(raised.value)
    assert "--source demo" in str(raised.value)
