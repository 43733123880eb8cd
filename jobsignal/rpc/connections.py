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
from grpclib.metadata import encode_grpc_message
from grpclib.protocol import Connection, H2Protocol
from h2.errors import ErrorCodes
from h2.events import PingReceived, RequestReceived

from jobsignal.rpc.activity import ConnectionActivity, PingPolicy
from jobsignal.rpc.limits import ConnectionCounter, Limits

log = logging.getLogger(__name__)

TOO_MANY_PINGS = b"too_many_pings"
RESOURCE_EXHAUSTED = 8
# Seconds a refused connection may take to send the request it is refused on.
REFUSED_CONNECTION_LINGER = 5.0


class ConnectionTable:
    """The live connections of one server, keyed by grpclib's Connection."""

    def __init__(self, ping_policy: PingPolicy, limits: Limits | None = None) -> None:
        self.ping_policy = ping_policy
        self.limits = limits or Limits()
        self.counter = ConnectionCounter(self.limits)
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

    def stream_limit_refusal(self, stream: grpclib.server.Stream[Any, Any]) -> str | None:
        """Why this stream exceeds its connection's stream limit, or None."""
        protocol = self._protocols.get(stream._stream.connection)
        limit = self.limits.max_streams_per_connection
        if protocol is not None and len(protocol.processor.streams) > limit:
            return f"too many concurrent streams on this connection (limit {limit})"
        return None

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
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self.ip = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        peer_text = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.activity = ConnectionActivity(self._table.ping_policy, peer_text, self.ip)
        self._refusal = self._table.counter.refusal(self.ip)
        if self._refusal is not None:
            # Answer the first request with a status the client can read, then go.
            log.warning("refusing connection from %s: %s", peer_text, self._refusal)
            self._table.counter.refused += 1
            self.processor.processors[RequestReceived] = self._refuse_request
            self._linger = asyncio.get_running_loop().call_later(
                REFUSED_CONNECTION_LINGER, self.goaway, ErrorCodes.NO_ERROR, b"refused"
            )
            return
        self._table.counter.opened(self.ip)
        self.processor.processors[PingReceived] = self._ping_received
        self._table.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._linger is not None:
            self._linger.cancel()  # the timer would keep this protocol alive
            self._linger = None
        if self._refusal is None:
            self._table.counter.closed(self.ip)
            self._table.discard(self)
        super().connection_lost(exc)

    def _refuse_request(self, event: RequestReceived) -> None:
        assert self._refusal is not None
        h2_connection = self.connection._connection
        h2_connection.send_headers(
            event.stream_id,
            [
                (":status", "200"),
                ("content-type", "application/grpc+proto"),
                ("grpc-status", str(RESOURCE_EXHAUSTED)),
                ("grpc-message", encode_grpc_message(self._refusal)),
            ],
            end_stream=True,
        )
        self.goaway(ErrorCodes.NO_ERROR, b"too_many_connections")

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
