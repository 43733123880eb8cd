"""What a relay connects to and how: its settings (jobsignal/config.py) and fixed timings."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from jobsignal.client_options import SubscribeFailed, SubscribeOptions, client_ssl_context
from jobsignal.config import ConfigError, LayerSettings, from_setting


@dataclass(frozen=True)
class RelaySettings(LayerSettings):
    """The upstream and the relay's rules for it; the first ones are settings."""

    upstream: tuple[str, int] | None = from_setting(lambda c: c.upstream)
    role: str = from_setting(lambda c: c.upstream_role)
    tls_ca: str = from_setting(lambda c: c.upstream_tls_ca)
    tls_cert: str = from_setting(lambda c: c.upstream_tls_cert)
    tls_key: str = from_setting(lambda c: c.upstream_tls_key)
    tls_server_name: str = from_setting(lambda c: c.upstream_tls_server_name)
    grace: float = from_setting(lambda c: c.upstream_grace)
    max_message_bytes: int = from_setting(lambda c: c.upstream_max_message_bytes)
    # TCP connect and TLS handshake; Register's answer.
    connect_timeout: float = 10.0
    request_timeout: float = 10.0
    # PING the upstream after this long without a frame from it (its own idle rule
    # counts them as heartbeats); no answer within the timeout: the connection is dead.
    keepalive_time: float = 30.0
    keepalive_timeout: float = 10.0
    # Between attempts to reach the upstream (jobsignal/backoff.py).
    backoff_initial: float = 0.8
    backoff_max: float = 30.0

    @property
    def host(self) -> str:
        assert self.upstream is not None, "a relay needs an upstream"
        return self.upstream[0]

    @property
    def port(self) -> int:
        assert self.upstream is not None, "a relay needs an upstream"
        return self.upstream[1]

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def client_options(self) -> SubscribeOptions:
        """The upstream's TLS as `jobsignal subscribe` takes it (jobsignal/client.py)."""
        return SubscribeOptions(
            self.host,
            self.port,
            self.role,
            tls=bool(self.tls_ca),
            tls_ca="" if self.tls_ca == "system" else self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            tls_server_name=self.tls_server_name,
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for the upstream, None for plain text; a file that cannot
        be loaded is a ConfigError, found at start-up."""
        options = self.client_options()
        if not options.uses_tls:
            return None
        try:
            return client_ssl_context(options)
        except SubscribeFailed as error:
            raise ConfigError(f"--upstream-tls-*: {error}") from None
