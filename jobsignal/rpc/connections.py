"""HTTP/2 connections as jobsignal sees them: heartbeats, ping floods, idle closes.

grpclib answers client PINGs inside h2 and offers no hook for them, so the
server's protocol factory wraps grpclib's protocol in a subclass that routes
PingReceived to the connection's `ConnectionActivity`. This reaches into
grpclib internals (`Server._protocol_factory`, `EventsProcessor.processors`,
`Connection._connection`, `protocol.Stream.connection`): grpclib is pinned
in pyproject.toml and tests/rpc/test_pings.py proves real client pings are seen.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpclib.server
from grpclib.protocol import Connection, H2Protocol
from h2.errors import ErrorCodes
from h2.events import PingReceived

from jobsignal.rpc.activity import ConnectionActivity, PingPolicy

log = logging.getLogger(__name__)

TOO_MANY_PINGS = b"too_many_pings"


class ConnectionTable:
    """The live connections of one server, keyed by grpclib's Connection."""

    def __init__(self, ping_policy: PingPolicy) -> None:
        self.ping_policy = ping_policy
        self._protocols: dict[Connection, ObservedH2Protocol] = {}
        self.ping_floods = 0

    def __len__(self) -> int:
        return len(self._protocols)

    def add(self, protocol: ObservedH2Protocol) -> None:
        self._protocols[protocol.connection] = protocol

    def discard(self, protocol: ObservedH2Protocol) -> None:
        self._protocols.pop(protocol.connection, None)

    def protocols(self) -> list[ObservedH2Protocol]:
        return list(self._protocols.values())

    def activity_of(self, stream: grpclib.server.Stream[Any, Any]) -> ConnectionActivity:
        return self._protocols[stream._stream.connection].activity

    def close_if_unused(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        """Close the stream's connection once no other stream uses it.

        Checked on the next loop turn, after grpclib has released the ending
        stream, so the check sees only the streams that are still live.
        """
        protocol = self._protocols.get(stream._stream.connection)
        if protocol is not None:
            asyncio.get_running_loop().call_soon(protocol.goaway_if_unused)

    def close_all(self) -> None:
        for protocol in self.protocols():
            protocol.goaway(ErrorCodes.NO_ERROR, b"shutdown")


class ObservedH2Protocol(H2Protocol):
    activity: ConnectionActivity

    def __init__(self, base: H2Protocol, table: ConnectionTable) -> None:
        super().__init__(base.handler, base.config, base.h2_config)
        self._table = table

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        peer_text = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.activity = ConnectionActivity(self._table.ping_policy, peer_text)
        self.processor.processors[PingReceived] = self._ping_received
        self._table.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._table.discard(self)
        super().connection_lost(exc)

    def _ping_received(self, event: PingReceived) -> None:
        # h2 has already queued the PING ACK; only the heartbeat is ours.
        if not self.activity.ping_received():
            log.warning("closing connection from %s: too many pings", self.activity.peer)
            self._table.ping_floods += 1
            self.goaway(ErrorCodes.ENHANCE_YOUR_CALM, TOO_MANY_PINGS)

    def goaway_if_unused(self) -> None:
        if not self.processor.streams:
            self.goaway(ErrorCodes.NO_ERROR, b"idle")

    def goaway(self, code: ErrorCodes, debug: bytes) -> None:
        """Send GOAWAY and close the transport (after buffered data is written)."""
        if self.connection.is_closing():
            return
        self.connection._connection.close_connection(error_code=code, additional_data=debug)
        self.connection.flush()
        self.processor.close(reason=f"GOAWAY {code.name} {debug.decode()}")


class JobsignalServer(grpclib.server.Server):
    """grpclib's Server, with connections observed through `ConnectionTable`."""

    def __init__(self, *args: Any, connections: ConnectionTable, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connections = connections

    def _protocol_factory(self) -> H2Protocol:
        return ObservedH2Protocol(super()._protocol_factory(), self.connections)
