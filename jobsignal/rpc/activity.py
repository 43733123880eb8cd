"""Per-connection activity: client heartbeats (HTTP/2 PINGs) and the ping-flood rule.

A client's PING on a connection, or its ACK of the server's keepalive PING,
counts as a heartbeat for every subscription on that connection
(docs/architecture.md section 3, "The idle rule and keepalive"). As in grpc-go and
gRPC core, a PING counts against the client only while no data flows: every
DATA or HEADERS frame the server sends on the connection (`note_sent`, called
per frame by `rpc.connections`) forgives the strikes, because clients ping
with their window updates while they receive (grpc-go's BDP estimation).
A PING with no data sent since the previous one, sooner than the minimum
interval less 10% for timer jitter, is a strike; past the allowed strikes
the connection is closed with GOAWAY ENHANCE_YOUR_CALM "too_many_pings".
The default minimum interval, 3 s with or without open streams, is ClusterD
v26's keepalive enforcement policy. Time comes from trio's clock, which
trio-asyncio also gives the asyncio loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import trio

from jobsignal.config import LayerSettings, from_setting

# Timers fire a little early or late: a client pinging every `min_interval`
# seconds may measure a few percent under it.
TIMER_SLACK = 0.1


@dataclass(frozen=True)
class PingPolicy(LayerSettings):
    """The ping-flood rule: each field is a setting (jobsignal/config.py)."""

    min_interval: float = from_setting(lambda c: c.min_client_ping_interval)
    max_strikes: int = from_setting(lambda c: c.ping_strikes)


class ConnectionActivity:
    def __init__(self, policy: PingPolicy, peer: str, ip: str = "") -> None:
        self.policy = policy
        self.peer = peer  # "address:port", for logs
        self.ip = ip or peer  # the client address that limits are counted per
        self.heartbeat_listeners: set[Callable[[], None]] = set()
        self.pings_received = 0
        self.ping_acks_received = 0  # ACKs of the server's keepalive PINGs
        self.strikes = 0
        self._last_ping_at: float | None = None
        self._sent_since_ping = False

    def note_sent(self) -> None:
        """The server sent a DATA or HEADERS frame on this connection."""
        self._sent_since_ping = True

    def ping_received(self) -> bool:
        """Record a client PING; False when the client is flooding."""
        now = trio.current_time()
        self.pings_received += 1
        if self._sent_since_ping:
            self.strikes = 0
        elif (
            self._last_ping_at is not None
            and now - self._last_ping_at < self.policy.min_interval * (1 - TIMER_SLACK)
        ):
            self.strikes += 1
        self._last_ping_at = now
        self._sent_since_ping = False
        if self.strikes > self.policy.max_strikes:
            return False
        self.heartbeat()
        return True

    def ping_acked(self) -> None:
        """The client ACKed the server's keepalive PING: a heartbeat."""
        self.ping_acks_received += 1
        self.heartbeat()

    def heartbeat(self) -> None:
        """The client proved it is there (its PING, or its ACK of the server's)."""
        for listener in list(self.heartbeat_listeners):
            listener()
