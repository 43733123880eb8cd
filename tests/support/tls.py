"""Certificates made in the test (trustme), as files and as TLS contexts for servers and clients."""

from __future__ import annotations

import base64
import ssl
from pathlib import Path
from typing import Any

import grpc
import trustme

from jobsignal.rpc.tls import TlsFiles


def write_pair(cert: trustme.LeafCert, directory: Path, name: str) -> tuple[Path, Path]:
    """`name`.crt (the chain) and `name`.key in `directory`."""
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(cert_path), append=True)
    cert.private_key_pem.write_to_path(str(key_path))
    return cert_path, key_path


class Pki:
    """A server certificate for localhost and 127.0.0.1, and a CA for client certificates."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.server_ca = trustme.CA()
        self.client_ca = trustme.CA()
        self.server_cert, self.server_key = write_pair(
            self.server_ca.issue_cert("localhost", "127.0.0.1"), directory, "server"
        )
        self.client_ca_path = directory / "client-ca.pem"
        self.client_ca.cert_pem.write_to_path(str(self.client_ca_path))

    def files(self, mutual: bool) -> TlsFiles:
        return TlsFiles(self.server_cert, self.server_key, self.client_ca_path if mutual else None)

    def credentials(self, client_ca: trustme.CA | None) -> Any:
        """grpcio channel credentials trusting the server, with a client certificate
        from `client_ca` if given."""
        chain = key = None
        if client_ca is not None:
            leaf = client_ca.issue_cert("client@example")
            chain = b"".join(p.bytes() for p in leaf.cert_chain_pems)
            key = leaf.private_key_pem.bytes()
        return grpc.ssl_channel_credentials(
            root_certificates=self.server_ca.cert_pem.bytes(),
            private_key=key,
            certificate_chain=chain,
        )


def server_context(
    ca: trustme.CA, *, client_certs: bool, hostname: str = "127.0.0.1"
) -> ssl.SSLContext:
    """A TLS server context with a certificate for `hostname` from `ca`; with
    `client_certs`, mutual TLS: a client certificate from `ca` is required."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(hostname).configure_cert(context)
    if client_certs:
        context.verify_mode = ssl.CERT_REQUIRED
        ca.configure_trust(context)
    return context


def client_context(ca: trustme.CA, *, with_cert: bool) -> ssl.SSLContext:
    """A TLS client context trusting `ca`, with a client certificate from it if asked."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    if with_cert:
        ca.issue_cert("jobsignal@example.com").configure_cert(context)
    return context


def b64(data: bytes) -> str:
    """Base64 text, as a kubeconfig inlines certificates and keys (`*-data`)."""
    return base64.b64encode(data).decode("ascii")


def trusting(ca: trustme.CA) -> dict[str, str]:
    """A kubeconfig cluster's inline trust: `ca`'s certificate."""
    return {"certificate-authority-data": b64(ca.cert_pem.bytes())}
