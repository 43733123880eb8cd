"""TLS and mutual TLS for the gRPC port, with certificates reloaded as files change.

The listening socket keeps one SSLContext for its whole life, so rotation
works through that context's SNI callback: at every handshake it hands the
connection the newest context built from the files. Live connections keep
the context they were accepted with, so rotating a certificate (or the
client CA) never drops a stream. A rotation that fails to load (a half-written
key, a mismatched pair) is logged and the previous certificates stay in use.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import trio

log = logging.getLogger(__name__)


class TlsConfigError(Exception):
    """The certificate files cannot be loaded; one line naming the file."""


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def signature(self) -> tuple[tuple[int, int, int], ...]:
        """Changes whenever any of the files is rewritten or replaced."""
        paths = [self.cert, self.key] + ([self.client_ca] if self.client_ca else [])
        result = []
        for path in paths:
            try:
                stat = os.stat(path)
            except OSError:
                result.append((0, 0, 0))
            else:
                result.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
        return tuple(result)


def build_context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # gRPC runs over HTTP/2 only, negotiated with ALPN.
    context.set_alpn_protocols(["h2"])
    try:
        context.load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as error:
        raise TlsConfigError(
            f"cannot load TLS certificate {files.cert} / key {files.key}: {error}"
        ) from None
    if files.client_ca is not None:
        try:
            context.load_verify_locations(cafile=files.client_ca)
        except (OSError, ssl.SSLError) as error:
            raise TlsConfigError(f"cannot load client CA {files.client_ca}: {error}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class ReloadingTls:
    """The listening context, forwarding each handshake to the newest certificates."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._current = build_context(files)
        self._signature = files.signature()
        self.reloads = 0
        # The outer context must itself require client certificates for mTLS:
        # the verify mode is read before the SNI callback can switch contexts.
        self.listening_context = build_context(files)
        self.listening_context.sni_callback = self._pick_context

    def _pick_context(self, connection: ssl.SSLObject, name: str | None, _: ssl.SSLContext) -> None:
        connection.context = self._current

    def reload_if_changed(self) -> bool:
        signature = self.files.signature()
        if signature == self._signature:
            return False
        try:
            context = build_context(self.files)
        except TlsConfigError as error:
            log.error("TLS reload failed, keeping the previous certificates: %s", error)
            return False
        self._current = context
        self._signature = signature
        self.reloads += 1
        log.info("TLS certificates reloaded from %s", self.files.cert)
        return True

    async def run_reloader(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            self.reload_if_changed()
