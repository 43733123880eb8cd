"""Tests for jobsignal.kube.credentials: in-cluster, kubeconfig, discovery, real TLS."""

from __future__ import annotations

import os
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme
import yaml
from cryptography.hazmat.primitives import serialization

from jobsignal.kube.api import open_kube_client
from jobsignal.kube.credentials import (
    KubeConfigError,
    KubeConnection,
    TokenSource,
    discover,
    load_in_cluster,
    load_kubeconfig,
)
from tests.support.tls import b64, server_context

TOKEN = "s3cr3t-token-value"
CLUSTER_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def context_of(connection: KubeConnection) -> ssl.SSLContext:
    """The connection's SSLContext, which every TLS-capable connection has."""
    assert connection.verify is not None
    return connection.verify


@pytest.fixture(scope="module")
def client_cert(ca: Any) -> Any:
    return ca.issue_cert("jobsignal-user@example.test", common_name="jobsignal-user")


def ca_pem(ca: Any) -> bytes:
    pem: bytes = ca.cert_pem.bytes()
    return pem


def cert_pem(cert: Any) -> bytes:
    pem: bytes = cert.cert_chain_pems[0].bytes()
    return pem


def key_pem(cert: Any) -> bytes:
    pem: bytes = cert.private_key_pem.bytes()
    return pem


# --- in-cluster --------------------------------------------------------------


@pytest.fixture
def sa_root(tmp_path: Path, ca: Any) -> Path:
    root = tmp_path / "serviceaccount"
    root.mkdir()
    (root / "token").write_text(TOKEN + "\n")
    (root / "ca.crt").write_bytes(ca_pem(ca))
    (root / "namespace").write_text("training\n")
    return root


def test_in_cluster_reads_service_account(sa_root: Path) -> None:
    conn = load_in_cluster(CLUSTER_ENV, sa_root)
    assert conn.base_url == "https://10.96.0.1:443"
    assert conn.token_source is not None
    assert conn.token_source.current() == TOKEN
    assert conn.default_namespace == "training"
    assert context_of(conn).verify_mode == ssl.CERT_REQUIRED
    assert context_of(conn).check_hostname
    assert len(context_of(conn).get_ca_certs()) == 1  # the service-account CA only
    assert "in-cluster service account" in conn.description
    assert TOKEN not in conn.description
    assert TOKEN not in repr(conn)


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("fd00:10:96::1", "https://[fd00:10:96::1]:6443"),
        ("[fd00:10:96::1]", "https://[fd00:10:96::1]:6443"),
        ("kubernetes.default.svc", "https://kubernetes.default.svc:6443"),
    ],
)
def test_in_cluster_host_forms(sa_root: Path, host: str, url: str) -> None:
    env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": "6443"}
    assert load_in_cluster(env, sa_root).base_url == url


def test_in_cluster_namespace_file_is_optional(sa_root: Path) -> None:
    (sa_root / "namespace").unlink()
    assert load_in_cluster(CLUSTER_ENV, sa_root).default_namespace is None


@pytest.mark.parametrize(
    ("env", "breakage", "message"),
    [
        ({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, None, "needs KUBERNETES_SERVICE_HOST and"),
        ({**CLUSTER_ENV, "KUBERNETES_SERVICE_PORT": "https"}, None, "not a port number"),
        (CLUSTER_ENV, "no-token", "cannot read token file {root}/token"),
        (CLUSTER_ENV, "empty-token", "token file {root}/token is empty"),
        (CLUSTER_ENV, "no-ca", "cannot read {root}/ca.crt (service-account CA)"),
        (CLUSTER_ENV, "bad-ca", "service-account CA {root}/ca.crt holds no PEM certificate"),
    ],
)
def test_in_cluster_errors(
    sa_root: Path, env: dict[str, str], breakage: str | None, message: str
) -> None:
    if breakage == "no-token":
        (sa_root / "token").unlink()
    elif breakage == "empty-token":
        (sa_root / "token").write_text("\n")
    elif breakage == "no-ca":
        (sa_root / "ca.crt").unlink()
    elif breakage == "bad-ca":
        (sa_root / "ca.crt").write_text("not a certificate")
    with pytest.raises(KubeConfigError) as err:
        load_in_cluster(env, sa_root)
    assert message.format(root=sa_root) in str(err.value)
    assert_clean(err.value)


# --- TokenSource -------------------------------------------------------------


def test_file_token_follows_rewrites(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first")
    tokens = TokenSource.from_file(path)
    assert tokens.current() == "first"
    path.write_text("second-longer")
    assert tokens.current() == "second-longer"


def test_file_token_follows_atomic_replace(tmp_path: Path) -> None:
    # Same length, replaced by rename: only the inode tells the files apart.
    path = tmp_path / "token"
    path.write_text("aaaa")
    tokens = TokenSource.from_file(path)
    assert tokens.current() == "aaaa"
    (tmp_path / "token.new").write_text("bbbb")
    os.replace(tmp_path / "token.new", path)
    assert tokens.current() == "bbbb"


def test_file_token_follows_kubelet_symlink_swap(tmp_path: Path) -> None:
    # The kubelet's projected volumes: token -> ..data/token, ..data -> ..<timestamp>.
    for version, token in (("..v1", "token-one"), ("..v2", "token-two")):
        (tmp_path / version).mkdir()
        (tmp_path / version / "token").write_text(token)
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "token").symlink_to("..data/token")
    tokens = TokenSource.from_file(tmp_path / "token")
    assert tokens.current() == "token-one"
    (tmp_path / "..data.tmp").symlink_to("..v2")
    os.replace(tmp_path / "..data.tmp", tmp_path / "..data")
    assert tokens.current() == "token-two"


def test_invalidate_forces_reread(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("aaaa")
    tokens = TokenSource.from_file(path)
    assert tokens.current() == "aaaa"
    # Rewrite in place with the same size and modification time: invisible to stat.
    before = path.stat()
    path.write_text("bbbb")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert tokens.current() == "aaaa"
    tokens.invalidate()
    assert tokens.current() == "bbbb"


def test_file_token_vanishing_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    tokens = TokenSource.from_file(path)
    path.unlink()
    with pytest.raises(KubeConfigError, match="cannot read token file"):
        tokens.current()


def test_token_source_repr_hides_token(tmp_path: Path) -> None:
    fixed = TokenSource.fixed(TOKEN)
    assert fixed.current() == TOKEN
    fixed.invalidate()  # nothing to re-read
    assert fixed.current() == TOKEN
    path = tmp_path / "token"
    path.write_text(TOKEN)
    for tokens in (fixed, TokenSource.from_file(path)):
        assert TOKEN not in repr(tokens)
        assert TOKEN not in tokens.description
    assert repr(fixed) == "<TokenSource static token>"


# --- kubeconfig --------------------------------------------------------------


def write_kubeconfig(
    directory: Path,
    *,
    cluster: dict[str, Any] | None = None,
    user: dict[str, Any] | None = None,
    context: dict[str, Any] | None = None,
    name: str = "config",
) -> Path:
    """A kubeconfig with one cluster 'c', one user 'u' and current context 'ctx'."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster or {"server": "https://10.0.0.1:6443"}}],
        "users": [{"name": "u", "user": user or {}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u", **(context or {})}}],
        "current-context": "ctx",
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(yaml.safe_dump(doc))
    return path


def assert_clean(err: Exception) -> None:
    """An error message is one line and carries no secret."""
    text = str(err)
    assert "\n" not in text
    assert TOKEN not in text
    assert "PRIVATE KEY" not in text


def test_kubeconfig_token_and_ca_data(tmp_path: Path, ca: Any) -> None:
    path = write_kubeconfig(
        tmp_path,
        cluster={
            "server": "https://api.example.test:6443/",
            "certificate-authority-data": b64(ca_pem(ca)),
        },
        user={"token": TOKEN},
        context={"namespace": "jobs"},
    )
    conn = load_kubeconfig(path, environ={})
    assert conn.base_url == "https://api.example.test:6443"
    assert conn.token_source is not None
    assert conn.token_source.current() == TOKEN
    assert conn.default_namespace == "jobs"
    assert len(context_of(conn).get_ca_certs()) == 1
    assert context_of(conn).verify_mode == ssl.CERT_REQUIRED
    assert conn.description == (
        f"kubeconfig {path} context 'ctx' (server https://api.example.test:6443, static token)"
    )
    assert TOKEN not in repr(conn)


def test_kubeconfig_keeps_server_path_prefix(tmp_path: Path) -> None:
    path = write_kubeconfig(
        tmp_path, cluster={"server": "https://rancher.example.test/k8s/clusters/c-1/"}
    )
    conn = load_kubeconfig(path, environ={})
    assert conn.base_url == "https://rancher.example.test/k8s/clusters/c-1"
    assert conn.token_source is None
    assert conn.default_namespace is None
    assert "no credentials" in conn.description


def test_kubeconfig_token_file_relative_and_preferred(tmp_path: Path) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "token").write_text("from-file\n")
    path = write_kubeconfig(tmp_path, user={"tokenFile": "secrets/token", "token": TOKEN})
    conn = load_kubeconfig(path, environ={})
    assert conn.token_source is not None
    assert conn.token_source.path == tmp_path / "secrets" / "token"
    assert conn.token_source.current() == "from-file"  # tokenFile wins, as in client-go
    assert f"token file {tmp_path / 'secrets' / 'token'}" in conn.description


def test_kubeconfig_ca_file_relative(tmp_path: Path, ca: Any) -> None:
    (tmp_path / "pki").mkdir()
    (tmp_path / "pki" / "ca.crt").write_bytes(ca_pem(ca))
    path = write_kubeconfig(
        tmp_path,
        cluster={"server": "https://10.0.0.1:6443", "certificate-authority": "pki/ca.crt"},
    )
    assert len(context_of(load_kubeconfig(path, environ={})).get_ca_certs()) == 1


def test_kubeconfig_without_ca_uses_system_roots(tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path)
    conn = load_kubeconfig(path, environ={})
    assert context_of(conn).verify_mode == ssl.CERT_REQUIRED
    assert context_of(conn).check_hostname


def test_kubeconfig_insecure_skip_tls_verify(tmp_path: Path) -> None:
    path = write_kubeconfig(
        tmp_path, cluster={"server": "https://10.0.0.1:6443", "insecure-skip-tls-verify": True}
    )
    conn = load_kubeconfig(path, environ={})
    assert context_of(conn).verify_mode == ssl.CERT_NONE
    assert not context_of(conn).check_hostname
    assert "TLS verification disabled" in conn.description


def test_kubeconfig_data_fields_override_files(tmp_path: Path, ca: Any) -> None:
    # As in kubectl: with both set, the -data form is used and the file ignored.
    path = write_kubeconfig(
        tmp_path,
        cluster={
            "server": "https://10.0.0.1:6443",
            "certificate-authority": "missing.crt",
            "certificate-authority-data": b64(ca_pem(ca)),
        },
    )
    assert len(context_of(load_kubeconfig(path, environ={})).get_ca_certs()) == 1


def test_client_key_data_temp_file_is_removed(
    tmp_path: Path, client_cert: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    path = write_kubeconfig(
        tmp_path,
        user={
            "client-certificate-data": b64(cert_pem(client_cert)),
            "client-key-data": b64(key_pem(client_cert)),
        },
    )
    load_kubeconfig(path, environ={})
    assert list(scratch.iterdir()) == []


def test_kubeconfig_explicit_context_beats_current(tmp_path: Path) -> None:
    doc = {
        "clusters": [
            {"name": "dev", "cluster": {"server": "https://dev.example.test"}},
            {"name": "prod", "cluster": {"server": "https://prod.example.test"}},
        ],
        "users": [{"name": "u", "user": {"token": TOKEN}}],
        "contexts": [
            {"name": "dev", "context": {"cluster": "dev", "user": "u", "namespace": "a"}},
            {"name": "prod", "context": {"cluster": "prod", "user": "u", "namespace": "b"}},
        ],
        "current-context": "dev",
    }
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(doc))
    current = load_kubeconfig(path, environ={})
    assert (current.base_url, current.default_namespace) == ("https://dev.example.test", "a")
    chosen = load_kubeconfig(path, "prod", environ={})
    assert (chosen.base_url, chosen.default_namespace) == ("https://prod.example.test", "b")
    assert "context 'prod'" in chosen.description


def test_kubeconfig_env_merges_entries(tmp_path: Path) -> None:
    # First existing file that names something wins; missing files are skipped;
    # relative paths resolve against the file that defined the entry.
    first = tmp_path / "one" / "config"
    first.parent.mkdir()
    first.write_text(
        yaml.safe_dump(
            {
                "current-context": "work",
                "contexts": [{"name": "work", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "token").write_text("merged-token")
    second = tmp_path / "two" / "config"
    second.write_text(
        yaml.safe_dump(
            {
                "current-context": "other",
                "clusters": [{"name": "c", "cluster": {"server": "https://merged.example.test"}}],
                "users": [{"name": "u", "user": {"tokenFile": "token"}}],
                "contexts": [
                    {"name": "work", "context": {"cluster": "shadowed", "user": "u"}},
                    {"name": "other", "context": {"cluster": "c"}},
                ],
            }
        )
    )
    missing = tmp_path / "missing" / "config"
    env = {"KUBECONFIG": os.pathsep.join([str(missing), str(first), "", str(second)])}
    conn = load_kubeconfig(environ=env)
    assert conn.base_url == "https://merged.example.test"
    assert conn.token_source is not None
    assert conn.token_source.current() == "merged-token"
    assert f"kubeconfig {first} context 'work'" in conn.description
    other = load_kubeconfig(context="other", environ=env)
    assert other.token_source is None


def test_kubeconfig_defaults_to_home(tmp_path: Path) -> None:
    write_kubeconfig(tmp_path / ".kube", user={"token": TOKEN})
    conn = load_kubeconfig(environ={"HOME": str(tmp_path)})
    assert conn.description.startswith(f"kubeconfig {tmp_path / '.kube' / 'config'} ")


def _encrypted_key(cert: Any) -> bytes:
    key = serialization.load_pem_private_key(key_pem(cert), password=None)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase"),
    )


# Each case: a function that builds the broken kubeconfig in a directory and
# returns its path, and the message expected ({dir} is the directory).
BrokenCase = Callable[[Path, Any, Any], Path]


def _raw(text: str) -> BrokenCase:
    def build(d: Path, ca: Any, cert: Any) -> Path:
        d.mkdir(parents=True, exist_ok=True)
        (d / "config").write_text(text)
        return d / "config"

    return build


def _with(**parts: Any) -> BrokenCase:
    """A kubeconfig whose sections are computed from the CA and client cert."""

    def build(d: Path, ca: Any, cert: Any) -> Path:
        kwargs = {k: v(ca, cert) if callable(v) else v for k, v in parts.items()}
        return write_kubeconfig(d, **kwargs)

    return build


SERVER = "https://10.0.0.1:6443"
C = "cluster 'c' in kubeconfig {dir}/config"
U = "user 'u' in kubeconfig {dir}/config"
BROKEN: list[tuple[str, BrokenCase, str]] = [
    ("empty", _raw(""), "kubeconfig {dir}/config has no current-context and none was given"),
    ("yaml", _raw("clusters: [\n"), "kubeconfig {dir}/config is not valid YAML at line 2"),
    (
        "yaml-token-line",
        _raw(f"users:\n- name: u\n  user:\n    token: {TOKEN}: x\n"),
        "kubeconfig {dir}/config is not valid YAML at line 4, column 30: "
        "mapping values are not allowed here",
    ),
    ("not-mapping", _raw("- a\n- b\n"), "kubeconfig {dir}/config is not a YAML mapping"),
    # JSON is YAML too (read without PyYAML): the same checks, the same messages.
    ("json-not-mapping", _raw('["a", "b"]'), "kubeconfig {dir}/config is not a YAML mapping"),
    (
        "json-clusters-not-list",
        _raw('{"clusters": {}}'),
        "kubeconfig {dir}/config: clusters is not a list",
    ),
    (
        "json-nested-too-deeply",
        _raw('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        "kubeconfig {dir}/config is nested too deeply",
    ),
    (
        "yaml-nested-too-deeply",
        _raw("a: " + "[" * 100_000 + "]" * 100_000 + "\n"),
        "kubeconfig {dir}/config is nested too deeply",
    ),
    (
        "clusters-not-list",
        _raw("clusters: {}\n"),
        "kubeconfig {dir}/config: clusters is not a list",
    ),
    ("nameless", _raw("users:\n- user: {}\n"), "kubeconfig {dir}/config: users[0] has no name"),
    (
        "unknown-context",
        _raw("current-context: nope\ncontexts:\n- name: a\n  context: {cluster: c}\n"),
        "context 'nope' not found in kubeconfig {dir}/config (available: a)",
    ),
    (
        "context-without-cluster",
        _raw("current-context: a\ncontexts:\n- name: a\n  context: {user: u}\n"),
        "context 'a' in kubeconfig {dir}/config names no cluster",
    ),
    (
        "unknown-cluster",
        _raw("current-context: a\ncontexts:\n- name: a\n  context: {cluster: c}\n"),
        "cluster 'c' of context 'a' in kubeconfig {dir}/config is not defined",
    ),
    (
        "unknown-user",
        _raw(
            "current-context: a\nclusters:\n- name: c\n  cluster: {server: 'https://x'}\n"
            "contexts:\n- name: a\n  context: {cluster: c, user: ghost}\n"
        ),
        "user 'ghost' of context 'a' in kubeconfig {dir}/config is not defined",
    ),
    ("no-server", _with(cluster={"insecure-skip-tls-verify": True}), f"{C} has no server"),
    ("server-not-url", _with(cluster={"server": "10.0.0.1:6443"}), f"{C}: server is not an http"),
    (
        "server-credentials",
        _with(cluster={"server": f"https://admin:{TOKEN}@10.0.0.1"}),
        f"{C}: server URL must not contain credentials",
    ),
    (
        "server-port",
        _with(cluster={"server": "https://h:99999"}),
        f"{C}: server URL has an invalid",
    ),
    (
        "ca-base64",
        _with(cluster={"server": SERVER, "certificate-authority-data": "%%%"}),
        f"certificate-authority-data of {C} is not valid base64",
    ),
    (
        "ca-not-pem",
        _with(cluster={"server": SERVER, "certificate-authority-data": b64(b"hello")}),
        f"certificate-authority-data of {C} holds no PEM certificate",
    ),
    (
        "ca-bad-pem",
        _with(
            cluster={
                "server": SERVER,
                "certificate-authority-data": b64(
                    b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
                ),
            }
        ),
        f"certificate-authority-data of {C} is not a valid PEM certificate",
    ),
    (
        "ca-file-missing",
        _with(cluster={"server": SERVER, "certificate-authority": "missing.crt"}),
        f"cannot read {{dir}}/missing.crt (certificate-authority of {C}): No such file",
    ),
    (
        "insecure-and-ca",
        _with(
            cluster=lambda ca, cert: {
                "server": SERVER,
                "insecure-skip-tls-verify": True,
                "certificate-authority-data": b64(ca_pem(ca)),
            }
        ),
        f"{C} sets both insecure-skip-tls-verify and a certificate authority",
    ),
    (
        "insecure-not-bool",
        _with(cluster={"server": SERVER, "insecure-skip-tls-verify": "yes please"}),
        f"{C}: insecure-skip-tls-verify is not true or false",
    ),
    (
        "proxy-url-socks",
        _with(cluster={"server": SERVER, "proxy-url": "socks5://proxy:1080"}),
        f"{C}: proxy-url uses socks5, which jobsignal does not support (http and https",
    ),
    (
        "exec-without-api-version",
        _with(user={"exec": {"command": "aws", "args": ["eks", "get-token"]}}),
        f"exec plugin 'aws' of {U} has no apiVersion (use client.authentication.k8s.io/v1",
    ),
    (
        "impersonation",
        _with(user={"token": TOKEN, "as": "admin", "as-groups": ["system:masters"]}),
        f"{U} sets as, as-groups (impersonation), which jobsignal does not support",
    ),
    (
        "auth-provider",
        _with(user={"auth-provider": {"name": "oidc", "config": {"id-token": TOKEN}}}),
        f"{U} uses an auth-provider plugin, which jobsignal does not support",
    ),
    (
        "basic-auth",
        _with(user={"username": "admin", "password": TOKEN}),
        f"{U} uses basic auth (username/password), which is not supported",
    ),
    (
        "token-file-missing",
        _with(user={"tokenFile": "nope"}),
        "cannot read token file {dir}/nope: No such file",
    ),
    (
        "token-not-string",
        _with(user={"token": 12345}),
        f"{U}: token is not a string",
    ),
    (
        "cert-without-key",
        _with(user=lambda ca, cert: {"client-certificate-data": b64(cert_pem(cert))}),
        f"{U} has a client certificate or key but no client-key",
    ),
    (
        "key-without-cert",
        _with(user=lambda ca, cert: {"client-key-data": b64(key_pem(cert))}),
        f"{U} has a client certificate or key but no client-certificate",
    ),
    (
        "key-base64",
        _with(
            user=lambda ca, cert: {
                "client-certificate-data": b64(cert_pem(cert)),
                # Raw PEM pasted where base64 belongs: a common mistake.
                "client-key-data": key_pem(cert).decode(),
            }
        ),
        f"client-key-data of {U} is not valid base64",
    ),
    (
        "cert-not-pem",
        _with(
            user=lambda ca, cert: {
                "client-certificate-data": b64(b"junk"),
                "client-key-data": b64(key_pem(cert)),
            }
        ),
        f"client-certificate-data of {U} is not a PEM certificate",
    ),
    (
        "key-not-pem",
        _with(
            user=lambda ca, cert: {
                "client-certificate-data": b64(cert_pem(cert)),
                "client-key-data": b64(cert_pem(cert)),
            }
        ),
        f"client-key-data of {U} is not a PEM private key",
    ),
    (
        "cert-file-missing",
        _with(user={"client-certificate": "client.crt", "client-key": "client.key"}),
        f"cannot read {{dir}}/client.crt (client-certificate of {U}): No such file",
    ),
    (
        "key-mismatch",
        _with(
            user=lambda ca, cert: {
                "client-certificate-data": b64(cert_pem(cert)),
                "client-key-data": b64(key_pem(ca.issue_cert("someone-else"))),
            }
        ),
        f"client certificate and key of {U} do not match",
    ),
    (
        "key-encrypted",
        _with(
            user=lambda ca, cert: {
                "client-certificate-data": b64(cert_pem(cert)),
                "client-key-data": b64(_encrypted_key(cert)),
            }
        ),
        f"client-key-data of {U} is encrypted; jobsignal needs an unencrypted key",
    ),
]


@pytest.mark.parametrize(("build", "message"), [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_kubeconfig_errors(
    tmp_path: Path, ca: Any, client_cert: Any, build: BrokenCase, message: str
) -> None:
    path = build(tmp_path, ca, client_cert)
    with pytest.raises(KubeConfigError) as err:
        load_kubeconfig(path, environ={})
    assert message.format(dir=tmp_path) in str(err.value)
    assert_clean(err.value)


def test_kubeconfig_unknown_explicit_context(tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path)
    with pytest.raises(KubeConfigError, match=r"context 'nope' not found .*\(available: ctx\)"):
        load_kubeconfig(path, "nope", environ={})


def test_kubeconfig_missing_files(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError) as err:
        load_kubeconfig(tmp_path / "nope", environ={})
    assert str(err.value) == f"kubeconfig {tmp_path / 'nope'} does not exist or is not a file"

    listed = os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")])
    with pytest.raises(KubeConfigError) as err:
        load_kubeconfig(environ={"KUBECONFIG": listed})
    assert str(err.value) == f"none of the files in KUBECONFIG exist: {listed}"

    with pytest.raises(KubeConfigError) as err:
        load_kubeconfig(environ={"HOME": str(tmp_path)})
    assert str(err.value) == (
        f"no kubeconfig: KUBECONFIG is not set and {tmp_path / '.kube' / 'config'} is missing"
    )


# --- discover ----------------------------------------------------------------


@pytest.fixture
def home(tmp_path: Path) -> Path:
    write_kubeconfig(tmp_path / "home" / ".kube", cluster={"server": "https://home.example.test"})
    return tmp_path / "home"


def test_discover_explicit_kubeconfig_first(tmp_path: Path, sa_root: Path, home: Path) -> None:
    explicit = write_kubeconfig(
        tmp_path / "explicit", cluster={"server": "https://explicit.example.test"}
    )
    env = {**CLUSTER_ENV, "HOME": str(home)}
    conn = discover(explicit, None, env, in_cluster_root=sa_root)
    assert conn is not None
    assert conn.base_url == "https://explicit.example.test"


def test_discover_in_cluster_before_kubeconfig(sa_root: Path, home: Path) -> None:
    env = {**CLUSTER_ENV, "HOME": str(home), "KUBECONFIG": str(home / ".kube" / "config")}
    conn = discover(None, None, env, in_cluster_root=sa_root)
    assert conn is not None
    assert conn.base_url == "https://10.96.0.1:443"


def test_discover_context_means_kubeconfig_even_in_cluster(sa_root: Path, home: Path) -> None:
    env = {**CLUSTER_ENV, "HOME": str(home)}
    conn = discover(None, "ctx", env, in_cluster_root=sa_root)
    assert conn is not None
    assert conn.base_url == "https://home.example.test"


def test_discover_kubeconfig_env_then_home(tmp_path: Path, home: Path) -> None:
    other = write_kubeconfig(tmp_path / "env", cluster={"server": "https://env.example.test"})
    conn = discover(None, None, {"HOME": str(home), "KUBECONFIG": str(other)})
    assert conn is not None
    assert conn.base_url == "https://env.example.test"
    conn = discover(None, None, {"HOME": str(home)})
    assert conn is not None
    assert conn.base_url == "https://home.example.test"


def test_discover_kubeconfig_env_typo_is_an_error(home: Path) -> None:
    with pytest.raises(KubeConfigError, match="none of the files in KUBECONFIG exist"):
        discover(None, None, {"HOME": str(home), "KUBECONFIG": str(home / "typo")})


def test_discover_nothing_configured(tmp_path: Path) -> None:
    assert discover(None, None, {"HOME": str(tmp_path)}) is None
    with pytest.raises(KubeConfigError, match="context 'prod' was given but no kubeconfig"):
        discover(None, "prod", {"HOME": str(tmp_path)})


def test_discover_explicit_errors_propagate(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="does not exist"):
        discover(tmp_path / "nope", None, {})


# --- real TLS handshakes -----------------------------------------------------


@dataclass
class TlsServer:
    """A one-request-per-connection HTTPS server that answers with the client's name."""

    port: int = 0
    refusals: list[str] = field(default_factory=list)  # failed handshakes, as ssl reports them

    async def handle(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            self.refusals.append(ssl_reason(exc))
            return
        try:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                request += chunk
            peer = stream.getpeercert() or {}
            names = [v for rdn in peer.get("subject", ()) for k, v in rdn if k == "commonName"]
            body = (names[0] if names else "anonymous").encode()
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            await stream.send_all(head.encode() + body)
            await stream.aclose()
        except trio.BrokenResourceError as exc:
            # TLS 1.3 checks the client certificate after the client's side of
            # the handshake is done, so a refusal can surface here.
            self.refusals.append(ssl_reason(exc))


@asynccontextmanager
async def tls_server(context: ssl.SSLContext) -> AsyncIterator[TlsServer]:
    server = TlsServer()
    async with trio.open_nursery() as nursery:
        serving = partial(trio.serve_ssl_over_tcp, server.handle, 0, context, host="127.0.0.1")
        listeners = await nursery.start(serving)
        server.port = listeners[0].transport_listener.socket.getsockname()[1]
        yield server
        nursery.cancel_scope.cancel()


async def get(conn: KubeConnection) -> str:
    async with open_kube_client(conn, timeout=httpx.Timeout(10.0)) as c:
        response = await c.get("/version")
        response.raise_for_status()
        return response.text


def ssl_reason(exc: BaseException) -> str:
    """The ssl error under trio's BrokenResourceError, or the ConnectError that names it."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__ or cause.__context__
    return str(cause or exc)


@pytest.mark.parametrize("form", ["data", "files"])
async def test_client_certificate_handshake(
    tmp_path: Path, ca: Any, client_cert: Any, form: str
) -> None:
    with trio.fail_after(10):
        context = server_context(ca, client_certs=True, hostname="127.0.0.1")
        async with tls_server(context) as tls:
            server = f"https://127.0.0.1:{tls.port}"
            if form == "data":
                cluster = {"server": server, "certificate-authority-data": b64(ca_pem(ca))}
                user = {
                    "client-certificate-data": b64(cert_pem(client_cert)),
                    "client-key-data": b64(key_pem(client_cert)),
                }
            else:
                (tmp_path / "ca.crt").write_bytes(ca_pem(ca))
                (tmp_path / "client.crt").write_bytes(cert_pem(client_cert))
                (tmp_path / "client.key").write_bytes(key_pem(client_cert))
                cluster = {"server": server, "certificate-authority": "ca.crt"}
                user = {"client-certificate": "client.crt", "client-key": "client.key"}
            with_cert = load_kubeconfig(write_kubeconfig(tmp_path, cluster=cluster, user=user))
            assert await get(with_cert) == "jobsignal-user"

            without_cert = load_kubeconfig(
                write_kubeconfig(tmp_path, cluster=cluster, user={"token": TOKEN}, name="bare")
            )
            assert tls.refusals == []
            with pytest.raises(httpx.TransportError):
                await get(without_cert)
        assert len(tls.refusals) == 1
        assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in tls.refusals[0]


async def test_tls_server_name(tmp_path: Path, ca: Any) -> None:
    # The certificate names the in-cluster service, the URL has an address.
    context = server_context(ca, client_certs=False, hostname="kubernetes.default.svc")
    with trio.fail_after(10):
        async with tls_server(context) as tls:
            cluster = {
                "server": f"https://127.0.0.1:{tls.port}",
                "certificate-authority-data": b64(ca_pem(ca)),
            }
            plain = load_kubeconfig(write_kubeconfig(tmp_path, cluster=cluster))
            with pytest.raises(httpx.ConnectError) as err:
                await get(plain)
            assert "IP address mismatch" in ssl_reason(err.value)

            named = load_kubeconfig(
                write_kubeconfig(
                    tmp_path, cluster={**cluster, "tls-server-name": "kubernetes.default.svc"}
                )
            )
            assert "TLS server name kubernetes.default.svc" in named.description
            assert await get(named) == "anonymous"


async def test_insecure_skip_tls_verify_handshake(tmp_path: Path) -> None:
    unknown_ca = trustme.CA()
    context = server_context(unknown_ca, client_certs=False, hostname="127.0.0.1")
    with trio.fail_after(10):
        async with tls_server(context) as tls:
            server = f"https://127.0.0.1:{tls.port}"
            checked = load_kubeconfig(write_kubeconfig(tmp_path, cluster={"server": server}))
            with pytest.raises(httpx.ConnectError) as err:
                await get(checked)
            assert "unable to get local issuer certificate" in ssl_reason(err.value)

            insecure = load_kubeconfig(
                write_kubeconfig(
                    tmp_path, cluster={"server": server, "insecure-skip-tls-verify": True}
                )
            )
            assert await get(insecure) == "anonymous"
