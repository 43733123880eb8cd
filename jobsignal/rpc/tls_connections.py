"""TLS on the gRPC port: asyncio's TLS protocol with a small read buffer, and a bound
on the handshakes in progress.

asyncio's `SSLProtocol` gives every connection a 256 KiB receive buffer,
zero-filled (so resident) as the connection is accepted and kept for its
whole life. A server with 1,024 TLS clients held 256 MiB for them, and a peer
that opened connections and never sent a ClientHello held 256 KiB with each
until the handshake timeout: 12,486 of them took a server to 2.9 GB of RSS
(measured, then 3.9 GB, which the C heap kept after they were gone). A
gRPC request is a few hundred bytes and the server handles at most
`--read-bytes-per-turn` of a connection's input per loop turn, so
`LeanTlsProtocol` reads through 16 KiB, one TLS record.

asyncio hands a TLS connection to the HTTP/2 protocol, where the connection
limits count it, only once its handshake is done. A counter of its own
(`limits.tls_handshake_counter`) counts the handshakes in progress, in total
and per client address, and a connection
past either bound is closed as it is accepted (docs/architecture.md section
7, "File descriptors").

The one reach into asyncio's internals: `_on_handshake_complete`, the method
`SSLProtocol` calls when the handshake ends (the same in Python 3.11 to 3.13),
marks the handshake over; `connection_lost` does for one that never ends.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from asyncio import sslproto
from dataclasses import dataclass
from typing import Any

from jobsignal.logs import RateLimitedLog
from jobsignal.rpc.limits import ConnectionCounter, peer_ip

log = logging.getLogger(__name__)
fault_log = RateLimitedLog(log)

# Bytes read from the socket at once (and decrypted at once): about one TLS
# record, which carries at most 16 KiB of data.
TLS_READ_BUFFER = 16 * 1024
# What SSLProtocol is made with once a connection is admitted: loop, protocol within,
# context, handshake timeout.
_Setup = tuple[asyncio.AbstractEventLoop, asyncio.BaseProtocol, ssl.SSLContext, float]


class LeanTlsProtocol(sslproto.SSLProtocol):
    """Server-side TLS around `app_protocol`, as asyncio's `create_server(ssl=...)`
    would make it, with a 16 KiB read buffer and its handshake counted.

    `SSLProtocol`'s own state (the buffer, the SSL object: about 28 KiB) is made
    in `connection_made`, once the connection is admitted: a connection refused
    there costs only this object (asyncio makes the protocol of every connection
    it accepts, up to the backlog in one loop turn).
    """

    max_size = TLS_READ_BUFFER

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        app_protocol: asyncio.BaseProtocol,
        context: ssl.SSLContext,
        handshakes: ConnectionCounter,
        handshake_timeout: float,
    ) -> None:
        self._pending_setup: _Setup | None = (
            loop,
            app_protocol,
            context,
            handshake_timeout,
        )
        self._handshakes = handshakes
        self._handshaking_ip: str | None = None

    def connection_made(self, transport: Any) -> None:
        assert self._pending_setup is not None
        loop, app_protocol, context, handshake_timeout = self._pending_setup
        self._pending_setup = None
        ip = peer_ip(transport.get_extra_info("peername"))
        refusal = self._handshakes.refusal(ip)
        if refusal is not None:
            self._handshakes.refused += 1
            fault_log.warning(
                "tls_handshakes",
                "closing TLS connection from %s before its handshake: %s",
                ip,
                refusal,
            )
            transport.abort()
            return
        # No waiter (asyncio's code allows None: nobody awaits this handshake) and a
        # float timeout: typeshed's stub is narrower than asyncio on both.
        super().__init__(
            loop,
            app_protocol,
            context,
            None,  # type: ignore[arg-type]
            server_side=True,
            ssl_handshake_timeout=handshake_timeout,  # type: ignore[arg-type]
        )
        self._handshakes.opened(ip)
        self._handshaking_ip = ip
        super().connection_made(transport)

    def _on_handshake_complete(self, handshake_exc: BaseException | None) -> None:
        self._handshake_over()
        super()._on_handshake_complete(handshake_exc)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._pending_setup = None
        if hasattr(self, "_sslobj"):  # admitted: SSLProtocol set itself up
            self._handshake_over()
            super().connection_lost(exc)

    def _handshake_over(self) -> None:
        if self._handshaking_ip is not None:
            self._handshakes.closed(self._handshaking_ip)
            self._handshaking_ip = None


@dataclass(frozen=True)
class TlsServing:
    """How the gRPC port wraps each accepted connection in TLS."""

    context: ssl.SSLContext
    handshake_timeout: float
    handshakes: ConnectionCounter

    def wrap(self, app_protocol: asyncio.BaseProtocol) -> LeanTlsProtocol:
        return LeanTlsProtocol(
            asyncio.get_running_loop(),
            app_protocol,
            self.context,
            self.handshakes,
            self.handshake_timeout,
        )
