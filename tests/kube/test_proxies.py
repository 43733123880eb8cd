"""Proxies from the environment as client-go takes them (kube/proxies.py), and where requests go.

The rules, as Go's `http.ProxyFromEnvironment` applies them, on addresses
that are only ever compared (10.96.0.1, example names: nothing is sent);
then in-cluster connections over 127.0.0.1 with HTTPS_PROXY set to a
CONNECT proxy of the tests' own: a server NO_PROXY names is reached
directly, one it does not name through the proxy (a name only the proxy
resolves, to 127.0.0.1).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import trustme

from jobsignal.kube.api import KubeApi, open_kube_client
from jobsignal.kube.credentials import KubeConfigError, KubeConnection, load_in_cluster
from jobsignal.kube.proxies import EnvironmentProxy, ProxyConfigError, proxy_for
from jobsignal.sim.emulator import KubeEmulator, open_emulator
from tests.support.cluster import Cluster
from tests.support.factories import clusterd_job
from tests.support.proxy import open_proxy
from tests.support.tls import server_context

PROXY = "http://proxy.example:3128"
# A cluster-wide proxy as OpenShift and kubeadm air-gap guides set it.
CLUSTER_WIDE = {"HTTPS_PROXY": PROXY, "NO_PROXY": "10.96.0.0/12,.svc"}


def via(url: str, **environ: str) -> str | None:
    found = proxy_for(url, environ)
    return None if found is None else found.url


def test_a_cidr_and_a_suffix_in_no_proxy_keep_the_in_cluster_api_server_direct() -> None:
    assert via("https://10.96.0.1:443", **CLUSTER_WIDE) is None
    assert via("https://10.111.255.254", **CLUSTER_WIDE) is None  # still in /12
    assert via("https://kubernetes.default.svc", **CLUSTER_WIDE) is None
    assert via("https://10.112.0.1", **CLUSTER_WIDE) == PROXY  # past the /12
    assert via("https://kubernetes.default.svc.cluster.local", **CLUSTER_WIDE) == PROXY
    assert via("https://api.example.com:6443", **CLUSTER_WIDE) == PROXY


@pytest.mark.parametrize(
    ("entry", "url", "direct"),
    [
        # A domain: itself and its subdomains.
        ("example.com", "https://example.com", True),
        ("example.com", "https://api.example.com", True),
        ("example.com", "https://notexample.com", False),
        # A leading dot, or "*.": subdomains only.
        (".example.com", "https://api.example.com", True),
        (".example.com", "https://example.com", False),
        ("*.example.com", "https://a.b.example.com", True),
        ("*.example.com", "https://example.com", False),
        # Case does not matter, on either side.
        ("Example.COM", "https://API.example.com", True),
        # A port: only that port (the scheme's default when the URL has none).
        ("example.com:6443", "https://example.com:6443", True),
        ("example.com:6443", "https://example.com", False),
        ("example.com:443", "https://example.com", True),
        # IP addresses, with or without a port; IPv6 in brackets or bare.
        ("10.0.0.1", "https://10.0.0.1:6443", True),
        ("10.0.0.1:6443", "https://10.0.0.1:6443", True),
        ("10.0.0.1:6443", "https://10.0.0.1:443", False),
        ("10.0.0.2", "https://10.0.0.1", False),
        ("fd00::1", "https://[fd00::1]:6443", True),
        ("[fd00::1]:6443", "https://[fd00::1]:6443", True),
        ("[fd00::1]:6443", "https://[fd00::1]:443", False),
        # CIDRs of both families; host bits in the entry are ignored.
        ("10.96.0.1/12", "https://10.100.0.1", True),
        ("fd00::/8", "https://[fd12::1]", True),
        ("fd00::/8", "https://[fe80::1]", False),
        ("10.0.0.0/8", "https://[::ffff:10.1.2.3]", True),  # IPv4-mapped
        # An IP entry never matches a name, nor a name's entry an address.
        ("10.0.0.1", "https://ten.example", False),
        # Everything.
        ("*", "https://anything.example", True),
        ("*", "https://10.0.0.1", True),
        # Malformed entries are skipped, the others still apply.
        ("10.0.0.0/99, :443, example.com:http, ,example.org", "https://example.org", True),
        ("10.0.0.0/99, :443, example.com:http", "https://example.com", False),
    ],
)
def test_no_proxy_entries(entry: str, url: str, direct: bool) -> None:
    assert (via(url, HTTPS_PROXY=PROXY, NO_PROXY=entry) is None) is direct


@pytest.mark.parametrize(
    "url", ["https://localhost:6443", "https://127.0.0.1", "https://127.1.2.3", "https://[::1]"]
)
def test_localhost_and_loopback_addresses_are_never_proxied(url: str) -> None:
    assert via(url, HTTPS_PROXY=PROXY) is None


def test_each_scheme_has_its_variable_and_all_proxy_is_not_read() -> None:
    both = {"HTTP_PROXY": "http://plain:1", "HTTPS_PROXY": "http://secure:2"}
    assert via("http://api.example", **both) == "http://plain:1"
    assert via("https://api.example", **both) == "http://secure:2"
    # No fallback from one scheme to the other, and ALL_PROXY is curl's, not Go's.
    assert via("https://api.example", HTTP_PROXY="http://plain:1") is None
    assert via("http://api.example", HTTPS_PROXY="http://secure:2") is None
    assert via("https://api.example", ALL_PROXY="http://all:3", all_proxy="http://all:3") is None


def test_upper_case_first_and_an_empty_value_is_unset() -> None:
    assert via("https://a.example", HTTPS_PROXY="http://up:1", https_proxy="http://low:2") == (
        "http://up:1"
    )
    assert via("https://a.example", HTTPS_PROXY="", https_proxy="http://low:2") == "http://low:2"
    assert via("https://a.example", https_proxy="http://low:2", no_proxy="a.example") is None
    # NO_PROXY set but empty: no_proxy is read instead.
    assert via("https://a.example", HTTPS_PROXY=PROXY, NO_PROXY="", no_proxy="a.example") is None


def test_the_variable_a_proxy_came_from_is_named() -> None:
    assert proxy_for("https://a.example", {"https_proxy": PROXY}) == EnvironmentProxy(
        PROXY, "https_proxy"
    )


@pytest.mark.parametrize(
    ("value", "url"),
    [
        ("proxy.example:3128", "http://proxy.example:3128"),
        ("http://proxy.example:3128", "http://proxy.example:3128"),
        ("https://user:pw@proxy.example", "https://user:pw@proxy.example"),
    ],
)
def test_a_value_without_a_scheme_is_read_as_http(value: str, url: str) -> None:
    assert via("https://a.example", HTTPS_PROXY=value) == url


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"HTTPS_PROXY": "socks5://proxy:1080"}, "HTTPS_PROXY names a socks5 proxy"),
        ({"HTTPS_PROXY": "ftp://proxy:21"}, "HTTPS_PROXY names a ftp proxy"),
        ({"https_proxy": "http://proxy:99999"}, "https_proxy has an invalid port"),
        ({"HTTPS_PROXY": "http://:3128"}, "HTTPS_PROXY names no proxy host"),
    ],
)
def test_a_proxy_jobsignal_cannot_use_is_refused_by_name(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ProxyConfigError, match=message):
        proxy_for("https://a.example", environ)


def test_http_proxy_is_refused_in_a_cgi_environment() -> None:
    environ = {"HTTP_PROXY": PROXY, "HTTPS_PROXY": PROXY, "REQUEST_METHOD": "GET"}
    with pytest.raises(ProxyConfigError, match="CGI"):
        proxy_for("http://a.example", environ)
    assert via("https://a.example", **environ) == PROXY


# -- in cluster, over 127.0.0.1 -------------------------------------------------------------

TOKEN = "in-cluster-token"


def service_account(directory: Path, ca: trustme.CA) -> Path:
    directory.mkdir()
    (directory / "token").write_text(TOKEN)
    (directory / "ca.crt").write_bytes(ca.cert_pem.bytes())
    (directory / "namespace").write_text("training")
    return directory


def in_cluster(root: Path, host: str, port: int, **environ: str) -> KubeConnection:
    env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": str(port), **environ}
    return load_in_cluster(env, root)


async def list_and_watch(connection: KubeConnection, emu: KubeEmulator) -> None:
    async with open_kube_client(connection, timeout=httpx.Timeout(10.0)) as client:
        api = KubeApi(client, connection.token_source, read_timeout=30.0)
        page = await api.list_page(None, {})
        assert len(page["items"]) == 1
        version = page["metadata"]["resourceVersion"]
        async with api.watch(None, {"resourceVersion": version, "timeoutSeconds": "1"}):
            pass
    assert [r.kind for r in emu.requests] == ["list", "watch"]
    assert {r.authorization for r in emu.requests} == {f"Bearer {TOKEN}"}


async def test_in_cluster_behind_a_proxy_an_api_server_no_proxy_names_is_reached_directly(
    tmp_path: Path, ca: trustme.CA
) -> None:
    # The cluster-wide configuration above, on the loopback range.
    tls = server_context(ca, client_certs=False, hostname="127.0.0.1")
    async with open_proxy() as proxy, open_emulator(ssl_context=tls, token=TOKEN) as emu:
        Cluster(emu.state).write(clusterd_job("bert"), "running")
        port = urlsplit(emu.url).port
        assert port is not None
        environ = {"HTTPS_PROXY": proxy.url, "NO_PROXY": "127.0.0.0/8,.svc"}
        connection = in_cluster(service_account(tmp_path / "sa", ca), "127.0.0.1", port, **environ)
        assert connection.proxy is None
        assert "via proxy" not in connection.description
        await list_and_watch(connection, emu)
        assert proxy.tunnels == [] and proxy.forwarded == []


async def test_in_cluster_behind_a_proxy_any_other_api_server_is_reached_through_it(
    tmp_path: Path, ca: trustme.CA
) -> None:
    name = "kubernetes.proxied.test"  # resolved by the proxy alone, to 127.0.0.1
    tls = server_context(ca, client_certs=False, hostname=name)
    async with (
        open_proxy(frozenset({name})) as proxy,
        open_emulator(ssl_context=tls, token=TOKEN) as emu,
    ):
        Cluster(emu.state).write(clusterd_job("bert"), "running")
        port = urlsplit(emu.url).port
        assert port is not None
        environ = {"https_proxy": proxy.url, "NO_PROXY": "127.0.0.0/8,.svc"}
        connection = in_cluster(service_account(tmp_path / "sa", ca), name, port, **environ)
        assert connection.proxy == proxy.url
        assert f"via proxy {proxy.url} (https_proxy)" in connection.description
        await list_and_watch(connection, emu)
        assert proxy.tunnels and set(proxy.tunnels) == {f"{name}:{port}"}


def test_a_proxy_variable_jobsignal_cannot_use_is_a_configuration_error(
    tmp_path: Path, ca: trustme.CA
) -> None:
    root = service_account(tmp_path / "sa", ca)
    with pytest.raises(KubeConfigError, match="HTTPS_PROXY names a socks5 proxy"):
        in_cluster(root, "10.96.0.1", 443, HTTPS_PROXY="socks5://proxy:1080")
