"""The system trust store is loaded for an https cluster without a CA, and only then.

A plain-http API server (kubectl proxy, the emulator) never has a certificate
checked: with no TLS setting its connection has no SSLContext at all (about
0.5 MB of OpenSSL memory, 1.3 MB more with the system roots); https clusters
verify exactly as before.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import trustme

from jobsignal.kube.credentials import load_kubeconfig
from tests.kube.test_credentials import ca_pem, write_kubeconfig


def system_roots() -> int:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_default_certs()
    return int(context.cert_store_stats()["x509_ca"])


def loaded_cas(tmp_path: Path, cluster: dict[str, object]) -> int:
    connection = load_kubeconfig(write_kubeconfig(tmp_path, cluster=cluster), environ={})
    assert connection.verify is not None
    assert connection.verify.verify_mode == ssl.CERT_REQUIRED
    return int(connection.verify.cert_store_stats()["x509_ca"])


def test_an_https_cluster_without_a_ca_trusts_the_system_roots(tmp_path: Path) -> None:
    assert system_roots() > 0  # (else this machine could not tell the cases apart)
    assert loaded_cas(tmp_path, {"server": "https://10.0.0.1:6443"}) == system_roots()


def test_a_plain_http_cluster_builds_no_ssl_context(tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path, cluster={"server": "http://127.0.0.1:8001"})
    assert load_kubeconfig(path, environ={}).verify is None


def test_a_configured_ca_is_loaded_alone_for_http_and_https(tmp_path: Path) -> None:
    ca = trustme.CA()
    data = ca_pem(ca)
    (tmp_path / "ca.crt").write_bytes(data)
    for server in ("http://127.0.0.1:8001", "https://10.0.0.1:6443"):
        assert loaded_cas(tmp_path, {"server": server, "certificate-authority": "ca.crt"}) == 1
