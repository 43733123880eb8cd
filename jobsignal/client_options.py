"""What a client connects with: `SubscribeOptions` and the TLS context they ask for.

Without gRPC, so that what needs only a client's options and TLS (the relay's
settings, the command line's parsing) loads no grpclib.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field


class SubscribeFailed(Exception):
    """The server refused in a way retrying cannot fix; the message says why."""


@dataclass(frozen=True)
class SubscribeOptions:
    """Where to subscribe and how; TLS when `tls` is set or any `tls_*` file is given.

    `tls_ca` is a PEM CA bundle that verifies the server (empty: the system's
    trust store), `tls_cert` and `tls_key` a PEM client certificate and key for
    mutual TLS, `tls_server_name` the name the server's certificate must carry
    (empty: `host`). `on_subscribed(client_id)` is called each time the client has
    registered and sends its Subscribe request (again after every reconnect).
    """

    host: str
    port: int
    role: str
    list_mode: bool = False
    keepalive_time: float = 30.0
    backoff_initial: float = 0.8
    backoff_max: float = 30.0
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    on_subscribed: Callable[[str], object] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")

    @property
    def uses_tls(self) -> bool:
        return self.tls or any((self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name))


def client_ssl_context(options: SubscribeOptions) -> ssl.SSLContext:
    """The TLS context of `options`; SubscribeFailed when its files cannot be loaded."""
    try:
        context = ssl.create_default_context(cafile=options.tls_ca or None)
        if options.tls_cert:
            context.load_cert_chain(options.tls_cert, options.tls_key)
    except (OSError, ssl.SSLError) as error:
        files = ", ".join(f for f in (options.tls_ca, options.tls_cert, options.tls_key) if f)
        raise SubscribeFailed(f"TLS: cannot load {files or 'the trust store'}: {error}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    return context
